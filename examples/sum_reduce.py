"""SumReduce: sum the blocks of P_x onto the workers of P_y that broadcast to them; the adjoint of Broadcast.

Run: mpiexec -n 4 python examples/sum_reduce.py
Look at: P_x is the 2 x 2 grid of all four workers, P_y a 1 x 2 grid on workers 2 and 3; worker ``j`` of
P_y gets the sum of column ``j`` of P_x. Workers 0 and 1 only send, and get zero-volume tensors back.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import SumReduce
from distdl.testing import assert_adjoint, random_tensor

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("sum_reduce.py: run on 4 ranks (mpiexec -n 4)")
P_x = P_world.create_cartesian_topology_partition((2, 2))
P_y = P_world.create_partition_inclusive([2, 3]).create_cartesian_topology_partition((1, 2))
layer = SumReduce(P_x, P_y)

x = torch.full((2, 3), 10.0 ** P_x.rank, requires_grad=True)  # 1, 10, 100, 1000
y = layer(x)
if P_y.active:  # column j of P_x: ranks j and j + 2
    assert torch.equal(y, torch.full((2, 3), 10.0 ** P_y.rank + 10.0 ** (P_y.rank + 2)))
else:
    assert y.numel() == 0
y.backward(torch.full_like(y, 7.0) if P_y.active else y)  # the adjoint broadcasts the cotangent back
assert torch.equal(x.grad, torch.full((2, 3), 7.0))
assert_adjoint(layer, random_tensor(x.shape, seed=P_world.rank), MPI.COMM_WORLD)

text = P_world.comm.gather(f"rank {P_world.rank}: P_x index {P_x.index}  x = {x[0, 0].item():6.0f}   "
                           f"in P_y {P_y.active!s:5}  y = {y.flatten()[:1].tolist()}", root=0)
if P_world.rank == 0:
    print("sum_reduce from P_x (2 x 2) onto P_y (1 x 2, workers 2 and 3); [] is a zero-volume tensor:")
    print("\n".join(text))
    print("forward, backward (a broadcast) and the dot-product adjoint test agree on every rank")
