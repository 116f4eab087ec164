"""ReduceScatter: sum within fibres along partition axes, then keep this worker's balanced block.

Run: mpiexec -n 4 python examples/reduce_scatter.py
Look at: on a 2 x 2 grid each worker holds a whole 2 x 5 tensor; along axis 1 each row's two tensors are
summed and split along dimension 1 into blocks of 3 and 2 columns. Backward is AllGather.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import ReduceScatter
from distdl.testing import assert_adjoint, random_tensor

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("reduce_scatter.py: run on 4 ranks (mpiexec -n 4)")
P_x = P_world.create_cartesian_topology_partition((2, 2))
layer = ReduceScatter(P_x, axes_reduce_scatter=[1])


def contribution(rank: int) -> torch.Tensor:
    return torch.arange(10.0).reshape(2, 5) * 10.0 ** rank


x = contribution(P_x.rank)
y = layer(x)
row, column = P_x.index
total = contribution(2 * row) + contribution(2 * row + 1)  # the sum over this worker's row fibre
assert torch.equal(y, total[:, :3] if column == 0 else total[:, 3:])  # 5 columns over 2: 3 and 2
assert_adjoint(layer, random_tensor(x.shape, seed=P_world.rank), MPI.COMM_WORLD)

text = P_world.comm.gather(f"rank {P_world.rank} index {P_x.index}: x {tuple(x.shape)} -> y {tuple(y.shape)}, "
                           f"y[1] = {y[1].tolist()}", root=0)
if P_world.rank == 0:
    print("reduce_scatter along axis 1 of a 2 x 2 grid, each worker holding a 2 x 5 tensor:")
    print("\n".join(text))
    print("each worker holds its columns of its row's sum; the dot-product adjoint test passes")
