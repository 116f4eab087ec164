"""DistributedUpsample: nearest and (bi/tri)linear upsampling of a tensor partitioned along any dimension.

Forward ``y_j = I_j W_j x``, ``W_j`` the window exchange onto worker ``j``'s input window and
``I_j`` the (linear) interpolation from it; adjoint ``dx = sum_j W_j* I_j^T dy_j``. Every output
index has a known source (torch's coordinate formulas, reproduced in the same floating-point
precision), so each worker fetches only the input window its balanced block of the global output
reads (``window_exchange``) and gathers from it (nearest) or blends the two neighbours per
dimension, last dimension first (linear; equal to torch's up to rounding). The backward is autograd's through
``window_scatter_add``, the exchange's adjoint.

============================  =====================================================================
worker                        does
============================  =====================================================================
in P_x, non-empty output      fetches its window, interpolates it, returns its block of ``y``
in P_x, empty output block    serves others' windows, returns an empty block of the right shape
outside P_x                   passes and gets a zero-volume tensor
============================  =====================================================================
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import numpy as np
import torch

from distdl.functional._common import check_flags, check_partition
from distdl.nn import _windows
from distdl.partition import MPIPartition
from distdl.utilities.torch import in_format, zeros_block

__all__ = ["DistributedUpsample"]

_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}


def coordinates(mode: str, align_corners: bool, n: int, length: int, scale_factor: float | None,
                dtype: torch.dtype, spatial: int) -> tuple[np.ndarray, ...]:
    """Return torch's sources of ``length`` outputs from ``n`` inputs: ``(index,)`` for the nearest modes,
    ``(index0, index1, lambda0, lambda1)`` for linear; computed as torch's CPU kernels do for ``dtype``
    (in float64 for float64, else float32; ``scale * (i + 0.5) - 0.5`` rounded once, as the fused
    multiply-add the compiled kernels use) with ``spatial`` spatial dimensions. torch's 2-d 'nearest'
    forward copies when ``length == n`` and halves when ``length == 2 * n``, whatever the scale factor; its
    1-d and 3-d forwards do not (their backwards do, so there torch's gradient is not its forward's adjoint:
    distdl's is)."""
    real = np.float64 if dtype == torch.float64 else np.float32
    out = np.arange(length, dtype=real)
    if mode != "nearest" and align_corners:
        scale = real(n - 1) / real(length - 1) if length > 1 else real(0)
    elif scale_factor is not None and scale_factor > 0:
        scale = real(1.0 / scale_factor)
    else:
        scale = real(n) / real(length)
    if mode == "nearest":
        if spatial == 2 and length in (n, 2 * n):
            return (np.arange(length, dtype=np.int64) // (length // n),)
        return (np.minimum(np.floor((scale * out).astype(np.float32)).astype(np.int64), n - 1),)
    if align_corners:
        source = scale * out
    elif real is np.float32:  # exact in float64, then rounded once
        source = ((out.astype(np.float64) + 0.5) * np.float64(scale) - 0.5).astype(real)
    else:
        exact = Fraction(float(scale))
        source = np.array([float(exact * (i + Fraction(1, 2)) - Fraction(1, 2)) for i in range(length)])
    source = np.maximum(source, real(0)).astype(real)
    if mode == "nearest-exact":
        return (np.minimum(np.floor((source.astype(np.float64) + 0.5).astype(np.float32)).astype(np.int64), n - 1),)
    if length == n:  # torch copies
        index = np.arange(n, dtype=np.int64)
        return index, index, np.ones(n, dtype=real), np.zeros(n, dtype=real)
    index0 = np.minimum(np.floor(source.astype(np.float32)).astype(np.int64), n - 1)
    lambda1 = np.clip(source - index0.astype(real), real(0), real(1)).astype(real)
    return index0, index0 + (index0 < n - 1), (real(1) - lambda1).astype(real), lambda1


def _factor(f: object) -> float | None:
    """Return a scale factor as a float, or None unless it is a finite positive number as torch takes them (Python
    and NumPy numbers, 0-d tensors)."""
    if isinstance(f, torch.Tensor) and f.dim() == 0 and f.dtype != torch.bool and not f.is_complex():
        f = f.item()
    if not isinstance(f, numbers.Real) or isinstance(f, bool):
        return None
    return float(f) if 0 < f < math.inf else None


class DistributedUpsample(torch.nn.Module):
    """Upsample ``(N, C, *spatial)`` tensors partitioned by ``P_x`` (any axis may be split).

    Args:
        P_x: the input (and output) partition, of dimension 3 to 5.
        size: the global output's spatial extents, an int or one per spatial dimension (DistDL took the whole
            output shape, batch and channels included).
        scale_factor: torch's; exactly one of ``size`` and ``scale_factor``.
        mode: ``'nearest'``, ``'nearest-exact'``, or ``'linear'``/``'bilinear'``/``'trilinear'`` for 1/2/3
            spatial dimensions (as torch's: ``'linear'`` is not DistDL's N-linear).
        align_corners: None with the nearest modes, as torch's (DistDL's default False is refused).
        recompute_scale_factor: with ``scale_factor``, ``True`` interpolates at the scale of the output extents
            (``n / floor(n * scale_factor)``), ``False`` or ``None`` at ``scale_factor`` itself, as torch's.
    Raises:
        ValueError: a partition of the wrong dimension, an unsupported mode, or arguments torch would reject.
        TypeError: an ``align_corners`` or ``recompute_scale_factor`` that is neither None nor a bool.
    """

    def __init__(self, P_x: MPIPartition, size: int | tuple[int, ...] | None = None,
                 scale_factor: float | tuple[float, ...] | None = None, mode: str = "nearest",
                 align_corners: bool | None = None, recompute_scale_factor: bool | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        check_partition(name, "P_x", P_x)
        d = P_x.dim - 2
        if not 1 <= d <= 3:
            raise ValueError(f"{name}: expected a partition of 3 to 5 dimensions, got shape {P_x.shape}")
        if mode not in ("nearest", "nearest-exact") and _LINEAR.get(mode) != d:
            raise ValueError(f"{name}: expected mode 'nearest', 'nearest-exact' or "
                             f"{['linear', 'bilinear', 'trilinear'][d - 1]!r} for {d} spatial dimensions, got {mode!r}")
        for flag, value in (("align_corners", align_corners), ("recompute_scale_factor", recompute_scale_factor)):
            if value is not None:
                check_flags(name, **{flag: value})  # torch takes a string "False" as True here
        if mode.startswith("nearest") and align_corners is not None:
            raise ValueError(f"{name}: expected align_corners=None with mode {mode!r}, got {align_corners!r}")
        if (size is None) == (scale_factor is None):
            raise ValueError(f"{name}: expected exactly one of size and scale_factor, got size={size!r}, "
                             f"scale_factor={scale_factor!r}")
        if size is not None and recompute_scale_factor:
            raise ValueError(f"{name}: expected recompute_scale_factor only with scale_factor (as torch), got it "
                             f"with size={size!r}")
        self.P_x, self.mode, self.align_corners = P_x, mode, align_corners
        self.size = None if size is None else _windows.as_tuple(name, "size", size, d, minimum=1)
        self.scale_factor = None
        if scale_factor is not None:
            single = _factor(scale_factor)
            factors = [single] * d if single else \
                [_factor(f) for f in scale_factor] if isinstance(scale_factor, (tuple, list)) else []
            if len(factors) != d or not all(factors):
                raise ValueError(f"{name}: expected scale_factor as a positive number or {d} of them, "
                                 f"got {scale_factor!r}")
            self.scale_factor = tuple(factors)
        self.recompute_scale_factor = recompute_scale_factor

    def _length(self, k: int, n: int) -> int:
        return self.size[k] if self.size is not None else math.floor(n * self.scale_factor[k])

    def _coordinates(self, k: int, n: int, length: int, dtype: torch.dtype) -> tuple[np.ndarray, ...]:
        scale = None if self.scale_factor is None or self.recompute_scale_factor else self.scale_factor[k]
        key = (self.mode, bool(self.align_corners), n, length, scale, dtype == torch.float64)
        return self.P_x._memo_recent("upsample", key, lambda: coordinates(
            self.mode, bool(self.align_corners), n, length, scale, dtype, self.P_x.dim - 2), 32)  # O(length) each

    def _source(self, k: int, n: int, length: int, o0: int, o1: int, dtype: torch.dtype) -> tuple[int, int]:
        sources = self._coordinates(k, n, length, dtype)
        return int(sources[0][o0]), int(sources[0 if len(sources) == 1 else 1][o1 - 1]) + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of the upsampled tensor; zero-volume outside ``P_x``."""
        name = type(self).__name__
        _windows.check_input(name, x, self.P_x)
        if not self.P_x.active:
            return x.clone()
        if not self.mode.startswith("nearest") and not x.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor for mode {self.mode!r}, got {x.dtype}")
        precision = x.dtype == torch.float64
        key = ("upsample", self.size, self.scale_factor, self.recompute_scale_factor, self.mode,
               bool(self.align_corners), precision)
        plan, window = _windows.fetch(name, x, self.P_x, key, None, self._length,
                                      lambda k, n, length, o0, o1: self._source(k, n, length, o0, o1, x.dtype))
        shape = tuple(b - a for a, b in plan.block)
        if 0 in shape:
            return _windows.connect(zeros_block(shape, x), window, reads_input=False)
        y, compute = window, torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else x.dtype
        for k in reversed(range(self.P_x.dim - 2)):  # the last dimension first, as torch
            dim, (o0, o1), start = 2 + k, plan.block[2 + k], plan.window[2 + k][0]
            sources = [s[o0:o1] for s in self._coordinates(k, plan.x_shape[dim], plan.y_shape[dim], x.dtype)]
            index = [torch.from_numpy(s - start).to(x.device) for s in sources[:len(sources) // 2 or 1]]
            if len(sources) == 1:
                y = y.index_select(dim, index[0])
                continue
            view = (-1,) + (1,) * (y.dim() - 1 - dim)
            lambda0, lambda1 = (torch.from_numpy(s).to(x.device, x.dtype).to(compute).view(view) for s in sources[2:])
            y = y.to(compute)
            y = y.index_select(dim, index[0]) * lambda0 + y.index_select(dim, index[1]) * lambda1
        return in_format(y.to(x.dtype), x)  # channels_last stays so, as with torch's

    def extra_repr(self) -> str:
        # as torch's: the size or the scale factor (whichever was given), the mode; then what else was given
        info = f"size={self.size}" if self.scale_factor is None else f"scale_factor={self.scale_factor}"
        corners = "" if self.align_corners is None else f", align_corners={self.align_corners}"
        return f"{info}, mode={self.mode!r}{corners}, P_x shape={self.P_x.shape}"
