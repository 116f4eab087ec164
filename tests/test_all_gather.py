"""AllGather: forward against serial slicing, adjoint tests, zero-volume, inactive workers, dtypes and errors."""

import pytest
import torch

from distdl.functional.all_gather import all_gather, block_slices, in_rank_order
from distdl.nn.all_gather import AllGather
from distdl.testing import assert_adjoint, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import gather_paths, partition_shapes, sizes  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("gather_paths")  # every test on every data path

# Global shapes per partition dimension: uneven extents (7 over 3 or 4, 5 over 2), and a leading extent of 1.
GLOBAL_SHAPES = {1: [(7,)], 2: [(7, 5), (1, 7)], 3: [(5, 4, 7)]}


def _axes_cases(dim):
    singles = [(a,) for a in range(dim)]
    return singles + [tuple(range(dim)), ()] + ([(1, 2)] if dim == 3 else [])


def _gathered(X, P_x, axes):
    """The serial reference: the block of X over P_x with the gathered axes collapsed."""
    shape = [1 if a in axes else p for a, p in enumerate(P_x.shape)]
    index = [0 if a in axes else i for a, i in enumerate(P_x.index)]
    start, stop = compute_start_index(shape, index, X.shape), compute_stop_index(shape, index, X.shape)
    return X[tuple(slice(int(a), int(b)) for a, b in zip(start, stop))]


@sizes(1, 2, 3, 4)
def test_forward_matches_serial(P_world, comm):
    for shape in partition_shapes(comm.size):
        P_x = P_world.create_cartesian_topology_partition(shape)
        for global_shape in GLOBAL_SHAPES[len(shape)]:
            X = random_tensor(global_shape, seed=len(global_shape))
            x = scatter(X, P_x)
            for axes in _axes_cases(len(shape)):
                y = AllGather(P_x, axes_all_gather=axes)(x)
                assert torch.equal(y, _gathered(X, P_x, axes)), (shape, global_shape, axes, comm.rank)
                assert y.data_ptr() != x.data_ptr() or x.numel() == 0  # a copy, never an alias


def test_layout_helpers():
    assert block_slices((3,), (1,), (2, 7)) == [(slice(None), slice(0, 3)), (slice(None), slice(3, 5)),
                                                (slice(None), slice(5, 7))]
    assert block_slices((2, 2), (0, 1), (3, 4))[1] == (slice(0, 2), slice(2, 4))
    assert in_rank_order((3,), (0,), (7, 5))  # gathering the leading dimension: no unpacking
    assert in_rank_order((1, 3), (0, 1), (1, 7, 2))  # leading extents of 1 do not matter
    assert not in_rank_order((3,), (1,), (2, 7))
    assert not in_rank_order((2, 2), (0, 1), (4, 4))


@sizes(1, 2, 3, 4)
def test_adjoint(P_world, comm):
    for shape in partition_shapes(comm.size):
        P_x = P_world.create_cartesian_topology_partition(shape)
        x = scatter(random_tensor(GLOBAL_SHAPES[len(shape)][0], seed=5), P_x)
        for axes in sorted({(0,), (len(shape) - 1,), tuple(range(len(shape)))}):  # leading, last, all at once
            assert_adjoint(lambda t: all_gather(t, P_x, axes_all_gather=axes), x, comm)
    # axes_keep is the complement of axes_all_gather
    P_x = P_world.create_cartesian_topology_partition(partition_shapes(comm.size)[1])
    x = scatter(random_tensor((7, 5), seed=1), P_x)
    assert torch.equal(AllGather(P_x, axes_keep=[0])(x), AllGather(P_x, axes_all_gather=[1])(x))


@sizes(2, 3)
def test_backward_is_reduce_scatter(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = AllGather(P_x, axes_all_gather=[1])
    x = scatter(random_tensor((3, 7), seed=2), P_x).requires_grad_()
    dy = random_tensor((3, 7), seed=100 + comm.rank)
    keep = dy.clone()
    layer(x).backward(dy)
    assert torch.equal(dy, keep)  # grad_output is not modified
    dy_sum = sum(random_tensor((3, 7), seed=100 + r) for r in range(comm.size))
    torch.testing.assert_close(x.grad, scatter(dy_sum, P_x), rtol=1e-14, atol=1e-14)


@sizes(3, 4)
def test_zero_volume_blocks_and_empty_tensors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([comm.size, 1])
    X = random_tensor((2, 3), seed=3)  # 2 rows over 3 or 4 workers: some hold (0, 3)
    x = scatter(X, P_x)
    assert torch.equal(all_gather(x, P_x, axes_all_gather=[0]), X)
    assert_adjoint(lambda t: all_gather(t, P_x, axes_all_gather=[0]), x, comm)
    empty = torch.zeros(0, 4, dtype=torch.float64)  # an empty global tensor
    assert all_gather(empty, P_x, axes_all_gather=[0]).shape == (0, 4)
    assert all_gather(empty, P_x, axes_all_gather=[1]).shape == (0, 4)


@sizes(3, 4)
def test_empty_blocks_off_the_leading_dimension(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([1, comm.size])
    X = random_tensor((2, comm.size - 1), seed=7)  # the last worker's block is (2, 0)
    x = scatter(X, P_x)
    for t, expected in ((x, X), (x.to(torch.bfloat16), X.to(torch.bfloat16)), (x > 0, X > 0)):  # placed as bytes
        assert torch.equal(all_gather(t, P_x, axes_all_gather=[1]), expected), (t.dtype, comm.rank)
    assert_adjoint(lambda t: all_gather(t, P_x, axes_all_gather=[1]), x, comm)


@sizes(3, 4)
def test_inactive_workers(P_world, comm):
    P_x = P_world.create_partition_inclusive([1, 2]).create_cartesian_topology_partition([2])
    layer = AllGather(P_x, axes_all_gather=[0])
    X = random_tensor((5,), seed=4)
    x = scatter(X, P_x)  # zero-volume outside P_x
    assert_adjoint(layer, x, comm)
    y = layer(x)
    if P_x.active:
        assert torch.equal(y, X)
    else:
        assert y.shape == (0,)
        with pytest.raises(ValueError, match=rf"all_gather: worker {comm.rank} is outside P_x and expected a "
                                             r"zero-volume tensor, got shape \(3,\)"):
            layer(torch.ones(3))


@sizes(2, 3)
def test_second_call_with_smaller_batch(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = AllGather(P_x, axes_all_gather=[1])
    for batch in (5, 3, 0):
        X = random_tensor((batch, 7), seed=batch)
        assert torch.equal(layer(scatter(X, P_x)), X)


@sizes(2, 3)
def test_dtypes_and_noncontiguous(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = AllGather(P_x, axes_all_gather=[1])
    X = torch.arange(4 * 7).reshape(4, 7) - 9
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8,
                  torch.complex128):
        y = layer(scatter(X.to(dtype), P_x))
        assert y.dtype == dtype and torch.equal(y, X.to(dtype))
    big = X + 2 ** 53 + 1  # int64 values a float64 cannot hold: moved exactly
    assert torch.equal(layer(scatter(big, P_x)), big)
    mask = X % 3 == 0
    assert torch.equal(layer(scatter(mask, P_x)), mask)  # bool moves exactly
    T = random_tensor((9, 4), seed=6)
    x = scatter(T, P_world.create_cartesian_topology_partition([comm.size, 1])).t()  # non-contiguous block
    assert not x.is_contiguous()
    assert torch.equal(AllGather(P_world.create_cartesian_topology_partition([1, comm.size]), [1])(x), T.t())


@sizes(2, 3)
def test_errors(P_world, comm):
    with pytest.raises(ValueError, match=r"AllGather: expected axes in \[-1, 1\) for a partition of shape "
                                         r"\(\d,\), got \[1\]"):
        AllGather(P_world, axes_all_gather=[1])
    with pytest.raises(ValueError, match="all_gather: expected exactly one of axes_all_gather and axes_keep"):
        all_gather(torch.ones(1), P_world, axes_all_gather=[0], axes_keep=[])
    with pytest.raises(TypeError, match="all_gather: expected a torch.Tensor, got list"):
        all_gather([1.0], P_world, axes_all_gather=[0])
    with pytest.raises(ValueError, match=r"all_gather: expected a tensor of 1 dimensions to match P_x of shape "
                                         r"\(\d,\), got shape \(2, 2\)"):
        all_gather(torch.ones(2, 2), P_world, axes_all_gather=[0])
    # Unbalanced blocks: every member sees the same headers and raises the same error.
    rows = [2, 3, 2] if comm.size == 3 else [3, 1]
    total = sum(rows)
    P_column = P_world.create_cartesian_topology_partition([comm.size, 1])
    for attempt in range(2):  # agreed headers are remembered, failed ones are not
        with pytest.raises(ValueError, match=rf"all_gather: expected the blocks of a balanced decomposition of "
                                             rf"a tensor of shape \({total}, 2\), got shape \({rows[0]}, 2\) on "
                                             rf"worker 0"):
            all_gather(torch.ones(rows[comm.rank], 2), P_column, [0])
    P_row = P_world.create_cartesian_topology_partition([1, comm.size])
    with pytest.raises(ValueError, match=r"all_gather: expected the blocks .* got shape \(3, 2\) on worker 1"):
        all_gather(torch.ones(3 if comm.rank == 1 else 2, 2), P_row, [1])  # a non-gathered extent differs
    with pytest.raises(ValueError, match="all_gather: expected one dtype on every member of the fibre, got "
                                         "torch.float64 on worker 0 and torch.float32 on worker 1"):
        all_gather(torch.ones(1, dtype=torch.float64 if comm.rank != 1 else torch.float32), P_world, [0])
    # The partition still works after the errors.
    assert torch.equal(all_gather(torch.full((1,), comm.rank), P_world, [0]), torch.arange(comm.size))
