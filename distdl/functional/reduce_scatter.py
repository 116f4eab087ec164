"""ReduceScatter: sum within fibres along partition axes, then keep this member's balanced block.

Forward ``y_i = (sum_{j in fibre(i)} x_j)[block i]``; adjoint ``x_j = concat_{i in fibre(j)} y_i``,
that is :func:`~distdl.functional.all_gather.all_gather`.

============================  ===================================================
worker                        does
============================  ===================================================
in P_x, fibre of size > 1     contributes ``x`` (full shape), receives its block
in P_x, fibre of size 1       returns a copy of ``x``
outside P_x                   passes and gets a zero-volume tensor
============================  ===================================================

Partition axis ``k`` splits tensor dimension ``k``; along it the first ``n % p`` members of the
fibre get one extra element (no padding is visible). float16/bfloat16 are summed in float32.
Members exchange headers each call (members that disagree in shape or dtype all raise); in fibres
of up to 8 workers, tensors of up to 1 KiB travel with them and are summed locally (one collective).
As the adjoint of :func:`~distdl.functional.all_gather.all_gather` in a backward, the shapes already
agree and no header round runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import begin_backward, in_graph, save_anchor
from distdl.functional._messages import carries_payload, sum_payloads
from distdl.functional.all_gather import Layout, agreed, all_gather, exchange, gather_adjoint, layout, member_plan
from distdl.checks import verify
from distdl.partition import MPIPartition
from distdl.utilities.torch import eager_when_compiled

__all__ = ["reduce_scatter"]


@host_staged
def reduce_scatter(x: torch.Tensor, P_x: MPIPartition, axes_reduce_scatter: Iterable[int] | None = None,
                   axes_keep: Iterable[int] | None = None) -> torch.Tensor:
    """Return this worker's balanced block of the sum of ``x`` over its fibre along ``axes_reduce_scatter``.

    Args:
        x: this worker's tensor, of the same (full) shape on every member of a fibre and
            ``P_x.dim`` dimensions.
        P_x: the partition.
        axes_reduce_scatter: partition axes to sum and split along; or give ``axes_keep``, the others.
    Returns:
        A new tensor (never aliasing ``x``): this member's block of the sum; zero-volume outside ``P_x``.
    Raises:
        ValueError: axes out of range, both or neither of ``axes_reduce_scatter``/``axes_keep``, a
            tensor whose dimension differs from ``P_x.dim``, data on a worker outside ``P_x``; and,
            on every member of the fibre, tensors of differing shapes or dtypes.
        TypeError: ``x`` of a dtype that cannot be summed (bool).
    """
    where = "reduce_scatter"
    fibre = member_plan(where, x, P_x, axes_reduce_scatter, axes_keep, "axes_reduce_scatter", summed=True)
    if fibre is None:
        return in_graph(x).clone()  # backward runs here too
    P_fibre, axes = fibre.P_fibre, fibre.axes
    # The headers are a safety check here (every member holds the full shape): members that
    # disagree all raise instead of posting mismatched reductions. Small tensors ride along.
    verify(where, P_fibre, x, ("device",))  # in check mode, before the header round (see all_gather)
    messages = exchange(where, P_fibre, x)
    plan = agreed(where, P_fibre, ("agreed", where, axes), messages,
                  lambda shapes: layout(P_fibre.shape, axes, _same_shape(where, P_fibre, shapes)))
    if not torch.is_grad_enabled():  # nothing to record (e.g. inside a backward): skip autograd's ~5 us
        return _reduce_scatter(x, P_fibre, plan, messages)
    return _ReduceScatter.apply(in_graph(x), (P_x, fibre, plan, messages))  # one argument: each costs autograd ~1 us


def _same_shape(where: str, P_fibre: MPIPartition, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Return the members' one shape; ValueError (the same on every member) if they differ."""
    for r, shape in enumerate(shapes):
        if shape != shapes[0]:
            raise ValueError(f"{where}: expected the same shape on every member of the fibre, got {shapes[0]} on "
                             f"worker {P_fibre.root_ranks[0]} and {shape} on worker {P_fibre.root_ranks[r]}")
    return shapes[0]


def _reduce_scatter(x, P_fibre, plan, messages):
    """Return this member's block of the sum of ``x``, of :class:`Layout` ``plan``; ``messages`` (or None: not
    exchanged) may carry every ``x`` inline."""
    sum_dtype = transport.reduction_dtype("reduce_scatter", x.dtype)
    rank = P_fibre.comm.rank
    if messages is not None and carries_payload(messages, x.dtype, plan.shape):  # every x came with the headers
        y = sum_payloads(messages, None, x.dtype, plan.shape, sum_dtype, plan.blocks[rank])
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if x.is_cpu else y.to(x.device)
    comm = P_fibre.comm
    x = transport.contiguous(x)  # its values in memory (a lazy view, a sparse cotangent): the blocks are views of it
    y = transport.empty(plan.shapes[rank], sum_dtype, x.device)
    if transport.pairwise(comm, x.numel() * y.element_size()):  # each block copied only as it is sent
        transport.reduce_scatter_blocks(comm, [x[block] for block in plan.blocks], y)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    if plan.in_rank_order:
        x_sum = transport.contiguous(x, sum_dtype)
    else:  # pack: the blocks one after another in fibre rank order
        x_sum = transport.empty((x.numel(),), sum_dtype, x.device)
        for block, shape, n, d in zip(plan.blocks, plan.shapes, plan.counts, plan.displacements):
            x_sum[d:d + n].view(shape).copy_(x[block])
    send, recv = transport.buffer(x_sum, summed=True), transport.buffer(y, summed=True)
    if plan.equal:  # MPICH's Reduce_scatter_block is faster than the general form
        comm.Reduce_scatter_block([send[0], recv[1], send[2]], recv, op=MPI.SUM)  # counts per block
    else:
        comm.Reduce_scatter(send, recv, plan.counts, op=MPI.SUM)
    return y if y.dtype == x.dtype else y.to(x.dtype)


@eager_when_compiled  # a backward's: compiled autograd would trace into it
def scatter_adjoint(grad: torch.Tensor, P_fibre: MPIPartition, plan: Layout) -> torch.Tensor:
    """Return :func:`reduce_scatter` of ``grad``, an all_gather's output gradient of :class:`Layout` ``plan``, in a
    backward.

    Every member's shape and dtype are already agreed (autograd gives each gradient its output's
    shape and dtype), so no header round runs (see :func:`~distdl.functional.all_gather.gather_adjoint`).
    """
    verify("reduce_scatter (backward)", P_fibre, grad)
    return _reduce_scatter(grad, P_fibre, plan, None)


class _ReduceScatter(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, call):
        save_anchor(ctx)
        P_x, fibre, plan, messages = call
        ctx.call = P_x, fibre, plan
        return _reduce_scatter(x, fibre.P_fibre, plan, messages)

    @staticmethod
    def backward(ctx, grad_y):
        begin_backward(ctx, grad_y, ctx.call[0])
        P_x, fibre, plan = ctx.call
        if torch.is_grad_enabled():  # double backward: record the adjoint too
            return all_gather(grad_y, P_x, axes_all_gather=fibre.axes), None
        return gather_adjoint(grad_y, fibre.P_fibre, plan), None
