"""Array streams: one Zarr array per captured site, filled chunk by chunk (or shard by shard).

Rows arrive in blocks; every whole chunk is encoded and written once, as it fills. At a commit the
partly filled last chunk is written padded (and rewritten whole when it fills). A chunk is encoded
here exactly as zarr encodes it (bytes codec, little endian, then blosc, then its crc32c), which
skips zarr's per-write overhead, and is written through the location like every other key; a
shard goes through zarr's sharding codec (each inner chunk with its crc32c).

Every chunk ends in the crc32c of its bytes (zarr's crc32c codec, the last of the array's codecs):
every read checks it, and each commit records it (hookrun.format.files). It costs ~0.1 ms a MB.
"""
from __future__ import annotations

import collections
import functools
import io
import json
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from numcodecs import Blosc
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec
from zarr.dtype import parse_dtype

from hookrun.format.files import crc32c, shard_count, shard_sum
from hookrun.format.layout import CHUNK_KEY_ENCODING, RUN_ID, array_attrs, dtype_name, parse_key
from hookrun.storage import Location
from hookrun.storage.internals import (ArrayV3Metadata, array_metadata, array_of, group_json, metadata_json,
                                       resize_in_place, with_attributes)
from hookrun.store.spec import SHUFFLES


def dim_names(role: str, ndim: int, unit: str) -> List[str]:
    """Names of a capture's axes after the first, prefixed by the role (roles of one layer share a group,
    and xarray needs one size per name): channel/height/width for image-like [N, C, H, W] captures,
    position/feature for [N, T, D] sequences, feature for [N, D]; <role>_dim_<i> otherwise."""
    known = {4: ["channel", "height", "width"], 3: ["position", "feature"], 2: ["feature"]}
    names = known.get(ndim) if unit == "sample" else (["feature"] if ndim == 2 else None)
    return [f"{role}_{n}" for n in names] if names else [f"{role}_dim_{i}" for i in range(1, ndim)]


def _encoding(compressors) -> dict:
    """How an array's chunks are encoded, from its bytes-to-bytes codecs (`array.compressors`, or the list it is made
    with): through blosc or raw, with a crc32c or without."""
    return dict(compressed=any(isinstance(c, BloscCodec) for c in compressors),
                checksum=any(isinstance(c, Crc32cCodec) for c in compressors))


GROUP_JSON = group_json()  # an implicit parent group's zarr.json, as zarr writes it


@functools.lru_cache(maxsize=None)
def _zarr_dtype(dtype: np.dtype):
    """zarr's data type for a numpy dtype (its registry lookup costs ~0.5 ms)."""
    return parse_dtype(dtype, zarr_format=3)


ATTRS_SLOT = b'"hookrun: the attributes go here"'  # in a layout's zarr.json (_layout), replaced by each array's


_LAYOUTS: "collections.OrderedDict[tuple, Tuple[ArrayV3Metadata, bytes]]" = collections.OrderedDict()
LAYOUTS_KEPT = 256


def _layout(shape: tuple, chunks: tuple, dtype: np.dtype, shard_rows: Optional[int], compressors: list,
            codecs_key: str, dims: tuple) -> Tuple[ArrayV3Metadata, bytes]:
    """The zarr metadata of an array of this layout without attributes, and its zarr.json (as zarr writes it) with
    ATTRS_SLOT for them: made once a layout (the last LAYOUTS_KEPT kept), as a rerun makes the same arrays (~0.2 ms
    an array: zarr parses its arguments and indents its JSON in Python). `compressors`: the bytes-to-bytes codecs,
    `codecs_key` their repr."""
    key = (shape, chunks, dtype, shard_rows, codecs_key, dims)
    found = _LAYOUTS.get(key)
    if found is not None:
        return found
    codecs = [BytesCodec(), *compressors]
    if shard_rows:
        codecs = [ShardingCodec(chunk_shape=chunks, codecs=codecs)]
        chunks = (shard_rows, *chunks[1:])
    meta = array_metadata(shape, _zarr_dtype(dtype), chunks, codecs, dims, CHUNK_KEY_ENCODING["separator"])
    _LAYOUTS[key] = found = (meta, metadata_json(with_attributes(meta, json.loads(ATTRS_SLOT))))
    while len(_LAYOUTS) > LAYOUTS_KEPT:
        _LAYOUTS.popitem(last=False)
    return found


def _indented(attrs: dict) -> bytes:
    """Attributes as zarr's zarr.json holds them (json, indent 2, one level in)."""
    return json.dumps(attrs, allow_nan=True, indent=2).replace("\n", "\n  ").encode()


class BloscByTypesize(dict):
    """numcodecs Blosc encoders keyed by item size, configured like zarr's BloscCodec."""

    def __init__(self, cname: str, clevel: int, shuffle: str):
        super().__init__()
        self.args = dict(cname=cname, clevel=clevel, shuffle=SHUFFLES.index(shuffle))

    def __missing__(self, typesize: int):
        self[typesize] = Blosc(typesize=typesize, **self.args)
        return self[typesize]


class Stages:
    """The writer's seconds by stage (statistics, assemble, encode, write, index commits, close): `cpu` counts
    the writing thread's own CPU time (time.thread_time), `wall` the clock; wall minus CPU is time spent
    waiting, for a core taken by torch's threads or for the disk (an object store's PUTs run on zarr's
    event loop thread, so their CPU shows as waiting too).

        with stages.timed("encode"): ...   # (a plain object, not a generator: it runs a few times a capture)"""

    def __init__(self):
        self.cpu: Dict[str, float] = collections.Counter()
        self.wall: Dict[str, float] = collections.Counter()

    def timed(self, stage: str) -> "_Timed":
        return _Timed(self, stage)

    def summary(self) -> dict:
        """For the store's summary attrs: CPU and wall seconds by stage."""
        return {"cpu": {k: round(v, 4) for k, v in self.cpu.items()},
                "wall": {k: round(v, 4) for k, v in self.wall.items()}}


class _Timed:
    """One stage's timing (Stages.timed)."""

    __slots__ = ("stages", "stage", "cpu", "wall")

    def __init__(self, stages: Stages, stage: str):
        self.stages, self.stage = stages, stage

    def __enter__(self):
        self.cpu, self.wall = time.thread_time(), time.perf_counter()

    def __exit__(self, *exc):
        self.stages.cpu[self.stage] += time.thread_time() - self.cpu
        self.stages.wall[self.stage] += time.perf_counter() - self.wall


@dataclass
class Stream:
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
    first_row: int = 0  # the first row this process writes (> 0 for later ranks of a data-parallel run)
    head_key: Optional[str] = None  # where rows before first_row's chunk boundary go (the chunk is shared)
    rows_assigned: int = 0  # rows handed out to captures
    rows_flushed: int = 0  # rows in whole objects on disk (a multiple of key_rows)
    rows_durable: int = 0  # rows on disk, including a partial last object
    pending: list = field(default_factory=list)  # numpy blocks from rows_flushed on
    pending_bytes: int = 0
    raw_bytes: int = 0
    calls: int = 1  # calls per forward of the module (a reused module stores each call's rows)
    compressed: bool = False  # chunks go through blosc (store.codec, where it saves store.min_saving)
    checksum: bool = True  # chunks end in their crc32c (not in arrays of stores written before it)
    expected: Optional[int] = None  # the rows the run is expected to write (its size from the start); None: unknown

    def block(self) -> np.ndarray:
        """The pending rows as one array (and kept as one block)."""
        if len(self.pending) > 1:
            self.pending = [np.concatenate(self.pending)]
        return self.pending[0]


class Streams:
    """Every array of one store: creates them, writes their whole and partial chunks, logs chunk sizes."""

    def __init__(self, location: Location, root, cfg, expected_samples: Optional[int], expected_batches: Optional[int],
                 expected_tokens: Optional[int] = None, fresh: bool = False):
        self.location = location
        self.fresh = fresh  # no key holds anything of an array yet (a new store, or an overwrite that left nothing)
        self.root = root
        self.cfg = cfg
        self.expected_samples = expected_samples  # known sample, batch and stored-token counts size chunks and arrays
        self.expected_batches = expected_batches
        self.expected_tokens = expected_tokens
        self.compressor = None if cfg.codec == "none" else BloscCodec(cname=cfg.codec, clevel=cfg.level,
                                                                        shuffle=cfg.shuffle)
        self.blosc = None if cfg.codec == "none" else BloscByTypesize(cfg.codec, cfg.level, cfg.shuffle)
        self.by_key: Dict[str, Stream] = {}
        self.chunk_log: Dict[tuple, tuple] = {}  # (array, chunk) -> (encoded bytes, crc32c or -1) since the last commit
        self.outbox: Optional[list] = None  # (key, bytes) of chunks to put together, while a block is written
        self.stages = Stages()  # the writer's CPU and wall seconds by stage
        self.groups: set = set()  # groups known to exist (their zarr.json written or found)
        self.unwritten: Dict[str, bytes] = {}  # zarr.json of the arrays and groups made or resized since the last
        # write_metadata (the next commit writes them, together: concurrently on an object store)
        self.codec_lists: Dict[bool, list] = {}  # compressed -> the codecs (codecs())
        self.codec_keys: Dict[int, str] = {}  # id of a codecs() list -> its repr

    def get(self, key: str) -> Optional[Stream]:
        return self.by_key.get(key)

    def reopen(self, key: str, committed_rows: int, calls: int, first_row: int = 0,
               head_key: Optional[str] = None) -> None:
        """Continue an array after a resume (or a rank's region of it, rows from `first_row`): reload the
        rows of its partial last chunk (or of its unfinished head) into the buffer."""
        array = self.root[key]
        if array.shards is not None:
            array = array.with_config({"write_empty_chunks": True})
        key_rows = (array.shards or array.chunks)[0]
        committed_rows = max(committed_rows, first_row)
        start = committed_rows - committed_rows % key_rows
        if start < first_row:  # still inside the shared head chunk: its rows are in the head key
            pending = [np.load(io.BytesIO(self.location.get(head_key)))] if committed_rows > first_row else []
        else:
            pending = [array[start:committed_rows]] if committed_rows > start else []
        self.by_key[key] = Stream(
            key, array, tuple(array.shape[1:]), str(array.dtype), bool(array.attrs["per_sample"]), key_rows,
            sharded=array.shards is not None, first_row=first_row, head_key=head_key,
            rows_assigned=committed_rows, rows_flushed=start, rows_durable=committed_rows, pending=pending,
            pending_bytes=sum(p.nbytes for p in pending),
            raw_bytes=(committed_rows - first_row) * int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize,
            calls=calls, expected=self._expected_rows(bool(array.attrs["per_sample"]))
            if array.attrs.get("unit") != "token" else None, **_encoding(array.compressors))

    def create(self, key: str, piece, data: np.ndarray, dtype: torch.dtype) -> Stream:
        """A new array for the site of `piece` (a hooks.Piece), sized from the first block of rows `data`."""
        row_shape = data.shape[1:]
        row_bytes = max(1, math.prod(row_shape) * data.dtype.itemsize)
        chunk_rows = self.cfg.chunk_rows or max(1, int(self.cfg.chunk_mb * 2**20) // row_bytes)
        unit = piece.unit  # sample | token (one row per stored token of a text batch) | batch
        expected = self._expected_rows(piece.per_sample) if unit != "token" else self._expected_token_rows(piece, data)
        if expected and not self.cfg.chunk_rows:  # equal chunks that just hold the rows: no padded last chunk
            chunks = -(-expected // chunk_rows)
            chunk_rows = -(-expected // chunks)
        shard_rows = None
        if self.cfg.shard_mb:  # whole shards of whole chunks: one file per shard, written at once
            per_shard = max(1, int(self.cfg.shard_mb * 2**20) // (row_bytes * chunk_rows))
            if expected:
                per_shard = min(per_shard, -(-expected // chunk_rows))
            shard_rows = per_shard * chunk_rows
        attrs = array_attrs(piece.per_sample, piece.kind, unit, dtype, piece.site.module, piece.site.module_role)
        if self.root.attrs.get(RUN_ID):  # the run that made the array (hookrun.format.files.run_id_problems)
            attrs[RUN_ID] = self.root.attrs[RUN_ID]
        compressed = self._compresses(data[:chunk_rows])
        codecs = self.codecs(compressed)
        array = self._new_array(  # roles of one layer share a group: dims are named per role so xarray can open it
            key, (expected or 0, *row_shape), (chunk_rows, *row_shape), data.dtype, shard_rows,
            codecs, attrs, (unit, *dim_names(piece.site.role, data.ndim, unit)))
        stream = Stream(key, array, row_shape, str(data.dtype), piece.per_sample, shard_rows or chunk_rows,
                        sharded=shard_rows is not None, expected=expected, **_encoding(codecs))
        self.by_key[key] = stream
        return stream

    def _new_array(self, key: str, shape: tuple, chunks: tuple, dtype: np.dtype, shard_rows: Optional[int],
                   compressors: list, attrs: dict, dims: tuple) -> zarr.Array:
        """A new array at `key`, as `root.create_array(key, overwrite=True, ...)` makes it (the same zarr.json and its
        parent groups', put with the next write_metadata): zarr's create checks and writes every parent group through
        its event loop, ~6 ms an array (most of a small run's store time). What a killed run left at `key` goes first
        (in a store this run did not make fresh: a resume, an overwrite)."""
        if not self.fresh and self.location.is_dir(key):  # (a memory store's listing reads every key of the process)
            self.location.delete_dir(key)
        codecs_key = self.codec_keys.get(id(compressors)) or repr(compressors)
        meta, text = _layout(shape, chunks, np.dtype(dtype), shard_rows, compressors, codecs_key, dims)
        meta = with_attributes(meta, dict(attrs))  # the layout's metadata with this array's attributes
        parts = key.split("/")
        for depth in range(1, len(parts)):  # the groups above it, once each
            group = "/".join(parts[:depth])
            if group not in self.groups and (self.fresh or not self.location.exists(f"{group}/zarr.json")):
                self.unwritten[f"{group}/zarr.json"] = GROUP_JSON
            self.groups.add(group)
        self.unwritten[f"{key}/zarr.json"] = text.replace(ATTRS_SLOT, _indented(attrs))
        # every shard written, whole: a missing one is damage
        return array_of(meta, self.root, key, config={"write_empty_chunks": True})

    def codecs(self, compressed: bool) -> list:
        """An array's bytes-to-bytes codecs: blosc where it pays, then crc32c (one list of each for the store, and
        its key for _layout made once: a codec's repr takes ~20 us)."""
        if compressed not in self.codec_lists:
            found = [self.compressor, Crc32cCodec()] if compressed else [Crc32cCodec()]
            self.codec_lists[compressed] = found
            self.codec_keys[id(found)] = repr(found)
        return self.codec_lists[compressed]

    def _compresses(self, rows: np.ndarray) -> bool:
        """Whether an array is worth compressing: its first chunk of rows shrinks by at least store.min_saving.
        Dense float activations save 8-15% with lz4 (ReLU outputs too: their zeros are scattered) at ~1.5 GB/s of
        a core; runs of equal values (masks, padding, causal attention patterns, small integers) save half and more."""
        if self.blosc is None:
            return False
        if self.cfg.min_saving <= 0 or rows.nbytes == 0:
            return True
        with self.stages.timed("encode"):
            encoded = len(self.blosc[rows.dtype.itemsize].encode(np.ascontiguousarray(rows)))
        return encoded <= (1 - self.cfg.min_saving) * rows.nbytes

    def _encode(self, rows: np.ndarray, compressed: bool, checksum: bool):
        """Rows as the bytes of a chunk, exactly as zarr encodes them: little endian, blosc if compressed, then
        their crc32c; as (pieces to write one after another, their size, the crc32c or -1). Raw rows are not
        copied."""
        rows = np.ascontiguousarray(rows, dtype=rows.dtype.newbyteorder("<"))
        data = self.blosc[rows.dtype.itemsize].encode(rows) if compressed else memoryview(rows).cast("B")
        if not checksum:
            return [data], len(data), -1
        crc = crc32c(data)
        return [data, crc.to_bytes(4, "little")], len(data) + 4, crc

    def _expected_rows(self, per_sample: bool) -> Optional[int]:
        return self.expected_samples if per_sample else self.expected_batches

    def _expected_token_rows(self, piece, data: np.ndarray) -> Optional[int]:
        """Rows a per-token array will have: every stored token of the run when the first batch stores all of its
        tokens; else (some positions) its rows per sample times the samples, an estimate."""
        info, site = piece.site.tokens, piece.site
        if info is not None and self.expected_tokens and len(data) == int(info.keep.sum()):
            return self.expected_tokens
        samples = site.sample_stop - site.sample_start
        if not self.expected_samples or samples <= 0:
            return None
        return max(1, -(-len(data) * self.expected_samples // samples))

    def _ensure_rows(self, stream: Stream, stop: int) -> None:
        """Make room for rows up to `stop`: the array is made at its expected row count (per-token arrays: the
        stored tokens, or an estimate), so this grows it only past a guess, by doubling; `trim` cuts it back."""
        size = stream.array.shape[0]
        if stop > size:
            expected = stream.expected or 0
            self.set_rows(stream, max(stop, expected if expected >= stop else 2 * size))

    def set_rows(self, stream: Stream, rows: int) -> None:
        """Make an array `rows` long where no chunk lies past `rows` (it grows, or nothing is written yet), as zarr's
        resize does then (its new zarr.json, the metadata changed in place), in one put from this thread: zarr's
        own goes through its event loop (~3 ms each, a batch's worth on a small model). `trim` cuts with zarr's."""
        self._put_metadata(stream.key, resize_in_place(stream.array, (rows, *stream.row_shape)))

    def _put_metadata(self, key: str, meta: ArrayV3Metadata) -> None:
        """The array `key`'s zarr.json, as zarr writes it from `meta`, with the next write_metadata."""
        self.unwritten[f"{key}/zarr.json"] = metadata_json(meta)

    def write_metadata(self) -> None:
        """The zarr.json of every array and group made or resized since the last call, put together (concurrently on
        an object store), before the commit whose rows they hold (write_partial) or what zarr does to the arrays
        itself (trim): no reader or resume looks at an array before a commit names it, and a short run's loop
        does not wait on a file a new array."""
        if self.unwritten:
            items, self.unwritten = list(self.unwritten.items()), {}
            with self.stages.timed("write"):
                self.location.put_many(items)

    def append(self, stream: Stream, data: np.ndarray, borrowed: bool = False) -> None:
        """Add rows to a stream; write every chunk they fill. `borrowed` rows belong to the model (a sync
        writer reads them in the hook, uncopied): whole chunks are encoded straight from them, and only the
        rows left pending for the next chunk are copied."""
        stream.rows_assigned += len(data)
        stream.pending.append(data)
        stream.pending_bytes += data.nbytes
        stream.raw_bytes += data.nbytes
        if stream.rows_assigned - stream.rows_flushed >= stream.key_rows:
            self._write_whole_chunks(stream)
        if borrowed and stream.pending and np.may_share_memory(stream.pending[-1], data):
            stream.pending[-1] = stream.pending[-1].copy()  # the only block that can hold borrowed rows

    def _write_whole_chunks(self, stream: Stream) -> None:
        """Write every whole chunk (or shard) of pending rows; they are final. The rest stays pending."""
        with self.stages.timed("assemble"):
            block = stream.block()
        cr = stream.key_rows
        start = max(stream.rows_flushed, stream.first_row)  # the row block[0] holds
        stop = stream.rows_assigned - stream.rows_assigned % cr  # the end of the last whole chunk
        if stop <= start:
            return
        self._ensure_rows(stream, stop)
        self.outbox = []  # the chunks of this block go out together (concurrently on an object store)
        try:
            for k in range(start // cr, stop // cr):
                rows = block[max(k * cr, start) - start:(k + 1) * cr - start]
                if k * cr < stream.first_row:
                    self._put_head(stream, rows)
                else:
                    self.put_chunk(stream, k, rows)
            with self.stages.timed("write"):
                self.location.put_many(self.outbox)
        finally:
            self.outbox = None
        rest = block[stop - start:]
        stream.pending = [rest] if len(rest) else []
        stream.pending_bytes = rest.nbytes
        stream.rows_flushed = stop
        stream.rows_durable = max(stream.rows_durable, stream.rows_flushed)

    def write_partial(self) -> None:
        """Make every assigned row durable: write each stream's pending rows as its last chunk, padded with
        the fill value as zarr pads; they stay pending, so the chunk is rewritten whole once it fills. The arrays'
        metadata first (write_metadata)."""
        self.write_metadata()
        for stream in self.by_key.values():
            if stream.rows_durable >= stream.rows_assigned or not stream.pending:
                continue
            block = stream.block()
            self._ensure_rows(stream, stream.rows_assigned)
            if stream.rows_flushed < stream.first_row:  # the head chunk, shared with the rank before
                self._put_head(stream, block)
                stream.rows_durable = stream.rows_assigned
                continue
            if not stream.sharded:
                chunk = np.zeros((stream.key_rows, *stream.row_shape), dtype=block.dtype)
                chunk[:len(block)] = block
                block = chunk
            self.put_chunk(stream, stream.rows_flushed // stream.key_rows, block)
            stream.rows_durable = stream.rows_assigned

    def _put_head(self, stream: Stream, rows: np.ndarray) -> None:
        """A rank's rows in the chunk it shares with the rank before: kept beside the array (as .npy) until
        the first rank writes that chunk whole at the end of the run."""
        buf = io.BytesIO()
        np.save(buf, rows, allow_pickle=False)
        self.location.put(stream.head_key, buf.getbuffer())

    def trim(self) -> None:
        """Cut pre-sized arrays to the rows written (a run that stopped early, or a row count that was a guess)."""
        self.write_metadata()
        for stream in self.by_key.values():
            if stream.array.shape[0] != stream.rows_assigned:
                stream.array.resize((stream.rows_assigned, *stream.row_shape))

    def put_chunk(self, stream: Stream, index: int, chunk: np.ndarray) -> None:
        """Write one whole chunk key, encoded exactly as zarr would, through the location (one atomic put).
        A shard (rows `index * key_rows` on, whole or the partial last one) goes through zarr itself."""
        name = stream.array.metadata.encode_chunk_key((index,) + (0,) * len(stream.row_shape))
        if stream.sharded:
            with self.stages.timed("encode+write (shards, zarr)"):
                start = index * stream.key_rows
                stream.array[start:start + len(chunk)] = chunk
            data = self.location.get(f"{stream.key}/{name}")  # (in the page cache: just written)
            self.chunk_log[stream.key, index] = (len(data), shard_sum(name, data, shard_count(stream.array)))
            return
        with self.stages.timed("encode"):
            pieces, size, crc = self._encode(chunk, stream.compressed, stream.checksum)
        if self.outbox is not None:
            self.outbox.append((f"{stream.key}/{name}", pieces))
        else:
            with self.stages.timed("write"):
                self.location.put(f"{stream.key}/{name}", pieces)
        self.chunk_log[stream.key, index] = (size, crc)

    def summary(self) -> List[dict]:
        """Per array: layer, role, calls, shape of one call (what `load(..., call=c)` returns), dtype (by its own name:
        bfloat16, not the uint16 bits it is stored as), bytes."""
        out = []
        stored = self.location.sizes_by_dir(list(self.by_key))
        for key, s in self.by_key.items():
            hook, layer, role = parse_key(key)
            out.append(dict(hook=hook, layer=layer, role=role, calls=s.calls,
                            shape=[s.rows_assigned // s.calls, *s.row_shape], dtype=dtype_name(s.dtype, s.array.attrs),
                            raw_bytes=s.raw_bytes, stored_bytes=stored[key]))
        return out
