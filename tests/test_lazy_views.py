"""Inputs whose memory does not hold their values: lazily conjugated (``x.conj()``) and negated
views, and autograd's efficient zero tensors (no memory at all: the gradient of ``torch.sgn``, also
as a parameter's ``.grad``). MPI sees memory only, so the primitives must send the values.

Each primitive takes such tensors, inline (inside the header round) and not, and is compared with
the sequential result on random rank-varying data; the primitives, a windowed layer and the
gradient synchronisation also take zero tensors as they come from autograd.
"""

import warnings

import pytest
import torch

import distdl.backends.mpi as transport
from distdl.backends import cuda
from distdl.functional.all_gather import all_gather
from distdl.functional.all_sum_reduce import all_sum_reduce
from distdl.functional.broadcast import broadcast
from distdl.functional.reduce_scatter import reduce_scatter
from distdl.functional.repartition import repartition
from distdl.functional.sum_reduce import sum_reduce
from distdl.nn.batchnorm import DistributedBatchNorm
from distdl.nn.conv_feature import DistributedFeatureConv1d
from distdl.nn import data_parallel
from distdl.nn.data_parallel import DataParallel, all_reduce_gradients
from distdl.testing import random_tensor, scatter
from helpers import sizes


def _complex(shape, seed):
    return torch.complex(random_tensor(shape, seed), random_tensor(shape, seed + 1000))


# A conjugate view, a contiguous negative view (``x.conj().imag`` is one too, but strided, so that
# making it contiguous already resolves it), and a zero tensor of the same shape (autograd makes them
# as gradients; its data pointer is null).
VIEWS = {"conj": lambda t: t.conj(), "neg": lambda t: torch._neg_view(t.real.contiguous()),
         "zeros": lambda t: torch._efficientzerotensor(t.shape, dtype=t.dtype)}


def _lazy(t):
    return t.is_conj() or t.is_neg() or t._is_zerotensor()


def _sums(P_world, comm, lazy, xs):
    """Yield (result, expected, exact) of each sum; a worker outside the result's partition yields nothing."""
    mine, expected = lazy(xs[comm.rank]), lazy(sum(xs)).resolve_neg()
    yield all_sum_reduce(mine, P_world, [0]), expected, False
    P_root = P_world.create_partition_inclusive([comm.size - 1])
    total = sum_reduce(mine, P_world, P_root, preserve_batch=False)
    if P_root.active:
        yield total, expected, False
    P_rows = P_world.create_cartesian_topology_partition([comm.size, 1])
    yield reduce_scatter(mine, P_rows, [0]), scatter(expected, P_rows), False
    P_cols = P_world.create_cartesian_topology_partition([1, comm.size])
    yield reduce_scatter(mine, P_cols, [1]), scatter(expected, P_cols), False


def _moves(P_world, comm, lazy, xs):
    whole = lazy(xs[0])
    P_root = P_world.create_partition_inclusive([comm.size - 1])
    source = whole if P_root.active else lazy(torch.zeros(0, 0, dtype=torch.complex128))
    yield broadcast(source, P_root, P_world, preserve_batch=False), whole, True
    P_rows = P_world.create_cartesian_topology_partition([comm.size, 1])
    P_cols = P_world.create_cartesian_topology_partition([1, comm.size])
    block = lazy(scatter(xs[0], P_rows))  # a lazy view of this worker's block
    yield all_gather(block, P_rows, [0]), whole, True
    yield all_gather(lazy(scatter(xs[0], P_cols)), P_cols, [1]), whole, True
    yield repartition(block, P_rows, P_cols), scatter(whole, P_cols), True


@pytest.mark.parametrize("pairwise", [False, True], ids=["MPI", "pairwise"])
@pytest.mark.parametrize("primitives", [_sums, _moves], ids=["sums", "moves"])
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("rows", [2, 40])  # 2 x 3 elements ride in the header round; 40 x 3 do not
@sizes(1, 2, 3)
def test_primitives_send_the_values_of_lazy_views(P_world, comm, primitives, view, rows, pairwise, monkeypatch):
    if pairwise:  # distdl's own exchanges from 8 B: the sums' rows, the blocks along dimension 1
        monkeypatch.setattr(transport, "PAIRWISE_SUM_BYTES", 8)
    xs = [_complex((rows, 3), seed=10 * s + rows) for s in range(comm.size)]
    assert _lazy(VIEWS[view](xs[0]))
    results = list(primitives(P_world, comm, VIEWS[view], xs))  # every collective before any assertion
    for i, (y, expected, exact) in enumerate(results):
        assert not _lazy(y)
        if exact:
            assert torch.equal(y, expected), (i, comm.rank)
        else:
            torch.testing.assert_close(y, expected, msg=lambda m: f"{i} on rank {comm.rank}: {m}")


def _cases(P_world, comm, rows):
    """Return {name: (input, op)} for each primitive, a windowed layer and batch norm."""
    P_root = P_world.create_partition_inclusive([comm.size - 1])
    P_rows = P_world.create_cartesian_topology_partition([comm.size, 1])
    P_cols = P_world.create_cartesian_topology_partition([1, comm.size])
    P_line = P_world.create_cartesian_topology_partition([1, 1, comm.size])
    conv = DistributedFeatureConv1d(P_line, 2, 3, 3, padding=1, dtype=torch.float64)
    norm = DistributedBatchNorm(P_line, 2, dtype=torch.float64)
    whole = random_tensor((rows, 3), seed=rows + comm.rank)
    cases = {"all_sum_reduce": (whole, lambda x: all_sum_reduce(x, P_world, [0])),
             "broadcast": (whole if P_root.active else torch.zeros(0, 0, dtype=whole.dtype),
                           lambda x: broadcast(x, P_root, P_world, preserve_batch=False)),
             "sum_reduce": (whole, lambda x: sum_reduce(x, P_world, P_root, preserve_batch=False)),
             "all_gather": (scatter(whole, P_rows), lambda x: all_gather(x, P_rows, [0])),
             "reduce_scatter": (whole, lambda x: reduce_scatter(x, P_rows, [0])),
             "all_gather of columns": (scatter(whole, P_cols), lambda x: all_gather(x, P_cols, [1])),
             "reduce_scatter of columns": (whole, lambda x: reduce_scatter(x, P_cols, [1])),
             "repartition": (scatter(whole, P_rows), lambda x: repartition(x, P_rows, P_cols)),
             "conv": (scatter(random_tensor((2, 2, rows), seed=comm.rank), P_line), conv),
             "batch norm": (scatter(random_tensor((2, 2, rows), seed=comm.rank), P_line), norm)}
    return cases


def _through_sgn(P_world, comm, rows):
    """Yield (name, gradient of x) through each case followed by ``torch.sgn``, whose gradient autograd
    passes back as a zero tensor."""
    for name, (x, op) in _cases(P_world, comm, rows).items():
        x = x.clone().requires_grad_()
        torch.sgn(op(x)).sum().backward()
        yield name, x.grad


@pytest.mark.parametrize("pairwise", [False, True], ids=["MPI", "pairwise"])
@pytest.mark.parametrize("rows", [2, 40])
@sizes(1, 2, 3)
def test_zero_gradients_from_autograd(P_world, comm, rows, pairwise, monkeypatch):
    if pairwise:
        monkeypatch.setattr(transport, "PAIRWISE_SUM_BYTES", 8)
    grads = list(_through_sgn(P_world, comm, rows))  # every collective before any assertion
    for name, grad in grads:
        assert grad is not None and torch.equal(grad, torch.zeros(grad.shape, dtype=grad.dtype)), (name, comm.rank)


@pytest.mark.parametrize("in_place", [False, True], ids=["bucketed", "in place"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["all_reduce_gradients", "DataParallel"])
@sizes(1, 2, 3)
def test_zero_parameter_gradients_are_synchronised(P_world, comm, overlapped, in_place, monkeypatch):
    """A parameter used only through ``torch.sgn`` on some workers gets a zero tensor as ``.grad`` there; the
    synchronised gradient is the sum over the workers that used it directly."""
    if in_place:
        monkeypatch.setattr(data_parallel, "IN_PLACE_BYTES", 0)
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2, dtype=torch.float64)
    model = DataParallel(module, P_world, op="sum") if overlapped else module
    x = random_tensor((4, 3), seed=comm.rank)
    signs = comm.rank % 2 == 1  # odd workers use the weight only through its sign
    weight = torch.sgn(module.weight) if signs else module.weight
    torch.nn.functional.linear(x, weight, module.bias).sum().backward()  # DataParallel synchronises here
    if not overlapped:
        assert module.weight.grad._is_zerotensor() == signs
        all_reduce_gradients(module, P_world, op="sum")
    rows = [random_tensor((4, 3), seed=r) for r in range(comm.size)]
    expected = sum(r.sum(0) for i, r in enumerate(rows) if i % 2 == 0).expand(2, 3)
    torch.testing.assert_close(module.weight.grad, expected)
    torch.testing.assert_close(module.bias.grad, torch.full((2,), 4.0 * comm.size, dtype=torch.float64))


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("rows", [2, 40])
@sizes(1, 2, 3)
def test_sparse_cotangents(P_world, comm, rows, staged, monkeypatch):
    """A sparse cotangent (what ``F.embedding(..., sparse=True)`` on an output passes back) gives each primitive
    the gradient its dense values give; it used to stop every worker with torch's "unsupported memory format",
    and staged through the host (CUDA tensors where MPI is not CUDA-aware) with "copy_() between dense and sparse
    Tensors is not implemented"."""
    monkeypatch.setattr(cuda, "stage_cpu_for_tests", staged)
    results = []
    for name, (x, op) in _cases(P_world, comm, rows).items():
        if name in ("conv", "batch norm"):  # torch's own kernels take no sparse cotangent, as for its layers
            continue
        grads = []
        for sparse in (False, True):
            x = x.detach().requires_grad_()
            y = op(x)
            g = random_tensor(y.shape, seed=100 + comm.rank)
            y.backward(g.to_sparse() if sparse else g)
            grads.append(x.grad)
        results.append((name, *grads))
    for name, dense, sparse in results:
        assert torch.equal(sparse.to_dense(), dense), (name, comm.rank, sparse, dense)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@sizes(1, 2, 3)
def test_sparse_inputs_are_refused(P_world, comm, staged, monkeypatch):
    """Every primitive and layer refuses a sparse input on every worker before communicating, and every primitive
    a quantized one; staged through the host, the primitives copied them first and raised torch's errors there."""
    monkeypatch.setattr(cuda, "stage_cpu_for_tests", staged)
    for name, (x, op) in _cases(P_world, comm, 2).items():
        with pytest.raises(TypeError, match="dense"):
            op(x.to_sparse())
        if name not in ("conv", "batch norm"):
            with warnings.catch_warnings():  # torch deprecates making quantized tensors; users may still pass them
                warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
                quantized = torch.quantize_per_tensor(x.float(), 0.5, 0, torch.quint8)
            with pytest.raises(TypeError, match=f"{name.split()[0]}: expected .* got torch.quint8"):
                op(quantized)
