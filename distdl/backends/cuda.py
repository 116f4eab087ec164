"""CUDA tensors over MPI: direct with a CUDA-aware MPI, staged through pinned host memory otherwise.

The mode is chosen once per process:

- ``DISTDL_CUDA_AWARE_MPI=1`` hands device memory straight to MPI (after synchronising the
  current stream, which MPI cannot see); ``DISTDL_CUDA_AWARE_MPI=0`` stages through the host.
- Unset, the first CUDA tensor triggers a probe: a child process sends a device buffer to
  itself through MPI. If that fails in any way (wrong data, error, crash, time-out) distdl
  stages; the probe can never crash the calling process.

Staging happens at the boundary of each primitive (:func:`host_staged`): the input is copied
with a non-blocking device-to-host copy into a reusable pinned buffer, the one CPU
implementation of the primitive runs, and the result is copied back to the device. Both copies
are autograd operations, so backward (and double backward) stage the same way. The window and
halo exchanges instead stage only the slabs they send and receive (:func:`host_copies`): the rest
of a block stays on the device. Several ranks may share one GPU; :func:`device_for_rank` maps each
rank on a node to a device.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import subprocess
import sys

import torch
import torch.autograd.forward_ad as forward_ad
from mpi4py import MPI

from distdl.utilities.settings import flag, shared
from distdl.utilities.torch import eager_when_compiled

__all__ = ["buffer_device", "cuda_aware", "device_for_rank", "host_copies", "host_staged", "needs_staging",
           "staging"]

_log = logging.getLogger("distdl")
_mode: bool | None = None  # True: CUDA-aware, False: staged, None: not decided yet
# compared by MPIPartition(comm): the tensor-parallel rings take another algorithm where a rank stages
shared("DISTDL_CUDA_AWARE_MPI", flag("DISTDL_CUDA_AWARE_MPI"))
_pools: dict[torch.device, torch.Tensor] = {}
# Set once this process stages a CUDA tensor: from then on the host buffers that the primitives allocate
# (their outputs above all, copied to the device next) come pinned, from torch's caching host allocator.
pin_host_buffers = False
# Test seam: stage CPU tensors too, through an unpinned pool, so CI without a GPU runs the staging path.
stage_cpu_for_tests = False

_PROBE = r"""
import torch
from mpi4py import MPI
x = torch.arange(1024, dtype=torch.float32, device="cuda")
y = torch.zeros_like(x)
torch.cuda.synchronize()
addr = lambda t: MPI.buffer.fromaddress(t.data_ptr(), t.numel() * 4)
MPI.COMM_SELF.Sendrecv([addr(x), MPI.BYTE], 0, 0, [addr(y), MPI.BYTE], 0, 0)
torch.cuda.synchronize()
print("ok" if torch.equal(x, y) else "mismatch")
"""


def cuda_aware() -> bool:
    """Return whether CUDA tensors go to MPI directly (decided once: environment, else probe)."""
    global _mode
    if _mode is None:
        setting = flag("DISTDL_CUDA_AWARE_MPI")
        if setting is not None:
            _mode = setting
        else:
            _mode = _probe()
            if not _mode:
                _log.info("distdl: MPI is not CUDA-aware; staging CUDA tensors through pinned host memory "
                          "(set DISTDL_CUDA_AWARE_MPI=1 to force direct transfers, =0 to skip the probe)")
    return _mode


def _probe() -> bool:
    # The child must start its own MPI, not join this job: drop the launcher's variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip().endswith("ok")


def prepare(t: torch.Tensor) -> None:
    """Make a CUDA tensor's memory safe to hand to MPI: the producing stream must be finished."""
    if not cuda_aware():
        raise RuntimeError("distdl: a CUDA tensor reached MPI, which is not CUDA-aware here; stage it with "
                           "distdl.backends.cuda.host_staged or set DISTDL_CUDA_AWARE_MPI=1")
    torch.cuda.current_stream(t.device).synchronize()


def buffer_device(device: torch.device) -> torch.device:
    """Return where MPI buffers for tensors on ``device`` live: the device, or the host when staging."""
    return torch.device("cpu") if device.type == "cuda" and not cuda_aware() else device


def needs_staging(x: torch.Tensor) -> bool:
    """Whether MPI cannot take ``x``'s memory directly: a CUDA tensor without CUDA-aware MPI (or, for the
    tests, a CPU tensor under ``stage_cpu_for_tests``)."""
    if x.is_cuda:
        return not cuda_aware()
    return stage_cpu_for_tests and x.device.type == "cpu"


def staging(x: torch.Tensor) -> bool:
    """:func:`needs_staging` for a primitive about to stage ``x``: from the first CUDA tensor staged, the host
    buffers the primitives allocate (``transport.empty``) come pinned."""
    global pin_host_buffers
    if not needs_staging(x):
        return False
    pin_host_buffers = pin_host_buffers or x.is_cuda
    return True


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Return contiguous host copies of ``tensors`` (of one device; pinned where it is a GPU), the copies done:
    the slabs a primitive that stages its own messages sends."""
    copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=True)
              for t in tensors]
    if tensors and tensors[0].is_cuda:
        torch.cuda.current_stream(tensors[0].device).synchronize()
    return copies


def _pool(device: torch.device, nbytes: int) -> torch.Tensor:
    """Return a reusable host buffer of at least ``nbytes`` for ``device`` (pinned for CUDA)."""
    pool = _pools.get(device)
    if pool is None or pool.numel() < nbytes:
        size = max(nbytes, 2 * (0 if pool is None else pool.numel()), 1 << 16)
        with torch.inference_mode(False):  # made under inference mode, it could not be written outside it
            pool = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        _pools[device] = pool
    return pool


def _to_host(x: torch.Tensor, reuse: bool) -> torch.Tensor:
    """Copy ``x`` to the host (stream-ordered, then waited for): into the reusable buffer where the copy is
    done with before the next one (``reuse``), else into memory of its own. A sparse ``x`` (a cotangent: the
    gradient of ``F.embedding(..., sparse=True)``) arrives dense."""
    if x.layout != torch.strided:
        x = x.to_dense()
    nbytes = x.numel() * x.element_size()
    if reuse:
        host = _pool(x.device, nbytes)[:nbytes].view(x.dtype).view(x.shape)
    else:
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_cuda)
    host.copy_(x, non_blocking=True)
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()
    return host


class _ToHost(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, reuse):
        ctx.device = x.device
        return _to_host(x, reuse)

    @staticmethod
    def backward(ctx, grad):
        return _ToDevice.apply(grad, ctx.device), None


class _ToDevice(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, device):
        # Stream-ordered: a pageable y is read before the call returns; a pinned one is kept from reuse by
        # torch's host allocator until the copy is done.
        return y.to(device, copy=True, non_blocking=device.type == "cuda")

    @staticmethod
    def backward(ctx, grad):
        # Not the reusable buffer: autograd may stage the next gradient (on the device's thread) before the
        # adjoint that reads this one has run (on the CPU's).
        return _ToHost.apply(grad, False), None


def refuse_unsupported(where: str) -> None:
    """Raise NotImplementedError inside forward-mode AD's dual levels (a dual tensor's tangent would be dropped: a
    zero derivative, silently), inside torch.jit.trace, and inside torch.func's transforms; for every primitive's
    entry. Within a dual level also where this worker's tensor has no tangent: a worker passing a placeholder (or an
    empty block) cannot tell whether its peers' have one, and would go on into the transfer alone."""
    if torch._C._functorch.maybe_current_level() is not None:  # its tensors are wrappers without memory
        raise NotImplementedError(f"{where}: torch.func transforms (vmap, grad, vjp, jacrev...) are "
                                  "not supported; use torch.autograd (backward, torch.autograd.grad)")
    if forward_ad._current_level >= 0:
        raise NotImplementedError(f"{where}: forward-mode AD (torch.autograd.forward_ad) is not supported (refused "
                                  "within dual_level() on every worker, dual tensor or not); "
                                  "torch.autograd.functional.jvp works (through reverse mode)")
    if torch._C._is_tracing():  # the tracer cannot see what MPI writes: a trace would replay this call's result
        raise NotImplementedError(f"{where}: torch.jit.trace is not supported (it cannot record MPI's "
                                  "transfers); use the module itself, or torch.compile")


def host_staged(function=None, *, whole: bool = True):
    """Decorate a primitive ``function(x, ...)`` to run on a host copy of ``x`` when MPI cannot take it.

    Every primitive's entry: it also refuses forward-mode AD's dual tensors, whose tangent the primitive would
    drop (a zero derivative, silently), torch.func's transforms and torch.jit.trace, and runs eagerly under
    torch.compile. With ``whole=False`` it does only that: the primitive stages the slabs it moves itself
    (:func:`staging`, :func:`host_copies`), and the rest of ``x`` stays where it is.
    """
    if function is None:
        return functools.partial(host_staged, whole=whole)
    name = next(iter(inspect.signature(function).parameters))  # the tensor's, also when passed by keyword

    @eager_when_compiled
    @functools.wraps(function)
    def staged(*args, **kwargs):
        x = args[0] if args else kwargs.get(name)
        refuse_unsupported(function.__name__)
        if not whole or not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_quantized or \
                not staging(x):
            return function(*args, **kwargs)  # or refused there, with its own checks (the copy would fail first)
        # The primitive never returns an alias of its input, so the pool is free again on return.
        host = _ToHost.apply(x, True)
        args, kwargs = ((host, *args[1:]), kwargs) if args else (args, {**kwargs, name: host})
        return _ToDevice.apply(function(*args, **kwargs), x.device)
    return staged


def device_for_rank(comm: MPI.Comm = MPI.COMM_WORLD) -> torch.device:
    """Return the CUDA device of this rank: its rank on the node modulo the visible devices (CPU if none).

    Collective over ``comm`` where a GPU is present: every rank of ``comm`` calls it.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = node.rank
    node.Free()
    return torch.device("cuda", local_rank % torch.cuda.device_count())
