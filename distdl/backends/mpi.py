"""The transport: hand torch tensor memory to mpi4py without copies.

Every primitive moves data through these few helpers, so there is one data path for all of
them. ``buffer(t)`` wraps a contiguous tensor's memory as an mpi4py buffer specification
(``MPI.buffer.fromaddress``: about 0.2 us, against ~5 us for DLPack). Data movement sends raw
bytes, so every dtype moves exactly; sums use the MPI type of the dtype, and float16/bfloat16
are summed in float32 (never as integer bit patterns).
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from distdl.backends import cuda

__all__ = ["buffer", "reduction_dtype", "empty", "contiguous"]

_SUM_TYPES = {
    torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
    torch.complex64: MPI.C_FLOAT_COMPLEX, torch.complex128: MPI.C_DOUBLE_COMPLEX,
    torch.int8: MPI.INT8_T, torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
}
# Reduced-precision floats are summed in float32.
_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def buffer(t: torch.Tensor, summed: bool = False) -> list:
    """Return the mpi4py buffer specification of contiguous ``t``: raw bytes, or typed for a sum.

    The specification holds only the address: keep ``t`` referenced until MPI is done with it
    (never pass a temporary such as ``buffer(x.contiguous())`` to a non-blocking call).
    """
    if t.is_cuda:
        cuda.prepare(t)
    nbytes = t.nbytes
    memory = MPI.buffer.fromaddress(t.data_ptr(), nbytes)
    if summed:
        return [memory, t.numel(), _SUM_TYPES[t.dtype]]
    return [memory, nbytes, MPI.BYTE]


def reduction_dtype(where: str, dtype: torch.dtype) -> torch.dtype:
    """Return the dtype a sum of ``dtype`` is carried out in; TypeError if it cannot be summed."""
    dtype = _ACCUMULATE.get(dtype, dtype)
    if dtype not in _SUM_TYPES:
        raise TypeError(f"{where}: expected a dtype that can be summed, got {dtype}")
    return dtype


def contiguous(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return ``t`` as a contiguous tensor of ``dtype`` (no copy when it already is one)."""
    if dtype is not None and dtype != t.dtype:  # a no-op ``t.to(dtype)`` still costs ~1 us
        t = t.to(dtype)
    return t.contiguous()


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Return a new uninitialised contiguous tensor to receive into."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)
