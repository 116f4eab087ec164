"""Repartition: forward exact against scatter, adjoint tests, inactive workers, shapes, dtypes and errors.

The forward and adjoint tests run twice: as they are, and with every non-contiguous overlap moved in
place through an MPI datatype (``STRIDED_BYTES`` lowered to 1 byte; by default only large ones are).
"""

import gc

import pytest
import torch
from distdl import MPIPartition
from distdl.backends import mpi as transport
from distdl.functional import _messages as messages
from distdl.functional.repartition import repartition
from distdl.nn.repartition import Repartition
from distdl.partition import live_communicators
from distdl.testing import assert_adjoint, random_tensor, scatter
from distdl.utilities.torch import zero_volume_tensor
from helpers import sizes

# (P_x ranks, P_x shape), (P_y ranks, P_y shape), global shape; ranks=None means all of them.
CASES = {
    1: [((None, (1,)), (None, (1,)), (5,)),
        ((None, (1, 1)), (None, (1, 1)), (3, 4)),
        ((None, (1, 1, 1)), (None, (1, 1, 1)), (2, 3, 4))],
    2: [(([0], (1, 1)), (None, (1, 2)), (4, 7)),                  # scatter from one worker
        (([0], (1, 1)), (None, (2, 1)), (7, 3)),
        ((None, (2, 1)), ([1], (1, 1)), (7, 3)),                  # gather to one worker
        ((None, (2, 1)), (None, (1, 2)), (5, 7)),                 # re-layout
        ((None, (2, 1, 1)), (None, (1, 1, 2)), (3, 2, 5)),
        ((None, (2,)), ([1, 0], (2,)), (7,))],                    # the same grid, workers swapped
    3: [(([0], (1, 1)), (None, (3, 1)), (7, 4)),                  # scatter, 7 over 3
        (([0], (1, 1)), (None, (1, 3)), (4, 7)),
        ((None, (3, 1)), ([2], (1, 1)), (7, 2)),                  # gather
        ((None, (3, 1)), (None, (1, 3)), (7, 7)),
        ((None, (1, 1, 3)), (None, (3, 1, 1)), (7, 2, 7)),
        (([0, 1], (2, 1)), ([1, 2], (1, 2)), (5, 7))],
    4: [(([0], (1, 1)), (None, (2, 2)), (7, 5)),                  # scatter to 2x2
        ((None, (2, 2)), ([3], (1, 1)), (5, 7)),                  # gather from 2x2
        (([0, 1], (2, 1)), ([0, 1], (1, 2)), (5, 7)),             # re-layout; ranks 2, 3 in neither
        ((None, (2, 2)), (None, (4, 1)), (7, 6)),
        (([0, 1], (2,)), ([2, 3], (2,)), (7,)),                   # disjoint partitions
        (([0, 1], (2, 1)), ([2, 3], (1, 2)), (5, 7)),
        (([0, 1], (2, 1)), ([1, 2], (1, 2)), (7, 3)),             # partial overlap; rank 3 in neither
        ((None, (1, 2, 2)), (None, (2, 2, 1)), (3, 7, 5)),
        (([1], (1, 1, 1)), ([0, 2, 3], (3, 1, 1)), (7, 2, 3))],
}


def _partition(P_world, ranks, shape):
    P = P_world if ranks is None else P_world.create_partition_inclusive(ranks)
    return P.create_cartesian_topology_partition(shape)


def _cases(P_world, n):
    for (x_ranks, x_shape), (y_ranks, y_shape), global_shape in CASES[n]:
        yield _partition(P_world, x_ranks, x_shape), _partition(P_world, y_ranks, y_shape), global_shape


def _expected(y_global, P_y, x, preserve_batch=True):
    if P_y.active:
        return scatter(y_global, P_y)
    return zero_volume_tensor(x.shape[0] if preserve_batch else None, dtype=x.dtype)


@pytest.fixture(params=["packed", "in place"])
def strided(request, monkeypatch):
    if request.param == "in place":
        monkeypatch.setattr(transport, "STRIDED_BYTES", 1)
    return request.param


@sizes(1, 2, 3, 4)
def test_forward_matches_scatter(P_world, comm, strided):
    for P_x, P_y, global_shape in _cases(P_world, comm.size):
        x_global = random_tensor(global_shape, seed=sum(global_shape))
        x = scatter(x_global, P_x, preserve_batch=True)
        kept = x.clone()
        y = Repartition(P_x, P_y)(x)
        expected = _expected(x_global, P_y, x)
        assert y.shape == expected.shape and y.dtype == expected.dtype, (comm.rank, P_x, P_y)
        assert torch.equal(y, expected), (comm.rank, P_x, P_y)
        assert torch.equal(x, kept)  # the input is untouched
        if y.numel() and x.numel():
            assert y.data_ptr() != x.data_ptr()  # a copy, never an alias


@sizes(1, 2, 3, 4)
def test_adjoint(P_world, comm, strided):
    for P_x, P_y, global_shape in _cases(P_world, comm.size):
        x = scatter(random_tensor(global_shape, seed=100 + comm.rank), P_x, preserve_batch=True)  # rank-varying
        assert_adjoint(lambda t: repartition(t, P_x, P_y), x, comm, seed=comm.size)
        assert_adjoint(lambda t: repartition(t, P_x, P_y, preserve_batch=False), x, comm, adjoint_of_adjoint=False)


@sizes(4)
def test_inactive_workers_and_zero_volume(P_world, comm):
    P_x = _partition(P_world, [0, 1], (2, 1))
    P_y = _partition(P_world, [1, 2], (1, 2))  # rank 0 sends only, 1 both, 2 receives only, 3 neither
    x_global = random_tensor((6, 5), seed=3)
    for preserve_batch in (True, False):
        layer = Repartition(P_x, P_y, preserve_batch=preserve_batch)
        x = scatter(x_global, P_x, preserve_batch=True)  # (6, 0) placeholders outside P_x
        y = layer(x)
        expected = _expected(x_global, P_y, x, preserve_batch)
        assert y.shape == expected.shape and torch.equal(y, expected)
        y_plain = layer(torch.zeros(0)) if not P_x.active else layer(x)  # (0,) placeholders (no batch) work too
        assert y_plain.shape == ((0,) if comm.rank == 3 else expected.shape)
    # An empty global tensor moves everywhere and keeps its shape on every block.
    layer = Repartition(P_x, P_y)
    empty = scatter(torch.zeros(0, 5), P_x, preserve_batch=True)
    y = layer(empty)
    assert y.shape == ((0, 3 if comm.rank == 1 else 2) if P_y.active else (0, 0))
    # Integer data keeps its dtype on every worker (rank 3, in neither, too), outside the graph.
    ints_global = torch.arange(30).reshape(6, 5) + 2 ** 40
    ints = scatter(ints_global, P_x, preserve_batch=True)
    y = layer(ints)
    assert y.dtype == torch.int64 and not y.requires_grad, (comm.rank, y.dtype, y.requires_grad)
    assert y.shape == _expected(ints_global, P_y, ints).shape and torch.equal(y, _expected(ints_global, P_y, ints))
    if not P_x.active:
        with pytest.raises(ValueError, match=rf"repartition: worker {comm.rank} is outside P_x and expected a "
                                             r"zero-volume tensor, got shape \(2, 2\)"):
            layer(torch.ones(2, 2))


@sizes(2, 3, 4)
def test_new_shapes_each_call(P_world, comm):
    # Receive-only workers learn each call's shape; plans are reused; no communicator per call.
    P_x = _partition(P_world, [0], (1, 1))
    P_y = _partition(P_world, list(range(1, comm.size)), (comm.size - 1, 1))
    layer = Repartition(P_x, P_y)
    gc.collect()  # partitions left over from earlier tests free their communicators now, not mid-loop
    before = live_communicators()
    for batch in (8, 3, 8, 1, 0):
        x_global = random_tensor((batch, 4), seed=batch)
        x = scatter(x_global, P_x, preserve_batch=True).requires_grad_()
        y = layer(x)
        assert torch.equal(y, _expected(x_global, P_y, x)), (comm.rank, batch)
        dy = random_tensor(y.shape, seed=comm.rank)
        kept = dy.clone()
        y.backward(dy)
        assert torch.equal(dy, kept)  # grad_output is never modified
        dy_global = _gather_rows(dy, comm, P_y)  # collective: every rank calls it
        if P_x.active:
            assert torch.equal(x.grad, dy_global)
    assert live_communicators() == before


def _gather_rows(dy, comm, P_y):
    parts = comm.allgather(dy if P_y.active else None)
    return torch.cat([p for p in parts if p is not None])


@sizes(2, 3)
def test_dtypes_and_noncontiguous(P_world, comm):
    P_x = _partition(P_world, None, (comm.size, 1))
    P_y = _partition(P_world, None, (1, comm.size))
    layer = Repartition(P_x, P_y)
    base = torch.arange(7 * 5).reshape(7, 5)
    for dtype, x_global in [(torch.float32, base), (torch.float64, base / 3), (torch.int64, base + 2 ** 40),
                            (torch.int8, base - 17), (torch.bool, base % 3 == 0), (torch.float16, base / 7),
                            (torch.bfloat16, base / 7), (torch.complex128, base * (1 + 2j))]:
        x_global = x_global.to(dtype)
        y = layer(scatter(x_global, P_x))
        assert y.dtype == dtype
        assert torch.equal(y, scatter(x_global, P_y)), dtype
    # The last worker of P_x holds an empty block: data of the data's dtype, in grad mode too (it was taken for a
    # placeholder and sent as float32: the others' blocks then disagreed in dtype, ValueError)
    for dtype in (torch.int64, torch.bool, torch.float64):
        x_global = base[:comm.size - 1].to(dtype)
        y = layer(scatter(x_global, P_x))
        assert y.dtype == dtype and torch.equal(y, scatter(x_global, P_y)), dtype
    x_global = random_tensor((7, 5), seed=1)
    x = scatter(x_global, P_x)
    x_strided = x.t().contiguous().t()  # same values, column-major strides
    assert not x_strided.is_contiguous()
    assert torch.equal(layer(x_strided), scatter(x_global, P_y))


@pytest.mark.parametrize("headers_only", [False, True])
@sizes(2, 3, 4)
def test_backward_without_header_round(P_world, comm, monkeypatch, headers_only):
    # The backward knows the blocks from the forward: those that ride in a collective do, the
    # others move point to point, with no header round; on both sides of the inline limit.
    if headers_only:
        monkeypatch.setattr(messages, "INLINE_GROUP", 1)
    P_x = _partition(P_world, None, (comm.size, 1))
    P_y = _partition(P_world, None, (1, comm.size))
    limit = messages.INLINE_BYTES // 8  # float64 elements that ride
    for shape, dtype in [((comm.size * (limit // comm.size) + 1, comm.size), torch.float64),  # P_x's blocks
                         ((100, comm.size + 1), torch.float64),  # P_y's blocks on both sides of the limit
                         ((5, 7), torch.complex128), ((5, 7), torch.bfloat16)]:
        x_global, dy_global = (random_tensor(shape, seed=seed).to(dtype) for seed in shape)
        x = scatter(x_global, P_x).requires_grad_()
        y = repartition(x, P_x, P_y)
        assert torch.equal(y, scatter(x_global, P_y)), (shape, dtype, comm.rank)
        y.backward(scatter(dy_global, P_y))
        assert torch.equal(x.grad, scatter(dy_global, P_x)), (shape, dtype, comm.rank)
        if not dtype.is_complex:
            x.grad = None
            repartition(x, P_x, P_y).sum().backward()  # an expanded gradient, of stride 0
            assert torch.equal(x.grad, torch.ones_like(x)), (shape, dtype, comm.rank)


@sizes(1, 2)
def test_errors(P_world, comm):
    P_1d = _partition(P_world, None, (comm.size,))
    P_2d = _partition(P_world, None, (comm.size, 1))
    with pytest.raises(ValueError, match=r"Repartition: expected P_x and P_y of the same dimension, got shapes "
                                         rf"\({comm.size},\) and \({comm.size}, 1\)"):
        Repartition(P_1d, P_2d)
    with pytest.raises(ValueError, match="repartition: expected P_x and P_y of the same dimension"):
        repartition(torch.ones(3), P_1d, P_2d)
    other = comm.Dup()
    with pytest.raises(ValueError, match="repartition: expected partitions derived from the same root partition"):
        repartition(torch.ones(3), P_1d, MPIPartition(other))
    other.Free()
    with pytest.raises(ValueError, match=r"repartition: expected a tensor of 2 dimensions to match P_x of shape "
                                         rf"\({comm.size}, 1\), got shape \(3,\)"):
        repartition(torch.ones(3), P_2d, P_2d)
    with pytest.raises(TypeError, match="repartition: expected a torch.Tensor, got list"):
        repartition([1.0], P_1d, P_1d)
    with pytest.raises(TypeError, match="repartition: expected an MPIPartition for P_y, got str"):
        repartition(torch.ones(3), P_1d, "P_y")
    with pytest.raises(TypeError, match="Repartition: expected an MPIPartition for P_x, got NoneType"):
        Repartition(None, P_1d)
    with pytest.raises(TypeError, match="Repartition: expected a bool for preserve_batch, got 'False'"):
        Repartition(P_1d, P_1d, preserve_batch="False")
    # Workers disagreeing about the global tensor all get the same error instead of a hang.
    P_y = _partition(P_world, None, (1,)) if comm.size == 1 else _partition(P_world, [1, 0], (2,))
    bad = torch.ones(1 if comm.rank == 0 else 2)
    if comm.size == 2:
        with pytest.raises(ValueError, match=r"repartition: expected blocks of P_x forming the balanced "
                                             r"decomposition of one tensor, got shape \(1,\) at P_x index \(0,\), "
                                             r"where a global shape of \(3,\) needs \(2,\)"):
            repartition(bad, P_1d, P_y)
        mixed = torch.ones(2, dtype=torch.float32 if comm.rank == 0 else torch.float64)
        with pytest.raises(ValueError, match=r"repartition: expected one dtype on every worker of P_x, got "
                                             r"\['torch.float32', 'torch.float64'\]"):
            repartition(mixed, P_1d, P_y)
    with pytest.raises(TypeError, match="repartition: expected one of"):
        repartition(torch.ones(comm.size, dtype=torch.uint16), P_1d, P_y)
