"""The balanced tensor decomposition: along each dimension the first ``n % p`` workers hold one extra element."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["compute_subshape", "compute_start_index", "compute_stop_index"]


def _arrays(where: str, P_shape: Sequence[int], index: Sequence[int], shape: Sequence[int]):
    P_shape, index, shape = (np.atleast_1d(np.asarray(a, dtype=np.int64)) for a in (P_shape, index, shape))
    if not len(P_shape) == len(index) == len(shape):
        raise ValueError(f"{where}: expected P_shape, index and shape of one length, got "
                         f"{P_shape.tolist()}, {index.tolist()}, {shape.tolist()}")
    if np.any(index < 0) or np.any(index >= P_shape):
        raise ValueError(f"{where}: expected an index inside P_shape {P_shape.tolist()}, got {index.tolist()}")
    return P_shape, index, shape


def compute_subshape(P_shape: Sequence[int], index: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """Return the shape of the block held by the worker at ``index`` of a ``P_shape`` grid."""
    P_shape, index, shape = _arrays("compute_subshape", P_shape, index, shape)
    return shape // P_shape + (index < shape % P_shape)


def compute_start_index(P_shape: Sequence[int], index: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """Return the global index of the first element of the worker's block."""
    P_shape, index, shape = _arrays("compute_start_index", P_shape, index, shape)
    return index * (shape // P_shape) + np.minimum(index, shape % P_shape)


def compute_stop_index(P_shape: Sequence[int], index: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """Return the global index one past the last element of the worker's block."""
    return compute_start_index(P_shape, index, shape) + compute_subshape(P_shape, index, shape)
