"""Windowed layers (convolution, pooling, upsampling) on random geometries, against torch.

Each case draws from its seed alone (the same on every worker): a layer of 1-3 spatial dimensions and its
arguments (kernel, stride, padding, dilation, groups, ceil_mode, count_include_pad, divisor_override, scale
or size and mode), a small global input, and a partition of a random subset of the workers, in random
order, over batch and space (and channels for pooling). The output and the input gradient for a random
cotangent are compared with torch's on the global tensor. Where torch rejects the arguments, every worker
of the partition must raise too. The hand-picked cases live in test_conv_feature.py, test_pooling.py and
test_upsampling.py; these found three geometries they missed.
"""

import numpy as np
import pytest
import torch

from distdl.nn import conv_feature, pooling, upsampling
from distdl.testing import random_tensor, scatter
from helpers import sizes

CASES = 40  # per world size; seeds differ between world sizes


def _partition_shape(rng, dims, workers, channels):
    shape = [1] * (dims + 2)
    axes = [0] + [1] * channels + list(range(2, dims + 2))
    for p in (2, 2, 3):
        while workers % p == 0 and rng.random() < 0.8:
            shape[int(rng.choice(axes))] *= p
            workers //= p
    shape[int(rng.choice(axes))] *= workers
    return shape


def _layer(rng, kind, dims, P_x):
    """Return (distributed layer, torch layer, input channels)."""
    ints = lambda low, high: [int(v) for v in rng.integers(low, high, dims)]  # noqa: E731
    channels = int(rng.integers(1, 5))
    if kind == "conv":
        kernel, stride, dilation = ints(1, 6), ints(1, 4), ints(1, 3)
        groups = 2 if channels % 2 == 0 and rng.random() < 0.3 else 1
        padding = ("same", "valid", [int(rng.integers(0, k + 1)) for k in kernel])[int(rng.choice(3, p=[.2, .1, .7]))]
        if padding == "same":
            stride = 1
        kwargs = dict(in_channels=channels, out_channels=groups * int(rng.integers(1, 3)), kernel_size=kernel,
                      stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bool(rng.random() < .7),
                      dtype=torch.float64)
        name = f"Conv{dims}d"
        layer = getattr(conv_feature, f"DistributedFeature{name}")(P_x, **kwargs)
        reference = getattr(torch.nn, name)(**kwargs)
        with torch.no_grad():  # the distributed layer's initial parameters are torch's on rank 0, broadcast
            reference.weight.copy_(layer.weight)
            if reference.bias is not None:
                reference.bias.copy_(layer.bias)
        return layer, reference, channels
    if kind == "up":
        mode = ("nearest", "nearest-exact", ("linear", "bilinear", "trilinear")[dims - 1])[int(rng.integers(3))]
        kwargs = dict(mode=mode)
        if rng.random() < 0.5:
            kwargs["scale_factor"] = float(rng.choice([0.5, 1.0, 1.5, 2.0, 2.5, 3.0]))
        else:
            kwargs["size"] = ints(1, 14)
        if "linear" in mode:
            kwargs["align_corners"] = bool(rng.random() < 0.5)
        return upsampling.DistributedUpsample(P_x, **kwargs), torch.nn.Upsample(**kwargs), channels
    kernel = ints(1, 5)
    kwargs = dict(kernel_size=kernel, stride=ints(1, 5) if rng.random() < 0.7 else None,
                  padding=[int(rng.integers(0, k // 2 + 1)) for k in kernel], ceil_mode=bool(rng.random() < 0.4))
    if kind == "max":
        kwargs["dilation"] = ints(1, 3)
    else:
        kwargs["count_include_pad"] = bool(rng.random() < 0.5)
        if dims > 1 and rng.random() < 0.2:
            kwargs["divisor_override"] = int(rng.integers(1, 5))
    name = f"{kind.capitalize()}Pool{dims}d"
    return getattr(pooling, f"Distributed{name}")(P_x, **kwargs), getattr(torch.nn, name)(**kwargs), channels


def _case(P_world, seed):
    """Return a description of what differs from torch on this worker, or None."""
    rng = np.random.default_rng(seed)
    kind = ("conv", "max", "avg", "up")[int(rng.integers(4))]
    dims, workers = int(rng.integers(1, 4)), int(rng.integers(1, P_world.size + 1))
    ranks = [int(r) for r in rng.permutation(P_world.size)[:workers]]
    split_channels = kind in ("max", "avg") and rng.random() < 0.3  # the others take no split channel axis
    P_x = P_world.create_partition_inclusive(ranks).create_cartesian_topology_partition(
        _partition_shape(rng, dims, workers, split_channels))
    layer, reference, channels = _layer(rng, kind, dims, P_x)
    x_shape = (int(rng.integers(1, 4)), channels) + tuple(int(n) for n in rng.integers(1, 13 if dims < 3 else 7, dims))
    x = random_tensor(x_shape, seed)
    x_ref = x.clone().requires_grad_()
    try:
        y_ref = reference(x_ref)
    except RuntimeError as error:
        if "smaller than kernel size" in str(error):  # avg_pool3d ignores the padding here; distdl does not
            return None
        try:
            layer(scatter(x, P_x))
        except ValueError:
            return None
        return f"no error where torch raises {error}" if P_x.active else None
    if kind == "max" and torch.isinf(y_ref).any():  # a window of padding only: torch's index lies outside the
        # input (its backward writes there); the reference pads explicitly, so that the window sends no gradient
        pad = [p for side in reversed(reference.padding) for p in (side, side)]
        padded = getattr(torch.nn.functional, f"max_pool{dims}d")(
            torch.nn.functional.pad(x_ref, pad, value=-torch.inf), reference.kernel_size, reference.stride, 0,
            reference.dilation, reference.ceil_mode)[tuple(slice(n) for n in y_ref.shape)]  # ceil_mode: no more
        if not torch.equal(padded, y_ref):
            return "the explicitly padded reference differs from torch's"
        y_ref = padded
    x_local = scatter(x, P_x).requires_grad_()
    y = layer(x_local)
    dy = random_tensor(y_ref.shape, seed + 1)
    y_ref.backward(dy)
    y.backward(scatter(dy, P_x) if P_x.active else torch.zeros_like(y))
    if not P_x.active:
        return None if y.numel() == 0 else f"output of shape {tuple(y.shape)} outside P_x"
    expected = scatter(y_ref.detach(), P_x)
    if y.shape != expected.shape or not torch.allclose(y, expected, rtol=1e-9, atol=1e-12):
        return f"output {tuple(y.shape)} against {tuple(expected.shape)}"
    if not torch.allclose(x_local.grad, scatter(x_ref.grad, P_x), rtol=1e-9, atol=1e-12):
        return "input gradient"
    return None


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@sizes(1, 2, 3, 4)
def test_random_geometries_match_torch(P_world, comm):
    failures = {}
    for seed in range(1000 * comm.size, 1000 * comm.size + CASES):
        failure = _case(P_world, seed)
        if failure:
            failures[seed] = failure
    everyone = comm.allgather(failures)  # every case on every worker before any assertion
    assert not any(everyone), everyone
