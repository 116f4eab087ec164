"""Measure the extra memory of a 64 MiB AllSumReduce, and large calls under an allocator setting.

Run: ``mpiexec -n 2 python benchmarks/bench_memory.py --label NAME`` under the allocator settings
to compare (``make bench`` runs it once each, one after the other: with glibc's defaults, with
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` and with ``THP_MEM_ALLOC_ENABLE=1``). glibc
reads these at start-up and stops adapting its thresholds after any ``mallopt``, so the settings
cannot be interleaved inside one process: each run interleaves distdl and raw mpi4py, and only
ratios within a run are exact. It writes ``results/memory-<label>.json`` (``--output`` to write
elsewhere), which ``bench_primitives.py --report`` adds to ``results/primitives.md``.

1. Peak memory: each rank's resident high-water mark (Linux VmHWM, reset before the call) above
   its resident memory just before, less the output the call returns; for distdl's forward,
   forward+backward, and raw mpi4py's Allreduce into a preallocated buffer (and in place).
2. Time: distdl's forward and raw mpi4py's (into a preallocated buffer, and into a new tensor each
   call as distdl must) at 1 to 64 MiB (``--sizes``), for all_sum_reduce, broadcast and all_gather.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (first: it chooses the MPI thread level)

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import bench_primitives as bp  # noqa: E402
from distdl import MPIPartition  # noqa: E402
from distdl.functional.all_sum_reduce import all_sum_reduce  # noqa: E402

MiB = 2 ** 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def peak_extra(comm: MPI.Comm, run, kept_bytes: int, prepare=None) -> list[int]:
    """Return, per rank, how far ``run()`` raised resident memory above where it was, less ``kept_bytes``."""
    prepare = prepare or (lambda: None)
    prepare()
    run()  # warm up: communicators, MPI's own buffers
    prepare()
    gc.collect()
    comm.Barrier()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    result = run()
    extra = _status("VmHWM") - before - kept_bytes
    del result
    return comm.allgather(extra)


def memory_table(comm: MPI.Comm, P: MPIPartition, n: int) -> dict:
    x, g = torch.rand(n, requires_grad=True), torch.rand(n)
    y = torch.empty(n)
    np_x, np_y = x.detach().numpy(), y.numpy()

    def fwd_bwd():
        all_sum_reduce(x, P, axes_reduce=(0,)).backward(g)
        return x.grad  # the gradient is the output kept

    def fresh_grad():
        x.grad = None
    rows = {"distdl all_sum_reduce forward (output: 64 MiB)": (lambda: all_sum_reduce(x, P, [0]), 4 * n, None),
            "distdl forward + backward (output: x.grad, 64 MiB)": (fwd_bwd, 4 * n, fresh_grad),
            "mpi4py Allreduce into a preallocated buffer": (lambda: comm.Allreduce(np_x, np_y), 0, None),
            "mpi4py Allreduce in place": (lambda: comm.Allreduce(MPI.IN_PLACE, np_y), 0, None)}
    return {name: peak_extra(comm, run, kept, before) for name, (run, kept, before) in rows.items()}


def _fresh_output(name: str, comm: MPI.Comm, n: int):
    """Return raw mpi4py's collective writing into a new tensor each call, as distdl must (outputs never alias)."""
    # all_gather's blocks as bench_primitives' case has them: n rounded up to a multiple of the ranks.
    x = torch.rand(n if name != "all_gather" else -(-n // comm.size))

    def all_sum_reduce_():
        y = torch.empty(n)
        comm.Allreduce(x.numpy(), y.numpy())
        return y

    def broadcast_():  # the root keeps a copy of what it sends, as distdl's does
        y = x.clone() if comm.rank == 0 else torch.empty(n)
        comm.Bcast(y.numpy(), root=0)
        return y

    def all_gather_():
        y = torch.empty(x.numel() * comm.size)
        comm.Allgather(x.numpy(), y.numpy())
        return y
    return {"all_sum_reduce": all_sum_reduce_, "broadcast": broadcast_, "all_gather": all_gather_}[name]


def timing_table(comm: MPI.Comm, P: MPIPartition, sizes: list[int], rounds: int, budget: float) -> dict:
    out = {}
    for size in sizes:
        for name in ("all_sum_reduce", "broadcast", "all_gather"):
            case = bp.CASES[name](P, comm, size // 4)
            key = f"{name} {h.format_size(size)}"
            variants = {k: case[k] for k in ("distdl fwd", "mpi4py fwd")}
            variants["mpi4py fwd, fresh output"] = _fresh_output(name, comm, size // 4)
            out[key] = h.interleaved(comm, variants, rounds=rounds, budget_s=budget)
            if comm.rank == 0:
                print(key, {k: round(h.median(v) * 1e3, 1) for k, v in out[key].items()}, "ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="default")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sizes", type=int, nargs="+", default=[MiB, 4 * MiB, 16 * MiB, 64 * MiB],
                        help="global tensor sizes in bytes for the timings")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds of timing per primitive and size")
    parser.add_argument("--output", help="JSON path (default results/memory-<label>.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    h.init_gloo(comm)  # the cases build gloo variants too (not run here)
    P = MPIPartition(comm)
    result = {"machine": h.machine(), "label": args.label,
              "memory": memory_table(comm, P, 64 * MiB // 4),
              "timing": timing_table(comm, P, args.sizes, args.rounds, args.budget)}
    result["machine"]["load during run"] = [round(os.getloadavg()[0], 1)] * 2
    if comm.rank == 0:
        path = args.output or os.path.join(h.RESULTS, f"memory-{args.label}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f)
        for name, extra in result["memory"].items():
            print(f"{name:55s} extra per rank (MiB): {[round(e / MiB, 1) for e in extra]}")
        print(f"wrote {path}")
    import torch.distributed as dist
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
