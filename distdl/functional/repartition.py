"""Repartition: move a tensor from its balanced decomposition over P_x to the one over P_y.

Forward ``y = R x``: every element of the global tensor goes from the P_x worker that holds it to
the P_y worker that holds it (scatter, gather, re-layout). Adjoint ``R* = repartition(., P_y, P_x)``.

=================  ==========================================================================
worker             does
=================  ==========================================================================
in P_x and P_y     sends the overlaps of its x block, receives its y block (self-overlap copied)
in P_x only        sends the overlaps of its x block, gets a zero-volume tensor
in P_y only        passes a zero-volume tensor, receives its y block
in neither         passes and gets a zero-volume tensor, without communicating
=================  ==========================================================================

Each call, the workers of both partitions allgather a header (dtype, shape) of every x block, so
receive-only workers learn the global shape and a call with a new shape works everywhere; the
overlaps then move as non-blocking messages over the union of the partitions, one per pair (a
large overlap that is not contiguous straight from and into the blocks, see ``transport.strided``). In
unions of up to 8 workers, blocks of up to 1 KiB travel with the headers (one collective). The
backward already knows the global structure from its forward: it runs no header round, and a
collective only where some blocks ride in one.
"""

from __future__ import annotations

import itertools
import math
import weakref

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import (HEADER_LENGTH, begin_backward, check_dim, check_flags, check_idle_input,
                                       check_partition, check_tensor, decode_header, grad_like, header_of,
                                       in_graph, receiving_in_graph, save_anchor, zero_volume_like)
from distdl.functional._messages import (HEADER_BYTES, MESSAGE_LENGTH, empty_message, encode_message, inline,
                                         message_length, payloads)
from distdl.checks import announce, check_mode, verify
from distdl.partition import MPIPartition
from distdl.utilities.caches import keep
from distdl.utilities.slicing import compute_start_index, compute_stop_index, compute_subshape

__all__ = ["repartition"]

_TAG = 7301
_PLANS_KEPT = 16  # overlap plans kept per pair of partitions, keyed by the blocks' shapes and dtype


@host_staged
def repartition(x: torch.Tensor, P_x: MPIPartition, P_y: MPIPartition, preserve_batch: bool = True) -> torch.Tensor:
    """Return this worker's block over ``P_y`` of the global tensor whose blocks over ``P_x`` are ``x``.

    Args:
        x: this worker's balanced block over ``P_x``; a zero-volume tensor outside ``P_x``.
        P_x: the partition ``x`` is decomposed over.
        P_y: the partition the result is decomposed over (same root, same dimension as ``P_x``).
        preserve_batch: zero-volume outputs keep ``x``'s first extent, as ``(b, 0)``.
    Returns:
        A new tensor (never aliasing ``x``); zero-volume outside ``P_y``. Where ``P_y`` equals ``P_x``, a copy
        of ``x``, without communication (so without the check of the blocks below).
    Raises:
        ValueError: partitions of different roots or dimensions, ``x`` of the wrong dimension, data
            outside ``P_x``, or (on every worker of both, ``P_y`` other than ``P_x``) blocks that are not one
            balanced decomposition.
        TypeError: non-tensor input, non-partition arguments or an unsupported dtype.
    """
    where = "repartition"
    pair = _pair(where, P_x, P_y, preserve_batch)
    try:  # in check mode a worker failing here still takes part in the check (a receiver its peers wait for)
        check_tensor(where, x)
        check_idle_input(where, P_x, x)
        check_dim(where, P_x, x)
        if P_x.active:
            header_of(where, x)  # rejects dtypes that cannot be described to receivers
    except (TypeError, ValueError) as error:
        announce(where, lambda: pair.P_union or P_x, error)
        raise
    if check_mode():  # the workers of both partitions take part; receivers hold placeholders
        verify(where, pair.P_union or P_x, agree=())
    if torch.is_grad_enabled():
        x = receiving_in_graph(x, P_x) if P_y.active else in_graph(x)  # a worker in neither keeps its dtype
        if x.requires_grad:
            return _Repartition.apply(x, pair)
    return _forward(x, P_x, P_y, pair)[0]  # nothing to record (e.g. inside a backward): skip autograd's ~5 us


def check_pair(where: str, P_x: object, P_y: object) -> None:
    """Check that ``P_x`` and ``P_y`` are partitions of one root with the same dimension."""
    check_partition(where, "P_x", P_x)
    check_partition(where, "P_y", P_y)
    P_x._check_same_root(where, P_y)
    if P_x.dim != P_y.dim:
        raise ValueError(f"{where}: expected P_x and P_y of the same dimension, got shapes {P_x.shape} "
                         f"and {P_y.shape}")
    if P_x.active or P_y.active:  # a member of either must know both, to build their union
        P_x._require_members(where)
        P_y._require_members(where)
        P_x._check_joinable(where, P_y)


def union(P_x: MPIPartition, P_y: MPIPartition) -> MPIPartition | None:
    """Return the union of ``P_x`` and ``P_y``, built once and shared by both directions; None if unneeded."""
    if P_x == P_y or not (P_x.active or P_y.active):
        return None
    built = P_y._cached_with(P_x, "union")  # the other way round
    return built if built is not None else P_x._memo_with(P_y, "union", lambda: P_x.create_partition_union(P_y))


class _Pair:
    """What the first call from ``P_x`` to ``P_y`` validated and built, kept in ``P_x``'s cache.

    At 8 B a call's cost is mostly Python, so later calls with these very partition objects find
    it by identity (``MPIPartition.__hash__`` is Python code) instead of checking them again. It
    refers to the partitions weakly (see ``MPIPartition._memo_with``).
    """
    __slots__ = ("x_ref", "y_ref", "preserve_batch", "P_union", "comm", "plans")

    def __init__(self, P_x: MPIPartition, P_y: MPIPartition, preserve_batch: bool) -> None:
        self.x_ref, self.y_ref, self.preserve_batch = weakref.ref(P_x), weakref.ref(P_y), preserve_batch
        self.P_union = union(P_x, P_y)
        self.comm = None if self.P_union is None else self.P_union.comm
        self.plans: dict = {}  # _Plan per global structure, keyed by the headers of P_x's blocks


def _pair(where: str, P_x: object, P_y: object, preserve_batch: object) -> _Pair:
    """Return the :class:`_Pair` of a call, checking the partitions where none is cached for them."""
    check_partition(where, "P_x", P_x)
    if type(preserve_batch) is not bool:  # as broadcast and sum_reduce: a bool (or numpy bool) only
        (preserve_batch,) = check_flags(where, preserve_batch=preserve_batch)
    key = ("repartition pair", preserve_batch)
    pair = P_x._cached_with(P_y, key)
    if pair is not None and P_y._freed:
        P_y._check_live(f"{where} (P_y)")
    if pair is None or (pair.P_union is not None and pair.P_union.comm is not pair.comm):  # or a union freed since
        check_pair(where, P_x, P_y)
        P_x._cache.pop((key, id(P_y)), None)
        pair = P_x._memo_with(P_y, key, lambda: _Pair(P_x, P_y, bool(preserve_batch)))
    return pair


class _Repartition(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, pair):  # one argument besides x: each costs autograd ~1 us
        save_anchor(ctx)
        ctx.P_x, ctx.P_y, ctx.pair, ctx.x_shape, ctx.x_dtype = pair.x_ref(), pair.y_ref(), pair, x.shape, x.dtype
        y, ctx.plan = _forward(x, ctx.P_x, ctx.P_y, pair)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        begin_backward(ctx, grad_y, ctx.P_x, ctx.P_y)
        pair = ctx.pair
        if torch.is_grad_enabled():  # double backward: record the adjoint too
            grad_x = repartition(grad_y, ctx.P_y, ctx.P_x, pair.preserve_batch)
        else:  # the forward validated the arguments; autograd gives grad_y y's shape and dtype
            if check_mode():
                verify("repartition (backward)", pair.P_union or ctx.P_y, agree=())
            grad_x = _adjoint(grad_y, ctx.P_x, ctx.P_y, pair, ctx.plan)
        return grad_like(grad_x, ctx.x_shape, ctx.x_dtype), None


def _forward(x, P_x, P_y, pair):
    """Return this worker's block of ``R x`` and the plan it moved by (None without a union)."""
    if pair.P_union is None:
        return (x.clone() if P_x.active else zero_volume_like(x, pair.preserve_batch)), None
    # Header round; in unions of up to INLINE_GROUP workers, blocks of up to INLINE_BYTES ride along.
    size = pair.comm.size
    messages = np.empty((size, message_length(size)), dtype=np.int64)
    pair.comm.Allgather((encode_message("repartition", x) if P_x.active else empty_message())[:messages.shape[1]],
                        messages)
    key = messages[:, :HEADER_LENGTH].tobytes()  # the rows of workers outside P_x are always empty headers
    plan = pair.plans.get(key)
    if plan is None:
        dtype, shape = _global_structure(messages[_union_ranks(pair.P_union, P_x), :HEADER_LENGTH], P_x)
        plan = keep(pair.plans, key, _Plan(P_x, P_y, pair.P_union, shape, dtype), _PLANS_KEPT)
    return _exchange(x, plan, pair, messages), plan


def _adjoint(grad_y, P_x, P_y, pair, plan):
    """Return ``R* grad_y`` in a backward: every worker knows the global structure from the forward,
    so no header round runs; a collective carries the blocks only where some of them ride in one."""
    if plan is None:
        return grad_y.clone() if P_y.active else zero_volume_like(grad_y, pair.preserve_batch)
    if plan.adjoint is None:
        plan.adjoint = _Plan(P_y, P_x, pair.P_union, plan.shape, plan.dtype)
    adjoint, messages, size = plan.adjoint, None, pair.comm.size
    if adjoint.any_rides and message_length(size) == MESSAGE_LENGTH:  # decided alike by every worker
        messages = np.empty((size, MESSAGE_LENGTH), dtype=np.int64)
        pair.comm.Allgather(encode_message("repartition", grad_y) if P_y.active else empty_message(), messages)
    return _exchange(grad_y, adjoint, pair, messages)


def _exchange(x, plan, pair, messages):
    """Return this worker's block of the moved tensor; ``messages`` (None: no collective) may carry blocks."""
    y = (zero_volume_like(x, pair.preserve_batch) if plan.y_shape is None
         else transport.empty(plan.y_shape, plan.dtype, x.device))
    carried = messages is not None and messages.shape[1] == MESSAGE_LENGTH  # small blocks rode in the messages
    comm, requests, buffers, staged, datatypes = pair.comm, [], [], [], []
    gathered = carried and plan.gather is not None and y.is_cpu
    if gathered and y.numel():  # every piece of y is in the messages: one NumPy gather (~1 us per torch op saved)
        unit, index = plan.gather
        memory = np.frombuffer(MPI.buffer.fromaddress(y.data_ptr(), y.nbytes), dtype=unit)
        messages.view(unit).reshape(-1).take(index, out=memory, mode="clip")  # "clip": unbuffered
    for peer, slices, shape, their_slices, rides in () if gathered else plan.recvs:
        if carried and rides:  # that block came with the headers
            y[slices] = payloads(messages[peer:peer + 1], plan.dtype, shape)[0][their_slices]
            continue
        view = y[slices]  # straight into y where the overlap is contiguous there, or large
        spec = transport.strided(view, datatypes)
        if spec is None:
            buffers.append(view if view.is_contiguous() else transport.empty(view.shape, plan.dtype, x.device))
            if buffers[-1] is not view:
                staged.append((view, buffers[-1]))
            spec = transport.buffer(buffers[-1])
        requests.append(comm.Irecv(spec, source=peer, tag=_TAG))
    for peer, slices in () if carried and plan.x_rides else plan.sends:
        view = x[slices]
        spec = transport.strided(view, datatypes)
        if spec is None:
            buffers.append(transport.contiguous(view))
            spec = transport.buffer(buffers[-1])
        requests.append(comm.Isend(spec, dest=peer, tag=_TAG))
    for x_slices, y_slices in () if gathered else plan.copies:
        y[y_slices] = x[x_slices]
    if requests:
        MPI.Request.Waitall(requests)
    for datatype in datatypes:
        datatype.Free()
    for view, buffer in staged:
        view.copy_(buffer)
    return y


def _global_structure(headers, P_x):
    """Return the dtype and global shape described by the headers of P_x's blocks, checking them."""
    if (headers[:, 0] != headers[0, 0]).any():
        found = sorted({str(decode_header(h)[0]) for h in headers})
        raise ValueError(f"repartition: expected one dtype on every worker of P_x, got {found}")
    blocks = headers[:, 2:2 + P_x.dim]
    index = np.stack(np.unravel_index(np.arange(P_x.size), P_x.shape), axis=1)
    # Along axis k, the global extent is the sum of the blocks on the line through index 0.
    shape = tuple(int(blocks[(np.delete(index, k, axis=1) == 0).all(axis=1), k].sum()) for k in range(P_x.dim))
    expected = compute_subshape(np.broadcast_to(P_x.shape, index.shape), index, np.broadcast_to(shape, index.shape))
    bad = np.flatnonzero((blocks != expected).any(axis=1))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"repartition: expected blocks of P_x forming the balanced decomposition of one tensor, got "
                         f"shape {tuple(blocks[r].tolist())} at P_x index {tuple(index[r].tolist())}, where a global "
                         f"shape of {shape} needs {tuple(expected[r].tolist())}")
    return decode_header(headers[0])[0], shape


def _union_ranks(P_union, P):
    """Return the union ranks of the members of ``P``, in ``P``'s rank order."""
    def build():
        position = {root: i for i, root in enumerate(P_union.root_ranks)}
        return np.array([position[root] for root in P.root_ranks])
    return P_union._memo(("ranks", P.root_ranks), build)


class _Plan:
    """How this worker moves a tensor of one global ``shape`` and ``dtype`` from ``P_x`` to ``P_y``."""
    __slots__ = ("shape", "dtype", "y_shape", "sends", "recvs", "copies", "x_rides", "any_rides", "gather", "adjoint")

    def __init__(self, P_x: MPIPartition, P_y: MPIPartition, P_union: MPIPartition, shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.shape, self.dtype, self.adjoint = shape, dtype, None  # adjoint: the plan back, built in a backward
        self.sends, self.recvs, self.copies = [], [], []
        x_shape = _block(P_x, P_x.index, shape) if P_x.active else None
        self.x_rides = x_shape is not None and inline(dtype, x_shape)
        # Whether any block of P_x can ride in a header round: its last block is its smallest.
        self.any_rides = inline(dtype, _block(P_x, [p - 1 for p in P_x.shape], shape))
        if P_x.active:
            ranks_y = _union_ranks(P_union, P_y)
            for j, x_slices, y_slices in _overlaps(shape, P_x.shape, P_x.index, P_y.shape):
                peer = int(ranks_y[np.ravel_multi_index(j, P_y.shape)])
                if peer == P_union.rank:
                    self.copies.append((x_slices, y_slices))
                else:
                    self.sends.append((peer, x_slices))
        sources = []  # (union rank, slices of y, block shape, slices of that block) of every piece of y
        if P_y.active:
            ranks_x = _union_ranks(P_union, P_x)
            for i, y_slices, x_slices in _overlaps(shape, P_y.shape, P_y.index, P_x.shape):
                peer = int(ranks_x[np.ravel_multi_index(i, P_x.shape)])
                their_shape = _block(P_x, i, shape)
                sources.append((peer, y_slices, their_shape, x_slices))
                if peer != P_union.rank:
                    self.recvs.append((peer, y_slices, their_shape, x_slices, inline(dtype, their_shape)))
        self.y_shape = _block(P_y, P_y.index, shape) if P_y.active else None
        self.gather = None  # where each element of y lies in allgathered messages, when every piece rides there
        if self.y_shape is not None and all(inline(dtype, block) for _, _, block, _ in sources):
            self.gather = _gather_index(self.y_shape, sources, dtype)


def _block(P, index, shape):
    """Return the shape of the block at ``index`` of ``P`` of the global ``shape``."""
    return tuple(compute_subshape(P.shape, index, shape).tolist())


def _gather_index(y_shape, sources, dtype):
    """Return the positions of y's elements in allgathered messages viewed as a flat array of ``dtype``'s size."""
    unit = np.dtype(f"u{dtype.itemsize}") if dtype.itemsize <= 8 else np.dtype((np.void, dtype.itemsize))
    row, start = MESSAGE_LENGTH * 8 // unit.itemsize, HEADER_BYTES // unit.itemsize
    index = np.empty(y_shape, dtype=np.intp)
    for peer, y_slices, block, block_slices in sources:
        index[y_slices] = (peer * row + start + np.arange(math.prod(block)).reshape(block))[block_slices]
    return unit, index.reshape(-1)


def _overlaps(shape, P_mine, index, P_theirs):
    """Yield ``(their index, slices of my block, slices of theirs)`` for each block of ``P_theirs`` meeting mine."""
    per_axis = []
    for n, p, i, q in zip(shape, P_mine, index, P_theirs):
        (a, b), hits = _bounds(n, p, i), []
        for j in range(q):
            c, d = _bounds(n, q, j)
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                hits.append((j, slice(lo - a, hi - a), slice(lo - c, hi - c)))
        per_axis.append(hits)
    for combination in itertools.product(*per_axis):
        yield tuple(zip(*combination))


def _bounds(n, p, i):
    """Return ``(start, stop)`` of block ``i`` of ``n`` elements balanced over ``p`` workers."""
    return int(compute_start_index([p], [i], [n])[0]), int(compute_stop_index([p], [i], [n])[0])
