"""DistributedFeatureConv1d/2d/3d: forward, input and parameter gradients equal torch's on the gathered tensors."""

import importlib
import re

import numpy as np
import pytest
import torch

from distdl.nn.conv import DistributedConv1d, DistributedConv2d, DistributedConv3d
from distdl.nn.conv_feature import DistributedFeatureConv1d, DistributedFeatureConv2d, DistributedFeatureConv3d
from distdl.testing import assert_adjoint, assert_sequential_equivalence, gather, random_tensor, scatter
from helpers import sizes

LAYERS = {1: (DistributedFeatureConv1d, torch.nn.Conv1d), 2: (DistributedFeatureConv2d, torch.nn.Conv2d),
          3: (DistributedFeatureConv3d, torch.nn.Conv3d)}

# (partition shape, global input shape, out_channels, kwargs): uneven splits, split batch axis, 2-d and 3-d
# partitions, blocks smaller than the halo, empty output blocks, stride/dilation/padding/groups combinations.
CASES = {
    1: [((1, 1, 1, 1), (2, 3, 6, 5), 4, dict(kernel_size=3, padding=1)),
        ((1, 1, 1), (1, 2, 9), 3, dict(kernel_size=3, stride=2, dilation=2, padding=2)),
        ((1, 1, 1, 1), (1, 2, 6, 8), 3, dict(kernel_size=3, stride=2, padding=1))],  # right padding unused
    2: [((1, 1, 2, 1), (2, 2, 7, 5), 3, dict(kernel_size=3, padding=1)),
        ((2, 1, 1), (3, 2, 9), 2, dict(kernel_size=4, stride=3, padding=2)),
        ((1, 1, 1, 2), (1, 2, 4, 7), 4, dict(kernel_size=(3, 2), stride=(1, 2), dilation=(1, 2), padding=(1, 0),
                                             groups=2)),
        ((1, 1, 1, 2), (1, 2, 6, 8), 2, dict(kernel_size=3, stride=2, padding=1))],
    3: [((1, 1, 3), (2, 2, 5), 3, dict(kernel_size=5, padding=2)),  # blocks of 2, 2, 1 with a halo of 2
        ((1, 1, 1, 3), (1, 2, 3, 8), 2, dict(kernel_size=3, stride=(1, 3), padding=1)),
        ((1, 1, 1, 3, 1), (1, 2, 3, 4, 3), 2, dict(kernel_size=2, padding="same")),
        ((1, 1, 3), (1, 2, 4), 2, dict(kernel_size=1, stride=2, padding=1))],  # worker 0's output reads zeros only
    4: [((1, 1, 2, 2), (2, 3, 5, 6), 2, dict(kernel_size=3, stride=2, padding=1)),
        ((1, 1, 4), (1, 2, 5), 2, dict(kernel_size=5, padding=2)),  # 5 pixels over 4 workers, kernel 5
        ((1, 1, 4), (1, 2, 9), 2, dict(kernel_size=3, stride=4)),  # 2 outputs over 4 workers: empty blocks
        ((2, 1, 2, 1), (3, 2, 6, 4), 4, dict(kernel_size=(3, 2), padding="same", dilation=(2, 1), groups=2)),
        ((1, 1, 1, 2, 2), (1, 2, 3, 4, 5), 2, dict(kernel_size=3, padding=(0, 1, 2), stride=(1, 2, 1)))],
}


def _pair(P_x, dims, in_channels, out_channels, dtype=torch.float64, seed=0, **kwargs):
    """A distributed layer and the torch layer, with the same random parameters."""
    ours, theirs = LAYERS[dims]
    ref = theirs(in_channels, out_channels, **kwargs).to(dtype)
    layer = ours(P_x, in_channels, out_channels, **kwargs).to(dtype)
    with torch.no_grad():
        for offset, name in enumerate(("weight", "bias")):
            if getattr(ref, name) is not None:
                getattr(ref, name).copy_(random_tensor(getattr(ref, name).shape, seed=seed + offset))
                getattr(layer, name).copy_(getattr(ref, name))
    return layer, ref


def _check(P_x, layer, ref, x_shape, dtype=torch.float64, tol=1e-10, calls=2):
    for call in range(calls):
        shape = (x_shape[0] + call,) + tuple(x_shape[1:])  # the same layer with a larger batch
        x = random_tensor(shape, seed=10 + call).to(dtype)
        assert_sequential_equivalence(layer, ref, x, P_x, P_x, seed=call, rtol=tol, atol=tol)
        if P_x.active:
            for name in ("weight", "bias"):
                if getattr(ref, name) is not None:
                    torch.testing.assert_close(getattr(layer, name).grad, getattr(ref, name).grad, rtol=tol, atol=tol)
        layer.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm):
    for P_shape, x_shape, out_channels, kwargs in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        layer, ref = _pair(P_x, len(P_shape) - 2, x_shape[1], out_channels, **kwargs)
        _check(P_x, layer, ref, x_shape)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@sizes(1, 2, 3, 4)
def test_numpy_channel_counts_and_factory(P_world, comm):
    """Channel counts taken from a NumPy array (as ``np.asarray(x.shape)[1]``) are ints to the layer; the factory
    builds the same layer from DistDL's positional ``P_y=None, P_w=None`` and says it is one of its own."""
    selectors = {1: DistributedConv1d, 2: DistributedConv2d, 3: DistributedConv3d}
    for P_shape, x_shape, out_channels, kwargs in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        dims = len(P_shape) - 2
        counts = np.asarray([x_shape[1], out_channels])
        layer, ref = _pair(P_x, dims, *counts, **kwargs)
        assert (layer.in_channels, layer.out_channels) == (x_shape[1], out_channels)
        assert type(layer.in_channels) is int and type(layer.out_channels) is int
        _check(P_x, layer, ref, x_shape)
        built = selectors[dims](P_x, None, None, *counts, **kwargs)
        assert type(built) is LAYERS[dims][0] and isinstance(built, selectors[dims])
        assert not any(isinstance(built, selectors[d]) for d in selectors if d != dims)
        assert issubclass(LAYERS[dims][0], selectors[dims]) and not isinstance(ref, selectors[dims])


@sizes(1, 2, 3, 4)
def test_adjoint_float32_and_non_contiguous(P_world, comm):
    P_shape, x_shape, out_channels, kwargs = CASES[comm.size][0]
    P_x = P_world.create_cartesian_topology_partition(P_shape)
    dims = len(P_shape) - 2
    layer, _ = _pair(P_x, dims, x_shape[1], out_channels, bias=False, **kwargs)
    assert_adjoint(layer, random_tensor(scatter(torch.zeros(x_shape), P_x).shape, seed=comm.rank), comm)
    layer, ref = _pair(P_x, dims, x_shape[1], out_channels, dtype=torch.float32, **kwargs)
    _check(P_x, layer, ref, x_shape, dtype=torch.float32, tol=1e-5, calls=1)
    x = random_tensor(x_shape, seed=3)
    x_local = scatter(x, P_x).transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous block
    assert not x_local.is_contiguous() or x_local.numel() <= 1
    y = layer.double()(x_local)
    torch.testing.assert_close(y, scatter(ref.double()(x), P_x).detach(), rtol=1e-10, atol=1e-10)


@sizes(3)
def test_inactive_workers_and_one_worker(P_world, comm):
    for ranks, P_shape in (([0], (1, 1, 1, 1)), ([1, 2], (1, 1, 2, 1))):
        P_x = P_world.create_partition_inclusive(ranks).create_cartesian_topology_partition(P_shape)
        layer, ref = _pair(P_x, 2, 2, 3, kernel_size=3, padding=1)
        _check(P_x, layer, ref, (1, 2, 5, 4))
        if not P_x.active:
            assert layer(torch.zeros(0, dtype=torch.float64)).shape == (0,)
            with pytest.raises(ValueError, match=rf"DistributedFeatureConv2d: worker {comm.rank} is outside P_x"):
                layer(torch.ones(1, 2, 5, 4, dtype=torch.float64))


@sizes(1, 2, 4)
def test_initialisation_and_state_dict_round_trip(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size, 1))
    torch.manual_seed(123 + comm.rank)  # only rank 0's generator counts
    layer = DistributedFeatureConv2d(P_x, 2, 3, 3, padding=1, collect_state=True).double()
    torch.manual_seed(123)
    fresh = torch.nn.Conv2d(2, 3, 3, padding=1).double()
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(layer, name), getattr(fresh, name), rtol=0, atol=0)
    _, ref = _pair(P_x, 2, 2, 3, kernel_size=3, padding=1, seed=5)
    layer.load_state_dict(ref.state_dict() if comm.rank % 2 == 0 else {})
    _check(P_x, layer, ref, (1, 2, 5, 4), calls=1)
    state = layer.state_dict()
    if P_x.rank == 0:
        assert list(state) == ["weight", "bias"]
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    else:
        assert list(state) == []
    with pytest.raises(RuntimeError, match=r"size mismatch for weight"):
        layer.load_state_dict({"weight": torch.ones(3, 2, 2, 2), "bias": ref.bias} if P_x.rank == 0 else {})


@sizes(1, 2)
def test_errors(P_world, comm):
    with pytest.raises(ValueError, match=r"DistributedFeatureConv2d: expected a partition of 4 dimensions whose "
                                         r"channel axis \(1\) has extent 1, got shape \(1, 1, \d\)"):
        DistributedFeatureConv2d(P_world.create_cartesian_topology_partition((1, 1, comm.size)), 2, 2, 3)
    if comm.size == 2:
        with pytest.raises(ValueError, match=r"channel axis \(1\) has extent 1, got shape \(1, 2, 1\)"):
            DistributedFeatureConv1d(P_world.create_cartesian_topology_partition((1, 2, 1)), 2, 2, 3)
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    with pytest.raises(ValueError, match="DistributedFeatureConv1d: expected padding_mode 'zeros'"):
        DistributedFeatureConv1d(P_x, 2, 2, 3, padding_mode="circular")
    with pytest.raises(ValueError, match="expected in_channels and out_channels divisible by groups"):
        DistributedFeatureConv1d(P_x, 3, 2, 3, groups=2)
    for bad in (np.float64(2.0), np.bool_(True), True, np.int64(0)):
        with pytest.raises(ValueError, match="DistributedFeatureConv1d: expected a positive int for out_channels, "
                                             f"got {re.escape(repr(bad))}"):
            DistributedFeatureConv1d(P_x, 2, bad, 3)
    with pytest.raises(TypeError, match="DistributedFeatureConv1d: expected a bool for collect_state, got 'no'"):
        DistributedFeatureConv1d(P_x, 2, 2, 3, collect_state="no")
    with pytest.raises(ValueError, match=r"expected kernel_size as an int or a sequence of 1, each at least 1, "
                                         r"got \(3, 3\)"):
        DistributedFeatureConv1d(P_x, 2, 2, (3, 3))
    with pytest.raises(ValueError, match="expected stride 1 with padding='same'"):
        DistributedFeatureConv1d(P_x, 2, 2, 3, stride=2, padding="same")
    layer = DistributedFeatureConv1d(P_x, 2, 3, 3).double()
    with pytest.raises(ValueError, match=r"DistributedFeatureConv1d: expected a tensor of 3 dimensions"):
        layer(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"DistributedFeatureConv1d: expected 2 channels \(dimension 1\), "
                                         rf"got shape \(1, 3, 4\) on worker {comm.rank}"):
        layer(torch.ones(1, 3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="expected a tensor of dtype torch.float64"):
        layer(torch.ones(1, 2, 4))
    # Every worker learns the global shape, so every worker raises the same error.
    with pytest.raises(ValueError, match=r"expected an input large enough for an output, got global shape"):
        layer(torch.ones(1, 2, 1 if comm.rank == 0 else 0, dtype=torch.float64))
    if comm.size == 2:
        with pytest.raises(ValueError, match=r"expected the blocks of a balanced decomposition of a global shape "
                                             r"\(1, 2, 8\) over P_x of shape \(1, 1, 2\), got shape \(1, 2, 3\) "
                                             r"on P_x rank 0"):
            layer(torch.ones(1, 2, 3 if comm.rank == 0 else 5, dtype=torch.float64))


@sizes(1, 2, 3, 4)
def test_input_gradient_only_where_asked(P_world, comm, monkeypatch):
    """No worker's input needs a gradient: the exchange's adjoint never runs; one worker's does: it gets its own."""
    module = importlib.import_module("distdl.functional.window_exchange")  # the package exports a function by that name
    adjoints = []
    window = module._window

    def counted(*args):  # the exchange's adjoint, which its backward runs, has forward (the last argument) False
        adjoints.extend([] if args[-1] else [1])
        return window(*args)
    monkeypatch.setattr(module, "_window", counted)
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size, 1))
    x_global = random_tensor((2, 2, 3 * comm.size + 1, 5), seed=1)
    dy_global = random_tensor((2, 3, 3 * comm.size + 1, 5), seed=2)
    for asking in ((), (0,)):
        layer, ref = _pair(P_x, 2, 2, 3, kernel_size=3, padding=1)
        x_ref = x_global.clone().requires_grad_(bool(asking))
        ref(x_ref).backward(dy_global)
        x = scatter(x_global, P_x).requires_grad_(comm.rank in asking)
        y = layer(x)
        torch.testing.assert_close(y, scatter(ref(x_global), P_x).detach(), rtol=1e-12, atol=1e-12)
        y.backward(scatter(dy_global, P_x))
        for name in ("weight", "bias"):
            torch.testing.assert_close(getattr(layer, name).grad, getattr(ref, name).grad, rtol=1e-12, atol=1e-12)
        if comm.rank in asking:
            torch.testing.assert_close(x.grad, scatter(x_ref.grad, P_x), rtol=1e-12, atol=1e-12)
        assert x.grad is None or comm.rank in asking
        assert len(adjoints) == (0 if not asking or comm.size == 1 else 1)  # one worker: nothing exchanged
        adjoints.clear()
