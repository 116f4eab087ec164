"""Settings read from the environment: a value distdl does not understand is an error naming the variable."""

from __future__ import annotations

import os

__all__ = ["flag", "shared", "SHARED"]

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# The settings by which each worker chooses the messages of its collectives, as this worker read them: a worker
# that read another value waits for messages its peers never send. ``MPIPartition(comm)`` compares them over
# ``comm`` (see ``distdl.partition``).
SHARED: dict[str, str] = {}


def flag(name: str) -> bool | None:
    """Return the on/off setting ``name``: True or False, None where unset or empty; ValueError otherwise."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return None
    if text not in _ON + _OFF:
        raise ValueError(f"{name}: expected 1 or 0 (or true/false, yes/no, on/off), got {os.environ[name]!r}")
    return text in _ON


def shared(name: str, value):
    """Record ``value``, this worker's reading of setting ``name``, as one every worker must read alike; return it."""
    SHARED[name] = str(value)
    return value
