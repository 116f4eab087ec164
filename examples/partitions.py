"""Build the partitions a distributed layer uses, and print them and a tensor's decomposition.

Run: mpiexec -n 4 python examples/partitions.py   (any number of ranks; 4 shows a 2 x 2 grid)
Look at: ``describe(P_x, shape)``, which says which block of a 7 x 10 tensor each worker holds
(the first ``n % p`` workers along an axis hold one extra element), and the sub-partitions each
worker belongs to, printed in rank order.
"""

from mpi4py import MPI

from distdl import MPIPartition
from distdl.describe import describe

P_world = MPIPartition(MPI.COMM_WORLD)  # every worker of the job, shape (n,)
n = P_world.size
shape = (2, n // 2) if n % 2 == 0 else (n, 1)

P_x = P_world.create_cartesian_topology_partition(shape)  # the same workers as a grid
P_row = P_x.create_subpartition([1])  # this worker's row of the grid (a fibre along axis 1)
P_first = P_world.create_partition_inclusive([0])  # a single worker; the others are inactive there
P_send, P_recv = P_first.create_broadcast_partition_to(P_x)  # the groups a broadcast from P_first uses

if P_world.rank == 0:
    print(describe(P_x, (7, 10)))
    print()
lines = [f"rank {P_world.rank}: {P_x!r}",
         f"  row fibre: root ranks {P_row.root_ranks}; neighbours per axis {P_x.neighbor_ranks(P_x.rank)}",
         f"  in P_first: {P_first.active} ({P_first!r}); receives P_first's broadcast: {P_recv.active}"]
text = P_world.comm.gather("\n".join(lines), root=0)  # print in rank order
if P_world.rank == 0:
    print("\n".join(text))
