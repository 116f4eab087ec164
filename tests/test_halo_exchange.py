"""HaloExchange: forward against slices of the global tensor, adjoint tests, edges, dtypes and errors."""

import importlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

from distdl.functional.halo_exchange import halo_exchange, halo_exchange_adjoint
from distdl.nn.halo_exchange import HaloExchange
from distdl.testing import assert_adjoint, random_tensor
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import partition_shapes, sizes

SENTINEL = -7  # what x holds in ghosts that nobody fills


def _layout(P, global_shape, needs, pad=True, extra=0):
    """Return this worker's (start, stop, halo, recv, send) when, along dimension d, every worker needs
    needs[d] = (left, right) slices of its neighbours; ``pad`` keeps ghosts at the global boundary
    too, and ``extra`` adds that many outer ghost slices nobody fills."""
    start = compute_start_index(P.shape, P.index, global_shape)
    stop = compute_stop_index(P.shape, P.index, global_shape)
    halo, recv, send = [], [], []
    for d, (left, right) in enumerate(needs):
        has_left, has_right = P.index[d] > 0, P.index[d] < P.shape[d] - 1
        recv.append([left * has_left, right * has_right])
        send.append([right * has_left, left * has_right])
        halo.append([(left if pad or has_left else 0) + extra, (right if pad or has_right else 0) + extra])
    return start, stop, np.array(halo), np.array(recv), np.array(send)


def _padded_input(x_global, start, stop, halo, fill=SENTINEL):
    """Return this worker's block of ``x_global`` padded with ghosts of ``halo`` holding ``fill``."""
    shape = [b - a + h.sum() for a, b, h in zip(start, stop, halo)]
    x = torch.full(shape, fill, dtype=x_global.dtype)
    x[tuple(slice(h[0], h[0] + b - a) for a, b, h in zip(start, stop, halo))] = \
        x_global[tuple(slice(a, b) for a, b in zip(start, stop))]
    return x


def _expected(x, x_global, start, stop, halo, recv):
    """Return ``x`` with global[start - recv_l : stop + recv_r] written over its filled region."""
    y = x.clone()
    y[tuple(slice(h[0] - r[0], h[0] + b - a + r[1]) for a, b, h, r in zip(start, stop, halo, recv))] = \
        x_global[tuple(slice(a - r[0], b + r[1]) for a, b, r in zip(start, stop, recv))]
    return y


def _assert_equal(actual, expected):
    """Assert exact equality (torch.testing.assert_close would import torch.distributed.tensor: seconds)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    assert torch.equal(actual, expected), f"{actual}\n!=\n{expected}"


def _global(shape, dtype=torch.float64):
    return (torch.arange(int(np.prod(shape))).reshape(shape) + 1).to(dtype)


@sizes(1, 2, 3, 4)
def test_forward_and_adjoint(P_world, comm):
    extra_shapes = {3: [(1, 3)]}.get(comm.size, [])
    for shape in partition_shapes(comm.size) + extra_shapes:
        P_x = P_world.create_cartesian_topology_partition(shape)
        global_shape = [3 * p + 1 for p in shape]  # uneven blocks of 3 or 4
        asymmetric = [[(2, 1), (1, 2), (0, 1)][d % 3] for d in range(len(shape))]
        # (needs, ghosts at the global boundary too, extra outer ghosts nobody fills)
        for needs, pad, extra in (([(1, 1)] * len(shape), True, 0), (asymmetric, False, 0), (asymmetric, True, 1)):
            start, stop, halo, recv, send = _layout(P_x, global_shape, needs, pad, extra)
            x_global = _global(global_shape)
            x = _padded_input(x_global, start, stop, halo)
            keep = x.clone()
            layer = HaloExchange(P_x, halo, recv, send)
            y = layer(x)
            _assert_equal(y, _expected(x, x_global, start, stop, halo, recv))
            assert torch.equal(x, keep) and y.data_ptr() != x.data_ptr()
            assert_adjoint(layer, random_tensor(x.shape, seed=comm.rank), comm)


@sizes(2, 3)
def test_untouched_ghosts_keep_their_values(P_world, comm):
    # 1-d, so no corners: every ghost nobody fills keeps this worker's own values.
    start, stop, halo, recv, send = _layout(P_world, [8], [(2, 1)], pad=True, extra=2)
    x_global = _global([8])
    x = _padded_input(x_global, start, stop, halo, fill=100 + comm.rank)
    y = halo_exchange(x, P_world, halo, recv, send)
    _assert_equal(y, _expected(x, x_global, start, stop, halo, recv))


@sizes(2, 3)
def test_messages_of_the_program_never_meet_distdls(P_world, comm):
    """The root partition works on its own duplicate of the program's communicator: a receive the program posted
    on it for any source and tag takes the program's own message, not a halo (which then went astray)."""
    got = np.zeros(1)
    pending = comm.Irecv(got, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    start, stop, halo, recv, send = _layout(P_world, [8], [(2, 1)], pad=True)
    x_global = _global([8])
    x = _padded_input(x_global, start, stop, halo)
    y = halo_exchange(x, P_world, halo, recv, send)
    comm.Send(np.array([1000.0 + comm.rank]), dest=(comm.rank + 1) % comm.size, tag=0x4841)
    pending.Wait()
    assert got[0] == 1000.0 + (comm.rank - 1) % comm.size
    _assert_equal(y, _expected(x, x_global, start, stop, halo, recv))


@sizes(3)
def test_empty_blocks_and_zero_volume(P_world, comm):
    # Global extent 2 over 3 workers: worker 2 holds nothing, and exchanges empty slabs with worker 1.
    halo = recv = send = [[[0, 1]], [[1, 0]], [[0, 0]]][comm.rank]
    x = torch.tensor([[5.0, SENTINEL], [SENTINEL, 6.0], []][comm.rank], dtype=torch.float64)
    y = halo_exchange(x, P_world, halo, recv, send)
    _assert_equal(y, torch.tensor([[5.0, 6.0], [5.0, 6.0], []][comm.rank], dtype=torch.float64))
    assert_adjoint(lambda t: halo_exchange(t, P_world, halo, recv, send), random_tensor(x.shape, comm.rank), comm)


@sizes(2, 4)
def test_new_batch_size_each_call(P_world, comm):
    shape = (1, 2) if comm.size == 2 else (1, 2, 2)
    P_x = P_world.create_cartesian_topology_partition(shape)
    layer = None
    for batch in (4, 2, 0, 3):
        global_shape = [batch] + [5] * (len(shape) - 1)
        start, stop, halo, recv, send = _layout(P_x, global_shape, [(0, 0)] + [(1, 2)] * (len(shape) - 1))
        layer = layer or HaloExchange(P_x, halo, recv, send)
        x_global = _global(global_shape)
        x = _padded_input(x_global, start, stop, halo)
        _assert_equal(layer(x), _expected(x, x_global, start, stop, halo, recv))
        assert_adjoint(layer, random_tensor(x.shape, seed=comm.rank), comm)


@sizes(2, 3)
def test_a_call_under_inference_mode_then_training(P_world, comm):
    """Slabs across the last dimension are packed through cached buffers: one made by a first call under
    torch.inference_mode (an evaluation pass) could not be written outside it, so every later call of that shape
    raised torch's "Inplace update to inference tensor outside InferenceMode"."""
    P_x = P_world.create_cartesian_topology_partition([1, comm.size])
    start, stop, halo, recv, send = _layout(P_x, [3, 7], [(0, 0), (1, 1)])
    x_global = _global([3, 7])
    x = _padded_input(x_global, start, stop, halo)
    with torch.inference_mode():
        evaluated = halo_exchange(x, P_x, halo, recv, send)
    x = x.clone().requires_grad_()
    y = halo_exchange(x, P_x, halo, recv, send)
    _assert_equal(y.detach(), evaluated)
    _assert_equal(y.detach(), _expected(x.detach(), x_global, start, stop, halo, recv))
    assert_adjoint(lambda t: halo_exchange(t, P_x, halo, recv, send), x.detach(), comm)


@sizes(3, 4)
def test_inactive_workers(P_world, comm):
    P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition([2])
    if P_x.active:
        start, stop, halo, recv, send = _layout(P_x, [5], [(1, 2)])
        x_global = _global([5])
        x = _padded_input(x_global, start, stop, halo)
    else:
        halo = recv = send = None
        x = torch.zeros(0, dtype=torch.float64)
    layer = HaloExchange(P_x, halo, recv, send)
    y = layer(x)
    if P_x.active:
        _assert_equal(y, _expected(x, x_global, start, stop, halo, recv))
    else:
        assert y.shape == (0,)
        with pytest.raises(ValueError, match=rf"halo_exchange: worker {comm.rank} is outside P_x and expected a "
                                             r"zero-volume tensor, got shape \(3,\)"):
            layer(torch.ones(3))
    assert_adjoint(layer, random_tensor(x.shape, seed=comm.rank), comm)


@sizes(2, 4)
def test_dtypes_and_noncontiguous(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((2,) if comm.size == 2 else (2, 2))
    global_shape = [7, 6][:P_x.dim]
    start, stop, halo, recv, send = _layout(P_x, global_shape, [(2, 1)] * P_x.dim)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.uint8, torch.bool,
                  torch.complex128):
        x_global = (_global(global_shape) % 100).to(dtype)
        x = _padded_input(x_global, start, stop, halo, fill=0).to(dtype)
        y = halo_exchange(x, P_x, halo, recv, send)
        assert y.dtype == dtype
        _assert_equal(y, _expected(x, x_global, start, stop, halo, recv))
    # Non-contiguous input (a transposed view) gives the same result.
    x = _padded_input(_global(global_shape), start, stop, halo)
    x_strided = x.t().contiguous().t()
    assert x_strided.is_contiguous() == (P_x.dim == 1)
    _assert_equal(halo_exchange(x_strided, P_x, halo, recv, send), halo_exchange(x, P_x, halo, recv, send))
    # The adjoint sums: integers exactly, half precision accumulated in float32.
    g = torch.randint(-8, 9, x.shape, generator=torch.Generator().manual_seed(comm.rank)).double()
    reference = halo_exchange_adjoint(g, P_x, halo, recv, send)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        result = halo_exchange_adjoint(g.to(dtype), P_x, halo, recv, send)
        assert result.dtype == dtype
        _assert_equal(result, reference.to(dtype))
    with pytest.raises(TypeError, match="halo_exchange_adjoint: expected a dtype that can be summed, got torch.bool"):
        halo_exchange_adjoint(torch.ones(x.shape, dtype=torch.bool), P_x, halo, recv, send)


@sizes(2)
def test_grad_output_not_modified(P_world, comm):
    start, stop, halo, recv, send = _layout(P_world, [6], [(1, 2)])
    layer = HaloExchange(P_world, halo, recv, send)
    x = random_tensor([stop[0] - start[0] + 3], seed=comm.rank).requires_grad_()
    dy = random_tensor(x.shape, seed=100 + comm.rank)
    keep = dy.clone()
    layer(x).backward(dy)
    assert torch.equal(dy, keep)
    _assert_equal(x.grad, halo_exchange_adjoint(dy, P_world, halo, recv, send))
    x.grad = None
    layer(x).sum().backward()  # a non-contiguous (expanded) grad_output
    _assert_equal(x.grad, halo_exchange_adjoint(torch.ones(x.shape, dtype=x.dtype), P_world, halo,
                                                             recv, send))


@sizes(1, 2)
def test_errors(P_world, comm):
    x = torch.zeros(6)
    ok = [[1, 1]]
    with pytest.raises(TypeError, match="halo_exchange: expected a torch.Tensor, got list"):
        halo_exchange([1.0], P_world, ok, ok, ok)
    with pytest.raises(TypeError, match="halo_exchange: expected an MPIPartition for P_x, got NoneType"):
        halo_exchange(x, None, ok, ok, ok)
    with pytest.raises(ValueError, match=r"halo_exchange: expected halo_shape of shape \(1, 2\), got shape \(2, 2\)"):
        halo_exchange(x, P_world, [[1, 1], [1, 1]], ok, ok)
    with pytest.raises(ValueError, match=r"HaloExchange: expected send_buffer_shape of shape \(1, 2\), got "
                                         r"shape \(2,\)"):
        HaloExchange(P_world, ok, ok, [1, 1])
    with pytest.raises(TypeError, match="halo_exchange: expected integers for recv_buffer_shape, got dtype float64"):
        halo_exchange(x, P_world, ok, [[1.0, 1.0]], ok)
    with pytest.raises(ValueError, match=r"halo_exchange: expected non-negative halo_shape, got \[\[-1, 1\]\]"):
        halo_exchange(x, P_world, [[-1, 1]], ok, ok)
    with pytest.raises(ValueError, match=r"halo_exchange: expected a tensor of 1 dimensions .* got shape \(2, 3\)"):
        halo_exchange(torch.zeros(2, 3), P_world, ok, ok, ok)
    with pytest.raises(ValueError, match=r"halo_exchange: expected recv_buffer_shape\[0\] <= halo_shape\[0\] = "
                                         rf"\[1, 1\] on worker {comm.rank}, got \[2, 0\]"):
        halo_exchange(x, P_world, ok, [[2, 0]], ok)
    with pytest.raises(ValueError, match=rf"halo_exchange: expected halo_shape\[0\] to fit in extent 6 of dimension 0 "
                                         rf"of x on worker {comm.rank}, got \[4, 3\]"):
        halo_exchange(x, P_world, [[4, 3]], ok, ok)
    P_2d = P_world.create_cartesian_topology_partition((1, comm.size))
    with pytest.raises(ValueError, match=rf"halo_exchange_adjoint: worker {comm.rank} holds 2 interior slices along "
                                         r"dimension 1; expected send_buffer_shape\[1\] of at most 2, got \[0, 3\]"):
        halo_exchange_adjoint(torch.zeros(3, 4), P_2d, [[0, 0], [1, 1]], [[0, 0], [1, 1]], [[0, 0], [0, 3]])


@sizes(2)
def test_neighbours_that_disagree_are_detected(P_world, comm):
    # Worker 0 sends 1 slice to the right, but worker 1 expects 2: worker 1 sees a short message.
    x = torch.arange(5.0)
    halo, recv, send = ([[0, 1]], [[0, 1]], [[0, 1]]) if comm.rank == 0 else ([[2, 0]], [[2, 0]], [[1, 0]])
    if comm.rank == 1:
        with pytest.raises(ValueError, match=r"halo_exchange: expected 2 torch.float32 elements \(8 bytes\) on "
                                             r"worker 1 from its left neighbour \(rank 0 of P_x\) along dimension 0, "
                                             r"got 4 bytes \(a slab of another size or dtype\)"):
            halo_exchange(x, P_world, halo, recv, send)
    else:
        halo_exchange(x, P_world, halo, recv, send)
    # Worker 0 sends 2 slices, but worker 1 expects 1: worker 1 sees a message too long for its ghosts.
    halo, recv, send = ([[0, 1]], [[0, 1]], [[0, 2]]) if comm.rank == 0 else ([[1, 0]], [[1, 0]], [[1, 0]])
    if comm.rank == 1:
        with pytest.raises(ValueError, match="halo_exchange: expected the neighbours of worker 1 along dimension 0 "
                                             "to send slabs of the sizes and dtype it receives"):
            halo_exchange(x, P_world, halo, recv, send)
    else:
        halo_exchange(x, P_world, halo, recv, send)
    # Worker 0 sends 1 float32 slice, worker 1 expects 1 float64 slice (and sends none): the message names bytes
    # and the dtype.
    halo, recv, send = ([[0, 0]], [[0, 0]], [[0, 1]]) if comm.rank == 0 else ([[1, 0]], [[1, 0]], [[0, 0]])
    if comm.rank == 1:
        with pytest.raises(ValueError, match=r"expected 1 torch.float64 elements \(8 bytes\) on worker 1 from its "
                                             r"left neighbour .* got 4 bytes \(a slab of another size or dtype\)"):
            halo_exchange(x.double(), P_world, halo, recv, send)
    else:
        halo_exchange(x, P_world, halo, recv, send)


@sizes(4)
def test_a_dimension_that_fails_does_not_desynchronise_the_next(P_world, comm):
    """Worker 2 sends its upper neighbour 2 slices where 1 is expected: worker 0 raises at dimension 0 and still
    exchanges dimension 1, so the next exchange is right (its messages used to pair with the stale ones)."""
    P = P_world.create_cartesian_topology_partition((2, 2))
    ones = [[1, 1], [1, 1]]
    send = [[2, 1], [1, 1]] if comm.rank == 2 else ones
    if comm.rank == 0:
        with pytest.raises(ValueError, match=r"halo_exchange: expected the neighbours of worker 0 along dimension 0"):
            halo_exchange(torch.zeros(6, 6), P, ones, ones, send)
    else:
        halo_exchange(torch.zeros(6, 6), P, ones, ones, send)
    x = torch.arange(36.0).reshape(6, 6) + 100 * comm.rank
    y = halo_exchange(x, P, ones, ones, ones)
    neighbours = comm.allgather(x)
    i, j = P.index  # every worker has one neighbour along each dimension (below or above, right or left)
    vertical, horizontal = neighbours[P.rank + 2 - 4 * i], neighbours[P.rank + 1 - 2 * j]
    rows = (y[-1, 1:-1], vertical[1, 1:-1]) if i == 0 else (y[0, 1:-1], vertical[-2, 1:-1])
    columns = (y[1:-1, -1], horizontal[1:-1, 1]) if j == 0 else (y[1:-1, 0], horizontal[1:-1, -2])
    torch.testing.assert_close(*rows)
    torch.testing.assert_close(*columns)


@sizes(3)
def test_pack_buffers_live_until_their_sends_complete(P_world, comm, monkeypatch):
    """Column slabs are packed through cached buffers; a cache cleared in mid-exchange (here on every new
    buffer) must not free a pack whose send is still in flight (its memory went to the next buffer)."""
    monkeypatch.setattr(importlib.import_module("distdl.functional.halo_exchange"), "_MAX_SCRATCH", 1)
    P = P_world.create_cartesian_topology_partition((1, 3))
    i = P.index[1]
    widths = [[0, 0], [2 if i > 0 else 0, 2 if i < 2 else 0]]
    n = 4 + sum(widths[1])
    for rows in (12288, 3):  # 96 KiB slabs (sent by rendezvous, after the next buffer is made), then small ones
        x = torch.full((rows, n), float(comm.rank))
        y = halo_exchange(x, P, widths, widths, widths)
        if i > 0:
            assert torch.equal(y[:, :2], torch.full((rows, 2), float(comm.rank - 1)))
        if i < 2:
            assert torch.equal(y[:, n - 2:], torch.full((rows, 2), float(comm.rank + 1)))


@sizes(2, 3)
@pytest.mark.parametrize("op", [halo_exchange, halo_exchange_adjoint])
def test_check_mode_names_neighbours_built_with_other_widths(P_world, comm, op):
    """Worker 0 sends its right neighbour 1 slice where that one receives 2: outside check mode the receiver alone
    raised; check mode raises on every worker, naming it, and the next call pairs up."""
    from distdl.checks import CollectiveMismatchError, checking
    n, r = comm.size, comm.rank
    P_x = P_world.create_cartesian_topology_partition([n])
    halo = [[2 if r > 0 else 0, 2 if r < n - 1 else 0]]
    x = random_tensor((6,), seed=r)
    wrong = [[halo[0][0], 1 if r == 0 and n > 1 else halo[0][1]]]
    outgoing = "recv" if op is halo_exchange_adjoint else "send"  # the widths whose slabs go out
    with checking():
        with pytest.raises(CollectiveMismatchError, match=r"ranks disagree on slabs from the neighbours: .*rank 1 "
                                                          r"has 2 elements expected from the left neighbour"):
            op(x, P_x, halo, wrong if outgoing == "recv" else halo, wrong if outgoing == "send" else halo)
        checked = op(x, P_x, halo, halo, halo)
    torch.testing.assert_close(checked, op(x, P_x, halo, halo, halo))
