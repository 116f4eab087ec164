"""DistributedLayerNorm: layer normalisation over trailing dimensions split across the partition.

Forward ``y = (x - mean) / sqrt(var + eps) * weight + bias``, ``mean`` and ``var`` over the global
trailing ``normalized_shape`` from the local moments merged about the global mean (two small
all-sum-reduces along the partition axes of those dimensions; true adjoints, so the input gradient is
exact). Each worker holds its balanced block of ``weight``/``bias`` along the normalised dimensions, replicated over
the other axes, where it enters through ``all_sum_reduce_backward`` (gradients are the totals).

============================  =====================================================================
worker                        does
============================  =====================================================================
in P_x                        normalises its block with the global per-row statistics
outside P_x                   passes and gets a zero-volume tensor; holds zero-volume parameters
============================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from distdl.checks import announce, check_mode, verify
from distdl.functional._common import check_flags, check_idle_input, check_partition, check_tensor, idle_output
from distdl.functional.all_sum_reduce import fibre
from distdl.functional.invariant import all_sum_reduce_backward
from distdl.nn.batchnorm import global_moments
from distdl.nn.module import CollectStateMixin, StateLayout
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_subshape

__all__ = ["DistributedLayerNorm"]


class DistributedLayerNorm(CollectStateMixin, torch.nn.Module):
    """Layer-normalise the trailing ``normalized_shape`` dimensions of a tensor partitioned by ``P_x``.

    Args:
        P_x: the input partition, of the input's dimension; any of its axes may be split unevenly.
        normalized_shape: the GLOBAL extents of the trailing dimensions; the other arguments are torch's.
        collect_state: save and load the sequential layer's state dict (see :mod:`distdl.nn.module`).
    Raises:
        ValueError: ``normalized_shape`` of more dimensions than ``P_x`` or with negative extents.
    """

    def __init__(self, P_x: MPIPartition, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, collect_state: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        check_partition(name, "P_x", P_x)
        integer = (int, np.integer)  # torch takes NumPy integers too
        try:
            shape = (normalized_shape,) if isinstance(normalized_shape, integer) else tuple(normalized_shape)
        except TypeError:  # not a sequence (a float, a 0-d tensor): the error below names it
            shape = (normalized_shape,)
        if not 0 < len(shape) <= P_x.dim or any(not isinstance(n, integer) or n < 0 for n in shape):
            raise ValueError(f"{name}: expected a normalized_shape of 1 to {P_x.dim} non-negative extents for P_x "
                             f"of shape {P_x.shape}, got {normalized_shape!r}")
        shape = tuple(int(n) for n in shape)
        self.P_x, self.normalized_shape, self.eps = P_x, shape, eps
        self.elementwise_affine, bias, self.collect_state = check_flags(
            name, elementwise_affine=elementwise_affine, bias=bias, collect_state=collect_state)
        self.axes = tuple(range(P_x.dim - len(shape), P_x.dim))  # the partition axes of the normalised dims
        self.axes_replicated = tuple(range(P_x.dim - len(shape)))
        fibre(P_x, self.axes)  # the communicators are built here, once
        fibre(P_x, self.axes_replicated)
        self.local_shape = self._local_shape()
        factory = {"device": device, "dtype": dtype}
        weight = torch.nn.Parameter(torch.ones(self.local_shape, **factory)) if elementwise_affine else None
        self.register_parameter("weight", weight)
        self.register_parameter("bias", torch.nn.Parameter(torch.zeros(self.local_shape, **factory))
                                if elementwise_affine and bias else None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Reset the weight to ones and the bias to zeros, as torch does."""
        if self.weight is not None:
            self.weight.fill_(1)
        if self.bias is not None:
            self.bias.zero_()

    def _local_shape(self) -> tuple[int, ...]:
        if not self.P_x.active:  # empty, with the trailing extents: a fan for xavier_* (see [1] in linear.py)
            return (0,) + self.normalized_shape[1:]
        return tuple(int(n) for n in compute_subshape([self.P_x.shape[a] for a in self.axes],
                                                      [self.P_x.index[a] for a in self.axes], self.normalized_shape))

    def _state_layouts(self) -> dict[str, StateLayout]:
        layout = StateLayout(self.normalized_shape, self.axes)
        return {"weight": layout, "bias": layout}

    def _replicated_settings(self) -> dict[str, object]:
        return {"eps": self.eps}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the normalised block of ``x``; zero-volume outside ``P_x``."""
        name = type(self).__name__
        self._verify_replicas(name)
        k = len(self.normalized_shape)
        try:
            check_tensor(name, x)
            check_idle_input(name, self.P_x, x)
            if self.P_x.active and (x.dim() != self.P_x.dim or tuple(x.shape[-k:]) != self.local_shape):
                raise ValueError(f"{name}: expected a tensor of {self.P_x.dim} dimensions ending in this worker's "
                                 f"block {self.local_shape} of normalized_shape {self.normalized_shape} over P_x of "
                                 f"shape {self.P_x.shape}, got shape {tuple(x.shape)} on worker {self.P_x._root.rank}")
            if self.P_x.active and not x.is_floating_point():
                raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
        except (TypeError, ValueError) as error:
            announce(name, lambda: fibre(self.P_x, self.axes), error)  # check mode: the workers normalising
            raise  # these rows with this one raise too
        if not self.P_x.active:
            return idle_output(x)  # backward runs here too
        dims = tuple(range(x.dim() - k, x.dim()))
        if check_mode():  # the workers normalising one row together must hold the same rows (else their moments'
            # sums pair up other rows, or differ in length)
            verify(name, fibre(self.P_x, self.axes), agree={"the extents before normalized_shape": tuple(x.shape[:-k])})
        mean, var, _ = global_moments(x, dims, self.P_x, self.axes)
        compute = torch.promote_types(x.dtype, torch.float32)
        y = (x.to(compute) - mean.to(compute)) * torch.rsqrt(var.to(compute) + self.eps)
        weight, bias = self.weight, self.bias  # once: a parametrization computes them at each read
        affine = [t for t in (weight, bias) if t is not None]
        if affine:  # one gradient all-sum-reduce for both
            affine = all_sum_reduce_backward(torch.stack(affine), self.P_x, self.axes_replicated)
            y = y * affine[0] + (affine[1] if bias is not None else 0)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}, P_x shape={self.P_x.shape}, local shape={self.local_shape}")
