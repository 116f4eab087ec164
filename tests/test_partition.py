"""MPIPartition at 1-4 ranks: every method, inactive workers, odd sizes and the error paths."""

import gc
import re
import weakref

import numpy as np
import pytest
import torch
from mpi4py import MPI

from distdl import MPIPartition, checking, partition
from distdl.functional import all_sum_reduce, repartition
from distdl.partition import live_communicators
from distdl.utilities import settings
from distdl.utilities.torch import zero_volume_tensor
from helpers import sizes


@sizes(1, 2, 3, 4)
def test_root_partition(P_world, comm):
    assert P_world.active and MPI.Comm.Compare(P_world.comm, comm) == MPI.CONGRUENT  # distdl's own duplicate
    assert (P_world.rank, P_world.size, P_world.shape, P_world.dim) == (comm.rank, comm.size, (comm.size,), 1)
    assert P_world.index == (comm.rank,)
    assert P_world.root_ranks == tuple(range(comm.size))


@sizes(1, 2, 3, 4)
def test_inclusive_and_exclusive(P_world, comm):
    n = comm.size
    evens = list(range(0, n, 2))
    P_even = P_world.create_partition_inclusive(evens[::-1])
    assert P_even.active == (comm.rank % 2 == 0)
    assert P_even.size == len(evens) and P_even.shape == (len(evens),)
    assert P_even.root_ranks == tuple(evens[::-1])
    if P_even.active:
        assert P_even.rank == evens[::-1].index(comm.rank)
        assert P_even.comm.size == len(evens)
        assert P_even.index == (P_even.rank,)
    else:
        assert (P_even.rank, P_even.index, P_even.comm) == (-1, None, MPI.COMM_NULL)
    if n > 1:
        P_odd = P_world.create_partition_exclusive(evens)
        assert P_odd.active == (comm.rank % 2 == 1)
        assert P_odd.root_ranks == tuple(range(1, n, 2))
        # Ranks are relative to the partition the method is called on.
        P_last = P_odd.create_partition_inclusive([P_odd.size - 1])
        assert P_last.active == (comm.rank == P_odd.root_ranks[-1])
        P_odd.free()
    P_even.free()


@sizes(2, 3, 4)
def test_union(P_world, comm):
    n = comm.size
    P_a = P_world.create_partition_inclusive([n - 1])
    P_b = P_world.create_partition_inclusive([0])
    P_ab = P_a.create_partition_union(P_b)
    assert P_ab.root_ranks == (n - 1, 0)
    assert P_ab.active == (comm.rank in (0, n - 1))
    if P_ab.active:
        # Union members keep the order: first partition, then the new workers of the second.
        assert P_ab.rank == (0 if comm.rank == n - 1 else 1)
        assert P_ab.comm.allreduce(1) == 2
    assert P_a.create_partition_union(P_a) == P_a


@sizes(1, 2, 3, 4)
def test_cartesian_topology_and_neighbors(P_world, comm):
    n = comm.size
    shape = {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[n]
    P = P_world.create_cartesian_topology_partition(shape)
    assert P.shape == shape and P.dim == 2 and P.size == n
    assert P.index == tuple(np.unravel_index(comm.rank, shape))
    for r in range(n):
        i = P.cartesian_index(r)
        assert i == tuple(np.unravel_index(r, shape))
        for axis, (left, right) in enumerate(P.neighbor_ranks(r)):
            for step, neighbor in ((-1, left), (1, right)):
                j = list(i)
                j[axis] += step
                expect = int(np.ravel_multi_index(j, shape)) if 0 <= j[axis] < shape[axis] else MPI.PROC_NULL
                assert neighbor == expect
    # A 3-d shape as well.
    P3 = P_world.create_cartesian_topology_partition((1, n, 1))
    assert P3.index == (0, comm.rank, 0)


@sizes(1, 2, 3, 4)
def test_subpartitions(P_world, comm):
    n = comm.size
    shape = {1: (1, 1), 2: (2, 1), 3: (1, 3), 4: (2, 2)}[n]
    P = P_world.create_cartesian_topology_partition(shape)
    i, j = P.index
    grid = np.arange(n).reshape(shape)
    rows = P.create_subpartition([1])
    assert rows.shape == (shape[1],) and rows.root_ranks == tuple(grid[i, :])
    assert rows.comm.allreduce(comm.rank) == int(grid[i, :].sum())
    cols = P.create_cartesian_subtopology_partition([True, False])
    assert cols.shape == (shape[0],) and cols.root_ranks == tuple(grid[:, j])
    assert cols.rank == i
    fibre = P.create_allreduction_partition([0])
    assert fibre == cols
    whole = P.create_subpartition([1, 0])  # axes are taken in the partition's order
    assert whole == P
    alone = P.create_subpartition([])
    assert (alone.shape, alone.size, alone.index, alone.comm.size) == ((), 1, (), 1)


@sizes(2, 3, 4)
def test_a_sub_grid_joins_only_partitions_within_it(P_world, comm):
    """A sub-grid is each worker's own (unknown outside its parent): joined with a partition reaching outside it,
    every worker raises instead of building a mixed group or hanging."""
    n = comm.size
    if n % 2 == 0:  # a row of a (2, n / 2) grid: one each
        rows = P_world.create_cartesian_topology_partition((2, n // 2)).create_subpartition([1])
    else:  # the one row of ranks 0 and 1, unknown on rank 2
        rows = P_world.create_partition_inclusive([0, 1]).create_subpartition([0])
    # within its sub-grid each worker's sub-grid joins its own parts: every row builds its own partition
    assert rows.active or (n == 3 and comm.rank == 2 and rows.root_ranks is None)  # unknown outside its parent
    first = rows.create_partition_inclusive([0])  # every worker derives alike; outside the parent, inactive
    others = rows.create_partition_exclusive([0]) if rows.size > 1 else first
    if not rows.active:
        assert not first.active and first.root_ranks is None and not others.active and others.root_ranks is None
        with pytest.raises(ValueError, match="create_partition_union: the members of this partition are unknown"):
            first.create_partition_union(rows)
    else:
        assert first.root_ranks == rows.root_ranks[:1]
        assert others.root_ranks == (rows.root_ranks[1:] or first.root_ranks)
        assert first.create_partition_union(rows).root_ranks == rows.root_ranks
        P_send, P_recv = first.create_broadcast_partition_to(rows)
        assert P_recv.root_ranks == rows.root_ranks
    if n % 2 == 0:  # rank 0 alone lies in one row: the other row cannot join it, so neither does
        first_of_world = P_world.create_partition_inclusive([0])
        # also made through a sub-grid that keeps the whole grid (the row holding it went on alone)
        whole = P_world.create_cartesian_topology_partition((2, n // 2)).create_subpartition([0, 1])
        first_of_whole = whole.create_partition_inclusive([0])
        for join in (lambda: rows.create_partition_union(first_of_world),
                     lambda: first_of_world.create_broadcast_partition_to(rows),
                     lambda: rows.create_partition_union(first_of_whole)):
            with pytest.raises(ValueError, match="create_subpartition"):
                join()
    outside = P_world.create_partition_inclusive([0, n - 1])  # reaching outside every row
    for join in (lambda: rows.create_partition_union(outside), lambda: outside.create_partition_union(rows),
                 lambda: rows.create_broadcast_partition_to(outside),
                 lambda: repartition(zero_volume_tensor(), outside, rows)):
        with pytest.raises(ValueError, match="create_subpartition"):
            join()


@sizes(3, 4)
def test_inactive_workers_get_well_defined_values(P_world, comm):
    P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition([1, 2])
    sub = P_x.create_subpartition([1])
    if comm.rank >= 2:
        assert not P_x.active and not sub.active
        assert (P_x.rank, P_x.index, P_x.shape, P_x.size) == (-1, None, (1, 2), 2)
        assert (sub.shape, sub.size, sub.root_ranks) == ((2,), 2, None)
        assert P_x.broadcast_data(1) is None and P_x.allgather_data(1) is None
        assert P_x.allreduce_data(1) is None
        assert repr(P_x) == "MPIPartition(shape=(1, 2), active=False)"
    else:
        assert sub == P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition([2])


@sizes(1, 2, 3, 4)
def test_data_collectives(P_world, comm):
    r, n = comm.rank, comm.size
    for dtype in (np.int8, np.int64, np.float32, np.float64, np.complex128, np.bool_):
        data = (np.arange(3) + r).astype(dtype)
        got = P_world.broadcast_data(data if r == n - 1 else None, root=n - 1)
        assert got.dtype == dtype and np.array_equal(got, (np.arange(3) + n - 1).astype(dtype))
        gathered = P_world.allgather_data(data)
        assert gathered.shape == (n, 3) and gathered.dtype == dtype
        assert np.array_equal(gathered, np.stack([(np.arange(3) + k).astype(dtype) for k in range(n)]))
        total = P_world.allreduce_data(data)
        assert total.dtype == dtype
        assert np.array_equal(total, np.add.reduce(gathered, axis=0, dtype=dtype))
    assert P_world.allreduce_data(r, op="max") == n - 1
    assert P_world.allreduce_data(r + 1, op="min") == 1
    assert P_world.allreduce_data(2, op="prod") == 2 ** n
    with pytest.raises(ValueError, match="allreduce_data: expected op"):
        P_world.allreduce_data(1, op="mean")
    with pytest.raises(ValueError, match=r"broadcast_data: expected a root in \[0, "):
        P_world.broadcast_data(1, root=n)
    # every member has every member's data, so each finds what disagrees
    if n > 1:
        with pytest.raises(ValueError, match=r"allgather_data: expected data of one shape on every member, got "
                                             r"\(1,\) on root rank 0, \(2,\) on root rank 1"):
            P_world.allgather_data(np.zeros(r + 1))
        with pytest.raises(ValueError, match="allreduce_data: expected data of one shape"):
            P_world.allreduce_data(list(range(r)))
    with pytest.raises(TypeError, match="allreduce_data: expected numeric data, got <U1"):
        P_world.allreduce_data("a")
    for bad in (1.5, "1", True):
        with pytest.raises(TypeError, match=f"neighbor_ranks: expected an int rank, got {bad!r}"):
            P_world.neighbor_ranks(bad)
    with pytest.raises(ValueError, match=r"neighbor_ranks: expected a rank in \[0, "):
        P_world.neighbor_ranks(n)
    assert P_world.cartesian_index(np.int64(0)) == (0,)


@sizes(2, 3, 4)
def test_broadcast_and_reduction_partitions(P_world, comm):
    """Broadcast from a 1 x k source onto a k' x k destination; the groups carry the right blocks."""
    n = comm.size
    dest_shape = {2: (2, 1), 3: (3, 1), 4: (2, 2)}[n]
    src_shape = (dest_shape[1],)
    # Sources are the last ranks, so source and destination overlap only partly.
    P_src = P_world.create_partition_inclusive(range(n - src_shape[0], n)).create_cartesian_topology_partition(
        src_shape)
    P_dest = P_world.create_cartesian_topology_partition(dest_shape)
    P_send, P_recv = P_src.create_broadcast_partition_to(P_dest)
    assert P_send.active == P_src.active
    assert P_recv.active == P_dest.active
    # Non-blocking, as a worker may send in one group and receive in another.
    sent, got = np.array(P_src.index or [-1]), np.array([-1])
    requests = []
    if P_send.active:
        requests.append(P_send.comm.Ibcast(sent, root=0))
    if P_recv.active and P_recv is not P_send:
        requests.append(P_recv.comm.Ibcast(got, root=0))
    MPI.Request.Waitall(requests)
    if P_recv is P_send:
        got = sent
    if P_dest.active:
        assert got.tolist() == [P_dest.index[1]]
        assert P_recv.root_ranks[0] == P_src.root_ranks[P_dest.index[1]]
    # The reduction partitions are the same groups seen from the other side.
    Q_send, Q_recv = P_dest.create_reduction_partition_to(P_src)
    assert Q_send.active == P_dest.active and Q_recv.active == P_src.active
    if Q_recv.active:
        assert Q_recv.root_ranks == P_send.root_ranks
        assert Q_recv.rank == 0
    if Q_send.active:
        assert Q_send.root_ranks == P_recv.root_ranks


@sizes(4)
def test_broadcast_partitions_transposed(P_world, comm):
    """A (2, 2) weight grid reduces onto a transposed (1, 2) output: DistDL's linear layer."""
    P_w = P_world.create_cartesian_topology_partition((2, 2))
    P_y = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition((1, 2))
    P_send, P_recv = P_w.create_reduction_partition_to(P_y, transpose_dest=True)
    # Each worker of P_w sends its column index; P_y's worker j receives the sum over row j.
    mine, total, zero = np.array([P_w.index[1] + 10]), np.array([-1]), np.array([0])
    requests = [P_send.comm.Ireduce(mine, total if P_send is P_recv else None, root=0)]
    if P_recv.active and P_recv is not P_send:
        requests.append(P_recv.comm.Ireduce(zero, total, root=0))
    MPI.Request.Waitall(requests)
    assert P_send.root_ranks[0] == P_y.root_ranks[P_w.index[0]]
    assert P_recv.active == P_y.active
    if P_y.active:
        assert total.tolist() == [10 + 11]
        assert P_recv.root_ranks[0] == comm.rank and P_recv.rank == 0


@sizes(1, 2, 3, 4)
def test_errors_are_raised_on_every_rank_before_communicating(P_world, comm):
    n = comm.size
    with pytest.raises(ValueError, match=rf"create_cartesian_topology_partition: expected a shape .* size {n}, "
                                         rf"got \[{n}, 2\]"):
        P_world.create_cartesian_topology_partition([n, 2])
    with pytest.raises(ValueError, match=rf"got \[{n}, 2\] \(launch {2 * n} ranks for it: mpiexec -n {2 * n}\)$"):
        P_world.create_cartesian_topology_partition([n, 2])
    with pytest.raises(ValueError, match=r"got \[5, 7378697629483820647\] \(launch"):  # np.prod would wrap to 3
        P_world.create_cartesian_topology_partition((5, (2**65 + 3) // 5))
    if n > 1:
        with pytest.raises(ValueError, match=rf"got \[{n}\]$"):  # more than these workers, no more than all
            P_world.create_partition_inclusive(range(n - 1)).create_cartesian_topology_partition([n])
        with pytest.raises(ValueError, match=r"got \[1, 1\] \(to use 1 of its workers, take them first: "
                                             r"create_partition_inclusive\(range\(1\)\)\)$"):
            P_world.create_cartesian_topology_partition([1, 1])
    with pytest.raises(ValueError, match=r"create_partition_inclusive: expected ranks in \[0, \d\), got \[-1\]"):
        P_world.create_partition_inclusive([0, -1])
    with pytest.raises(ValueError, match=rf"got \[{n}\]"):
        P_world.create_partition_exclusive([n])
    with pytest.raises(ValueError, match="expected distinct ranks, got \\[0, 0\\]"):
        P_world.create_partition_inclusive([0, 0])
    with pytest.raises(ValueError, match="expected at least one rank"):
        P_world.create_partition_inclusive([])
    with pytest.raises(ValueError, match="expected to keep at least one"):
        P_world.create_partition_exclusive(range(n))
    with pytest.raises(ValueError, match=r"create_subpartition: expected axes in \[-1, 1\) .*, got \[1\]"):
        P_world.create_subpartition([1])
    with pytest.raises(TypeError, match="create_subpartition: expected integers"):
        P_world.create_subpartition([0.5])
    with pytest.raises(ValueError, match="cartesian_index: expected a rank"):
        P_world.cartesian_index(n)
    if n > 1:
        with pytest.raises(ValueError, match=r"source partition shape \(\d, 1\) does not broadcast to destination "
                                             r"shape \(1, \d\)"):
            P_world.create_cartesian_topology_partition([n, 1]).create_broadcast_partition_to(
                P_world.create_cartesian_topology_partition([1, n]))
    with pytest.raises(ValueError, match="expected a source partition of at most 1 dimensions"):
        P_world.create_cartesian_topology_partition([1, n]).create_broadcast_partition_to(P_world)
    with pytest.raises(ValueError, match="expected partitions derived from the same root"):
        P_world.create_partition_union(MPIPartition(MPI.COMM_SELF))
    with pytest.raises(ValueError, match="got MPI.COMM_NULL"):
        MPIPartition(MPI.COMM_NULL)
    for other in (None, comm.Get_group()):
        with pytest.raises(TypeError, match="MPIPartition: expected an mpi4py intracommunicator, got"):
            MPIPartition(other)
    if n > 1:  # the two halves of the world, joined by an intercommunicator
        half = comm.Split(comm.rank % 2)
        inter = half.Create_intercomm(0, comm, 1 - comm.rank % 2)
        with pytest.raises(TypeError, match=r"got an intercommunicator \(use its Merge\(\) to make one\)"):
            MPIPartition(inter)
        inter.Free()
        half.Free()
    # After all of that the partition still works on every rank.
    assert P_world.comm.allreduce(1) == n


@sizes(2, 3, 4)
def test_free_and_no_leak(P_world, comm):
    gc.collect()
    start = live_communicators()
    with P_world.create_partition_inclusive([0, 1]) as P:
        assert live_communicators() == start + P.active
    assert live_communicators() == start and repr(P) == "MPIPartition(shape=(2,), freed)"
    with pytest.raises(ValueError, match=r"MPIPartition: the partition of shape \(2,\) was freed"):
        P.active  # its members would read as outside it
    P.free()  # idempotent
    for _ in range(20):
        P_world.create_cartesian_topology_partition([comm.size, 1]).create_subpartition([0])
    assert live_communicators() == start


@sizes(1, 2, 3)
def test_a_root_works_on_its_own_duplicate(P_world, comm):
    """MPIPartition(comm) duplicates comm once (every root of comm shares it). After the program frees comm, the
    partitions made from it go on working (the duplicate was freed under them at distdl's next safe point: raw MPI
    errors, or a hang where one rank reached that point and the others not), and the duplicate is freed once the
    last of them is collected."""
    mine = comm.Dup()
    P, again = MPIPartition(mine), MPIPartition(mine)
    assert P.comm is again.comm and P.comm != mine
    assert MPI.Comm.Compare(P.comm, mine) == MPI.CONGRUENT
    private = weakref.ref(P.comm)
    Q = P.create_partition_inclusive(range(comm.size)[::-1])
    mine.Free()
    P_world.create_partition_inclusive([0])  # safe points, where distdl frees what was released
    live_communicators()
    assert P.active and P.rank == comm.rank
    x = torch.full((1,), float(comm.rank + 1))
    assert all_sum_reduce(x, P, axes_reduce=(0,)).item() == comm.size * (comm.size + 1) / 2
    assert torch.equal(repartition(x, P, Q), torch.full((1,), float(comm.size - comm.rank)))
    assert P.create_partition_inclusive([0]).active == (comm.rank == 0)
    del P, again, Q
    gc.collect()
    live_communicators()
    assert private() is None and not partition._released_private  # collected, then freed


@sizes(2, 3)
def test_settings_read_differently_are_named(comm, monkeypatch):
    """Ranks that read another value of a setting by which they choose a collective's messages (here one that turns
    distdl's pairwise sums off) are named on every rank when the root partition is made: they waited for ever in the
    first large sum."""
    read = settings.SHARED["DISTDL_PAIRWISE_SUM_BYTES"]
    other = "0" if read != "0" else "1"
    mine = comm.Dup()
    with monkeypatch.context() as patch:
        if comm.rank == 1:
            patch.setitem(settings.SHARED, "DISTDL_PAIRWISE_SUM_BYTES", other)
        with pytest.raises(ValueError) as info:
            MPIPartition(mine)
    others = ", ".join(str(r) for r in range(comm.size) if r != 1)
    assert str(info.value).endswith(f"set them alike on every rank: DISTDL_PAIRWISE_SUM_BYTES: "
                                    f"rank{'s' if comm.size > 2 else ''} {others} read {read}; rank 1 read {other}")
    P = MPIPartition(mine)  # read alike now: the refused duplicate was freed, and a new one is made and checked
    assert MPI.Comm.Compare(P.comm, mine) == MPI.CONGRUENT
    mine.Free()


@sizes(2, 3)
def test_check_mode_set_alike_is_no_difference(comm, monkeypatch):
    """MPIPartition(comm) compares the check mode in effect: set alike on every rank by set_check_mode, it agrees
    though the environment read at import differed (here rank 1's)."""
    monkeypatch.setitem(settings.SHARED, "DISTDL_CHECK", str(comm.rank == 1))
    mine = comm.Dup()
    with checking(False):
        assert MPI.Comm.Compare(MPIPartition(mine).comm, mine) == MPI.CONGRUENT
    mine.Free()


@sizes(1, 2, 3)
def test_copies_share_the_partition(P_world, comm):
    """copy.deepcopy of a layer (an EMA or teacher copy) shares its partitions and copies its parameters; a
    partition cannot be pickled, and says why (deepcopy used to fail on the communicator, unclearly)."""
    import copy
    import io
    import pickle

    import torch
    from distdl.nn import DistributedLayerNorm, DistributedLinearAllGather
    P_x = P_world.create_cartesian_topology_partition((1, comm.size))
    assert copy.copy(P_x) is P_x and copy.deepcopy(P_x) is P_x
    with pytest.raises(TypeError, match="MPIPartition cannot be pickled: it holds an MPI communicator"):
        pickle.dumps(P_x)
    x = torch.rand(3, 6 // comm.size + (comm.rank < 6 % comm.size), dtype=torch.float64)
    for layer in (DistributedLinearAllGather(P_x, 6, 4).double(), DistributedLayerNorm(P_x, (6,)).double()):
        twin = copy.deepcopy(layer)
        assert twin.P_x is P_x
        torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
        with torch.no_grad():
            next(twin.parameters()).add_(1)
        assert not torch.equal(next(twin.parameters()), next(layer.parameters()))
        with pytest.raises(TypeError, match="MPIPartition cannot be pickled"):  # torch.save(model): documented
            torch.save(layer, io.BytesIO())


@sizes(2, 3)
def test_partitions_collected_inside_mpi4py(P_world, comm):
    """Partitions in reference cycles (a caught exception's traceback makes them easily) are freed by the garbage
    collector, which may run inside mpi4py while it holds the lock that its communicator-free callback takes.
    Freeing the communicator there deadlocked the worker; now it is freed at the next partition call."""
    gc.collect()
    start = live_communicators()
    threshold = gc.get_threshold()
    gc.set_threshold(3)  # collect at nearly every allocation, inside mpi4py's lowercase calls too
    try:
        for i in range(100):
            P = P_world.create_cartesian_topology_partition((comm.size,))
            P.comm.allgather(i)
            cycle = [P]
            cycle.append(cycle)
            del P, cycle
            fresh = comm.Dup()  # a communicator that mpi4py has not seen: its first lowercase call takes the lock
            assert fresh.allgather(i) == [i] * comm.size
            fresh.Free()
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert live_communicators() == start


@sizes(1, 2, 3, 4)
def test_plans_between_partitions_leave_no_cycle(P_world, comm):
    """Plans each way between two partitions, and from one to itself, are freed with the partitions, without
    the garbage collector (which would free their communicators at different times on different workers)."""
    import torch
    from distdl.functional import broadcast, repartition, sum_reduce
    gc.collect()
    start = live_communicators()
    gc.disable()
    try:
        for _ in range(2):
            P_a = P_world.create_cartesian_topology_partition((comm.size, 1))
            P_b = P_world.create_cartesian_topology_partition((1, comm.size))
            P_c = P_world.create_partition_inclusive(range(comm.size)[::-1]).create_cartesian_topology_partition(
                (comm.size, 1))  # P_a's shape on other workers
            P_one = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
            x = torch.ones(2, 3, requires_grad=True)
            pairs = [(P_a, P_a), (P_a, P_b), (P_b, P_a), (P_one, P_a), (P_a, P_one)]
            for P_x, P_y in pairs:
                y = repartition(x if P_x.active else torch.zeros(0, 0), P_x, P_y)
                y.sum().backward()
            for P_x, P_y in [(P_a, P_a), (P_a, P_c), (P_c, P_a), (P_one, P_a)]:
                y = broadcast(x if P_x.active else torch.zeros(0, 0), P_x, P_y)
                z = sum_reduce(y, P_y, P_x)
                z.sum().backward()
            assert live_communicators() > start
            del P_a, P_b, P_c, P_one, P_x, P_y, y, z, pairs
            assert live_communicators() == start
    finally:
        gc.enable()


@sizes(4)
def test_creation_order_does_not_deadlock(P_world, comm):
    """Ranks build partitions over disjoint sets in different orders; non-members never block."""
    r = comm.rank
    if r < 2:
        a = P_world.create_partition_inclusive([0, 1])
        b = P_world.create_partition_inclusive([2, 3])
    else:
        b = P_world.create_partition_inclusive([2, 3])
        a = P_world.create_partition_inclusive([0, 1])
    assert a.active == (r < 2) and b.active == (r >= 2)
    # Only the members of a partition take part in building it.
    if r == 3:
        c = P_world.create_partition_inclusive([3])
        assert c.active and c.size == 1
    assert comm.allreduce(1) == 4


@sizes(2, 4)
def test_equality(P_world, comm):
    n = comm.size
    a = P_world.create_partition_inclusive(range(n)).create_cartesian_topology_partition([n // 2, 2])
    b = P_world.create_cartesian_topology_partition([n // 2, 2])
    assert a == b and hash(a) == hash(b)
    assert a != P_world.create_cartesian_topology_partition([n // 2, 1, 2])
    assert a != P_world.create_partition_inclusive(range(n))
    assert P_world.create_partition_inclusive([0, 1]) != P_world.create_partition_inclusive([1, 0])


@sizes(2)
def test_boolean_flags_are_not_axes_or_ranks(P_world, comm):
    """[False, True] is the remain_dims form of create_cartesian_subtopology_partition, not axes 0 and 1."""
    P = P_world.create_cartesian_topology_partition([1, 2])
    with pytest.raises(TypeError, match=r"create_subpartition: expected integers for axes, got \[False, True\]"):
        P.create_subpartition([False, True])
    with pytest.raises(TypeError, match="create_partition_inclusive: expected integers for ranks"):
        P_world.create_partition_inclusive(np.array([True, False]))
    assert P.create_cartesian_subtopology_partition([False, True]).shape == (2,)
    assert P.create_cartesian_subtopology_partition([0, 1]).shape == (2,)


@sizes(2)
def test_arguments_of_the_wrong_form_are_named(P_world, comm):
    """Nested sequences were flattened (a shape [[1, 2]] read as (1, 2)), a string read as flags ('01': both axes;
    transpose_src='no': True), and other forms raised numpy's or Python's own errors."""
    P = P_world.create_cartesian_topology_partition([2, 1])
    for call, message in [
            (lambda: P_world.create_cartesian_topology_partition([[1, 2]]), "create_cartesian_topology_partition: "
             "expected a flat sequence of integers for shape"),
            (lambda: P.create_subpartition([[0, 1]]), "create_subpartition: expected a flat sequence of integers"),
            (lambda: P_world.create_partition_inclusive([[0], [0, 1]]), "create_partition_inclusive: expected a "
             "sequence of integers for ranks"),
            (lambda: P.create_cartesian_subtopology_partition("01"), "create_cartesian_subtopology_partition: "
             "expected a sequence of bools, got '01'"),
            (lambda: P.create_cartesian_subtopology_partition(None), "create_cartesian_subtopology_partition: "
             "expected a sequence of bools, got None"),
            (lambda: P.create_broadcast_partition_to(P, "no"), "create_broadcast_partition_to: expected a bool for "
             "transpose_src, got 'no'"),
            (lambda: P.create_reduction_partition_to([0]), "create_reduction_partition_to: expected an "
             "MPIPartition, got list"),
            (lambda: P.broadcast_data(1, root=None), "broadcast_data: expected an integer root, got None"),
            (lambda: P.broadcast_data(1, root=True), "broadcast_data: expected an integer root, got True")]:
        with pytest.raises(TypeError, match=re.escape(message)):
            call()
    assert P.broadcast_data(comm.rank, root=np.int64(1)) == 1


@sizes(2)
def test_a_freed_partition_cannot_be_used(P_world, comm):
    """After free() (or its `with` block) a partition raises on every worker instead of passing its members off as
    inactive: repartition onto a live partition deadlocked building their union."""
    import torch
    from distdl.functional import all_sum_reduce, broadcast, repartition
    P_y = P_world.create_partition_inclusive([1]).create_cartesian_topology_partition([1])
    with P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1]) as P_x:
        pass
    for call in (lambda: repartition(torch.zeros(0), P_x, P_y), lambda: repartition(torch.zeros(0), P_y, P_x),
                 lambda: broadcast(torch.zeros(0), P_x, P_y), lambda: all_sum_reduce(torch.zeros(0), P_x, [0]),
                 lambda: P_x.create_partition_inclusive([0]), lambda: P_x.create_subpartition([0]),
                 lambda: P_y.create_partition_union(P_x)):
        with pytest.raises(ValueError, match=r"the partition of shape \(1,\) was freed"):
            call()
