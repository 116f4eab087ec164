"""The message format of the header rounds: a fixed-size int64 header, then a small payload inline.

Receive-only workers learn each call's dtype and shape from a header (:func:`~distdl.functional.
_common.encode_header`). At 8 B a primitive's cost is Python overhead plus the number of
collectives, so a payload of up to ``INLINE_BYTES`` travels inside its header message: small
tensors take one collective instead of a header round and a data round. Whether a payload is
inline follows from the header alone, so senders and receivers always decide alike. In groups of
more than ``INLINE_GROUP`` workers the allgathered header rounds carry headers only (an allgather
grows with the group). Measured in ``benchmarks/bench_primitives.py``; NumPy does the byte
shuffling because each torch call costs ~1 us here and a NumPy one ~0.3 us.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import mpi as transport
from distdl.functional._common import _DTYPES, HEADER_LENGTH, header_of
from distdl.utilities.caches import keep

INLINE_BYTES = 1024
HEADER_BYTES = HEADER_LENGTH * 8
MESSAGE_LENGTH = HEADER_LENGTH + INLINE_BYTES // 8  # int64 words: header, then the inline payload
INLINE_GROUP = 8  # payloads ride in allgathered header rounds only in groups of at most this many workers
_templates: dict = {}


def inline(dtype: torch.dtype, shape) -> bool:
    """Whether a tensor of ``dtype`` and ``shape`` travels inside its header message (decided alike by all)."""
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize <= INLINE_BYTES


def encode_message(where: str, x: torch.Tensor):
    """Return an int64 message: ``x``'s header, followed by ``x``'s bytes when :func:`inline` says so."""
    key = (x.dtype, x.shape)  # a torch.Size hashes and compares as the tuple
    found = _templates.get(key)
    if found is None:
        template = np.full(MESSAGE_LENGTH, -1, dtype=np.int64)
        template[:HEADER_LENGTH] = header_of(where, x)
        found = template, x.nbytes if inline(x.dtype, x.shape) else 0  # the bytes riding inline
        if len(_templates) < 4096:
            _templates[key] = found
    template, nbytes = found
    message = template.copy()
    if nbytes:
        x = transport.contiguous(x)
        if x.is_cpu:  # numpy views of both memories: ~1 us, against ~6 us through torch
            data = np.frombuffer(MPI.buffer.fromaddress(x.data_ptr(), nbytes), dtype=np.uint8)
            message.view(np.uint8)[HEADER_BYTES:HEADER_BYTES + nbytes] = data
        else:
            data = x.detach().view(-1).view(torch.uint8)
            torch.from_numpy(message).view(torch.uint8)[HEADER_BYTES:HEADER_BYTES + data.numel()].copy_(data)
    return message


_EMPTY = np.full(MESSAGE_LENGTH, -1, dtype=np.int64)


def empty_message():
    """Return the message of a worker that sends nothing (its header is all -1)."""
    return _EMPTY.copy()  # ~0.5 us, against ~2 us for np.full


def decode(message) -> tuple[torch.dtype, tuple[int, ...]]:
    """Return the dtype and shape in a message's header (as :func:`decode_header`, faster)."""
    values = message[:HEADER_LENGTH].tolist()
    return _DTYPES[values[0]], tuple(values[2:2 + values[1]])


def payloads(messages, dtype: torch.dtype, shape) -> torch.Tensor:
    """Return a view of the payloads of allgathered ``messages`` (one row each) as ``(rows, *shape)``."""
    count = 1
    for n in shape:
        count *= n
    data = torch.from_numpy(messages).view(torch.uint8)[:, HEADER_BYTES:HEADER_BYTES + count * dtype.itemsize]
    return data.view(dtype).view((len(messages), *shape))


def sum_payloads(messages, rows: list[int] | None, dtype: torch.dtype, shape, accumulate: torch.dtype,
                 index: tuple = ()) -> torch.Tensor:
    """Return the sum over ``rows`` (None: all) of the payloads of ``messages`` (or of their ``index`` blocks), in
    ``accumulate``.

    NumPy does it where it knows the dtype (each torch call costs ~1 us here, a NumPy one ~0.3 us), on a view
    of the messages as that dtype: every itemsize divides the header's and the row's bytes.
    """
    if rows is None:  # a slice views the rows where a list would copy them
        rows = slice(None)
    kind, total_kind = _NUMPY_DTYPES.get(dtype), _NUMPY_DTYPES.get(accumulate)
    if kind is None or total_kind is None:  # bfloat16
        blocks = payloads(messages, dtype, shape)[(rows, *index)]
        return blocks.sum(0, dtype=accumulate)
    count = 1
    for n in shape:
        count *= n
    start = HEADER_BYTES // dtype.itemsize
    blocks = messages.view(kind)[rows, start:start + count]
    if index:
        blocks = blocks.reshape((len(blocks), *shape))[(slice(None), *index)]
        return torch.from_numpy(blocks.sum(0, dtype=total_kind))
    return torch.from_numpy(blocks.sum(0, dtype=total_kind).reshape(shape))  # a new array: C-contiguous


_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
                 torch.complex64: np.complex64, torch.complex128: np.complex128, torch.int8: np.int8,
                 torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8}


def copy_payloads(messages, y: torch.Tensor, counts: list[int]) -> bool:
    """Copy the payloads of ``messages``, one after another, into contiguous CPU ``y``; False if ``y`` is not such.

    ``counts``: the elements of ``y``'s dtype each row carries.
    """
    if not y.is_cpu or not y.is_contiguous():
        return False
    if y.numel():
        out = np.frombuffer(MPI.buffer.fromaddress(y.data_ptr(), y.nbytes), dtype=np.uint8)
        data = messages.view(np.uint8)[:, HEADER_BYTES:]
        sizes = [n * y.itemsize for n in counts]
        if sizes.count(sizes[0]) == len(sizes):  # one NumPy copy instead of one per row
            out.reshape(len(sizes), sizes[0])[:] = data[:, :sizes[0]]
            return True
        offset = 0
        for row, n in zip(data, sizes):
            out[offset:offset + n] = row[:n]
            offset += n
    return True


def inline_payload(message, dtype: torch.dtype, shape, device: torch.device | str = "cpu") -> torch.Tensor:
    """Return a new tensor of ``dtype`` and ``shape`` on ``device`` holding the payload carried in ``message``."""
    y = torch.empty(tuple(shape), dtype=dtype)
    if y.numel():
        data = message.view(np.uint8)[HEADER_BYTES:HEADER_BYTES + y.nbytes]
        np.frombuffer(MPI.buffer.fromaddress(y.data_ptr(), y.nbytes), dtype=np.uint8)[:] = data
    return y if getattr(device, "type", device) == "cpu" else y.to(device)


def message_length(group_size: int) -> int:
    """Return the int64 words each member contributes to an allgathered header round in a group of this size."""
    return MESSAGE_LENGTH if group_size <= INLINE_GROUP else HEADER_LENGTH


def remembered(P, key, messages, derive):
    """Return ``derive(messages)``, remembered in ``P``'s cache under ``key`` by the messages' headers.

    Decoding and checking the headers costs a few us a call, and they repeat call after call; a
    ``derive`` that raises (alike on every member) is not remembered.
    """
    known = P._memo(key, dict)
    headers = messages[:, :HEADER_LENGTH].tobytes()
    found = known.get(headers)
    if found is None:
        found = keep(known, headers, derive(messages), 512)
    return found


def carries_payload(messages, dtype: torch.dtype, shape) -> bool:
    """Whether the allgathered ``messages`` (one row per member) carry the data of ``dtype`` and ``shape``."""
    return messages.shape[-1] == MESSAGE_LENGTH and inline(dtype, shape)
