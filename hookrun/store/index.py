"""The parquet index of a store: per-commit parts, what a resume reads back, the merge at completion.

    _index/part-N.parquet     index rows of the batches committed in commit N
    _index/<table>-N.parquet  their side tables (samples, tokens) and chunk sizes (chunks)
    _index/batches-N.parquet  one row per batch of commit N
    _index/index.parquet      all rows (and batches/<table>.parquet), once the run is complete

A commit writes its files (each one key, written whole), then raises the root attr
`committed_parts` (one atomic write): that attr is the commit. Readers and a resume read only
the parts below it.
"""
from __future__ import annotations

import collections
import json
import re
from typing import Dict, List

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from hookrun.storage import Location
from hookrun.verify import BATCH_COLUMNS, INDEX_COLUMNS, INDEX_DIR, Sources, part_keys, side_tables

TABLES_KEY = "_tables"  # a batch record's side tables (name -> DataFrame), committed with it
_PART = re.compile(r"(?P<table>[\w.-]+)-(?P<n>\d{6})\.parquet")  # a part: `<table>-N.parquet`


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

    def key(self, name: str) -> str:
        return f"{self.dir}/{name}"

    def parts_of(self, prefix: str) -> List[str]:
        """Keys of the committed parts with this prefix, in order."""
        return part_keys(self.location, prefix, [(self.dir, self.parts)])

    def commit(self, chunk_log: Dict[tuple, int]) -> None:
        """Write part N: index rows, side tables, chunk sizes and batch records of every finished batch,
        then raise the committed count to N + 1."""
        ready, self.batch_rows = self.batch_rows, []
        done = {r["batch"] for r in ready}
        rows = [r for r in self.rows if r["batch"] in done]
        self.rows = [r for r in self.rows if r["batch"] not in done]
        tables: Dict[str, list] = collections.defaultdict(list)
        for record in ready:
            for name, frame in record[TABLES_KEY].items():
                tables[name].append(frame)
        n = f"{self.parts:06d}"
        put = self.location.write_parquet
        put(self.key(f"part-{n}.parquet"), pd.DataFrame(rows, columns=INDEX_COLUMNS))
        for name, frames in tables.items():
            put(self.key(f"{name}-{n}.parquet"), pd.concat(frames, ignore_index=True))
        put(self.key(f"chunks-{n}.parquet"),
            pd.DataFrame([(a, c, b) for (a, c), b in chunk_log.items()], columns=["array", "chunk", "nbytes"]))
        put(self.key(f"batches-{n}.parquet"),
            pd.DataFrame([{k: r[k] for k in BATCH_COLUMNS} for r in ready], columns=BATCH_COLUMNS))
        self.parts += 1
        self.mark()
        pa.default_memory_pool().release_unused()  # arrow's allocator keeps freed pages: memory would grow with the run

    def mark(self) -> None:
        """Record the committed count: this one atomic write is the commit."""
        if self.dir == INDEX_DIR:
            self.root.attrs["committed_parts"] = self.parts
        else:
            self.location.put(self.key("committed.json"), json.dumps({"committed_parts": self.parts}).encode())

    def drop_uncommitted(self) -> None:
        """Remove index files a killed run wrote after its last commit (and a merge it did not finish): the parts
        numbered from the committed count on, the merged tables and their temp files. Nothing else: a file of
        yours in the index dir stays."""
        names = [k[len(self.dir) + 1:] for k in self.location.keys(f"{self.dir}/")]
        found = [(name, _PART.fullmatch(name)) for name in names if "/" not in name]
        tables = {"index", "batches"} | {m["table"] for _, m in found if m} - {"part"}
        keys = [self.key(name) for name, m in found if m and int(m["n"]) >= self.parts]
        keys += [f"{INDEX_DIR}/{t}.parquet{tmp}" for t in sorted(tables) for tmp in ("", ".tmp")]
        for key in keys:
            if self.location.exists(key):
                self.location.delete(key)

    def committed(self):
        """(index rows, batch records) of every committed part, for a resume."""
        index = pd.concat([self.location.read_parquet(k) for k in self.parts_of("part-")]
                          or [pd.DataFrame(columns=INDEX_COLUMNS)], ignore_index=True)
        done = pd.concat([self.location.read_parquet(k) for k in self.parts_of("batches-")]
                         or [pd.DataFrame(columns=BATCH_COLUMNS)])
        return index, done


def merge(location: Location, sources: Sources) -> None:
    """index.parquet, batches.parquet and each side table in `_index`, from every committed part of every
    writer (rank order), beside the parts (which stay until the status says complete). Streamed part by
    part, so memory does not grow with the run."""
    tables = sorted({t for d, _ in sources for t in side_tables(location, d)})
    merges = [("part-", "index.parquet"), ("batches-", "batches.parquet")]
    merges += [(f"{name}-", f"{name}.parquet") for name in tables]
    for prefix, name in merges:
        keys = part_keys(location, prefix, sources)
        if not keys and prefix not in ("part-", "batches-", "chunks-"):
            continue  # no part: not a table of this run (a file of yours named <name>.parquet), never written over
        with location.local_file(f"{INDEX_DIR}/{name}") as path:
            _merge_parquet(location, keys, path, order=forward_order if prefix == "part-" else None)
        pa.default_memory_pool().release_unused()


def remove_parts(location: Location, sources: Sources) -> None:
    """Delete the parts once the status says the merged files are whole (and the rank dirs, emptied)."""
    for index_dir, parts in sources:
        for prefix in ["part-", *(f"{name}-" for name in side_tables(location, index_dir)), "batches-"]:
            for key in part_keys(location, prefix, [(index_dir, parts)]):
                location.delete(key)
        if index_dir != INDEX_DIR:
            location.delete_dir(index_dir)


def _merge_parquet(location: Location, parts: List[str], path, order=None) -> None:
    """Concatenate parquet parts into one local file, one part in memory at a time; `order(DataFrame) ->
    DataFrame` orders the rows within each part (a part holds whole batches, in order)."""
    writer, schema = None, None
    try:
        for key in parts:
            table = pq.read_table(pa.BufferReader(location.get(key)))
            if not table.num_rows and schema is not None:
                continue
            if order is not None and table.num_rows:
                table = pa.Table.from_pandas(order(table.to_pandas()), preserve_index=False)
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
