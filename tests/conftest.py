"""The MPI test harness.

Launch: ``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests`` (``make test`` does it
at 1-4 ranks). Tests marked ``@pytest.mark.mpi(min_size=N)`` take the ``comm`` or ``P_world``
fixture: COMM_WORLD split so exactly the first N ranks run the test while the others sit it
out. Every test is guarded by a watchdog: a rank that hangs past ``DISTDL_TEST_TIMEOUT``
seconds (default 300) dumps its traceback and exits, and ``mpiexec`` then ends the job.
"""

import faulthandler
import os

import pytest
import torch
from mpi4py import MPI

from distdl import MPIPartition

torch.set_num_threads(1)

_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def pytest_report_header(config):
    vendor, version = MPI.get_vendor()
    return (f"MPI: {vendor} {'.'.join(map(str, version))}, thread level "
            f"{_THREAD_LEVELS.get(MPI.Query_thread(), '?')}, world size {MPI.COMM_WORLD.size}, "
            f"rank {MPI.COMM_WORLD.rank}")


def pytest_sessionstart(session):
    # pytest-mpi prints a long MPI section from every rank; rank 0's is enough.
    if MPI.COMM_WORLD.rank > 0:
        for plugin in session.config.pluginmanager.get_plugins():
            if type(plugin).__name__ == "MPIPlugin":
                plugin._is_testing_mpi = False


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(float(os.environ.get("DISTDL_TEST_TIMEOUT", 300)), exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def comm(request):
    """COMM_WORLD split to exactly the size the test's mpi marker asks for; other ranks sit it out.

    Parametrise over sizes with ``helpers.sizes(1, 2, 3, 4)`` (an indirect parameter).
    """
    marker = request.node.get_closest_marker("mpi")
    size = getattr(request, "param", None) or (marker.kwargs.get("min_size", 1) if marker is not None else 1)
    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.rank < size else MPI.UNDEFINED, world.rank)
    if sub == MPI.COMM_NULL:
        pytest.skip(f"runs on {size} ranks; rank {world.rank} sits it out")
    yield sub
    sub.Free()


@pytest.fixture
def P_world(comm):
    """The root partition over the test's ranks."""
    return MPIPartition(comm)
