"""Soak test: many training steps of a small distributed model; memory and communicators must stay flat.

    mpiexec -n 2 .venv/bin/python benchmarks/soak.py --steps 10000

The model is a row-parallel linear layer: each rank holds ``Linear(features / P, out)`` on its
slice of the input features, and ``all_sum_reduce`` adds the partial outputs (its backward is
itself), followed by a local ReLU and a second local linear layer and an MSE loss, trained with
SGD. The second layer is replicated: it starts alike on every rank (its own seed) and, since every
rank computes the same sum, stays so, one model with the same loss on every rank. Every tenth batch
is smaller, as a last batch would be. The script reports resident memory
(``VmRSS``) after warm-up and at the end (target: growth below 1%),
``distdl.partition.live_communicators()`` after warm-up and at the end (must not change), and
whether the replicated layer is identical on every rank at the end; it prints the report and writes
it to ``benchmarks/results/soak.md`` (``--output``).
``--check`` runs every step with check mode on and a ``verify`` call before the sum.
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from pathlib import Path

import torch
from mpi4py import MPI

import distdl
from distdl.checks import verify
from distdl.functional.all_sum_reduce import all_sum_reduce
from distdl.partition import live_communicators


def resident_kib() -> int:
    """Return this process's resident memory in KiB (VmRSS from /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("soak: expected a VmRSS line in /proc/self/status, got none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=None, help="steps before the first measurement (steps/10)")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--check", action="store_true", help="check mode on, verify() before each sum")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "soak.md"))
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    if not 0 < warmup < args.steps:
        parser.error(f"expected 0 < warmup < steps, got warmup={warmup}, steps={args.steps}")

    torch.set_num_threads(1)
    torch.manual_seed(0)
    P_world = distdl.MPIPartition(MPI.COMM_WORLD)
    P_x = P_world.create_cartesian_topology_partition([P_world.size])
    distdl.set_check_mode(args.check)
    local_features = args.features // P_x.size + (P_x.rank < args.features % P_x.size)
    # Only rank 0 holds the first layer's bias, so the sum adds it once.
    first = torch.nn.Linear(local_features, 32, bias=P_x.rank == 0, dtype=torch.float64)
    # The second layer is replicated: it must start alike on every rank, so it draws from a seed of its own
    # (the first layer's shape and bias differ by rank, and so does where it leaves the shared stream).
    torch.manual_seed(1)
    second = torch.nn.Linear(32, 4, dtype=torch.float64)
    parameters = list(first.parameters()) + list(second.parameters())
    optimizer = torch.optim.SGD(parameters, lr=1e-2)
    generator = torch.Generator().manual_seed(1 + P_x.rank)

    def step(i: int) -> float:
        batch = args.batch if i % 10 else args.batch // 2 + 1  # a smaller "last batch" now and then
        x = torch.randn(batch, local_features, generator=generator, dtype=torch.float64)
        target = torch.ones(batch, 4, dtype=torch.float64)
        optimizer.zero_grad(set_to_none=True)
        partial = first(x)
        verify("all_sum_reduce", P_x, partial)  # a no-op unless --check
        hidden = torch.relu(all_sum_reduce(partial, P_x, axes_reduce=[0]))
        loss = torch.nn.functional.mse_loss(second(hidden), target)
        loss.backward()
        optimizer.step()
        return loss.item()

    communicators_built = live_communicators()
    for i in range(warmup):
        step(i)
    gc.collect()
    rss_warm, communicators_warm = resident_kib(), live_communicators()
    P_world.comm.Barrier()
    start = time.perf_counter()
    for i in range(warmup, args.steps):
        loss = step(i)
    elapsed = time.perf_counter() - start
    gc.collect()
    rss_end, communicators_end = resident_kib(), live_communicators()
    # One model: every rank computes the same sum, so the replicated layer must still be the same everywhere.
    replicated = P_world.comm.gather([p.detach().clone() for p in second.parameters()], root=0)

    rows = P_world.comm.gather((P_world.rank, rss_warm, rss_end, communicators_built, communicators_warm,
                                communicators_end, elapsed, loss), root=0)
    if P_world.rank == 0:
        same = all(torch.equal(a, b) for other in replicated for a, b in zip(replicated[0], other))
        report = _report(args, warmup, rows, same)
        print(report)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(report)


def _report(args: argparse.Namespace, warmup: int, rows: list[tuple], same: bool) -> str:
    worst = max((end - warm) / warm for _, warm, end, *_ in rows)
    flat = all(c_warm == c_end for _, _, _, _, c_warm, c_end, _, _ in rows)
    slowest = max(r[6] for r in rows)
    measured = args.steps - warmup
    vendor, version = MPI.get_vendor()
    lines = [
        "# Soak test",
        "",
        f"`mpiexec -n {len(rows)} python benchmarks/soak.py --steps {args.steps}"
        f"{' --check' if args.check else ''}`: a row-parallel linear layer (all_sum_reduce) + ReLU + linear, "
        f"SGD, batch {args.batch} (every tenth batch {args.batch // 2 + 1}), {args.features} features, float64.",
        f"distdl {distdl.__version__}, torch {torch.__version__}, {vendor} {'.'.join(map(str, version))}, "
        f"Python {platform.python_version()}, {platform.machine()}; check mode {'on' if args.check else 'off'}.",
        "",
        f"Measured over steps {warmup}..{args.steps} (after {warmup} warm-up steps): "
        f"{slowest / measured * 1e3:.3f} ms per step (slowest rank).",
        "",
        "| rank | VmRSS after warm-up (KiB) | VmRSS at end (KiB) | growth | communicators built / after warm-up / end "
        "| final loss |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for rank, warm, end, c_built, c_warm, c_end, _, loss in rows:
        lines.append(f"| {rank} | {warm} | {end} | {100 * (end - warm) / warm:+.2f}% | {c_built} / {c_warm} / {c_end} "
                     f"| {loss:.4g} |")
    lines += ["", f"Worst memory growth {100 * worst:+.2f}% (target < 1%): {'PASS' if worst < 0.01 else 'FAIL'}. "
                  f"Live communicators constant after warm-up: {'PASS' if flat else 'FAIL'}. "
                  f"Replicated second layer identical on every rank at the end: {'PASS' if same else 'FAIL'}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
