"""HaloExchange as a module; see :func:`distdl.functional.halo_exchange`."""

from __future__ import annotations

import torch

from distdl.functional._common import check_partition
from distdl.functional.halo_exchange import Widths, _as_widths, halo_exchange, neighbors
from distdl.partition import MPIPartition

__all__ = ["HaloExchange"]


class HaloExchange(torch.nn.Module):
    """Fill ghost regions from the neighbours' interiors; backward sends ghost gradients back and adds them.

    Args:
        P_x: the Cartesian partition of the input.
        halo_shape, recv_buffer_shape, send_buffer_shape: this worker's ``(P_x.dim, 2)`` integer
            arrays (``[left, right]`` per dimension); ignored, and may be ``None``, outside ``P_x``.
    """

    def __init__(self, P_x: MPIPartition, halo_shape: Widths | None, recv_buffer_shape: Widths | None,
                 send_buffer_shape: Widths | None) -> None:
        super().__init__()
        check_partition("HaloExchange", "P_x", P_x)
        self.P_x = P_x
        self.halo_shape = halo_shape
        self.recv_buffer_shape = recv_buffer_shape
        self.send_buffer_shape = send_buffer_shape
        if P_x.active:  # checked here once; the widths' fit in x is checked per call
            for name in ("halo_shape", "recv_buffer_shape", "send_buffer_shape"):
                setattr(self, name, _as_widths("HaloExchange", name, getattr(self, name), P_x.dim))
            neighbors(P_x)  # the neighbour table is built here, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return halo_exchange(x, self.P_x, self.halo_shape, self.recv_buffer_shape, self.send_buffer_shape)

    def extra_repr(self) -> str:
        return (f"P_x shape={self.P_x.shape}, halo_shape={self.halo_shape}, "
                f"recv_buffer_shape={self.recv_buffer_shape}, send_buffer_shape={self.send_buffer_shape}")
