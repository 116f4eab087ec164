"""Data parallelism: every worker holds a replica and a shard of the batch; DataParallel averages gradients.

Run: mpiexec -n 2 python examples/data_parallel.py   (any number of ranks that divides the batch of 12)
Look at: the losses of the data-parallel replicas and of the same model trained sequentially on the
whole batch agree step by step: the averaged gradient of equal shards is the whole batch's gradient.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DataParallel
from distdl.testing import scatter

P_world = MPIPartition(MPI.COMM_WORLD)
if 12 % P_world.size:
    raise SystemExit("data_parallel.py: run on 1, 2, 3, 4 or 6 ranks")
P_data = P_world.create_cartesian_topology_partition((P_world.size, 1))  # the batch split over every worker


def model() -> torch.nn.Module:
    torch.manual_seed(P_world.rank)  # deliberately different on each rank: DataParallel broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


replica = DataParallel(model(), P_world)  # parameters broadcast from rank 0; gradients averaged in backward
torch.manual_seed(0)
sequential = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
opt, opt_seq = torch.optim.SGD(replica.parameters(), lr=0.1), torch.optim.SGD(sequential.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(1)
x_all = torch.randn(12, 4, dtype=torch.float64, generator=generator)
y_all = x_all.sum(1, keepdim=True).sin()

lines = []
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(replica(scatter(x_all, P_data)), scatter(y_all, P_data))
    loss.backward()  # each bucket of gradients is averaged over the replicas as soon as it is ready
    opt.step()
    opt_seq.zero_grad()
    loss_seq = torch.nn.functional.mse_loss(sequential(x_all), y_all)
    loss_seq.backward()
    opt_seq.step()
    mean_loss = P_world.allreduce_data([loss.item()])[0] / P_world.size
    assert abs(mean_loss - loss_seq.item()) < 1e-12
    lines.append(f"step {step}: mean of the replicas' losses {mean_loss:.6f}, sequential {loss_seq.item():.6f}")
if P_world.rank == 0:
    print(f"data parallel over {P_world.size} workers, {12 // P_world.size} samples each:")
    print("\n".join(lines))
    print("the data-parallel model follows the sequential one exactly")
