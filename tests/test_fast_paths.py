"""The fast paths of the primitives: payloads inside the header round, blocking calls, pairwise sums.

Every primitive is run on both sides of the inline limit (``INLINE_BYTES``), with the header-only
round forced (``INLINE_GROUP = 1``), with every broadcast root that feeds itself copying its block
during a non-blocking data round (``OVERLAP_BYTES = 1``), in plans where a worker is in two groups
(non-blocking), and for the dtypes whose bytes travel inline; results are compared exactly with local references. The
large-message sums are run on both sides of ``PAIRWISE_SUM_BYTES``, with it lowered to small sizes,
and repartition with overlaps large enough to move in place (``STRIDED_BYTES``).
"""

import importlib

import pytest
import torch

import distdl.backends.mpi as transport
import distdl.functional._messages as messages
from distdl.functional.all_gather import all_gather
from distdl.functional.all_sum_reduce import all_sum_reduce
from distdl.functional.broadcast import blocking_allowed, broadcast
from distdl.functional.reduce_scatter import reduce_scatter
from distdl.functional.repartition import repartition
from distdl.functional.sum_reduce import sum_reduce
from distdl.testing import assert_adjoint, gather, random_tensor, scatter
from helpers import sizes

broadcast_module = importlib.import_module("distdl.functional.broadcast")  # the package exports the function
LIMIT = messages.INLINE_BYTES // 4  # float32 elements that still travel inline
LENGTHS = (0, 1, LIMIT, LIMIT + 1, 3 * LIMIT)  # around the limit: inline, exactly full, one over


def _data(n, seed, dtype=torch.float32):
    """Exactly representable values (small integers), so sums in any order are exact."""
    values = torch.arange(n, dtype=torch.float64) % 7 + seed
    return values.to(dtype) if dtype != torch.bool else values.remainder(2).to(torch.bool)


@pytest.fixture(params=["inline", "headers only", "overlapped copies"])
def mode(request, monkeypatch):
    if request.param == "headers only":
        monkeypatch.setattr(messages, "INLINE_GROUP", 1)
    if request.param == "overlapped copies":  # every broadcast root that feeds itself copies x during the round
        monkeypatch.setattr(broadcast_module, "OVERLAP_BYTES", 1)
    return request.param


@sizes(2, 3, 4)
def test_broadcast_and_sum_reduce(P_world, comm, mode):
    P_root = P_world.create_partition_inclusive([comm.size - 1])
    for n in LENGTHS:
        for dtype in (torch.float32, torch.float16, torch.int64, torch.bool, torch.complex64):
            x = _data(n, 3, dtype) if P_root.active else torch.zeros(0, dtype=dtype)
            y = broadcast(x, P_root, P_world, preserve_batch=False)
            assert torch.equal(y, _data(n, 3, dtype)), (n, dtype, comm.rank)
            if dtype == torch.bool:
                continue
            total = sum_reduce(_data(n, comm.rank, dtype), P_world, P_root, preserve_batch=False)
            expected = sum(_data(n, r, torch.float64) for r in range(comm.size)).to(dtype)
            assert torch.equal(total, expected) if P_root.active else total.numel() == 0, (n, dtype, comm.rank)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):  # 0-d tensors (a loss) stay 0-d: summed by NumPy
        x = _data(1, comm.rank, dtype)[0]  # and, for bfloat16, by torch
        total = sum_reduce(x, P_world, P_root, preserve_batch=False)
        expected = sum(_data(1, r, torch.float64) for r in range(comm.size))[0].to(dtype)
        assert torch.equal(total, expected) if P_root.active else total.shape == (0,), (dtype, comm.rank)
        y = broadcast(x if P_root.active else torch.zeros(0, dtype=dtype), P_root, P_world, preserve_batch=False)
        assert torch.equal(y, _data(1, comm.size - 1, dtype)[0]), (dtype, comm.rank)
    assert_adjoint(lambda t: sum_reduce(t, P_world, P_root, preserve_batch=False), _data(1, comm.rank)[0], comm)
    for n in (4, 2 * LIMIT):  # non-contiguous views, inline and not
        x = _data(n, comm.size - 1, torch.float64)[::2]
        y = broadcast(x if P_root.active else torch.zeros(0, dtype=x.dtype), P_root, P_world, preserve_batch=False)
        assert torch.equal(y, x) and y.is_contiguous()


@sizes(2, 3)
def test_worker_in_two_groups(P_world, comm, mode):
    """A cycle: every worker sends to its successor and receives from its predecessor (non-blocking)."""
    ranks = [(r + 1) % comm.size for r in range(comm.size)]
    P_y = P_world.create_partition_inclusive(ranks)
    assert not blocking_allowed(P_world, P_y, False, False)
    assert blocking_allowed(P_world.create_partition_inclusive([0]), P_world, False, False)
    for n in (2, LIMIT + 5):
        y = broadcast(_data(n, comm.rank), P_world, P_y, preserve_batch=False)
        assert torch.equal(y, _data(n, ranks.index(comm.rank)))  # from the worker at my index of P_y
        z = sum_reduce(_data(n, comm.rank), P_y, P_world, preserve_batch=False)
        assert torch.equal(z, _data(n, ranks[comm.rank]))
        assert_adjoint(lambda t: broadcast(t, P_world, P_y), _data(n, comm.rank, torch.float64), comm)


@sizes(4)
def test_root_feeds_itself_in_a_non_blocking_plan(P_world, comm, mode):
    """Worker 0 feeds itself and worker 1; worker 1 receives from 0 and feeds 2 and 3 (two groups)."""
    P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition((2, 1))
    P_y = P_world.create_cartesian_topology_partition((2, 2))
    assert not blocking_allowed(P_x, P_y, False, False)
    source = comm.rank // 2
    for n in (2, LIMIT + 5):
        x = _data(n, comm.rank) if P_x.active else torch.zeros(0)
        assert torch.equal(broadcast(x, P_x, P_y, preserve_batch=False), _data(n, source)), (n, comm.rank)
        z = sum_reduce(_data(n, comm.rank), P_y, P_x, preserve_batch=False)
        assert torch.equal(z, _data(n, 2 * comm.rank) + _data(n, 2 * comm.rank + 1)) if P_x.active else z.numel() == 0
        x = _data(n, comm.rank, torch.float64) if P_x.active else torch.zeros(0, dtype=torch.float64)
        assert_adjoint(lambda t: broadcast(t, P_x, P_y), x, comm)


@sizes(1, 2, 3, 4)
def test_broadcast_groups_are_checked_until_cached(P_world, comm):
    """Later calls with the very same partitions skip the checks; anything else is checked again."""
    P_root = P_world.create_partition_inclusive([0])
    x = _data(3, 1) if P_root.active else torch.zeros(0)
    for _ in range(2):
        assert torch.equal(broadcast(x, P_root, P_world, preserve_batch=False), _data(3, 1))
        total = sum_reduce(_data(3, comm.rank), P_world, P_root, preserve_batch=False)
        assert torch.equal(total, sum(_data(3, r) for r in range(comm.size))) if P_root.active else total.numel() == 0
    with pytest.raises(TypeError, match="expected a bool for transpose_src"):
        broadcast(x, P_root, P_world, transpose_src=0)  # 0 == False as a cache key
    with pytest.raises(TypeError, match="expected a bool for preserve_batch"):
        sum_reduce(x, P_world, P_root, preserve_batch=1)
    P_grid = P_world.create_cartesian_topology_partition((comm.size, 1))  # does not broadcast to P_world's (size,)
    with pytest.raises(ValueError, match="expected the shape of P_x"):
        broadcast(x, P_grid, P_world)
    P_again = P_world.create_partition_inclusive([0])  # equal to P_root, another object: checked, then cached
    assert torch.equal(broadcast(x, P_again, P_world, preserve_batch=False), _data(3, 1))


@sizes(1, 2, 3, 4)
def test_all_gather_and_reduce_scatter(P_world, comm, mode):
    for n in LENGTHS + (comm.size * LIMIT + 1,):  # the last: some blocks inline, some not
        X = _data(n, 1)
        y = all_gather(scatter(X, P_world), P_world, [0])
        assert torch.equal(y, X), (n, comm.rank)
        for dtype in (torch.float32, torch.float16, torch.int32):
            z = reduce_scatter(_data(n, comm.rank, dtype), P_world, [0])
            expected = sum(_data(n, r, torch.float64) for r in range(comm.size)).to(dtype)
            assert torch.equal(z, scatter(expected, P_world)), (n, dtype, comm.rank)
    P_grid = P_world.create_cartesian_topology_partition((1, comm.size))  # a gathered last dimension: unpacked
    X = _data(6 * 5, 2).reshape(6, 5)
    assert torch.equal(all_gather(scatter(X, P_grid), P_grid, [1]), X)
    assert torch.equal(reduce_scatter(X, P_grid, [1]), scatter(X * comm.size, P_grid))
    assert_adjoint(lambda t: reduce_scatter(t, P_world, [0]), _data(5, comm.rank, torch.float64), comm)


@sizes(1, 2, 3, 4)
def test_all_sum_reduce_without_grad_mode(P_world, comm):
    x = _data(4, comm.rank).requires_grad_()
    with torch.no_grad():  # the direct path, without autograd.Function
        y = all_sum_reduce(x, P_world, [0])
    assert not y.requires_grad and torch.equal(y, sum(_data(4, r) for r in range(comm.size)))
    y = all_sum_reduce(x, P_world, [0])
    y.backward(torch.ones(4))
    assert torch.equal(x.grad, torch.full((4,), float(comm.size)))


@sizes(2, 3, 4)
def test_repartition(P_world, comm, mode):
    P_rows = P_world.create_cartesian_topology_partition((comm.size, 1))
    P_cols = P_world.create_cartesian_topology_partition((1, comm.size))
    P_one = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    for shape in ((1, 3), (comm.size, LIMIT // comm.size), (comm.size + 1, LIMIT)):
        X = _data(shape[0] * shape[1], 4).reshape(shape)
        y = repartition(scatter(X, P_rows), P_rows, P_cols)
        assert torch.equal(y, scatter(X, P_cols)), (shape, comm.rank)
        z = repartition(scatter(X, P_rows), P_rows, P_one)  # a gather onto one worker
        assert torch.equal(z, X) if P_one.active else z.numel() == 0
        assert torch.equal(gather(y, P_cols), X)
    assert_adjoint(lambda t: repartition(t, P_rows, P_cols), scatter(_data(12, 1, torch.float64).reshape(3, 4),
                                                                      P_rows), comm)


@sizes(1, 2, 3)
def test_scatter_and_gather_every_dtype(P_world, comm):
    """The test kit's gather assembles dtypes NumPy lacks (bfloat16) and non-contiguous blocks; idle workers too."""
    P_x = P_world.create_partition_inclusive(range(comm.size - 1 or 1)).create_cartesian_topology_partition(
        (1, comm.size - 1 or 1))
    X = random_tensor((3, 2 * comm.size + 1), seed=5)
    for dtype in (torch.bfloat16, torch.float16, torch.complex64, torch.int64, torch.bool):
        x_local = scatter(X.to(dtype), P_x)
        assert torch.equal(gather(x_local, P_x), X.to(dtype)), (dtype, comm.rank)
        assert torch.equal(gather(x_local.t().contiguous().t(), P_x), X.to(dtype)), (dtype, comm.rank)


@pytest.mark.parametrize("threshold", [16, "default"])
@sizes(2, 3, 4)
def test_pairwise_sums(P_world, comm, threshold, monkeypatch):
    """Sums from PAIRWISE_SUM_BYTES on: random rank-varying inputs against the sequential sum, adjoints, and
    the same bits on every worker; lengths that do not divide by the number of workers leave a tail."""
    if threshold != "default":
        monkeypatch.setattr(transport, "PAIRWISE_SUM_BYTES", threshold)
    limit = (transport.PAIRWISE_SUM_BYTES or 1 << 17) // 8  # float64 elements (MPI's sums where it is off)
    P_root = P_world.create_partition_inclusive([comm.size - 1])
    for n in (limit - 1, limit, limit + 1, comm.size * limit + 1):
        xs = [random_tensor((n,), seed=100 * n + r) for r in range(comm.size)]
        expected = sum(xs)
        y = all_sum_reduce(xs[comm.rank], P_world, [0])
        torch.testing.assert_close(y, expected, rtol=1e-13, atol=1e-13)
        assert len(set(comm.allgather(y.detach().numpy().tobytes()))) == 1  # every worker has the same bits
        total = sum_reduce(xs[comm.rank], P_world, P_root, preserve_batch=False)
        if P_root.active:
            torch.testing.assert_close(total, expected, rtol=1e-13, atol=1e-13)
        n_even = n - n % comm.size
        z = reduce_scatter(xs[comm.rank][:n_even], P_world, [0])
        torch.testing.assert_close(z, scatter(expected[:n_even], P_world), rtol=1e-13, atol=1e-13)
    n = comm.size * limit + 3
    P_y = P_world.create_partition_inclusive(list(range(1, comm.size)))  # rank 0 receives, and is no source
    total = sum_reduce(random_tensor((n,), seed=comm.rank) if P_y.active else torch.zeros(0, dtype=torch.float64),
                       P_y, P_root, preserve_batch=False)
    if P_root.active:
        torch.testing.assert_close(total, sum(random_tensor((n,), seed=r) for r in range(1, comm.size)))
    x = random_tensor((n,), seed=comm.rank)
    assert_adjoint(lambda t: all_sum_reduce(t, P_world, [0]), x, comm)
    assert_adjoint(lambda t: sum_reduce(t, P_world, P_root), x, comm)
    assert_adjoint(lambda t: reduce_scatter(t, P_world, [0]), x[:n - n % comm.size], comm)


@sizes(1, 2, 3, 4)
def test_crowded_is_agreed_and_kept_on_the_communicator(comm):
    """Every member gets the same answer: whether some node holds more of the job's ranks than the CPUs its
    members of ``comm`` may run on; it is kept on the communicator and goes with it."""
    import os

    from mpi4py import MPI
    dup = comm.Dup()
    transport.crowded(MPI.COMM_SELF)  # makes the attribute's key
    assert dup.Get_attr(transport._CROWDED) is None
    crowded = transport.crowded(dup)
    assert len(set(comm.allgather(crowded))) == 1
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    cpus = set().union(*node.allgather(os.sched_getaffinity(0)))
    ranks = max([node.size] + [int(os.environ.get(v, 0)) for v in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")])
    node.Free()
    assert crowded == (comm.size > 1 and any(comm.allgather(ranks > len(cpus))))
    if comm.size > 1:
        assert dup.Get_attr(transport._CROWDED) is crowded
    assert transport.crowded(dup) is crowded
    dup.Free()


@pytest.mark.parametrize("crowded", [False, True])
@sizes(2, 3, 4)
def test_blocking_and_non_blocking_waits(P_world, comm, crowded, monkeypatch):
    """The sums and broadcasts give the same results whether their communicators count as crowded
    (non-blocking MPI calls) or not (blocking ones), on either side of the inline and pairwise limits."""
    monkeypatch.setattr(transport, "crowded", lambda comm: crowded)
    monkeypatch.setattr(transport, "PAIRWISE_SUM_BYTES", 64)
    P_root = P_world.create_partition_inclusive([comm.size - 1])
    for n in (3, 2 * LIMIT + 1):  # inline and not; past the pairwise limit with a tail
        xs = [random_tensor((n,), seed=10 * n + r) for r in range(comm.size)]
        x = xs[-1] if P_root.active else torch.zeros(0, dtype=torch.float64)
        assert torch.equal(broadcast(x, P_root, P_world, preserve_batch=False), xs[-1])
        torch.testing.assert_close(all_sum_reduce(xs[comm.rank], P_world, [0]), sum(xs), rtol=1e-13, atol=1e-13)
        total = sum_reduce(xs[comm.rank], P_world, P_root, preserve_batch=False)
        if P_root.active:
            torch.testing.assert_close(total, sum(xs), rtol=1e-13, atol=1e-13)
        assert_adjoint(lambda t: broadcast(t, P_root, P_world), x, comm)
        assert_adjoint(lambda t: all_sum_reduce(t, P_world, [0]), xs[comm.rank], comm)


@sizes(1, 2, 3)
def test_broadcast_root_output_is_a_copy(P_world, comm, mode):
    """The root's own output is a copy of x: writes to either never show in the other, also where x's memory
    is NumPy's or is written through a NumPy view (which torch's copy-on-write cannot see)."""
    import numpy as np
    P_root = P_world.create_partition_inclusive([0])
    expected = random_tensor((64, 64), seed=5)  # 32 KiB: not inline

    def call(x):
        return broadcast(x if P_root.active else torch.zeros(0, 0, dtype=x.dtype), P_root, P_world,
                         preserve_batch=False)
    x = expected.clone()
    view = x.numpy()  # shares x's memory, as torch documents
    y = call(x)
    assert torch.equal(y, expected)
    view += 1  # written outside torch
    x.mul_(2)  # and by torch: the view must still be x
    assert torch.equal(y, expected) and torch.equal(x, 2 * (expected + 1)) and np.array_equal(view, x.numpy())
    y.add_(1)
    assert torch.equal(x, 2 * (expected + 1))
    for array in (expected.numpy().copy(), expected.numpy().T.copy(order="F")):  # NumPy's memory; the second
        y = call(torch.from_numpy(array))  # is not contiguous as a tensor
        values = torch.from_numpy(array.copy())
        assert torch.equal(y, values), comm.rank
        array += 1
        assert torch.equal(y, values), comm.rank
    y = call(expected.t())  # not contiguous
    assert torch.equal(y, expected.t())


@pytest.mark.parametrize("name", ["PAIRWISE_SUM", "STRIDED"])
def test_byte_settings_are_checked(name):
    import os
    import subprocess
    import sys
    variable, code = f"DISTDL_{name}_BYTES", f"import distdl.backends.mpi as m; print(m.{name}_BYTES)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, variable: "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"  # off
    bad = subprocess.run([sys.executable, "-c", code], env={**os.environ, variable: "1e5"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and f"{variable}: expected a number of bytes (0 for never), got '1e5'" in bad.stderr


@sizes(2, 3)
def test_large_strided_repartition(P_world, comm):
    """Overlaps of at least STRIDED_BYTES that are not contiguous move in place, both ways: rows to
    columns sends them (forward) and receives them (adjoint); random rank-varying data."""
    p = comm.size
    P_rows = P_world.create_cartesian_topology_partition([p, 1, 1])
    P_cols = P_world.create_cartesian_topology_partition([1, 1, p])
    shape = (p, 2, transport.STRIDED_BYTES * p // 16 + 5)  # float64: each overlap (1, 2, >= limit / 16)
    x_global = random_tensor(shape, seed=7)
    y = repartition(scatter(x_global, P_rows), P_rows, P_cols)
    assert torch.equal(y, scatter(x_global, P_cols))
    x = scatter(random_tensor(shape, seed=comm.rank), P_rows)
    assert_adjoint(lambda t: repartition(t, P_rows, P_cols), x, comm, adjoint_of_adjoint=False)
