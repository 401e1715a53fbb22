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

import re
from typing import List

import pandas as pd
import zarr

from hookrun.storage import Location

INDEX_DIR = "_index"
_PART = re.compile(r"^(?P<table>.+)-(?P<n>\d{6})\.parquet$")


def _index_files(location: Location) -> List[str]:
    """Names of the parquet files in a store's index (one listing)."""
    return [n for n in location.children(INDEX_DIR) if n.endswith(".parquet")]


def committed_parts(location: Location, prefix: str, parts: int) -> List[str]:
    """Names of the index parts ("part-") or side-table parts ("<name>-") of committed batches, in order: those
    numbered below `parts`, the root attr `committed_parts`. A commit writes its files first and raises that
    attr last (one atomic write), so a part written by a run killed before that is not committed."""
    found = (_PART.match(n) for n in _index_files(location))
    return sorted(m.string for m in found if m and f"{m['table']}-" == prefix and int(m["n"]) < parts)


def side_tables(location: Location) -> List[str]:
    """Names of the per-batch side tables (samples, tokens, chunks, ...) a store holds, merged or in parts."""
    names = {n[:-len(".parquet")] for n in _index_files(location)}
    tables = {m["table"] for m in map(_PART.match, (f"{n}.parquet" for n in names)) if m}
    tables |= {n for n in names if not _PART.match(f"{n}.parquet")}
    return sorted(tables - {"part", "batches", "index"})


def read_parts(location: Location, merged: str, prefix: str, parts: int) -> pd.DataFrame:
    """A table from its merged file (complete runs) or its committed parts (running, failed, killed)."""
    if location.exists(f"{INDEX_DIR}/{merged}"):
        return location.read_parquet(f"{INDEX_DIR}/{merged}")
    frames = [location.read_parquet(f"{INDEX_DIR}/{p}") for p in committed_parts(location, prefix, parts)]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _part_problems(location: Location, attrs) -> List[str]:
    present = set(_index_files(location))
    if attrs.get("status") == "complete":
        return [f"{INDEX_DIR}/{name}: missing (a complete run keeps its merged index here)"
                for name in ("index.parquet", "batches.parquet", "chunks.parquet") if name not in present]
    expected = int(attrs.get("committed_parts", 0))
    return [f"{INDEX_DIR}/{prefix}{n:06d}.parquet: missing (committed part {n} of {expected})"
            for n in range(expected) for prefix in ("part-", "chunks-", "batches-")
            if f"{prefix}{n:06d}.parquet" not in present]


def verify_store(root: zarr.Group, location: Location, decode: bool = False) -> List[str]:
    """What is missing or damaged in a store, one line per problem ([] = it reads back as committed).
    `decode=True` also decodes every committed chunk (slower; sizes catch deletion and truncation)."""
    attrs = root.attrs
    problems = _part_problems(location, attrs)
    if problems:
        return problems
    try:  # only the columns needed, reduced part by part: memory stays small for long runs
        committed, index_batches = {}, set()
        parts = int(attrs.get("committed_parts", 0))
        for frame in _frames(location, "index.parquet", "part-", parts, ["array", "row_stop", "batch"]):
            for key, stop in frame.groupby("array").row_stop.max().items():
                committed[key] = max(committed.get(key, 0), int(stop))
            index_batches.update(frame.batch.unique().tolist())
        sizes = {}
        for frame in _frames(location, "chunks.parquet", "chunks-", parts, ["array", "chunk", "nbytes"]):
            sizes.update(zip(zip(frame.array, frame.chunk), frame.nbytes))
        batches = sorted(b for f in _frames(location, "batches.parquet", "batches-", parts, ["batch"]) for b in f.batch)
    except Exception as err:  # noqa: BLE001 - a damaged parquet file
        return [f"{INDEX_DIR}: an index file does not read ({type(err).__name__}: {err})"]
    if batches != list(range(len(batches))):
        problems.append(f"{INDEX_DIR}: committed batches are not 0..{len(batches) - 1} (a part is missing)")
    if not index_batches <= set(batches):
        problems.append(f"{INDEX_DIR}: index rows of batches with no batch record (a batches part is missing)")
    running = attrs.get("status") != "complete"
    for key, stop in sorted(committed.items()):
        problems += _array_problems(root, location, key, stop, sizes, running, decode)
    return problems


def _frames(location: Location, merged: str, prefix: str, parts: int, columns: List[str]):
    """The given columns of a table, one part (or the merged file) at a time."""
    names = [merged] if location.exists(f"{INDEX_DIR}/{merged}") else committed_parts(location, prefix, parts)
    for name in names:
        frame = location.read_parquet(f"{INDEX_DIR}/{name}", columns=columns)
        if len(frame):
            yield frame


def _array_problems(root, location: Location, key: str, committed: int, sizes: dict, running: bool, decode: bool) -> List[str]:
    try:
        array = root[key]
    except KeyError:
        return [f"{key}: array missing (the index holds {committed} committed rows of it)"]
    if array.shape[0] < committed:
        return [f"{key}: array has {array.shape[0]} rows but the index commits {committed}"]
    chunk_rows = (array.shards or array.chunks)[0]  # rows per stored object: a chunk, or a shard
    boundary = committed // chunk_rows if running and committed % chunk_rows else None
    problems = []
    for k in range(-(-committed // chunk_rows)):
        name = array.metadata.encode_chunk_key((k,) + (0,) * (array.ndim - 1))
        path = f"{array.path}/{name}"
        if not location.exists(path):
            problems.append(f"{path}: chunk missing (holds committed rows {k * chunk_rows}..{(k + 1) * chunk_rows})")
            continue
        size, want = location.size(path), sizes.get((key, k))
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
