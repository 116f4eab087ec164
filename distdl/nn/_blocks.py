"""Whether the blocks of a partition form one global tensor, checked inside a sum the layer makes anyway.

A layer that sums statistics over the workers of a partition (batch norm's moments, a loss's sum) takes
blocks whose extents may be uneven, but the workers at one index along an axis must hold the same extent
of that axis's dimension (the same rows), or the blocks form no global tensor and the sum is of no
sequential model's. Each worker adds, for every dimension ``d`` and index ``j`` along partition axis ``d``,
``[1, e, e^2]`` at its own index (``e``: its extent of ``d``) to the sum; the workers at ``j`` agree exactly
when ``count * squares == extents^2``, and every member reads the same sums, so all raise alike.
"""

from __future__ import annotations

import numpy as np
import torch

from distdl.partition import MPIPartition


def extent_terms(shape, P: MPIPartition, axes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Return this worker's part (float64) of the sum that :func:`check_extents` reads, for dimensions ``axes``."""
    terms = np.zeros(3 * sum(P.shape[a] for a in axes))  # NumPy: a torch call costs ~1 us each here
    start, index = 0, P.index
    for a in axes:
        e = float(shape[a])
        terms[start + 3 * index[a]:start + 3 * index[a] + 3] = (1.0, e, e * e)
        start += 3 * P.shape[a]
    return torch.from_numpy(terms).to(device)


def check_extents(where: str, sums: torch.Tensor, shape, P: MPIPartition, axes: tuple[int, ...]) -> None:
    """Raise ValueError (on every worker that summed ``sums``) where workers at one index along an axis hold
    different extents of that dimension; ``shape`` is this worker's block's."""
    values = sums.tolist()
    start = 0
    for a in axes:
        for j in range(P.shape[a]):
            count, extents, squares = (int(v) for v in values[start + 3 * j:start + 3 * j + 3])
            # exact while the sum of squares is (beyond 2^53 the float64 sum may have rounded: not checked)
            if squares < 2 ** 53 and count * squares != extents * extents:
                at = f"at index {j} along axis {a} of P_x" if P.shape[a] > 1 else "of P_x"
                raise ValueError(f"{where}: expected the blocks of one global tensor (the same extent of dimension "
                                 f"{a} on every worker {at}), got shape {tuple(shape)} on worker {P._root.rank} and "
                                 f"another extent on a worker {at} (P_x of shape {P.shape})")
        start += 3 * P.shape[a]
