"""DistributedLinear: DistDL's classic distributed affine layer, with weight blocks on a 2-D partition.

Forward ``y = x W^T + b`` as ``y = SumReduce(P_w -> P_y)(Broadcast(P_x -> P_w)(x) W_ij^T + [j == 0] b_i)``:
the features of ``x`` are split over ``P_x`` of shape ``(1, P_in)``, worker ``(i, j)`` of ``P_w`` of shape
``(P_out, P_in)`` holds the weight block ``W[out_block_i, in_block_j]`` (and, on column ``j == 0`` only, the
bias block ``b[out_block_i]``, so it is added once), and the features of ``y`` are split over ``P_y`` of
shape ``(1, P_out)``. The partitions may lie on different or overlapping workers. Backward is the
adjoint of each step (SumReduce back to ``P_w``, Broadcast back to ``P_x``).

==========================  =================================================================
worker                      does
==========================  =================================================================
in P_x                      sends its block of ``x`` to column ``j`` of ``P_w``
in P_w                      multiplies the block it receives by its weight block
in P_y                      receives the sum over its row of ``P_w``
in none of them             passes and gets a zero-volume tensor; holds zero-volume parameters
==========================  =================================================================

Default initialisation is torch's for the GLOBAL weight: every block is cut from one global tensor
drawn from a generator seeded the same on every worker (:func:`shared_seed`, :func:`global_block`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from distdl.functional._common import check_flags, check_idle_input, check_partition, check_tensor, idle_output
from distdl.functional.broadcast import broadcast, broadcast_plan
from distdl.functional.sum_reduce import reduction_plan, sum_reduce
from distdl.nn.module import CollectStateMixin, StateLayout, check_materialised
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_subshape

__all__ = ["DistributedLinear", "shared_seed", "global_block", "check_features"]


def check_features(where: str, **counts: object) -> None:
    """Raise TypeError/ValueError unless every named count is a non-negative int."""
    for name, n in counts.items():
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
            raise TypeError(f"{where}: expected an int for {name}, got {n!r}")
        if n < 0:
            raise ValueError(f"{where}: expected a non-negative {name}, got {n}")


def shared_seed(P: MPIPartition) -> int:
    """Return a seed from torch's default generator, the same (rank 0's) on every member of ``P``.

    Every worker draws once, so the default generators of all workers advance alike.
    """
    seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())  # also under `with torch.device("meta")`
    if P.active and P.size > 1:
        seed = int(P.broadcast_data(seed))
    return seed


def global_block(global_shape: Sequence[int], start: Sequence[int], size: Sequence[int],
                 sample: Callable[[tuple[int, ...], torch.Generator], torch.Tensor], seed: int,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Return the block ``[start, start + size)`` of a global tensor drawn by ``sample`` from ``seed``.

    The global tensor is drawn in chunks of leading rows (bounded memory) and only up to the block's
    last row; every worker draws the same values, so blocks of one tensor fit together.
    """
    dtype = dtype or torch.get_default_dtype()
    block = torch.empty(tuple(int(n) for n in size), dtype=dtype, device=device)
    if block.numel() == 0:
        return block
    generator = torch.Generator().manual_seed(seed)
    rest = tuple(global_shape[1:])
    rows = max(1, 2**20 // max(1, math.prod(rest)))
    inner = tuple(slice(int(a), int(a + n)) for a, n in zip(start[1:], size[1:]))
    first, stop = int(start[0]), int(start[0] + size[0])
    for r0 in range(0, stop, rows):
        chunk = sample((min(rows, global_shape[0] - r0),) + rest, generator)
        lo, hi = max(r0, first), min(r0 + chunk.shape[0], stop)
        if lo < hi:
            block[lo - first:hi - first] = chunk[(slice(lo - r0, hi - r0),) + inner]
    return block


def uniform(bound: float) -> Callable[[tuple[int, ...], torch.Generator], torch.Tensor]:
    """Return a sampler of ``U(-bound, bound)`` (torch's Linear initialisation, bound ``1/sqrt(fan_in)``)."""
    return lambda shape, generator: torch.empty(shape, dtype=torch.float64).uniform_(-bound, bound,
                                                                                       generator=generator)


# [1] Outside the layer's partition a weight is empty, of shape (0, in_features) (in_channels for a convolution):
# torch's fan-based init functions (xavier_*, kaiming_*) then find a fan and do nothing; (0, 0) made xavier_* divide
# by zero there, so `model.apply(init)` failed on those workers only.


class SeededInit:
    """``reset_parameters()`` for a layer whose parameters are blocks of global tensors drawn from one seed shared
    over ``_init_partition`` (so they fit together, and equal the sequential layer's drawn from that seed).

    ``_init_blocks`` maps a parameter's name to ``(global shape, block start, block size, sampler, seed offset)``.
    """

    _init_blocks: dict[str, tuple]
    _init_partition: MPIPartition

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw the parameters again, as at construction (collective over the layer's partition: a shared seed)."""
        seed = shared_seed(self._init_partition)
        for name, (shape, start, size, sample, offset) in self._init_blocks.items():
            p = getattr(self, name)
            if p is not None:
                p.copy_(global_block(shape, start, size, sample, seed + offset, p.dtype, p.device))


class DistributedLinear(SeededInit, CollectStateMixin, torch.nn.Module):
    """Apply ``y = x W^T + b``: ``x`` on ``P_x`` (1, P_in), ``W`` on ``P_w`` (P_out, P_in), ``y`` on ``P_y`` (1, P_out).

    Args:
        P_x, P_y, P_w: the partitions of the input, output and weight (any workers of one root).
        in_features, out_features: the GLOBAL feature counts (split in balanced blocks, unevenly if need be).
        bias: whether to add a learnable bias (held by column 0 of ``P_w``).
        collect_state: ``state_dict()`` on rank 0 of the root partition holds torch's keys and global shapes,
            and ``load_state_dict()`` takes that rank's values (see :mod:`distdl.nn.module`).
    Raises:
        ValueError: partitions of the wrong shapes or negative feature counts.
        TypeError: arguments of the wrong types.
    """

    def __init__(self, P_x: MPIPartition, P_y: MPIPartition, P_w: MPIPartition, in_features: int,
                 out_features: int, bias: bool = True, collect_state: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        name = "DistributedLinear"
        for label, P in (("P_x", P_x), ("P_y", P_y), ("P_w", P_w)):
            check_partition(name, label, P)
        check_features(name, in_features=in_features, out_features=out_features)
        self.use_bias, self.collect_state = check_flags(name, bias=bias, collect_state=collect_state)
        if P_w.dim != 2 or P_x.shape != (1, P_w.shape[1]) or P_y.shape != (1, P_w.shape[0]):
            raise ValueError(f"{name}: expected P_w of shape (P_out, P_in), P_x of shape (1, P_in) and P_y of shape "
                             f"(1, P_out), got P_x {P_x.shape}, P_y {P_y.shape} and P_w {P_w.shape}")
        self.P_x, self.P_y, self.P_w = P_x, P_y, P_w
        self.in_features, self.out_features = int(in_features), int(out_features)
        broadcast_plan(P_x, P_w, False, False)  # the communicators are built here, once
        reduction_plan(P_w, P_y, False, True)
        shape = (self.out_features, self.in_features)
        start = compute_start_index(P_w.shape, P_w.index, shape) if P_w.active else (0, 0)
        size = compute_subshape(P_w.shape, P_w.index, shape) if P_w.active else (0, self.in_features)  # [1]
        self.holds_bias = self.use_bias and P_w.active and P_w.index[1] == 0
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self._init_partition = P_w
        self._init_blocks = {"weight": (shape, start, size, uniform(bound), 0),
                             "bias": ((self.out_features,), start[:1], size[:1], uniform(bound), 1)}
        factory = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(tuple(int(n) for n in size), **factory))
        self.register_parameter("bias", torch.nn.Parameter(torch.empty(int(size[0]), **factory))
                                if self.holds_bias else None)
        self.reset_parameters()

    def _state_layouts(self) -> dict[str, StateLayout]:
        return {"weight": StateLayout((self.out_features, self.in_features), (0, 1)),
                "bias": StateLayout((self.out_features,), (0,), first=(1,))}

    def _state_partition(self) -> MPIPartition:
        return self.P_w  # the parameters live on P_w

    def _held_elsewhere(self) -> set[str]:
        return {"bias"} if self.use_bias and not self.holds_bias else set()  # column 0 of P_w holds the bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of ``y``. Outside ``P_y`` it is zero-volume and, as DistDL's, keeps the batch
        extent of the block this worker sent or multiplied, ``(batch, 0)`` (so ``y.view(y.size(0), -1)`` works)."""
        name = "DistributedLinear"
        check_materialised(name, self)
        check_tensor(name, x)
        check_idle_input(name, self.P_x, x)
        weight = self.weight  # once: a parametrization computes it at each read
        if self.P_x.active:
            local = int(compute_subshape(self.P_x.shape, self.P_x.index, (1, self.in_features))[1])
            if x.dim() != 2 or x.shape[1] != local:
                raise ValueError(f"{name}: expected a tensor of shape (batch, {local}) (this worker's block of "
                                 f"{self.in_features} features over P_x of shape {self.P_x.shape}), got shape "
                                 f"{tuple(x.shape)} on worker {self.P_x._root.rank}")
            # else F.linear raises on the workers of P_w, after the broadcast (autocast casts both)
            if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
                raise TypeError(f"{name}: expected an input of the parameters' dtype {weight.dtype}, got "
                                f"{x.dtype} on worker {self.P_x._root.rank}")
        x_w = broadcast(x, self.P_x, self.P_w)
        if self.P_w.active:
            x_w = torch.nn.functional.linear(x_w, weight, self.bias)
        else:  # a double backward reaches the broadcast here too, as on P_w (see idle_output)
            x_w = idle_output(x_w)
        return sum_reduce(x_w, self.P_w, self.P_y, transpose_dest=True)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"P_w shape={self.P_w.shape}, local weight shape={tuple(self.weight.shape)}")
