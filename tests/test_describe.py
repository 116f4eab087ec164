"""describe(): the text view of a partition and of a decomposition, on every kind of worker."""

import re

import pytest
import torch

from distdl.describe import describe
from distdl.utilities.slicing import compute_start_index, compute_stop_index, compute_subshape
from helpers import partition_shapes, sizes


@sizes(1, 2, 3, 4)
def test_partition_and_decomposition(P_world, comm):
    for shape in partition_shapes(comm.size):
        P_x = P_world.create_cartesian_topology_partition(shape)
        global_shape = tuple(2 * p + 1 for p in shape)  # uneven blocks
        text = describe(P_x, global_shape)
        lines = text.splitlines()
        assert lines[0] == (f"MPIPartition of shape {shape}: {comm.size} worker{'s' if comm.size > 1 else ''} "
                            f"(this worker is rank {P_x.rank}, index {P_x.index})")
        rows = [line for line in lines if line.startswith("  (")]
        assert len(rows) == comm.size
        for rank, row in enumerate(rows):
            index = P_x.cartesian_index(rank)
            fields = [tuple(int(v) for v in f(shape, index, global_shape))
                      for f in (compute_start_index, compute_stop_index, compute_subshape)]
            expected = f"{index}  {rank}  {P_x.root_ranks[rank]}  " + "  ".join(map(str, fields))
            assert re.sub(r"\s+", " ", row.strip()).startswith(re.sub(r"\s+", " ", expected)), (row, expected)
            assert row.endswith("<- this worker") == (rank == P_x.rank)
        # Without a shape: the same workers, no block columns; the same text on every worker but the mark.
        plain = describe(P_x)
        assert "start" not in plain
        assert len([line for line in plain.splitlines() if line.startswith("  (")]) == comm.size
        texts = comm.allgather(plain.replace("  <- this worker", "").splitlines()[1:])
        assert all(t == texts[0] for t in texts)


@sizes(2)
def test_inactive_worker(P_world, comm):
    P_one = P_world.create_partition_inclusive([1])
    text = describe(P_one, [5])
    assert "this worker is not a member" in text if comm.rank == 0 else "this worker is rank 0" in text
    assert "(0,)   0     1          (0,)   (5,)  (5,)" in text
    P_row = P_one.create_subpartition([0])  # made outside its parent on worker 0: members unknown there
    if comm.rank == 0:
        assert "members unknown" in describe(P_row)


@sizes(1)
def test_errors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 1))
    with pytest.raises(TypeError, match=r"describe: expected an MPIPartition, got list"):
        describe([1, 2])
    with pytest.raises(ValueError, match=r"describe: expected a global_shape of 2 extents for a partition of "
                                         r"shape \(1, 1\), got \(3,\)"):
        describe(P_x, [3])
    with pytest.raises(ValueError, match=r"describe: expected non-negative extents, got \(3, -1\)"):
        describe(P_x, (3, -1))
    with pytest.raises(TypeError, match=r"describe: expected a sequence of integers for global_shape"):
        describe(P_x, (3, 1.5))
    with pytest.raises(TypeError, match=r"describe: expected a sequence of integers for global_shape"):
        describe(P_x, 3)
    assert "(3, 4)" in describe(P_x, torch.Size([3, 4]))
