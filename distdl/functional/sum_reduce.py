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

Each group first all-reduces a small header (the max of the header and of its negation), so the
receiver learns dtype and shape each call, and when sources disagree every member of the group
raises instead of posting mismatched reductions. Workers in two groups post both non-blocking.
float16/bfloat16 are summed in float32; bool cannot be summed.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import (check_flags, check_idle_input, check_tensor, decode_header, encode_header,
                                       grad_like, in_graph, zero_volume_like)
from distdl.functional.broadcast import broadcast, broadcast_plan, check_broadcastable
from distdl.functional.repartition import union
from distdl.checks import check_mode, verify
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
    check_tensor(where, x)
    transpose_src, transpose_dest, preserve_batch = check_flags(
        where, transpose_src=transpose_src, transpose_dest=transpose_dest, preserve_batch=preserve_batch)
    check_broadcastable(where, P_y, P_x, transpose_dest, transpose_src, names=("P_y", "P_x"))
    header = encode_header(where, x)
    transport.reduction_dtype(where, x.dtype)
    check_idle_input(where, P_x, x)
    P_send, P_recv = reduction_plan(P_x, P_y, transpose_src, transpose_dest)
    if check_mode():  # the workers of both partitions take part; receivers hold placeholders
        verify(where, union(P_x, P_y) or P_x, agree=())
    if not (P_send.active or P_recv.active):
        return x.clone()
    flags = (transpose_src, transpose_dest, preserve_batch)
    return _SumReduce.apply(in_graph(x), P_x, P_y, flags, header, P_send, P_recv)


def reduction_plan(P_x: MPIPartition, P_y: MPIPartition, transpose_src: bool,
                   transpose_dest: bool) -> tuple[MPIPartition, MPIPartition]:
    """Return ``(P_send, P_recv)`` for sum-reducing ``P_x`` onto ``P_y``: the broadcast plan reversed."""
    P_recv, P_send = broadcast_plan(P_y, P_x, transpose_dest, transpose_src)
    return P_send, P_recv


def _check_agreement(P: MPIPartition, both: np.ndarray) -> None:
    half = both.size // 2
    if not np.array_equal(both[:half], -both[half:]):
        raise ValueError(f"sum_reduce: expected the blocks summed onto one worker to agree in dtype and shape, "
                         f"got blocks that differ among root ranks {list(P.root_ranks)}")


class _SumReduce(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, P_x, P_y, flags, header, P_send, P_recv):
        ctx.P_x, ctx.P_y, ctx.flags, ctx.x_shape = P_x, P_y, flags, x.shape
        sources_itself = P_recv.active and P_recv is P_send
        if sources_itself and P_recv.size == 1:
            return x.clone()
        sending = P_send.active and not sources_itself
        receiving = P_recv.active
        # Header round: max of (header, -header) over each group gives its max and min.
        nothing = np.full(2 * header.size, np.iinfo(np.int64).min, dtype=np.int64)
        mine = np.concatenate([header, -header])
        sent, received = np.empty_like(mine), np.empty_like(mine)
        requests = [P_send.comm.Iallreduce(mine, sent, op=MPI.MAX)] if sending else []
        if receiving:
            requests.append(P_recv.comm.Iallreduce(mine if sources_itself else nothing, received, op=MPI.MAX))
        MPI.Request.Waitall(requests)
        if sending:
            _check_agreement(P_send, sent)
        if receiving:
            _check_agreement(P_recv, received)
        # Data round, in the accumulation dtype, straight from and into tensor memory.
        requests = []
        if P_send.active:
            x_sum = transport.contiguous(x, transport.reduction_dtype("sum_reduce", x.dtype))
        if sending:
            requests.append(P_send.comm.Ireduce(transport.buffer(x_sum, summed=True), None, op=MPI.SUM, root=0))
        if receiving:
            dtype, shape = decode_header(received[:header.size])
            accumulate = transport.reduction_dtype("sum_reduce", dtype)
            if sources_itself:
                y, contribution = transport.empty(shape, accumulate, x.device), transport.buffer(x_sum, summed=True)
            else:  # a receiver that is no source of its group adds zeros
                y, contribution = torch.zeros(shape, dtype=accumulate, device=x.device), MPI.IN_PLACE
            requests.append(P_recv.comm.Ireduce(contribution, transport.buffer(y, summed=True), op=MPI.SUM, root=0))
        MPI.Request.Waitall(requests)
        if receiving:
            return y.to(dtype)
        return zero_volume_like(x, flags[2])

    @staticmethod
    def backward(ctx, grad_y):
        transpose_src, transpose_dest, preserve_batch = ctx.flags
        grad_x = broadcast(grad_y, ctx.P_y, ctx.P_x, transpose_src=transpose_dest, transpose_dest=transpose_src,
                           preserve_batch=preserve_batch)
        return grad_like(grad_x, ctx.x_shape), None, None, None, None, None, None
