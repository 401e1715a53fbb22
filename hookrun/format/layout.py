"""The on-disk format of a store, each fact written once: keys, tables, columns, root attrs, the bfloat16 codec.

    captures.zarr/zarr.json                 the root group; its attrs hold the run (names below)
    captures.zarr/<hook>/<layer>/<role>     one array per captured site (array_key), axis 0 = record
    captures.zarr/_metrics/<role>/<name>    a declared metric, a row per sample (METRICS)
    captures.zarr/_patching/<metric>/scores a patching grid [samples, layers, positions | heads] (PATCHING)
    captures.zarr/_lens/top/ids             the logit lens [samples, layers, positions, k] (LENS; _dla: DLA)
    captures.zarr/_index/part-N.parquet     index rows (INDEX_COLUMNS) of the batches of commit N
    captures.zarr/_index/<table>-N.parquet  the other tables of commit N: batches (BATCH_COLUMNS), chunks
                                            (CHUNK_COLUMNS), samples, tokens
    captures.zarr/_index/sums-N.json        [bytes, crc32c] of each file of commit N (sums_key)
    captures.zarr/_index/<table>.parquet    the merged tables of a complete store (its parts are removed)
    captures.zarr/_index/rank-RRR/          a data-parallel rank's parts, committed.json, heads/<array>.npy
    captures.zarr/_index/stitched/          the final sizes of the chunks two ranks share
    <sweep dir>/<job>/hookrun-job.json      how a multirun's job ended (JOB_RECORD; hookrun.engine.jobs)

A commit writes its files, then its sums, then raises the root attr `committed_parts` (one rank's
committed.json): readers read only the parts below it. FORMAT_VERSION is in the root attrs: 1 = written
before checksums (no attr), 2 = chunks end in their crc32c, commits record sums-N.json, the close records
index_files; 3 = a shard's crc32c is recorded (shard_sum: over its index and each inner chunk's crc32c) and
the close records root_crc32c (root_sum). A reader refuses a newer version than its own.
Columns added to a table since keep the version: a reader fills them for older stores (ADDED_COLUMNS: the
index's `norm` and `fired`, the capture's place in the order its batch's hooks fired, are NaN in a store written
before them; its `module` and `module_role`, the native module and role of a standard site, are the layer and role
in a store written before them: ADDED_FROM).
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

import numpy as np

FORMAT_VERSION = 3  # what this hookrun writes; it reads every version up to it
VERSION = "format_version"  # root attr (absent: version 1)

# root attrs the writer and the readers share
CONFIG_HASH = "config_hash"
STATUS = "status"
COMMITTED = "committed_parts"  # the commit: parts numbered below it are committed (one writer)
WORLD_SIZE = "world_size"  # ranks of a data-parallel run (absent: one)
MANIFEST = "index_files"  # of a complete store: {merged table file: [bytes, crc32c]}
ROOT_SUM = "root_crc32c"  # of a complete store (version 3): crc32c of its other root attrs and consolidated copy
INPUTS = "inputs"  # what the run was made from: {section: {item: digest}} (hookrun.engine.fingerprint)
INPUTS_RULE = "inputs_rule"  # the rule that made those digests (a resume compares digests of one rule only)
RUN_ID = "run_id"  # made at creation, in the root, the index group and every array's attrs: compared on open
SUMS_FROM = "index_sums_from"  # the first commit that wrote its sums-N.json (null: none must)
RUNNING, COMPLETE, FAILED, INTERRUPTED, REPLACING = "running", "complete", "failed", "interrupted", "replacing"
MISSING = "missing"  # a sweep's job that left neither a store nor a record (hookrun.collect)
JOB_RECORD = "hookrun-job.json"  # in a multirun job's output dir: how it ended (hookrun.engine.jobs.write_record)

# the index: tables, their columns, their files
INDEX_DIR = "_index"
INDEX_COLUMNS = ["hook", "kind", "layer", "role", "call", "batch", "sample_start", "sample_stop", "array",
                 "row_start", "row_stop", "shape", "dtype", "per_sample", "unit", "mean", "std", "min", "max",
                 "norm", "nan_count", "inf_count", "numel", "fired", "module", "module_role"]
ADDED_COLUMNS = {"index": {"norm": float("nan"), "fired": float("nan")}}  # table -> {column added since version 1: its value in older stores}
ADDED_FROM = {"index": {"module": "layer", "module_role": "role"}}  # table -> {column added since: the column whose
# values it takes in older stores} (module, module_role: the native module and role a standard site name resolved to;
# the layer and role themselves for a module name)
BATCH_COLUMNS = ["batch", "sample_start", "sample_stop", "loss", "forward_s", "backward_s"]
CHUNK_COLUMNS = ["array", "chunk", "nbytes", "crc32c"]  # crc32c -1: not recorded (a shard before version 3)
REQUIRED = ("index", "batches", "chunks")  # tables every commit writes (side tables: when a batch has rows)
GENERATIONS = "generations"  # a generate run's table: a row per sample (hookrun.methods.generation, cap.generations())
GENERATION_COLUMNS = ["sample", "batch", "prompt", "prompt_ids", "completion", "completion_ids", "stop_reason",
                      "new_tokens", "logprobs"]
TABLES = (*REQUIRED, "samples", "tokens", GENERATIONS)  # the tables hookrun writes
COMMITTED_FILE = "committed.json"  # a rank dir's {"committed_parts": n}
STITCHED_DIR = f"{INDEX_DIR}/stitched"
_PART = re.compile(r"(?P<table>[\w.-]+)-(?P<n>\d{6})\.parquet")
_SUMS = re.compile(r"sums-(?P<n>\d{6})\.json")
_WRITER_DIR = re.compile(r"rank-\d{3}|stitched")

# arrays
METRICS = "_metrics"  # the hook name of declared metrics' arrays: _metrics/<role fed | output>/<metric>, a row a sample
PATCHING = "_patching"  # the hook name of a patching grid's arrays: _patching/<metric>/scores [samples, layers,
# positions | heads] (NaN past a sample's end), .../source and .../target [samples]: the unpatched runs' metric
METRIC_COLUMNS = "metric_columns"  # root attr: the columns of the samples table that hold metrics
PATCHING_ATTR = "patching"  # root attr: the grid's key, metric, source, target, layers, axis and labels
ATTRIBUTION = "_attribution"  # the hook name of an attribution grid's arrays: _attribution/<metric>/{scores,source,
# target,exact}
ATTRIBUTION_ATTR = "attribution"  # root attr: the grid's key, metric, roles, layers, axis, labels, method, steps
LENS = "_lens"  # the logit lens's arrays: _lens/top/ids and /probs [samples, layers, positions, k], _lens/tokens/
# logprob and /rank [samples, layers, positions, tokens] (ids and ranks -1, probabilities NaN past a sample's end)
DLA = "_dla"  # direct logit attribution: _dla/answer/parts [samples, components], /heads [samples, layers, heads],
# /logit [samples]: the model's own logit (difference)
CIRCUIT = "_circuit"  # edge attribution: _circuit/<metric>/scores [samples, edges], /exact, /circuits [samples, circuits]
CIRCUIT_ATTR = "circuit"  # root attr: the block resolved, the graph (its shape, and its senders, receivers and
# edge names: hookrun.read.results.graph; older stores hold the shape only), the circuits evaluated (edge indices)
LENS_ATTR = "lens"  # root attr: the lens's layers, positions, k, tokens, readout and its DLA's components and axes
DTYPE_ATTR = "hookrun_dtype"  # array attr: "bfloat16" where the array holds bfloat16 as uint16 bit patterns
CHUNK_KEY_ENCODING = {"name": "default", "separator": "."}  # flat c.<i>.0.0: no directory per chunk


def version(attrs) -> int:
    """The format version of a store from its root attrs (1: written before the attr existed)."""
    return int(attrs.get(VERSION, 1))


def newer_version(attrs, where) -> Optional[str]:
    """Why this hookrun cannot read a store written in a newer format (None if it can)."""
    found = version(attrs)
    if found <= FORMAT_VERSION:
        return None
    return (f"{where}: written in hookrun store format version {found}, but this hookrun reads versions 1 to "
            f"{FORMAT_VERSION}; upgrade hookrun (pip install -U hookrun) to read or resume it")


def is_run_attrs(attrs) -> bool:
    """Whether root attrs are a hookrun run's."""
    return isinstance(attrs, dict) and CONFIG_HASH in attrs and STATUS in attrs


def layer_group(hook: str, layer: str) -> str:
    """The group holding every role of one layer of one hook (what `to_xarray` opens)."""
    return f"{hook}/{layer}"


def array_key(hook: str, layer: str, role: str) -> str:
    """The key of the array of one captured site: `<hook>/<layer>/<role>`."""
    return f"{layer_group(hook, layer)}/{role}"


def parse_key(key: str) -> Tuple[str, str, str]:
    """(hook, layer, role) of an array key (a hook name holds no "/", nor does a role)."""
    hook, rest = key.split("/", 1)
    layer, role = rest.rsplit("/", 1)
    return hook, layer, role


def part_prefix(table: str) -> str:
    """The name prefix of a table's parts: index rows are `part-N`, the others `<table>-N`."""
    return "part-" if table == "index" else f"{table}-"


def part_name(table: str, n: int) -> str:
    """The file of commit n of a table."""
    return f"{part_prefix(table)}{n:06d}.parquet"


def merged_name(table: str) -> str:
    """The file of a table once merged (a complete store)."""
    return f"{table}.parquet"


def parse_part(name: str) -> Optional[Tuple[str, int]]:
    """(table prefix without its "-" - "part" for the index -, n) of a part's file name, or None."""
    m = _PART.fullmatch(name)
    return (m["table"], int(m["n"])) if m else None


def is_part(name: str) -> bool:
    """Whether a file name in an index dir is a committed part's (`<table>-N.parquet`)."""
    return parse_part(name) is not None


def sums_number(name: str) -> Optional[int]:
    """The commit whose sums a file name holds (`sums-N.json`), or None."""
    m = _SUMS.fullmatch(name)
    return int(m["n"]) if m else None


def is_sums(name: str) -> bool:
    """Whether a file name in an index dir is a commit's sums (`sums-N.json`)."""
    return sums_number(name) is not None


def sums_key(index_dir: str, n: int) -> str:
    """Where commit `n` of an index dir records the size and crc32c of each of its files."""
    return f"{index_dir}/sums-{n:06d}.json"


def rank_dir(rank: int) -> str:
    """The index dir of one rank of a data-parallel run (its parts, until the run completes)."""
    return f"{INDEX_DIR}/rank-{rank:03d}"


def is_writer_dir(name: str) -> bool:
    """Whether a name in `_index` is a dir of a data-parallel run's (a rank's parts, the stitched chunks)."""
    return _WRITER_DIR.fullmatch(name) is not None


def head_key(rank: int, key: str) -> str:
    """Where rank `rank` keeps its rows of the chunk it shares with the rank before."""
    return f"{rank_dir(rank)}/heads/{key}.npy"


def array_attrs(per_sample: bool, kind: str, unit: str, dtype, module: Optional[str] = None,
                module_role: Optional[str] = None) -> dict:
    """The attrs of a new array (dtype: the captured torch dtype; bfloat16 is stored as its bit patterns; module,
    module_role: the native module and role of a standard site name)."""
    attrs = {"per_sample": per_sample, "kind": kind, "unit": unit}
    if module is not None:
        attrs.update(module=module, module_role=module_role)
    if str(dtype) == "torch.bfloat16":
        attrs[DTYPE_ATTR] = "bfloat16"
    return attrs


def to_stored(t) -> np.ndarray:
    """A CPU tensor as the numpy stored for it: bfloat16 as its uint16 bit pattern (read back: bf16_bits_to_float32)."""
    if str(t.dtype) == "torch.bfloat16":
        import torch  # the writer's side: the read side never needs torch

        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def bf16_bits_to_float32(bits: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """bfloat16 stored as uint16 bit patterns -> exact float32: the one decoding of a bfloat16 array (the loads, the
    xarray view, the writer's statistics). `out`: a float32 array of their shape written in place (no temporary).

        bf16_bits_to_float32(stored_rows); bf16_bits_to_float32(stored_rows, out=dest)"""
    if out is None:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    wide = out.view(np.uint32)
    wide[...] = bits
    wide <<= 16
    return out


def dtype_name(stored, attrs) -> str:
    """The dtype an array holds, by its name (what the index and the summary say): `bfloat16` for bfloat16 stored as
    its uint16 bits (DTYPE_ATTR), else the stored numpy dtype's name (float16, float32, int64...)."""
    return attrs.get(DTYPE_ATTR) or str(np.dtype(stored))
