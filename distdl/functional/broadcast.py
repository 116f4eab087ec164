"""Broadcast: copy each block of P_x to the workers of P_y it broadcasts to.

Forward ``y_j = x_{s(j)}``, where worker ``s(j)`` of ``P_x`` is the one whose index broadcasts to
index ``j`` of ``P_y`` (NumPy rules on the partition shapes); adjoint ``x_i = sum_{j: s(j)=i} y_j``,
:func:`~distdl.functional.sum_reduce.sum_reduce` from ``P_y`` back to ``P_x``.

==========================  ===========================================================
worker                      does
==========================  ===========================================================
in P_x only                 sends ``x`` to its workers of P_y, returns a zero-volume tensor
in P_y only                 receives its source's block and returns it
in P_x and P_y              sends ``x`` to the workers it feeds and returns its own source's
                            block (a copy of ``x`` when it feeds itself)
in neither                  passes and gets a zero-volume tensor
==========================  ===========================================================

Receivers learn dtype and shape from a small header broadcast first, so the same layer works
when the block shape changes between calls; blocks of up to 1 KiB travel inside the header, in
one broadcast. As the adjoint of :func:`~distdl.functional.sum_reduce.sum_reduce` in a backward,
receivers already know what arrives and no header round runs.
A worker that sends in one group and receives in another posts both broadcasts non-blocking, so
no order of groups can deadlock. A root that feeds itself makes its copy of ``x`` while its group
reads ``x`` (a non-blocking data round, from ``OVERLAP_BYTES``).
"""

from __future__ import annotations

import weakref

import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import (begin_backward, check_flags, check_idle_input, check_partition, check_tensor,
                                       grad_like, header_of, idle_in_graph, receiving_in_graph, save_anchor,
                                       zero_volume_like)
from distdl.functional._messages import (decode, empty_message, encode_message, inline, inline_payload)
from distdl.functional.repartition import union
from distdl.checks import announce, check_mode, verify
from distdl.partition import MPIPartition, _broadcast_groups

__all__ = ["broadcast"]

# From this block size a root that feeds itself copies x while its group reads x (a non-blocking data round
# in every plan); below it, the blocking round and then the copy cost less.
OVERLAP_BYTES = 64 * 1024


@host_staged
def broadcast(x: torch.Tensor, P_x: MPIPartition, P_y: MPIPartition, transpose_src: bool = False,
              transpose_dest: bool = False, preserve_batch: bool = True) -> torch.Tensor:
    """Return the block of ``P_x`` that broadcasts to this worker of ``P_y``.

    Args:
        x: this worker's block (a zero-volume tensor outside ``P_x``).
        P_x: the source partition.
        P_y: the destination partition; ``P_x``'s shape must broadcast to it.
        transpose_src: read ``P_x``'s shape (and grid) reversed.
        transpose_dest: read ``P_y``'s shape (and grid) reversed.
        preserve_batch: keep ``x``'s first extent in zero-volume outputs, ``(b, 0)``.
    Returns:
        A new tensor (never aliasing ``x``); zero-volume outside ``P_y``.
    Raises:
        ValueError: partitions that do not broadcast, or data on a worker outside ``P_x``.
        TypeError: wrong argument types, or a dtype that cannot be sent.
    """
    where = "broadcast"
    plan = groups(where, P_x, P_y, transpose_src, transpose_dest, preserve_batch)
    try:  # in check mode a worker failing here still takes part in the check (a receiver its group waits for)
        check_tensor(where, x)
        check_idle_input(where, P_x, x)
        header_of(where, x)  # rejects dtypes and shapes that cannot be described to receivers
    except (TypeError, ValueError) as error:
        announce(where, lambda: union(P_x, P_y) or P_x, error)
        raise
    if check_mode():  # the workers of both partitions take part; receivers hold placeholders
        verify(where, union(P_x, P_y) or P_x, agree=())
    if not (plan.P_send.active or plan.P_recv.active):
        return idle_in_graph(x, preserve_batch)
    if not torch.is_grad_enabled():  # nothing to record (e.g. inside a backward): skip autograd's ~5 us
        return _broadcast(x, bool(preserve_batch), plan)
    return _Broadcast.apply(receiving_in_graph(x, P_x), plan, P_x, bool(preserve_batch))


class Groups:
    """The groups broadcasting ``P_src`` onto ``P_dest`` (or sum-reducing ``P_dest`` onto ``P_src``): what a
    call validated and built, kept in ``P_src``'s cache for the calls after it with these very partitions.

    Below a few KiB a call's cost is mostly Python, and validating the partitions costs as much as the
    collective. It refers to ``P_dest`` weakly (see ``MPIPartition._memo_with``).
    """
    __slots__ = ("dest_ref", "transpose_src", "transpose_dest", "P_send", "P_recv", "blocking", "copying")

    def __init__(self, P_src: MPIPartition, P_dest: MPIPartition, transpose_src: bool, transpose_dest: bool) -> None:
        self.dest_ref, self.transpose_src, self.transpose_dest = weakref.ref(P_dest), transpose_src, transpose_dest
        self.P_send, self.P_recv = broadcast_plan(P_src, P_dest, transpose_src, transpose_dest)
        self.blocking = blocking_allowed(P_src, P_dest, transpose_src, transpose_dest)
        # whether the root of a group this worker is in feeds itself too (see _broadcast)
        self.copying = any(feeds_itself and P_src._root.rank in members for members, feeds_itself
                           in _broadcast_groups("broadcast", P_src, P_dest, transpose_src, transpose_dest))


def groups(where: str, P_src: MPIPartition, P_dest: MPIPartition, transpose_src: object, transpose_dest: object,
           preserve_batch: object, names: tuple[str, str] = ("P_x", "P_y")) -> Groups:
    """Return the :class:`Groups` of broadcasting ``P_src`` onto ``P_dest`` after checking the arguments;
    the check runs once per pair of partition objects and transposes (flags of exactly bool type)."""
    if type(transpose_src) is bool and type(transpose_dest) is bool and type(preserve_batch) is bool:
        try:
            plan = P_src._cached_with(P_dest, ("groups", transpose_src, transpose_dest))
        except AttributeError:  # not a partition: checked below
            plan = None
        if plan is not None and not (P_src._freed or P_dest._freed):
            return plan
    transpose_src, transpose_dest, _ = check_flags(where, transpose_src=transpose_src,
                                                   transpose_dest=transpose_dest, preserve_batch=preserve_batch)
    check_broadcastable(where, P_src, P_dest, transpose_src, transpose_dest, names)
    return P_src._memo_with(P_dest, ("groups", transpose_src, transpose_dest),
                            lambda: Groups(P_src, P_dest, transpose_src, transpose_dest))


def check_broadcastable(where: str, P_src: MPIPartition, P_dest: MPIPartition, transpose_src: bool,
                        transpose_dest: bool, names: tuple[str, str] = ("P_x", "P_y")) -> None:
    """Raise ValueError unless ``P_src``'s shape broadcasts to ``P_dest``'s (NumPy rules)."""
    check_partition(where, names[0], P_src)
    check_partition(where, names[1], P_dest)
    if P_src._root is not P_dest._root and MPI.Comm.Compare(P_src._root, P_dest._root) != MPI.IDENT:
        raise ValueError(f"{where}: expected {names[0]} and {names[1]} derived from the same root partition, "
                         "got different roots")
    src = P_src.shape[::-1] if transpose_src else P_src.shape
    dest = P_dest.shape[::-1] if transpose_dest else P_dest.shape
    padded = (1,) * (len(dest) - len(src)) + src
    if len(src) > len(dest) or any(s not in (1, d) for s, d in zip(padded, dest)):
        raise ValueError(f"{where}: expected the shape of {names[0]}{' (reversed)' if transpose_src else ''} to "
                         f"broadcast to the shape of {names[1]}{' (reversed)' if transpose_dest else ''}, "
                         f"got {P_src.shape} and {P_dest.shape}")


def blocking_allowed(P_src: MPIPartition, P_dest: MPIPartition, transpose_src: bool, transpose_dest: bool) -> bool:
    """Whether no worker is in two groups of the plan, so every group may use blocking collectives.

    MPI never matches a blocking collective with a non-blocking one, so the choice is made for the
    whole plan from the groups every worker computes alike (without communicating). Blocking
    calls save ~1 us each over non-blocking ones at small sizes, and MPICH's blocking Bcast is
    faster at large ones unless the node is crowded (``transport.bcast``). SumReduce's groups are the same.
    """
    counts: dict[int, int] = {}
    for members, _ in _broadcast_groups("broadcast", P_src, P_dest, transpose_src, transpose_dest):
        for m in members:
            counts[m] = counts.get(m, 0) + 1
    return all(n == 1 for n in counts.values())


def broadcast_plan(P_src: MPIPartition, P_dest: MPIPartition, transpose_src: bool,
                   transpose_dest: bool) -> tuple[MPIPartition, MPIPartition]:
    """Return ``(P_send, P_recv)`` for broadcasting ``P_src`` onto ``P_dest``, built once per pair.

    SumReduce from ``P_dest`` to ``P_src`` uses the same groups, so a layer and its adjoint share them. In
    check mode it also builds the union of the two, on which every call then verifies its peers.
    """
    if check_mode():
        union(P_src, P_dest)
    return P_src._memo_with(P_dest, ("broadcast", transpose_src, transpose_dest),
                            lambda: P_src.create_broadcast_partition_to(P_dest, transpose_src, transpose_dest))


def _broadcast(x, preserve_batch, plan, incoming=None):
    """Return this worker's block under ``plan`` (:class:`Groups`); ``incoming`` is the dtype and shape it
    receives when known on every worker (in a backward: then no header round runs), None to learn them."""
    P_send, P_recv, blocking = plan.P_send, plan.P_recv, plan.blocking
    feeds_itself = P_recv.active and P_recv is P_send
    sending = P_send.active and P_send.comm.size > 1
    receiving = P_recv.active and not feeds_itself
    # Header round: every receiver learns what arrives; up to INLINE_BYTES of data ride along. Where the
    # structure is known, the data alone travel: even at 8 B a broadcast of them costs less than one of a
    # message, which adds packing and unpacking.
    send_header = sending and incoming is None
    recv_header = receiving and incoming is None
    outgoing = encode_message("broadcast", x) if send_header else None
    message = empty_message() if recv_header else None
    if blocking:  # this worker is in one group only (see blocking_allowed)
        if send_header:
            transport.bcast(P_send.comm, outgoing)
        elif recv_header:
            transport.bcast(P_recv.comm, message)
    elif send_header or recv_header:
        requests = [P_send.comm.Ibcast(outgoing, root=0)] if send_header else []
        if recv_header:
            requests.append(P_recv.comm.Ibcast(message, root=0))
        MPI.Request.Waitall(requests)
    if receiving:
        dtype, shape = decode(message) if recv_header else incoming
        small = recv_header and inline(dtype, shape)
        y = inline_payload(message, dtype, shape, x.device) if small else transport.empty(shape, dtype, x.device)
    # Data round for larger blocks, straight from and into tensor memory, blocking where the plan allows
    # (see blocking_allowed) unless the group's root copies x for itself (see Groups.copying): then from
    # OVERLAP_BYTES the round is non-blocking and the copy is made while the group reads x.
    data = []
    if sending and not (send_header and inline(x.dtype, x.shape)):
        data.append((P_send.comm, transport.contiguous(x)))  # keep a reference until the wait
    if receiving and not small:
        data.append((P_recv.comm, y))
    requests = []
    if blocking and not (plan.copying and data and data[0][1].nbytes >= OVERLAP_BYTES):  # at most one
        for comm, t in data:
            transport.bcast(comm, transport.buffer(t))
    else:
        requests = [comm.Ibcast(transport.buffer(t), root=0) for comm, t in data]
    if feeds_itself:
        y = x.clone()
    if requests:
        MPI.Request.Waitall(requests)
    return y if P_recv.active else zero_volume_like(x, preserve_batch)


class _Broadcast(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, plan, P_x, preserve_batch):  # few arguments: each costs autograd ~1 us
        save_anchor(ctx)
        ctx.plan, ctx.P_x, ctx.preserve_batch, ctx.x_shape, ctx.x_dtype = plan, P_x, preserve_batch, x.shape, x.dtype
        ctx.P_dest = plan.dest_ref()  # the plan holds it weakly; a backward with create_graph needs it
        return _broadcast(x, preserve_batch, plan)

    @staticmethod
    def backward(ctx, grad_y):
        begin_backward(ctx, grad_y, ctx.P_x, ctx.P_dest)
        from distdl.functional.sum_reduce import _sum_reduce, sum_reduce  # the adjoints refer to each other
        plan = ctx.plan
        if torch.is_grad_enabled():  # double backward: record the adjoint too
            grad_x = sum_reduce(grad_y, ctx.P_dest, ctx.P_x, transpose_src=plan.transpose_dest,
                                transpose_dest=plan.transpose_src, preserve_batch=ctx.preserve_batch)
        else:  # the forward validated the arguments; autograd gives grad_y y's shape and dtype
            if check_mode():
                verify("sum_reduce (backward)", union(ctx.P_dest, ctx.P_x) or ctx.P_dest, agree=())
            # the reduction runs on the same groups, reversed
            grad_x = _sum_reduce(grad_y, ctx.preserve_batch, plan.P_recv, plan.P_send, plan.blocking,
                                 (ctx.x_dtype, ctx.x_shape))
        return grad_like(grad_x, ctx.x_shape, ctx.x_dtype), None, None, None
