"""Distributed losses: the loss of the whole tensors, from blocks held by different workers.

Run: mpiexec -n 3 python examples/losses.py
Look at: predictions and targets of 7 samples split over 3 workers (3, 2 and 2 samples); every worker
gets the same global loss, equal to torch's on the whole batch, and backward on every worker gives each
block its exact gradient (the losses sum with the invariant all_sum_reduce_forward, because every worker
holds the same loss).
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DistributedCrossEntropyLoss, DistributedMSELoss
from distdl.testing import scatter

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 3:
    raise SystemExit("losses.py: run on 3 ranks (mpiexec -n 3)")
P_x = P_world.create_cartesian_topology_partition((3, 1))  # (batch, features or classes)
P_t = P_world.create_cartesian_topology_partition((3,))  # class indices: the batch axis only
generator = torch.Generator().manual_seed(0)
logits = torch.randn(7, 5, dtype=torch.float64, generator=generator)
targets = torch.randint(0, 5, (7,), generator=generator)
values = torch.randn(7, 5, dtype=torch.float64, generator=generator)

lines = []
for loss, reference, target in ((DistributedMSELoss(P_x), torch.nn.MSELoss(), values),
                                (DistributedCrossEntropyLoss(P_x), torch.nn.CrossEntropyLoss(), targets)):
    x_ref = logits.clone().requires_grad_()
    loss_ref = reference(x_ref, target)
    loss_ref.backward()
    x = scatter(logits, P_x).requires_grad_()
    value = loss(x, scatter(target, P_x if target.dim() == 2 else P_t))
    value.backward()
    assert torch.allclose(value, loss_ref) and torch.allclose(x.grad, scatter(x_ref.grad, P_x))
    lines.append(f"{type(loss).__name__} = {value.item():.6f} (torch: {loss_ref.item():.6f})")

text = P_world.comm.gather(f"rank {P_world.rank}, {scatter(logits, P_x).shape[0]} samples: " + "; ".join(lines),
                           root=0)
if P_world.rank == 0:
    print("\n".join(text))
    print("every worker holds the global loss; the input gradients equal torch's")
