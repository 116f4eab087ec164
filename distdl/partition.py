"""Partitions: sets of MPI workers, optionally arranged as a Cartesian grid.

Every partition is derived from a *root* partition that wraps a user communicator
(``MPIPartition(MPI.COMM_WORLD)``). A partition records its members as ranks of that root,
so every worker -- member or not -- knows who belongs to it without communicating (except a
sub-grid taken on a worker outside its parent, which has no fibre to know). New
communicators are made with ``MPI_Comm_create_group``, which is collective over the members of
the new partition only: workers outside it never block, and ranks that build partitions over
disjoint sets of workers in different orders cannot deadlock each other.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from distdl.utilities import settings
from distdl.utilities.caches import keep

__all__ = ["MPIPartition", "live_communicators"]

_live_communicators = 0

_REDUCE_OPS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


# Communicators of collected partitions, freed at the next safe point. A partition's finalizer may run inside
# the garbage collector at any allocation, including one that mpi4py makes while holding the lock that its own
# MPI_Comm_free callback takes: freeing there deadlocks the worker (and its peers in their next collective).
_released: list[MPI.Comm] = []


def live_communicators() -> int:
    """Return how many communicators distdl has created and not yet freed on this worker."""
    free_released()
    return _live_communicators


def _release(comm: MPI.Comm) -> None:
    _released.append(comm)  # no MPI call here (see _released)


def free_released() -> None:
    """Free the communicators of partitions the garbage collector has collected (called where MPI may be called:
    when partitions are made and counted)."""
    global _live_communicators
    for queue in (_released_private, _released):
        while queue:
            try:
                comm = queue.pop()
            except IndexError:  # emptied meanwhile by another thread (backward on a device's)
                break
            if queue is _released:
                _live_communicators -= 1
            if not MPI.Is_finalized():
                comm.Free()


def _forget_private(comm: MPI.Comm, keyval: int, private: MPI.Comm) -> None:
    """The user freed ``comm``: the partitions made from it go on working on its duplicate, which is freed once the
    last of them is collected (at the next safe point; no MPI call here, see _released)."""
    done = weakref.finalize(private, _released_private.append, MPI.Intracomm.fromhandle(private.handle))
    done.atexit = False


def _private(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Return distdl's duplicate of the user's ``comm`` (made once, collectively, and kept as an attribute of
    ``comm``): distdl's point-to-point messages never meet the user's own on ``comm``, whatever their tags."""
    global _PRIVATE
    if _PRIVATE is None:  # made at first use: importing distdl must not call MPI (not yet initialised)
        _PRIVATE = MPI.Comm.Create_keyval(delete_fn=_forget_private)
    private = comm.Get_attr(_PRIVATE)
    if private is None:
        private = comm.Dup()
        try:
            _agree_on_settings(private)
        except ValueError:
            private.Free()
            raise
        comm.Set_attr(_PRIVATE, private)
    return private


def _agree_on_settings(comm: MPI.Intracomm) -> None:
    """Raise ValueError on every worker of ``comm`` unless all read the same :data:`settings.SHARED` (collective)."""
    seen = comm.allgather(settings.SHARED)
    differing = sorted({name for reading in seen for name in reading if reading.get(name) != seen[0].get(name)})
    if not differing:
        return
    from distdl.checks import _ranks  # checks imports this module
    clauses = []
    for name in differing:
        groups: dict[str | None, list[int]] = {}
        for rank, reading in enumerate(seen):
            groups.setdefault(reading.get(name), []).append(rank)
        clauses.append(f"{name}: " + "; ".join(f"{_ranks(ranks)} read {value}" for value, ranks in groups.items()))
    raise ValueError("MPIPartition: the ranks of the communicator read different settings, by which each chooses "
                     "the messages of its collectives (a rank would wait for messages never sent); set them alike "
                     "on every rank: " + "; ".join(clauses))


_PRIVATE: int | None = None
_released_private: list[MPI.Comm] = []  # duplicates of user communicators the user has freed (not counted as live)


def _check_initialized(where: str) -> None:
    """Raise RuntimeError outside MPI's lifetime (MPICH would end the process with its own message)."""
    if MPI.Is_finalized() or not MPI.Is_initialized():
        raise RuntimeError(f"{where}: MPI is {'finalized' if MPI.Is_finalized() else 'not initialised'}; distdl's "
                           "partitions work between MPI's initialisation (importing mpi4py's MPI module, or "
                           "MPI.Init_thread with mpi4py.rc.initialize = False) and MPI.Finalize()")


def _as_int_tuple(values: Iterable[Any], what: str, where: str) -> tuple[int, ...]:
    try:
        array = np.asarray(list(values) if not np.isscalar(values) else [values])
    except (TypeError, ValueError) as error:  # ValueError: nested sequences of several lengths
        raise TypeError(f"{where}: expected a sequence of integers for {what}, got {values!r}") from error
    if array.ndim > 1:  # nested: flattened, it read as another shape or other ranks
        raise TypeError(f"{where}: expected a flat sequence of integers for {what}, got {values!r}")
    if array.size and not np.issubdtype(array.dtype, np.integer):  # bools too: flags are not indices
        raise TypeError(f"{where}: expected integers for {what}, got {values!r}")
    return tuple(int(v) for v in array.ravel())


class _Other:
    """An entry of a partition's cache about another partition, held weakly (see ``MPIPartition._memo_with``)."""
    __slots__ = ("ref", "value")

    def __init__(self, ref: weakref.ref, value: Any) -> None:
        self.ref, self.value = ref, value


class MPIPartition:
    """A set of workers (MPI ranks), optionally arranged as a Cartesian grid.

    ``MPIPartition(comm)`` wraps ``comm`` (default ``MPI.COMM_WORLD``) as a root partition of
    shape ``(comm.size,)`` (``comm.dims`` for a Cartesian communicator). It works on its own duplicate of
    ``comm``, made collectively by the first ``MPIPartition(comm)`` and kept while ``comm`` or a partition made
    from it lives (freeing ``comm`` leaves those partitions working), so
    distdl's messages never meet the program's own on ``comm``; that first call also raises ValueError on
    every worker unless all read the same settings that shape distdl's collectives (``DISTDL_CHECK``,
    ``DISTDL_PAIRWISE_SUM_BYTES``, ``DISTDL_STRIDED_BYTES``). Every partition's ``comm`` is distdl's: for
    point-to-point messages of your own, use a duplicate of it.

    Every other partition is derived from a root with the ``create_*`` methods, which every worker
    of the root may call (SPMD). A worker outside a partition is *inactive* there: its ``comm`` is
    ``MPI.COMM_NULL``, ``rank`` is -1 and ``index`` is ``None``, while ``shape``, ``dim`` and ``size``
    still describe the partition.
    """

    def __init__(self, comm: MPI.Comm = MPI.COMM_WORLD) -> None:
        _check_initialized("MPIPartition")
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"MPIPartition: expected an mpi4py intracommunicator, got {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError("MPIPartition: expected an active communicator, got MPI.COMM_NULL")
        if comm.Is_inter():
            raise TypeError("MPIPartition: expected an intracommunicator, got an intercommunicator (use its "
                            "Merge() to make one)")
        if type(comm) is MPI.Comm:  # a plain handle of an intracommunicator
            comm = MPI.Intracomm(comm)
        shape = tuple(comm.dims) if isinstance(comm, MPI.Cartcomm) else (comm.size,)
        private = _private(comm)
        self._init(private, tuple(range(comm.size)), shape, private, owned=False)

    # -- construction ---------------------------------------------------------------------

    def _init(self, root: MPI.Comm, members: tuple[int, ...] | None, shape: tuple[int, ...],
              comm: MPI.Comm, owned: bool) -> None:
        self._root = root
        self._members = members
        self._shape = shape
        self._comm = comm
        self._index: tuple[int, ...] | None = None
        self._cache: dict = {}
        self._finalizer = None
        self._freed = False
        # The root ranks of the sub-grid this partition was made within by create_subpartition (each worker's own,
        # unknown outside its parent), where it was: then it joins only partitions within that sub-grid; and
        # whether that sub-grid is one of several (its parent's other workers have theirs).
        self._fibre: frozenset[int] | None = None
        self._split = False
        if owned and comm != MPI.COMM_NULL:
            global _live_communicators
            _live_communicators += 1
            self._finalizer = weakref.finalize(self, _release, comm)
            self._finalizer.atexit = False

    def _derive(self, members: tuple[int, ...] | None, shape: tuple[int, ...], tag: int = 0,
                fibre: frozenset[int] | None = None, split: bool = False) -> MPIPartition:
        """Return the partition of ``members`` (root ranks) with ``shape``, made within this partition's sub-grid
        or ``fibre`` (see ``_fibre``); collective over the members."""
        self._check_live("MPIPartition")
        free_released()
        comm = MPI.COMM_NULL
        if members is not None and self._root.rank in members:
            root_group = self._root.Get_group()
            group = root_group.Incl(list(members))
            comm = self._root.Create_group(group, tag)
            group.Free()
            root_group.Free()
        partition = MPIPartition.__new__(MPIPartition)
        partition._init(self._root, members, shape, comm, owned=True)
        partition._fibre = self._fibre if fibre is None else fibre
        partition._split = self._split or split
        return partition

    def _agree(self, where: str, **facts: Any) -> None:
        """In check mode, verify that every member of this partition derives the same partition (else a hang)."""
        from distdl import checks  # checks imports this module
        if checks.check_mode() and self.active:
            checks.verify(where, self, agree=facts)

    def _require_members(self, where: str) -> tuple[int, ...]:
        if self._members is None:
            raise ValueError(f"{where}: the members of this partition are unknown on root rank "
                             f"{self._root.rank}: it was made by create_subpartition on a worker outside "
                             "its parent; derive partitions from ones this worker knows")
        return self._members

    def _check_joinable(self, where: str, other: MPIPartition) -> None:
        """ValueError where this partition or ``other`` is a worker's own sub-grid (made by create_subpartition)
        and the other has workers outside that sub-grid: those workers see another sub-grid there (or none), so
        the partition joining both would differ between its workers (mixed groups, or a hang)."""
        for P, Q in ((self, other), (other, self)):
            if P._fibre is None:
                continue
            outside = sorted(set(Q._members) - P._fibre)
            if outside:
                raise ValueError(f"{where}: a partition made by create_subpartition is each worker's own sub-grid "
                                 f"(unknown outside its parent), so it joins only partitions within that sub-grid "
                                 f"(root ranks {sorted(P._fibre)}); got one with root ranks {outside} outside it")
            # Q, made from the whole (or from a sub-grid keeping it all), lies in one of the sub-grids at most: the
            # others would raise above
            if P._split and (Q._fibre is None or not Q._fibre <= P._fibre):
                raise ValueError(f"{where}: a partition made by create_subpartition is each worker's own sub-grid, one "
                                 f"of several, so it joins only partitions made from it; got one made from the whole "
                                 f"(root ranks {list(Q._members)}), which the other sub-grids cannot join")

    def _check_ranks(self, where: str, ranks: Iterable[int]) -> tuple[int, ...]:
        ranks = _as_int_tuple(ranks, "ranks", where)
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ValueError(f"{where}: expected ranks in [0, {self.size}), got {bad}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{where}: expected distinct ranks, got {list(ranks)}")
        return ranks

    def _check_axes(self, where: str, axes: Iterable[int]) -> tuple[int, ...]:
        axes = _as_int_tuple(axes, "axes", where)
        bad = [a for a in axes if not -self.dim <= a < self.dim]
        if bad:
            raise ValueError(f"{where}: expected axes in [{-self.dim}, {self.dim}) for a partition of "
                             f"shape {self.shape}, got {bad}")
        axes = tuple(a % self.dim for a in axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"{where}: expected distinct axes, got {list(axes)}")
        return tuple(sorted(axes))

    def _check_same_root(self, where: str, other: MPIPartition) -> None:
        if not isinstance(other, MPIPartition):
            raise TypeError(f"{where}: expected an MPIPartition, got {type(other).__name__}")
        self._check_live(where)
        other._check_live(where)
        if other._root is not self._root and MPI.Comm.Compare(other._root, self._root) != MPI.IDENT:
            raise ValueError(f"{where}: expected partitions derived from the same root partition")

    def create_partition_inclusive(self, ranks: Iterable[int]) -> MPIPartition:
        """Return the partition of the listed ranks of this partition, in the order given."""
        self._check_live("create_partition_inclusive")
        ranks = self._check_ranks("create_partition_inclusive", ranks)
        if not ranks:
            raise ValueError("create_partition_inclusive: expected at least one rank, got none")
        if self._members is None:  # a sub-grid of a parent this worker is outside: so is any part of it
            return self._derive(None, (len(ranks),), fibre=frozenset(), split=True)
        return self._derive(tuple(self._members[r] for r in ranks), (len(ranks),))

    def create_partition_exclusive(self, ranks: Iterable[int]) -> MPIPartition:
        """Return the partition of all ranks of this partition except the listed ones."""
        self._check_live("create_partition_exclusive")
        excluded = set(self._check_ranks("create_partition_exclusive", ranks))
        keep = [r for r in range(self.size) if r not in excluded]
        if not keep:
            raise ValueError(f"create_partition_exclusive: expected to keep at least one of {self.size} "
                             "ranks, got all of them excluded")
        if self._members is None:  # as in create_partition_inclusive
            return self._derive(None, (len(keep),), fibre=frozenset(), split=True)
        return self._derive(tuple(self._members[r] for r in keep), (len(keep),))

    def create_partition_union(self, other: MPIPartition) -> MPIPartition:
        """Return the workers of this partition followed by those of ``other`` not in it."""
        self._check_same_root("create_partition_union", other)
        mine = self._require_members("create_partition_union")
        theirs = other._require_members("create_partition_union")
        self._check_joinable("create_partition_union", other)
        members = mine + tuple(m for m in theirs if m not in set(mine))
        fibres = [P._fibre for P in (self, other) if P._fibre is not None]
        return self._derive(members, (len(members),), fibre=frozenset.intersection(*fibres) if fibres else None,
                            split=other._split)

    def create_cartesian_topology_partition(self, shape: Sequence[int]) -> MPIPartition:
        """Return the same workers arranged as a grid of ``shape`` (row-major rank order)."""
        self._check_live("create_cartesian_topology_partition")
        shape = _as_int_tuple(shape, "shape", "create_cartesian_topology_partition")
        if not shape or any(s < 1 for s in shape) or math.prod(shape) != self.size:
            raise ValueError(f"create_cartesian_topology_partition: expected a shape of positive extents "
                             f"whose product is the partition size {self.size}, got {list(shape)}"
                             + self._grid_hint(shape))
        self._agree("create_cartesian_topology_partition", shape=shape)
        return self._derive(self._members, shape)

    def _grid_hint(self, shape: tuple[int, ...]) -> str:
        """Say how to get a grid of ``shape`` whose product is not this partition's size, where one of the usual
        two ways does."""
        n = math.prod(shape) if shape and min(shape) >= 1 else 0
        if 0 < n < self.size:
            return f" (to use {n} of its workers, take them first: create_partition_inclusive(range({n})))"
        if n > self.size and self.size == self._root.size:
            return f" (launch {n} ranks for it: mpiexec -n {n})"
        return ""

    def create_subpartition(self, axes: Iterable[int]) -> MPIPartition:
        """Return the sub-grid keeping ``axes``: the workers sharing this worker's other coordinates."""
        self._check_live("create_subpartition")
        axes = self._check_axes("create_subpartition", axes)
        shape = tuple(self.shape[a] for a in axes)
        if not self.active:
            return self._derive(None, shape, fibre=frozenset(), split=True)
        self._agree("create_subpartition", axes=axes)
        grid = np.arange(self.size).reshape(self.shape)
        fibre = tuple(self._members[r] for r in grid[tuple(slice(None) if a in axes else i
                                                           for a, i in enumerate(self.index))].ravel())
        return self._derive(fibre, shape, fibre=frozenset(fibre), split=len(fibre) < self.size)

    def create_cartesian_subtopology_partition(self, remain_dims: Sequence[bool]) -> MPIPartition:
        """Return the sub-grid keeping the axes flagged in ``remain_dims`` (as ``MPI_Cart_sub``)."""
        flags = list(remain_dims) if isinstance(remain_dims, Iterable) and not isinstance(remain_dims, str) else None
        if flags is None or not all(isinstance(f, (bool, np.bool_)) or f in (0, 1) for f in flags):
            raise TypeError(f"create_cartesian_subtopology_partition: expected a sequence of bools, got "
                            f"{remain_dims!r}")
        remain_dims = flags
        if len(remain_dims) != self.dim:
            raise ValueError(f"create_cartesian_subtopology_partition: expected {self.dim} flags, "
                             f"got {len(remain_dims)}")
        return self.create_subpartition([a for a, keep in enumerate(remain_dims) if keep])

    def create_allreduction_partition(self, axes_reduce: Iterable[int]) -> MPIPartition:
        """Return this worker's fibre along ``axes_reduce``: the workers it sums with."""
        return self.create_subpartition(axes_reduce)

    def create_broadcast_partition_to(self, P_dest: MPIPartition, transpose_src: bool = False,
                                      transpose_dest: bool = False) -> tuple[MPIPartition, MPIPartition]:
        """Return ``(P_send, P_recv)`` for broadcasting blocks of this partition onto ``P_dest``.

        Shapes follow NumPy broadcasting: the source shape (reversed if ``transpose_src``) is
        left-padded with 1s to the destination's dimension (reversed if ``transpose_dest``),
        and each source extent must equal the destination's or be 1. Each source worker is
        rank 0 of its ``P_send``, whose other members are the destination workers it feeds;
        ``P_recv`` is the group this worker receives in. Both are inactive where not needed,
        and they are the same object when this worker feeds itself.
        """
        where = "create_broadcast_partition_to"
        self._check_same_root(where, P_dest)
        for name, value in (("transpose_src", transpose_src), ("transpose_dest", transpose_dest)):
            if not isinstance(value, (bool, np.bool_)):  # a string read as True
                raise TypeError(f"{where}: expected a bool for {name}, got {value!r}")
        groups = _broadcast_groups(where, self, P_dest, transpose_src, transpose_dest)
        me = self._root.rank
        P_send = P_recv = None
        # Every worker walks the groups in the same order, so creation is deadlock-free.
        for tag, (members, feeds_itself) in enumerate(groups):
            if me not in members:
                continue
            partition = self._derive(members, (len(members),), tag)
            if members[0] == me:
                P_send = partition
            if me in members[1:] or (members[0] == me and feeds_itself):
                P_recv = partition
        null = self._derive((), (0,))
        return P_send or null, P_recv or null

    def create_reduction_partition_to(self, P_dest: MPIPartition, transpose_src: bool = False,
                                      transpose_dest: bool = False) -> tuple[MPIPartition, MPIPartition]:
        """Return ``(P_send, P_recv)`` for sum-reducing blocks of this partition onto ``P_dest``.

        The reverse of :meth:`create_broadcast_partition_to` from ``P_dest`` to this partition:
        each destination worker is rank 0 of the group it receives the sum in (``P_recv``).
        """
        self._check_same_root("create_reduction_partition_to", P_dest)
        P_recv, P_send = P_dest.create_broadcast_partition_to(self, transpose_dest, transpose_src)
        return P_send, P_recv

    def _memo(self, key: Any, build: Any) -> Any:
        """Return what ``build()`` returns for ``key``, built once per partition (plans, sub-partitions)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _memo_recent(self, kind: str, key: Any, build: Any, limit: int = 256) -> Any:
        """Return what ``build()`` returns for ``key``, kept among the ``limit`` latest built for ``kind``.

        For plans keyed by a call's shapes: a job whose shapes vary from call to call (sequence lengths,
        image sizes, a smaller last batch) must not keep one per shape for ever. Every member sees the
        same calls, so every member forgets the same plans. ``build()`` must not communicate.
        """
        known = self._memo(("recent", kind), dict)
        found = known.get(key)
        if found is None:
            found = keep(known, key, build(), limit)
        return found

    def _memo_with(self, other: MPIPartition, key: Any, build: Any) -> Any:
        """Return what ``build()`` returns for ``key`` and the partition object ``other``, built once.

        The entry refers to ``other`` weakly and is found by identity. Entries keyed by partitions
        would keep them alive, and a plan each way between two partitions (or from one to itself)
        would make a cycle: the garbage collector would then free their communicators at different
        times on different workers, and MPI's free may wait on the other members. ``build()`` must not
        return None.
        """
        value = self._cached_with(other, key)
        if value is None:
            # entries of partitions that are gone: their ids may be reused
            for stale in [k for k, v in self._cache.items() if type(v) is _Other and v.ref() is None]:
                del self._cache[stale]
            value = build()
            self._cache[(key, id(other))] = _Other(weakref.ref(other), value)
        return value

    def _cached_with(self, other: MPIPartition, key: Any) -> Any:
        """Return what :meth:`_memo_with` built for ``key`` and ``other``, or None (a lookup costs ~0.2 us)."""
        entry = self._cache.get((key, id(other)))
        return entry.value if entry is not None and entry.ref() is other else None

    # -- attributes -----------------------------------------------------------------------

    @property
    def comm(self) -> MPI.Comm:
        """The communicator of the members (``MPI.COMM_NULL`` on inactive workers)."""
        return self._comm

    @property
    def active(self) -> bool:
        """Whether this worker is a member; ValueError once the partition was freed (its members would read as
        outside it)."""
        if self._freed:
            self._check_live("MPIPartition")
        return self._comm != MPI.COMM_NULL

    @property
    def rank(self) -> int:
        """This worker's rank in the partition, -1 if inactive."""
        return self._comm.Get_rank() if self.active else -1

    @property
    def size(self) -> int:
        """The number of workers."""
        return math.prod(self._shape)  # ~0.2 us, against ~5 us for np.prod

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid shape."""
        return self._shape

    @property
    def dim(self) -> int:
        """The number of grid axes."""
        return len(self._shape)

    @property
    def index(self) -> tuple[int, ...] | None:
        """This worker's grid coordinates, ``None`` if inactive."""
        if not self.active:
            return None
        if self._index is None:  # computed once: ~7 us each time (layers read it in their forward)
            self._index = self.cartesian_index(self.rank)
        return self._index

    @property
    def root_ranks(self) -> tuple[int, ...] | None:
        """The members' ranks in the root communicator, in partition rank order."""
        return self._members

    def cartesian_index(self, rank: int, where: str = "cartesian_index") -> tuple[int, ...]:
        """Return the grid coordinates of partition rank ``rank`` (row-major)."""
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, (bool, np.bool_)):
            raise TypeError(f"{where}: expected an int rank, got {rank!r}")
        if not 0 <= rank < self.size:
            raise ValueError(f"{where}: expected a rank in [0, {self.size}), got {rank}")
        return tuple(int(i) for i in np.unravel_index(rank, self._shape))

    def neighbor_ranks(self, rank: int) -> list[tuple[int, int]]:
        """Return, per axis, the (left, right) neighbours of ``rank``; ``MPI.PROC_NULL`` at edges."""
        index = self.cartesian_index(rank, "neighbor_ranks")
        neighbors = []
        for axis, extent in enumerate(self._shape):
            pair = []
            for step in (-1, 1):
                i = index[axis] + step
                if 0 <= i < extent:
                    pair.append(int(np.ravel_multi_index(index[:axis] + (i,) + index[axis + 1:], self._shape)))
                else:
                    pair.append(MPI.PROC_NULL)
            neighbors.append((pair[0], pair[1]))
        return neighbors

    # -- small metadata collectives ---------------------------------------------------------

    def broadcast_data(self, data: Any, root: int = 0) -> np.ndarray | None:
        """Return ``data`` from partition rank ``root`` as a numpy array; ``None`` if inactive."""
        if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"broadcast_data: expected an integer root, got {root!r}")
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast_data: expected a root in [0, {self.size}), got {root}")
        if not self.active:
            return None
        return self._comm.bcast(np.asarray(data) if self.rank == root else None, root=root)

    def allgather_data(self, data: Any) -> np.ndarray | None:
        """Return every member's ``data`` stacked along a new first axis; ``None`` if inactive."""
        return self._gathered("allgather_data", data)

    def allreduce_data(self, data: Any, op: str = "sum") -> np.ndarray | None:
        """Return the elementwise reduction (``sum``, ``prod``, ``max``, ``min``) of ``data`` over members.

        Members reduce in rank order, so every member gets the same bits. ``None`` if inactive.
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"allreduce_data: expected op in {sorted(_REDUCE_OPS)}, got {op!r}")
        gathered = self._gathered("allreduce_data", data)
        if gathered is None:
            return None
        if gathered.dtype.kind not in "biufc":  # the same on every member: each has every member's data
            raise TypeError(f"allreduce_data: expected numeric data, got {gathered.dtype}")
        return _REDUCE_OPS[op].reduce(gathered, axis=0, dtype=gathered.dtype)

    def _gathered(self, where: str, data: Any) -> np.ndarray | None:
        """Return every member's ``data`` stacked (None if inactive); ValueError (on every member: each has them
        all) unless their shapes agree."""
        if not self.active:
            return None
        arrays = self._comm.allgather(np.asarray(data))
        shapes = [a.shape for a in arrays]
        if any(shape != shapes[0] for shape in shapes):
            seen = ", ".join(f"{shape} on root rank {r}" for shape, r in zip(shapes, self.root_ranks))
            raise ValueError(f"{where}: expected data of one shape on every member, got {seen}")
        return np.stack(arrays)

    # -- lifetime and comparison ------------------------------------------------------------

    def free(self) -> None:
        """Free this partition's communicator now (collective over its members); idempotent."""
        for value in self._cache.values():
            value = value.value if type(value) is _Other else value
            for partition in value if isinstance(value, tuple) else (value,):
                if isinstance(partition, MPIPartition):
                    partition.free()
        self._cache.clear()
        if self._finalizer is not None:
            self._finalizer()
            free_released()
        self._comm = MPI.COMM_NULL
        self._freed = True

    deactivate = free
    """DistDL's name of :meth:`free`. Unlike DistDL's, it leaves the partition unusable, not inactive: deriving
    from it or passing it to a primitive or layer raises ValueError (build a new one instead)."""

    def _check_live(self, where: str) -> None:
        """Raise RuntimeError outside MPI's lifetime, ValueError if this partition was freed (its members would pass
        for inactive workers)."""
        _check_initialized(where)
        if self._freed:
            raise ValueError(f"{where}: the partition of shape {self.shape} was freed (free(), or the end of its "
                             "`with` block) and cannot be used; build a new one")

    def __enter__(self) -> MPIPartition:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    def __copy__(self) -> MPIPartition:
        return self

    def __deepcopy__(self, memo: dict) -> MPIPartition:
        return self  # a partition names workers and their communicator: copies of a layer share it

    def __reduce__(self):
        raise TypeError("MPIPartition cannot be pickled: it holds an MPI communicator (save a module's state_dict(), "
                        "and build the module again where it is loaded)")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MPIPartition):
            return NotImplemented
        if self is other:
            return True
        if self._members is None or other._members is None:
            return False
        same_root = other._root is self._root or MPI.Comm.Compare(other._root, self._root) == MPI.IDENT
        return same_root and self._members == other._members and self._shape == other._shape

    def __hash__(self) -> int:
        return hash((self._members, self._shape)) if self._members is not None else id(self)

    def __repr__(self) -> str:
        if self._freed:
            return f"MPIPartition(shape={self.shape}, freed)"
        if not self.active:
            return f"MPIPartition(shape={self.shape}, active=False)"
        return f"MPIPartition(shape={self.shape}, rank={self.rank}, index={self.index})"


def _broadcast_groups(where: str, P_src: MPIPartition, P_dest: MPIPartition, transpose_src: bool,
                      transpose_dest: bool) -> list[tuple[tuple[int, ...], bool]]:
    """Return, per source worker, ``(source, *other destinations)`` as root ranks and whether the
    source is also one of its own destinations (computed locally, without communication)."""
    src_shape = P_src.shape[::-1] if transpose_src else P_src.shape
    dest_shape = P_dest.shape[::-1] if transpose_dest else P_dest.shape
    if len(src_shape) > len(dest_shape):
        raise ValueError(f"{where}: expected a source partition of at most {len(dest_shape)} dimensions "
                         f"(the destination's), got shape {P_src.shape}")
    padded = (1,) * (len(dest_shape) - len(src_shape)) + src_shape
    if any(s != d and s != 1 for s, d in zip(padded, dest_shape)):
        raise ValueError(f"{where}: source partition shape {P_src.shape} does not broadcast to destination "
                         f"shape {P_dest.shape} (transpose_src={transpose_src}, transpose_dest={transpose_dest})")
    if not (P_src.active or P_dest.active):
        return []
    src_members = P_src._require_members(where)
    dest_members = P_dest._require_members(where)
    P_src._check_joinable(where, P_dest)

    def grid(shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        ranks = np.arange(int(np.prod(shape))).reshape(shape)
        return ranks.transpose() if transpose else ranks

    src_grid = grid(P_src.shape, transpose_src).reshape(padded)
    dest_grid = grid(P_dest.shape, transpose_dest)
    groups = []
    for src_index in np.ndindex(*padded):
        fed = dest_grid[tuple(slice(None) if s == 1 else i for s, i in zip(padded, src_index))]
        source = src_members[src_grid[src_index]]
        fed_members = [dest_members[r] for r in fed.ravel()]
        groups.append(((source, *(m for m in fed_members if m != source)), source in fed_members))
    return groups
