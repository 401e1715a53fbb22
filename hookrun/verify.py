"""Checks a store against what its committed index claims: parts, arrays, chunks and their sizes.

    problems = verify_store(root, index_dir)    # [] when every committed byte is where the index says

Used by `Captures.verify()` on any store, by a resume before it continues a run, and by the writer
before it marks a run complete. Read-only: it never changes the store.

Every commit writes `_index/chunks-N.parquet`, the encoded size of each chunk written since the
previous commit. A chunk below an array's last committed row must be present at that size. The
chunk holding the boundary of a running store's committed rows may have been rewritten after the
commit (it was partial then); it only has to decode.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

import pandas as pd
import zarr
from zarr.core.sync import sync

INDEX_DIR = "_index"


def committed_parts(index_dir: Path, prefix: str, parts: int) -> list:
    """Index parts ("part-") or side-table parts ("<name>-") of committed batches, in order: those numbered
    below `parts`, the root attr `committed_parts`. A commit writes its files first and raises that attr
    last (one atomic write), so a part written by a run killed before that is not committed."""
    return [p for p in sorted(index_dir.glob(f"{prefix}*.parquet")) if int(p.stem.rsplit("-", 1)[1]) < parts]


def side_tables(index_dir: Path) -> list:
    """Names of the per-batch side tables (samples, tokens, chunks, ...) a store holds, merged or in parts."""
    names = {p.stem.rsplit("-", 1)[0] for p in index_dir.glob("*-*.parquet")} - {"part", "batches"}
    names |= {p.stem for p in index_dir.glob("*.parquet") if "-" not in p.stem} - {"index", "batches"}
    return sorted(names)


def read_parts(index_dir: Path, merged: str, prefix: str, parts: int) -> pd.DataFrame:
    """A table from its merged file (complete runs) or its committed parts (running, failed, killed)."""
    if (index_dir / merged).exists():
        return pd.read_parquet(index_dir / merged)
    frames = [pd.read_parquet(p) for p in committed_parts(index_dir, prefix, parts)]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _part_problems(index_dir: Path, attrs) -> List[str]:
    if attrs.get("status") == "complete":
        return [f"{INDEX_DIR}/{name}: missing (a complete run keeps its merged index here)"
                for name in ("index.parquet", "batches.parquet", "chunks.parquet") if not (index_dir / name).exists()]
    expected = int(attrs.get("committed_parts", 0))
    return [f"{INDEX_DIR}/{prefix}{n:06d}.parquet: missing (committed part {n} of {expected})"
            for n in range(expected) for prefix in ("part-", "chunks-", "batches-")
            if not (index_dir / f"{prefix}{n:06d}.parquet").exists()]


def verify_store(root: zarr.Group, index_dir: Path, decode: bool = False) -> List[str]:
    """What is missing or damaged in a store, one line per problem ([] = it reads back as committed).
    `decode=True` also decodes every committed chunk (slower; sizes catch deletion and truncation)."""
    attrs = root.attrs
    problems = _part_problems(index_dir, attrs)
    if problems:
        return problems
    try:  # only the columns needed, reduced part by part: memory stays small for long runs
        committed, index_batches = {}, set()
        parts = int(attrs.get("committed_parts", 0))
        for frame in _frames(index_dir, "index.parquet", "part-", parts, ["array", "row_stop", "batch"]):
            for key, stop in frame.groupby("array").row_stop.max().items():
                committed[key] = max(committed.get(key, 0), int(stop))
            index_batches.update(frame.batch.unique().tolist())
        sizes = {}
        for frame in _frames(index_dir, "chunks.parquet", "chunks-", parts, ["array", "chunk", "nbytes"]):
            sizes.update(zip(zip(frame.array, frame.chunk), frame.nbytes))
        batches = sorted(b for f in _frames(index_dir, "batches.parquet", "batches-", parts, ["batch"]) for b in f.batch)
    except Exception as err:  # noqa: BLE001 - a damaged parquet file
        return [f"{INDEX_DIR}: an index file does not read ({type(err).__name__}: {err})"]
    if batches != list(range(len(batches))):
        problems.append(f"{INDEX_DIR}: committed batches are not 0..{len(batches) - 1} (a part is missing)")
    if not index_batches <= set(batches):
        problems.append(f"{INDEX_DIR}: index rows of batches with no batch record (a batches part is missing)")
    running = attrs.get("status") != "complete"
    for key, stop in sorted(committed.items()):
        problems += _array_problems(root, key, stop, sizes, running, decode)
    return problems


def _frames(index_dir: Path, merged: str, prefix: str, parts: int, columns: List[str]):
    """The given columns of a table, one part (or the merged file) at a time."""
    paths = [index_dir / merged] if (index_dir / merged).exists() else committed_parts(index_dir, prefix, parts)
    for path in paths:
        frame = pd.read_parquet(path, columns=columns)
        if len(frame):
            yield frame


def _array_problems(root, key: str, committed: int, sizes: dict, running: bool, decode: bool) -> List[str]:
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
        if not sync(root.store.exists(path)):
            problems.append(f"{path}: chunk missing (holds committed rows {k * chunk_rows}..{(k + 1) * chunk_rows})")
            continue
        size, want = sync(root.store.getsize(path)), sizes.get((key, k))
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
