"""A layer whose partition was freed raises the same ValueError on every worker, naming the freed partition.

A freed partition's members would pass for inactive workers: the layers took a block for a worker outside the
partition's ("expected a zero-volume tensor") and a zero-volume tensor for an idle worker's input (no error).
"""

import pytest
import torch

import distdl.nn as dnn
from distdl.utilities.torch import zero_volume_tensor
from helpers import sizes


def _layers(P_world, n):
    """(name, a function building the layer on a new partition and returning both, a block of its input)."""
    grid = lambda: P_world.create_cartesian_topology_partition((n, 1, 1, 1))  # noqa: E731
    features = lambda: P_world.create_cartesian_topology_partition((1, n))  # noqa: E731
    image, rows = torch.rand(2, 2, 4, 4), torch.rand(2, 3)

    def loss(P):
        mse = dnn.DistributedMSELoss(P)
        return lambda x: mse(x, x.detach())
    return [
        ("DistributedFeatureConv2d", grid, lambda P: dnn.DistributedConv2d(P, 2, 3, 3, padding=1), image),
        ("DistributedBatchNorm", grid, lambda P: dnn.DistributedBatchNorm(P, 2), image),
        ("DistributedMaxPool2d", grid, lambda P: dnn.DistributedMaxPool2d(P, 2), image),
        ("DistributedUpsample", grid, lambda P: dnn.DistributedUpsample(P, scale_factor=2), image),
        ("DistributedLinearAllGather", features, lambda P: dnn.DistributedLinearAllGather(P, 3 * n, 4), rows),
        ("DistributedLinearReduceScatter", features, lambda P: dnn.DistributedLinearReduceScatter(P, 3 * n, 4), rows),
        ("DistributedLayerNorm", features, lambda P: dnn.DistributedLayerNorm(P, 3 * n), rows),
        ("DistributedEmbedding", features, lambda P: dnn.DistributedEmbedding(P, 5, 3 * n), torch.tensor([0, 4])),
        ("DistributedMSELoss", features, loss, rows),
    ]


@sizes(1, 2, 3, 4)
def test_layers_on_a_freed_partition_raise_on_every_worker(P_world, comm):
    for name, partition, build, block in _layers(P_world, comm.size):
        P = partition()
        layer = build(P)
        layer(block)  # works while P lives
        P.free()
        for x in (block, zero_volume_tensor(block.shape[0], dtype=block.dtype)):
            with pytest.raises(ValueError, match=rf"^{name} \(P_x\): the partition of shape .* was freed"):
                layer(x)


@sizes(2, 3)
def test_a_partition_freed_between_forward_and_backward(P_world, comm):
    """Freed after the forward, a partition fails its backward with the same ValueError on every worker (MPI's null
    communicator error came out on some; a broadcast's receivers raised about a gradient's shape and its source
    returned). DataParallel, which reduces on a communicator of its own, refuses a freed partition too."""
    import distdl.functional as F
    from distdl.nn import DataParallel
    grid = lambda: P_world.create_cartesian_topology_partition((comm.size,))  # noqa: E731
    root = lambda: P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1,))  # noqa: E731
    x = torch.rand(3 * comm.size, requires_grad=True)
    calls = {"AllSumReduce": (grid, lambda P: F.all_sum_reduce(x, P, axes_reduce=(0,))),
             "AllGather": (grid, lambda P: F.all_gather(x, P, axes_all_gather=(0,))),
             "ReduceScatter": (grid, lambda P: F.reduce_scatter(x, P, axes_reduce_scatter=(0,))),
             "Broadcast": (root, lambda P: F.broadcast(x if P.active else x[:0], P, P_world)),
             "SumReduce": (root, lambda P: F.sum_reduce(x, P_world, P)),
             "Repartition": (root, lambda P: F.repartition(x if P.active else x[:0], P, P_world))}
    for name, (partition, call) in calls.items():
        P = partition()
        y = call(P)
        P.free()
        with pytest.raises(ValueError, match=rf"^{name} \(backward\): the partition of shape .* was freed"):
            y.sum().backward()
    P = P_world.create_cartesian_topology_partition((comm.size,))
    wrapped = DataParallel(torch.nn.Linear(3, 2), P)
    wrapped(torch.rand(2, 3)).sum().backward()
    P.free()
    with pytest.raises(ValueError, match=r"^DataParallel: the partition of shape .* was freed"):
        wrapped(torch.rand(2, 3))
