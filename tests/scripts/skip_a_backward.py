"""Rank 1 skips the first backward of a DataParallel model, so rank 0 waits in that backward's reduction forever.

Launched by tests/test_abort.py as ``mpiexec -n 2 python tests/scripts/skip_a_backward.py`` with check mode on
and a short ``DISTDL_CHECK_TIMEOUT``: rank 1's next forward waits for rank 0 to check it past the limit and raises
CollectiveTimeoutError, and the abort hook ends the job. Without check mode the job hangs.
"""

import torch
from mpi4py import MPI

import distdl
from distdl.nn import DataParallel

comm = MPI.COMM_WORLD
model = DataParallel(torch.nn.Linear(3, 2), distdl.MPIPartition(comm))
x = torch.rand(4, 3)
for step in range(2):
    loss = model(x).sum()
    if not (comm.rank == 1 and step == 0):
        loss.backward()
print(f"rank {comm.rank} finished", flush=True)
