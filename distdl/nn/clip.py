"""``clip_grad_norm_``: torch's gradient-norm clipping for a model whose parameters are partitioned.

``torch.nn.utils.clip_grad_norm_`` on a worker sees that worker's blocks only: its norm is local, differs
from worker to worker and is not the sequential model's, so each worker scales by its own factor and the
replicated parameters (convolution kernels, normalisation parameters, data-parallel replicas) drift apart,
silently. Here each block of a distdl layer's parameter is counted once, on the first member of ``P`` that
holds a copy of it (all of ``P`` may: a batch norm over the batch that data parallelism splits); a parameter
of any other module is taken as replicated over the members of ``P`` that hold it under its name in the model
(its state dict key: wrap the model alike on every worker), and counted on the first of them (rank 0 of ``P``
where every member holds the same ones; a torch head that only the last stage of a pipeline holds counts there).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from distdl.checks import verify
from distdl.functional._common import check_partition
from distdl.nn.module import block_holders, check_unparametrized, parameter_layouts
from distdl.partition import MPIPartition

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(module: torch.nn.Module, max_norm: float, P: MPIPartition, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Scale the gradients of ``module`` by ``min(1, max_norm / (norm + 1e-6))``, as torch's
    ``clip_grad_norm_``, with ``norm`` that of the sequential model's gradient.

    Collective over ``P``, the workers the model is laid out on (with data parallelism, one replica's: the
    replicas' gradients are already equal). Every member gets the same norm and scales alike.

    Args:
        module: the model (distdl layers and ordinary torch modules; the latter replicated over the members that
            hold them).
        max_norm: the largest norm allowed.
        P: the partition of the model's workers.
        norm_type: ``p`` of the p-norm, or ``math.inf``.
        error_if_nonfinite: raise where the norm is NaN or infinite (on every member, before scaling); otherwise
            scale by the factor it gives, as torch does (a NaN norm makes every gradient NaN).
        foreach: as torch's: scale with one multi-tensor call (None or True) or tensor by tensor (False); the
            result is the same.
    Returns:
        The norm before clipping (0-dim, float64, on the gradients' device); 0 outside ``P``.
    Raises:
        RuntimeError: a NaN or infinite norm with ``error_if_nonfinite``.
    """
    where = "clip_grad_norm_"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: expected a torch.nn.Module, got {type(module).__name__}")
    check_partition(where, "P", P)
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"{where}: expected None or a bool for foreach, got {foreach!r}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"{where}: expected a positive norm_type (or math.inf), got {norm_type}")
    if not P.active:
        return torch.zeros((), dtype=torch.float64)
    # check mode: a member with another norm_type or max_norm (or making another call) scales by another factor
    verify(where, P, agree={"norm_type": repr(norm_type), "max_norm": repr(float(max_norm))})
    grads, owned, plain, seen = [], [], {}, set()
    for prefix, m in module.named_modules():  # no communication here: a parametrized layer raises on every member
        check_unparametrized(where, m)
        for name, p, layout in parameter_layouts(m):
            if p.grad is None or id(p) in seen:  # a parameter shared by two modules counts once
                continue
            seen.add(id(p))
            grads.append(p.grad)
            if layout is None:
                plain[f"{prefix}.{name}" if prefix else name] = p.grad
                continue
            # the first member of P holding a copy of this block (all of P where a layer sums over it)
            P_m = m._state_partition()
            held = P_m.active and block_holders(P_m, layout.axes + layout.first, P)
            if held and min(held) == P.root_ranks[P.rank]:
                owned.append(p.grad)

    def share(tensors) -> float:  # this worker's part of the norm: a sum of p-th powers, or a maximum
        tensors = [g.detach().double().abs() for g in tensors]
        if norm_type != math.inf:
            return sum(float(g.pow(norm_type).sum()) for g in tensors)
        maxima = [g.max() for g in tensors if g.numel()]
        return float(torch.stack(maxima).max()) if maxima else 0.0  # a NaN wins, as in torch (Python's max drops it)

    names = zlib.crc32(repr([(k, tuple(g.shape)) for k, g in plain.items()]).encode())
    parts = P.allgather_data(np.array([share(owned), share(plain.values()), names]))
    if not np.isfinite(parts[:, 1]).all():  # a NaN or inf in any copy makes the norm so on every member, as torch's
        shares = np.append(parts[:, 0], parts[~np.isfinite(parts[:, 1]), 1][0])
    elif (parts[:, 2] == names).all():  # every member holds the same plain parameters: rank 0 counts them
        shares = np.append(parts[:, 0], parts[0, 1])
    else:
        shares = np.append(parts[:, 0], P.allgather_data(np.array([share(_first_held(where, P, plain))]))[:, 0])
    norm = float(shares.max()) if norm_type == math.inf else float(shares.sum()) ** (1 / norm_type)
    if error_if_nonfinite and not math.isfinite(norm):  # the same norm on every member: all raise
        raise RuntimeError(f"{where}: the total norm of order {norm_type} of the gradients is non-finite ({norm}), "
                           "so it cannot be clipped; set error_if_nonfinite=False to scale them by it anyway")
    coefficient = max_norm / (norm + 1e-6)
    if grads and not coefficient >= 1:  # a NaN norm too: every gradient becomes NaN, as torch's
        if foreach is False:
            for g in grads:
                g.mul_(coefficient)
        else:
            torch._foreach_mul_(grads, coefficient)
    return torch.tensor(norm, dtype=torch.float64, device=grads[0].device if grads else None)


def _first_held(where: str, P: MPIPartition, plain: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Return the gradients of ``plain`` (by name) that this worker is the first member of ``P`` to hold; ValueError
    on every member where two hold one name with different shapes."""
    held = P.comm.allgather({name: tuple(g.shape) for name, g in plain.items()})
    first = {}
    for rank, shapes in enumerate(held):
        for name, shape in shapes.items():
            r = first.setdefault(name, rank)
            if held[r][name] != shape:
                raise ValueError(f"{where}: expected the parameter {name} of a torch module (replicated over the "
                                 f"members of P that hold it) of one shape, got {held[r][name]} on rank {r} of P and "
                                 f"{shape} on rank {rank}")
    return [g for name, g in plain.items() if first[name] == P.rank]
