"""The transport: hand torch tensor memory to mpi4py without copies.

Every primitive moves data through these few helpers, so there is one data path for all of
them. ``buffer(t)`` wraps a contiguous tensor's memory as an mpi4py buffer specification
(``MPI.buffer.fromaddress``: about 0.2 us, against ~5 us for DLPack). Data movement sends raw
bytes, so every dtype moves exactly; sums use the MPI type of the dtype, and float16/bfloat16
are summed in float32 (never as integer bit patterns).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from mpi4py import MPI
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from distdl.backends import cuda
from distdl.utilities.settings import shared

__all__ = ["buffer", "strided", "reduction_dtype", "empty", "contiguous", "crowded", "bcast", "bcast_in_place",
           "bcast_in_place_all", "allreduce_sum", "InPlaceSum", "reduce_sum", "reduce_scatter_blocks",
           "allgather_blocks", "pairwise", "PAIRWISE_SUM_BYTES", "STRIDED_BYTES"]

_SUM_TYPES = {
    torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
    torch.complex64: MPI.C_FLOAT_COMPLEX, torch.complex128: MPI.C_DOUBLE_COMPLEX,
    torch.int8: MPI.INT8_T, torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
}
# Reduced-precision floats are summed in float32.
_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def buffer(t: torch.Tensor, summed: bool = False) -> list:
    """Return the mpi4py buffer specification of contiguous ``t``: raw bytes, or typed for a sum.

    The specification holds only the address: keep ``t`` referenced until MPI is done with it
    (never pass a temporary such as ``buffer(x.contiguous())`` to a non-blocking call).
    """
    if t.is_cuda:
        cuda.prepare(t)
    nbytes = t.nbytes
    memory = MPI.buffer.fromaddress(t.data_ptr(), nbytes)
    if summed:
        return [memory, t.numel(), _SUM_TYPES[t.dtype]]
    return [memory, nbytes, MPI.BYTE]


def strided(t: torch.Tensor, datatypes: list) -> list | None:
    """Return the mpi4py buffer specification of ``t`` where its elements lie, or None where ``t`` is
    contiguous or moves faster through a contiguous copy: below ``STRIDED_BYTES``, off the CPU, or lazy (see
    :func:`contiguous`).

    MPI then reads or writes the elements in place (through a datatype of nested strides), which
    saves a copy of a large slice. The datatype is appended to ``datatypes``: free it once MPI is done.
    """
    if STRIDED_BYTES is None or t.nbytes < STRIDED_BYTES or t.is_contiguous() or not t.is_cpu or _lazy(t):
        return None
    itemsize, dims = t.element_size(), [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    run = 1  # elements in the innermost contiguous run
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    nested = [MPI.BYTE.Create_contiguous(run * itemsize)]
    for n, s in reversed(dims):
        nested.append(nested[-1].Create_hvector(n, 1, s * itemsize))
    datatypes.append(nested.pop().Commit())
    for inner in nested:  # the committed type keeps what it needs
        inner.Free()
    span = (sum((n - 1) * s for n, s in dims) + run) * itemsize
    return [MPI.buffer.fromaddress(t.data_ptr(), span), 1, datatypes[-1]]


def reduction_dtype(where: str, dtype: torch.dtype) -> torch.dtype:
    """Return the dtype a sum of ``dtype`` is carried out in; TypeError if it cannot be summed."""
    dtype = _ACCUMULATE.get(dtype, dtype)
    if dtype not in _SUM_TYPES:
        raise TypeError(f"{where}: expected a dtype that can be summed, got {dtype}")
    return dtype


def _lazy(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory does not hold its values: a lazily conjugated or negated view (``x.conj()``,
    ``x.conj().imag``: its memory holds the values before the conjugation), or autograd's efficient zero
    tensor (no memory at all: the gradient of ``torch.sgn``, also as a parameter's ``.grad``)."""
    return t.is_conj() or t.is_neg() or t._is_zerotensor()


def contiguous(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return ``t`` as a contiguous tensor of ``dtype`` whose memory holds its values (no copy when it
    already is one); a lazy tensor (a conjugate or negative bit set, or a zero tensor) is materialised, since
    MPI sees only memory, and a sparse one (a cotangent: the gradient of ``F.embedding(..., sparse=True)``)
    made dense."""
    if t.layout != torch.strided:
        t = t.to_dense()
    if dtype is not None and dtype != t.dtype:  # a no-op ``t.to(dtype)`` still costs ~1 us
        t = t.to(dtype)
    if _lazy(t):
        t = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) if t._is_zerotensor()
             else t.resolve_conj().resolve_neg())
    return t.contiguous()


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Return a new uninitialised contiguous tensor to receive into: on the host of a process that stages CUDA
    tensors, pinned (torch's caching host allocator reuses it, and it reaches the device at full speed)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device,
                       pin_memory=cuda.pin_host_buffers and device.type == "cpu")


def _bytes_setting(name: str, default: int) -> int | None:
    """Return setting ``name`` in bytes (None for never), to be read alike on every worker (see ``shared``)."""
    value = os.environ.get(name, "").strip() or str(default)
    if not value.isdigit():
        raise ValueError(f"{name}: expected a number of bytes (0 for never), got {value!r}")
    return shared(name, int(value)) or None


# From this many bytes, the sums below run their own reduce-scatter. MPICH's shared-memory
# Allreduce, Reduce and Reduce_scatter_block are 1.3-3x slower than that on one node from ~128 KiB
# (benchmarks/README.md). all_gather's blocks along a later dimension take allgather_blocks from the
# same size. Read once at import, so it must be the same on every worker; 0 turns it off.
PAIRWISE_SUM_BYTES = _bytes_setting("DISTDL_PAIRWISE_SUM_BYTES", 128 * 1024)
# From this many bytes, a non-contiguous CPU slice moves in place (see strided). Against packing it
# first, repartition took 0.65-0.85x the time with 2-8 MiB slices and 0.83-0.99x with 16 MiB ones,
# but 0.79-1.08x with 1 MiB ones and up to 1.08x below (benchmarks/README.md). 0 turns it off.
STRIDED_BYTES = _bytes_setting("DISTDL_STRIDED_BYTES", 2 << 20)
_PAIRWISE_TAG = 0x5d1  # point-to-point on the communicator of a collective: clear of distdl's other tags


# MPICH's blocking Bcast, Reduce and Allreduce among the ranks of one node (its shared-memory
# "release-gather" algorithms) wait by spinning. With a CPU per rank they are the fastest: Bcast took
# 0.75-0.8x Ibcast's time at 16-64 MiB on 2 ranks. With more ranks than CPUs, a waiting rank spins
# through its time slice while the rank it waits for cannot run: on 4 ranks over 2 CPUs, Allreduce took
# 8 ms at 8 B and 64 ms at 64 KiB, Bcast 1 s at 4 MiB, against 4, 4 and 5 ms for the non-blocking calls
# (benchmarks/README.md). So these three run non-blocking on a crowded communicator.
_CROWDED: int | None = None  # its keyval, made at first use: importing distdl must not call MPI (not yet initialised)
_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")  # ranks on this node: Hydra, Open MPI


def crowded(comm: MPI.Intracomm) -> bool:
    """Whether some member of ``comm`` shares its node with more ranks than the CPUs it may run on.

    Collective over ``comm`` on the first call: make it only where every member is about to take part
    in a collective on ``comm``. The answer is kept on the communicator (an MPI attribute, freed with it).
    """
    global _CROWDED
    if _CROWDED is None:
        _CROWDED = MPI.Comm.Create_keyval()
    if comm.size == 1:
        return False
    value = comm.Get_attr(_CROWDED)
    if value is None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        cpus = set().union(*node.allgather(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                           else range(os.cpu_count() or 1)))
        ranks = max([node.size] + [int(v) for v in map(os.environ.get, _LOCAL_SIZE_VARIABLES) if v and v.isdigit()])
        node.Free()
        flag = np.array(ranks > len(cpus), dtype=np.int8)
        comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MAX).Wait()  # blocking would spin where it is crowded
        value = bool(flag)
        comm.Set_attr(_CROWDED, value)
    return value


def _either(comm: MPI.Intracomm, blocking, non_blocking, *args, **kwargs) -> None:
    """Call the collective ``blocking``, or ``non_blocking`` and wait, where ``comm`` is :func:`crowded`."""
    if crowded(comm):
        non_blocking(*args, **kwargs).Wait()
    else:
        blocking(*args, **kwargs)


def bcast(comm: MPI.Intracomm, buf, root: int = 0) -> None:
    """``comm.Bcast``, non-blocking where ``comm`` is :func:`crowded`."""
    _either(comm, comm.Bcast, comm.Ibcast, buf, root=root)


def bcast_in_place(comm: MPI.Intracomm, t: torch.Tensor) -> None:
    """Overwrite ``t`` with its value on rank 0 of ``comm`` (through a host copy where MPI cannot take its memory)."""
    data = t.detach().to("cpu", copy=True).contiguous() if cuda.needs_staging(t) else contiguous(t.detach())
    bcast(comm, buffer(data))
    if data.data_ptr() != t.data_ptr():
        with torch.no_grad():
            t.copy_(data)


def bcast_in_place_all(comm: MPI.Intracomm, tensors) -> None:
    """Overwrite each of ``tensors`` with its value on rank 0 of ``comm``: one broadcast per device and dtype,
    of those tensors laid end to end (as torch's DDP coalesces its buffers), instead of a collective each.

    Every member passes tensors of the same shapes and dtypes, in the same order.
    """
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for (device, dtype), group in groups.items():
            if len(group) == 1:
                bcast_in_place(comm, group[0])
                continue
            flat = _flatten_dense_tensors(group) if comm.rank == 0 else torch.empty(
                sum(t.numel() for t in group), dtype=dtype, device=device)
            bcast_in_place(comm, flat)
            if comm.rank != 0:
                torch._foreach_copy_(group, _unflatten_dense_tensors(flat, group))


def allreduce_sum(comm: MPI.Intracomm, x: torch.Tensor, y: torch.Tensor) -> None:
    """Write the sum over ``comm`` of ``x`` into ``y`` (both contiguous, of one summable dtype and shape).

    Large tensors take a pairwise reduce-scatter (see :func:`_reduce_scatter_rows`) and an allgather
    in place, with ``y`` as the scratch space, so nothing beyond it is allocated. Each element is
    summed by one worker, so every worker gets the same bits.
    """
    rows = _rows(comm, x)
    if rows is None:
        _either(comm, comm.Allreduce, comm.Iallreduce, buffer(x, summed=True), buffer(y, summed=True), op=MPI.SUM)
        return
    r, p = comm.rank, comm.size
    y_rows = _rows(comm, y)
    _reduce_scatter_rows(comm, rows, y_rows[r], y_rows[(r + 1) % p])  # row r + 1 is free until the allgather
    comm.Allgather(MPI.IN_PLACE, [buffer(y_rows)[0], y_rows[r].nbytes, MPI.BYTE])
    _tail(x, y, p, lambda x_tail, y_tail: _either(comm, comm.Allreduce, comm.Iallreduce, x_tail, y_tail, op=MPI.SUM))


class InPlaceSum:
    """A non-blocking sum of contiguous ``t`` over ``comm`` into ``t`` itself, divided by ``divisor``: posted
    here, continued by :meth:`spread`, completed by :meth:`wait`. Every member makes these calls for its sums
    in the same order.

    Small tensors take MPI's ``Iallreduce`` (and a division of the whole). From ``PAIRWISE_SUM_BYTES``, the
    pairwise reduce-scatter of :func:`allreduce_sum`: the first exchange is posted here, into ``scratch`` (one
    row; a new one where it is None or too small, kept as ``self.scratch`` for the next sum); :meth:`spread`
    waits for it, runs the other exchanges (into rows already sent), adds, divides this worker's row only,
    and posts an in-place ``Iallgather``. On 2 ranks, 24 MiB of 4 MiB gradients averaged in 0.79-0.81x the
    time of ``Iallreduce`` and a division of the whole (benchmarks/README.md).
    """

    __slots__ = ("comm", "t", "divisor", "rows", "scratch", "tail", "requests")

    def __init__(self, comm: MPI.Intracomm, t: torch.Tensor, divisor: int, scratch: torch.Tensor | None) -> None:
        self.comm, self.t, self.divisor, self.scratch = comm, t, divisor, scratch
        self.rows, self.tail = _rows(comm, t), None
        if self.rows is None:
            self.requests = [comm.Iallreduce(MPI.IN_PLACE, buffer(t, summed=True), op=MPI.SUM)]
            return
        r, p, n = comm.rank, comm.size, t.numel()
        m = self.rows.shape[1]
        if scratch is None or scratch.numel() < m or scratch.dtype != t.dtype or scratch.device != t.device:
            self.scratch = torch.empty(m, dtype=t.dtype, device=t.device)
        self.requests = [comm.Irecv(buffer(self.scratch[:m]), (r - 1) % p, _PAIRWISE_TAG),
                         comm.Isend(buffer(self.rows[(r + 1) % p]), (r + 1) % p, _PAIRWISE_TAG)]
        if n % p:  # the elements the rows leave out
            self.tail = t.view(-1)[n - n % p:]
            self.requests.append(comm.Iallreduce(MPI.IN_PLACE, buffer(self.tail, summed=True), op=MPI.SUM))

    def spread(self) -> None:
        """Finish this worker's row of the sum and start sending it to the others (pairwise sums only)."""
        if self.rows is None:
            return
        comm, rows, r, p = self.comm, self.rows, self.comm.rank, self.comm.size
        MPI.Request.Waitall(self.requests[:2])
        row = rows[r]
        row.add_(self.scratch[:row.numel()])
        for step in range(2, p):  # the row sent in the step before is free to receive into
            to, source, free = (r + step) % p, (r - step) % p, rows[(r + step - 1) % p]
            comm.Sendrecv(buffer(rows[to]), to, _PAIRWISE_TAG, buffer(free), source, _PAIRWISE_TAG)
            row.add_(free)
        if self.divisor != 1:
            row.div_(self.divisor)
        self.requests[:2] = [comm.Iallgather(MPI.IN_PLACE, [buffer(rows)[0], row.nbytes, MPI.BYTE])]

    def wait(self) -> None:
        """Complete the sum (after :meth:`spread`)."""
        MPI.Request.Waitall(self.requests)
        rest = self.t if self.rows is None else self.tail
        if self.divisor != 1 and rest is not None:
            rest.div_(self.divisor)


def reduce_sum(comm: MPI.Intracomm, x: torch.Tensor, y: torch.Tensor | None) -> None:
    """Write the sum over ``comm`` of ``x`` into ``y`` on rank 0 (``y`` None elsewhere). Large tensors take a
    pairwise reduce-scatter and a gather, with ``y`` as rank 0's scratch space; the other workers hold one or
    two rows of ``x``."""
    root = comm.rank == 0
    rows = _rows(comm, x)
    if rows is None:
        _either(comm, comm.Reduce, comm.Ireduce, buffer(x, summed=True), buffer(y, summed=True) if root else None,
                op=MPI.SUM, root=0)
        return
    r, p = comm.rank, comm.size
    if root:
        y_rows = _rows(comm, y)
        row, scratch = y_rows[0], y_rows[1]
    else:
        row = torch.empty_like(rows[r])
        scratch = torch.empty_like(row) if p > 2 else None
    _reduce_scatter_rows(comm, rows, row, scratch)
    comm.Gather(MPI.IN_PLACE if root else buffer(row), [buffer(y_rows)[0], row.nbytes, MPI.BYTE] if root else None,
                root=0)
    _tail(x, y, p, lambda x_tail, y_tail: _either(comm, comm.Reduce, comm.Ireduce, x_tail, y_tail if root else None,
                                                   op=MPI.SUM, root=0))


def pairwise(comm: MPI.Intracomm, nbytes: int) -> bool:
    """Whether ``nbytes`` summed (or gathered into blocks) over ``comm`` take distdl's pairwise exchanges."""
    return comm.size > 1 and PAIRWISE_SUM_BYTES is not None and nbytes >= PAIRWISE_SUM_BYTES


def _rows(comm: MPI.Intracomm, t: torch.Tensor) -> torch.Tensor | None:
    """Return ``t``'s first ``p * (numel // p)`` elements as ``p`` rows; None where MPI's own sum is used."""
    p, n = comm.size, t.numel()
    if not pairwise(comm, t.nbytes) or n < 2 * p:
        return None
    return t.view(-1)[:n - n % p].view(p, -1)


def _reduce_scatter_rows(comm: MPI.Intracomm, rows: torch.Tensor | list[torch.Tensor], row: torch.Tensor,
                         scratch: torch.Tensor | None) -> None:
    """Sum ``rows[r]`` of every worker into ``row`` on worker ``r``.

    Worker ``r`` receives its row from every other worker in turn while sending them theirs (one
    single-copy transfer each), and adds it with torch; ``scratch`` holds the rows after the first.
    A row that is not contiguous (a block of a tensor split along a later dimension) is copied just
    before it is sent. Each element is summed in one fixed order, so the same inputs always give the
    same bits.
    """
    r, p = comm.rank, comm.size
    for step in range(1, p):
        to, source = (r + step) % p, (r - step) % p
        into = row if step == 1 else scratch
        send = contiguous(rows[to], row.dtype)  # referenced until the call returns
        comm.Sendrecv(buffer(send), to, _PAIRWISE_TAG, buffer(into), source, _PAIRWISE_TAG)
        row.add_(rows[r] if step == 1 else scratch)


def reduce_scatter_blocks(comm: MPI.Intracomm, blocks: list[torch.Tensor], y: torch.Tensor) -> None:
    """Write the sum over ``comm`` of every member's ``blocks[r]`` into ``y`` on member ``r``, pairwise (see
    :func:`_reduce_scatter_rows`): each block is copied only as it is sent, and this worker's own is added
    where it lies, so a tensor split along a later dimension is never packed whole."""
    _reduce_scatter_rows(comm, blocks, y, torch.empty_like(y) if comm.size > 2 else None)


def allgather_blocks(comm: MPI.Intracomm, x: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    """Write every member's contiguous ``x`` into ``blocks[i]`` (views of one output; member ``i``'s place).

    Every message is posted at once, one from each other member, each received straight into its place
    where that is contiguous or moves in place (see :func:`strided`), else into a contiguous copy put in
    place at the end; this worker's own block is copied meanwhile. Against MPI's ``Allgather`` into a
    packed buffer and unpacking it, float32 split by columns over 2 ranks took 0.60-0.66x the time at
    8-32 MiB and 0.78-0.95x at 128 KiB-2 MiB (benchmarks/README.md).
    """
    r, p = comm.rank, comm.size
    datatypes, staged, requests = [], [], []
    for step in range(1, p):
        source = (r - step) % p
        place = blocks[source]
        into = buffer(place) if place.is_contiguous() else strided(place, datatypes)
        if into is None:
            staged.append((place, torch.empty(place.shape, dtype=place.dtype, device=place.device)))
            into = buffer(staged[-1][1])
        requests.append(comm.Irecv(into, source, _PAIRWISE_TAG))
    send = buffer(x)
    requests += [comm.Isend(send, (r + step) % p, _PAIRWISE_TAG) for step in range(1, p)]
    blocks[r].copy_(x)
    MPI.Request.Waitall(requests)
    for place, received in staged:
        place.copy_(received)
    for datatype in datatypes:
        datatype.Free()


def _tail(x: torch.Tensor, y: torch.Tensor | None, p: int, collective) -> None:
    """Sum the last ``numel % p`` elements, which the rows leave out, with MPI's own ``collective``."""
    n = x.numel()
    if n % p:
        collective(buffer(x.view(-1)[n - n % p:], summed=True),
                   None if y is None else buffer(y.view(-1)[n - n % p:], summed=True))
