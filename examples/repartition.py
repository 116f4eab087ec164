"""Repartition: move a tensor from its decomposition over P_x to the one over P_y (scatter, re-layout, gather).

Run: mpiexec -n 4 python examples/repartition.py
Look at: a 7 x 10 tensor held whole by worker 0 is scattered onto a 2 x 2 grid, re-laid out onto a
4 x 1 grid (row bands), and gathered back onto worker 0 unchanged. Backward of each is the reverse move.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.describe import describe
from distdl.nn import Repartition
from distdl.testing import assert_adjoint, random_tensor, scatter
from distdl.utilities.torch import zero_volume_tensor

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("repartition.py: run on 4 ranks (mpiexec -n 4)")
P_root = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
P_grid = P_world.create_cartesian_topology_partition((2, 2))
P_bands = P_world.create_cartesian_topology_partition((4, 1))
scatter_layer, relayout, gather_layer = Repartition(P_root, P_grid), Repartition(P_grid, P_bands), \
    Repartition(P_bands, P_root)

x_global = torch.arange(70.0).reshape(7, 10)
x = x_global.clone() if P_root.active else zero_volume_tensor()
on_grid = scatter_layer(x)
assert torch.equal(on_grid, scatter(x_global, P_grid))
in_bands = relayout(on_grid)
assert torch.equal(in_bands, scatter(x_global, P_bands))
back = gather_layer(in_bands)
assert torch.equal(back, x_global) if P_root.active else back.numel() == 0
for layer, x_in in ((scatter_layer, x), (relayout, on_grid), (gather_layer, in_bands)):
    assert_adjoint(layer, random_tensor(x_in.shape, seed=P_world.rank), MPI.COMM_WORLD)

if P_world.rank == 0:
    print(describe(P_grid, (7, 10)))
    print(describe(P_bands, (7, 10)))
text = P_world.comm.gather(f"rank {P_world.rank}: whole {tuple(x.shape)} -> grid block {tuple(on_grid.shape)} "
                           f"-> band {tuple(in_bands.shape)} -> gathered {tuple(back.shape)}", root=0)
if P_world.rank == 0:
    print("\n".join(text))
    print("every block matches the balanced decomposition; worker 0 got the tensor back; adjoint tests pass")
