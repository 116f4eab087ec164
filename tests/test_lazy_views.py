"""Inputs whose memory does not hold their values: lazily conjugated (``x.conj()``) and negated
views. MPI sees memory only, so the primitives must send the values.

Each primitive takes such views, inline (inside the header round) and not, and is compared with
the sequential result on random rank-varying data.
"""

import pytest
import torch

from distdl.functional.all_gather import all_gather
from distdl.functional.all_sum_reduce import all_sum_reduce
from distdl.functional.broadcast import broadcast
from distdl.functional.reduce_scatter import reduce_scatter
from distdl.functional.repartition import repartition
from distdl.functional.sum_reduce import sum_reduce
from distdl.testing import random_tensor, scatter
from helpers import sizes


def _complex(shape, seed):
    return torch.complex(random_tensor(shape, seed), random_tensor(shape, seed + 1000))


# A conjugate view, and a contiguous negative view (``x.conj().imag`` is one too, but strided, so that
# making it contiguous already resolves it).
VIEWS = {"conj": lambda t: t.conj(), "neg": lambda t: torch._neg_view(t.real.contiguous())}


def _sums(P_world, comm, lazy, xs):
    """Yield (result, expected, exact) of each sum; a worker outside the result's partition yields nothing."""
    mine, expected = lazy(xs[comm.rank]), lazy(sum(xs)).resolve_neg()
    yield all_sum_reduce(mine, P_world, [0]), expected, False
    P_root = P_world.create_partition_inclusive([comm.size - 1])
    total = sum_reduce(mine, P_world, P_root, preserve_batch=False)
    if P_root.active:
        yield total, expected, False
    P_rows = P_world.create_cartesian_topology_partition([comm.size, 1])
    yield reduce_scatter(mine, P_rows, [0]), scatter(expected, P_rows), False


def _moves(P_world, comm, lazy, xs):
    whole = lazy(xs[0])
    P_root = P_world.create_partition_inclusive([comm.size - 1])
    source = whole if P_root.active else lazy(torch.zeros(0, 0, dtype=torch.complex128))
    yield broadcast(source, P_root, P_world, preserve_batch=False), whole, True
    P_rows = P_world.create_cartesian_topology_partition([comm.size, 1])
    P_cols = P_world.create_cartesian_topology_partition([1, comm.size])
    block = lazy(scatter(xs[0], P_rows))  # a lazy view of this worker's block
    yield all_gather(block, P_rows, [0]), whole, True
    yield repartition(block, P_rows, P_cols), scatter(whole, P_cols), True


@pytest.mark.parametrize("primitives", [_sums, _moves], ids=["sums", "moves"])
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("rows", [2, 40])  # 2 x 3 elements ride in the header round; 40 x 3 do not
@sizes(1, 2, 3)
def test_primitives_send_the_values_of_lazy_views(P_world, comm, primitives, view, rows):
    xs = [_complex((rows, 3), seed=10 * s + rows) for s in range(comm.size)]
    assert VIEWS[view](xs[0]).is_conj() or VIEWS[view](xs[0]).is_neg()
    results = list(primitives(P_world, comm, VIEWS[view], xs))  # every collective before any assertion
    for i, (y, expected, exact) in enumerate(results):
        assert not (y.is_conj() or y.is_neg())
        if exact:
            assert torch.equal(y, expected), (i, comm.rank)
        else:
            torch.testing.assert_close(y, expected, msg=lambda m: f"{i} on rank {comm.rank}: {m}")
