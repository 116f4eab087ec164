"""DistributedUpsample: forward and input gradient equal torch's on the gathered tensors."""

import math

import numpy as np
import pytest
import torch

from distdl.nn.upsampling import DistributedUpsample
from distdl.testing import assert_adjoint, assert_sequential_equivalence, random_tensor, scatter
from helpers import sizes

# (partition shape, global input shape, kwargs): nearest, nearest-exact and (bi/tri)linear with and without
# align_corners, up and down, uneven splits, split batch and channel axes, empty input and output blocks.
CASES = {
    1: [((1, 1, 1, 1), (2, 2, 5, 4), dict(scale_factor=2)),
        ((1, 1, 1), (1, 2, 5), dict(size=11, mode="linear"))],
    2: [((1, 1, 2, 1), (1, 2, 5, 3), dict(scale_factor=1.7, mode="bilinear")),
        ((2, 1, 1), (3, 2, 7), dict(size=4, mode="linear", align_corners=True)),
        ((1, 2, 1), (1, 3, 5), dict(scale_factor=2.5, mode="nearest-exact")),
        ((1, 1, 2, 1), (1, 2, 3, 3), dict(scale_factor=(2.2, 1.3)))],  # 2-d nearest: torch halves (6 rows), copies
    3: [((1, 1, 3), (1, 2, 4), dict(scale_factor=2.3, mode="linear", recompute_scale_factor=True)),
        ((1, 1, 1, 3), (1, 2, 3, 8), dict(size=(5, 5), mode="bilinear", align_corners=True)),
        ((1, 1, 1, 3, 1), (1, 1, 2, 3, 4), dict(scale_factor=(1.5, 2, 1), mode="trilinear"))],
    4: [((1, 1, 2, 2), (2, 2, 5, 6), dict(scale_factor=1.5, mode="bilinear")),
        ((1, 1, 4), (1, 2, 3), dict(size=13)),  # one worker holds no input
        ((1, 1, 4), (1, 2, 9), dict(size=2)),  # two workers hold no output
        ((2, 1, 1, 2), (3, 2, 4, 5), dict(size=(3, 7), mode="nearest-exact")),
        ((1, 1, 1, 2, 2), (1, 2, 3, 4, 5), dict(scale_factor=2, mode="trilinear", align_corners=True))],
}


def _check(P_x, layer, ref, x_shape, dtype=torch.float64, tol=1e-12, calls=2):
    for call in range(calls):
        shape = (x_shape[0] + call,) + tuple(x_shape[1:])  # the same layer with a larger batch
        assert_sequential_equivalence(layer, ref, random_tensor(shape, seed=call).to(dtype), P_x, P_x, seed=call,
                                      rtol=tol, atol=tol)


@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm):
    for P_shape, x_shape, kwargs in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        _check(P_x, DistributedUpsample(P_x, **kwargs), torch.nn.Upsample(**kwargs), x_shape)


@sizes(1, 2, 3, 4)
def test_adjoint_and_dtypes(P_world, comm):
    for P_shape, x_shape, kwargs in CASES[comm.size][:2]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        layer, ref = DistributedUpsample(P_x, **kwargs), torch.nn.Upsample(**kwargs)
        assert_adjoint(layer, random_tensor(scatter(torch.zeros(x_shape), P_x).shape, seed=comm.rank), comm)
        _check(P_x, layer, ref, x_shape, dtype=torch.float32, tol=1e-6, calls=1)
        x = random_tensor(x_shape, seed=4)
        y = layer(scatter(x.bfloat16(), P_x))
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), scatter(ref(x.bfloat16()).double(), P_x), rtol=2e-2, atol=2e-2)
        x_local = scatter(x, P_x).transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous block
        torch.testing.assert_close(layer(x_local), scatter(ref(x), P_x), rtol=1e-12, atol=1e-12)
        if "mode" not in kwargs:  # nearest moves integers exactly
            integers = (x * 100).long()
            expected = scatter(ref(integers.double()).long(), P_x)  # torch has no integer nearest2d
            torch.testing.assert_close(layer(scatter(integers, P_x)), expected, rtol=0, atol=0)


@sizes(3)
def test_inactive_workers_and_one_worker(P_world, comm):
    for ranks, P_shape in (([0], (1, 1, 1, 1)), ([1, 2], (1, 1, 2, 1))):
        P_x = P_world.create_partition_inclusive(ranks).create_cartesian_topology_partition(P_shape)
        kwargs = dict(scale_factor=2, mode="bilinear")
        layer = DistributedUpsample(P_x, **kwargs)
        _check(P_x, layer, torch.nn.Upsample(**kwargs), (1, 2, 3, 4))
        if not P_x.active:
            assert layer(torch.zeros(0, dtype=torch.float64)).shape == (0,)
            with pytest.raises(ValueError, match=rf"DistributedUpsample: worker {comm.rank} is outside P_x"):
                layer(torch.ones(1, 2, 3, 4, dtype=torch.float64))


@sizes(1, 2)
def test_errors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    with pytest.raises(ValueError, match=r"DistributedUpsample: expected a partition of 3 to 5 dimensions, got "
                                         rf"shape \({comm.size},\)"):
        DistributedUpsample(P_world, scale_factor=2)
    with pytest.raises(ValueError, match="DistributedUpsample: expected mode 'nearest', 'nearest-exact' or 'linear' "
                                         "for 1 spatial dimensions, got 'bilinear'"):
        DistributedUpsample(P_x, scale_factor=2, mode="bilinear")
    with pytest.raises(ValueError, match="expected align_corners=None with mode 'nearest', got True"):
        DistributedUpsample(P_x, scale_factor=2, align_corners=True)
    with pytest.raises(TypeError, match="DistributedUpsample: expected a bool for align_corners, got 'False'"):
        DistributedUpsample(P_x, scale_factor=2, mode="linear", align_corners="False")  # torch's op raises too
    with pytest.raises(TypeError, match="DistributedUpsample: expected a bool for recompute_scale_factor, got 0"):
        DistributedUpsample(P_x, scale_factor=2, recompute_scale_factor=0)
    with pytest.raises(ValueError, match="expected exactly one of size and scale_factor, got size=None"):
        DistributedUpsample(P_x)
    with pytest.raises(ValueError, match=r"expected recompute_scale_factor only with scale_factor \(as torch\), got "
                                         r"it with size=5"):
        DistributedUpsample(P_x, size=5, recompute_scale_factor=True)
    for bad in (-1, True, math.inf, "2", (2, 2), torch.tensor([2.0])):
        with pytest.raises(ValueError, match=r"expected scale_factor as a positive number or 1 of them, got "):
            DistributedUpsample(P_x, scale_factor=bad)
    for factor, expected in ((np.float32(2.5), 2.5), (torch.tensor(2.5), 2.5), ([np.int64(2)], 2.0)):  # as torch
        assert DistributedUpsample(P_x, scale_factor=factor).scale_factor == (expected,)
    layer = DistributedUpsample(P_x, scale_factor=2, mode="linear")
    assert repr(layer).startswith("DistributedUpsample(scale_factor=(2.0,), mode='linear', P_x shape=")  # as torch
    assert "size=(6,), mode='linear', align_corners=True," in repr(
        DistributedUpsample(P_x, size=6, mode="linear", align_corners=True))
    with pytest.raises(ValueError, match=r"DistributedUpsample: expected a tensor of 3 dimensions"):
        layer(torch.ones(2, 4))
    with pytest.raises(TypeError, match="expected a floating-point tensor for mode 'linear', got torch.int64"):
        layer(torch.ones(1, 2, 3, dtype=torch.int64))
