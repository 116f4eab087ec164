"""The same computation at the same rank count gives bitwise-identical results, run after run."""

import torch

from distdl.nn import DistributedBatchNorm, DistributedFeatureConv1d, DistributedMSELoss
from distdl.testing import random_tensor, scatter
from helpers import sizes


def _train(P_x, steps=3):
    torch.manual_seed(5)
    conv = DistributedFeatureConv1d(P_x, 2, 3, kernel_size=3, padding=1).double()
    norm = DistributedBatchNorm(P_x, 3).double()
    loss_fn = DistributedMSELoss(P_x)
    optimizer = torch.optim.SGD(list(conv.parameters()) + list(norm.parameters()), lr=0.1)
    x = scatter(random_tensor((4, 2, 11), seed=1), P_x)
    target = scatter(random_tensor((4, 3, 11), seed=2), P_x)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(norm(conv(x)), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses), [p.detach().clone() for p in conv.parameters()]


@sizes(1, 3, 4)
def test_bitwise_identical_runs(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([1, 1, comm.size])
    first_losses, first_params = _train(P_x)
    second_losses, second_params = _train(P_x)
    assert torch.equal(first_losses, second_losses)
    assert all(torch.equal(a, b) for a, b in zip(first_params, second_params))


@sizes(1, 2, 3)
def test_reset_parameters_draws_as_construction(P_world, comm):
    """Every layer with parameters has torch's reset_parameters(), so model.apply(reset) re-initialises a whole model
    (it skipped the linear, embedding and normalisation layers): from the same seed, the construction's values."""
    from distdl.nn import (DistributedEmbedding, DistributedLayerNorm, DistributedLinear, DistributedLinearAllGather,
                           DistributedLinearReduceScatter)
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    P_y = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    P_b = P_world.create_cartesian_topology_partition([comm.size, 1])
    makers = [lambda: DistributedLinear(P_f, P_y, P_f, 5, 4), lambda: DistributedLinearAllGather(P_f, 5, 7),
              lambda: DistributedLinearReduceScatter(P_f, 7, 5), lambda: DistributedEmbedding(P_f, 6, 5, padding_idx=2),
              lambda: DistributedLayerNorm(P_f, 5), lambda: DistributedBatchNorm(P_b, 5)]
    for make in makers:
        torch.manual_seed(11)
        layer = make()
        built = [t.clone() for t in layer.state_dict().values()]
        with torch.no_grad():
            for t in layer.state_dict().values():
                t.add_(random_tensor(t.shape, seed=comm.rank).to(t.dtype) if t.is_floating_point() else 1)
        torch.manual_seed(11)
        layer.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        for before, after in zip(built, layer.state_dict().values()):
            assert torch.equal(before, after), type(layer).__name__
