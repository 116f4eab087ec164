"""DistributedFeatureConv1d/2d/3d: convolution of a tensor partitioned along its batch and spatial dimensions.

Forward ``y_j = conv(W_j x, w) + b``, ``W_j`` the window exchange onto worker ``j``'s input window;
adjoint (input gradient) ``dx = sum_j W_j* conv^T(dy_j, w)``, ``dw = sum_j conv_w^T(W_j x, dy_j)``.
Each worker fetches the input window its balanced block of the global output reads
(``window_exchange``: halos of any width, so blocks smaller than the halo work) and convolves it;
the zeros past the global edges are torch's padding where the window has them on both sides (the
unsplit dimensions, one worker), and part of the window elsewhere. ``w`` and ``b`` are replicated on
every worker of ``P_x`` and enter through one ``all_sum_reduce_backward``, so their gradients are the
totals; the input gradient comes back through ``window_scatter_add`` (only where some worker's input
needs one).

============================  =====================================================================
worker                        does
============================  =====================================================================
in P_x, non-empty output      fetches its window, convolves it, returns its block of ``y``
in P_x, empty output block    serves others' windows, returns an empty block of the right shape
outside P_x                   passes and gets a zero-volume tensor; holds unused parameters
============================  =====================================================================
"""

from __future__ import annotations

import math

import numpy as np
import torch

from distdl.backends import mpi as transport
from distdl.checks import check_mode, verify
from distdl.functional._common import check_flags, check_partition, idle_output
from distdl.functional.all_sum_reduce import fibre
from distdl.functional.invariant import all_sum_reduce_backward
from distdl.nn import _windows
from distdl.nn.module import CollectStateMixin
from distdl.partition import MPIPartition
from distdl.utilities.torch import zeros_block

__all__ = ["DistributedFeatureConv1d", "DistributedFeatureConv2d", "DistributedFeatureConv3d"]


def positive_ints(where: str, **values: object) -> tuple[int, ...]:
    """Return the named values as ints; raise ValueError unless each is a positive int or NumPy integer."""
    for arg, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{where}: expected a positive int for {arg}, got {value!r}")
    return tuple(int(value) for value in values.values())


class _DistributedFeatureConvNd(CollectStateMixin, torch.nn.Module):
    """Convolve ``(N, C, *spatial)`` tensors partitioned by ``P_x`` over batch and spatial dimensions.

    Args:
        P_x: the input (and output) partition, of dimension ``d + 2``, with ``P_x.shape[1] == 1``.
        collect_state: save and load the sequential layer's state dict (see :mod:`distdl.nn.module`).
        The other arguments are torch's; ``padding`` may be ``'same'`` or ``'valid'``; the weights are
        initialised as torch's on rank 0 of ``P_x`` (``torch.manual_seed`` there reproduces torch's
        layer) and broadcast to the other workers.
    Raises:
        ValueError: a partition of the wrong dimension or with a split channel axis, a ``padding_mode``
            other than ``'zeros'``, or arguments torch would reject.
    """

    dims: int

    def __init__(self, P_x: MPIPartition, in_channels: int, out_channels: int, kernel_size: int | tuple[int, ...],
                 stride: int | tuple[int, ...] = 1, padding: int | tuple[int, ...] | str = 0,
                 dilation: int | tuple[int, ...] = 1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 collect_state: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        name, d = type(self).__name__, self.dims
        check_partition(name, "P_x", P_x)
        if P_x.dim != d + 2 or P_x.shape[1] != 1:
            raise ValueError(f"{name}: expected a partition of {d + 2} dimensions whose channel axis (1) has "
                             f"extent 1, got shape {P_x.shape}")
        in_channels, out_channels, groups = positive_ints(name, in_channels=in_channels, out_channels=out_channels,
                                                          groups=groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{name}: expected in_channels and out_channels divisible by groups, got "
                             f"{in_channels}, {out_channels} and groups={groups}")
        if padding_mode != "zeros":
            raise ValueError(f"{name}: expected padding_mode 'zeros' (the only one supported), got {padding_mode!r}")
        self.P_x, self.in_channels, self.out_channels, self.groups = P_x, in_channels, out_channels, groups
        self.padding_mode = padding_mode
        bias, self.collect_state = check_flags(name, bias=bias, collect_state=collect_state)
        self.kernel_size = _windows.as_tuple(name, "kernel_size", kernel_size, d, minimum=1)
        self.stride = _windows.as_tuple(name, "stride", stride, d, minimum=1)
        self.dilation = _windows.as_tuple(name, "dilation", dilation, d, minimum=1)
        if padding == "same" and any(s != 1 for s in self.stride):
            raise ValueError(f"{name}: expected stride 1 with padding='same', got stride={stride!r}")
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"{name}: expected padding 'same', 'valid' or ints, got {padding!r}")
            self.padding = padding
            total = [dl * (k - 1) if padding == "same" else 0 for k, dl in zip(self.kernel_size, self.dilation)]
            self._pads = tuple((t // 2, t - t // 2) for t in total)
        else:
            self.padding = _windows.as_tuple(name, "padding", padding, d)
            self._pads = tuple((p, p) for p in self.padding)
        self.axes = tuple(range(P_x.dim))
        fibre(P_x, self.axes)  # the communicator is built here, once
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty((out_channels, in_channels // groups) + self.kernel_size,
                                                     **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as torch does on rank 0 of ``P_x`` and broadcast (collective over ``P_x``)."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight.shape[1] * math.prod(self.kernel_size)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)
        if self.P_x.active and self.P_x.size > 1 and not self.weight.is_meta:  # meta: no values to broadcast
            tensors = [t for t in (self.weight, self.bias) if t is not None]
            if check_mode():  # parameters built otherwise on one worker would broadcast mismatched messages
                verify(type(self).__name__, self.P_x, agree={"parameters": [(t.shape, t.dtype) for t in tensors]})
            transport.bcast_in_place_all(self.P_x.comm, tensors)

    def _length(self, k: int, n: int) -> int:
        return _windows.sliding_length(n, self.kernel_size[k], self.stride[k], *self._pads[k], self.dilation[k])

    def _source(self, k: int, n: int, length: int, o0: int, o1: int) -> tuple[int, int]:
        return _windows.sliding_source(o0, o1, self.kernel_size[k], self.stride[k], self._pads[k][0],
                                       self.dilation[k])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of the convolution; zero-volume outside ``P_x``."""
        name = type(self).__name__
        self._verify_replicas(name)
        _windows.check_input(name, x, self.P_x, self.in_channels)
        if not self.P_x.active:
            return idle_output(x)  # backward runs here too
        weight, bias = self.weight, self.bias  # once: a parametrization computes them at each read
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):  # autocast casts both
            raise TypeError(f"{name}: expected a tensor of dtype {weight.dtype} (the weight's), got {x.dtype}")
        key = ("conv", self.kernel_size, self.stride, self._pads, self.dilation, self.out_channels)
        plan, window = _windows.fetch(name, x, self.P_x, key, self.out_channels, self._length, self._source,
                                      self.stride)
        if self.P_x.comm.size > 1 and torch.is_grad_enabled():  # one sum of the parameters' gradients
            flat = torch.cat([weight.flatten()] + ([bias] if bias is not None else []))
            flat = all_sum_reduce_backward(flat, self.P_x, axes_reduce=self.axes)
            weight, bias = flat[:weight.numel()].view_as(weight), None if bias is None else flat[weight.numel():]
        shape = tuple(b - a for a, b in plan.block)
        if 0 in shape:  # still joined to the graph: its backward takes part in the collectives
            return _windows.connect(zeros_block(shape, x, _windows.conv_dtype(window, weight)), window, weight,
                                    bias)
        return _windows.convolve(self.dims, window, weight, bias, self.stride, plan.padding, self.dilation,
                                 self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}, P_x shape={self.P_x.shape}")


class DistributedFeatureConv1d(_DistributedFeatureConvNd):
    """Convolve ``(N, C, L)`` tensors partitioned by ``P_x`` along batch and length."""
    dims = 1


class DistributedFeatureConv2d(_DistributedFeatureConvNd):
    """Convolve ``(N, C, H, W)`` tensors partitioned by ``P_x`` along batch, height and width."""
    dims = 2


class DistributedFeatureConv3d(_DistributedFeatureConvNd):
    """Convolve ``(N, C, D, H, W)`` tensors partitioned by ``P_x`` along batch and the spatial dimensions."""
    dims = 3
