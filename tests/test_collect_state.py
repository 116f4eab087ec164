"""collect_state where world rank 0, which reads the checkpoint, is not the layer's rank 0: strict loading reports
what the checkpoint on world rank 0 holds, alike on every worker that reports; sub-grids are refused."""

import pytest
import torch

from distdl.nn import DistributedLayerNorm
from distdl.testing import gather, random_tensor, scatter
from helpers import sizes

GOOD = torch.nn.LayerNorm(6).state_dict()
BROKEN = {  # what is wrong with the checkpoint -> the error torch reports
    "missing": ({"weight": GOOD["weight"]}, r'Missing key\(s\) in state_dict: "bias"'),
    "size": ({"weight": torch.ones(7), "bias": GOOD["bias"]}, r"size mismatch for weight"),
    "unexpected": ({**GOOD, "zzz": torch.zeros(1)}, r'Unexpected key\(s\) in state_dict: "zzz"'),
}


@sizes(2, 3, 4)
def test_world_rank_0_a_member_but_not_the_layers_rank_0(P_world, comm):
    n = comm.size
    P_x = P_world.create_partition_inclusive(range(n)[::-1]).create_cartesian_topology_partition((1, n))
    layer = DistributedLayerNorm(P_x, 6, collect_state=True)
    assert P_x.root_ranks[0] == n - 1  # world rank 0 is the last member
    for checkpoint, error in BROKEN.values():
        with pytest.raises(RuntimeError, match=error):  # on every worker: all are members
            layer.load_state_dict(checkpoint if comm.rank == 0 else {})
    result = layer.load_state_dict(BROKEN["unexpected"][0] if comm.rank == 0 else {}, strict=False)
    assert result.unexpected_keys == ["zzz"] and result.missing_keys == []


@sizes(2, 3, 4)
def test_world_rank_0_outside_the_layer(P_world, comm):
    """The layer lives on rank 1 alone: it and world rank 0 report; the other workers report nothing."""
    P_x = P_world.create_partition_inclusive([1]).create_cartesian_topology_partition((1, 1))
    layer = DistributedLayerNorm(P_x, 6, collect_state=True)
    for checkpoint, error in BROKEN.values():
        for others in (checkpoint, {}):
            if comm.rank <= 1:
                with pytest.raises(RuntimeError, match=error):
                    layer.load_state_dict(checkpoint if comm.rank == 0 else others)
            else:
                layer.load_state_dict(others)
    result = layer.load_state_dict(BROKEN["missing"][0] if comm.rank == 0 else {}, strict=False)
    assert result.missing_keys == (["bias"] if comm.rank <= 1 else [])
    layer.load_state_dict(GOOD if comm.rank == 0 else {})
    if P_x.active:
        assert torch.equal(layer.weight, GOOD["weight"]) and torch.equal(layer.bias, GOOD["bias"])
    else:  # the others hold (unused) empty blocks
        assert layer.weight.numel() == 0 and layer.bias.numel() == 0


@sizes(2, 3, 4)
def test_a_layer_on_a_sub_grid_is_refused_on_every_worker(P_world, comm):
    """Rank 0 of the root cannot know whose state to collect: a sub-grid is each worker's own (several hold
    copies of the layer; or one, unknown outside its parent)."""
    n = comm.size
    if n % 2 == 0:  # rows of a (2, n / 2) grid, each with its copy of the layer
        rows = P_world.create_cartesian_topology_partition((2, n // 2)).create_subpartition([1])
    else:  # the one row of ranks 0 and 1, unknown on rank 2
        rows = P_world.create_partition_inclusive([0, 1]).create_subpartition([0])
    layer = DistributedLayerNorm(rows.create_cartesian_topology_partition((1, rows.size)), 6, collect_state=True)
    with pytest.raises(ValueError, match="state_dict: collect_state needs a partition every worker knows"):
        layer.state_dict()
    with pytest.raises(ValueError, match="load_state_dict: collect_state needs a partition every worker knows"):
        layer.load_state_dict(GOOD)
    assert list(DistributedLayerNorm(rows.create_cartesian_topology_partition((1, rows.size)), 6).state_dict()) \
        == ["weight", "bias"]  # without collect_state: each worker's own blocks


@sizes(2, 3, 4)
def test_a_partition_chosen_per_worker_is_refused_on_every_worker(P_world, comm):
    """Each data-parallel replica's stage on its own worker (the layer on worker 2r + 1 for the workers of replica
    r): rank 0 of the root handed the state to its own layer's rank 0 only, and the other stage's worker waited for
    it forever (load), or sent its state where nobody received it (save)."""
    stage = 2 * (comm.rank // 2) + 1 if 2 * (comm.rank // 2) + 1 < comm.size else 0
    P_stage = P_world.create_partition_inclusive([stage]).create_cartesian_topology_partition((1, 1))
    layer = DistributedLayerNorm(P_stage, 6, collect_state=True)
    other = 2 if comm.size > 2 else None
    expected = (f"collect_state needs DistributedLayerNorm on the same partition on every worker, got workers \\[1\\] "
                f"of shape \\(1, 1\\) on worker 0 and \\[{3 if comm.size == 4 else 0}\\] of shape \\(1, 1\\) on "
                f"worker {other}")
    if other is None:  # 2 workers: one replica, one stage, the same on both
        state = layer.state_dict()
        assert list(state) == (["weight", "bias"] if comm.rank == 0 else [])
        layer.load_state_dict(GOOD)
        return
    with pytest.raises(ValueError, match="state_dict: " + expected):
        layer.state_dict()
    with pytest.raises(ValueError, match="load_state_dict: " + expected):
        layer.load_state_dict(GOOD)


@sizes(1, 2, 3)
@pytest.mark.parametrize("given_on", ["every worker", "rank 0"])
def test_load_pre_hooks_see_the_checkpoint(P_world, comm, given_on):
    """A load pre-hook on the layer (renaming a key of an older checkpoint, converting a value) sees the checkpoint's
    global entries, as torch's does: it ran after the scatter, so it saw blocks or nothing (a size mismatch on rank 0
    and a missing key on the others)."""
    P_x = P_world.create_cartesian_topology_partition((1, comm.size))
    layer = DistributedLayerNorm(P_x, 6, collect_state=True).double()
    reference = torch.nn.LayerNorm(6).double()

    def migrate(module, state_dict, prefix, *rest):
        if prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = 2 * state_dict.pop(prefix + "w")  # a global tensor: (6,)
    layer.register_load_state_dict_pre_hook(migrate)
    reference.register_load_state_dict_pre_hook(migrate)
    old = {"w": random_tensor((6,), seed=1), "bias": random_tensor((6,), seed=2)}
    reference.load_state_dict(dict(old))
    layer.load_state_dict(dict(old) if comm.rank == 0 or given_on == "every worker" else {})
    x = random_tensor((3, 6), seed=3)
    torch.testing.assert_close(gather(layer(scatter(x, P_x)), P_x), reference(x), rtol=1e-12, atol=1e-12)
    state = layer.state_dict()  # the hook is still there, and runs once
    assert list(state) == (["weight", "bias"] if comm.rank == 0 else [])
    if comm.rank == 0:
        torch.testing.assert_close(state["weight"], 2 * old["w"], rtol=0, atol=0)
    assert len(layer._load_state_dict_pre_hooks) == 1
