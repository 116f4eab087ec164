"""torch's init functions run on every worker, those outside a layer's partition too (`model.apply(init)`)."""

import warnings

import torch

import distdl.nn as dnn
from helpers import sizes

INITS = (torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_, torch.nn.init.kaiming_uniform_,
         torch.nn.init.kaiming_normal_, torch.nn.init.orthogonal_)


@sizes(2, 3)
def test_fan_based_inits_work_outside_the_layers_partitions(P_world, comm):
    """Outside its partitions a weight is empty but has a fan (xavier_* divided by zero on (0, 0) weights)."""
    n = comm.size
    first = P_world.create_partition_inclusive(range(n - 1))  # the last worker is in none of the partitions
    P_row = first.create_cartesian_topology_partition((1, n - 1))
    P_one = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    P_image = first.create_cartesian_topology_partition((1, n - 1, 1, 1))
    P_one_image = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1, 1, 1))
    model = torch.nn.ModuleList([
        dnn.DistributedLinear(P_row, P_one, P_one.create_cartesian_topology_partition((1, 1)) if n == 2
                              else P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition(
                                  (1, 2)), 12, 16),
        dnn.DistributedLinearAllGather(P_row, 12, 16), dnn.DistributedLinearReduceScatter(P_row, 12, 16),
        dnn.DistributedEmbedding(P_row, 10, 6),
        dnn.DistributedChannelConv2d(P_image, P_one_image, P_image.create_cartesian_topology_partition(
            (1, n - 1, 1, 1)), 4, 6, 3)])
    for layer in model:
        weight = layer.weight
        assert weight.dim() >= 2 and weight.shape[1] > 0, (type(layer).__name__, tuple(weight.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: initialising an empty tensor is a no-op
        for init in INITS:
            model.apply(lambda m: init(m.weight) if getattr(m, "weight", None) is not None and m.weight.dim() >= 2
                        else None)
