"""The device paths of the transport: host staging (through the CPU seam on CI) and CUDA tensors.

The staging seam (``distdl.backends.cuda.stage_cpu_for_tests``) routes CPU tensors through the
same staging code CUDA tensors take when MPI is not CUDA-aware, so CI exercises it without a GPU.
CUDA cases run when a GPU is present and skip otherwise.
"""

import os
import subprocess
import sys

import pytest
import torch
from mpi4py import MPI

from distdl.backends import cuda
from distdl.functional.all_gather import all_gather
from distdl.functional.all_sum_reduce import all_sum_reduce
from distdl.functional.broadcast import broadcast
from distdl.functional.halo_exchange import halo_exchange
from distdl.functional.reduce_scatter import reduce_scatter
from distdl.functional.repartition import repartition
from distdl.functional.sum_reduce import sum_reduce
from distdl.testing import assert_adjoint, random_tensor, scatter
from helpers import sizes

DEVICES = [pytest.param("staged", id="cpu-staged"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA device on this machine"))]


@pytest.fixture
def device(request, comm, monkeypatch):
    if request.param == "staged":
        monkeypatch.setattr(cuda, "stage_cpu_for_tests", True)
        return torch.device("cpu")
    return cuda.device_for_rank(comm)  # collective: on the test's ranks, after those sitting it out have left


def operators(P_world, n):
    P_x = P_world.create_cartesian_topology_partition([n, 1])
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    return {
        "all_sum_reduce": (lambda t: all_sum_reduce(t, P_x, axes_reduce=[0]), (3, 4)),
        "all_gather": (lambda t: all_gather(t, P_x, axes_all_gather=[0]), (2, 4)),
        "reduce_scatter": (lambda t: reduce_scatter(t, P_x, axes_reduce_scatter=[0]), (5, 3)),
        "halo_exchange": (lambda t: halo_exchange(t, P_x, [[1, 1], [0, 0]], [[1, 1], [0, 0]], [[1, 1], [0, 0]]),
                          (4, 3)),
        "broadcast": (lambda t: broadcast(t, P_0, P_x), (3, 4) if P_0.active else (0,)),
        "sum_reduce": (lambda t: sum_reduce(t, P_x, P_0), (3, 4)),
        "repartition": (lambda t: repartition(t, P_0, P_x), (5, 2) if P_0.active else (0,)),
    }


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@sizes(1, 2, 3)
def test_primitives_on_device(P_world, comm, device):
    for name, (op, shape) in operators(P_world, comm.size).items():
        x = random_tensor(shape, seed=comm.rank).to(device)
        reference_mode = cuda.stage_cpu_for_tests
        y = op(x)
        assert y.device.type == device.type, name
        cuda.stage_cpu_for_tests = False  # the same operator without staging, on the CPU
        expected = op(x.cpu())
        cuda.stage_cpu_for_tests = reference_mode
        torch.testing.assert_close(y.cpu(), expected, rtol=0, atol=0, msg=name)
        assert_adjoint(op, x, comm)


@sizes(2)
def test_staging_reuses_its_buffer(P_world, comm, monkeypatch):
    monkeypatch.setattr(cuda, "stage_cpu_for_tests", True)
    monkeypatch.setattr(cuda, "_pools", {})
    x = random_tensor((64,), seed=comm.rank)
    all_sum_reduce(x, P_world, axes_reduce=[0])
    pool = cuda._pools[torch.device("cpu")]
    for _ in range(3):
        y = all_sum_reduce(x, P_world, axes_reduce=[0])
    assert cuda._pools[torch.device("cpu")] is pool  # no per-call allocation of the staging buffer
    torch.testing.assert_close(y, sum(random_tensor((64,), seed=r) for r in range(2)))


def test_mode_from_environment(monkeypatch):
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setattr(cuda, "_mode", None)
        monkeypatch.setenv("DISTDL_CUDA_AWARE_MPI", value)
        assert cuda.cuda_aware() is expected
    monkeypatch.setattr(cuda, "_mode", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the probe's fallback where no GPU exists")
def test_probe_falls_back_without_crashing(monkeypatch):
    monkeypatch.setattr(cuda, "_mode", None)
    monkeypatch.delenv("DISTDL_CUDA_AWARE_MPI", raising=False)
    assert cuda.cuda_aware() is False  # the child process fails; this one carries on
    monkeypatch.setattr(cuda, "_mode", None)


def test_device_for_rank_without_gpu():
    if torch.cuda.is_available():
        assert cuda.device_for_rank().type == "cuda"
    else:
        assert cuda.device_for_rank() == torch.device("cpu")


def test_info_reports_the_transport():
    import distdl
    report = distdl.info()
    assert report["mpi_vendor"].startswith(MPI.get_vendor()[0])
    assert report["thread_level"] in ("single", "funneled", "serialized", "multiple")
    assert report["world_size"] == MPI.COMM_WORLD.size
    if not torch.cuda.is_available():
        assert report["cuda_transport"].startswith("CPU only") and report["devices"] == []


def layers(P_world, n):
    from distdl.nn import (DistributedAvgPool1d, DistributedBatchNorm, DistributedChannelConv1d,
                           DistributedFeatureConv1d, DistributedLayerNorm, DistributedLinear,
                           DistributedLinearReduceScatter, DistributedMaxPool1d, DistributedUpsample)
    P_x = P_world.create_cartesian_topology_partition([1, 1, n])
    P_c = P_world.create_cartesian_topology_partition([1, n, 1])
    P_f = P_world.create_cartesian_topology_partition([1, n])
    one = P_world.create_partition_inclusive([0])
    P_1, P_11 = one.create_cartesian_topology_partition([1, 1, 1]), one.create_cartesian_topology_partition([1, 1])
    return [
        (lambda: DistributedFeatureConv1d(P_x, 2, 3, kernel_size=3, padding=1), P_x, (4, 2, 9)),
        (lambda: DistributedChannelConv1d(P_c, P_1, P_c, 5, 3, kernel_size=3, padding=1), P_c, (2, 5, 6)),
        (lambda: DistributedBatchNorm(P_x, 2), P_x, (4, 2, 9)),
        (lambda: DistributedLayerNorm(P_x, (9,)), P_x, (4, 2, 9)),
        (lambda: DistributedMaxPool1d(P_x, 2), P_x, (2, 2, 10)),
        (lambda: DistributedAvgPool1d(P_x, 3, stride=2, padding=1), P_x, (2, 2, 9)),
        (lambda: DistributedUpsample(P_x, scale_factor=2, mode="linear"), P_x, (2, 2, 7)),
        (lambda: DistributedLinear(P_f, P_11, P_f, 5, 4), P_f, (3, 5)),
        (lambda: DistributedLinearReduceScatter(P_f, 5, 4), P_f, (3, 5)),
    ]


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@sizes(1, 2, 3)
def test_layers_on_device(P_world, comm, device):
    """Each layer on the device gives the values and gradients it gives on the CPU."""
    for build, P_x, shape in layers(P_world, comm.size):
        torch.manual_seed(0)
        on_device = build().double().to(device)
        torch.manual_seed(0)
        on_cpu = build().double()
        x = scatter(random_tensor(shape, seed=3), P_x)
        staged = cuda.stage_cpu_for_tests
        results = []
        for layer, dev in ((on_device, device), (on_cpu, torch.device("cpu"))):
            cuda.stage_cpu_for_tests = staged and layer is on_device
            x_local = x.to(dev).requires_grad_()
            y = layer(x_local)
            y.backward(random_tensor(y.shape, seed=10 + comm.rank).to(dev))
            results.append((y.detach().cpu(), x_local.grad.cpu(), [p.grad.cpu() for p in layer.parameters()]))
        cuda.stage_cpu_for_tests = staged
        (y_d, gx_d, gp_d), (y_c, gx_c, gp_c) = results
        torch.testing.assert_close(y_d, y_c)
        torch.testing.assert_close(gx_d, gx_c)
        for a, b in zip(gp_d, gp_c):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@sizes(1, 2, 3)
def test_training_utilities_on_device(P_world, comm, device):
    """An embedding, a general convolution and losses, then clip_grad_norm_ and the collected state dict, in check
    mode, on the device: the loss, the norm, the clipped gradients and rank 0's state dict are the CPU's."""
    from distdl import checking
    from distdl.nn import DistributedEmbedding, DistributedGeneralConv1d, DistributedMSELoss, clip_grad_norm_
    P_s = P_world.create_cartesian_topology_partition([1, 1, comm.size])
    tokens = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(1))
    x, t, u = (scatter(random_tensor(shape, seed=s), P_s) for s, shape in ((2, (2, 3, 8)), (3, (2, 4, 8)),
                                                                            (4, (2, 5, 6))))
    staged = cuda.stage_cpu_for_tests
    results = []
    for reference, dev in enumerate((device, torch.device("cpu"))):
        cuda.stage_cpu_for_tests = staged and not reference
        torch.manual_seed(0)
        model = torch.nn.ModuleList([DistributedEmbedding(P_s, 7, 6, collect_state=True),
                                     DistributedGeneralConv1d(P_s, P_s, P_s, 3, 4, 3, padding=1, collect_state=True)])
        model.double().to(dev)
        embedding, conv = model
        mse = DistributedMSELoss(P_s)
        with checking():
            loss = mse(embedding(tokens.to(dev)), u.to(dev)) + mse(conv(x.to(dev)), t.to(dev))
            loss.backward()
            norm = clip_grad_norm_(model, 0.01, P_world)
            state = model.state_dict()
        results.append((loss.detach().cpu(), norm.cpu(), [p.grad.cpu() for p in model.parameters()],
                        {k: v.cpu() for k, v in state.items()}))
    cuda.stage_cpu_for_tests = staged
    (loss_d, norm_d, grads_d, state_d), (loss_c, norm_c, grads_c, state_c) = results
    torch.testing.assert_close(loss_d, loss_c)
    torch.testing.assert_close(norm_d, norm_c)
    assert norm_c > 0.01  # clipped
    for a, b in zip(grads_d, grads_c):
        torch.testing.assert_close(a, b)
    assert list(state_d) == list(state_c) == (["0.weight", "1.weight", "1.bias"] if comm.rank == 0 else [])
    for key in state_c:
        torch.testing.assert_close(state_d[key], state_c[key], msg=key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@sizes(2, 3)
def test_staged_outputs_are_pinned(P_world, comm, monkeypatch):
    """Where CUDA tensors are staged, the host output of a collective is pinned memory (reused by torch's caching
    host allocator, copied to the device at full speed), forward and backward."""
    device = cuda.device_for_rank(comm)
    if cuda.cuda_aware():
        pytest.skip("MPI is CUDA-aware here: nothing is staged")
    pinned = []
    to_device = cuda._ToDevice.forward

    def record(ctx, y, d):
        pinned.append(y.is_pinned())
        return to_device(ctx, y, d)
    monkeypatch.setattr(cuda._ToDevice, "forward", staticmethod(record))
    P_x = P_world.create_cartesian_topology_partition([comm.size])
    x = random_tensor((3 * comm.size + 1,), seed=comm.rank).to(device).requires_grad_()
    y = all_gather(x, P_x, axes_all_gather=[0])
    y.backward(random_tensor(y.shape, seed=9).to(device))
    assert pinned == [True, True]


def test_staged_gradients_own_their_memory(monkeypatch):
    """The gradient a staged output passes back to its primitive is not the reusable buffer: autograd may stage
    the next one (on the device's thread) before that primitive's adjoint has read it (on the CPU's)."""
    monkeypatch.setattr(cuda, "stage_cpu_for_tests", True)
    leaves = [torch.zeros(4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    cotangents = [random_tensor((4,), seed=s) for s in (1, 2)]
    grads = [torch.autograd.grad(cuda._ToDevice.apply(h, torch.device("cpu")), h, g)[0]
             for h, g in zip(leaves, cotangents)]
    for grad, g in zip(grads, cotangents):
        assert torch.equal(grad, g)


@sizes(2, 3)
def test_halos_and_windows_stage_only_their_slabs(P_world, comm, monkeypatch):
    """Where tensors are staged, halo_exchange and window_exchange (under the windowed layers) take only the slabs
    they send through host memory, forward and backward; the rest of a block stays on its device."""
    from distdl.nn import DistributedFeatureConv1d
    monkeypatch.setattr(cuda, "stage_cpu_for_tests", True)
    slabs, wholes = [], []
    host_copies, to_host = cuda.host_copies, cuda._to_host
    monkeypatch.setattr(cuda, "host_copies", lambda ts: slabs.extend(t.numel() for t in ts) or host_copies(ts))
    monkeypatch.setattr(cuda, "_to_host", lambda x, reuse: wholes.append(x.numel()) or to_host(x, reuse))
    neighbours = (comm.rank > 0) + (comm.rank < comm.size - 1)
    P_x = P_world.create_cartesian_topology_partition([comm.size, 1])
    widths = [[1, 1], [0, 0]]
    x = random_tensor((6, 3), seed=comm.rank).requires_grad_()
    y = halo_exchange(x, P_x, widths, widths, widths)
    y.backward(random_tensor(y.shape, seed=10 + comm.rank))
    assert (wholes, slabs) == ([], [3] * 2 * neighbours)  # one row to each neighbour, each way
    slabs.clear()
    conv = DistributedFeatureConv1d(P_world.create_cartesian_topology_partition([1, 1, comm.size]), 2, 3, 3,
                                    padding=1).double()
    x = random_tensor((4, 2, 5), seed=comm.rank).requires_grad_()
    y = conv(x)
    y.backward(random_tensor(y.shape, seed=20 + comm.rank))
    assert slabs == [4 * 2] * 2 * neighbours  # a column of every sample and channel to each neighbour, each way


@sizes(1, 2)
def test_staged_calls_by_keyword(P_world, comm, monkeypatch):
    """The staging wrapper finds the tensor by its name too (``y`` for the adjoints)."""
    from distdl.functional.halo_exchange import halo_exchange_adjoint
    monkeypatch.setattr(cuda, "stage_cpu_for_tests", True)
    P_x = P_world.create_cartesian_topology_partition([comm.size])
    widths = [[0, 0]]
    y = random_tensor((3,), seed=comm.rank)
    torch.testing.assert_close(halo_exchange_adjoint(y=y, P_x=P_x, halo_shape=widths, recv_buffer_shape=widths,
                                                     send_buffer_shape=widths), y)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@sizes(2, 3)
def test_data_parallel_and_ring_layers_on_device(P_world, comm, device):
    """DataParallel broadcasts staged parameters through the host; the overlapped linear layers take the plain
    collectives where MPI cannot take the device's memory, with the same results."""
    from distdl.nn import DataParallel, DistributedLinearAllGather, DistributedLinearReduceScatter
    torch.manual_seed(comm.rank)  # replicas start different
    model = torch.nn.Linear(3, 2).double().to(device)
    DataParallel(model, P_world)
    weights = comm.allgather(model.weight.detach().cpu())
    assert all(torch.equal(w, weights[0]) for w in weights)
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    for layer in (DistributedLinearAllGather, DistributedLinearReduceScatter):
        results = []
        for overlap in (False, True):
            torch.manual_seed(0)
            built = layer(P_f, 5, 4, overlap=overlap).double().to(device)
            features = built.local_in_features
            x = random_tensor((3, features), seed=comm.rank).to(device).requires_grad_()
            y = built(x)
            y.backward(random_tensor(y.shape, seed=10 + comm.rank).to(device))
            results.append((y.detach().cpu(), x.grad.cpu()))
        torch.testing.assert_close(results[0], results[1])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@sizes(1, 2, 3)
def test_rings_take_the_plain_collective_where_tensors_are_staged(P_world, comm, device, monkeypatch):
    """all_gather_linear and linear_reduce_scatter hand their blocks to MPI around a ring: a tensor that must be
    staged (a CUDA tensor where MPI is not CUDA-aware) goes through the host in the plain collective instead, as
    in the layers. The rings handed such tensors to MPI directly."""
    from distdl.nn.linear_all_gather import all_gather_linear
    from distdl.nn.linear_reduce_scatter import linear_reduce_scatter
    staged = []
    to_host = cuda._to_host
    monkeypatch.setattr(cuda, "_to_host", lambda t, reuse: staged.append(t.shape) or to_host(t, reuse))
    P_cols = P_world.create_cartesian_topology_partition([1, comm.size])
    P_rows = P_world.create_cartesian_topology_partition([comm.size, 1])
    x_all, w = random_tensor((3, 2 * comm.size + 1), seed=1), random_tensor((4, 2 * comm.size + 1), seed=2)
    xs = [random_tensor((3, 2 * comm.size + 1), seed=10 + r) for r in range(comm.size)]
    cases = {"all_gather_linear": (lambda t: all_gather_linear(t, w.to(device), P_cols, 1), scatter(x_all, P_cols),
                                   x_all @ w.t()),
             "linear_reduce_scatter": (lambda t: linear_reduce_scatter(t, w.to(device), P_rows, 0), xs[comm.rank],
                                       scatter(sum(xs) @ w.t(), P_rows))}
    for name, (op, x, expected) in cases.items():
        staged.clear()
        x = x.to(device)
        torch.testing.assert_close(op(x).cpu(), expected, rtol=1e-12, atol=1e-12, msg=name)
        assert bool(staged) == cuda.needs_staging(x), name
        assert_adjoint(op, x, comm)
