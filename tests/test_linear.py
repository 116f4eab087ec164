"""Classic DistributedLinear: forward, input and parameter gradients equal torch's, on any placement of partitions."""

import pytest
import torch

from distdl.nn.linear import DistributedLinear, global_block, uniform
from distdl.testing import assert_adjoint, assert_sequential_equivalence, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import sizes

# (P_w shape, root ranks of P_x, P_w and P_y, in_features, out_features): uneven splits (7 over 2 or 3),
# partitions on different or overlapping workers, a worker in none of them (4 ranks, rank 3), an empty block.
CASES = {
    1: [((1, 1), [0], [0], [0], 4, 3)],
    2: [((1, 2), [0, 1], [0, 1], [1], 7, 5), ((2, 1), [1], [1, 0], [0, 1], 5, 7)],
    3: [((1, 3), [0, 1, 2], [0, 1, 2], [2], 7, 5), ((3, 1), [2], [0, 1, 2], [1, 2, 0], 5, 7),
        ((1, 2), [1, 2], [0, 1], [2], 7, 3), ((1, 3), [0, 1, 2], [2, 1, 0], [0], 2, 4)],  # an empty block
    4: [((2, 2), [2, 3], [0, 1, 2, 3], [3, 0], 7, 5), ((1, 2), [1, 2], [0, 1], [0], 7, 5)],
}


def _partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks):
    P_x = P_world.create_partition_inclusive(x_ranks).create_cartesian_topology_partition((1, len(x_ranks)))
    P_w = P_world.create_partition_inclusive(w_ranks).create_cartesian_topology_partition(P_w_shape)
    P_y = P_world.create_partition_inclusive(y_ranks).create_cartesian_topology_partition((1, len(y_ranks)))
    return P_x, P_y, P_w


def _block(t, P_w):
    """This worker's block of a weight (2-D) or bias (1-D, along P_w's rows)."""
    P_shape, index = P_w.shape[:t.dim()], P_w.index[:t.dim()]
    start, stop = compute_start_index(P_shape, index, t.shape), compute_stop_index(P_shape, index, t.shape)
    return t[tuple(slice(a, b) for a, b in zip(start, stop))]


def _pair(P_x, P_y, P_w, n_in, n_out, dtype=torch.float64, **kwargs):
    """A distributed layer and the torch layer with the same random parameters on every worker."""
    ref = torch.nn.Linear(n_in, n_out, **kwargs).to(dtype)
    layer = DistributedLinear(P_x, P_y, P_w, n_in, n_out, **kwargs).to(dtype)
    with torch.no_grad():
        for seed, name in enumerate(("weight", "bias")):
            if getattr(ref, name) is not None:
                getattr(ref, name).copy_(random_tensor(getattr(ref, name).shape, seed=seed))
                if getattr(layer, name) is not None and P_w.active:
                    getattr(layer, name).copy_(_block(getattr(ref, name), P_w))
    return layer, ref


@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm):
    for P_w_shape, x_ranks, w_ranks, y_ranks, n_in, n_out in CASES[comm.size]:
        P_x, P_y, P_w = _partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks)
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            layer, ref = _pair(P_x, P_y, P_w, n_in, n_out, dtype=dtype)
            assert (layer.bias is not None) == (P_w.active and P_w.index[1] == 0)  # the bias is added once
            for call in range(2):  # the same layer again with a smaller batch
                x = random_tensor((4 - call, n_in), seed=call).to(dtype)
                assert_sequential_equivalence(layer, ref, x, P_x, P_y, seed=call, rtol=tol, atol=tol)
                if P_w.active:
                    torch.testing.assert_close(layer.weight.grad, _block(ref.weight.grad, P_w), rtol=tol, atol=tol)
                if layer.bias is not None:
                    torch.testing.assert_close(layer.bias.grad, _block(ref.bias.grad, P_w), rtol=tol, atol=tol)
                if not (P_x.active or P_w.active or P_y.active):
                    assert layer.weight.numel() == 0 and layer(torch.zeros(0)).shape == (0,)
                layer.zero_grad(set_to_none=True)
                ref.zero_grad(set_to_none=True)
            y = layer(scatter(random_tensor((3, n_in), seed=7).to(dtype), P_x))
            if not P_y.active and (P_x.active or P_w.active):  # DistDL's placeholder: y.view(y.size(0), -1) works
                assert y.shape == (3, 0)


@sizes(1, 2, 3, 4)
def test_adjoint(P_world, comm):
    """Without bias the layer is linear: backward is its adjoint, double backward the adjoint's."""
    for P_w_shape, x_ranks, w_ranks, y_ranks, n_in, n_out in CASES[comm.size]:
        P_x, P_y, P_w = _partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks)
        layer = DistributedLinear(P_x, P_y, P_w, n_in, n_out, bias=False).double()
        assert_adjoint(layer, scatter(random_tensor((3, n_in), seed=1), P_x), comm)


@sizes(1, 2, 3, 4)
def test_state_dict_round_trip(P_world, comm):
    P_x, P_y, P_w = _partitions(P_world, *CASES[comm.size][0][:4])
    n_in, n_out = CASES[comm.size][0][4:]
    _, ref = _pair(P_x, P_y, P_w, n_in, n_out)
    layer = DistributedLinear(P_x, P_y, P_w, n_in, n_out, collect_state=True).double()
    for others in (ref.state_dict(), {}):  # workers other than rank 0 of P_w may pass the dict or nothing
        layer.load_state_dict(ref.state_dict() if P_w.rank == 0 else others)
        assert_sequential_equivalence(layer, ref, random_tensor((3, n_in), seed=2), P_x, P_y, rtol=1e-12)
        state = layer.state_dict()
        if P_w.rank == 0:
            assert list(state) == ["weight", "bias"]
            for key, value in ref.state_dict().items():
                assert torch.equal(state[key], value)
        else:
            assert list(state) == []
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: copying a param with shape \(2, 2\)"):
        layer.load_state_dict({"weight": torch.ones(2, 2), "bias": ref.bias} if P_w.rank == 0 else {})
    local = DistributedLinear(P_x, P_y, P_w, n_in, n_out).state_dict()  # without collect_state: per-worker blocks
    assert local["weight"].shape == _block(ref.weight, P_w).shape


@sizes(2, 3, 4)
def test_state_dict_with_the_root_outside_the_bias_column(P_world, comm):
    """World rank 0 holds no bias block (outside P_w, or outside its column 0): the bias still loads from its
    checkpoint and is saved back there."""
    n = comm.size
    x_ranks, w_ranks, y_ranks, P_w_shape = {2: ([0], [1], [0], (1, 1)), 3: ([2, 1], [2, 0], [1], (1, 2)),
                                            4: ([3], [1, 2], [0, 2], (2, 1))}[n]
    P_x, P_y, P_w = _partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks)
    _, ref = _pair(P_x, P_y, P_w, 5, 7)
    layer = DistributedLinear(P_x, P_y, P_w, 5, 7, collect_state=True).double()
    assert not (comm.rank == 0 and layer.holds_bias)
    layer.load_state_dict(ref.state_dict() if comm.rank == 0 else {})
    assert_sequential_equivalence(layer, ref, random_tensor((3, 5), seed=2), P_x, P_y, rtol=1e-12)
    state = layer.state_dict()
    assert list(state) == (["weight", "bias"] if comm.rank == 0 else [])
    for key, value in state.items():
        assert torch.equal(value, ref.state_dict()[key])


@sizes(4)
def test_initialisation(P_world, comm):
    """Blocks of one global U(-1/sqrt(in), 1/sqrt(in)) draw, whatever each worker's seed."""
    torch.manual_seed(comm.rank)
    P_w = P_world.create_cartesian_topology_partition((2, 2))
    P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition((1, 2))
    layer = DistributedLinear(P_x, P_x, P_w, 64, 48, collect_state=True)
    state = layer.state_dict()
    if P_w.rank == 0:
        weight, bias = state["weight"], state["bias"]
        assert weight.abs().max() <= 1 / 8 and bias.abs().max() <= 1 / 8
        assert weight.abs().max() > 0.12 and abs(weight.mean()) < 0.01 and abs(weight.std() - 1 / 8 / 3**0.5) < 0.005
        assert not torch.equal(weight[:24, :32], weight[24:, 32:])  # the blocks are not copies of one another
        # the block of a global draw equals the global draw's block
        whole = global_block((48, 64), (0, 0), (48, 64), uniform(0.125), seed=5)
        assert torch.equal(global_block((48, 64), (24, 32), (24, 32), uniform(0.125), seed=5), whole[24:, 32:])


@sizes(1, 2)
def test_errors(P_world, comm):
    P_w = P_world.create_cartesian_topology_partition((1, comm.size))
    P_y = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    with pytest.raises(ValueError, match=r"DistributedLinear: expected P_w of shape \(P_out, P_in\), P_x of shape "
                                         rf"\(1, P_in\) and P_y of shape \(1, P_out\), got P_x \(1, 1\), P_y "
                                         rf"\(1, 1\) and P_w \({comm.size},\)"):
        DistributedLinear(P_y, P_y, P_world, 4, 4)
    if comm.size > 1:
        with pytest.raises(ValueError, match=r"got P_x \(1, 1\), P_y \(1, 1\) and P_w \(1, 2\)"):
            DistributedLinear(P_y, P_y, P_w, 4, 4)
    with pytest.raises(ValueError, match=r"DistributedLinear: expected a non-negative out_features, got -2"):
        DistributedLinear(P_w, P_y, P_w, 4, -2)
    with pytest.raises(TypeError, match=r"DistributedLinear: expected a bool for bias, got 1"):
        DistributedLinear(P_w, P_y, P_w, 4, 2, bias=1)
    with pytest.raises(TypeError, match=r"DistributedLinear: expected an MPIPartition for P_w, got int"):
        DistributedLinear(P_w, P_y, 3, 4, 2)
    layer = DistributedLinear(P_w, P_y, P_w, 7, 2)
    local = 7 if comm.size == 1 else 4 - comm.rank
    with pytest.raises(ValueError, match=rf"DistributedLinear: expected a tensor of shape \(batch, {local}\) \(this "
                                         rf"worker's block of 7 features over P_x of shape \(1, {comm.size}\)\), got "
                                         rf"shape \(3, 9\) on worker {comm.rank}"):
        layer(torch.ones(3, 9))
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 1\)"):
        layer(torch.ones(2, 3, 1))
    outside = DistributedLinear(P_y, P_y, P_y, 4, 2)
    if comm.rank == 1:
        with pytest.raises(ValueError, match=r"DistributedLinear: worker 1 is outside P_x and expected a zero-volume "
                                             r"tensor, got shape \(3, 4\)"):
            outside(torch.ones(3, 4))


@sizes(2)
def test_input_dtype_checked_before_the_broadcast(P_world, comm):
    """An input of another dtype than the parameters raises on the worker that holds it, before any message (torch
    raised on the workers of P_w after the broadcast, and the input's worker waited in the sum-reduce)."""
    P_x = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    P_w = P_world.create_partition_inclusive([1]).create_cartesian_topology_partition((1, 1))
    layer = DistributedLinear(P_x, P_x, P_w, 4, 3, dtype=torch.float64)
    if P_x.active:
        with pytest.raises(TypeError, match=r"DistributedLinear: expected an input of the parameters' dtype "
                                             r"torch.float64, got torch.float32 on worker 0"):
            layer(torch.ones(2, 4))
    y = layer(torch.ones(2, 4, dtype=torch.float64) if P_x.active else torch.zeros(0, dtype=torch.float64))
    assert y.shape == ((2, 3) if P_x.active else (2, 0))


@sizes(2, 3)
def test_bias_errors_on_every_member(P_world, comm):
    """A checkpoint on rank 0 without a bias, or with one of the wrong shape, is reported on the workers that hold no
    block of the bias too (columns of P_w other than 0 loaded without a word, out of step with the others)."""
    P_w = P_world.create_cartesian_topology_partition((1, comm.size))
    P_y = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    layer = DistributedLinear(P_w, P_y, P_w, 6, 4, collect_state=True).double()
    weight = random_tensor((4, 6), seed=1)
    with pytest.raises(RuntimeError, match='Missing key.*"bias"'):
        layer.load_state_dict({"weight": weight} if comm.rank == 0 else {})
    with pytest.raises(RuntimeError, match="size mismatch for bias"):
        layer.load_state_dict({"weight": weight, "bias": torch.zeros(5)} if comm.rank == 0 else {})
    assert layer.load_state_dict({"weight": weight} if comm.rank == 0 else {}, strict=False).missing_keys == ["bias"]
