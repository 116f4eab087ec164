"""AllGather: gather the blocks of a fibre along partition axes; every member gets the whole.

Forward ``y_i = concat_{j in fibre(i)} x_j`` (block ``j`` placed at its index along the gathered
dimensions); adjoint ``x_j = (sum_{i in fibre(j)} y_i)[block j]``, that is
:func:`~distdl.functional.reduce_scatter.reduce_scatter`.

============================  ===============================================
worker                        does
============================  ===============================================
in P_x, fibre of size > 1     contributes its block ``x``, receives the whole
in P_x, fibre of size 1       returns a copy of ``x``
outside P_x                   passes and gets a zero-volume tensor
============================  ===============================================

Partition axis ``k`` gathers tensor dimension ``k``. Block extents are exchanged every call (a
small header per member), so a smaller last batch works; they must follow the balanced
decomposition, which makes :func:`~distdl.functional.reduce_scatter.reduce_scatter` the exact
adjoint. In fibres of up to 8 workers, blocks of up to 1 KiB travel with the headers (one
collective). As the adjoint of :func:`~distdl.functional.reduce_scatter.reduce_scatter` in a
backward, the block shapes are known and no header round runs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.backends.cuda import host_staged
from distdl.functional._common import (HEADER_LENGTH, begin_backward, check_dim, check_idle_input, check_partition,
                                       check_tensor, header_of, in_graph, save_anchor)
from distdl.functional._messages import (HEADER_BYTES, carries_payload, copy_payloads, decode, encode_message,
                                         message_length, payloads, remembered)
from distdl.functional.all_sum_reduce import FibrePlan, checked_fibre, fibre_plan
from distdl.checks import announce, check_mode, verify
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from distdl.utilities.torch import eager_when_compiled

__all__ = ["all_gather"]


@host_staged
def all_gather(x: torch.Tensor, P_x: MPIPartition, axes_all_gather: Iterable[int] | None = None,
               axes_keep: Iterable[int] | None = None) -> torch.Tensor:
    """Return the blocks of this worker's fibre of ``P_x`` along ``axes_all_gather``, assembled.

    Args:
        x: this worker's balanced block; ``x.dim()`` equals ``P_x.dim`` on members.
        P_x: the partition.
        axes_all_gather: partition axes to gather along; or give ``axes_keep``, the axes not gathered.
    Returns:
        A new tensor (never aliasing ``x``) holding the fibre's blocks; zero-volume outside ``P_x``.
    Raises:
        ValueError: axes out of range, both or neither of ``axes_all_gather``/``axes_keep``, a tensor
            whose dimension differs from ``P_x.dim``, data on a worker outside ``P_x``; and, on every
            member of the fibre, blocks of differing dtypes or not of a balanced decomposition.
        TypeError: ``x`` of an unsupported dtype.
    """
    where = "all_gather"
    fibre = member_plan(where, x, P_x, axes_all_gather, axes_keep, "axes_all_gather", summed=False)
    if fibre is None:
        return in_graph(x).clone()  # backward runs here too
    # In check mode, before the header round (whose message a mismatched collective would truncate); the
    # headers then check dtypes and shapes with their own errors.
    verify(where, fibre.P_fibre, x, ("dim", "device"))
    messages = exchange(where, fibre.P_fibre, x)
    plan = _agreed_layout(where, fibre, messages)
    if not torch.is_grad_enabled():  # nothing to record (e.g. inside a backward): skip autograd's ~5 us
        return _gather(x, fibre.P_fibre, plan, messages)
    return _AllGather.apply(in_graph(x), (P_x, fibre, plan, messages))  # one argument: each costs autograd ~1 us


def member_plan(where: str, x: torch.Tensor, P_x: MPIPartition, axes: Iterable[int] | None,
                axes_keep: Iterable[int] | None, what: str, summed: bool) -> FibrePlan | None:
    """Check the arguments of all_gather or reduce_scatter; return the fibre plan, or None where the result
    is a copy of ``x`` (a worker outside ``P_x``, or alone in its fibre)."""
    try:
        check_tensor(where, x)
        check_partition(where, "P_x", P_x)
        plan = fibre_plan(where, x, P_x, axes, axes_keep, what, summed)
        if plan.P_fibre is None:  # outside P_x
            check_idle_input(where, P_x, x)
            return None
        check_dim(where, P_x, x)
        if plan.alone or check_mode():
            header_of(where, x)  # rejects dtypes and shapes that cannot be described to the other members
    except (TypeError, ValueError) as error:
        announce(where, lambda: checked_fibre(where, P_x, axes, axes_keep, what), error)
        raise
    # Outside check mode the header round's encode_message checks x before any communication.
    return None if plan.alone else plan


def exchange_headers(where: str, P_fibre: MPIPartition, header: np.ndarray) -> list[tuple[int, ...]]:
    """Return every member's block shape, in fibre rank order; ValueError on all if dtypes differ."""
    headers = np.empty((P_fibre.size, HEADER_LENGTH), dtype=np.int64)
    P_fibre.comm.Allgather(header, headers)
    return _shapes(where, P_fibre, headers)


def exchange(where: str, P_fibre: MPIPartition, x: torch.Tensor) -> np.ndarray:
    """Return the allgathered messages, one row per member: headers, and small blocks in small fibres."""
    comm = P_fibre.comm
    length = message_length(comm.size)
    messages = np.empty((comm.size, length), dtype=np.int64)
    comm.Allgather(encode_message(where, x)[:length], messages)
    return messages


def agreed(where: str, P_fibre: MPIPartition, key: tuple, messages: np.ndarray, check) -> Layout:
    """Return ``check(shapes)``, the :class:`Layout` the members' headers agree on, remembered by the headers."""
    return remembered(P_fibre, key, messages, lambda rows: check(_shapes(where, P_fibre, rows)))


def _agreed_layout(where: str, fibre: FibrePlan, messages: np.ndarray) -> Layout:
    """Return the :class:`Layout` of the gathered tensor; ValueError on every member unless the blocks are balanced."""
    P_fibre, axes = fibre.P_fibre, fibre.axes
    return agreed(where, P_fibre, ("agreed", where, axes), messages, lambda shapes: layout(
        P_fibre.shape, axes, _global_shape(where, P_fibre.shape, P_fibre.root_ranks, axes, tuple(shapes))))


def _shapes(where: str, P_fibre: MPIPartition, headers: np.ndarray) -> list[tuple[int, ...]]:
    decoded = [decode(h) for h in headers]
    for r, (dtype, shape) in enumerate(decoded):
        if dtype != decoded[0][0]:
            raise ValueError(f"{where}: expected one dtype on every member of the fibre, got {decoded[0][0]} on "
                             f"worker {P_fibre.root_ranks[0]} and {dtype} on worker {P_fibre.root_ranks[r]}")
    return [shape for _, shape in decoded]


@functools.lru_cache(maxsize=512)  # pure, and called on every call with the same few arguments
def block_slices(fibre_shape: Sequence[int], axes: Sequence[int],
                 global_shape: Sequence[int]) -> list[tuple[slice, ...]]:
    """Return, in fibre rank order, where each member's balanced block lies in the global tensor."""
    extents = [global_shape[a] for a in axes]
    blocks = []
    for index in np.ndindex(*fibre_shape):
        start = compute_start_index(fibre_shape, index, extents)
        stop = compute_stop_index(fibre_shape, index, extents)
        bounds = {a: slice(int(b), int(e)) for a, b, e in zip(axes, start, stop)}
        blocks.append(tuple(bounds.get(d, slice(None)) for d in range(len(global_shape))))
    return blocks  # shared between calls: read it, never change it


def in_rank_order(fibre_shape: Sequence[int], axes: Sequence[int], global_shape: Sequence[int]) -> bool:
    """Whether the blocks, flattened in fibre rank order, are already the global tensor's layout."""
    split = [a for a, p in zip(axes, fibre_shape) if p > 1]
    return len(split) <= 1 and math.prod(global_shape[:split[0] if split else 0]) <= 1


@functools.lru_cache(maxsize=512)  # successes only: an error is raised again on every call
def _global_shape(where: str, fibre_shape: tuple[int, ...], root_ranks: tuple[int, ...], axes: tuple[int, ...],
                  shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Return the gathered shape; ValueError (the same on every member) unless the blocks are balanced."""
    ranks = np.arange(math.prod(fibre_shape)).reshape(fibre_shape)
    global_shape = list(shapes[0])
    for j, a in enumerate(axes):
        line = ranks[tuple(slice(None) if k == j else 0 for k in range(len(axes)))]
        global_shape[a] = sum(shapes[r][a] for r in line)
    for r, block in enumerate(block_slices(fibre_shape, axes, tuple(global_shape))):
        expected = tuple(len(range(*s.indices(n))) for s, n in zip(block, global_shape))
        if shapes[r] != expected:
            raise ValueError(f"{where}: expected the blocks of a balanced decomposition of a tensor of shape "
                             f"{tuple(global_shape)}, got shape {shapes[r]} on worker {root_ranks[r]} "
                             f"(expected {expected})")
    return tuple(global_shape)


class Layout(NamedTuple):
    """Where a fibre's balanced blocks lie in the global tensor, and how they travel (see :func:`layout`)."""
    shape: tuple[int, ...]  # the global tensor's
    blocks: list[tuple[slice, ...]]  # in fibre rank order
    shapes: list[tuple[int, ...]]  # the first is the largest (a balanced decomposition's first blocks get extras)
    counts: list[int]  # elements per block
    displacements: list[int]  # element offsets of the blocks laid one after another
    in_rank_order: bool  # the blocks laid one after another are the global tensor's layout
    equal: bool  # every block has as many elements (MPICH's Allgather and Reduce_scatter_block apply)


@functools.lru_cache(maxsize=512)
def layout(fibre_shape: tuple[int, ...], axes: tuple[int, ...], global_shape: tuple[int, ...]) -> Layout:
    """Return the :class:`Layout` of ``global_shape`` over a fibre, computed once (Python is most of a call's
    cost below a few MiB, and slower still right after a large transfer has evicted it from the caches)."""
    blocks = block_slices(fibre_shape, axes, global_shape)
    shapes = [tuple(len(range(*s.indices(n))) for s, n in zip(block, global_shape)) for block in blocks]
    counts = [math.prod(shape) for shape in shapes]
    displacements = [sum(counts[:r]) for r in range(len(counts))]
    return Layout(global_shape, blocks, shapes, counts, displacements, in_rank_order(fibre_shape, axes, global_shape),
                  counts.count(counts[0]) == len(counts))  # shared between calls: read it, never change it


def _gather(x, P_fibre, plan, messages):
    """Return the gathered tensor of :class:`Layout` ``plan``; ``messages`` (or None: not exchanged) may carry
    every block inline."""
    y = transport.empty(plan.shape, x.dtype, x.device)
    if messages is not None and carries_payload(messages, x.dtype, plan.shapes[0]):  # every block rode along
        if not (plan.in_rank_order and copy_payloads(messages, y, plan.counts)):
            _place_payloads(messages, y, plan)
        return y
    send = transport.contiguous(x)  # keep a reference: the buffer spec does not keep the tensor alive
    if not plan.in_rank_order and transport.pairwise(P_fibre.comm, y.nbytes):  # each block straight to its place
        transport.allgather_blocks(P_fibre.comm, send, [y[block] for block in plan.blocks])
        return y
    flat = y if plan.in_rank_order else transport.empty((sum(plan.counts),), x.dtype, x.device)
    size = x.element_size()
    memory = transport.buffer(flat)[0]
    if plan.equal:  # equal blocks: MPICH's Allgather is ~1.5x its Allgatherv
        P_fibre.comm.Allgather(transport.buffer(send), [memory, plan.counts[0] * size, MPI.BYTE])
    else:
        P_fibre.comm.Allgatherv(transport.buffer(send), [memory, [n * size for n in plan.counts],
                                                         [d * size for d in plan.displacements], MPI.BYTE])
    if not plan.in_rank_order:  # unpack: copy each member's block to its place
        for block, shape, n, d in zip(plan.blocks, plan.shapes, plan.counts, plan.displacements):
            y[block] = flat[d:d + n].view(shape)
    return y


def _place_payloads(messages: np.ndarray, y: torch.Tensor, plan: Layout) -> None:
    """Copy each member's block from ``messages`` to its place in ``y``; on the CPU through NumPy views of both
    as bytes, for any dtype (a NumPy copy costs ~0.3 us here, a torch one ~1 us)."""
    if not y.is_cpu:
        for r, (block, shape) in enumerate(zip(plan.blocks, plan.shapes)):
            y[block] = payloads(messages[r:r + 1], y.dtype, shape)[0]
        return
    if not y.numel():
        return
    size = y.element_size()
    out = np.frombuffer(MPI.buffer.fromaddress(y.data_ptr(), y.nbytes), dtype=np.uint8)
    out = out.reshape(*plan.shape[:-1], plan.shape[-1] * size)
    rows = messages.view(np.uint8)[:, HEADER_BYTES:]
    for row, block, shape, n in zip(rows, plan.blocks, plan.shapes, plan.counts):
        last = block[-1] if block[-1].start is None else slice(block[-1].start * size, block[-1].stop * size)
        out[(*block[:-1], last)] = row[:n * size].reshape(*shape[:-1], shape[-1] * size)


@eager_when_compiled  # a backward's: compiled autograd would trace into it
def gather_adjoint(grad: torch.Tensor, P_fibre: MPIPartition, plan: Layout) -> torch.Tensor:
    """Return :func:`all_gather` of ``grad``, this member's block of ``plan``, in a backward.

    Every member's block shape and dtype are already agreed (autograd gives each gradient its
    output's shape and dtype), so no header round runs: even at 8 B one Allgather of the data costs
    less than one of the messages, which adds packing and unpacking.
    """
    verify("all_gather (backward)", P_fibre, grad, ("dim", "dtype", "device"))
    return _gather(grad, P_fibre, plan, None)


class _AllGather(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, call):
        save_anchor(ctx)
        P_x, fibre, plan, messages = call
        ctx.call = P_x, fibre, plan
        return _gather(x, fibre.P_fibre, plan, messages)

    @staticmethod
    def backward(ctx, grad_y):
        begin_backward(ctx, grad_y, ctx.call[0])
        from distdl.functional.reduce_scatter import reduce_scatter, scatter_adjoint
        P_x, fibre, plan = ctx.call
        if torch.is_grad_enabled():  # double backward: record the adjoint too
            return reduce_scatter(grad_y, P_x, axes_reduce_scatter=fibre.axes), None
        return scatter_adjoint(grad_y, fibre.P_fibre, plan), None
