"""Build the partitions a distributed layer uses and print them in rank order.

Run: mpiexec -n 4 python examples/partitions.py   (any number of ranks works; 4 shows a 2 x 2 grid)
"""

import numpy as np
from mpi4py import MPI

from distdl import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_subshape

P_world = MPIPartition(MPI.COMM_WORLD)
n = P_world.size
shape = (2, n // 2) if n % 2 == 0 else (n, 1)

P_x = P_world.create_cartesian_topology_partition(shape)  # a grid over every worker
P_row = P_x.create_subpartition([1])  # this worker's row of the grid
P_first = P_world.create_partition_inclusive([0])  # a single worker
P_send, P_recv = P_first.create_broadcast_partition_to(P_x)  # how worker 0's block reaches the grid

global_shape = (7, 10)
lines = [
    f"rank {P_world.rank}: P_x {P_x.shape} index {P_x.index}",
    f"  holds block {compute_subshape(P_x.shape, P_x.index, global_shape).tolist()} of a {global_shape} tensor, "
    f"starting at {compute_start_index(P_x.shape, P_x.index, global_shape).tolist()}",
    f"  row fibre: world ranks {P_row.root_ranks}, neighbours per axis {P_x.neighbor_ranks(P_x.rank)}",
    f"  in P_first: {P_first.active}; broadcast from worker 0 reaches world ranks {P_recv.root_ranks}",
]
total = P_world.allreduce_data(np.array([P_world.rank]))

# Print in rank order: gather the text on rank 0.
text = P_world.comm.gather("\n".join(lines), root=0)
if P_world.rank == 0:
    print(f"distdl partitions on {n} workers (grid {shape}); sum of ranks = {int(total[0])}")
    print("\n".join(text))
