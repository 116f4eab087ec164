"""DistributedBatchNorm: forward, input and parameter gradients and running statistics equal torch's."""

import inspect
import re

import pytest
import torch

from distdl.nn.batchnorm import DistributedBatchNorm
from distdl.testing import assert_sequential_equivalence, random_tensor, scatter
from distdl.utilities.torch import zero_volume_tensor
from helpers import sizes

TORCH_BN = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
TORCH_BN_BIAS = "bias" in inspect.signature(torch.nn.BatchNorm1d).parameters  # torch 2.13 on; 2.11 has none

# (partition shape, global input shape): uneven splits, a worker with an empty batch, 2-4 dimensions.
CASES = {
    1: [((1, 1, 1), (4, 3, 5)), ((1, 1), (6, 3))],
    2: [((2, 1, 1), (5, 3, 4)), ((1, 1, 2), (3, 3, 5)), ((2, 1), (7, 3))],
    3: [((3, 1, 1), (5, 3, 4)), ((1, 1, 3), (2, 3, 7)), ((1, 1, 3, 1), (2, 3, 5, 2))],
    4: [((2, 1, 2), (5, 3, 7)), ((4, 1, 1), (3, 3, 4)), ((1, 1, 2, 2), (3, 2, 5, 3)), ((4, 1), (6, 3))],
}


def _pair(P_x, x_shape, dtype=torch.float64, **kwargs):
    """A distributed layer and the torch layer, with the same random affine parameters."""
    ref = TORCH_BN[len(x_shape)](x_shape[1], **kwargs).to(dtype)
    layer = DistributedBatchNorm(P_x, x_shape[1], **kwargs).to(dtype)
    assert [name for name, _ in layer.named_parameters()] == [name for name, _ in ref.named_parameters()]
    with torch.no_grad():
        for name, parameter in ref.named_parameters():
            parameter.copy_(random_tensor((x_shape[1],), seed=len(name)))
            getattr(layer, name).copy_(parameter)
    return layer, ref


def _check_steps(P_x, layer, ref, x_shape, steps=3, dtype=torch.float64, tol=1e-10):
    for step in range(steps):
        shape = (x_shape[0] + (step % 2),) + x_shape[1:]  # a different batch size every other call
        x = (random_tensor(shape, seed=10 * step + 1) * 2 + 3).to(dtype)
        assert_sequential_equivalence(layer, ref, x, P_x, P_x, seed=step, rtol=tol, atol=tol)
        if P_x.active:
            for name, parameter in ref.named_parameters():
                torch.testing.assert_close(getattr(layer, name).grad, parameter.grad, rtol=tol, atol=tol)
            for name in ("running_mean", "running_var") if ref.track_running_stats else ():
                torch.testing.assert_close(getattr(layer, name), getattr(ref, name), rtol=tol, atol=tol)
            if ref.track_running_stats:
                assert layer.num_batches_tracked.item() == ref.num_batches_tracked.item()
        layer.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


@sizes(1, 2, 3, 4)
def test_training_and_eval_match_torch(P_world, comm):
    for P_shape, x_shape in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        layer, ref = _pair(P_x, x_shape)
        _check_steps(P_x, layer, ref, x_shape)
        layer.eval()
        ref.eval()
        _check_steps(P_x, layer, ref, x_shape, steps=1)


@sizes(1, 2, 3, 4)
def test_options_and_float32(P_world, comm):
    P_shape, x_shape = CASES[comm.size][0]
    P_x = P_world.create_cartesian_topology_partition(P_shape)
    for kwargs in ({"momentum": None}, {"track_running_stats": False}, {"affine": False, "eps": 1e-3},
                   {"bias": False}, {"affine": False, "bias": False}):
        if "bias" in kwargs and not TORCH_BN_BIAS:
            continue  # nothing in torch to compare with
        layer, ref = _pair(P_x, x_shape, **kwargs)
        ours = repr(layer) if TORCH_BN_BIAS else re.sub(r", bias=\w+", "", repr(layer))
        assert repr(ref).split("(", 1)[1][:-1] in ours  # torch's arguments, as torch names them
        assert list(layer.state_dict()) == list(ref.state_dict())
        _check_steps(P_x, layer, ref, x_shape, steps=2)
        layer.eval()
        ref.eval()
        _check_steps(P_x, layer, ref, x_shape, steps=1)
    layer, ref = _pair(P_x, x_shape, dtype=torch.float32)
    _check_steps(P_x, layer, ref, x_shape, steps=2, dtype=torch.float32, tol=1e-5)
    layer = DistributedBatchNorm(P_x, x_shape[1], track_running_stats=False).double()
    x = scatter(random_tensor(x_shape, seed=7), P_x)
    strided = x.transpose(0, -1).contiguous().transpose(0, -1)  # same values, not contiguous
    torch.testing.assert_close(layer(strided), layer(x))


@sizes(1, 2, 3, 4)
def test_subset_partitions_and_inactive_workers(P_world, comm):
    """A one-worker partition and a partition leaving rank 0 out: outsiders pass and get zero-volume."""
    subsets = [([0], (1, 1, 1))] + ([(list(range(1, comm.size)), (comm.size - 1, 1, 1))] if comm.size > 2 else [])
    for ranks, P_shape in subsets:
        P_x = P_world.create_partition_inclusive(ranks).create_cartesian_topology_partition(P_shape)
        layer, ref = _pair(P_x, (3, 2, 5))
        _check_steps(P_x, layer, ref, (3, 2, 5), steps=2)
        if not P_x.active:
            y = layer(torch.zeros(0, dtype=torch.float64))
            assert y.shape == (0,)
            with pytest.raises(ValueError, match=rf"DistributedBatchNorm: worker {comm.rank} is outside P_x"):
                layer(torch.ones(3, 2, 5))


@sizes(2, 3, 4)
def test_empty_blocks_and_frozen_parameters_in_backward(P_world, comm):
    """Workers whose block is empty and needs no gradient still join the backward's all-sum-reduce; so do
    workers whose copies of the parameters are frozen (in eval mode too)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    x_shape = (comm.size - 1, 3, 4)  # the last worker's block is empty
    layer, ref = _pair(P_x, x_shape, affine=False)
    x = random_tensor(x_shape, seed=5) * 2 + 3
    x_local = scatter(x, P_x)
    x_local.requires_grad_(x_local.numel() > 0)
    x_ref = x.clone().requires_grad_()
    dy = random_tensor(x_shape, seed=6)
    ref(x_ref).backward(dy)
    layer(x_local).backward(scatter(dy, P_x))
    if x_local.numel():
        torch.testing.assert_close(x_local.grad, scatter(x_ref.grad, P_x), rtol=1e-10, atol=1e-10)
    layer, ref = _pair(P_x, x_shape)
    layer(scatter(x, P_x))  # running statistics
    ref(x)
    for module in (layer, ref):
        module.eval().requires_grad_(False)
    _check_steps(P_x, layer, ref, x_shape, steps=1)
    layer.requires_grad_(comm.rank != 1)  # frozen on worker 1 only: the others' gradients are still the totals
    ref.requires_grad_(True)
    layer(scatter(x, P_x)).backward(scatter(dy, P_x))
    ref(x).backward(dy)
    for name, parameter in ref.named_parameters():
        grad = getattr(layer, name).grad
        assert grad is None if comm.rank == 1 else torch.allclose(grad, parameter.grad, rtol=1e-10, atol=1e-10)


@sizes(2, 3)
def test_a_block_of_another_dtype_on_one_worker(P_world, comm):
    """A float32 block on worker 1 under a float64 layer: the backward's sums are taken in float64 on every worker,
    as the forward's statistics are (they were summed as each worker's own dtype: mismatched bytes, silently wrong
    gradients of 1e9 and more)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    x_shape = (2 * comm.size + 1, 3, 4)
    layer, ref = _pair(P_x, x_shape)
    x = (random_tensor(x_shape, seed=5) * 2 + 3).float().double()  # values a float32 block holds exactly
    dy = random_tensor(x_shape, seed=6).float().double()
    dtype = torch.float32 if comm.rank == 1 else torch.float64
    x_local = scatter(x, P_x).to(dtype).requires_grad_()
    x_ref = x.clone().requires_grad_()
    y = layer(x_local)
    assert y.dtype == dtype
    y.backward(scatter(dy, P_x).to(dtype))
    ref(x_ref).backward(dy)
    tol = 1e-5
    torch.testing.assert_close(x_local.grad.double(), scatter(x_ref.grad, P_x), rtol=tol, atol=tol)
    for name, parameter in ref.named_parameters():
        torch.testing.assert_close(getattr(layer, name).grad, parameter.grad, rtol=tol, atol=tol)


@sizes(1, 2)
def test_double_backward_raises(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    layer = DistributedBatchNorm(P_x, 3).double()
    x = scatter(random_tensor((4, 3, 5), seed=1), P_x).requires_grad_()
    (grad,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()


@sizes(2, 3)
def test_double_backward_raises_on_workers_outside_too(P_world, comm):
    """Batch norm on the last worker between repartitions from and to worker 0: a gradient penalty raises torch's
    "differentiate twice" error on every worker. Worker 0 (outside the layer) went on into the repartition's
    collective in the second backward, where the last worker had raised, and waited forever."""
    from distdl.nn import DistributedMSELoss, Repartition
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1, 1))
    P_1 = P_world.create_partition_inclusive([comm.size - 1]).create_cartesian_topology_partition((1, 1, 1))
    norm, mse = DistributedBatchNorm(P_1, 2).double(), DistributedMSELoss(P_0)
    there, back = Repartition(P_0, P_1), Repartition(P_1, P_0)
    x = (random_tensor((2, 2, 4), seed=1) if P_0.active else zero_volume_tensor(dtype=torch.float64))
    x.requires_grad_()
    y = back(torch.tanh(norm(there(x))))
    (grad,) = torch.autograd.grad(mse(y, torch.zeros_like(y)), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        mse(grad, torch.zeros_like(grad)).backward()


@sizes(2, 3)
def test_bfloat16_accumulates_in_float32(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    layer = DistributedBatchNorm(P_x, 3).to(torch.bfloat16)
    x = random_tensor((7, 3, 6), seed=3) * 3 + 5
    y = layer(scatter(x.to(torch.bfloat16), P_x))
    assert y.dtype == torch.bfloat16
    expected = torch.nn.functional.batch_norm(x.to(torch.bfloat16).double(), None, None, training=True)
    torch.testing.assert_close(y.double(), scatter(expected, P_x), rtol=2e-2, atol=2e-2)


@sizes(1, 2, 3)
def test_state_dict_round_trip(P_world, comm):
    """A serial checkpoint loads into the distributed layer, which saves it back on rank 0 of P_x."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    ref = torch.nn.BatchNorm1d(3).double()
    with torch.no_grad():
        ref.weight.copy_(random_tensor((3,), seed=1))
        ref.bias.copy_(random_tensor((3,), seed=2))
    ref(random_tensor((6, 3, 4), seed=3) + 2)  # non-trivial running statistics
    ref.eval()
    layer = DistributedBatchNorm(P_x, 3, collect_state=True).double().eval()
    layer.load_state_dict(ref.state_dict() if P_x.rank == 0 else {})  # the others may pass nothing
    assert_sequential_equivalence(layer, ref, random_tensor((5, 3, 4), seed=4), P_x, P_x, rtol=1e-10, atol=1e-12)
    state = layer.state_dict()
    if P_x.rank == 0:
        assert list(state) == list(ref.state_dict())
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    else:
        assert list(state) == []
    # Rank 0's checkpoint decides: a missing key or a wrong shape is reported on every member.
    broken = {k: v for k, v in ref.state_dict().items() if k != "running_var"}
    with pytest.raises(RuntimeError, match='Missing key.*"running_var"'):
        layer.load_state_dict(broken if P_x.rank == 0 else ref.state_dict())
    layer.load_state_dict(broken, strict=False)
    wrong = {**ref.state_dict(), "bias": torch.zeros(4)}
    with pytest.raises(RuntimeError, match=r"size mismatch for bias"):
        layer.load_state_dict(wrong if P_x.rank == 0 else {})
    # Without collect_state every worker saves and loads its own (replicated) tensors.
    plain = DistributedBatchNorm(P_x, 3)
    assert list(plain.state_dict()) == list(ref.state_dict())


@sizes(1, 2)
def test_errors(P_world, comm):
    if comm.size == 2:
        with pytest.raises(ValueError, match=r"DistributedBatchNorm: expected a partition of at least 2 dimensions "
                                             r"whose channel axis \(1\) has extent 1, got shape \(1, 2\)"):
            DistributedBatchNorm(P_world.create_cartesian_topology_partition((1, 2)), 3)
    with pytest.raises(ValueError, match="DistributedBatchNorm: expected a partition of at least 2 dimensions"):
        DistributedBatchNorm(P_world, 3)
    with pytest.raises(TypeError, match="DistributedBatchNorm: expected an int for num_features, got 2.5"):
        DistributedBatchNorm(P_world, 2.5)
    with pytest.raises(TypeError, match="DistributedBatchNorm: expected a bool for collect_state, got 'no'"):
        DistributedBatchNorm(P_world.create_cartesian_topology_partition((comm.size, 1)), 3, collect_state="no")
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    layer = DistributedBatchNorm(P_x, 3)
    with pytest.raises(ValueError, match=r"DistributedBatchNorm: expected a tensor of 3 dimensions with 3 channels "
                                         r"\(dimension 1\) for P_x of shape \(\d, 1, 1\), got shape \(2, 3\)"):
        layer(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"with 3 channels .* got shape \(2, 4, 5\)"):
        layer(torch.ones(2, 4, 5))
    with pytest.raises(TypeError, match="DistributedBatchNorm: expected a floating-point tensor, got torch.int64"):
        layer(torch.ones(2, 3, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="DistributedBatchNorm: expected a torch.Tensor, got list"):
        layer([1.0])
    if comm.size == 1:
        with pytest.raises(ValueError, match="expected more than 1 value per channel when training, got 1"):
            layer(torch.ones(1, 3, 1))
        # batch statistics in eval mode too where there are no running ones, as torch
        untracked = DistributedBatchNorm(P_x, 3, track_running_stats=False).eval()
        with pytest.raises(ValueError, match="expected more than 1 value per channel when training, got 1"):
            untracked(torch.ones(1, 3, 1))
    # eps as torch's: > 0 with batch statistics, >= 0 with running ones (a constant channel gave NaN); on every
    # worker, outside P_x too
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1, 1))
    x = random_tensor((2, 3, 4), seed=comm.rank, dtype=torch.float32) if P_0.active else torch.zeros(0)
    for eps, training, tracked, expected in ((0.0, True, True, "> 0 with batch statistics, got 0.0"),
                                             (float("nan"), True, True, "> 0 with batch statistics, got nan"),
                                             (0.0, False, False, "> 0 with batch statistics, got 0.0"),
                                             (-1e-5, False, True, ">= 0, got -1e-05")):
        layer = DistributedBatchNorm(P_0, 3, eps=eps, track_running_stats=tracked).train(training)
        with pytest.raises(ValueError, match=re.escape(f"DistributedBatchNorm: expected eps {expected}")):
            layer(x)
    layer, ref = DistributedBatchNorm(P_0, 3, eps=0.0).eval(), torch.nn.BatchNorm1d(3, eps=0.0).eval()
    y = layer(x)  # torch runs eval with eps 0 too
    assert not P_0.active or torch.allclose(y, ref(x), rtol=1e-6, atol=1e-6)


@sizes(1, 2, 3)
def test_running_statistics_set_to_none_and_state_dicts_without_a_count(P_world, comm):
    """As torch: with running_mean and running_var set to None after construction, batch statistics in eval mode
    too and nothing to update in training (AttributeError until now); a state dict without num_batches_tracked
    (saved before torch's batch norms' version 2, or made by hand) loads and leaves the count (a missing key)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    layer, ref = _pair(P_x, (5, 3, 4))
    for module in (layer, ref):
        module.running_mean = module.running_var = None
    for step, mode in enumerate(("train", "eval", "train")):
        layer.train(mode == "train")
        ref.train(mode == "train")
        x = random_tensor((5 + step, 3, 4), seed=20 + step) * 2 + 3
        assert_sequential_equivalence(layer, ref, x, P_x, P_x, seed=step, rtol=1e-10, atol=1e-10)
        assert layer.num_batches_tracked.item() == ref.num_batches_tracked.item()
    assert ref.num_batches_tracked.item() == 2
    ref = torch.nn.BatchNorm1d(3).double()
    ref(random_tensor((6, 3, 4), seed=3))
    state = {k: v for k, v in ref.state_dict().items() if k != "num_batches_tracked"}  # no version metadata
    for collect_state in (False, True):
        layer = DistributedBatchNorm(P_x, 3, collect_state=collect_state).double()
        layer.num_batches_tracked.fill_(5)
        layer.load_state_dict(dict(state) if P_x.rank == 0 or not collect_state else {})
        assert layer.num_batches_tracked.item() == 5
        torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=0, atol=0)
    ref.load_state_dict(state)  # torch's own rule, kept by the layer
    assert ref.num_batches_tracked.item() == 1
    assert layer.state_dict()._metadata[""]["version"] == ref.state_dict()._metadata[""]["version"] == 2


@sizes(1, 2, 3)
def test_empty_global_batch_in_training(P_world, comm):
    """As torch: an empty output, the batch counted, the running statistics left as they were."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    layer, ref = _pair(P_x, (2, 3, 4))
    x = torch.zeros(0, 3, 4, dtype=torch.float64, requires_grad=True)
    y, y_ref = layer(x), ref(x)
    y.sum().backward()
    assert y.shape == y_ref.shape == (0, 3, 4)
    assert layer.num_batches_tracked.item() == ref.num_batches_tracked.item() == 1
    torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(layer.running_var, ref.running_var, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, torch.zeros(3, dtype=torch.float64), rtol=0, atol=0)


@sizes(1, 2, 3)
def test_means_far_above_the_spread(P_world, comm):
    """Moments merged about the global mean keep float64's precision where the mean is 1e6 times the spread,
    also where it moves between calls (merged about zero, or about the previous mean, 2e-4 was lost)."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1, 1))
    layer, ref = _pair(P_x, (5, 3, 4))
    per_channel = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64).view(1, 3, 1)
    for step, offset in enumerate((1e3, 1e6, -1e5)):
        x = random_tensor((5, 3, 4), seed=step) + offset * per_channel
        assert_sequential_equivalence(layer, ref, x, P_x, P_x, seed=step, rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(layer.running_var, ref.running_var, rtol=1e-8, atol=1e-8)


@sizes(2, 3, 4)
def test_blocks_of_no_global_tensor_raise_on_every_worker(P_world, comm):
    """Workers holding blocks that form no global tensor (along the length split, one with another batch size;
    on a 2-D grid, one with another length than the worker beside it in its column): the statistics summed
    them silently. Every worker raises; uneven blocks of one tensor still equal torch."""
    n = comm.size
    grid = (2, 1, n // 2) if n % 2 == 0 and n > 2 else (1, 1, n)
    P_x = P_world.create_cartesian_topology_partition(grid)
    layer = DistributedBatchNorm(P_x, 2).double()
    x = scatter(random_tensor((4, 2, 2 * n + 1), seed=1), P_x)
    if grid[0] == 1:  # another batch size on the last worker
        wrong, message = x[:1] if comm.rank == n - 1 else x, r"dimension 0 on every worker of P_x\)"
    else:  # another length on the last worker of the (2, 1, 2) grid than on worker 1, at its index along axis 2
        wrong, message = x[..., 1:] if comm.rank == n - 1 else x, r"dimension 2 on every worker at index 1 along axis 2"
    with pytest.raises(ValueError, match=r"DistributedBatchNorm: expected the blocks of one global tensor \(the same "
                                         r"extent of " + message):
        layer(wrong)
    g = random_tensor((4, 2, 2 * n + 1), seed=2)
    reference = torch.nn.BatchNorm1d(2).double()
    torch.testing.assert_close(layer(scatter(g, P_x)), scatter(reference(g), P_x), rtol=1e-12, atol=1e-12)
