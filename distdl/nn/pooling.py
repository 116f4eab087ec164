"""DistributedMaxPool1d/2d/3d and DistributedAvgPool1d/2d/3d: pooling of a tensor partitioned along any dimension.

Forward ``y_j = pool(W_j x)``, ``W_j`` the window exchange onto worker ``j``'s input window; adjoint
(input gradient) ``dx = sum_j W_j* pool'(W_j x)^T dy_j``. Each worker fetches the input window its
balanced block of the global output reads (``window_exchange``; halos of any width; nothing where
the windows lie in the blocks, as with ``stride == kernel_size`` and blocks a multiple of it) and
pools it. The parts of the window outside the global tensor are torch's padding where the window has
them on both sides (max pooling: wherever it has them on the left, cropping the outputs the surplus on the
right adds), and part of the window elsewhere: max pooling fills those with the lowest value (``-inf``);
average pooling sums the window and divides by torch's divisor for every output (padding counted or not,
``ceil_mode`` windows clipped), computed from the global geometry. The backward is autograd's through
``window_scatter_add``, the exchange's adjoint.

============================  =====================================================================
worker                        does
============================  =====================================================================
in P_x, non-empty output      fetches its window, pools it, returns its block of ``y``
in P_x, empty output block    serves others' windows, returns an empty block of the right shape
outside P_x                   passes and gets a zero-volume tensor
============================  =====================================================================
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from distdl.functional._common import check_flags, check_partition
from distdl.nn import _windows
from distdl.partition import MPIPartition
from distdl.utilities.torch import memory_format, zeros_block

__all__ = ["DistributedMaxPool1d", "DistributedMaxPool2d", "DistributedMaxPool3d",
           "DistributedAvgPool1d", "DistributedAvgPool2d", "DistributedAvgPool3d"]

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_AUTOCAST_DTYPES: dict = {}  # (device type, autocast dtype, input dtype, torch's op) -> the op's output dtype


def _pooled_dtype(x: torch.Tensor, pool) -> torch.dtype:
    """Return the dtype torch's pooling ``pool`` (such as F.max_pool3d) gives ``x``: its own, but under
    torch.autocast what autocast makes of the op (CPU autocast runs max_pool3d and avg_pool3d in float32), learnt
    once from the op on a one-element tensor."""
    kind = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(kind):
        return x.dtype
    key = (kind, torch.get_autocast_dtype(kind), x.dtype, pool)
    if key not in _AUTOCAST_DTYPES:
        _AUTOCAST_DTYPES[key] = pool(torch.zeros((1, 1) + (1,) * (x.dim() - 2), dtype=x.dtype, device=x.device),
                                     1).dtype
    return _AUTOCAST_DTYPES[key]

Size = int | tuple[int, ...]


class _DistributedPoolNd(torch.nn.Module):
    """Pool ``(N, C, *spatial)`` tensors partitioned by ``P_x`` (``d + 2`` dimensions; any axis may be split).

    Args, their order and defaults are torch's (``stride=None`` or empty: the kernel size); the max pools reject
    ``return_indices=True`` (indices would be local to the window), and the average pools accept
    ``divisor_override`` in 1-d too.
    Raises:
        ValueError: a partition of the wrong dimension, or arguments torch would reject.
    """

    dims: int
    # torch pads the left edge itself wherever a window holds some of it (the surplus on the right adds outputs,
    # cropped): a max pool's padding of -inf inside the window won ties with inputs of -inf (torch's index starts
    # at the first element inside the input), so a window of -inf at the edge sent its gradient nowhere
    _pads_left = False

    def _setup(self, P_x: MPIPartition, kernel_size: Size, stride: Size | None, padding: Size, dilation: Size,
               ceil_mode: bool) -> None:
        name, d = type(self).__name__, self.dims
        check_partition(name, "P_x", P_x)
        if P_x.dim != d + 2:
            raise ValueError(f"{name}: expected a partition of {d + 2} dimensions, got shape {P_x.shape}")
        self.P_x = P_x
        self.kernel_size = _windows.as_tuple(name, "kernel_size", kernel_size, d, minimum=1)
        default = stride is None or (isinstance(stride, (tuple, list)) and not stride)  # torch: () too
        self.stride = _windows.as_tuple(name, "stride", kernel_size if default else stride, d, minimum=1)
        self.padding = _windows.as_tuple(name, "padding", padding, d)
        self.dilation = _windows.as_tuple(name, "dilation", dilation, d, minimum=1)
        (self.ceil_mode,) = check_flags(name, ceil_mode=ceil_mode)
        if any(p > k // 2 for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(f"{name}: expected padding at most half the kernel size {self.kernel_size}, "
                             f"got {self.padding}")

    def _length(self, k: int, n: int) -> int:
        p = self.padding[k]
        return _windows.sliding_length(n, self.kernel_size[k], self.stride[k], p, p, self.dilation[k], self.ceil_mode)

    def _source(self, k: int, n: int, length: int, o0: int, o1: int) -> tuple[int, int]:
        return _windows.sliding_source(o0, o1, self.kernel_size[k], self.stride[k], self.padding[k], self.dilation[k])

    def _windowed(self, x: torch.Tensor):
        """Return ``(plan, window, output block shape)``, or ``(None, copy, None)`` outside ``P_x``."""
        name = type(self).__name__
        _windows.check_input(name, x, self.P_x)
        if not self.P_x.active:
            return None, x.clone(), None
        key = ("pool", self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode) + self._options()
        padded_stride = (float("inf"),) * self.dims if self._pads_left else self.stride
        plan, window = _windows.fetch(name, x, self.P_x, key, None, self._length, self._source, padded_stride)
        return plan, window, tuple(b - a for a, b in plan.block)

    def _options(self) -> tuple:
        """Return the options besides the window's geometry that every worker must share (check mode compares
        them with the geometry)."""
        return ()

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}, P_x shape={self.P_x.shape}")


class _DistributedMaxPoolNd(_DistributedPoolNd):
    _pads_left = True

    def __init__(self, P_x: MPIPartition, kernel_size: Size, stride: Size | None = None, padding: Size = 0,
                 dilation: Size = 1, return_indices: bool = False, ceil_mode: bool = False) -> None:
        super().__init__()
        self._setup(P_x, kernel_size, stride, padding, dilation, ceil_mode)
        if check_flags(type(self).__name__, return_indices=return_indices)[0]:
            raise ValueError(f"{type(self).__name__}: expected return_indices=False (indices would be local to "
                             "each worker's window)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of the max pooling; zero-volume outside ``P_x``."""
        if x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{type(self).__name__}: expected a real tensor, got {x.dtype}")
        plan, window, shape = self._windowed(x)
        if plan is None:
            return window
        if 0 in shape:
            return _windows.connect(zeros_block(shape, x, _pooled_dtype(x, _MAX[self.dims])), window)
        inside = None
        for k, ((a, b), n) in enumerate(zip(plan.window[2:], plan.x_shape[2:])):
            if a < 0 or b > n:
                index = torch.arange(a, b, device=x.device).view((-1,) + (1,) * (self.dims - 1 - k))
                mask = (index >= 0) & (index < n)
                inside = mask if inside is None else inside & mask
        lowest = -torch.inf if window.is_floating_point() else torch.iinfo(window.dtype).min
        if inside is not None:
            window = torch.where(inside, window, lowest)  # keeps channels_last (masked_fill does not)
        padding = plan.padding
        if any(padding) and any(d > 1 for d in self.dilation) and self._wholly_outside(plan):
            # A dilated window may lie wholly in torch's padding, where torch's index points past the input and its
            # backward writes there (another plane's gradient, or past the buffer): pad here instead, so that the
            # index points into the pad, whose gradient F.pad's backward drops. Only then: a pad of -inf in the
            # window wins ties with inputs of -inf, as masked ones do (see _pads_left).
            window, padding = F.pad(window, [p for side in reversed(padding) for p in (side, side)],
                                    value=lowest), (0,) * self.dims
        if self.dims == 1:  # through the 2-d kernel, which also takes integer tensors (torch's 1-d one does not)
            y = F.max_pool2d(window.unsqueeze(-2), (1,) + self.kernel_size, (1,) + self.stride, (0, *padding),
                             (1,) + self.dilation).squeeze(-2)
        else:
            y = _MAX[self.dims](window, self.kernel_size, self.stride, padding, self.dilation)
        if y.shape[2:] != shape[2:]:  # dense in torch's output's format, as torch's output (y.view works)
            y = y[(slice(None),) * 2 + tuple(slice(0, n) for n in shape[2:])].contiguous(memory_format=memory_format(y))
        return y

    def _wholly_outside(self, plan: _windows.Plan) -> bool:
        """Whether the window of one of this worker's outputs lies wholly outside the input along a dimension."""
        for k, ((o0, o1), n) in enumerate(zip(plan.block[2:], plan.x_shape[2:])):
            taps = (np.arange(o0, o1)[:, None] * self.stride[k] - self.padding[k]
                    + np.arange(self.kernel_size[k]) * self.dilation[k])
            if ((taps < 0) | (taps >= n)).all(axis=1).any():
                return True
        return False


class _DistributedAvgPoolNd(_DistributedPoolNd):

    def __init__(self, P_x: MPIPartition, kernel_size: Size, stride: Size | None = None, padding: Size = 0,
                 ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None) -> None:
        super().__init__()
        self._setup(P_x, kernel_size, stride, padding, 1, ceil_mode)
        (self.count_include_pad,) = check_flags(type(self).__name__, count_include_pad=count_include_pad)
        if divisor_override is not None and (isinstance(divisor_override, bool) or not isinstance(
                divisor_override, (int, np.integer)) or divisor_override == 0):
            raise ValueError(f"{type(self).__name__}: expected divisor_override as a non-zero int (or None), got "
                             f"{divisor_override!r}")  # torch takes a negative one too
        self.divisor_override = None if divisor_override is None else int(divisor_override)

    def _divisor(self, plan: _windows.Plan) -> np.ndarray:
        """Return torch's divisor of every output of this worker's block (broadcastable over N and C)."""
        divisor = np.ones((1, 1) + (1,) * self.dims, dtype=np.int64)
        for k, ((o0, o1), n) in enumerate(zip(plan.block[2:], plan.x_shape[2:])):
            start = np.arange(o0, o1) * self.stride[k] - self.padding[k]
            stop = np.minimum(start + self.kernel_size[k], n + self.padding[k])
            if not self.count_include_pad:
                start, stop = np.maximum(start, 0), np.minimum(stop, n)
            divisor = divisor * np.maximum(stop - start, 1).reshape((-1,) + (1,) * (self.dims - 1 - k))
        return divisor

    def _options(self) -> tuple:
        return self.count_include_pad, self.divisor_override

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of the average pooling; zero-volume outside ``P_x``."""
        if x.is_complex() or x.dtype == torch.bool or (not x.is_floating_point() and x.dtype != torch.int64):
            raise TypeError(f"{type(self).__name__}: expected a floating-point or int64 tensor, got {x.dtype}")
        plan, window, shape = self._windowed(x)
        if plan is None:
            return window
        if 0 in shape:
            return _windows.connect(zeros_block(shape, x, _pooled_dtype(x, _AVG[self.dims])), window)
        compute = torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else x.dtype
        window = window.to(compute)
        if self.dims == 1:  # a sum pooling: torch's average with divisor 1
            sums = F.avg_pool2d(window.unsqueeze(-2), (1,) + self.kernel_size, (1,) + self.stride,
                                (0,) + plan.padding, False, True, 1).squeeze(-2)
        elif self.dims == 2:
            sums = F.avg_pool2d(window, self.kernel_size, self.stride, plan.padding, False, True, 1)
        else:  # torch's avg_pool3d refuses an input smaller than the kernel even where the padding makes up for it
            padding = plan.padding
            if any(n < k for n, k in zip(window.shape[2:], self.kernel_size)):
                window, padding = F.pad(window, [p for side in reversed(padding) for p in (side, side)]), (0, 0, 0)
            sums = F.avg_pool3d(window, self.kernel_size, self.stride, padding, False, True, 1)
        divisor = self.divisor_override or torch.from_numpy(
            self.P_x._memo_recent("avg divisor", (self.kernel_size, self.stride, self.padding, self.ceil_mode,
                                                  self.count_include_pad, plan.x_shape), lambda: self._divisor(plan),
                                  32)  # each as large as the output block
        ).to(device=x.device, dtype=compute)
        y = sums / divisor if x.is_floating_point() else torch.div(sums, divisor, rounding_mode="trunc")
        return y.to(_pooled_dtype(x, _AVG[self.dims]))

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"ceil_mode={self.ceil_mode}, count_include_pad={self.count_include_pad}, "
                f"divisor_override={self.divisor_override}, P_x shape={self.P_x.shape}")


class DistributedMaxPool1d(_DistributedMaxPoolNd):
    """Max-pool ``(N, C, L)`` tensors partitioned by ``P_x``."""
    dims = 1


class DistributedMaxPool2d(_DistributedMaxPoolNd):
    """Max-pool ``(N, C, H, W)`` tensors partitioned by ``P_x``."""
    dims = 2


class DistributedMaxPool3d(_DistributedMaxPoolNd):
    """Max-pool ``(N, C, D, H, W)`` tensors partitioned by ``P_x``."""
    dims = 3


class DistributedAvgPool1d(_DistributedAvgPoolNd):
    """Average-pool ``(N, C, L)`` tensors partitioned by ``P_x``."""
    dims = 1


class DistributedAvgPool2d(_DistributedAvgPoolNd):
    """Average-pool ``(N, C, H, W)`` tensors partitioned by ``P_x``."""
    dims = 2


class DistributedAvgPool3d(_DistributedAvgPoolNd):
    """Average-pool ``(N, C, D, H, W)`` tensors partitioned by ``P_x``."""
    dims = 3
