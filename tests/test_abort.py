"""Abort on error, logging and import hygiene: serial tests that launch their own processes.

Not marked ``mpi``: they start ``mpiexec`` or ``python`` subprocesses, which an MPI rank must not
do, so they run in the serial pass (``pytest -m "not mpi" tests``).
"""

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from mpi4py import MPI

import distdl
from distdl import abort
from helpers import MPIEXEC

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "raise_on_one_rank.py"

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                reason="launches subprocesses; runs in the serial pass, not under mpiexec")


def _environment(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_"))}
    env.pop("DISTDL_ABORT_ON_ERROR", None)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def _python(code, cwd, **extra):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_environment(**extra), capture_output=True,
                          text=True, timeout=120)


IMPORT_ALL = ("import pkgutil, importlib, distdl\n"
              "for module in pkgutil.walk_packages(distdl.__path__, 'distdl.'):\n"
              "    importlib.import_module(module.name)\n"
              "raise SystemExit(0 if distdl.abort.installed() else 3)\n")  # the abort hook is on by default


def test_import_writes_nothing(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    result = _python(IMPORT_ALL, cwd, HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    assert list(cwd.iterdir()) == [] and list(home.iterdir()) == []


def test_logger_has_only_a_null_handler():
    logger = logging.getLogger("distdl")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert all(isinstance(h, logging.NullHandler) for h in logger.handlers)


def test_install_and_uninstall(monkeypatch):
    was_installed = abort.installed()  # on import, unless DISTDL_ABORT_ON_ERROR=0
    abort.install()
    assert sys.excepthook is abort._sys_hook and threading.excepthook is abort._thread_hook
    previous = abort._previous["sys"], abort._previous["threading"]
    try:
        abort.uninstall()
        assert not abort.installed()
        assert (sys.excepthook, threading.excepthook) == previous
        abort.uninstall()  # idempotent
        assert (sys.excepthook, threading.excepthook) == previous
        abort.install()
        abort.install()  # idempotent: never chains to itself
        assert (abort._previous["sys"], abort._previous["threading"]) == previous and abort.installed()
        for value, expected in [("0", False), ("off", False), ("1", True), (None, True)]:
            abort.uninstall()
            if value is None:
                monkeypatch.delenv("DISTDL_ABORT_ON_ERROR", raising=False)
            else:
                monkeypatch.setenv("DISTDL_ABORT_ON_ERROR", value)
            abort.install_from_environment()
            assert abort.installed() is expected, value
    finally:
        (abort.install if was_installed else abort.uninstall)()


def test_opt_out_on_import(tmp_path):
    code = ("import sys, threading, distdl\n"
            "print(distdl.abort.installed(), sys.excepthook is sys.__excepthook__, "
            "threading.excepthook is threading.__excepthook__)")
    result = _python(code, tmp_path, DISTDL_ABORT_ON_ERROR="0")
    assert result.stdout.strip() == "False True True", result.stderr


@pytest.mark.parametrize("name", ["DISTDL_CHECK", "DISTDL_ABORT_ON_ERROR", "DISTDL_CUDA_AWARE_MPI"])
def test_on_off_settings_are_understood_or_refused(tmp_path, name):
    """An on/off setting takes 1/0, true/false, yes/no or on/off; anything else raises naming the variable (a typo
    turned check mode on, or left the abort hook on, without a word)."""
    code = "import distdl\nfrom distdl.backends import cuda\nprint(distdl.check_mode(), distdl.abort.installed(), " \
           "cuda.cuda_aware())"
    for off in ("0", "Off"):  # check mode off, the hook installed unless turned off, CUDA-aware off or probed
        result = _python(code, tmp_path, **{name: off})
        check, hook, aware = result.stdout.split()
        assert (check, hook) == ("False", str(name != "DISTDL_ABORT_ON_ERROR")), result.stderr
        assert aware == "False" or name != "DISTDL_CUDA_AWARE_MPI"
    result = _python(code, tmp_path, **{name: "garbage"})
    assert result.returncode != 0 and f"ValueError: {name}: expected 1 or 0" in result.stderr, result.stderr


def test_mpi_outside_its_lifetime_is_named(tmp_path):
    """distdl imports without initialising MPI (a program may call MPI.Init_thread itself), and a partition made
    before MPI.Init_thread or after MPI.Finalize raises RuntimeError instead of MPICH ending the process."""
    code = ("import mpi4py\nmpi4py.rc.initialize = False\nimport torch, distdl\nfrom mpi4py import MPI\n"
            "from distdl.functional import all_sum_reduce\n"
            "def attempt():\n    try:\n        distdl.MPIPartition()\n    except RuntimeError as error:\n"
            "        print(error)\n"
            "attempt()\nMPI.Init_thread(MPI.THREAD_SERIALIZED)\n"
            "print(all_sum_reduce(torch.ones(2), distdl.MPIPartition(), axes_reduce=(0,)).tolist())\n"
            "MPI.Finalize()\nattempt()")
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("MPIPartition: MPI is not initialised") and lines[1] == "[1.0, 1.0]"
    assert lines[2].startswith("MPIPartition: MPI is finalized")


def test_a_setting_read_differently_is_named(tmp_path):
    """One rank of two reads DISTDL_PAIRWISE_SUM_BYTES=0 (no pairwise sums), the other the default: the two used to
    wait for ever in a 1 MiB all_sum_reduce, each for the other's messages; now both name the setting when the
    partition is made, and the job ends. A value refused on one rank, launched without -m mpi4py, ends the job too:
    the abort hook is installed before distdl reads its settings (rank 1 used to wait in its first partition), and
    where its own setting is the one refused, before that raises."""
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable} (install the mpich extra: make install)")
    code = ("import torch, distdl\nfrom distdl.functional import all_sum_reduce\n"
            "all_sum_reduce(torch.ones(1 << 18), distdl.MPIPartition(), axes_reduce=(0,))\nprint('summed')")
    for name, value, module, expected in [
            ("DISTDL_PAIRWISE_SUM_BYTES", "0", ["-m", "mpi4py"],
             ["DISTDL_PAIRWISE_SUM_BYTES: rank 0 read 0; rank 1 read 131072",
              "ValueError: MPIPartition: the ranks of the communicator read different settings"]),
            # a rank staging CUDA tensors takes another algorithm in the tensor-parallel rings (MPI aborted)
            ("DISTDL_CUDA_AWARE_MPI", "1", ["-m", "mpi4py"],
             ["DISTDL_CUDA_AWARE_MPI: rank 0 read True; rank 1 read None"]),
            ("DISTDL_STRIDED_BYTES", "1e6", [],
             ["ValueError: DISTDL_STRIDED_BYTES: expected a number of bytes (0 for never), got '1e6'"]),
            ("DISTDL_ABORT_ON_ERROR", "maybe", [],  # the hook's own setting: installed before it raises
             ["ValueError: DISTDL_ABORT_ON_ERROR: expected 1 or 0 (or true/false, yes/no, on/off), got 'maybe'"])]:
        python = [sys.executable, *module, "-c", code]
        command = [str(MPIEXEC), "-n", "1", "-env", name, value, *python, ":", "-n", "1", *python]
        try:
            result = subprocess.run(command, cwd=tmp_path, env=_environment(), capture_output=True, text=True,
                                    timeout=90)
        except subprocess.TimeoutExpired as error:
            pytest.fail(f"the job hung: {error}")
        assert result.returncode != 0 and "summed" not in result.stdout, result.stdout + result.stderr
        assert all(line in result.stderr for line in expected), result.stderr


def test_hook_prints_the_traceback_and_spares_a_single_rank(capsys):
    try:
        raise ValueError("boom")
    except ValueError as error:
        abort._sys_hook(ValueError, error, error.__traceback__)  # world size 1: prints, does not abort
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: boom" in err


def _launch(*args, module=False, script=SCRIPT, **environment):
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable} (install the mpich extra: make install)")
    command = [str(MPIEXEC), "-n", "2", sys.executable, *(["-m", "mpi4py"] if module else []), str(script), *args]
    try:
        return subprocess.run(command, cwd=ROOT, env=_environment(**environment), capture_output=True, text=True,
                              timeout=90)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the job hung instead of aborting: {error}")


@pytest.mark.parametrize("args, module", [([], False), (["--thread"], False), ([], True)],
                         ids=["python-script", "python-script-thread", "python-m-mpi4py"])
def test_uncaught_exception_ends_the_job(args, module):
    result = _launch(*args, module=module)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback (most recent call last)" in output and "RuntimeError: rank 1 failed on purpose" in output
    assert "rank 0 finished" not in output


def test_job_without_error_exits_cleanly():
    result = _launch("--no-raise")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 finished" in result.stdout and "rank 1 finished" in result.stdout
    assert "aborting" not in result.stderr


@pytest.mark.parametrize("args, module", [(["--child-thread"], False), (["--child"], False), (["--child"], True)],
                         ids=["thread", "main-thread", "main-thread-python-m-mpi4py"])
def test_a_forked_child_never_aborts_the_job(args, module):
    """An uncaught exception in a forked child (a DataLoader worker's helper thread, or the child's main thread)
    prints its traceback there and leaves the job alone: the hook inherited through fork used to abort every rank,
    and a child's main thread then hung its rank finalising MPI at exit."""
    result = _launch(*args, module=module)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "RuntimeError: rank 1 failed on purpose" in output and "aborting" not in output
    assert "rank 0 finished" in result.stdout and "rank 1 finished" in result.stdout


def test_an_operator_raising_in_the_test_kit_before_its_collective_ends_the_job():
    """The test kit catches an operator's error to raise it on every worker; where the others wait in the operator's
    own collective, the worker that raised waits for them a while, then raises alone and the abort hook ends the job
    (it waited for ever)."""
    result = _launch(script=ROOT / "tests" / "scripts" / "kit_raise_before_collective.py")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "RuntimeError: a failure on purpose, before the collective" in output, output
    assert "finished" not in output


@pytest.mark.parametrize("how", ["skipped", "raised"])
def test_a_skipped_backward_ends_the_job_in_check_mode(how):
    """Rank 1 skips a DataParallel backward, or catches an error raised part-way through it: rank 0 waits in its
    reduction for ever. In check mode, where rank 1 skipped it, its next forward meets rank 0's check of that
    backward (it gave up waiting for rank 0 to check it, rank 0 waiting in the sums); where the backward raised
    after rank 1 had started that check, rank 1's next forward gives up waiting for rank 0 (it completed the sums in
    flight first, unchecked: a hang). Either way, the abort hook ends the job."""
    result = _launch(*([how] if how == "raised" else []), script=ROOT / "tests" / "scripts" / "skip_a_backward.py",
                     DISTDL_CHECK="1", DISTDL_CHECK_TIMEOUT="3")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    if how == "skipped":
        assert ("CollectiveMismatchError: DataParallel: ranks disagree on primitive: rank 0 has DataParallel "
                "(backward); rank 1 has DataParallel") in output, output
    else:
        assert "CollectiveTimeoutError: DataParallel: waited " in output, output
    assert "finished" not in output
