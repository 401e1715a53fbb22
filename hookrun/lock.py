"""One writer per store: an exclusive OS file lock held for a run's whole life.

    with StoreLock(path) as lock:     # raises LockError naming the holder (host, pid, start time)
        ...                           # write the store

The lock file `<store>/.hookrun.lock` holds the holder's host, pid and start time as JSON. The lock
itself is `fcntl.flock`, which the OS releases when its process dies: a store left by a killed
run is never blocked, and a live writer is never passed over.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from hookrun.config import ConfigError

LOCK_NAME = ".hookrun.lock"


class LockError(ConfigError):
    """Another process holds the store's lock (a refusal before any work, like a config problem)."""


def holder(path: Path) -> str:
    """Who holds (or last held) the lock of the store at `path`, in words."""
    try:
        info = json.loads((Path(path) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return "an unknown process"
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"


class StoreLock:
    """The exclusive lock on one store directory (created if absent, parents included)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: Optional[int] = None

    def acquire(self) -> "StoreLock":
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockError([f"store.path: {self.path} is being written by another run ({holder(self.path)}); "
                             "wait for it to finish, or choose another store.path"]) from None
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
