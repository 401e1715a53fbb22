"""A store at a URL: an object store (`s3://`, `gs://`, ...) or any fsspec protocol, with every request retried.

    loc = Location("s3://bucket/runs/a.zarr", {"key": ..., "secret": ...})   # its backend a RemoteBackend
    loc.put(key, data)              # one PUT, whole or absent
    loc.put_if_absent(key, data)    # a conditional PUT (If-None-Match: *): the lease lock
    loc.zarr_store                  # zarr's FsspecStore in a RetryingStore: zarr's own requests retried too

Options (`storage_options`, else the standard AWS_* variables) go to fsspec; listings are never cached (other
processes, ranks or a resumed run, change the store under a reader). Once the store has answered, a transient
error is retried with backoff for up to `retry_s` seconds (`store.retry_s`; hookrun.storage.retry).
"""
from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from zarr.storage import FsspecStore

from hookrun.storage.internals import buffer, default_buffer_prototype, fs_create, fs_find, fs_info, fs_put_file, sync
from hookrun.storage.location import BACKENDS, Backend, Kind, is_url, joined
from hookrun.storage.retry import RETRY_S, Retry, RetryingStore


class RemoteBackend(Backend):
    """A store at an fsspec URL: every request through zarr's store (a RetryingStore) or its async filesystem
    (`fs`, at `fs_root`), in zarr's event loop."""

    def __init__(self, path, storage_options: Optional[dict] = None, retry_s: float = RETRY_S,
                 retry: Optional[Retry] = None):
        self.url = str(path).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.retry = retry or Retry(self.url, retry_s)
        fsspec_store, self.zarr_store = self._zarr_stores()
        self.reader = self.zarr_store
        self.fs = fsspec_store.fs  # async (zarr opens fsspec filesystems so): called through zarr's loop
        self.fs_root = fsspec_store.path

    def _zarr_stores(self) -> tuple:
        """(zarr's FsspecStore of the URL, the store zarr is given: it in a RetryingStore)."""
        fresh = {"use_listings_cache": False}  # no cached listings: other processes change the store under a reader
        store = FsspecStore.from_url(self.url, storage_options={**fresh, **self.storage_options})
        return store, RetryingStore(store, self.retry)

    def _fs_path(self, key: str) -> str:
        return f"{self.fs_root}/{key}"

    def get(self, key: str) -> Optional[bytes]:
        buf = self._read(lambda s: s.get(key, prototype=default_buffer_prototype()), None)
        return None if buf is None else buf.to_bytes()

    def put(self, key: str, data) -> None:
        sync(self.zarr_store.set(key, buffer(joined(data))))

    def put_many(self, items: List[tuple]) -> None:
        async def put_all():
            await asyncio.gather(*(self.zarr_store.set(key, buffer(joined(data))) for key, data in items))
        sync(put_all())

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """A conditional PUT (If-None-Match: *): True if this call created `key`. After a retry the answer lost may
        have been ours: then the key holding our bytes counts as created."""
        tries = []

        async def create():
            tries.append(1)
            await fs_create(self.fs, self._fs_path(key), data)
        try:
            sync(self.retry(create))
        except FileExistsError:
            return len(tries) > 1 and self.get(key) == bytes(data)
        except OSError as err:  # s3fs raises a refused conditional PUT as OSError, botocore's error as its cause
            code = getattr(err.__cause__, "response", {}).get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return len(tries) > 1 and self.get(key) == bytes(data)
            raise
        except (TypeError, NotImplementedError) as err:
            raise NotImplementedError(f"{self.url}: this filesystem cannot create a key only if it is absent, "
                                      "which the store lock needs") from err
        return True

    def sizes(self, prefix: str) -> Dict[str, int]:
        found = sync(self.retry(lambda: fs_find(self.fs, self._fs_path(prefix.rstrip("/")))))
        root = f"{self.fs_root.rstrip('/')}/"
        return {path[len(root):]: int(info["size"]) for path, info in found.items() if info.get("type") != "directory"}

    def missing_bucket(self) -> Optional[str]:
        """The bucket when the object store says it does not exist (an object store creates no bucket for a write:
        the run would fail at its first write), else None (present, or not known: denied or unreachable, which the
        listing after this reports)."""
        bucket = self.fs_root.strip("/").split("/", 1)[0]
        try:
            sync(fs_info(self.fs, bucket))
        except FileNotFoundError:
            return bucket
        except Exception:  # noqa: BLE001 - not ours to judge here
            return None
        return None

    @contextlib.contextmanager
    def local_file(self, key: str) -> Iterator[Path]:
        """A temp file, uploaded (multipart) to `key` on success."""
        with tempfile.TemporaryDirectory(prefix="hookrun-") as tmpdir:
            tmp = Path(tmpdir) / "file"
            yield tmp
            sync(self.retry(lambda: fs_put_file(self.fs, str(tmp), self._fs_path(key))))


BACKENDS.append(Kind(is_url, RemoteBackend))
