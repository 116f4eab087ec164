"""WindowExchange: give every worker an arbitrary window of the global tensor (the general halo).

Forward ``W x``: worker ``j`` gets ``x_global[window_j]``, where ``window_j`` is a box (per tensor
dimension a ``[start, stop)``) that may overlap other workers' blocks and reach past the global
edges (zeros there). Adjoint ``W* y``: each worker sends the parts of its window back to the workers
that hold them, which add them into their blocks (so overlapping windows sum). Windowed layers
(convolution, pooling, upsampling) use it for halos of any width, also where a block is smaller
than the halo and data comes from beyond the nearest neighbour.

=========================  ==========================================================
worker                     does
=========================  ==========================================================
in P_x                     sends the parts of its block in others' windows, receives its window
outside P_x                passes and gets a zero-volume tensor
=========================  ==========================================================
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import cuda
from distdl.backends import mpi as transport
from distdl.functional._common import (begin_backward, check_dim, check_idle_input, check_partition, check_tensor,
                                       in_graph, save_anchor)
from distdl.checks import announce, verify
from distdl.partition import MPIPartition
from distdl.utilities.caches import keep
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from distdl.utilities.torch import eager_when_compiled, memory_format

__all__ = ["window_exchange", "window_scatter_add"]

_TAG = 7402
Windows = tuple[tuple[tuple[int, int], ...], ...]  # per worker of P_x (rank order), per dimension, [start, stop)


@cuda.host_staged(whole=False)  # stages the pieces that travel (_exchange)
def window_exchange(x: torch.Tensor, P_x: MPIPartition, x_global_shape: tuple[int, ...],
                    windows: Windows) -> torch.Tensor:
    """Return ``x_global[window]`` of this worker's window, zero outside the global tensor.

    Args:
        x: this worker's balanced block of a global tensor of ``x_global_shape`` over ``P_x``.
        P_x: the partition the global tensor is decomposed over.
        x_global_shape: the global tensor's shape.
        windows: every worker's window, in ``P_x`` rank order (the same on every worker): per dimension a
            ``(start, stop)`` range of global indices, which may reach past the tensor's edges.
    Raises:
        ValueError: wrong dimensionality, a block that does not match ``x_global_shape``,
            windows of the wrong count or dimension, or data outside ``P_x``.
    """
    return _window("window_exchange", x, P_x, x_global_shape, windows, True)


@cuda.host_staged(whole=False)  # stages the pieces that travel (_exchange)
def window_scatter_add(y: torch.Tensor, P_x: MPIPartition, x_global_shape: tuple[int, ...],
                       windows: Windows) -> torch.Tensor:
    """Return this worker's block of the sum of every worker's window ``y`` placed in the global tensor (the
    adjoint of :func:`window_exchange`; the parts of windows past the tensor's edges are dropped).

    Args:
        y: this worker's window, of the shape its entry of ``windows`` gives.
        P_x, x_global_shape, windows: as for :func:`window_exchange`.
    """
    return _window("window_scatter_add", y, P_x, x_global_shape, windows, False)


@eager_when_compiled  # also a backward's: compiled autograd would trace into it
def _window(where: str, t: torch.Tensor, P_x: MPIPartition, shape, windows, forward: bool) -> torch.Tensor:
    """:func:`window_exchange` (``forward``) or :func:`window_scatter_add` of ``t``, checked and recorded (check mode)
    as ``where`` (an adjoint run by backward as such: "... (backward)")."""
    shape, windows = _check(where, t, P_x, shape, windows, "block" if forward else "window")
    verify(where, P_x, agree=_facts(t, shape, windows))
    return _Window.apply(in_graph(t), P_x, shape, windows, forward)


def _facts(x, shape, windows) -> dict:
    """What check mode verifies: the dtype, the device and the windows (a layer built with another kernel or
    padding on some worker exchanges other windows: raw MPI errors, or a hang)."""
    return {"dtype": x.dtype, "device": x.device, "x_global_shape": shape, "windows": windows}


def _ints(where, name, values):
    """Return ``values`` as a tuple of Python ints; TypeError for anything else (floats, bools)."""
    try:
        values = tuple(values)
    except TypeError as error:
        raise TypeError(f"{where}: expected a sequence of integers for {name}, got {values!r}") from error
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values):
        raise TypeError(f"{where}: expected integers for {name}, got {values!r}")
    return tuple(int(v) for v in values)


def _normalized(where, P_x, shape, windows):
    """Return ``(shape, windows)`` as tuples of ints (the plan cache's key: (0.0, 3.0) equals (0, 3) as a key),
    checked alike on every worker. Checking costs ~25 us at 4 workers in 4-d: windows already in that form are
    remembered by identity (a layer passes the same objects every call)."""
    known = P_x._memo(("normalized windows",), dict)
    found = known.get(id(windows))
    if found is not None and found[0] is shape and found[1] is windows:
        return shape, windows
    result = _checked(where, P_x, shape, windows)
    if result == (shape, windows) and type(shape) is tuple and type(windows) is tuple:  # immutable: remember
        keep(known, id(windows), (shape, windows), 64)  # holds them: the ids stay theirs
    return result


def _checked(where, P_x, shape, windows):
    shape = _ints(where, "x_global_shape", shape)
    if len(shape) != P_x.dim or any(n < 0 for n in shape):
        raise ValueError(f"{where}: expected x_global_shape of {P_x.dim} non-negative extents, got {shape}")
    try:
        boxes = [list(w) for w in windows]
    except TypeError as error:
        raise TypeError(f"{where}: expected a sequence of windows (per worker, per dimension [start, stop)), "
                        f"got {windows!r}") from error
    if len(boxes) != P_x.size or any(len(w) != P_x.dim for w in boxes):
        raise ValueError(f"{where}: expected {P_x.size} windows of {P_x.dim} dimensions, got {len(boxes)}")
    normalized = []
    for r, box in enumerate(boxes):
        pairs = tuple(_ints(where, f"windows[{r}][{k}]", pair) for k, pair in enumerate(box))
        if any(len(p) != 2 or p[0] > p[1] for p in pairs):
            raise ValueError(f"{where}: expected windows[{r}] of [start, stop) pairs with start <= stop, got {box!r}")
        normalized.append(pairs)
    return shape, tuple(normalized)


def _check(where, t, P_x, shape, windows, what):
    """Check a call; return its global shape and windows as tuples of ints. In check mode a member whose call
    fails here still takes part in the call's check (see :func:`~distdl.checks.announce`)."""
    try:
        return _check_locally(where, t, P_x, shape, windows, what)
    except (TypeError, ValueError) as error:
        announce(where, lambda: P_x if P_x.active else None, error)
        raise


def _check_locally(where, t, P_x, shape, windows, what):
    check_tensor(where, t)
    check_partition(where, "P_x", P_x)
    check_idle_input(where, P_x, t)
    if not P_x.active:
        return (), windows
    check_dim(where, P_x, t)
    shape, windows = _normalized(where, P_x, shape, windows)
    box = _plan(P_x, shape, windows).block if what == "block" else windows[P_x.rank]
    expected = tuple(b - a for a, b in box)
    if tuple(t.shape) != expected:
        raise ValueError(f"{where}: expected a {what} of shape {expected} on rank {P_x._root.rank}, "
                         f"got {tuple(t.shape)}")
    return shape, windows


def _block(P_x, index, shape):
    start = compute_start_index(P_x.shape, index, shape)
    stop = compute_stop_index(P_x.shape, index, shape)
    return tuple((int(a), int(b)) for a, b in zip(start, stop))


def _overlap(box, other):
    """Return the slices of ``box`` and ``other`` covering their intersection, or None."""
    mine, theirs = [], []
    for (a, b), (c, d) in zip(box, other):
        lo, hi = max(a, c), min(b, d)
        if lo >= hi:
            return None
        mine.append(slice(lo - a, hi - a))
        theirs.append(slice(lo - c, hi - c))
    return tuple(mine), tuple(theirs)


class _Plan(NamedTuple):
    block: tuple[tuple[int, int], ...]  # this worker's block
    sends: list  # (peer, block slices, window slices, shape): my block inside their window
    recvs: list  # (peer, block slices, window slices, shape): their block inside my window
    own: tuple | None  # (block slices, window slices): my block inside my window
    covered: bool  # whether my window holds all of my block (the adjoint starts from a copy, not zeros)
    outside: list  # window slices past the global edges (zeros), one slab per dimension and side


def _plan(P_x, shape, windows):
    """Return this worker's ``_Plan`` of the exchange (built once per global shape and windows)."""
    def build():
        me, window = P_x.rank, windows[P_x.rank]
        block = _block(P_x, P_x.index, shape)
        sends, recvs, own = [], [], None
        for peer, index in enumerate(itertools.product(*map(range, P_x.shape))):
            out = _overlap(block, windows[peer])  # my block inside their window
            if peer == me:
                own = out
            elif out is not None:
                sends.append((peer, *out, tuple(s.stop - s.start for s in out[0])))
            if peer != me:
                inward = _overlap(_block(P_x, index, shape), window)  # their block inside my window
                if inward is not None:
                    recvs.append((peer, *inward, tuple(s.stop - s.start for s in inward[0])))
        covered = own is not None and all(s.stop - s.start == b - a for s, (a, b) in zip(own[0], block))
        full = tuple(slice(None) for _ in window)
        outside = [full[:k] + (edge,) + full[k + 1:] for k, ((a, b), n) in enumerate(zip(window, shape))
                   for edge in (slice(0, min(-a, b - a)) if a < 0 else None,
                                slice(max(n - a, 0), b - a) if b > n else None) if edge is not None]
        return _Plan(block, sends, recvs, own, covered, outside)
    return P_x._memo_recent("window plan", (shape, windows), build)


def _exchange(t, P_x, shape, windows, forward):
    """Forward: my window from the blocks (copies: every element has one source, or lies outside and is zero).
    Adjoint: my block from the windows (sums: windows overlap)."""
    plan = _plan(P_x, shape, windows)
    incoming, outgoing = (plan.recvs, plan.sends) if forward else (plan.sends, plan.recvs)
    side = 2 if forward else 1  # where pieces lie in my output: window slices forward, block slices adjoint
    # In t's memory format (channels_last stays so through convolutions and pooling, as with torch's).
    out = torch.empty(tuple(b - a for a, b in (windows[P_x.rank] if forward else plan.block)), dtype=t.dtype,
                      device=t.device, memory_format=memory_format(t))
    if not (forward or plan.covered):
        out.zero_()
    # Where MPI cannot take t's memory, only the pieces that travel go through (pinned) host memory.
    staged = cuda.staging(t)
    requests, received = [], []
    for piece in incoming:
        buf = transport.empty(piece[3], t.dtype, cuda.buffer_device(t.device))
        received.append((piece[side], buf))
        requests.append(P_x.comm.Irecv(transport.buffer(buf), source=piece[0], tag=_TAG))
    packed = [transport.contiguous(t[piece[3 - side]]) for piece in outgoing]
    if staged:
        packed = cuda.host_copies(packed)
    for piece, buf in zip(outgoing, packed):
        requests.append(P_x.comm.Isend(transport.buffer(buf), dest=piece[0], tag=_TAG))
    if forward:
        for slices in plan.outside:
            out[slices] = 0
    if plan.own is not None:
        block, window = plan.own
        if forward:
            out[window].copy_(t[block])
        elif plan.covered:
            out.copy_(t[window])
        else:
            out[block] += t[window]
    MPI.Request.Waitall(requests)
    for slices, buf in received:  # a pinned buf is kept from reuse by torch's host allocator until copied
        if forward:
            out[slices].copy_(buf, non_blocking=True)
        else:
            out[slices] += buf.to(out.device, non_blocking=True)
    return out


class _Window(torch.autograd.Function):

    @staticmethod
    def forward(ctx, t, P_x, shape, windows, forward):
        save_anchor(ctx)
        ctx.args = (P_x, shape, windows)
        ctx.forward_direction = forward
        if not P_x.active:
            return t.clone()
        return _exchange(t, P_x, shape, windows, forward)

    @staticmethod
    def backward(ctx, grad):
        begin_backward(ctx, grad, ctx.args[0])
        where = ("window_exchange" if ctx.forward_direction else "window_scatter_add") + " (backward)"
        return _window(where, grad, *ctx.args, not ctx.forward_direction), None, None, None, None


def global_shape(x: torch.Tensor, P_x: MPIPartition) -> tuple[int, ...]:
    """Return the global shape of the balanced decomposition whose block ``x`` is (one small allgather)."""
    if not P_x.active:
        return ()
    extents = np.empty((P_x.size, P_x.dim), dtype=np.int64)
    P_x.comm.Allgather(np.asarray(x.shape, dtype=np.int64), extents)
    index = np.stack(np.unravel_index(np.arange(P_x.size), P_x.shape), axis=1)
    return tuple(int(extents[(np.delete(index, k, axis=1) == 0).all(axis=1), k].sum()) for k in range(P_x.dim))
