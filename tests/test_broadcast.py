"""Broadcast: forward against a local reference, adjoint tests, zero-volume, inactive workers, dtypes and errors."""

import gc

import numpy as np
import pytest
import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.checks import checking
from distdl.functional._messages import INLINE_BYTES
from distdl.functional.broadcast import broadcast
from distdl.nn.broadcast import Broadcast
from distdl.partition import live_communicators
from distdl.testing import assert_adjoint, random_tensor
from helpers import sizes


def cases(P_world):
    """(name, P_x, P_y, transpose_src, transpose_dest): disjoint, overlapping, nested, transposed, 1-3-D."""
    n, W = P_world.size, P_world
    grid = W.create_cartesian_topology_partition
    some = lambda ranks, shape=None: W.create_partition_inclusive(ranks).create_cartesian_topology_partition(
        shape or (len(ranks),))
    out = [("one to all", some([0]), W, False, False),
           ("one to all, 3-D", some([n - 1], (1, 1, 1)), grid((1, n, 1) if n < 4 else (1, 2, 2)), False, False)]
    if n == 1:
        out += [("itself", W, W, False, False)]
    if n == 2:
        out += [("disjoint", some([0]), some([1]), False, False),
                ("swap", W, some([1, 0]), False, False)]
    if n == 3:
        out += [("cycle", W, some([1, 2, 0]), False, False),
                ("transposed cycle", grid((3, 1)), some([2, 0, 1], (1, 3)), True, False),
                ("disjoint, one idle", some([0]), some([2]), False, False)]
    if n == 4:
        out += [("[1, 2] onto [2, 2]", some([0, 1], (1, 2)), grid((2, 2)), False, False),
                ("disjoint", some([2, 3]), some([0, 1]), False, False),
                ("linear layer's P_y onto P_w", some([0, 1], (1, 2)), grid((2, 2)), True, False),
                ("(2,) onto (1, 2, 2)", some([2, 3]), grid((1, 2, 2)), False, False),
                ("(1, 2, 1) onto reversed (1, 2, 2)", some([1, 3], (1, 2, 1)), grid((1, 2, 2)), False, True),
                ("transpose in place", grid((2, 2)), grid((2, 2)), True, False),
                ("one idle", some([3]), some([1, 2]), False, False)]
    return out


def source_index(src_shape, dest_index, transpose_src, transpose_dest):
    """Return the index of the source worker that broadcasts to ``dest_index`` (NumPy rules on the grids)."""
    frame = dest_index[::-1] if transpose_dest else dest_index
    shape = src_shape[::-1] if transpose_src else src_shape
    offset = len(frame) - len(shape)
    index = tuple(0 if extent == 1 else frame[offset + a] for a, extent in enumerate(shape))
    return index[::-1] if transpose_src else index


def block(P, index, batch, dtype=torch.float64):
    """The block of the worker of ``P`` at ``index``: integer-valued, its width varies with the worker."""
    r = int(np.ravel_multi_index(index, P.shape))
    return (random_tensor((batch, 2 + r), seed=r) * 8).round().to(dtype)


@sizes(1, 2, 3, 4)
def test_forward_matches_reference(P_world, comm):
    for name, P_x, P_y, ts, td in cases(P_world):
        layer = Broadcast(P_x, P_y, transpose_src=ts, transpose_dest=td)
        for batch in (3, 1):  # a smaller last batch: receivers learn the new shape
            x = block(P_x, P_x.index, batch) if P_x.active else torch.zeros(batch, 0, dtype=torch.float64)
            y = layer(x)
            if P_y.active:
                expected = block(P_x, source_index(P_x.shape, P_y.index, ts, td), batch)
                assert torch.equal(y, expected), (name, comm.rank)
                assert y.data_ptr() != x.data_ptr()  # a copy, never an alias
            else:
                assert y.shape == (batch, 0), (name, comm.rank)


@sizes(1, 2, 3, 4)
def test_adjoint(P_world, comm):
    for name, P_x, P_y, ts, td in cases(P_world):
        x = random_tensor((2, 3), seed=comm.rank) if P_x.active else torch.zeros(2, 0, dtype=torch.float64)
        assert_adjoint(lambda t: broadcast(t, P_x, P_y, ts, td), x, comm, seed=comm.size)
    # Zero-volume outputs without a batch extent, (0,), against (b, 0) placeholders on the inputs.
    assert_adjoint(lambda t: broadcast(t, P_x, P_y, ts, td, preserve_batch=False), x, comm)


def plain_and_recorded_grads(op, x, comm):
    """Return the gradient of ``op`` at ``x`` from a plain backward and from a recorded (create_graph) one."""
    grads = []
    for create_graph in (False, True):  # a plain backward skips header rounds the recorded adjoint runs
        t = x.detach().clone().requires_grad_()
        y = op(t)
        dy = random_tensor(y.shape, seed=10 + comm.rank).to(y.dtype)
        grads.append(torch.autograd.grad(y, t, dy, create_graph=create_graph)[0].detach())
    return grads


# Blocks that ride inline in the forward's header round and blocks above its 1 KiB; float16/bfloat16 sum in float32.
BACKWARD_BLOCKS = [((2, 3), torch.float64), ((3, 100), torch.float64), ((3, 300), torch.float16),
                   ((2, 300), torch.bfloat16)]


@sizes(1, 2, 3, 4)
def test_plain_backward_matches_recorded_adjoint(P_world, comm):
    for name, P_x, P_y, ts, td in cases(P_world):  # among them workers in two groups and feeding themselves
        for (shape, dtype), preserve_batch in zip(BACKWARD_BLOCKS, (True, False, True, False)):
            x = random_tensor(shape, seed=comm.rank).to(dtype) if P_x.active else torch.zeros(shape[0], 0, dtype=dtype)
            op = lambda t: broadcast(t, P_x, P_y, ts, td, preserve_batch)  # noqa: E731
            plain, recorded = plain_and_recorded_grads(op, x, comm)
            assert plain.shape == x.shape, (name, shape, dtype, comm.rank)
            if x.nbytes <= INLINE_BYTES:  # the recorded adjoint sums the blocks that rode in its header round in
                # rank order, the plain one with MPI's reduction: from 3 workers up the rounding may differ
                torch.testing.assert_close(plain, recorded, rtol=1e-13, atol=1e-13, msg=str((name, comm.rank)))
            else:
                assert torch.equal(plain, recorded), (name, shape, dtype, comm.rank)
        x = random_tensor((3, 100), seed=comm.rank) if P_x.active else torch.zeros(3, 0, dtype=torch.float64)
        assert_adjoint(lambda t: broadcast(t, P_x, P_y, ts, td), x, comm, adjoint_of_adjoint=False)


@sizes(3, 4)
def test_inactive_workers_and_zero_volume(P_world, comm):
    P_x = P_world.create_partition_inclusive([0])
    P_y = P_world.create_partition_inclusive([1, 2])
    layer = Broadcast(P_x, P_y)
    for sent, placeholder in [((0, 5), (0,)), ((4, 0), (4, 0))]:  # empty global tensors move like any other
        x = torch.zeros(sent if P_x.active else placeholder)
        y = layer(x)
        if P_y.active:
            assert y.shape == sent
        elif P_x.active:
            assert y.shape == (sent[0], 0)
        else:
            assert y.shape == placeholder  # (b, 0) keeps its batch; (0,) carries none
    for placeholder in ((0,), (4, 0)):  # in neither partition: (4, 0) came back as is
        y = Broadcast(P_x, P_y, preserve_batch=False)(torch.ones(4, 3) if P_x.active else torch.zeros(placeholder))
        assert y.shape == ((4, 3) if P_y.active else (0,))
    if not P_x.active:
        with pytest.raises(ValueError, match=rf"broadcast: worker {comm.rank} is outside P_x and expected a "
                                             r"zero-volume tensor, got shape \(3,\)"):
            layer(torch.ones(3))


@sizes(2, 3)
def test_dtypes_and_noncontiguous(P_world, comm):
    P_x = P_world.create_partition_inclusive([comm.size - 1])
    layer = Broadcast(P_x, P_world)
    base = torch.arange(12).reshape(3, 4)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                  torch.int8, torch.uint8, torch.bool, torch.complex128):
        x = base.to(dtype) if P_x.active else torch.zeros(0, dtype=torch.float32)
        y = layer(x)
        assert y.dtype == dtype and torch.equal(y, base.to(dtype)), dtype
    big = torch.tensor([2 ** 62 + 1, -2 ** 53 - 1], dtype=torch.int64)
    assert torch.equal(layer(big if P_x.active else torch.zeros(0, dtype=torch.int64)), big)  # bits exactly
    for dtype in (torch.int64, torch.bool):  # an empty block of data keeps its dtype (it went as float32)
        y = layer(torch.zeros(2, 0, dtype=dtype) if P_x.active else torch.zeros(0))
        assert y.dtype == dtype and y.shape == (2, 0), (dtype, y.dtype)
    t = random_tensor((4, 6), seed=3).t()  # non-contiguous
    assert torch.equal(layer(t if P_x.active else torch.zeros(0, dtype=torch.float64)), t)


@sizes(2, 4)
@pytest.mark.parametrize("checked", [False, True])  # check mode builds what it needs up front
def test_backward_is_sum_and_plan_built_once(P_world, comm, checked):
    with checking(checked):
        P_x = P_world.create_partition_inclusive([0])
        layer = Broadcast(P_x, P_world)
        gc.collect()  # earlier tests' partitions, freed now rather than while counting
        count = live_communicators()
        for batch in (3, 2):
            x = (torch.ones(batch, 2) if P_x.active else torch.zeros(batch, 0)).double().requires_grad_()
            dy = random_tensor((batch, 2), seed=100 + comm.rank)
            keep = dy.clone()
            layer(x).backward(dy)
            assert torch.equal(dy, keep)  # grad_output is never modified in place
            if P_x.active:
                expected = sum(random_tensor((batch, 2), seed=100 + r) for r in range(comm.size))
                torch.testing.assert_close(x.grad, expected, rtol=1e-14, atol=1e-14)
            else:
                assert x.grad.shape == (batch, 0)
        assert live_communicators() == count  # calls, backward included, build no communicators


@sizes(1, 2)
def test_errors(P_world, comm):
    x = torch.ones(2)
    if comm.size == 2:
        with pytest.raises(ValueError, match=r"Broadcast: expected the shape of P_x to broadcast to the shape of "
                                             r"P_y, got \(2,\) and \(1,\)"):
            Broadcast(P_world, P_world.create_partition_inclusive([0]))
        with pytest.raises(ValueError, match=r"broadcast: expected the shape of P_x \(reversed\) to broadcast to "
                                             r"the shape of P_y, got \(1, 2\) and \(1, 2\)"):
            P = P_world.create_cartesian_topology_partition((1, 2))
            broadcast(x, P, P, transpose_src=True)
    with pytest.raises(ValueError, match=r"broadcast: expected the shape of P_x to broadcast to the shape of P_y, "
                                         rf"got \(1, {comm.size}\) and \({comm.size},\)"):
        broadcast(x, P_world.create_cartesian_topology_partition((1, comm.size)), P_world)
    with pytest.raises(ValueError, match="broadcast: expected P_x and P_y derived from the same root partition"):
        broadcast(x, P_world, MPIPartition(MPI.COMM_SELF))
    with pytest.raises(TypeError, match="broadcast: expected a torch.Tensor, got list"):
        broadcast([1.0], P_world, P_world)
    with pytest.raises(TypeError, match="Broadcast: expected an MPIPartition for P_y, got str"):
        Broadcast(P_world, "P_y")
    with pytest.raises(TypeError, match="broadcast: expected a bool for transpose_dest, got 'yes'"):
        broadcast(x, P_world, P_world, transpose_dest="yes")
