"""DistributedLinearAllGather: the column-parallel linear layer (all-gather, then this worker's output block).

Forward ``y_m = AllGather_axis(x) W[out_block_m]^T + b[out_block_m]`` on the worker at coordinate ``m`` of
the model-parallel partition axis ``axis``, which splits tensor dimension ``axis`` of ``x``: the features
(``axis=-1``) or, with the features whole (``P_x.shape[-1] == 1``), e.g. the tokens (``axis=-2``, sequence
parallelism). Backward: ``dx = ReduceScatter_axis(dy W[out_block_m])``. The output's features are split along
the model-parallel coordinate: it lives on ``P_y``, the same workers as ``P_x`` with the extents of
``axis`` and the last axis swapped (``P_y`` is ``P_x`` when ``axis=-1``). The other partition axes (data
parallelism) replicate ``W`` and ``b``, whose gradients are summed over them.

``overlap=True`` passes the blocks of ``x`` around a ring of the model-parallel fibre with non-blocking
point-to-point messages and multiplies each block while the next one travels (:func:`all_gather_linear`);
its backward is the reduce-scatter ring of :mod:`distdl.nn.linear_reduce_scatter`.

==========================  =================================================================
worker                      does
==========================  =================================================================
in P_x                      gathers ``x`` along ``axis``, multiplies by its output block of ``W``
outside P_x                 passes and gets a zero-volume tensor; holds zero-volume parameters
==========================  =================================================================
"""

from __future__ import annotations

import math

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import cuda
from distdl.backends import mpi as transport
from distdl.checks import verify
from distdl.functional._common import (check_flags, check_idle_input, check_partition, check_tensor, encode_header,
                                       idle_output, in_graph)
from distdl.functional.all_gather import all_gather, exchange_headers
from distdl.functional.all_sum_reduce import fibre
from distdl.functional.invariant import all_sum_reduce_backward
from distdl.functional.reduce_scatter import reduce_scatter
from distdl.nn.linear import SeededInit, check_features, uniform
from distdl.nn.module import CollectStateMixin, StateLayout
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index
from distdl.utilities.torch import eager_when_compiled

__all__ = ["DistributedLinearAllGather", "all_gather_linear", "tensor_parallel_partition"]

RING_TAG = 0x1EA  # point-to-point tag of the rings of the overlapped linear layers


def tensor_parallel_partition(P_x: MPIPartition, axis: int) -> MPIPartition:
    """Return the workers of ``P_x`` with the extents of ``axis`` and the last axis swapped, built once.

    The worker at index ``j`` of the result is the worker at ``j`` with those two coordinates swapped.
    """
    check_partition("tensor_parallel_partition", "P_x", P_x)
    axis = check_axis("tensor_parallel_partition", P_x, axis)
    last = P_x.dim - 1
    if axis == last:
        return P_x

    def build() -> MPIPartition:
        perm = list(range(P_x.dim))
        perm[axis], perm[last] = last, axis
        shape = tuple(P_x.shape[k] for k in perm)
        order = np.arange(P_x.size).reshape(P_x.shape).transpose(perm).ravel().tolist()
        if order == sorted(order):
            return P_x.create_cartesian_topology_partition(shape)
        listed = P_x.create_partition_inclusive(order)
        P_y = listed.create_cartesian_topology_partition(shape)
        listed.free()
        return P_y
    return P_x._memo(("tensor_parallel_partition", axis), build)


def check_axis(where: str, P: MPIPartition, axis: object) -> int:
    """Return ``axis`` as an index in ``[0, P.dim)``; ValueError if it is not a partition axis."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -P.dim <= axis < P.dim:
        raise ValueError(f"{where}: expected an axis in [{-P.dim}, {P.dim}) for P_x of shape {P.shape}, got {axis!r}")
    return int(axis) % P.dim


def check_operands(where: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless ``weight`` is a matrix of ``x``'s real floating dtype (the rings'
    backward does not conjugate: complex is refused)."""
    check_tensor(where, x)
    check_tensor(where, weight)
    if weight.dim() != 2:
        raise ValueError(f"{where}: expected a weight of 2 dimensions, got shape {tuple(weight.shape)}")
    if weight.dtype == x.dtype and x.is_complex():
        raise TypeError(f"{where}: expected x and weight of one real floating dtype, got complex {x.dtype} (complex "
                        "is not supported)")
    if weight.dtype != x.dtype or not x.is_floating_point():
        raise TypeError(f"{where}: expected x and weight of one floating dtype, got {x.dtype} and {weight.dtype}")


def autocast_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``x`` and ``weight`` in autocast's dtype where autocast is on for ``x``'s device (torch's Linear casts
    them so), else as they are: the rings multiply, send and save blocks of one dtype."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        return x.to(dtype), weight.to(dtype)
    return x, weight


def build_fibres(P: MPIPartition, *axes_lists: tuple[int, ...]) -> None:
    """Build the communicators of the fibres of more than one worker along each of ``axes_lists``, once."""
    for axes in axes_lists:
        if math.prod(P.shape[a] for a in axes) > 1:
            fibre(P, axes)


def replicated(t: torch.Tensor, P: MPIPartition, axes: tuple[int, ...]) -> torch.Tensor:
    """Return ``t`` as used by every replica along ``axes`` of ``P``: its gradient is summed over them."""
    if math.prod(P.shape[a] for a in axes) == 1:
        return t
    return all_sum_reduce_backward(t, P, axes_reduce=axes)


def rows(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` as a matrix of its last dimension's vectors."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def block_extents(n: int, parts: int) -> list[tuple[int, int]]:
    """Return the ``(start, stop)`` of each balanced block of ``n`` over ``parts``."""
    starts = [int(compute_start_index((parts,), (j,), (n,))[0]) for j in range(parts)] + [n]
    return list(zip(starts[:-1], starts[1:]))


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, P_x: MPIPartition, axis: int) -> torch.Tensor:
    """Return ``all_gather(x, P_x, (axis,)) @ weight.T``, multiplying each block as it arrives around a ring.

    Args:
        x: this worker's balanced block along tensor dimension ``axis`` (``x.dim() == P_x.dim``).
        weight: ``(n, k)``, with ``k`` the gathered tensor's last extent.
        P_x: the partition; ``axis`` one of its axes, whose fibre forms the ring.
    Returns:
        A new tensor; zero-volume outside ``P_x``.
    Raises:
        ValueError: an axis out of range, a tensor not of ``P_x``'s dimension, a weight of the wrong width;
            and, on every member of the fibre, blocks of a non-balanced decomposition or of differing dtypes.
        TypeError: ``x`` and ``weight`` not of one floating dtype.
    """
    where = "all_gather_linear"
    check_operands(where, x, weight)
    check_partition(where, "P_x", P_x)
    return _all_gather_linear(where, x, weight, P_x, check_axis(where, P_x, axis))[0]


@eager_when_compiled
def _all_gather_linear(where, x, weight, P_x, axis):
    """Return ``(all_gather(x) @ weight.T, all_gather(x))`` (differentiable in both)."""
    cuda.refuse_unsupported(where)  # the ring's Function would drop a forward-mode tangent, as the primitives'
    check_idle_input(where, P_x, x)
    if not P_x.active:
        return idle_output(x), in_graph(x).clone()
    if x.dim() != P_x.dim:
        raise ValueError(f"{where}: expected a tensor of {P_x.dim} dimensions to match P_x of shape {P_x.shape}, "
                         f"got shape {tuple(x.shape)}")
    P_fibre = fibre(P_x, (axis,))
    verify(where, P_fibre, x, ("dim", "device"))  # check mode: a skipped call or backward is named, not paired
    shapes = [tuple(x.shape)]
    if P_fibre.size > 1:
        shapes = exchange_headers(where, P_fibre, encode_header(where, x))
        total = sum(s[axis] for s in shapes)
        for j, (s, (lo, hi)) in enumerate(zip(shapes, block_extents(total, P_fibre.size))):
            expected = shapes[0][:axis] + (hi - lo,) + shapes[0][axis + 1:]
            if s != expected:
                raise ValueError(f"{where}: expected the blocks of a balanced decomposition, got shape {s} on "
                                 f"worker {P_fibre.root_ranks[j]} (expected {expected})")
    k = sum(s[-1] for s in shapes) if axis == x.dim() - 1 else x.shape[-1]
    if weight.shape[1] != k:
        raise ValueError(f"{where}: expected a weight of {k} columns (the gathered features), got shape "
                         f"{tuple(weight.shape)} on worker {P_x._root.rank}")
    if cuda.needs_staging(x):  # the ring hands tensor memory to MPI: a staged tensor takes the plain collective
        gathered = all_gather(x, P_x, axes_all_gather=(axis,))
        return torch.nn.functional.linear(gathered, weight), gathered
    return _AllGatherLinear.apply(in_graph(x), weight, P_x, axis, P_fibre, shapes)


class _AllGatherLinear(torch.autograd.Function):
    """Return ``(x_full @ w.T, x_full)`` with ``x_full`` gathered around the ring; backward: the reduce-scatter ring."""

    @staticmethod
    def forward(ctx, x, weight, P_x, axis, P_fibre, shapes):
        ctx.set_materialize_grads(False)  # the gathered output is rarely used: no reduce-scatter of zeros
        ctx.P_x, ctx.axis = P_x, axis
        size, rank = P_fibre.size, P_fibre.rank
        extents = block_extents(sum(s[axis] for s in shapes), size)
        full_shape = list(shapes[0])
        full_shape[axis] = extents[-1][1]
        on_features = axis == x.dim() - 1
        x_full = transport.empty(full_shape, x.dtype, x.device)
        accumulate = transport.reduction_dtype("all_gather_linear", x.dtype) if on_features else x.dtype
        y = torch.zeros(full_shape[:-1] + [weight.shape[0]], dtype=accumulate, device=x.device)
        chunk = transport.contiguous(x)
        if chunk.is_cuda:  # MPI reads the memory directly
            torch.cuda.current_stream(chunk.device).synchronize()
        for step in range(size):
            source = (rank - step) % size
            requests = []
            if step < size - 1:  # pass the block in hand on while receiving the next one
                incoming = transport.empty(shapes[(source - 1) % size], x.dtype, x.device)
                requests = [P_fibre.comm.Irecv(transport.buffer(incoming), (rank - 1) % size, RING_TAG),
                            P_fibre.comm.Isend(transport.buffer(chunk), (rank + 1) % size, RING_TAG)]
            lo, hi = extents[source]
            try:
                x_full.narrow(axis, lo, hi - lo).copy_(chunk)
                if on_features:
                    y += torch.nn.functional.linear(chunk, weight[:, lo:hi])
                else:
                    y.narrow(axis, lo, hi - lo).copy_(torch.nn.functional.linear(chunk, weight))
            finally:  # also when the multiply raises: MPI must be done with the buffers before they are freed
                MPI.Request.Waitall(requests)
            if requests:
                chunk = incoming
        ctx.save_for_backward(weight, x_full)
        ctx.y_shape = y.shape
        return y.to(x.dtype), x_full

    @staticmethod
    def backward(ctx, grad_y, grad_full):
        from distdl.nn.linear_reduce_scatter import _linear_reduce_scatter  # the rings refer to each other
        weight, x_full = ctx.saved_tensors
        if grad_y is None:
            grad_y = weight.new_zeros(ctx.y_shape)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = _linear_reduce_scatter("all_gather_linear (backward)", grad_y, weight.t(), ctx.P_x, ctx.axis)
            if grad_full is not None:
                grad_x = grad_x + reduce_scatter(grad_full, ctx.P_x, axes_reduce_scatter=(ctx.axis,))
        if ctx.needs_input_grad[1]:
            grad_weight = rows(grad_y).t() @ rows(x_full)
        return grad_x, grad_weight, None, None, None, None


class DistributedLinearAllGather(SeededInit, CollectStateMixin, torch.nn.Module):
    """Column-parallel linear layer: all-gather ``x`` along ``axis``, multiply by this worker's output block.

    Args:
        P_x: the input partition (of ``x``'s dimension); ``axis`` is the model-parallel axis.
        in_features, out_features: the GLOBAL feature counts; ``out_features`` is split along ``axis``.
        bias: whether to add a learnable bias.
        axis: the partition axis (= tensor dimension) gathered: ``-1`` (features) or another one when
            ``P_x.shape[-1] == 1``.
        collect_state: save and load torch's state dict on rank 0 of the root partition (see
            :mod:`distdl.nn.module`).
        overlap: gather around a ring, multiplying each block while the next one travels.
    Attributes:
        P_y: the partition of the output (features split along its last axis).
    Raises:
        ValueError: an axis out of range, a partition the layer cannot use, negative feature counts.
    """

    def __init__(self, P_x: MPIPartition, in_features: int, out_features: int, bias: bool = True, axis: int = -1,
                 collect_state: bool = False, overlap: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        name = "DistributedLinearAllGather"
        check_partition(name, "P_x", P_x)
        check_features(name, in_features=in_features, out_features=out_features)
        self.use_bias, self.collect_state, self.overlap = check_flags(name, bias=bias, collect_state=collect_state,
                                                                      overlap=overlap)
        self.axis = check_axis(name, P_x, axis)
        if self.axis != P_x.dim - 1 and P_x.shape[-1] != 1:
            raise ValueError(f"{name}: expected the features whole (P_x.shape[-1] == 1) when gathering axis {axis}, "
                             f"got P_x of shape {P_x.shape}")
        self.P_x, self.in_features, self.out_features = P_x, int(in_features), int(out_features)
        self.P_y = tensor_parallel_partition(P_x, self.axis)
        self.axes_replicated = tuple(a for a in range(P_x.dim) if a != self.axis)
        fibre(P_x, (self.axis,))  # the communicators are built here, once
        build_fibres(P_x, self.axes_replicated)
        parts, m = P_x.shape[self.axis], P_x.index[self.axis] if P_x.active else 0
        out_lo, out_hi = block_extents(self.out_features, parts)[m] if P_x.active else (0, 0)
        in_lo, in_hi = block_extents(self.in_features, parts)[m] if self.axis == P_x.dim - 1 else (0, self.in_features)
        self.local_in_features = in_hi - in_lo
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        shape, factory = (self.out_features, self.in_features), {"dtype": dtype, "device": device}
        width = self.in_features  # also outside P_x: see [1] in distdl/nn/linear.py
        self._init_partition = P_x
        self._init_blocks = {"weight": (shape, (out_lo, 0), (out_hi - out_lo, width), uniform(bound), 0),
                             "bias": ((self.out_features,), (out_lo,), (out_hi - out_lo,), uniform(bound), 1)}
        self.weight = torch.nn.Parameter(torch.empty(out_hi - out_lo, width, **factory))
        self.register_parameter("bias", torch.nn.Parameter(torch.empty(out_hi - out_lo, **factory))
                                if self.use_bias else None)
        self.reset_parameters()

    def _state_layouts(self) -> dict[str, StateLayout]:
        return {"weight": StateLayout((self.out_features, self.in_features), (self.axis, None)),
                "bias": StateLayout((self.out_features,), (self.axis,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of ``y`` over ``P_y`` (zero-volume outside ``P_x``)."""
        name = "DistributedLinearAllGather"
        self._verify_replicas(name)
        check_tensor(name, x)
        check_idle_input(name, self.P_x, x)
        if not self.P_x.active:
            return idle_output(x)  # backward runs here too
        if x.dim() != self.P_x.dim or x.shape[-1] != self.local_in_features:
            raise ValueError(f"{name}: expected a tensor of {self.P_x.dim} dimensions with {self.local_in_features} "
                             f"features (of {self.in_features}) over P_x of shape {self.P_x.shape}, got shape "
                             f"{tuple(x.shape)} on worker {self.P_x._root.rank}")
        x, weight = autocast_operands(x, replicated(self.weight, self.P_x, self.axes_replicated))
        check_operands(name, x, weight)  # before the ring posts its messages
        if self.overlap and not cuda.needs_staging(x):  # the ring hands device memory to MPI
            y = _all_gather_linear(name, x, weight, self.P_x, self.axis)[0]
        else:
            y = torch.nn.functional.linear(all_gather(x, self.P_x, axes_all_gather=(self.axis,)), weight)
        bias = self.bias  # once: a parametrization computes it at each read
        if bias is not None:
            y = y + replicated(bias, self.P_x, self.axes_replicated).to(y.dtype)  # autocast: y's dtype, as torch
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"axis={self.axis}, overlap={self.overlap}, P_x shape={self.P_x.shape}, P_y shape={self.P_y.shape}")
