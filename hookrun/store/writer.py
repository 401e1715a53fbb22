"""The Store: one run's writer, tying the lock, the queue, the array streams and the index together.

    store = Store.open(location, cfg.store, attrs, writer)   # lock, create (or reopen, to resume); thread | sync
    store.submit(capture)                       # from a hook: copy off the device, queue
    store.end_batch(record, tables)             # a finished batch; commits every commit_s seconds
    store.end_batch(record, tables, commit=True)   # ... committed before end_batch returns
    store.close("complete")                     # drain, commit, verify, merge the index, mark complete

The store is whole at every moment a kill can come (hookrun.format.verify checks it):
- creation writes the root group (with its attrs) first, then `_index`; a resume adds a missing `_index`.
- the close commits, trims, checks, merges the index beside its parts, then writes `status: complete` with the
  size and crc32c of each merged file, the consolidated metadata and the crc32c of the root attrs and consolidated
  metadata (root_crc32c) in one write of the root, and only then removes the parts. A kill before that write leaves
  a running store that a resume finishes like any other; after it, a complete one whose leftover parts
  `finish_close` (the resume of a complete store) removes.

Hooks call `submit(capture)`: it copies the tensor off the device (on CUDA: into pinned memory, on a
side stream, without waiting) and queues it; a sync writer on CPU reads the model's tensor in the
hook itself, without a copy. The writer (thread, or the hook itself when sync) turns captures into
numpy, computes their statistics and hands their rows to the streams. A writer error is raised in
the run at its next submit or at close.
"""
from __future__ import annotations

import functools
import json
import logging
import time
import unicodedata
import uuid
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
import zarr

from hookrun.config.checks import ConfigError
from hookrun.format.files import index_sources, rank_committed, root_meta, root_sum
from hookrun.format.layout import (COMPLETE, FAILED, FORMAT_VERSION, INDEX_DIR, INPUTS, INPUTS_RULE, MANIFEST, ROOT_SUM,
                                   RUN_ID, RUNNING, STATUS, STITCHED_DIR, SUMS_FROM, VERSION, array_key,
                                   bf16_bits_to_float32, head_key, is_part, is_sums, is_writer_dir, rank_dir,
                                   to_stored)
from hookrun.storage import Location
from hookrun.format.verify import verify_store
from hookrun.store.lock import NoLock, store_lock
from hookrun.store.host import HostCopier
from hookrun.store.index import TABLES_KEY, Index, merge, remove_parts
from hookrun.store.parallel import Share, stitch
from hookrun.store.place import check_path, clear_store, read_attrs, write_root
from hookrun.store.queue import WriteQueue
from hookrun.store.spec import WRITER_MODES, NonFiniteError, StoreError
from hookrun.store.stats import stats, stats_from_sums
from hookrun.store.streams import Streams

log = logging.getLogger("hookrun")
COMMIT_KEY = "_commit"  # a batch record to commit at once (end_batch(commit=True))
ITEM_OVERHEAD = 16384  # bytes a queued item is counted as beyond its data (its Python objects, ~1-2 KB, with room): a budget on tiny captures too


@dataclass
class _Item:
    """A capture on its way to the writer: metadata, host tensor, and the CUDA event to wait on."""

    meta: object
    host: torch.Tensor
    event: object = None
    nbytes: int = 0
    borrowed: bool = False  # host is the model's own tensor (sync writer on CPU): rows kept past the hook are copied
    sums: object = None  # the statistics' sums, computed on the device (CUDA captures)


@functools.lru_cache(maxsize=None)
def _name(dtype) -> str:
    """A numpy or torch dtype's name as the index and the streams write it (float32, bfloat16): str() of a numpy
    dtype runs Python code in numpy, ~10 us a capture."""
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=1024)
def _shape_text(shape: tuple) -> str:
    """A capture's shape as the index writes it: "[8, 2, 64]"."""
    return str(list(shape))


def _rows(piece, data: np.ndarray) -> np.ndarray:
    """A capture's rows: itself for per-sample captures, one row for the others."""
    return data if piece.per_sample else data[None]


class Store:
    """Writes captures and their index into one Zarr store; one per run, holding the store's lock.

    `Store.open(...)` opens one; the constructor only records what the store is given (no I/O, no lock, no
    thread)."""

    def __init__(self, location: Location, cfg, writer: str, expected_samples: Optional[int] = None,
                 expected_batches: Optional[int] = None, on_nonfinite: str = "record", share: Optional[Share] = None,
                 expected_tokens: Optional[int] = None):
        if writer not in WRITER_MODES:
            raise ValueError(f"writer: {writer!r}; give thread or sync (store.writer=auto is decided by writer_mode)")
        self.location = location
        self.path = location.url  # for messages
        self.cfg = cfg
        self.writer = writer  # thread | sync
        self.expected = (expected_samples, expected_batches, expected_tokens)  # known counts size chunks and arrays
        self.on_nonfinite = on_nonfinite
        self.share = share if share is not None and share.world > 1 else None  # None: one process
        self.rank = self.share.rank if self.share else 0
        self.next_batch = self.share.first_batch if self.share else 0  # the first batch to compute (later when resuming)
        self.committed_samples = 0  # rows of per-sample arrays before next_batch (cap.samples.row)
        self.resumed = False  # whether this continues a stopped run (rank 0 knows; other ranks see next_batch)
        self.fresh = False  # whether no key of the store holds anything of an array: made new, or an overwrite that
        # left nothing but the root and the index group (rank 0 knows)
        self.warned: set = set()
        self.last_commit = time.perf_counter()
        self.write_seconds = 0.0  # the writer's busy time, wall clock
        self.write_cpu_seconds = 0.0  # and its own CPU time in it
        self.copier = HostCopier()  # CUDA captures: pinned buffers, side-stream copies
        self.lock = NoLock()  # open(): the store's lock (rank 0 holds it for every rank)
        self.root: Optional[zarr.Group] = None  # open(): the root group, the arrays, the index, the writer's queue
        self.streams: Optional[Streams] = None
        self.index: Optional[Index] = None
        self.queue: Optional[WriteQueue] = None
        self.summary: Optional[dict] = None  # close(): the summary written in the root attrs

    @classmethod
    def open(cls, location, cfg, attrs: dict, writer: str, **settings) -> "Store":
        """The store at `location` (a Location or a path) opened for writing: its lock taken, created with the root
        `attrs` (or reopened for a resume; each rank of a data-parallel run at its own rows), its writer started.
        `settings`: expected_samples, expected_batches, expected_tokens, on_nonfinite, share (as the constructor takes them)."""
        store = cls(location if isinstance(location, Location) else Location(location), cfg, writer, **settings)
        # one writer per store: the lock is taken before anything is written, and checked again under it;
        # in a data-parallel run rank 0 holds it for every rank
        store.lock = store_lock(store.location).acquire() if store.rank == 0 else NoLock()
        try:
            store._open(attrs)
        except BaseException:
            store.lock.release()
            raise
        store.queue = WriteQueue(store._handle, int(cfg.queue_mb * 2**20), thread=writer == "thread")
        return store

    def _open(self, attrs: dict) -> None:
        """Rank 0 creates (or reopens) the store; then every rank opens its rows, once all know rank 0 could."""
        error: Optional[BaseException] = None
        try:
            if self.rank == 0:
                self._open_as_owner(attrs)
        except BaseException as err:  # noqa: BLE001 - told to the other ranks first, then raised
            error = err
        if self.share:  # every rank learns whether rank 0 could open the store
            owner = self.share.gather(getattr(error, "problems", [str(error)]) if error else None)[0]
            if owner and error is None:
                error = ConfigError(owner) if isinstance(owner, list) else StoreError(owner)
            if error is None:
                try:
                    self._open_as_rank()
                except BaseException as err:  # noqa: BLE001
                    error = err
        if error is not None:
            raise error

    def _open_as_owner(self, attrs: dict) -> None:
        """Check the path, then create the store (and, for ranks, every array) or reopen it for a resume."""
        resume = self._create(attrs)
        self.root = self._open_root()
        self.streams = Streams(self.location, self.root, self.cfg, *self.expected, fresh=self.fresh)
        self.index = Index(self.location, self.root)
        self.resumed = resume
        if resume:
            self._resume(attrs)
        elif self.share:  # every array made once, at its final size, before any rank writes
            for key, (piece, host) in self.share.first.items():
                data = _rows(piece, to_stored(host))
                stream = self.streams.create(key, piece, data, host.dtype)
                self.streams.set_rows(stream, self.share.total_rows(piece.unit, key))
            self.streams.write_metadata()  # before any other rank opens them

    def _create(self, attrs: dict) -> bool:
        """Create the store with its root attrs (replacing the old run's, for an overwrite), unless this resumes it;
        returns whether it does."""
        cfg = self.cfg
        problems = check_path(self.location, cfg.mode, attrs.get("config_hash"), attrs.get("config", {}),
                              attrs.get(INPUTS), attrs.get(INPUTS_RULE))
        if problems:
            raise ConfigError(problems)
        world = self.share.world if self.share else 1
        old = read_attrs(self.location)
        resume = cfg.mode == "resume" and old is not None
        if resume and int(old.get("world_size", 1)) != world:
            raise ConfigError([f"store.mode: resume refused, {self.path} was written by "
                               f"{old.get('world_size', 1)} process(es), this run has {world}; "
                               "resume with the same number of ranks (torchrun --nproc-per-node, SLURM tasks)"])
        if resume:
            return True
        extra = {"world_size": world} if self.share else {}
        fresh = {**attrs, **extra, STATUS: RUNNING, SUMS_FROM: 0, VERSION: FORMAT_VERSION, RUN_ID: uuid.uuid4().hex}
        if old is not None:  # overwrite: check_path allowed only a hookrun store here
            kept = clear_store(self.location)  # marks it replacing, then removes the old run's keys
            self._index_group(fresh[RUN_ID])
            write_root(self.location, fresh)  # no longer replacing
            self.fresh = not kept  # nothing but the root and the index group left
        else:
            zarr.create_group(store=self.location.zarr_store, attributes=fresh)  # first: killed before
            self._index_group(fresh[RUN_ID])  # _index, it is still a store
            self.fresh = True
        return False

    def _resume(self, attrs: dict) -> None:
        """Continue a stopped run's store: drop what it left unfinished, check what it committed, reopen its arrays
        (one process; ranks reopen their own parts), mark it running again."""
        dropped = self.location.drop_partial_writes()  # what the killed run was writing when it died
        if dropped:
            log.info("resume: removed %d unfinished write(s) of the killed run (%s)", len(dropped), dropped[0])
        self._check_before_resume()
        if not self.share:
            self._reopen()
        else:  # each rank reopens its own parts; a merge the killed run left in _index goes
            Index(self.location, self.root).drop_uncommitted()
        if SUMS_FROM not in self.root.attrs:  # a store from before commits recorded sums: from this one on
            attrs = {**attrs, SUMS_FROM: None if self.share else self.index.parts}
        # one write (zarr writes attrs.update key by key), without a consolidated copy a killed close left
        self.root.update_attributes({**attrs, STATUS: RUNNING, "resumed_at_batch": self.next_batch,
                                     VERSION: FORMAT_VERSION})
        self._index_group(self.root.attrs.get(RUN_ID))  # (the killed run may have made only the root)

    def _index_group(self, run_id: Optional[str]) -> None:
        """The `_index` group with the run's id, unless it is there (an overwrite gives the one there its id)."""
        attributes = {"what": "hookrun index parts (parquet)", **({RUN_ID: run_id} if run_id else {})}
        if not self.location.exists(f"{INDEX_DIR}/zarr.json"):
            zarr.create_group(store=self.location.zarr_store, path=INDEX_DIR, attributes=attributes)
        elif run_id and zarr.open_group(store=self.location.zarr_store, path=INDEX_DIR).attrs.get(RUN_ID) != run_id:
            zarr.open_group(store=self.location.zarr_store, path=INDEX_DIR, mode="r+").update_attributes(attributes)

    def _open_root(self) -> zarr.Group:
        """The root group, read and write; without the consolidated copy, which a write of its attrs then drops
        (it would describe arrays that change; the close writes it, hookrun.store.writer.consolidated_root)."""
        return zarr.open_group(store=self.location.zarr_store, mode="r+", use_consolidated=False)

    def _check_before_resume(self) -> None:
        damaged = verify_store(self.root, self.location)  # every index file, every committed chunk's crc32c
        if damaged:
            raise ConfigError([f"store.mode: resume refused, {self.path} is damaged: {p}" for p in damaged] +
                              ["store.mode: rerun with store.mode=overwrite (or another store.path); "
                               "hookrun.open(path).verify() lists the damage"])

    def _reopen(self) -> None:
        """Resume one process: drop uncommitted parts, reload the partial last chunk of each array."""
        self.index.parts = int(self.root.attrs.get("committed_parts", 0))
        self.index.drop_uncommitted()
        index, done = self.index.committed()
        self.next_batch = int(done.batch.max()) + 1 if len(done) else 0
        self.committed_samples = int((done.sample_stop - done.sample_start).sum()) if len(done) else 0
        for key, rows in index.groupby("array"):
            self.streams.reopen(key, int(rows.row_stop.max()), calls=int(rows.call.max()) + 1)
        self.root.attrs["committed_parts"] = self.index.parts

    def _open_as_rank(self) -> None:
        """Every rank (rank 0 too): open the arrays at this rank's rows, and its own index (its committed
        parts when resuming)."""
        share = self.share
        self.root = self._open_root()
        self.streams = Streams(self.location, self.root, self.cfg, *self.expected)
        index_dir = rank_dir(self.rank)
        self.index = Index(self.location, self.root, rank_committed(self.location, index_dir), index_dir)
        self.index.drop_uncommitted()
        index, done = self.index.committed()
        stops = index.groupby("array").row_stop.max().to_dict() if len(index) else {}
        for key, calls in share.calls.items():
            unit = self.root[key].attrs.get("unit", "sample")
            first = share.first_row(self.rank, unit, key)
            self.streams.reopen(key, int(stops.get(key, first)), calls, first_row=first,
                                head_key=head_key(self.rank, key))
        self.next_batch = int(done.batch.max()) + 1 if len(done) else share.first_batch
        self.committed_samples = share.before[self.rank]["sample"] + (
            int((done.sample_stop - done.sample_start).sum()) if len(done) else 0)

    # -- hot path ------------------------------------------------------------------------------
    def submit(self, capture) -> None:
        """Take a capture from a hook: copy it to the host and queue it for the writer."""
        t = capture.tensor
        borrowed, sums = False, None
        if t.device.type == "cuda":
            host, sums, event = self.copier.to_host(t)
        elif t.device.type == "cpu" and self.queue.thread is None:  # written before the hook returns: no copy
            host, event, borrowed = t.detach().contiguous(), None, True
        else:
            host, event = t.detach().to("cpu", copy=True).contiguous(), None
        capture.tensor = None
        item = _Item(capture, host, event, host.numel() * host.element_size() + ITEM_OVERHEAD, borrowed, sums)
        self.queue.put(item, item.nbytes)
        self._raise_if_failed()

    def end_batch(self, record: dict, tables: Optional[Dict[str, pd.DataFrame]] = None, commit: bool = False) -> None:
        """Queue a finished batch's record (samples, loss, timings); may commit every finished batch (`commit`:
        does, and returns once it has: a method's checkpoint of this batch is then never ahead of the store).

        `tables` are per-batch rows of named side tables (e.g. samples, tokens): they are committed
        with the batch as `_index/<name>-N.parquet` and merged into `<name>.parquet` at completion."""
        self.queue.put({**record, TABLES_KEY: dict(tables or {}), COMMIT_KEY: commit}, ITEM_OVERHEAD)
        if commit:
            self.queue.wait()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        error = self.queue.error
        if isinstance(error, NonFiniteError):
            raise error
        if error is not None:
            raise StoreError(f"writing {self.path} failed: {error}") from error
        if self.lock.lost:
            raise StoreError(f"writing {self.path} failed: another run took the store's lock")

    # -- writer side ---------------------------------------------------------------------------
    def _handle(self, item) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        if isinstance(item, dict):
            now = item.pop(COMMIT_KEY, False)
            self.index.batch_rows.append(item)
            if now or time.perf_counter() - self.last_commit >= self.cfg.commit_s:
                self._commit()
        else:
            self._add(item)
        self.write_seconds += time.perf_counter() - start
        self.write_cpu_seconds += time.thread_time() - cpu

    def _add(self, item: _Item) -> None:
        if item.event is not None:
            item.event.synchronize()
        piece, host = item.meta, item.host
        data = _rows(piece, to_stored(host))
        site = piece.site
        key = array_key(site.hook, site.layer, site.role)
        stream = self.streams.get(key)
        if stream is None and self.share:
            raise StoreError(f"{key}: captured in batch {site.batch} but not in the run's first batch; a "
                             "data-parallel run makes every array from the first batch: capture it in every batch")
        stream = stream or self.streams.create(key, piece, data, host.dtype)
        if (data.shape[1:] != stream.row_shape or _name(data.dtype) != stream.dtype
                or piece.per_sample != stream.per_sample):
            raise StoreError(
                f"{key}: batch {site.batch} captured shape {list(host.shape)} {host.dtype}, but earlier batches "
                f"stored rows of {list(stream.row_shape)} {stream.dtype}; one array holds one shape: pad inputs "
                "to a fixed size, reduce/select to one, or (for outputs whose axis 0 is not the batch, like "
                "sequence-first tensors) make the sample count a multiple of data.batch_size")
        with self.streams.stages.timed("statistics"):
            row = dict(hook=site.hook, kind=piece.kind, layer=site.layer, role=site.role, call=site.call,
                       batch=site.batch, sample_start=site.sample_start, sample_stop=site.sample_stop, array=key,
                       row_start=stream.rows_assigned, row_stop=stream.rows_assigned + len(data),
                       shape=_shape_text(tuple(host.shape)), dtype=_name(host.dtype),
                       per_sample=piece.per_sample, unit=piece.unit, module=site.module or site.layer,
                       module_role=site.module_role or site.role,
                       **(stats_from_sums(item.sums.tolist(), host.numel()) if item.sums is not None else
                          stats(bf16_bits_to_float32(data) if host.dtype == torch.bfloat16 else data)))
        if row["nan_count"] or row["inf_count"]:
            self._nonfinite(row)
        stream.calls = max(stream.calls, site.call + 1)
        self.index.rows.append(row)
        self.streams.append(stream, data, borrowed=item.borrowed)

    def _nonfinite(self, row: dict) -> None:
        what = (f"hooks.{row['hook']}: {row['layer']} {row['role']} in batch {row['batch']} (samples "
                f"{row['sample_start']}..{row['sample_stop']}) has {row['nan_count']} NaN and {row['inf_count']} inf values")
        if self.on_nonfinite == "error":
            raise NonFiniteError(f"{what}; on_nonfinite=error stops the run (record or warn keep going)")
        if self.on_nonfinite == "warn" and row["array"] not in self.warned:
            self.warned.add(row["array"])
            log.warning("%s (further ones in this array are only counted in the index)", what)

    def _commit(self) -> None:
        """Make every finished batch durable: the partial chunks holding its rows, then the index part
        (hookrun.store.index), whose last write commits it."""
        self.last_commit = time.perf_counter()
        if not self.index.batch_rows:
            return
        if self.lock.lost:
            raise StoreError("another run took the store's lock: this run stops before it commits")
        self.streams.write_partial()
        with self.streams.stages.timed("index commits"):
            self.index.commit(self.streams.chunk_log)
        self.streams.chunk_log = {}

    # -- end -----------------------------------------------------------------------------------
    def close(self, status: str, summary: Optional[dict] = None) -> None:
        """Drain the queue, commit every finished batch, and for a complete run check the store against its
        index, write the merged index, the final status and summary; release the lock."""
        try:
            self._close(status, summary)
        finally:
            self.lock.release()

    def _close(self, status: str, summary: Optional[dict]) -> None:
        self.queue.close()
        final, failure = self._drain(status)
        sources = [(self.index.dir, self.index.parts)]
        if self.share:  # every rank has committed; rank 0 finishes the store for all of them
            final = self._join_ranks(final, failure)
            if final is None:
                return
            sources = index_sources(self.location, self.root.attrs)
        manifest = None
        try:
            if final == COMPLETE and failure is None:
                manifest = self._finish(sources)
        except BaseException as err:  # noqa: BLE001
            failure = err
        finally:
            final = final if self.queue.error is None and failure is None else FAILED
            self._write_status(final, summary, manifest, sources)
            if self.share:
                self.share.gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        self._raise_if_failed()

    def _drain(self, status: str) -> tuple:
        """Commit every finished batch (and, for a complete run, every row): (the status to write, the error)."""
        try:
            if self.queue.error is None:
                if status == COMPLETE:
                    self.streams.write_partial()
                self._commit()
                return status, None
        except BaseException as err:  # noqa: BLE001 - the status is written first, then it is raised
            return FAILED, err
        return FAILED, None

    def _join_ranks(self, final: str, failure: Optional[BaseException]) -> Optional[str]:
        """Every rank's outcome (complete if all are complete): rank 0 takes every rank's rows and bytes into its
        streams, to finish the store; another rank waits until rank 0 has, and returns None."""
        outcomes = self.share.gather((final, {k: s.raw_bytes for k, s in self.streams.by_key.items()}))
        final = next((f for f, _ in outcomes if f != COMPLETE), COMPLETE)
        if self.rank != 0:
            finish = self.share.gather(None)[0]
            if failure is not None:
                raise failure
            self._raise_if_failed()
            if finish:
                raise StoreError(f"finishing {self.path} failed on rank 0: {finish}")
            return None
        for key, stream in self.streams.by_key.items():  # the summary describes the whole run
            stream.rows_assigned = self.share.total_rows(stream.array.attrs.get("unit", "sample"), key)
            stream.raw_bytes = sum(raw.get(key, 0) for _, raw in outcomes)
        return final

    def _finish(self, sources: list) -> dict:
        """A complete run's arrays made final (shared chunks stitched, or arrays trimmed), checked against the index
        `sources` (the stitched sizes added to them), and the index merged; returns the merged files' sums."""
        if self.share:
            stitch(self.location, self.streams, self.share)
            stitched = Index(self.location, self.root, index_dir=STITCHED_DIR)
            stitched.commit(self.streams.chunk_log)  # the shared chunks' final sizes, merged last
            sources.append((stitched.dir, stitched.parts))
        else:
            self.streams.trim()
        if not self.location.in_memory:  # in memory no other party can lose or change a byte: cap.save checks the copy
            with self.streams.stages.timed("close: verify"):  # sizes: these bytes were just written
                damaged = verify_store(self.root, self.location, sources=sources, depth="size")
                pa.default_memory_pool().release_unused()
            if damaged:
                raise StoreError(f"{self.path} does not read back as written: {'; '.join(damaged)}")
        with self.streams.stages.timed("close: merge index"):
            return merge(self.location, self.root.attrs, sources)

    def _write_status(self, final: str, summary: Optional[dict], manifest: Optional[dict], sources: list) -> None:
        """The final status and summary in the root attrs; a complete store is consolidated in the same write, and
        its index parts go once the status says complete."""
        summary = {**(summary or {}), "writer": self.writer, "write_s": self.write_seconds,
                   "write_cpu_s": self.write_cpu_seconds,
                   "arrays": self.streams.summary(), "writer_stages_s": self.streams.stages.summary()}
        done = {STATUS: final, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary}
        self.summary = summary
        if final == COMPLETE:  # the store is whole once this write is: then its parts go
            attrs = {**root_meta(self.location)["attributes"], **done, MANIFEST: manifest}
            _write_consolidated(self.location, attrs, with_sum=True)
            remove_parts(self.location, sources)
        else:
            self.root.update_attributes(done)


def consolidated_root(location: Location, attrs: dict) -> dict:
    """The root zarr.json that `zarr.consolidate_metadata` writes (one read of it lists every array: xarray opens the
    store unwarned), with the root attributes `attrs`: every group's and array's metadata below the root, as stored.
    Built here and written in one put, instead of zarr's consolidation, reopen and attribute update (three passes
    through its event loop, ~25 ms a close); a test compares the bytes with zarr's.

        location.put("zarr.json", encode_root(consolidated_root(location, attrs)))"""
    nodes = dict(_nodes(location, "", location.lister()))
    flat = {}
    for path in sorted(nodes, key=lambda k: (k.count("/"), unicodedata.normalize("NFKC", k).casefold())):
        meta = nodes[path]  # (zarr's order: by depth, then by name)
        flat[path] = meta if meta.get("node_type") != "group" else {
            "attributes": meta.get("attributes", {}), "zarr_format": 3, "consolidated_metadata": _inline({}),
            "node_type": "group"}
    return {"attributes": attrs, "zarr_format": 3, "consolidated_metadata": _inline(flat), "node_type": "group"}


def _inline(metadata: dict) -> dict:
    return {"kind": "inline", "must_understand": False, "metadata": metadata}


def _nodes(location: Location, group: str, children):
    """(path, metadata) of every group and array below `group`, as zarr finds them: a child with a zarr.json."""
    for name in children(group):
        path = f"{group}/{name}" if group else name
        raw = location.get(f"{path}/zarr.json")
        if raw is None:
            continue
        meta = json.loads(raw)
        yield path, meta
        if meta.get("node_type") == "group":
            yield from _nodes(location, path, children)


def encode_root(meta: dict) -> bytes:
    """A root zarr.json's bytes, as zarr encodes its metadata."""
    return json.dumps(meta, indent=zarr.config.get("json_indent"), allow_nan=True).encode()


def _write_consolidated(location: Location, attrs: dict, with_sum: bool) -> None:
    """Write the root with `attrs` and the consolidated metadata; `with_sum`: with the root_crc32c of both, as a
    reader reads them back."""
    meta = consolidated_root(location, attrs)
    if with_sum:
        read_back = json.loads(json.dumps(attrs, allow_nan=True))
        meta["attributes"] = {**attrs, ROOT_SUM: root_sum({**meta, "attributes": read_back})}
    location.put("zarr.json", encode_root(meta))


def finish_close(location: Location) -> None:
    """The end of a close killed after it marked the store complete (the resume of a complete store): remove
    the index parts it left, under the store's lock; a complete store without its consolidated metadata
    (one closed before the status was written last) gets it. Nothing to do: nothing is written."""
    attrs = read_attrs(location) or {}
    sources = index_sources(location, attrs)
    if location.is_dir(STITCHED_DIR):
        sources.append((STITCHED_DIR, rank_committed(location, STITCHED_DIR)))
    names = location.children(INDEX_DIR)
    left = [n for n in names if is_part(n) or is_sums(n) or is_writer_dir(n) and location.is_dir(f"{INDEX_DIR}/{n}")]
    whole = (root_meta(location) or {}).get("consolidated_metadata") is not None
    if not left and whole:
        return
    with store_lock(location):
        log.info("%s: finishing the close of its run (removing %d index file(s) it left%s)", location, len(left),
                 "" if whole else ", consolidating its metadata")
        location.drop_partial_writes()
        remove_parts(location, sources)
        if not whole:
            _write_consolidated(location, root_meta(location)["attributes"], with_sum=False)
