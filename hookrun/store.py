"""The Zarr writer and the parquet index: the only module that writes a store.

    captures.zarr/<hook>/<layer>/<role>     one array per stream, axis 0 = record, chunked along it
    captures.zarr/_index/part-*.parquet     index rows of whole batches, written after their data
    captures.zarr/_index/batches-*.parquet  one row per committed batch: samples, loss, timings
    captures.zarr/_index/index.parquet      all rows (and batches.parquet), once the run is complete

A batch is committed when every capture of it is on disk: its index rows and batch record go
into the next part (temp file, then rename). A killed run leaves a readable store whose index
describes only committed batches; `store.mode=resume` continues after the last of them.

Hooks call `submit(capture)`: it copies the tensor off the device (non-blocking into pinned
memory on CUDA) and queues it. A writer thread turns captures into numpy, computes their
statistics, buffers whole chunks per array and writes them; a byte budget on the queue gives
backpressure. A writer error is raised in the run at its next submit or at close.
"""
from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pandas as pd
import torch
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec

from hookrun.analysis import bf16_bits_to_float32, committed_parts, side_tables
from hookrun.config import suggest

CODECS = ("none", "lz4", "zstd", "blosclz", "lz4hc", "zlib")
SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")
INDEX_DIR = "_index"
log = logging.getLogger("hookrun")
MODES = ("create", "overwrite", "resume")


class NonFiniteError(RuntimeError):
    """A capture held NaN or inf values and on_nonfinite is error."""


class StoreError(RuntimeError):
    """The store could not be written (exists, disk full, permission denied, writer failure)."""


def check_spec(store_cfg) -> List[str]:
    """Problems with the `store` entry."""
    problems = []
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
    if store_cfg.chunk_rows is not None and store_cfg.chunk_rows <= 0:
        problems.append(f"store.chunk_rows: {store_cfg.chunk_rows} must be a positive integer or null")
    if store_cfg.writer not in ("thread", "sync"):
        problems.append(f"store.writer: {store_cfg.writer!r} is unknown; use thread or sync")
    if store_cfg.queue_mb <= 0:
        problems.append(f"store.queue_mb: {store_cfg.queue_mb} must be > 0")
    return problems


def is_complete(path: Path) -> bool:
    """Whether `path` holds a finished run."""
    try:
        return zarr.open_group(str(path), mode="r").attrs.get("status") == "complete"
    except Exception:  # noqa: BLE001 - absent or not a store
        return False


def check_path(path: Path, mode: str, config_hash: str, config: dict) -> List[str]:
    """Problems with writing a run to `path` in `mode` (an existing run needs overwrite or resume)."""
    if not path.exists():
        return []
    if mode == "create":
        return [f"store.path: {path} already holds a run; set store.mode=overwrite to replace it, "
                "store.mode=resume to continue it, or choose another store.path"]
    if mode == "resume":
        try:
            attrs = zarr.open_group(str(path), mode="r").attrs
        except Exception as err:  # noqa: BLE001
            return [f"store.path: {path} is not a hookrun store ({err}); use store.mode=overwrite or another path"]
        if attrs.get("config_hash") != config_hash:
            return [f"store.mode: resume refused, {path} was written with another config: "
                    f"{config_diff(attrs.get('config', {}), config) or 'config hash differs'}"]
    return []


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
    """One array being written: its buffer of whole chunks-to-be and how far it is committed."""

    key: str
    array: object
    row_shape: tuple
    dtype: str
    per_sample: bool
    chunk_rows: int
    rows_assigned: int = 0  # rows handed out to captures
    rows_written: int = 0  # rows on disk (whole chunks, or everything after close)
    pending: list = field(default_factory=list)  # numpy blocks not yet written
    pending_bytes: int = 0
    raw_bytes: int = 0


@dataclass
class _Item:
    """A capture on its way to the writer: metadata, host tensor, and the CUDA event to wait on."""

    meta: object
    host: torch.Tensor
    event: object = None
    nbytes: int = 0


class Store:
    """Writes captures and their index into one Zarr store; one per run."""

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
        self.parts = 0
        self.next_batch = 0  # the first batch this run must compute (> 0 when resuming)
        self.warned: set = set()
        self.last_commit = time.perf_counter()
        self.write_seconds = 0.0
        self.error: Optional[BaseException] = None
        if cfg.mode == "resume" and (self.path / "zarr.json").exists():
            self._reopen(attrs)
        else:
            if self.path.exists():
                shutil.rmtree(self.path)  # check_path refused this unless mode is overwrite
            self.root = zarr.open_group(str(self.path), mode="w", attributes={**attrs, "status": "running"})
            zarr.open_group(str(self.index_dir), mode="w", attributes={"what": "hookrun index parts (parquet)"})
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
        """Resume: keep committed batches, reload the partial chunk of each array into its buffer."""
        self.root = zarr.open_group(str(self.path), mode="r+")
        parts = committed_parts(self.index_dir, "part-")
        kept = set(parts) | set(committed_parts(self.index_dir, "batches-"))
        kept |= {p for name in side_tables(self.index_dir) for p in committed_parts(self.index_dir, f"{name}-")}
        for stray in set(self.index_dir.glob("*.tmp")) | set(self.index_dir.glob("*-*.parquet")) - kept:
            stray.unlink()  # a part whose batches file was never written was not committed
        self.parts = int(parts[-1].stem.split("-")[1]) + 1 if parts else 0
        frames = [pd.read_parquet(p) for p in parts]
        index = pd.concat([f for f in frames if len(f)] or [pd.DataFrame(columns=INDEX_COLUMNS)], ignore_index=True)
        batches = [pd.read_parquet(p) for p in committed_parts(self.index_dir, "batches-")]
        done = pd.concat([b for b in batches if len(b)] or [pd.DataFrame(columns=BATCH_COLUMNS)])
        self.next_batch = int(done.batch.max()) + 1 if len(done) else 0
        for key, rows in index.groupby("array"):
            array = self.root[key]
            committed = int(rows.row_stop.max())
            chunk_rows = array.chunks[0]
            start = committed - committed % chunk_rows
            pending = [array[start:committed]] if committed > start else []
            stream = _Stream(key, array, tuple(array.shape[1:]), str(array.dtype), bool(array.attrs["per_sample"]),
                             chunk_rows, rows_assigned=committed, rows_written=start, pending=pending,
                             pending_bytes=sum(p.nbytes for p in pending),
                             raw_bytes=committed * int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize)
            self.streams[key] = stream
        self.root.attrs.update({**attrs, "status": "running", "resumed_at_batch": self.next_batch})

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
        item = _Item(capture, host, event, host.numel() * host.element_size())
        if self.thread is None:
            self._handle(item)
        else:
            self._put(item)

    def end_batch(self, record: dict, tables: Optional[Dict[str, pd.DataFrame]] = None) -> None:
        """Queue a batch's record (samples, loss, timings); may flush an index part.

        `tables` are per-batch rows of named side tables (e.g. samples, tokens): they are committed
        with the batch as `_index/<name>-N.parquet` and merged into `<name>.parquet` at completion."""
        record = {**record, TABLES_KEY: dict(tables or {})}
        if self.thread is None:
            self._handle(record)
        else:
            self._put(record)

    def _put(self, item) -> None:
        nbytes = getattr(item, "nbytes", 0)
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
                self.queued_bytes -= getattr(item, "nbytes", 0)
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
        stream.pending.append(data)
        stream.pending_bytes += data.nbytes
        stream.raw_bytes += data.nbytes
        self.rows.append(row)
        self.peak_pending_bytes = max(self.peak_pending_bytes, sum(s.pending_bytes for s in self.streams.values()))
        if stream.rows_assigned - stream.rows_written >= stream.chunk_rows:
            self._write(stream, whole_chunks=True)

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
        attrs = {"per_sample": cap.per_sample, "kind": cap.kind, "unit": unit}
        if dtype == torch.bfloat16:
            attrs["hookrun_dtype"] = "bfloat16"
        array = self.root.create_array(  # overwrite: a killed run may have left it uncommitted
            key, overwrite=True, shape=(0, *row_shape), chunks=(chunk_rows, *row_shape), dtype=data.dtype,
            compressors=self.compressors, fill_value=0, attributes=attrs,
            chunk_key_encoding={"name": "default", "separator": "."},  # flat c.<i>.0.0: no directory per chunk
            # roles of one layer share a group: dims are named per role so xarray can open the group
            dimension_names=(unit, *(f"{cap.site.role}_dim_{i}" for i in range(1, data.ndim))))
        stream = _Stream(key, array, row_shape, str(data.dtype), cap.per_sample, chunk_rows)
        self.streams[key] = stream
        return stream

    def _expected_rows(self, per_sample: bool) -> Optional[int]:
        return self.expected_samples if per_sample else self.expected_batches

    def _write(self, stream: _Stream, whole_chunks: bool) -> None:
        """Write pending rows: only whole chunks, or everything (at close)."""
        block = np.concatenate(stream.pending) if len(stream.pending) > 1 else stream.pending[0]
        cr = stream.chunk_rows
        n = len(block) - len(block) % cr if whole_chunks else len(block)
        if n <= 0:
            return
        start, stop = stream.rows_written, stream.rows_written + n
        if stop > stream.array.shape[0]:
            # pre-size once when the record count is known; grow as needed otherwise
            stream.array.resize((max(stop, self._expected_rows(stream.per_sample) or 0), *stream.row_shape))
        whole = n - n % cr
        for k in range(0, whole, cr):
            self._put_chunk(stream, (start + k) // cr, block[k:k + cr])
        if whole < n:  # the last, partial chunk at close: zarr pads it
            stream.array[start + whole:stop] = block[whole:n]
        rest = block[n:]
        stream.pending = [rest] if len(rest) else []
        stream.pending_bytes = rest.nbytes
        stream.rows_written = stop

    def _put_chunk(self, stream: _Stream, index: int, chunk: np.ndarray) -> None:
        """Write one whole chunk file, encoded exactly as zarr would (bytes codec, little endian, then
        blosc), without zarr's per-write overhead; temp file then rename, like zarr's own writes."""
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

    def _commit(self) -> None:
        """Write the index rows and records of every finished batch whose captures are all on disk."""
        unwritten = {r["batch"] for r in self.rows if r["row_stop"] > self.streams[r["array"]].rows_written}
        ready = []
        for record in self.batch_rows:
            if record["batch"] in unwritten:
                break  # batches commit in order
            ready.append(record)
        if ready:
            done = {r["batch"] for r in ready}
            rows = [r for r in self.rows if r["batch"] in done]
            self.rows = [r for r in self.rows if r["batch"] not in done]
            self.batch_rows = self.batch_rows[len(ready):]
            # data first (above), then the index part and side tables, then the batch records that mark them committed
            _write_parquet(pd.DataFrame(rows, columns=INDEX_COLUMNS), self.index_dir / f"part-{self.parts:06d}.parquet")
            tables: Dict[str, list] = collections.defaultdict(list)
            for record in ready:
                for name, frame in record[TABLES_KEY].items():
                    tables[name].append(frame)
            for name, frames in tables.items():
                _write_parquet(pd.concat(frames, ignore_index=True), self.index_dir / f"{name}-{self.parts:06d}.parquet")
            _write_parquet(pd.DataFrame([{k: r[k] for k in BATCH_COLUMNS} for r in ready], columns=BATCH_COLUMNS),
                           self.index_dir / f"batches-{self.parts:06d}.parquet")
            self.parts += 1
        self.last_commit = time.perf_counter()

    # -- end -----------------------------------------------------------------------------------
    def close(self, status: str, summary: Optional[dict] = None) -> None:
        """Drain the queue, write every pending row, the merged index, the final status and summary."""
        if self.thread is not None:
            with self.cond:
                self.closing = True
                self.cond.notify_all()
            self.thread.join()
        final = "failed"
        try:
            if self.error is None:
                for stream in self.streams.values():
                    if stream.pending:
                        self._write(stream, whole_chunks=False)
                    if stream.array.shape[0] != stream.rows_written:
                        stream.array.resize((stream.rows_written, *stream.row_shape))
                self._commit()
                if status == "complete":
                    self._write_merged()
                final = status
        finally:
            final = final if self.error is None else "failed"
            summary = {**(summary or {}), "write_s": self.write_seconds, "arrays": self.array_summary()}
            self.root.attrs.update({"status": final, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                    "summary": summary})
        if final == "complete":  # the parts go only once the status says the merged files are whole
            for prefix in ["part-", *(f"{name}-" for name in side_tables(self.index_dir)), "batches-"]:
                for part in committed_parts(self.index_dir, prefix):
                    part.unlink()
        self._raise_if_failed()

    def _write_merged(self) -> None:
        """index.parquet and batches.parquet from every part, beside the parts (which stay until complete)."""
        merges = [("part-", "index.parquet", INDEX_COLUMNS), ("batches-", "batches.parquet", BATCH_COLUMNS)]
        merges += [(f"{name}-", f"{name}.parquet", None) for name in side_tables(self.index_dir)]
        for prefix, name, columns in merges:
            frames = [f for f in (pd.read_parquet(p) for p in committed_parts(self.index_dir, prefix)) if len(f)]
            merged = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
            if prefix == "part-":
                merged = merged.sort_values(["batch", "hook", "layer", "call", "role"], kind="stable", ignore_index=True)
            _write_parquet(merged, self.index_dir / name)

    def array_summary(self) -> List[dict]:
        """Per array: layer, role, shape, dtype, bytes raw and stored."""
        out = []
        for key, s in self.streams.items():
            hook, layer, role = key.split("/", 2)
            stored = sum(f.stat().st_size for f in (self.path / key).rglob("*") if f.is_file())
            out.append(dict(hook=hook, layer=layer, role=role, shape=[s.rows_written, *s.row_shape], dtype=s.dtype,
                            raw_bytes=s.raw_bytes, stored_bytes=stored))
        return out


INDEX_COLUMNS = ["hook", "kind", "layer", "role", "call", "batch", "sample_start", "sample_stop", "array",
                 "row_start", "row_stop", "shape", "dtype", "per_sample", "unit", "mean", "std", "min", "max",
                 "nan_count", "inf_count", "numel"]
BATCH_COLUMNS = ["batch", "sample_start", "sample_stop", "loss", "forward_s", "backward_s"]
TABLES_KEY = "_tables"  # a batch record's side tables (name -> DataFrame), committed with it


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
