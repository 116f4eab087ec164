"""clip_grad_norm_: the sequential model's gradient norm and clipping, for partitioned and replicated parameters."""

import copy
import math

import pytest
import torch

from distdl.nn import (DataParallel, DistributedBatchNorm, DistributedChannelConv1d, DistributedFeatureConv1d,
                       DistributedLinear, DistributedLinearAllGather, DistributedMSELoss, clip_grad_norm_)
from distdl.functional import all_gather
from distdl.testing import random_tensor, scatter
from helpers import sizes


@sizes(1, 2, 3)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_matches_the_sequential_model(P_world, comm, norm_type):
    """A spatial convolution and batch norm (replicated parameters), a tensor-parallel linear (row blocks) and a
    plain torch linear on every worker: the norm is the sequential model's on every worker, and the clipped step
    keeps the replicas equal and equals torch's (a local clip_grad_norm_ gave each worker its own norm)."""
    P_s = P_world.create_cartesian_topology_partition([1, 1, comm.size])
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    torch.manual_seed(3)
    model = torch.nn.ModuleList([DistributedFeatureConv1d(P_s, 2, 3, 3, padding=1, collect_state=True),
                                 DistributedBatchNorm(P_s, 3, collect_state=True),
                                 DistributedLinearAllGather(P_f, 4, 5, collect_state=True), torch.nn.Linear(4, 2)])
    model.double()
    sequential = torch.nn.ModuleList([torch.nn.Conv1d(2, 3, 3, padding=1), torch.nn.BatchNorm1d(3),
                                      torch.nn.Linear(4, 5), torch.nn.Linear(4, 2)]).double()
    sequential.load_state_dict(comm.bcast(model.state_dict(), root=0))  # rank 0's collected state, everywhere
    x, t = random_tensor((2, 2, 7), seed=1), random_tensor((2, 3, 7), seed=2)
    z, u = random_tensor((3, 4), seed=3), random_tensor((3, 5), seed=4)

    def loss(layers, split):
        conv, norm, linear, plain = layers
        mse = DistributedMSELoss(P_s) if split else torch.nn.MSELoss()
        mse_f = DistributedMSELoss(P_f) if split else torch.nn.MSELoss()
        return (mse(norm(conv(scatter(x, P_s) if split else x)), scatter(t, P_s) if split else t)
                + mse_f(linear(scatter(z, P_f) if split else z), scatter(u, P_f) if split else u)
                + plain(z).square().mean())

    loss(model, True).backward()
    loss(sequential, False).backward()
    norm = clip_grad_norm_(model, 0.1, P_world, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(sequential.parameters(), 0.1, norm_type)
    torch.testing.assert_close(norm, expected.to(norm.dtype), rtol=1e-12, atol=0)
    assert norm > 0.1  # clipped
    for module in (model, sequential):
        torch.optim.SGD(module.parameters(), lr=1.0).step()
    state = model.state_dict()
    if comm.rank == 0:  # the collected state of the distributed model
        for key, value in sequential.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12, msg=key)
    replicated = torch.cat([p.detach().flatten() for p in (*model[0].parameters(), *model[1].parameters(),
                                                           *model[3].parameters())])
    assert all(torch.equal(replicated, r) for r in comm.allgather(replicated))  # replicas equal on every worker


@sizes(2, 3)
@pytest.mark.parametrize("kind", ["linear", "channel conv"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_a_bias_held_by_a_column_of_later_ranks(P_world, comm, kind, norm_type):
    """DistributedLinear and the channel convolutions hold the bias on column 0 of P_w only. With P_w's workers in
    reverse order, column 0 is the last world rank: the bias was counted on the first member of its row, which does
    not hold it, so the norm left it out on every worker. foreach=False scales alike."""
    P_w = P_world.create_partition_inclusive(range(comm.size)[::-1])
    P_y = P_world.create_partition_inclusive([0])
    if kind == "linear":
        P_w = P_w.create_cartesian_topology_partition([1, comm.size])
        P_y = P_y.create_cartesian_topology_partition([1, 1])
        layer, sequential, x = DistributedLinear(P_w, P_y, P_w, 6, 3, collect_state=True), torch.nn.Linear(6, 3), (4, 6)
    else:
        P_w = P_w.create_cartesian_topology_partition([1, comm.size, 1])
        P_y = P_y.create_cartesian_topology_partition([1, 1, 1])
        layer = DistributedChannelConv1d(P_w, P_y, P_w, 6, 3, 3, collect_state=True)
        sequential, x = torch.nn.Conv1d(6, 3, 3), (2, 6, 7)
    layer.double(), sequential.double()
    sequential.load_state_dict(comm.bcast(layer.state_dict(), root=0))
    x = random_tensor(x, seed=1)
    y = layer(scatter(x, P_w))
    (y * random_tensor(y.shape, seed=2 + comm.rank)).sum().backward()
    z = sequential(x)
    (z * random_tensor(z.shape, seed=2)).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(sequential.parameters(), 0.1, norm_type)
    norm = clip_grad_norm_(layer, 0.1, P_world, norm_type, foreach=False)
    torch.testing.assert_close(norm, expected.to(norm.dtype), rtol=1e-12, atol=0)
    torch.testing.assert_close(layer.weight.grad, scatter(sequential.weight.grad, P_w), rtol=1e-12, atol=1e-12)
    assert (layer.bias is not None) == (comm.rank == comm.size - 1)
    if layer.bias is not None:
        torch.testing.assert_close(layer.bias.grad, sequential.bias.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="clip_grad_norm_: expected None or a bool for foreach, got 1"):
        clip_grad_norm_(layer, 0.1, P_world, norm_type, foreach=1)


@sizes(2, 3)
@pytest.mark.parametrize("foreach", [None, False])
def test_workers_without_gradients(P_world, comm, foreach):
    """P_w on the last rank only: the other workers hold no weight block (and no gradient). They return the norm
    too (the multi-tensor scale raised 'Tensor list must have at least one tensor' on them when clipping)."""
    last = comm.size - 1
    P_x = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    P_w = P_world.create_partition_inclusive([last]).create_cartesian_topology_partition([1, 1])
    layer = DistributedLinear(P_x, P_w, P_w, 3, 2, collect_state=True).double()
    sequential = torch.nn.Linear(3, 2).double()
    sequential.load_state_dict(comm.bcast(layer.state_dict(), root=0))
    x = random_tensor((4, 3), seed=1)
    layer(scatter(x, P_x)).square().sum().backward()
    sequential(x).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(sequential.parameters(), 0.01, foreach=foreach)
    norm = clip_grad_norm_(layer, 0.01, P_world, foreach=foreach)
    torch.testing.assert_close(norm, expected.to(norm.dtype), rtol=1e-12, atol=0)
    assert norm > 0.01  # clipped
    assert (layer.weight.grad is not None) == (comm.rank == last)
    if comm.rank == last:
        for mine, theirs in [(layer.weight, sequential.weight), (layer.bias, sequential.bias)]:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12)


@sizes(2, 3)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_torch_modules_held_by_some_workers(P_world, comm, norm_type):
    """A tensor-parallel linear on every worker, a torch head that only the last worker holds (a pipeline's last
    stage) and one that only worker 0 holds: each head counts once, where it is held (the last one was counted on
    rank 0 of P only, so it was left out of the norm and its gradient was not clipped, silently). Heads of one name
    but different shapes raise on every worker."""
    last = comm.size - 1
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    torch.manual_seed(5)
    shared = DistributedLinearAllGather(P_f, 4, 5, collect_state=True).double()
    heads = {"first": torch.nn.Linear(5, 2).double(), "last": torch.nn.Linear(5, 3).double()}
    heads = comm.bcast(heads, root=0)  # the same initial values everywhere
    mine = {name: heads[name] for name, rank in [("first", 0), ("last", last)] if comm.rank == rank}
    model = torch.nn.ModuleDict({"shared": shared, **mine})
    sequential = torch.nn.ModuleDict({"shared": torch.nn.Linear(4, 5), **copy.deepcopy(heads)}).double()
    sequential["shared"].load_state_dict(comm.bcast(shared.state_dict(), root=0))
    z = random_tensor((3, 4), seed=3)

    def loss(layers, split):  # the workers' losses add up to the sequential one
        h = layers["shared"](scatter(z, P_f) if split else z)
        h = all_gather(h, P_f, axes_all_gather=(1,)) if split else h
        terms = [layers[name](h).square().sum() for name in heads if name in layers]
        return sum(terms, h.square().sum() * (comm.rank == 0 or not split))  # in the graph on every worker
    loss(model, True).backward()
    loss(sequential, False).backward()
    expected = torch.nn.utils.clip_grad_norm_(sequential.parameters(), 0.1, norm_type)
    norm = clip_grad_norm_(model, 0.1, P_world, norm_type)
    torch.testing.assert_close(norm, expected.to(norm.dtype), rtol=1e-12, atol=0)
    for name in mine:
        for a, b in zip(model[name].parameters(), sequential[name].parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)  # clipped alike
    other = torch.nn.Linear(5, 2 + (comm.rank == last))
    other(torch.ones(5)).sum().backward()
    with pytest.raises(ValueError, match=rf"clip_grad_norm_: expected the parameter head.weight of a torch module .* "
                                         rf"of one shape, got \(2, 5\) on rank 0 of P and \(3, 5\) on rank {last}"):
        clip_grad_norm_(torch.nn.ModuleDict({"head": other}), 0.1, P_world, norm_type)


@sizes(1, 2, 3)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("where", ["block", "copy"])
def test_a_nan_gradient_gives_a_nan_norm(P_world, comm, norm_type, where):
    """A NaN in one worker's block of a gradient (not the first it counts), or in the last worker's copy of a torch
    module's: the norm is NaN on every worker and every gradient becomes NaN, as with torch's clip_grad_norm_;
    error_if_nonfinite raises on every worker. (The inf-norm took Python's max, which drops a NaN after a number, a
    NaN norm left the gradients unscaled, and a copy other than rank 0's was not looked at.)"""
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    model = torch.nn.ModuleList([DistributedLinearAllGather(P_f, 4, 5), DistributedLinearAllGather(P_f, 4, 5),
                                 torch.nn.Linear(3, 2)])
    for k, p in enumerate(model.parameters()):
        p.grad = random_tensor(p.shape, seed=10 * comm.rank + k, dtype=torch.float32)
    if comm.rank == comm.size - 1:
        model[1 if where == "block" else 2].weight.grad[-1, -1] = math.nan
    sequential = torch.nn.Linear(4, 5)
    sequential.weight.grad = torch.rand(5, 4)
    sequential.weight.grad[-1, -1] = math.nan
    expected = torch.nn.utils.clip_grad_norm_(sequential.parameters(), 1.0, norm_type)
    assert math.isnan(expected) and sequential.weight.grad.isnan().all()  # torch's behaviour
    norm = clip_grad_norm_(model, 1.0, P_world, norm_type)
    assert math.isnan(norm)
    assert all(p.grad.isnan().all() for p in model.parameters())
    with pytest.raises(RuntimeError, match=f"clip_grad_norm_: the total norm of order {norm_type} of the gradients "
                                           "is non-finite"):
        clip_grad_norm_(model, 1.0, P_world, norm_type, error_if_nonfinite=True)


@sizes(2, 3)
def test_clip_with_a_batch_norm_over_the_replicas(P_world, comm):
    """Data parallelism with a batch norm over the batch it splits (SyncBatchNorm in DDP): one replica is one worker,
    and each replica counts the norm's parameters (only the norm's rank 0 did: the replicas clipped by different
    factors and drifted apart)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    P_replica = P_x.create_subpartition([1])  # this worker alone
    x = random_tensor((7, 4), seed=5)
    blocks = [slice(r * 7 // comm.size, (r + 1) * 7 // comm.size) for r in range(comm.size)]

    def model(norm):
        torch.manual_seed(6)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), norm, torch.nn.Linear(3, 2)).double()
    sequential = model(torch.nn.BatchNorm1d(3))
    sum(sequential(x)[rows].square().sum() for rows in blocks).backward()
    expected = torch.nn.utils.clip_grad_norm_(sequential.parameters(), 0.1)
    replica = DataParallel(model(DistributedBatchNorm(P_x, 3)), P_world, op="sum")
    replica(x[blocks[comm.rank]]).square().sum().backward()
    norm = clip_grad_norm_(replica.module, 0.1, P_replica)
    torch.testing.assert_close(norm, expected.to(norm.dtype), rtol=1e-12, atol=0)
    for p, q in zip(replica.module.parameters(), sequential.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


@sizes(2)
def test_parametrized_layers_are_refused(P_world, comm):
    """torch.nn.utils.parametrize moves a layer's weight under new names, whose blocks were taken for replicated
    copies: the norm left out the other workers' blocks, and a collected state dict held rank 0's block under the
    global names. Both raise on every worker instead."""
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = DistributedLinearAllGather(P_f, 4, 6, collect_state=True).double()
    torch.nn.utils.parametrizations.weight_norm(layer, dim=0)
    layer(random_tensor((3, 2), seed=comm.rank)).sum().backward()
    expected = r"expected no torch.nn.utils.parametrize parametrization .* got one on ParametrizedDistributedLinear"
    with pytest.raises(ValueError, match="clip_grad_norm_: " + expected):
        clip_grad_norm_(layer, 1.0, P_world)
    with pytest.raises(ValueError, match="state_dict: " + expected):
        layer.state_dict()
    with pytest.raises(ValueError, match="load_state_dict: " + expected):
        layer.load_state_dict({})


def _assert_clipped_step_and_state(layer, sequential, P_world, P_f, comm, z, original):
    """After a backward through both: the norm, the clipped step and the collected state dict are torch's, and a
    checkpoint the layer does not hold yet (``original`` scaled) loads as blocks."""
    norm = clip_grad_norm_(layer, 0.01, P_world)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(sequential.parameters(), 0.01), rtol=1e-12,
                               atol=0)
    for module in (layer, sequential):
        torch.optim.SGD(module.parameters(), lr=1.0).step()
    state = layer.state_dict()
    assert sorted(state) == (sorted(sequential.state_dict()) if comm.rank == 0 else [])
    if comm.rank == 0:
        for key, value in sequential.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12, msg=key)
    getattr(sequential, original).data.mul_(3)
    layer.load_state_dict(sequential.state_dict() if comm.rank == 0 else {})
    torch.testing.assert_close(layer(scatter(z, P_f)), scatter(sequential(z), P_f), rtol=1e-12, atol=1e-12)


@sizes(1, 2, 3)
def test_pruned_layers(P_world, comm):
    """torch.nn.utils.prune keeps a pruned weight as weight_orig (a parameter) and weight_mask (a buffer): both are
    laid out as the weight. They were taken for replicated copies: the norm left out the other workers' blocks and
    a collected state dict held rank 0's blocks under the global names."""
    from torch.nn.utils import prune
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = DistributedLinearAllGather(P_f, 4, 6, collect_state=True).double()
    sequential = torch.nn.Linear(4, 6).double()
    sequential.load_state_dict(comm.bcast(layer.state_dict(), root=0))
    mask = (random_tensor((6, 4), seed=5) > 0).double()  # the sequential model's mask; each worker takes its rows
    prune.custom_from_mask(sequential, "weight", mask)
    prune.custom_from_mask(layer, "weight", scatter(mask.T, P_f).T)
    z, u = random_tensor((3, 4), seed=3), random_tensor((3, 6), seed=4)
    DistributedMSELoss(P_f)(layer(scatter(z, P_f)), scatter(u, P_f)).backward()
    torch.nn.MSELoss()(sequential(z), u).backward()
    _assert_clipped_step_and_state(layer, sequential, P_world, P_f, comm, z, "weight_orig")


@sizes(1, 2, 3)
@pytest.mark.parametrize("dim", [0, -2, None])
def test_hook_based_weight_norm(P_world, comm, dim):
    """torch.nn.utils.weight_norm (the hook-based form) keeps a weight as weight_g and weight_v, which were taken
    for replicated copies: the norm left out the other workers' blocks, a collected state dict held rank 0's
    blocks under the global names, and check mode named the blocks as copies that differ. weight_v is laid out as
    the weight, weight_g along dim (a scalar for the whole tensor's norm, which only one block equals)."""
    import distdl
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = DistributedLinearAllGather(P_f, 4, 6, collect_state=True).double()
    sequential = torch.nn.Linear(4, 6).double()
    sequential.load_state_dict(comm.bcast(layer.state_dict(), root=0))
    for module in (layer, sequential):
        torch.nn.utils.weight_norm(module, dim=dim)
    z, u = random_tensor((3, 4), seed=3), random_tensor((3, 6), seed=4)
    with distdl.checking():
        if dim is None and comm.size > 1:  # each block's own norm, in copies of a scalar that differ
            with pytest.raises(distdl.CollectiveMismatchError, match="weight_g"):
                layer(scatter(z, P_f))
            return
        DistributedMSELoss(P_f)(layer(scatter(z, P_f)), scatter(u, P_f)).backward()
    torch.nn.MSELoss()(sequential(z), u).backward()
    _assert_clipped_step_and_state(layer, sequential, P_world, P_f, comm, z, "weight_g")


@sizes(2)
def test_hook_based_spectral_norm_of_a_split_weight_is_refused(P_world, comm):
    """torch.nn.utils.spectral_norm (hook-based) on a split weight keeps its power iteration's vectors per block
    (weight_u, weight_v buffers): neither a norm nor a collected state dict can be the sequential layer's."""
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    layer = torch.nn.utils.spectral_norm(DistributedLinearAllGather(P_f, 4, 6, collect_state=True).double())
    layer(random_tensor((3, 2), seed=comm.rank)).sum().backward()
    expected = "expected no torch.nn.utils.spectral_norm on a tensor a distdl layer splits, got one on weight of "
    with pytest.raises(ValueError, match="clip_grad_norm_: " + expected):
        clip_grad_norm_(layer, 1.0, P_world)
    with pytest.raises(ValueError, match="state_dict: " + expected):
        layer.state_dict()
