"""AllGather as a module; see :func:`distdl.functional.all_gather.all_gather`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from distdl.functional._common import check_partition, resolve_axes
from distdl.functional.all_gather import all_gather
from distdl.functional.all_sum_reduce import fibre
from distdl.partition import MPIPartition

__all__ = ["AllGather"]


class AllGather(torch.nn.Module):
    """Gather the blocks of fibres of ``P_x`` along ``axes_all_gather`` (backward: reduce-scatter)."""

    def __init__(self, P_x: MPIPartition, axes_all_gather: Iterable[int] | None = None,
                 axes_keep: Iterable[int] | None = None) -> None:
        super().__init__()
        check_partition("AllGather", "P_x", P_x)
        self.P_x = P_x
        self.axes_all_gather = resolve_axes("AllGather", P_x, axes_all_gather, axes_keep, "axes_all_gather")
        fibre(P_x, self.axes_all_gather)  # the communicator is built here, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x, self.P_x, axes_all_gather=self.axes_all_gather)

    def extra_repr(self) -> str:
        return f"P_x shape={self.P_x.shape}, axes_all_gather={self.axes_all_gather}"
