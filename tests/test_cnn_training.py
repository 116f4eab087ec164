"""A small distributed CNN trained for 3 SGD steps follows the same model run sequentially, step for step.

conv -> batch norm -> ReLU -> max pool on a (1, 1, 2, 2) spatial partition, the input scattered from rank 0
by Repartition; the features re-laid out over channels (Repartition) feed a DistributedLinear head whose
logits land on rank 0, and a distributed cross-entropy loss. Every rank runs the sequential model next to it
and asserts that the loss and all parameters (and the batch-norm statistics) agree after every step.
"""

import pytest
import torch

from distdl.backends import cuda
from distdl.nn.batchnorm import DistributedBatchNorm
from distdl.nn.conv_feature import DistributedFeatureConv2d
from distdl.nn.linear import DistributedLinear
from distdl.nn.loss import DistributedCrossEntropyLoss
from distdl.nn.pooling import DistributedMaxPool2d
from distdl.nn.repartition import Repartition
from distdl.testing import random_tensor
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import sizes

N, C_IN, SIZE, C_MID, CLASSES = 4, 2, 8, 4, 3
FEATURES = C_MID * (SIZE // 2) ** 2
TOL = dict(rtol=1e-10, atol=1e-12)


def sequential_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(C_IN, C_MID, 3, padding=1), torch.nn.BatchNorm2d(C_MID),
                               torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(FEATURES, CLASSES)).double()


class DistributedCNN(torch.nn.Module):
    """The sequential model's layers over 4 workers; input on rank 0, logits on rank 0."""

    def __init__(self, P_world):
        super().__init__()
        one = P_world.create_partition_inclusive([0])
        P_0 = one.create_cartesian_topology_partition((1, 1, 1, 1))  # the input
        self.P_logits = one.create_cartesian_topology_partition((1, 1))
        self.P_x = P_world.create_cartesian_topology_partition((1, 1, 2, 2))  # height and width split
        P_channels = P_world.create_cartesian_topology_partition((1, 4, 1, 1))
        self.P_features = P_world.create_cartesian_topology_partition((1, 4))  # head input and weight columns
        self.scatter = Repartition(P_0, self.P_x)
        self.conv = DistributedFeatureConv2d(self.P_x, C_IN, C_MID, 3, padding=1)
        self.norm = DistributedBatchNorm(self.P_x, C_MID)
        self.pool = DistributedMaxPool2d(self.P_x, 2)
        self.to_channels = Repartition(self.P_x, P_channels)  # each worker: one channel, i.e. 16 features
        self.head = DistributedLinear(self.P_features, self.P_logits, self.P_features, FEATURES, CLASSES)
        self.loss = DistributedCrossEntropyLoss(self.P_logits)

    def forward(self, x):
        x = self.pool(torch.relu(self.norm(self.conv(self.scatter(x)))))
        return self.head(self.to_channels(x).flatten(1))


def _columns(weight, P):
    start, stop = (int(f(P.shape, P.index, (1, FEATURES))[1]) for f in (compute_start_index, compute_stop_index))
    return weight[:, start:stop]


def _check_parameters(model, ref, rank):
    conv, norm, head = ref[0], ref[1], ref[5]
    for ours, theirs in ((model.conv.weight, conv.weight), (model.conv.bias, conv.bias),
                         (model.norm.weight, norm.weight), (model.norm.bias, norm.bias),
                         (model.norm.running_mean, norm.running_mean), (model.norm.running_var, norm.running_var),
                         (model.head.weight, _columns(head.weight, model.P_features))):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), **TOL,
                                   msg=lambda m: f"parameters differ on rank {rank}: {m}")
    assert (model.head.bias is not None) == (rank == 0)
    if model.head.bias is not None:
        torch.testing.assert_close(model.head.bias.detach().cpu(), head.bias.detach(), **TOL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"))])
@sizes(4)
def test_training_follows_sequential(P_world, comm, device):
    """On the CPU, and on the GPU (through CUDA-aware MPI or staged through the host) against the CPU's model."""
    device = cuda.device_for_rank(comm) if device == "cuda" else torch.device(device)
    ref = sequential_model()
    model = DistributedCNN(P_world).double().to(device)
    with torch.no_grad():  # the same initial weights
        for ours, theirs in ((model.conv, ref[0]), (model.norm, ref[1])):
            ours.weight.copy_(theirs.weight)
            ours.bias.copy_(theirs.bias)
        model.head.weight.copy_(_columns(ref[5].weight, model.P_features))
        if model.head.bias is not None:
            model.head.bias.copy_(ref[5].bias)
    _check_parameters(model, ref, comm.rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    x = random_tensor((N, C_IN, SIZE, SIZE), seed=1)  # one batch, so that the loss must go down
    target = torch.randint(0, CLASSES, (N,), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        on_root = comm.rank == 0
        logits = model((x if on_root else torch.zeros(0, dtype=torch.float64)).to(device))
        loss = model.loss(logits, (target if on_root else torch.zeros(0, dtype=torch.long)).to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ref_loss = torch.nn.functional.cross_entropy(ref(x), target)
        ref_optimizer.zero_grad()
        ref_loss.backward()
        ref_optimizer.step()
        assert logits.shape == ((N, CLASSES) if on_root else (N, 0))  # the batch extent is kept, as in DistDL
        losses.append(comm.bcast(loss.item() if on_root else None, root=0))
        torch.testing.assert_close(losses[-1], ref_loss.item(), **TOL,
                                   msg=lambda m: f"loss differs at step {step} on rank {comm.rank}: {m}")
        _check_parameters(model, ref, comm.rank)
    assert losses[2] < losses[0]  # it learns
