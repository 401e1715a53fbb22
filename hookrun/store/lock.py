"""One writer per store: a lock held for a run's whole life, on a local disk or an object store.

    lock = store_lock(location).acquire()   # raises LockError naming the holder (host, pid, start time)
    ...                                     # write the store
    lock.release()

On a local disk the lock is `fcntl.flock` on `<store>/.hookrun.lock` (holding the holder's host,
pid and start time as JSON), which the OS releases when its process dies: a store left by a
killed run is never blocked, and a live writer is never passed over. The lock file is opened
without following a link, and only a regular file that hookrun made (empty, or a holder's record,
with no other hard link) is taken: anything else is refused, never truncated.

An object store has no locks, so there the lock is a lease: `.hookrun.lock/lease-N`, created only
if absent (a conditional PUT; of two racers exactly one creates a given N), renewed every
`ttl_s / 3` by its holder. A lease that was released, was not renewed for `ttl_s`, or whose holder
is a dead process on this host is stale: the next writer creates lease N+1. A holder that finds a
newer lease than its own has lost the store (it stalled past its lease) and its run fails.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Optional

from hookrun.config.checks import ConfigError
from hookrun.storage import Location

LOCK_NAME = ".hookrun.lock"
LEASE_TTL_S = 60.0
log = logging.getLogger("hookrun")


class LockError(ConfigError):
    """Another process holds the store's lock (a refusal before any work, like a config problem)."""


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _words(info: Optional[dict]) -> str:
    if not info:
        return "an unknown process"
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"


def _record(text: bytes) -> Optional[dict]:
    """A lock holder's record (host, pid, start time), or None if `text` is not one."""
    try:
        info = json.loads(text)
    except ValueError:
        return None
    return info if isinstance(info, dict) and {"host", "pid", "started"} <= set(info) else None


def _refusal(location: Location, info: Optional[dict]) -> LockError:
    return LockError([f"store.path: {location} is being written by another run ({_words(info)}); "
                      "wait for it to finish, or choose another store.path"])


def store_lock(location: Location, ttl_s: float = LEASE_TTL_S):
    """The lock of the store at `location`: a file lock on a local disk, a lease on an object store."""
    return FileLock(location.local) if location.local is not None else LeaseLock(location, ttl_s)


class _Lock:
    """`with lock:` acquires and releases."""

    def acquire(self):
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class NoLock(_Lock):
    """What a rank other than 0 holds: rank 0 holds the store's lock for every rank of the run."""

    lost = False

    def acquire(self) -> "NoLock":
        return self

    def release(self) -> None:
        pass


class FileLock(_Lock):
    """The exclusive OS lock on one local store directory (created if absent, parents included)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: Optional[int] = None
        self.lost = False  # a file lock cannot be lost while its process lives

    def acquire(self) -> "FileLock":
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise LockError([f"store.path: {self.path} cannot be created ({type(err).__name__}: {err}); give a path "
                             "in a directory you can write"]) from None
        lock = self.path / LOCK_NAME
        if os.path.lexists(lock) and not stat.S_ISREG(os.lstat(lock).st_mode):  # not even opened: a FIFO, a device
            raise self._foreign(lock, os.lstat(lock))
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # a link (to anything), a directory
                raise self._foreign(lock, os.lstat(lock)) from None
            raise
        try:
            held = os.fstat(fd)
            if not stat.S_ISREG(held.st_mode) or held.st_nlink != 1:
                raise self._foreign(lock, held)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _refusal(Location(self.path), _record(os.pread(fd, 4096, 0))) from None
            text = os.pread(fd, 4096, 0)
            if text.strip() and _record(text) is None:  # a file of the same name that hookrun did not write
                raise self._foreign(lock, held)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        self.fd = fd
        return self

    def _foreign(self, lock: Path, info: os.stat_result) -> LockError:
        if stat.S_ISLNK(info.st_mode):
            what = f"a symbolic link to {os.readlink(lock)}"
        elif stat.S_ISREG(info.st_mode):
            what = f"a file with {info.st_nlink} hard links" if info.st_nlink != 1 else "a file hookrun did not write"
        else:
            what = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        return LockError([f"store.path: {lock} is {what}; hookrun never follows, truncates or writes a lock it did "
                          "not make: the store is damaged. Move that file away, or choose another store.path"])

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class LeaseLock(_Lock):
    """A renewed lease object on an object store (see the module docstring)."""

    def __init__(self, location: Location, ttl_s: float = LEASE_TTL_S):
        self.location = location
        self.ttl_s = ttl_s
        self.key: Optional[str] = None
        self.info = {**_me(), "ttl_s": ttl_s}
        self.lost = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _leases(self) -> list:
        return [k for k in self.location.keys(f"{LOCK_NAME}/") if k.rsplit("/", 1)[-1].startswith("lease-")]

    def _read(self, key: str) -> Optional[dict]:
        try:
            return json.loads(self.location.get(key) or b"{}")
        except ValueError:
            return None

    def _stale(self, info: Optional[dict]) -> bool:
        if not info or info.get("released"):
            return True
        if time.time() - float(info.get("renewed", 0)) > float(info.get("ttl_s", self.ttl_s)):
            return True
        if info.get("host") == socket.gethostname():  # a holder on this host: is its process alive?
            try:
                os.kill(int(info.get("pid", 0)), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, ValueError):
                return False
        return False

    def acquire(self) -> "LeaseLock":
        leases = self._leases()
        n = 0
        if leases:
            latest = leases[-1]
            info = self._read(latest)
            if not self._stale(info):
                raise _refusal(self.location, info)
            n = int(latest.rsplit("-", 1)[-1]) + 1
        key = f"{LOCK_NAME}/lease-{n:06d}"
        if not self.location.put_if_absent(key, self._body()):
            raise _refusal(self.location, self._read(key))
        self.key = key
        for old in leases:  # stale leases of earlier runs: the newest one decides, these are history
            self.location.delete(old)
        self._thread = threading.Thread(target=self._renew, name="hookrun-lease", daemon=True)
        self._thread.start()
        return self

    def _body(self, released: bool = False) -> bytes:
        return json.dumps({**self.info, "renewed": time.time(), "released": released}).encode()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self._leases()[-1] != self.key:
                    self.lost = True
                    log.error("%s: another run took this store's lease (this run stalled past %.0f s)",
                              self.location, self.ttl_s)
                    return
                self.location.put(self.key, self._body())
            except Exception as err:  # noqa: BLE001 - retried at the next renewal; the ttl leaves room
                log.warning("%s: renewing the store's lease failed (%s); retrying", self.location, err)

    def release(self) -> None:
        if self.key is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.lost:
            self.location.put(self.key, self._body(released=True))
        self.key = None
