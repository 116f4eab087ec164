"""AllGather: gather the blocks of a fibre along partition axes; every member gets the assembled tensor.

Run: mpiexec -n 4 python examples/all_gather.py
Look at: a 5 x 7 tensor is decomposed over a 2 x 2 grid (uneven blocks); gathering along axis 1 gives
each worker its whole row band (tensor dimension 1 assembled). Backward is ReduceScatter.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import AllGather
from distdl.testing import assert_adjoint, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("all_gather.py: run on 4 ranks (mpiexec -n 4)")
P_x = P_world.create_cartesian_topology_partition((2, 2))
layer = AllGather(P_x, axes_all_gather=[1])

x_global = torch.arange(35.0).reshape(5, 7)  # every worker builds it, so each can check its answer
x = scatter(x_global, P_x)  # this worker's balanced block: 3 x 4, 3 x 3, 2 x 4 or 2 x 3
y = layer(x)
rows = slice(*(int(f([2], P_x.index[:1], [5])[0]) for f in (compute_start_index, compute_stop_index)))
assert torch.equal(y, x_global[rows])  # the rows of this worker's block, every column
assert_adjoint(layer, random_tensor(x.shape, seed=P_world.rank), MPI.COMM_WORLD)

text = P_world.comm.gather(f"rank {P_world.rank} index {P_x.index}: x {tuple(x.shape)} -> y {tuple(y.shape)}, "
                           f"y[0] = {y[0].tolist()}", root=0)
if P_world.rank == 0:
    print("all_gather along axis 1 of a 5 x 7 tensor on a 2 x 2 grid:")
    print("\n".join(text))
    print("every worker holds its row band of the global tensor; the dot-product adjoint test passes")
