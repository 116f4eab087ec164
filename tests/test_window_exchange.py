"""WindowExchange: arbitrary windows (halos of any width, past the nearest neighbour and the edges)."""

import numpy as np
import pytest
import torch

from distdl.functional.window_exchange import global_shape, window_exchange, window_scatter_add
from distdl.testing import assert_adjoint, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import sizes


def halo_windows(P, shape, left, right):
    """Every worker's block widened by ``left``/``right`` per dimension (may pass the edges)."""
    windows = []
    for index in np.ndindex(*P.shape):
        start = compute_start_index(P.shape, index, shape)
        stop = compute_stop_index(P.shape, index, shape)
        windows.append(tuple((int(a) - l, int(b) + r) for a, b, l, r in zip(start, stop, left, right)))
    return tuple(windows)


def padded_slice(x_global, window):
    """x_global[window] with zeros outside the tensor (the serial reference)."""
    pad = [max(0, -a) for a, _ in window]
    out = torch.zeros([b - a for a, b in window], dtype=x_global.dtype)
    src = tuple(slice(max(a, 0), min(b, n)) for (a, b), n in zip(window, x_global.shape))
    dst = tuple(slice(p, p + s.stop - s.start) for p, s in zip(pad, src))
    out[dst] = x_global[src]
    return out


CASES = {1: [((1,), (5,), (2,), (1,)), ((1,), (5,), (-1,), (2,))],  # a window that leaves out part of the block
         2: [((2,), (5,), (1,), (1,)), ((1, 2), (3, 3), (0, 2), (0, 2)), ((2,), (6,), (-1,), (1,))],
         3: [((3,), (4,), (2,), (3,)), ((1, 3), (2, 7), (1, 2), (0, 1))],  # blocks of 1 with a halo of 2-3
         4: [((2, 2), (5, 3), (1, 2), (2, 1)), ((1, 2, 2), (2, 3, 4), (0, 1, 1), (0, 1, 1))]}


@sizes(1, 2, 3, 4)
def test_forward_and_adjoint(P_world, comm):
    for P_shape, shape, left, right in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        x_global = random_tensor(shape, seed=3)
        windows = halo_windows(P_x, shape, left, right)
        x = scatter(x_global, P_x)
        assert global_shape(x, P_x) == shape
        y = window_exchange(x, P_x, shape, windows)
        torch.testing.assert_close(y, padded_slice(x_global, windows[P_x.rank]), rtol=0, atol=0)
        assert_adjoint(lambda t: window_exchange(t, P_x, shape, windows), random_tensor(x.shape, seed=comm.rank), comm)
        # The adjoint adds overlapping windows: the sum of all windows' ones counts the coverage.
        ones = torch.ones(y.shape, dtype=torch.float64)
        count = window_scatter_add(ones, P_x, shape, windows)
        coverage = torch.zeros(shape, dtype=torch.float64)
        for w in windows:
            coverage += padded_slice(torch.ones(shape, dtype=torch.float64), w).new_ones(()) * 0  # shape check only
            src = tuple(slice(max(a, 0), min(b, n)) for (a, b), n in zip(w, shape))
            coverage[src] += 1
        torch.testing.assert_close(count, scatter(coverage, P_x), rtol=0, atol=0)


@sizes(3)
def test_inactive_and_errors(P_world, comm):
    P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition([2])
    shape = (4,)
    windows = halo_windows(P_x, shape, (1,), (1,))
    x = scatter(random_tensor(shape, seed=1), P_x) if P_x.active else torch.zeros(0, dtype=torch.float64)
    assert_adjoint(lambda t: window_exchange(t, P_x, shape, windows), x, comm)
    if P_x.active:
        with pytest.raises(ValueError,
                           match=r"window_exchange: expected a block of shape \(2,\) on rank \d, got \(3,\)"):
            window_exchange(torch.ones(3), P_x, shape, windows)
        with pytest.raises(ValueError, match="window_exchange: expected 2 windows of 1 dimensions, got 1"):
            window_exchange(x, P_x, shape, windows[:1])


@sizes(2)
def test_windows_are_checked_and_normalized(P_world, comm):
    """Windows as lists work; floats, bools and reversed boxes raise on every worker and leave no plan behind."""
    P_x = P_world.create_cartesian_topology_partition([2])
    x = scatter(torch.arange(8.), P_x)
    expected = window_exchange(x, P_x, (8,), (((0, 3),), ((3, 8),)))
    assert torch.equal(window_exchange(x, P_x, [8], [[[0, 3]], [[3, 8]]]), expected)
    with pytest.raises(TypeError, match=r"window_exchange: expected integers for windows\[0\]\[0\]"):
        window_exchange(x, P_x, (8,), (((0.0, 3.0),), ((3.0, 8.0),)))  # equal to the int windows as a key
    with pytest.raises(TypeError, match=r"window_exchange: expected integers for windows\[0\]\[0\]"):
        window_exchange(x, P_x, (8,), (((False, True),), ((3, 8),)))
    with pytest.raises(ValueError, match=r"window_exchange: expected windows\[1\] of \[start, stop\) pairs"):
        window_exchange(x, P_x, (8,), (((0, 3),), ((5, 3),)))
    with pytest.raises(ValueError, match=r"window_exchange: expected x_global_shape of 1 non-negative extents"):
        window_exchange(x, P_x, (8, 1), (((0, 3),), ((3, 8),)))
    assert torch.equal(window_exchange(x, P_x, torch.Size([8]), (((0, 3),), ((3, 8),))), expected)


@sizes(1, 2, 3)
def test_channels_last_stays_channels_last(P_world, comm):
    """A channels_last input gives a channels_last output where torch's layer gives one (the windows were contiguous,
    and so were the outputs built from them: only blocks exchanging nothing kept the format, so it depended on the
    rank), with the values and input gradients of a contiguous input. Split along the height, uneven at 2 and 3."""
    from distdl import nn as dnn
    n = comm.size
    P_4 = P_world.create_cartesian_topology_partition((1, 1, n, 1))
    P_5 = P_world.create_cartesian_topology_partition((1, 1, n, 1, 1))
    P_c = P_world.create_cartesian_topology_partition((1, n, 1, 1))
    P_y = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1, 1, 1))
    torch.manual_seed(0)
    cases = [(dnn.DistributedFeatureConv2d(P_4, 3, 4, 3, padding=1), torch.nn.Conv2d(3, 4, 3, padding=1), P_4, 4),
             (dnn.DistributedGeneralConv2d(P_4, P_4, P_4, 3, 4, 3, padding=1), torch.nn.Conv2d(3, 4, 3, padding=1),
              P_4, 4),
             (dnn.DistributedChannelConv2d(P_c, P_y, P_c, 2 * n, 2, 3, padding=1), torch.nn.Conv2d(2 * n, 2, 3),
              P_c, 4),
             (dnn.DistributedMaxPool2d(P_4, 3, padding=1), torch.nn.MaxPool2d(3, padding=1), P_4, 4),
             (dnn.DistributedMaxPool2d(P_4, 3, 1, padding=1), torch.nn.MaxPool2d(3, 1, padding=1), P_4, 4),  # cropped
             (dnn.DistributedAvgPool2d(P_4, 2, ceil_mode=True), torch.nn.AvgPool2d(2, ceil_mode=True), P_4, 4),
             (dnn.DistributedMaxPool3d(P_5, 2), torch.nn.MaxPool3d(2), P_5, 5),
             (dnn.DistributedUpsample(P_4, scale_factor=2, mode="bilinear"), torch.nn.Upsample(scale_factor=2,
                                                                                            mode="bilinear"), P_4, 4)]
    for layer, reference, P_x, dims in cases:
        layer, reference = layer.double(), reference.double()
        fmt = torch.channels_last if dims == 4 else torch.channels_last_3d
        shape = (2, layer.in_channels if hasattr(layer, "in_channels") else 3, 7, 5, 3)[:dims]
        x_global = random_tensor(shape, seed=1)
        expected = reference(x_global.contiguous(memory_format=fmt)).is_contiguous(memory_format=fmt)
        x = scatter(x_global, P_x)
        outputs = []
        for layout in (torch.contiguous_format, fmt):
            x_k = x.detach().contiguous(memory_format=layout).requires_grad_()
            y = layer(x_k)
            y.backward(random_tensor(y.shape, seed=2 + comm.rank).contiguous(memory_format=layout)
                       if y.dim() == dims else torch.zeros_like(y))
            outputs.append((y.detach(), x_k.grad))
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-12, atol=1e-12)
        y = outputs[1][0]
        if y.dim() == dims and y.numel():
            assert y.is_contiguous(memory_format=fmt if expected else torch.contiguous_format), type(layer).__name__
    # through an empty block: a pooling that leaves worker 1 no rows (3 workers), an upsampling that gives it one
    pool, up = dnn.DistributedMaxPool2d(P_4, 2), dnn.DistributedUpsample(P_4, scale_factor=2)
    y = up(pool(scatter(random_tensor((2, 3, 3, 5), seed=3), P_4).contiguous(memory_format=torch.channels_last)))
    assert not y.numel() or y.is_contiguous(memory_format=torch.channels_last)
    # an empty block sliced from a channels_last tensor keeps its strides, not those torch gives an empty one
    x = scatter(random_tensor((1, 3, 2, 2), seed=4).contiguous(memory_format=torch.channels_last), P_4)
    y = up(x.contiguous(memory_format=torch.channels_last))
    assert y.numel() and y.is_contiguous(memory_format=torch.channels_last), (tuple(x.shape), x.stride())
