"""A store's files read as the format defines them, each checked against what was recorded when it was written.

    files = IndexFiles(location, attrs)     # the merged tables of a complete store, else the committed parts
    files.read("index", INDEX_COLUMNS)      # a table, every file checked against its [bytes, crc32c]
    open_array(root, key); crc_problem(path, data)   # an array, a chunk's bytes against its crc32c
    read_table(location, key); parquet_bytes(frame)  # a parquet table read (checked), a frame as one
    shard_sum(path, data, count); root_problem(meta) # a shard's recorded checksum; the root metadata's
    files.chunk_sums()                              # {array: {chunk: (bytes, crc32c)}} as committed

Used by the read side, by the writer (a resume, the merge at its close) and by verify. Whatever is missing,
does not parse or differs from what was recorded raises DamagedError naming the file.
"""
from __future__ import annotations

import io
import json
from typing import Dict, Iterable, List, Optional, Tuple

import crc32c as _crc32c
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from zarr.codecs import Crc32cCodec

from hookrun.format.layout import (CHUNK_COLUMNS, COMMITTED, COMMITTED_FILE, COMPLETE, INDEX_DIR, MANIFEST, REQUIRED, ROOT_SUM,
                                   RUN_ID, STATUS, SUMS_FROM, WORLD_SIZE, is_part, is_run_attrs, merged_name, parse_part,
                                   part_name, rank_dir, sums_key, version)
from hookrun.storage import Location
from hookrun.storage.internals import node_of

Sources = List[Tuple[str, int]]  # (index dir, committed parts) of each writer: one, or one per rank


class DamagedError(ValueError):
    """A file of a store is missing, does not parse, or differs from what was recorded when it was written."""


def crc32c(data, value: int = 0) -> int:
    """The crc32c of a bytes-like object (continued from `value`: the crc32c of the bytes before it), as zarr's
    crc32c codec computes it: the crc32c package's hardware sum (~2x google-crc32c's on this machine's CPU), with
    the GIL released from 32 KiB on (the reader's threads sum their chunks side by side).

        crc32c(chunk_body) == int.from_bytes(chunk_tail, "little")
    """
    return _crc32c.crc32c(data, value)


def file_sum(data) -> List[int]:
    """[bytes, crc32c] of a file's content: what commits and the close record of each index file."""
    return [len(data), crc32c(data)]


def index_sources(location: Location, attrs) -> Sources:
    """Where a store's committed index parts are: `_index` with the root attr `committed_parts`, or for a
    data-parallel run each rank's dir with the count in its `committed.json` (ranks never share a key)."""
    world = int(attrs.get(WORLD_SIZE, 1))
    if world == 1:
        return [(INDEX_DIR, int(attrs.get(COMMITTED, 0)))]
    return [(rank_dir(r), rank_committed(location, rank_dir(r))) for r in range(world)]


def rank_committed(location: Location, index_dir: str) -> int:
    """The committed part count of one rank's index dir (0 before its first commit)."""
    raw = location.get(f"{index_dir}/{COMMITTED_FILE}")
    try:
        return int(json.loads(raw)[COMMITTED]) if raw else 0
    except (ValueError, KeyError, TypeError):
        raise DamagedError(f"{index_dir}/{COMMITTED_FILE}: does not parse (damaged)") from None


def root_meta(location: Location) -> Optional[dict]:
    """A store's root zarr.json as JSON (None if absent); DamagedError if it does not parse."""
    raw = location.get("zarr.json")
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError as err:
        raise DamagedError(f"{location}/zarr.json: the store's root metadata does not parse ({err}); the store is "
                           "damaged beyond what hookrun can read") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("attributes", {}), dict):
        raise DamagedError(f"{location}/zarr.json: the store's root metadata is not a zarr group's (damaged)")
    return meta


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True, separators=(",", ":"))


def root_sum(meta: dict) -> int:
    """The crc32c of a root zarr.json's attrs (all but root_crc32c itself) and consolidated copy of every array's
    metadata, as canonical JSON: what a complete store's close records in root_crc32c."""
    attrs = {k: v for k, v in (meta.get("attributes") or {}).items() if k != ROOT_SUM}
    body = {"attributes": attrs, "consolidated_metadata": meta.get("consolidated_metadata")}
    return crc32c(_canonical(body).encode())


def root_problem(meta: Optional[dict]) -> Optional[str]:
    """Why a complete store's root metadata (its attrs: the grid's axes, index_files, ...; the consolidated
    copy: every array's dtype, shape and chunks) is not what its close wrote (None if it is, or for a store
    before version 3 or not complete)."""
    attrs = (meta or {}).get("attributes") or {}
    if attrs.get(STATUS) != COMPLETE or version(attrs) < 3:
        return None
    want = attrs.get(ROOT_SUM)
    if not isinstance(want, int):
        return f"zarr.json: the root attrs have no {ROOT_SUM} (the close records it): edited or damaged"
    got = root_sum(meta)
    if got != want:
        return (f"zarr.json: the root attrs or the consolidated metadata differ from what the run's close wrote "
                f"(crc32c {got:08x}, written {want:08x}): edited or damaged")
    return None


def hookrun_attrs(meta: Optional[dict]) -> Optional[dict]:
    """The root attrs of a hookrun store's root metadata, or None if it is not one."""
    attrs = (meta or {}).get("attributes")
    return attrs if is_run_attrs(attrs) else None


def run_id_problems(location: Location, attrs, keys: Iterable[str] = ()) -> List[str]:
    """The parts of a store another run wrote: the index group (`_index/zarr.json`) or an array of `keys` whose run
    id differs from the root's (its `_index/` or root metadata replaced by another run's). [] for a store from
    before run ids; a part whose metadata is missing is left to the checks that report missing parts."""
    mine = attrs.get(RUN_ID)
    if mine is None:
        return []
    problems = []
    for key in [INDEX_DIR, *sorted(set(keys))]:
        try:
            meta = json.loads(location.get(f"{key}/zarr.json") or b"null")
        except ValueError:
            continue
        if not isinstance(meta, dict):
            continue
        theirs = (meta.get("attributes") or {}).get(RUN_ID)
        if theirs != mine:
            what = "the index" if key == INDEX_DIR else f"array {key}"
            problems.append(f"{location}/{key}: {what} belongs to another run (run id {theirs}; the root's is {mine}): "
                            "its root metadata or index was replaced by another run's, so the index would describe "
                            "rows this store does not hold; the store is damaged: restore it from a copy, or rerun "
                            "with store.mode=overwrite")
    return problems


def _index_files(location: Location, index_dir: str = INDEX_DIR) -> List[str]:
    """Names of the parquet files in one index dir (one listing)."""
    return [n for n in location.children(index_dir) if n.endswith(".parquet")]


def committed_parts(names: List[str], prefix: str, parts: int) -> List[str]:
    """Of an index dir's file names (one listing), the index parts ("part-") or side-table parts ("<name>-") of
    committed batches, in order: those numbered below `parts` (the committed count). A commit writes its files first
    and raises that count last (one atomic write), so a part written by a run killed before that is not committed."""
    found = ((n, parse_part(n)) for n in names if n.endswith(".parquet"))
    return sorted(n for n, p in found if p and f"{p[0]}-" == prefix and p[1] < parts)


def tables_of(names: List[str]) -> List[str]:
    """Of an index dir's file names (one listing), the per-batch side tables (samples, tokens, chunks, ...) it holds,
    merged or in parts."""
    names = [n for n in names if n.endswith(".parquet")]
    tables = {p[0] for p in map(parse_part, names) if p} | {n[:-len(".parquet")] for n in names if not is_part(n)}
    return sorted(tables - {"part", "batches", "index"})


def side_tables(location: Location, index_dir: str = INDEX_DIR) -> List[str]:
    """Names of the per-batch side tables (samples, tokens, chunks, ...) an index dir holds, merged or in parts."""
    return tables_of(_index_files(location, index_dir))


def read_file(location: Location, key: str, want=None) -> bytes:
    """The bytes of an index file, checked against its recorded [bytes, crc32c] (when recorded)."""
    data = location.get(key)
    if data is None:
        raise DamagedError(f"{key}: missing")
    if want is not None and file_sum(data) != list(want):
        raise DamagedError(f"{key}: {len(data)} bytes with crc32c {crc32c(data):08x}, but {want[0]} bytes with "
                           f"crc32c {want[1]:08x} were written (damaged)")
    return data


def parquet_bytes(frame: pd.DataFrame) -> memoryview:
    """A table as the bytes of a parquet file, the bytes `frame.to_parquet(buf, index=False)` writes, without pandas'
    I/O layer (~3 ms a call: most of the cost of a small index part).

        location.put(key, parquet_bytes(frame)); read_table(location, key)"""
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buf)
    return buf.getbuffer()


def read_table(location: Location, key: str, want=None, columns: Optional[List[str]] = None) -> pd.DataFrame:
    """A parquet index file, checked (read_file); DamagedError if it does not read."""
    data = read_file(location, key, want)
    try:
        return pd.read_parquet(io.BytesIO(data), columns=columns)
    except Exception as err:  # noqa: BLE001 - anything pyarrow says about a file that was written whole
        raise DamagedError(f"{key}: does not read as parquet ({type(err).__name__}: {err})") from None


def chunk_table_sums(frame: pd.DataFrame) -> Dict[str, Dict[int, tuple]]:
    """{array: {chunk: (encoded bytes, crc32c or -1)}} of a chunks table, the last record of each winning."""
    crcs = frame["crc32c"].tolist() if "crc32c" in frame.columns else [-1] * len(frame)
    out: Dict[str, Dict[int, tuple]] = {}
    for array, k, size, crc in zip(frame["array"].tolist(), frame["chunk"].tolist(), frame["nbytes"].tolist(), crcs):
        out.setdefault(array, {})[int(k)] = (int(size), int(crc))
    return out


class IndexFiles:
    """Which files hold a store's tables, and what each must be: the merged files of a complete store (their
    [bytes, crc32c] in the root attr index_files), else every writer's committed parts (in each commit's
    sums-N.json). `sources` names the parts explicitly (the writer's close, a resume)."""

    def __init__(self, location: Location, attrs, sources: Optional[Sources] = None, check_root: bool = True):
        self.location = location
        self.merged = sources is None and attrs.get(STATUS) == COMPLETE
        self.manifest = attrs.get(MANIFEST) if self.merged else None
        self.sources = [] if self.merged else (sources or index_sources(location, attrs))
        self.sums_from = attrs.get(SUMS_FROM)
        self._sums: Dict[tuple, Optional[dict]] = {}
        self._listed: Dict[str, set] = {}
        self._chunks: Optional[Dict[str, Dict[int, tuple]]] = None
        if self.merged and check_root:  # the attrs read are the ones the close wrote (verify names it itself)
            meta = root_meta(location) or {}
            if _canonical(meta.get("attributes")) != _canonical(dict(attrs)):
                raise DamagedError("zarr.json: the root attrs changed since the store was opened")
            problem = root_problem(meta)
            if problem:
                raise DamagedError(f"{problem}; no data is read from it (cap.verify() lists every damaged file)")

    def groups(self) -> list:
        """What verify checks one by one: the merged files, or each writer's parts."""
        return [None] if self.merged else [[s] for s in self.sources]

    def sums(self, index_dir: str, n: int) -> Optional[dict]:
        """{file name: [bytes, crc32c]} of commit n (None for a commit made before commits recorded them)."""
        if (index_dir, n) not in self._sums:
            key = sums_key(index_dir, n)
            raw = self.location.get(key)
            required = self.sums_from is not None and (n >= self.sums_from if index_dir == INDEX_DIR
                                                       else self.sums_from == 0)
            if raw is None and required:
                raise DamagedError(f"{key}: missing (the sizes and checksums of committed part {n})")
            try:
                sums = json.loads(raw) if raw is not None else None
            except ValueError:
                raise DamagedError(f"{key}: does not parse (damaged)") from None
            if sums is not None and not isinstance(sums, dict):
                raise DamagedError(f"{key}: is not the sums of a commit (damaged)")
            self._sums[index_dir, n] = sums
        return self._sums[index_dir, n]

    def files(self, table: str, group: Optional[Sources] = None) -> List[Tuple[str, Optional[list]]]:
        """(key, [bytes, crc32c] or None where nothing was recorded) of each file holding `table`, in order
        (of one group, or all). A required table's file is listed even when absent (read_file names it)."""
        name = merged_name(table)
        if self.merged:
            key = f"{INDEX_DIR}/{name}"
            if self.manifest is not None:  # what the close wrote, and nothing else
                return [(key, self.manifest[name])] if name in self.manifest else []
            return [(key, None)] if table in REQUIRED or self.location.exists(key) else []  # before manifests
        out = []
        for index_dir, parts in (group or self.sources):
            if index_dir not in self._listed:
                self._listed[index_dir] = set(_index_files(self.location, index_dir))
            for n in range(parts):
                part = part_name(table, n)
                sums = self.sums(index_dir, n)
                if table in REQUIRED or (part in sums if sums is not None else part in self._listed[index_dir]):
                    out.append((f"{index_dir}/{part}", sums.get(part) if sums is not None else None))
        return out

    def tables(self) -> List[str]:
        """Names of every table the store holds (index, batches, chunks, samples, tokens, ...)."""
        if self.merged:
            names = self.manifest if self.manifest is not None else _index_files(self.location)
            return sorted({n[:-len(".parquet")] for n in names if not is_part(n)} | set(REQUIRED))
        found = set(REQUIRED)
        for index_dir, parts in self.sources:
            found |= set(side_tables(self.location, index_dir))
            for n in range(parts):
                found |= {p[0] for p in map(parse_part, self.sums(index_dir, n) or {}) if p}
        return sorted(found - {"part"} | {"index"})

    @property
    def has_chunk_sums(self) -> bool:
        """Whether chunk_sums has read the chunks table already."""
        return self._chunks is not None

    def chunk_sums(self, frame: Optional[pd.DataFrame] = None) -> Dict[str, Dict[int, tuple]]:
        """{array: {chunk (or shard) along axis 0: (encoded bytes, crc32c or -1)}} as committed: the last record
        of each (a partial last chunk is rewritten, and recorded again, as it fills); read once, from `frame` (the
        chunks table, read by the caller) or from the files."""
        if self._chunks is None:
            self._chunks = chunk_table_sums(self.read("chunks", CHUNK_COLUMNS) if frame is None else frame)
        return self._chunks

    def read(self, table: str, columns: Optional[List[str]] = None) -> pd.DataFrame:
        """The whole table (every file, checked), or an empty one with `columns` if it has no rows."""
        frames = [read_table(self.location, key, want) for key, want in self.files(table)]
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)



def chunk_path(array, k: int) -> str:
    """The key of chunk (or shard) k along axis 0 of an array."""
    return f"{array.path}/{array.metadata.encode_chunk_key((k,) + (0,) * (array.ndim - 1))}"


def has_crc(array, inner: bool = False) -> bool:
    """Whether each stored object of an array ends in its crc32c (arrays written before it do not; a shard
    holds inner chunks that do: `inner=True` asks about those)."""
    return (inner or array.shards is None) and any(isinstance(c, Crc32cCodec) for c in array.compressors)


def crc_problem(path: str, data: bytes) -> Optional[str]:
    """Why a chunk's bytes do not match the crc32c they end in (None if they do)."""
    body, tail = memoryview(data)[:-4], bytes(data[-4:])
    if len(data) < 4 or crc32c(body) != int.from_bytes(tail, "little"):
        return f"{path}: chunk fails its crc32c checksum (damaged)"
    return None


SHARD_EMPTY = 2**64 - 1  # an inner chunk a shard does not hold (zarr's sharding codec: all fill value)


def shard_count(array) -> int:
    """Inner chunks per shard of a sharded array."""
    return int(np.prod([s // c for s, c in zip(array.shards, array.chunks)]))


def shard_index(path: str, data, count: int) -> np.ndarray:
    """The [count, 2] (offset, bytes) of each inner chunk of a shard (zarr's sharding codec: the index at the end,
    little-endian uint64 pairs, then its crc32c), checked: ValueError names what does not fit."""
    size = count * 16
    if len(data) < size + 4:
        raise ValueError(f"{path}: shard is {len(data)} bytes, shorter than its index (damaged)")
    raw = memoryview(data)[len(data) - size - 4:len(data) - 4]
    if crc32c(raw) != int.from_bytes(bytes(data[-4:]), "little"):
        raise ValueError(f"{path}: shard index fails its crc32c checksum (damaged)")
    index = np.frombuffer(raw, dtype="<u8").reshape(count, 2)
    held = index[:, 0] != SHARD_EMPTY
    if (index[held, 0] + index[held, 1] > len(data) - size - 4).any() or (index[held, 1] < 4).any():
        raise ValueError(f"{path}: shard index points past its chunks (damaged)")
    return index


def shard_sum(path: str, data, count: int) -> int:
    """A shard's checksum, recorded at its commit: the crc32c of its index and of each inner chunk's own
    crc32c (its last four bytes), so a read that checks every inner chunk it decodes checks the shard too.
    ValueError where the shard's index does not read."""
    index = shard_index(path, data, count)
    view = memoryview(data)
    tails = b"".join(bytes(view[int(o + n - 4):int(o + n)]) for o, n in index if o != SHARD_EMPTY)
    return crc32c(tails, crc32c(view[len(data) - count * 16 - 4:]))


def open_array(root, key: str):
    """root[key], or DamagedError naming the metadata that does not read (KeyError if absent); from the root's
    consolidated metadata without zarr's event loop where it has some (a complete store)."""
    try:
        return node_of(root, key)
    except KeyError:
        raise
    except Exception as err:  # noqa: BLE001 - JSONDecodeError, a zarr metadata error: damaged metadata
        raise DamagedError(f"{key}/zarr.json: the array's metadata does not read ({type(err).__name__}: {err})") \
            from None


def _is_store(location: Location) -> bool:
    """Whether a hookrun store is at `location` (its root metadata holds a run's attrs; DamagedError if that
    does not parse). A store killed before it made `_index` is one too."""
    return location.exists("zarr.json") and (hookrun_attrs(root_meta(location)) is not None
                                             or location.is_dir(INDEX_DIR))


def find_store(path, storage_options: Optional[dict] = None) -> Location:
    """The .zarr store of a run dir, or the path itself if it is a store (a path or a URL)."""
    location = path if isinstance(path, Location) else Location(path, storage_options)
    if _is_store(location):
        return location
    if _is_store(location.child("captures.zarr")):
        return location.child("captures.zarr")
    found = [name for name in location.children() if name.endswith(".zarr")]
    if len(found) == 1:
        return location.child(found[0])
    raise FileNotFoundError(f"{location} is neither a hookrun store nor a run dir holding captures.zarr")
