"""Every worker takes part in a primitive's backward, also where its input needs no gradient.

A collective's adjoint needs all its members. A receive-only worker holds a placeholder that does
not require grad (or a worker feeds in data); without care its output would carry no autograd
history, its backward would skip the adjoint and the workers waiting for it would hang.
"""

import math

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

from distdl import functional as F
from distdl.functional import all_sum_reduce, broadcast, repartition, sum_reduce
from distdl.nn import (DistributedBatchNorm, DistributedLinear, DistributedLinearAllGather,
                       DistributedLinearReduceScatter)
from distdl.testing import random_tensor, scatter
from distdl.utilities.torch import zero_volume_tensor
from helpers import sizes


@sizes(2, 3)
def test_placeholders_without_grad(P_world, comm):
    n = comm.size
    P_0 = P_world.create_partition_inclusive([0])
    P_all = P_world.create_cartesian_topology_partition([n])
    # Only rank 0 has an input that requires grad; the others pass plain placeholders or data.
    x = random_tensor((4,), seed=1).requires_grad_() if P_0.active else zero_volume_tensor(dtype=torch.float64)
    y = broadcast(x, P_0, P_all)
    assert y.requires_grad
    y.backward(torch.ones_like(y))
    if P_0.active:
        torch.testing.assert_close(x.grad, torch.full((4,), float(n), dtype=torch.float64))
    data = random_tensor((3,), seed=comm.rank)  # data: no grad on any worker but rank 0
    if comm.rank == 0:
        data.requires_grad_()
    z = all_sum_reduce(data, P_all, axes_reduce=[0])
    z.sum().backward()
    if comm.rank == 0:
        torch.testing.assert_close(data.grad, torch.full((3,), float(n), dtype=torch.float64))
    w = sum_reduce(random_tensor((2,), seed=comm.rank), P_all, P_0)
    w.sum().backward()  # a no-grad input everywhere: runs without hanging
    v = repartition(random_tensor((n, 2), seed=0) if P_0.active else zero_volume_tensor(dtype=torch.float64),
                    P_0.create_cartesian_topology_partition([1, 1]), P_all.create_cartesian_topology_partition([n, 1]))
    v.sum().backward()


@sizes(2, 3)
def test_real_placeholders_for_complex_data(P_world, comm):
    """Workers with nothing to send hold the default (float32) placeholder while the data is complex: their
    empty gradients must be real, or autograd rejects them."""
    n = comm.size
    P_0, P_last = P_world.create_partition_inclusive([0]), P_world.create_partition_inclusive([n - 1])
    data = torch.complex(random_tensor((4,), seed=1), random_tensor((4,), seed=2))
    x = data.clone().requires_grad_() if P_0.active else zero_volume_tensor()
    for op, copies in ((lambda t: broadcast(t, P_0, P_world), n), (lambda t: sum_reduce(t, P_0, P_last), 1),
                       (lambda t: repartition(t, P_0, P_last), 1)):
        x.grad = None
        y = op(x)
        g = torch.complex(random_tensor(y.shape, seed=3), random_tensor(y.shape, seed=4))  # the same on every worker
        if y.requires_grad:  # the output of a worker in neither partition may not be in the graph
            y.backward(g if y.is_complex() else g.real.to(y.dtype))  # there: real (the placeholder's) and empty
        if P_0.active:
            torch.testing.assert_close(x.grad, copies * torch.complex(random_tensor((4,), seed=3),
                                                                      random_tensor((4,), seed=4)))
        else:
            assert x.grad is None or x.grad.shape == x.shape


@sizes(2, 3)
def test_integer_placeholders_for_floating_data(P_world, comm):
    """A receiving worker's integer placeholder cannot require grad: the floating data arriving in its place must
    join the graph all the same (its backward hung the senders); integer data stays outside the graph."""
    n = comm.size
    P_0, P_last = P_world.create_partition_inclusive([0]), P_world.create_partition_inclusive([n - 1])
    P_all = P_world.create_cartesian_topology_partition([n])
    for op, x_grad in ((lambda t: broadcast(t, P_0, P_all), lambda: sum(random_tensor((2 * n,), seed=10 + r)
                                                                          for r in range(n))),
                       (lambda t: sum_reduce(t, P_0, P_last), lambda: random_tensor((2 * n,), seed=10 + n - 1)),
                       (lambda t: repartition(t, P_0, P_all), lambda: torch.cat([random_tensor((2,), seed=10 + r)
                                                                                 for r in range(n)]))):
        x = random_tensor((2 * n,), seed=1).requires_grad_() if P_0.active else zero_volume_tensor(dtype=torch.int64)
        y = op(x)
        if y.requires_grad or y.numel():
            assert y.requires_grad and y.dtype == torch.float64
            y.backward(random_tensor(y.shape, seed=10 + comm.rank) if y.numel() else torch.zeros_like(y))
        else:  # a worker in neither partition of sum_reduce: it passes
            assert 0 < comm.rank < n - 1
        if P_0.active:
            torch.testing.assert_close(x.grad, x_grad())
        ids = torch.arange(2 * n) if P_0.active else zero_volume_tensor(dtype=torch.int64)
        assert not op(ids).requires_grad


@sizes(3)
def test_linear_with_receive_only_output_worker(P_world, comm):
    """DistributedLinear whose P_y worker is outside P_x and P_w, with an input that needs no gradient."""
    P_x = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    P_w = P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition([2, 1])
    P_y = P_world.create_partition_inclusive([1, 2]).create_cartesian_topology_partition([1, 2])
    layer = DistributedLinear(P_x, P_y, P_w, 4, 5).double()
    x = random_tensor((3, 4), seed=0) if P_x.active else zero_volume_tensor(dtype=torch.float64)
    y = layer(x)
    y.sum().backward()  # every rank returns: the adjoint ran on all of them
    if P_w.active:
        assert layer.weight.grad is not None


@sizes(3, 4)
def test_autograd_grad_requesting_placeholders(P_world, comm):
    """torch.autograd.grad as docs/concepts.md advises: every worker requests the parameters and the input, made to
    require grad everywhere. At 4 workers, 2 and 3 receive x's blocks on P_w only; at 3, worker 0 of P_x and P_y
    holds no parameter and sends dy on to P_w. Requesting parameters alone there skipped those adjoints, and the
    others waited for them."""
    def part(ranks, shape):
        return P_world.create_partition_inclusive(ranks).create_cartesian_topology_partition(shape)
    if comm.size == 4:
        P_x, P_w, P_y = part([0, 1], [1, 2]), part([0, 1, 2, 3], [2, 2]), part([2, 3], [1, 2])
    else:
        P_x, P_w, P_y = part([0], [1, 1]), part([1, 2], [2, 1]), part([0, 1], [1, 2])
    layer = DistributedLinear(P_x, P_y, P_w, 5, 4).double()
    x = scatter(random_tensor((3, 5), seed=1), P_x).requires_grad_()  # (0,) placeholders outside P_x
    y = layer(x)
    dy = random_tensor(y.shape, seed=10 + comm.rank)
    params = list(layer.parameters())
    grads = torch.autograd.grad(y, [x, *params], dy, allow_unused=True)
    layer(x).backward(dy)  # the same gradients by backward(), compared with sequential torch in test_linear
    for got, t in zip(grads, [x, *params]):
        if t.grad is None:
            assert got is None or got.numel() == 0, comm.rank
        else:
            torch.testing.assert_close(got, t.grad, rtol=1e-13, atol=1e-13, msg=str(comm.rank))


def _primitives(P_world, n):
    P = P_world.create_cartesian_topology_partition([n, 1])
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    widths = [[1 if P.rank else 0, 1 if P.rank < n - 1 else 0], [0, 0]]
    return {"all_sum_reduce": lambda t: F.all_sum_reduce(t, P, axes_reduce=[0]),
            "all_gather": lambda t: F.all_gather(t, P, axes_all_gather=[0]),
            "reduce_scatter": lambda t: F.reduce_scatter(t, P, axes_reduce_scatter=[0]),
            "broadcast": lambda t: F.broadcast(t if P_0.active else t[:0], P_0, P),
            "sum_reduce": lambda t: F.sum_reduce(t, P, P_0),
            "repartition": lambda t: F.repartition(t if P_0.active else t[:0], P_0, P),
            "halo_exchange": lambda t: F.halo_exchange(t, P, widths, widths, widths),
            "all_sum_reduce_forward": lambda t: F.all_sum_reduce_forward(t, P, axes_reduce=[0]),
            "all_sum_reduce_backward": lambda t: F.all_sum_reduce_backward(t, P, axes_reduce=[0])}


@sizes(2, 3)
def test_inputs_made_in_inference_mode(P_world, comm):
    """A tensor made under torch.inference_mode, used in grad mode (a batch from such a pipeline): the same
    result as a normal tensor (it used to raise: an inference tensor cannot be made to require grad)."""
    for name, op in _primitives(P_world, comm.size).items():
        x = random_tensor((2 * comm.size, 3), seed=comm.rank)
        with torch.inference_mode():
            frozen = x.clone()
        y = op(frozen)
        y.sum().backward()  # every worker takes part, as with any input
        torch.testing.assert_close(y, op(x), rtol=0, atol=0, msg=name)
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    P_y = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    layer = DistributedLinear(P_f, P_y, P_f, 6, 4).double()
    with torch.inference_mode():
        frozen = random_tensor((3, layer.weight.shape[1]), seed=comm.rank)
    layer(frozen).sum().backward()
    assert layer.weight.grad is not None
    P = P_world.create_cartesian_topology_partition((1, comm.size))
    for overlap in (False, True):  # without the ring, the reduce-scatter layer raised torch's error
        for layer in (DistributedLinearAllGather(P, 8, 12, overlap=overlap),
                      DistributedLinearReduceScatter(P, 8, 12, overlap=overlap)):
            with torch.inference_mode():
                frozen = random_tensor((5, layer.local_in_features), seed=comm.rank).float()
            layer(frozen).sum().backward()
            assert layer.weight.grad is not None


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's forward AD scripts functions with torch.jit
@sizes(2, 3)
def test_forward_mode_ad_is_refused(P_world, comm):
    """A dual tensor's tangent would be dropped (a zero derivative): every primitive raises instead, on every
    worker, also where its tensor is no dual (here on rank 0 alone: the others' placeholders of broadcast and
    repartition went on into the transfer, which waited for ever where rank 0 caught its error)."""
    for name, op in _primitives(P_world, comm.size).items():
        x = random_tensor((2 * comm.size, 3), seed=comm.rank)
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(x, torch.ones_like(x)) if comm.rank == 0 else x
            for grad_mode in (True, False):
                with torch.set_grad_enabled(grad_mode), pytest.raises(
                        NotImplementedError, match=rf"{name}: forward-mode AD \(torch.autograd.forward_ad\) is not "
                                                   "supported"):
                    op(dual)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@sizes(2)
def test_forward_mode_ad_is_refused_by_layers_outside_the_primitives(P_world, comm):
    """The overlapped rings and batch norm's eval mode run no primitive in the forward: they refuse a dual tensor
    themselves (its tangent was dropped, silently, where the input needed no gradient)."""
    P = P_world.create_cartesian_topology_partition((1, comm.size))
    P_image = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    layers = {"DistributedLinearAllGather": (DistributedLinearAllGather(P, 8, 12, overlap=True), (5, 4)),
              "linear_reduce_scatter": (DistributedLinearReduceScatter(P, 8, 12, overlap=True), (5, 4)),
              "DistributedBatchNorm": (DistributedBatchNorm(P_image, 3).eval(), (2, 3, 6))}
    for name, (layer, shape) in layers.items():
        for requires_grad in (False, True):
            x = random_tensor(shape, seed=comm.rank).float().requires_grad_(requires_grad)
            with forward_ad.dual_level(), pytest.raises(NotImplementedError, match=rf"{name}: forward-mode AD"):
                layer(forward_ad.make_dual(x, torch.ones_like(x)))


@sizes(2)
def test_torch_func_transforms_are_refused(P_world, comm):
    """Under vmap, grad or vjp a primitive gets wrappers without memory: every primitive names the transform instead
    of torch's internal errors."""
    for name, op in _primitives(P_world, comm.size).items():
        x = random_tensor((2 * comm.size, 3), seed=comm.rank)
        for transform in (lambda: torch.func.vmap(op)(x.unsqueeze(0)), lambda: torch.func.grad(
                lambda t: op(t).sum())(x), lambda: torch.func.vjp(op, x),
                lambda: torch.func.jvp(op, (x,), (torch.ones_like(x),))):  # named as forward-mode AD before
            with pytest.raises(NotImplementedError, match=rf"{name}: torch.func transforms \(vmap, grad"):
                transform()


@sizes(2, 3)
def test_batched_gradients_are_refused(P_world, comm):
    """is_grads_batched=True (and jacobian(vectorize=True)) runs backward under vmap: every primitive's backward
    names it, on every worker (torch's "Cannot access data pointer" came out of MPI's buffer code)."""
    for name, op in _primitives(P_world, comm.size).items():
        x = random_tensor((2 * comm.size, 3), seed=comm.rank).requires_grad_()
        y = op(x)
        with pytest.raises(NotImplementedError, match=r"\(backward\): batched gradients \(is_grads_batched=True"):
            torch.autograd.grad(y, x, torch.ones(2, *y.shape), is_grads_batched=True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.trace is deprecated
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@sizes(2)
def test_jit_trace_is_refused(P_world, comm):
    """The tracer cannot see what MPI writes, so a traced primitive or layer replayed the traced call's result for
    any later input (silently); every primitive raises instead."""
    from distdl.nn import DistributedLinearAllGather
    for name, op in _primitives(P_world, comm.size).items():
        x = random_tensor((2 * comm.size, 3), seed=comm.rank)
        with pytest.raises(NotImplementedError, match=rf"{name}: torch.jit.trace is not supported"):
            torch.jit.trace(op, (x,))
    layer = DistributedLinearAllGather(P_world.create_cartesian_topology_partition([1, comm.size]), 4, 6)
    with pytest.raises(NotImplementedError, match=r"all_gather: torch.jit.trace is not supported"):
        torch.jit.trace(layer, (torch.rand(3, 2),))


@sizes(3)
def test_workers_outside_a_layer_run_backward(P_world, comm):
    """A layer with parameters on workers 0 and 1, fed data that needs no gradient (a first layer): worker 2, outside
    it, gets a zero-volume output that backward runs through, as everywhere else (it used to have no autograd
    history, so its backward() raised)."""
    from distdl.nn import (DistributedBatchNorm, DistributedFeatureConv2d, DistributedLayerNorm,
                           DistributedLinearAllGather, DistributedLinearReduceScatter)
    two = P_world.create_partition_inclusive([0, 1])
    P_f, P_s = two.create_cartesian_topology_partition([1, 2]), two.create_cartesian_topology_partition([1, 1, 1, 2])
    P_y = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    layers = [(DistributedLinearAllGather(P_f, 4, 6), (3, 2)), (DistributedLinearReduceScatter(P_f, 4, 6), (3, 2)),
              (DistributedLinear(P_f, P_y, P_f, 4, 6), (3, 2)),
              (DistributedFeatureConv2d(P_s, 2, 3, 3, padding=1), (2, 2, 4, 3)),
              (DistributedBatchNorm(P_s, 2), (2, 2, 4, 3)), (DistributedLayerNorm(P_s, (4, 6)), (2, 2, 4, 3))]
    for layer, shape in layers:
        x = torch.rand(shape) if two.active else zero_volume_tensor()
        y = layer(x)
        assert y.requires_grad, type(layer).__name__
        y.sum().backward()  # every worker; those in the layer wait for each other's adjoints


@sizes(2)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_where_some_workers_save_nothing(P_world, comm, reentrant):
    """Checkpointed regions in which one worker saves tensors (a weight block, a local stage) and the other only runs
    collectives: every worker recomputes the region before its first backward collective in it (non-reentrant
    checkpointing recomputed on worker 1 only and hung, or paired a recomputed repartition with a backward one)."""
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    from distdl.nn import DistributedChannelConv1d, Repartition
    P_0, P_1 = (P_world.create_partition_inclusive([r]) for r in (0, 1))
    P0_2, P1_2 = (P.create_cartesian_topology_partition([1, 1]) for P in (P_0, P_1))
    P0_3, P1_3 = (P.create_cartesian_topology_partition([1, 1, 1]) for P in (P_0, P_1))
    linear = DistributedLinear(P0_2, P0_2, P1_2, 4, 3).double()
    conv = DistributedChannelConv1d(P0_3, P0_3, P1_3, 2, 3, 3, padding=1).double()
    stage = torch.nn.Linear(5, 5).double()
    there, back = Repartition(P0_3, P1_3), Repartition(P1_3, P0_3)
    pipeline = torch.nn.Sequential(there, torch.nn.Identity() if P_0.active else stage, back)
    cases = [(lambda f, x: checkpoint(f, x, use_reentrant=reentrant), linear, (2, 4)),
             (lambda f, x: checkpoint(f, x, use_reentrant=reentrant), conv, (2, 2, 5)),
             (lambda f, x: checkpoint(f, x, use_reentrant=reentrant), pipeline, (2, 2, 5)),
             (lambda f, x: checkpoint_sequential(f, 2, x, use_reentrant=reentrant), pipeline, (2, 2, 5))]
    for run, f, shape in cases:
        x = random_tensor(shape, seed=3) if P_0.active else zero_volume_tensor(dtype=torch.float64)
        grads = []
        for checkpointed in (False, True):
            x_k = x.clone().requires_grad_()
            for p in (*linear.parameters(), *conv.parameters(), *stage.parameters()):
                p.grad = None
            (run(f, x_k) if checkpointed else f(x_k)).square().sum().backward()
            grads.append([x_k.grad] + [p.grad for p in f.parameters()])
        assert grads[0][0].numel() == (math.prod(shape) if P_0.active else 0)
        assert any(g is not None and g.numel() for g in grads[0])  # worker 1 holds the weight or the stage
        torch.testing.assert_close(grads[1], grads[0])


@sizes(2, 3)
def test_selective_activation_checkpointing(P_world, comm):
    """torch's selective activation checkpointing hands a recomputation the tensors its policy kept from the
    forward's ops. A sum_reduce onto a worker that sources nothing summed in place into zeros made by torch, whose
    version counter does not see MPI's write: the recomputation added the others' blocks twice (silently wrong
    gradients, at sizes past the inline payloads). The overlapped reduce-scatter ring added into the products a
    policy keeps (torch's "mutated" error). Gradients equal those without checkpointing."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from distdl.nn import SumReduce

    def run(region, policy, x, params):
        grads = []
        for context in (None, functools.partial(create_selective_checkpoint_contexts, policy)):
            for t in (x, *params):
                t.grad = None
            y = region(x) if context is None else checkpoint(region, x, use_reentrant=False, context_fn=context)
            y.backward(random_tensor(y.shape, seed=20 + comm.rank))
            grads.append([t.grad for t in (x, *params)])
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)

    def all_but_tanh(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_RECOMPUTE if op == torch.ops.aten.tanh.default else CheckpointPolicy.PREFER_SAVE

    def products(ctx, op, *args, **kwargs):
        saved = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    n = comm.size
    P_x = P_world.create_partition_inclusive(list(range(1, n))).create_cartesian_topology_partition((n - 1, 1))
    P_y = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    reduce = SumReduce(P_x, P_y)
    for shape in ((2, 1), (64, 64)):  # inline in the header round; a data round
        w = random_tensor(shape, seed=7).requires_grad_()
        x = random_tensor(shape, seed=comm.rank) if P_x.active else zero_volume_tensor(dtype=torch.float64)
        run(lambda x: torch.tanh(reduce(x) * w) if P_y.active else reduce(x), all_but_tanh, x.requires_grad_(), [w])
    P_row = P_world.create_cartesian_topology_partition((1, n))
    torch.manual_seed(3)
    up = DistributedLinearAllGather(P_row, 6, 2 * n + 1, overlap=True)
    mlp = torch.nn.Sequential(up, torch.nn.Tanh(), DistributedLinearReduceScatter(up.P_y, 2 * n + 1, 5, overlap=True))
    x = scatter(random_tensor((4, 6), seed=9), P_row).requires_grad_()
    run(mlp.double(), products, x, list(mlp.parameters()))


@pytest.mark.parametrize("kind", ["tensor parallel", "DistributedLinear", "layer norm"])
@sizes(2, 3, 4)
def test_double_backward_through_layers_leaving_workers_out(P_world, comm, kind):
    """A gradient penalty through two stages on different workers, joined by repartitions whose unions hold every
    worker: (2 workers) stage a on {0}, b on {1}; (3) a on {0, 1}, b on {1, 2}; (4) a on {0, 1}, b on {1, 2, 3}.
    A layer's workers outside it returned a copy of their input, whose gradient does not refer to it: in the second
    backward they skipped the repartitions and collectives behind the layer, which the members ran, and the
    members waited for them forever. Values and gradients equal the sequential model's."""
    from distdl.nn import DistributedLayerNorm, DistributedMSELoss, Repartition
    from distdl.testing import scatter
    n = comm.size
    a, b = ([0], [1]) if n == 2 or kind == "DistributedLinear" else ([0, 1], list(range(1, n)))
    P_a = P_world.create_partition_inclusive(a).create_cartesian_topology_partition((1, len(a)))
    P_b = P_world.create_partition_inclusive(b).create_cartesian_topology_partition((1, len(b)))
    torch.manual_seed(5)
    if kind == "tensor parallel":
        stage_a, stage_b = (DistributedLinearAllGather(P, 6, 6, collect_state=True).double() for P in (P_a, P_b))
        sequential = [torch.nn.Linear(6, 6).double() for _ in range(2)]
    elif kind == "DistributedLinear":  # worker 0 holds x and y, the last worker the weight: 0 is outside P_w
        P_w = P_world.create_partition_inclusive([n - 1]).create_cartesian_topology_partition((1, 1))
        stage_a = DistributedLinear(P_a, P_a, P_w, 6, 6, collect_state=True).double()
        stage_b = DistributedLinearAllGather(P_b, 6, 6, collect_state=True).double()
        sequential = [torch.nn.Linear(6, 6).double() for _ in range(2)]
    else:
        stage_a = DistributedLinearAllGather(P_a, 6, 6, collect_state=True).double()
        stage_b = DistributedLayerNorm(P_b, 6, collect_state=True).double()
        with torch.no_grad():
            stage_b.weight.add_(random_tensor(stage_b.weight.shape, seed=9 + comm.rank) * 0.1 if P_b.active else 0)
        sequential = [torch.nn.Linear(6, 6).double(), torch.nn.LayerNorm(6).double()]
    distributed = torch.nn.ModuleList([stage_a, stage_b])
    sequential = torch.nn.ModuleList(sequential)
    sequential.load_state_dict(comm.bcast(distributed.state_dict(), root=0))
    to_b, to_a, loss = Repartition(P_a, P_b), Repartition(P_b, P_a), DistributedMSELoss(P_a)
    x, t = random_tensor((4, 6), seed=1), random_tensor((4, 6), seed=2)

    def penalised(layers, move_b, move_a, mse, x, t):
        x = x.requires_grad_()
        y = move_a(torch.tanh(layers[1](move_b(torch.tanh(layers[0](x)))))) + x
        (g,) = torch.autograd.grad(mse(y, t), [x], create_graph=True)
        mse(g, torch.zeros_like(g)).backward()
        return x.grad

    grad = penalised(distributed, to_b, to_a, loss, scatter(x, P_a), scatter(t, P_a))
    identity = torch.nn.Identity()
    expected = penalised(sequential, identity, identity, torch.nn.MSELoss(), x, t)
    torch.testing.assert_close(grad, scatter(expected, P_a), rtol=1e-10, atol=1e-12)
    for module in (distributed, sequential):
        torch.optim.SGD(module.parameters(), lr=1.0).step()
    state = distributed.state_dict()
    if comm.rank == 0:
        for key, value in sequential.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=key)


@pytest.mark.parametrize("form", ["feature", "general", "channel", "max pool", "average pool"])
@sizes(2, 3)
def test_gradient_penalty_alone_through_windowed_layers_with_empty_blocks(P_world, comm, form):
    """A penalty on the input gradient, backpropagated on its own (as a lazy R1 regulariser is), through a
    convolution or pooling where a worker's block is empty (fewer pixels or output channels than workers): the
    empty block's gradients refer to what torch's double backward refers to (the input and the weight), as the
    others' do, so every worker runs the collectives behind them (they referred to less: the others waited
    forever, or the empty worker raised torch's error)."""
    from distdl.nn import DistributedAvgPool1d, DistributedMaxPool1d
    from distdl.nn.conv import DistributedConv1d
    n, c_out = comm.size, 3
    if form == "channel":  # 1 output channel over 2 blocks: one worker's is empty (at 2 workers, outside P_x)
        c_out, P_x, P_y, P_w = 1, (1, 1, 1), (1, 2, 1), (2, 1, 1)
        x_shape = (1, 2, 5)
    else:  # n - 1 pixels over n workers along the length
        P_x = P_y = P_w = (1, 1, n)
        c_out, x_shape = (c_out, (1, 2, n - 1)) if "pool" not in form else (2, (1, 2, n - 1))
    P_x, P_y, P_w = (P_world.create_partition_inclusive(range(math.prod(s))).create_cartesian_topology_partition(s)
                     for s in (P_x, P_y, P_w))
    if "pool" in form:
        kind = DistributedMaxPool1d if form == "max pool" else DistributedAvgPool1d
        layer, reference = kind(P_x, 3, 1, 1), getattr(torch.nn, kind.__name__.removeprefix("Distributed"))(3, 1, 1)
    else:
        kwargs = dict(in_channels=2, out_channels=c_out, kernel_size=3, padding=1, dtype=torch.float64)
        layer = DistributedConv1d(P_x, **kwargs) if form == "feature" else DistributedConv1d(P_x, P_y, P_w, **kwargs)
        reference = torch.nn.Conv1d(**kwargs)
        with torch.no_grad():
            reference.weight.copy_(random_tensor(reference.weight.shape, seed=1))
            reference.bias.copy_(random_tensor(reference.bias.shape, seed=2))
            start = getattr(layer, "_start", (0, 0, 0))
            block = tuple(slice(a, a + k) for a, k in zip(start, layer.weight.shape))
            layer.weight.copy_(reference.weight[block])
            if layer.bias is not None:  # None outside P_w
                layer.bias.copy_(reference.bias[block[0]])
    x, dy = random_tensor(x_shape, seed=3), random_tensor(x_shape[:1] + (c_out,) + x_shape[2:], seed=4)

    def penalised(op, x, dy):  # requested with the parameters, as docs/concepts.md says (a worker outside P_x)
        x = x.requires_grad_()
        g = torch.autograd.grad(op(x), [x, *op.parameters()], dy, create_graph=True, allow_unused=True)[0]
        (g ** 2).sum().backward()
        return x.grad, getattr(op, "weight", None)

    (grad, weight), (expected, expected_weight) = (
        penalised(layer, scatter(x, P_x, preserve_batch=True),
                  scatter(dy, P_y) if P_y.active else zero_volume_tensor(1, dtype=torch.float64)),
        penalised(reference, x.clone(), dy))
    if P_x.active:  # None from torch counts as zero: the convolution's input gradient does not depend on it
        expected = scatter(torch.zeros_like(x) if expected is None else expected, P_x)
        torch.testing.assert_close(torch.zeros_like(expected) if grad is None else grad, expected)
    if weight is not None and P_w.active:
        torch.testing.assert_close(weight.grad, expected_weight.grad[block], rtol=1e-10, atol=1e-12)
