"""DistributedLinearReduceScatter: the row-parallel linear layer (partial products, then reduce-scatter).

Forward ``y = ReduceScatter_axis(x_m W[:, in_block_m]^T) + b_block`` on the worker at coordinate ``m`` of
the last (model-parallel) partition axis, which splits the features of ``x``: each worker's product is
a partial sum of the whole output, and the reduce-scatter sums them and splits tensor dimension
``axis``: the output features (``axis=-1``) or, when ``P_x.shape[axis] == 1``, e.g. the tokens (``axis=-2``,
sequence parallelism); the bias (its block along ``axis=-1``, else whole) is added once, after it.
Backward: ``dx_m = AllGather_axis(dy) W[:, in_block_m]``. The output lives on ``P_y``, the same workers as
``P_x`` with the extents of ``axis`` and the last axis swapped (``P_y`` is ``P_x`` when ``axis=-1``). The
other partition axes (data parallelism) replicate the parameters, whose gradients are summed over them.

``overlap=True`` computes the partial block destined for the next worker of a ring of the model-parallel
fibre while the previous partial travels, with non-blocking point-to-point messages
(:func:`linear_reduce_scatter`); its backward is the all-gather ring of
:mod:`distdl.nn.linear_all_gather`.

==========================  =================================================================
worker                      does
==========================  =================================================================
in P_x                      multiplies its features by its input block of ``W``, reduce-scatters
outside P_x                 passes and gets a zero-volume tensor; holds zero-volume parameters
==========================  =================================================================
"""

from __future__ import annotations

import math

import torch
from mpi4py import MPI

from distdl.backends import cuda
from distdl.backends import mpi as transport
from distdl.checks import verify
from distdl.functional._common import (check_flags, check_idle_input, check_partition, check_tensor, encode_header,
                                       idle_output, in_graph)
from distdl.functional.all_gather import all_gather, exchange_headers
from distdl.functional.all_sum_reduce import fibre
from distdl.functional.reduce_scatter import reduce_scatter
from distdl.nn.linear import SeededInit, check_features, uniform
from distdl.nn.linear_all_gather import (RING_TAG, _all_gather_linear, autocast_operands, block_extents, build_fibres,
                                         check_axis, check_operands, replicated, rows, tensor_parallel_partition)
from distdl.nn.module import CollectStateMixin, StateLayout
from distdl.partition import MPIPartition
from distdl.utilities.torch import eager_when_compiled

__all__ = ["DistributedLinearReduceScatter", "linear_reduce_scatter"]


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, P_y: MPIPartition, axis: int) -> torch.Tensor:
    """Return ``reduce_scatter(x @ weight.T, P_y, (axis,))``, computing each block as the previous one travels.

    Args:
        x: this worker's tensor (``x.dim() == P_y.dim``); the products must agree in shape over the fibre.
        weight: ``(n, k)`` with ``k == x.shape[-1]``.
        P_y: the partition of the output; the fibre along ``axis`` forms the ring.
    Returns:
        A new tensor: this worker's balanced block of the summed product; zero-volume outside ``P_y``.
    Raises:
        ValueError: an axis out of range, a tensor not matching ``P_y`` or the weight; and, on every member
            of the fibre, products of differing shapes or dtypes.
        TypeError: ``x`` and ``weight`` not of one floating dtype.
    """
    return _linear_reduce_scatter("linear_reduce_scatter", x, weight, P_y, axis)


@eager_when_compiled
def _linear_reduce_scatter(where, x, weight, P_y, axis):
    """:func:`linear_reduce_scatter`, named ``where`` (``all_gather_linear (backward)`` in that ring's adjoint)."""
    check_operands(where, x, weight)
    cuda.refuse_unsupported(where)  # the ring's Function would drop a forward-mode tangent, as the primitives'
    check_partition(where, "P_y", P_y)
    axis = check_axis(where, P_y, axis)
    check_idle_input(where, P_y, x, "P_y")
    if not P_y.active:
        return idle_output(x)  # backward runs here too
    if x.dim() != P_y.dim or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{where}: expected a tensor of {P_y.dim} dimensions (P_y has shape {P_y.shape}) and "
                         f"{weight.shape[1]} features (the weight's columns), got shape {tuple(x.shape)} on worker "
                         f"{P_y._root.rank}")
    if cuda.needs_staging(x):  # the ring hands tensor memory to MPI: a staged tensor takes the plain collective
        return reduce_scatter(torch.nn.functional.linear(x, weight), P_y, axes_reduce_scatter=(axis,))
    P_fibre = fibre(P_y, (axis,))
    verify(where, P_fibre, x, ("dim", "device"))  # check mode: a skipped call or backward is named, not paired
    if P_fibre.size > 1:
        product = torch.empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=x.dtype, device="meta")
        shapes = exchange_headers(where, P_fibre, encode_header(where, product))
        for j, shape in enumerate(shapes):
            if shape != shapes[0]:
                raise ValueError(f"{where}: expected products of one shape on every member of the fibre, got "
                                 f"{shapes[0]} on worker {P_fibre.root_ranks[0]} and {shape} on worker "
                                 f"{P_fibre.root_ranks[j]}")
    return _LinearReduceScatter.apply(in_graph(x), weight, P_y, axis, P_fibre)


class _LinearReduceScatter(torch.autograd.Function):
    """Return this worker's block of the ring sum of ``x @ w.T``; backward: the all-gather ring."""

    @staticmethod
    def forward(ctx, x, weight, P_y, axis, P_fibre):
        ctx.P_y, ctx.axis = P_y, axis
        ctx.save_for_backward(x, weight)
        size, rank = P_fibre.size, P_fibre.rank
        on_features = axis == x.dim() - 1
        extents = block_extents(weight.shape[0] if on_features else x.shape[axis], size)
        accumulate = transport.reduction_dtype("linear_reduce_scatter", x.dtype)

        def partial(j: int) -> torch.Tensor:  # this worker's term of block j of the sum
            lo, hi = extents[j]
            if on_features:
                return transport.contiguous(torch.nn.functional.linear(x, weight[lo:hi]), accumulate)
            return transport.contiguous(torch.nn.functional.linear(x.narrow(axis, lo, hi - lo), weight), accumulate)

        requests, held = [], []  # held: the memory of the messages, alive until they complete
        try:
            for step in range(size):  # block (rank - step - 1) arrives from the left, summed over `step` workers
                block = (rank - step - 1) % size
                if step > 0:
                    incoming = transport.empty(partial_shape(x, weight, axis, extents[block]), accumulate, x.device)
                    receive = P_fibre.comm.Irecv(transport.buffer(incoming), (rank - 1) % size, RING_TAG)
                    requests.append(receive)
                total = partial(block)
                if step > 0:
                    receive.Wait()
                    total = incoming.add_(total)  # not into the product: checkpointing policies may keep it
                if step < size - 1:
                    if total.is_cuda:  # MPI reads the memory directly
                        torch.cuda.current_stream(total.device).synchronize()
                    requests.append(P_fibre.comm.Isend(transport.buffer(total), (rank + 1) % size, RING_TAG))
                    held.append(total)
        finally:  # also when a multiply raises: MPI must be done with the buffers before they are freed
            MPI.Request.Waitall(requests)
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_full = None
        if ctx.needs_input_grad[0]:
            grad_x, grad_full = _all_gather_linear("linear_reduce_scatter (backward)", grad_y, weight.t(), ctx.P_y,
                                                   ctx.axis)
        elif ctx.needs_input_grad[1]:
            grad_full = all_gather(grad_y, ctx.P_y, axes_all_gather=(ctx.axis,))
        if ctx.needs_input_grad[1]:
            grad_weight = rows(grad_full).t() @ rows(x)
        return grad_x, grad_weight, None, None, None


def partial_shape(x: torch.Tensor, weight: torch.Tensor, axis: int, extent: tuple[int, int]) -> tuple[int, ...]:
    """Return the shape of one block of ``x @ weight.T`` split along ``axis``."""
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    shape[axis] = extent[1] - extent[0]
    return tuple(shape)


class DistributedLinearReduceScatter(SeededInit, CollectStateMixin, torch.nn.Module):
    """Row-parallel linear layer: multiply this worker's features by its input block, reduce-scatter along ``axis``.

    Args:
        P_x: the input partition (of ``x``'s dimension); its last axis splits the input features.
        in_features, out_features: the GLOBAL feature counts.
        bias: whether to add a learnable bias.
        axis: the partition axis (= tensor dimension) the output is scattered along: ``-1`` (features)
            or another one when ``P_x.shape[axis] == 1``.
        collect_state: save and load torch's state dict on rank 0 of the root partition (see
            :mod:`distdl.nn.module`).
        overlap: reduce-scatter around a ring, computing each partial block while the previous one travels.
    Attributes:
        P_y: the partition of the output (split along ``axis``).
    Raises:
        ValueError: an axis out of range, a partition the layer cannot use, negative feature counts.
    """

    def __init__(self, P_x: MPIPartition, in_features: int, out_features: int, bias: bool = True, axis: int = -1,
                 collect_state: bool = False, overlap: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        name = "DistributedLinearReduceScatter"
        check_partition(name, "P_x", P_x)
        check_features(name, in_features=in_features, out_features=out_features)
        self.use_bias, self.collect_state, self.overlap = check_flags(name, bias=bias, collect_state=collect_state,
                                                                      overlap=overlap)
        last = P_x.dim - 1
        self.axis = check_axis(name, P_x, axis)
        if self.axis != last and P_x.shape[self.axis] != 1:
            raise ValueError(f"{name}: expected an unsplit axis {axis} (P_x.shape[{axis}] == 1) to scatter the output "
                             f"along, got P_x of shape {P_x.shape}")
        self.P_x, self.in_features, self.out_features = P_x, int(in_features), int(out_features)
        self.P_y = tensor_parallel_partition(P_x, self.axis)
        self.axes_replicated = tuple(range(last))
        # A bias block along the features is replicated like the weight; a whole bias on every worker.
        self.axes_bias = self.axes_replicated if self.axis == last else tuple(range(P_x.dim))
        fibre(self.P_y, (self.axis,))  # the communicators are built here, once
        build_fibres(P_x, self.axes_replicated, self.axes_bias if self.use_bias else ())
        parts, m = P_x.shape[last], P_x.index[last] if P_x.active else 0
        in_lo, in_hi = block_extents(self.in_features, parts)[m] if P_x.active else (0, 0)
        out_lo, out_hi = block_extents(self.out_features, parts)[m] if self.axis == last else (0, self.out_features)
        self.local_in_features = in_hi - in_lo
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        shape, factory = (self.out_features, self.in_features), {"dtype": dtype, "device": device}
        height = self.out_features if P_x.active else 0
        columns = in_hi - in_lo if P_x.active else self.in_features  # outside P_x: see [1] in distdl/nn/linear.py
        width = out_hi - out_lo if P_x.active else 0
        self._init_partition = P_x
        self._init_blocks = {"weight": (shape, (0, in_lo), (height, columns), uniform(bound), 0),
                             "bias": ((self.out_features,), (out_lo,), (width,), uniform(bound), 1)}
        self.weight = torch.nn.Parameter(torch.empty(height, columns, **factory))
        self.register_parameter("bias", torch.nn.Parameter(torch.empty(width, **factory)) if self.use_bias else None)
        self.reset_parameters()

    def _state_layouts(self) -> dict[str, StateLayout]:
        last = self.P_x.dim - 1
        return {"weight": StateLayout((self.out_features, self.in_features), (None, last)),
                "bias": StateLayout((self.out_features,), (last,) if self.axis == last else (None,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of ``y`` over ``P_y`` (zero-volume outside ``P_x``)."""
        name = "DistributedLinearReduceScatter"
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
        check_operands(name, x, weight)
        if self.overlap and not cuda.needs_staging(x):  # the ring hands device memory to MPI
            y = linear_reduce_scatter(x, weight, self.P_y, self.axis)
        else:
            y = reduce_scatter(torch.nn.functional.linear(in_graph(x), weight), self.P_y,
                               axes_reduce_scatter=(self.axis,))  # in_graph: an inference tensor, as the ring takes
        bias = self.bias  # once: a parametrization computes it at each read
        if bias is not None:
            y = y + replicated(bias, self.P_x, self.axes_bias).to(y.dtype)  # autocast: y's dtype, as torch
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"axis={self.axis}, overlap={self.overlap}, P_x shape={self.P_x.shape}, P_y shape={self.P_y.shape}")
