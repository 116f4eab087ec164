"""DistributedChannelConv1d/2d/3d: forward, input and parameter gradients equal torch's on the gathered tensors."""

import re

import numpy as np
import pytest
import torch

from distdl.nn.conv_channel import DistributedChannelConv1d, DistributedChannelConv2d, DistributedChannelConv3d
from distdl.testing import assert_adjoint, assert_sequential_equivalence, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import sizes

LAYERS = {1: (DistributedChannelConv1d, torch.nn.Conv1d), 2: (DistributedChannelConv2d, torch.nn.Conv2d),
          3: (DistributedChannelConv3d, torch.nn.Conv3d)}

# (P_w shape, root ranks of P_x, P_w and P_y, global input shape, out_channels, kwargs): uneven channel splits
# (5 over 2, 7 over 3), empty channel blocks (1 over 2), partitions on different or overlapping workers, a worker
# in none of them (4 ranks, rank 3), every padding mode.
CASES = {
    1: [((1, 1, 1), [0], [0], [0], (2, 3, 7), 2, dict(kernel_size=3, padding=1)),
        ((1, 1, 1, 1), [0], [0], [0], (1, 2, 5, 6), 3, dict(kernel_size=(3, 2), stride=2, padding=1,
                                                             padding_mode="reflect"))],
    2: [((1, 2, 1, 1), [0, 1], [0, 1], [1], (2, 5, 5, 4), 3, dict(kernel_size=3, padding=1)),
        ((2, 1, 1), [1], [1, 0], [0, 1], (2, 3, 8), 5, dict(kernel_size=3, dilation=2, padding="same",
                                                           padding_mode="circular"))],
    3: [((1, 3, 1), [0, 1, 2], [2, 0, 1], [2], (2, 7, 9), 4, dict(kernel_size=4, stride=2, padding=2,
                                                                  padding_mode="replicate")),
        ((3, 1, 1, 1, 1), [2], [0, 1, 2], [1, 2, 0], (1, 2, 3, 4, 3), 7, dict(kernel_size=2)),
        ((1, 2, 1, 1), [1, 2], [0, 1], [2], (1, 3, 4, 4), 2, dict(kernel_size=3, bias=False))],
    4: [((2, 2, 1, 1), [2, 3], [0, 1, 2, 3], [3, 0], (2, 5, 5, 4), 5, dict(kernel_size=3, padding=1)),
        ((1, 2, 1), [1, 2], [0, 1], [0], (1, 7, 6), 5, dict(kernel_size=2, padding=(1,))),
        ((2, 2, 1), [0, 1], [3, 2, 1, 0], [2, 3], (2, 1, 6), 1, dict(kernel_size=3))],  # empty channel blocks
}


def partitions(P_world, P_x_shape, P_y_shape, P_w_shape, x_ranks, w_ranks, y_ranks):
    """``P_x``, ``P_y``, ``P_w`` of the given shapes on the listed root ranks."""
    make = lambda ranks, shape: P_world.create_partition_inclusive(ranks).create_cartesian_topology_partition(shape)
    return make(x_ranks, P_x_shape), make(y_ranks, P_y_shape), make(w_ranks, P_w_shape)


def channel_partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks):
    ones = (1,) * (len(P_w_shape) - 2)
    return partitions(P_world, (1, P_w_shape[1]) + ones, (1, P_w_shape[0]) + ones, P_w_shape, x_ranks, w_ranks,
                      y_ranks)


def block(t, P_w, axes):
    """This worker's block of a weight (split on its first two dims along ``axes`` of P_w) or bias (first only)."""
    grid = tuple(P_w.shape[a] for a in axes[:min(t.dim(), 2)])
    index = tuple(P_w.index[a] for a in axes[:len(grid)])
    start = compute_start_index(grid, index, t.shape[:len(grid)])
    stop = compute_stop_index(grid, index, t.shape[:len(grid)])
    return t[tuple(slice(a, b) for a, b in zip(start, stop))]


def make_pair(layers, P_x, P_y, P_w, axes, x_shape, out_channels, dtype=torch.float64, seed=0, **kwargs):
    """A distributed layer and the torch layer with the same random parameters on every worker."""
    ours, theirs = layers[len(x_shape) - 2]
    ref = theirs(x_shape[1], out_channels, **kwargs).to(dtype)
    layer = ours(P_x, P_y, P_w, x_shape[1], out_channels, **kwargs).to(dtype)
    with torch.no_grad():
        for offset, name in enumerate(("weight", "bias")):
            if getattr(ref, name) is not None:
                getattr(ref, name).copy_(random_tensor(getattr(ref, name).shape, seed=seed + offset))
                if getattr(layer, name) is not None and P_w.active:
                    getattr(layer, name).copy_(block(getattr(ref, name), P_w, axes))
    return layer, ref


def numpy_counts(build):
    """``build(P_x, P_y, P_w, in_channels, out_channels, ...)`` called with the channel counts as NumPy integers (as
    ``np.asarray(x.shape)[1]`` gives them)."""
    return lambda P_x, P_y, P_w, c_in, c_out, **kwargs: build(P_x, P_y, P_w, *np.asarray([c_in, c_out]), **kwargs)


def check(layer, ref, P_x, P_y, P_w, axes, x_shape, dtype=torch.float64, tol=1e-10, calls=2):
    """Forward, input gradient and parameter gradients against torch, on ``calls`` calls with growing batch."""
    for call in range(calls):
        x = random_tensor((x_shape[0] + call,) + tuple(x_shape[1:]), seed=10 + call).to(dtype)
        assert_sequential_equivalence(layer, ref, x, P_x, P_y, seed=call, rtol=tol, atol=tol)
        if P_w.active:
            torch.testing.assert_close(layer.weight.grad, block(ref.weight.grad, P_w, axes), rtol=tol, atol=tol)
        else:
            assert layer.weight.numel() == 0 and layer.bias is None
        assert (layer.bias is not None) == (ref.bias is not None and P_w.active and P_w.index[axes[1]] == 0)
        if layer.bias is not None:
            torch.testing.assert_close(layer.bias.grad, block(ref.bias.grad, P_w, axes), rtol=tol, atol=tol)
        layer.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm):
    for P_w_shape, x_ranks, w_ranks, y_ranks, x_shape, out_channels, kwargs in CASES[comm.size]:
        P_x, P_y, P_w = channel_partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks)
        layer, ref = make_pair(LAYERS, P_x, P_y, P_w, (0, 1), x_shape, out_channels, **kwargs)
        check(layer, ref, P_x, P_y, P_w, (0, 1), x_shape)
        if not (P_x.active or P_y.active or P_w.active):
            assert layer(torch.zeros(0, dtype=torch.float64)).shape == (0,)
        y = layer(scatter(random_tensor(x_shape, seed=7), P_x))
        if not P_y.active and (P_x.active or P_w.active):  # DistDL's placeholder keeps the batch
            assert y.shape == (x_shape[0], 0)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@sizes(1, 2, 3, 4)
def test_numpy_channel_counts(P_world, comm):
    for P_w_shape, x_ranks, w_ranks, y_ranks, x_shape, out_channels, kwargs in CASES[comm.size]:
        P_x, P_y, P_w = channel_partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks)
        ours, theirs = LAYERS[len(x_shape) - 2]
        layers = {len(x_shape) - 2: (numpy_counts(ours), theirs)}
        layer, ref = make_pair(layers, P_x, P_y, P_w, (0, 1), x_shape, out_channels, **kwargs)
        assert (layer.in_channels, layer.out_channels) == (x_shape[1], out_channels)
        assert type(layer.in_channels) is int and type(layer.out_channels) is int
        check(layer, ref, P_x, P_y, P_w, (0, 1), x_shape)


@sizes(1, 2, 3, 4)
def test_adjoint_float32_and_non_contiguous(P_world, comm):
    P_w_shape, x_ranks, w_ranks, y_ranks, x_shape, out_channels, kwargs = CASES[comm.size][0]
    P_x, P_y, P_w = channel_partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks)
    kwargs = {**kwargs, "bias": False}
    layer, _ = make_pair(LAYERS, P_x, P_y, P_w, (0, 1), x_shape, out_channels, **kwargs)
    assert_adjoint(layer, random_tensor(scatter(torch.zeros(x_shape), P_x).shape, seed=comm.rank), comm)
    layer, ref = make_pair(LAYERS, P_x, P_y, P_w, (0, 1), x_shape, out_channels, dtype=torch.float32, seed=3,
                           **CASES[comm.size][0][6])
    check(layer, ref, P_x, P_y, P_w, (0, 1), x_shape, dtype=torch.float32, tol=1e-5, calls=1)
    x = random_tensor(x_shape, seed=3, dtype=torch.float32)
    x_local = scatter(x, P_x)
    if P_x.active:
        x_local = x_local.transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous block
        assert not x_local.is_contiguous()
    with torch.no_grad():  # no graph anywhere: every worker skips backward alike
        y = layer(x_local)
        expected = scatter(ref(x), P_y, preserve_batch=True)  # outside P_y: (batch, 0)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@sizes(3)
def test_every_worker_runs_backward(P_world, comm):
    """Workers that only send, only compute or only receive all take part in backward, also when the input
    does not require a gradient (the usual first layer): the weight gradients are still torch's."""
    P_x, P_y, P_w = partitions(P_world, (1, 1, 1), (1, 1, 1), (1, 1, 1), [0], [1], [2])
    layer, ref = make_pair(LAYERS, P_x, P_y, P_w, (0, 1), (2, 3, 6), 4, kernel_size=3)
    x = random_tensor((2, 3, 6), seed=1)
    y = layer(scatter(x, P_x))
    assert y.requires_grad
    dy = random_tensor((2, 4, 4), seed=2)
    y.backward(scatter(dy, P_y) if P_y.active else torch.zeros_like(y))
    ref(x).backward(dy)
    if P_w.active:
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        assert not layer(scatter(x, P_x)).requires_grad


@sizes(1, 2, 4)
def test_initialisation_and_state_dict_round_trip(P_world, comm):
    P_w_shape, x_ranks, w_ranks, y_ranks, x_shape, out_channels, _ = CASES[comm.size][0]
    P_x, P_y, P_w = channel_partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks)
    torch.manual_seed(comm.rank)  # blocks of one global draw, whatever each worker's seed
    layer = DistributedChannelConv2d(P_x, P_y, P_w, 16, 6, 3, padding=1, collect_state=True) if len(x_shape) == 4 \
        else DistributedChannelConv1d(P_x, P_y, P_w, 16, 6, 3, padding=1, collect_state=True)
    state = layer.state_dict()
    if P_w.rank == 0:
        weight, bias = state["weight"], state["bias"]
        bound = 1 / (16 * 3 ** (len(x_shape) - 2)) ** 0.5
        assert weight.shape == (6, 16) + (3,) * (len(x_shape) - 2) and bias.shape == (6,)
        assert weight.abs().max() <= bound and bias.abs().max() <= bound and weight.abs().max() > 0.9 * bound
        assert abs(weight.mean()) < 0.1 * bound
    layer, ref = make_pair(LAYERS, P_x, P_y, P_w, (0, 1), x_shape, out_channels, **CASES[comm.size][0][6])
    layer = type(layer)(P_x, P_y, P_w, x_shape[1], out_channels, collect_state=True, **CASES[comm.size][0][6]).double()
    for others in (ref.state_dict(), {}):  # workers other than rank 0 of P_w may pass the dict or nothing
        layer.load_state_dict(ref.state_dict() if P_w.rank == 0 else others)
        check(layer, ref, P_x, P_y, P_w, (0, 1), x_shape, calls=1)
        state = layer.state_dict()
        if P_w.rank == 0:
            assert list(state) == ["weight", "bias"]
            for key, value in ref.state_dict().items():
                assert torch.equal(state[key], value)
        else:
            assert list(state) == []
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: copying a param with shape \(2, 2\)"):
        layer.load_state_dict({"weight": torch.ones(2, 2), "bias": ref.bias} if P_w.rank == 0 else {})
    local = type(layer)(P_x, P_y, P_w, x_shape[1], out_channels, **CASES[comm.size][0][6]).state_dict()
    assert local["weight"].shape == (block(ref.weight, P_w, (0, 1)).shape if P_w.active else layer.weight.shape)


@sizes(3, 4)
def test_state_dict_with_the_root_outside_the_bias_column(P_world, comm):
    """World rank 0 holds no bias block (it is in column 1 of P_w): the bias still loads from its checkpoint
    and is saved back there."""
    P_w_shape, x_ranks, w_ranks, y_ranks, x_shape, out_channels, kwargs = CASES[comm.size][{3: 0, 4: 2}[comm.size]]
    P_x, P_y, P_w = channel_partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks)
    _, ref = make_pair(LAYERS, P_x, P_y, P_w, (0, 1), x_shape, out_channels, **kwargs)
    layer = LAYERS[len(x_shape) - 2][0](P_x, P_y, P_w, x_shape[1], out_channels, collect_state=True,
                                        **kwargs).double()
    assert not (comm.rank == 0 and layer.holds_bias)
    layer.load_state_dict(ref.state_dict() if comm.rank == 0 else {})
    check(layer, ref, P_x, P_y, P_w, (0, 1), x_shape, calls=1)
    state = layer.state_dict()
    assert list(state) == (["weight", "bias"] if comm.rank == 0 else [])
    for key, value in state.items():
        assert torch.equal(value, ref.state_dict()[key])


@sizes(1, 2)
def test_errors(P_world, comm):
    n = comm.size
    P_x, P_y, P_w = channel_partitions(P_world, (1, n, 1), list(range(n)), list(range(n)), [0])
    with pytest.raises(ValueError, match=r"DistributedChannelConv1d: expected P_w of shape \(P_co, P_ci, 1\), P_x of "
                                         r"shape \(1, P_ci, 1\) and P_y of shape \(1, P_co, 1\), got P_x "
                                         rf"\(1, {n}, 1\), P_y \(1, 1, 1\) and P_w \({n},\)"):
        DistributedChannelConv1d(P_x, P_y, P_world, 4, 4, 3)
    if n == 2:
        with pytest.raises(ValueError, match=r"got P_x \(1, 2, 1\), P_y \(1, 2, 1\) and P_w \(1, 2, 1\)"):
            DistributedChannelConv1d(P_x, P_x, P_w, 4, 4, 3)
    with pytest.raises(ValueError, match=r"got P_x \(1, \d, 1\), P_y \(1, 1, 1\) and P_w \(1, \d, 1, 1\)"):
        DistributedChannelConv2d(P_x, P_y, P_world.create_cartesian_topology_partition((1, n, 1, 1)), 4, 4, 3)
    with pytest.raises(ValueError, match=r"DistributedChannelConv1d: expected groups=1 \(the only value supported\), "
                                         r"got 2"):
        DistributedChannelConv1d(P_x, P_y, P_w, 4, 4, 3, groups=2)
    with pytest.raises(ValueError, match=r"expected padding_mode in \['zeros', 'reflect', 'replicate', 'circular'\], "
                                         r"got 'mirror'"):
        DistributedChannelConv1d(P_x, P_y, P_w, 4, 4, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match=r"expected a positive int for in_channels, got 0"):
        DistributedChannelConv1d(P_x, P_y, P_w, 0, 4, 3)
    for bad in (np.float64(4.0), np.bool_(True), np.int64(-1)):
        with pytest.raises(ValueError, match="DistributedChannelConv1d: expected a positive int for in_channels, "
                                             f"got {re.escape(repr(bad))}"):
            DistributedChannelConv1d(P_x, P_y, P_w, bad, 4, 3)
    with pytest.raises(ValueError, match=r"DistributedChannelConv1d: expected kernel_size as an int or .*got \(3, 3\)"):
        DistributedChannelConv1d(P_x, P_y, P_w, 4, 4, (3, 3))
    with pytest.raises(TypeError, match=r"DistributedChannelConv1d: expected an MPIPartition for P_w, got int"):
        DistributedChannelConv1d(P_x, P_y, 3, 4, 4, 3)
    with pytest.raises(TypeError, match=r"expected a bool for bias, got 1"):
        DistributedChannelConv1d(P_x, P_y, P_w, 4, 4, 3, bias=1)
    layer = DistributedChannelConv1d(P_x, P_y, P_w, 5, 2, 3, padding=2, padding_mode="reflect").double()
    local = 5 if n == 1 else 3 - comm.rank
    with pytest.raises(ValueError, match=rf"DistributedChannelConv1d: expected {local} channels \(dimension 1: this "
                                         rf"worker's block of 5 over P_x of shape \(1, {n}, 1\)\), got shape "
                                         rf"\(2, 9, 4\) on worker {comm.rank}"):
        layer(torch.ones(2, 9, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"expected a tensor of 3 dimensions, got shape \(2, 4\)"):
        layer(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"expected a tensor of dtype torch.float64 \(the weight's\), got "
                                        r"torch.float32"):
        layer(torch.ones(2, local, 4))
    with pytest.raises(ValueError, match=r"expected padding \(\(2, 2\),\) below the spatial extents for padding_mode "
                                         r"'reflect', got shape \(2, \d, 2\)"):
        layer(torch.ones(2, local, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"DistributedChannelConv1d: expected a torch.Tensor, got list"):
        layer([1.0])
    if n == 2:
        outside = DistributedChannelConv1d(P_y, P_y, P_y, 4, 2, 3)
        if comm.rank == 1:
            with pytest.raises(ValueError, match=r"DistributedChannelConv1d: worker 1 is outside P_x and expected a "
                                                 r"zero-volume tensor, got shape \(3, 4, 5\)"):
                outside(torch.ones(3, 4, 5))
