"""DistributedEmbedding: an embedding table whose embedding dimension is split over workers.

Run: mpiexec -n 2 python examples/embedding.py
Look at: a table of 20 words x 6 dimensions is split into two 20 x 3 column blocks; both workers look
up the same indices and each returns its 3 columns of the embeddings, with no communication. The
gradient of each table block equals its columns of torch.nn.Embedding's gradient.
"""

import torch
from mpi4py import MPI

from distdl import MPIPartition
from distdl.nn import DistributedEmbedding
from distdl.testing import scatter

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 2:
    raise SystemExit("embedding.py: run on 2 ranks (mpiexec -n 2)")
P_x = P_world.create_cartesian_topology_partition((1, 2))  # (indices, embedding dimension)

torch.manual_seed(0)
reference = torch.nn.Embedding(20, 6).double()
layer = DistributedEmbedding(P_x, 20, 6, collect_state=True).double()
layer.load_state_dict(reference.state_dict())

words = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
y_ref = reference(words)
y_ref.square().sum().backward()
y = layer(words)  # the indices are replicated along the split (last) axis
y.square().sum().backward()
assert torch.allclose(y, scatter(y_ref.detach(), P_x))
assert torch.allclose(layer.weight.grad, scatter(reference.weight.grad, P_x))

text = P_world.comm.gather(f"rank {P_world.rank}: table block {tuple(layer.weight.shape)}, output "
                           f"{tuple(y.shape)}, y[0] = {[round(v, 3) for v in y[0].tolist()]}", root=0)
if P_world.rank == 0:
    print(f"embedding of the words {words.tolist()} in a 20 x 6 table split over 2 workers:")
    print("\n".join(text))
    print(f"torch's y[0] = {[round(v, 3) for v in y_ref[0].tolist()]}: the two blocks side by side")
