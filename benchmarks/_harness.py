"""Pieces shared by the benchmark scripts: MPI set-up, interleaved timing, allocator settings, gloo.

Import this module before anything imports ``mpi4py.MPI``: it picks the MPI thread level.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import os
import statistics
import time
from collections.abc import Callable

import mpi4py

# MPI_THREAD_MULTIPLE (mpi4py's default) makes MPICH take a lock around every call: a raw 8 B
# allreduce took 3.5 us against 3.0 us under "serialized" (best rounds, 2 ranks; the thread table of
# results/primitives.md). On the CPU distdl calls MPI from one thread at a time (autograd runs a CPU
# backward on the calling thread), and so do these scripts' single primitives on a GPU, so "serialized"
# is enough here. Training on GPUs staged through the host (MPI not CUDA-aware) is not: a primitive's
# adjoint runs in the calling thread while the device's autograd thread may call MPI too (DataParallel's
# hooks, DistributedBatchNorm's sums); that needs MPI_THREAD_MULTIPLE (docs/gpu.md). The environment
# variable MPI4PY_RC_THREAD_LEVEL overrides this.
if "MPI4PY_RC_THREAD_LEVEL" not in os.environ:
    mpi4py.rc.thread_level = "serialized"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                 MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    """Return what a report should say about the machine and the run (rank 0's view)."""
    return {"cores": os.cpu_count(), "ranks": MPI.COMM_WORLD.size, "load": round(os.getloadavg()[0], 1),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(), "mpi4py": mpi4py.__version__,
            "torch": torch.__version__, "thread level": THREAD_LEVELS.get(MPI.Query_thread(), "?"),
            "allocator": allocator_environment(), "mpich": mpich_environment(),
            "date": datetime.datetime.now().isoformat(timespec="minutes")}


def mpich_environment() -> str:
    """Return the MPICH settings (``MPIR_CVAR_*``) in the environment."""
    return " ".join(f"{n}={v}" for n, v in sorted(os.environ.items()) if n.startswith("MPIR_CVAR_")) or "defaults"


def allocator_environment() -> str:
    names = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "THP_MEM_ALLOC_ENABLE")
    return " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ) or "glibc and torch defaults"


# -- glibc allocator switches (the same effect as the MALLOC_* variables, settable at run time) -------

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def retain_freed_memory() -> None:
    """Keep freed memory in the process heap: the run-time equivalent of the MALLOC_* settings below.

    glibc serves blocks above its mmap threshold (which adapts up to 32 MiB) with a fresh ``mmap``
    and unmaps them on free, so every new 64 MiB tensor is page-faulted again (~26 ms against
    ~5 ms to copy it). ``MALLOC_MMAP_MAX_=0`` (never mmap) with a large ``MALLOC_TRIM_THRESHOLD_``
    (never give the heap back) makes freed blocks reusable, like a caching allocator. There is no
    switching back: after ``mallopt`` glibc no longer adapts its thresholds.
    """
    _libc.mallopt(_M_MMAP_MAX, 0)
    _libc.mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1)


# -- timing ---------------------------------------------------------------------------------------


# Each round runs the variants in a fresh random order, the same on every rank (the variants are
# collective, and every rank draws from one seed in step). A call runs faster right after one that
# warmed the same code and memory, so an order that only rotates favours whichever variant follows a
# similar one (README.md, "Why random").
_TURNS = np.random.default_rng(20261122)


def turns(n: int) -> list[int]:
    """Return the order of one round of ``n`` variants: a random permutation, the same on every rank."""
    return [int(i) for i in _TURNS.permutation(n)]


def interleaved(comm: MPI.Comm, variants: dict[str, Callable[[], object]], rounds: int, batch_s: float = 0.004,
                budget_s: float = 4.0, setup: dict[str, Callable[[], None]] | None = None,
                min_rounds: int = 3) -> dict[str, list[float]]:
    """Return per-call seconds of each variant, one sample per round, the variants taking turns.

    Each sample is a batch of back-to-back calls started together after a barrier; its time is the
    slowest rank's. The batch length is fitted to ``batch_s`` and the number of rounds cut to keep
    the whole measurement near ``budget_s``. ``setup[name]`` runs (untimed) before each of that
    variant's batches.
    """
    setup = setup or {}
    names = list(variants)
    estimate = {}
    for name in names:  # warm up (plans, communicators, first-touch memory) and estimate
        setup.get(name, lambda: None)()
        variants[name]()
        comm.Barrier()
        start = time.perf_counter()
        variants[name]()
        estimate[name] = time.perf_counter() - start
    estimate = dict(zip(names, _slowest(comm, np.array([estimate[n] for n in names]))))
    reps = {n: int(min(2000, max(1, batch_s // max(estimate[n], 1e-7)))) for n in names}
    per_round = sum(reps[n] * estimate[n] for n in names)
    rounds = int(max(min_rounds, min(rounds, budget_s // max(per_round, 1e-9))))
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        local = np.empty(len(names))
        for i in turns(len(names)):
            name = names[i]
            setup.get(name, lambda: None)()
            fn, n = variants[name], reps[name]
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            local[i] = (time.perf_counter() - start) / n
        slowest = _slowest(comm, local)
        for name, t in zip(names, slowest):
            samples[name].append(float(t))
    return samples


def _slowest(comm: MPI.Comm, local: np.ndarray) -> np.ndarray:
    result = np.empty_like(local)
    comm.Allreduce(local, result, op=MPI.MAX)
    return result


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a/b: both measured in the same round, so slow stretches cancel."""
    return statistics.median(x / y for x, y in zip(a, b))


# -- torch.distributed (gloo) -----------------------------------------------------------------------


def init_gloo(comm: MPI.Comm) -> None:
    """Start a gloo process group over localhost TCP on the same ranks as ``comm``."""
    import torch.distributed as dist
    store = None
    if comm.rank == 0:  # port 0: the OS picks a free port, which the other ranks learn through MPI
        store = dist.TCPStore("127.0.0.1", 0, comm.size, True, timeout=datetime.timedelta(seconds=120),
                              wait_for_workers=False)
    port = comm.bcast(store.port if store is not None else None)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, comm.size, False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)


def format_size(n: int) -> str:
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"
