"""The Zarr writer and the parquet index: the only module that writes a store.

    captures.zarr/<hook>/<layer>/<role>     one array per stream, axis 0 = record, chunked (or sharded) along it
    captures.zarr/_index/part-N.parquet     index rows of the batches committed in commit N
    captures.zarr/_index/<table>-N.parquet  their side tables (samples, tokens) and chunk sizes (chunks)
    captures.zarr/_index/batches-N.parquet  one row per batch of commit N: written last, it marks N committed
    captures.zarr/_index/index.parquet      all rows (and batches/<table>.parquet), once the run is complete
    captures.zarr/.hookrun.lock             the writer's lock (hookrun.lock)

Every `commit_s` seconds every finished batch is committed: the partly filled last chunk of each
array is written (and rewritten when it fills), then the part files above, each a temp file and a
rename. A killed run leaves a readable store whose index describes only committed batches;
`store.mode=resume` checks it (hookrun.verify) and continues after the last of them. Only an
absent path, an empty directory or a hookrun store is ever written; overwrite removes only what
hookrun wrote.

Hooks call `submit(capture)`: it copies the tensor off the device (non-blocking into pinned
memory on CUDA) and queues it. A writer thread turns captures into numpy, computes their
statistics, buffers whole chunks per array and writes them; a byte budget on the queue gives
backpressure. A writer error is raised in the run at its next submit or at close.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec
from zarr.core.sync import sync

from hookrun.analysis import bf16_bits_to_float32
from hookrun.config import ConfigError, suggest
from hookrun.lock import LOCK_NAME, StoreLock
from hookrun.verify import INDEX_DIR, committed_parts, side_tables, verify_store

CODECS = ("none", "lz4", "zstd", "blosclz", "lz4hc", "zlib")
SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")
log = logging.getLogger("hookrun")
MODES = ("create", "overwrite", "resume")
ITEM_OVERHEAD = 16384  # bytes a queued item is counted as beyond its data (its Python objects, ~1-2 KB, with room): a budget on tiny captures too
ENCODING_KEYS = ("codec", "level", "shuffle", "chunk_mb", "chunk_rows", "shard_mb")  # fixed for the life of a store
MAX_SHARD_MB = 16384  # a shard is buffered whole in memory before it is written
MAX_CHUNK_MB = 2048  # one chunk is encoded in memory at once: larger is a typo, not a plan


class NonFiniteError(RuntimeError):
    """A capture held NaN or inf values and on_nonfinite is error."""


class StoreError(RuntimeError):
    """The store could not be written (exists, disk full, permission denied, writer failure)."""


def check_spec(store_cfg) -> List[str]:
    """Problems with the `store` entry."""
    problems = []
    for key in ("chunk_mb", "commit_s", "queue_mb"):
        value = store_cfg[key]
        if not math.isfinite(value):
            problems.append(f"store.{key}: {value} is not a finite number; give a positive number")
    if problems:
        return problems
    if store_cfg.chunk_mb > MAX_CHUNK_MB:
        problems.append(f"store.chunk_mb: {store_cfg.chunk_mb} MB per chunk is more than {MAX_CHUNK_MB}; "
                        "chunks of 1-64 MB read and write best")
    if store_cfg.mode not in MODES:
        problems.append(f"store.mode: {store_cfg.mode!r} is unknown; use one of {', '.join(MODES)}{suggest(store_cfg.mode, MODES)}")
    if store_cfg.commit_s < 0:
        problems.append(f"store.commit_s: {store_cfg.commit_s} must be >= 0 (0 = commit after every batch)")
    if store_cfg.codec not in CODECS:
        problems.append(f"store.codec: {store_cfg.codec!r} is unknown; use one of {', '.join(CODECS)}{suggest(store_cfg.codec, CODECS)}")
    if store_cfg.shuffle not in SHUFFLES:
        problems.append(f"store.shuffle: {store_cfg.shuffle!r} is unknown; use one of {', '.join(SHUFFLES)}")
    if not 0 <= store_cfg.level <= 9:
        problems.append(f"store.level: {store_cfg.level} must be 0..9")
    if store_cfg.chunk_mb <= 0:
        problems.append(f"store.chunk_mb: {store_cfg.chunk_mb} must be > 0")
    shard = store_cfg.get("shard_mb")
    if shard is not None and not (math.isfinite(shard) and 0 < shard <= MAX_SHARD_MB):
        problems.append(f"store.shard_mb: {shard} must be a number in (0, {MAX_SHARD_MB}] or null (no shards); "
                        "256 makes few large files")
    if store_cfg.chunk_rows is not None and store_cfg.chunk_rows <= 0:
        problems.append(f"store.chunk_rows: {store_cfg.chunk_rows} must be a positive integer or null")
    if store_cfg.writer not in ("thread", "sync"):
        problems.append(f"store.writer: {store_cfg.writer!r} is unknown; use thread or sync")
    if store_cfg.queue_mb <= 0:
        problems.append(f"store.queue_mb: {store_cfg.queue_mb} must be > 0")
    return problems


def read_attrs(path: Path) -> Optional[dict]:
    """The root attributes of a hookrun store at `path`, or None if it is not one (read as JSON, no zarr)."""
    try:
        meta = json.loads((Path(path) / "zarr.json").read_text())
    except (OSError, ValueError):
        return None
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    return attrs if isinstance(attrs, dict) and "config_hash" in attrs and "status" in attrs else None


def is_complete(path: Path) -> bool:
    """Whether `path` holds a finished run."""
    return (read_attrs(path) or {}).get("status") == "complete"


def _foreign_entries(path: Path) -> List[str]:
    """What is at `path` that hookrun did not write (empty for an absent path, an empty dir or a store)."""
    if not path.exists():
        return []
    if not path.is_dir():
        return [path.name]
    if read_attrs(path) is not None:
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir() if p.name != LOCK_NAME)


def check_path(path: Path, mode: str, config_hash: str, config: dict) -> List[str]:
    """Problems with writing a run to `path` in `mode`: never into something hookrun did not write; an
    existing run needs overwrite or resume; a resume needs the same config and encoding."""
    foreign = _foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return [f"store.path: {path} exists and is not a hookrun store (it holds {shown}); hookrun never writes "
                "into or deletes what it did not create: choose another store.path"]
    attrs = read_attrs(path)
    if attrs is None:
        return []
    if mode == "create":
        return [f"store.path: {path} already holds a hookrun run (status {attrs.get('status')}); set "
                "store.mode=resume to continue it, store.mode=overwrite to replace it, or choose another store.path"]
    if mode == "resume":
        if attrs.get("config_hash") != config_hash:
            return [f"store.mode: resume refused, {path} was written with another config: "
                    f"{config_diff(attrs.get('config', {}), config) or 'config hash differs'}"]
        old, new = attrs.get("config", {}).get("store", {}), config.get("store", {})
        changed = [f"store.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in ENCODING_KEYS if old.get(k) != new.get(k)]
        if changed:
            return [f"store.mode: resume refused, the arrays of {path} are encoded and chunked otherwise "
                    f"({'; '.join(changed)}); one array keeps one encoding: resume with the old settings"]
    return []


def dim_names(role: str, ndim: int, unit: str) -> List[str]:
    """Names of a capture's axes after the first, prefixed by the role (roles of one layer share a group,
    and xarray needs one size per name): channel/height/width for image-like [N, C, H, W] captures,
    position/feature for [N, T, D] sequences, feature for [N, D]; <role>_dim_<i> otherwise."""
    known = {4: ["channel", "height", "width"], 3: ["position", "feature"], 2: ["feature"]}
    names = known.get(ndim) if unit == "sample" else (["feature"] if ndim == 2 else None)
    return [f"{role}_{n}" for n in names] if names else [f"{role}_dim_{i}" for i in range(1, ndim)]


def _clear_store(path: Path) -> None:
    """Remove what a previous hookrun run wrote at `path` (root metadata, index, array groups), nothing else."""
    for entry in path.iterdir():
        if entry.name == LOCK_NAME:
            continue
        if entry.name == INDEX_DIR or (entry.is_dir() and (entry / "zarr.json").exists()):
            shutil.rmtree(entry)
        elif entry.name == "zarr.json":
            entry.unlink()
        else:
            log.warning("overwrite: left %s in place (hookrun did not write it)", entry)


def config_diff(old: dict, new: dict, prefix: str = "") -> str:
    """The keys whose values differ between two resolved configs, as 'key: old -> new; ...'."""
    out = []
    for key in sorted(set(old) | set(new)):
        if key == "store" and not prefix:
            continue
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            sub = config_diff(a, b, f"{prefix}{key}.")
            if sub:
                out.append(sub)
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return "; ".join(out)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy; bfloat16 as its uint16 bit pattern (restored by analysis.load)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def stats(a: np.ndarray) -> dict:
    """Per-capture statistics for the index: mean, std, min, max, nan and inf counts (numpy, one thread)."""
    n = a.size
    if n == 0:
        return dict(mean=np.nan, std=np.nan, min=np.nan, max=np.nan, nan_count=0, inf_count=0, numel=0)
    flat = a.reshape(-1)
    if flat.dtype.kind != "f" or flat.dtype.itemsize < 4:
        flat = flat.astype(np.float32)
    lo, hi = flat.min(), flat.max()
    nan = inf = 0
    if not (np.isfinite(lo) and np.isfinite(hi)):  # min/max propagate NaN and show inf
        nan, inf = int(np.isnan(flat).sum()), int(np.isinf(flat).sum())
        flat = flat[np.isfinite(flat)]
        if not flat.size:
            return dict(mean=np.nan, std=np.nan, min=np.nan, max=np.nan, nan_count=nan, inf_count=inf, numel=n)
        lo, hi = flat.min(), flat.max()
    return dict(mean=(m := _mean(flat)), std=_std(flat, m), min=float(lo), max=float(hi),
                nan_count=nan, inf_count=inf, numel=n)


def _mean(flat: np.ndarray) -> float:
    return float(np.add.reduce(flat, dtype=flat.dtype)) / flat.size  # pairwise summation: accurate


def _std(flat: np.ndarray, mean: float, block: int = 1 << 16) -> float:
    """sqrt(E[x^2] - mean^2) from BLAS dot products over blocks (summed in float64): ~3x faster than
    np.std; falls back to the two-pass formula where the subtraction would cancel."""
    sq = sum(float(np.dot(flat[i:i + block], flat[i:i + block])) for i in range(0, flat.size, block)) / flat.size
    var = sq - mean * mean
    if var <= 1e-3 * mean * mean:
        return float(flat.std(dtype=np.float64))
    return var ** 0.5


class _BloscByTypesize(dict):
    """numcodecs Blosc encoders keyed by item size, configured like zarr's BloscCodec."""

    def __init__(self, cname: str, clevel: int, shuffle: str):
        super().__init__()
        self.args = dict(cname=cname, clevel=clevel, shuffle=SHUFFLES.index(shuffle))

    def __missing__(self, typesize: int):
        self[typesize] = Blosc(typesize=typesize, **self.args)
        return self[typesize]


@dataclass
class _Stream:
    """One array being written: its buffer of the chunk being filled and how far it is on disk.

    Rows [0, rows_flushed) sit in whole chunks that are final; `pending` holds rows_flushed..rows_assigned;
    rows up to rows_durable are on disk too (the last chunk written padded, rewritten when it grows)."""

    key: str
    array: object
    row_shape: tuple
    dtype: str
    per_sample: bool
    key_rows: int  # rows per stored object: a chunk, or a shard of chunks (store.shard_mb)
    sharded: bool = False
    rows_assigned: int = 0  # rows handed out to captures
    rows_flushed: int = 0  # rows in whole objects on disk (a multiple of key_rows)
    rows_durable: int = 0  # rows on disk, including a partial last object
    pending: list = field(default_factory=list)  # numpy blocks from rows_flushed on
    pending_bytes: int = 0
    raw_bytes: int = 0
    calls: int = 1  # calls per forward of the module (a reused module stores each call's rows)

    def block(self) -> np.ndarray:
        """The pending rows as one array (and kept as one block)."""
        if len(self.pending) > 1:
            self.pending = [np.concatenate(self.pending)]
        return self.pending[0]


@dataclass
class _Item:
    """A capture on its way to the writer: metadata, host tensor, and the CUDA event to wait on."""

    meta: object
    host: torch.Tensor
    event: object = None
    nbytes: int = 0


class Store:
    """Writes captures and their index into one Zarr store; one per run, holding the store's lock."""

    def __init__(self, path, cfg, attrs: dict, expected_samples: Optional[int] = None,
                 expected_batches: Optional[int] = None, on_nonfinite: str = "record"):
        self.path = Path(path)
        self.cfg = cfg
        self.expected_samples = expected_samples  # known sample and batch counts size chunks and arrays
        self.expected_batches = expected_batches
        self.on_nonfinite = on_nonfinite
        self.index_dir = self.path / INDEX_DIR
        self.compressors = None if cfg.codec == "none" else BloscCodec(cname=cfg.codec, clevel=cfg.level, shuffle=cfg.shuffle)
        self.blosc = None if cfg.codec == "none" else _BloscByTypesize(cfg.codec, cfg.level, cfg.shuffle)
        self.streams: Dict[str, _Stream] = {}
        self.rows: List[dict] = []  # index rows of batches not yet committed
        self.batch_rows: List[dict] = []  # records of finished batches not yet committed
        self.chunk_log: Dict[tuple, int] = {}  # (array, chunk) -> encoded bytes, written since the last commit
        self.parts = 0
        self.next_batch = 0  # the first batch this run must compute (> 0 when resuming)
        self.committed_samples = 0  # samples of the committed batches (rows of per-sample arrays before next_batch)
        self.warned: set = set()
        self.last_commit = time.perf_counter()
        self.write_seconds = 0.0
        self.error: Optional[BaseException] = None
        # one writer per store: the lock is taken before anything is written, and checked again under it
        self.lock = StoreLock(self.path).acquire()
        try:
            problems = check_path(self.path, cfg.mode, attrs.get("config_hash"), attrs.get("config", {}))
            if problems:
                raise ConfigError(problems)
            if cfg.mode == "resume" and read_attrs(self.path) is not None:
                self._reopen(attrs)
            else:
                if read_attrs(self.path) is not None:
                    _clear_store(self.path)  # overwrite: check_path allowed only a hookrun store here
                self.root = zarr.create_group(str(self.path), attributes={**attrs, "status": "running"})
                zarr.create_group(str(self.index_dir), attributes={"what": "hookrun index parts (parquet)"})
        except BaseException:
            self.lock.release()
            raise
        # queue and its byte budget
        self.budget = int(cfg.queue_mb * 2**20)
        self.queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.peak_queued_bytes = 0
        self.peak_pending_bytes = 0
        self.cond = threading.Condition()
        self.closing = False
        self.thread = None
        if cfg.writer == "thread":
            self.thread = threading.Thread(target=self._loop, name="hookrun-writer", daemon=True)
            self.thread.start()

    def _reopen(self, attrs: dict) -> None:
        """Resume: check the store against its committed index, drop uncommitted parts, reload the
        partial last chunk of each array into its buffer."""
        self.root = zarr.open_group(str(self.path), mode="r+")
        damaged = verify_store(self.root, self.index_dir)
        if damaged:
            raise ConfigError([f"store.mode: resume refused, {self.path} is damaged: {p}" for p in damaged] +
                              ["store.mode: rerun with store.mode=overwrite (or another store.path); "
                               "hookrun.open(path).verify() lists the damage"])
        self.parts = int(self.root.attrs.get("committed_parts", 0))
        committed = {f"{prefix}{n:06d}.parquet" for n in range(self.parts)
                     for prefix in ["part-", "batches-", *(f"{t}-" for t in side_tables(self.index_dir))]}
        for stray in self.index_dir.iterdir():
            if stray.suffix in (".tmp", ".parquet") and stray.name not in committed:
                stray.unlink()  # written by the killed run after its last commit: not committed
        index = pd.concat([pd.read_parquet(p) for p in committed_parts(self.index_dir, "part-", self.parts)]
                          or [pd.DataFrame(columns=INDEX_COLUMNS)], ignore_index=True)
        done = pd.concat([pd.read_parquet(p) for p in committed_parts(self.index_dir, "batches-", self.parts)]
                         or [pd.DataFrame(columns=BATCH_COLUMNS)])
        self.next_batch = int(done.batch.max()) + 1 if len(done) else 0
        self.committed_samples = int((done.sample_stop - done.sample_start).sum()) if len(done) else 0
        for key, rows in index.groupby("array"):
            array = self.root[key]
            committed_rows = int(rows.row_stop.max())
            key_rows = (array.shards or array.chunks)[0]
            start = committed_rows - committed_rows % key_rows
            pending = [array[start:committed_rows]] if committed_rows > start else []
            self.streams[key] = _Stream(
                key, array, tuple(array.shape[1:]), str(array.dtype), bool(array.attrs["per_sample"]), key_rows,
                sharded=array.shards is not None,
                rows_assigned=committed_rows, rows_flushed=start, rows_durable=committed_rows, pending=pending,
                pending_bytes=sum(p.nbytes for p in pending),
                raw_bytes=committed_rows * int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize,
                calls=int(rows.call.max()) + 1)
        self.root.attrs.update({**attrs, "status": "running", "resumed_at_batch": self.next_batch,
                                "committed_parts": self.parts})

    # -- hot path ------------------------------------------------------------------------------
    def submit(self, capture) -> None:
        """Take a capture from a hook: copy it to the host and queue it for the writer."""
        t = capture.tensor
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = t.detach().to("cpu", copy=True).contiguous(), None
        capture.tensor = None
        item = _Item(capture, host, event, host.numel() * host.element_size() + ITEM_OVERHEAD)
        if self.thread is None:
            self._handle(item)
        else:
            self._put(item)

    def end_batch(self, record: dict, tables: Optional[Dict[str, pd.DataFrame]] = None) -> None:
        """Queue a finished batch's record (samples, loss, timings); may commit every finished batch.

        `tables` are per-batch rows of named side tables (e.g. samples, tokens): they are committed
        with the batch as `_index/<name>-N.parquet` and merged into `<name>.parquet` at completion."""
        record = {**record, TABLES_KEY: dict(tables or {})}
        if self.thread is None:
            self._handle(record)
        else:
            self._put(record)

    def _put(self, item) -> None:
        nbytes = getattr(item, "nbytes", ITEM_OVERHEAD)
        with self.cond:
            while self.queue and self.queued_bytes + nbytes > self.budget and self.error is None:
                self.cond.wait(0.1)
            self._raise_if_failed()
            self.queue.append(item)
            self.queued_bytes += nbytes
            self.peak_queued_bytes = max(self.peak_queued_bytes, self.queued_bytes)
            self.cond.notify_all()

    def _raise_if_failed(self) -> None:
        if isinstance(self.error, NonFiniteError):
            raise self.error
        if self.error is not None:
            raise StoreError(f"writing {self.path} failed: {self.error}") from self.error

    # -- writer side ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:  # a lower priority than the model's threads: torch's OpenMP barriers stall when a core is taken
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait()
                if not self.queue:
                    return
                item = self.queue[0]
            try:
                if self.error is None:
                    self._handle(item)
            except BaseException as err:  # noqa: BLE001 - handed to the run thread
                self.error = err
            with self.cond:
                self.queue.popleft()
                self.queued_bytes -= getattr(item, "nbytes", ITEM_OVERHEAD)
                self.cond.notify_all()

    def _handle(self, item) -> None:
        start = time.perf_counter()
        if isinstance(item, dict):
            self.batch_rows.append(item)
            if time.perf_counter() - self.last_commit >= self.cfg.commit_s:
                self._commit()
        else:
            self._add(item)
        self.write_seconds += time.perf_counter() - start

    def _add(self, item: _Item) -> None:
        if item.event is not None:
            item.event.synchronize()
        cap, host = item.meta, item.host
        data = to_numpy(host)
        if not cap.per_sample:
            data = data[None]
        site = cap.site
        key = f"{site.hook}/{site.layer}/{site.role}"
        stream = self.streams.get(key) or self._create(key, cap, data, host.dtype)
        if data.shape[1:] != stream.row_shape or str(data.dtype) != stream.dtype or cap.per_sample != stream.per_sample:
            raise StoreError(
                f"{key}: batch {site.batch} captured shape {list(host.shape)} {host.dtype}, but earlier batches "
                f"stored rows of {list(stream.row_shape)} {stream.dtype}; one array holds one shape: pad inputs "
                "to a fixed size, reduce/select to one, or (for outputs whose axis 0 is not the batch, like "
                "sequence-first tensors) make the sample count a multiple of data.batch_size")
        row = dict(hook=site.hook, kind=cap.kind, layer=site.layer, role=site.role, call=site.call, batch=site.batch,
                   sample_start=site.sample_start, sample_stop=site.sample_stop, array=key,
                   row_start=stream.rows_assigned, row_stop=stream.rows_assigned + len(data),
                   shape=str(list(host.shape)), dtype=str(host.dtype).replace("torch.", ""),
                   per_sample=cap.per_sample, unit=getattr(cap, "unit", "sample"),
                   **stats(bf16_bits_to_float32(data) if host.dtype == torch.bfloat16 else data))
        if row["nan_count"] or row["inf_count"]:
            self._nonfinite(row)
        stream.rows_assigned += len(data)
        stream.calls = max(stream.calls, site.call + 1)
        stream.pending.append(data)
        stream.pending_bytes += data.nbytes
        stream.raw_bytes += data.nbytes
        self.rows.append(row)
        self.peak_pending_bytes = max(self.peak_pending_bytes, sum(s.pending_bytes for s in self.streams.values()))
        if stream.rows_assigned - stream.rows_flushed >= stream.key_rows:
            self._write_whole_chunks(stream)

    def _nonfinite(self, row: dict) -> None:
        what = (f"hooks.{row['hook']}: {row['layer']} {row['role']} in batch {row['batch']} (samples "
                f"{row['sample_start']}..{row['sample_stop']}) has {row['nan_count']} NaN and {row['inf_count']} inf values")
        if self.on_nonfinite == "error":
            raise NonFiniteError(f"{what}; on_nonfinite=error stops the run (record or warn keep going)")
        if self.on_nonfinite == "warn" and row["array"] not in self.warned:
            self.warned.add(row["array"])
            log.warning("%s (further ones in this array are only counted in the index)", what)

    def _create(self, key: str, cap, data: np.ndarray, dtype: torch.dtype) -> _Stream:
        row_shape = data.shape[1:]
        row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * data.dtype.itemsize)
        chunk_rows = self.cfg.chunk_rows or max(1, int(self.cfg.chunk_mb * 2**20) // row_bytes)
        unit = getattr(cap, "unit", "sample")  # sample | token (one row per stored token of a text batch) | batch
        expected = self._expected_rows(cap.per_sample) if unit != "token" else None
        if expected:
            chunk_rows = min(chunk_rows, expected)
        shard_rows = None
        if self.cfg.shard_mb:  # whole shards of whole chunks: one file per shard, written at once
            per_shard = max(1, int(self.cfg.shard_mb * 2**20) // (row_bytes * chunk_rows))
            if expected:
                per_shard = min(per_shard, -(-expected // chunk_rows))
            shard_rows = per_shard * chunk_rows
        attrs = {"per_sample": cap.per_sample, "kind": cap.kind, "unit": unit}
        if dtype == torch.bfloat16:
            attrs["hookrun_dtype"] = "bfloat16"
        array = self.root.create_array(  # overwrite: a killed run may have left it uncommitted
            key, overwrite=True, shape=(0, *row_shape), chunks=(chunk_rows, *row_shape), dtype=data.dtype,
            shards=(shard_rows, *row_shape) if shard_rows else None,
            compressors=self.compressors, fill_value=0, attributes=attrs,
            chunk_key_encoding={"name": "default", "separator": "."},  # flat c.<i>.0.0: no directory per chunk
            # roles of one layer share a group: dims are named per role so xarray can open the group
            dimension_names=(unit, *dim_names(cap.site.role, data.ndim, unit)))
        stream = _Stream(key, array, row_shape, str(data.dtype), cap.per_sample, shard_rows or chunk_rows,
                         sharded=shard_rows is not None)
        self.streams[key] = stream
        return stream

    def _expected_rows(self, per_sample: bool) -> Optional[int]:
        return self.expected_samples if per_sample else self.expected_batches

    def _ensure_rows(self, stream: _Stream, stop: int) -> None:
        if stop > stream.array.shape[0]:
            # pre-size once when the record count is known; grow as needed otherwise
            stream.array.resize((max(stop, self._expected_rows(stream.per_sample) or 0), *stream.row_shape))

    def _write_whole_chunks(self, stream: _Stream) -> None:
        """Write every whole chunk (or shard) of pending rows; they are final. The rest stays pending."""
        block = stream.block()
        cr = stream.key_rows
        n = len(block) - len(block) % cr
        if n <= 0:
            return
        start = stream.rows_flushed
        self._ensure_rows(stream, start + n)
        for k in range(0, n, cr):
            self._put_chunk(stream, (start + k) // cr, block[k:k + cr])
        rest = block[n:]
        stream.pending = [rest] if len(rest) else []
        stream.pending_bytes = rest.nbytes
        stream.rows_flushed = start + n
        stream.rows_durable = max(stream.rows_durable, stream.rows_flushed)

    def _write_partial_chunk(self, stream: _Stream) -> None:
        """Make every assigned row durable: write the pending rows as the last chunk, padded with the
        fill value as zarr pads; they stay pending, so the chunk is rewritten whole once it fills."""
        if stream.rows_durable >= stream.rows_assigned or not stream.pending:
            return
        block = stream.block()
        self._ensure_rows(stream, stream.rows_assigned)
        if not stream.sharded:
            chunk = np.zeros((stream.key_rows, *stream.row_shape), dtype=block.dtype)
            chunk[:len(block)] = block
            block = chunk
        self._put_chunk(stream, stream.rows_flushed // stream.key_rows, block)
        stream.rows_durable = stream.rows_assigned

    def _put_chunk(self, stream: _Stream, index: int, chunk: np.ndarray) -> None:
        """Write one whole chunk file, encoded exactly as zarr would (bytes codec, little endian, then
        blosc), without zarr's per-write overhead; temp file then rename, like zarr's own writes.
        A shard (rows `index * key_rows` on, whole or the partial last one) goes through zarr itself."""
        if stream.sharded:
            start = index * stream.key_rows
            stream.array[start:start + len(chunk)] = chunk
            name = stream.array.metadata.encode_chunk_key((index,) + (0,) * len(stream.row_shape))
            self.chunk_log[stream.key, index] = sync(self.root.store.getsize(f"{stream.key}/{name}"))
            return
        chunk = np.ascontiguousarray(chunk, dtype=chunk.dtype.newbyteorder("<"))
        data = memoryview(chunk).cast("B") if self.blosc is None else self.blosc[chunk.dtype.itemsize].encode(chunk)
        path = self.path / stream.key / ".".join(["c", str(index)] + ["0"] * len(stream.row_shape))
        tmp = path.with_name(path.name + ".partial")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # on a full disk this frees room for the final status
            raise
        self.chunk_log[stream.key, index] = len(data)

    def _commit(self) -> None:
        """Make every finished batch durable: the partial chunks holding its rows, then its index rows and
        side tables, the sizes of the chunks written since the last commit, and last the batch records
        that mark the part committed (each file a temp file, then a rename)."""
        self.last_commit = time.perf_counter()
        if not self.batch_rows:
            return
        for stream in self.streams.values():
            self._write_partial_chunk(stream)
        ready, self.batch_rows = self.batch_rows, []
        done = {r["batch"] for r in ready}
        rows = [r for r in self.rows if r["batch"] in done]
        self.rows = [r for r in self.rows if r["batch"] not in done]
        tables: Dict[str, list] = collections.defaultdict(list)
        for record in ready:
            for name, frame in record[TABLES_KEY].items():
                tables[name].append(frame)
        n = f"{self.parts:06d}"
        _write_parquet(pd.DataFrame(rows, columns=INDEX_COLUMNS), self.index_dir / f"part-{n}.parquet")
        for name, frames in tables.items():
            _write_parquet(pd.concat(frames, ignore_index=True), self.index_dir / f"{name}-{n}.parquet")
        chunks = pd.DataFrame([(a, c, b) for (a, c), b in self.chunk_log.items()], columns=["array", "chunk", "nbytes"])
        _write_parquet(chunks, self.index_dir / f"chunks-{n}.parquet")
        _write_parquet(pd.DataFrame([{k: r[k] for k in BATCH_COLUMNS} for r in ready], columns=BATCH_COLUMNS),
                       self.index_dir / f"batches-{n}.parquet")
        self.chunk_log = {}
        self.parts += 1
        self.root.attrs["committed_parts"] = self.parts
        pa.default_memory_pool().release_unused()  # arrow's allocator keeps freed pages: memory would grow with the run

    # -- end -----------------------------------------------------------------------------------
    def close(self, status: str, summary: Optional[dict] = None) -> None:
        """Drain the queue, commit every finished batch, and for a complete run check the store against its
        index, write the merged index, the final status and summary; release the lock."""
        try:
            self._close(status, summary)
        finally:
            self.lock.release()

    def _close(self, status: str, summary: Optional[dict]) -> None:
        if self.thread is not None:
            with self.cond:
                self.closing = True
                self.cond.notify_all()
            self.thread.join()
        final = "failed"
        try:
            if self.error is None:
                if status == "complete":
                    for stream in self.streams.values():
                        self._write_partial_chunk(stream)
                self._commit()
                if status == "complete":
                    for stream in self.streams.values():
                        if stream.array.shape[0] != stream.rows_assigned:
                            stream.array.resize((stream.rows_assigned, *stream.row_shape))
                    damaged = verify_store(self.root, self.index_dir)
                    pa.default_memory_pool().release_unused()
                    if damaged:
                        raise StoreError(f"{self.path} does not read back as written: {'; '.join(damaged)}")
                    self._write_merged()
                final = status
        except BaseException as err:
            self.error = self.error or err
            raise
        finally:
            final = final if self.error is None else "failed"
            summary = {**(summary or {}), "write_s": self.write_seconds, "arrays": self.array_summary()}
            self.root.attrs.update({"status": final, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                    "summary": summary})
        if final == "complete":  # one read of the root lists every array (xarray opens it without a warning)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)  # "not part of the v3 spec" (it works)
                zarr.consolidate_metadata(str(self.path))
        if final == "complete":  # the parts go only once the status says the merged files are whole
            for prefix in ["part-", *(f"{name}-" for name in side_tables(self.index_dir)), "batches-"]:
                for part in committed_parts(self.index_dir, prefix, self.parts):
                    part.unlink()
        self._raise_if_failed()

    def _write_merged(self) -> None:
        """index.parquet, batches.parquet and each side table from every part, beside the parts (which stay
        until the status says complete). Streamed part by part, so memory does not grow with the run."""
        merges = [("part-", "index.parquet"), ("batches-", "batches.parquet")]
        merges += [(f"{name}-", f"{name}.parquet") for name in side_tables(self.index_dir)]
        for prefix, name in merges:
            _merge_parquet(committed_parts(self.index_dir, prefix, self.parts), self.index_dir / name,
                           order=forward_order if prefix == "part-" else None)
            pa.default_memory_pool().release_unused()

    def array_summary(self) -> List[dict]:
        """Per array: layer, role, calls, shape of one call (what `load(..., call=c)` returns), dtype, bytes."""
        out = []
        for key, s in self.streams.items():
            hook, layer, role = key.split("/", 2)
            stored = sum(f.stat().st_size for f in (self.path / key).rglob("*") if f.is_file())
            out.append(dict(hook=hook, layer=layer, role=role, calls=s.calls,
                            shape=[s.rows_assigned // s.calls, *s.row_shape], dtype=s.dtype,
                            raw_bytes=s.raw_bytes, stored_bytes=stored))
        return out


INDEX_COLUMNS = ["hook", "kind", "layer", "role", "call", "batch", "sample_start", "sample_stop", "array",
                 "row_start", "row_stop", "shape", "dtype", "per_sample", "unit", "mean", "std", "min", "max",
                 "nan_count", "inf_count", "numel"]
BATCH_COLUMNS = ["batch", "sample_start", "sample_stop", "loss", "forward_s", "backward_s"]
TABLES_KEY = "_tables"  # a batch record's side tables (name -> DataFrame), committed with it


def forward_order(index: pd.DataFrame) -> pd.DataFrame:
    """Index rows sorted by batch, hook, then each hook's layers and calls in forward order, then role.

    Rows arrive in capture order: forward in forward order, gradient kinds (backward*, *_grad) in
    backward order, so the (layer, call) blocks of a gradient hook are reversed within their batch."""
    if not len(index):
        return index
    keys = ["batch", "hook", "layer", "call"]
    blocks = index.drop_duplicates(keys)[[*keys, "kind"]].copy()
    blocks["position"] = blocks.groupby(["batch", "hook"]).cumcount()
    grad = blocks.kind.str.startswith("backward") | blocks.kind.str.endswith("_grad")
    last = blocks.groupby(["batch", "hook"]).position.transform("max")
    blocks.loc[grad, "position"] = last[grad] - blocks.position[grad]
    ordered = index.merge(blocks[[*keys, "position"]], on=keys, how="left")
    ordered = ordered.sort_values(["batch", "hook", "position", "role"], kind="stable", ignore_index=True)
    return ordered.drop(columns="position")


def _merge_parquet(parts: List[Path], path: Path, order=None) -> None:
    """Concatenate parquet parts into one file (temp file, then rename), one part in memory at a time;
    `order(DataFrame) -> DataFrame` orders the rows within each part (a part holds whole batches, in order)."""
    import pyarrow.parquet as pq

    tables = (pq.read_table(p) for p in parts)
    writer, schema, tmp = None, None, path.with_suffix(".tmp")
    try:
        for table in tables:
            if not table.num_rows and schema is not None:
                continue
            if order is not None and table.num_rows:
                table = pa.Table.from_pandas(order(table.to_pandas()), preserve_index=False)
            if writer is None:
                schema = table.schema
                writer = pq.ParquetWriter(tmp, schema)
            writer.write_table(table.cast(schema) if table.num_rows else table)
            del table
            pa.default_memory_pool().release_unused()  # else arrow's allocator keeps every part's pages
        if writer is None:  # no parts at all
            pq.write_table(pa.table({}), tmp)
    finally:
        if writer is not None:
            writer.close()
    os.replace(tmp, path)


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    """Write a parquet file atomically: temp file, then rename."""
    tmp = path.with_suffix(".tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def versions() -> dict:
    """Versions of the packages a run depends on, for the store attrs."""
    import hydra
    import omegaconf

    import hookrun

    return {"hookrun": hookrun.__version__, "torch": torch.__version__, "zarr": zarr.__version__,
            "numpy": np.__version__, "pandas": pd.__version__, "hydra": hydra.__version__,
            "omegaconf": omegaconf.__version__}
