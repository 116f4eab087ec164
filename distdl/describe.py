"""Text views of a partition and of a tensor's decomposition over it, for printing at run time.

``describe(P)`` lists the workers of ``P``: each one's grid index, partition rank and root rank,
and the grid of root ranks. ``describe(P, global_shape)`` adds, per worker, the block of a tensor
of ``global_shape`` it holds (start, stop and shape, the balanced decomposition every layer uses).
Neither communicates: every worker knows the members of a partition it derived, so any worker,
active or not, may call them and print the same text (the line of the calling worker is marked); a
sub-grid taken on a worker outside its parent is the exception: that worker does not know its members.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_stop_index, compute_subshape

__all__ = ["describe"]


def describe(P: MPIPartition, global_shape: Sequence[int] | None = None) -> str:
    """Return a text view of ``P``, and of the decomposition of a ``global_shape`` tensor over it.

    Args:
        P: the partition.
        global_shape: the global tensor's shape (one extent per axis of ``P``); ``None`` describes
            the partition alone.
    Returns:
        Several lines of text, the same on every worker except for the ``<- this worker`` mark.
    Raises:
        TypeError: ``P`` not a partition, or a ``global_shape`` that is not a sequence of integers.
        ValueError: a ``global_shape`` of the wrong length or with negative extents, or a freed ``P``.
    """
    where = "describe"
    if not isinstance(P, MPIPartition):
        raise TypeError(f"{where}: expected an MPIPartition, got {type(P).__name__}")
    P._check_live(where)
    shape = None if global_shape is None else _check_shape(where, P, global_shape)
    members = P.root_ranks
    me = P.rank if P.active else -1
    status = f"this worker is rank {me}, index {P.index}" if P.active else "this worker is not a member"
    lines = [f"MPIPartition of shape {P.shape}: {P.size} worker{'s' if P.size != 1 else ''} ({status})"]
    if members is None:
        lines.append("  members unknown on this worker (made by create_subpartition outside its parent)")
        return "\n".join(lines)
    if P.size > 1 and P.dim > 1:
        lines.append("  root ranks laid out on the grid:")
        grid = np.array(members).reshape(P.shape)
        lines += ["    " + row for row in np.array2string(grid, separator=" ").splitlines()]
    if shape is not None:
        lines.append(f"  tensor of global shape {shape}, balanced blocks:")
    header = ["index", "rank", "root rank"] + (["start", "stop", "shape"] if shape is not None else [])
    rows = []
    for rank in range(P.size):
        index = P.cartesian_index(rank)
        row = [str(index), str(rank), str(members[rank])]
        if shape is not None:
            row += [str(tuple(int(v) for v in f(P.shape, index, shape)))
                    for f in (compute_start_index, compute_stop_index, compute_subshape)]
        rows.append(row)
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for rank, row in enumerate(rows):
        mark = "  <- this worker" if rank == me else ""
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + mark)
    return "\n".join(lines)


def _check_shape(where: str, P: MPIPartition, global_shape: Sequence[int]) -> tuple[int, ...]:
    try:
        values = list(global_shape)
    except TypeError as error:
        raise TypeError(f"{where}: expected a sequence of integers for global_shape, got {global_shape!r}") from error
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{where}: expected a sequence of integers for global_shape, got {global_shape!r}")
    if len(values) != P.dim:
        raise ValueError(f"{where}: expected a global_shape of {P.dim} extents for a partition of shape {P.shape}, "
                         f"got {tuple(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"{where}: expected non-negative extents, got {tuple(values)}")
    return tuple(int(v) for v in values)
