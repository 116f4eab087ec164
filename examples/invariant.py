"""The two gradient conventions: the true adjoint (distdl's default) and the invariant pair.

Run: mpiexec -n 2 python examples/invariant.py
Look at: the same all-sum-reduce followed by a loss that BOTH workers compute redundantly. The true
adjoint adds the two identical cotangents (x.grad = 2, the gradient of the loss counted twice); the
invariant all_sum_reduce_forward (backward: identity) gives the gradient of the one loss (x.grad = 1).
Then the mirror case: a weight replicated on both workers, each using it on its own data;
all_sum_reduce_backward makes each replica's gradient the total, as the sequential model has it.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.functional import all_sum_reduce, all_sum_reduce_backward, all_sum_reduce_forward

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 2:
    raise SystemExit("invariant.py: run on 2 ranks (mpiexec -n 2)")
P_x = P_world.create_cartesian_topology_partition((2,))

# 1. A loss computed redundantly after a sum: L = sum(x_0 + x_1), the same on both workers.
grads = {}
for name, op in (("all_sum_reduce (true adjoint)", all_sum_reduce), ("all_sum_reduce_forward", all_sum_reduce_forward)):
    x = torch.full((3,), float(P_x.rank + 1), requires_grad=True)
    op(x, P_x, axes_reduce=[0]).sum().backward()  # each worker calls backward on its copy of L
    grads[name] = x.grad[0].item()
assert grads == {"all_sum_reduce (true adjoint)": 2.0, "all_sum_reduce_forward": 1.0}

# 2. A replicated weight used on local data: L = sum_i w * d_i, so dL/dw = sum_i d_i on every replica.
w = torch.tensor(0.5, requires_grad=True)
data = torch.tensor([1.0, 2.0]) + 10 * P_x.rank  # worker 0: 1, 2; worker 1: 11, 12
(all_sum_reduce_backward(w, P_x, axes_reduce=[0]) * data).sum().backward()
assert w.grad.item() == 3.0 + 23.0

if P_world.rank == 0:
    print("loss computed on both workers after a sum over them:")
    for name, g in grads.items():
        print(f"  {name:32} x.grad = {g:.0f}")
    print("the redundant loss is one loss, so the invariant convention is right here (see docs: concepts)")
    print(f"replicated weight through all_sum_reduce_backward: w.grad = {w.grad.item():.0f} on every worker "
          "(1 + 2 + 11 + 12, the sequential gradient)")
