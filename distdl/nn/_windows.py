"""Window arithmetic shared by the spatially partitioned layers (convolution, pooling, upsampling).

A windowed layer maps a global ``(N, C, *spatial)`` input, decomposed over ``P_x``, to a global
output decomposed over the same ``P_x`` (balanced blocks). Per spatial dimension the layer gives
the output length for an input length, and the input range ``[a, b)`` an output range ``[o0, o1)``
reads (it may reach past the global edges). From these every worker computes every worker's input
window (cached per set of block shapes), fetches its own with ``window_exchange`` (zeros past the
edges) and applies the torch op to it. A layer whose op pads with zeros (convolution, pooling)
leaves the zeros past the edges to the op wherever they lie on both sides of the window, so that
only halos travel and, where the windows are the blocks, nothing does. Along the batch and channel
dimensions the window is the worker's own block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from distdl.checks import check_mode, verify
from distdl.functional._common import check_idle_input, check_tensor
from distdl.functional.window_exchange import window_exchange
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_stop_index

__all__ = ["as_tuple", "check_input", "Plan", "fetch", "connect", "sliding_length", "sliding_source"]


def as_tuple(where: str, name: str, value: object, d: int, minimum: int = 0) -> tuple[int, ...]:
    """Return ``value`` (an int or ``d`` ints, each at least ``minimum``) as ``d`` ints."""
    values = (value,) * d if isinstance(value, (int, np.integer)) else value
    try:
        values = tuple(values)
    except TypeError:
        values = ()
    if (len(values) != d or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in values)
            or any(v < minimum for v in values)):
        raise ValueError(f"{where}: expected {name} as an int or a sequence of {d}, each at least {minimum}, "
                         f"got {value!r}")
    return tuple(int(v) for v in values)


def check_input(where: str, x: torch.Tensor, P_x: MPIPartition, channels: int | None = None) -> None:
    """Check a layer's input on this worker (no communication)."""
    check_tensor(where, x)
    check_idle_input(where, P_x, x)
    if not P_x.active:
        return
    if x.dim() != P_x.dim:
        raise ValueError(f"{where}: expected a tensor of {P_x.dim} dimensions to match P_x of shape {P_x.shape}, "
                         f"got shape {tuple(x.shape)} on worker {P_x._root.rank}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(f"{where}: expected {channels} channels (dimension 1), got shape {tuple(x.shape)} "
                         f"on worker {P_x._root.rank}")


def _block(P_x: MPIPartition, index, shape) -> tuple[tuple[int, int], ...]:
    start, stop = compute_start_index(P_x.shape, index, shape), compute_stop_index(P_x.shape, index, shape)
    return tuple((int(a), int(b)) for a, b in zip(start, stop))


def _global_shape(where: str, extents: np.ndarray, P_x: MPIPartition) -> tuple[int, ...]:
    """Return the global shape from every worker's block shape; check that they form its balanced blocks."""
    index = np.stack(np.unravel_index(np.arange(P_x.size), P_x.shape), axis=1)
    shape = tuple(int(extents[(np.delete(index, k, axis=1) == 0).all(axis=1), k].sum()) for k in range(P_x.dim))
    for rank in range(P_x.size):
        expected = tuple(b - a for a, b in _block(P_x, index[rank], shape))
        if tuple(extents[rank]) != expected:
            raise ValueError(f"{where}: expected the blocks of a balanced decomposition of a global shape "
                             f"{shape} over P_x of shape {P_x.shape}, got shape {tuple(extents[rank].tolist())} "
                             f"on P_x rank {rank} (expected {expected})")
    return shape


class Plan(NamedTuple):
    x_shape: tuple[int, ...]  # global input shape
    y_shape: tuple[int, ...]  # global output shape
    windows: tuple  # every worker's input window, in P_x rank order, less the zeros the local op adds
    window: tuple[tuple[int, int], ...]  # this worker's input window
    block: tuple[tuple[int, int], ...]  # this worker's output block
    padding: tuple[int, ...]  # per spatial dimension, the zeros the local op adds on both sides of the window
    local: tuple[slice, ...] | None  # every window lies in its worker's block: this worker's window in ``x``


def fetch(where: str, x: torch.Tensor, P_x: MPIPartition, key: tuple, out_channels: int | None,
          length: Callable[[int, int], int], source: Callable[[int, int, int, int, int], tuple[int, int]],
          padded_stride: tuple[int, ...] | None = None) -> tuple[Plan, torch.Tensor]:
    """Return the layer's plan and this worker's input window; collective over ``P_x``.

    One small allgather per call (every worker's block shape, and whether it needs a gradient); the plan
    is built once per key and set of block shapes. Where no worker's input needs a gradient, the exchange
    stays out of the autograd graph. Where every worker's window lies in its own block (pooling with the
    windows aligned to the blocks; one worker) nothing is exchanged and the window is ``x`` or a view of it.

    Args:
        key: what identifies the layer's geometry.
        out_channels: the global output channels (``None``: as the input).
        length: ``length(k, n)``, the output length of spatial dimension ``k`` for input length ``n``.
        source: ``source(k, n, L, o0, o1)``, the input range ``[a, b)`` output range ``[o0, o1)`` reads.
        padded_stride: the local op's stride per spatial dimension where it takes torch's zero padding
            (``plan.padding``, on both sides; convolution, pooling), ``None`` where it takes none. The window
            then leaves out the zeros past the global edges that the op adds itself.
    Raises:
        ValueError: blocks that do not form a balanced decomposition, or an empty global output.
    """
    if check_mode():  # a worker making another windowed call (another layer or geometry, or none) would pair its
        # Allgather with its peers' (silently, where no window is exchanged after it) or with their checks (a hang)
        # (the geometry last: it may hold a flag of the dtype, which is then named first)
        verify(where, P_x, x, agree={"dim": x.dim(), "dtype": x.dtype, "device": x.device.type, "geometry": key})
    facts = np.array((*x.shape, torch.is_grad_enabled() and x.requires_grad), dtype=np.int64).reshape(1, -1)
    if P_x.comm.size > 1:
        mine, facts = facts, np.empty((P_x.comm.size, facts.size), dtype=np.int64)
        P_x.comm.Allgather(mine, facts)
    extents = facts[:, :-1]

    def build():
        x_shape = _global_shape(where, extents, P_x)
        lengths = tuple(length(k, n) for k, n in enumerate(x_shape[2:]))
        if any(n < 1 for n in lengths):
            raise ValueError(f"{where}: expected an input large enough for an output, got global shape {x_shape} "
                             f"(output spatial shape {lengths})")
        y_shape = (x_shape[0], x_shape[1] if out_channels is None else out_channels) + lengths
        windows, paddings, blocks = [], [], []
        for rank in range(P_x.size):
            index = P_x.cartesian_index(rank)
            blocks.append(_block(P_x, index, x_shape))
            window, padding = list(blocks[-1][:2]), []
            for k, (o0, o1) in enumerate(_block(P_x, index, y_shape)[2:]):
                a, b = (0, 0) if o0 == o1 else source(k, x_shape[2 + k], lengths[k], o0, o1)
                left, right = max(-a, 0), max(b - x_shape[2 + k], 0)  # zeros past the edges
                # torch pads p on both sides: the left zeros exactly, and on the right as many as the window has
                # there, or more where the surplus (less than a stride) adds no output; else what both sides have
                p = 0 if padded_stride is None else left if left - right < padded_stride[k] else right
                if a + p >= b - min(p, right):  # the outputs read only zeros: torch takes no empty input, so
                    p = 0  # the zeros stay in the window
                window.append((a + p, b - min(p, right)))
                padding.append(p)
            windows.append(tuple(window))
            paddings.append(tuple(padding))
        window, block = windows[P_x.rank], blocks[P_x.rank]
        local = None
        if all(a == b or s <= a and b <= e for w, bl in zip(windows, blocks) for (a, b), (s, e) in zip(w, bl)):
            local = () if window == block else tuple(slice(a - s, b - s) if a < b else slice(0, 0)
                                                      for (a, b), (s, _) in zip(window, block))
        return Plan(x_shape, y_shape, tuple(windows), window, _block(P_x, P_x.index, y_shape), paddings[P_x.rank],
                    local)

    plan = P_x._memo_recent("windowed layer", (padded_stride,) + key + (extents.tobytes(),), build)
    if plan.local is not None:  # no exchange; () is the whole block, used as it is (a slice would copy in backward)
        return plan, x[plan.local] if plan.local else x
    if any(facts[:, -1].tolist()):  # some worker's input needs a gradient
        return plan, window_exchange(x, P_x, plan.x_shape, plan.windows)
    with torch.no_grad():
        return plan, window_exchange(x, P_x, plan.x_shape, plan.windows)


def connect(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
            reads_input: bool = True) -> torch.Tensor:
    """Return the empty output ``y`` joined to the autograd graph as the layer's op joins a worker's output (zero
    gradients), so that every worker's backward, and the second one of a gradient penalty, takes part in the
    collectives behind ``x``, ``weight`` and ``bias`` even where its output is empty: the gradients refer to the
    incoming gradient and, where torch's backward of the op reads them (convolution, pooling; not upsampling), to
    the input and the parameters, as torch's double backward does (joined to each alone, an empty block's
    gradients referred to less than its peers': a penalty's backward skipped collectives they ran, and they
    waited)."""
    terms = [t.flatten()[:0].sum() for t in (x, weight, bias) if t is not None]
    total = sum(terms[1:], terms[0])
    return y + (total * total if reads_input else total).to(y.dtype)


_CONV = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}


def convolve(dims: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, ...],
             *args) -> torch.Tensor:
    """Return torch's convolution (``args``: padding, dilation, groups). A 3-d one with a stride above 1 that runs
    in bfloat16 on the CPU (its dtype or autocast's) runs in float32, its output rounded: torch's CPU kernel gives
    wrong values, up to the dtype's range, for some inputs a few elements wide there (torch 2.13), which a block's
    window may be where the whole tensor is not."""
    conv = _CONV[dims]
    if dims == 3 and x.device.type == "cpu" and max(stride) > 1 and (
            x.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu") and x.is_floating_point()
                                          and torch.get_autocast_dtype("cpu") == torch.bfloat16)):
        with torch.autocast("cpu", enabled=False):
            return conv(x.float(), weight.float(), None if bias is None else bias.float(), stride,
                        *args).to(torch.bfloat16)
    return conv(x, weight, bias, stride, *args)


def conv_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """Return the dtype of torch's convolution of ``x`` and ``weight`` (autocast's, under torch.autocast), for an
    empty output block, from a one-element convolution."""
    return torch.nn.functional.conv1d(x.new_zeros(1, 1, 1), weight.new_zeros(1, 1, 1)).dtype


def sliding_length(n: int, kernel: int, stride: int, left: int, right: int, dilation: int,
                   ceil_mode: bool = False) -> int:
    """Return torch's output length of a sliding window (convolution, pooling)."""
    span = n + left + right - dilation * (kernel - 1) - 1  # negative: the first window reaches past the end
    length = -(-span // stride) + 1 if ceil_mode else span // stride + 1
    if ceil_mode and (length - 1) * stride >= n + left:  # the last window must start inside the input
        length -= 1
    return max(length, 0)


def sliding_source(o0: int, o1: int, kernel: int, stride: int, left: int, dilation: int) -> tuple[int, int]:
    """Return the input range a sliding window's outputs ``[o0, o1)`` read (past the edges: padding)."""
    return o0 * stride - left, (o1 - 1) * stride - left + dilation * (kernel - 1) + 1
