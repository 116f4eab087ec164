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
overlaps then move as non-blocking messages over the union of the partitions, one per pair. In
unions of up to 8 workers, blocks of up to 1 KiB travel with the headers (one collective).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import (HEADER_LENGTH, check_dim, check_idle_input, check_partition, check_tensor,
                                       decode_header, grad_like, header_of, in_graph, zero_volume_like)
from distdl.functional._messages import (carries_payload, empty_message, encode_message, message_length, payloads)
from distdl.checks import check_mode, verify
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_stop_index, compute_subshape

__all__ = ["repartition"]

_TAG = 7301
_PLANS_KEPT = 16  # overlap plans kept per union, keyed by direction and the blocks' shapes and dtype


@host_staged
def repartition(x: torch.Tensor, P_x: MPIPartition, P_y: MPIPartition, preserve_batch: bool = True) -> torch.Tensor:
    """Return this worker's block over ``P_y`` of the global tensor whose blocks over ``P_x`` are ``x``.

    Args:
        x: this worker's balanced block over ``P_x``; a zero-volume tensor outside ``P_x``.
        P_x: the partition ``x`` is decomposed over.
        P_y: the partition the result is decomposed over (same root, same dimension as ``P_x``).
        preserve_batch: zero-volume outputs keep ``x``'s first extent, as ``(b, 0)``.
    Returns:
        A new tensor (never aliasing ``x``); zero-volume outside ``P_y``.
    Raises:
        ValueError: partitions of different roots or dimensions, ``x`` of the wrong dimension, data
            outside ``P_x``, or (on every worker of both) blocks that are not one balanced decomposition.
        TypeError: non-tensor input, non-partition arguments or an unsupported dtype.
    """
    where = "repartition"
    check_tensor(where, x)
    check_pair(where, P_x, P_y)
    check_dim(where, P_x, x)
    check_idle_input(where, P_x, x)
    if P_x.active:
        header_of(where, x)  # rejects dtypes that cannot be described to receivers
    if check_mode():  # the workers of both partitions take part; receivers hold placeholders
        verify(where, union(P_x, P_y) or P_x, agree=())
    return _Repartition.apply(in_graph(x), P_x, P_y, bool(preserve_batch))


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


def union(P_x: MPIPartition, P_y: MPIPartition) -> MPIPartition | None:
    """Return the union of ``P_x`` and ``P_y``, built once and shared by both directions; None if unneeded."""
    if P_x == P_y or not (P_x.active or P_y.active):
        return None
    key = ("repartition", P_y)
    if key not in P_x._cache and ("repartition", P_x) in P_y._cache:
        return P_y._cache[("repartition", P_x)]
    return P_x._memo(key, lambda: P_x.create_partition_union(P_y))


class _Repartition(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, P_x, P_y, preserve_batch):
        ctx.P_x, ctx.P_y, ctx.preserve_batch, ctx.x_shape = P_x, P_y, preserve_batch, x.shape
        P_union = union(P_x, P_y)
        if P_union is None:
            return x.clone() if P_x.active else zero_volume_like(x, preserve_batch)
        return _move(x, P_x, P_y, P_union, preserve_batch)

    @staticmethod
    def backward(ctx, grad_y):
        grad_x = repartition(grad_y, ctx.P_y, ctx.P_x, ctx.preserve_batch)
        return grad_like(grad_x, ctx.x_shape), None, None, None


def _move(x, P_x, P_y, P_union, preserve_batch):
    # Header round; in unions of up to INLINE_GROUP workers, blocks of up to INLINE_BYTES ride along.
    length = message_length(P_union.comm.size)
    messages = np.empty((P_union.comm.size, length), dtype=np.int64)
    P_union.comm.Allgather((encode_message("repartition", x) if P_x.active else empty_message())[:length], messages)
    headers = messages[_union_ranks(P_union, P_x), :HEADER_LENGTH]  # P_x's blocks, in P_x rank order
    # Plans are cached by the blocks' headers (the union serves both P_x -> P_y and P_y -> P_x).
    plans, key = P_union._memo("plans", dict), (P_x.root_ranks, P_x.shape, headers.tobytes())
    if key not in plans:
        dtype, shape = _global_structure(headers, P_x)
        if len(plans) >= _PLANS_KEPT:
            plans.pop(next(iter(plans)))
        plans[key] = (dtype, *_plan(P_x, P_y, P_union, shape))
    dtype, y_shape, sends, recvs, copies = plans[key]
    y = zero_volume_like(x, preserve_batch) if y_shape is None else transport.empty(y_shape, dtype, x.device)
    requests, buffers, staged = [], [], []
    for peer, slices, shape, their_slices in recvs:  # straight into y where the overlap is contiguous there
        if carries_payload(messages, dtype, shape):  # that block came with the headers
            y[slices] = payloads(messages[peer:peer + 1], dtype, shape)[0][their_slices]
            continue
        view = y[slices]
        buffers.append(view if view.is_contiguous() else transport.empty(view.shape, dtype, x.device))
        if buffers[-1] is not view:
            staged.append((view, buffers[-1]))
        requests.append(P_union.comm.Irecv(transport.buffer(buffers[-1]), source=peer, tag=_TAG))
    for peer, slices in sends if not carries_payload(messages, dtype, x.shape) else ():
        buffers.append(transport.contiguous(x[slices]))
        requests.append(P_union.comm.Isend(transport.buffer(buffers[-1]), dest=peer, tag=_TAG))
    for x_slices, y_slices in copies:
        y[y_slices] = x[x_slices]
    MPI.Request.Waitall(requests)
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


def _plan(P_x, P_y, P_union, shape):
    """Return ``(y block shape, sends, receives, local copies)`` of this worker for a global ``shape``."""
    sends, recvs, copies = [], [], []
    if P_x.active:
        ranks_y = _union_ranks(P_union, P_y)
        for j, x_slices, y_slices in _overlaps(shape, P_x.shape, P_x.index, P_y.shape):
            peer = int(ranks_y[np.ravel_multi_index(j, P_y.shape)])
            if peer == P_union.rank:
                copies.append((x_slices, y_slices))
            else:
                sends.append((peer, x_slices))
    if P_y.active:
        ranks_x = _union_ranks(P_union, P_x)
        for i, y_slices, x_slices in _overlaps(shape, P_y.shape, P_y.index, P_x.shape):
            peer = int(ranks_x[np.ravel_multi_index(i, P_x.shape)])
            if peer != P_union.rank:
                their_shape = tuple(compute_subshape(P_x.shape, i, shape).tolist())
                recvs.append((peer, y_slices, their_shape, x_slices))
    y_shape = tuple(compute_subshape(P_y.shape, P_y.index, shape).tolist()) if P_y.active else None
    return y_shape, sends, recvs, copies


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
