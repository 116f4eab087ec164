"""Shared test helpers."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import distdl.backends.mpi as transport
import distdl.functional._messages as messages

FLOAT_DTYPES = (torch.float32, torch.float64)
# The MPI launcher for tests that start jobs: $MPIEXEC, a path or a command name looked up on PATH (`make test
# MPIEXEC=mpiexec` exports a bare name, as the Makefile's recipes use it), else the one beside this Python.
_LAUNCHER = os.environ.get("MPIEXEC")
MPIEXEC = Path(shutil.which(_LAUNCHER) or _LAUNCHER) if _LAUNCHER else Path(sys.executable).parent / "mpiexec"


def sizes(*ns):
    """Run a test taking ``comm``/``P_world`` at each of these world sizes (exactly that many ranks)."""
    return pytest.mark.parametrize("comm", [pytest.param(n, marks=pytest.mark.mpi(min_size=n), id=f"{n}ranks")
                                            for n in ns], indirect=True)


def partition_shapes(n):
    """Cartesian shapes of 1-3 dimensions with n workers."""
    return {1: [(1,), (1, 1), (1, 1, 1)], 2: [(2,), (1, 2), (2, 1, 1)], 3: [(3,), (3, 1), (1, 1, 3)],
            4: [(4,), (2, 2), (1, 2, 2), (4, 1)]}[n]


@pytest.fixture(params=["inline", "MPI collectives", "pairwise", "pairwise, in place"])
def gather_paths(request, monkeypatch):
    """Run an all_gather or reduce_scatter test on each data path: as shipped (these small blocks ride inside
    the header round); through MPI's collectives; through the pairwise exchanges from 8 B (received into a
    contiguous copy, and into place through MPI datatypes)."""
    if request.param == "inline":
        return request.param
    monkeypatch.setattr(messages, "INLINE_GROUP", 1)  # header rounds carry headers only
    monkeypatch.setattr(transport, "PAIRWISE_SUM_BYTES", None if request.param == "MPI collectives" else 8)
    if request.param == "pairwise, in place":
        monkeypatch.setattr(transport, "STRIDED_BYTES", 1)
    return request.param
