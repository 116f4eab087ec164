"""DistributedConv1d/2d/3d: build the distributed convolution that fits the partitions given (as DistDL).

===================================================  ======================================================
partitions given                                     layer built
===================================================  ======================================================
``P_x`` only                                         :mod:`~distdl.nn.conv_feature` (batch and spatial split)
``P_x``, ``P_y``, ``P_w``, no spatial axis split     :mod:`~distdl.nn.conv_channel` (channels split)
``P_x``, ``P_y``, ``P_w``, otherwise                 :mod:`~distdl.nn.conv_general` (channels, spatial, batch)
===================================================  ======================================================

``P_y`` and ``P_w`` may be given by keyword or, as DistDL takes them, by position right after ``P_x``: the second
and third positional arguments are taken as ``P_y`` and ``P_w`` while they are partitions or ``None``, so both
``DistributedConv2d(P_x, P_y, P_w, 4, 6, 3)`` and ``DistributedConv2d(P_x, 4, 6, 3, P_y=P_y, P_w=P_w)`` work.
``isinstance(layer, DistributedConv2d)`` holds for every layer ``DistributedConv2d`` can build.
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


class _ConvSelector(type):
    """Metaclass of DistributedConv1d/2d/3d: calling the class builds the layer that fits the partitions, and
    ``isinstance``/``issubclass`` cover the feature, channel and general convolutions of its dimension."""

    dims: int

    def __call__(cls, P_x: MPIPartition, *args: Any, P_y: MPIPartition | None = None,
                 P_w: MPIPartition | None = None, **kwargs: Any) -> torch.nn.Module:
        given = {"P_y": P_y, "P_w": P_w}
        for label in given:  # DistDL's order: P_y and P_w by position, while the arguments are partitions or None
            if not args or not (args[0] is None or isinstance(args[0], MPIPartition)):
                break
            if given[label] is not None:
                raise TypeError(f"{cls.__name__}: got {label} both by position and by keyword")
            given[label], args = args[0], args[1:]
        return _build(cls.dims, P_x, args, given["P_y"], given["P_w"], kwargs)

    def _layers(cls) -> tuple[type, ...]:
        return tuple(getattr(module, f"Distributed{kind}Conv{cls.dims}d") for module, kind in
                     ((conv_feature, "Feature"), (conv_channel, "Channel"), (conv_general, "General")))

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, cls._layers())

    def __subclasscheck__(cls, sub: type) -> bool:
        return sub is cls or issubclass(sub, cls._layers())


class DistributedConv1d(metaclass=_ConvSelector):
    """``DistributedConv1d(P_x, [P_y, P_w,] *args, **kwargs)``: the distributed 1-d convolution for these
    partitions (see :mod:`distdl.nn.conv`; the other arguments are torch's)."""
    dims = 1


class DistributedConv2d(metaclass=_ConvSelector):
    """``DistributedConv2d(P_x, [P_y, P_w,] *args, **kwargs)``: the distributed 2-d convolution for these
    partitions (see :mod:`distdl.nn.conv`; the other arguments are torch's)."""
    dims = 2


class DistributedConv3d(metaclass=_ConvSelector):
    """``DistributedConv3d(P_x, [P_y, P_w,] *args, **kwargs)``: the distributed 3-d convolution for these
    partitions (see :mod:`distdl.nn.conv`; the other arguments are torch's)."""
    dims = 3
