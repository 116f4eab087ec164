"""AllSumReduce: sum within the fibres of a partition along some axes; every member gets the sum.

Run: mpiexec -n 4 python examples/all_sum_reduce.py
Look at: on the 2 x 2 grid, the workers of each row (a fibre along axis 1) end with the sum of their
row's inputs; backward is the same sum (the operator is self-adjoint), and the dot-product test passes.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import AllSumReduce
from distdl.testing import assert_adjoint, random_tensor

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("all_sum_reduce.py: run on 4 ranks (mpiexec -n 4)")
P_x = P_world.create_cartesian_topology_partition((2, 2))
layer = AllSumReduce(P_x, axes_reduce=[1])  # the fibre communicators are built here, once

x = torch.full((2, 3), 10.0 ** P_x.rank, requires_grad=True)  # 1, 10, 100, 1000
y = layer(x)
row = P_x.index[0]
assert torch.equal(y, torch.full((2, 3), 10.0 ** (2 * row) + 10.0 ** (2 * row + 1)))
y.backward(torch.ones_like(y))  # the adjoint: the same sum of the cotangents
assert torch.equal(x.grad, torch.full((2, 3), 2.0))
assert_adjoint(layer, random_tensor((2, 3), seed=P_x.rank), MPI.COMM_WORLD)  # <F x, y> == <x, F* y>

text = P_world.comm.gather(f"rank {P_x.rank} index {P_x.index}: x = {x[0, 0].item():6.0f}   "
                           f"y = {y[0, 0].item():6.0f}   x.grad = {x.grad[0, 0].item():.0f}", root=0)
if P_world.rank == 0:
    print("all_sum_reduce along axis 1 of a 2 x 2 grid (each entry stands for a 2 x 3 tensor):")
    print("\n".join(text))
    print("forward, backward and the dot-product adjoint test agree with the serial reference on every rank")
