"""Check mode: agreement passes, every kind of disagreement raises on every rank, off costs nothing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import distdl
from distdl import checks
from distdl.checks import CollectiveMismatchError, CollectiveTimeoutError, checking, verify
from distdl.functional.window_exchange import window_exchange, window_scatter_add
from distdl.testing import random_tensor
from helpers import partition_shapes, sizes


@pytest.fixture(autouse=True)
def _restore_check_mode():
    previous = distdl.check_mode()
    yield
    distdl.set_check_mode(previous)


def _ranks(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _clause(groups):
    """The expected text for ``{value: ranks}``, as the error writes it."""
    return "; ".join(f"{_ranks(r)} {'has' if len(r) == 1 else 'have'} {v}" for v, r in groups.items())


@sizes(1, 2, 3, 4)
def test_agreement_passes_on_partitions_and_communicators(P_world, comm):
    with checking():
        for shape in partition_shapes(comm.size):
            P = P_world.create_cartesian_topology_partition(shape)
            for axes in [(0,), tuple(range(len(shape)))]:
                fibre = P.create_subpartition(axes)
                verify("all_sum_reduce", fibre, torch.zeros(3, 4))
        verify("all_sum_reduce", P_world.comm, torch.zeros(2, dtype=torch.int64))
        # The caller decides what must agree: here shapes may differ, dtypes may not.
        verify("broadcast", P_world, torch.zeros(comm.rank + 1), agree=("dtype", "device", "dim"))
        verify("halo_exchange", P_world, agree={"halo_shape": [[1, 1], [2, 2]], "axes": (0,)})
        verify("no_facts", P_world)
        # Every call advanced this communicator's call number in step.
        # (each partition built was checked too)
        assert checks._next_sequence(P_world.comm) == 4 + len(partition_shapes(comm.size))


@sizes(2, 3, 4)
def test_shape_disagreement(P_world, comm):
    last = comm.size - 1
    x = torch.zeros(3, 5) if comm.rank == last else torch.zeros(3, 4)
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        verify("all_sum_reduce", P_world, x)
    groups = {"(3, 4)": list(range(last)), "(3, 5)": [last]}
    assert str(info.value) == f"all_sum_reduce: ranks disagree on shape: {_clause(groups)}"
    assert info.value.differences == {"shape": groups} and info.value.where == "all_sum_reduce"
    assert isinstance(info.value, RuntimeError)


@sizes(2, 3)
def test_dtype_disagreement(P_world, comm):
    x = torch.zeros(2, 2, dtype=torch.float64 if comm.rank == 0 else torch.float32)
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        verify("sum_reduce", comm, x)
    groups = {"torch.float64": [0], "torch.float32": list(range(1, comm.size))}
    assert str(info.value) == f"sum_reduce: ranks disagree on dtype: {_clause(groups)}"


@sizes(2, 3, 4)
def test_name_disagreement(P_world, comm):
    # Call order differs: odd ranks are already in the next primitive.
    where = "broadcast" if comm.rank % 2 == 0 else "sum_reduce"
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        verify(where, P_world, torch.zeros(2))
    groups = {"broadcast": list(range(0, comm.size, 2)), "sum_reduce": list(range(1, comm.size, 2))}
    assert str(info.value) == f"{where}: ranks disagree on primitive: {_clause(groups)}"


@sizes(2, 3)
def test_sequence_disagreement(P_world, comm):
    with checking():
        verify("all_sum_reduce", P_world, torch.zeros(2))
        if comm.rank == 1:
            checks._next_sequence(P_world.comm)  # as if rank 1 had made a call on this communicator its peers skipped
        with pytest.raises(CollectiveMismatchError) as info:
            verify("all_sum_reduce", P_world, torch.zeros(2))
    groups = {1: [r for r in range(comm.size) if r != 1], 2: [1]}
    assert str(info.value) == f"all_sum_reduce: ranks disagree on call number: {_clause(groups)}"


def _ring(name, P):
    """The tensor-parallel rings of distdl.nn (overlap=True) along axis 0 of ``P``, with a (2, 3) weight."""
    from distdl.nn.linear_all_gather import all_gather_linear
    from distdl.nn.linear_reduce_scatter import linear_reduce_scatter
    ring = {"all_gather_linear": all_gather_linear, "linear_reduce_scatter": linear_reduce_scatter}[name]
    weight = torch.rand(2, 3, requires_grad=True)
    return lambda x: ring(x, weight, P, 0)


@sizes(2, 3, 4)
@pytest.mark.parametrize("skipped", ["all_gather", "reduce_scatter", "all_gather_linear", "linear_reduce_scatter"])
def test_a_skipped_primitive_is_named_before_any_data_moves(P_world, comm, skipped):
    """Rank 0 skips a call its peers make and goes on to the next one: every rank raises, naming both, before
    the skipped primitive's header round could pair with the next one's messages (MPI would abort); the rings of
    the tensor-parallel layers too (they paired silently, or hung)."""
    P = P_world.create_cartesian_topology_partition((comm.size, 1))
    call = {"all_gather": lambda x: distdl.functional.all_gather(x, P, axes_all_gather=(0,)),
            "reduce_scatter": lambda x: distdl.functional.reduce_scatter(x, P, axes_reduce_scatter=(0,))}.get(
        skipped) or _ring(skipped, P)
    x = torch.rand(4, 3)
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        if comm.rank != 0:
            call(x)
        distdl.functional.all_sum_reduce(x, P, axes_reduce=(0,))
    groups = {"all_sum_reduce": [0], skipped: list(range(1, comm.size))}
    assert f": ranks disagree on primitive: {_clause(groups)}; and on " in str(info.value)  # and on their facts


@sizes(2, 3)
@pytest.mark.parametrize("op", ["all_sum_reduce", "all_sum_reduce_backward"])
def test_a_skipped_backward_is_named(P_world, comm, op):
    """Rank 0 runs backward (the sum's adjoint, a sum again; the invariant pair's sum in backward) while its peers
    skip it and sum something else (the pair's sum used to be recorded as a forward all_sum_reduce: the ranks summed
    each other's tensors, silently)."""
    P = P_world.create_cartesian_topology_partition((comm.size,))
    x = torch.rand(3, requires_grad=True)
    with checking():
        y = getattr(distdl.functional, op)(x, P, axes_reduce=(0,))
        with pytest.raises(CollectiveMismatchError) as info:
            if comm.rank == 0:
                y.backward(torch.ones(3))
            else:
                distdl.functional.all_sum_reduce(torch.rand(3), P, axes_reduce=(0,))
    groups = {f"{op} (backward)": [0], "all_sum_reduce": list(range(1, comm.size))}
    assert f"ranks disagree on primitive: {_clause(groups)}" in str(info.value)


@sizes(2, 3)
@pytest.mark.parametrize("ring", ["all_gather_linear", "linear_reduce_scatter"])
def test_a_skipped_backward_of_a_ring_is_named(P_world, comm, ring):
    """The adjoint of each ring is the other ring, recorded as the first's backward (rank 0's ran unchecked: each
    rank raised another ValueError, from the headers of different calls)."""
    P = P_world.create_cartesian_topology_partition((comm.size, 1))
    x = torch.rand(4, 3, requires_grad=True)
    with checking():
        y = _ring(ring, P)(x)
        with pytest.raises(CollectiveMismatchError) as info:
            if comm.rank == 0:
                y.backward(torch.rand(y.shape))
            else:
                distdl.functional.all_sum_reduce(torch.rand(3), P, axes_reduce=(0,))
    groups = {f"{ring} (backward)": [0], "all_sum_reduce": list(range(1, comm.size))}
    assert f"ranks disagree on primitive: {_clause(groups)}" in str(info.value)


@sizes(2, 3)
@pytest.mark.parametrize("op", ["window_exchange", "window_scatter_add"])
def test_a_skipped_backward_of_a_window_exchange_is_named(P_world, comm, op):
    """The adjoint of a window exchange is recorded as its backward: it was recorded as the forward call, so a
    rank that skipped the backward and exchanged windows forward paired with it unnamed (silently wrong data there,
    a timeout on the other)."""
    n = comm.size
    P = P_world.create_cartesian_topology_partition((n,))
    blocks = [(2 * r, 2 * r + 2) for r in range(n)]
    windows = tuple(((a - 1, b + 1),) for a, b in blocks)
    block, window = torch.rand(2, requires_grad=True), torch.rand(4, requires_grad=True)
    x = block if op == "window_exchange" else window
    call = getattr(distdl.functional, op)
    with checking():
        y = call(x, P, (2 * n,), windows)
        with pytest.raises(CollectiveMismatchError) as info:
            if comm.rank == 0:
                y.backward(torch.rand(y.shape))
            else:
                call(x.detach(), P, (2 * n,), windows)
    groups = {f"{op} (backward)": [0], op: list(range(1, n))}
    assert f"ranks disagree on primitive: {_clause(groups)}" in str(info.value)


@sizes(2, 3)
def test_a_call_that_fails_its_checks_on_one_worker(P_world, comm):
    """Worker 1's input fails the local checks (a bool sum, a tensor of another dimension): it still takes part in
    the call's check, so every worker raises, and the next call pairs with the next call (it used to pair with the
    one after, one call behind: wrong sums, then a hang)."""
    F = distdl.functional
    P = P_world.create_cartesian_topology_partition((comm.size,))
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1,))
    widths = [[1 if comm.rank else 0, 1 if comm.rank < comm.size - 1 else 0]]
    calls = {"all_sum_reduce": lambda t: F.all_sum_reduce(t, P, axes_reduce=(0,)),
             "reduce_scatter": lambda t: F.reduce_scatter(t, P, axes_reduce_scatter=(0,)),
             "all_gather": lambda t: F.all_gather(t, P, axes_all_gather=(0,)),
             "sum_reduce": lambda t: F.sum_reduce(t, P, P_0),
             "halo_exchange_adjoint": lambda t: F.halo_exchange_adjoint(t, P, widths, widths, widths),
             "all_sum_reduce_forward": lambda t: F.all_sum_reduce_forward(t, P, axes_reduce=(0,))}
    n = 3 * comm.size  # each worker's block of a (n * comm.size,) tensor, and its window
    windows = tuple(((r * n, (r + 1) * n),) for r in range(comm.size))
    calls["window_exchange"] = lambda t: window_exchange(t, P, (n * comm.size,), windows)
    calls["window_scatter_add"] = lambda t: window_scatter_add(t, P, (n * comm.size,), windows)
    bad = {"all_gather": torch.ones(3, 1), "window_exchange": torch.ones(n + 1), "window_scatter_add": torch.ones(1)}
    # the others: bool, which cannot be summed
    for name, call in calls.items():
        good = torch.full((3 * comm.size,), float(comm.rank + 1))
        with checking():
            with pytest.raises(CollectiveMismatchError) as info:
                call(bad.get(name, good > 0) if comm.rank == 1 else good)
            y = call(good)
        # only what failed: worker 1 has no shape or dtype to compare (they were named as its "nothing")
        assert str(info.value).startswith(f"{name}: ranks disagree on failed with: "), str(info.value)
        assert "; and on " not in str(info.value), str(info.value)
        unchecked = call(good)
        assert torch.equal(y, unchecked), name


@sizes(2, 3)
def test_a_worker_of_a_broadcast_group_that_fails_its_checks(P_world, comm):
    """Worker 1, a receiver of worker 0's broadcast or repartition, passes data outside P_x or a sparse tensor, or,
    a source of a sum_reduce, a sparse tensor: in check mode every worker raises (worker 1 raised alone, before the
    check, and the others waited for it)."""
    F = distdl.functional
    P = P_world.create_cartesian_topology_partition((comm.size,))
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1,))
    whole = torch.rand(3 * comm.size)
    calls = {"broadcast": (lambda t: F.broadcast(t, P_0, P), whole if comm.rank == 0 else torch.zeros(0)),
             "repartition": (lambda t: F.repartition(t, P_0, P), whole if comm.rank == 0 else torch.zeros(0)),
             "sum_reduce": (lambda t: F.sum_reduce(t, P, P_0), whole + comm.rank)}
    for name, (call, good) in calls.items():
        for bad in ([good.to_sparse()] if name == "sum_reduce" else [torch.ones(3), torch.zeros(0).to_sparse()]):
            with checking():
                with pytest.raises(CollectiveMismatchError, match=rf"{name}: ranks disagree on failed with: "):
                    call(bad if comm.rank == 1 else good)
                y = call(good)
            assert torch.equal(y, call(good)), name


@sizes(2, 3)
def test_several_disagreements_and_custom_facts(P_world, comm):
    facts = {"axes": (comm.rank % 2,), "halo": [1, 1]}
    x = torch.zeros(comm.rank + 1, dtype=torch.float64)
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        verify("halo_exchange", comm, x, agree=facts)
    assert list(info.value.differences) == ["axes"]
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        verify("halo_exchange", comm, x)  # shape differs on every rank, dtype on none
    assert list(info.value.differences) == ["shape"]
    assert len(info.value.differences["shape"]) == comm.size


@sizes(4)
def test_disagreement_within_fibres_names_world_ranks(P_world, comm):
    P = P_world.create_cartesian_topology_partition([2, 2])
    fibre = P.create_subpartition([0])  # ranks {0, 2} and {1, 3}
    x = torch.zeros(7 if comm.rank == 3 else 2)
    with checking():
        if comm.rank in (0, 2):
            verify("all_sum_reduce", fibre, x)
        else:
            with pytest.raises(CollectiveMismatchError, match=r"ranks disagree on shape: rank 1 has \(2,\); "
                                                              r"rank 3 has \(7,\)$"):
                verify("all_sum_reduce", fibre, x)


@sizes(2, 3)
def test_inactive_workers_and_single_member_partitions(P_world, comm):
    P = P_world.create_partition_inclusive([0])
    with checking():
        verify("all_sum_reduce", P, torch.zeros(comm.rank))  # rank 0 alone, others outside: no communication
        verify("all_sum_reduce", P_world.create_partition_exclusive([0]), torch.zeros(3))
        verify("all_sum_reduce", MPI.COMM_SELF, torch.zeros(comm.rank))


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"verify looked at {name} with check mode off")


@sizes(2, 3)
def test_off_costs_nothing_and_does_not_communicate(P_world, comm):
    with checking(False):
        assert not distdl.check_mode()
        if comm.rank == 0:  # only rank 0 calls: any communication would hang
            for _ in range(1000):
                verify("all_sum_reduce", P_world, torch.zeros(comm.rank + 1))
                verify(_Untouchable(), _Untouchable(), _Untouchable(), agree=_Untouchable())
    # The calls made with check mode off did not advance the call number either.
    with checking():
        verify("all_sum_reduce", P_world, torch.zeros(1))


@sizes(1)
def test_switches_and_errors(P_world, comm):
    distdl.set_check_mode(False)
    with checking():
        assert distdl.check_mode() and checks.check_mode()
        with checking(False):
            assert not distdl.check_mode()
        assert distdl.check_mode()
        with pytest.raises(TypeError, match=r"verify: expected an MPIPartition or an MPI.Intracomm, got int"):
            verify("f", 3, torch.zeros(1))
        with pytest.raises(TypeError, match=r"verify: expected a str for where, got int"):
            verify(1, P_world)
        with pytest.raises(ValueError, match=r"verify: expected facts of a tensor in \['shape', 'dtype', 'device', "
                                             r"'dim'\], got 'stride'"):
            verify("f", P_world, torch.zeros(1), agree=("stride",))
        with pytest.raises(TypeError, match=r"verify: expected a torch.Tensor to check \['dtype'\] of, got NoneType"):
            verify("f", P_world, agree=("dtype",))
    assert not distdl.check_mode()


def test_environment_switch(tmp_path, monkeypatch):
    """``DISTDL_CHECK=1`` turns check mode on at import (serial: starts its own Python)."""
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts a subprocess; runs in the serial pass")
    for value, expected in [("1", True), ("yes", True), ("0", False), ("off", False), ("", False)]:
        monkeypatch.setenv("DISTDL_CHECK", value)
        assert checks._from_environment() is expected
    monkeypatch.delenv("DISTDL_CHECK")
    assert not checks._from_environment()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "DISTDL_CHECK": "1"}
    result = subprocess.run([sys.executable, "-c", "import distdl; print(distdl.check_mode())"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "True", result.stderr


@sizes(2, 3)
def test_a_state_dict_load_on_rank_0_alone_is_named(P_world, comm):
    """load_state_dict of a collect_state layer on rank 0 alone returned (its sends are eager), and the next load
    on every worker paired with its messages: the others loaded the first dict's blocks, silently."""
    from distdl.nn import DistributedLinearAllGather
    P = P_world.create_cartesian_topology_partition((1, comm.size))
    layer = DistributedLinearAllGather(P, 4, 3 * comm.size, collect_state=True)
    state = {k: torch.rand(v.shape) for k, v in layer.state_dict().items()}  # every worker: it is collective
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        if comm.rank == 0:
            layer.load_state_dict(state)
        layer.state_dict()
    groups = {"load_state_dict": [0], "state_dict": list(range(1, comm.size))}
    assert f"ranks disagree on primitive: {_clause(groups)}" in str(info.value)


@sizes(2, 3)
def test_state_calls_on_rank_0_alone_time_out_naming_them(P_world, comm, monkeypatch):
    """state_dict() and load_state_dict() of a collect_state layer are collective over the root partition: on rank 0
    alone they hung in its exchange, before any check; in check mode rank 0 raises, naming the call."""
    from distdl.nn import DistributedLayerNorm
    layer = DistributedLayerNorm(P_world.create_cartesian_topology_partition((comm.size,)), 4, collect_state=True)
    monkeypatch.setenv("DISTDL_CHECK_TIMEOUT", "1")
    calls = {"state_dict": layer.state_dict,
             "load_state_dict": lambda: layer.load_state_dict(torch.nn.LayerNorm(4).state_dict())}
    for where, call in calls.items():
        if comm.rank == 0:
            with checking(), pytest.raises(CollectiveTimeoutError, match=rf"^{where}: waited \d+ s in check mode"):
                call()
            request, _ = checks._abandoned.pop()
            comm.bcast(None, root=0)  # it gave up: the others now join the exchange it waited in, to complete it
            request.Wait()
        else:
            comm.bcast(None, root=0)
            P_world._root.Iallgather(np.zeros(4, dtype=np.int64), np.empty((comm.size, 4), dtype=np.int64)).Wait()


@sizes(2, 3)
def test_two_models_saved_in_different_orders_are_named(P_world, comm):
    """Rank 0 saves (or loads) model A then B, the others B then A: the calls paired A's layer with B's, which mixed
    their states silently or raised on some ranks only (a raw torch error)."""
    from distdl.nn import DistributedLayerNorm, DistributedLinear
    P = P_world.create_cartesian_topology_partition((comm.size,))
    A, B = DistributedLayerNorm(P, 4, collect_state=True), DistributedLayerNorm(P, 6, collect_state=True)
    first = A if comm.rank == 0 else B
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        first.state_dict()
    assert str(info.value).startswith("state_dict: ranks disagree on state: "), str(info.value)
    with checking(), pytest.raises(CollectiveMismatchError, match="^load_state_dict: ranks disagree on state: "):
        first.load_state_dict(torch.nn.LayerNorm(4 if comm.rank == 0 else 6).state_dict())
    # Not a mismatch: a bias pruned where it is held (column 0 of P_w), which adds names there only.
    from torch.nn.utils import prune
    P_w = P_world.create_cartesian_topology_partition((1, comm.size))
    layer = DistributedLinear(P_w, P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1)),
                              P_w, 4, 3, collect_state=True)
    if layer.bias is not None:
        prune.l1_unstructured(layer, "bias", amount=0.5)
    with checking():
        state = layer.state_dict()
        layer.load_state_dict(state)
    assert sorted(state) == (["bias_mask", "bias_orig", "weight"] if comm.rank == 0 else []), (comm.rank, list(state))


@sizes(2, 3)
def test_a_call_skipped_before_a_call_on_another_communicator_times_out(P_world, comm, monkeypatch):
    """The last rank skips a call on A and goes on to one on B, where its peers never come (they wait on A): the
    sequence numbers, counted per communicator, cannot pair them up; past DISTDL_CHECK_TIMEOUT each raises,
    naming its own call (distdl's abort hook then ends a job)."""
    A, B = (P_world.create_partition_inclusive(range(comm.size)) for _ in range(2))
    last = comm.rank == comm.size - 1
    monkeypatch.setenv("DISTDL_CHECK_TIMEOUT", "1")
    with checking(), pytest.raises(CollectiveTimeoutError) as info:
        if not last:
            verify("all_gather", A)
        verify("all_sum_reduce", B)
    where = "all_sum_reduce" if last else "all_gather"
    others = [r for r in range(comm.size) if r != comm.rank]  # the ranks it waited for, not itself
    ranks = ("rank " if len(others) == 1 else "ranks ") + ", ".join(map(str, others))
    assert re.match(rf"{where}: waited \d+ s in check mode for the other members of call 0 on this communicator "
                    rf"\({ranks}\) to make it too: one of them skipped it", str(info.value)), str(info.value)
    # End cleanly: each joins the exchange it skipped, so that the abandoned one completes.
    request, _ = checks._abandoned.pop()
    (A if last else B).comm.Iallgather(np.zeros(4, dtype=np.int64), np.empty((comm.size, 4), dtype=np.int64)).Wait()
    request.Wait()
    monkeypatch.setenv("DISTDL_CHECK_TIMEOUT", "soon")
    with checking(), pytest.raises(ValueError, match="verify: expected a number of seconds for DISTDL_CHECK_TIMEOUT, "
                                                     "got 'soon'"):
        verify("all_sum_reduce", A)


@sizes(2, 3)
def test_partitions_built_differently_are_named(P_world, comm):
    """Deriving a partition is collective: workers passing other shapes or axes hung creating its communicator."""
    last = comm.rank == comm.size - 1
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        P_world.create_cartesian_topology_partition((1, comm.size) if last else (comm.size, 1))
    groups = {f"({comm.size}, 1)": list(range(comm.size - 1)), f"(1, {comm.size})": [comm.size - 1]}
    assert str(info.value) == f"create_cartesian_topology_partition: ranks disagree on shape: {_clause(groups)}"
    P = P_world.create_cartesian_topology_partition((1, comm.size))
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        P.create_subpartition((0,) if last else (1,))
    groups = {"(1,)": list(range(comm.size - 1)), "(0,)": [comm.size - 1]}
    assert str(info.value) == f"create_subpartition: ranks disagree on axes: {_clause(groups)}"


@sizes(2, 3)
def test_layers_built_differently_are_named(P_world, comm):
    """A loss with another reduction on one worker summed the same three numbers into another loss (silently), or
    ('none') skipped the sum; a convolution with other padding exchanged other windows (raw MPI errors)."""
    from distdl.nn import (DistributedAvgPool1d, DistributedFeatureConv1d, DistributedMaxPool1d, DistributedMSELoss,
                           DistributedUpsample)
    last = comm.rank == comm.size - 1
    P = P_world.create_cartesian_topology_partition((comm.size, 1))
    x, y = random_tensor((2, 3), seed=comm.rank), random_tensor((2, 3), seed=comm.rank + 10)
    for other in ("sum", "none"):
        loss = DistributedMSELoss(P, reduction=other if last else "mean")
        with checking(), pytest.raises(CollectiveMismatchError) as info:
            loss(x, y)
        groups = {"mean": list(range(comm.size - 1)), other: [comm.size - 1]}
        assert str(info.value) == f"DistributedMSELoss: ranks disagree on reduction: {_clause(groups)}"
    P = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    conv = DistributedFeatureConv1d(P, 2, 3, 3, padding=0 if last else 1)
    with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedFeatureConv1d: ranks disagree on "
                                                                  r"geometry: "):
        conv(random_tensor((1, 2, 4), seed=comm.rank, dtype=torch.float32))
    with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedFeatureConv1d: ranks disagree on "
                                                                  r"parameters: "):  # a raw MPI error in its bcast
        DistributedFeatureConv1d(P, 2, 3, 5 if last else 3)
    # the channel form exchanges no window: its geometry is compared as a setting (it went unnamed, silently wrong)
    from distdl.nn import DistributedChannelConv1d
    P_c = P_world.create_cartesian_topology_partition((1, comm.size, 1))
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1, 1))
    conv = DistributedChannelConv1d(P_c, P_0, P_c, comm.size, 2, 3, padding=1,
                                    padding_mode="circular" if last else "reflect")
    with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedChannelConv1d \(settings\): ranks "
                                                                  r"disagree on geometry: "):
        conv(random_tensor((1, 1, 6), seed=comm.rank, dtype=torch.float32))
    # Windows inside each worker's block exchange nothing: another kernel, or another layer, went unseen.
    x = random_tensor((1, 2, 4 * comm.size), seed=comm.rank, dtype=torch.float32)
    with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedMaxPool1d: ranks disagree on "
                                                                  r"geometry: "):
        DistributedMaxPool1d(P, 4 if last else 2)(x)
    for option in ({"count_include_pad": False}, {"divisor_override": 3}):  # the average's own options too
        with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedAvgPool1d: ranks disagree on "
                                                                      r"geometry: "):
            DistributedAvgPool1d(P, 3, 1, 1, **(option if last else {}))(x)
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        (DistributedAvgPool1d if last else DistributedMaxPool1d)(P, 2)(x)
    groups = {"DistributedMaxPool1d": list(range(comm.size - 1)), "DistributedAvgPool1d": [comm.size - 1]}
    assert f"ranks disagree on primitive: {_clause(groups)}" in str(info.value)
    # float64 on one worker: the dtype is named first (upsampling's geometry holds a float64 flag, named first)
    upsample = DistributedUpsample(P, scale_factor=2, mode="linear")
    with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedUpsample: ranks disagree on dtype: "):
        upsample(x.double() if last else x)


@sizes(2, 3)
def test_gradient_calls_made_differently_are_named(P_world, comm):
    """clip_grad_norm_ with another norm_type or max_norm, and all_reduce_gradients with another op, on one worker
    scaled the replicas' gradients apart, silently."""
    from distdl.nn import all_reduce_gradients, clip_grad_norm_
    last = comm.rank == comm.size - 1
    model = torch.nn.Linear(3, 2)
    model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.ones(2)
    for name, value, other in (("norm_type", 2.0, float("inf")), ("max_norm", 1.0, 2.0)):
        arguments = {"max_norm": 1.0, "norm_type": 2.0, name: other if last else value}
        with checking(), pytest.raises(CollectiveMismatchError, match=rf"clip_grad_norm_: ranks disagree on {name}"):
            clip_grad_norm_(model, P=P_world, **arguments)
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        all_reduce_gradients(model, P_world, op="sum" if last else "avg")
    groups = {"avg": list(range(comm.size - 1)), "sum": [comm.size - 1]}
    assert str(info.value) == f"all_reduce_gradients: ranks disagree on op: {_clause(groups)}"


@sizes(2, 3)
def test_copies_of_parameters_that_differ_are_named(P_world, comm):
    """A replicated parameter changed on one worker only (DistDL's examples initialise weights on a root worker,
    which held the only copy there) gave silently wrong results; check mode names it at the next forward, for a
    layer's copies over its partition and for DataParallel's over its workers."""
    from distdl.nn import (DataParallel, DistributedBatchNorm, DistributedFeatureConv1d, DistributedGeneralConv1d,
                           DistributedLayerNorm, DistributedLinearAllGather)
    P = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    P_2d = P_world.create_cartesian_topology_partition((comm.size, 1))
    from torch.nn.utils.parametrizations import weight_norm
    layers = [(DistributedFeatureConv1d(P, 2, 3, 3, padding=1), "weight", (1, 2, 4)),
              (DistributedBatchNorm(P, 2), "bias", (2, 2, 4)),
              (DistributedLinearAllGather(P_2d, 4, 6), "bias", (2, 4)),
              (DistributedGeneralConv1d(P, P, P, 2, 3, 3, padding=1), "weight", (1, 2, 4)),  # was never compared
              (DistributedGeneralConv1d(P, P, P, 2, 3, 3, padding=1), "bias", (1, 2, 4)),
              # with a parametrization the parameters are its originals
              (weight_norm(DistributedFeatureConv1d(P, 2, 3, 3, padding=1)), "parametrizations.weight.original1",
               (1, 2, 4)),
              # buffers too: running statistics loaded on rank 0 alone (collect_state=False), no parameters
              (DistributedBatchNorm(P, 2, affine=False).eval(), "running_mean", (2, 2, 4))]
    for layer, name, shape in layers:
        x = random_tensor(shape, seed=comm.rank, dtype=torch.float32)
        with checking():
            layer(x)  # equal copies pass
            if comm.rank == 0:
                with torch.no_grad():
                    (layer.get_parameter(name) if "running" not in name else layer.get_buffer(name)).add_(1)
            with pytest.raises(CollectiveMismatchError) as info:
                layer(x)
        where = f"{type(layer).__name__} (copies of its parameters and buffers)"
        assert str(info.value).startswith(f"{where}: ranks disagree on the values of {name} (checksum): ")
        assert "rank 0 has" in str(info.value)
    # settings no collective checks: a norm's epsilon or momentum, batch norm's mode (batch or running statistics)
    for layer, change, fact in ((DistributedBatchNorm(P, 2), lambda m: m.eval(), "training"),
                                (DistributedBatchNorm(P, 2), lambda m: setattr(m, "momentum", 0.5), "momentum"),
                                (DistributedLayerNorm(P_2d, (4,)), lambda m: setattr(m, "eps", 1e-3), "eps")):
        x = random_tensor((2, 2, 4) if isinstance(layer, DistributedBatchNorm) else (2, 4), seed=comm.rank,
                          dtype=torch.float32)
        with checking():
            layer(x)
            if comm.rank == comm.size - 1:
                change(layer)
            with pytest.raises(CollectiveMismatchError, match=rf"{type(layer).__name__} \(settings\): ranks "
                                                              rf"disagree on {fact}: "):
                layer(x)
    model = DataParallel(torch.nn.Linear(3, 2), P_world)
    with checking():
        model(torch.ones(1, 3)).sum().backward()
        if comm.rank == comm.size - 1:
            with torch.no_grad():
                model.module.weight.mul_(2)
        with pytest.raises(CollectiveMismatchError, match=r"DataParallel \(copies of its parameters\): ranks disagree "
                                                          r"on the values of its parameters \(checksum\)"):
            model(torch.ones(1, 3))


@sizes(2, 3)
def test_a_data_parallel_forward_on_rank_0_alone_is_named(P_world, comm):
    """Rank 0 makes a forward through DataParallel in grad mode that its peers do not (a validation forward outside
    no_grad; a backward it skipped is the same): its next forward met its peers in that step's reductions, which
    have no check (rank 0 timed out blaming them; they hung). The end of each backward is checked: every rank raises,
    naming both calls."""
    from distdl.nn import DataParallel
    model = DataParallel(torch.nn.Linear(3, 2), P_world)
    x = random_tensor((2, 3), seed=comm.rank, dtype=torch.float32)
    with checking():
        model(x).sum().backward()
        y = model(x)  # rank 0's extra forward pairs with its peers' next one
        with pytest.raises(CollectiveMismatchError) as info:
            if comm.rank == 0:
                model(x)
            else:
                y.sum().backward()
    groups = {"DataParallel": [0], "DataParallel (backward)": list(range(1, comm.size))}
    assert f"ranks disagree on primitive: {_clause(groups)}" in str(info.value)
    # Rank 0's backward completes its peers' sums, unchecked (its check of it has no peer); the wrapper steps as
    # before, checked
    distdl.set_check_mode(False)
    if comm.rank == 0:
        y.sum().backward()
    else:
        model.wait()
    model.zero_grad()
    with checking():
        model(x).sum().backward()
    xs = torch.stack(comm.allgather(x))
    assert torch.allclose(model.module.weight.grad, xs.sum(1).mean(0).expand(2, 3))
    assert torch.equal(model.module.bias.grad, torch.full((2,), 2.0))


@sizes(2, 3)
def test_data_parallel_wrappers_reached_in_another_order_per_rank_pass(P_world, comm, monkeypatch):
    """Two wrappers on partitions of their own, whose parameters rank 1's backward reaches in the other order (a
    penalty on the first's parameters, made before the second's forward): the ends of backward, which check each
    wrapper's sums, ran in another order there, and each rank waited in another wrapper's check (a false timeout).
    The checks start in the backward's hooks and complete at its end."""
    from distdl.nn import DataParallel
    monkeypatch.setenv("DISTDL_CHECK_TIMEOUT", "20")
    Q = P_world.create_partition_inclusive(range(comm.size))
    torch.manual_seed(0)
    D, G = DataParallel(torch.nn.Linear(3, 1), P_world), DataParallel(torch.nn.Linear(2, 3), Q)
    x = random_tensor((4, 3), seed=comm.rank, dtype=torch.float32)
    z = random_tensor((4, 2), seed=comm.size + comm.rank, dtype=torch.float32)

    def loss(d, g):
        penalty = sum((p * p).sum() for p in d.parameters()) if comm.rank == 1 else 0
        return g(z).square().sum() + d(x).sum() + penalty
    with checking():
        loss(D, G).backward()
    torch.manual_seed(0)
    d, g = torch.nn.Linear(3, 1), torch.nn.Linear(2, 3)
    params = [*d.parameters(), *g.parameters()]
    mean = [sum(grads) / comm.size for grads in zip(*comm.allgather(torch.autograd.grad(loss(d, g), params)))]
    for p, expected in zip([*D.module.parameters(), *G.module.parameters()], mean):
        torch.testing.assert_close(p.grad, expected)


@sizes(2, 3)
def test_a_failed_check_in_another_primitive_names_both(P_world, comm):
    """Worker 1 fails the local checks of another primitive than its peers' call: the error names the primitives
    too (only the failed check was named, once the failing worker's missing tensor facts were left out)."""
    P = P_world.create_cartesian_topology_partition((comm.size,))
    with checking(), pytest.raises(CollectiveMismatchError) as info:
        if comm.rank == 1:
            distdl.functional.all_gather(torch.ones(3, 3), P, axes_all_gather=(0,))  # a tensor of another dimension
        else:
            distdl.functional.all_sum_reduce(torch.ones(3), P, axes_reduce=(0,))
    others = [r for r in range(comm.size) if r != 1]
    assert f"; and on primitive: {_clause({'all_sum_reduce': others, 'all_gather': [1]})}" in str(info.value), \
        str(info.value)
    assert "shape" not in str(info.value)
