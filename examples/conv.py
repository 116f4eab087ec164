"""Distributed convolution: an image split over its height and width (halos), then over its channels.

Run: mpiexec -n 4 python examples/conv.py
Look at: first, a 9 x 10 image split 2 x 2 over height and width (uneven blocks): each worker fetches
the input window its block of the output reads (the halo) and convolves it. Second, the channels
split: input channels over workers 0-1, the weight over a 2 x 2 grid (output x input channel
blocks), output channels over workers 2-3. ``DistributedConv2d`` picks the layer that fits the
partitions given. Outputs and gradients equal torch.nn.Conv2d's in both.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DistributedConv2d
from distdl.testing import scatter
from distdl.utilities.torch import zero_volume_tensor

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("conv.py: run on 4 ranks (mpiexec -n 4)")
torch.manual_seed(0)
reference = torch.nn.Conv2d(4, 6, kernel_size=3, padding=1).double()
x_global = torch.randn(2, 4, 9, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
x_ref = x_global.clone().requires_grad_()
y_ref = reference(x_ref)
y_ref.square().sum().backward()


def run(layer, P_x, P_y):
    """Check the layer against torch on this worker; return its input and output shapes."""
    layer.load_state_dict(reference.state_dict())  # each worker keeps its block of the global weight
    x = (scatter(x_global, P_x) if P_x.active else zero_volume_tensor(2, dtype=torch.float64)).requires_grad_()
    y = layer(x)
    y.square().sum().backward()  # this worker's share of sum(y^2); zero-volume outputs add nothing
    if P_y.active:
        assert torch.allclose(y, scatter(y_ref.detach(), P_y))
    if P_x.active:
        assert torch.allclose(x.grad, scatter(x_ref.grad, P_x))
    return f"{tuple(x.shape)} -> {tuple(y.shape)}"


# 1. Spatial: batch, height and width may be split (the channel axis is whole).
P_space = P_world.create_cartesian_topology_partition((1, 1, 2, 2))
spatial = DistributedConv2d(P_space, 4, 6, kernel_size=3, padding=1, collect_state=True).double()
lines = [f"{type(spatial).__name__}: {run(spatial, P_space, P_space)}"]
assert torch.allclose(spatial.weight.grad, reference.weight.grad)  # replicated kernel: the total gradient

# 2. Channels: x on workers 0-1 (2 input-channel blocks), W on all four, y on workers 2-3.
P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition((1, 2, 1, 1))
P_w = P_world.create_cartesian_topology_partition((2, 2, 1, 1))
P_y = P_world.create_partition_inclusive([2, 3]).create_cartesian_topology_partition((1, 2, 1, 1))
channel = DistributedConv2d(P_x, 4, 6, kernel_size=3, padding=1, P_y=P_y, P_w=P_w, collect_state=True).double()
lines.append(f"{type(channel).__name__}: {run(channel, P_x, P_y)}, weight block {tuple(channel.weight.shape)}")

text = P_world.comm.gather(f"rank {P_world.rank}: " + "\n        ".join(lines), root=0)
if P_world.rank == 0:
    print("Conv2d(4 -> 6, 3 x 3, padding 1) of a 2 x 4 x 9 x 10 tensor, split two ways:")
    print("\n".join(text))
    print("outputs and input gradients equal torch.nn.Conv2d's in both layouts")
