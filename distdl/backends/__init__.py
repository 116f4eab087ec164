"""Transports between torch tensors and MPI (see :mod:`distdl.backends.mpi` and :mod:`distdl.backends.cuda`)."""

from __future__ import annotations

import torch
from mpi4py import MPI

_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def info() -> dict[str, object]:
    """Return what distdl runs on: the MPI library, thread level, CUDA transport and visible devices.

    With CUDA devices present, this decides the CUDA transport (environment or probe, once).
    """
    from distdl.backends import cuda
    vendor, version = MPI.get_vendor()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if not devices:
        transport = "CPU only (no CUDA devices visible)"
    else:
        transport = "CUDA-aware MPI (direct)" if cuda.cuda_aware() else "staged through pinned host memory"
    return {
        "mpi_vendor": f"{vendor} {'.'.join(map(str, version))}",
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi_standard": ".".join(map(str, MPI.Get_version())),
        "thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), "unknown"),
        "world_size": MPI.COMM_WORLD.size,
        "cuda_transport": transport,
        "devices": devices,
        "torch": torch.__version__,
    }
