"""Mixed precision: distdl's layers run under torch.autocast as torch's do (the activation in autocast's dtype, the
parameters in float32), and their results approximate the same layers' without autocast."""

import itertools

import pytest
import torch

from distdl.nn import (DistributedBatchNorm, DistributedFeatureConv2d, DistributedLinear, DistributedLinearAllGather,
                       DistributedLinearReduceScatter)
from distdl.testing import random_tensor, scatter
from distdl.utilities.torch import zero_volume_tensor
from helpers import sizes


def _compare(layers, x, dy):
    """Run ``layers`` on ``x`` with and without autocast; return both outputs and the parameter gradients."""
    results = []
    for autocast in (False, True):
        params = [p for layer in layers for p in layer.parameters()]
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = x.clone().requires_grad_()
            for layer in layers:
                y = layer(y)
        y.backward(dy.to(y.dtype))
        results.append((y.detach(), [p.grad.clone() for p in params]))
    return results


@sizes(1, 2, 3)
@pytest.mark.parametrize("overlap", [False, True])
def test_layers_under_autocast(P_world, comm, overlap):
    P_s = P_world.create_cartesian_topology_partition([1, 1, 1, comm.size])
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    spatial = [DistributedFeatureConv2d(P_s, 2, 3, 3, padding=1), DistributedBatchNorm(P_s, 3),
               DistributedFeatureConv2d(P_s, 3, 2, 3, padding=1)]
    parallel = [DistributedLinearAllGather(P_f, 4, 6, overlap=overlap), torch.nn.Tanh(),
                DistributedLinearReduceScatter(P_f, 6, 4, overlap=overlap)]
    P_col = P_world.create_cartesian_topology_partition([comm.size, 1])
    classic = [DistributedLinear(P_0, P_f, P_col, 4, 6), DistributedLinear(P_f, P_0, P_f, 6, 3)]
    x_0 = random_tensor((3, 4), seed=3).float() if P_0.active else zero_volume_tensor(dtype=torch.float32)
    y_0 = random_tensor((3, 3), seed=4).float() if P_0.active else zero_volume_tensor(3, dtype=torch.float32)
    cases = [(spatial, scatter(random_tensor((2, 2, 5, 7), seed=1).float(), P_s),
              scatter(random_tensor((2, 2, 5, 7), seed=2).float(), P_s)),
             (parallel, scatter(random_tensor((3, 4), seed=5).float(), P_f),
              scatter(random_tensor((3, 4), seed=6).float(), P_f)),
             (classic, x_0, y_0)]
    for layers, x, dy in cases:
        (exact, exact_grads), (mixed, mixed_grads) = _compare(layers, x, dy)
        assert mixed.dtype == (torch.bfloat16 if exact.numel() else mixed.dtype)  # as torch's Conv2d and Linear
        scale = max(float(t.norm()) for t in [exact] + exact_grads)  # bfloat16 keeps 8 bits of each: errors of the
        for a, b in zip([mixed.float()] + mixed_grads, [exact] + exact_grads):  # order of 1% of the whole
            assert a.dtype == torch.float32  # parameters and their gradients stay in float32
            assert (a - b).norm() <= 3e-2 * scale, (a, b)


@sizes(2, 3)
def test_an_empty_block_of_a_convolution_under_autocast(P_world, comm):
    """A worker whose output block is empty (fewer pixels, or output channels, than workers) gets autocast's dtype
    as the others do (it kept the input's float32: the blocks formed no tensor of one dtype)."""
    from distdl.nn import DistributedChannelConv1d, DistributedFeatureConv1d
    from distdl.testing import gather
    P_s = P_world.create_cartesian_topology_partition([1, 1, comm.size])
    P_c = P_world.create_cartesian_topology_partition([1, comm.size, 1])
    P_w = P_world.create_cartesian_topology_partition([comm.size, 1, 1])
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1, 1])
    for layer, x, P_y in ((DistributedFeatureConv1d(P_s, 2, 3, 3, padding=1),
                           scatter(random_tensor((2, 2, comm.size - 1), seed=1).float(), P_s), P_s),
                          (DistributedChannelConv1d(P_0, P_c, P_w, 2, comm.size - 1, 3, padding=1),
                           scatter(random_tensor((2, 2, 5), seed=2).float(), P_0), P_c)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        if P_y.active:
            assert y.dtype == torch.bfloat16, (type(layer).__name__, tuple(y.shape))
        assert gather(y.detach(), P_y).dtype == torch.bfloat16


@sizes(1, 2, 3)
def test_pooling_under_autocast(P_world, comm):
    """Pooling under autocast gives torch's dtypes (CPU autocast runs avg_pool3d in float32, so its output stays
    float32 for a bfloat16 input) and values, also in empty output blocks (an extent of 2: one output pixel)."""
    from distdl.nn import pooling
    for dims, n in itertools.product((1, 2, 3), (2 * comm.size + 1, 2)):
        P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size) + (1,) * (dims - 1))
        x = random_tensor((2, 2, n) + (4,) * (dims - 1), seed=7)
        for kind in ("Max", "Avg"):
            name = f"{kind}Pool{dims}d"
            layer, ref = getattr(pooling, "Distributed" + name)(P_x, 2), getattr(torch.nn, name)(2)
            for dtype in (torch.float32, torch.bfloat16):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y, expected = layer(scatter(x.to(dtype), P_x)), scatter(ref(x.to(dtype)), P_x)
                assert y.dtype == expected.dtype, (name, dtype, y.dtype, expected.dtype)
                torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)
