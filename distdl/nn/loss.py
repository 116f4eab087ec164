"""Distributed losses: the sequential loss of the global tensors, from partitioned inputs and targets.

Forward ``L = (sum_i l(x_i, t_i)) / D`` with ``D`` the global count (``mean``), the global batch
size (``batchmean``) or 1 (``sum``): each worker sums its elementwise loss in float64, and
``[sum, count, batch]`` is summed over ``P_x`` with ``all_sum_reduce_forward`` (backward: identity),
so every member holds the same loss and ``backward()`` on every member yields each block's exact
gradient. ``reduction="none"`` returns the local block of the elementwise loss. A worker whose block fails (torch
raises, or its block of ``weight`` does not fit its input) flags it in that sum: every member raises. So do blocks
that form no global tensor (their extents travel in the sum too: :mod:`distdl.nn._blocks`).

============================  ========================================================================
worker                        does
============================  ========================================================================
in P_x                        contributes its local sums; gets the global loss (0-dim)
outside P_x                   passes zero-volume input and target; gets a 0-dim zero (of the members' dtype)
                              it can backward()
                              (``none``: a zero-volume tensor)
============================  ========================================================================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distdl.checks import announce, verify
from distdl.functional._common import check_idle_input, check_partition, check_tensor, idle_output
from distdl.functional.all_sum_reduce import fibre
from distdl.functional.invariant import all_sum_reduce_backward, all_sum_reduce_forward
from distdl.nn._blocks import check_extents, extent_terms
from distdl.nn.module import StateLayout
from distdl.partition import MPIPartition

__all__ = ["DistributedMSELoss", "DistributedL1Loss", "DistributedBCELoss", "DistributedBCEWithLogitsLoss",
           "DistributedKLDivLoss", "DistributedPoissonNLLLoss", "DistributedCrossEntropyLoss"]


def _loss_dtype(input: torch.Tensor, target: torch.Tensor) -> torch.dtype:
    """Return the dtype of the loss that the members compute from blocks of ``input``'s and ``target``'s dtypes: the
    promoted real floating dtype (a complex input's real one; an integer or bool placeholder's: the default), and
    float32 for lower precision under autocast (torch's losses run in float32 there): a worker outside P_x returns
    a loss of the members' dtype."""
    dtype = input.real.dtype if input.is_floating_point() or input.is_complex() else torch.get_default_dtype()
    if target.is_floating_point():  # class indices do not take part
        dtype = torch.promote_types(dtype, target.dtype)
    if dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(input.device.type):
        dtype = torch.float32
    return dtype


# The kinds of block a loss may get (see _DistributedLoss._kind), numbered for the sum that compares them
_KINDS = [(dtype, probabilities) for probabilities in (False, True)
          for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)]


class _DistributedLoss(torch.nn.Module):
    """Reduce a local elementwise loss over ``P_x``; subclasses define ``_elementwise``."""

    reductions = ("mean", "sum", "none")

    def __init__(self, P_x: MPIPartition, reduction: str = "mean") -> None:
        super().__init__()
        name = type(self).__name__
        check_partition(name, "P_x", P_x)
        if reduction not in self.reductions:
            raise ValueError(f"{name}: expected reduction in {list(self.reductions)}, got {reduction!r}")
        self.P_x, self.reduction = P_x, reduction
        self.axes = tuple(range(P_x.dim))
        fibre(P_x, self.axes)  # the communicator is built here, once

    def _elementwise(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _count(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor | int:
        return input.numel()

    def _target_shape(self, input: torch.Tensor, target: torch.Tensor) -> tuple[int, ...]:
        return tuple(input.shape)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Return the global loss (0-dim on every worker), or the local elementwise block for ``none``."""
        name = type(self).__name__
        try:
            for tensor in (input, target):
                check_tensor(name, tensor)
                check_idle_input(name, self.P_x, tensor)
        except (TypeError, ValueError) as error:
            announce(name, lambda: self.P_x, error)  # check mode: the members raise too
            raise
        if not self.P_x.active:
            if self.reduction == "none":
                return idle_output(input)  # backward runs here too
            loss = idle_output(input).sum()  # 0, and backward() works everywhere
            loss = (loss.real if loss.is_complex() else loss).to(_loss_dtype(input, target))
            return loss if loss.requires_grad or not torch.is_grad_enabled() else loss.requires_grad_()
        if self.reduction == "none":  # no sum: a block that fails raises here alone
            self._check_block(name, input, target)
        # check mode: a loss made with another reduction elsewhere sums the same three numbers to another value,
        # or ('none') makes no collective
        verify(name, self.P_x, agree={"reduction": self.reduction, "buffers requiring grad": sorted(
            key for key, t in self._buffers.items() if t is not None and t.requires_grad)})
        if self.reduction == "none":
            return self._elementwise(input, target)
        # A worker whose block fails (of the wrong shape, a class index out of range, a probability outside
        # [0, 1], a weight of the wrong size) still takes part in the sum, with its failure flagged: every member
        # raises.
        n = self.P_x.size
        failures = torch.zeros(n, dtype=torch.float64, device=input.device)
        kinds = torch.zeros(n, dtype=torch.float64, device=input.device)  # each member's, to be one
        try:
            self._check_block(name, input, target)
            losses = self._elementwise(input, target)
            if losses.is_complex():  # the float64 sum would drop the imaginary part
                raise TypeError(f"{name}: expected inputs whose loss is real for reduction {self.reduction!r}, got "
                                f"a {losses.dtype} loss from {input.dtype} input")
            if self.reduction != "sum" and not losses.is_floating_point():  # torch's mean refuses them too
                raise TypeError(f"{name}: expected floating-point inputs for reduction {self.reduction!r} (as "
                                f"torch's), got {input.dtype}")
            at_batch_start = all(i == 0 for i in self.P_x.index[1:])
            count = torch.as_tensor(self._count(input, target), dtype=torch.float64, device=input.device)
            batch = torch.tensor(float(input.shape[0] if at_batch_start else 0), dtype=torch.float64,
                                 device=input.device)
            packed = torch.stack([losses.sum(dtype=torch.float64), count.reshape(()), batch])
            kinds[self.P_x.rank] = 1 + _KINDS.index(self._kind(input, target))
            error = None
        except Exception as failure:
            packed, error = torch.zeros(3, dtype=torch.float64, device=input.device), failure
            failures[self.P_x.rank] = 1
        # and the extents of the blocks, checked to be blocks of one global tensor (distdl.nn._blocks)
        terms = extent_terms(input.shape if error is None else (0,) * self.P_x.dim, self.P_x, self.axes, input.device)
        total = all_sum_reduce_forward(torch.cat([packed, failures, kinds, terms]), self.P_x, axes_reduce=self.axes)
        if error is not None or total[3:3 + n].any():
            self._raise_failed(name, total[3:3 + n], error)
        if (total[3 + n:3 + 2 * n] != total[3 + n]).any():
            self._raise_kinds(name, total[3 + n:3 + 2 * n])
        check_extents(name, total[3 + 2 * n:], input.shape, self.P_x, self.axes)
        # the counts are constants: in the graph, every backward of a double backward (a Hessian's, one per element
        # of a worker's own gradient) ran an all-sum, as many as each worker's block has elements (a hang)
        loss = total[0] / {"mean": total[1].detach(), "batchmean": total[2].detach(), "sum": 1}[self.reduction]
        if self.reduction == "mean":  # nothing counted: torch's 0 / 0 = nan, also where label smoothing added to
            loss = loss + torch.where(total[1] == 0, float("nan"), 0.0)  # the sum (inf); a constant: same gradients
        return loss.to(losses.dtype)

    def _check_block(self, name: str, input: torch.Tensor, target: torch.Tensor) -> None:
        """Raise ValueError unless ``input`` and ``target`` are blocks of ``P_x``'s dimension and matching shapes."""
        if input.dim() != self.P_x.dim:
            raise ValueError(f"{name}: expected an input of {self.P_x.dim} dimensions to match P_x of shape "
                             f"{self.P_x.shape}, got shape {tuple(input.shape)} on worker {self.P_x._root.rank}")
        expected = self._target_shape(input, target)
        if tuple(target.shape) != expected:
            raise ValueError(f"{name}: expected a target of shape {expected} (the input's block is "
                             f"{tuple(input.shape)}), got shape {tuple(target.shape)} on worker {self.P_x._root.rank}")

    def _kind(self, input: torch.Tensor, target: torch.Tensor) -> tuple[torch.dtype, bool]:
        """Return what must be alike on every member: the loss's dtype, and whether the target holds probabilities
        rather than class indices (only the cross entropy takes both)."""
        return _loss_dtype(input, target), False

    def _raise_kinds(self, name: str, kinds: torch.Tensor) -> None:
        """Raise ValueError, on every member, naming the members whose blocks differ in dtype or kind of target."""
        members = self.P_x.root_ranks or range(self.P_x.size)
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(kinds.tolist()):
            dtype, probabilities = _KINDS[int(k) - 1]
            what = str(dtype) + (", class probabilities" if probabilities else "")
            groups.setdefault(what, []).append(members[i])
        raise ValueError(f"{name}: expected blocks of one dtype (and one kind of target) on every member of P_x, got "
                         + "; ".join(f"{what} on worker{'s' if len(w) > 1 else ''} {', '.join(map(str, w))}"
                                     for what, w in groups.items()))

    def _raise_failed(self, name: str, failures: torch.Tensor, error: Exception | None) -> None:
        """Raise, on every member, for the members whose block failed: ``error`` where this is one of them."""
        members = self.P_x.root_ranks or range(self.P_x.size)
        workers = [members[i] for i in torch.nonzero(failures).flatten().tolist()]
        said = f"{name}: the loss failed on worker{'s' if len(workers) > 1 else ''} {', '.join(map(str, workers))}"
        if error is not None:
            error.add_note(f"{said} (this one and any others named), on every member of P_x")
            raise error
        raise ValueError(f"{said} of P_x (its error says why); no loss was computed here")


class DistributedMSELoss(_DistributedLoss):
    """Mean squared error of partitioned ``input`` and ``target`` (same shape and partition)."""

    def _elementwise(self, input, target):
        return F.mse_loss(input, target, reduction="none")


class DistributedL1Loss(_DistributedLoss):
    """Mean absolute error of partitioned ``input`` and ``target`` (same shape and partition)."""

    def _elementwise(self, input, target):
        return F.l1_loss(input, target, reduction="none")


class _Weighted(_DistributedLoss):
    """A loss with torch's optional ``weight``/``pos_weight``: GLOBAL tensors broadcastable to the global input (to
    the target for ``pos_weight``), as torch's; each worker applies its block of them."""

    def __init__(self, P_x: MPIPartition, reduction: str = "mean", **weights: torch.Tensor | None) -> None:
        super().__init__(P_x, reduction)
        for key, weight in weights.items():
            if weight is not None:
                if not isinstance(weight, torch.Tensor):
                    raise TypeError(f"{type(self).__name__}: expected a torch.Tensor or None for {key}, got "
                                    f"{type(weight).__name__}")
                if weight.dim() > P_x.dim:
                    raise ValueError(f"{type(self).__name__}: expected a {key} of at most {P_x.dim} dimensions (it "
                                     f"broadcasts to the input), got shape {tuple(weight.shape)}")
            self.register_buffer(key, weight)

    def _block(self, key: str, input: torch.Tensor) -> torch.Tensor | None:
        """Return this worker's block of the global ``weight``/``pos_weight`` (``key``), broadcastable to the global
        input; ValueError where its block does not match ``input``'s."""
        weight = getattr(self, key)
        if weight is None:
            return None
        offset = self.P_x.dim - weight.dim()  # an extent above 1: the global extent of input dimension d + offset
        axes = [None if n == 1 else d + offset for d, n in enumerate(weight.shape)]
        block = StateLayout(weight.shape, axes).block(weight, self.P_x.shape, self.P_x.index)
        for d, n in enumerate(block.shape):
            if weight.shape[d] != 1 and n != input.shape[d + offset]:
                raise ValueError(f"{type(self).__name__}: expected a {key} broadcastable to the global input (each "
                                 f"extent 1 or the input's global extent) and input blocks of the balanced split, "
                                 f"which the {key} is cut into, got shape {tuple(weight.shape)}: its block on worker "
                                 f"{self.P_x._root.rank} has {n} along dimension {d + offset}, the input's "
                                 f"{input.shape[d + offset]}")
        return block


class DistributedBCELoss(_Weighted):
    """Binary cross entropy of partitioned probabilities and targets; ``weight`` is global (see ``_Weighted``)."""

    def __init__(self, P_x: MPIPartition, weight: torch.Tensor | None = None, reduction: str = "mean") -> None:
        super().__init__(P_x, reduction, weight=weight)

    def _elementwise(self, input, target):
        return F.binary_cross_entropy(input, target, weight=self._block("weight", input), reduction="none")


class DistributedBCEWithLogitsLoss(_Weighted):
    """Binary cross entropy of partitioned logits and targets; ``weight`` and ``pos_weight`` are global."""

    def __init__(self, P_x: MPIPartition, weight: torch.Tensor | None = None, reduction: str = "mean",
                 pos_weight: torch.Tensor | None = None) -> None:
        super().__init__(P_x, reduction, weight=weight, pos_weight=pos_weight)

    def _elementwise(self, input, target):
        return F.binary_cross_entropy_with_logits(input, target, weight=self._block("weight", input),
                                                  pos_weight=self._block("pos_weight", input), reduction="none")


class DistributedKLDivLoss(_DistributedLoss):
    """KL divergence of partitioned log-probabilities and targets; ``batchmean`` divides by the global batch."""

    reductions = ("mean", "batchmean", "sum", "none")

    def __init__(self, P_x: MPIPartition, reduction: str = "mean", log_target: bool = False) -> None:
        super().__init__(P_x, reduction)
        self.log_target = log_target

    def _elementwise(self, input, target):
        return F.kl_div(input, target, reduction="none", log_target=self.log_target)


class DistributedPoissonNLLLoss(_DistributedLoss):
    """Poisson negative log-likelihood of partitioned ``input`` and ``target``."""

    def __init__(self, P_x: MPIPartition, log_input: bool = True, full: bool = False, eps: float = 1e-8,
                 reduction: str = "mean") -> None:
        super().__init__(P_x, reduction)
        self.log_input, self.full, self.eps = log_input, full, eps

    def _elementwise(self, input, target):
        return F.poisson_nll_loss(input, target, log_input=self.log_input, full=self.full, eps=self.eps,
                                  reduction="none")


class DistributedCrossEntropyLoss(_DistributedLoss):
    """Cross entropy of ``(N, C, *d)`` logits, class axis not partitioned, and ``(N, *d)`` class indices
    (or ``(N, C, *d)`` class probabilities) partitioned the same way; ``weight`` (C,) is replicated."""

    def __init__(self, P_x: MPIPartition, weight: torch.Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0) -> None:
        super().__init__(P_x, reduction)
        name = type(self).__name__
        if P_x.dim < 2 or P_x.shape[1] != 1:
            raise ValueError(f"{name}: expected a partition of at least 2 dimensions whose class axis (1) has "
                             f"extent 1, got shape {P_x.shape}")
        self.register_buffer("weight", weight)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def _target_shape(self, input, target):
        if target.is_floating_point():  # class probabilities
            return tuple(input.shape)
        return tuple(input.shape[:1] + input.shape[2:])

    def _elementwise(self, input, target):
        weight = self.weight
        if weight is not None and weight.requires_grad and torch.is_grad_enabled():  # replicated: the gradient
            weight = all_sum_reduce_backward(weight, self.P_x, axes_reduce=self.axes)  # is the total over P_x
        return F.cross_entropy(input, target, weight=weight, ignore_index=self.ignore_index,
                               reduction="none", label_smoothing=self.label_smoothing)

    def _kind(self, input, target):
        return _loss_dtype(input, target), target.is_floating_point()

    def _count(self, input, target):
        if target.is_floating_point():
            return target.numel() // max(input.shape[1], 1)
        kept = target[target != self.ignore_index].long()  # uint8 targets would index the weight as a mask
        return kept.numel() if self.weight is None else self.weight[kept].sum(dtype=torch.float64).detach()
