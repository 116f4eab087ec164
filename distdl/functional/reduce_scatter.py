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
As the adjoint of :func:`all_gather` in a backward, the shapes already agree and no header round
runs unless the tensors ride in it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import in_graph
from distdl.functional._messages import carries_payload, rides_inline, sum_payloads
from distdl.functional.all_gather import all_gather, exchange_messages, gather_adjoint, layout, member_plan
from distdl.checks import verify
from distdl.partition import MPIPartition

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
    plan = member_plan(where, x, P_x, axes_reduce_scatter, axes_keep, "axes_reduce_scatter", summed=True)
    if plan is None:
        return x.clone()
    axes, P_fibre = plan.axes, plan.P_fibre
    # The headers are a safety check here (every member holds the full shape): members that
    # disagree all raise instead of posting mismatched reductions. Small tensors ride along.
    shapes, messages = exchange_messages(where, P_fibre, x)
    for r, shape in enumerate(shapes):
        if shape != shapes[0]:
            raise ValueError(f"{where}: expected the same shape on every member of the fibre, got {shapes[0]} on "
                             f"worker {P_fibre.root_ranks[0]} and {shape} on worker {P_fibre.root_ranks[r]}")
    verify(where, P_fibre, x)
    if not torch.is_grad_enabled():  # nothing to record (e.g. inside a backward): skip autograd's ~5 us
        return _reduce_scatter(x, axes, P_fibre, messages)
    return _ReduceScatter.apply(in_graph(x), P_x, plan, messages)


def _reduce_scatter(x, axes, P_fibre, messages):
    """Return this member's block of the sum; ``messages`` (or None: not exchanged) may carry every ``x`` inline."""
    sum_dtype = transport.reduction_dtype("reduce_scatter", x.dtype)
    plan = layout(P_fibre.shape, axes, tuple(x.shape))
    mine = plan.blocks[P_fibre.rank]
    if messages is not None and carries_payload(messages, x.dtype, x.shape):  # every x came with the headers
        y = sum_payloads(messages, list(range(len(messages))), x.dtype, x.shape, sum_dtype, mine)
        return (y if y.dtype == x.dtype else y.to(x.dtype)).to(x.device)
    if plan.in_rank_order:
        x_sum = transport.contiguous(x, sum_dtype)
    else:  # pack: the blocks one after another in fibre rank order
        x_sum = transport.empty((x.numel(),), sum_dtype, x.device)
        for block, shape, n, d in zip(plan.blocks, plan.shapes, plan.counts, plan.displacements):
            x_sum[d:d + n].view(shape).copy_(x[block])
    y = transport.empty(plan.shapes[P_fibre.rank], sum_dtype, x.device)
    send, recv = transport.buffer(x_sum, summed=True), transport.buffer(y, summed=True)
    if plan.equal:  # MPICH's Reduce_scatter_block, like its Allgather, is faster than the general form
        P_fibre.comm.Reduce_scatter_block([send[0], recv[1], send[2]], recv, op=MPI.SUM)  # counts per block
    else:
        P_fibre.comm.Reduce_scatter(send, recv, plan.counts, op=MPI.SUM)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def scatter_adjoint(grad: torch.Tensor, axes: tuple[int, ...], P_fibre: MPIPartition) -> torch.Tensor:
    """Return :func:`reduce_scatter` of ``grad``, an all_gather's output gradient, in a backward.

    Every member's shape and dtype are already agreed (autograd gives each gradient its output's
    shape and dtype), so the header round runs only to carry tensors small enough to ride in it.
    """
    verify("reduce_scatter", P_fibre, grad)
    messages = None
    if rides_inline(grad.dtype, grad.shape, P_fibre.comm.size):
        messages = exchange_messages("reduce_scatter", P_fibre, grad)[1]
    return _reduce_scatter(grad, axes, P_fibre, messages)


class _ReduceScatter(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, P_x, plan, messages):
        ctx.P_x, ctx.plan, ctx.x_shape = P_x, plan, tuple(x.shape)
        return _reduce_scatter(x, plan.axes, plan.P_fibre, messages)

    @staticmethod
    def backward(ctx, grad_y):
        if torch.is_grad_enabled():  # double backward: record the adjoint too
            grad_x = all_gather(grad_y, ctx.P_x, axes_all_gather=ctx.plan.axes)
        else:
            grad_x = gather_adjoint(grad_y, ctx.plan.axes, ctx.plan.P_fibre, ctx.x_shape)
        return grad_x, None, None, None
