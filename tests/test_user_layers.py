"""A layer written by a user on CollectStateMixin, as its docstring says to."""

import re

import pytest
import torch

from distdl import CollectiveMismatchError, checking
from distdl.nn import clip_grad_norm_
from distdl.nn.module import CollectStateMixin, StateLayout
from helpers import sizes


class _ColumnBias(CollectStateMixin, torch.nn.Module):
    """``x + bias``, the bias held by column 0 of a 2-D partition only (copies down that column)."""

    def __init__(self, P, n):
        super().__init__()
        self.P_x, self.collect_state, self.n = P, True, n
        self.bias = torch.nn.Parameter(torch.arange(n, dtype=torch.float64)) if P.index[1] == 0 else None

    def _state_layouts(self):
        return {"bias": StateLayout((self.n,), (None,), first=(1,))}

    def _held_elsewhere(self):
        return set() if self.P_x.index[1] == 0 else {"bias"}

    def forward(self, x):
        self._verify_replicas("ColumnBias")
        return x if self.bias is None else x + self.bias


@sizes(2, 4)
def test_check_mode_compares_a_bias_held_by_one_column(P_world, comm):
    """Check mode compared the bias over the row it is not copied along: its holders waited for the others in a
    fibre only they built (a timeout), or met the next collective's record. Now the copies down column 0 are
    compared, and a copy changed on one of them is named there."""
    P = P_world.create_cartesian_topology_partition((comm.size // 2, 2))
    layer = _ColumnBias(P, 3)
    with checking(True):
        for _ in range(2):
            torch.testing.assert_close(layer(torch.zeros(3, dtype=torch.float64)),
                                       torch.arange(3.0, dtype=torch.float64) * (P.index[1] == 0), rtol=0, atol=0)
        if comm.size == 4:
            if P.index == (1, 0):
                with torch.no_grad():
                    layer.bias[0] = 5.0
            if P.index[1] == 0:
                with pytest.raises(CollectiveMismatchError, match=r"values of bias \(checksum\)"):
                    layer(torch.zeros(3, dtype=torch.float64))
            else:  # no copies here to compare
                assert layer(torch.zeros(3, dtype=torch.float64)).eq(0).all()


class _Rows(CollectStateMixin, torch.nn.Module):
    """A weight in row blocks over a 1-D partition, with the layout it is given."""

    def __init__(self, P, axes):
        super().__init__()
        self.P_x, self.collect_state, self.axes = P, True, axes
        self.weight = torch.nn.Parameter(torch.ones(2, 3))

    def _state_layouts(self):
        return {"weight": StateLayout((2 * self.P_x.size, 3), self.axes)}


@sizes(1, 2, 3)
def test_a_wrong_layout_or_base_order_is_named(P_world, comm):
    """A layout naming an axis the partition lacks (or one axis for a 2-D tensor) raised an IndexError or a helper's
    error on rank 0 only in state_dict, and clip_grad_norm_ took it for replicated (a wrong norm); the mixin after
    torch.nn.Module was skipped by the state dict, silently. Each is now an error on every worker."""
    P = P_world.create_cartesian_topology_partition((comm.size,))
    for axes in [(1, None), (0,)]:
        layer = _Rows(P, axes)
        layer.weight.grad = torch.ones(2, 3)
        for call in (layer.state_dict, lambda: clip_grad_norm_(layer, 1.0, P)):
            with pytest.raises(ValueError, match=re.escape(
                    f"_Rows: expected the StateLayout of weight to give an axis of its partition (of 1 axes) or None "
                    f"per dimension of ({2 * comm.size}, 3), got axes {axes}")):
                call()
    state = _Rows(P, (0, None)).state_dict()
    assert list(state) == (["weight"] if comm.rank == 0 else [])
    assert comm.rank != 0 or state["weight"].shape == (2 * comm.size, 3)
    with pytest.raises(TypeError, match=r"_Wrong: expected CollectStateMixin before torch.nn.Module among the bases"):
        class _Wrong(torch.nn.Module, CollectStateMixin):
            pass


class _ColumnScale(CollectStateMixin, torch.nn.Module):
    """``x * scale``, a persistent buffer held by column 0 of a 2-D partition only."""

    def __init__(self, P, n):
        super().__init__()
        self.P_x, self.collect_state, self.n = P, True, n
        self.register_buffer("scale", torch.arange(n, dtype=torch.float64) if P.index[1] == 0 else None)

    def _state_layouts(self):
        return {"scale": StateLayout((self.n,), (None,), first=(1,))}

    def _held_elsewhere(self):
        return set() if self.P_x.index[1] == 0 else {"scale"}

    def forward(self, x):
        self._verify_replicas("ColumnScale")
        return x if self.scale is None else x * self.scale


@sizes(2, 4)
def test_check_mode_with_a_buffer_held_by_one_column(P_world, comm):
    """Only parameters' copies are compared: the workers without the buffer built a fibre for it that its holders
    never joined (a hang in the first checked forward)."""
    P = P_world.create_cartesian_topology_partition((comm.size // 2, 2))
    layer = _ColumnScale(P, 3)
    with checking(True):
        y = layer(torch.ones(3, dtype=torch.float64))
        state = layer.state_dict()
    torch.testing.assert_close(y, torch.arange(3.0, dtype=torch.float64) if P.index[1] == 0 else torch.ones(3,
                               dtype=torch.float64), rtol=0, atol=0)
    assert list(state) == (["scale"] if comm.rank == 0 else [])
