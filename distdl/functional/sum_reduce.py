"""SumReduce: sum the blocks of P_x onto the workers of P_y they broadcast from.

Forward ``y_j = sum_{i: s(i)=j} x_i``, where worker ``s(i)`` of ``P_y`` is the one whose index
broadcasts to index ``i`` of ``P_x`` (NumPy rules; ``P_y`` is the smaller partition); adjoint
``x_i = y_{s(i)}``, :func:`~distdl.functional.broadcast.broadcast` from ``P_y`` back to ``P_x``.

==========================  ===========================================================
worker                      does
==========================  ===========================================================
in P_x only                 sends ``x`` into its sum, returns a zero-volume tensor
in P_y only                 receives the sum of its group (contributing zeros)
in P_x and P_y              sends ``x`` into its sum and receives its own group's sum
                            (contributing ``x`` when it is one of that group's sources)
in neither                  passes and gets a zero-volume tensor
==========================  ===========================================================

Each group first allgathers a small header, so the receiver learns dtype and shape each call, and
when sources disagree every member of the group raises instead of posting mismatched reductions.
In groups of up to 8 workers, blocks of up to 1 KiB travel with the headers and the receiver sums
them (one collective). As the adjoint of :func:`~distdl.functional.broadcast.broadcast` in a
backward, the blocks already agree and no header round runs.
Workers in two groups post both non-blocking. float16/bfloat16 are summed in float32; bool cannot
be summed.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import (HEADER_LENGTH, begin_backward, check_idle_input, check_tensor, grad_like,
                                       header_of, idle_in_graph, receiving_in_graph, save_anchor, zero_volume_like)
from distdl.functional._messages import (carries_payload, decode, empty_message, encode_message, message_length,
                                         remembered, sum_payloads)
from distdl.functional.broadcast import _broadcast, broadcast, broadcast_plan, groups
from distdl.functional.repartition import union
from distdl.checks import announce, check_mode, verify
from distdl.partition import MPIPartition

__all__ = ["sum_reduce"]


@host_staged
def sum_reduce(x: torch.Tensor, P_x: MPIPartition, P_y: MPIPartition, transpose_src: bool = False,
               transpose_dest: bool = False, preserve_batch: bool = True) -> torch.Tensor:
    """Return the sum of the blocks of ``P_x`` that reduce onto this worker of ``P_y``.

    Args:
        x: this worker's block (a zero-volume tensor outside ``P_x``); the blocks summed together
            must agree in shape and dtype.
        P_x: the source partition.
        P_y: the destination partition; its shape must broadcast to ``P_x``'s.
        transpose_src: read ``P_x``'s shape (and grid) reversed.
        transpose_dest: read ``P_y``'s shape (and grid) reversed.
        preserve_batch: keep ``x``'s first extent in zero-volume outputs, ``(b, 0)``.
    Returns:
        A new tensor (never aliasing ``x``); zero-volume outside ``P_y``.
    Raises:
        ValueError: partitions that do not reduce onto each other, data on a worker outside
            ``P_x``, or (after the header round, on every worker of the group) sources that
            disagree in shape or dtype.
        TypeError: wrong argument types, or a dtype that cannot be summed (bool).
    """
    where = "sum_reduce"
    plan = groups(where, P_y, P_x, transpose_dest, transpose_src, preserve_batch, names=("P_y", "P_x"))
    try:  # in check mode a worker failing here still takes part in the check (a receiver its group waits for)
        check_tensor(where, x)
        check_idle_input(where, P_x, x)
        header_of(where, x)  # rejects dtypes and shapes that cannot be described to receivers
        transport.reduction_dtype(where, x.dtype)
    except (TypeError, ValueError) as error:
        announce(where, lambda: union(P_x, P_y) or P_x, error)
        raise
    if check_mode():  # the workers of both partitions take part; receivers hold placeholders
        verify(where, union(P_x, P_y) or P_x, agree=())
    if not (plan.P_send.active or plan.P_recv.active):
        return idle_in_graph(x, preserve_batch)
    if not torch.is_grad_enabled():  # nothing to record (e.g. inside a backward): skip autograd's ~5 us
        return _sum_reduce(x, bool(preserve_batch), plan.P_recv, plan.P_send, plan.blocking)
    return _SumReduce.apply(receiving_in_graph(x, P_x), plan, P_y, bool(preserve_batch))


def reduction_plan(P_x: MPIPartition, P_y: MPIPartition, transpose_src: bool,
                   transpose_dest: bool) -> tuple[MPIPartition, MPIPartition]:
    """Return ``(P_send, P_recv)`` for sum-reducing ``P_x`` onto ``P_y``: the broadcast plan reversed."""
    P_recv, P_send = broadcast_plan(P_y, P_x, transpose_dest, transpose_src)
    return P_send, P_recv


_NO_SOURCE = empty_message()[:HEADER_LENGTH].tobytes()


def _agreed(P: MPIPartition, messages: np.ndarray) -> tuple[torch.dtype, tuple[int, ...], list[int] | None]:
    """Return the dtype and shape of a group's blocks and its sources' ranks (None: every member is one);
    ValueError unless all agree."""
    return remembered(P, "sum_reduce agreed", messages, lambda rows: _structure(P, rows))


def _structure(P: MPIPartition, messages: np.ndarray) -> tuple[torch.dtype, tuple[int, ...], list[int] | None]:
    headers = [row[:HEADER_LENGTH].tobytes() for row in messages]
    sources = [r for r, header in enumerate(headers) if header != _NO_SOURCE]  # not a receiver that is no source
    if any(headers[r] != headers[sources[0]] for r in sources):
        seen: dict[str, list[int]] = {}
        for r in sources:
            dtype, shape = decode(messages[r])
            seen.setdefault(f"shape {shape} of {dtype}", []).append(P.root_ranks[r])
        raise ValueError("sum_reduce: expected the blocks summed onto one worker to agree in dtype and shape, got "
                         + "; ".join(f"{what} on root rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                                     for what, ranks in seen.items()))
    return (*decode(messages[sources[0]]), None if len(sources) == len(headers) else sources)


def _sum_reduce(x, preserve_batch, P_send, P_recv, blocking, summed=None):
    """Return this worker's sum; ``summed`` is the dtype and shape of the blocks summed onto it when known on
    every worker (in a backward: then no header round runs), None to exchange them."""
    sources_itself = P_recv.active and P_recv is P_send
    if sources_itself and P_recv.comm.size == 1:
        return x.clone()
    # Header round: in each of its groups this worker allgathers every member's header, so every
    # member raises alike when sources disagree and the receiver learns what arrives. In groups of
    # up to INLINE_GROUP workers, blocks of up to INLINE_BYTES ride along and the receiver sums them.
    # Where the blocks' dtype and shape are known, the data alone travel: even at 8 B a reduction of them
    # costs less than an allgather of the messages, which adds packing and summing here.
    groups = []  # (partition, whether this worker is its receiver, its blocks' dtype and shape where known)
    if P_send.active and not sources_itself:
        groups.append((P_send, False, None if summed is None else (x.dtype, x.shape)))
    if P_recv.active:
        groups.append((P_recv, True, summed))
    gathered, requests = [], []
    for P, receiver, known in groups:
        if known is not None:
            gathered.append(None)  # nothing to learn
            continue
        mine = encode_message("sum_reduce", x) if not receiver or sources_itself else empty_message()
        length = message_length(P.comm.size)
        gathered.append(np.empty((P.comm.size, length), dtype=np.int64))
        if blocking:  # this worker is in one group only (see broadcast.blocking_allowed)
            P.comm.Allgather(mine[:length], gathered[-1])
        else:
            requests.append(P.comm.Iallgather(mine[:length], gathered[-1]))
    MPI.Request.Waitall(requests)
    structures, error = [], None
    for (P, _, known), messages in zip(groups, gathered):
        try:
            structures.append((*known, None) if messages is None else _agreed(P, messages))
        except ValueError as failure:  # every member of this group raises; the other group still sums
            error = error or failure
            structures.append(None)
    # Data round for the rest, in the accumulation dtype, straight from and into tensor memory.
    y, y_dtype, requests, keep = None, None, [], []
    for (P, receiver, _), messages, structure in zip(groups, gathered, structures):
        if structure is None:
            continue
        dtype, shape, sources = structure
        y_dtype = dtype if receiver else y_dtype
        accumulate = transport.reduction_dtype("sum_reduce", dtype)
        if messages is not None and carries_payload(messages, dtype, shape):
            if receiver:  # sum the blocks here
                y = sum_payloads(messages, sources, dtype, shape, accumulate).to(x.device)
            continue
        # A receiver that is no source of its group sends zeros. MPI overwrites y, never adds into it: selective
        # activation checkpointing hands a recomputation the tensors torch's ops made in the forward, and cannot
        # see MPI's writes (summing in place into zeros made by torch counted the others' blocks twice).
        x_sum = transport.contiguous(x, accumulate) if not receiver or sources_itself else torch.zeros(
            shape, dtype=accumulate, device=x.device)
        if receiver:
            y = transport.empty(shape, accumulate, x.device)
        if blocking:
            transport.reduce_sum(P.comm, x_sum, y if receiver else None)
        else:
            keep.append(x_sum)  # referenced until the wait
            requests.append(P.comm.Ireduce(transport.buffer(x_sum, summed=True),
                                           transport.buffer(y, summed=True) if receiver else None, op=MPI.SUM, root=0))
    MPI.Request.Waitall(requests)
    if error is not None:
        raise error
    if y is None:
        return zero_volume_like(x, preserve_batch)
    return y if y.dtype == y_dtype else y.to(y_dtype)


class _SumReduce(torch.autograd.Function):
    """On the groups of the broadcast from P_y to P_x (``plan``), reversed."""

    @staticmethod
    def forward(ctx, x, plan, P_y, preserve_batch):  # few arguments: each costs autograd ~1 us
        save_anchor(ctx)
        ctx.plan, ctx.P_y, ctx.preserve_batch, ctx.x_shape, ctx.x_dtype = plan, P_y, preserve_batch, x.shape, x.dtype
        ctx.P_dest = plan.dest_ref()  # the plan holds it weakly; a backward with create_graph needs it
        return _sum_reduce(x, preserve_batch, plan.P_recv, plan.P_send, plan.blocking)

    @staticmethod
    def backward(ctx, grad_y):
        begin_backward(ctx, grad_y, ctx.P_y, ctx.P_dest)
        plan = ctx.plan
        if torch.is_grad_enabled():  # double backward: record the adjoint too
            grad_x = broadcast(grad_y, ctx.P_y, ctx.P_dest, transpose_src=plan.transpose_src,
                               transpose_dest=plan.transpose_dest, preserve_batch=ctx.preserve_batch)
        else:  # the forward validated the arguments and agreed on the blocks; grad_y has y's shape and dtype
            if check_mode():
                verify("broadcast (backward)", union(ctx.P_y, ctx.P_dest) or ctx.P_y, agree=())
            grad_x = _broadcast(grad_y, ctx.preserve_batch, plan, (ctx.x_dtype, ctx.x_shape))
        return grad_like(grad_x, ctx.x_shape, ctx.x_dtype), None, None, None
