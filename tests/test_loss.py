"""Distributed losses: every member holds torch's loss of the gathered tensors and gets the exact gradient."""

import pytest
import torch
import torch.nn.functional as F

from distdl.nn import loss as losses
from distdl.testing import random_tensor, scatter
from helpers import sizes

# (partition shape, global input shape): 1-3 dimensions, uneven splits, a worker with an empty block.
CASES = {1: [((1,), (5,)), ((1, 1, 1), (2, 3, 4))],
         2: [((2,), (5,)), ((1, 2), (3, 5)), ((2, 1, 1), (3, 2, 4))],
         3: [((3,), (7,)), ((3, 1), (2, 4)), ((1, 1, 3), (2, 3, 5))],
         4: [((4,), (6,)), ((2, 2), (3, 5)), ((2, 1, 2), (3, 2, 4))]}


def _inputs(name, shape, seed):
    """Global input and target valid for the loss ``name``, the same on every worker."""
    x, t = random_tensor(shape, seed), random_tensor(shape, seed + 1)
    if name == "BCELoss":
        return torch.sigmoid(x), torch.sigmoid(t)
    if name == "BCEWithLogitsLoss":
        return x, torch.sigmoid(t)
    if name == "KLDivLoss":
        return F.log_softmax(x, dim=-1), F.softmax(t, dim=-1)
    if name == "PoissonNLLLoss":
        return x.abs() + 0.1, torch.floor(t.abs() * 3)  # positive rates serve log_input=False too
    return x, t


LOSSES = [("MSELoss", {}), ("L1Loss", {}), ("BCELoss", {}), ("BCEWithLogitsLoss", {}), ("KLDivLoss", {}),
          ("KLDivLoss", {"log_target": True}), ("PoissonNLLLoss", {}),
          ("PoissonNLLLoss", {"log_input": False, "full": True})]


def _check(P_x, distributed, sequential, x, t, comm, target_partition=None, tol=1e-12):
    """Every worker: the loss value (members) and, after backward() everywhere, the input gradient."""
    split = target_partition or (lambda t: scatter(t, P_x))  # how the target (and "none" loss) is laid out
    x_ref = x.clone().requires_grad_()
    expected = sequential(x_ref, t)
    x_local = scatter(x, P_x).requires_grad_()
    y = distributed(x_local, split(t))
    if distributed.reduction == "none":
        if P_x.active:
            torch.testing.assert_close(y, split(expected.detach()), rtol=tol, atol=tol)
        dy = random_tensor(expected.shape, seed=99)
        expected.backward(dy)
        y.backward(split(dy))
    else:
        assert y.shape == ()
        if P_x.active:
            torch.testing.assert_close(y, expected.detach(), rtol=tol, atol=tol)
        else:
            assert y.item() == 0
        expected.backward()
        y.backward()  # on every rank, members and outsiders alike
    if P_x.active:
        torch.testing.assert_close(x_local.grad, scatter(x_ref.grad, P_x), rtol=tol, atol=tol,
                                   msg=lambda m: f"gradient differs on rank {comm.rank}: {m}")


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning")  # torch's KLDivLoss
@sizes(1, 2, 3, 4)
def test_elementwise_losses_match_torch(P_world, comm):
    for P_shape, shape in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        for name, kwargs in LOSSES:
            reductions = ("mean", "sum", "none") + (("batchmean",) if name == "KLDivLoss" else ())
            for reduction in reductions:
                distributed = getattr(losses, "Distributed" + name)(P_x, reduction=reduction, **kwargs)
                sequential = getattr(torch.nn, name)(reduction=reduction, **kwargs)
                x, t = _inputs(name, shape, seed=len(name))
                _check(P_x, distributed, sequential, x, t, comm)


@sizes(1, 2, 3, 4)
def test_binary_cross_entropy_weights_match_torch(P_world, comm):
    """weight and pos_weight are global tensors broadcastable to the input (target): each worker applies its block."""
    for P_shape, shape in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        full, last = random_tensor(shape, seed=7).abs() + 0.5, random_tensor(shape[-1:], seed=8).abs() + 0.5
        broadcast = full[(0,) * (len(shape) - 1)].reshape((1,) * (len(shape) - 1) + shape[-1:])
        for name, kwargs in (("BCELoss", {"weight": full}), ("BCELoss", {"weight": broadcast}),
                             ("BCEWithLogitsLoss", {"weight": last, "pos_weight": last}),
                             ("BCEWithLogitsLoss", {"pos_weight": full})):
            for reduction in ("mean", "sum", "none"):
                distributed = getattr(losses, "Distributed" + name)(P_x, reduction=reduction, **kwargs)
                sequential = getattr(torch.nn, name)(reduction=reduction, **kwargs)
                _check(P_x, distributed, sequential, *_inputs(name, shape, seed=3), comm)
    with pytest.raises(TypeError, match="DistributedBCELoss: expected a torch.Tensor or None for weight, got str"):
        losses.DistributedBCELoss(P_x, "sum")
    with pytest.raises(ValueError, match=r"DistributedBCEWithLogitsLoss: expected a pos_weight of at most"):
        losses.DistributedBCEWithLogitsLoss(P_x, pos_weight=torch.ones((1,) * (P_x.dim + 1)))


@sizes(1, 2, 3, 4)
def test_cross_entropy_matches_torch(P_world, comm):
    n = comm.size
    P_x = P_world.create_cartesian_topology_partition((n, 1) if n < 4 else (2, 1, 2))
    shape = (5, 4) if n < 4 else (3, 4, 3)  # (N, C) or (N, C, d); the class axis is not partitioned

    def target_partition(t):  # partitioned like the input without its class axis
        return scatter(t.unsqueeze(1), P_x).squeeze(1) if P_x.active else scatter(t, P_x)

    x = random_tensor(shape, seed=1)
    t = torch.randint(0, 4, shape[:1] + shape[2:], generator=torch.Generator().manual_seed(2))
    t.view(-1)[1] = -100  # an ignored target
    weight = random_tensor((4,), seed=3).abs() + 0.5
    for kwargs in ({}, {"weight": weight}, {"label_smoothing": 0.2}, {"weight": weight, "label_smoothing": 0.1},
                   {"ignore_index": 2}):
        for reduction in ("mean", "sum", "none"):
            distributed = losses.DistributedCrossEntropyLoss(P_x, reduction=reduction, **kwargs)
            sequential = torch.nn.CrossEntropyLoss(reduction=reduction, **kwargs)
            _check(P_x, distributed, sequential, x, t.clamp_min(0) if "ignore_index" in kwargs else t, comm,
                   target_partition)
    probabilities = F.softmax(random_tensor(shape, seed=4), dim=1)  # class-probability targets
    for reduction in ("mean", "sum"):
        distributed = losses.DistributedCrossEntropyLoss(P_x, weight=weight, reduction=reduction, label_smoothing=0.1)
        sequential = torch.nn.CrossEntropyLoss(weight=weight, reduction=reduction, label_smoothing=0.1)
        _check(P_x, distributed, sequential, x, probabilities, comm)


@sizes(1, 2, 3, 4)
def test_cross_entropy_weight_that_requires_grad(P_world, comm):
    """With class-probability targets torch differentiates the class weight: the replicated weight's gradient is
    the total over P_x on every member (each held its own rows' share), with workers whose block is empty."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    shape = (comm.size + 1, 4) if comm.size < 3 else (comm.size - 1, 4)  # uneven, or the last block empty
    x = random_tensor(shape, seed=1)
    t = F.softmax(random_tensor(shape, seed=2), dim=1)
    for reduction in ("mean", "sum", "none"):
        weight = (random_tensor((4,), seed=3).abs() + 0.5).requires_grad_()
        ours = weight.detach().clone().requires_grad_()
        expected = F.cross_entropy(x, t, weight=weight, reduction=reduction, label_smoothing=0.1)
        y = losses.DistributedCrossEntropyLoss(P_x, weight=ours, reduction=reduction, label_smoothing=0.1)(
            scatter(x, P_x), scatter(t, P_x))
        if reduction == "none":
            dy = random_tensor(expected.shape, seed=4)
            expected.backward(dy)
            y.backward(scatter(dy.unsqueeze(1), P_x).squeeze(1))
        else:
            expected.backward()
            y.backward()
        torch.testing.assert_close(ours.grad, weight.grad, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"{reduction}: weight gradient differs on rank {comm.rank}: {m}")


@sizes(2, 3)
def test_hessian_of_a_mean_over_uneven_blocks(P_world, comm):
    """torch.autograd.functional.hessian backwards once per element of each worker's own gradient: the mean's
    count joined the graph, so each of those ran an all-sum, as many as the worker's block has elements (a hang)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size,))
    x, t = random_tensor((2 * comm.size - 1,), seed=1), random_tensor((2 * comm.size - 1,), seed=2)
    for loss, sequential, reduction in ((losses.DistributedMSELoss, F.mse_loss, "mean"),
                                        (losses.DistributedKLDivLoss, F.kl_div, "batchmean")):
        distributed = loss(P_x, reduction=reduction)
        t_local = scatter(t, P_x)
        hessian = torch.autograd.functional.hessian(lambda a: distributed(a, t_local), scatter(x, P_x))
        expected = torch.autograd.functional.hessian(lambda a: sequential(a, t, reduction=reduction), x)
        block = scatter(torch.arange(x.numel()), P_x)
        torch.testing.assert_close(hessian, expected[block][:, block], rtol=1e-12, atol=1e-12)


@sizes(1, 2, 3)
def test_cross_entropy_with_nothing_counted(P_world, comm):
    """A mean over targets that all weigh 0 or are all ignored is torch's 0 / 0: nan, with the gradients torch
    gives (nan, or 0 where every target is ignored), also where label smoothing adds to the sum (it was inf)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x = random_tensor((5, 4), seed=7)
    t = torch.tensor([1, 2, 1, -100, 2])
    weight = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # the targets' classes weigh 0
    for kwargs, target in (({"weight": weight, "label_smoothing": 0.1}, t), ({"weight": weight}, t),
                           ({"label_smoothing": 0.1}, torch.full((5,), -100)), ({}, torch.full((5,), -100))):
        x_ref = x.clone().requires_grad_()
        expected = torch.nn.CrossEntropyLoss(**kwargs)(x_ref, target)
        expected.backward()
        x_local = scatter(x, P_x).requires_grad_()
        loss = losses.DistributedCrossEntropyLoss(P_x, **kwargs)(x_local, scatter(target.unsqueeze(1), P_x).squeeze(1))
        loss.backward()
        assert expected.isnan() and loss.isnan(), (kwargs, loss, comm.rank)
        torch.testing.assert_close(x_local.grad, scatter(x_ref.grad, P_x), equal_nan=True)


@sizes(1, 2, 3, 4)
def test_inactive_workers_and_float32(P_world, comm):
    P_x = P_world.create_partition_inclusive([comm.size - 1]).create_cartesian_topology_partition((1, 1))
    for reduction in ("mean", "sum", "none"):
        x, t = _inputs("MSELoss", (3, 4), seed=0)
        _check(P_x, losses.DistributedMSELoss(P_x, reduction=reduction), torch.nn.MSELoss(reduction=reduction),
               x, t, comm)
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x, t = (v.float() for v in _inputs("BCEWithLogitsLoss", (7, 3), seed=5))
    _check(P_x, losses.DistributedBCEWithLogitsLoss(P_x), torch.nn.BCEWithLogitsLoss(), x, t, comm, tol=1e-6)
    outside = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1,))
    loss = losses.DistributedL1Loss(outside)(torch.zeros(0), torch.zeros(0))
    if not outside.active:
        assert loss.shape == () and loss.requires_grad
        loss.backward()  # a constant input still gives a loss one can call backward() on
        for dtype in (torch.int64, torch.bool):  # integer placeholders too (torch refused a grad for their sum)
            placeholder = torch.zeros(0, dtype=dtype)
            loss = losses.DistributedMSELoss(outside)(placeholder, placeholder)
            assert loss.dtype == torch.get_default_dtype() and loss.requires_grad
            loss.backward()
    with torch.no_grad():  # but not where no graph is recorded, members and outsiders alike
        assert not losses.DistributedL1Loss(outside)(torch.zeros(0), torch.zeros(0)).requires_grad
    outside_2d = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    for loss in (losses.DistributedL1Loss(outside, reduction="none"),
                 losses.DistributedCrossEntropyLoss(outside_2d, reduction="none")):
        if not outside.active:  # (the zero-volume loss had no autograd history)
            loss(torch.zeros(0), torch.zeros(0, dtype=torch.long)).sum().backward()


@sizes(2, 3)
def test_workers_outside_get_the_members_dtype(P_world, comm):
    """The loss has torch's dtype on every worker, outside P_x too: promoted, real for a complex input, float32
    for bfloat16 under autocast (they returned their placeholder's dtype)."""
    P_x = P_world.create_partition_inclusive(range(1, comm.size)).create_cartesian_topology_partition((comm.size - 1,))
    x, t = random_tensor((5,), seed=comm.rank), random_tensor((5,), seed=comm.rank + 7)  # float64
    cases = [(losses.DistributedMSELoss, F.mse_loss, x.float(), t, False),
             (losses.DistributedL1Loss, F.l1_loss, torch.complex(x, t), torch.complex(t, x), False),
             (losses.DistributedMSELoss, F.mse_loss, x.bfloat16(), t.bfloat16(), True),
             (losses.DistributedBCEWithLogitsLoss, F.binary_cross_entropy_with_logits, x.bfloat16(),
              t.sigmoid().bfloat16(), True)]
    for layer, function, input, target, autocast in cases:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            expected = function(input, target).dtype
            loss = layer(P_x)(scatter(input, P_x), scatter(target, P_x))
        assert loss.dtype == expected, f"rank {comm.rank}: {layer.__name__} gave {loss.dtype}, torch {expected}"


@sizes(1, 2, 3)
def test_a_complex_or_integer_loss_is_refused_where_a_sum_would_change_it(P_world, comm):
    """A complex Poisson loss lost its imaginary part in the float64 sum (silently); an integer L1 loss's mean was
    truncated where torch refuses it. Every member raises; 'sum' of integers and 'none' stay torch's."""
    P_x = P_world.create_cartesian_topology_partition((comm.size,))
    x, t = random_tensor((5,), seed=comm.rank), random_tensor((5,), seed=comm.rank + 7)
    with pytest.raises(TypeError, match=r"DistributedPoissonNLLLoss: expected inputs whose loss is real for reduction "
                                        r"'mean', got a torch.complex128 loss from torch.complex128 input"):
        losses.DistributedPoissonNLLLoss(P_x)(torch.complex(x, t), torch.complex(t, x))
    i, j = (10 * x).long(), (10 * t).long()
    with pytest.raises(TypeError, match=r"DistributedL1Loss: expected floating-point inputs for reduction 'mean' "
                                        r"\(as torch's\), got torch.int64"):
        losses.DistributedL1Loss(P_x)(i, j)
    i_all, j_all = (torch.cat([(10 * random_tensor((5,), seed=r + k)).long() for r in range(comm.size)])
                    for k in (0, 7))
    total = losses.DistributedL1Loss(P_x, reduction="sum")(i, j)
    assert total.dtype == torch.int64 and total == F.l1_loss(i_all, j_all, reduction="sum")
    none = losses.DistributedPoissonNLLLoss(P_x, reduction="none")(torch.complex(x, t), torch.complex(t, x))
    torch.testing.assert_close(none, F.poisson_nll_loss(torch.complex(x, t), torch.complex(t, x), reduction="none"))


@sizes(2, 3)
def test_check_mode_an_input_that_is_not_a_dense_tensor_on_one_worker(P_world, comm):
    """A sparse input or a list on worker 1: in check mode every member raises (the others waited in the sum); so
    does a class weight that requires grad on worker 1 alone (its backward alone would sum its gradient)."""
    from distdl.checks import CollectiveMismatchError, checking
    P_x = P_world.create_cartesian_topology_partition((comm.size,))
    x, t = random_tensor((3,), seed=comm.rank), random_tensor((3,), seed=comm.rank + 5)
    for bad in (x.to_sparse(), x.tolist()):
        with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedMSELoss: ranks disagree on failed "
                                                                      r"with: ranks? 0(, 2)? ha(s|ve) nothing; rank 1 "
                                                                      r"has TypeError"):
            losses.DistributedMSELoss(P_x)(bad if comm.rank == 1 else x, t)
    with checking():
        assert losses.DistributedMSELoss(P_x)(x, t).shape == ()
    x = random_tensor((2, 3), seed=comm.rank)
    weight = torch.ones(3, dtype=torch.float64, requires_grad=comm.rank == 1)  # its sum in the backward: rank 1's
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedCrossEntropyLoss: ranks disagree on "
                                                                  r"buffers requiring grad: "):
        losses.DistributedCrossEntropyLoss(P_x, weight=weight)(x, F.softmax(x, dim=1))


@sizes(2, 3)
def test_blocks_of_another_dtype_or_kind_of_target_on_one_worker(P_world, comm):
    """Float32 blocks on worker 1 and float64 elsewhere, or class indices on worker 1 and probabilities elsewhere:
    every member raises, naming them (the members returned losses of different dtypes, or a loss of no model)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x, t = _inputs("KLDivLoss", (2 * comm.size, 3), seed=3)
    x, t = scatter(x, P_x), scatter(t, P_x)
    with pytest.raises(ValueError, match=r"DistributedKLDivLoss: expected blocks of one dtype \(and one kind of "
                                         r"target\) on every member of P_x, got torch.float64 on workers? 0(, 2)?; "
                                         r"torch.float32 on worker 1"):
        losses.DistributedKLDivLoss(P_x)(*((x.float(), t.float()) if comm.rank == 1 else (x, t)))
    logits, labels = scatter(random_tensor((2 * comm.size, 4), seed=4), P_x), torch.arange(2) % 4
    one_hot = F.one_hot(labels, 4).double()
    with pytest.raises(ValueError, match=r"DistributedCrossEntropyLoss: expected blocks of one dtype"):
        losses.DistributedCrossEntropyLoss(P_x)(logits, labels if comm.rank == 1 else one_hot)


@sizes(1, 2)
def test_errors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    with pytest.raises(ValueError, match=r"DistributedMSELoss: expected reduction in \['mean', 'sum', 'none'\], "
                                         r"got 'batchmean'"):
        losses.DistributedMSELoss(P_x, reduction="batchmean")
    loss = losses.DistributedMSELoss(P_x)
    with pytest.raises(ValueError, match=r"DistributedMSELoss: expected an input of 2 dimensions to match P_x of "
                                         r"shape \(\d, 1\), got shape \(3,\)"):
        loss(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match=rf"DistributedMSELoss: expected a target of shape \(3, 2\) \(the input's "
                                         rf"block is \(3, 2\)\), got shape \(3, 1\) on worker {comm.rank}"):
        loss(torch.ones(3, 2), torch.ones(3, 1))
    with pytest.raises(TypeError, match="DistributedMSELoss: expected a torch.Tensor, got float"):
        loss(torch.ones(3, 2), 1.0)
    if comm.size == 2:
        with pytest.raises(ValueError, match=r"DistributedCrossEntropyLoss: expected a partition of at least 2 "
                                             r"dimensions whose class axis \(1\) has extent 1, got shape \(1, 2\)"):
            losses.DistributedCrossEntropyLoss(P_world.create_cartesian_topology_partition((1, 2)))
    ce = losses.DistributedCrossEntropyLoss(P_x)
    with pytest.raises(ValueError, match=r"DistributedCrossEntropyLoss: expected a target of shape \(3,\)"):
        ce(torch.ones(3, 4), torch.ones(3, 4, dtype=torch.long))


@pytest.mark.filterwarnings("ignore:indexing with dtype torch.uint8 is now deprecated")
@sizes(1, 2, 3)
def test_cross_entropy_weight_with_byte_targets(P_world, comm):
    """torch takes uint8 class indices; the weighted count of a 'mean' must read them as classes, not as a boolean
    mask of the weight (a block of as many targets as classes passed as one: a silently wrong mean)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x = random_tensor((4 * comm.size, 4), seed=1)
    t = torch.randint(0, 4, (4 * comm.size,), generator=torch.Generator().manual_seed(2)).to(torch.uint8)
    weight = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    for kwargs in ({"weight": weight}, {"weight": weight, "ignore_index": 3}):
        _check(P_x, losses.DistributedCrossEntropyLoss(P_x, **kwargs), torch.nn.CrossEntropyLoss(**kwargs), x, t,
               comm, lambda t: scatter(t.unsqueeze(1), P_x).squeeze(1))


@sizes(2, 3, 4)
def test_a_block_failing_on_one_worker_raises_on_every_member(P_world, comm):
    """A class index out of range, or a probability outside [0, 1], on one worker: torch's error there, a ValueError
    naming that worker on the others, and the next call pairs up; a weight of the wrong global size (which a block
    could broadcast against silently) fails alike."""
    n, last = comm.size, comm.size - 1
    P_x = P_world.create_cartesian_topology_partition((n, 1))
    ce = losses.DistributedCrossEntropyLoss(P_x)
    x = random_tensor((2, 3), seed=comm.rank)
    bad = torch.tensor([0, 7 if comm.rank == last else 2])
    with pytest.raises(IndexError if comm.rank == last else ValueError, match="out of bounds" if comm.rank == last
                       else rf"DistributedCrossEntropyLoss: the loss failed on worker {last} of P_x"):
        ce(x, bad)
    _check(P_x, ce, torch.nn.CrossEntropyLoss(), random_tensor((2 * n, 3), seed=5),
           torch.arange(2 * n) % 3, comm, lambda t: scatter(t.unsqueeze(1), P_x).squeeze(1))
    mse = losses.DistributedMSELoss(P_x)  # a target block of the wrong shape on one worker (an uneven split)
    with pytest.raises(ValueError, match=r"DistributedMSELoss: expected a target of shape \(2, 3\)" if comm.rank == last
                       else rf"DistributedMSELoss: the loss failed on worker {last} of P_x"):
        mse(x, torch.ones((3 if comm.rank == last else 2), 3))
    bce = losses.DistributedBCELoss(P_x)
    p = torch.full((2, 1), 2.0 if comm.rank == 0 else 0.5)
    with pytest.raises(RuntimeError if comm.rank == 0 else ValueError, match="between 0 and 1" if comm.rank == 0
                       else "DistributedBCELoss: the loss failed on worker 0 of P_x"):
        bce(p, torch.full((2, 1), 0.5))
    # A weight of 2n - 1 over the global input's 2n features: blocks of 2 but the last, of 1 (which broadcast over
    # its 2 features silently); and one too long.
    P_y = P_world.create_cartesian_topology_partition((1, n))
    x, t = scatter(random_tensor((2, 2 * n), seed=1), P_y), scatter(torch.rand(2, 2 * n), P_y)
    for size, failing in ((2 * n - 1, last), (2 * n + 1, 0)):  # balanced blocks: the last of 1, the first of 3
        logits = losses.DistributedBCEWithLogitsLoss(P_y, weight=torch.ones(size))
        message = (r"expected a weight broadcastable to the global input" if comm.rank == failing else
                   rf"the loss failed on worker {failing} of P_x")
        with pytest.raises(ValueError, match="DistributedBCEWithLogitsLoss: " + message):
            logits(x, t)


@sizes(2, 3)
def test_blocks_of_no_global_tensor_raise_on_every_worker(P_world, comm):
    """Along a feature split, a worker with another batch size: the loss summed the blocks silently (no global
    tensor has them); every worker raises, and the next call pairs up."""
    P_x = P_world.create_cartesian_topology_partition((1, comm.size))
    loss = losses.DistributedMSELoss(P_x)
    x, t = random_tensor((3, 5), seed=1), random_tensor((3, 5), seed=2)
    x_block, t_block = scatter(x, P_x), scatter(t, P_x)
    if comm.rank == 1:
        x_block, t_block = x_block[:2], t_block[:2]
    with pytest.raises(ValueError, match=r"DistributedMSELoss: expected the blocks of one global tensor \(the same "
                                         r"extent of dimension 0 on every worker of P_x\)"):
        loss(x_block, t_block)
    torch.testing.assert_close(loss(scatter(x, P_x), scatter(t, P_x)), F.mse_loss(x, t), rtol=1e-12, atol=0)
