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
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import (check_dim, check_idle_input, check_partition, check_tensor, header_of, in_graph,
                                       resolve_axes_cached)
from distdl.functional._messages import (carries_payload, sum_payloads)
from distdl.functional.all_gather import all_gather, block_slices, exchange_messages, in_rank_order
from distdl.functional.all_sum_reduce import fibre
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
    check_tensor(where, x)
    check_partition(where, "P_x", P_x)
    axes = resolve_axes_cached(where, P_x, axes_reduce_scatter, axes_keep, "axes_reduce_scatter")
    transport.reduction_dtype(where, x.dtype)
    check_idle_input(where, P_x, x)
    if not P_x.active:
        return x.clone()
    check_dim(where, P_x, x)
    header_of(where, x)  # rejects dtypes and shapes that cannot be described to the other members
    P_fibre = fibre(P_x, axes)
    if P_fibre.comm.size == 1:
        return x.clone()
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
    return _ReduceScatter.apply(in_graph(x), P_x, axes, P_fibre, messages)


def _reduce_scatter(x, axes, P_fibre, messages):
    sum_dtype = transport.reduction_dtype("reduce_scatter", x.dtype)
    mine = block_slices(P_fibre.shape, axes, x.shape)[P_fibre.rank]
    if carries_payload(messages, x.dtype, x.shape):  # every member's x came with the headers: sum here
        y = sum_payloads(messages, list(range(len(messages))), x.dtype, x.shape, sum_dtype, mine)
        return (y if y.dtype == x.dtype else y.to(x.dtype)).to(x.device)
    blocks = [x[block] for block in block_slices(P_fibre.shape, axes, x.shape)]
    if in_rank_order(P_fibre.shape, axes, x.shape):
        x_sum = transport.contiguous(x, sum_dtype)
    else:  # pack: the blocks one after another in fibre rank order
        x_sum = transport.empty((x.numel(),), sum_dtype, x.device)
        offset = 0
        for block in blocks:
            x_sum[offset:offset + block.numel()].view(block.shape).copy_(block)
            offset += block.numel()
    y = transport.empty(blocks[P_fibre.rank].shape, sum_dtype, x.device)
    P_fibre.comm.Reduce_scatter(transport.buffer(x_sum, summed=True), transport.buffer(y, summed=True),
                                [block.numel() for block in blocks], op=MPI.SUM)
    return y if y.dtype == x.dtype else y.to(x.dtype)


class _ReduceScatter(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, P_x, axes, P_fibre, messages):
        ctx.P_x, ctx.axes = P_x, axes
        return _reduce_scatter(x, axes, P_fibre, messages)

    @staticmethod
    def backward(ctx, grad_y):
        return all_gather(grad_y, ctx.P_x, axes_all_gather=ctx.axes), None, None, None, None
