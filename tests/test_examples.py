"""Every example runs to completion with short settings and prints what its docstring says to look at.

Serial tests (not marked ``mpi``): each launches ``mpiexec -n N python examples/<name>.py`` with
``DISTDL_EXAMPLE_QUICK=1``, so they run in the serial pass (``pytest -m "not mpi" tests``). The
examples check themselves against serial references on every rank (an assertion on any rank ends
the job with a non-zero status); here we check the exit status and the key line of the output.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import MPIEXEC

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# name: (ranks, a line the example prints when everything it checked held)
CASES = {
    "partitions": (4, r"rank 3: MPIPartition\(shape=\(2, 2\), rank=3, index=\(1, 1\)\)"),
    "all_sum_reduce": (4, r"rank 3 index \(1, 1\): x =\s+1000\s+y =\s+1100"),
    "broadcast": (4, r"rank 2: in P_x False .* y = 10 "),
    "sum_reduce": (4, r"rank 3: .* y = \[1010.0\]"),
    "all_gather": (4, r"rank 1 index \(0, 1\): x \(3, 3\) -> y \(3, 7\)"),
    "reduce_scatter": (4, r"rank 1 index \(0, 1\): x \(2, 5\) -> y \(2, 2\), y\[1\] = \[88.0, 99.0\]"),
    "repartition": (4, r"worker 0 got the tensor back"),
    "halo_exchange": (3, r"y = \[30.0, 40.0, 50.0, 60.0, 70.0\]"),
    "window_exchange": (3, r"window \[-4, 8\) -> \[0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8\]"),
    "invariant": (2, r"all_sum_reduce_forward\s+x.grad = 1"),
    "linear": (4, r"state_dict on rank 0: \[\('weight', \(6, 10\)\), \('bias', \(6,\)\)\]"),
    "tensor_parallel_mlp": (4, r"equal the sequential block's, with and without overlap"),
    "data_parallel": (2, r"follows the sequential one exactly"),
    "conv": (4, r"equal torch.nn.Conv2d's in both layouts"),
    "pooling": (3, r"outputs and input gradients equal torch's"),
    "upsampling": (2, r"outputs and input gradients equal torch's"),
    "normalization": (4, r"equal torch's BatchNorm1d and LayerNorm"),
    "embedding": (2, r"the two blocks side by side"),
    "losses": (3, r"every worker holds the global loss"),
    "train_digits": (4, r"test accuracy: distributed \d+\.\d%, sequential \d+\.\d%"),
}

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                reason="launches mpiexec; runs in the serial pass, not under mpiexec")


def _environment():
    # A child job must start its own MPI, not join this process's: drop the launcher's variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DISTDL_EXAMPLE_QUICK="1")
    env.setdefault("MPIR_CVAR_POSIX_POLL_FREQUENCY", "10")
    return env


def test_every_example_is_covered():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name):
    ranks, expected = CASES[name]
    if name == "train_digits":
        pytest.importorskip("sklearn", reason="the digits demo needs scikit-learn (the examples extra)")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC} (install the mpich extra, or set MPIEXEC)")
    script = EXAMPLES / f"{name}.py"
    docstring = script.read_text().split('"""')[1]
    assert f"mpiexec -n {ranks} python examples/{name}.py" in docstring, "the docstring gives another rank count"
    command = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(script)]
    try:
        result = subprocess.run(command, cwd=ROOT, env=_environment(), capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{name}.py did not finish in 300 s: {error}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name}.py exited with {result.returncode}:\n{output[-4000:]}"
    assert re.search(expected, result.stdout), f"{name}.py did not print {expected!r}:\n{result.stdout[-4000:]}"
