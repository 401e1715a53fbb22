"""Checks a store against what its committed index claims: parts, arrays, chunks and their sizes.

    problems = verify_store(root, location)     # [] when every committed byte is where the index says

Used by `Captures.verify()` on any store, by a resume before it continues a run, and by the writer
before it marks a run complete. Read-only: it never changes the store.

Every commit writes `_index/chunks-N.parquet`, the encoded size of each chunk written since the
previous commit. A chunk below an array's last committed row must be present at that size. The
chunk holding the boundary of a running store's committed rows may have been rewritten after the
commit (it was partial then); it only has to decode.
"""
from __future__ import annotations

import json
import re
from typing import Dict, List, Tuple

import pandas as pd
import zarr

from hookrun.storage import Location

INDEX_DIR = "_index"
INDEX_COLUMNS = ["hook", "kind", "layer", "role", "call", "batch", "sample_start", "sample_stop", "array",
                 "row_start", "row_stop", "shape", "dtype", "per_sample", "unit", "mean", "std", "min", "max",
                 "nan_count", "inf_count", "numel"]
BATCH_COLUMNS = ["batch", "sample_start", "sample_stop", "loss", "forward_s", "backward_s"]
_PART = re.compile(r"^(?P<table>.+)-(?P<n>\d{6})\.parquet$")
Sources = List[Tuple[str, int]]  # (index dir, committed parts) of each writer: one, or one per rank


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
    return int(json.loads(raw)["committed_parts"]) if raw else 0


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


def read_parts(location: Location, merged: str, prefix: str, sources: Sources, columns=None) -> pd.DataFrame:
    """A table from its merged file (complete runs) or its committed parts (running, failed, killed); with
    no committed part, an empty table with `columns`."""
    if location.exists(f"{INDEX_DIR}/{merged}"):
        return location.read_parquet(f"{INDEX_DIR}/{merged}")
    frames = [location.read_parquet(k) for k in part_keys(location, prefix, sources)]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def _part_problems(location: Location, attrs, sources: Sources) -> List[str]:
    if attrs.get("status") == "complete":
        present = set(_index_files(location))
        return [f"{INDEX_DIR}/{name}: missing (a complete run keeps its merged index here)"
                for name in ("index.parquet", "batches.parquet", "chunks.parquet") if name not in present]
    problems = []
    for index_dir, expected in sources:
        present = set(_index_files(location, index_dir))
        problems += [f"{index_dir}/{prefix}{n:06d}.parquet: missing (committed part {n} of {expected})"
                     for n in range(expected) for prefix in ("part-", "chunks-", "batches-")
                     if f"{prefix}{n:06d}.parquet" not in present]
    return problems


def verify_store(root: zarr.Group, location: Location, decode: bool = False, sources: Sources = None) -> List[str]:
    """What is missing or damaged in a store, one line per problem ([] = it reads back as committed).
    `decode=True` also decodes every committed chunk (slower; sizes catch deletion and truncation).
    `sources` names the index parts to check against (default: the committed ones)."""
    attrs = root.attrs
    complete = attrs.get("status") == "complete"
    sources = sources or ([(INDEX_DIR, 0)] if complete else index_sources(location, attrs))
    problems = _part_problems(location, attrs, sources)
    if problems:
        return problems
    try:  # only the columns needed, reduced part by part: memory stays small for long runs
        regions: Dict[tuple, List[int]] = {}  # (writer, array) -> [first row, last committed row]
        index_batches, batches, sizes = set(), [], {}
        for n, source in enumerate(sources):
            for frame in _frames(location, "index.parquet", "part-", [source], ["array", "row_start", "row_stop", "batch"]):
                for key, group in frame.groupby("array"):
                    lo, hi = regions.get((n, key), [int(group.row_start.min()), 0])
                    regions[n, key] = [min(lo, int(group.row_start.min())), max(hi, int(group.row_stop.max()))]
                index_batches.update(frame.batch.unique().tolist())
            for frame in _frames(location, "chunks.parquet", "chunks-", [source], ["array", "chunk", "nbytes"]):
                sizes.update(zip(zip(frame.array, frame.chunk), frame.nbytes))
            mine = sorted(b for f in _frames(location, "batches.parquet", "batches-", [source], ["batch"]) for b in f.batch)
            if mine and mine != list(range(mine[0], mine[0] + len(mine))):
                problems.append(f"{source[0]}: committed batches are not {mine[0]}..{mine[0] + len(mine) - 1} "
                                "(a part is missing)")
            batches += mine
    except Exception as err:  # noqa: BLE001 - a damaged parquet file
        return [f"{INDEX_DIR}: an index file does not read ({type(err).__name__}: {err})"]
    if len(sources) == 1 and batches != list(range(len(batches))):
        problems.append(f"{INDEX_DIR}: committed batches are not 0..{len(batches) - 1} (a part is missing)")
    if not index_batches <= set(batches):
        problems.append(f"{INDEX_DIR}: index rows of batches with no batch record (a batches part is missing)")
    for (_, key), (first, stop) in sorted(regions.items()):
        problems += _array_problems(root, location, key, 0 if len(sources) == 1 else first, stop, sizes,
                                    not complete, decode)
    return problems


def _frames(location: Location, merged: str, prefix: str, sources: Sources, columns: List[str]):
    """The given columns of a table, one part (or the merged file) at a time."""
    keys = [f"{INDEX_DIR}/{merged}"] if location.exists(f"{INDEX_DIR}/{merged}") else part_keys(location, prefix, sources)
    for key in keys:
        frame = location.read_parquet(key, columns=columns)
        if len(frame):
            yield frame


def _array_problems(root, location: Location, key: str, first: int, committed: int, sizes: dict, running: bool,
                    decode: bool) -> List[str]:
    """The chunks holding rows [first, committed) of one array (a rank's region starts at the first chunk
    boundary at or after `first`: the chunk before is shared, and kept aside until the run completes)."""
    try:
        array = root[key]
    except KeyError:
        return [f"{key}: array missing (the index holds {committed} committed rows of it)"]
    if array.shape[0] < committed:
        return [f"{key}: array has {array.shape[0]} rows but the index commits {committed}"]
    chunk_rows = (array.shards or array.chunks)[0]  # rows per stored object: a chunk, or a shard
    boundary = committed // chunk_rows if running and committed % chunk_rows else None
    problems = []
    stored = location.sizes(f"{array.path}/")  # one listing, not a request per chunk
    for k in range(-(-first // chunk_rows), -(-committed // chunk_rows)):
        name = array.metadata.encode_chunk_key((k,) + (0,) * (array.ndim - 1))
        path = f"{array.path}/{name}"
        if path not in stored:
            problems.append(f"{path}: chunk missing (holds committed rows {k * chunk_rows}..{(k + 1) * chunk_rows})")
            continue
        size, want = stored[path], sizes.get((key, k))
        if k == boundary or decode:
            try:
                array[k * chunk_rows:min((k + 1) * chunk_rows, committed)]
            except Exception as err:  # noqa: BLE001 - any decode failure is damage
                problems.append(f"{path}: chunk does not decode ({type(err).__name__}: {err})")
                continue
        if k != boundary and want is not None and size != want:
            problems.append(f"{path}: chunk is {size} bytes but {want} were committed (truncated or rewritten)")
        elif k != boundary and want is None:
            problems.append(f"{path}: chunk has no committed size in {INDEX_DIR}/chunks (written after its commit?)")
    return problems
