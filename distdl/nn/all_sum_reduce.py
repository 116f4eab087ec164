"""AllSumReduce as a module; see :func:`distdl.functional.all_sum_reduce`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from distdl.functional._common import check_partition, resolve_axes
from distdl.functional.all_sum_reduce import all_sum_reduce, fibre
from distdl.partition import MPIPartition

__all__ = ["AllSumReduce"]


class AllSumReduce(torch.nn.Module):
    """Sum within fibres of ``P_x`` along ``axes_reduce``; self-adjoint (backward: the same sum)."""

    def __init__(self, P_x: MPIPartition, axes_reduce: Iterable[int] | None = None,
                 axes_keep: Iterable[int] | None = None) -> None:
        super().__init__()
        check_partition("AllSumReduce", "P_x", P_x)
        self.P_x = P_x
        self.axes_reduce = resolve_axes("AllSumReduce", P_x, axes_reduce, axes_keep, "axes_reduce")
        fibre(P_x, self.axes_reduce)  # the communicator is built here, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_sum_reduce(x, self.P_x, axes_reduce=self.axes_reduce)

    def extra_repr(self) -> str:
        return f"P_x shape={self.P_x.shape}, axes_reduce={self.axes_reduce}"
