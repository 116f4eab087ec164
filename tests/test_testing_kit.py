"""The test kit users check their own layers with: a wrong layer fails, on every worker, without a hang."""

import numpy as np
import pytest
import torch

from distdl.functional.repartition import repartition
from distdl.testing import assert_adjoint, assert_sequential_equivalence, gather, random_tensor, scatter
from helpers import sizes


class _Backward(torch.autograd.Function):
    """The identity, whose backward is ``backward(grad)``: a wrong one for the kit to catch."""

    @staticmethod
    def forward(ctx, x, backward):
        ctx.backward = backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward(grad), None


def _one_element_off(grad):
    grad = grad.clone()
    grad.view(-1)[:1] *= 1.001
    return grad


def _pair(P_world, comm):
    """A repartition from rows to columns: its backward is collective, so a worker that left early would hang."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    P_y = P_world.create_cartesian_topology_partition((1, comm.size))
    return P_x, P_y, lambda x: repartition(x, P_x, P_y)


@sizes(2, 3)
@pytest.mark.parametrize("wrong", ["forward", "gradient"])
def test_a_difference_on_one_worker_fails_on_every_worker(P_world, comm, wrong):
    P_x, P_y, op = _pair(P_world, comm)

    def distributed(x):
        y = op(x)
        if comm.rank != 1:
            return y
        if wrong == "forward":  # one element off
            return y + torch.nn.functional.one_hot(torch.tensor(0), y.shape[-1]) * 1e-3
        return _Backward.apply(y, _one_element_off)  # right values; one element of the cotangent off
    what = "forward differs from the sequential result on rank 1" if wrong == "forward" else "input gradient differs"
    with pytest.raises(AssertionError, match=what):
        assert_sequential_equivalence(distributed, lambda x: x, random_tensor((4, 5), seed=1), P_x, P_y)
    assert_sequential_equivalence(op, lambda x: x, random_tensor((4, 5), seed=1), P_x, P_y)  # and the right one


@sizes(2, 3)
def test_float32_is_compared_at_its_own_precision(P_world, comm):
    """A column sum of row blocks adds in another order than torch: float32 rounds apart, beyond float64's
    tolerances, and passes; a gradient 1e-3 off still fails."""
    from distdl.functional.all_sum_reduce import all_sum_reduce
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))

    def column_sum(x, backward=lambda g: g):
        y = all_sum_reduce(_Backward.apply(x, backward).sum(0, keepdim=True), P_x, axes_reduce=(0,))
        return y if comm.rank == 0 else y[:0]  # the (1, m) sum is rank 0's block of P_x
    x = random_tensor((3 * comm.size, 256), seed=4, dtype=torch.float32)
    assert_sequential_equivalence(column_sum, lambda x: x.sum(0, keepdim=True), x, P_x, P_x)
    with pytest.raises(AssertionError, match="input gradient differs"):
        assert_sequential_equivalence(lambda x: column_sum(x, _one_element_off), lambda x: x.sum(0, keepdim=True),
                                      x, P_x, P_x)


@sizes(1, 2)
def test_complex_random_tensors_and_cotangents(P_world, comm):
    z = random_tensor((64,), seed=3, dtype=torch.complex128)
    assert z.imag.abs().max() > 0.5 and z.real.abs().max() > 0.5
    P = P_world.create_cartesian_topology_partition((comm.size,))
    with pytest.raises(AssertionError, match="input gradient differs"):  # a backward that drops the imaginary part
        assert_sequential_equivalence(lambda x: _Backward.apply(x, lambda g: g.real.to(g.dtype)), lambda x: x, z,
                                      P, P)


@sizes(1, 2)
def test_adjoint_probe_is_random(P_world, comm):
    """A wrong adjoint is caught whatever x the caller passes (zeros made both inner products 0)."""
    with pytest.raises(AssertionError, match="assert_adjoint"):
        assert_adjoint(lambda x: _Backward.apply(x, lambda g: g.flip(0)), torch.zeros(6), comm,
                       adjoint_of_adjoint=False)


@sizes(2, 3)
def test_gather_refuses_blocks_it_would_cast_or_misplace(P_world, comm):
    P = P_world.create_cartesian_topology_partition((comm.size,))
    x = scatter(random_tensor((2 * comm.size + 1,), seed=4), P)
    with pytest.raises(ValueError, match="gather: expected blocks of 1 dimensions and one dtype"):
        gather(x.float() if comm.rank == 1 else x, P)
    with pytest.raises(ValueError, match="gather: expected the blocks of a balanced decomposition"):
        gather(torch.ones(3 if comm.rank == 0 else 1), P)
    blocks = scatter(random_tensor((2 * comm.size + 1, 2), seed=5), P_world.create_cartesian_topology_partition(
        (comm.size, 1)))
    torch.testing.assert_close(gather(blocks[:, :1], P_world.create_cartesian_topology_partition((comm.size, 1))),
                               random_tensor((2 * comm.size + 1, 2), seed=5)[:, :1])  # a sliced block (it raised)


@sizes(1, 2)
def test_sequential_equivalence_refuses_integer_input(P_world, comm):
    """An integer x_global raises TypeError naming the kit on every worker, before any communication (it raised
    torch's "only Tensors of floating point dtype can require gradients"); the next calls pair up."""
    P = P_world.create_cartesian_topology_partition((comm.size,))

    def distributed(x):
        raise AssertionError("called")  # the check comes first
    with pytest.raises(TypeError, match=r"assert_sequential_equivalence: expected x_global of a floating or "
                                        r"complex dtype \(its input gradient is compared\), got torch.int64"):
        assert_sequential_equivalence(distributed, lambda x: x, torch.arange(2 * comm.size), P, P)
    assert_sequential_equivalence(lambda x: x.clone(), lambda x: x, random_tensor((5,), seed=2), P, P)


@sizes(2, 3)
def test_scatter_checks_the_dimension_on_every_worker(P_world, comm):
    """Workers outside P raise too (they returned a zero-volume tensor before the check); preserve_batch keeps
    the batch extent there."""
    P = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    with pytest.raises(ValueError, match=r"scatter: expected a tensor of 2 dimensions for a partition of shape "
                                         r"\(1, 1\), got shape \(4,\)"):
        scatter(torch.ones(4), P)
    assert scatter(torch.ones(3, 4), P).shape == ((3, 4) if comm.rank == 0 else (0,))
    assert scatter(torch.ones(3, 4), P, preserve_batch=True).shape == ((3, 4) if comm.rank == 0 else (3, 0))


class _NotDifferentiable(torch.autograd.Function):
    """The identity, with a backward that cannot be differentiated again."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return grad.clone()


@sizes(2, 3)
@pytest.mark.parametrize("cut", ["leaf", "detached", "None", "below", "collective"])
def test_an_output_cut_from_the_graph_fails_on_every_worker(P_world, comm, cut):
    """Right values on every worker, but on worker 1 the output carries no gradient back: the other workers
    waited in the repartition's backward, worker 1 in the kit's agreement (a hang), or worker 1 alone raised
    torch's error (a detached output) or an AttributeError (None); now every worker fails before the backward.
    "below": an output in a graph (a detached value plus a parameter) that does not reach the input, which
    passed the kit's check and hung; "collective": an output that reaches the input, but not the repartition made
    for it (a detached value plus a term in the input), which hung too."""
    P_x, P_y, op = _pair(P_world, comm)

    def distributed(x):
        y = op(x)
        if comm.rank != 1:
            return y
        if cut == "below":
            return y.detach() + torch.zeros_like(y, requires_grad=True)
        if cut == "collective":
            return y.detach() + 0 * x.sum()
        return {"leaf": y.detach().requires_grad_(), "detached": y.detach(), "None": None}[cut]
    what = {"None": "is a NoneType, not a tensor",
            "collective": r"does not depend on the result of its Repartition \(detached on the way\?\), where other "
                          "workers' do"}.get(cut, "is not in the autograd graph of the input")
    with pytest.raises(AssertionError, match=f"the output on rank 1 {what}"):
        assert_sequential_equivalence(distributed, lambda x: x, random_tensor((4, 5), seed=1), P_x, P_y)
    with pytest.raises(AssertionError, match=f"assert_adjoint: the output on rank 1 {what}"):
        assert_adjoint(distributed, scatter(torch.zeros(4, 5), P_x), comm)
    assert_adjoint(op, scatter(torch.zeros(4, 5), P_x), comm)  # the next calls pair up


@sizes(1, 2)
def test_a_backward_that_is_not_differentiable(P_world, comm):
    """The adjoint of the adjoint needs a differentiable backward: without one the kit says so (it compared a
    zero for the second inner product, under the first check's labels)."""
    op = _NotDifferentiable.apply
    with pytest.raises(AssertionError, match=r"assert_adjoint: the backward on rank \d is not differentiable .* "
                                             r"adjoint_of_adjoint=False"):
        assert_adjoint(op, torch.zeros(5), comm)
    assert_adjoint(op, torch.zeros(5), comm, adjoint_of_adjoint=False)
    with pytest.raises(AssertionError, match=r"assert_adjoint \(adjoint of the adjoint\): <F\* y, v> = .* but "
                                             r"<y, F\*\* v> = "):
        assert_adjoint(lambda x: _Backward.apply(x, lambda g: _Backward.apply(g, lambda h: 2 * h)), torch.zeros(5),
                       comm)  # the adjoint right, its adjoint twice what it should be


@sizes(1, 2)
def test_an_unused_input_has_a_zero_gradient(P_world, comm):
    """The zero operator whose backward gives the input no gradient (None): its gradient is zero, as is its
    adjoint's adjoint (the equivalence compared None with the zeros and failed; the adjoint's adjoint said the
    backward was not differentiable)."""
    P = P_world.create_cartesian_topology_partition((comm.size, 1))

    def zero(x):
        return _Backward.apply(x, lambda g: None) * 0
    assert_sequential_equivalence(zero, lambda x: x * 0, random_tensor((3, 2), seed=5), P, P)
    assert_adjoint(zero, scatter(torch.zeros(3, 2), P), comm)
    w = torch.ones((), requires_grad=True)  # a sequential operator whose input gets no gradient either
    assert_sequential_equivalence(zero, lambda x: torch.zeros_like(x) * w, random_tensor((3, 2), seed=5), P, P)
    with pytest.raises(AssertionError, match="input gradient differs on rank"):  # and a zero gradient is compared
        assert_sequential_equivalence(zero, lambda x: x - x.detach(), random_tensor((3, 2), seed=5), P, P)
    # a sequential result outside the graph: zero too (torch's "does not require grad" from its backward)
    assert_sequential_equivalence(zero, torch.zeros_like, random_tensor((3, 2), seed=5), P, P)
    with pytest.raises(AssertionError, match=r"input gradient differs on rank \d+ \(the sequential result is not in "
                                             r"the autograd graph: zero expected\)"):
        assert_sequential_equivalence(lambda x: x * 1, lambda x: x.detach(), random_tensor((3, 2), seed=5), P, P)


@sizes(2, 3)
@pytest.mark.parametrize("backward", ["None", "not differentiable"])
def test_a_backward_differentiable_on_some_workers_only(P_world, comm, backward):
    """On worker 1 the backward gives the input no gradient, or one that cannot be differentiated again: the
    adjoint of the adjoint fails on every worker (the others waited in the repartition's double backward)."""
    P_x, P_y, op = _pair(P_world, comm)
    local = {"None": lambda x: _Backward.apply(x, lambda g: None) * 0, "not differentiable": _NotDifferentiable.apply}

    def distributed(x):
        return op(local[backward](x) if comm.rank == 1 else x)
    what = ("is not differentiable" if backward == "not differentiable" else
            r"does not depend on the result of its Repartition \(detached on the way\?\)")
    with pytest.raises(AssertionError, match=f"assert_adjoint: the backward on rank 1 {what}.*"
                                             "pass adjoint_of_adjoint=False"):
        assert_adjoint(distributed, scatter(torch.zeros(4, 5), P_x), comm)
    assert_adjoint(distributed, scatter(torch.zeros(4, 5), P_x), comm, adjoint_of_adjoint=False)


@sizes(2, 3)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_dtypes_are_compared_at_their_precision(P_world, comm, dtype):
    """A convolution's halo gradients add in another order than torch's: a unit in the last place of the largest
    terms apart, beyond torch's atol of 1e-5, and passes; a gradient 10% off in one element still fails."""
    from distdl.nn import DistributedFeatureConv2d
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size, 1))
    layer, ref = DistributedFeatureConv2d(P_x, 2, 3, 3, padding=1).to(dtype), torch.nn.Conv2d(2, 3, 3, padding=1)
    ref = ref.to(dtype)
    with torch.no_grad():
        for p, q, seed in ((layer.weight, ref.weight, 1), (layer.bias, ref.bias, 2)):
            q.copy_(random_tensor(q.shape, seed=seed))
            p.copy_(q)
    x = random_tensor((2, 2, 7, 5), seed=4, dtype=dtype)
    assert_sequential_equivalence(layer, ref, x, P_x, P_x)

    def far_off(grad):
        grad = grad.clone()
        grad.view(-1)[:1] *= 1.1
        return grad
    with pytest.raises(AssertionError, match="input gradient differs"):
        assert_sequential_equivalence(lambda x: layer(_Backward.apply(x, far_off)), ref, x, P_x, P_x)


@sizes(2, 3)
def test_complex_operators(P_world, comm):
    """A complex input is drawn complex (it was drawn real, leaving the imaginary parts unchecked), and a real
    input into a complex output gets a complex cotangent (torch raised on the float64 one)."""
    P_x, P_y, op = _pair(P_world, comm)
    z = scatter(torch.zeros(4, 5, dtype=torch.complex128), P_x)
    assert_adjoint(op, z, comm)
    assert_adjoint(lambda x: op(x) * (1 - 2j), scatter(torch.zeros(4, 5), P_x), comm)
    with pytest.raises(AssertionError, match="assert_adjoint"):  # a backward that drops the imaginary part
        assert_adjoint(lambda x: _Backward.apply(op(x), lambda g: g.real.to(g.dtype)), z, comm,
                       adjoint_of_adjoint=False)


@sizes(2, 3)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_arguments_of_the_kit(P_world, comm):
    """Non-tensors, freed partitions and integer dtypes are named errors on every worker (gather raised
    AttributeError on one worker while the others waited; a freed partition passed for one without members)."""
    P = P_world.create_cartesian_topology_partition((comm.size,))
    x = scatter(random_tensor((2 * comm.size + 1,), seed=4), P)
    with pytest.raises(TypeError, match="gather: expected a tensor on every worker, got a ndarray on rank 1"):
        gather(x.numpy() if comm.rank == 1 else x, P)
    with pytest.raises(TypeError, match="scatter: expected a tensor for x_global, got ndarray"):
        scatter(x.numpy(), P)
    with pytest.raises(ValueError, match=r"gather: expected the blocks of a balanced decomposition \(they add up "
                                         r"to shape .*\), got \(3,\) at \(0,\), \(1,\) at \(1,\)"):
        gather(torch.ones(3 if comm.rank == 0 else 1), P)
    with pytest.raises(TypeError, match="random_tensor: expected a floating or complex dtype, got torch.int64"):
        random_tensor((2,), seed=0, dtype=torch.int64)
    assert random_tensor(3, seed=0).shape == (3,)
    from distdl import describe
    Q = P_world.create_cartesian_topology_partition((comm.size,))
    Q.free()
    for call, where in [(lambda: scatter(torch.ones(comm.size), Q), "scatter"), (lambda: gather(x, Q), "gather"),
                        (lambda: describe(Q), "describe")]:
        with pytest.raises(ValueError, match=f"{where}( \\(P\\))?: the partition of shape .* was freed"):
            call()
    torch.testing.assert_close(gather(x, P), random_tensor((2 * comm.size + 1,), seed=4), rtol=0, atol=0)
    # a wrong kind of argument is named, before any communication (AttributeError or TypeError from inside)
    with pytest.raises(TypeError, match="assert_sequential_equivalence \\(x_global\\): expected a torch.Tensor, "
                                        "got ndarray"):
        assert_sequential_equivalence(lambda x: x, lambda x: x, x.numpy(), P, P)
    with pytest.raises(TypeError, match="assert_sequential_equivalence: expected an MPIPartition for P_y, got "
                                        "Intracomm"):
        assert_sequential_equivalence(lambda x: x, lambda x: x, x, P, comm)
    with pytest.raises(TypeError, match=r"assert_adjoint: expected an MPI communicator for comm, got MPIPartition "
                                        r"\(a partition's is its .comm\)"):
        assert_adjoint(lambda x: x, x, P)
    with pytest.raises(TypeError, match="assert_adjoint \\(x\\): expected a torch.Tensor, got ndarray"):
        assert_adjoint(lambda x: x, x.numpy(), comm)
    for call, where in [(lambda: scatter(x, comm), "scatter"), (lambda: gather(x, None), "gather")]:
        with pytest.raises(TypeError, match=f"{where}: expected an MPIPartition for P, got"):
            call()
    assert random_tensor(np.int64(3), seed=0).shape == (3,)
    for dtype in (torch.float8_e4m3fn, torch.complex32):  # dtypes torch cannot pickle
        y = random_tensor((2 * comm.size + 1, 2), seed=4, dtype=dtype)
        Q = P_world.create_cartesian_topology_partition((comm.size, 1))
        assert gather(scatter(y, Q), Q).view(torch.uint8).equal(y.view(torch.uint8))


@sizes(1, 2, 3)
def test_an_inf_does_not_loosen_the_16_bit_tolerance(P_world, comm):
    """The scaled atol of the 16-bit dtypes came from the largest magnitude expected: one inf made it inf, and every
    finite value passed (a layer off by 5 everywhere, in float16). It comes from the finite values now."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x = random_tensor((2 * comm.size, 3), seed=1, dtype=torch.float16)
    x[::2, 0] = 60000  # doubled: inf in every worker's block
    with pytest.raises(AssertionError, match="forward differs from the sequential result"):
        assert_sequential_equivalence(lambda t: t * 2 + 5, lambda t: t * 2, x, P_x, P_x)
    assert_sequential_equivalence(lambda t: t * 2, lambda t: t * 2, x, P_x, P_x)


@sizes(1, 2, 3)
def test_a_nan_in_one_part_of_a_complex_value_hides_nothing(P_world, comm):
    """torch's equal_nan takes a complex value with NaN in either part for NaN: a layer whose imaginary parts were
    off wherever the real part is NaN passed. The parts are compared there."""
    P_x = P_world.create_cartesian_topology_partition((comm.size, 1))
    x = random_tensor((comm.size + 2, 3), seed=1, dtype=torch.complex128)
    x.real[:, 0] = float("nan")
    with pytest.raises(AssertionError, match="forward differs from the sequential result"):
        assert_sequential_equivalence(lambda t: t + 5j * t.real.isnan(), lambda t: t * 1, x, P_x, P_x)
    assert_sequential_equivalence(lambda t: t * 1, lambda t: t * 1, x, P_x, P_x)


@sizes(2, 3)
def test_a_sequential_backward_raising_on_one_worker_fails_on_every_worker(P_world, comm):
    """The sequential operator's backward raised torch's error on that worker alone, the others waiting in the
    distributed backward (a hang where it was caught)."""
    P_x, P_y, op = _pair(P_world, comm)

    def fail(grad):
        raise RuntimeError("wrong on purpose")

    def sequential(x):
        return _Backward.apply(x, fail) if comm.rank == comm.size - 1 else x * 1
    with pytest.raises(AssertionError, match=f"assert_sequential_equivalence: the sequential operator's backward "
                                             f"raised on rank {comm.size - 1}: RuntimeError: wrong on purpose"):
        assert_sequential_equivalence(op, sequential, random_tensor((4, 5), seed=1), P_x, P_y)


@sizes(2, 3)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_layer_raising_on_one_worker_fails_on_every_worker(P_world, comm, where):
    """A layer that raises on the last worker alone, after its collectives (forward, or its backward): the others
    waited for ever in the kit's next collective, while the caller caught the error there. Every worker raises."""
    P_x, P_y, op = _pair(P_world, comm)

    def fail(grad):
        raise RuntimeError("wrong on purpose")

    def distributed(x):
        last = comm.rank == comm.size - 1
        y = op(_Backward.apply(x, fail) if last and where == "backward" else x)  # raising after op's backward
        if last and where == "forward":
            fail(y)
        return y
    what = "the distributed operator" + ("'s backward" if where == "backward" else "")
    with pytest.raises(AssertionError, match=f"assert_sequential_equivalence: {what} raised on rank "
                                             f"{comm.size - 1}: RuntimeError: wrong on purpose"):
        assert_sequential_equivalence(distributed, lambda x: x, random_tensor((4, 5), seed=1), P_x, P_y)
    with pytest.raises(AssertionError, match=f"assert_adjoint: the {where if where == 'backward' else 'operator'} "
                                             f"raised on rank {comm.size - 1}: RuntimeError: wrong on purpose"):
        assert_adjoint(distributed, scatter(torch.zeros(4, 5), P_x), comm)


@sizes(2, 3)
@pytest.mark.parametrize("what", ["x_global", "the sequential result"])
def test_inputs_that_differ_between_workers_are_named(P_world, comm, what):
    """An x_global drawn unseeded, or a sequential operator whose parameters differ per worker: a correct layer
    failed as if it were wrong ("forward differs"). The kit names what differs."""
    P_x, P_y, op = _pair(P_world, comm)
    x = random_tensor((4, 5), seed=1 + (comm.rank if what == "x_global" else 0))
    sequential = (lambda t: t) if what == "x_global" else (lambda t: t + comm.rank)
    with pytest.raises(AssertionError, match=f"{what} on rank 1 differs from rank 0's"):
        assert_sequential_equivalence(op, sequential, x, P_x, P_y)


@sizes(1, 2)
def test_adjoint_seeds_of_any_size(P_world, comm):
    """A seed past 2**63 (a time in nanoseconds times the kit's factor) raised torch's overflow error."""
    P_x, _, op = _pair(P_world, comm)
    assert_adjoint(op, scatter(torch.zeros(4, 5), P_x), comm, seed=10**15)
    assert random_tensor(3, seed=2**70 + 5).equal(random_tensor(3, seed=(2**70 + 5) % 2**63))


@sizes(1, 2, 3)
def test_nan_where_the_sequential_result_has_nan(P_world, comm):
    """A NaN where the sequential result has one is equal (a correct layer failed "forward differs"); a sequential
    result that is not a tensor is named on every worker (torch's AttributeError, or a hang where it was one on
    some workers only); a NumPy integer seed works."""
    P_x, P_y, op = _pair(P_world, comm)
    x = random_tensor((4, 5), seed=np.int64(1))
    x[1, 2] = float("nan")
    assert_sequential_equivalence(lambda t: op(t * 2), lambda t: t * 2, x, P_x, P_y)
    with pytest.raises(AssertionError, match="forward differs"):
        assert_sequential_equivalence(lambda t: op(t * 2).nan_to_num(), lambda t: t * 2, x, P_x, P_y)
    with pytest.raises(AssertionError, match="the sequential result on rank 0 is a tuple, not a tensor"):
        assert_sequential_equivalence(op, lambda t: (t,) if comm.rank == 0 else t, x, P_x, P_y)
