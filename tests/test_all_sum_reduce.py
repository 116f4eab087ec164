"""AllSumReduce: forward against a serial sum, adjoint tests, zero-volume, dtypes and errors."""

import pytest
import torch

from distdl.functional import all_sum_reduce
from distdl.nn import AllSumReduce
from distdl.testing import assert_adjoint, random_tensor
from helpers import partition_shapes, sizes


@sizes(1, 2, 3, 4)
def test_forward_matches_serial_sum(P_world, comm):
    for shape in partition_shapes(comm.size):
        P_x = P_world.create_cartesian_topology_partition(shape)
        for axes in [(0,), tuple(range(len(shape))), ()]:
            layer = AllSumReduce(P_x, axes_reduce=axes)
            # Every worker builds everyone's input from its index, so the serial sum is known locally.
            inputs = {index: random_tensor((3, 5), seed=hash(index) % 1000) for index in _indices(shape)}
            y = layer(inputs[P_x.index])
            fibre = [i for i in inputs if all(i[a] == P_x.index[a] for a in range(len(shape)) if a not in axes)]
            expected = sum(inputs[i] for i in sorted(fibre))
            torch.testing.assert_close(y, expected, rtol=1e-14, atol=1e-14)
            if not axes:
                assert y.data_ptr() != inputs[P_x.index].data_ptr()  # a copy, never an alias


def _indices(shape):
    import numpy as np
    return [tuple(int(v) for v in i) for i in np.ndindex(*shape)]


@sizes(1, 2, 3, 4)
def test_adjoint(P_world, comm):
    for shape in partition_shapes(comm.size):
        P_x = P_world.create_cartesian_topology_partition(shape)
        for axes in [(0,), (len(shape) - 1,), tuple(range(len(shape)))]:
            x = random_tensor((4, 3), seed=10 + comm.rank)
            assert_adjoint(lambda t: all_sum_reduce(t, P_x, axes_reduce=axes), x, comm)
        # axes_keep is the complement of axes_reduce
        x = random_tensor((2, 2), seed=comm.rank)
        keep = AllSumReduce(P_x, axes_keep=[0])(x)
        reduce = AllSumReduce(P_x, axes_reduce=list(range(1, len(shape))))(x)
        torch.testing.assert_close(keep, reduce, rtol=0, atol=0)


@sizes(3, 4)
def test_inactive_workers_and_zero_volume(P_world, comm):
    P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition([2])
    layer = AllSumReduce(P_x, axes_reduce=[0])
    x = random_tensor((3,), seed=comm.rank) if P_x.active else torch.zeros(0, dtype=torch.float64)
    assert_adjoint(layer, x, comm)
    y = layer(x)
    if P_x.active:
        torch.testing.assert_close(y, random_tensor((3,), seed=0) + random_tensor((3,), seed=1))
    else:
        assert y.shape == (0,)
        with pytest.raises(ValueError, match=rf"all_sum_reduce: worker {comm.rank} is outside P_x and expected a "
                                             r"zero-volume tensor, got shape \(3,\)"):
            layer(torch.ones(3))
    # An empty global tensor works everywhere.
    empty = torch.zeros(0, 4, dtype=torch.float64)
    assert layer(empty).shape == (0, 4)


@sizes(2, 3)
def test_dtypes_and_noncontiguous(P_world, comm):
    layer = AllSumReduce(P_world, axes_reduce=[0])
    n = comm.size
    base = torch.arange(12).reshape(3, 4) + comm.rank
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8, torch.complex128):
        y = layer(base.to(dtype))
        assert y.dtype == dtype
        expected = sum((torch.arange(12).reshape(3, 4) + r).to(dtype) for r in range(n))
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
    big = torch.tensor([2 ** 40 + comm.rank], dtype=torch.int64)
    assert layer(big).item() == n * 2 ** 40 + sum(range(n))  # 64-bit integers exactly
    # Half precision is summed in float32: 2048 + 1 + 1 is exact in fp32, not in fp16 pairwise.
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.tensor([256.0 if comm.rank == 0 else 0.5], dtype=dtype)
        y = layer(x)
        assert y.dtype == dtype
        assert y.item() == torch.tensor(256.0 + 0.5 * (n - 1)).to(dtype).item()
    t = random_tensor((4, 6), seed=comm.rank).t()  # non-contiguous
    torch.testing.assert_close(layer(t), sum(random_tensor((4, 6), seed=r) for r in range(n)).t())
    with pytest.raises(TypeError, match="all_sum_reduce: expected a dtype that can be summed, got torch.bool"):
        layer(torch.ones(2, dtype=torch.bool))


@sizes(2)
def test_grad_output_not_modified(P_world, comm):
    layer = AllSumReduce(P_world, axes_reduce=[0])
    x = random_tensor((5,), seed=comm.rank).requires_grad_()
    dy = random_tensor((5,), seed=100 + comm.rank)
    keep = dy.clone()
    layer(x).backward(dy)
    assert torch.equal(dy, keep)
    torch.testing.assert_close(x.grad, random_tensor((5,), seed=100) + random_tensor((5,), seed=101))


@sizes(1, 2)
def test_errors(P_world, comm):
    with pytest.raises(ValueError, match=r"AllSumReduce: expected axes in \[-1, 1\) for a partition of shape "
                                         r"\(\d,\), got \[1\]"):
        AllSumReduce(P_world, axes_reduce=[1])
    with pytest.raises(ValueError, match="all_sum_reduce: expected exactly one of axes_reduce and axes_keep"):
        all_sum_reduce(torch.ones(1), P_world)
    with pytest.raises(TypeError, match="all_sum_reduce: expected a torch.Tensor, got list"):
        all_sum_reduce([1.0], P_world, axes_reduce=[0])


@sizes(1, 2)
def test_repeat_calls_check_as_the_first(P_world, comm):
    """Calls after the first skip validation only for the very axes objects it validated."""
    P_x = P_world.create_cartesian_topology_partition([comm.size])
    axes = (0,)
    x = torch.ones(2, dtype=torch.float64)
    torch.testing.assert_close(all_sum_reduce(x, P_x, axes_reduce=axes), x * comm.size)
    with pytest.raises(TypeError, match=r"all_sum_reduce: expected integers for axes, got \(0\.0,\)"):
        all_sum_reduce(x, P_x, axes_reduce=(0.0,))  # equal to (0,) as a dict key
    with pytest.raises(TypeError, match="all_sum_reduce: expected a dtype that can be summed, got torch.bool"):
        all_sum_reduce(x.bool(), P_x, axes_reduce=axes)
    torch.testing.assert_close(all_sum_reduce(x, P_x, axes_reduce=[0]), x * comm.size)  # a list: every call
    P_x.free()  # a freed partition's plans go with it, and using it is an error on every worker
    for t in (torch.zeros(0), x):
        with pytest.raises(ValueError, match=r"all_sum_reduce \(P_x\): the partition of shape .* was freed"):
            all_sum_reduce(t, P_x, axes_reduce=axes)
