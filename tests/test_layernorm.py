"""DistributedLayerNorm: forward, input and parameter gradients equal torch's, with split normalised dims."""

import numpy as np
import pytest
import torch

from distdl.nn.layernorm import DistributedLayerNorm
from distdl.testing import assert_sequential_equivalence, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import sizes

# (partition shape, global input shape, normalized_shape): uneven splits of the normalised dims,
# split leading dims (replicated parameters), an empty block of a normalised dim, 3-4 dimensions.
CASES = {
    1: [((1, 1, 1), (2, 3, 5), (5,)), ((1, 1, 1), (2, 3, 5), (3, 5))],
    2: [((1, 1, 2), (2, 3, 5), (5,)), ((2, 1, 1), (3, 2, 4), (2, 4)), ((1, 2, 1), (2, 3, 4), (3, 4))],
    3: [((1, 1, 3), (2, 2, 7), (7,)), ((1, 3, 1), (2, 4, 3), (4, 3)), ((3, 1, 1), (4, 2, 3), (3,)),
        ((1, 1, 3), (2, 2, 2), (2,))],
    4: [((2, 1, 2), (3, 2, 5), (5,)), ((1, 2, 2), (2, 3, 5), (3, 5)), ((1, 1, 2, 2), (2, 2, 3, 5), (2, 3, 5))],
}


def _block(t, P_x, k):
    """This worker's block of a tensor of normalized_shape (the last k partition axes)."""
    P_shape, index = P_x.shape[-k:], P_x.index[-k:]
    start, stop = compute_start_index(P_shape, index, t.shape), compute_stop_index(P_shape, index, t.shape)
    return t[tuple(slice(a, b) for a, b in zip(start, stop))]


def _pair(P_x, normalized_shape, dtype=torch.float64, **kwargs):
    """A distributed layer and the torch layer, with the same random affine parameters."""
    ref = torch.nn.LayerNorm(normalized_shape, **kwargs).to(dtype)
    layer = DistributedLayerNorm(P_x, normalized_shape, **kwargs).to(dtype)
    with torch.no_grad():
        for seed, name in enumerate(("weight", "bias")):
            if getattr(ref, name, None) is not None:
                getattr(ref, name).copy_(random_tensor(normalized_shape, seed=seed))
                if P_x.active:
                    getattr(layer, name).copy_(_block(getattr(ref, name), P_x, len(normalized_shape)))
    return layer, ref


def _check(P_x, layer, ref, x_shape, dtype=torch.float64, tol=1e-10, calls=2):
    k = len(ref.normalized_shape)
    for call in range(calls):
        shape = (x_shape[0] + call,) + x_shape[1:]  # the same layer with a larger batch
        x = (random_tensor(shape, seed=call) * 3 + 2).to(dtype)
        assert_sequential_equivalence(layer, ref, x, P_x, P_x, seed=call, rtol=tol, atol=tol)
        for name in ("weight", "bias"):
            if getattr(ref, name, None) is not None and P_x.active:
                torch.testing.assert_close(getattr(layer, name).grad, _block(getattr(ref, name).grad, P_x, k),
                                           rtol=tol, atol=tol)
        layer.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm):
    for P_shape, x_shape, normalized_shape in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        layer, ref = _pair(P_x, normalized_shape)
        _check(P_x, layer, ref, x_shape)
    P_shape, x_shape, normalized_shape = CASES[comm.size][0]
    P_x = P_world.create_cartesian_topology_partition(P_shape)
    layer, ref = _pair(P_x, tuple(np.int64(n) for n in normalized_shape))  # NumPy extents, which torch takes
    assert layer.normalized_shape == normalized_shape
    _check(P_x, layer, ref, x_shape, calls=1)


@sizes(1, 2, 3, 4)
def test_options_and_float32(P_world, comm):
    P_shape, x_shape, normalized_shape = CASES[comm.size][0]
    P_x = P_world.create_cartesian_topology_partition(P_shape)
    for kwargs in ({"elementwise_affine": False}, {"bias": False, "eps": 1e-2}):
        layer, ref = _pair(P_x, normalized_shape, **kwargs)
        assert repr(ref).split("(", 1)[1][:-1] in repr(layer)  # torch's arguments, as torch names them
        _check(P_x, layer, ref, x_shape, calls=1)
    layer, ref = _pair(P_x, normalized_shape, dtype=torch.float32)
    _check(P_x, layer, ref, x_shape, dtype=torch.float32, tol=1e-5, calls=1)
    x = scatter(random_tensor(x_shape, seed=7).float(), P_x)
    strided = x.transpose(0, -1).contiguous().transpose(0, -1)  # same values, not contiguous
    torch.testing.assert_close(layer(strided), layer(x))
    layer = DistributedLayerNorm(P_x, normalized_shape).to(torch.bfloat16)
    x = random_tensor(x_shape, seed=5).to(torch.bfloat16)
    y = layer(scatter(x, P_x))
    assert y.dtype == torch.bfloat16
    expected = torch.nn.functional.layer_norm(x.double(), normalized_shape)
    torch.testing.assert_close(y.double(), scatter(expected, P_x), rtol=2e-2, atol=2e-2)


@sizes(1, 2, 3, 4)
def test_subset_partitions_and_inactive_workers(P_world, comm):
    subsets = [([0], (1, 1, 1))] + ([(list(range(1, comm.size)), (1, 1, comm.size - 1))] if comm.size > 2 else [])
    for ranks, P_shape in subsets:
        P_x = P_world.create_partition_inclusive(ranks).create_cartesian_topology_partition(P_shape)
        layer, ref = _pair(P_x, (5,))
        _check(P_x, layer, ref, (2, 3, 5))
        if not P_x.active:
            assert layer.weight.shape == (0,)
            assert layer(torch.zeros(0, dtype=torch.float64)).shape == (0,)
            with pytest.raises(ValueError, match=rf"DistributedLayerNorm: worker {comm.rank} is outside P_x"):
                layer(torch.ones(2, 3, 5))


@sizes(1, 2, 3, 4)
def test_state_dict_round_trip(P_world, comm):
    """A serial checkpoint is split over the workers and gathered back on rank 0 of P_x."""
    P_shape, x_shape, normalized_shape = CASES[comm.size][-1]
    P_x = P_world.create_cartesian_topology_partition(P_shape)
    ref = torch.nn.LayerNorm(normalized_shape).double()
    with torch.no_grad():
        ref.weight.copy_(random_tensor(normalized_shape, seed=1))
        ref.bias.copy_(random_tensor(normalized_shape, seed=2))
    layer = DistributedLayerNorm(P_x, normalized_shape, collect_state=True).double()
    layer.load_state_dict(ref.state_dict() if comm.rank % 2 == 0 else {})
    assert_sequential_equivalence(layer, ref, random_tensor(x_shape, seed=3), P_x, P_x, rtol=1e-10, atol=1e-12)
    state = layer.state_dict()
    if P_x.rank == 0:
        assert list(state) == ["weight", "bias"]
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    else:
        assert list(state) == []
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: copying a param with shape \(4,\)"):
        layer.load_state_dict({"weight": torch.ones(4), "bias": ref.bias} if P_x.rank == 0 else {})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        layer.load_state_dict({**ref.state_dict(), "extra": torch.ones(1)})
    # Nested in a model: the keys carry the module prefixes, as the serial model's do.
    serial = torch.nn.Sequential(torch.nn.Identity(), ref)
    model = torch.nn.Sequential(torch.nn.Identity(), DistributedLayerNorm(P_x, normalized_shape, collect_state=True))
    model.double().load_state_dict(serial.state_dict())
    state = model.state_dict()
    assert list(state) == (["1.weight", "1.bias"] if P_x.rank == 0 else [])
    if P_x.rank == 0:
        torch.testing.assert_close(state["1.bias"], ref.bias, rtol=0, atol=0)
    local = DistributedLayerNorm(P_x, normalized_shape).state_dict()  # per-worker blocks
    assert local["weight"].shape == _block(ref.weight, P_x, len(normalized_shape)).shape


@sizes(1, 2)
def test_errors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    with pytest.raises(ValueError, match=r"DistributedLayerNorm: expected a normalized_shape of 1 to 3 non-negative "
                                         r"extents for P_x of shape \(1, 1, \d\), got \(1, 2, 3, 4\)"):
        DistributedLayerNorm(P_x, (1, 2, 3, 4))
    for bad in (3.0, torch.tensor(3)):  # not a sequence (tuple() of it failed with Python's own message)
        with pytest.raises(ValueError, match=r"DistributedLayerNorm: expected a normalized_shape of 1 to 3"):
            DistributedLayerNorm(P_x, bad)
    with pytest.raises(TypeError, match="DistributedLayerNorm: expected a bool for bias, got None"):
        DistributedLayerNorm(P_x, 5, bias=None)
    layer = DistributedLayerNorm(P_x, 5)
    local = 5 if comm.size == 1 else 3 - comm.rank
    with pytest.raises(ValueError, match=rf"DistributedLayerNorm: expected a tensor of 3 dimensions ending in this "
                                         rf"worker's block \({local},\) of normalized_shape \(5,\) over P_x of shape "
                                         rf"\(1, 1, \d\), got shape \(2, 6\) on worker {comm.rank}"):
        layer(torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 6\)"):
        layer(torch.ones(2, 3, 6))
    with pytest.raises(TypeError, match="DistributedLayerNorm: expected a floating-point tensor, got torch.int64"):
        layer(torch.ones(2, 3, local, dtype=torch.int64))


@sizes(1, 2, 3)
def test_means_far_above_the_spread(P_world, comm):
    """A mean 1e6 times the spread keeps float64's precision (merged about zero, 2e-4 was lost)."""
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    layer, ref = _pair(P_x, (7,))
    assert_sequential_equivalence(layer, ref, random_tensor((2, 3, 7), seed=1) + 1e6, P_x, P_x, rtol=1e-8, atol=1e-8)


@sizes(2, 3)
def test_check_mode_names_workers_with_other_rows(P_world, comm):
    """Workers normalising rows together with other leading extents: outside check mode MPI aborts where the
    moments differ in length, and pairs up other rows silently where they do not; check mode names the layer."""
    from distdl.checks import CollectiveMismatchError, checking
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    layer = DistributedLayerNorm(P_x, 6).double()
    x = scatter(random_tensor((2, 3, 6), seed=1), P_x)
    wrong = x.reshape(3, 2, -1) if comm.rank == 1 else x  # the same number of rows
    with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedLayerNorm: ranks disagree on the "
                                                                  r"extents before normalized_shape"):
        layer(wrong)
    # a worker whose block fails its own check (another trailing extent) takes part: the others raised after a
    # timeout in check mode (and wait in the moments' sum outside it, as after any layer's local check)
    wrong = torch.cat([x, x], -1) if comm.rank == 1 else x
    failed = (r"DistributedLayerNorm: ranks disagree on failed with: "
              r"ranks? 0(, 2)? ha(s|ve) nothing; rank 1 has ValueError")
    with checking(), pytest.raises(CollectiveMismatchError, match=failed):
        layer(wrong)
    with checking(), pytest.raises(CollectiveMismatchError, match=failed.replace("ValueError", "TypeError")):
        layer(x.tolist() if comm.rank == 1 else x)  # not a tensor: the same (the others waited for it)
