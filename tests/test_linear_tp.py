"""Tensor-parallel Linear pair: forward, input and parameter gradients equal torch's; ring overlap is exact."""

import pytest
import torch

from distdl.nn.linear_all_gather import DistributedLinearAllGather, all_gather_linear, tensor_parallel_partition
from distdl.nn.linear_reduce_scatter import DistributedLinearReduceScatter, linear_reduce_scatter
from distdl.testing import assert_adjoint, assert_sequential_equivalence, random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import sizes

# (P_x shape of the column-parallel layer, axis, global input shape, in_features, out_features): features
# or tokens split, uneven splits (7 over 2 or 3), replicated (data-parallel) axes, a one-worker partition.
# The row-parallel layer takes the column-parallel layer's output partition (the same for axis=-1).
CASES = {
    1: [((1, 1), -1, (3, 7), 7, 5), ((1, 1, 1), -2, (2, 5, 7), 7, 5)],
    2: [((1, 2), -1, (3, 7), 7, 5), ((2, 1), -1, (4, 7), 7, 5), ((1, 2, 1), -2, (2, 5, 7), 7, 5)],
    3: [((1, 3), -1, (3, 7), 7, 5), ((1, 3, 1), -2, (2, 7, 4), 4, 7), ((3, 1), -1, (5, 4), 4, 3)],
    4: [((2, 2), -1, (5, 7), 7, 5), ((2, 2, 1), -2, (3, 5, 4), 4, 7), ((1, 4), -1, (2, 3), 3, 6),
        ((1, 2, 2, 1), 1, (2, 5, 3, 4), 4, 6)],  # P_y (1, 1, 2, 2) reorders the workers
}
LAYERS = {"all_gather": DistributedLinearAllGather, "reduce_scatter": DistributedLinearReduceScatter}


def _blocks(kind, layer, W, b):
    """This worker's blocks of the global weight and bias."""
    P_x, axis, last = layer.P_x, layer.axis, layer.P_x.dim - 1

    def cut(t, dim, partition_axis):
        shape = [1] * t.dim()
        shape[dim] = P_x.shape[partition_axis]
        index = [0] * t.dim()
        index[dim] = P_x.index[partition_axis]
        start, stop = compute_start_index(shape, index, t.shape), compute_stop_index(shape, index, t.shape)
        return t[tuple(slice(a, z) for a, z in zip(start, stop))]
    if kind == "all_gather":
        return cut(W, 0, axis), cut(b, 0, axis)
    return cut(W, 1, last), (cut(b, 0, last) if axis == last else b)


def _pair(kind, P_x, axis, in_features, out_features, dtype=torch.float64, seed=0, integer=False, **kwargs):
    """A distributed layer and the torch layer with the same random (or small-integer) parameters."""
    ref = torch.nn.Linear(in_features, out_features).to(dtype)
    layer = LAYERS[kind](P_x, in_features, out_features, axis=axis, **kwargs).to(dtype)
    with torch.no_grad():
        for k, p in enumerate((ref.weight, ref.bias)):
            value = random_tensor(p.shape, seed=seed + k)
            p.copy_(value.mul(2).round() if integer else value)
        if P_x.active:
            weight, bias = _blocks(kind, layer, ref.weight, ref.bias)
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
    return layer, ref


def _partition(P_world, kind, P_shape, axis):
    """The input partition of ``kind`` in a case (the row-parallel layer takes the column-parallel output's)."""
    P_x = P_world.create_cartesian_topology_partition(P_shape)
    return P_x if kind == "all_gather" else tensor_parallel_partition(P_x, axis)


def _check_grads(kind, layer, ref, tol):
    if layer.P_x.active:
        weight, bias = _blocks(kind, layer, ref.weight.grad, ref.bias.grad)
        torch.testing.assert_close(layer.weight.grad, weight, rtol=tol, atol=tol)
        torch.testing.assert_close(layer.bias.grad, bias, rtol=tol, atol=tol)
    layer.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("overlap", [False, True])
@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm, kind, overlap):
    for case, (P_shape, axis, x_shape, n_in, n_out) in enumerate(CASES[comm.size]):
        P_x = _partition(P_world, kind, P_shape, axis)
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5))[:2 if case == 0 else 1]:
            layer, ref = _pair(kind, P_x, axis, n_in, n_out, dtype=dtype, overlap=overlap)
            for call in range(2):  # the same layer again with a smaller batch
                shape = (x_shape[0] - call,) + x_shape[1:]
                x = random_tensor(shape, seed=call).to(dtype)
                assert_sequential_equivalence(layer, ref, x, P_x, layer.P_y, seed=call, rtol=tol, atol=tol)
                _check_grads(kind, layer, ref, tol)


@pytest.mark.parametrize("kind", LAYERS)
@sizes(1, 2, 3, 4)
def test_overlap_equals_plain_exactly(P_world, comm, kind):
    """With small-integer data every sum is exact, so the ring and the collective must agree bit for bit."""
    for P_shape, axis, x_shape, n_in, n_out in CASES[comm.size]:
        P_x = _partition(P_world, kind, P_shape, axis)
        for dtype in (torch.float64, torch.bfloat16):
            results = []
            for overlap in (False, True):
                layer, _ = _pair(kind, P_x, axis, n_in, n_out, dtype=dtype, integer=True, overlap=overlap)
                x = scatter(random_tensor(x_shape, seed=3).mul(2).round().to(dtype), P_x)
                if overlap:  # a non-contiguous input
                    x = torch.empty(x.shape[::-1], dtype=dtype).permute(*reversed(range(x.dim()))).copy_(x)
                x.requires_grad_()
                y = layer(x)
                y.backward(random_tensor(y.shape, seed=10 + comm.rank).mul(2).round().to(dtype))
                results.append([y, x.grad, layer.weight.grad, layer.bias.grad])
            for plain, ring in zip(*results):
                assert torch.equal(plain, ring), (P_shape, axis, dtype, comm.rank)


@pytest.mark.parametrize("overlap", [False, True])
@sizes(1, 2, 3, 4)
def test_adjoint(P_world, comm, overlap):
    """Without bias the layers are linear in x: backward is the adjoint, double backward its adjoint."""
    for P_shape, axis, x_shape, n_in, n_out in CASES[comm.size]:
        for kind in LAYERS:
            P_x = _partition(P_world, kind, P_shape, axis)
            layer = LAYERS[kind](P_x, n_in, n_out, bias=False, axis=axis, overlap=overlap).double()
            assert_adjoint(layer, scatter(random_tensor(x_shape, seed=4), P_x), comm)


@pytest.mark.parametrize("overlap", [False, True])
@sizes(2, 4)
def test_sequence_parallel_mlp(P_world, comm, overlap):
    """Column-parallel then row-parallel over tokens (Megatron sequence parallelism) equals the torch MLP."""
    P_x = P_world.create_cartesian_topology_partition((comm.size // 2, 2, 1))
    up, ref_up = _pair("all_gather", P_x, -2, 4, 6, seed=1, overlap=overlap)
    down, ref_down = _pair("reduce_scatter", up.P_y, -2, 6, 3, seed=3, overlap=overlap)
    assert down.P_y == P_x
    assert_sequential_equivalence(lambda x: down(torch.tanh(up(x))), lambda x: ref_down(torch.tanh(ref_up(x))),
                                  random_tensor((2, 7, 4), seed=5), P_x, P_x, rtol=1e-12, atol=1e-12)
    _check_grads("all_gather", up, ref_up, 1e-12)
    _check_grads("reduce_scatter", down, ref_down, 1e-12)


@pytest.mark.parametrize("kind", LAYERS)
@sizes(3)
def test_inactive_worker(P_world, comm, kind):
    P_x = P_world.create_partition_inclusive([0, 2]).create_cartesian_topology_partition((1, 2))
    for overlap in (False, True):
        layer, ref = _pair(kind, P_x, -1, 7, 5, overlap=overlap)
        assert_sequential_equivalence(layer, ref, random_tensor((3, 7), seed=6), P_x, layer.P_y, rtol=1e-12)
        _check_grads(kind, layer, ref, 1e-12)
        if comm.rank == 1:
            assert layer.weight.numel() == 0 and layer.bias.numel() == 0
            assert layer(torch.zeros(0)).shape == (0,)
            with pytest.raises(ValueError, match=rf"{type(layer).__name__}: worker 1 is outside P_x"):
                layer(torch.ones(3, 2))


@pytest.mark.parametrize("kind", LAYERS)
@sizes(1, 2, 3, 4)
def test_state_dict_round_trip(P_world, comm, kind):
    P_shape, axis, x_shape, n_in, n_out = CASES[comm.size][-1 if comm.size > 1 else 0]
    P_x = _partition(P_world, kind, P_shape, axis)
    _, ref = _pair(kind, P_x, axis, n_in, n_out, seed=8)  # the same torch layer on every worker
    layer = LAYERS[kind](P_x, n_in, n_out, axis=axis, collect_state=True).double()
    layer.load_state_dict(ref.state_dict() if comm.rank % 2 == 0 else {})
    assert_sequential_equivalence(layer, ref, random_tensor(x_shape, seed=7), P_x, layer.P_y, rtol=1e-12)
    state = layer.state_dict()
    if comm.rank == 0:  # rank 0 of the root partition, where P_x's rank 0 is another worker too
        assert list(state) == ["weight", "bias"]
        for key, value in ref.state_dict().items():
            assert torch.equal(state[key], value)
    else:
        assert list(state) == []


@pytest.mark.parametrize("kind", LAYERS)
@sizes(2, 3, 4)
def test_a_layer_without_root_rank_0_saves_and_loads_through_it(P_world, comm, kind):
    """A layer whose partition leaves out rank 0 of the root partition: its collected state reaches rank 0's
    state_dict (it stayed on the layer's own rank 0, so a checkpoint saved on rank 0 silently lacked it), and a
    checkpoint given to rank 0 alone loads into it (the layer's rank 0 reported missing keys, alone)."""
    P_sub = P_world.create_partition_inclusive(range(1, comm.size))
    P_x = _partition(P_sub, kind, (1, comm.size - 1), -1)
    _, ref = _pair(kind, P_x, -1, 7, 5, seed=8)
    model = torch.nn.ModuleDict({"inner": LAYERS[kind](P_x, 7, 5, collect_state=True).double()})
    model.load_state_dict({"inner." + k: v for k, v in ref.state_dict().items()} if comm.rank == 0 else {})
    layer = model["inner"]
    assert_sequential_equivalence(layer, ref, random_tensor((3, 7), seed=7), P_x, layer.P_y, rtol=1e-12)
    state = model.state_dict()
    if comm.rank == 0:
        assert list(state) == ["inner.weight", "inner.bias"]
        for key, value in ref.state_dict().items():
            assert torch.equal(state["inner." + key], value)
    else:
        assert list(state) == []


@pytest.mark.parametrize("kind", LAYERS)
@sizes(2, 3)
def test_unexpected_keys_raise_on_every_member(P_world, comm, kind):
    """Rank 0's state dict has a key the layer lacks (a bias): every member raises, not rank 0 alone (the others
    returned and went on, out of step with it); strict=False then loads on every member."""
    P_shape, axis, x_shape, n_in, n_out = CASES[comm.size][0]
    P_x = _partition(P_world, kind, P_shape, axis)
    _, ref = _pair(kind, P_x, axis, n_in, n_out, seed=8)
    layer = LAYERS[kind](P_x, n_in, n_out, bias=False, axis=axis, collect_state=True).double()
    state = ref.state_dict() if comm.rank == 0 else {}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "bias"'):
        layer.load_state_dict(state)
    result = layer.load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["bias"] and result.missing_keys == []
    saved = layer.state_dict()  # collective
    if P_x.rank == 0:
        assert saved["weight"].equal(ref.weight)


@pytest.mark.parametrize("kind", LAYERS)
@sizes(2, 4)
def test_initialisation(P_world, comm, kind):
    """Blocks of one global U(-1/sqrt(in), 1/sqrt(in)) draw; replicas equal even when the seeds differ."""
    torch.manual_seed(comm.rank)
    P_x = P_world.create_cartesian_topology_partition((comm.size // 2, 2))
    layer = LAYERS[kind](P_x, 64, 48, collect_state=True)
    replicas = P_x.create_subpartition([0]).allgather_data(torch.cat([layer.weight.detach().ravel(),
                                                                      layer.bias.detach()]).numpy())
    assert all((r == replicas[0]).all() for r in replicas)
    state = layer.state_dict()
    if P_x.rank == 0:
        weight, bias = state["weight"], state["bias"]
        assert weight.abs().max() <= 1 / 8 and bias.abs().max() <= 1 / 8
        assert weight.abs().max() > 0.12 and abs(weight.mean()) < 0.01 and abs(weight.std() - 1 / 8 / 3**0.5) < 0.005
        assert not torch.equal(weight[:24], weight[24:])  # the blocks are not copies of one another


@sizes(1, 2)
def test_errors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    if comm.size > 1:  # partitions the layers cannot use
        with pytest.raises(ValueError, match=r"DistributedLinearAllGather: expected the features whole "
                                             r"\(P_x.shape\[-1\] == 1\) when gathering axis -2, got P_x of shape "
                                             r"\(1, 1, 2\)"):
            DistributedLinearAllGather(P_x, 4, 4, axis=-2)
        P_t = P_world.create_cartesian_topology_partition((1, comm.size, 1))
        with pytest.raises(ValueError, match=r"DistributedLinearReduceScatter: expected an unsplit axis -2 "
                                             r"\(P_x.shape\[-2\] == 1\) to scatter the output along, got P_x of "
                                             r"shape \(1, 2, 1\)"):
            DistributedLinearReduceScatter(P_t, 4, 4, axis=-2)
    for cls in LAYERS.values():
        name = cls.__name__
        with pytest.raises(ValueError, match=rf"{name}: expected an axis in \[-3, 3\) for P_x of shape .*, got 3"):
            cls(P_x, 4, 4, axis=3)
        with pytest.raises(ValueError, match=rf"{name}: expected a non-negative in_features, got -1"):
            cls(P_x, -1, 4)
        with pytest.raises(TypeError, match=rf"{name}: expected a bool for overlap, got 'yes'"):
            cls(P_x, 4, 4, overlap="yes")
        layer = cls(P_x, 7, 4)
        local = 7 if comm.size == 1 else 4 - comm.rank
        with pytest.raises(ValueError, match=rf"{name}: expected a tensor of 3 dimensions with {local} features "
                                             rf"\(of 7\) over P_x of shape \(1, 1, {comm.size}\), got shape "
                                             rf"\(2, 3, 9\) on worker {comm.rank}"):
            layer(torch.ones(2, 3, 9))
        with pytest.raises(ValueError, match=rf"{name}: expected a tensor of 3 dimensions"):
            layer(torch.ones(2, local))



@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("overlap", [False, True])
@sizes(2, 3)
def test_wrong_dtype_then_recovery(P_world, comm, kind, overlap):
    """An input of another dtype than the weight raises on every worker before any message (the ring used to post
    its messages, fail in the multiply and free their buffers under MPI: heap corruption); the layer then works."""
    P_shape, axis, x_shape, n_in, n_out = CASES[comm.size][0]
    P_x = _partition(P_world, kind, P_shape, axis)
    layer, ref = _pair(kind, P_x, axis, n_in, n_out, overlap=overlap)
    with pytest.raises(TypeError, match=rf"{LAYERS[kind].__name__}: expected x and weight of one floating dtype, "
                                        r"got torch.float32 and torch.float64"):
        layer(scatter(random_tensor(x_shape, seed=1), P_x).float())
    assert_sequential_equivalence(layer, ref, random_tensor(x_shape, seed=1), P_x, layer.P_y, seed=1)
    _check_grads(kind, layer, ref, 1e-12)


@pytest.mark.parametrize("kind", LAYERS)
@sizes(2, 3)
def test_ring_waits_for_its_messages_when_a_multiply_raises(P_world, comm, kind, monkeypatch):
    P_shape, axis, x_shape, n_in, n_out = CASES[comm.size][0]
    P_x = _partition(P_world, kind, P_shape, axis)
    layer, ref = _pair(kind, P_x, axis, n_in, n_out, overlap=True)
    x = scatter(random_tensor(x_shape, seed=2), P_x)
    linear, calls = torch.nn.functional.linear, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:  # the second block: messages are in flight on every worker
            raise RuntimeError("out of memory (simulated)")
        return linear(*args)
    monkeypatch.setattr(torch.nn.functional, "linear", failing)
    with pytest.raises(RuntimeError, match=r"out of memory \(simulated\)"):
        layer(x)
    monkeypatch.undo()
    for _ in range(3):  # freed buffers still under MPI would corrupt these
        assert_sequential_equivalence(layer, ref, random_tensor(x_shape, seed=3), P_x, layer.P_y, seed=3)
        _check_grads(kind, layer, ref, 1e-12)


@sizes(2)
def test_ring_errors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 2))
    x = torch.ones(3, 3 - comm.rank)  # a balanced block of 5 features
    with pytest.raises(TypeError, match=r"all_gather_linear: expected x and weight of one floating dtype, got "
                                        r"torch.float32 and torch.float64"):
        all_gather_linear(x, torch.ones(4, 5, dtype=torch.float64), P_x, -1)
    with pytest.raises(ValueError, match=r"linear_reduce_scatter: expected an axis in \[-2, 2\) for P_x of shape "
                                         r"\(1, 2\), got 2"):
        linear_reduce_scatter(x, torch.ones(4, 3 - comm.rank), P_x, 2)
    with pytest.raises(ValueError, match=r"all_gather_linear: expected the blocks of a balanced decomposition, got "
                                         r"shape \(3, 2\) on worker 0 \(expected \(3, 3\)\)"):
        all_gather_linear(torch.ones(3, 2 + 2 * comm.rank), torch.ones(4, 6), P_x, -1)
    with pytest.raises(ValueError, match=r"all_gather_linear: expected a weight of 5 columns \(the gathered "
                                         rf"features\), got shape \(4, 4\) on worker {comm.rank}"):
        all_gather_linear(x, torch.ones(4, 4), P_x, -1)
    with pytest.raises(ValueError, match=r"linear_reduce_scatter: expected products of one shape on every member"):
        linear_reduce_scatter(torch.ones(3 + comm.rank, 2), torch.ones(4, 2), P_x, -1)
    assert torch.equal(all_gather_linear(x, torch.ones(4, 5), P_x, -1), torch.full((3, 4), 5.0))
