"""Checks a store against what its commits and its close recorded: index files, array metadata, chunks.

    problems = verify_store(root, location)     # [] when every committed byte is where the index says

Used by `Captures.verify()` on any store, by a resume before it continues a run, and by the writer
before it marks a run complete. Read-only: it never changes the store, and never raises (what does
not read is a problem line).

What is recorded when it is written, and checked here:
- Chunks: every chunk ends in its crc32c (zarr's `crc32c` codec; stores written before it have none).
  Every commit writes `_index/chunks-N.parquet`: the encoded size and crc32c of each chunk written
  since the previous commit. A chunk below an array's last committed row must be present with that
  size and crc32c (a swap of two same-size chunks shows), and its bytes must match its own crc32c.
  The chunk holding the boundary of a running store's committed rows may have been rewritten after
  the commit (it was partial then); it only has to match its own crc32c.
- Index files: every commit writes `_index/sums-N.json`, the size and crc32c of each file of commit
  N (the root attr `index_sums_from` is the first commit that did); the close records those of the
  merged tables in the root attr `index_files`. A file that is missing or differs is named.
- Array metadata: a complete store's root zarr.json holds a consolidated copy of every group's and
  array's metadata, which readers use: each `zarr.json` must still equal its copy (else the copy
  would mask its damage). In a running store every array's metadata must parse.

Three depths: "size" (sizes only: the writer's check of what it just wrote), "crc" (every chunk's
bytes against its crc32c; the default, and what a resume checks) and "decode" (every chunk decoded).
"""
from __future__ import annotations

import io
import json
import re
from typing import Dict, List, Optional, Tuple

import google_crc32c
import numpy as np
import pandas as pd
import zarr
from zarr.codecs import Crc32cCodec

from hookrun.format.location import Location

INDEX_DIR = "_index"
INDEX_COLUMNS = ["hook", "kind", "layer", "role", "call", "batch", "sample_start", "sample_stop", "array",
                 "row_start", "row_stop", "shape", "dtype", "per_sample", "unit", "mean", "std", "min", "max",
                 "nan_count", "inf_count", "numel"]
BATCH_COLUMNS = ["batch", "sample_start", "sample_stop", "loss", "forward_s", "backward_s"]
CHUNK_COLUMNS = ["array", "chunk", "nbytes", "crc32c"]  # crc32c -1: not recorded (a shard, written by zarr)
MANIFEST = "index_files"  # root attr of a complete store: {merged table file: [bytes, crc32c]}
SUMS_FROM = "index_sums_from"  # root attr: the first commit that wrote its sums-N.json (null: none must)
REQUIRED = ("index", "batches", "chunks")  # tables every commit writes (side tables: when a batch has rows)
_PART = re.compile(r"^(?P<table>.+)-(?P<n>\d{6})\.parquet$")
_SUMS = re.compile(r"sums-\d{6}\.json")
Sources = List[Tuple[str, int]]  # (index dir, committed parts) of each writer: one, or one per rank


class DamagedError(ValueError):
    """A file of a store is missing, does not parse, or differs from what was recorded when it was written."""


def crc32c(data) -> int:
    """The crc32c of a bytes-like object, as zarr's crc32c codec computes it."""
    return google_crc32c.value(data if isinstance(data, bytes) else np.frombuffer(data, dtype=np.uint8))


def file_sum(data) -> List[int]:
    """[bytes, crc32c] of a file's content: what commits and the close record of each index file."""
    return [len(data), crc32c(data)]


def part_prefix(table: str) -> str:
    """The name prefix of a table's parts: index rows are `part-N`, the others `<table>-N`."""
    return "part-" if table == "index" else f"{table}-"


def is_part(name: str) -> bool:
    """Whether a file name in an index dir is a committed part's (`<table>-N.parquet`)."""
    return _PART.match(name) is not None


def is_sums(name: str) -> bool:
    """Whether a file name in an index dir is a commit's sums (`sums-N.json`)."""
    return _SUMS.fullmatch(name) is not None


def sums_key(index_dir: str, n: int) -> str:
    """Where commit `n` of an index dir records the size and crc32c of each of its files."""
    return f"{index_dir}/sums-{n:06d}.json"


def rank_dir(rank: int) -> str:
    """The index dir of one rank of a data-parallel run (its parts, until the run completes)."""
    return f"{INDEX_DIR}/rank-{rank:03d}"


def index_sources(location: Location, attrs) -> Sources:
    """Where a store's committed index parts are: `_index` with the root attr `committed_parts`, or for a
    data-parallel run each rank's dir with the count in its `committed.json` (ranks never share a key)."""
    world = int(attrs.get("world_size", 1))
    if world == 1:
        return [(INDEX_DIR, int(attrs.get("committed_parts", 0)))]
    return [(rank_dir(r), rank_committed(location, rank_dir(r))) for r in range(world)]


def rank_committed(location: Location, index_dir: str) -> int:
    """The committed part count of one rank's index dir (0 before its first commit)."""
    raw = location.get(f"{index_dir}/committed.json")
    try:
        return int(json.loads(raw)["committed_parts"]) if raw else 0
    except (ValueError, KeyError, TypeError):
        raise DamagedError(f"{index_dir}/committed.json: does not parse (damaged)") from None


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


def hookrun_attrs(meta: Optional[dict]) -> Optional[dict]:
    """The root attrs of a hookrun store's root metadata, or None if it is not one."""
    attrs = (meta or {}).get("attributes")
    return attrs if isinstance(attrs, dict) and "config_hash" in attrs and "status" in attrs else None


def _index_files(location: Location, index_dir: str = INDEX_DIR) -> List[str]:
    """Names of the parquet files in one index dir (one listing)."""
    return [n for n in location.children(index_dir) if n.endswith(".parquet")]


def committed_parts(location: Location, prefix: str, parts: int, index_dir: str = INDEX_DIR) -> List[str]:
    """Names of the index parts ("part-") or side-table parts ("<name>-") of committed batches, in order: those
    numbered below `parts` (the committed count). A commit writes its files first and raises that count
    last (one atomic write), so a part written by a run killed before that is not committed."""
    found = (_PART.match(n) for n in _index_files(location, index_dir))
    return sorted(m.string for m in found if m and f"{m['table']}-" == prefix and int(m["n"]) < parts)


def side_tables(location: Location, index_dir: str = INDEX_DIR) -> List[str]:
    """Names of the per-batch side tables (samples, tokens, chunks, ...) an index dir holds, merged or in parts."""
    names = {n[:-len(".parquet")] for n in _index_files(location, index_dir)}
    tables = {m["table"] for m in map(_PART.match, (f"{n}.parquet" for n in names)) if m}
    tables |= {n for n in names if not _PART.match(f"{n}.parquet")}
    return sorted(tables - {"part", "batches", "index"})


def part_keys(location: Location, prefix: str, sources: Sources) -> List[str]:
    """Keys of every committed part with this prefix, writer by writer (rank order), each in order."""
    return [f"{d}/{name}" for d, parts in sources for name in committed_parts(location, prefix, parts, d)]


def read_file(location: Location, key: str, want=None) -> bytes:
    """The bytes of an index file, checked against its recorded [bytes, crc32c] (when recorded)."""
    data = location.get(key)
    if data is None:
        raise DamagedError(f"{key}: missing")
    if want is not None and file_sum(data) != list(want):
        raise DamagedError(f"{key}: {len(data)} bytes with crc32c {crc32c(data):08x}, but {want[0]} bytes with "
                           f"crc32c {want[1]:08x} were written (damaged)")
    return data


def read_table(location: Location, key: str, want=None, columns: Optional[List[str]] = None) -> pd.DataFrame:
    """A parquet index file, checked (read_file); DamagedError if it does not read."""
    data = read_file(location, key, want)
    try:
        return pd.read_parquet(io.BytesIO(data), columns=columns)
    except Exception as err:  # noqa: BLE001 - anything pyarrow says about a file that was written whole
        raise DamagedError(f"{key}: does not read as parquet ({type(err).__name__}: {err})") from None


class IndexFiles:
    """Which files hold a store's tables, and what each must be: the merged files of a complete store (their
    [bytes, crc32c] in the root attr index_files), else every writer's committed parts (in each commit's
    sums-N.json). `sources` names the parts explicitly (the writer's close, a resume)."""

    def __init__(self, location: Location, attrs, sources: Optional[Sources] = None):
        self.location = location
        self.merged = sources is None and attrs.get("status") == "complete"
        self.manifest = attrs.get(MANIFEST) if self.merged else None
        self.sources = [] if self.merged else (sources or index_sources(location, attrs))
        self.sums_from = attrs.get(SUMS_FROM)
        self._sums: Dict[tuple, Optional[dict]] = {}
        self._listed: Dict[str, set] = {}

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
        name = f"{table}.parquet"
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
                part = f"{part_prefix(table)}{n:06d}.parquet"
                sums = self.sums(index_dir, n)
                if table in REQUIRED or (part in sums if sums is not None else part in self._listed[index_dir]):
                    out.append((f"{index_dir}/{part}", sums.get(part) if sums is not None else None))
        return out

    def tables(self) -> List[str]:
        """Names of every table the store holds (index, batches, chunks, samples, tokens, ...)."""
        if self.merged:
            names = self.manifest if self.manifest is not None else _index_files(self.location)
            return sorted({n[:-len(".parquet")] for n in names if not _PART.match(n)} | set(REQUIRED))
        found = set(REQUIRED)
        for index_dir, parts in self.sources:
            found |= set(side_tables(self.location, index_dir))
            for n in range(parts):
                found |= {m["table"] for m in map(_PART.match, self.sums(index_dir, n) or {}) if m}
        return sorted(found - {"part"} | {"index"})

    def read(self, table: str, columns: Optional[List[str]] = None) -> pd.DataFrame:
        """The whole table (every file, checked), or an empty one with `columns` if it has no rows."""
        frames = [read_table(self.location, key, want) for key, want in self.files(table)]
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def verify_store(root: zarr.Group, location: Location, decode: bool = False, sources: Sources = None,
                 depth: Optional[str] = None) -> List[str]:
    """What is missing or damaged in a store, one line per problem ([] = it reads back as committed).
    `depth`: size, crc (default) or decode (`decode=True`); `sources` names the index parts to check against
    (default: the committed ones, or the merged tables of a complete store)."""
    try:
        return _store_problems(root, location, depth or ("decode" if decode else "crc"), sources)
    except DamagedError as err:
        return [str(err)]
    except Exception as err:  # noqa: BLE001 - verify reports; it never raises
        return [f"{location}: the store does not read ({type(err).__name__}: {err})"]


def _store_problems(root, location: Location, depth: str, sources: Optional[Sources]) -> List[str]:
    attrs = dict(root.attrs)
    links = [f"{key}: a symbolic link to {target}; hookrun never follows a link inside a store"
             for key, target in location.links().items()]
    if attrs.get("status") == "replacing":
        return links + ["status replacing: an overwrite was removing this run; rerun it with store.mode=overwrite"]
    running = attrs.get("status") != "complete" or sources is not None
    files = IndexFiles(location, attrs, sources)
    problems = links + _metadata_problems(location, root_meta(location) or {})
    damaged: List[str] = []  # index files: then the index does not say what the arrays hold
    regions: Dict[tuple, List[int]] = {}  # (writer, array) -> [first row, last committed row]
    index_batches, batches, sizes = set(), [], {}
    for n, group in enumerate(files.groups()):  # only the columns needed, file by file: memory stays small
        try:
            for key, want in files.files("index", group):
                frame = read_table(location, key, want, ["array", "row_start", "row_stop", "batch"])
                for array, rows in frame.groupby("array"):
                    lo, hi = regions.get((n, array), [int(rows.row_start.min()), 0])
                    regions[n, array] = [min(lo, int(rows.row_start.min())), max(hi, int(rows.row_stop.max()))]
                index_batches.update(frame.batch.unique().tolist())
            for key, want in files.files("chunks", group):
                frame = read_table(location, key, want)
                crcs = frame.crc32c if "crc32c" in frame.columns else [-1] * len(frame)
                sizes.update(zip(zip(frame.array, frame.chunk), zip(frame.nbytes, crcs)))
            mine = sorted(b for key, want in files.files("batches", group)
                          for b in read_table(location, key, want, ["batch"]).batch)
        except DamagedError as err:
            damaged.append(str(err))
            continue
        if mine and mine != list(range(mine[0], mine[0] + len(mine))):
            damaged.append(f"{group[0][0] if group else INDEX_DIR}: committed batches are not "
                           f"{mine[0]}..{mine[0] + len(mine) - 1} (a part is missing)")
        batches += mine
    try:
        tables = [t for t in files.tables() if t not in REQUIRED]
    except DamagedError:  # a commit's sums (named above)
        tables = []
    for table in tables:
        try:
            for key, want in files.files(table):
                read_table(location, key, want)
        except DamagedError as err:
            damaged.append(str(err))
    if damaged:
        return problems + damaged
    if len(files.sources) <= 1 and batches != list(range(len(batches))):
        problems.append(f"{INDEX_DIR}: committed batches are not 0..{len(batches) - 1} (a part is missing)")
    if not index_batches <= set(batches):
        problems.append(f"{INDEX_DIR}: index rows of batches with no batch record (a batches part is missing)")
    if running:  # no consolidated copy: the groups above the arrays must read (the close consolidates them)
        problems += _group_problems(location, {k.rsplit("/", i)[0] for _, k in regions for i in (1, 2)})
    for (_, key), (first, stop) in sorted(regions.items()):
        problems += _array_problems(root, location, key, 0 if len(files.sources) <= 1 else first, stop, sizes,
                                    running, depth)
    return problems


def _group_problems(location: Location, groups) -> List[str]:
    problems = []
    for group in sorted(groups):
        raw = location.get(f"{group}/zarr.json")
        try:
            if raw is None or json.loads(raw).get("node_type") != "group":
                problems.append(f"{group}/zarr.json: {'missing' if raw is None else 'not a group'} (damaged)")
        except (ValueError, AttributeError) as err:
            problems.append(f"{group}/zarr.json: does not parse ({err}): truncated or damaged")
    return problems


def _plain(meta):
    """Node metadata as written to its zarr.json (a group's consolidated copy adds consolidated_metadata)."""
    return {k: v for k, v in meta.items() if k != "consolidated_metadata"} if isinstance(meta, dict) else meta


def _metadata_problems(location: Location, meta: dict) -> List[str]:
    """Each group's and array's zarr.json against the consolidated copy in the root's (a complete store)."""
    copy = (meta.get("consolidated_metadata") or {}).get("metadata") or {}
    problems = []
    for key, node in sorted(copy.items()):
        path = f"{key}/zarr.json"
        raw = location.get(path)
        if raw is None:
            problems.append(f"{path}: missing (the consolidated copy in zarr.json still lists it)")
            continue
        try:
            found = json.loads(raw)
        except ValueError as err:
            problems.append(f"{path}: does not parse ({err}): truncated or damaged")
            continue
        if _plain(found) != _plain(node):
            problems.append(f"{path}: differs from its consolidated copy in zarr.json (edited or damaged)")
    return problems


def chunk_path(array, k: int) -> str:
    """The key of chunk (or shard) k along axis 0 of an array."""
    return f"{array.path}/{array.metadata.encode_chunk_key((k,) + (0,) * (array.ndim - 1))}"


def has_crc(array) -> bool:
    """Whether each stored object of an array ends in its crc32c (arrays written before it do not; a shard
    holds inner chunks that do)."""
    return array.shards is None and any(isinstance(c, Crc32cCodec) for c in array.compressors)


def crc_problem(path: str, data: bytes) -> Optional[str]:
    """Why a chunk's bytes do not match the crc32c they end in (None if they do)."""
    body, tail = memoryview(data)[:-4], bytes(data[-4:])
    if len(data) < 4 or crc32c(body) != int.from_bytes(tail, "little"):
        return f"{path}: chunk fails its crc32c checksum (damaged)"
    return None


def open_array(root, key: str):
    """root[key], or DamagedError naming the metadata that does not read (KeyError if absent)."""
    try:
        return root[key]
    except KeyError:
        raise
    except Exception as err:  # noqa: BLE001 - JSONDecodeError, a zarr metadata error: damaged metadata
        raise DamagedError(f"{key}/zarr.json: the array's metadata does not read ({type(err).__name__}: {err})") \
            from None


def _array_problems(root, location: Location, key: str, first: int, committed: int, sizes: dict, running: bool,
                    depth: str) -> List[str]:
    """The chunks holding rows [first, committed) of one array (a rank's region starts at the first chunk
    boundary at or after `first`: the chunk before is shared, and kept aside until the run completes)."""
    try:
        array = open_array(root, key)
    except KeyError:
        return [f"{key}: array missing (the index holds {committed} committed rows of it)"]
    except DamagedError as err:
        return [str(err)]
    if array.shape[0] < committed:
        return [f"{key}: array has {array.shape[0]} rows but the index commits {committed}"]
    chunk_rows = (array.shards or array.chunks)[0]  # rows per stored object: a chunk, or a shard
    boundary = committed // chunk_rows if running and committed % chunk_rows else None
    problems = []
    stored = location.sizes(f"{array.path}/")  # one listing, not a request per chunk
    crc = has_crc(array)
    for k in range(-(-first // chunk_rows), -(-committed // chunk_rows)):
        path = chunk_path(array, k)
        if path not in stored:
            problems.append(f"{path}: chunk missing (holds committed rows {k * chunk_rows}..{(k + 1) * chunk_rows})")
            continue
        size, (want, want_crc) = stored[path], sizes.get((key, k), (None, -1))
        if k != boundary and want is not None and size != want:
            problems.append(f"{path}: chunk is {size} bytes but {want} were committed (truncated or rewritten)")
            continue
        if k != boundary and want is None:
            problems.append(f"{path}: chunk has no committed size in {INDEX_DIR}/chunks (written after its commit?)")
            continue
        if depth != "size" and crc:
            data = location.get(path) or b""
            damaged = crc_problem(path, data)
            if damaged:
                problems.append(damaged)
                continue
            if k != boundary and want_crc != -1 and int.from_bytes(data[-4:], "little") != want_crc:
                problems.append(f"{path}: chunk is not the one committed here (crc32c {crc32c(data[:-4]):08x}, "
                                f"committed {want_crc:08x}): moved or rewritten")
                continue
        if k == boundary or depth == "decode" or (depth == "crc" and array.shards is not None):
            try:
                array[k * chunk_rows:min((k + 1) * chunk_rows, committed)]
            except Exception as err:  # noqa: BLE001 - any decode failure is damage
                problems.append(f"{path}: chunk does not decode ({type(err).__name__}: {err})")
    return problems
