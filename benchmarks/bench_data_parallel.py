"""Time a data-parallel training step: DataParallel's overlapped reductions vs backward, then all_reduce_gradients.

Run: ``mpiexec -n 2 .venv/bin/python benchmarks/bench_data_parallel.py [--width 1024 --layers 6 --batch 32]``.
The variants take turns, one step each per round in a fresh random order (``_harness.turns``), each step
timed from a barrier to the slowest worker's end; the report gives medians, and the overlap's ratio as the
median over rounds of the per-round ratio, and writes ``benchmarks/results/data_parallel.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (first: it chooses the MPI thread level)

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from distdl import MPIPartition  # noqa: E402
from distdl.backends import mpi as transport  # noqa: E402
from distdl.nn import data_parallel  # noqa: E402
from distdl.nn.data_parallel import DataParallel, all_reduce_gradients  # noqa: E402


def mlp(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])


def bn_mlp(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width),
                                                                     torch.nn.BatchNorm1d(width))])


def buffer_broadcasts(comm: MPI.Intracomm, P: MPIPartition, reps: int, layers: int = 40, width: int = 64) -> list[str]:
    """Time DataParallel's forward (grad mode on), whose buffers are broadcast in one Bcast per dtype, against
    the same forward with them broadcast one Bcast each (by hand), and with none broadcast; return the report."""
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(comm.rank))
    variants = {"no buffer broadcast (`broadcast_buffers=False`)": DataParallel(bn_mlp(width, layers), P,
                                                                               broadcast_buffers=False),
                "one Bcast per buffer, by hand (before 2026-11-26)": DataParallel(bn_mlp(width, layers), P,
                                                                                broadcast_buffers=False),
                "DataParallel (one Bcast per dtype)": DataParallel(bn_mlp(width, layers), P)}
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps + 3):
        for name in (names[i] for i in h.turns(len(names))):
            model = variants[name]
            comm.Barrier()
            start = MPI.Wtime()
            if name == names[1]:
                for t in model.module.buffers():
                    transport.bcast_in_place(P.comm, t)
            model(x)
            elapsed = comm.allreduce(MPI.Wtime() - start, op=MPI.MAX)
            if rep >= 3:
                times[name].append(elapsed)
    count = len(list(variants[names[0]].module.buffers()))
    lines = ["", f"Buffers: DataParallel broadcasts rank 0's buffers at every forward with grad mode on. Model "
             f"{layers} x (Linear({width}, {width}), BatchNorm1d({width})), {count} buffers (float32 running "
             f"statistics, int64 counters); forward only, local batch 16, {reps} rounds as above.", "",
             "| variant | median forward (ms) | vs. one Bcast per buffer |", "| --- | ---: | ---: |"]
    for name in names:
        ratio = "" if name == names[1] else f"{h.paired_ratio(times[name], times[names[1]]):.2f}"
        lines.append(f"| {name} | {h.median(times[name]) * 1e3:.2f} | {ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="local batch per worker")
    parser.add_argument("--reps", type=int, default=30, help="rounds (after 3 to warm up)")
    parser.add_argument("--caps", type=float, nargs="+", default=[25.0, 4.0], help="bucket caps in MB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    P = MPIPartition(comm)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(comm.rank))

    variants = {"backward only (no reduction)": (mlp(args.width, args.layers), None)}
    for cap in args.caps:
        variants[f"backward, then all_reduce_gradients (cap {cap:g} MB)"] = (mlp(args.width, args.layers), cap)
        variants[f"DataParallel, overlapped (cap {cap:g} MB)"] = (DataParallel(mlp(args.width, args.layers), P,
                                                                               bucket_cap_mb=cap), cap)
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps + 3):  # the first 3 rounds warm up
        for name in (names[i] for i in h.turns(len(names))):
            model, cap = variants[name]
            model.zero_grad(set_to_none=True)
            comm.Barrier()
            start = MPI.Wtime()
            model(x).square().mean().backward()
            if cap is not None and not isinstance(model, DataParallel):
                all_reduce_gradients(model, P, bucket_cap_mb=cap)
            elapsed = comm.allreduce(MPI.Wtime() - start, op=MPI.MAX)
            if rep >= 3:
                times[name].append(elapsed)

    buffers = buffer_broadcasts(comm, P, args.reps)
    if comm.rank != 0:
        return
    megabytes = sum(p.numel() * p.element_size() for p in variants["backward only (no reduction)"][0].parameters())
    medians = {name: h.median(t) * 1e3 for name, t in times.items()}
    threshold = transport.PAIRWISE_SUM_BYTES
    pairwise = (f"Buckets of {threshold >> 10} KiB or more are summed by distdl's pairwise sum "
                "(`DISTDL_PAIRWISE_SUM_BYTES`), the others by MPI's `Iallreduce`." if threshold is not None else
                "Every bucket is summed by MPI's `Iallreduce` (`DISTDL_PAIRWISE_SUM_BYTES=0`).")
    lines = [f"Data-parallel training step (forward + backward + gradient reduction), {comm.size} ranks, "
             f"MLP {args.layers} x Linear({args.width}, {args.width}) = {megabytes / 2 ** 20:.1f} MB of float32 "
             f"parameters, local batch {args.batch}; {args.reps} rounds, one step of each variant per round in a "
             "fresh random order. Medians over rounds; the ratio is the median of the per-round ratios. "
             f"Gradients of {data_parallel.IN_PLACE_BYTES >> 10} KiB or more are reduced in place, each on its own "
             "(`IN_PLACE_BYTES`): the cap only groups the smaller ones. " + pairwise, "",
             "| variant | median step (ms) | vs. backward then all_reduce_gradients |", "| --- | ---: | ---: |"]
    for name, median in medians.items():
        ratio = ""
        if name.startswith("DataParallel"):
            cap = name[name.index("(cap"):]
            ratio = f"{h.paired_ratio(times[name], times[f'backward, then all_reduce_gradients {cap}']):.2f}"
        lines.append(f"| {name} | {median:.1f} | {ratio} |")
    run = h.machine()
    lines += ["", f"Machine: {run['cores']} cores, load average {run['load']} at the end of the run (shared); "
              f"{run['date']}, thread level {run['thread level']}, allocator: {run['allocator']}. A ratio below 1 "
              "means overlap paid off. With MPI's shared-memory transport a non-blocking reduction advances only "
              "while a rank is inside an MPI call, and with one core per rank there is no spare core to run it "
              "during backward: expect little gain here; the overlap is meant for networks with offloaded progress "
              "(or MPICH's MPIR_CVAR_ASYNC_PROGRESS=1 with spare cores)."] + buffers
    report = "\n".join(lines)
    print(report)
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "data_parallel.md"), "w") as f:
        f.write(f"# bench_data_parallel.py\n\n{report}\n")


if __name__ == "__main__":
    main()
