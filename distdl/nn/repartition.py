"""Repartition as a module; see :func:`distdl.functional.repartition`."""

from __future__ import annotations

import torch

from distdl.functional._common import check_flags
from distdl.functional.repartition import check_pair, repartition, union
from distdl.partition import MPIPartition

__all__ = ["Repartition"]


class Repartition(torch.nn.Module):
    """Move a tensor from its decomposition over ``P_x`` to the one over ``P_y`` (backward: ``P_y`` to ``P_x``).

    Args:
        P_x: the partition of the input.
        P_y: the partition of the output (same root, same dimension as ``P_x``).
        preserve_batch: zero-volume outputs keep the input's first extent, as ``(b, 0)``.
    Raises:
        ValueError: partitions of different roots or dimensions.
        TypeError: arguments that are not partitions, a ``preserve_batch`` that is not a bool.
    """

    def __init__(self, P_x: MPIPartition, P_y: MPIPartition, preserve_batch: bool = True) -> None:
        super().__init__()
        self.preserve_batch, = check_flags("Repartition", preserve_batch=preserve_batch)
        check_pair("Repartition", P_x, P_y)
        self.P_x, self.P_y = P_x, P_y
        union(P_x, P_y)  # the communicator (shared with the backward) is built here, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return repartition(x, self.P_x, self.P_y, self.preserve_batch)

    def extra_repr(self) -> str:
        return f"P_x shape={self.P_x.shape}, P_y shape={self.P_y.shape}, preserve_batch={self.preserve_batch}"
