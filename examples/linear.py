"""DistributedLinear: DistDL's classic affine layer, y = x W^T + b with W in blocks on a 2-D partition.

Run: mpiexec -n 4 python examples/linear.py
Look at: x (features split over workers 0 and 1) is broadcast to the 2 x 2 weight grid, each worker
multiplies by its block of W, and the partial products are summed onto workers 2 and 3, which hold the
output features. The output and the input gradient equal torch.nn.Linear's on the whole tensors.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DistributedLinear
from distdl.testing import scatter
from distdl.utilities.torch import zero_volume_tensor

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("linear.py: run on 4 ranks (mpiexec -n 4)")
P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition((1, 2))  # in features
P_w = P_world.create_cartesian_topology_partition((2, 2))  # (out blocks, in blocks)
P_y = P_world.create_partition_inclusive([2, 3]).create_cartesian_topology_partition((1, 2))  # out features

torch.manual_seed(0)
reference = torch.nn.Linear(10, 6).double()  # the same on every rank
layer = DistributedLinear(P_x, P_y, P_w, 10, 6, collect_state=True).double()
layer.load_state_dict(reference.state_dict())  # rank 0 of P_w's values; each worker keeps its blocks

x_global = torch.randn(5, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
x = scatter(x_global, P_x) if P_x.active else zero_volume_tensor(5, dtype=torch.float64)
x.requires_grad_()
y = layer(x)

x_ref = x_global.clone().requires_grad_()
y_ref = reference(x_ref)
dy = torch.randn(y_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
y_ref.backward(dy)
y.backward(scatter(dy, P_y) if P_y.active else torch.zeros_like(y))
if P_y.active:
    assert torch.allclose(y, scatter(y_ref.detach(), P_y))
if P_x.active:
    assert torch.allclose(x.grad, scatter(x_ref.grad, P_x))

text = P_world.comm.gather(f"rank {P_world.rank}: x block {tuple(x.shape)}, weight block {tuple(layer.weight.shape)}, "
                           f"y block {tuple(y.shape)}", root=0)
state = layer.state_dict()  # collective: rank 0 of P_w gets torch's keys and global shapes
if P_world.rank == 0:
    print("DistributedLinear(10 -> 6): x on workers 0-1, W on the 2 x 2 grid, y on workers 2-3")
    print("\n".join(text))
    print(f"state_dict on rank 0: {[(k, tuple(v.shape)) for k, v in state.items()]}")
    print("output and input gradient equal torch.nn.Linear's on the gathered tensors")
