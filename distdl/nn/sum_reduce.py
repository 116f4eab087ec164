"""SumReduce as a module; see :func:`distdl.functional.sum_reduce`."""

from __future__ import annotations

import torch

from distdl.functional._common import check_flags
from distdl.functional.broadcast import check_broadcastable
from distdl.functional.sum_reduce import reduction_plan, sum_reduce
from distdl.partition import MPIPartition

__all__ = ["SumReduce"]


class SumReduce(torch.nn.Module):
    """Sum the blocks of ``P_x`` onto the workers of ``P_y`` they broadcast from; backward: Broadcast(P_y, P_x)."""

    def __init__(self, P_x: MPIPartition, P_y: MPIPartition, transpose_src: bool = False,
                 transpose_dest: bool = False, preserve_batch: bool = True) -> None:
        super().__init__()
        self.transpose_src, self.transpose_dest, self.preserve_batch = check_flags(
            "SumReduce", transpose_src=transpose_src, transpose_dest=transpose_dest, preserve_batch=preserve_batch)
        check_broadcastable("SumReduce", P_y, P_x, self.transpose_dest, self.transpose_src, names=("P_y", "P_x"))
        self.P_x, self.P_y = P_x, P_y
        reduction_plan(P_x, P_y, self.transpose_src, self.transpose_dest)  # the communicators are built here, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum_reduce(x, self.P_x, self.P_y, self.transpose_src, self.transpose_dest, self.preserve_batch)

    def extra_repr(self) -> str:
        return (f"P_x shape={self.P_x.shape}, P_y shape={self.P_y.shape}, transpose_src={self.transpose_src}, "
                f"transpose_dest={self.transpose_dest}, preserve_batch={self.preserve_batch}")
