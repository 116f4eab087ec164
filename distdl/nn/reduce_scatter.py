"""ReduceScatter as a module; see :func:`distdl.functional.reduce_scatter.reduce_scatter`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from distdl.functional._common import check_partition, resolve_axes
from distdl.functional.all_sum_reduce import fibre
from distdl.functional.reduce_scatter import reduce_scatter
from distdl.partition import MPIPartition

__all__ = ["ReduceScatter"]


class ReduceScatter(torch.nn.Module):
    """Sum within fibres of ``P_x`` along ``axes_reduce_scatter``, keep this member's block (backward: all-gather)."""

    def __init__(self, P_x: MPIPartition, axes_reduce_scatter: Iterable[int] | None = None,
                 axes_keep: Iterable[int] | None = None) -> None:
        super().__init__()
        check_partition("ReduceScatter", "P_x", P_x)
        self.P_x = P_x
        self.axes_reduce_scatter = resolve_axes("ReduceScatter", P_x, axes_reduce_scatter, axes_keep,
                                                "axes_reduce_scatter")
        fibre(P_x, self.axes_reduce_scatter)  # the communicator is built here, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(x, self.P_x, axes_reduce_scatter=self.axes_reduce_scatter)

    def extra_repr(self) -> str:
        return f"P_x shape={self.P_x.shape}, axes_reduce_scatter={self.axes_reduce_scatter}"
