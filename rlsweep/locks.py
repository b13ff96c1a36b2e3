"""One writer per run or sweep directory: an advisory ``flock`` that the OS releases when its holder dies.

A second writer fails at once, naming the holder. Locks are re-entrant within a process, so the sweep
gate can write into the sweep dir whose lock the same process took at the sweep's start; a sweep's
jobs lock their own job dirs, never the sweep dir, so no launcher blocks them.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from rlsweep.errors import OutputDirError

LOCK_FILE = ".rlsweep.lock"

_held: dict[Path, tuple[int, int]] = {}  # resolved dir -> (fd, depth) for the locks this process holds


class DirectoryInUseError(OutputDirError):
    """Another process writes into the directory."""


def holder_of(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']} since {holder['since']}: {holder['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"


def acquire(directory: Path) -> None:
    """Take the lock of ``directory`` (created if needed) or raise DirectoryInUseError naming its holder."""
    key = directory.resolve()
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        return
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # a lock file made read-only (an archive): flock needs no write access, naming its holder
        fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUseError(
            f"{str(directory)!r} is in use by another rlsweep writer ({holder_of(path)}); wait for it to end or "
            f"choose another directory"
        ) from None
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
    except OSError:  # opened read-only: the lock holds all the same, unnamed
        pass
    _held[key] = (fd, 1)


def release(directory: Path) -> None:
    key = directory.resolve()
    fd, depth = _held[key]
    if depth > 1:
        _held[key] = (fd, depth - 1)
        return
    del _held[key]
    os.close(fd)  # closing the descriptor drops the flock


@contextmanager
def locked(directory: Path):
    """Hold the lock of ``directory`` for the ``with`` block."""
    acquire(directory)
    try:
        yield
    finally:
        release(directory)
