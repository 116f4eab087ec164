"""Checks for distributed operators and layers, for distdl's tests and for users' own layers.

- :func:`assert_adjoint`: the dot-product test ``<F x, y> == <x, F* y>`` summed over workers, in
  float64 (complex128 for a complex input or output) with random, rank-varying ``x`` and ``y``; every worker
  asserts.
- :func:`assert_sequential_equivalence`: scatter a global tensor, run the distributed operator,
  and compare outputs and input gradients with the sequential operator; a difference on any worker
  raises on every worker.
- :func:`scatter` / :func:`gather`: a global tensor to and from its balanced decomposition.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from distdl.functional._common import check_partition, check_tensor, recording_collectives
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_stop_index
from distdl.utilities.torch import zero_volume_tensor

__all__ = ["assert_adjoint", "assert_sequential_equivalence", "scatter", "gather", "random_tensor"]


def random_tensor(shape, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Return a standard normal tensor from ``seed`` (same on every worker for the same seed); complex for a
    complex ``dtype`` (random real and imaginary parts). ``shape`` is a sequence of extents or one int; ``seed``
    any int (taken modulo 2**63); TypeError for a dtype that is neither floating nor complex."""
    if not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)):
        raise TypeError(f"random_tensor: expected a floating or complex dtype, got {dtype}")
    try:
        shape = (operator.index(shape),)  # one int (or a numpy integer)
    except TypeError:
        pass
    generator = torch.Generator().manual_seed(operator.index(seed) % 2**63)  # any int (a time in ns, say)
    draw = torch.complex128 if dtype.is_complex else torch.float64
    return torch.randn(tuple(shape), generator=generator, dtype=draw).to(dtype)


def scatter(x_global: torch.Tensor, P: MPIPartition, preserve_batch: bool = False) -> torch.Tensor:
    """Return this worker's balanced block of ``x_global`` (which every worker holds); zero-volume if inactive.

    No communication. With ``preserve_batch``, an inactive worker gets shape ``(x_global.shape[0], 0)`` (the
    batch extent kept, as the primitives' ``preserve_batch`` does) instead of ``(0,)``. Raises ValueError on
    every worker, active or not, unless ``x_global`` has ``P.dim`` dimensions.
    """
    if not isinstance(x_global, torch.Tensor):
        raise TypeError(f"scatter: expected a tensor for x_global, got {type(x_global).__name__}")
    check_partition("scatter", "P", P)
    if x_global.dim() != P.dim:
        raise ValueError(f"scatter: expected a tensor of {P.dim} dimensions for a partition of shape {P.shape}, "
                         f"got shape {tuple(x_global.shape)}")
    if not P.active:
        b = x_global.shape[0] if preserve_batch and x_global.dim() else None
        return zero_volume_tensor(b, dtype=x_global.dtype, device=x_global.device)
    start = compute_start_index(P.shape, P.index, x_global.shape)
    stop = compute_stop_index(P.shape, P.index, x_global.shape)
    return x_global[tuple(slice(a, b) for a, b in zip(start, stop))].clone()


def gather(x_local: torch.Tensor, P: MPIPartition) -> torch.Tensor:
    """Return the global tensor assembled from the blocks of ``P`` on every worker of P's root.

    Collective over the root communicator (every worker calls it); for tests, not for speed.
    Raises TypeError on every worker unless every worker passes a tensor, and ValueError unless the blocks
    share one dtype and are the blocks of a balanced decomposition (so a wrong block is never cast or
    written over another). The global shape is the sum of the blocks' extents along each axis: blocks
    of a balanced decomposition of another shape than the one meant (one row short on every worker of
    an axis) gather without an error.
    """
    check_partition("gather", "P", P)
    mine = type(x_local).__name__ if not isinstance(x_local, torch.Tensor) else (
        (P.index, _bytes(x_local)) if P.active else None)
    items = P._root.allgather(mine)  # pickled: as bytes, for dtypes torch cannot pickle (float8, complex32)
    wrong = [f"a {item} on rank {r}" for r, item in enumerate(items) if isinstance(item, str)]
    if wrong:
        raise TypeError(f"gather: expected a tensor on every worker, got {', '.join(wrong)}")
    blocks = {index: _from_bytes(*block) for item in items if item is not None for index, block in [item]}
    first = next(iter(blocks.values()))  # the same block on every worker (root rank order)
    for index, block in blocks.items():
        if block.dim() != P.dim or block.dtype != first.dtype:
            raise ValueError(f"gather: expected blocks of {P.dim} dimensions and one dtype, got shape "
                             f"{tuple(block.shape)} of {block.dtype} at index {index}")
    shape = [sum(blocks[tuple(i if a == axis else 0 for a in range(P.dim))].shape[axis]
                 for i in range(P.shape[axis])) for axis in range(P.dim)]
    out = first.new_empty(shape)
    for index, block in blocks.items():
        start = compute_start_index(P.shape, index, shape)
        stop = compute_stop_index(P.shape, index, shape)
        expected = tuple(int(b - a) for a, b in zip(start, stop))
        if tuple(block.shape) != expected:
            found = ", ".join(f"{tuple(b.shape)} at {i}" for i, b in sorted(blocks.items()))
            raise ValueError(f"gather: expected the blocks of a balanced decomposition (they add up to shape "
                             f"{tuple(shape)}, whose block at index {index} is {expected}), got {found}")
        out[tuple(slice(a, b) for a, b in zip(start, stop))] = block
    return out.to(x_local.device)


def _bytes(x: torch.Tensor) -> tuple:
    flat = x.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)  # a sliced block too
    return x.dtype, x.shape, flat.view(torch.uint8).numpy().copy()


def _from_bytes(dtype: torch.dtype, shape: torch.Size, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


def _allsum(comm: MPI.Comm, values: list[float]) -> list[float]:
    return [float(v) for v in comm.allreduce(np.array([float(v) for v in values], dtype=np.float64))]


def _assert_close(where: str, names: tuple[str, str], comm: MPI.Comm, a: float, b: float, rtol: float) -> None:
    left, right = names
    if not abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300):
        raise AssertionError(f"{where}: {left} = {a!r} but {right} = {b!r} (relative difference "
                             f"{abs(a - b) / max(abs(a), abs(b), 1e-300):.3e} > {rtol:.1e}); the inner products are "
                             f"sums over the {comm.size} ranks, so this cannot tell which rank's part is wrong")


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The real inner product (of complex tensors as pairs of reals, the one torch's gradients are adjoint in)."""
    return (a.detach().conj() * b.detach()).real.sum()


def _graph(node) -> set:
    """Return the autograd nodes at and below ``node`` (none below None)."""
    seen, todo = set(), [node]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return seen


def _cut(what: str, comm: MPI.Comm, y, x: torch.Tensor, made: list, detached: str, hint: str = "",
         unused: bool = False) -> str | None:
    """Return why ``y`` cannot carry a gradient back on this worker (None if it can); collective over ``comm``.

    ``y`` must be a tensor whose graph reaches the leaf ``x`` (else ``what``, ``detached`` and ``hint`` say so; with
    ``unused``, ``y`` None has nothing to carry back), and reach the collectives ``made`` for it (see
    recording_collectives) that other workers' graphs reach: a backward that skipped one here would leave them
    waiting for it.
    """
    graph = _graph(y.grad_fn) if isinstance(y, torch.Tensor) else set()
    made = [node for node in made if node.next_functions]  # those in a graph (not made under no_grad)
    reached = tuple(node in graph for node in made)
    everyone = comm.allgather(reached)
    if not (isinstance(y, torch.Tensor) or (unused and y is None)):
        return f"{what} on rank {comm.rank} is a {type(y).__name__}, not a tensor"
    if y is not None and not (y is x or any(getattr(node, "variable", None) is x for node in graph)):
        return f"{what} on rank {comm.rank} {detached}{hint}"
    if all(reached) or all(other == reached for other in everyone):
        return None
    names = ", ".join(sorted({type(node).__name__.strip("_").removesuffix("Backward")
                              for node, r in zip(made, reached) if not r}))
    return (f"{what} on rank {comm.rank} does not depend on the result of its {names} (detached on the way?), "
            f"where other workers' do: a backward would skip it here, and the other workers would wait for it{hint}")


_DETACHED = ("is not in the autograd graph of the input (detached, or a new leaf, or computed from detached "
             "values): no gradient flows back there, and the other workers' backward would wait for it")


# How long a worker whose operator raised waits for the others at the kit's next agreement before it raises that
# error alone (they may wait in the operator's own collective, which it left: then, as without the kit, the abort
# hook ends the job).
PATIENCE_SECONDS = 30.0


def _attempt(comm: MPI.Comm, what: str, function: Callable, *args):
    """Return ``function(*args)``; where it raises on some worker, raise AssertionError on every worker of ``comm``
    (from the exception where it was raised): a worker raising alone left the others waiting in the kit's next
    collective (a layer wrong on some workers only, after its own collectives). Where the others do not come (it
    raised before a collective of the operator's), it raises its error alone after ``PATIENCE_SECONDS``."""
    try:
        result, error = function(*args), None
    except Exception as caught:  # the user's code: anything
        result, error = None, caught
    _agree(comm, None if error is None else f"{what} raised on rank {comm.rank}: {type(error).__name__}: {error}",
           error)
    return result


def _vjp(y: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, create_graph: bool) -> torch.Tensor | None:
    """Return the vector-Jacobian product; None where ``y`` does not depend on ``x`` in the graph."""
    return torch.autograd.grad(y, x, dy, create_graph=create_graph, allow_unused=True)[0]


def assert_adjoint(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, comm: MPI.Comm = MPI.COMM_WORLD,
                   seed: int = 0, rtol: float = 1e-10, adjoint_of_adjoint: bool = True) -> None:
    """Assert that the backward of the distributed linear operator ``op`` is its adjoint.

    Every worker of ``comm`` calls this with its local input ``x``, which gives the shape and device:
    the values are replaced by random ones, as is ``y``, both drawn per rank (a linear operator's
    adjoint does not depend on them, and zeros or ones could hide a wrong one): float64, or complex128
    where ``x`` or the output is complex (the inner product is then the real one, ``Re sum(conj(a) b)``,
    in which torch's gradients are adjoints). The inner products are summed over ``comm`` and every
    worker asserts; an output that is not a tensor in the autograd graph of ``x`` on any worker, or whose graph
    leaves out there a collective of distdl's made for it that other workers' graphs reach (a result detached on
    the way), fails on every worker before the backward. With ``adjoint_of_adjoint``, the double backward is
    checked to be the adjoint of the backward (a backward that is not differentiable, on any worker, fails on
    every worker: pass False). An exception from ``op`` or its backward on some workers raises AssertionError on
    every worker. The sums cannot tell which worker's part is wrong; :func:`assert_sequential_equivalence` can.
    ``seed``: any int.
    """
    check_tensor("assert_adjoint (x)", x)
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"assert_adjoint: expected an MPI communicator for comm, got {type(comm).__name__}"
                        + (" (a partition's is its .comm)" if isinstance(comm, MPIPartition) else ""))
    base = operator.index(seed) * 100003 + 3 * comm.rank
    x = random_tensor(x.shape, base, torch.complex128 if x.is_complex() else torch.float64).to(x.device)
    x.requires_grad_()
    with recording_collectives() as made:
        y = _attempt(comm, "assert_adjoint: the operator", op, x)
    _agree(comm, _cut("assert_adjoint: the output", comm, y, x, made, _DETACHED))
    dy = random_tensor(y.shape, base + 1, y.dtype if y.is_complex() else torch.float64).to(y.device).requires_grad_()
    with recording_collectives() as made:
        dx = _attempt(comm, "assert_adjoint: the backward", _vjp, y, x, dy, adjoint_of_adjoint)
    unused = dx is None  # a backward that gives this input no gradient: zero, so its adjoint is zero too
    forward, adjoint = _allsum(comm, [_dot(y, dy), 0.0 if unused else _dot(x, dx)])
    _assert_close("assert_adjoint", ("<F x, y>", "<x, F* y>"), comm, forward, adjoint, rtol)
    if adjoint_of_adjoint:
        _agree(comm, _cut("assert_adjoint: the backward", comm, dx, dy, made, "is not differentiable (its result "
                          "does not depend on the cotangent in the autograd graph)",
                          "; pass adjoint_of_adjoint=False to check the adjoint only", unused=True))
        v = random_tensor(x.shape, base + 2, x.dtype).to(x.device)
        dv = None if unused else _attempt(comm, "assert_adjoint: the double backward", _vjp, dx, dy, v, False)
        backward, double = _allsum(comm, [0.0 if unused else _dot(dx, v), 0.0 if unused else _dot(dy, dv)])
        _assert_close("assert_adjoint (adjoint of the adjoint)", ("<F* y, v>", "<y, F** v>"), comm, backward, double,
                      rtol)


# (rtol, atol) when not given: 1e-7/1e-9 for float64 and complex128, torch.testing.assert_close's for float32 and
# complex64; for the 16-bit dtypes its rtol, with an atol of rtol times the largest magnitude compared (None here):
# sums over blocks round apart from sequential ones by a unit in the last place of their terms, and torch's atol
# of 1e-5 is below that. Exact for a dtype without an entry (float8: torch.testing has no defaults for it either).
_TOLERANCES = {torch.float64: (1e-7, 1e-9), torch.complex128: (1e-7, 1e-9), torch.float32: (1.3e-6, 1e-5),
               torch.complex64: (1.3e-6, 1e-5), torch.float16: (1e-3, None), torch.bfloat16: (1.6e-2, None),
               torch.complex32: (1e-3, None)}


def assert_sequential_equivalence(distributed: Callable[[torch.Tensor], torch.Tensor],
                                  sequential: Callable[[torch.Tensor], torch.Tensor], x_global: torch.Tensor,
                                  P_x: MPIPartition, P_y: MPIPartition, seed: int = 0, rtol: float | None = None,
                                  atol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Assert that ``distributed`` on the blocks of ``x_global`` equals ``sequential`` on the whole.

    Every worker holds ``x_global``; inputs are scattered over ``P_x``, outputs compared with the
    blocks of the sequential output over ``P_y``, then a global random cotangent (whose blocks
    differ per worker) is pulled back and input gradients compared. A difference on any worker raises
    AssertionError on every worker of the root partition (before the backward, for the forward, and for an
    output that is not a tensor in the autograd graph of the input, or leaves out a collective as
    :func:`assert_adjoint` says), so no worker is left waiting in a collective. Parameter gradients are NOT
    compared: both operators' parameters hold theirs (from the same cotangent) on return, for the caller to
    compare. Returns this worker's
    ``(x_local, y_local)``. ``rtol`` and ``atol``, each where not given, follow ``x_global``'s dtype: 1e-7 and
    1e-9 for float64 and complex128, :func:`torch.testing.assert_close`'s defaults for float32 and complex64; for
    float16, bfloat16 and complex32 its rtol and an atol of rtol times the largest magnitude of the tensor
    compared (sums over blocks round apart from sequential ones by about a unit in the last place of their
    largest terms); exact for other dtypes (float8).
    ``x_global`` must be of a floating or complex dtype (the input gradient is compared): any other raises
    TypeError on every worker, before any communication. ``x_global`` and the sequential result must be the same
    on every worker (seed them): where they differ from rank 0's, AssertionError on every worker names them; a
    sequential result outside the autograd graph gives the input a zero gradient. An exception from either operator,
    or from either backward, on some workers raises AssertionError on every worker (from it where it was raised)
    where the others reach the kit's next collective; where they wait in one of the operator's instead, that
    exception is raised alone after ``PATIENCE_SECONDS`` (the abort hook ends the job). NaN compares equal to NaN
    (in complex values part by part). After check mode's timeout (a CollectiveTimeoutError from the operator,
    raised here as AssertionError) the communicators are out of step: the program cannot go on.
    """
    check_tensor("assert_sequential_equivalence (x_global)", x_global)
    check_partition("assert_sequential_equivalence", "P_x", P_x)
    check_partition("assert_sequential_equivalence", "P_y", P_y)
    if not (x_global.is_floating_point() or x_global.is_complex()):
        raise TypeError(f"assert_sequential_equivalence: expected x_global of a floating or complex dtype (its "
                        f"input gradient is compared), got {x_global.dtype}")
    default_rtol, default_atol = _TOLERANCES.get(x_global.dtype, (0.0, 0.0))
    rtol, atol = default_rtol if rtol is None else rtol, default_atol if atol is None else atol  # None: scaled
    root, rank = P_x._root, P_x._root.rank
    _agree(root, _differs_from_rank_0(root, x_global, "x_global", 0.0, 0.0, "hold the same x_global everywhere"))
    x_ref = x_global.detach().clone().requires_grad_()
    y_ref = _attempt(root, "assert_sequential_equivalence: the sequential operator", sequential, x_ref)
    _agree(root, None if isinstance(y_ref, torch.Tensor) else f"assert_sequential_equivalence: the sequential result "
           f"on rank {rank} is a {type(y_ref).__name__}, not a tensor")
    _agree(root, _differs_from_rank_0(root, y_ref, "the sequential result", rtol, atol,
                                      "give the sequential operator the same parameters everywhere (seed them)"))
    x_local = scatter(x_global.detach(), P_x).requires_grad_()
    with recording_collectives() as made:
        y_local = _attempt(root, "assert_sequential_equivalence: the distributed operator", distributed, x_local)
    expected = scatter(y_ref.detach(), P_y)
    failure = _cut("assert_sequential_equivalence: the output", root, y_local, x_local, made, _DETACHED)
    if isinstance(y_local, torch.Tensor) and P_y.active:
        failure = _difference(y_local.detach(), expected, rtol, atol,
                              f"forward differs from the sequential result on rank {rank}") or failure
    elif isinstance(y_local, torch.Tensor) and y_local.numel() != 0:
        failure = f"rank {rank} is outside P_y but got output of shape {tuple(y_local.shape)}"
    _agree(root, failure)
    dy_global = random_tensor(y_ref.shape, seed + 7777, y_ref.dtype)
    if y_ref.requires_grad:  # else the input gets no gradient from it: zero
        _attempt(root, "assert_sequential_equivalence: the sequential operator's backward", y_ref.backward, dy_global)
    dy_local = scatter(dy_global, P_y)
    _attempt(root, "assert_sequential_equivalence: the distributed operator's backward", y_local.backward,
             dy_local if P_y.active else torch.zeros_like(y_local))
    expected_grad = scatter(torch.zeros_like(x_ref) if x_ref.grad is None else x_ref.grad, P_x)  # None: unused
    failure = None
    if P_x.active:
        grad = torch.zeros_like(x_local) if x_local.grad is None else x_local.grad  # None: an unused input
        failure = _difference(grad, expected_grad, rtol, atol, f"input gradient differs on rank {rank}" + (
            "" if y_ref.requires_grad else " (the sequential result is not in the autograd graph: zero expected)"))
    _agree(root, failure)
    return x_local, y_local


def _difference(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float | None,
                what: str) -> str | None:
    """Return ``what`` and torch's description of how ``actual`` differs from ``expected``; None if close (NaN
    where ``expected`` has NaN too). ``atol`` None: ``rtol`` times the largest finite magnitude in ``expected``."""
    if atol is None:  # of the finite values: one inf would let every finite value pass
        magnitudes = expected.detach().cpu().to(torch.complex64 if expected.is_complex() else torch.float32).abs()
        finite = magnitudes[torch.isfinite(magnitudes)]
        atol = rtol * float(finite.max()) if finite.numel() else 0.0
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)  # NaN where torch has
        if actual.is_complex() and (nan := expected.isnan()).any():  # NaN in either part: compare the parts there
            torch.testing.assert_close(torch.view_as_real(actual[nan].resolve_conj()),
                                       torch.view_as_real(expected[nan].resolve_conj()), rtol=rtol, atol=atol,
                                       equal_nan=True)
    except AssertionError as error:
        return f"{what}: {error}"
    return None


def _differs_from_rank_0(comm: MPI.Comm, t: torch.Tensor, what: str, rtol: float, atol: float | None,
                         hint: str) -> str | None:
    """Return how tensor ``t`` differs from rank 0's (None where it does not): inputs every worker must hold
    alike, or a difference would be blamed on the distributed operator."""
    mine = _bytes(t)  # a tensor on every worker
    theirs = comm.bcast(mine if comm.rank == 0 else None, root=0)
    if (t.dtype, t.shape) != theirs[:2]:
        return f"{what} on rank {comm.rank} is {t.dtype} of shape {tuple(t.shape)}, on rank 0 {theirs[0]} of " \
               f"shape {tuple(theirs[1])}: {hint}"
    if np.array_equal(mine[2], theirs[2]):
        return None
    return _difference(t.detach().cpu(), _from_bytes(*theirs), rtol, atol, f"{what} on rank {comm.rank} differs "
                       f"from rank 0's ({hint})")


def _agree(comm: MPI.Comm, failure: str | None, cause: BaseException | None = None) -> None:
    """Raise AssertionError on every worker of ``comm`` if any worker has a ``failure``, quoting them all (from
    ``cause`` where it has one: that worker waits for the others ``PATIENCE_SECONDS`` at most, then raises
    ``cause`` alone)."""
    failed = np.array([failure is not None], dtype=np.int64)
    request = comm.Iallreduce(MPI.IN_PLACE, failed, op=MPI.MAX)
    if cause is None:
        request.Wait()
    else:
        deadline = time.monotonic() + PATIENCE_SECONDS
        while not request.Test():
            if time.monotonic() > deadline:
                raise cause
            time.sleep(0.001)
    if failed[0]:
        failures = [f for f in comm.allgather(failure) if f is not None]
        raise AssertionError("\n".join(failures)) from cause
