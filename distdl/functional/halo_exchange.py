"""HaloExchange: fill each worker's ghost regions from its neighbours' interiors.

Forward, dimension by dimension (d = 0, 1, ...): ``y = x`` except ``y[ghost_d] = neighbour's y[send_d]``.
Adjoint, dimensions in reverse: ``x' = y'`` except ``x'[send_d] += neighbour's y'[ghost_d]``, ``x'[ghost_d] = 0``.

Along dimension ``d`` (extent ``n``, halo ``[h_l, h_r]``, recv ``[r_l, r_r]``, send ``[s_l, s_r]``) every
slab spans the full current extent of the other dimensions, so corners arrive through the edges:

===========  ==============================  ====================================
slab         indices along d                 forward
===========  ==============================  ====================================
left send    ``[h_l, h_l + s_l)``            sent to the left neighbour
right send   ``[n - h_r - s_r, n - h_r)``    sent to the right neighbour
left ghost   ``[h_l - r_l, h_l)``            overwritten from the left neighbour
right ghost  ``[n - h_r, n - h_r + r_r)``    overwritten from the right neighbour
===========  ==============================  ====================================

============================  ==========================================================
worker                        does
============================  ==========================================================
in P_x, with neighbours       exchanges slabs with each neighbour, one dimension at a time
in P_x, at a grid edge        nothing on the open side; those ghosts keep ``x``'s values
                              (corners excepted: other dimensions' slabs span them)
in P_x of size 1              returns a copy of ``x`` (adjoint: a copy of the gradient)
outside P_x                   passes and gets a zero-volume tensor
============================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import cuda
from distdl.backends import mpi as transport
from distdl.functional._common import (begin_backward, check_dim, check_idle_input, check_partition, check_tensor,
                                       in_graph, save_anchor)
from distdl.checks import announce, check_mode, verify
from distdl.partition import MPIPartition
from distdl.utilities.caches import keep

__all__ = ["halo_exchange", "halo_exchange_adjoint"]

Widths = Sequence[Sequence[int]] | np.ndarray | torch.Tensor  # (P_x.dim, 2): [left, right] per dimension

_TAG = 0x4841  # base tag; a message to the left neighbour along dimension d has tag _TAG + 2d, to the right + 1
_CHECK_TAG = 0x4800  # the same for check mode's slab sizes (dimensions < 32 stay below _TAG)
_MAX_SCRATCH = 64  # pack/unpack buffers cached per partition (per slab shape, dtype and device)


@cuda.host_staged(whole=False)  # stages the slabs that travel (_exchange)
def halo_exchange(x: torch.Tensor, P_x: MPIPartition, halo_shape: Widths | None, recv_buffer_shape: Widths | None,
                  send_buffer_shape: Widths | None) -> torch.Tensor:
    """Return a copy of ``x`` whose ghost regions are filled from the neighbours' interiors.

    Args:
        x: this worker's block padded with ghosts of ``halo_shape``.
        P_x: the Cartesian partition of ``x`` (``x.dim() == P_x.dim``).
        halo_shape, recv_buffer_shape, send_buffer_shape: integer arrays of shape ``(P_x.dim, 2)``:
            per dimension ``[left, right]`` ghost widths in ``x``, ghost widths filled from each
            neighbour (``<= halo_shape``), interior widths sent to each neighbour. Ignored outside ``P_x``.
    Returns:
        A new tensor of ``x``'s shape and dtype; zero-volume outside ``P_x``.
    Raises:
        TypeError: ``x`` not a tensor, ``P_x`` not a partition, non-integer widths.
        ValueError: widths of the wrong shape, negative, not fitting in ``x``; ``x`` of the wrong
            dimension; data on a worker outside ``P_x``; on the receiving worker, a neighbour sending a slab of
            another size (that worker alone: the neighbour is not told; check mode compares the slab sizes with
            each neighbour first and raises ``CollectiveMismatchError`` on every worker, naming the receivers).
    """
    try:
        widths = _validate("halo_exchange", x, P_x, halo_shape, recv_buffer_shape, send_buffer_shape)
    except (TypeError, ValueError) as error:
        announce("halo_exchange", lambda: P_x if P_x.active else None, error)
        raise
    verify("halo_exchange", P_x, x, ("dim", "dtype", "device"))
    if not P_x.active:
        return in_graph(x).clone()  # backward runs here too
    if check_mode():
        _check_slabs("halo_exchange", tuple(x.shape), P_x, widths, adjoint=False)
    return _HaloExchange.apply(in_graph(x), P_x, widths)


@cuda.host_staged(whole=False)  # stages the slabs that travel (_exchange)
def halo_exchange_adjoint(y: torch.Tensor, P_x: MPIPartition, halo_shape: Widths | None,
                          recv_buffer_shape: Widths | None, send_buffer_shape: Widths | None) -> torch.Tensor:
    """Return the adjoint of :func:`halo_exchange` applied to ``y``: ghosts sent back and added to their owners.

    Arguments, returns and errors are those of :func:`halo_exchange`; sums of float16/bfloat16
    are carried (and sent) in float32, and bool raises ``TypeError``.
    """
    try:
        widths = _validate("halo_exchange_adjoint", y, P_x, halo_shape, recv_buffer_shape, send_buffer_shape)
        transport.reduction_dtype("halo_exchange_adjoint", y.dtype)
    except (TypeError, ValueError) as error:
        announce("halo_exchange_adjoint", lambda: P_x if P_x.active else None, error)
        raise
    verify("halo_exchange_adjoint", P_x, y, ("dim", "dtype", "device"))
    if not P_x.active:
        return in_graph(y).clone()  # backward runs here too
    if check_mode():
        _check_slabs("halo_exchange_adjoint", tuple(y.shape), P_x, widths, adjoint=True)
    return _HaloExchangeAdjoint.apply(in_graph(y), P_x, widths)


def _as_widths(where: str, name: str, value, dim: int) -> tuple[tuple[int, int], ...]:
    try:
        array = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{where}: expected an integer array of shape ({dim}, 2) for {name}, got {value!r}") from error
    if array.shape != (dim, 2):
        raise ValueError(f"{where}: expected {name} of shape ({dim}, 2), got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{where}: expected integers for {name}, got dtype {array.dtype}")
    if (array < 0).any():
        raise ValueError(f"{where}: expected non-negative {name}, got {array.tolist()}")
    return tuple((int(left), int(right)) for left, right in array)


def _validate(where, x, P_x, halo_shape, recv_buffer_shape, send_buffer_shape):
    check_tensor(where, x)
    check_partition(where, "P_x", P_x)
    check_idle_input(where, P_x, x)
    if not P_x.active:
        return None
    check_dim(where, P_x, x)
    names = ("halo_shape", "recv_buffer_shape", "send_buffer_shape")
    halo, recv, send = (_as_widths(where, name, value, P_x.dim)
                        for name, value in zip(names, (halo_shape, recv_buffer_shape, send_buffer_shape)))
    worker = P_x._root.rank
    for d, n in enumerate(x.shape):
        interior = n - sum(halo[d])
        if interior < 0:
            raise ValueError(f"{where}: expected halo_shape[{d}] to fit in extent {n} of dimension {d} of x on "
                             f"worker {worker}, got {list(halo[d])}")
        if recv[d][0] > halo[d][0] or recv[d][1] > halo[d][1]:
            raise ValueError(f"{where}: expected recv_buffer_shape[{d}] <= halo_shape[{d}] = {list(halo[d])} on "
                             f"worker {worker}, got {list(recv[d])}")
        if max(send[d]) > interior:
            raise ValueError(f"{where}: worker {worker} holds {interior} interior slices along dimension {d}; "
                             f"expected send_buffer_shape[{d}] of at most {interior}, got {list(send[d])}")
    return halo, recv, send


class _HaloExchange(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, P_x, widths):
        save_anchor(ctx)
        ctx.P_x, ctx.widths = P_x, widths
        y = x.clone(memory_format=torch.contiguous_format)
        _exchange("halo_exchange", y, P_x, widths, adjoint=False)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        begin_backward(ctx, grad_y, ctx.P_x)
        return halo_exchange_adjoint(grad_y, ctx.P_x, *ctx.widths), None, None


class _HaloExchangeAdjoint(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, P_x, widths):
        save_anchor(ctx)
        ctx.P_x, ctx.widths = P_x, widths
        x = y.to(transport.reduction_dtype("halo_exchange_adjoint", y.dtype), memory_format=torch.contiguous_format,
                 copy=True)
        _exchange("halo_exchange_adjoint", x, P_x, widths, adjoint=True)
        return x.to(y.dtype)

    @staticmethod
    def backward(ctx, grad_x):
        begin_backward(ctx, grad_x, ctx.P_x)
        return halo_exchange(grad_x, ctx.P_x, *ctx.widths), None, None


def _exchange(where: str, t: torch.Tensor, P_x: MPIPartition, widths, adjoint: bool) -> None:
    """Run the forward (or adjoint) exchange in place on ``t``, a contiguous tensor this call owns."""
    halo, recv, send = widths
    error = None
    staged = cuda.staging(t)  # where MPI cannot take t's memory, only the slabs go through (pinned) host memory
    for d in reversed(range(t.dim())) if adjoint else range(t.dim()):
        n = t.shape[d]
        ghost = ((halo[d][0] - recv[d][0], recv[d][0]), (n - halo[d][1], recv[d][1]))
        interior = ((halo[d][0], send[d][0]), (n - halo[d][1] - send[d][1], send[d][1]))
        outgoing, incoming = (ghost, interior) if adjoint else (interior, ghost)
        requests, arrivals, packs = [], [], []  # the packs too stay referenced until the sends complete
        sides = [(side, peer) for side, peer in enumerate(neighbors(P_x)[d]) if peer != MPI.PROC_NULL]
        outs = [t.narrow(d, *outgoing[side]) for side, _ in sides]
        if staged:  # after the slabs that arrived along the previous dimension are on the device (stream order)
            outs = cuda.host_copies(outs)
        for (side, peer), out in zip(sides, outs):
            into = t.narrow(d, *incoming[side])
            packed = out if out.is_contiguous() else _scratch(P_x, out, ("out", side)).copy_(out)
            if staged:
                arrival = transport.empty(into.shape, t.dtype, torch.device("cpu"))
            else:
                arrival = into if into.is_contiguous() and not adjoint else _scratch(P_x, into, ("in", side))
            requests.append(P_x.comm.Irecv(transport.buffer(arrival), source=peer, tag=_TAG + 2 * d + 1 - side))
            requests.append(P_x.comm.Isend(transport.buffer(packed), dest=peer, tag=_TAG + 2 * d + side))
            arrivals.append((side, peer, into, arrival))
            packs.append(packed)
        try:
            _wait(where, P_x, d, requests, arrivals)
        except ValueError as failure:  # still exchange the other dimensions: every message must find its match
            error = error or failure
            continue
        for side, _, into, arrival in arrivals:  # a pinned arrival is kept from reuse by torch until copied
            if adjoint:
                into.add_(arrival.to(into.device, non_blocking=True))
                t.narrow(d, *ghost[side]).zero_()
            elif arrival is not into:
                into.copy_(arrival, non_blocking=True)
    if error is not None:
        raise error


def _check_slabs(where: str, shape: tuple[int, ...], P_x: MPIPartition, widths, adjoint: bool) -> None:
    """Check mode: tell each neighbour how many elements this worker will send it, and check what each will send
    here against what this worker receives; a mismatch (neighbours built with other widths) raises
    CollectiveMismatchError on every member of ``P_x``, naming the workers that found one."""
    halo, recv, send = widths
    outgoing, incoming = (recv, send) if adjoint else (send, recv)
    found = []
    for d in range(len(shape)):
        others = int(np.prod(shape[:d] + shape[d + 1:]))
        for side, peer in enumerate(neighbors(P_x)[d]):
            if peer == MPI.PROC_NULL:
                continue
            sending, expected = np.array([outgoing[d][side] * others]), incoming[d][side] * others
            coming = np.empty(1, dtype=sending.dtype)
            P_x.comm.Sendrecv(sending, peer, _CHECK_TAG + 2 * d + side, coming, peer, _CHECK_TAG + 2 * d + 1 - side)
            if coming[0] != expected:
                found.append(f"{expected} elements expected from the {('left', 'right')[side]} neighbour (rank "
                             f"{peer} of P_x) along dimension {d}, which sends {coming[0]}")
    verify(where, P_x, agree={"slabs from the neighbours": "; ".join(found) or "as expected"})


def neighbors(P_x: MPIPartition) -> tuple[tuple[int, int], ...]:
    """Return this worker's (left, right) neighbours per axis of ``P_x`` (``MPI.PROC_NULL`` at edges), built once."""
    return P_x._memo("halo_exchange_neighbors", lambda: tuple(P_x.neighbor_ranks(P_x.rank)))


def _wait(where, P_x, d, requests, arrivals) -> None:
    """Complete one dimension's messages; a neighbour that sent a slab of another size is a ValueError."""
    statuses = [MPI.Status() for _ in requests]
    try:
        MPI.Request.Waitall(requests, statuses)
    except MPI.Exception as error:
        raise ValueError(f"{where}: expected the neighbours of worker {P_x._root.rank} along dimension {d} to send "
                         f"slabs of the sizes and dtype it receives, got an MPI error: {error}") from error
    for (side, peer, _, arrival), status in zip(arrivals, statuses[::2]):
        got = status.Get_count(MPI.BYTE)
        if got != arrival.numel() * arrival.element_size():
            raise ValueError(f"{where}: expected {arrival.numel()} {arrival.dtype} elements "
                             f"({arrival.numel() * arrival.element_size()} bytes) on worker {P_x._root.rank} from its "
                             f"{('left', 'right')[side]} neighbour (rank {peer} of P_x) along dimension {d}, got "
                             f"{got} bytes (a slab of another size or dtype)")


def _scratch(P_x: MPIPartition, like: torch.Tensor, slot) -> torch.Tensor:
    """Return a cached contiguous buffer shaped like ``like`` (one per slot, shape, dtype and device)."""
    cache = P_x._memo("halo_exchange_scratch", dict)
    key = (tuple(like.shape), like.dtype, like.device, slot)
    found = cache.get(key)
    if found is None:
        with torch.inference_mode(False):  # a buffer made under inference mode could not be written outside it
            found = keep(cache, key, torch.empty(like.shape, dtype=like.dtype, device=like.device), _MAX_SCRATCH)
    return found
