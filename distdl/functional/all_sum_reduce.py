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

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import (begin_backward, check_idle_input, check_partition, check_tensor, in_graph,
                                       resolve_axes_cached, save_anchor)
from distdl.checks import announce, verify
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
    try:
        check_tensor("all_sum_reduce", x)
        check_partition("all_sum_reduce", "P_x", P_x)
        plan = fibre_plan("all_sum_reduce", x, P_x, axes_reduce, axes_keep)
    except (TypeError, ValueError) as error:
        announce("all_sum_reduce", lambda: checked_fibre("all_sum_reduce", P_x, axes_reduce, axes_keep), error)
        raise
    if plan.P_fibre is None:  # outside P_x
        check_idle_input("all_sum_reduce", P_x, x)
        return in_graph(x).clone()  # backward runs here too
    return _run(x, plan)


def validate(where: str, x: torch.Tensor, P_x: MPIPartition, axes: Iterable[int] | None,
             axes_keep: Iterable[int] | None, what: str = "axes_reduce", summed: bool = True) -> tuple[int, ...]:
    """Check the arguments of a fibre collective (``summed``: a sum); return the partition axes it acts along."""
    check_tensor(where, x)
    check_partition(where, "P_x", P_x)
    axes = resolve_axes_cached(where, P_x, axes, axes_keep, what)
    if summed:
        transport.reduction_dtype(where, x.dtype)
    check_idle_input(where, P_x, x)
    return axes


def checked_fibre(where: str, P_x: MPIPartition, axes: Iterable[int] | None, axes_keep: Iterable[int] | None,
                  what: str = "axes_reduce") -> MPIPartition | None:
    """Return the fibre a fibre collective checks its call on (None outside ``P_x``; raises for bad axes)."""
    return fibre(P_x, resolve_axes_cached(where, P_x, axes, axes_keep, what)) if P_x.active else None


def fibre(P_x: MPIPartition, axes: tuple[int, ...]) -> MPIPartition:
    """Return this worker's fibre of ``P_x`` along ``axes``, built once per partition."""
    return P_x._memo(("fibre", axes), lambda: P_x.create_allreduction_partition(axes))


class FibrePlan:
    """What the first call of a fibre collective with a partition, axes and dtype validated and built.

    At 8 B a call's cost is mostly Python, so the calls after it look the plan up in the
    partition's cache (freed with the partition) instead of validating again.
    """
    __slots__ = ("given", "axes", "P_fibre", "alone", "sum_dtype")

    def __init__(self, given: tuple, axes: tuple[int, ...], P_x: MPIPartition,
                 sum_dtype: torch.dtype | None) -> None:
        self.given = given  # the axes arguments as passed, kept alive so that identity proves a match
        self.axes = axes
        self.P_fibre = fibre(P_x, axes) if P_x.active else None  # None outside P_x
        self.alone = self.P_fibre is not None and self.P_fibre.comm.size == 1
        self.sum_dtype = sum_dtype  # None: summed in the input's dtype


_KEYED = (tuple, type(None), int, range)  # axes arguments that hash by value


def fibre_plan(where: str, x: torch.Tensor, P_x: MPIPartition, axes: Iterable[int] | None,
               axes_keep: Iterable[int] | None, what: str = "axes_reduce", summed: bool = True) -> FibrePlan:
    """Return the plan of a call after :func:`validate`; skip validating when these very axes objects were.

    ``x`` and ``P_x`` must have passed ``check_tensor`` and ``check_partition``.
    """
    key = (where, axes, axes_keep, x.dtype)
    if not (type(axes) in _KEYED and type(axes_keep) in _KEYED):  # an iterator (a new object each call) would
        plan = key = None  # add an entry per call; a list is unhashable: validated on every call
    else:
        try:
            plan = P_x._cache.get(key)
        except TypeError:  # a tuple holding something unhashable
            plan = key = None
    # Equal axes are not enough to skip validation: (0.0,) equals (0,) as a key and must still be rejected.
    if plan is not None and plan.given[0] is axes and plan.given[1] is axes_keep:
        return plan
    resolved = validate(where, x, P_x, axes, axes_keep, what, summed)
    if plan is None:
        sum_dtype = transport.reduction_dtype(where, x.dtype) if summed else x.dtype
        plan = FibrePlan((axes, axes_keep), resolved, P_x, None if sum_dtype == x.dtype else sum_dtype)
        if key is not None:
            P_x._cache[key] = plan
    return plan


def _run(x: torch.Tensor, plan: FibrePlan, where: str = "all_sum_reduce") -> torch.Tensor:
    """Return the fibre sum of ``x`` under ``plan``, recorded for autograd when grad mode is on; check mode
    verifies the call as ``where``."""
    verify(where, plan.P_fibre, x)
    if not torch.is_grad_enabled():  # nothing to record (e.g. inside a backward): skip autograd's ~5 us
        return _sum(x, plan)
    return _AllSumReduce.apply(in_graph(x), plan)


def _sum(x: torch.Tensor, plan: FibrePlan) -> torch.Tensor:
    """Return the sum of ``x`` over the plan's fibre, straight from and into tensor memory."""
    if plan.alone:
        return x.clone()
    x_sum = transport.contiguous(x, plan.sum_dtype)
    y = transport.empty(x_sum.shape, x_sum.dtype, x_sum.device)
    transport.allreduce_sum(plan.P_fibre.comm, x_sum, y)
    return y if plan.sum_dtype is None else y.to(x.dtype)


class _AllSumReduce(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, plan):  # one argument besides x: each costs autograd ~1 us
        save_anchor(ctx)
        ctx.plan = plan
        return _sum(x, plan)

    @staticmethod
    def backward(ctx, grad_y):
        begin_backward(ctx, grad_y, ctx.plan.P_fibre)
        # Self-adjoint; autograd gives grad_y y's dtype, so the forward's plan holds (in a double
        # backward, _run records the adjoint too).
        return _run(grad_y, ctx.plan, "all_sum_reduce (backward)"), None
