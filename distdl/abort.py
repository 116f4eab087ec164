"""Abort on error: an uncaught exception on any rank ends the whole MPI job.

Without this, a rank that dies of an exception leaves its peers waiting forever in their next
collective. Importing distdl installs hooks for uncaught exceptions in the main thread
(``sys.excepthook``) and in other threads (``threading.excepthook``). Each hook first runs the
hook it replaced (which prints the traceback), flushes stdout and stderr, says on stderr that it
is aborting, and then, when the world has more than one rank, calls ``MPI.COMM_WORLD.Abort(1)``:
the MPI launcher ends every rank and the job exits non-zero. This works for ``mpiexec -n N python script.py`` as
well as for ``python -m mpi4py script.py``. A single-rank run, an interactive session, and a program that has
already finalised MPI are left alone. Only the rank's own process aborts: a child it forked after importing distdl
(a ``DataLoader`` worker, ``os.fork()``) inherits the hooks, but an exception there just prints its traceback (and
ends the child, without finalising the rank's MPI, where it is the main thread's).

Opt out with ``DISTDL_ABORT_ON_ERROR=0`` in the environment (read when distdl is imported) or
with :func:`uninstall`. Not covered: ``sys.exit(n)`` on one rank is not an exception (run under
``python -m mpi4py`` to abort on a non-zero exit status too), nor is a rank killed by a signal
(the launcher ends the job then).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from mpi4py import MPI

from distdl.utilities.settings import flag

__all__ = ["install", "uninstall", "installed"]

_previous: dict[str, Any] = {}
_PID = os.getpid()  # the rank's own process: a forked child (a DataLoader worker, os.fork) never aborts the job


def install() -> None:
    """Install the abort hooks (idempotent); the hooks they replace still print the traceback."""
    if sys.excepthook is not _sys_hook:
        _previous["sys"], sys.excepthook = sys.excepthook, _sys_hook
    if threading.excepthook is not _thread_hook:
        _previous["threading"], threading.excepthook = threading.excepthook, _thread_hook


def uninstall() -> None:
    """Restore the hooks that :func:`install` replaced (idempotent)."""
    if sys.excepthook is _sys_hook:
        sys.excepthook = _previous.pop("sys", sys.__excepthook__)
    if threading.excepthook is _thread_hook:
        threading.excepthook = _previous.pop("threading", threading.__excepthook__)


def installed() -> bool:
    """Return whether the abort hook for uncaught exceptions in the main thread is installed."""
    return sys.excepthook is _sys_hook


def install_from_environment() -> None:
    """Install the hooks unless ``DISTDL_ABORT_ON_ERROR`` turns them off (called on import); a value that cannot be
    read installs them before raising, so the error ends the job rather than leaving the other ranks waiting."""
    try:
        off = flag("DISTDL_ABORT_ON_ERROR") is False
    except ValueError:
        install()
        raise
    if not off:
        install()


def _sys_hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    try:
        _previous.get("sys", sys.__excepthook__)(exc_type, exc, tb)
    finally:
        _abort(f"an uncaught {exc_type.__name__}")
        if os.getpid() != _PID and MPI.Is_initialized() and not MPI.Is_finalized():
            os._exit(1)  # a forked child: finalising the rank's MPI at exit would hang it (or, under
            # python -m mpi4py, abort the job)


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    try:
        _previous.get("threading", threading.__excepthook__)(args)
    finally:
        if args.exc_type is not SystemExit:  # a thread that calls sys.exit() just ends, as in Python
            name = args.thread.name if args.thread is not None else "a thread"
            _abort(f"an uncaught {args.exc_type.__name__} in thread {name}")


_FORWARD_SECONDS = 1.0


def _abort(what: str) -> None:
    """Flush the output and abort the MPI job when other ranks would otherwise wait forever."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or replaced stream must not stop the abort
            pass
    if os.getpid() != _PID or hasattr(sys, "ps1") or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD
    if world.Get_size() <= 1:
        return
    try:
        sys.stderr.write(f"distdl: rank {world.Get_rank()} of {world.Get_size()} ended with {what}; "
                         "aborting the MPI job (set DISTDL_ABORT_ON_ERROR=0 to disable)\n")
        sys.stderr.flush()
    except Exception:
        pass
    time.sleep(_FORWARD_SECONDS)  # let the launcher forward the traceback before it tears the job down
    world.Abort(1)
