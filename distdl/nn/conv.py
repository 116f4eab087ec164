"""DistributedConv1d/2d/3d: build the distributed convolution that fits the partitions given (as DistDL).

===================================================  ======================================================
partitions given                                     layer built
===================================================  ======================================================
``P_x`` only                                         :mod:`~distdl.nn.conv_feature` (batch and spatial split)
``P_x``, ``P_y``, ``P_w``, no spatial axis split     :mod:`~distdl.nn.conv_channel` (channels split)
``P_x``, ``P_y``, ``P_w``, otherwise                 :mod:`~distdl.nn.conv_general` (channels, spatial, batch)
===================================================  ======================================================
"""

from __future__ import annotations

from typing import Any

import torch

from distdl.functional._common import check_partition
from distdl.nn import conv_channel, conv_feature, conv_general
from distdl.partition import MPIPartition

__all__ = ["DistributedConv1d", "DistributedConv2d", "DistributedConv3d"]


def _build(dims: int, P_x: MPIPartition, args: tuple, P_y: MPIPartition | None, P_w: MPIPartition | None,
           kwargs: dict[str, Any]) -> torch.nn.Module:
    name = f"DistributedConv{dims}d"
    if P_y is None and P_w is None:
        return getattr(conv_feature, f"DistributedFeatureConv{dims}d")(P_x, *args, **kwargs)
    if P_y is None or P_w is None:
        raise ValueError(f"{name}: expected both P_y and P_w or neither, got "
                         f"{'P_y' if P_y is not None else 'P_w'} alone")
    for label, P in (("P_x", P_x), ("P_y", P_y), ("P_w", P_w)):
        check_partition(name, label, P)
    unsplit = P_w.dim == dims + 2 and all(P.shape[2:] == (1,) * dims for P in (P_x, P_y, P_w))
    module = conv_channel if unsplit else conv_general
    kind = "Channel" if unsplit else "General"
    return getattr(module, f"Distributed{kind}Conv{dims}d")(P_x, P_y, P_w, *args, **kwargs)


def DistributedConv1d(P_x: MPIPartition, *args: Any, P_y: MPIPartition | None = None,
                      P_w: MPIPartition | None = None, **kwargs: Any) -> torch.nn.Module:
    """Return the distributed 1-d convolution for these partitions (arguments after them are torch's)."""
    return _build(1, P_x, args, P_y, P_w, kwargs)


def DistributedConv2d(P_x: MPIPartition, *args: Any, P_y: MPIPartition | None = None,
                      P_w: MPIPartition | None = None, **kwargs: Any) -> torch.nn.Module:
    """Return the distributed 2-d convolution for these partitions (arguments after them are torch's)."""
    return _build(2, P_x, args, P_y, P_w, kwargs)


def DistributedConv3d(P_x: MPIPartition, *args: Any, P_y: MPIPartition | None = None,
                      P_w: MPIPartition | None = None, **kwargs: Any) -> torch.nn.Module:
    """Return the distributed 3-d convolution for these partitions (arguments after them are torch's)."""
    return _build(3, P_x, args, P_y, P_w, kwargs)
