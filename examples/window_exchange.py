"""WindowExchange: give every worker any window of the global tensor (the general halo, used by conv/pooling).

Run: mpiexec -n 3 python examples/window_exchange.py
Look at: a length-10 signal over 3 workers (blocks of 4, 3, 3); each worker asks for a window four cells
wider than its block on each side, so workers 0 and 2 reach past their neighbour (worker 1) into the far
block, worker 1's window takes in both neighbours' blocks, and windows past the ends of the signal are
zero-filled. The adjoint adds overlapping windows back.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.functional import window_exchange, window_scatter_add
from distdl.testing import assert_adjoint, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 3:
    raise SystemExit("window_exchange.py: run on 3 ranks (mpiexec -n 3)")
P_x = P_world.create_cartesian_topology_partition((3,))
n, reach = 10, 4
blocks = [(int(compute_start_index([3], [i], [n])[0]), int(compute_stop_index([3], [i], [n])[0])) for i in range(3)]
windows = tuple(((a - reach, b + reach),) for a, b in blocks)  # per worker, per dimension, [start, stop)

signal = torch.arange(1.0, n + 1)
x = scatter(signal, P_x)
y = window_exchange(x, P_x, (n,), windows)
a, b = windows[P_x.rank][0]
padded = torch.cat([torch.zeros(reach), signal, torch.zeros(reach)])  # zeros past the ends
assert torch.equal(y, padded[a + reach:b + reach])
# The adjoint: every window sent back and added where it came from (each cell is in several windows).
back = window_scatter_add(torch.ones_like(y), P_x, (n,), windows)
covered = sum(((torch.arange(n) >= wa) & (torch.arange(n) < wb)).double() for ((wa, wb),) in windows)
assert torch.equal(back, scatter(covered, P_x).to(back.dtype))
assert_adjoint(lambda t: window_exchange(t, P_x, (n,), windows), random_tensor(x.shape, seed=P_world.rank),
               MPI.COMM_WORLD)

text = P_world.comm.gather(f"rank {P_world.rank}: block {blocks[P_x.rank]} window [{a}, {b}) -> "
                           f"{[int(v) for v in y]}   adjoint of ones: {[int(v) for v in back]}", root=0)
if P_world.rank == 0:
    print("window_exchange of the signal 1..10 over 3 workers, windows 4 cells wider than each block:")
    print("\n".join(text))
    print("each window matches the zero-padded signal; the adjoint counts how many windows hold each cell")
