"""The invariant pair (Megatron-LM / TransformerEngine convention) along partition axes.

- ``all_sum_reduce_forward``: forward all-sum-reduce, backward identity.
- ``all_sum_reduce_backward``: forward identity, backward all-sum-reduce.

Each one's backward is the other's forward. They are NOT the true adjoints of their forwards
(the true adjoint of a sum onto every member is :func:`~distdl.functional.all_sum_reduce`
again). They are right exactly when what consumes the result is computed *redundantly*, the
same on every member of the fibre:

- after ``all_sum_reduce_forward`` every member holds the full sum and each computes the same
  downstream function (e.g. the loss) and calls ``backward`` with the same cotangent; the true
  adjoint would add those identical cotangents up (a factor of the fibre size), identity does not;
- ``all_sum_reduce_backward`` marks a replicated input (e.g. a parameter held by every member)
  entering rank-local computations: each member's gradient is one part of the total, so the
  backward must sum them.

When each member's downstream computation is different (the usual distributed layer) the true
adjoint is right; distdl's primitives use it by default.

============================  ==========================================================
worker                        does
============================  ==========================================================
in P_x                        forward/backward as above within its fibre along the axes
outside P_x                   passes and gets a zero-volume tensor
============================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from distdl.backends.cuda import host_staged, refuse_unsupported
from distdl.checks import announce
from distdl.functional.all_sum_reduce import _run, checked_fibre, fibre_plan, validate
from distdl.functional._common import begin_backward, in_graph, save_anchor
from distdl.partition import MPIPartition
from distdl.utilities.torch import eager_when_compiled

__all__ = ["all_sum_reduce_forward", "all_sum_reduce_backward"]


@eager_when_compiled
def all_sum_reduce_forward(x: torch.Tensor, P_x: MPIPartition, axes_reduce: Iterable[int] | None = None,
                           axes_keep: Iterable[int] | None = None) -> torch.Tensor:
    """Return the fibre sum of ``x`` (forward: all-sum-reduce; backward: identity)."""
    refuse_unsupported("all_sum_reduce_forward")
    where = "all_sum_reduce_forward"
    try:
        axes = validate(where, x, P_x, axes_reduce, axes_keep)
    except (TypeError, ValueError) as error:  # check mode: take part in the sum's check all the same
        announce(where, lambda: checked_fibre(where, P_x, axes_reduce, axes_keep), error)
        raise
    return _pair(x, P_x, axes, True, where)


@eager_when_compiled
def all_sum_reduce_backward(x: torch.Tensor, P_x: MPIPartition, axes_reduce: Iterable[int] | None = None,
                            axes_keep: Iterable[int] | None = None) -> torch.Tensor:
    """Return a copy of ``x`` (forward: identity; backward: all-sum-reduce of the gradient)."""
    refuse_unsupported("all_sum_reduce_backward")
    axes = validate("all_sum_reduce_backward", x, P_x, axes_reduce, axes_keep)
    return _pair(x, P_x, axes, False, "all_sum_reduce_backward")


def _pair(x: torch.Tensor, P_x: MPIPartition, axes: tuple[int, ...], reduce_in_forward: bool,
          where: str) -> torch.Tensor:
    """Apply one of the pair; check mode records its sum as ``where`` (``... (backward)`` when run by a backward,
    so that a rank that skipped the backward and calls a sum forward is named)."""
    y = _summed(x.detach(), P_x, axes, where) if reduce_in_forward else x.detach().clone()
    # y travels inside a tuple: returned as an input, autograd would make it a view that refuses in-place ops
    return _Pair.apply(in_graph(x), (y,), P_x, axes, reduce_in_forward, where)


@host_staged
def _summed(x: torch.Tensor, P_x: MPIPartition, axes: tuple[int, ...], where: str) -> torch.Tensor:
    plan = fibre_plan("all_sum_reduce", x, P_x, axes, None)
    if plan.P_fibre is None:  # outside P_x: a zero-volume copy
        return x.clone()
    with torch.no_grad():
        return _run(x, plan, where)


class _Pair(torch.autograd.Function):
    """Return the precomputed forward value ``y[0]``; backward applies the partner's forward."""

    @staticmethod
    def forward(ctx, x, y, P_x, axes, reduce_in_forward, where):
        save_anchor(ctx)
        ctx.P_x, ctx.axes, ctx.where = P_x, axes, where
        ctx.reduce_in_forward = reduce_in_forward
        return y[0]

    @staticmethod
    def backward(ctx, grad_y):
        begin_backward(ctx, grad_y, ctx.P_x)
        where = ctx.where if ctx.where.endswith(" (backward)") else f"{ctx.where} (backward)"
        return _pair(grad_y, ctx.P_x, ctx.axes, not ctx.reduce_in_forward, where), None, None, None, None, None
