"""Where a store lives, behind one interface: every key hookrun reads or writes, and the zarr store its arrays use.

    loc = Location("outputs/run/captures.zarr")             # a local directory (hookrun.storage.local)
    loc = Location("s3://bucket/runs/a.zarr", {"key": ...})  # any fsspec URL (hookrun.storage.remote)
    loc = Location("memory://hookrun/<id>/captures.zarr")   # a MemoryLocation (hookrun.storage.memory)
    loc.put(key, data); loc.get(key); loc.exists(key); loc.size(key); loc.keys(prefix); loc.delete(key)
    loc.put_if_absent(key, data)                  # atomic create: the lease lock on object stores
    with loc.local_file(key) as path: ...         # a large file written in pieces, then the key whole
    loc.zarr_store, loc.reader                    # zarr's view of it (writes, reads): zarr's arrays use these

A Location hands each call to its backend (`backend`: the first of BACKENDS that takes the path; each backend's
module adds its own, and the package imports them all), so that every read and write of every backend goes
through this one class. Each `put` replaces one key whole: a reader never sees half a key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, ContextManager, Dict, List, NamedTuple, Optional, Sequence

import zarr

from hookrun.storage.internals import sync
from hookrun.storage.retry import RETRY_S, Retry


class Kind(NamedTuple):
    """A kind of store: whether it `takes` a path, what makes its backend (path, storage_options, retry_s, retry),
    the Location class it is seen as."""

    takes: Callable[[str], bool]
    backend: Callable[..., "Backend"]
    location: Optional[type] = None  # None: Location itself


BACKENDS: List[Kind] = []  # the most specific first: memory://, then any URL, then a local path


def is_url(path) -> bool:
    """Whether `path` names a URL (`s3://...`) rather than a local path (`file://` counts as local)."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def joined(data):
    """A list of buffers as one (`put` takes either)."""
    return b"".join(data) if isinstance(data, list) else data


def _kind(path: str) -> Kind:
    return next(k for k in BACKENDS if k.takes(path))


class Backend:
    """What a kind of store does for its Location; here, what is answered alike through zarr's store (`reader`,
    `zarr_store`) and the defaults of a store without links, temp files or buckets. Each backend sets `local`,
    `url`, `zarr_store`, `reader` (and `fs`, `fs_root`, `retry` for an fsspec URL)."""

    local: Optional[Path] = None
    fs = None
    fs_root: Optional[str] = None
    retry: Optional[Retry] = None

    def _read(self, call, absent):
        """Run a read on zarr's reader."""
        return sync(call(self.reader))

    def exists(self, key: str) -> bool:
        return bool(self._read(lambda s: s.exists(key), False))

    def size(self, key: str) -> int:
        return int(self._read(lambda s: s.getsize(key), 0))

    def sizes_by_dir(self, dirs: Sequence[str]) -> Dict[str, int]:
        """From one listing of the store (an object store's listing is requests, a memory store's a pass over every
        key of the process)."""
        totals = dict.fromkeys(dirs, 0)
        for key, size in self.sizes("").items():
            for cut in (i for i, c in enumerate(key) if c == "/"):  # each dir it is below, at any depth
                if key[:cut] in totals:
                    totals[key[:cut]] += size
        return totals

    def keys(self, prefix: str) -> List[str]:
        async def gather(store):
            return [k async for k in store.list_prefix(prefix)]
        return sorted(self._read(gather, []))

    def children(self, prefix: str) -> List[str]:
        async def gather(store):
            return [k async for k in store.list_dir(prefix)]
        try:
            return sorted(set(self._read(gather, [])))
        except FileNotFoundError:  # a prefix that is not there
            return []

    def lister(self) -> Optional[Callable[[str], List[str]]]:
        return None  # the Location's own children

    def is_dir(self, prefix: str) -> bool:
        return bool(self.children(prefix))

    def put_many(self, items: List[tuple]) -> None:
        """Each (key, data) put, one after another."""
        for key, data in items:
            self.put(key, data)

    def delete(self, key: str) -> None:
        sync(self.zarr_store.delete(key))

    def links(self, prefix: str) -> Dict[str, str]:
        return {}

    def drop_partial_writes(self) -> List[str]:
        return []

    def missing_bucket(self) -> Optional[str]:
        return None


class Location:
    """One store's place: a local directory (`local` is its Path) or a URL (`local` is None), its calls done by its
    backend (hookrun.storage.local, .remote, .memory)."""

    def __new__(cls, path=None, *args, **kwargs):  # (no path: unpickling)
        if cls is Location and path is not None:
            cls = _kind(str(path)).location or Location
        return super().__new__(cls)

    def __init__(self, path, storage_options: Optional[dict] = None, retry_s: float = RETRY_S,
                 retry: Optional[Retry] = None):
        text = str(path)
        if text.startswith("file://"):
            text = text[len("file://"):]
        self.storage_options = dict(storage_options or {})
        self.backend = backend = _kind(text).backend(text, self.storage_options, retry_s, retry)
        self.local: Optional[Path] = backend.local  # the directory of a local store (else None)
        self.url: str = backend.url
        self.zarr_store = backend.zarr_store  # zarr's store for writes (a local one never follows a link)
        self.reader = backend.reader  # zarr's store for reads (a local one creates nothing)
        self.fs, self.fs_root = backend.fs, backend.fs_root  # an fsspec URL's async filesystem, the store's path on it
        self.retry: Optional[Retry] = backend.retry  # an fsspec URL's retries of transient errors (store.retry_s)

    def __str__(self) -> str:
        return self.url

    @property
    def in_memory(self) -> bool:
        """Whether the store lives in this process's memory (fsspec `memory://`, store.path=memory): nothing outside
        the process reads or writes it, and nothing of it outlives the process."""
        return False

    def child(self, name: str) -> "Location":
        """A location below this one (a run dir's captures.zarr)."""
        if self.local is not None:
            return Location(self.local / name)
        return Location(f"{self.url}/{name}", self.storage_options, retry=self.retry)

    # -- keys ----------------------------------------------------------------------------------
    def get(self, key: str) -> Optional[bytes]:
        """The bytes of `key`, or None if it is absent."""
        return self.backend.get(key)

    def put(self, key: str, data) -> None:
        """Write `key` whole (bytes, a buffer, or a list of them to join): a reader sees the old value or the new
        one, never a mix."""
        self.backend.put(key, data)

    def put_many(self, items: List[tuple]) -> None:
        """`put` each (key, data): one after another on a local disk (the keys of one directory through one walk
        down to it), all at once on an object store (one request each, in flight together: a single stream of PUTs
        leaves most of the bandwidth unused)."""
        if len(items) < 2:
            for key, data in items:
                self.put(key, data)
            return
        self.backend.put_many(items)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` only if no one has: True if this call created it. Atomic on a local disk (exclusive
        create), on S3 (a conditional PUT, If-None-Match: *) and in memory (one dict operation)."""
        return self.backend.put_if_absent(key, data)

    def exists(self, key: str) -> bool:
        """Whether `key` is a file."""
        return self.backend.exists(key)

    def size(self, key: str) -> int:
        """The bytes of `key` (FileNotFoundError if it is absent)."""
        return self.backend.size(key)

    def sizes(self, prefix: str) -> Dict[str, int]:
        """{key: bytes} of every key below `prefix` ("dir/"), from one listing (not a request per key)."""
        return self.backend.sizes(prefix)

    def sizes_by_dir(self, dirs: Sequence[str]) -> Dict[str, int]:
        """{dir: bytes of every key below it} for directories of the store (arrays).

            loc.sizes_by_dir(["resid/blocks.0/output"]) == {"resid/blocks.0/output": 123456}"""
        return self.backend.sizes_by_dir(dirs)

    def keys(self, prefix: str = "") -> List[str]:
        """Every key below `prefix` (a "dir/" prefix, or "" for the whole store), sorted."""
        return self.backend.keys(prefix)

    def children(self, prefix: str = "") -> List[str]:
        """The names directly below `prefix` ("" = the top), files and directories alike."""
        return self.backend.children(prefix)

    def lister(self) -> Callable[[str], List[str]]:
        """`children` for a walk of the store that writes nothing meanwhile (the consolidated metadata): the store's
        own listings; a memory store lists its keys once for the whole walk.

            children = loc.lister(); children(""); children("resid")"""
        return self.backend.lister() or self.children

    def is_dir(self, prefix: str) -> bool:
        """Whether `prefix` is a directory (on an object store: holds any key)."""
        return self.backend.is_dir(prefix)

    def delete(self, key: str) -> None:
        self.backend.delete(key)

    def delete_dir(self, prefix: str) -> None:
        """Remove every key below `prefix` (on a local disk without following a link)."""
        if self.local is not None:
            self.backend.delete_tree(prefix)
            return
        for key in self.keys(prefix.rstrip("/") + "/"):
            self.delete(key)

    def links(self, prefix: str = "") -> Dict[str, str]:
        """{key: target} of every symbolic link at or below `prefix` ("" = the whole store), found without following
        any (an object store has none). hookrun never writes or deletes through a link inside a store."""
        return self.backend.links(prefix)

    def drop_partial_writes(self) -> List[str]:
        """Remove the temp files of writes that a killed process left unfinished; only a writer holding the store's
        lock may call this. Object stores have none (a PUT is whole or absent). Returns the keys removed."""
        return self.backend.drop_partial_writes()

    def missing_bucket(self) -> Optional[str]:
        """The bucket of an object store's URL when the object store says it does not exist (it creates no bucket
        for a write: the run would fail at its first write), else None (local, present, or not known)."""
        return self.backend.missing_bucket()

    # -- files ---------------------------------------------------------------------------------
    def local_file(self, key: str) -> ContextManager[Path]:
        """A local path to write `key` into (a large file written in pieces); on success it becomes `key`
        whole: renamed into place on a local disk, uploaded (multipart) to an object store.

            with loc.local_file("_index/index.parquet") as path: frame.to_parquet(path)"""
        return self.backend.local_file(key)

    def open_group(self, mode: str = "r") -> zarr.Group:
        """The store's root group (mode r: read only; r+: read and write)."""
        return zarr.open_group(store=self.reader if mode == "r" else self.zarr_store, mode=mode)
