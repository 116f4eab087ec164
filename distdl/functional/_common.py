"""Checks and helpers shared by the primitives (validation happens before any communication)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from distdl.partition import MPIPartition
from distdl.utilities.torch import zero_volume_tensor


def check_tensor(where: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{where}: expected a dense (strided) tensor, got layout {x.layout}; densify it with "
                        ".to_dense()")
    if x.is_meta:
        raise TypeError(f"{where}: expected a tensor with values (MPI moves them), got one on the meta device; "
                        "materialise the module first (module.to_empty(device=...), then reset_parameters())")


def check_partition(where: str, name: str, P: object) -> None:
    if not isinstance(P, MPIPartition):
        raise TypeError(f"{where}: expected an MPIPartition for {name}, got {type(P).__name__}")
    if P._freed:
        P._check_live(f"{where} ({name})")


def check_idle_input(where: str, P: MPIPartition, x: torch.Tensor, name: str = "P_x") -> None:
    """A worker outside ``P`` contributes nothing: its input must be zero-volume. ValueError on every worker
    where ``P`` was freed (it would pass for inactive on each)."""
    if P._freed:
        P._check_live(f"{where} ({name})")
    if P.active:
        return
    if x.numel() != 0:
        raise ValueError(f"{where}: worker {P._root.rank} is outside {name} and expected a zero-volume tensor, "
                         f"got shape {tuple(x.shape)}")


def check_dim(where: str, P: MPIPartition, x: torch.Tensor, name: str = "P_x") -> None:
    if P.active and x.dim() != P.dim:
        raise ValueError(f"{where}: expected a tensor of {P.dim} dimensions to match {name} of shape {P.shape}, "
                         f"got shape {tuple(x.shape)}")


def resolve_axes(where: str, P: MPIPartition, axes: Iterable[int] | None, axes_keep: Iterable[int] | None,
                 what: str) -> tuple[int, ...]:
    """Return the sorted partition axes an operation acts on, given them or their complement."""
    if (axes is None) == (axes_keep is None):
        raise ValueError(f"{where}: expected exactly one of {what} and axes_keep, got "
                         f"{what}={axes!r}, axes_keep={axes_keep!r}")
    checked = P._check_axes(where, axes if axes is not None else axes_keep)
    if axes is None:
        checked = tuple(a for a in range(P.dim) if a not in checked)
    return checked


def zero_volume_like(x: torch.Tensor, preserve_batch: bool) -> torch.Tensor:
    """Return the zero-volume output of a worker with nothing to receive: ``(b, 0)`` for ``x`` of first extent
    ``b``, or ``(0,)`` without ``preserve_batch`` and for a ``(0,)`` placeholder (which carries no batch)."""
    b = x.shape[0] if preserve_batch and x.dim() > 0 and x.shape != (0,) else None
    return zero_volume_tensor(b, dtype=x.dtype, device=x.device)


def idle_in_graph(x: torch.Tensor, preserve_batch: bool) -> torch.Tensor:
    """Return :func:`zero_volume_like` for the zero-volume input ``x`` of a worker outside both partitions of a
    primitive, as a new tensor computed from ``x`` (backward runs here too)."""
    return in_graph(x).reshape(zero_volume_like(x, preserve_batch).shape).clone()


def in_graph(x: torch.Tensor) -> torch.Tensor:
    """Return ``x``, made to require grad when grad mode is on, so every worker runs the adjoint.

    A collective's backward needs every member: a worker whose input (a zero-volume placeholder,
    or data) needs no gradient must still take part in the backward of the others. The gradient
    computed for such an input is discarded. An input made under ``torch.inference_mode`` cannot require grad:
    a copy of it does.
    """
    if torch.is_grad_enabled() and not x.requires_grad and (x.is_floating_point() or x.is_complex()):
        return (x.clone() if x.is_inference() else x.detach()).requires_grad_()
    return x


def idle_output(x: torch.Tensor) -> torch.Tensor:
    """Return the zero-volume output of a worker outside a layer for its zero-volume input ``x``, in the graph.

    Not a copy: ``x * x``, whose gradient refers to ``x`` as the members' gradients (of a product with a weight,
    a normalisation, a loss) refer to their inputs. A double backward (``create_graph=True``: a gradient penalty)
    then reaches the collectives behind ``x`` on every worker; behind a copy, the workers outside skipped them
    while the members ran them again and waited.
    """
    x = in_graph(x)
    return x * x


def receiving_in_graph(x: torch.Tensor, P_x: MPIPartition) -> torch.Tensor:
    """Return :func:`in_graph` of the input of a worker that may receive data in place of ``x``.

    Outside the source partition ``P_x``, a zero-volume placeholder of an integer (or bool) dtype cannot require
    grad: floating data arriving in its place would leave the graph here while the senders wait in the backward for
    this worker. Such a placeholder is replaced by an empty one of the default floating dtype (an integer result
    stays outside the graph anyway). An empty block of ``P_x`` is data: its dtype is the data's.
    """
    if (torch.is_grad_enabled() and x.numel() == 0 and not (x.is_floating_point() or x.is_complex())
            and not P_x.active):
        x = torch.empty(x.shape, dtype=torch.get_default_dtype(), device=x.device)
    return in_graph(x)


# Non-reentrant activation checkpointing (torch.utils.checkpoint, use_reentrant=False) recomputes a region's forward
# when backward first unpacks a tensor saved in it, and stops after the last one. A worker whose part of the region
# saves nothing (a collective's adjoint needs no tensor) would recompute late or not at all, while its peers'
# recomputed collectives wait for it. So where saved-tensor hooks are on, a collective saves an empty tensor, and
# unpacks it before its adjoint communicates: every worker recomputes the region's collectives first.
_ANCHOR = torch.empty(0)
try:
    _saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    _saved_tensor_hooks(False)
except (AttributeError, TypeError):  # a torch without it: always save
    _saved_tensor_hooks = bool


_record: list | None = None  # the autograd nodes of the collectives made, while distdl.testing takes a record


@contextlib.contextmanager
def recording_collectives() -> Iterator[list]:
    """Within: the autograd nodes of the collectives made are appended to the list given (for distdl.testing, which
    checks that an output's graph reaches them alike on every worker). Nodes made under no_grad are appended too:
    they have no ``next_functions``."""
    global _record
    outer, _record = _record, []
    try:
        yield _record
    finally:
        _record = outer


def save_anchor(ctx) -> None:
    """In a collective's forward: save the recomputation anchor where saved-tensor hooks are on (see above); add
    ``ctx`` (its autograd node) to a record being taken."""
    if _record is not None:
        _record.append(ctx)
    if _saved_tensor_hooks(False) is not None:
        ctx.save_for_backward(_ANCHOR)
        ctx.anchored = True


def begin_backward(ctx, grad: torch.Tensor, *partitions: MPIPartition | None) -> None:
    """First thing in a collective's backward: refuse a batched ``grad`` and ``partitions`` freed since the forward
    (ValueError on every worker that freed them: to its members a freed communicator looks like an inactive one), then
    unpack the anchor, if saved (see above)."""
    if torch._C._functorch.is_legacy_batchedtensor(grad):  # a wrapper without memory
        raise NotImplementedError(f"{_backward_name(ctx)}: batched gradients (is_grads_batched=True, jacobian or "
                                  "hessian with vectorize=True) run backward under torch.func.vmap, which is not "
                                  "supported; compute one gradient at a time")
    for P in partitions:
        if P is not None and P._freed:
            P._check_live(_backward_name(ctx))
    if getattr(ctx, "anchored", False):
        ctx.saved_tensors


def _backward_name(ctx) -> str:
    return type(ctx).__name__.strip("_").removesuffix("Backward") + " (backward)"


def grad_like(grad: torch.Tensor, x_shape: torch.Size, x_dtype: torch.dtype) -> torch.Tensor:
    """Return ``grad`` shaped as the input it belongs to (zero-volume placeholders may differ in shape and dtype).

    A zero-volume gradient is reshaped rather than replaced, so double backward stays connected on
    every worker (a fresh ``new_zeros`` would have no ``grad_fn``). Autograd casts a gradient to its
    input's dtype, but takes no complex gradient for a real input: a real placeholder of a worker that
    sends nothing, for complex data, gets the real part of its (empty) gradient.
    """
    if grad.numel() == 0 and 0 in tuple(x_shape):
        if grad.is_complex() and not x_dtype.is_complex:
            grad = grad.real
        if grad.shape != x_shape:
            grad = grad.reshape(x_shape)
    return grad


# Receivers that hold only a zero-volume placeholder learn the dtype and shape of what arrives
# from a fixed-size header sent with the same pattern as the data.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
HEADER_LENGTH = 2 + 14  # dtype code, number of dimensions, up to 14 extents


def encode_header(where: str, x: torch.Tensor):
    """Return an int64 numpy header describing ``x``'s dtype and shape."""
    import numpy as np
    if x.dtype not in _DTYPES:
        raise TypeError(f"{where}: expected one of {[str(d) for d in _DTYPES]}, got {x.dtype}")
    if x.dim() > HEADER_LENGTH - 2:
        raise ValueError(f"{where}: expected a tensor of at most {HEADER_LENGTH - 2} dimensions, got {x.dim()}")
    header = np.full(HEADER_LENGTH, -1, dtype=np.int64)
    header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
    header[2:2 + x.dim()] = x.shape
    return header


def decode_header(header) -> tuple[torch.dtype, tuple[int, ...]]:
    """Return the dtype and shape in a header made by :func:`encode_header`."""
    return _DTYPES[int(header[0])], tuple(int(n) for n in header[2:2 + int(header[1])])


def check_flags(where: str, **flags: object) -> tuple[bool, ...]:
    """Return the named flags as bools; TypeError for anything that is not a bool."""
    import numpy as np
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{where}: expected a bool for {name}, got {value!r}")
    return tuple(bool(value) for value in flags.values())


# Validation results that depend only on the arguments, remembered: at 8 B a primitive's cost is
# mostly Python (measured in benchmarks/bench_primitives.py).
_headers: dict = {}


def resolve_axes_cached(where: str, P: MPIPartition, axes: Iterable[int] | None, axes_keep: Iterable[int] | None,
                        what: str) -> tuple[int, ...]:
    """Return :func:`resolve_axes`, remembered per partition for tuples or lists of plain ints (~4 us a call)."""
    plain = [v if v is None else tuple(v) for v in (axes, axes_keep)
             if v is None or (type(v) in (tuple, list) and all(type(a) is int for a in v))]
    if len(plain) < 2:
        return resolve_axes(where, P, axes, axes_keep, what)
    return P._memo(("axes", what, *plain), lambda: resolve_axes(where, P, axes, axes_keep, what))


def header_of(where: str, x: torch.Tensor):
    """Return :func:`encode_header` of ``x``, one read-only array shared by calls of the same dtype and shape."""
    key = (x.dtype, tuple(x.shape))
    header = _headers.get(key)
    if header is None:
        header = encode_header(where, x)
        header.flags.writeable = False
        if len(_headers) < 4096:
            _headers[key] = header
    return header
