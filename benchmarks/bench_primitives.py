"""Time distdl's primitives against raw mpi4py and torch.distributed (gloo), interleaved, 8 B to 64 MiB.

Run: ``mpiexec -n 2 python benchmarks/bench_primitives.py`` (``make bench`` runs it at 2 and 4
ranks and then ``--report``). Each run writes ``results/primitives-<ranks>.json``; ``--report``
turns every such file into ``results/primitives.md`` and ``results/primitives.png`` (``--results DIR``:
read the JSON files from, and write the report to, another folder).

For each primitive and size, seven variants take turns (see ``_harness.interleaved``): distdl
forward (autograd recording the graph), the same forward under ``torch.no_grad()`` ("distdl fwd,
no grad"), and forward+backward (``y = op(x); y.backward(g)``, autograd calling the adjoint);
raw mpi4py doing the same collective on preallocated buffers, forward and, for forward+backward,
the collective and its adjoint's; and torch.distributed.nn.functional's autograd collective on
gloo, forward and forward+backward.
The size is the global tensor's: what every rank holds for all_sum_reduce, broadcast and
sum_reduce, the gathered tensor for all_gather, reduce_scatter and repartition.
"""

from __future__ import annotations

import argparse
import faulthandler
import glob
import json
import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (first: it chooses the MPI thread level)

import torch  # noqa: E402
import torch.distributed.nn.functional as tdf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from distdl import MPIPartition  # noqa: E402
from distdl.functional.all_gather import all_gather  # noqa: E402
from distdl.functional.all_sum_reduce import all_sum_reduce  # noqa: E402
from distdl.functional.broadcast import broadcast  # noqa: E402
from distdl.functional.reduce_scatter import reduce_scatter  # noqa: E402
from distdl.functional.repartition import repartition  # noqa: E402
from distdl.functional.sum_reduce import sum_reduce  # noqa: E402
from distdl.utilities.torch import zero_volume_tensor  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)  # tdf's deprecation notices
SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
PRIMITIVES = ["all_sum_reduce", "broadcast", "sum_reduce", "all_gather", "reduce_scatter", "repartition"]
VARIANTS = ["distdl fwd", "mpi4py fwd", "gloo fwd", "distdl fwd+bwd", "mpi4py fwd+bwd", "gloo fwd+bwd"]
EXTRA = "distdl fwd, no grad"  # the forward where no graph is recorded (inference, or inside a backward)


def np_(t: torch.Tensor):
    return t.detach().numpy()


def fwd_bwd(op, x, g):
    """Return a step running ``op`` forward and its adjoint backward into a fresh ``x.grad``."""
    def step():
        x.grad = None
        op(x).backward(g)
    return step


def fwd_bwd_many(op, x, gs):
    def step():
        x.grad = None
        torch.autograd.backward(op(x), gs)
    return step


def case_all_sum_reduce(P, comm, n):
    x, g = torch.rand(n, requires_grad=True), torch.rand(n)
    y, gx = torch.empty(n), torch.empty(n)
    op = lambda x: all_sum_reduce(x, P, axes_reduce=(0,))  # noqa: E731
    gloo = lambda x: tdf.all_reduce(x)  # noqa: E731

    def raw2():
        comm.Allreduce(np_(x), np_(y))
        comm.Allreduce(np_(g), np_(gx))
    return {"distdl fwd": lambda: op(x), "mpi4py fwd": lambda: comm.Allreduce(np_(x), np_(y)),
            "gloo fwd": lambda: gloo(x), "distdl fwd+bwd": fwd_bwd(op, x, g), "mpi4py fwd+bwd": raw2,
            "gloo fwd+bwd": fwd_bwd(gloo, x, g)}


def case_broadcast(P, comm, n):
    """P_x is rank 0 alone; P_y is every rank."""
    P_x = P._memo("bench root", lambda: P.create_partition_inclusive([0]))
    root = comm.rank == 0
    x = torch.rand(n, requires_grad=True) if root else zero_volume_tensor(requires_grad=True)
    x_full, g = torch.rand(n, requires_grad=True), torch.rand(n)
    y, gx = torch.empty(n), torch.empty(n)
    op = lambda x: broadcast(x, P_x, P, preserve_batch=False)  # noqa: E731
    gloo = lambda x: tdf.broadcast(x, 0)  # noqa: E731
    buf = np_(x) if root else np_(y)

    def raw2():
        comm.Bcast(buf, root=0)
        comm.Reduce(np_(g), np_(gx) if root else None, root=0)
    return {"distdl fwd": lambda: op(x), "mpi4py fwd": lambda: comm.Bcast(buf, root=0),
            "gloo fwd": lambda: gloo(x_full), "distdl fwd+bwd": fwd_bwd(op, x, g), "mpi4py fwd+bwd": raw2,
            "gloo fwd+bwd": fwd_bwd(gloo, x_full, g)}


def case_sum_reduce(P, comm, n):
    """P_x is every rank; P_y is rank 0 alone."""
    P_y = P._memo("bench root", lambda: P.create_partition_inclusive([0]))
    root = comm.rank == 0
    x = torch.rand(n, requires_grad=True)
    op = lambda x: sum_reduce(x, P, P_y, preserve_batch=False)  # noqa: E731
    gloo = lambda x: tdf.reduce(x, 0)  # noqa: E731
    y_shape = op(x).shape  # collective: every rank calls it
    g = torch.rand(n) if root else torch.empty(y_shape)
    g_full, y, gx = torch.rand(n), torch.empty(n), torch.empty(n)

    def raw2():
        comm.Reduce(np_(x), np_(y) if root else None, root=0)
        comm.Bcast(np_(g) if root else np_(gx), root=0)
    return {"distdl fwd": lambda: op(x), "mpi4py fwd": lambda: comm.Reduce(np_(x), np_(y) if root else None, root=0),
            "gloo fwd": lambda: gloo(x), "distdl fwd+bwd": fwd_bwd(op, x, g), "mpi4py fwd+bwd": raw2,
            "gloo fwd+bwd": fwd_bwd(gloo, x, g_full)}


def case_all_gather(P, comm, n):
    n = -(-n // comm.size) * comm.size
    x, g = torch.rand(n // comm.size, requires_grad=True), torch.rand(n)
    y, gx = torch.empty(n), torch.empty(n // comm.size)
    op = lambda x: all_gather(x, P, axes_all_gather=(0,))  # noqa: E731
    gloo = lambda x: tdf.all_gather(x)  # a tuple of blocks: no concatenation is charged to gloo  # noqa: E731

    def raw2():
        comm.Allgather(np_(x), np_(y))
        comm.Reduce_scatter_block(np_(g), np_(gx))
    return {"distdl fwd": lambda: op(x), "mpi4py fwd": lambda: comm.Allgather(np_(x), np_(y)),
            "gloo fwd": lambda: gloo(x), "distdl fwd+bwd": fwd_bwd(op, x, g), "mpi4py fwd+bwd": raw2,
            "gloo fwd+bwd": fwd_bwd_many(gloo, x, list(g.chunk(comm.size)))}


def case_reduce_scatter(P, comm, n):
    n = -(-n // comm.size) * comm.size
    x, g = torch.rand(n, requires_grad=True), torch.rand(n // comm.size)
    y, gx = torch.empty(n // comm.size), torch.empty(n)
    op = lambda x: reduce_scatter(x, P, axes_reduce_scatter=(0,))  # noqa: E731
    gloo = lambda x: tdf.reduce_scatter(torch.empty(n // comm.size), list(x.chunk(comm.size)))  # noqa: E731

    def raw2():
        comm.Reduce_scatter_block(np_(x), np_(y))
        comm.Allgather(np_(g), np_(gx))
    return {"distdl fwd": lambda: op(x), "mpi4py fwd": lambda: comm.Reduce_scatter_block(np_(x), np_(y)),
            "gloo fwd": lambda: gloo(x), "distdl fwd+bwd": fwd_bwd(op, x, g), "mpi4py fwd+bwd": raw2,
            "gloo fwd+bwd": fwd_bwd(gloo, x, g)}


def _bounds(n, p):
    return [(i * (n // p) + min(i, n % p), (i + 1) * (n // p) + min(i + 1, n % p)) for i in range(p)]


def case_repartition(P, comm, n):
    """A (R, C) tensor split by rows over P_x = (p, 1) goes to split by columns over P_y = (1, p)."""
    p, me = comm.size, comm.rank
    C = 2 ** (max(n, 1).bit_length() // 2)
    R = max(1, n // C)
    P_x = P._memo("bench rows", lambda: P.create_cartesian_topology_partition((p, 1)))
    P_y = P._memo("bench cols", lambda: P.create_cartesian_topology_partition((1, p)))
    rows, cols = _bounds(R, p), _bounds(C, p)
    r0, r1 = rows[me]
    c0, c1 = cols[me]
    x, g = torch.rand(r1 - r0, C, requires_grad=True), torch.rand(R, c1 - c0)
    y, gx = torch.empty(R, c1 - c0), torch.empty(r1 - r0, C)
    # raw: pack x's column blocks in rank order, Alltoallv straight into y (rows of y arrive whole);
    # backward: rows of g go out whole, the column blocks arrive packed and are unpacked into gx.
    packed, unpacked = torch.empty(x.numel()), torch.empty(x.numel())
    send_counts = [(r1 - r0) * (b - a) for a, b in cols]
    recv_counts = [(b - a) * (c1 - c0) for a, b in rows]

    def displacements(counts):
        return [sum(counts[:i]) for i in range(len(counts))]
    send_spec = [np_(packed), (send_counts, displacements(send_counts)), MPI.FLOAT]
    recv_spec = [np_(y), (recv_counts, displacements(recv_counts)), MPI.FLOAT]

    def raw():
        offset = 0
        for a, b in cols:
            packed[offset:offset + (r1 - r0) * (b - a)].view(r1 - r0, b - a).copy_(x[:, a:b])
            offset += (r1 - r0) * (b - a)
        comm.Alltoallv(send_spec, recv_spec)

    back_send = [np_(g), (recv_counts, displacements(recv_counts)), MPI.FLOAT]
    back_recv = [np_(unpacked), (send_counts, displacements(send_counts)), MPI.FLOAT]

    def raw2():
        raw()
        comm.Alltoallv(back_send, back_recv)
        offset = 0
        for a, b in cols:
            gx[:, a:b] = unpacked[offset:offset + (r1 - r0) * (b - a)].view(r1 - r0, b - a)
            offset += (r1 - r0) * (b - a)

    op = lambda x: repartition(x, P_x, P_y)  # noqa: E731

    def gloo(x):
        send = torch.cat([x[:, a:b].reshape(-1) for a, b in cols])
        return tdf.all_to_all_single(torch.empty(sum(recv_counts)), send, recv_counts, send_counts).view(R, c1 - c0)
    return {"distdl fwd": lambda: op(x), "mpi4py fwd": raw, "gloo fwd": lambda: gloo(x),
            "distdl fwd+bwd": fwd_bwd(op, x, g), "mpi4py fwd+bwd": raw2, "gloo fwd+bwd": fwd_bwd(gloo, x, g)}


def _with_no_grad(case):
    def build(P, comm, n):
        variants = case(P, comm, n)
        forward = variants["distdl fwd"]

        def no_grad():
            with torch.no_grad():
                return forward()
        variants[EXTRA] = no_grad
        return variants
    return build


CASES = {name: _with_no_grad(globals()[f"case_{name}"]) for name in PRIMITIVES}


def measure(args) -> None:
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints where a rank is
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    h.init_gloo(comm)
    if args.retain_freed_memory:
        h.retain_freed_memory()
    P = MPIPartition(comm)
    results = {"machine": h.machine(), "sizes": {s: {n: {} for n in args.primitives} for s in args.sizes},
               "load": []}
    # Rounds outermost: each round visits every size and primitive once (largest first on odd rounds),
    # so a slow stretch of the machine costs every size a few samples instead of one size all of its.
    for r in range(args.rounds):
        for size in (args.sizes if r % 2 == 0 else args.sizes[::-1]):
            for name in args.primitives:
                variants = CASES[name](P, comm, max(1, size // 4))
                samples = h.interleaved(comm, variants, rounds=2, budget_s=args.budget, min_rounds=1)
                for variant, values in samples.items():
                    results["sizes"][size][name].setdefault(variant, []).extend(values)
                del variants, samples
        results["load"].append(os.getloadavg()[0])
        if comm.rank == 0:
            print(f"round {r + 1} of {args.rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)
    if comm.rank == 0:
        for size in args.sizes:
            for name in args.primitives:
                samples = results["sizes"][size][name]
                row = "  ".join(f"{v} {h.median(samples[v]) * 1e6:9.1f}" for v in VARIANTS)
                print(f"{name:>15} {h.format_size(size):>7}: {row}  (us)", flush=True)
    results["machine"]["load during run"] = [round(min(results["load"]), 1), round(max(results["load"]), 1)]
    import torch.distributed as dist
    dist.destroy_process_group()
    if comm.rank == 0:
        os.makedirs(h.RESULTS, exist_ok=True)
        path = args.output or os.path.join(h.RESULTS, f"primitives-{comm.size}.json")
        with open(path, "w") as f:
            json.dump(results, f)
        print(f"wrote {path}")


# -- report -----------------------------------------------------------------------------------------

def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def _load(paths: list[str]) -> list[dict]:
    """Return the JSON run of each path, in the given order."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def report(directory: str) -> None:
    """Write ``primitives.md`` and ``primitives.png`` in ``directory`` from the JSON runs there."""
    runs = _load(sorted(glob.glob(os.path.join(directory, "primitives-*.json"))))
    lines = ["# distdl primitives vs raw mpi4py and torch.distributed (gloo)", "",
             "Generated by `make bench` (`benchmarks/bench_primitives.py`); see `benchmarks/README.md` for the method.",
             "Times are medians over interleaved rounds, in microseconds per call (the slowest rank's). Ratios are",
             "medians of per-round ratios (both sides measured in the same round). `fwd+bwd` is `y = op(x);",
             "y.backward(g)`, against the raw collective plus its adjoint's. `gloo/distdl` above 1 means distdl is",
             "faster.",
             ""]
    for run in runs:
        lines += _run_section(run)
    lines += _threads_section(sorted(glob.glob(os.path.join(directory, "threads-*.json"))))
    lines += _memory_section(sorted(glob.glob(os.path.join(directory, "memory-*.json"))))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(directory, "primitives.md"), "w") as f:
        f.write(text)
    _plot(runs, directory)
    print(text)


def _targets(run) -> list[str]:
    sizes = {int(s): v for s, v in run["sizes"].items()}
    big = [s for s in sizes if s >= 1 << 20]
    lines = ["| primitive | fwd / mpi4py, worst at >= 1 MiB (target <= 1.10) | fwd+bwd / mpi4py x2, worst at >= 1 MiB "
             "(<= 1.10) | fwd at 8 B, us (<= 8) | fwd+bwd at 8 B, us (<= 30) | gloo / distdl, worst size (>= 3) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in PRIMITIVES:
        if not all(name in sizes[s] for s in sizes):
            continue

        def worst(kind, within):
            values = [(h.paired_ratio(sizes[s][name][f"distdl {kind}"], sizes[s][name][f"mpi4py {kind}"]), s)
                      for s in within]
            r, s = max(values)
            # Best rounds: each size's fastest distdl sample over its fastest raw one; the worst of those over
            # the same sizes, at whichever size it falls (not necessarily the median's).
            best, best_s = max((min(sizes[t][name][f"distdl {kind}"]) / min(sizes[t][name][f"mpi4py {kind}"]), t)
                               for t in within)
            return f"{r:.2f} at {h.format_size(s)} (best rounds: {best:.2f} at {h.format_size(best_s)})"

        def worst_gloo():
            values = [(min(h.paired_ratio(sizes[s][name][f"gloo {k}"], sizes[s][name][f"distdl {k}"])
                           for k in ("fwd", "fwd+bwd")), s) for s in sizes]
            r, s = min(values)
            return f"{r:.1f} ({h.format_size(s)})"
        small = sizes.get(8, {}).get(name)
        def at_8(variant):
            return f"{_us(h.median(small[variant]))} (best {_us(min(small[variant]))})" if small else "-"
        no_grad = f"; no grad {at_8(EXTRA)}" if small and EXTRA in small else ""
        lines.append(f"| {name} | {worst('fwd', big) if big else '-'} | {worst('fwd+bwd', big) if big else '-'} | "
                     f"{at_8('distdl fwd')}{no_grad} | {at_8('distdl fwd+bwd')} | {worst_gloo()} |")
    return lines


def _run_section(run) -> list[str]:
    m = run["machine"]
    lines = [f"## {m['ranks']} ranks" + (" (oversubscribed: more ranks than the machine's cores)"
                                        if m["ranks"] > m["cores"] else ""), "",
             f"{m['date']}; {m['cores']} cores; load average {m['load during run'][0]}-{m['load during run'][1]} "
             f"during the run (the machine is shared); {m['mpi']}; mpi4py {m['mpi4py']}, thread level "
             f"{m['thread level']}; torch {m['torch']}; allocator: {m['allocator']}; MPICH settings: "
             f"{m.get('mpich', 'not recorded')}.", "",
             "Targets (worst case over the sizes named; medians, and in brackets the best rounds, which is what a",
             "call costs when neither rank is descheduled). For the ratios, the bracket is the worst over the same",
             "sizes of distdl's best round over raw mpi4py's best round, and the size where that falls:", ""]
    lines += _targets(run) + [""]
    sizes = {int(s): v for s, v in run["sizes"].items()}
    for name in PRIMITIVES:
        rows = [(s, sizes[s][name]) for s in sorted(sizes) if name in sizes[s]]
        if not rows:
            continue
        lines += [f"### {name}", "",
                  "| size | distdl fwd | mpi4py fwd | distdl/mpi4py | gloo fwd | gloo/distdl | distdl fwd+bwd | "
                  "mpi4py x2 | distdl/mpi4py | gloo fwd+bwd | gloo/distdl |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for s, v in rows:
            cells = [h.format_size(s)]
            for kind in ("fwd", "fwd+bwd"):
                d, r, g = v[f"distdl {kind}"], v[f"mpi4py {kind}"], v[f"gloo {kind}"]
                cells += [_us(h.median(d)), _us(h.median(r)), f"{h.paired_ratio(d, r):.2f}", _us(h.median(g)),
                          f"{h.paired_ratio(g, d):.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _threads_section(paths: list[str]) -> list[str]:
    if not paths:
        return []
    runs = _load(paths)
    lines = ["## MPI thread level", "",
             "The same 8 B calls at 2 ranks, in separate runs (the thread level is fixed when MPI starts), the levels "
             "alternating; median per call in microseconds (best round in brackets).", "",
             "| thread level | load | " + " | ".join(f"{p} {v}" for p in runs[0]["sizes"]["8"] for v in
                                                   ("mpi4py fwd", "distdl fwd", "distdl fwd+bwd")) + " |",
             "| --- | ---: |" + " ---: |" * (3 * len(runs[0]["sizes"]["8"]))]
    for path, run in zip(paths, runs):
        cells = [f"{_us(h.median(run['sizes']['8'][p][v]))} ({_us(min(run['sizes']['8'][p][v]))})"
                 for p in run["sizes"]["8"] for v in ("mpi4py fwd", "distdl fwd", "distdl fwd+bwd")]
        m, label = run["machine"], os.path.basename(path)[len("threads-"):-len(".json")]
        lines.append(f"| {m['thread level']} (run {label.split('-')[0]}) | {m['load during run'][1]} | "
                     + " | ".join(cells) + " |")
    return lines + [""]


def _memory_section(paths: list[str]) -> list[str]:
    if not paths:
        return []
    runs = _load(paths)
    MiB = 2 ** 20
    ranks = runs[0]["machine"]["ranks"]
    lines = ["## Memory and the allocator", "",
             f"From `benchmarks/bench_memory.py` at {ranks} ranks, once per allocator setting (glibc reads its "
             "settings at start-up, so they cannot take turns inside one run; the runs were made one after the "
             "other, and only ratios within a run are exact). `mpi4py, fresh` writes into a new tensor each call as "
             "distdl must (outputs never alias inputs; its broadcast root copies, as distdl's does).", ""]
    first = next((r for r in runs if r["label"] == "default"), runs[0])
    lines += [f"Peak memory of one 64 MiB AllSumReduce above the resident memory just before the call, less the "
              f"output it returns, per rank (MiB), allocator `{first['machine']['allocator']}`:", "",
              "| call | " + " | ".join(f"rank {i}" for i in range(len(next(iter(first["memory"].values())))))
              + " |", "| --- |" + " ---: |" * len(next(iter(first["memory"].values())))]
    for name, extra in first["memory"].items():
        lines.append(f"| {name} | " + " | ".join(f"{e / MiB:.1f}" for e in extra) + " |")
    lines += ["", "Median time per call (ms) and distdl's ratio to raw mpi4py (preallocated / fresh output):", "",
              "| call | " + " | ".join(f"{r['label']}: distdl | mpi4py | mpi4py, fresh | ratios" for r in runs) + " |",
              "| --- |" + " ---: | ---: | ---: | ---: |" * len(runs)]
    for key in runs[0]["timing"]:
        cells = []
        for r in runs:
            t = r["timing"][key]
            d, raw, fresh = t["distdl fwd"], t["mpi4py fwd"], t["mpi4py fwd, fresh output"]
            cells += [f"{h.median(d) * 1e3:.1f}", f"{h.median(raw) * 1e3:.1f}", f"{h.median(fresh) * 1e3:.1f}",
                      f"{h.paired_ratio(d, raw):.2f} / {h.paired_ratio(d, fresh):.2f}"]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    settings = "; ".join(f"{r['label']}: `{r['machine']['allocator']}` (load {r['machine']['load during run'][0]})"
                         for r in runs)
    return lines + ["", f"Settings: {settings}.", ""]


def _plot(runs, directory: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    run = next((r for r in runs if r["machine"]["ranks"] == 2), runs[0])
    sizes = {int(s): v for s, v in run["sizes"].items()}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), sharex=True)
    colours = {"distdl": "tab:blue", "mpi4py": "tab:green", "gloo": "tab:red"}
    for ax, name in zip(axes.ravel(), PRIMITIVES):
        xs = [s for s in sorted(sizes) if name in sizes[s]]
        for variant in VARIANTS:
            impl, kind = variant.split()
            ys = [min(sizes[s][name][variant]) * 1e6 for s in xs]  # best round: robust to the machine's load
            ax.plot(xs, ys, color=colours[impl], linestyle="-" if kind == "fwd" else "--", marker=".",
                    label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xticks(xs, [h.format_size(s) for s in xs], rotation=45, fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("time per call, best round (us)")
    axes[0, 0].legend(fontsize=8)
    m = run["machine"]
    fig.suptitle(f"distdl vs raw mpi4py vs gloo autograd collectives, {m['ranks']} ranks on {m['cores']} cores "
                 f"(load {m['load during run'][0]}-{m['load during run'][1]}), thread level {m['thread level']}")
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "primitives.png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="global tensor sizes in bytes")
    parser.add_argument("--primitives", nargs="+", default=PRIMITIVES, choices=PRIMITIVES)
    parser.add_argument("--rounds", type=int, default=8, help="rounds over every size and primitive (2 samples each)")
    parser.add_argument("--budget", type=float, default=0.5, help="at most about this many seconds per primitive, "
                        "size and round")
    parser.add_argument("--retain-freed-memory", action="store_true",
                        help="keep freed memory in the heap (as MALLOC_MMAP_MAX_=0; see _harness.retain_freed_memory)")
    parser.add_argument("--output", help="JSON path (default results/primitives-<ranks>.json)")
    parser.add_argument("--report", action="store_true", help="write primitives.md/.png from the JSON files")
    parser.add_argument("--results", default=h.RESULTS,
                        help="with --report: the folder of the JSON files, where the report is written")
    args = parser.parse_args()
    if args.report:
        report(args.results)
    else:
        measure(args)


if __name__ == "__main__":
    main()
