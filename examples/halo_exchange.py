"""HaloExchange: fill each worker's ghost cells from its neighbours' interiors.

Run: mpiexec -n 3 python examples/halo_exchange.py
Look at: a length-10 signal over 3 workers (blocks of 4, 3, 3) padded with one ghost cell on each side;
after the exchange the ghosts hold the neighbours' edge values (the outer ghosts at the ends of the
signal keep their value, -1). Backward sends ghost gradients back and adds them to their owners.
"""

import numpy as np
import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import HaloExchange
from distdl.testing import assert_adjoint, random_tensor
from distdl.utilities.slicing import compute_start_index, compute_stop_index

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 3:
    raise SystemExit("halo_exchange.py: run on 3 ranks (mpiexec -n 3)")
P_x = P_world.create_cartesian_topology_partition((3,))
n = 10
start = int(compute_start_index(P_x.shape, P_x.index, [n])[0])
stop = int(compute_stop_index(P_x.shape, P_x.index, [n])[0])
first, last = P_x.index[0] == 0, P_x.index[0] == P_x.shape[0] - 1

# Per tensor dimension [left, right]: ghost widths in x, widths received and widths sent.
halo = np.array([[1, 1]])
recv = np.array([[0 if first else 1, 0 if last else 1]])
send = recv.copy()  # each neighbour needs one cell from each side
layer = HaloExchange(P_x, halo, recv, send)

signal = torch.arange(n, dtype=torch.float64) * 10
x = torch.full((stop - start + 2,), -1.0, dtype=torch.float64)  # ghosts start at -1
x[1:-1] = signal[start:stop]
y = layer(x)
expected = x.clone()
if not first:
    expected[0] = signal[start - 1]
if not last:
    expected[-1] = signal[stop]
assert torch.equal(y, expected)
assert_adjoint(layer, random_tensor(x.shape, seed=P_world.rank), MPI.COMM_WORLD)

text = P_world.comm.gather(f"rank {P_world.rank}: block [{start}, {stop})  x = {x.tolist()}\n"
                           f"{'':22}y = {y.tolist()}", root=0)
if P_world.rank == 0:
    print("halo exchange of a length-10 signal (values 0, 10, ..., 90) with one ghost cell per side:")
    print("\n".join(text))
    print("ghosts hold the neighbours' values; the dot-product adjoint test passes")
