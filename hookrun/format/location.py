"""Where a store lives: a local directory or a URL, reached through one Zarr store object.

    loc = Location("outputs/run/captures.zarr")                       # zarr LocalStore
    loc = Location("s3://bucket/runs/a.zarr", {"key": ..., "secret": ...})  # zarr FsspecStore (s3fs)
    loc.put("_index/part-000000.parquet", data)   # every write of hookrun goes through these few calls
    loc.get(key), loc.exists(key), loc.size(key), loc.keys(prefix), loc.delete(key)
    loc.put_if_absent(key, data)                  # atomic create: the lease lock on object stores
    loc.read_parquet(key), loc.write_parquet(key, df), with loc.local_file(key) as path: ...

Chunks, index parts, batch records and the lock all go through the same Zarr store that zarr's
arrays use, so a path, a `file://` URL and any fsspec protocol (`s3://`, `gs://`, `memory://`)
behave alike. Each `put` replaces one key whole: a temp file and a rename on a local disk, one
object PUT on an object store; a reader never sees half a key.

A local path is taken with `~` expanded. hookrun never follows a symbolic link inside a store:
`links()` lists them (without following any) so that a store holding one is refused, and every write
(`put`, `local_file`, zarr's own through NoLinkStore) opens its directories from the store's root
with O_NOFOLLOW (open_dir): a directory replaced by a link mid-run raises LinkError naming it. On an object
store, once it has answered, a transient error (no connection, a timeout, a 5xx, throttling) is
retried with backoff for up to `retry_s` seconds (`store.retry_s`), zarr's own requests included.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import io
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer
from zarr.core.sync import sync
from fsspec.core import url_to_fs
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from fsspec.implementations.memory import MemoryFile
from zarr.storage import FsspecStore, LocalStore

log = logging.getLogger("hookrun")

# put's temp file `<chunk, index file or metadata>.<pid>.partial`, zarr's `<stem>.<uuid>.partial`
_PARTIAL_WRITE = re.compile(r"(c(\.\d+)+|[\w.-]+\.(parquet|json|npy))\.\d+\.partial|[\w.-]+\.[0-9a-f]{32}\.partial")


def is_partial_write(name: str) -> bool:
    """Whether a file name is the temp file of a write in flight, or of one a killed process cut short."""
    return _PARTIAL_WRITE.fullmatch(name) is not None


def _joined(data):
    """A list of buffers as one (`put` takes either)."""
    return b"".join(data) if isinstance(data, list) else data


def is_url(path) -> bool:
    """Whether `path` names a URL (`s3://...`) rather than a local path (`file://` counts as local)."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


RETRY_S = 60.0  # how long an object store that has answered may stay unreachable before a request fails
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EPIPE,
                     getattr(errno, "EREMOTEIO", 121)}  # s3fs: 500 InternalError
# botocore, aiohttp, urllib3 and fsspec errors of a connection or a timeout (by name: none of them is a dependency)
_TRANSIENT_TYPES = {"EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",
                    "HTTPClientError", "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError",
                    "FSTimeoutError", "IncompleteRead", "ResponseParserError"}
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable", "InternalError"}


def is_transient(err: BaseException) -> bool:
    """Whether an object store's error may pass by itself: no connection, a timeout, a server error (5xx) or
    throttling; never a missing key, a refused permission or a bad request."""
    for e in (err, err.__cause__):
        if e is None or isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                                       NotADirectoryError)):
            continue
        if isinstance(e, (ConnectionError, TimeoutError)) or {c.__name__ for c in type(e).__mro__} & _TRANSIENT_TYPES:
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # a botocore ClientError (s3fs keeps it as the cause of the error it raises)
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if status >= 500 or response.get("Error", {}).get("Code") in _THROTTLED:
                return True
    return False


class Retry:
    """Runs an object store's requests, retrying transient errors with backoff for up to `seconds` each, once the store
    has answered (an endpoint that never answered is a wrong URL or a missing server: refused at once)."""

    def __init__(self, url: str, seconds: float = RETRY_S):
        self.url = url
        self.seconds = float(seconds)
        self.reached = False
        self.down_since: Optional[float] = None  # when the outage in progress began (monotonic)

    async def __call__(self, request):
        """`await request()`, again after each transient error until `seconds` have passed; then that error."""
        delay, deadline = 0.2, None
        while True:
            try:
                result = await request()
            except Exception as err:
                if not (self.reached and self.seconds > 0 and is_transient(err)):
                    raise
                now = time.monotonic()
                if self.down_since is None:
                    self.down_since = now
                    log.warning("%s: the object store did not answer (%s: %s); retrying for up to %.0f s "
                                "(store.retry_s)", self.url, type(err).__name__, err, self.seconds)
                deadline = deadline or now + self.seconds
                if now >= deadline:
                    raise
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, 5.0)
                continue
            self.reached = True
            if self.down_since is not None:
                log.warning("%s: the object store answers again (after %.1f s)", self.url,
                            time.monotonic() - self.down_since)
                self.down_since = None
            return result


async def _listed(keys) -> List[str]:
    return [k async for k in keys]


class _RetryingStore(FsspecStore):
    """zarr's fsspec store with every request run through a Retry (set as `retry` after it is made)."""

    retry: Optional[Retry] = None

    def with_read_only(self, read_only: bool = False) -> "_RetryingStore":
        store = super().with_read_only(read_only)
        store.retry = self.retry
        return store

    async def get(self, key, prototype, byte_range=None):
        return await self.retry(lambda: FsspecStore.get(self, key, prototype, byte_range))

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        return await self.retry(lambda: FsspecStore.get_partial_values(self, prototype, key_ranges))

    async def set(self, key, value, *args, **kwargs):
        return await self.retry(lambda: FsspecStore.set(self, key, value, *args, **kwargs))

    async def delete(self, key):
        return await self.retry(lambda: FsspecStore.delete(self, key))

    async def delete_dir(self, prefix):
        return await self.retry(lambda: FsspecStore.delete_dir(self, prefix))

    async def exists(self, key):
        return await self.retry(lambda: FsspecStore.exists(self, key))

    async def getsize(self, key):
        return await self.retry(lambda: FsspecStore.getsize(self, key))

    async def list(self):
        for key in await self.retry(lambda: _listed(FsspecStore.list(self))):
            yield key

    async def list_prefix(self, prefix):
        for key in await self.retry(lambda: _listed(FsspecStore.list_prefix(self, prefix))):
            yield key

    async def list_dir(self, prefix):
        for key in await self.retry(lambda: _listed(FsspecStore.list_dir(self, prefix))):
            yield key


MEMORY_URL = "memory://"  # a URL on fsspec's memory filesystem: a MemoryLocation


class _InlineFileSystem(AsyncFileSystemWrapper):
    """fsspec's memory filesystem awaited in zarr's event loop itself, not in a worker thread per call as fsspec's
    wrapper does: its calls are dict operations, and the thread hops were half of a small run's store time."""

    def _wrap_all_sync_methods(self):
        super()._wrap_all_sync_methods()
        for name in [n for n in vars(self) if n.startswith("_") and hasattr(self.sync_fs, n[1:])]:
            setattr(self, name, _inline(getattr(self.sync_fs, name[1:])))


def _inline(method):
    async def call(*args, **kwargs):
        return method(*args, **kwargs)
    return call


def _memory_store(url: str) -> "_RetryingStore":
    """zarr's store for a `memory://` URL, on fsspec's (process-wide) memory filesystem called inline."""
    fs, path = url_to_fs(url)
    return _RetryingStore(fs=_inline_filesystem(fs), path=path)


@functools.lru_cache(maxsize=None)
def _inline_filesystem(fs) -> _InlineFileSystem:
    """One wrapper a filesystem (wrapping every method costs ~3 ms; fsspec's memory filesystem is one object)."""
    return _InlineFileSystem(fs, asynchronous=True)


# kernel filesystems that hold no files of their own: a store there cannot be made
PSEUDO_FILESYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf",
                      "pstore", "efivarfs", "devpts", "mqueue", "binfmt_misc", "fusectl", "nsfs", "rpc_pipefs"}


def _filesystem_type(path: str) -> Optional[str]:
    """The type of the filesystem holding `path` (Linux: /proc/self/mounts), or None where that cannot be told."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    best, kind = "", None
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def local_problem(path) -> Optional[str]:
    """Why a local store cannot be made at `path`, found without writing anything (None if nothing is seen): a parent
    that is a file, a kernel filesystem (/proc, /sys), a directory this user cannot write."""
    path = Path(os.path.abspath(path))
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory" if existing != path else None  # a file at `path`: not a store
    kind = _filesystem_type(os.path.realpath(existing))
    if kind in PSEUDO_FILESYSTEMS:
        return f"{existing} is on {kind}, a kernel filesystem that holds no files"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable (permissions, or a read-only filesystem)"
    return None


# -- writes that never follow a link ------------------------------------------------------------------------------
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkError(OSError):
    """A directory of a store is a symbolic link (or not a directory): hookrun writes nothing through it."""


def _link_error(root: Path, parts: List[str], fd: int) -> LinkError:
    name, where = parts[-1], "/".join(parts)
    try:
        what = f"a symbolic link to {os.readlink(name, dir_fd=fd)}"
    except OSError:
        what = "not a directory"
    return LinkError(errno.ELOOP, f"{root}/{where}: is {what}, not the store's directory (replaced while the run "
                                  "wrote?); hookrun writes nothing through a link, so the write stopped here")


def open_dir(root: Path, parts: List[str], create: bool = True) -> int:
    """A descriptor of the directory root/parts[0]/parts[1]/..., each opened from the one above without following
    a link (O_NOFOLLOW; created where missing if `create`); LinkError names a directory that is a link."""
    try:
        fd = os.open(root, _DIR)  # the store's own path may be a link the user chose; nothing below it may be
    except FileNotFoundError:
        if not create:
            raise
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, _DIR)
    made = False  # a directory this call made: what is below it is made too, without looking first
    try:
        for i, name in enumerate(parts):
            if made:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
            for attempt in (0, 1):
                try:
                    below = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=fd)
                    break
                except FileNotFoundError:
                    if not create or attempt:
                        raise
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)
                        made = True
                    except FileExistsError:
                        pass
                except OSError as err:
                    if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise _link_error(root, parts[:i + 1], fd) from None
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(root: Path, key: str, data, tmp_name: str, exclusive: bool = False) -> None:
    """`key` below `root` written whole (a temp file `tmp_name` beside it, then a rename), through directory
    descriptors opened without following links (open_dir): nothing is written outside the store, whatever
    became of its directories. `exclusive`: FileExistsError if `key` exists."""
    *dirs, name = key.split("/")
    dfd = open_dir(root, dirs)
    try:
        fd = os.open(tmp_name, _NEW, 0o644, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.writelines(data if isinstance(data, list) else [data])
            if exclusive:
                os.link(tmp_name, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                os.unlink(tmp_name, dir_fd=dfd)
            else:
                os.replace(tmp_name, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:  # a full disk (this frees room for the final status), a signal mid-write
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def check_dirs(root: Path, key: str) -> None:
    """LinkError if a directory above `key` (below `root`) is a link (FileNotFoundError-free: a missing one is
    fine); what zarr's own deletes check first."""
    dirs = key.strip("/").split("/")[:-1]
    try:
        os.close(open_dir(root, dirs, create=False))
    except FileNotFoundError:
        pass


def remove_tree(root: Path, prefix: str) -> None:
    """Remove root/prefix and everything below it without following any link (shutil.rmtree with a dir_fd);
    a link in its place is left, and nothing it points to is touched."""
    *dirs, name = prefix.strip("/").split("/")
    try:
        dfd = open_dir(root, dirs, create=False)
    except FileNotFoundError:
        return
    try:
        shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
    finally:
        os.close(dfd)


class NoLinkStore(LocalStore):
    """zarr's LocalStore whose writes open their directories from the store's root without following a link
    (write_file), and whose deletes refuse a directory that became one: zarr's own writes (array metadata,
    shards, root attrs) are as safe as hookrun's."""

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"NoLinkStore.set(): value must be a Buffer, got {type(value)}")
        tmp = f"{key.rsplit('/', 1)[-1]}.{uuid.uuid4().hex}.partial"
        await asyncio.to_thread(write_file, self.root, key, value.as_buffer_like(), tmp, exclusive)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._ensure_open_sync()
        self._check_writable()
        write_file(self.root, key, value.as_buffer_like(), f"{key.rsplit('/', 1)[-1]}.{uuid.uuid4().hex}.partial")

    async def delete(self, key: str) -> None:
        self._check_writable()
        check_dirs(self.root, key)
        await LocalStore.delete(self, key)

    def delete_sync(self, key: str) -> None:
        check_dirs(self.root, key)
        super().delete_sync(key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        check_dirs(self.root, prefix.rstrip("/") + "/x")
        await LocalStore.delete_dir(self, prefix)


def parquet_bytes(frame: pd.DataFrame) -> memoryview:
    """A table as the bytes of a parquet file, the bytes `frame.to_parquet(buf, index=False)` writes, without pandas'
    I/O layer (~3 ms a call: most of the cost of a small index part).

        location.put(key, parquet_bytes(frame))"""
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buf)
    return buf.getbuffer()


class Location:
    """One store's place: a local directory (`local` is its Path) or a URL (`local` is None); a `memory://` URL makes
    a MemoryLocation."""

    def __new__(cls, path=None, *args, **kwargs):  # (no path: unpickling)
        if cls is Location and str(path).startswith(MEMORY_URL):
            cls = MemoryLocation
        return super().__new__(cls)

    def __init__(self, path, storage_options: Optional[dict] = None, retry_s: float = RETRY_S,
                 retry: Optional[Retry] = None):
        text = str(path)
        if text.startswith("file://"):
            text = text[len("file://"):]
        self.storage_options = dict(storage_options or {})
        self.retry: Optional[Retry] = None
        if is_url(text):
            self.url = text.rstrip("/")
            self.local: Optional[Path] = None
            # no cached listings: other processes (ranks, a resumed run) change the store under a reader
            fresh = {"use_listings_cache": False}
            self.zarr_store = _memory_store(self.url) if self.in_memory else \
                _RetryingStore.from_url(self.url, storage_options={**fresh, **self.storage_options})
            self.retry = self.zarr_store.retry = retry or Retry(self.url, retry_s)
            self.reader = self.zarr_store
            self.fs = self.zarr_store.fs  # async (zarr opens fsspec filesystems so): called through zarr's loop
            self.fs_root = self.zarr_store.path
        else:
            self.local = Path(text).expanduser()  # once, here: every key below is a plain path
            self.url = str(self.local)
            self.zarr_store = NoLinkStore(self.local)  # the writer's (opening it creates the directory)
            self.reader = LocalStore(self.local, read_only=True)  # reads never create anything
            self.fs, self.fs_root = None, None

    def __str__(self) -> str:
        return self.url

    @property
    def in_memory(self) -> bool:
        """Whether the store lives in this process's memory (fsspec `memory://`, store.path=memory): nothing outside
        the process reads or writes it, and nothing of it outlives the process."""
        return isinstance(self, MemoryLocation)

    def child(self, name: str) -> "Location":
        """A location below this one (a run dir's captures.zarr)."""
        if self.local is not None:
            return Location(self.local / name)
        return Location(f"{self.url}/{name}", self.storage_options, retry=self.retry)

    # -- keys ----------------------------------------------------------------------------------
    def _read(self, call, absent):
        """Run a read on the reader; `absent` if the local directory does not exist (yet)."""
        try:
            return sync(call(self.reader))
        except FileNotFoundError:
            if self.local is not None and not self.local.is_dir():
                return absent
            raise

    def get(self, key: str) -> Optional[bytes]:
        """The bytes of `key`, or None if it is absent. On a local disk read in the calling thread (what zarr's
        LocalStore does in a worker thread: the two thread hops cost more than a small file's read)."""
        if self.local is not None:
            try:
                return (self.local / key).read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
        buf = self._read(lambda s: s.get(key, prototype=default_buffer_prototype()), None)
        return None if buf is None else buf.to_bytes()

    def put(self, key: str, data) -> None:
        """Write `key` whole (bytes, a buffer, or a list of them to join): a reader sees the old value or the new
        one, never a mix.

        On a local disk this is zarr's own atomic write (temp file, rename) done in the calling thread:
        through zarr's event loop each put hops two threads, which cost ~12% of a run's wall time on
        uncompressed captures (benchmarked); an object store goes through zarr."""
        if self.local is None:
            sync(self.zarr_store.set(key, Buffer.from_bytes(_joined(data))))
            return
        write_file(self.local, key, data, f"{key.rsplit('/', 1)[-1]}.{os.getpid()}.partial")

    def put_many(self, items: List[tuple]) -> None:
        """`put` each (key, data): one after another on a local disk, all at once on an object store (one
        request each, in flight together: a single stream of PUTs leaves most of the bandwidth unused)."""
        if self.local is not None or len(items) < 2:
            for key, data in items:
                self.put(key, data)
            return

        async def put_all():
            await asyncio.gather(*(self.zarr_store.set(key, Buffer.from_bytes(_joined(data))) for key, data in items))
        sync(put_all())

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` only if no one has: True if this call created it. Atomic on a local disk (exclusive
        create) and on S3 (a conditional PUT, If-None-Match: *)."""
        if self.local is not None:
            try:
                write_file(self.local, key, [data], f"{key.rsplit('/', 1)[-1]}.{os.getpid()}.partial", exclusive=True)
            except FileExistsError:
                return False
            return True
        tries = []

        async def create():
            tries.append(1)
            await self.fs._pipe_file(self._fs_path(key), data, mode="create")
        try:
            sync(self.retry(create))
        except FileExistsError:
            return len(tries) > 1 and self.get(key) == bytes(data)  # after a retry: maybe the lost answer was ours
        except OSError as err:  # s3fs raises a refused conditional PUT as OSError, botocore's error as its cause
            code = getattr(err.__cause__, "response", {}).get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return len(tries) > 1 and self.get(key) == bytes(data)
            raise
        except (TypeError, NotImplementedError) as err:
            raise NotImplementedError(f"{self.url}: this filesystem cannot create a key only if it is absent, "
                                      "which the store lock needs") from err
        return True

    def exists(self, key: str) -> bool:
        """Whether `key` is a file (on a local disk checked in the calling thread, as zarr's LocalStore checks it)."""
        if self.local is not None:
            return (self.local / key).is_file()
        return bool(self._read(lambda s: s.exists(key), False))

    def size(self, key: str) -> int:
        return int(self._read(lambda s: s.getsize(key), 0))

    def sizes(self, prefix: str) -> Dict[str, int]:
        """{key: bytes} of every key below `prefix` ("dir/"), from one listing (not a request per key)."""
        if self.local is not None:
            base = self.local / prefix
            return {p.relative_to(self.local).as_posix(): p.stat().st_size for p in base.rglob("*") if p.is_file()} \
                if base.is_dir() else {}
        found = sync(self.retry(lambda: self.fs._find(self._fs_path(prefix.rstrip("/")), detail=True)))
        root = f"{self.fs_root.rstrip('/')}/"
        return {path[len(root):]: int(info["size"]) for path, info in found.items() if info.get("type") != "directory"}

    def sizes_by_dir(self, dirs: Sequence[str]) -> Dict[str, int]:
        """{dir: bytes of every key below it} for directories of the store (arrays): each one walked on a local disk
        (no link followed out of it), one listing of the store elsewhere (an object store's listing is requests, a
        memory store's a pass over every key of the process).

            loc.sizes_by_dir(["resid/blocks.0/output"]) == {"resid/blocks.0/output": 123456}"""
        if self.local is not None:
            return {d: sum(self.sizes(f"{d}/").values()) for d in dirs}
        totals = dict.fromkeys(dirs, 0)
        for key, size in self.sizes("").items():
            for cut in (i for i, c in enumerate(key) if c == "/"):  # each dir it is below, at any depth
                if key[:cut] in totals:
                    totals[key[:cut]] += size
        return totals

    def keys(self, prefix: str = "") -> List[str]:
        """Every key below `prefix` (a "dir/" prefix, or "" for the whole store), sorted."""
        async def gather(store):
            return [k async for k in store.list_prefix(prefix)]
        return sorted(self._read(gather, []))

    def children(self, prefix: str = "") -> List[str]:
        """The names directly below `prefix` ("" = the top), files and directories alike."""
        async def gather(store):
            return [k async for k in store.list_dir(prefix)]
        try:
            return sorted(set(self._read(gather, [])))
        except FileNotFoundError:  # a prefix that is not there
            return []

    def lister(self) -> Callable[[str], List[str]]:
        """`children` for a walk of the store that writes nothing meanwhile (the consolidated metadata): the store's
        own listings here; a memory store lists its keys once for the whole walk.

            children = loc.lister(); children(""); children("resid")"""
        return self.children

    def is_dir(self, prefix: str) -> bool:
        """Whether `prefix` is a directory (on an object store: holds any key)."""
        return (self.local / prefix).is_dir() if self.local is not None else bool(self.children(prefix))

    def delete(self, key: str) -> None:
        sync(self.zarr_store.delete(key))  # (a local store's checks its directories: NoLinkStore)

    def links(self, prefix: str = "") -> Dict[str, str]:
        """{key: target} of every symbolic link at or below `prefix` ("" = the whole store), found without following
        any (an object store has none). hookrun never writes or deletes through a link inside a store."""
        if self.local is None:
            return {}
        found: Dict[str, str] = {}
        start = self.local / prefix
        if prefix and start.is_symlink():
            return {prefix.rstrip("/"): os.readlink(start)}
        stack = [start]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                if entry.is_symlink():
                    found[Path(entry.path).relative_to(self.local).as_posix()] = os.readlink(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
        return dict(sorted(found.items()))

    def drop_partial_writes(self) -> List[str]:
        """Remove the temp files of writes that a killed process left unfinished (`put`'s `<key>.<pid>.partial`,
        zarr's `<stem>.<uuid>.partial`); only a writer holding the store's lock may call this. Object
        stores have none (a PUT is whole or absent). Returns the keys removed."""
        if self.local is None or not self.local.is_dir():
            return []
        dropped = []
        for path in self.local.rglob("*.partial"):
            if is_partial_write(path.name) and path.is_file():
                path.unlink(missing_ok=True)
                dropped.append(path.relative_to(self.local).as_posix())
        return dropped

    def delete_dir(self, prefix: str) -> None:
        """Remove every key below `prefix`."""
        if self.local is not None:
            remove_tree(self.local, prefix)
        else:
            for key in self.keys(prefix.rstrip("/") + "/"):
                self.delete(key)

    def _fs_path(self, key: str) -> str:
        return f"{self.fs_root}/{key}"

    # -- files ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def local_file(self, key: str) -> Iterator[Path]:
        """A local path to write `key` into (a large file written in pieces); on success it becomes `key`
        whole: renamed into place on a local disk, uploaded (multipart) to an object store."""
        if self.local is not None:  # written in its directory, held open: never through a link made since
            *dirs, name = key.split("/")
            dfd = open_dir(self.local, dirs)
            here = Path(f"/proc/self/fd/{dfd}")  # that directory itself (Linux); else its real path, checked
            base = here if here.is_dir() else Path(os.path.realpath(self.local.joinpath(*dirs)))
            try:
                yield base / f"{name}.tmp"
                os.replace(f"{name}.tmp", name, src_dir_fd=dfd, dst_dir_fd=dfd)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{name}.tmp", dir_fd=dfd)
                os.close(dfd)
            return
        with tempfile.TemporaryDirectory(prefix="hookrun-") as tmpdir:
            tmp = Path(tmpdir) / "file"
            yield tmp
            sync(self.retry(lambda: self.fs._put_file(str(tmp), self._fs_path(key))))

    def read_parquet(self, key: str, columns: Optional[List[str]] = None) -> pd.DataFrame:
        return pd.read_parquet(io.BytesIO(self.get(key)), columns=columns)

    def write_parquet(self, key: str, df: pd.DataFrame) -> None:
        self.put(key, parquet_bytes(df))

    def open_group(self, mode: str = "r") -> zarr.Group:
        """The store's root group (mode r: read only; r+: read and write)."""
        return zarr.open_group(store=self.reader if mode == "r" else self.zarr_store, mode=mode)


class MemoryLocation(Location):
    """A store in this process's memory (fsspec's memory filesystem, `memory://`): hookrun's own reads and writes are
    dict operations done in the calling thread, not requests through zarr's event loop (two thread hops each, most
    of a small run's store time). zarr reads and writes its arrays through the same filesystem.

        Location("memory://hookrun/<id>/captures.zarr").put("k", b"...")"""

    @property
    def _mem(self):
        return self.fs.sync_fs

    def get(self, key: str) -> Optional[bytes]:
        try:
            return bytes(self._mem.cat_file(self._fs_path(key)))
        except FileNotFoundError:
            return None

    def put(self, key: str, data) -> None:
        self._mem.pipe_file(self._fs_path(key), _joined(data))

    def put_many(self, items: List[tuple]) -> None:
        for key, data in items:
            self.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._fs_path(key)  # one dict operation (atomic): fsspec's mode="create" first reads every key
        file = MemoryFile(self._mem, path, bytes(data))
        return self._mem.store.setdefault(path, file) is file

    def exists(self, key: str) -> bool:
        return self._mem.isfile(self._fs_path(key))

    def size(self, key: str) -> int:
        return int(self._mem.size(self._fs_path(key)))  # (FileNotFoundError for an absent key, as on any URL)

    def sizes(self, prefix: str) -> Dict[str, int]:
        return {key: int(info["size"]) for key, info in self._found(prefix).items()}

    def keys(self, prefix: str = "") -> List[str]:
        return sorted(self._found(prefix))

    def _found(self, prefix: str) -> Dict[str, dict]:
        """{key: {"size": bytes}} of every file below a "dir/" prefix ("" = the whole store), sorted: one pass over
        the memory filesystem's keys (every store of the process: fsspec's `find` took ~30x longer a pass, ~1 s a
        run's close beside 50,000 other keys)."""
        root = f"{self.fs_root.rstrip('/')}/"
        base = self._fs_path(prefix).rstrip("/")  # the file `base` itself or those below it, as fsspec's find
        start, below = root + prefix, base + "/"
        found = {path[len(root):]: {"size": int(file.size)} for path, file in tuple(self._mem.store.items())
                 if path.startswith(start) and (path == base or path.startswith(below))}
        return dict(sorted(found.items()))

    def children(self, prefix: str = "") -> List[str]:
        """As fsspec's ls answers (files, the directories they imply, empty directories made), in one pass over the
        keys without an info dict a key (~3x faster beside many keys)."""
        path = self._fs_path(prefix).rstrip("/")
        mem = self._mem
        if mem.isfile(path):
            return []
        below = path + "/"
        names = {key[len(below):].split("/", 1)[0] for key in (*tuple(mem.store), *mem.pseudo_dirs)
                 if key.startswith(below) and len(key) > len(below)}
        return sorted(names)

    def lister(self) -> Callable[[str], List[str]]:
        """`children` answered from one listing of the store's keys (each listing reads every key of the process)."""
        keys = self.keys()

        def children(prefix: str = "") -> List[str]:
            below = f"{prefix.rstrip('/')}/" if prefix.strip("/") else ""
            return sorted({k[len(below):].split("/", 1)[0] for k in keys if k.startswith(below)})
        return children

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._mem.rm_file(self._fs_path(key))

    def delete_all(self) -> None:
        """Remove the whole store: its keys and the directories made below it, in one pass over the process's keys
        (fsspec's recursive rm took ~0.6 s beside 50,000 other keys).

            Location("memory://hookrun/<id>").delete_all()"""
        mem, root = self._mem, self.fs_root.rstrip("/")
        below = root + "/"
        for key in [k for k in tuple(mem.store) if k.startswith(below)]:
            mem.store.pop(key, None)
        mem.pseudo_dirs[:] = [d for d in mem.pseudo_dirs if d != root and not d.startswith(below)]
