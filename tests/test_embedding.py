"""DistributedEmbedding: forward and table gradients equal torch's, with the embedding dimension split."""

import numpy as np
import pytest
import torch

from distdl.nn.embedding import DistributedEmbedding
from distdl.testing import random_tensor, scatter
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from helpers import sizes

# (P_x shape, global index shape, num_embeddings, embedding_dim): uneven splits of the embedding dim
# (7 over 2 or 3), split (data-parallel) index axes, indices of 0-2 dimensions, a one-worker partition.
CASES = {
    1: [((1, 1), (5,), 6, 4), ((1, 1, 1), (2, 3), 6, 4)],
    2: [((1, 2), (5,), 6, 7), ((2, 1), (5,), 6, 3), ((2,), (), 6, 5)],
    3: [((1, 3), (4,), 6, 7), ((3, 1), (5,), 9, 2), ((1, 1, 3), (2, 3), 6, 7)],
    4: [((2, 2), (5,), 6, 7), ((2, 1, 2), (3, 2), 8, 5), ((1, 4), (3,), 5, 3)],
}


def _indices(P_x, x_global):
    """This worker's block of the indices (split over the leading axes of P_x, replicated on the last)."""
    P_shape, index, shape = P_x.shape[:-1], P_x.index[:-1], x_global.shape
    start, stop = compute_start_index(P_shape, index, shape), compute_stop_index(P_shape, index, shape)
    return x_global[tuple(slice(a, b) for a, b in zip(start, stop))]


def _columns(t, P_x):
    """This worker's columns of the table."""
    P_shape, index, shape = P_x.shape[-1:], P_x.index[-1:], t.shape[-1:]
    start, stop = compute_start_index(P_shape, index, shape), compute_stop_index(P_shape, index, shape)
    return t[..., int(start[0]):int(stop[0])]


def _pair(P_x, num, dim, **kwargs):
    ref = torch.nn.Embedding(num, dim, **kwargs).double()
    layer = DistributedEmbedding(P_x, num, dim, **kwargs).double()
    with torch.no_grad():
        ref.weight.copy_(random_tensor((num, dim), seed=1))
        if kwargs.get("padding_idx") is not None:
            ref.weight[kwargs["padding_idx"]] = 0
        if P_x.active:
            layer.weight.copy_(_columns(ref.weight, P_x))
    return layer, ref


def _check(P_x, layer, ref, x_global, seed=0):
    y_ref = ref(x_global)
    dy = random_tensor(y_ref.shape, seed=seed + 2)
    y_ref.backward(dy)
    y = layer(_indices(P_x, x_global) if P_x.active else torch.zeros(0, dtype=torch.long))
    if P_x.active:
        assert torch.equal(y, scatter(y_ref.detach(), P_x))  # a lookup is pure data movement: exact
    else:
        assert y.shape == (0,)
    y.backward(scatter(dy, P_x) if P_x.active else torch.zeros_like(y))
    if P_x.active:
        torch.testing.assert_close(layer.weight.grad, _columns(ref.weight.grad, P_x), rtol=1e-12, atol=1e-12)
    layer.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm):
    for P_shape, x_shape, num, dim in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        for padding_idx in (None, -2):
            layer, ref = _pair(P_x, num, dim, padding_idx=padding_idx)
            for call in range(2):  # the same layer again with a smaller batch
                shape = x_shape[:1] and (x_shape[0] - call,) + x_shape[1:]
                x = torch.randint(0, num, shape, generator=torch.Generator().manual_seed(call))
                _check(P_x, layer, ref, x, seed=call)
            _check(P_x, layer, ref, torch.full(x_shape, num - 2).to(torch.int32))  # only padding (or int32)


@sizes(3)
def test_inactive_worker(P_world, comm):
    P_x = P_world.create_partition_inclusive([2, 0]).create_cartesian_topology_partition((1, 2))
    layer, ref = _pair(P_x, 6, 5)
    _check(P_x, layer, ref, torch.tensor([0, 5, 3, 3]))
    if comm.rank == 1:
        assert layer.weight.numel() == 0
        with pytest.raises(ValueError, match=r"DistributedEmbedding: worker 1 is outside P_x and expected a "
                                             r"zero-volume tensor, got shape \(2,\)"):
            layer(torch.tensor([1, 2]))


@sizes(1, 2, 3, 4)
def test_state_dict_round_trip(P_world, comm):
    P_shape, x_shape, num, dim = CASES[comm.size][0]
    P_x = P_world.create_cartesian_topology_partition(P_shape)
    _, ref = _pair(P_x, num, dim)
    layer = DistributedEmbedding(P_x, num, dim, collect_state=True).double()
    layer.load_state_dict(ref.state_dict() if comm.rank % 2 == 0 else {})
    _check(P_x, layer, ref, torch.arange(num).flip(0)[:x_shape[0]])
    state = layer.state_dict()
    if P_x.rank == 0:
        assert list(state) == ["weight"] and torch.equal(state["weight"], ref.weight)
    else:
        assert list(state) == []


@sizes(2, 4)
def test_initialisation(P_world, comm):
    """Columns of one global N(0, 1) draw, replicated over the index axes whatever each worker's seed."""
    torch.manual_seed(comm.rank)
    P_x = P_world.create_cartesian_topology_partition((comm.size // 2, 2))
    layer = DistributedEmbedding(P_x, 100, 40, padding_idx=3, collect_state=True)
    replicas = P_x.create_subpartition([0]).allgather_data(layer.weight.detach().numpy())
    assert all((r == replicas[0]).all() for r in replicas)
    state = layer.state_dict()
    if P_x.rank == 0:
        table = state["weight"]
        assert torch.equal(table[3], torch.zeros(40))
        assert abs(table.mean()) < 0.05 and abs(table.std() - 1) < 0.05
        assert not torch.equal(table[:, :20], table[:, 20:])


@sizes(1, 2)
def test_errors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, comm.size))
    name = "DistributedEmbedding"
    for option, value in (("max_norm", 1.0), ("scale_grad_by_freq", True), ("sparse", True)):
        with pytest.raises(ValueError, match=rf"{name}: expected {option}=.* \(not supported\), got {value}"):
            DistributedEmbedding(P_x, 5, 3, **{option: value})
    DistributedEmbedding(P_x, 5, 3, norm_type=1.0)  # read only with max_norm, as torch takes it (it raised)
    for bad in (5, True, 1.0):
        with pytest.raises(ValueError, match=rf"{name}: expected an integer padding_idx in \[-5, 5\), got {bad}"):
            DistributedEmbedding(P_x, 5, 3, padding_idx=bad)
    assert DistributedEmbedding(P_x, 5, 3, padding_idx=np.int64(-2)).padding_idx == 3  # as torch takes it
    with pytest.raises(ValueError, match=rf"{name}: expected a non-negative embedding_dim, got -3"):
        DistributedEmbedding(P_x, 5, -3)
    layer = DistributedEmbedding(P_x, 5, 3)
    with pytest.raises(ValueError, match=rf"{name}: expected indices of 1 dimensions for P_x of shape "
                                         rf"\(1, {comm.size}\), got shape \(2, 2\) on worker {comm.rank}"):
        layer(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match=rf"{name}: expected indices of dtype torch.int64 or torch.int32, got "
                                        r"torch.float32"):
        layer(torch.zeros(2))
    with pytest.raises(ValueError, match=rf"{name}: expected indices in \[0, 5\), got values in \[-1, 5\] on "
                                         rf"worker {comm.rank}"):
        layer(torch.tensor([-1, 5]))


@sizes(2, 3)
def test_check_mode_names_indices_that_differ_along_the_last_axis(P_world, comm):
    """The indices are replicated along the last axis and no collective reads them: copies that differ (in
    values or shape) gave embeddings of no sequential model. Check mode names them, on every worker."""
    from distdl.checks import CollectiveMismatchError, checking
    P_x = P_world.create_cartesian_topology_partition((1, comm.size))
    layer = DistributedEmbedding(P_x, 10, 6)
    for indices in (torch.tensor([1, 2, 3]) + (comm.rank == 1), torch.arange(3 + (comm.rank == 1))):
        with checking(), pytest.raises(CollectiveMismatchError, match=r"DistributedEmbedding: ranks disagree on the "
                                                                      r"indices"):
            layer(indices)
    # a worker whose indices fail its own checks (out of range) takes part: the others raised after a timeout
    failed = (r"DistributedEmbedding: ranks disagree on failed with: "
              r"ranks? 0(, 2)? ha(s|ve) nothing; rank 1 has ValueError")
    with checking(), pytest.raises(CollectiveMismatchError, match=failed):
        layer(torch.tensor([1, 2, 3 if comm.rank != 1 else 10]))
    # indices that are not a tensor: the same (the others waited for it)
    with checking(), pytest.raises(CollectiveMismatchError, match=failed.replace("ValueError", "TypeError")):
        layer([1, 2, 3] if comm.rank == 1 else torch.tensor([1, 2, 3]))
    with checking():
        assert layer(torch.tensor([1, 2, 3])).shape[0] == 3
        # equal indices of the two allowed dtypes agree (their checksum differed)
        assert layer(torch.tensor([1, 2, 3], dtype=torch.int32 if comm.rank == 1 else torch.int64)).shape[0] == 3
