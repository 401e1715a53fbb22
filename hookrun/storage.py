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
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pandas as pd
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore


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


class Location:
    """One store's place: a local directory (`local` is its Path) or a URL (`local` is None)."""

    def __init__(self, path, storage_options: Optional[dict] = None):
        text = str(path)
        if text.startswith("file://"):
            text = text[len("file://"):]
        self.storage_options = dict(storage_options or {})
        self._dirs: set = set()  # local directories known to exist
        if is_url(text):
            self.url = text.rstrip("/")
            self.local: Optional[Path] = None
            # no cached listings: other processes (ranks, a resumed run) change the store under a reader
            fresh = {"use_listings_cache": False}
            self.zarr_store = FsspecStore.from_url(self.url, storage_options={**fresh, **self.storage_options})
            self.reader = self.zarr_store
            self.fs = self.zarr_store.fs  # async (zarr opens fsspec filesystems so): called through zarr's loop
            self.fs_root = self.zarr_store.path
        else:
            self.local = Path(text)
            self.url = str(self.local)
            self.zarr_store = LocalStore(self.local)  # the writer's (opening it creates the directory)
            self.reader = LocalStore(self.local, read_only=True)  # reads never create anything
            self.fs, self.fs_root = None, None

    def __str__(self) -> str:
        return self.url

    def child(self, name: str) -> "Location":
        """A location below this one (a run dir's captures.zarr)."""
        return Location(f"{self.url}/{name}" if self.local is None else self.local / name, self.storage_options)

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
        """The bytes of `key`, or None if it is absent."""
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
        path = self.local / key
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            with open(tmp, "wb") as f:
                f.writelines(data if isinstance(data, list) else [data])
            os.replace(tmp, path)
        except BaseException:  # a full disk (this frees room for the final status), a signal mid-write
            tmp.unlink(missing_ok=True)
            raise

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
            path = self.local / key
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        try:
            sync(self.fs._pipe_file(self._fs_path(key), data, mode="create"))
        except FileExistsError:
            return False
        except OSError as err:  # s3fs raises a refused conditional PUT as OSError, botocore's error as its cause
            code = getattr(err.__cause__, "response", {}).get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        except (TypeError, NotImplementedError) as err:
            raise NotImplementedError(f"{self.url}: this filesystem cannot create a key only if it is absent, "
                                      "which the store lock needs") from err
        return True

    def exists(self, key: str) -> bool:
        return bool(self._read(lambda s: s.exists(key), False))

    def size(self, key: str) -> int:
        return int(self._read(lambda s: s.getsize(key), 0))

    def sizes(self, prefix: str) -> Dict[str, int]:
        """{key: bytes} of every key below `prefix` ("dir/"), from one listing (not a request per key)."""
        if self.local is not None:
            base = self.local / prefix
            return {p.relative_to(self.local).as_posix(): p.stat().st_size for p in base.rglob("*") if p.is_file()} \
                if base.is_dir() else {}
        found = sync(self.fs._find(self._fs_path(prefix.rstrip("/")), detail=True))
        root = f"{self.fs_root.rstrip('/')}/"
        return {path[len(root):]: int(info["size"]) for path, info in found.items() if info.get("type") != "directory"}

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

    def is_dir(self, prefix: str) -> bool:
        """Whether `prefix` is a directory (on an object store: holds any key)."""
        return (self.local / prefix).is_dir() if self.local is not None else bool(self.children(prefix))

    def delete(self, key: str) -> None:
        sync(self.zarr_store.delete(key))

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
            shutil.rmtree(self.local / prefix, ignore_errors=True)
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
        if self.local is not None:
            dest = self.local / key
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".tmp")
            try:
                yield tmp
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
            return
        with tempfile.TemporaryDirectory(prefix="hookrun-") as tmpdir:
            tmp = Path(tmpdir) / "file"
            yield tmp
            sync(self.fs._put_file(str(tmp), self._fs_path(key)))

    def read_parquet(self, key: str, columns: Optional[List[str]] = None) -> pd.DataFrame:
        return pd.read_parquet(io.BytesIO(self.get(key)), columns=columns)

    def write_parquet(self, key: str, df: pd.DataFrame) -> None:
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        self.put(key, buf.getbuffer())

    def open_group(self, mode: str = "r") -> zarr.Group:
        """The store's root group (mode r: read only; r+: read and write)."""
        return zarr.open_group(store=self.reader if mode == "r" else self.zarr_store, mode=mode)
