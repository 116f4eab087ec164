"""DistributedChannelConv1d/2d/3d: convolution of a tensor partitioned along its channels.

Forward ``y = SumReduce(P_w -> P_y)(conv(Broadcast(P_x -> P_w)(x), W_ij) + [j == 0] b_i)``, as
:class:`~distdl.nn.linear.DistributedLinear`: ``x`` (N, C_in, *spatial) is split on input channels over
``P_x`` of shape ``(1, P_ci, 1, ...)``, worker ``(i, j)`` of ``P_w`` of shape ``(P_co, P_ci, 1, ...)`` holds
``W[out_block_i, in_block_j]`` (and, where ``j == 0``, the bias block ``b[out_block_i]``, added once), and
``y`` is split on output channels over ``P_y`` of shape ``(1, P_co, 1, ...)``. For the sum, ``P_y`` is seen as
``(P_co, 1, 1, ...)`` (its axis 1 is ``P_w``'s axis 0). Spatial dimensions are whole on every worker, so every
torch ``padding_mode`` works. Backward is the adjoint of each step.

==========================  =================================================================
worker                      does
==========================  =================================================================
in P_x                      sends its channels of ``x`` to column ``j`` of ``P_w``
in P_w                      convolves the block it receives with its weight block
in P_y                      receives the sum over its row of ``P_w``
in none of them             passes and gets a zero-volume tensor; holds zero-volume parameters
==========================  =================================================================

Default initialisation is torch's for the GLOBAL weight (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``); every
block is cut from one draw shared by all workers. Every worker's output is in the autograd graph (when grad
mode is on), so ``backward()`` on every worker takes part in every collective behind it; no worker can know
whether the others' inputs need a gradient, so an input that needs none (a first layer's) still gets one,
computed and discarded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distdl.functional._common import (check_flags, check_idle_input, check_partition, check_tensor, idle_output,
                                       in_graph)
from distdl.functional.all_sum_reduce import fibre
from distdl.functional.broadcast import broadcast, broadcast_plan
from distdl.functional.invariant import all_sum_reduce_backward
from distdl.functional.sum_reduce import reduction_plan, sum_reduce
from distdl.nn import _windows
from distdl.nn.conv_feature import positive_ints
from distdl.nn.linear import global_block, shared_seed, uniform
from distdl.nn.module import CollectStateMixin, StateLayout
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_subshape
from distdl.utilities.torch import in_format, zeros_block

__all__ = ["DistributedChannelConv1d", "DistributedChannelConv2d", "DistributedChannelConv3d"]


def regrid(P: MPIPartition, shape: tuple[int, ...]) -> MPIPartition:
    """Return the workers of ``P`` (same rank order) as a grid of ``shape``; ``P`` itself if it has it; built once."""
    shape = tuple(int(n) for n in shape)
    return P if P.shape == shape else P._memo(("regrid", shape), lambda: P.create_cartesian_topology_partition(shape))


class _BlockConvNd(CollectStateMixin, torch.nn.Module):
    """Broadcast x from ``_X`` onto ``_W``, convolve with the weight blocks, sum-reduce onto ``_Y``.

    Subclasses set ``padding_modes`` and define ``_layout`` (check the partitions, return ``_X``, ``_W``, ``_Y``
    and the axes of ``P_w`` holding output and input channels) and ``_window`` (what each worker broadcasts).
    """

    dims: int
    padding_modes: tuple[str, ...]

    def __init__(self, P_x: MPIPartition, P_y: MPIPartition, P_w: MPIPartition, in_channels: int, out_channels: int,
                 kernel_size: int | tuple[int, ...], stride: int | tuple[int, ...] = 1,
                 padding: int | tuple[int, ...] | str = 0, dilation: int | tuple[int, ...] = 1, groups: int = 1,
                 bias: bool = True, padding_mode: str = "zeros", collect_state: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        name, d = type(self).__name__, self.dims
        for label, P in (("P_x", P_x), ("P_y", P_y), ("P_w", P_w)):
            check_partition(name, label, P)
        in_channels, out_channels, groups = positive_ints(name, in_channels=in_channels, out_channels=out_channels,
                                                          groups=groups)
        if groups != 1:
            raise ValueError(f"{name}: expected groups=1 (the only value supported), got {groups}")
        self.use_bias, self.collect_state = check_flags(name, bias=bias, collect_state=collect_state)
        if padding_mode not in self.padding_modes:
            raise ValueError(f"{name}: expected padding_mode in {list(self.padding_modes)}, got {padding_mode!r}")
        self.kernel_size = _windows.as_tuple(name, "kernel_size", kernel_size, d, minimum=1)
        self.stride = _windows.as_tuple(name, "stride", stride, d, minimum=1)
        self.dilation = _windows.as_tuple(name, "dilation", dilation, d, minimum=1)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"{name}: expected padding 'same', 'valid' or ints, got {padding!r}")
            if padding == "same" and any(s != 1 for s in self.stride):
                raise ValueError(f"{name}: expected stride 1 with padding='same', got stride={stride!r}")
            total = [dl * (k - 1) if padding == "same" else 0 for k, dl in zip(self.kernel_size, self.dilation)]
            self.padding, self._pads = padding, tuple((t // 2, t - t // 2) for t in total)
        else:
            self.padding = _windows.as_tuple(name, "padding", padding, d)
            self._pads = tuple((p, p) for p in self.padding)
        self.P_x, self.P_y, self.P_w, self.padding_mode = P_x, P_y, P_w, padding_mode
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self._X, self._W, self._Y, (co, ci) = self._layout(name, P_x, P_y, P_w)
        self._channel_axes = (co, ci)
        self._replicated = tuple(a for a in range(P_w.dim) if a not in (co, ci) and P_w.shape[a] > 1)
        broadcast_plan(self._X, self._W, False, False)  # the communicators are built here, once
        reduction_plan(self._W, self._Y, False, False)
        if self._replicated:
            fibre(P_w, self._replicated)
        self._start, size = (0,) * (d + 2), (0, in_channels) + self.kernel_size  # see [1] in distdl/nn/linear.py
        if P_w.active:
            grid, at = (P_w.shape[co], P_w.shape[ci]), (P_w.index[co], P_w.index[ci])
            self._start = tuple(int(n) for n in compute_start_index(grid, at, (out_channels, in_channels))) + (0,) * d
            size = tuple(int(n) for n in compute_subshape(grid, at, (out_channels, in_channels))) + self.kernel_size
        self.holds_bias = self.use_bias and P_w.active and P_w.index[ci] == 0
        factory = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(size, **factory))
        bias_block = torch.nn.Parameter(torch.empty(size[:1], **factory)) if self.holds_bias else None
        self.register_parameter("bias", bias_block)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every block from one global torch-style initialisation (collective over ``P_w``)."""
        seed = shared_seed(self.P_w)
        bound = 1 / math.sqrt(self.in_channels * math.prod(self.kernel_size))
        shape = (self.out_channels, self.in_channels) + self.kernel_size
        self.weight.copy_(global_block(shape, self._start, self.weight.shape, uniform(bound), seed))
        if self.bias is not None:
            self.bias.copy_(global_block(shape[:1], self._start[:1], self.bias.shape, uniform(bound), seed + 1))

    def _state_layouts(self) -> dict[str, StateLayout]:
        co, ci = self._channel_axes
        return {"weight": StateLayout((self.out_channels, self.in_channels) + self.kernel_size,
                                      (co, ci) + (None,) * self.dims),
                "bias": StateLayout((self.out_channels,), (co,), first=(ci,))}

    def _state_partition(self) -> MPIPartition:
        return self.P_w  # the parameters live on P_w

    def _held_elsewhere(self) -> set[str]:
        return {"bias"} if self.use_bias and not self.holds_bias else set()  # column 0 of P_w holds the bias

    def _check_block(self, name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
        """Check this worker's block of ``x`` (a worker of ``P_x``; no communication) against the weight's
        ``dtype``."""
        where = f"on worker {self.P_x._root.rank}"
        if x.dim() != self.dims + 2:
            raise ValueError(f"{name}: expected a tensor of {self.dims + 2} dimensions, got shape {tuple(x.shape)} "
                             f"{where}")
        channels = int(compute_subshape(self.P_x.shape[1], self.P_x.index[1], self.in_channels)[0])
        if x.shape[1] != channels:
            raise ValueError(f"{name}: expected {channels} channels (dimension 1: this worker's block of "
                             f"{self.in_channels} over P_x of shape {self.P_x.shape}), got shape {tuple(x.shape)} "
                             f"{where}")
        if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):  # autocast casts both
            raise TypeError(f"{name}: expected a tensor of dtype {dtype} (the weight's), got {x.dtype}")

    def _replicated_settings(self) -> dict[str, object]:
        # the channel form exchanges no window, whose check would compare these
        return {"geometry": (self.kernel_size, self.stride, self._pads, self.dilation, self.padding_mode)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of ``y``. Outside ``P_y`` it is zero-volume and, as DistDL's, keeps the batch
        extent of the block this worker sent or multiplied, ``(batch, 0)`` (so ``y.view(y.size(0), -1)`` works)."""
        name = type(self).__name__
        self._verify_replicas(name)  # copies of a block along P_w's batch and spatial axes (the general convolution)
        check_tensor(name, x)
        check_idle_input(name, self.P_x, x)
        weight = self.weight  # once: a parametrization computes it at each read
        if self.P_x.active:
            self._check_block(name, x, weight.dtype)
        else:
            x = x.to(weight.dtype)
        x = in_graph(x)  # join the graph, so every worker runs backward
        x_w = broadcast(self._window(name, x), self._X, self._W)
        if self.P_w.active:
            x_w = self._local(x_w, weight)
        else:  # a double backward reaches the broadcast here too, as on P_w (see idle_output)
            x_w = idle_output(x_w)
        return in_format(sum_reduce(x_w, self._W, self._Y), x)  # channels_last stays so, as with torch's

    def _local(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Return this worker's partial sum: its input block convolved with its ``weight`` block (plus bias)."""
        bias = self.bias
        if self._replicated:  # copies of one block on several workers: their gradients are summed
            flat = torch.cat([weight.flatten()] + ([bias] if bias is not None else []))
            flat = all_sum_reduce_backward(flat, self.P_w, axes_reduce=self._replicated)
            weight, bias = flat[:weight.numel()].view_as(weight), (flat[weight.numel():] if bias is not None else None)
        pads = self._local_pads()
        shape = (x.shape[0], weight.shape[0]) + tuple(
            _windows.sliding_length(n, k, s, left, right, dl)
            for n, k, s, (left, right), dl in zip(x.shape[2:], self.kernel_size, self.stride, pads, self.dilation))
        if x.numel() == 0 or weight.numel() == 0 or 0 in shape:  # still joined to the graph
            return _windows.connect(zeros_block(shape, x, _windows.conv_dtype(x, weight)), x, weight, bias)
        if self.padding_mode == "zeros" and all(left == right for left, right in pads):
            return _windows.convolve(self.dims, x, weight, bias, self.stride, tuple(left for left, _ in pads),
                                    self.dilation)
        flat_pads = tuple(p for pair in reversed(pads) for p in pair)
        x = F.pad(x, flat_pads, mode="constant" if self.padding_mode == "zeros" else self.padding_mode)
        return _windows.convolve(self.dims, x, weight, bias, self.stride, 0, self.dilation)

    def _local_pads(self) -> tuple[tuple[int, int], ...]:
        return self._pads

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, bias={self.use_bias}, "
                f"padding_mode={self.padding_mode}, P_x shape={self.P_x.shape}, P_y shape={self.P_y.shape}, "
                f"P_w shape={self.P_w.shape}, local weight shape={tuple(self.weight.shape)}")


class _DistributedChannelConvNd(_BlockConvNd):
    """Convolve ``(N, C, *spatial)`` tensors split on channels: ``x`` over ``P_x`` (1, P_ci, 1, ...), the weight
    over ``P_w`` (P_co, P_ci, 1, ...), ``y`` over ``P_y`` (1, P_co, 1, ...); the partitions may lie on any workers.

    Args:
        P_x, P_y, P_w: the partitions of the input, output and weight (of ``d + 2`` dimensions).
        in_channels, out_channels: the GLOBAL channel counts (balanced blocks, unevenly if need be).
        collect_state: ``state_dict()`` on rank 0 of the root partition holds torch's keys and global shapes,
            and ``load_state_dict()`` takes that rank's values (see :mod:`distdl.nn.module`).
        The other arguments are torch's; ``groups`` must be 1.
    Raises:
        ValueError: partitions of the wrong shapes, ``groups != 1``, or arguments torch would reject.
        TypeError: arguments of the wrong types.
    """

    padding_modes = ("zeros", "reflect", "replicate", "circular")

    def _layout(self, name, P_x, P_y, P_w):
        d, ones = self.dims, (1,) * self.dims
        if (P_w.dim != d + 2 or P_w.shape[2:] != ones or P_x.shape != (1, P_w.shape[1]) + ones
                or P_y.shape != (1, P_w.shape[0]) + ones):
            spatial = ", 1" * d
            raise ValueError(f"{name}: expected P_w of shape (P_co, P_ci{spatial}), P_x of shape (1, P_ci{spatial}) "
                             f"and P_y of shape (1, P_co{spatial}), got P_x {P_x.shape}, P_y {P_y.shape} and "
                             f"P_w {P_w.shape}")
        return P_x, P_w, regrid(P_y, (P_w.shape[0], 1) + ones), (0, 1)

    def _check_block(self, name, x, dtype):
        super()._check_block(name, x, dtype)
        spatial = x.shape[2:]
        if any(_windows.sliding_length(n, k, s, left, right, dl) < 1 for n, k, s, (left, right), dl
               in zip(spatial, self.kernel_size, self.stride, self._pads, self.dilation)):
            raise ValueError(f"{name}: expected an input large enough for an output, got shape {tuple(x.shape)}")
        limit = {"reflect": 1, "circular": 0}.get(self.padding_mode)
        if limit is not None and any(max(pair) > n - limit for n, pair in zip(spatial, self._pads)):
            raise ValueError(f"{name}: expected padding {self._pads} {'below' if limit else 'at most'} the spatial "
                             f"extents for padding_mode {self.padding_mode!r}, got shape {tuple(x.shape)}")

    def _window(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x


class DistributedChannelConv1d(_DistributedChannelConvNd):
    """Convolve ``(N, C, L)`` tensors partitioned along channels."""
    dims = 1


class DistributedChannelConv2d(_DistributedChannelConvNd):
    """Convolve ``(N, C, H, W)`` tensors partitioned along channels."""
    dims = 2


class DistributedChannelConv3d(_DistributedChannelConvNd):
    """Convolve ``(N, C, D, H, W)`` tensors partitioned along channels."""
    dims = 3
