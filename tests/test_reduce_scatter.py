"""ReduceScatter: forward against a serial sum and slice, adjoint, zero-volume, inactive workers, dtypes, errors."""

import numpy as np
import pytest
import torch

from distdl.functional.reduce_scatter import reduce_scatter
from distdl.nn.reduce_scatter import ReduceScatter
from distdl.testing import assert_adjoint, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import gather_paths, partition_shapes, sizes  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("gather_paths")  # every test on every data path

# Full shapes per partition dimension: uneven extents (7 over 3 or 4, 5 over 2), and a leading extent of 1.
FULL_SHAPES = {1: [(7,)], 2: [(7, 5), (1, 7)], 3: [(5, 4, 7)]}


def _axes_cases(dim):
    singles = [(a,) for a in range(dim)]
    return singles + [tuple(range(dim)), ()] + ([(1, 2)] if dim == 3 else [])


def _input(P_shape, index, shape, dtype=torch.float64):
    """Worker ``index``'s input: integer-valued, so every order of summation is exact."""
    generator = torch.Generator().manual_seed(int(np.ravel_multi_index(index, P_shape)) + 17 * len(shape))
    return torch.randint(-50, 50, shape, generator=generator).to(dtype)


def _expected(P_x, axes, shape):
    """The serial reference: the sum over this worker's fibre, then its balanced block along ``axes``."""
    fibre = [j for j in np.ndindex(*P_x.shape) if all(j[a] == P_x.index[a] for a in range(P_x.dim) if a not in axes)]
    total = sum(_input(P_x.shape, j, shape) for j in fibre)
    P_shape = [p if a in axes else 1 for a, p in enumerate(P_x.shape)]
    index = [i if a in axes else 0 for a, i in enumerate(P_x.index)]
    start, stop = compute_start_index(P_shape, index, shape), compute_stop_index(P_shape, index, shape)
    return total[tuple(slice(int(a), int(b)) for a, b in zip(start, stop))]


@sizes(1, 2, 3, 4)
def test_forward_matches_serial(P_world, comm):
    for P_shape in partition_shapes(comm.size):
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        for shape in FULL_SHAPES[len(P_shape)]:
            x = _input(P_shape, P_x.index, shape)
            for axes in _axes_cases(len(P_shape)):
                y = ReduceScatter(P_x, axes_reduce_scatter=axes)(x)
                assert torch.equal(y, _expected(P_x, axes, shape)), (P_shape, shape, axes, comm.rank)
                assert y.data_ptr() != x.data_ptr()  # a copy, never an alias


@sizes(1, 2, 3, 4)
def test_adjoint(P_world, comm):
    for P_shape in partition_shapes(comm.size):
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        x = random_tensor(FULL_SHAPES[len(P_shape)][0], seed=10 + comm.rank)
        for axes in sorted({(0,), (len(P_shape) - 1,), tuple(range(len(P_shape)))}):  # leading, last, all at once
            assert_adjoint(lambda t: reduce_scatter(t, P_x, axes_reduce_scatter=axes), x, comm)
    # axes_keep is the complement of axes_reduce_scatter
    P_x = P_world.create_cartesian_topology_partition(partition_shapes(comm.size)[1])
    x = random_tensor((7, 5), seed=comm.rank)
    assert torch.equal(ReduceScatter(P_x, axes_keep=[0])(x), ReduceScatter(P_x, axes_reduce_scatter=[1])(x))


@sizes(2, 3)
def test_backward_is_all_gather(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = ReduceScatter(P_x, axes_reduce_scatter=[1])
    x = random_tensor((3, 7), seed=comm.rank).requires_grad_()
    dY = random_tensor((3, 7), seed=100)
    dy = scatter(dY, P_x)
    keep = dy.clone()
    layer(x).backward(dy)
    assert torch.equal(dy, keep)  # grad_output is not modified
    assert torch.equal(x.grad, dY)


@sizes(3, 4)
def test_zero_volume_blocks_and_empty_tensors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([comm.size, 1])
    x = random_tensor((2, 3), seed=comm.rank)  # 2 rows over 3 or 4 workers: some get (0, 3)
    y = reduce_scatter(x, P_x, axes_reduce_scatter=[0])
    total = sum(random_tensor((2, 3), seed=r) for r in range(comm.size))
    torch.testing.assert_close(y, scatter(total, P_x), rtol=1e-14, atol=1e-14)
    assert_adjoint(lambda t: reduce_scatter(t, P_x, axes_reduce_scatter=[0]), x, comm)
    empty = torch.zeros(0, 4, dtype=torch.float64)  # an empty global tensor
    assert reduce_scatter(empty, P_x, axes_reduce_scatter=[0]).shape == (0, 4)
    assert reduce_scatter(empty, P_x, axes_reduce_scatter=[1]).shape == (0, 4)


@sizes(3, 4)
def test_inactive_workers(P_world, comm):
    P_x = P_world.create_partition_inclusive([1, 2]).create_cartesian_topology_partition([2])
    layer = ReduceScatter(P_x, axes_reduce_scatter=[0])
    x = random_tensor((5,), seed=comm.rank) if P_x.active else torch.zeros(0, dtype=torch.float64)
    assert_adjoint(layer, x, comm)
    y = layer(x)
    if P_x.active:
        torch.testing.assert_close(y, scatter(random_tensor((5,), seed=1) + random_tensor((5,), seed=2), P_x))
    else:
        assert y.shape == (0,)
        with pytest.raises(ValueError, match=rf"reduce_scatter: worker {comm.rank} is outside P_x and expected a "
                                             r"zero-volume tensor, got shape \(3,\)"):
            layer(torch.ones(3))


@sizes(2, 3)
def test_second_call_with_smaller_batch(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = ReduceScatter(P_x, axes_reduce_scatter=[1])
    for batch in (5, 3, 0):
        x = _input((comm.size,), (comm.rank,), (batch, 7))
        total = sum(_input((comm.size,), (r,), (batch, 7)) for r in range(comm.size))
        assert torch.equal(layer(x), scatter(total, P_x))


@sizes(2, 3)
def test_dtypes_and_noncontiguous(P_world, comm):
    n = comm.size
    P_x = P_world.create_cartesian_topology_partition([1, n])
    layer = ReduceScatter(P_x, axes_reduce_scatter=[1])
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.complex128):
        y = layer(_input((n,), (comm.rank,), (4, 7), dtype))
        assert y.dtype == dtype
        assert torch.equal(y, scatter(sum(_input((n,), (r,), (4, 7), dtype) for r in range(n)), P_x))
    big = torch.full((1, 7), 2 ** 53 + 1 + comm.rank, dtype=torch.int64)  # beyond float64's integers
    assert torch.equal(layer(big), scatter(torch.full((1, 7), n * (2 ** 53 + 1) + sum(range(n))), P_x))
    # Reduced precision is summed in float32: big + 1 + 1 keeps the ones, pairwise fp16/bf16 sums lose them.
    for dtype, big in ((torch.float16, 2048.0), (torch.bfloat16, 256.0)):
        x = torch.full((2, n), big if comm.rank == 0 else 1.0, dtype=dtype)
        y = layer(x)
        assert y.dtype == dtype
        assert torch.equal(y, torch.full((2, 1), big + n - 1, dtype=torch.float32).to(dtype))
    x = random_tensor((7, 4), seed=comm.rank).t()  # non-contiguous
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x), scatter(sum(random_tensor((7, 4), seed=r) for r in range(n)).t(), P_x),
                               rtol=1e-14, atol=1e-14)
    with pytest.raises(TypeError, match="reduce_scatter: expected a dtype that can be summed, got torch.bool"):
        layer(torch.ones(1, 7, dtype=torch.bool))


@sizes(2, 3)
def test_errors(P_world, comm):
    with pytest.raises(ValueError, match=r"ReduceScatter: expected axes in \[-1, 1\) for a partition of shape "
                                         r"\(\d,\), got \[1\]"):
        ReduceScatter(P_world, axes_reduce_scatter=[1])
    with pytest.raises(ValueError, match="reduce_scatter: expected exactly one of axes_reduce_scatter and axes_keep"):
        reduce_scatter(torch.ones(1), P_world)
    with pytest.raises(TypeError, match="reduce_scatter: expected a torch.Tensor, got list"):
        reduce_scatter([1.0], P_world, axes_reduce_scatter=[0])
    with pytest.raises(ValueError, match=r"reduce_scatter: expected a tensor of 1 dimensions to match P_x of shape "
                                         r"\(\d,\), got shape \(2, 2\)"):
        reduce_scatter(torch.ones(2, 2), P_world, axes_reduce_scatter=[0])
    # Members disagreeing on the shape or dtype: every member sees the same headers and raises the same error.
    for attempt in range(2):  # agreed headers are remembered, failed ones are not
        with pytest.raises(ValueError, match=r"reduce_scatter: expected the same shape on every member of the fibre, "
                                             r"got \(4,\) on worker 0 and \(5,\) on worker 1"):
            reduce_scatter(torch.ones(5 if comm.rank == 1 else 4), P_world, [0])
    with pytest.raises(ValueError, match="reduce_scatter: expected one dtype on every member of the fibre, got "
                                         "torch.float64 on worker 0 and torch.float32 on worker 1"):
        reduce_scatter(torch.ones(4, dtype=torch.float32 if comm.rank == 1 else torch.float64), P_world, [0])
    # The partition still works after the errors.
    assert torch.equal(reduce_scatter(torch.ones(comm.size, dtype=torch.int64), P_world, [0]),
                       torch.full((1,), comm.size))
