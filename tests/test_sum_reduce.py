"""SumReduce: forward against a local reference, adjoint tests, zero-volume, inactive workers, dtypes and errors."""

import gc
import re

import numpy as np
import pytest
import torch

from distdl.checks import checking
from distdl.functional.sum_reduce import sum_reduce
from distdl.nn.broadcast import Broadcast
from distdl.nn.sum_reduce import SumReduce
from distdl.partition import live_communicators
from distdl.testing import assert_adjoint, random_tensor
from helpers import sizes
from test_broadcast import BACKWARD_BLOCKS, plain_and_recorded_grads, source_index
from test_broadcast import cases as broadcast_cases


def cases(P_world):
    """(name, P_x, P_y, transpose_src, transpose_dest): the adjoint of every Broadcast case.

    Among them the linear layer's ``SumReduce(P_w, P_y, transpose_dest=True)``, P_w (2, 2) and P_y (1, 2).
    """
    return [(name, P_y, P_x, td, ts) for name, P_x, P_y, ts, td in broadcast_cases(P_world)]


def destination(P_x, P_y, ts, td, index):
    """Return the index of the worker of P_y that the block of P_x at ``index`` is summed onto."""
    return source_index(P_y.shape, index, td, ts)


def block(P_x, P_y, ts, td, index, batch):
    """The block at ``index`` of P_x: integer-valued; its width is that of its destination's group."""
    j = int(np.ravel_multi_index(destination(P_x, P_y, ts, td, index), P_y.shape))
    seed = int(np.ravel_multi_index(index, P_x.shape))
    return (random_tensor((batch, 2 + j), seed=seed) * 8).round()


@sizes(1, 2, 3, 4)
def test_forward_matches_reference(P_world, comm):
    for name, P_x, P_y, ts, td in cases(P_world):
        layer = SumReduce(P_x, P_y, transpose_src=ts, transpose_dest=td)
        for batch in (3, 1):  # a smaller last batch: receivers learn the new shape
            x = block(P_x, P_y, ts, td, P_x.index, batch) if P_x.active else torch.zeros(batch, 0).double()
            y = layer(x)
            if P_y.active:
                group = [i for i in np.ndindex(*P_x.shape) if destination(P_x, P_y, ts, td, i) == P_y.index]
                expected = sum(block(P_x, P_y, ts, td, i, batch) for i in group)
                assert torch.equal(y, expected), (name, comm.rank)
                assert y.data_ptr() != x.data_ptr()  # a copy, never an alias
            else:
                assert y.shape == (batch, 0), (name, comm.rank)


@sizes(1, 2, 3, 4)
def test_adjoint(P_world, comm):
    for name, P_x, P_y, ts, td in cases(P_world):
        x = random_tensor((2, 3), seed=comm.rank) if P_x.active else torch.zeros(2, 0, dtype=torch.float64)
        assert_adjoint(lambda t: sum_reduce(t, P_x, P_y, ts, td), x, comm, seed=comm.size)
    assert_adjoint(lambda t: sum_reduce(t, P_x, P_y, ts, td, preserve_batch=False), x, comm)


@sizes(1, 2, 3, 4)
def test_plain_backward_matches_recorded_adjoint(P_world, comm):
    for name, P_x, P_y, ts, td in cases(P_world):  # among them workers in two groups and receivers adding zeros
        for (shape, dtype), preserve_batch in zip(BACKWARD_BLOCKS, (True, False, True, False)):
            x = random_tensor(shape, seed=comm.rank).to(dtype) if P_x.active else torch.zeros(shape[0], 0, dtype=dtype)
            op = lambda t: sum_reduce(t, P_x, P_y, ts, td, preserve_batch)  # noqa: E731
            plain, recorded = plain_and_recorded_grads(op, x, comm)
            assert plain.shape == x.shape and torch.equal(plain, recorded), (name, shape, dtype, comm.rank)
        x = random_tensor((3, 100), seed=comm.rank) if P_x.active else torch.zeros(3, 0, dtype=torch.float64)
        assert_adjoint(lambda t: sum_reduce(t, P_x, P_y, ts, td), x, comm, adjoint_of_adjoint=False)


@sizes(3, 4)
def test_inactive_workers_and_zero_volume(P_world, comm):
    P_x = P_world.create_partition_inclusive([0, 1])
    P_y = P_world.create_partition_inclusive([2])
    layer = SumReduce(P_x, P_y)
    for sent, placeholder in [((0, 5), (0,)), ((4, 0), (4, 0))]:  # empty global tensors sum like any other
        y = layer(torch.zeros(sent if P_x.active else placeholder))
        assert y.shape == (sent if P_y.active else (sent[0], 0) if P_x.active else placeholder)
    for placeholder in ((0,), (4, 0)):  # in neither partition: (4, 0) came back as is
        x = torch.full((2, 3), 1.0 + comm.rank) if P_x.active else torch.zeros(placeholder)
        y = SumReduce(P_x, P_y, preserve_batch=False)(x)
        if P_y.active:
            assert torch.equal(y, torch.full((2, 3), 3.0))
        else:
            assert y.shape == (0,)
    if not P_x.active:
        with pytest.raises(ValueError, match=rf"sum_reduce: worker {comm.rank} is outside P_x and expected a "
                                             r"zero-volume tensor, got shape \(3,\)"):
            layer(torch.ones(3))


@sizes(3)
def test_dtypes_and_noncontiguous(P_world, comm):
    P_y = P_world.create_partition_inclusive([0])
    layer = SumReduce(P_world, P_y)
    base = torch.arange(12).reshape(3, 4) + comm.rank
    expected = 3 * torch.arange(12).reshape(3, 4) + 3
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8, torch.complex128):
        y = layer(base.to(dtype))
        assert (y.dtype == dtype and torch.equal(y, expected.to(dtype))) or not P_y.active, dtype
    y = layer(torch.zeros(0, 3, dtype=torch.int64))  # empty blocks of data keep their dtype (they went as float32)
    assert not P_y.active or (y.dtype == torch.int64 and y.shape == (0, 3)), y.dtype
    big = torch.tensor([2 ** 61 + comm.rank, -2 ** 53 - 1], dtype=torch.int64)
    y = layer(big)  # 64-bit integers exactly
    assert not P_y.active or y.tolist() == [3 * 2 ** 61 + 3, 3 * (-2 ** 53 - 1)]
    # Half precision is summed in float32: 2048 + 1 + 1 (256 + 1 + 1 in bfloat16) is exact only there.
    for dtype, big_value in ((torch.float16, 2048.0), (torch.bfloat16, 256.0)):
        y = layer(torch.tensor([big_value if comm.rank == 0 else 1.0], dtype=dtype))
        assert not P_y.active or (y.dtype == dtype and y.item() == big_value + 2)
    t = random_tensor((4, 6), seed=comm.rank).t()  # non-contiguous
    y = layer(t)
    assert not P_y.active or torch.allclose(y, sum(random_tensor((4, 6), seed=r) for r in range(3)).t())
    with pytest.raises(TypeError, match="sum_reduce: expected a dtype that can be summed, got torch.bool"):
        layer(torch.ones(2, dtype=torch.bool))


@sizes(2, 4)
@pytest.mark.parametrize("checked", [False, True])  # check mode builds what it needs up front
def test_backward_is_broadcast_and_plan_shared(P_world, comm, checked):
    with checking(checked):
        P_y = P_world.create_partition_inclusive([comm.size - 1])
        layer = SumReduce(P_world, P_y)
        gc.collect()  # earlier tests' partitions, freed now rather than while counting
        count = live_communicators()
        Broadcast(P_y, P_world)  # the adjoint layer uses the same communicators
        for batch in (3, 2):
            x = torch.ones(batch, 2, dtype=torch.float64, requires_grad=True)
            dy = random_tensor((batch, 2), seed=batch) if P_y.active else torch.zeros(batch, 0, dtype=torch.float64)
            keep = dy.clone()
            layer(x).backward(dy)
            assert torch.equal(dy, keep)  # grad_output is never modified in place
            assert torch.equal(x.grad, random_tensor((batch, 2), seed=batch))
        assert live_communicators() == count  # calls, backward included, build no communicators


@sizes(2, 3)
def test_sources_that_disagree_raise_on_every_member(P_world, comm):
    layer = SumReduce(P_world, P_world.create_partition_inclusive([0]))
    expected = "sum_reduce: expected the blocks summed onto one worker to agree in dtype and shape, got "
    shapes = "; ".join(f"shape (2, {1 + r}) of torch.float32 on root rank {r}" for r in range(comm.size))
    with pytest.raises(ValueError, match=re.escape(expected + shapes) + "$"):
        layer(torch.ones(2, 1 + comm.rank))
    others = ", ".join(map(str, range(1, comm.size)))
    dtypes = ("shape (2,) of torch.float32 on root rank 0; shape (2,) of torch.float64 on root "
              f"rank{'s' * (comm.size > 2)} ")
    with pytest.raises(ValueError, match=re.escape(expected + dtypes + others) + "$"):
        layer(torch.ones(2, dtype=torch.float64 if comm.rank else torch.float32))
    y = layer(torch.ones(2))  # still usable
    assert y.tolist() == [comm.size] * 2 if comm.rank == 0 else y.shape == (2, 0)


@sizes(4)
def test_a_group_that_disagrees_leaves_the_other_group_done(P_world, comm):
    """Workers 0 and 1 are in two groups each (root 0 sums 1 and 2; root 1 sums 3 and 0). Blocks of the first group
    disagree: its members raise, worker 3 (only in the agreeing group) returns its sum, and the next call is right
    (worker 3 used to wait for a data round that its peers had abandoned, and every later call hung)."""
    P_y = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition((2, 1))
    P_x = P_world.create_partition_inclusive([1, 2, 3, 0]).create_cartesian_topology_partition((2, 2))
    rows = 101 if comm.rank == 2 else 100  # 12 KB blocks: beyond the header round's payload

    def block(scale, bad):
        return torch.full((rows if bad else 100, 30), float(scale * (comm.rank + 1)))
    if comm.rank == 3:
        assert sum_reduce(block(1, True), P_x, P_y).numel() == 0
    else:
        with pytest.raises(ValueError, match="sum_reduce: expected the blocks summed onto one worker to agree"):
            sum_reduce(block(1, True), P_x, P_y)
    y = sum_reduce(block(10, False), P_x, P_y)
    expected = {0: 10 * (2 + 3), 1: 10 * (4 + 1)}.get(comm.rank)
    assert torch.equal(y, torch.full((100, 30), float(expected))) if expected else y.numel() == 0


@sizes(1, 2)
def test_errors(P_world, comm):
    x = torch.ones(2)
    if comm.size == 2:
        with pytest.raises(ValueError, match=r"SumReduce: expected the shape of P_y to broadcast to the shape of "
                                             r"P_x, got \(2,\) and \(1,\)"):
            SumReduce(P_world.create_partition_inclusive([0]), P_world)
        with pytest.raises(ValueError, match=r"sum_reduce: expected the shape of P_y \(reversed\) to broadcast to "
                                             r"the shape of P_x, got \(2, 1\) and \(2, 1\)"):
            P = P_world.create_cartesian_topology_partition((2, 1))
            sum_reduce(x, P, P, transpose_dest=True)
    with pytest.raises(TypeError, match="sum_reduce: expected a torch.Tensor, got list"):
        sum_reduce([1.0], P_world, P_world)
    with pytest.raises(TypeError, match="SumReduce: expected an MPIPartition for P_x, got NoneType"):
        SumReduce(None, P_world)
    with pytest.raises(TypeError, match="sum_reduce: expected a bool for preserve_batch, got None"):
        sum_reduce(x, P_world, P_world, preserve_batch=None)
