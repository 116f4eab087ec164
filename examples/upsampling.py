"""Distributed upsampling: nearest and bilinear interpolation of an image split over workers.

Run: mpiexec -n 2 python examples/upsampling.py
Look at: a 5 x 4 image split over its height (blocks of 3 and 2 rows) is upsampled by 2; bilinear
interpolation near the split reads a row of the neighbour's block. Outputs and input gradients equal
torch.nn.functional.interpolate's.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DistributedUpsample
from distdl.testing import scatter

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 2:
    raise SystemExit("upsampling.py: run on 2 ranks (mpiexec -n 2)")
P_x = P_world.create_cartesian_topology_partition((1, 1, 2, 1))  # (batch, channels, height, width)
x_global = torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

lines = []
for mode, align in (("nearest", None), ("bilinear", False)):
    layer = DistributedUpsample(P_x, scale_factor=2, mode=mode, align_corners=align)
    x_ref = x_global.clone().requires_grad_()
    y_ref = torch.nn.functional.interpolate(x_ref, scale_factor=2, mode=mode, align_corners=align)
    y_ref.square().sum().backward()
    x = scatter(x_global, P_x).requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    assert torch.allclose(y, scatter(y_ref.detach(), P_x))
    assert torch.allclose(x.grad, scatter(x_ref.grad, P_x))
    lines.append(f"{mode}: {tuple(x.shape)} -> {tuple(y.shape)}")

text = P_world.comm.gather(f"rank {P_world.rank}: " + "; ".join(lines), root=0)
if P_world.rank == 0:
    print("upsampling by 2 of a 1 x 2 x 5 x 4 tensor split over its height:")
    print("\n".join(text))
    print("outputs and input gradients equal torch's")
