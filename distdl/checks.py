"""Check mode: before each collective, every worker verifies it is making the same call as its peers.

MPI turns ranks that disagree about a collective (one rank sums a ``(3, 4)`` tensor while another
sums a ``(3, 5)`` one, or calls a different primitive, or skipped a call) into a hang or a silent
wrong answer. With check mode on, each primitive calls :func:`verify` first: the members of its
communicator exchange one fixed-size int64 record (one small ``Allgather``) holding

- a hash of the primitive's name,
- the call's sequence number on that communicator (counted per communicator, in an MPI attribute),
- a hash of the facts that must agree (by default the tensor's shape, dtype and device type),

and if any record differs, every member raises :class:`CollectiveMismatchError` naming the
disagreeing ranks (ranks of ``MPI.COMM_WORLD``) and what differs, e.g.
``all_sum_reduce: ranks disagree on shape: ranks 0, 1 have (3, 4); rank 2 has (3, 5)``.

A rank that skipped a call and went on to a collective on another communicator never joins its
peers' check: a member that waits for its peers' records longer than ``DISTDL_CHECK_TIMEOUT``
seconds (default 120; 0 waits forever) raises :class:`CollectiveTimeoutError` naming its call,
and distdl's abort hook (:mod:`distdl.abort`) then ends the job.

Turn it on with ``DISTDL_CHECK=1`` in the environment, or ``distdl.set_check_mode(True)``, or for
a block with ``with distdl.checking():``. Set it the same way on every rank: a rank that skips
the check while its peers make it pairs their check with its collective. Off (the default),
:func:`verify` costs one global flag test. The device *type* is compared, not its index: ranks
on ``cuda:0`` and ``cuda:1`` agree.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import numbers
import os
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from distdl.partition import MPIPartition
from distdl.utilities.settings import flag, shared

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "announce", "verify", "verify_later", "set_check_mode",
           "check_mode", "checking"]


def _from_environment() -> bool:
    """Return whether ``DISTDL_CHECK`` turns check mode on (read when distdl is imported)."""
    return bool(flag("DISTDL_CHECK"))


_enabled = shared("DISTDL_CHECK", _from_environment())  # a worker checking alone would wait for its peers' records
_MAGIC = int.from_bytes(b"distdl", "big")  # a record from anything but verify() shows up as a mismatch
_RECORD = 4  # magic, sequence number, name hash, facts hash
_TENSOR_FACTS = ("shape", "dtype", "device")
_keyval: int | None = None
_hashes: dict[str, int] = {}
_abandoned: list = []  # requests given up on (see _wait)


class CollectiveMismatchError(RuntimeError):
    """Workers of one communicator disagree about the collective they are making.

    ``where`` is this worker's primitive; ``differences`` maps each fact that differs to
    ``{value: [ranks]}`` (ranks of ``MPI.COMM_WORLD``).
    """

    def __init__(self, where: str, differences: dict[str, dict[Any, list[int]]]) -> None:
        self.where = where
        self.differences = differences
        clauses = [f"{fact}: " + "; ".join(f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {value}"
                                            for value, ranks in groups.items())
                   for fact, groups in differences.items()]
        super().__init__(f"{where}: ranks disagree on " + "; and on ".join(clauses))


class CollectiveTimeoutError(RuntimeError):
    """In check mode, a worker waited longer than ``DISTDL_CHECK_TIMEOUT`` seconds for its peers to check a call:
    one of them skipped it (or waits in another collective)."""


def _timeout() -> float:
    """Return ``DISTDL_CHECK_TIMEOUT`` in seconds (0: no limit), read at each check so a test can set it."""
    text = os.environ.get("DISTDL_CHECK_TIMEOUT", "").strip()
    try:
        value = float(text) if text else 120.0
    except ValueError:
        raise ValueError(f"verify: expected a number of seconds for DISTDL_CHECK_TIMEOUT, got {text!r}") from None
    if not value >= 0:
        raise ValueError(f"verify: expected a number of seconds >= 0 for DISTDL_CHECK_TIMEOUT, got {text!r}")
    return value


def set_check_mode(enabled: bool) -> None:
    """Turn check mode on or off on this worker (do the same on every worker)."""
    global _enabled
    _enabled = shared("DISTDL_CHECK", bool(enabled))  # what the next MPIPartition(comm) compares


def check_mode() -> bool:
    """Return whether check mode is on."""
    return _enabled


@contextlib.contextmanager
def checking(enabled: bool = True) -> Iterator[None]:
    """Turn check mode on (or off) for a block, restoring the previous setting after it."""
    previous = _enabled
    set_check_mode(enabled)
    try:
        yield
    finally:
        set_check_mode(previous)


_FAILED = "failed with"  # the fact of a call whose local checks raised (see announce)


def verify(where: str, P: MPIPartition | MPI.Intracomm, x: torch.Tensor | None = None,
           agree: Mapping[str, Any] | Iterable[str] | None = None) -> None:
    """In check mode, verify that every member of ``P`` makes this same call; else do nothing.

    Collective over the members of ``P`` when check mode is on; a worker outside ``P`` returns.

    Args:
        where: the primitive's name, e.g. ``"all_sum_reduce"``.
        P: the partition (or intra-communicator) the collective runs on.
        x: this worker's tensor, whose facts are named in ``agree``.
        agree: what must agree besides the name and call number: names of facts of ``x``
            (``"shape"``, ``"dtype"``, ``"device"``, ``"dim"``), or a mapping of fact name to value.
            Default: shape, dtype and device of ``x`` (nothing without ``x``).
    Raises:
        CollectiveMismatchError: on every member, when any member's record differs.
        TypeError, ValueError: bad arguments (check mode only).
    """
    complete = verify_later(where, P, x, agree)
    if complete is not None:
        complete()


def verify_later(where: str, P: MPIPartition | MPI.Intracomm, x: torch.Tensor | None = None,
                 agree: Mapping[str, Any] | Iterable[str] | None = None,
                 force: bool = False) -> Callable[[], None] | None:
    """:func:`verify`, its exchange started now and completed by the function returned (which waits, and raises
    as :func:`verify` does); None where there is nothing to complete. For a check that workers start in an order
    of their own, such as autograd's order of a backward's hooks, with checks on other communicators between.
    ``force``: check with check mode off too (to match a check that peers started with it on)."""
    if not (_enabled or force):
        return None
    if not isinstance(where, str):
        raise TypeError(f"verify: expected a str for where, got {type(where).__name__}")
    comm = _communicator(P)
    if comm == MPI.COMM_NULL:
        return None
    facts = _facts(x, agree)
    record = np.array([_MAGIC, _next_sequence(comm), _hash(where), _hash(repr(sorted(facts.items())))],
                      dtype=np.int64)
    if comm.Get_size() == 1:
        return None
    records = np.empty((comm.Get_size(), _RECORD), dtype=np.int64)
    request = comm.Iallgather([record, MPI.INT64_T], [records, MPI.INT64_T])
    return functools.partial(_complete, where, comm, facts, record, records, request)


def _complete(where: str, comm: MPI.Intracomm, facts: dict[str, str], record: np.ndarray, records: np.ndarray,
              request: MPI.Request) -> None:
    """Wait for a check's records and raise CollectiveMismatchError where any differs."""
    _wait(where, comm, int(record[1]), request, (record, records))
    if (records == record).all():
        return
    # Every member saw the same records, so every member takes this branch: describe and raise.
    described = comm.allgather({"primitive": where, "call number": int(record[1]), **facts})
    ranks = _world_ranks(comm)
    differences = {}
    facts_seen = dict.fromkeys(key for description in described for key in description)
    failed = _FAILED in facts_seen
    for fact in sorted(facts_seen, key=lambda fact: fact != _FAILED):  # a failed local check first: the cause
        groups: dict[Any, list[int]] = {}
        for rank, description in zip(ranks, described):
            # a call whose local checks failed has no tensor facts (they would read "nothing")
            if not failed or _FAILED not in description or fact in (_FAILED, "primitive", "call number"):
                groups.setdefault(description.get(fact, "nothing"), []).append(rank)
        if len(groups) > 1:
            differences[fact] = groups
    if not differences:  # a record from a collective other than verify(), or a hash collision
        differences["check record"] = {"different records (is check mode on on every rank?)": ranks}
    raise CollectiveMismatchError(where, differences)


def _wait(where: str, comm: MPI.Comm, number: int, request: MPI.Request, buffers: tuple) -> None:
    """Complete the check's exchange; raise CollectiveTimeoutError past the time limit (see the module's doc).

    Polls with growing pauses (up to 10 ms): a worker waiting here leaves its CPU to the others. A request given
    up on keeps its ``buffers`` alive (MPI may still write them).
    """
    limit, start, pause = _timeout(), time.monotonic(), 1e-5
    while not request.Test():
        waited = time.monotonic() - start
        if limit and waited > limit:
            _abandoned.append((request, buffers))
            others = [r for i, r in enumerate(_world_ranks(comm)) if i != comm.rank]
            raise CollectiveTimeoutError(
                f"{where}: waited {waited:.0f} s in check mode for the other members of call {number} on this "
                f"communicator ({_ranks(others)}) to make it too: one of them skipped "
                "it (a forward or backward() made on some ranks only) or waits in another collective; each waiting "
                "rank names its own call (DISTDL_CHECK_TIMEOUT sets the limit in seconds, 0 for none)")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)


def announce(where: str, P: Callable[[], MPIPartition | MPI.Intracomm | None], error: Exception) -> None:
    """In check mode, let a call whose local checks raised ``error`` take part in the check of that call.

    A member that raised before communicating would otherwise skip the check: its peers' call would pair
    with its next one. ``P()`` returns the partition the call checks on (None, or raising, where it cannot be
    known: then nothing is done). Every member raises: CollectiveMismatchError where the others' calls
    passed their checks, nothing here where all failed alike (the caller then raises ``error``). A worker outside
    that partition (one passing data outside ``P_x`` and taking no other part in the call) does nothing here.
    """
    if not _enabled:
        return
    try:
        partition = P()
    except Exception:  # the arguments that name it are what failed
        return
    if partition is not None:
        verify(where, partition, agree={_FAILED: type(error).__name__})


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """Return a checksum of the values of ``tensors`` (for check mode's facts: copies that must be equal)."""
    value = 0
    for t in tensors:
        value = zlib.crc32(t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy(), value)
    return value


def _communicator(P: Any) -> MPI.Comm:
    if isinstance(P, MPIPartition):
        return P.comm
    if isinstance(P, MPI.Intracomm) or P == MPI.COMM_NULL:
        return P
    raise TypeError(f"verify: expected an MPIPartition or an MPI.Intracomm, got {type(P).__name__}")


def _facts(x: torch.Tensor | None, agree: Mapping[str, Any] | Iterable[str] | None) -> dict[str, str]:
    """Return the facts that must agree, each as a canonical string (the same text on every worker)."""
    if isinstance(agree, Mapping):
        return {str(key): _canonical(value) for key, value in agree.items()}
    names = _TENSOR_FACTS if agree is None and x is not None else tuple(agree or ())
    if names and not isinstance(x, torch.Tensor):
        raise TypeError(f"verify: expected a torch.Tensor to check {list(names)} of, got {type(x).__name__}")
    facts = {}
    for name in names:
        if name == "shape":
            facts[name] = str(tuple(x.shape))  # the same text as _canonical, faster
        elif name == "dtype":
            facts[name] = str(x.dtype)
        elif name == "device":
            facts[name] = x.device.type
        elif name == "dim":
            facts[name] = str(x.dim())
        else:
            raise ValueError(f"verify: expected facts of a tensor in {[*_TENSOR_FACTS, 'dim']}, got {name!r}")
    return facts


def _canonical(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, (tuple, list, torch.Size, np.ndarray)):
        items = [_canonical(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, torch.device):
        return value.type
    return str(value)


def _hash(text: str) -> int:
    """Return a 63-bit hash of ``text`` that is the same in every process (``hash()`` is salted)."""
    value = _hashes.get(text)
    if value is None:
        value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
        if len(_hashes) < 4096:
            _hashes[text] = value
    return value


def _next_sequence(comm: MPI.Comm) -> int:
    """Return this communicator's call number and advance it (kept as an MPI attribute of ``comm``)."""
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval()
    counter = comm.Get_attr(_keyval)
    if counter is None:
        counter = [0]
        comm.Set_attr(_keyval, counter)
    counter[0] += 1
    return counter[0] - 1


def _world_ranks(comm: MPI.Comm) -> list[int]:
    """Return the members' ranks in ``MPI.COMM_WORLD`` (their ranks in ``comm`` if not all are in it)."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        return list(range(comm.Get_size()))
    return [int(r) for r in ranks]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
