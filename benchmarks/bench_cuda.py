"""Time distdl's primitives on CUDA tensors against doing the same by hand, interleaved, at 2 ranks.

Run: ``mpiexec -n 2 python benchmarks/bench_cuda.py`` on a machine with a GPU (ranks may share one);
it writes ``results/cuda.md``. Without a GPU it says so and exits. Not part of ``make bench``.

distdl hands CUDA memory to MPI directly where MPI is CUDA-aware, and otherwise stages through a
pinned host buffer (``distdl.backends.cuda``). The hand-written alternative it is measured against
is what a user would write with mpi4py: copy the tensor into a preallocated pinned host buffer,
run the collective into another, copy the result back into a preallocated device tensor (or, with
CUDA-aware MPI, the collective on the device buffers). Every variant ends with a device
synchronisation. distdl's forward ("fwd") runs with grad mode on, on an input that does not require
grad; distdl records the primitive in the graph anyway (``in_graph``: every member must take part in a
backward), so it times a forward as in training, as ``bench_primitives.py``'s "distdl fwd" does (not
the no-grad path). Forward+backward is ``y = op(x); y.backward(g)`` against the hand-written forward
transfer run twice ("by hand x2"), not a hand-written adjoint. For all_sum_reduce, which is its own
adjoint, that is the same work; for all_gather the adjoint is a reduce-scatter and for window_exchange
an add of the halo gradients into the block, which move as much data as the forward and add it too, so
there the baseline understates the adjoint's work and the forward+backward ratios favour the baseline.
From 1 MiB it also times window_exchange of a block split along one dimension (the halo of a 3x3
convolution: a row from each neighbour) against the same written by hand: the block copied into the
window on the device, the boundary rows sent through pinned host buffers.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (first: it chooses the MPI thread level)

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from distdl import MPIPartition  # noqa: E402
from distdl.backends import cuda  # noqa: E402
from distdl.functional.all_gather import all_gather  # noqa: E402
from distdl.functional.all_sum_reduce import all_sum_reduce  # noqa: E402
from distdl.functional.window_exchange import window_exchange  # noqa: E402

SIZES = [8, 2 ** 20, 2 ** 24, 2 ** 26]


def by_hand(comm, device, direct, send_shape, recv_shape, collective):
    """A function running ``collective(send, recv)`` on host (or, ``direct``, device) buffers for a device tensor."""
    host = lambda shape: torch.empty(shape, dtype=torch.float32, pin_memory=True)
    x, y = torch.ones(send_shape, device=device), torch.empty(recv_shape, device=device)
    buf = lambda t: [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * 4), MPI.FLOAT]
    if direct:
        def run():
            torch.cuda.current_stream(device).synchronize()
            collective(buf(x), buf(y))
    else:
        hx, hy = host(send_shape), host(recv_shape)

        def run():
            hx.copy_(x, non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
            collective(buf(hx), buf(hy))
            y.copy_(hy, non_blocking=True)
    return run


def window_by_hand(comm, device, direct, block):
    """Forward of a window exchange of one row a side along dimension 2 (the halo of a 3x3 convolution), written
    by hand: the block copied into the window on the device, the boundary rows through pinned host buffers."""
    x, y = torch.ones(block, device=device), torch.empty(window_shape(comm, block), device=device)
    row = block[:2] + block[3:]
    hosts = [[torch.empty(row, device=device if direct else "cpu", pin_memory=not direct) for _ in range(2)]
             for _ in range(2)]  # per side: send, receive
    peers = [comm.rank - 1 if comm.rank > 0 else MPI.PROC_NULL,
             comm.rank + 1 if comm.rank < comm.size - 1 else MPI.PROC_NULL]
    buf = lambda t: [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * 4), MPI.FLOAT]

    def run():
        y[:, :, 1:-1].copy_(x)
        for side, (send, _) in enumerate(hosts):
            send.copy_(x[:, :, -side], non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
        for side, (send, recv) in enumerate(hosts):
            comm.Sendrecv(buf(send), peers[side], 0, buf(recv), peers[side], 0)
        for side, (_, recv) in enumerate(hosts):
            if peers[side] == MPI.PROC_NULL:
                y[:, :, -side].zero_()
            else:
                y[:, :, -side].copy_(recv, non_blocking=True)
    return run


def window_shape(comm, block):
    return block[:2] + (block[2] + 2,) + block[3:]


def cases(comm, device, direct, n):
    """Yield (name, input shape, output shape, by hand, distdl) for transfers of ``n`` bytes."""
    P = MPIPartition(comm).create_cartesian_topology_partition([comm.size])
    k = max(1, n // 4)
    k -= k % comm.size
    k = max(k, comm.size)
    raw = functools.partial(by_hand, comm, device, direct)
    yield ("all_sum_reduce", (k,), (k,), raw((k,), (k,), lambda s, r: comm.Allreduce(s, r)),
           lambda t: all_sum_reduce(t, P, axes_reduce=[0]))
    yield ("all_gather", (k // comm.size,), (k,), raw((k // comm.size,), (k,), lambda s, r: comm.Allgather(s, r)),
           lambda t: all_gather(t, P, axes_all_gather=[0]))
    if n >= 2 ** 20:  # a block of n bytes, its window one row wider on each side along dimension 2
        block = (8, 16, max(1, n // 2 ** 16), 128)
        P_x = MPIPartition(comm).create_cartesian_topology_partition([1, 1, comm.size, 1])
        rows = block[2]
        shape = block[:2] + (rows * comm.size,) + block[3:]
        windows = tuple(((0, block[0]), (0, block[1]), (r * rows - 1, (r + 1) * rows + 1), (0, block[3]))
                        for r in range(comm.size))
        yield ("window_exchange", block, window_shape(comm, block), window_by_hand(comm, device, direct, block),
               lambda t: window_exchange(t, P_x, shape, windows))


def main() -> None:
    comm = MPI.COMM_WORLD
    if not torch.cuda.is_available():
        if comm.rank == 0:
            print("bench_cuda.py: no CUDA device here; nothing to measure")
        return
    device = cuda.device_for_rank(comm)
    direct = cuda.cuda_aware()
    rows = []
    for n in SIZES:
        for name, send_shape, recv_shape, raw, op in cases(comm, device, direct, n):
            x = torch.rand(send_shape, device=device)
            xg = x.clone().requires_grad_()
            g = torch.rand(recv_shape, device=device)
            sync = torch.cuda.synchronize

            def forward():
                op(x)
                sync()

            def both():
                op(xg).backward(g)
                sync()

            def raw_once():
                raw()
                sync()

            def raw_twice():  # the forward's transfer twice: a stand-in for the adjoint, exact only for all_sum_reduce
                raw()
                raw()
                sync()
            t = h.interleaved(comm, {"fwd": forward, "raw": raw_once, "fwd+bwd": both, "raw x2": raw_twice},
                              rounds=30, budget_s=3.0)
            rows.append((name, h.format_size(n), *(h.median(t[v]) * 1e6 for v in ("fwd", "raw", "fwd+bwd",
                                                                                  "raw x2")),
                         h.paired_ratio(t["fwd"], t["raw"]), h.paired_ratio(t["fwd+bwd"], t["raw x2"])))
    if comm.rank == 0:
        info = h.machine()
        info["gpu"] = torch.cuda.get_device_name(device)
        info["transport"] = "CUDA-aware MPI" if direct else "staged through pinned host memory"
        lines = ["# bench_cuda.py", "", " · ".join(f"{k}: {v}" for k, v in info.items()), "",
                 "Medians in microseconds; ratios are medians of per-round ratios (distdl / by hand). *fwd* is "
                 "distdl's forward with grad mode on (it records the primitive for autograd although the input "
                 "does not require grad); *fwd+bwd* is `y = op(x); y.backward(g)`. *by hand x2* is the "
                 "hand-written forward transfer run twice, not a hand-written adjoint: exact for all_sum_reduce "
                 "(its own adjoint), but all_gather's adjoint is a reduce-scatter and window_exchange's an add of "
                 "the halo gradients, which move as much data as the forward and add it too, so for those two the "
                 "fwd+bwd ratio favours the by-hand side.", "",
                 "| primitive | size | fwd | by hand | ratio | fwd+bwd | by hand x2 | ratio |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, size, f, r, fb, r2, q1, q2 in rows:
            lines.append(f"| {name} | {size} | {f:.1f} | {r:.1f} | {q1:.2f} | {fb:.1f} | {r2:.1f} | {q2:.2f} |")
        report = "\n".join(lines) + "\n"
        os.makedirs(h.RESULTS, exist_ok=True)
        with open(os.path.join(h.RESULTS, "cuda.md"), "w") as f:
            f.write(report)
        print(report)


if __name__ == "__main__":
    main()
