"""Data-parallel gradient synchronisation: full-batch equivalence, fibres, buckets, hooks, errors.

Every test runs four times: with the default ``IN_PLACE_BYTES`` (these small gradients go through flat buckets)
and with it at 0 (every gradient is reduced on its own, in place where its layout allows); each with MPI's
``Iallreduce`` (these sums are below ``PAIRWISE_SUM_BYTES``) and with the pairwise sum (the threshold lowered).
"""

import builtins
import collections
import contextlib
import copy
import gc
import weakref

import numpy as np
import pytest
import torch

from distdl import MPIPartition
from distdl.backends import mpi as transport
from distdl.nn import data_parallel
from distdl.nn.all_sum_reduce import AllSumReduce
from distdl.nn.batchnorm import DistributedBatchNorm
from distdl.nn.embedding import DistributedEmbedding
from distdl.nn.linear_all_gather import DistributedLinearAllGather
from distdl.nn.loss import DistributedMSELoss
from distdl.nn.data_parallel import DataParallel, all_reduce_gradients
from distdl.testing import random_tensor, scatter
from helpers import sizes

TINY_CAP = 1e-5  # megabytes: every parameter gets its own bucket


@pytest.fixture(autouse=True, params=["bucketed", "in place"])
def in_place(request, monkeypatch):
    if request.param == "in place":
        monkeypatch.setattr(data_parallel, "IN_PLACE_BYTES", 0)
    return request.param == "in place"


@pytest.fixture(autouse=True, params=["MPI sum", "pairwise sum"])
def pairwise(request, monkeypatch):
    if request.param == "pairwise sum":  # from 8 B: rows of one element, a tail at 3 and 4 ranks
        monkeypatch.setattr(transport, "PAIRWISE_SUM_BYTES", 8)


def _mlp(seed, dtype=torch.float64):
    """A small MLP whose weights are drawn from ``seed``."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                torch.nn.Linear(5, 3)).to(dtype)
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.copy_(random_tensor(p.shape, seed=1000 * seed + k))
    return model


def _batch(n, seed):
    return random_tensor((n, 4), seed=seed), random_tensor((n, 3), seed=seed + 1)


def _rows(n, parts, part):
    """The balanced block ``part`` of ``n`` rows split ``parts`` ways."""
    start = part * (n // parts) + min(part, n % parts)
    return slice(start, start + n // parts + (part < n % parts))


def _grads(model, x, y, mean=False):
    """Return the gradients of the summed (or mean) squared error of ``model`` on ``(x, y)``."""
    model.zero_grad(set_to_none=True)
    loss = ((model(x) - y) ** 2).sum(dim=1)
    (loss.mean() if mean else loss.sum()).backward()
    return [p.grad.clone() for p in model.parameters()]


def _step(model, x, y, mean=False):
    model.zero_grad(set_to_none=True)
    loss = ((model(x) - y) ** 2).sum(dim=1)
    (loss.mean() if mean else loss.sum()).backward()


def _assert_grads(model, expected, exact=False):
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-12, atol=1e-12)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, **tol)


@sizes(1, 2, 3, 4)
def test_sum_equals_full_batch(P_world, comm, in_place):
    n = 7  # uneven at 3 and 4 ranks
    x, y = _batch(n, seed=3)
    expected = _grads(_mlp(0), x, y)
    rows = _rows(n, comm.size, comm.rank)
    for cap in (TINY_CAP, 25):
        model = _mlp(0)
        _step(model, x[rows], y[rows])
        grads = [p.grad for p in model.parameters()]
        all_reduce_gradients(model, P_world, op="sum", bucket_cap_mb=cap)
        _assert_grads(model, expected)
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # the same tensors, overwritten
        reference = [p.grad.clone() for p in model.parameters()]
        # DataParallel: the same buckets, reduced during backward; bit-identical, and again on a second step.
        wrapped = DataParallel(_mlp(0), P_world, bucket_cap_mb=cap, op="sum")
        apart = cap == TINY_CAP or in_place  # a bucket per parameter
        assert len(wrapped._buckets) == (6 if apart else 1)
        assert [b.solo for b in wrapped._buckets] == [in_place] * len(wrapped._buckets)
        for _ in range(2):
            _step(wrapped, x[rows], y[rows])
            _assert_grads(wrapped, reference, exact=True)
        if comm.size > 1:  # reductions start during backward, before it reaches the input
            started = []
            x_local = x[rows].clone().requires_grad_()
            x_local.register_hook(lambda grad: started.append(wrapped._next))
            _step(wrapped, x_local, y[rows])
            assert started[0] >= (4 if apart else 0)
            _assert_grads(wrapped, reference, exact=True)


@sizes(2, 3)
def test_post_accumulate_grad_hooks_run_before_the_sum(P_world, comm):
    """A parameter's post-accumulate-grad hooks, registered before or after wrapping, change its local gradient before
    DataParallel sums it (as with torch's DDP): the full batch's gradients, scaled as the hooks scale them."""
    def scale(factor):
        def hook(p):
            p.grad.mul_(factor)
        return hook

    def hooked(model, wrap=None):
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(scale(2))
        wrapped = wrap(model) if wrap else model
        for k, p in enumerate(model.parameters()):
            p.register_post_accumulate_grad_hook(scale(k + 3))
        return wrapped
    n = 7
    x, y = _batch(n, seed=3)
    expected = _grads(hooked(_mlp(0)), x, y)
    rows = _rows(n, comm.size, comm.rank)
    for cap in (TINY_CAP, 25):
        wrapped = hooked(_mlp(0), lambda model: DataParallel(model, P_world, bucket_cap_mb=cap, op="sum"))
        for _ in range(2):
            _step(wrapped, x[rows], y[rows])
            _assert_grads(wrapped, expected)


@sizes(2, 3)
def test_a_dtype_round_trip_after_wrapping(P_world, comm):
    """Parameters set to another dtype and back (on every member, or on one: evaluating in float64 through
    ``wrapper.module``) get new gradient accumulators while the layout stays as it was: DataParallel still reduces
    their gradients, after the parameters' post-accumulate-grad hooks registered after wrapping (it hooked the old
    accumulators; it moves to the new ones as they run)."""
    def double(p):
        p.grad.mul_(2)
    n = 7
    x, y = (t.float() for t in _batch(n, seed=3))
    expected = [2 * g for g in _grads(_mlp(0, torch.float32), x, y)]
    rows = _rows(n, comm.size, comm.rank)
    for who in ("every member", "rank 0"):
        model = _mlp(0, torch.float32)
        wrapped = DataParallel(model, P_world, op="sum")
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(double)
        for step in range(3):
            if who == "every member" or comm.rank == 0:
                model.double()
                model.float()
            _step(wrapped, x[rows], y[rows])
            for p, g in zip(model.parameters(), expected):
                torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


@sizes(2, 4)
def test_avg_equals_full_batch_mean(P_world, comm):
    local = 3
    x, y = _batch(local * comm.size, seed=5)
    expected = _grads(_mlp(1), x, y, mean=True)
    rows = slice(local * comm.rank, local * (comm.rank + 1))
    model = _mlp(1)
    _step(model, x[rows], y[rows], mean=True)
    all_reduce_gradients(model, P_world)  # op="avg" by default
    _assert_grads(model, expected)
    wrapped = DataParallel(_mlp(1), P_world, bucket_cap_mb=TINY_CAP)
    _step(wrapped, x[rows], y[rows], mean=True)
    _assert_grads(wrapped, expected)


@sizes(1, 2, 3, 4)
def test_a_distdl_loss_takes_op_sum(P_world, comm):
    """distdl's losses are the whole batch's on every member: op="sum" gives the sequential gradient (uneven
    shards too), op="avg" that divided by P.size."""
    n = 7  # uneven at 2, 3 and 4 ranks
    x, y = _batch(n, seed=7)
    model = _mlp(2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad for p in model.parameters()]
    P_out = P_world.create_cartesian_topology_partition((comm.size, 1))
    loss = DistributedMSELoss(P_out)
    rows = _rows(n, comm.size, comm.rank)
    for op, scale in (("sum", 1), ("avg", comm.size)):
        wrapped = DataParallel(_mlp(2), P_world, op=op)
        loss(wrapped(x[rows]), y[rows]).backward()
        _assert_grads(wrapped, [g / scale for g in expected])


@sizes(4)
def test_fibres_of_a_grid(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition([2, 2])
    P_dp = P_x.create_subpartition([0])  # workers sharing index[1]
    batches = {index: _batch(2 + index[0] + 2 * index[1], seed=10 * index[0] + index[1]) for index in np.ndindex(2, 2)}
    fibre = [batches[(i, P_x.index[1])] for i in range(2)]
    expected = _grads(_mlp(2), torch.cat([b[0] for b in fibre]), torch.cat([b[1] for b in fibre]))
    for sync in ("function", "module"):
        model = _mlp(2) if sync == "function" else DataParallel(_mlp(2), P_dp, bucket_cap_mb=TINY_CAP, op="sum")
        _step(model, *batches[P_x.index])
        if sync == "function":
            all_reduce_gradients(model, P_dp, op="sum")
        _assert_grads(model, expected)
    # Two axes of a three-dimensional grid, flattened into one reduction over all four workers.
    P_3 = P_world.create_cartesian_topology_partition([1, 2, 2])
    P_two_axes = P_3.create_subpartition([1, 2])
    model = _mlp(2)
    _step(model, *batches[P_3.index[1:]])
    all_reduce_gradients(model, P_two_axes, op="sum", bucket_cap_mb=TINY_CAP)
    everything = [batches[i] for i in sorted(batches)]
    _assert_grads(model, _grads(_mlp(2), torch.cat([b[0] for b in everything]), torch.cat([b[1] for b in everything])))


@sizes(4)
def test_hybrid_model_and_data_parallel(P_world, comm):
    # Input features split over axis 1 (model parallel: a distdl sum joins the partial products),
    # the batch over axis 0 (data parallel: each weight shard is synchronised along axis 0).
    P_x = P_world.create_cartesian_topology_partition([2, 2])
    i, j = P_x.index
    x, y = _batch(5, seed=60)
    weight = random_tensor((3, 4), seed=61)
    reference = torch.nn.Linear(4, 3, bias=False).double()
    with torch.no_grad():
        reference.weight.copy_(weight)
    expected = _grads(reference, x, y)[0][:, 2 * j:2 * j + 2]
    for sync in ("function", "module"):
        shard = torch.nn.Linear(2, 3, bias=False).double()
        with torch.no_grad():
            shard.weight.copy_(weight[:, 2 * j:2 * j + 2])
        model = torch.nn.Sequential(shard, AllSumReduce(P_x, axes_reduce=[1]))
        P_dp = P_x.create_subpartition([0])
        if sync == "module":
            model = DataParallel(model, P_dp, op="sum")
        rows = _rows(5, 2, i)
        out = model(x[rows, 2 * j:2 * j + 2])
        (((out - y[rows]) ** 2).sum() * (j == 0)).backward()  # the loss is counted once per row
        if sync == "function":
            all_reduce_gradients(model, P_dp, op="sum")
        torch.testing.assert_close(shard.weight.grad, expected)


def _norm_model(norm):
    """Linear, ``norm``, Linear (float64, weights drawn from fixed seeds)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), norm, torch.nn.Linear(3, 2)).double()
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.copy_(random_tensor(p.shape, seed=700 + k))
    return model


@sizes(2, 3)
def test_a_batch_norm_over_the_replicas(P_world, comm):
    """A DistributedBatchNorm over the batch that P splits (torch's SyncBatchNorm inside DDP) sums its parameters'
    gradients over P itself: they are not summed again (they came out P.size times too large), and with op="avg"
    they are divided as the buckets are; also when accumulated in no_sync()."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x = random_tensor((7, 4), seed=71)
    blocks = [_rows(7, comm.size, r) for r in range(comm.size)]
    for op in ("sum", "avg"):
        reference = _norm_model(torch.nn.BatchNorm1d(3))
        total = sum(reference(x)[rows].pow(2).sum() for rows in blocks)  # each member's loss on its rows
        (total / (comm.size if op == "avg" else 1)).backward()
        expected = [p.grad for p in reference.parameters()]
        for sync in ("function", "module", "no_sync", "another root"):
            model, mine = _norm_model(DistributedBatchNorm(P_x, 3)), x[blocks[comm.rank]]
            if sync == "another root":  # P made from another communicator (ranks reversed) than the norm's partition
                other = comm.Split(0, comm.size - 1 - comm.rank)
                wrapped = DataParallel(model, MPIPartition(other), op=op)
                wrapped(mine).pow(2).sum().backward()
                del wrapped
                other.Free()
            elif sync == "function":
                model(mine).pow(2).sum().backward()
                all_reduce_gradients(model, P_world, op=op)
            elif sync == "module":
                wrapped = DataParallel(model, P_world, op=op)
                wrapped(mine).pow(2).sum().backward()
                assert sum(len(b.params) for b in wrapped._buckets) == 4  # the linear layers' only
            else:  # the loss in two halves, the first accumulated locally
                wrapped = DataParallel(model, P_world, op=op)
                with wrapped.no_sync():
                    (wrapped(mine).pow(2).sum() / 2).backward()
                (wrapped(mine).pow(2).sum() / 2).backward()
            _assert_grads(model, expected)


@sizes(2, 3)
@pytest.mark.parametrize("kind", ["register_parametrization", "weight_norm"])
def test_a_parametrized_batch_norm_over_the_replicas(P_world, comm, kind):
    """torch.nn.utils.parametrize moves the norm's weight into norm.parametrizations.weight (original): its
    gradient, summed over P by the norm, was taken for a replica's own and summed again (P.size times torch's)."""
    class Twice(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    def parametrized(model):
        if kind == "weight_norm":
            torch.nn.utils.parametrizations.weight_norm(model[1], dim=0)
        else:
            torch.nn.utils.parametrize.register_parametrization(model[1], "weight", Twice())
        return model
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x = random_tensor((7, 4), seed=71)
    blocks = [_rows(7, comm.size, r) for r in range(comm.size)]
    for op in ("sum", "avg"):
        reference = parametrized(_norm_model(torch.nn.BatchNorm1d(3)))
        total = sum(reference(x)[rows].pow(2).sum() for rows in blocks)  # each member's loss on its rows
        (total / (comm.size if op == "avg" else 1)).backward()
        expected = [p.grad for p in reference.parameters()]
        for sync in ("function", "module"):
            model, mine = parametrized(_norm_model(DistributedBatchNorm(P_x, 3))), x[blocks[comm.rank]]
            if sync == "function":
                model(mine).pow(2).sum().backward()
                all_reduce_gradients(model, P_world, op=op)
            else:
                wrapped = DataParallel(model, P_world, op=op)  # kept: dropping it removes its hooks
                wrapped(mine).pow(2).sum().backward()
            _assert_grads(model, expected)


@sizes(4)
def test_a_batch_norm_over_more_than_the_replicas(P_world, comm):
    """Batch and length split over a 2 x 2 grid, a batch norm over all four workers, data parallelism over the
    batch fibre: the norm's gradients are summed over all four by the norm, and not again over the fibre. A norm
    over a pair of workers that is neither one member of P nor all of them is refused on every member."""
    P_x = P_world.create_cartesian_topology_partition((2, 1, 2))
    P_dp = P_x.create_subpartition([0])
    x = random_tensor((5, 3, 6), seed=73)
    reference = torch.nn.BatchNorm1d(3).double()
    with torch.no_grad():
        reference.weight.copy_(random_tensor((3,), seed=74))
    (reference(x) ** 2).sum().backward()
    for op in ("sum", "avg"):
        norm = DistributedBatchNorm(P_x, 3).double()
        with torch.no_grad():
            norm.weight.copy_(random_tensor((3,), seed=74))
        wrapped = DataParallel(norm, P_dp, op=op)
        assert wrapped._buckets == []
        (wrapped(scatter(x, P_x)) ** 2).sum().backward()
        for p, q in zip(norm.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad / (2 if op == "avg" else 1), rtol=1e-12, atol=1e-12)
    pair = P_world.create_partition_inclusive([0, 1] if comm.rank < 2 else [2, 3])
    halves = pair.create_cartesian_topology_partition((2, 1))
    for sync in ("function", "module"):
        model = _norm_model(DistributedBatchNorm(halves, 3))
        with pytest.raises(ValueError, match=r"on P rank 0, 1.weight \(DistributedBatchNorm\) is summed by its "
                                             r"layer over some members of P but not all"):
            if sync == "function":
                all_reduce_gradients(model, P_world)
            else:
                DataParallel(model, P_world)
        model[1].requires_grad_(False)  # frozen: not reduced, so where its copies lie does not matter
        if sync == "function":
            all_reduce_gradients(model, P_world)
        else:
            DataParallel(model, P_world)


@sizes(2, 3)
def test_a_tied_parameter_its_layer_sums_is_refused(P_world, comm):
    """An embedding over the batch that P splits sums its table's gradient over P itself; tied to a head (as GPT-2
    ties them), the head's part of that gradient would stay each member's own: refused on every member (the
    replicas' gradients differed, with no error)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    embedding = DistributedEmbedding(P_x, 7, 4).double()
    head = torch.nn.Linear(4, 7, bias=False).double()
    head.weight = embedding.weight
    tied = r"on P rank 0, 0.weight \(DistributedEmbedding\) is summed over P by its layer and held by another " \
           r"module too \(tied\)"
    for sync in ("function", "module"):
        with pytest.raises(ValueError, match=tied):
            if sync == "function":
                all_reduce_gradients(torch.nn.Sequential(embedding, head), P_world)
            else:
                DataParallel(torch.nn.Sequential(embedding, head), P_world)
    # Tied after wrapping: refused at the next forward, and at every one after (it used to go on unhooked).
    untied = torch.nn.Linear(4, 7, bias=False).double()
    wrapped = DataParallel(torch.nn.Sequential(embedding, untied), P_world)
    untied.weight = embedding.weight
    for _ in range(2):
        with pytest.raises(ValueError, match=tied):
            wrapped(torch.zeros(2, 3, dtype=torch.int64))


@sizes(2, 3)
def test_a_tie_made_or_undone_later_is_seen(P_world, comm):
    """A module coming to hold a parameter that a batch norm over P's batch split sums (a tie), or ceasing to, leaves
    the parameters alike: all_reduce_gradients kept the first call's plan (a tie made later went unrefused, that
    use's gradient left unsummed; one undone kept raising), and DataParallel did not plan again."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    tied = r"norm\.weight \(DistributedBatchNorm\) is summed over P by its layer and held by another module too " \
           r"\(tied\)"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = DistributedBatchNorm(P_x, 3).double()

        def forward(self, x):
            return self.norm(x)

    def tie(model, on):
        if on:
            model.tie = torch.nn.Module()
            model.tie.w = model.norm.weight
        else:
            del model.tie

    x = random_tensor((2, 3), seed=comm.rank)
    model = Model()

    def backward():
        model.zero_grad()
        model(x).square().sum().backward()
    backward()
    all_reduce_gradients(model, P_world)
    tie(model, True)
    backward()
    with pytest.raises(ValueError, match=tied):
        all_reduce_gradients(model, P_world)
    tie(model, False)
    backward()
    all_reduce_gradients(model, P_world)
    model = Model()
    wrapped = DataParallel(model, P_world)
    wrapped(x).square().sum().backward()
    tie(model, True)
    with pytest.raises(ValueError, match=tied):
        wrapped(x)
    tie(model, False)
    model.zero_grad()
    wrapped(x).square().sum().backward()
    reference = Model()
    reference(x).square().sum().backward()  # the layer's sum over P; "avg" divides it by P.size
    torch.testing.assert_close(model.norm.weight.grad, reference.norm.weight.grad / comm.size)


@sizes(2, 3)
def test_a_holder_replaced_by_another_kind_is_seen(P_world, comm, monkeypatch):
    """A distdl head tied to an embedding (taken: both sum it over P) replaced by a plain torch head tied alike (to be
    refused): the new module often takes the freed one's id, and a plan keyed on ids kept the old answer (the plain
    use's gradient unsummed, no error). Here every module's id is the same, the worst case of ids reused."""
    monkeypatch.setattr(data_parallel, "id", lambda obj: 0 if isinstance(obj, torch.nn.Module) else builtins.id(obj),
                        raising=False)
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))

    class PlainHead(torch.nn.Module):
        def forward(self, h):
            return torch.nn.functional.linear(h, self.weight)

    tied = r"0\.weight \(DistributedEmbedding\) is summed over P by its layer and held by another module too \(tied\)"
    tokens = torch.randint(7, (2, 3), generator=torch.Generator().manual_seed(comm.rank))

    def build():
        model = torch.nn.Sequential(DistributedEmbedding(P_x, 7, 4).double(),
                                    DistributedLinearAllGather(P_x, 4, 7, bias=False).double())
        model[1].weight = model[0].weight
        return model

    def replace_head(model):
        del model[1]
        gc.collect()  # freed (ids are reused only then)
        model.append(PlainHead())
        model[1].weight = model[0].weight

    model = build()
    wrapped = DataParallel(model, P_world, op="sum")
    wrapped(tokens).square().sum().backward()
    replace_head(model)
    with pytest.raises(ValueError, match=tied):
        wrapped(tokens)
    model = build()
    model(tokens).square().sum().backward()
    all_reduce_gradients(model, P_world, op="sum")
    replace_head(model)
    model.zero_grad()
    model(tokens).square().sum().backward()
    with pytest.raises(ValueError, match=tied):
        all_reduce_gradients(model, P_world, op="sum")


@sizes(2, 3)
def test_replicas_that_come_to_differ_are_named(P_world, comm):
    """A buffer registered on one replica after wrapping made the forward's buffer broadcasts differ in number (a
    hang, check mode too): the next forward raises on every member instead. The message names the first tensor whose
    dtype, shape or kind differs, not one named otherwise but alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    wrapped = DataParallel(model, P_world)
    wrapped(random_tensor((2, 4), seed=comm.rank, dtype=torch.float32)).sum().backward()
    if comm.rank == 1:
        model[0].register_buffer("stat", torch.zeros(3))
    with pytest.raises(ValueError, match=r"DataParallel: expected the same parameters .* the first difference: "
                                         r"nothing on P rank 0, 0\.stat \(torch\.float32, shape \(3,\), a buffer\) "
                                         r"on P rank 1"):
        wrapped(random_tensor((2, 4), seed=comm.rank, dtype=torch.float32))
    layers = [("0", torch.nn.Linear(4, 5)), ("1", torch.nn.Linear(5, 3))] if comm.rank == 0 else \
        [("enc", torch.nn.Linear(4, 5)), ("head", torch.nn.Linear(5, 4))]
    with pytest.raises(ValueError, match=r"the first difference: 1\.weight \(torch\.float32, shape \(3, 5\)\) on "
                                         r"P rank 0, head\.weight \(torch\.float32, shape \(4, 5\)\) on P rank 1"):
        DataParallel(torch.nn.Sequential(collections.OrderedDict(layers)), P_world)


@sizes(2, 3)
def test_a_tie_between_layers_that_both_sum_it_is_taken(P_world, comm):
    """An embedding over the batch that P splits tied to a head that is a distdl layer over the same batch split
    (GPT-2's tie in a Megatron-style model): both uses' gradients are summed over P by the layers, so the wrapper
    takes it (it was refused as a tie to a module that sums nothing); the tied gradient is the whole batch's."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    embedding = DistributedEmbedding(P_x, 7, 4).double()
    head = DistributedLinearAllGather(P_x, 4, 7, bias=False).double()
    head.weight = embedding.weight
    tokens = torch.randint(7, (5, 3), generator=torch.Generator().manual_seed(5))
    mine = tokens[_rows(5, comm.size, comm.rank)]
    reference = torch.nn.Embedding(7, 4).double()
    with torch.no_grad():
        reference.weight.copy_(embedding.weight)
    torch.nn.functional.linear(reference(tokens), reference.weight).pow(2).sum().backward()
    for sync in ("function", "module"):
        model = torch.nn.Sequential(embedding, head)
        embedding.weight.grad = None
        if sync == "function":
            model(mine).pow(2).sum().backward()
            all_reduce_gradients(model, P_world, op="sum")
        else:
            DataParallel(model, P_world, op="sum")(mine).pow(2).sum().backward()
        torch.testing.assert_close(embedding.weight.grad, reference.weight.grad, rtol=1e-12, atol=1e-12)


@sizes(2, 3)
def test_wrap_broadcasts_parameters_and_buffers(P_world, comm):
    model = _mlp(seed=20 + comm.rank)  # replicas start different on purpose
    model[2].requires_grad_(False)  # frozen parameters are broadcast too
    model.register_buffer("steps", torch.tensor([comm.rank + 5]))
    wrapped = DataParallel(model, P_world)
    for p, q in zip(wrapped.parameters(), _mlp(seed=20).parameters()):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    assert model.steps.item() == 5
    assert wrapped.module is model


class _Scaled(torch.nn.Module):
    """``w * x`` summed: ``w``'s gradient is ``x``; with ``x`` one 40000-vector, 320 KB (reduced in place)."""

    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n, dtype=torch.float64))

    def forward(self, x):
        return (self.w * x).sum()


@sizes(2, 3)
def test_a_dropped_wrapper_stops_reducing(P_world, comm):
    """A wrapper holds its hooks, not the other way round: dropped, it is freed at once and reduces nothing more;
    while it lives, wrapping its parameters again raises on every worker instead of reducing them twice."""
    for n in (3, 40000):
        model = _Scaled(n)
        first = DataParallel(model, P_world, op="sum")
        with pytest.raises(ValueError, match=r"DataParallel: expected parameters that no other DataParallel "
                                             rf"reduces, got one of shape \({n},\) that a live DataParallel"):
            DataParallel(model, P_world)
        first(torch.full((n,), comm.rank + 1.0)).backward()
        gone = weakref.ref(first)
        del first  # no garbage collection needed: nothing refers to it now
        assert gone() is None
        model.w.grad = None
        x = random_tensor((n,), seed=comm.rank)
        model(x).backward()  # the bare module: local gradients, no collective
        torch.testing.assert_close(model.w.grad, x, rtol=0, atol=0)
        model.w.grad = None
        second = DataParallel(model, P_world, op="sum")  # kept: a wrapper reduces while it lives
        second(x).backward()  # and a new one reduces once
        torch.testing.assert_close(model.w.grad, sum(random_tensor((n,), seed=r) for r in range(comm.size)))


@sizes(2, 3)
def test_a_dropped_wrapper_in_a_reference_cycle(P_world, comm):
    """A dropped wrapper caught in a reference cycle lives until the garbage collector runs: wrapping its
    parameters again collects it on every worker instead of raising, and then only the new wrapper reduces."""
    gc.disable()  # the cycle must survive until the new wrapper is made
    try:
        model = _Scaled(5)
        first = DataParallel(model, P_world, op="sum")
        first.cycle = [first]
        gone = weakref.ref(first)
        del first
        assert gone() is not None
        second = DataParallel(model, P_world, op="sum")
        assert gone() is None
        x = random_tensor((5,), seed=comm.rank)
        second(x).backward()
        torch.testing.assert_close(model.w.grad, sum(random_tensor((5,), seed=r) for r in range(comm.size)))
    finally:
        gc.enable()


class _Checkpointed(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.first, self.last = torch.nn.Linear(4, 3).double(), torch.nn.Linear(3, 2).double()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.last, self.first(x), use_reentrant=self.reentrant)


@sizes(1, 2, 3)
def test_checkpointed_last_layer(P_world, comm):
    """Checkpointing the last layer without reentrancy gives the full batch's gradients; reentrant, its backward
    ends before the first layer's gradients exist, which raises on every worker instead of reducing twice."""
    x = random_tensor((2, 4), seed=80 + comm.rank)
    full = torch.cat([random_tensor((2, 4), seed=80 + r) for r in range(comm.size)])
    model = _Checkpointed(reentrant=False)
    wrapped = DataParallel(model, P_world, op="sum")  # rank 0's weights everywhere
    expected = torch.autograd.grad(model(full).sum(), list(model.parameters()))  # accumulates nothing: no hooks
    wrapped(x).sum().backward()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-12)
    wrapped = DataParallel(_Checkpointed(reentrant=True), P_world, op="sum")
    if comm.size == 1:  # nothing to reduce: no hooks
        wrapped(x).sum().backward()
        return
    with pytest.raises(RuntimeError, match="DataParallel: expected every gradient of the module within one "
                                           "backward, got a backward that ended inside another"):
        wrapped(x).sum().backward()


class _Branchy(torch.nn.Module):
    """``extra`` is used only where ``use_extra``; ``unused`` never."""

    def __init__(self, use_extra):
        super().__init__()
        self.use_extra = use_extra
        self.weight = torch.nn.Parameter(random_tensor((3,), seed=1))
        self.extra = torch.nn.Parameter(random_tensor((3,), seed=2))
        self.unused = torch.nn.Parameter(random_tensor((2,), seed=3))

    def forward(self, x):
        return (x * self.weight * (self.extra if self.use_extra else 1)).sum()


@sizes(2, 3)
def test_parameter_without_gradient(P_world, comm):
    x = random_tensor((3,), seed=30 + comm.rank)
    weight, extra = random_tensor((3,), seed=1), random_tensor((3,), seed=2)
    factor = [extra if r == 0 else 1 for r in range(comm.size)]
    expected_weight = sum(random_tensor((3,), seed=30 + r) * factor[r] for r in range(comm.size))
    expected_extra = random_tensor((3,), seed=30) * weight  # only rank 0 had one: the others count as zeros
    for cap in (TINY_CAP, 25):
        for sync in ("function", "module"):
            model = _Branchy(use_extra=comm.rank == 0)
            if sync == "module":
                model = DataParallel(model, P_world, bucket_cap_mb=cap, op="sum")
            model(x).backward()
            if sync == "function":
                all_reduce_gradients(model, P_world, op="sum", bucket_cap_mb=cap)
            inner = model.module if sync == "module" else model
            torch.testing.assert_close(inner.weight.grad, expected_weight)
            torch.testing.assert_close(inner.extra.grad, expected_extra)
            assert inner.unused.grad is None  # no worker had one


class _MaybeGrad(torch.autograd.Function):
    """``x * w``, whose backward gives ``w`` a gradient only where asked (None otherwise; w's accumulator still
    runs)."""

    @staticmethod
    def forward(ctx, x, w, want):
        ctx.save_for_backward(x, w)
        ctx.want = want
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, grad * x if ctx.want else None, None


class _Weighted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(random_tensor((3,), seed=1))

    def forward(self, x, want):
        return _MaybeGrad.apply(x, self.w, want).sum()


@sizes(2, 3)
def test_a_gradient_left_none_after_a_step_with_one(P_world, comm):
    """With op="sum", a step where no member's backward gives a parameter a gradient, after a step where they did
    (zeroed to None between), leaves it None on every member (it raised an AttributeError)."""
    model = _Weighted()
    wrapped = DataParallel(model, P_world, op="sum")
    x = random_tensor((3,), seed=40 + comm.rank)
    for want in (True, False, True):
        model.zero_grad(set_to_none=True)
        wrapped(x, want).backward()
        if want:
            torch.testing.assert_close(model.w.grad, sum(random_tensor((3,), seed=40 + r) for r in range(comm.size)))
        else:
            assert model.w.grad is None


@sizes(3)
def test_workers_outside_P_do_nothing(P_world, comm):
    P = P_world.create_partition_inclusive([0, 1])
    x, y = _batch(4, seed=40 + comm.rank)
    expected = _grads(_mlp(4), *(torch.cat(t) for t in zip(_batch(4, 40), _batch(4, 41))))
    model = _mlp(4)
    local = _grads(model, x, y)
    all_reduce_gradients(model, P, op="sum")
    _assert_grads(model, expected if P.active else local, exact=not P.active)
    wrapped = DataParallel(_mlp(seed=4 + comm.rank), P, op="sum")  # rank 2 keeps its own weights
    _step(wrapped, x, y)
    if P.active:
        _assert_grads(wrapped, expected)
    else:
        _assert_grads(wrapped, _grads(_mlp(6), x, y), exact=True)
        wrapped.wait()  # nothing outstanding: a no-op


@sizes(2, 3)
def test_dtypes_and_layouts(P_world, comm):
    n = comm.size
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    model.b = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    model.c = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float32))
    model.d = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex128))
    model.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    for p in (model.a, model.b):  # 256 + 0.5 + 0.5 is exact in fp32, not summed pairwise in fp16
        p.grad = torch.full((2,), 256.0 if comm.rank == 0 else 0.5, dtype=p.dtype)
    model.c.grad = (torch.arange(9.0).reshape(3, 3) + comm.rank).t()  # non-contiguous
    model.d.grad = torch.tensor([1 + 2j, comm.rank * 1j], dtype=torch.complex128)
    all_reduce_gradients(model, P_world, op="sum", bucket_cap_mb=TINY_CAP)
    for p in (model.a, model.b):
        assert p.grad.dtype == p.dtype
        assert p.grad.tolist() == [torch.tensor(256.0 + 0.5 * (n - 1)).to(p.dtype).item()] * 2
    torch.testing.assert_close(model.c.grad, (n * torch.arange(9.0).reshape(3, 3) + sum(range(n))).t())
    torch.testing.assert_close(model.d.grad, torch.tensor([n * (1 + 2j), sum(range(n)) * 1j], dtype=torch.complex128))
    assert model.frozen.grad is None
    all_reduce_gradients(model, P_world, op="avg")
    torch.testing.assert_close(model.c.grad, (n * torch.arange(9.0).reshape(3, 3) + sum(range(n))).t())


@sizes(2, 3)
def test_shared_grad_tensor_is_reduced_once(P_world, comm):
    """Two parameters whose ``.grad`` is one tensor both get its reduction (summed in place twice, it would
    double); a third parameter's own gradient is unaffected."""
    model = torch.nn.Module()
    model.a, model.b, model.c = (torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64)) for _ in range(3))
    shared = random_tensor((4, 3), seed=70 + comm.rank)
    model.a.grad = model.b.grad = shared
    model.c.grad = random_tensor((4, 3), seed=80 + comm.rank)
    all_reduce_gradients(model, P_world, op="sum")
    expected = sum(random_tensor((4, 3), seed=70 + r) for r in range(comm.size))
    torch.testing.assert_close(model.a.grad, expected)
    torch.testing.assert_close(model.b.grad, expected)
    torch.testing.assert_close(model.c.grad, sum(random_tensor((4, 3), seed=80 + r) for r in range(comm.size)))


@pytest.mark.parametrize("set_to_none", [True, False])
@sizes(2, 3)
def test_a_backward_that_raised(P_world, comm, set_to_none):
    """A backward that raises on every member (a hook) leaves reductions in flight; the next forward through the
    wrapper completes them, and the steps after it give the full-batch gradients (they used to raise)."""
    n = 7
    x, y = _batch(n, seed=3)
    expected = _grads(_mlp(0), x, y)
    rows = _rows(n, comm.size, comm.rank)
    wrapped = DataParallel(_mlp(0), P_world, bucket_cap_mb=TINY_CAP, op="sum")

    def fail(grad):
        raise RuntimeError("a hook failed")
    handle = wrapped.module[0].weight.register_hook(fail)  # the last gradient: the other buckets have started
    with pytest.raises(RuntimeError, match="a hook failed"):
        _step(wrapped, x[rows], y[rows])
    assert wrapped._in_flight
    handle.remove()
    for _ in range(2):
        wrapped.zero_grad(set_to_none=set_to_none)  # in place too, on gradients still being summed in place
        ((wrapped(x[rows]) - y[rows]) ** 2).sum().backward()
        _assert_grads(wrapped, expected)


@sizes(2, 3, 4)
@pytest.mark.parametrize("checked", [False, True])
def test_a_backward_that_raised_at_another_point_on_each_member(P_world, comm, checked, monkeypatch):
    """A backward that raises on every member, but on rank 0 before the wrapper's first gradient (a hook on the
    output) and on ranks 1, 2, 3 at the first, second or last layer's weight (some or all of its sums started):
    caught, the next forward completes them on every member, and the steps after it give the full-batch
    gradients. It completed them on those that had started them only (a hang, or MPI's "message truncated"); in
    check mode, the check of that backward, started on some members only, paired with the others' next forward's."""
    import distdl
    monkeypatch.setenv("DISTDL_CHECK_TIMEOUT", "30")
    n = 7
    x, y = _batch(n, seed=3)
    expected = _grads(_mlp(0), x, y)
    rows = _rows(n, comm.size, comm.rank)
    wrapped = DataParallel(_mlp(0), P_world, bucket_cap_mb=TINY_CAP, op="sum")
    layer = [None, 0, 2, 4][comm.rank]  # 6 buckets; each weight's bucket starts after its bias's

    def fail(grad):
        raise RuntimeError("a hook failed")
    with distdl.checking() if checked else contextlib.nullcontext():
        wrapped.zero_grad()
        out = wrapped(x[rows])
        handle = (out if layer is None else wrapped.module[layer].weight).register_hook(fail)
        with pytest.raises(RuntimeError, match="a hook failed"):
            ((out - y[rows]) ** 2).sum().backward()
        assert wrapped._in_flight == (layer is not None)
        handle.remove()
        for _ in range(2):
            wrapped.zero_grad()
            ((wrapped(x[rows]) - y[rows]) ** 2).sum().backward()
            _assert_grads(wrapped, expected)


@sizes(2, 3, 4)
@pytest.mark.parametrize("then", ["check mode off", "another wrapper", "a primitive"])
def test_after_a_backward_raised_apart_in_check_mode(P_world, comm, then, monkeypatch):
    """In check mode, a backward raising at another point on each member (rank 0 before the wrapper's first
    gradient) leaves that backward's check started on some members only. What comes next on P before the wrapper's
    next checked forward (a step with check mode off, another wrapper's step, a validation primitive) met that
    check, when it was on P's communicator: a false mismatch, a timeout or a hang. The wrapper checks on a
    communicator of its own; a forward with check mode off completes that check on every member."""
    import distdl
    from distdl.functional import all_sum_reduce
    monkeypatch.setenv("DISTDL_CHECK_TIMEOUT", "30")
    n = 7
    x, y = _batch(n, seed=4)
    expected, other_expected = _grads(_mlp(0), x, y), _grads(_mlp(1), x, y)
    rows = _rows(n, comm.size, comm.rank)
    wrapped = DataParallel(_mlp(0), P_world, bucket_cap_mb=TINY_CAP, op="sum")
    other = DataParallel(_mlp(1), P_world, bucket_cap_mb=TINY_CAP, op="sum")
    layer = [None, 0, 2, 4][comm.rank]

    def fail(grad):
        raise RuntimeError("a hook failed")
    with distdl.checking():
        out = wrapped(x[rows])
        handle = (out if layer is None else wrapped.module[layer].weight).register_hook(fail)
        with pytest.raises(RuntimeError, match="a hook failed"):
            ((out - y[rows]) ** 2).sum().backward()
        handle.remove()
        if then == "another wrapper":
            other.zero_grad()
            ((other(x[rows]) - y[rows]) ** 2).sum().backward()
            _assert_grads(other, other_expected)
        elif then == "a primitive":
            with torch.no_grad():
                total = all_sum_reduce(torch.full((2,), float(comm.rank)), P_world, axes_reduce=[0])
            assert torch.equal(total, torch.full((2,), float(sum(range(comm.size)))))
        for step in range(2):
            with distdl.checking(then != "check mode off" or step == 1):
                wrapped.zero_grad()
                ((wrapped(x[rows]) - y[rows]) ** 2).sum().backward()
            _assert_grads(wrapped, expected)


@sizes(1, 2, 3)
def test_repeated_calls(P_world, comm):
    """all_reduce_gradients keeps its plan between calls: still right after the parameters change dtype in place
    or one is replaced, and a dropped model is not kept alive by it."""
    model = _mlp(6)
    for step, dtype in enumerate((torch.float64, torch.float64, torch.float32, torch.float32)):
        model.to(dtype)  # the same Parameter objects, new dtype
        if step == 3:
            model[0].bias = torch.nn.Parameter(random_tensor((6,), seed=9).to(dtype))
        x, y = (t.to(dtype) for t in _batch(4, seed=60 + step))
        _step(model, x * (comm.rank + 1), y)
        local = [p.grad.clone() for p in model.parameters()]
        all_reduce_gradients(model, P_world, op="sum")
        for p, g in zip(model.parameters(), local):
            assert p.grad.dtype == dtype
            torch.testing.assert_close(p.grad, sum(comm.allgather(g)))
    weight = weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert weight() is None


@sizes(2)
def test_no_sync_accumulates_locally(P_world, comm):
    x, y = _batch(2, seed=50 + comm.rank)
    wrapped = DataParallel(_mlp(5), P_world, op="sum")
    with wrapped.no_sync():
        _step(wrapped, x, y)
    _assert_grads(wrapped, _grads(_mlp(5), x, y), exact=True)
    loss = ((wrapped(x) - y) ** 2).sum()
    loss.backward()  # accumulates onto the local gradient, then reduces the total
    expected = _grads(_mlp(5), *(torch.cat(t) for t in zip(_batch(2, 50), _batch(2, 51))))
    _assert_grads(wrapped, [2 * g for g in expected])


@sizes(2)
def test_no_sync_around_the_forward_alone(P_world, comm):
    """As with DDP, the forward decides: a forward run in no_sync() is not reduced where its backward runs outside
    it, and one run outside is reduced where its backward runs inside (it was not)."""
    x, y = _batch(2, seed=50 + comm.rank)
    wrapped = DataParallel(_mlp(5), P_world, op="sum")
    with wrapped.no_sync():
        loss = ((wrapped(x) - y) ** 2).sum()
    loss.backward()
    _assert_grads(wrapped, _grads(_mlp(5), x, y), exact=True)
    ((wrapped(x) - y) ** 2).sum().backward()  # accumulates onto the local gradient, then reduces the total
    expected = _grads(_mlp(5), *(torch.cat(t) for t in zip(_batch(2, 50), _batch(2, 51))))
    _assert_grads(wrapped, [2 * g for g in expected])
    wrapped.zero_grad()
    loss = ((wrapped(x) - y) ** 2).sum()
    with wrapped.no_sync():
        loss.backward()
    _assert_grads(wrapped, expected)


@sizes(2, 3)
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("bucket_cap_mb", [25, 1e-6])
@pytest.mark.parametrize("how", ["heads", "inputs"])
def test_a_second_backward_in_a_step_leaves_what_the_first_reduced(P_world, comm, op, bucket_cap_mb, how):
    """Two backward calls in one step reaching different parameters (two heads; backward(inputs=...)): the second
    left the first's reduced gradients in buckets it had not reached, which it reduced again (P.size times the sum
    with op="sum"). Each gradient equals the sequential model's on the whole batch."""
    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.a, self.b = torch.nn.Linear(4, 2).double(), torch.nn.Linear(4, 3).double()

        def forward(self, x):
            return self.a(x).square().sum(), self.b(x).tanh().sum()

    wrapped = DataParallel(Heads(), P_world, op=op, bucket_cap_mb=bucket_cap_mb)
    for step in range(2):
        wrapped.zero_grad(set_to_none=step == 0)
        x = random_tensor((2, 4), seed=10 * step + comm.rank)
        la, lb = wrapped(x)
        if how == "heads":
            la.backward()
            lb.backward()
        else:
            (la + lb).backward(inputs=list(wrapped.module.a.parameters()), retain_graph=True)
            (la + lb).backward(inputs=list(wrapped.module.b.parameters()))
        sequential = Heads()
        whole = torch.cat([random_tensor((2, 4), seed=10 * step + r) for r in range(comm.size)])
        sum(sequential(whole)).backward()
        for p, q in zip(wrapped.module.parameters(), sequential.parameters()):
            torch.testing.assert_close(p.grad, q.grad / (comm.size if op == "avg" else 1), rtol=1e-12, atol=1e-12)


class _TwoHeads(torch.nn.Module):
    """Two heads on one input; the second (a) used where asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b = torch.nn.Linear(4, 2).double(), torch.nn.Linear(4, 3).double()

    def forward(self, x, use_a=True):
        return self.b(x).tanh().sum() + (self.a(x).square().sum() if use_a else 0)


@sizes(2, 3)
def test_a_second_backward_reaching_a_parameter_on_some_workers_with_avg(P_world, comm):
    """With op="avg", a second backward in a step that reaches a parameter on worker 0 only averages each worker's
    share of the first's average in again: g + dA / P (leaving it out gave (g + dA) / P, silently)."""
    wrapped = DataParallel(_TwoHeads(), P_world, op="avg")
    x = random_tensor((2, 4), seed=comm.rank)
    wrapped(x).backward()
    wrapped(2 * x, use_a=comm.rank == 0).backward()
    sequential = _TwoHeads()
    for r in range(comm.size):
        x_r = random_tensor((2, 4), seed=r)
        ((sequential(x_r) + sequential(2 * x_r, use_a=r == 0)) / comm.size).backward()
    for p, q in zip(wrapped.module.parameters(), sequential.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


@sizes(2, 3)
def test_a_backward_after_the_partition_was_freed(P_world, comm):
    """DataParallel reduces on a communicator of its own: a backward through a forward made before P.free() went on
    reducing silently; it raises on every worker, as the primitives' backward do."""
    P = P_world.create_partition_inclusive(range(comm.size))
    wrapped = DataParallel(torch.nn.Linear(3, 2).double(), P)
    loss = wrapped(random_tensor((2, 3), seed=comm.rank)).sum()
    P.free()
    with pytest.raises(ValueError, match=r"DataParallel \(backward\): the partition of shape .* was freed"):
        loss.backward()


@sizes(1, 2)
def test_errors(P_world, comm):
    model = _mlp(0)
    with pytest.raises(ValueError, match=r"all_reduce_gradients: expected op in \['avg', 'sum'\], got 'mean'"):
        all_reduce_gradients(model, P_world, op="mean")
    with pytest.raises(ValueError, match=r"DataParallel: expected op in \['avg', 'sum'\], got 'max'"):
        DataParallel(model, P_world, op="max")
    with pytest.raises(TypeError, match="all_reduce_gradients: expected a torch.nn.Module, got Tensor"):
        all_reduce_gradients(torch.ones(2), P_world)
    with pytest.raises(TypeError, match="DataParallel: expected a torch.nn.Module, got list"):
        DataParallel([model], P_world)
    with pytest.raises(TypeError, match="all_reduce_gradients: expected an MPIPartition for P, got Intracomm"):
        all_reduce_gradients(model, comm)
    with pytest.raises(ValueError, match="DataParallel: expected a positive bucket_cap_mb, got 0"):
        DataParallel(model, P_world, bucket_cap_mb=0)
    sparse = torch.nn.Embedding(4, 2, sparse=True)
    sparse(torch.tensor([1])).sum().backward()
    with pytest.raises(TypeError, match="all_reduce_gradients: expected dense gradients, got a torch.sparse_coo"):
        all_reduce_gradients(sparse, P_world)
    if comm.size > 1:  # replicas that disagree are named on every worker instead of hanging
        odd = torch.nn.Linear(3, 2 if comm.rank == 0 else 3)
        with pytest.raises(ValueError, match=r"all_reduce_gradients: expected the same parameters \(dtypes, "
                                             r"shapes, order\) on every worker of P, got a different layout on "
                                             r"P ranks \[1\] than on P rank 0; the first difference: weight "
                                             r"\(torch.float32, shape \(2, 3\)\) on P rank 0, weight \(torch.float32, "
                                             r"shape \(3, 3\)\) on P rank 1"):
            all_reduce_gradients(odd, P_world)
        with pytest.raises(ValueError, match=r"DataParallel: expected the same parameters .* the first difference: "
                                             r"weight .* on P rank 0, weight .* on P rank 1"):
            DataParallel(odd, P_world)
        odd = torch.nn.Linear(3, 2)
        odd.bias.requires_grad_(comm.rank != 0)  # which parameters take gradients, named too
        # all_reduce_gradients too (it named the next parameter, leaving frozen ones out of its list)
        for sync in (lambda: DataParallel(odd, P_world), lambda: all_reduce_gradients(odd, P_world)):
            with pytest.raises(ValueError, match=r"the first difference: bias \(torch.float32, shape \(2,\), "
                                                 r"frozen\) on P rank 0, bias \(torch.float32, shape \(2,\)\) "
                                                 r"on P rank 1"):
                sync()


@sizes(2, 3)
def test_parameters_changed_after_wrapping(P_world, comm):
    """Unfrozen, converted to float64 or replaced (load_state_dict(assign=True)) after wrapping: the next forward
    plans the buckets again on every member, so every gradient is reduced, in its own dtype (the unfrozen layer's
    gradient stayed local, the float64 ones were summed in float32, the replaced parameters were not reduced)."""
    x, y = _batch(7, seed=90)
    mine = _rows(7, comm.size, comm.rank)
    for change in ("unfreeze", "double", "assign"):
        model = _mlp(9, torch.float32 if change == "double" else torch.float64)
        if change == "unfreeze":
            model[0].requires_grad_(False)
        wrapped = DataParallel(model, P_world, op="sum")
        if change == "unfreeze":
            model[0].requires_grad_(True)
        elif change == "double":
            wrapped.double()
        else:
            wrapped.load_state_dict({k: v.clone() for k, v in wrapped.state_dict().items()}, assign=True)
        _step(wrapped, x[mine], y[mine])
        _assert_grads(wrapped.module, _grads(_mlp(9, torch.float32).double() if change == "double" else _mlp(9), x, y))
        del wrapped


@sizes(2, 3)
def test_a_layer_added_after_wrapping_starts_alike(P_world, comm):
    """A head replaced after wrapping, initialised differently on each member: the next forward broadcasts it from
    rank 0 with the new plan, so the replicas train alike (they drifted apart silently)."""
    x, y = _batch(7, seed=95)
    mine = _rows(7, comm.size, comm.rank)
    wrapped = DataParallel(_mlp(4), P_world, op="sum")
    wrapped.module[4] = _mlp(40 + comm.rank)[4]  # a new head of the same shape, drawn from another seed on each rank
    expected = _mlp(4)
    expected[4] = _mlp(40)[4]
    _step(wrapped, x[mine], y[mine])
    _assert_grads(wrapped.module, _grads(expected, x, y))
    for p, q in zip(wrapped.module.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@sizes(2, 3)
def test_a_replan_writes_only_new_tensors(P_world, comm):
    """A replan broadcast every parameter again in place, which bumped their versions on the members other than rank
    0: a graph that had saved one (the layer used outside the wrapper first) raised torch's in-place error there
    alone. Only tensors new on some member are broadcast now; a head replaced on rank 0 alone reaches every member."""
    x, y = _batch(2, seed=97 + comm.rank)
    model = _mlp(4)
    model[0].requires_grad_(False)
    wrapped = DataParallel(model, P_world, op="sum")
    model[0].requires_grad_(True)  # the next forward plans again
    versions = [p._version for p in model.parameters()]
    outside = model[0](x).square().sum()  # saves model[0].weight before the wrapper's forward
    (((wrapped(x) - y) ** 2).sum() + outside).backward()
    assert [p._version for p in model.parameters()] == versions
    if comm.rank == 0:  # a checkpoint's head, loaded on rank 0 alone
        model[4] = _mlp(41)[4]
    else:
        model[4] = torch.nn.Linear(5, 3).double()  # the same shape, another object
    wrapped.zero_grad()
    ((wrapped(x) - y) ** 2).sum().backward()
    for p, q in zip(model[4].parameters(), _mlp(41)[4].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@sizes(2, 3)
def test_a_parameter_unfrozen_into_two_wrappers_is_refused(P_world, comm):
    """A parameter frozen when one wrapper was made, then unfrozen and wrapped by another: the first's next forward
    hooked it too, and both summed it (in place, at once: silently wrong). It raises on every member instead."""
    shared, head = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 1).double()
    shared.requires_grad_(False)
    first = DataParallel(torch.nn.Sequential(shared, head), P_world)
    shared.requires_grad_(True)
    second = DataParallel(shared, P_world)
    with pytest.raises(ValueError, match=r"DataParallel: expected parameters that no other DataParallel reduces, "
                                         r"got one of shape \(4, 4\)"):
        first(torch.rand(2, 4, dtype=torch.float64))
    del second


@sizes(2, 3)
@pytest.mark.parametrize("setting", ["op", "broadcast_buffers", "bucket_cap_mb"])
def test_settings_that_differ_are_refused(P_world, comm, setting):
    """op, broadcast_buffers or bucket_cap_mb different on rank 0: replicas apart (op, silently), a hang (buffers),
    or a layout error naming no setting. Construction raises on every member, naming them."""
    value = {"op": "sum", "broadcast_buffers": False, "bucket_cap_mb": 1e-6}[setting]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=f"DataParallel: expected the same settings on every worker of P, got "
                                         f".*'{setting}': {value!r}.* on P rank 0 and .* on P rank 1"):
        DataParallel(model, P_world, **({setting: value} if comm.rank == 0 else {}))
    DataParallel(model, P_world, bucket_cap_mb=25 if comm.rank == 0 else np.float64(25.0))  # equal values agree


@sizes(2, 3)
def test_no_sync_on_some_members_is_refused(P_world, comm):
    """A forward within no_sync() on rank 0 only: its backward did not reduce there and did on the others, which
    waited for it (a hang). The forward raises on every member, and the next step is exact."""
    wrapped = DataParallel(_mlp(4), P_world, op="sum")
    x, y = _batch(2, seed=comm.rank)
    with wrapped.no_sync() if comm.rank == 0 else contextlib.nullcontext():
        with pytest.raises(ValueError, match=r"DataParallel: expected no_sync\(\) alike on every member of P"):
            wrapped(x)
    _step(wrapped, x, y)
    _assert_grads(wrapped, _grads(_mlp(4), *(torch.cat(t) for t in zip(*(_batch(2, r) for r in range(comm.size))))))


@sizes(2, 3)
def test_a_gan_step_zeroing_without_none(P_world, comm):
    """A generator's backward within the discriminator's no_sync() accumulates onto the discriminator's reduced
    gradients (op="sum"); zero_grad(set_to_none=False) then zeroes them: the discriminator's next step raised the
    accumulation error all the same (only None cleared it). Its gradients equal the sequential model's."""
    torch.manual_seed(5)
    generator, discriminator = torch.nn.Linear(3, 4).double(), torch.nn.Linear(4, 1).double()
    wrapped = DataParallel(discriminator, P_world, op="sum")
    z = random_tensor((2, 3), seed=comm.rank)
    wrapped(generator(z).detach()).sum().backward()  # the discriminator's step
    with wrapped.no_sync():
        wrapped(generator(z)).sum().backward()  # the generator's, through the discriminator
    wrapped.zero_grad(set_to_none=False)
    wrapped(generator(z).detach()).square().sum().backward()
    sequential = copy.deepcopy(discriminator)
    sequential.zero_grad(set_to_none=True)
    whole = torch.cat([random_tensor((2, 3), seed=r) for r in range(comm.size)])
    sequential(generator(whole).detach()).square().sum().backward()
    for p, q in zip(discriminator.parameters(), sequential.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


class _Decoder(torch.nn.Module):
    """An MLP taking 3 features, and a gate added to its output on the rows marked (a data-dependent branch)."""

    def __init__(self, seed):
        super().__init__()
        self.body, self.gate = _mlp(seed), _mlp(seed + 1)[4]
        self.body[0] = torch.nn.Linear(3, 6).double()
        with torch.no_grad():
            for k, p in enumerate(self.body[0].parameters()):
                p.copy_(random_tensor(p.shape, seed=1000 * seed + 50 + k))

    def forward(self, h, gated):
        hidden = self.body[:4](h)
        out = self.body[4](hidden)
        return out if gated is None else out + torch.where(gated[:, None], self.gate(hidden), 0)


@sizes(2, 3)
def test_two_wrappers_over_the_same_workers(P_world, comm):
    """An encoder and a decoder wrapped apart (a GAN's two models), the decoder's gate used on rank 0 only: its
    bucket starts at the end of backward there, and the encoder's first. With one communicator for both wrappers
    the members posted their sums in different orders, and MPI summed the encoder's gradients with the decoder's."""
    x, y = _batch(7, seed=97)
    mine, first = _rows(7, comm.size, comm.rank), _rows(7, comm.size, 0)

    def loss(encoder, decoder, rows, gated):
        return ((decoder(torch.tanh(encoder(x[rows])), gated) - y[rows]) ** 2).sum()

    gated = torch.ones(first.stop, dtype=torch.bool)  # rank 0's rows
    encoder, decoder = _mlp(11), _Decoder(12)
    (loss(encoder, decoder, first, gated) + loss(encoder, decoder, slice(first.stop, 7), None)).backward()
    wrapped = DataParallel(_mlp(11), P_world, op="sum"), DataParallel(_Decoder(12), P_world, op="sum")
    loss(*wrapped, mine, gated if comm.rank == 0 else None).backward()
    for model, reference in zip(wrapped, (encoder, decoder)):
        _assert_grads(model.module, [p.grad for p in reference.parameters()])


@sizes(2, 3)
def test_buffers_follow_rank_0_in_training(P_world, comm):
    """With grad mode on, every forward broadcasts rank 0's buffers first (as torch's DDP), so replicas whose batch
    statistics drifted apart agree again; not with broadcast_buffers=False, nor under no_grad (no collective)."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2).double()
            self.register_buffer("scale", torch.full((2,), 1.0 + comm.rank, dtype=torch.float64))

        def forward(self, x):
            return self.linear(x) * self.scale

    x = random_tensor((4, 3), seed=comm.rank)
    for broadcast in (True, False):
        wrapped = DataParallel(Scaled(), P_world, broadcast_buffers=broadcast)  # the scales agree after wrapping
        wrapped.module.scale.fill_(1.0 + comm.rank)  # drift
        with torch.no_grad():
            torch.testing.assert_close(wrapped(x), wrapped.module.linear(x) * (1.0 + comm.rank))
        expected = 1.0 if broadcast else 1.0 + comm.rank
        torch.testing.assert_close(wrapped(x), wrapped.module.linear(x) * expected)
        assert wrapped.module.scale.eq(expected).all()
        del wrapped
    with pytest.raises(TypeError, match="DataParallel: expected a bool for broadcast_buffers, got 1"):
        DataParallel(Scaled(), P_world, broadcast_buffers=1)


@sizes(2, 3)
def test_buffers_of_every_kind_follow_rank_0(P_world, comm):
    """The buffers travel in one broadcast per dtype: each lands back in its own place, whatever its dtype, shape
    (0-d, empty) or layout (a transposed view), at wrapping and at each forward with grad mode on."""
    def buffers(seed):
        g = torch.Generator().manual_seed(seed)
        return {"a": torch.rand(3, generator=g), "b": torch.rand(4, 3, generator=g).t(),
                "c": torch.rand((), generator=g), "d": torch.randint(9, (5,), generator=g),
                "e": torch.rand(4, generator=g) > 0.5, "f": torch.rand(2, 2, generator=g, dtype=torch.float64),
                "g": torch.empty(0), "h": torch.rand(7, generator=g)}

    model = torch.nn.Linear(3, 2)
    for name, t in buffers(comm.rank + 1).items():
        model.register_buffer(name, t)
    wrapped = DataParallel(model, P_world)
    for drift in (False, True):
        if drift:  # every buffer drifts; the next forward with grad mode on brings rank 0's back
            for name, t in buffers(comm.rank + 100).items():
                getattr(model, name).copy_(t)
            wrapped(torch.rand(2, 3))
        for name, t in buffers(100 if drift else 1).items():
            assert getattr(model, name).dtype == t.dtype
            torch.testing.assert_close(getattr(model, name), t, rtol=0, atol=0)
    assert not model.b.is_contiguous()


@sizes(1, 2, 3)
def test_sum_of_an_accumulated_gradient_raises(P_world, comm):
    """op='sum' with a second backward onto the last reduced gradients would sum them again (P.size times too large):
    it raises on every member; zeroing in place between the steps, or op='avg' (exact either way), does not."""
    x, y = _batch(2, seed=60 + comm.rank)
    wrapped = DataParallel(_mlp(6), P_world, op="sum")
    _step(wrapped, x, y)
    loss = ((wrapped(x) - y) ** 2).sum()
    if comm.size > 1:
        with pytest.raises(RuntimeError, match="DataParallel: expected the gradients zeroed between steps with "
                                               "op='sum', got a backward that accumulated onto the last reduced"):
            loss.backward()
    wrapped.zero_grad(set_to_none=False)
    ((wrapped(x) - y) ** 2).sum().backward()
    expected = _grads(_mlp(6), *(torch.cat(t) for t in zip(*(_batch(2, 60 + r) for r in range(comm.size)))))
    _assert_grads(wrapped, expected)
    with wrapped.no_sync():  # a first micro-batch onto the reduced gradients: the next reduction raises
        ((wrapped(x) - y) ** 2).sum().backward()
    loss = ((wrapped(x) - y) ** 2).sum()
    with pytest.raises(RuntimeError, match="accumulated onto the last reduced") if comm.size > 1 else \
            contextlib.nullcontext():
        loss.backward()
    for p in wrapped.parameters():  # zeroed through .data, unseen by the version counter: no error (there was one)
        p.grad.data.zero_()
    ((wrapped(x) - y) ** 2).sum().backward()
    _assert_grads(wrapped, expected)
    del wrapped
    averaged = DataParallel(_mlp(6), P_world)
    for _ in range(2):  # accumulates: mean(A + g_r) = A + mean(g_r)
        ((averaged(x) - y) ** 2).sum().backward()
    _assert_grads(averaged, [2 * g / comm.size for g in expected])


@sizes(2, 3)
@pytest.mark.parametrize("how", ["second backward", "micro-batch", "micro-batch, then zeroed"])
def test_an_accumulated_gradient_on_some_workers_raises_on_every_worker(P_world, comm, how):
    """op='sum': a backward onto the last reduced gradients on worker 0 only (a second backward in the step
    reaching a head there alone; or, in no_sync(), a micro-batch where worker 0 alone did not zero them) raised on
    worker 0 alone, and the others waited for it. Every worker raises at the end of the backward that reduces
    (none where the gradients were set to None before it), and the next step is exact."""
    wrapped = DataParallel(_TwoHeads(), P_world, op="sum")
    x = random_tensor((2, 4), seed=comm.rank)
    wrapped(x).backward()
    with contextlib.nullcontext() if how.endswith("zeroed") else pytest.raises(
            RuntimeError, match="DataParallel: expected the gradients zeroed between steps with op='sum', got a "
                                "backward that accumulated onto the last reduced gradient"):
        if how.startswith("micro-batch"):
            if comm.rank != 0:
                wrapped.zero_grad()
            with wrapped.no_sync():
                wrapped(x).backward()
            if how.endswith("zeroed"):
                wrapped.zero_grad()
            wrapped(x).backward()
        else:
            wrapped(2 * x, use_a=comm.rank == 0).backward()
    wrapped.zero_grad()
    wrapped(x).backward()
    sequential = _TwoHeads()
    sum(sequential(random_tensor((2, 4), seed=r)) for r in range(comm.size)).backward()
    for p, q in zip(wrapped.module.parameters(), sequential.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


@sizes(2, 3)
def test_a_function_call_per_micro_batch_raises_where_it_would_reduce_twice(P_world, comm):
    """all_reduce_gradients after each micro-batch reduces again what the last call reduced: with op='sum' every
    gradient (P.size times too large), with op='avg' a batch norm's, which its layer sums over P already (divided
    twice; silent until now). It raises on every member; op='avg' of ordinary parameters (exact either way),
    gradients zeroed in place between steps, and one call after the accumulated micro-batches do not."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x = random_tensor((7, 4), seed=81)
    blocks = [_rows(7, comm.size, r) for r in range(comm.size)]
    for op in ("sum", "avg"):
        reference = _norm_model(torch.nn.BatchNorm1d(3))
        for half in (0, 1):  # two micro-batches: the squared output, then its cube, each member's rows
            sum((reference(x)[rows] ** (2 + half)).sum() for rows in blocks).backward()
        expected = [p.grad / (comm.size if op == "avg" else 1) for p in reference.parameters()]
        model, mine = _norm_model(DistributedBatchNorm(P_x, 3)), x[blocks[comm.rank]]
        model(mine).pow(2).sum().backward()
        all_reduce_gradients(model, P_world, op=op)
        model(mine).pow(3).sum().backward()
        with pytest.raises(RuntimeError, match=r"all_reduce_gradients: expected the gradients zeroed between calls, "
                                               r"got the gradient of a parameter of shape \([0-9, ]+\) accumulated "
                                               r"onto its last reduced value by a backward; reduced again, that value "
                                               f"would be {'summed' if op == 'sum' else 'divided by P.size'} again"):
            all_reduce_gradients(model, P_world, op=op)
        model.zero_grad(set_to_none=False)  # zeroed in place: the same .grad tensors, written once since
        all_reduce_gradients(model, P_world, op=op)  # nothing to reduce twice
        for half in (0, 1):
            model(mine).pow(2 + half).sum().backward()
        all_reduce_gradients(model, P_world, op=op)
        _assert_grads(model, expected)
    averaged = _mlp(6)  # no parameter a layer sums: avg(avg(A) + g) = avg(A) + avg(g)
    xs, ys = _batch(2, seed=60 + comm.rank)
    for _ in range(2):
        ((averaged(xs) - ys) ** 2).sum().backward()
        all_reduce_gradients(averaged, P_world)
    batches = [_batch(2, 60 + r) for r in range(comm.size)]
    expected = _grads(_mlp(6), torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    _assert_grads(averaged, [2 * g / comm.size for g in expected])


@sizes(1, 2)
def test_copies_name_the_way(P_world, comm):
    """Deep and shallow copies of the wrapper are refused (a shallow copy shared its hooks, which reduced for the
    wrapper copied: dropping that one, the copy's backward reduced nothing, silently)."""
    import copy
    wrapped = DataParallel(_mlp(0), P_world)
    with pytest.raises(TypeError, match=r"DataParallel: expected no deep copy of the wrapper .* "
                                        r"DataParallel\(copy.deepcopy\(wrapper.module\), P\)"):
        copy.deepcopy(wrapped)
    with pytest.raises(TypeError, match=r"DataParallel: expected no copy of the wrapper .* "
                                        r"DataParallel\(copy.deepcopy\(wrapper.module\), P\)"):
        copy.copy(wrapped)
    assert isinstance(copy.deepcopy(wrapped.module), torch.nn.Sequential)


@sizes(2, 3)
def test_a_gradient_freed_by_zero_grad_and_unused_on_some_workers(P_world, comm):
    """A parameter reduced at one step, its .grad freed by zero_grad() (set_to_none, torch's default) and unused at
    the next on worker 1 only: its None gradient counts as zeros, as at a first call (the check for a gradient
    accumulated since the last call read None's version: AttributeError there, the others waited)."""
    x = random_tensor((3, 2), seed=comm.rank).float()
    for op in ("sum", "avg"):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        for step in range(2):
            model.zero_grad()
            used = step == 0 or comm.rank != 1
            y = model["a"](x) + (model["b"](x) if used else 0)
            y.sum().backward()
            all_reduce_gradients(model, P_world, op=op)
            expected = comm.allreduce(x.sum(0).numpy() if used else 0 * x.sum(0).numpy())  # d/dW_b: each row
            if op == "avg":
                expected = expected / comm.size
            torch.testing.assert_close(model["b"].weight.grad, torch.from_numpy(expected).expand(2, 2))



@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's forward AD scripts functions with torch.jit
@sizes(1, 2, 3)
def test_torch_func_and_forward_mode_are_refused(P_world, comm):
    """Under torch.func's transforms the wrapper's broadcasts met wrappers without memory (torch's "Cannot access
    data pointer" on every member); forward-mode AD is refused as by the primitives. Either is named, and the wrapper
    steps as before after it."""
    import torch.autograd.forward_ad as forward_ad
    x, y = _batch(5, seed=comm.rank)
    wrapped = DataParallel(_mlp(0), P_world, op="sum")
    params = dict(wrapped.named_parameters())

    def loss(p):
        return ((torch.func.functional_call(wrapped, p, (x,)) - y) ** 2).sum()
    for transform in (lambda: torch.func.grad(loss)(params), lambda: torch.func.vjp(loss, params)):
        with pytest.raises(NotImplementedError, match=r"DataParallel: torch.func transforms \(vmap, grad"):
            transform()
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match=r"DataParallel: forward-mode AD"):
        wrapped(forward_ad.make_dual(x, torch.ones_like(x)))
    _step(wrapped, x, y)
    batches = comm.allgather((x, y))
    _assert_grads(wrapped, _grads(_mlp(0), torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])))


@sizes(2, 3)
@pytest.mark.parametrize("checked", [False, True])
def test_a_wrapper_dropped_after_a_backward_that_raised(P_world, comm, checked):
    """A backward that raised on every member after the wrapper's sums (and, in check mode, its check) had started,
    caught, and the wrapper dropped: their buffers went to the garbage collector while MPI could still write them (a
    segfault at the next step). They stay alive; a new wrapper steps as before."""
    import distdl
    n = 7
    x, y = _batch(n, seed=3)
    expected = _grads(_mlp(0), x, y)
    rows = _rows(n, comm.size, comm.rank)

    def fail(grad):
        raise RuntimeError("a hook failed")
    with distdl.checking() if checked else contextlib.nullcontext():
        for _ in range(2):
            wrapped = DataParallel(_mlp(0), P_world, bucket_cap_mb=TINY_CAP, op="sum")
            wrapped.module[0].weight.register_hook(fail)  # the last gradient: the other buckets have started
            with pytest.raises(RuntimeError, match="a hook failed"):
                _step(wrapped, x[rows], y[rows])
            del wrapped
            gc.collect()
        wrapped = DataParallel(_mlp(0), P_world, bucket_cap_mb=TINY_CAP, op="sum")
        _step(wrapped, x[rows], y[rows])
    _assert_grads(wrapped, expected)
