"""``GradScaler``: torch's gradient scaler for mixed precision, its overflow check agreed over a partition.

``torch.amp.GradScaler`` checks each worker's own gradients for ``inf``/``NaN``. Where a parameter is split over
workers (the tensor-parallel layers' weights, a split embedding), an overflow in one worker's block makes that
worker alone skip the step and halve its scale: the others step on (after distdl's ``clip_grad_norm_``, whose norm
is then ``NaN`` on every worker, with ``NaN`` gradients), and the workers drift apart, silently. A worker whose
parameters all lie outside its layers' partitions has no gradient to check, and torch's ``step`` raises "No inf
checks were recorded for this optimizer" there. Here the check is the sequential model's: any member's overflow is
every member's, as with torch's ``ShardedGradScaler`` for FSDP.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from distdl.checks import verify
from distdl.functional._common import check_partition
from distdl.partition import MPIPartition

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a model laid out over ``P``: every member of ``P`` skips a step, and lowers its
    scale, where the gradients overflowed on any member (one ``MPI_Allreduce`` of a flag per optimizer and step).

    Use it as torch's (``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``); ``unscale_`` (called by
    ``step`` where the user did not, and for fused optimizers its check) is collective over ``P``: call it, or
    ``step``, for the same optimizers in the same order on every member. A member outside ``P`` checks its own
    gradients, as torch's.

    Args:
        P: the partition of the model's workers (all of them: with data parallelism too, the whole layout).
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch's.
    """

    def __init__(self, P: MPIPartition, device: str = "cuda", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        check_partition("GradScaler", "P", P)
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.P = P

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        # torch's unscale_ and its check for fused optimizers both come here, once per optimizer and step
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not self.P.active:
            return found
        verify("GradScaler", self.P)
        agreed = self.P.comm.allreduce(float(any(bool(t.item()) for t in found.values())), op=MPI.MAX)
        for t in found.values():
            t.fill_(agreed)
        if not found:  # no gradient here: the others' check counts (torch's step would raise)
            found[found_inf.device] = found_inf.fill_(agreed)
        return found
