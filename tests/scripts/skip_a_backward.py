"""Rank 1 skips the first backward of a DataParallel model, so rank 0 waits in that backward's reduction forever.

Launched by tests/test_abort.py as ``mpiexec -n 2 python tests/scripts/skip_a_backward.py [raised]`` with check mode
on and a short ``DISTDL_CHECK_TIMEOUT``: rank 1's next forward meets rank 0's check of its backward, both raise
CollectiveMismatchError, and the abort hook ends the job. Without check mode the job hangs. With ``raised``, rank
1's backward raises part-way (after a first bucket's sum started) and rank 1 catches the error and goes on: its
next forward times out waiting for rank 0, which waits in the sums.
"""

import sys

import torch
from mpi4py import MPI

import distdl
from distdl.nn import DataParallel

comm = MPI.COMM_WORLD
raised = sys.argv[1:] == ["raised"]
torch.manual_seed(0)
layers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
model = DataParallel(layers, distdl.MPIPartition(comm), bucket_cap_mb=1e-6)  # a bucket per parameter
armed = [comm.rank == 1]


def fail_once(grad):
    if armed.pop() if armed else False:
        raise RuntimeError("a failure on purpose, caught")
    return grad


layers[0].weight.register_hook(fail_once)  # the last gradient: the later layer's buckets have started
x = torch.rand(4, 3)
for step in range(2):
    loss = model(x).sum()
    if raised:
        try:
            loss.backward()
        except RuntimeError as error:
            print(f"rank {comm.rank} caught: {error}", flush=True)
    elif not (comm.rank == 1 and step == 0):
        loss.backward()
print(f"rank {comm.rank} finished", flush=True)
