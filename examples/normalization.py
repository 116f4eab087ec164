"""Distributed normalisation: BatchNorm with statistics of the whole batch, LayerNorm over split features.

Run: mpiexec -n 4 python examples/normalization.py
Look at: BatchNorm1d of a (6, 3, 10) tensor split 2 ways over the batch and 2 ways over the length:
every worker normalises with the global per-channel mean and variance (two small all-sum-reduces), and the
running statistics match torch's. LayerNorm(10) of a (6, 10) tensor split 2 x 2 normalises each row
over features held by two workers. Outputs and input gradients equal torch's.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DistributedBatchNorm, DistributedLayerNorm
from distdl.testing import scatter

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit("normalization.py: run on 4 ranks (mpiexec -n 4)")
generator = torch.Generator().manual_seed(0)


def check(layer, reference, x_global, P_x):
    x_ref = x_global.clone().requires_grad_()
    y_ref = reference(x_ref)
    (y_ref * torch.arange(y_ref.numel()).reshape(y_ref.shape)).sum().backward()  # a varied cotangent
    x = scatter(x_global, P_x).requires_grad_()
    y = layer(x)
    (y * scatter(torch.arange(y_ref.numel()).reshape(y_ref.shape), P_x)).sum().backward()
    assert torch.allclose(y, scatter(y_ref.detach(), P_x))
    assert torch.allclose(x.grad, scatter(x_ref.grad, P_x))
    return f"{type(layer).__name__}: block {tuple(x.shape)} of {tuple(x_global.shape)}"


P_bn = P_world.create_cartesian_topology_partition((2, 1, 2))  # (batch, channels, length)
batchnorm = DistributedBatchNorm(P_bn, 3).double()
reference_bn = torch.nn.BatchNorm1d(3).double()
lines = [check(batchnorm, reference_bn, 3 + 2 * torch.randn(6, 3, 10, dtype=torch.float64, generator=generator),
               P_bn)]
assert torch.allclose(batchnorm.running_mean, reference_bn.running_mean)
assert torch.allclose(batchnorm.running_var, reference_bn.running_var)

P_ln = P_world.create_cartesian_topology_partition((2, 2))  # (batch, features)
layernorm = DistributedLayerNorm(P_ln, 10).double()
lines.append(check(layernorm, torch.nn.LayerNorm(10).double(), torch.randn(6, 10, dtype=torch.float64,
                                                                           generator=generator), P_ln))

text = P_world.comm.gather(f"rank {P_world.rank}: " + "; ".join(lines), root=0)
if P_world.rank == 0:
    print("\n".join(text))
    print(f"BatchNorm running mean after one step: {[round(v, 4) for v in batchnorm.running_mean.tolist()]}"
          " (torch's is the same)")
    print("outputs and input gradients equal torch's BatchNorm1d and LayerNorm")
