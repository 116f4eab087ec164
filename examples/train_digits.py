"""Train a partitioned CNN on scikit-learn's digits (bundled, no download) and the same model sequentially.

Run: mpiexec -n 4 python examples/train_digits.py   (exactly 4 ranks; ``make demo`` runs it)
Set DISTDL_EXAMPLE_QUICK=1 for a few seconds of training (what the test suite does).

The distributed model, on 4 workers:

====================================  ===============================  =========================================
layer                                 partition                        what is split
====================================  ===============================  =========================================
conv 1->8, ReLU, max-pool             P_conv ``(2, 1, 2, 1)``          batch 2 ways, image height 2 ways (halos)
conv 8->16, ReLU, max-pool            P_conv ``(2, 1, 2, 1)``          batch, height
Repartition                           P_conv -> P_flat ``(2, 2, 1, 1)``  batch, channels (so flattening is local)
row-parallel linear 64->32, ReLU      P_fc ``(2, 2)``                  batch, features (reduce-scatter)
column-parallel linear 32->10         P_fc ``(2, 2)``                  batch, classes (all-gather)
Repartition, cross entropy            P_fc -> P_out ``(2, 1)``         batch, on workers 0 and 2
====================================  ===============================  =========================================

Both models start from the same weights (the sequential model's state dict is loaded into the
distributed layers) and see the same batches, so their losses agree step by step up to rounding.
Look at: the two loss columns of the progress bar, and the two test accuracies at the end.
"""

import os
import time

import numpy as np
import torch
from mpi4py import MPI
from sklearn.datasets import load_digits

from distdl import MPIPartition
from distdl.nn import (DistributedCrossEntropyLoss, DistributedFeatureConv2d, DistributedLinearAllGather,
                       DistributedLinearReduceScatter, DistributedMaxPool2d, Repartition)
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from distdl.utilities.torch import zero_volume_tensor

QUICK = os.environ.get("DISTDL_EXAMPLE_QUICK", "") not in ("", "0")
EPOCHS, STEPS_PER_EPOCH = (1, 6) if QUICK else (12, None)
BATCH, LEARNING_RATE = 64, 0.01

P_world = MPIPartition(MPI.COMM_WORLD)
if P_world.size != 4:
    raise SystemExit(f"train_digits.py: run on exactly 4 ranks (mpiexec -n 4), got {P_world.size}")
P_conv = P_world.create_cartesian_topology_partition((2, 1, 2, 1))
P_flat = P_world.create_cartesian_topology_partition((2, 2, 1, 1))
P_fc = P_world.create_cartesian_topology_partition((2, 2))
P_out = P_world.create_partition_inclusive([0, 2]).create_cartesian_topology_partition((2, 1))


def sequential_model() -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


class DistributedCNN(torch.nn.Module):
    """The sequential model's layers, partitioned as in the table above, with its weights."""

    def __init__(self, reference: torch.nn.Sequential) -> None:
        super().__init__()
        self.conv1 = DistributedFeatureConv2d(P_conv, 1, 8, 3, padding=1, collect_state=True)
        self.conv2 = DistributedFeatureConv2d(P_conv, 8, 16, 3, padding=1, collect_state=True)
        self.pool = DistributedMaxPool2d(P_conv, 2)
        self.to_flat = Repartition(P_conv, P_flat)
        self.fc1 = DistributedLinearReduceScatter(P_fc, 64, 32, collect_state=True)
        self.fc2 = DistributedLinearAllGather(P_fc, 32, 10, collect_state=True)
        self.to_out = Repartition(P_fc, P_out)
        for mine, theirs in [(self.conv1, reference[0]), (self.conv2, reference[3]),
                             (self.fc1, reference[7]), (self.fc2, reference[9])]:
            mine.load_state_dict(theirs.state_dict())  # rank 0's values; each worker keeps its block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = self.to_flat(x).flatten(1)  # (n, 8, 2, 2): this worker's 8 channels = 32 of the 64 features
        x = torch.relu(self.fc1(x))
        return self.to_out(self.fc2(x))  # (n, 10) logits on P_out, zero-volume elsewhere


def block(t: torch.Tensor, P: MPIPartition) -> torch.Tensor:
    """Return this worker's balanced block of ``t`` over ``P`` (leading dimensions), zero-volume outside."""
    if not P.active:
        return zero_volume_tensor(dtype=t.dtype)
    d = min(P.dim, t.dim())  # labels: the batch axis of P_out only
    P_shape, index, shape = P.shape[:d], P.index[:d], t.shape[:d]
    start, stop = compute_start_index(P_shape, index, shape), compute_stop_index(P_shape, index, shape)
    return t[tuple(slice(a, b) for a, b in zip(start, stop))]


def accuracy(distributed: torch.nn.Module, sequential: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """Return the test accuracy of both models (every rank gets the same numbers)."""
    with torch.no_grad():
        logits = distributed(block(x, P_conv))
        right = int((logits.argmax(1) == block(y, P_out)).sum()) if P_out.active else 0
        total = int(P_world.allreduce_data(np.array([right]))[0])
        seq = int((sequential(x).argmax(1) == y).sum())
    return total / len(y), seq / len(y)


def progress(done: int, total: int, text: str) -> None:
    if P_world.rank == 0:
        bar = "#" * (30 * done // total)
        print(f"\r[{bar:<30}] {done:4d}/{total} {text}", end="\n" if done == total else "", flush=True)


digits = load_digits()
images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
labels = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))
train, test = order[:1437], order[1437:]

sequential = sequential_model()
distributed = DistributedCNN(sequential)
loss_seq, loss_dist = torch.nn.CrossEntropyLoss(), DistributedCrossEntropyLoss(P_out)
opt_seq = torch.optim.Adam(sequential.parameters(), lr=LEARNING_RATE)
opt_dist = torch.optim.Adam(distributed.parameters(), lr=LEARNING_RATE)

steps = STEPS_PER_EPOCH or -(-len(train) // BATCH)
if P_world.rank == 0:
    print(f"digits: {len(train)} training and {len(test)} test images of 8 x 8; {EPOCHS} epochs of {steps} steps, "
          f"batch {BATCH}, Adam lr {LEARNING_RATE}; distributed on 4 workers and sequentially on one")
start = time.perf_counter()
for epoch in range(EPOCHS):
    shuffled = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(100 + epoch))]
    for step in range(steps):
        batch = shuffled[step * BATCH:(step + 1) * BATCH]  # the last batch is smaller: shapes change per call
        x, y = images[batch], labels[batch]
        opt_seq.zero_grad()
        seq = loss_seq(sequential(x), y)
        seq.backward()
        opt_seq.step()
        opt_dist.zero_grad()
        dist = loss_dist(distributed(block(x, P_conv)), block(y, P_out))  # every rank gets the global loss
        dist.backward()
        opt_dist.step()
        progress(epoch * steps + step + 1, EPOCHS * steps,
                 f"epoch {epoch + 1}: loss distributed {dist.item():.4f}, sequential {seq.item():.4f}")
elapsed = time.perf_counter() - start

acc_dist, acc_seq = accuracy(distributed, sequential, images[test], labels[test])
if P_world.rank == 0:
    print(f"trained in {elapsed:.1f} s")
    print(f"test accuracy: distributed {100 * acc_dist:.1f}%, sequential {100 * acc_seq:.1f}%")
    gap = abs(acc_dist - acc_seq)
    print("the distributed model matches the sequential one" if gap <= 0.02 else
          f"the accuracies differ by {100 * gap:.1f} points")
