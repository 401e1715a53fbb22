"""The parquet index of a store: per-commit parts, what a resume reads back, the merge at completion.

The files and their names are the format's (hookrun.format.layout). A commit writes its files (each one
key, written whole), then their sums, then raises the root attr `committed_parts` (one atomic write):
that attr is the commit. Readers and a resume read only the parts below it. The merge returns the size
and crc32c of each merged file (the close records them in the root attrs with the status complete).
"""
from __future__ import annotations

import collections
import json
from typing import Dict, List, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from hookrun.format.files import IndexFiles, Sources, committed_parts, crc32c, file_sum, read_file, tables_of
from hookrun.format.layout import (BATCH_COLUMNS, CHUNK_COLUMNS, COMMITTED, COMMITTED_FILE, INDEX_COLUMNS, INDEX_DIR,
                                   REQUIRED, is_sums, merged_name, parse_part, part_name, sums_key, sums_number)
from hookrun.format.files import parquet_bytes
from hookrun.storage import Location

TABLES_KEY = "_tables"  # a batch record's side tables (name -> DataFrame or Columns), committed with it


class Columns:
    """One batch's rows of a side table as columns (name -> numpy array or list, all one length), made a DataFrame
    once a commit, for all its batches together (a DataFrame a batch cost ~1 ms, more than a small model's
    lens batch).

        rows = Columns({"sample": np.arange(4), "token": ["a", "b", "c", "d"]}); len(rows) == 4; rows.frame()
    """

    def __init__(self, columns: Dict[str, object]):
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), ()))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.columns)


def joined(parts: list) -> pd.DataFrame:
    """One table of a side table's parts in order (DataFrames or Columns): Columns with the same names are
    joined column by column first (the table pd.concat of their frames makes, as one DataFrame would type it).

        joined([Columns({"sample": np.arange(2)}), Columns({"sample": np.arange(2, 4)})])["sample"].tolist()
        # [0, 1, 2, 3]
    """
    if parts and all(isinstance(p, Columns) for p in parts) and len({tuple(p.columns) for p in parts}) == 1:
        return pd.DataFrame({name: _joined_column([p.columns[name] for p in parts]) for name in parts[0].columns})
    return pd.concat([p.frame() if isinstance(p, Columns) else p for p in parts], ignore_index=True)


def _joined_column(values: list):
    if all(isinstance(v, np.ndarray) for v in values):
        return np.concatenate(values)
    return [x for v in values for x in (v.tolist() if isinstance(v, np.ndarray) else v)]


def forward_order(rows: List[dict]) -> List[dict]:
    """Index rows sorted by batch, hook, then each hook's layers and calls in forward order, then role (stable; a
    row without a role last).

    Rows arrive in capture order: forward in forward order, gradient kinds (backward*, *_grad) in
    backward order, so the (layer, call) blocks of a gradient hook are reversed within their batch."""
    blocks: Dict[tuple, int] = {}  # (batch, hook, layer, call) -> its place among its (batch, hook)'s blocks
    count: Dict[tuple, int] = collections.Counter()
    for row in rows:
        block = (row["batch"], row["hook"], row.get("layer"), row.get("call"))
        if block not in blocks:
            blocks[block] = count[block[:2]]
            count[block[:2]] += 1

    def key(row: dict) -> tuple:
        block = (row["batch"], row["hook"], row.get("layer"), row.get("call"))
        kind = row.get("kind") if isinstance(row.get("kind"), str) else ""
        place = blocks[block]
        if kind.startswith("backward") or kind.endswith("_grad"):
            place = count[block[:2]] - 1 - place
        role = row.get("role")
        return row["batch"], row["hook"], place, not isinstance(role, str), role if isinstance(role, str) else ""
    return sorted(rows, key=key)


class Index:
    """Index rows and batch records of one writer (the run, or one rank of it), committed part by part
    into `index_dir`; the committed count is the root attr (one writer) or `<index_dir>/committed.json`."""

    def __init__(self, location: Location, root, parts: int = 0, index_dir: str = INDEX_DIR):
        self.location = location
        self.root = root
        self.parts = parts  # committed parts
        self.dir = index_dir
        self.rows: List[dict] = []  # index rows of batches not yet committed
        self.batch_rows: List[dict] = []  # records of finished batches not yet committed
        self.last_batch: Optional[int] = None  # the last batch this process committed (None: none yet)

    def key(self, name: str) -> str:
        return f"{self.dir}/{name}"

    def commit(self, chunk_log: Dict[tuple, tuple]) -> None:
        """Write part N: index rows, side tables, chunk sizes and crc32c and batch records of every finished
        batch, then the size and crc32c of each, then raise the committed count to N + 1."""
        ready, self.batch_rows = self.batch_rows, []
        done = {r["batch"] for r in ready}
        self.last_batch = max(done, default=self.last_batch)
        rows = [r for r in self.rows if r["batch"] in done]
        self.rows = [r for r in self.rows if r["batch"] not in done]
        tables: Dict[str, list] = collections.defaultdict(list)
        for record in ready:
            for name, frame in record[TABLES_KEY].items():
                tables[name].append(frame)
        sums = {}

        def put(name: str, data) -> None:
            sums[name] = file_sum(data)
            self.location.put(self.key(name), data)
        fired: Dict[int, int] = collections.Counter()
        for row in rows:  # rows arrive as the hooks fired (cap.first_nonfinite)
            row["fired"] = fired[row["batch"]]
            fired[row["batch"]] += 1
        # a part holds whole batches in forward order: the merged index is the parts one after another
        put(part_name("index", self.parts), _rows_parquet(forward_order(rows), INDEX_COLUMNS))
        for name, frames in tables.items():
            put(part_name(name, self.parts), parquet_bytes(joined(frames)))
        chunks = [dict(zip(CHUNK_COLUMNS, (a, c, b, crc))) for (a, c), (b, crc) in chunk_log.items()]
        put(part_name("chunks", self.parts), _rows_parquet(chunks, CHUNK_COLUMNS))
        put(part_name("batches", self.parts), _rows_parquet(ready, BATCH_COLUMNS))
        self.location.put(sums_key(self.dir, self.parts), json.dumps(sums).encode())
        self.parts += 1
        self.mark()
        pa.default_memory_pool().release_unused()  # arrow's allocator keeps freed pages: memory would grow with the run

    def mark(self) -> None:
        """Record the committed count: this one atomic write is the commit."""
        if self.dir == INDEX_DIR:
            self.root.attrs[COMMITTED] = self.parts
        else:
            self.location.put(self.key(COMMITTED_FILE), json.dumps({COMMITTED: self.parts}).encode())

    def drop_uncommitted(self) -> None:
        """Remove index files a killed run wrote after its last commit (and a merge it did not finish): the parts
        and sums numbered from the committed count on, the merged tables and their temp files. Nothing else: a
        file of yours in the index dir stays."""
        names = [k[len(self.dir) + 1:] for k in self.location.keys(f"{self.dir}/")]
        found = [(name, parse_part(name)) for name in names if "/" not in name]
        tables = {"index", "batches"} | {p[0] for _, p in found if p} - {"part"}
        keys = [self.key(name) for name, p in found if p and p[1] >= self.parts]
        keys += [self.key(name) for name, _ in found if is_sums(name) and sums_number(name) >= self.parts]
        keys += [f"{INDEX_DIR}/{merged_name(t)}{tmp}" for t in sorted(tables) for tmp in ("", ".tmp")]
        for key in keys:
            if self.location.exists(key):
                self.location.delete(key)

    def committed(self):
        """(index rows, batch records) of every committed part (each checked against its commit's sums), for a
        resume."""
        files = IndexFiles(self.location, self.root.attrs, [(self.dir, self.parts)])
        return files.read("index", INDEX_COLUMNS), files.read("batches", BATCH_COLUMNS)


def _rows_parquet(rows: List[dict], columns: List[str]) -> bytes:
    """Rows (dicts) as the bytes of a parquet table of `columns`, read back as pd.DataFrame(rows, columns=columns)
    would be written (a missing value is null), without pandas: ~5 ms less for each small part."""
    nan = float("nan")

    def column(values: list) -> pa.Array:  # NaN alone (a column no row has): float, as pandas makes it
        only_nan = values and all(isinstance(v, float) and v != v for v in values)
        return pa.array(values, type=pa.float64() if only_nan else None, from_pandas=True)
    table = pa.table({c: column([r.get(c, nan) for r in rows]) for c in columns})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    return buf.getvalue().to_pybytes()


def merge(location: Location, attrs, sources: Sources) -> Dict[str, list]:
    """index.parquet, batches.parquet and each side table in `_index`, from every committed part of every
    writer (rank order, each part checked against its commit's sums), beside the parts (which stay until
    the status says complete). Streamed part by part, so memory does not grow with the run. Returns
    {merged file: [bytes, crc32c]} (the root attr index_files of the complete store)."""
    files = IndexFiles(location, attrs, sources)
    manifest = {}
    for table in files.tables():
        name = merged_name(table)
        parts = files.files(table)
        if not parts and table not in REQUIRED:
            continue  # no part: not a table of this run (a file of yours named <name>.parquet), never written over
        if len(parts) == 1:  # one part, as it is: its bytes (checked against its sums) are the file, in one put
            key, want = parts[0]
            data = read_file(location, key, want)
            location.put(f"{INDEX_DIR}/{name}", data)
            manifest[name] = list(want) if want is not None else file_sum(data)  # (read_file checked it against want)
            continue
        with location.local_file(f"{INDEX_DIR}/{name}") as path:
            _merge_parquet(location, parts, path)
            manifest[name] = _local_sum(path)
        pa.default_memory_pool().release_unused()
    return manifest


def _local_sum(path) -> list:
    """[bytes, crc32c] of a local file, read a block at a time."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = crc32c(block, crc)
            size += len(block)
    return [size, crc]


def remove_parts(location: Location, sources: Sources) -> None:
    """Delete the parts and their sums once the status says the merged files are whole (and the rank dirs); one
    listing of each index dir (a memory store's listing reads every key of the process)."""
    for index_dir, parts in sources:
        names = location.children(index_dir)
        for prefix in ["part-", *(f"{name}-" for name in tables_of(names)), "batches-"]:
            for name in committed_parts(names, prefix, parts):
                location.delete(f"{index_dir}/{name}")
        for name in names:
            if is_sums(name):
                location.delete(f"{index_dir}/{name}")
        if index_dir != INDEX_DIR:
            location.delete_dir(index_dir)


def _merge_parquet(location: Location, parts: List[tuple], path) -> None:
    """Concatenate parquet parts ((key, [bytes, crc32c]) each) into one local file, one part in memory at a time."""
    writer, schema = None, None
    try:
        for key, want in parts:
            table = pq.read_table(pa.BufferReader(read_file(location, key, want)))
            if not table.num_rows and schema is not None:
                continue
            if writer is None:
                schema = table.schema
                writer = pq.ParquetWriter(path, schema)
            writer.write_table(table.cast(schema) if table.num_rows else table)
            del table
            pa.default_memory_pool().release_unused()  # else arrow's allocator keeps every part's pages
        if writer is None:  # no parts at all
            pq.write_table(pa.table({}), path)
    finally:
        if writer is not None:
            writer.close()
