"""DistributedBatchNorm: batch normalisation with statistics over the whole partitioned batch.

Forward ``y = (x - mean) / sqrt(var + eps) * weight + bias`` per channel, ``mean`` and ``var`` over
every non-channel dimension of the global tensor, from ONE all-sum-reduce of the packed local
moments (true adjoint, so the input gradient is exact); ``weight``/``bias`` are replicated and
enter through ``all_sum_reduce_backward``, so their gradients are the totals.

============================  =====================================================================
worker                        does
============================  =====================================================================
in P_x                        normalises its block with the global statistics; updates running stats
outside P_x                   passes and gets a zero-volume tensor; holds unused parameters
============================  =====================================================================
"""

from __future__ import annotations

import math

import torch

from distdl.functional._common import check_idle_input, check_partition, check_tensor
from distdl.functional.all_sum_reduce import all_sum_reduce, fibre
from distdl.functional.invariant import all_sum_reduce_backward
from distdl.nn.module import CollectStateMixin
from distdl.partition import MPIPartition

__all__ = ["DistributedBatchNorm", "global_moments"]


def global_moments(x: torch.Tensor, dims: tuple[int, ...], P_x: MPIPartition, axes: tuple[int, ...],
                   shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the mean, biased variance (float64, keepdim over ``dims``) and count over the global tensor.

    Each worker computes its local mean and centred sum of squares (two-pass, stable), shifts them
    by ``shift`` (a reference every member agrees on, ideally near the mean: BatchNorm uses the
    previous call's global mean, which no user state can make differ between workers) and packs
    ``[count, n (m - shift), M2 + n (m - shift)^2]`` in float64 for one all-sum-reduce along ``axes``;
    the merge cancels only ``(mean - shift)^2`` in float64.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    x = x.to(compute)
    n = math.prod(x.shape[d] for d in dims)
    local_mean = x.sum(dims, keepdim=True) / max(n, 1)
    m2 = (x - local_mean).square().sum(dims, keepdim=True).double()
    delta = local_mean.double() - (0 if shift is None else shift)
    packed = torch.cat([torch.tensor([float(n)], dtype=torch.float64, device=x.device),
                        (n * delta).flatten(), (m2 + n * delta.square()).flatten()])
    total = all_sum_reduce(packed, P_x, axes_reduce=axes)
    count, k = total[0], delta.numel()
    mean_shifted = total[1:1 + k].view_as(delta) / count
    var = (total[1 + k:].view_as(delta) / count - mean_shifted.square()).clamp_min(0)
    return mean_shifted + (0 if shift is None else shift), var, count.detach()


class DistributedBatchNorm(CollectStateMixin, torch.nn.Module):
    """Batch-normalise ``(N, C, *spatial)`` tensors partitioned by ``P_x`` (channel axis not partitioned).

    Args:
        P_x: the input partition, of the input's dimension, with ``P_x.shape[1] == 1``.
        num_features: the number of channels ``C``; the other arguments are torch's.
        collect_state: save and load the sequential layer's state dict (see :mod:`distdl.nn.module`).
    Raises:
        ValueError: ``P_x`` of fewer than 2 dimensions or with a partitioned channel axis.
    """

    def __init__(self, P_x: MPIPartition, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, collect_state: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        check_partition(name, "P_x", P_x)
        if P_x.dim < 2 or P_x.shape[1] != 1:
            raise ValueError(f"{name}: expected a partition of at least 2 dimensions whose channel axis (1) has "
                             f"extent 1, got shape {P_x.shape}")
        self.P_x, self.num_features, self.eps, self.momentum = P_x, num_features, eps, momentum
        self.affine, self.track_running_stats, self.collect_state = affine, track_running_stats, collect_state
        self.axes = tuple(range(P_x.dim))
        self._shift: torch.Tensor | None = None  # reference for the moments' merge; see global_moments
        fibre(P_x, self.axes)  # the communicator is built here, once
        factory = {"device": device, "dtype": dtype}
        if affine:
            self.weight = torch.nn.Parameter(torch.ones(num_features, **factory))
            self.bias = torch.nn.Parameter(torch.zeros(num_features, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory))
            self.register_buffer("running_var", torch.ones(num_features, **factory))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            for buffer in ("running_mean", "running_var", "num_batches_tracked"):
                self.register_buffer(buffer, None)

    def reset_running_stats(self) -> None:
        """Reset the running statistics as torch does."""
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the normalised block of ``x``; zero-volume outside ``P_x``."""
        name = type(self).__name__
        check_tensor(name, x)
        check_idle_input(name, self.P_x, x)
        if not self.P_x.active:
            return x.clone()
        if x.dim() != self.P_x.dim or x.shape[1] != self.num_features:
            raise ValueError(f"{name}: expected a tensor of {self.P_x.dim} dimensions with {self.num_features} "
                             f"channels (dimension 1) for P_x of shape {self.P_x.shape}, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
        shape = (1, self.num_features) + (1,) * (x.dim() - 2)
        if self.training or not self.track_running_stats:
            dims = (0,) + tuple(range(2, x.dim()))
            shift = None if self._shift is None else self._shift.to(x.device)
            mean, var, count = global_moments(x, dims, self.P_x, self.axes, shift)
            self._shift = torch.nan_to_num(mean.detach(), 0.0, 0.0, 0.0)  # the same on every member
            if self.training and count <= 1:
                raise ValueError(f"{name}: expected more than 1 value per channel when training, got "
                                 f"{int(count)} over P_x")
            if self.training and self.track_running_stats:
                self._update_running_stats(mean.detach().flatten(), var.detach().flatten(), float(count))
        else:
            mean, var = self.running_mean.view(shape), self.running_var.view(shape)
        compute = torch.promote_types(x.dtype, torch.float32)
        y = (x.to(compute) - mean.to(compute)) * torch.rsqrt(var.to(compute) + self.eps)
        if self.affine:
            # one gradient all-sum-reduce for both
            weight, bias = all_sum_reduce_backward(torch.stack([self.weight, self.bias]), self.P_x, self.axes)
            y = y * weight.view(shape) + bias.view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / (count - 1))
        self.running_mean.copy_((1 - factor) * self.running_mean + factor * mean)
        self.running_var.copy_((1 - factor) * self.running_var + factor * unbiased)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}, P_x shape={self.P_x.shape}")
