"""The operator given to the test kit raises on rank 1 before its own collective, which rank 0 waits in.

Launched by tests/test_abort.py as ``mpiexec -n 2 python tests/scripts/kit_raise_before_collective.py``: rank 1
waits for rank 0 at the kit's next agreement for ``PATIENCE_SECONDS`` (shortened here), then raises its own error,
and the abort hook ends the job (the kit caught the error, so the job hung).
"""

import torch
from mpi4py import MPI

import distdl
from distdl import testing
from distdl.functional import repartition

testing.PATIENCE_SECONDS = 2
comm = MPI.COMM_WORLD
P = distdl.MPIPartition(comm)
P_x, P_y = P.create_cartesian_topology_partition((2, 1)), P.create_cartesian_topology_partition((1, 2))


def distributed(x):
    if comm.rank == 1:
        raise RuntimeError("a failure on purpose, before the collective")
    return repartition(x, P_x, P_y)


testing.assert_sequential_equivalence(distributed, lambda x: x, testing.random_tensor((4, 5), seed=1), P_x, P_y)
print(f"rank {comm.rank} finished", flush=True)
