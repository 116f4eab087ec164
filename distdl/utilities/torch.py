"""Torch helpers."""

from __future__ import annotations

import torch

__all__ = ["zero_volume_tensor"]


def zero_volume_tensor(b: int | None = None, dtype: torch.dtype | None = None, requires_grad: bool = False,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Return the placeholder of a worker holding no data: shape ``(0,)``, or ``(b, 0)`` to keep a batch."""
    shape = (0,) if b is None else (b, 0)
    return torch.zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)
