"""Distributed pooling: max and average pooling of a signal split over workers (uneven blocks).

Run: mpiexec -n 3 python examples/pooling.py
Look at: a length-17 signal over 3 workers (blocks of 6, 6, 5) is pooled with a window of 3, stride 2
and padding 1; each worker fetches the window its output block reads. Outputs and input gradients
equal torch.nn.MaxPool1d's and AvgPool1d's.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DistributedAvgPool1d, DistributedMaxPool1d
from distdl.testing import scatter

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 3:
    raise SystemExit("pooling.py: run on 3 ranks (mpiexec -n 3)")
P_x = P_world.create_cartesian_topology_partition((1, 1, 3))  # (batch, channels, length)
x_global = torch.randn(2, 2, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

lines = []
for layer, reference in ((DistributedMaxPool1d(P_x, 3, stride=2, padding=1), torch.nn.MaxPool1d(3, 2, 1)),
                         (DistributedAvgPool1d(P_x, 3, stride=2, padding=1), torch.nn.AvgPool1d(3, 2, 1))):
    x_ref = x_global.clone().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.square().sum().backward()
    x = scatter(x_global, P_x).requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    assert torch.allclose(y, scatter(y_ref.detach(), P_x))
    assert torch.allclose(x.grad, scatter(x_ref.grad, P_x))
    lines.append(f"{type(layer).__name__}: input block {tuple(x.shape)} -> output block {tuple(y.shape)}")

text = P_world.comm.gather(f"rank {P_world.rank}: " + "; ".join(lines), root=0)
if P_world.rank == 0:
    print("pooling (window 3, stride 2, padding 1) of a length-17 signal over 3 workers:")
    print("\n".join(text))
    print("outputs and input gradients equal torch's")
