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
- Shards (store.shard_mb): each commit records a shard's size and checksum (shard_sum: the crc32c of its
  index and of each inner chunk's crc32c); its index must match its crc32c, and it is decoded.
- Array metadata and root attrs: a complete store's root zarr.json holds a consolidated copy of every
  group's and array's metadata, which readers use: each `zarr.json` must still equal its copy (else the
  copy would mask its damage), and the root attrs and the copy must match root_crc32c, which the close
  records (version 3). In a running store every array's metadata must parse.

Three depths: "size" (sizes only: the writer's check of what it just wrote), "crc" (every chunk's
bytes against its crc32c; the default, and what a resume checks) and "decode" (every chunk decoded).
A store written in a newer format than this hookrun's is one problem line (hookrun.format.layout).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import zarr

from hookrun.format.files import (DamagedError, IndexFiles, Sources, chunk_path, crc32c, crc_problem, has_crc,
                                  open_array, read_table, root_meta, root_problem, run_id_problems, shard_count,
                                  shard_sum)
from hookrun.format.layout import (COMMITTED, COMPLETE, INDEX_DIR, MANIFEST, REPLACING, REQUIRED, STATUS,
                                   newer_version)
from hookrun.storage import Location


def verify_store(root: zarr.Group, location: Location, decode: bool = False, sources: Sources = None,
                 depth: Optional[str] = None) -> List[str]:
    """What is missing or damaged in a store, one line per problem ([] = it reads back as committed).
    `depth`: size, crc (default) or decode (`decode=True`); `sources` names the index parts to check against
    (default: the committed ones, or the merged tables of a complete store)."""
    depth = depth or ("decode" if decode else "crc")
    for _ in range(3):
        problems = _checked(root, location, depth, sources)
        if not problems or sources is not None:
            return problems
        attrs = dict(root.attrs)
        try:
            now = (root_meta(location) or {}).get("attributes") or {}
        except DamagedError:
            return problems
        if _moves(attrs) == _moves(now):  # nothing committed or closed meanwhile: what was found is what is there
            return problems
        root = location.open_group("r")  # read again, as it is now
    return [f"{location}: still being written (status {now.get(STATUS)}): a writer committed or closed it while "
            "verify read it, so parts it listed moved; verify again when the run has finished"]


def _moves(attrs: dict) -> tuple:
    """What a writer changes as it commits and closes (the committed count, the status, the merged files)."""
    return attrs.get(STATUS), attrs.get(COMMITTED), json.dumps(attrs.get(MANIFEST), sort_keys=True)


def _checked(root, location: Location, depth: str, sources: Optional[Sources]) -> List[str]:
    try:
        return _store_problems(root, location, depth, sources)
    except DamagedError as err:
        return [str(err)]
    except Exception as err:  # noqa: BLE001 - verify reports; it never raises
        return [f"{location}: the store does not read ({type(err).__name__}: {err})"]


def _store_problems(root, location: Location, depth: str, sources: Optional[Sources]) -> List[str]:
    attrs = dict(root.attrs)
    links = [f"{key}: a symbolic link to {target}; hookrun never follows a link inside a store"
             for key, target in location.links().items()]
    newer = newer_version(attrs, location)
    if newer:
        return links + [newer]
    if attrs.get(STATUS) == REPLACING:
        return links + ["status replacing: an overwrite was removing this run; rerun it with store.mode=overwrite"]
    running = attrs.get(STATUS) != COMPLETE or sources is not None
    files = IndexFiles(location, attrs, sources, check_root=False)
    meta = root_meta(location) or {}
    problems = links + [p for p in [root_problem(meta)] if p] + _metadata_problems(location, meta)
    committed = _read_committed(location, files)
    damaged = committed.damaged + _table_problems(location, files)
    if damaged:  # index files: then the index does not say what the arrays hold
        return problems + damaged
    batches = committed.batches
    if len(files.sources) <= 1 and batches != list(range(len(batches))):
        problems.append(f"{INDEX_DIR}: committed batches are not 0..{len(batches) - 1} (a part is missing)")
    if not committed.index_batches <= set(batches):
        problems.append(f"{INDEX_DIR}: index rows of batches with no batch record (a batches part is missing)")
    if running:  # no consolidated copy: the groups above the arrays must read (the close consolidates them)
        problems += _group_problems(location, {k.rsplit("/", i)[0] for _, k in committed.regions for i in (1, 2)})
    problems += run_id_problems(location, attrs, {key for _, key in committed.regions})
    for (_, key), (first, stop) in sorted(committed.regions.items()):
        problems += _array_problems(root, location, key, 0 if len(files.sources) <= 1 else first, stop,
                                    committed.sizes, running, depth)
    return problems


@dataclass
class _Committed:
    """What the index parts say was committed, and the parts that do not read (`damaged`)."""

    regions: Dict[tuple, List[int]] = field(default_factory=dict)  # (writer, array) -> [first row, last committed row]
    index_batches: Set[int] = field(default_factory=set)  # batches the index rows name
    batches: List[int] = field(default_factory=list)  # batches with a batch record, commit group by group
    sizes: Dict[tuple, tuple] = field(default_factory=dict)  # (array, chunk) -> (nbytes, crc32c or -1)
    damaged: List[str] = field(default_factory=list)


def _read_committed(location: Location, files: IndexFiles) -> _Committed:
    """The index, chunks and batches parts of every commit group, reading only the columns needed, file by file
    (memory stays small)."""
    out = _Committed()
    for n, group in enumerate(files.groups()):
        try:
            for key, want in files.files("index", group):
                frame = read_table(location, key, want, ["array", "row_start", "row_stop", "batch"])
                for array, rows in frame.groupby("array"):
                    lo, hi = out.regions.get((n, array), [int(rows.row_start.min()), 0])
                    out.regions[n, array] = [min(lo, int(rows.row_start.min())), max(hi, int(rows.row_stop.max()))]
                out.index_batches.update(frame.batch.unique().tolist())
            for key, want in files.files("chunks", group):
                frame = read_table(location, key, want)
                crcs = frame.crc32c if "crc32c" in frame.columns else [-1] * len(frame)
                out.sizes.update(zip(zip(frame.array, frame.chunk), zip(frame.nbytes, crcs)))
            mine = sorted(b for key, want in files.files("batches", group)
                          for b in read_table(location, key, want, ["batch"]).batch)
        except DamagedError as err:
            out.damaged.append(str(err))
            continue
        if mine and mine != list(range(mine[0], mine[0] + len(mine))):
            out.damaged.append(f"{group[0][0] if group else INDEX_DIR}: committed batches are not "
                               f"{mine[0]}..{mine[0] + len(mine) - 1} (a part is missing)")
        out.batches += mine
    return out


def _table_problems(location: Location, files: IndexFiles) -> List[str]:
    """The side tables (samples, tokens) that do not read back as committed."""
    try:
        tables = [t for t in files.tables() if t not in REQUIRED]
    except DamagedError:  # a commit's sums (named by _read_committed)
        return []
    problems = []
    for table in tables:
        try:
            for key, want in files.files(table):
                read_table(location, key, want)
        except DamagedError as err:
            problems.append(str(err))
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
    check_crc = depth != "size" and has_crc(array)
    shards = shard_count(array) if depth != "size" and array.shards is not None and has_crc(array, inner=True) else 0
    for k in range(-(-first // chunk_rows), -(-committed // chunk_rows)):
        path = chunk_path(array, k)
        if path not in stored:
            problems.append(f"{path}: chunk missing (holds committed rows {k * chunk_rows}..{(k + 1) * chunk_rows})")
            continue
        problem = _stored_problem(location, path, stored[path], sizes.get((key, k), (None, -1)), k == boundary,
                                  check_crc, shards)
        if problem:
            problems.append(problem)
            continue
        if k == boundary or depth == "decode" or (depth == "crc" and array.shards is not None):
            try:
                array[k * chunk_rows:min((k + 1) * chunk_rows, committed)]
            except Exception as err:  # noqa: BLE001 - any decode failure is damage
                problems.append(f"{path}: chunk does not decode ({type(err).__name__}: {err})")
    return problems


def _stored_problem(location: Location, path: str, size: int, recorded: tuple, at_boundary: bool,
                    check_crc: bool, shards: int = 0) -> Optional[str]:
    """Why a stored chunk is not the one committed (None if it is): its size, or (`check_crc`) its bytes against
    their own crc32c and the committed one; `recorded` is the committed (size, crc32c or -1), (None, -1) if none.
    The chunk at the boundary of a running store's committed rows may have been rewritten since: its own crc32c
    is all it must match."""
    want, want_crc = recorded
    if not at_boundary and want is not None and size != want:
        return f"{path}: chunk is {size} bytes but {want} were committed (truncated or rewritten)"
    if not at_boundary and want is None:
        return f"{path}: chunk has no committed size in {INDEX_DIR}/chunks (written after its commit?)"
    if shards:  # a shard: its index, and its checksum (its index and inner chunks' crc32c) against the committed
        data = location.get(path) or b""
        try:
            got = shard_sum(path, data, shards)
        except ValueError as err:
            return str(err)
        if not at_boundary and want_crc != -1 and got != want_crc:
            return (f"{path}: chunk is not the one committed here (shard checksum {got:08x}, committed "
                    f"{want_crc:08x}): moved or rewritten")
        return None
    if not check_crc:
        return None
    data = location.get(path) or b""
    damaged = crc_problem(path, data)
    if damaged:
        return damaged
    if not at_boundary and want_crc != -1 and int.from_bytes(data[-4:], "little") != want_crc:
        return (f"{path}: chunk is not the one committed here (crc32c {crc32c(data[:-4]):08x}, committed "
                f"{want_crc:08x}): moved or rewritten")
    return None
