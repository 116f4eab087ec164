"""Data-parallel gradient synchronisation over a partition of replicas.

Each member of ``P`` holds a replica of the same parameters and computes gradients on its own
part of the batch; synchronising sets every replica's gradient to ``g = sum_{j in P} g_j``
(``op="sum"``) or ``g / P.size`` (``op="avg"``): an all-sum-reduce of the gradients, which is
self-adjoint. Gradients travel in *buckets*: the gradients of several parameters of one dtype,
flattened into one buffer and reduced by one MPI call, in reverse parameter order (the order
backward produces them). float16/bfloat16 gradients are summed in float32.

A parameter without a gradient (``grad is None``) counts as zeros: every bucket carries one
presence slot per parameter, summed with the data, so every member learns without extra
messages how many members had a gradient. If any had one, every member gets the reduced
gradient; if none had one, it stays ``None`` everywhere.

==============================  ==================================================
worker                          does
==============================  ==================================================
in P                            contributes its gradients, receives the reduction
outside P                       nothing (its gradients are left as they are)
==============================  ==================================================
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import cuda
from distdl.backends import mpi as transport
from distdl.functional._common import check_partition
from distdl.partition import MPIPartition

__all__ = ["all_reduce_gradients", "DataParallel"]

_OPS = ("avg", "sum")


def all_reduce_gradients(module: torch.nn.Module, P: MPIPartition, op: str = "avg",
                         bucket_cap_mb: float = 25) -> None:
    """Reduce every parameter's ``.grad`` of ``module`` over ``P``, in buckets, in place.

    Blocking; the flat bucket buffers are kept on ``P`` and reused by later calls.

    Args:
        module: the replica; the members of ``P`` must hold the same parameters (dtypes, shapes, order).
        P: the partition of replicas (e.g. the data-parallel fibre ``P_x.create_subpartition([0])``).
        op: ``"avg"`` (sum divided by ``P.size``) or ``"sum"``.
        bucket_cap_mb: the most megabytes of gradients reduced by one MPI call.
    Raises:
        TypeError: ``module`` not a ``torch.nn.Module``, ``P`` not a partition, or a sparse gradient.
        ValueError: a bad ``op`` or ``bucket_cap_mb``, or members of ``P`` holding different parameters.
    """
    params = _validate("all_reduce_gradients", module, P, op, bucket_cap_mb)
    for p in params:
        _check_dense("all_reduce_gradients", p)
    if not P.active or P.size == 1:
        return  # a sum over one worker changes nothing
    buckets = _plan("all_reduce_gradients", params, bucket_cap_mb)
    _check_agreement("all_reduce_gradients", P, _signature(buckets, []))
    comm, pool = _communicator(P), P._memo(("gradient_buffers",), dict)
    for index, bucket in enumerate(buckets):
        # Reuse flat buffers between calls: fresh memory costs a page fault per page touched.
        key, length = (index, bucket.dtype, bucket.device), bucket.total + len(bucket.params)
        if key not in pool or pool[key].numel() < length:
            pool[key] = torch.empty(length, dtype=bucket.dtype, device=bucket.device)
        bucket.flat = pool[key][:length]
        bucket.start(comm)
    for bucket in buckets:
        bucket.finish(P.size if op == "avg" else 1)


class DataParallel(torch.nn.Module):
    """Wrap ``module`` so that backward reduces its gradients over ``P``, overlapped with backward.

    At construction the parameters and buffers are broadcast from rank 0 of ``P``. During
    backward, as soon as every parameter of a bucket has its gradient, a non-blocking
    ``Iallreduce`` of the bucket starts (buckets start in a fixed order, the same on every
    member); all of them complete when backward ends, before anyone can read ``.grad``.
    Zero the gradients between steps (as with ``torch.nn.parallel.DistributedDataParallel``)
    and call backward once per step, or accumulate in :meth:`no_sync`. Every member of ``P``
    must run backward through the module. Hooks run in the backward thread: for parameters
    on a GPU, the MPI library needs ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, module: torch.nn.Module, P: MPIPartition, bucket_cap_mb: float = 25,
                 op: str = "avg") -> None:
        super().__init__()
        params = _validate("DataParallel", module, P, op, bucket_cap_mb)
        self.module, self.P, self.op, self.bucket_cap_mb = module, P, op, bucket_cap_mb
        self._buckets = _plan("DataParallel", params, bucket_cap_mb)
        self._sync, self._in_flight = True, False
        if not P.active or P.size == 1:
            return
        self._comm = _communicator(P)
        buffers = list(module.buffers())
        _check_agreement("DataParallel", P, _signature(self._buckets, params + buffers))
        with torch.no_grad():
            for t in params + buffers:
                _broadcast(t, P.comm)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p, index=index: self._gradient_ready(p, index))
                       for index, bucket in enumerate(self._buckets) for p in bucket.params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this context, backward accumulates local gradients without reducing them."""
        self._sync, previous = False, self._sync
        try:
            yield
        finally:
            self._sync = previous

    def wait(self) -> None:
        """Complete every outstanding reduction (done at the end of backward; idempotent)."""
        if not self._in_flight:
            return
        for index in range(self._next, len(self._buckets)):  # buckets with an unused parameter
            self._buckets[index].start(self._comm)
        self._next = len(self._buckets)
        for bucket in self._buckets:
            bucket.finish(self.P.size if self.op == "avg" else 1)
        self._in_flight = False

    def _gradient_ready(self, p: torch.Tensor, index: int) -> None:
        if not self._sync:
            return
        _check_dense("DataParallel", p)
        if not self._in_flight:
            self._in_flight, self._next = True, 0
            self._waiting = [len(b.params) for b in self._buckets]
            self._seen: set[int] = set()
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
        if id(p) in self._seen:
            raise RuntimeError("DataParallel: expected one gradient per parameter per backward, got a second "
                               "(reentrant checkpointing or several backward calls before the end of one)")
        self._seen.add(id(p))
        self._waiting[index] -= 1
        # Start buckets strictly in order, so every member issues the same sequence of collectives.
        while self._next < len(self._buckets) and self._waiting[self._next] == 0:
            self._buckets[self._next].start(self._comm)
            self._next += 1


class _Bucket:
    """Gradients of several parameters of one dtype, flattened into one buffer for one reduction."""

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
        self.params, self.dtype = params, dtype
        self.device = cuda.buffer_device(params[0].device)  # the host when CUDA tensors are staged
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.flat: torch.Tensor | None = None  # allocated on first use, then reused
        self.request: MPI.Request | None = None

    def start(self, comm: MPI.Comm) -> None:
        """Copy the gradients in (zeros where there is none) and start the reduction."""
        if self.flat is None:
            self.flat = torch.empty(self.total + len(self.params), dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, segment in zip(self.params, self._segments()):
                segment.zero_() if p.grad is None else segment.copy_(p.grad)
            presence = [p.grad is not None for p in self.params]
            self.flat[self.total:].copy_(torch.tensor(presence, dtype=self.dtype))
        self.request = comm.Iallreduce(MPI.IN_PLACE, transport.buffer(self.flat, summed=True), op=MPI.SUM)

    def finish(self, divisor: int) -> None:
        """Wait for the reduction and copy the result back into ``.grad``."""
        self.request.Wait()
        self.request = None
        counts = self.flat[self.total:].tolist()
        with torch.no_grad():
            for p, segment, count in zip(self.params, self._segments(), counts):
                if count == 0:
                    continue  # no member had a gradient: it stays None
                if p.grad is None or p.grad._is_zerotensor():  # autograd's zero tensors cannot be written
                    p.grad = torch.empty_like(p, dtype=_grad_dtype(p), requires_grad=False)
                p.grad.copy_(segment if divisor == 1 else segment.div_(divisor))

    def _segments(self) -> Iterator[torch.Tensor]:
        offset = 0
        for p, n in zip(self.params, self.sizes):
            yield self.flat[offset:offset + n].view(p.shape)
            offset += n


def _validate(where: str, module: object, P: object, op: object, bucket_cap_mb: object) -> list:
    """Check the arguments; return the parameters that take gradients, in module order."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: expected a torch.nn.Module, got {type(module).__name__}")
    check_partition(where, "P", P)
    if op not in _OPS:
        raise ValueError(f"{where}: expected op in {list(_OPS)}, got {op!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"{where}: expected a positive bucket_cap_mb, got {bucket_cap_mb!r}")
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        transport.reduction_dtype(where, _grad_dtype(p))
    return params


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    """Return the dtype of ``p``'s gradient (``Tensor.grad_dtype`` where set, else ``p``'s dtype)."""
    return getattr(p, "grad_dtype", None) or p.dtype


def _check_dense(where: str, p: torch.Tensor) -> None:
    if p.grad is not None and p.grad.layout != torch.strided:
        raise TypeError(f"{where}: expected dense gradients, got a {p.grad.layout} gradient of shape "
                        f"{tuple(p.shape)}")


def _plan(where: str, params: list, bucket_cap_mb: float) -> list[_Bucket]:
    """Group the parameters, in reverse order, into buckets of one dtype and device up to the cap."""
    cap = bucket_cap_mb * 2 ** 20
    open_buckets: dict = {}
    closed: list[tuple[int, list, torch.dtype]] = []
    for position, p in enumerate(reversed(params)):
        dtype = transport.reduction_dtype(where, _grad_dtype(p))
        key = (dtype, p.device)
        first, members, nbytes = open_buckets.get(key, (position, [], 0))
        if members and nbytes + p.numel() * dtype.itemsize > cap:
            closed.append((first, members, dtype))
            first, members, nbytes = position, [], 0
        open_buckets[key] = (first, members + [p], nbytes + p.numel() * dtype.itemsize)
    closed += [(first, members, key[0]) for key, (first, members, _) in open_buckets.items()]
    return [_Bucket(members, dtype) for _, members, dtype in sorted(closed, key=lambda c: c[0])]


def _signature(buckets: list[_Bucket], tensors: list[torch.Tensor]) -> int:
    """Return a checksum of the bucket layout (and of ``tensors``' dtypes and shapes)."""
    layout = [(str(b.dtype), [tuple(p.shape) for p in b.params]) for b in buckets]
    layout += [(str(t.dtype), tuple(t.shape)) for t in tensors]
    return zlib.crc32(repr(layout).encode())


def _check_agreement(where: str, P: MPIPartition, signature: int) -> None:
    """Raise on every member if the members' layouts differ (MPI would hang or mix data up)."""
    mine = np.array([signature], dtype=np.int64)
    everyone = np.empty(P.size, dtype=np.int64)
    P.comm.Allgather(mine, everyone)
    differ = [int(r) for r in np.flatnonzero(everyone != everyone[0])]
    if differ:
        raise ValueError(f"{where}: expected the same parameters (dtypes, shapes, order) on every worker of P, "
                         f"got a different layout on P ranks {differ} than on P rank 0")


def _communicator(P: MPIPartition) -> MPI.Comm:
    """Return a communicator over P's members used only for gradients (built once per partition)."""
    return P._memo(("data_parallel",), lambda: P.create_partition_inclusive(range(P.size))).comm


def _broadcast(t: torch.Tensor, comm: MPI.Comm) -> None:
    """Overwrite ``t`` with its value on rank 0 of ``comm``."""
    data = transport.contiguous(t)
    transport.bcast(comm, transport.buffer(data))
    if data.data_ptr() != t.data_ptr():
        t.copy_(data)
