"""Broadcast: copy each block of P_x to the workers of P_y it broadcasts to (NumPy rules on the grid shapes).

Run: mpiexec -n 4 python examples/broadcast.py
Look at: P_x is a 1 x 2 grid on workers 0 and 1, P_y the 2 x 2 grid of all four; column ``j`` of P_y gets
the block of worker ``j`` of P_x. Backward is SumReduce: each source gets the sum of its column's gradients.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import Broadcast
from distdl.testing import assert_adjoint, random_tensor
from distdl.utilities.torch import zero_volume_tensor

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("broadcast.py: run on 4 ranks (mpiexec -n 4)")
P_x = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition((1, 2))
P_y = P_world.create_cartesian_topology_partition((2, 2))
layer = Broadcast(P_x, P_y)

# Workers outside P_x pass a zero-volume tensor: every rank calls every layer.
x = torch.full((2, 3), 10.0 * (P_x.rank + 1)) if P_x.active else zero_volume_tensor(2)
x.requires_grad_()
y = layer(x)
assert torch.equal(y, torch.full((2, 3), 10.0 * (P_y.index[1] + 1)))  # every worker is in P_y here
y.backward(torch.full_like(y, float(P_y.rank + 1)))  # cotangents 1, 2, 3, 4
if P_x.active:  # worker j of P_x gets the cotangents of column j summed: (1 + 3) and (2 + 4)
    assert torch.equal(x.grad, torch.full((2, 3), 4.0 + 2 * P_x.rank))
assert_adjoint(layer, random_tensor(x.shape, seed=P_world.rank), MPI.COMM_WORLD)

text = P_world.comm.gather(f"rank {P_world.rank}: in P_x {P_x.active!s:5}  x = {x.flatten()[:1].tolist()}  "
                           f"P_y index {P_y.index}  y = {y[0, 0].item():.0f}  x.grad = "
                           f"{x.grad.flatten()[:1].tolist()}", root=0)
if P_world.rank == 0:
    print("broadcast from P_x (1 x 2, workers 0 and 1) to P_y (2 x 2); [] is a zero-volume tensor:")
    print("\n".join(text))
    print("forward, backward (a sum-reduce) and the dot-product adjoint test agree on every rank")
