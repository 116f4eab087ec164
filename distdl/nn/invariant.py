"""The invariant pair as modules; see :mod:`distdl.functional.invariant` for when each is right."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from distdl.functional._common import check_partition, resolve_axes
from distdl.functional.all_sum_reduce import fibre
from distdl.functional.invariant import all_sum_reduce_backward, all_sum_reduce_forward
from distdl.partition import MPIPartition

__all__ = ["AllSumReduceForward", "AllSumReduceBackward"]


class _InvariantModule(torch.nn.Module):

    def __init__(self, P_x: MPIPartition, axes_reduce: Iterable[int] | None = None,
                 axes_keep: Iterable[int] | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        check_partition(name, "P_x", P_x)
        self.P_x = P_x
        self.axes_reduce = resolve_axes(name, P_x, axes_reduce, axes_keep, "axes_reduce")
        fibre(P_x, self.axes_reduce)

    def extra_repr(self) -> str:
        return f"P_x shape={self.P_x.shape}, axes_reduce={self.axes_reduce}"


class AllSumReduceForward(_InvariantModule):
    """Forward: all-sum-reduce along ``axes_reduce``; backward: identity (consumer computed redundantly)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_sum_reduce_forward(x, self.P_x, axes_reduce=self.axes_reduce)


class AllSumReduceBackward(_InvariantModule):
    """Forward: identity; backward: all-sum-reduce along ``axes_reduce`` (a replicated input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_sum_reduce_backward(x, self.P_x, axes_reduce=self.axes_reduce)
