"""DistributedBatchNorm: batch normalisation with statistics over the whole partitioned batch.

Forward ``y = (x - mean) / sqrt(var + eps) * weight + bias`` per channel, ``mean`` and ``var`` over
every non-channel dimension of the global tensor, from the local moments merged about the global
mean (two small all-sum-reduces, see ``_merge_moments``). The backward is written out: with
``xhat = (x - mean) / sqrt(var + eps)`` and ``N`` the global count per channel,
``dx = weight / sqrt(var + eps) * (dy - sum(dy) / N - xhat * sum(dy * xhat) / N)``, the per-channel
sums global, from ONE all-sum-reduce of both; they are also the gradients of ``bias`` and ``weight``,
so every worker gets the parameters' total gradients. With running statistics (eval mode) the
statistics are constants, ``dx = weight / sqrt(running_var + eps) * dy``, and the sums are reduced
only when the parameters need gradients. Each pass over the block is one fused torch kernel.

============================  =====================================================================
worker                        does
============================  =====================================================================
in P_x                        normalises its block with the global statistics; updates running stats
in P_x, empty block           contributes zero sums to both all-sum-reduces (forward and backward)
outside P_x                   passes and gets a zero-volume tensor; holds unused parameters
============================  =====================================================================
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from distdl.backends.cuda import refuse_unsupported
from distdl.functional._common import check_flags, check_idle_input, check_partition, check_tensor, in_graph
from distdl.functional.all_sum_reduce import all_sum_reduce, fibre
from distdl.nn._blocks import check_extents, extent_terms
from distdl.nn.linear import check_features
from distdl.nn.module import CollectStateMixin
from distdl.partition import MPIPartition

__all__ = ["DistributedBatchNorm", "global_moments"]


def global_moments(x: torch.Tensor, dims: tuple[int, ...], P_x: MPIPartition,
                   axes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the mean, biased variance (float64, keepdim over ``dims``) and count over the global tensor.

    Each worker computes its local mean and centred sum of squares (two-pass, stable), then
    :func:`_merge_moments`; differentiable (the all-sum-reduces are the true adjoints).
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    x = x.to(compute)
    n = math.prod(x.shape[d] for d in dims)
    local_mean = x.sum(dims, keepdim=True) / max(n, 1)
    m2 = (x - local_mean).square().sum(dims, keepdim=True)
    return _merge_moments(n, local_mean, m2, P_x, axes)


def _merge_moments(n: int, local_mean: torch.Tensor, m2: torch.Tensor, P_x: MPIPartition, axes: tuple[int, ...],
                   block: tuple[str, tuple[int, ...]] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the global mean, biased variance (float64, shaped as ``local_mean``) and count.

    From each worker's count ``n``, mean ``m`` and centred sum of squares ``M2``. A first all-sum-reduce
    of ``[n, n m]`` gives the count and the global mean ``s`` (constants for autograd). The second sums
    ``[n (m - s), M2 + n (m - s)^2]`` in float64; the merge then cancels only ``(mean - s)^2``, which is
    rounding-small, so a mean far above the spread (``x + 1e6``) keeps float64's precision. Merged about
    zero, or about the previous call's mean, about two digits were lost per tenfold of mean over spread
    (2e-4 at 1e6); the extra call cost the CNN step of benchmarks/bench_layers.py 1.003-1.017x.
    ``block``: a layer's name and this worker's block shape, checked to be a block of one global tensor along
    ``axes`` in the first sum (:mod:`distdl.nn._blocks`).
    """
    with torch.no_grad():
        local = local_mean.detach().double()
        parts = [local.new_full((1,), n), (n * local).flatten()]
        if block:
            parts.append(extent_terms(block[1], P_x, axes, local.device))
        first = all_sum_reduce(torch.cat(parts), P_x, axes_reduce=axes)
        if block:
            k = parts[-1].numel()
            check_extents(block[0], first[-k:], block[1], P_x, axes)
            first = first[:-k]
        count = first[0]
        shift = torch.nan_to_num((first[1:] / count).view(local.shape), 0.0, 0.0, 0.0)  # no data: 0
    delta = local_mean.double() - shift
    moments = torch.cat([(n * delta).flatten(), torch.addcmul(m2.double(), delta, delta, value=n).flatten()])
    total = all_sum_reduce(moments, P_x, axes_reduce=axes)
    mean_shifted, square = (total / count).view((2,) + delta.shape).unbind()
    var = (square - mean_shifted.square()).clamp_min(0)
    return mean_shifted + shift, var, count


_EPS = 2.0 ** -24  # 1 - _EPS is a float32: the sum is exactly 1 in float32 and float64


def _affine(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Return ``(x - shift) * scale + offset`` with per-channel (dimension 1) coefficients, in one fused pass.

    torch's batch_norm in eval mode with a variance that its epsilon makes exactly 1 (torch before 2.13 refuses an
    epsilon of 0); given weight and bias, its CPU kernel is several times faster than without them, and than a
    broadcast ``(x - shift) * scale``.
    """
    return F.batch_norm(x, shift, torch.full_like(scale, 1 - _EPS), scale, offset, training=False, eps=_EPS)


def _channel_moments(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Return the count, mean and centred sum of squares of each channel (dimension 1) of ``x``."""
    n = x.numel() // max(x.shape[1], 1)
    zeros = x.new_zeros(x.shape[1])
    if n == 0:  # native_batch_norm_backward divides by the count (SIGFPE on CPU)
        return 0, zeros, zeros
    ones = torch.ones_like(zeros)
    mean = x.sum((0,) + tuple(range(2, x.dim()))) / n
    centred = _affine(x, mean, ones, zeros)  # exact: x * 1 - mean
    # sum(centred * (centred - 0)) per channel in one fused pass: as accurate as centred.square().sum(),
    # which, like torch.var_mean, is several times slower
    _, m2, _ = torch.ops.aten.native_batch_norm_backward(centred, centred, ones, None, None, zeros, ones, True, 0.0,
                                                         [False, True, False])
    return n, mean, m2


def _sums(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """Return this worker's ``[sum(dy * xhat), sum(dy)]`` per channel, in one fused pass."""
    if x.numel() == 0:  # as in _channel_moments
        return x.new_zeros(2, x.shape[1])
    # A weight is given (its value does not enter these sums): the CUDA kernel needs one
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(dy, x, torch.ones_like(mean), None, None, mean,
                                                                       invstd, True, 0.0, [False, True, True])
    return torch.stack([sum_dy_xhat, sum_dy])


class _Outside(torch.autograd.Function):
    """The output of a worker outside ``P_x``: a copy of its zero-volume input whose backward, as
    :class:`_BatchNorm`'s, runs once only, so that a double backward raises torch's "differentiate twice" error on
    every worker (where the members raised, the others went on into the collectives behind and waited)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return grad


class _BatchNorm(torch.autograd.Function):
    """Normalise ``x`` with per-channel ``mean``/``var``; ``count`` is the global count per channel when
    they are the statistics of ``x`` over ``P_x`` (the backward then accounts for their dependence on
    ``x``), None when they are constants (running statistics)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, count, eps, P_x, axes):
        compute = torch.promote_types(x.dtype, torch.float32)
        # copies: the running statistics may be updated before this backward
        mean, invstd = mean.to(compute, copy=True), torch.rsqrt(var.to(compute) + eps)
        scale = invstd if weight is None else weight.to(compute) * invstd
        y = _affine(x.to(compute), mean, scale, torch.zeros_like(mean) if bias is None else bias.to(compute))
        ctx.save_for_backward(x, mean, invstd, scale)
        ctx.count, ctx.P_x, ctx.axes = count, P_x, axes
        ctx.weight_dtype = None if weight is None else weight.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, mean, invstd, scale = ctx.saved_tensors  # dx = scale * dy when the statistics are constants
        x_dtype, x, dy = x.dtype, x.to(mean.dtype), dy.to(mean.dtype)
        grad_weight = grad_bias = None
        # Whether to sum is decided alike on every worker (not by this worker's requires_grad: a worker whose
        # copies of the parameters are frozen still takes part in the others' sum)
        if ctx.count is not None or ctx.weight_dtype is not None:
            # in float64, as the forward's statistics: a worker whose block has another dtype sums the same bytes
            sums = all_sum_reduce(_sums(dy, x, mean, invstd).double(), ctx.P_x, axes_reduce=ctx.axes).to(mean.dtype)
            if ctx.weight_dtype is not None:
                grad_weight, grad_bias = sums.to(ctx.weight_dtype)
                grad_weight = grad_weight if ctx.needs_input_grad[1] else None
                grad_bias = grad_bias if ctx.needs_input_grad[2] else None  # also bias=False: no bias
        if ctx.count is None:
            grad_x = _affine(dy, torch.zeros_like(mean), scale, torch.zeros_like(mean))
        else:
            # dx = scale * (dy - sum(dy) / N - xhat * sum(dy * xhat) / N) is affine in x and dy per channel:
            # one fused pass over x, then one multiply-add of dy in place
            coefficients = sums * (scale / -ctx.count)
            grad_x = _affine(x, mean, coefficients[0] * invstd, coefficients[1])
            grad_x.addcmul_(dy, scale.view((1, -1) + (1,) * (x.dim() - 2)))
        return grad_x.to(x_dtype), grad_weight, grad_bias, None, None, None, None, None, None


class DistributedBatchNorm(CollectStateMixin, torch.nn.Module):
    """Batch-normalise ``(N, C, *spatial)`` tensors partitioned by ``P_x`` (channel axis not partitioned).

    Args:
        P_x: the input partition, of the input's dimension, with ``P_x.shape[1] == 1``.
        num_features: the number of channels ``C``; the other arguments are torch's.
        collect_state: save and load the sequential layer's state dict (see :mod:`distdl.nn.module`).
    Raises:
        ValueError: ``P_x`` of fewer than 2 dimensions or with a partitioned channel axis.
    """

    _version = 2  # torch's batch norms' state dict version (num_batches_tracked since 2)

    def __init__(self, P_x: MPIPartition, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, collect_state: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 bias: bool = True) -> None:
        super().__init__()
        name = type(self).__name__
        check_partition(name, "P_x", P_x)
        check_features(name, num_features=num_features)
        if P_x.dim < 2 or P_x.shape[1] != 1:
            raise ValueError(f"{name}: expected a partition of at least 2 dimensions whose channel axis (1) has "
                             f"extent 1, got shape {P_x.shape}")
        self.P_x, self.num_features, self.eps, self.momentum = P_x, num_features, eps, momentum
        self.affine, self.track_running_stats, self.collect_state, use_bias = check_flags(
            name, affine=affine, track_running_stats=track_running_stats, collect_state=collect_state, bias=bias)
        self.axes = tuple(range(P_x.dim))
        fibre(P_x, self.axes)  # the communicator is built here, once
        factory = {"device": device, "dtype": dtype}
        if affine:
            self.weight = torch.nn.Parameter(torch.ones(num_features, **factory))
        else:
            self.register_parameter("weight", None)
        if affine and use_bias:  # as torch: bias=False drops the bias only (of an affine norm)
            self.bias = torch.nn.Parameter(torch.zeros(num_features, **factory))
        else:
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

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Reset the running statistics, the weight to ones and the bias to zeros, as torch does."""
        self.reset_running_stats()
        if self.weight is not None:
            self.weight.fill_(1)
        if self.bias is not None:
            self.bias.zero_()

    def _replicated_settings(self) -> dict[str, object]:
        settings = {"eps": self.eps, "momentum": self.momentum}
        if self.running_mean is not None or self.running_var is not None:  # else batch statistics in either mode
            settings["training"] = self.training
        return settings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the normalised block of ``x``; zero-volume outside ``P_x``."""
        name = type(self).__name__
        self._verify_replicas(name)
        check_tensor(name, x)
        weight, bias = self.weight, self.bias  # once: a parametrization computes them at each read
        refuse_unsupported(name)  # _BatchNorm would drop a forward-mode tangent (in eval mode)
        check_idle_input(name, self.P_x, x)
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)  # torch's rule
        if not (self.eps > 0 if batch_statistics else self.eps >= 0):  # as torch, on every worker (NaN too)
            raise ValueError(f"{name}: expected eps {'> 0 with batch statistics' if batch_statistics else '>= 0'}, "
                             f"got {self.eps}")
        if not self.P_x.active:
            return _Outside.apply(in_graph(x))  # backward runs here too (and raises in a double backward)
        if x.dim() != self.P_x.dim or x.shape[1] != self.num_features:
            raise ValueError(f"{name}: expected a tensor of {self.P_x.dim} dimensions with {self.num_features} "
                             f"channels (dimension 1) for P_x of shape {self.P_x.shape}, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
        if batch_statistics:
            with torch.no_grad():
                n, local_mean, m2 = _channel_moments(x.to(torch.promote_types(x.dtype, torch.float32)))
                mean, var, count = _merge_moments(n, local_mean, m2, self.P_x, self.axes, (name, x.shape))
            count = float(count)
            if count == 1:  # torch's rule wherever batch statistics are used; an empty batch passes
                raise ValueError(f"{name}: expected more than 1 value per channel when training, got 1 over P_x")
            if self.training and self.track_running_stats:
                self._update_running_stats(mean, var, count)
        else:
            mean, var, count = self.running_mean, self.running_var, None
        return _BatchNorm.apply(in_graph(x), weight, bias, mean, var, count, self.eps, self.P_x, self.axes)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        """As torch: count the batch (an empty one too), then move the statistics there are toward its own."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not count:  # torch leaves the statistics after an empty batch
            return
        if self.running_mean is not None:
            self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        if self.running_var is not None:
            self.running_var.mul_(1 - factor).add_(var, alpha=factor * count / (count - 1))  # unbiased variance

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # As torch's batch norms: a state dict saved before their version 2 (or made by hand, with no version)
        # has no num_batches_tracked, which then keeps its value
        old = (local_metadata.get("version") or 0) < 2
        if old and self.track_running_stats and self.num_batches_tracked is not None:
            state_dict.setdefault(prefix + "num_batches_tracked", self.num_batches_tracked)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"bias={self.bias is not None}, track_running_stats={self.track_running_stats}, "
                f"P_x shape={self.P_x.shape}")
