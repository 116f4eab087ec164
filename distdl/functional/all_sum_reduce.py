"""AllSumReduce: sum within fibres along partition axes; every member gets the sum.

Forward ``y_i = sum_{j in fibre(i)} x_j``; it is self-adjoint, so its backward is itself.

============================  =====================================
worker                        does
============================  =====================================
in P_x, fibre of size > 1     contributes ``x``, receives the sum
in P_x, fibre of size 1       returns a copy of ``x``
outside P_x                   passes and gets a zero-volume tensor
============================  =====================================
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import check_idle_input, check_partition, check_tensor, in_graph, resolve_axes_cached
from distdl.checks import verify
from distdl.partition import MPIPartition

__all__ = ["all_sum_reduce"]


@host_staged
def all_sum_reduce(x: torch.Tensor, P_x: MPIPartition, axes_reduce: Iterable[int] | None = None,
                   axes_keep: Iterable[int] | None = None) -> torch.Tensor:
    """Return the sum of ``x`` over this worker's fibre of ``P_x`` along ``axes_reduce``.

    Args:
        x: this worker's tensor (same shape on every member of a fibre).
        P_x: the partition.
        axes_reduce: partition axes to sum along; or give ``axes_keep``, the axes not summed.
    Returns:
        A new tensor (never aliasing ``x``); zero-volume outside ``P_x``.
    Raises:
        ValueError: axes out of range, both or neither of ``axes_reduce``/``axes_keep``, or
            data on a worker outside ``P_x``.
        TypeError: ``x`` of a dtype that cannot be summed (bool).
    """
    axes = validate("all_sum_reduce", x, P_x, axes_reduce, axes_keep)
    if not P_x.active:
        return x.clone()
    P_fibre = fibre(P_x, axes)
    verify("all_sum_reduce", P_fibre, x)
    if not torch.is_grad_enabled():  # nothing to record (e.g. inside a backward): skip autograd's ~5 us
        return _sum(x, P_fibre)
    return _AllSumReduce.apply(in_graph(x), P_x, axes, P_fibre)


def validate(where: str, x: torch.Tensor, P_x: MPIPartition, axes_reduce: Iterable[int] | None,
             axes_keep: Iterable[int] | None) -> tuple[int, ...]:
    """Check the arguments of a fibre sum; return the partition axes summed along."""
    check_tensor(where, x)
    check_partition(where, "P_x", P_x)
    axes = resolve_axes_cached(where, P_x, axes_reduce, axes_keep, "axes_reduce")
    transport.reduction_dtype(where, x.dtype)
    check_idle_input(where, P_x, x)
    return axes


def fibre(P_x: MPIPartition, axes: tuple[int, ...]) -> MPIPartition:
    """Return this worker's fibre of ``P_x`` along ``axes``, built once per partition."""
    return P_x._memo(("fibre", axes), lambda: P_x.create_allreduction_partition(axes))


def _sum(x: torch.Tensor, P_fibre: MPIPartition) -> torch.Tensor:
    """Return the sum of ``x`` over ``P_fibre``: one Allreduce straight from and into tensor memory."""
    comm = P_fibre.comm
    if comm.size == 1:
        return x.clone()
    x_sum = transport.contiguous(x, transport.reduction_dtype("all_sum_reduce", x.dtype))
    y = torch.empty_like(x_sum)
    comm.Allreduce(transport.buffer(x_sum, summed=True), transport.buffer(y, summed=True), op=MPI.SUM)
    return y if y.dtype == x.dtype else y.to(x.dtype)


class _AllSumReduce(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, P_x, axes, P_fibre):
        ctx.P_x, ctx.axes, ctx.P_fibre = P_x, axes, P_fibre
        return _sum(x, P_fibre)

    @staticmethod
    def backward(ctx, grad_y):
        if torch.is_grad_enabled():  # double backward: record the adjoint too
            return all_sum_reduce(grad_y, ctx.P_x, axes_reduce=ctx.axes), None, None, None
        # The forward validated the arguments, and autograd gives grad_y y's shape and dtype.
        verify("all_sum_reduce", ctx.P_fibre, grad_y)
        return _sum(grad_y, ctx.P_fibre), None, None, None
