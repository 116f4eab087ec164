"""A tensor-parallel MLP block: column-parallel linear, GELU, row-parallel linear (Megatron's pattern).

Run: mpiexec -n 4 python examples/tensor_parallel_mlp.py
Look at: the 2 x 2 grid splits the batch over axis 0 (data parallelism) and the features over axis 1
(model parallelism). The first layer all-gathers x's features and keeps its half of the 32 hidden units;
the second multiplies its half and reduce-scatters the partial sums back to a feature split. Outputs and
input gradients equal the sequential block's; ``overlap=True`` (ring algorithms) gives the same result.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DistributedLinearAllGather, DistributedLinearReduceScatter
from distdl.testing import scatter

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("tensor_parallel_mlp.py: run on 4 ranks (mpiexec -n 4)")
P_x = P_world.create_cartesian_topology_partition((2, 2))  # (batch, features)

torch.manual_seed(0)
reference = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 12)).double()
x_global = torch.randn(6, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
x_ref = x_global.clone().requires_grad_()
y_ref = reference(x_ref)
y_ref.square().sum().backward()

for overlap in (False, True):
    up = DistributedLinearAllGather(P_x, 12, 32, collect_state=True, overlap=overlap).double()
    down = DistributedLinearReduceScatter(up.P_y, 32, 12, collect_state=True, overlap=overlap).double()
    up.load_state_dict(reference[0].state_dict())
    down.load_state_dict(reference[2].state_dict())
    block = torch.nn.Sequential(up, torch.nn.GELU(), down)

    x = scatter(x_global, P_x).requires_grad_()
    y = block(x)  # on down.P_y, which is P_x here (features split over axis 1)
    y.square().sum().backward()  # the block's share of the global loss sum(y^2): local, no communication
    assert torch.allclose(y, scatter(y_ref.detach(), down.P_y))
    assert torch.allclose(x.grad, scatter(x_ref.grad, P_x))

text = P_world.comm.gather(f"rank {P_world.rank} index {P_x.index}: x {tuple(x.shape)}, W1 block "
                           f"{tuple(up.weight.shape)}, hidden block {tuple(up(x).shape)}, W2 block "
                           f"{tuple(down.weight.shape)}, y {tuple(y.shape)}", root=0)
if P_world.rank == 0:
    print("Linear(12 -> 32), GELU, Linear(32 -> 12) on a 2 (batch) x 2 (features) grid:")
    print("\n".join(text))
    print("outputs and input gradients equal the sequential block's, with and without overlap")
