"""Rank 1 raises (in the main thread, or with --thread in another thread) while rank 0 waits for it.

Launched by tests/test_abort.py as ``mpiexec -n 2 python tests/scripts/raise_on_one_rank.py``:
with distdl's abort hook the job ends at once with the traceback shown and a non-zero exit;
without it rank 0 would wait in its receive forever. ``--no-raise``: every rank finishes.
``--child-thread`` / ``--child``: a thread / the main thread of a child that rank 1 forks raises; the job goes on
and every rank finishes.
"""

import os
import sys
import threading
import time

from mpi4py import MPI

import distdl  # noqa: F401  (installs the abort hook)

comm = MPI.COMM_WORLD


def fail():
    raise RuntimeError(f"rank {comm.rank} failed on purpose")


if "--child-thread" in sys.argv or "--child" in sys.argv:  # a forked child of rank 1 (as a DataLoader worker)
    if comm.rank == 1:
        pid = os.fork()
        if pid == 0:
            if "--child" in sys.argv:
                fail()
            thread = threading.Thread(target=fail, name="child-worker")
            thread.start()
            thread.join()
            os._exit(0)  # as multiprocessing's children leave: the rank's MPI is not the child's to finalise
        os.waitpid(pid, 0)
    comm.barrier()
elif comm.rank == 1 and "--no-raise" not in sys.argv:
    if "--thread" in sys.argv:
        thread = threading.Thread(target=fail, name="worker")
        thread.start()
        thread.join()
        time.sleep(60)  # the abort from the worker thread ends the job long before this
    else:
        fail()
if comm.rank == 1:
    comm.send("done", dest=0)
if comm.rank == 0:
    comm.recv(source=1)  # waits forever unless rank 1 sends, or the job is aborted
print(f"rank {comm.rank} finished", flush=True)
