"""Torch helpers."""

from __future__ import annotations

import functools
import numbers

import torch

__all__ = ["eager_when_compiled", "in_format", "memory_format", "zero_volume_tensor", "zeros_block"]


def eager_when_compiled(function):
    """Decorate a function that communicates so that torch.compile runs it eagerly, between compiled graphs
    (Dynamo cannot trace MPI, nor the tensor memory handed to it); outside torch.compile it costs ~0.05 us."""
    eager = torch.compiler.disable(function, reason="distdl communicates through MPI, outside compiled graphs (so "
                                   "fullgraph=True cannot hold it)")  # ~0.35 us a call even in eager mode

    @functools.wraps(function)
    def run(*args, **kwargs):
        return eager(*args, **kwargs) if torch.compiler.is_compiling() else function(*args, **kwargs)
    return run


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def memory_format(t: torch.Tensor) -> torch.memory_format:
    """Return the memory format torch's convolutions and pooling keep for an input ``t``: channels_last (or its 3-d
    form) where ``t`` is laid out so and not also plainly contiguous, else contiguous."""
    cl = _CHANNELS_LAST.get(t.dim())
    if cl is None:
        return torch.contiguous_format
    if not t.numel():  # every layout of an empty tensor is contiguous: tell by the strides
        made = [torch.empty(t.shape, device="meta", memory_format=f).stride() for f in (cl, torch.contiguous_format)]
        if t.stride() in made:  # made empty
            return cl if t.stride() == made[0] != made[1] else torch.contiguous_format
        # a slice of a larger tensor: channels innermost
        others = [s for d, (n, s) in enumerate(zip(t.shape, t.stride())) if d != 1 and n > 1]
        return cl if t.shape[1] > 1 and t.stride(1) == 1 and all(s > 1 for s in others) else torch.contiguous_format
    return cl if not t.is_contiguous() and t.is_contiguous(memory_format=cl) else torch.contiguous_format


def zeros_block(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return zeros of ``shape`` in ``like``'s memory format (and device; ``dtype`` or its), for an output block
    with nothing to compute (often zero-volume)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device, memory_format=memory_format(like)).zero_()


def in_format(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Return ``y`` in ``like``'s memory format (see :func:`memory_format`), copied only where it differs."""
    layout = memory_format(like)
    return y if layout is torch.contiguous_format or y.dim() != like.dim() else y.contiguous(memory_format=layout)


def zero_volume_tensor(b: int | None = None, dtype: torch.dtype | None = None, requires_grad: bool = False,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Return the placeholder of a worker holding no data: shape ``(0,)``, or ``(b, 0)`` to keep a batch.

    Raises:
        TypeError: a ``b`` that is neither None nor an int; ValueError: a negative ``b``.
    """
    if b is not None:
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(f"zero_volume_tensor: expected None or an int for b, got {b!r}")
        if b < 0:
            raise ValueError(f"zero_volume_tensor: expected b >= 0, got {b}")
        b = int(b)
    shape = (0,) if b is None else (b, 0)
    return torch.zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)
