"""Captures, what hookrun.open gives: a run's index, tables and arrays; collect() of a sweep. Never imports the runner.

    cap = hookrun.open("outputs/2026-11-22/10-00-00")   # a run dir or the .zarr path
    cap = hookrun.open("s3://bucket/runs/a.zarr", storage_options={...})   # or a URL (AWS_* env vars by default)
    cap.index                                          # pandas, one row per captured tensor per batch
    cap.load(layer="conv1", role="output")             # numpy, every record in store order
    cap.load(layer="blocks.0", role="output", call=1)  # a reused module: pick the call (required)
    cap.load(layer="conv1", role="output", rows=[7, 3])   # some records: only their chunks are read
    cap.samples                                        # one row per sample: sample, batch, row, recorded fields
    cap.loader(layer="conv1", role="output")           # a torch IterableDataset of shuffled minibatches (loader.py)
    cap.to_xarray(hook="resid")                        # lazy xarray: the hook's layers along a `layer` dim
    sweep = hookrun.collect("multirun/2026-11-22/10-05-00")   # a sweep dir (or URL) of run dirs

Text runs store per-token arrays (index column unit == "token"): row i is row i of cap.tokens().

    cap.tokens()                                            # sample, position, token_id, token
    cap.load(layer="transformer.h.1", role="output")         # [n_tokens, d_model]
    cap.samples                                              # token_start, token_stop: each document's rows
    cap.pool(layer="transformer.h.1", role="output")         # [n_samples, d_model]: each document's mean
    cap.top(layer="transformer.h.1", role="output", unit=7)  # value, sample, position, token, context
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import pandas as pd

from hookrun.format.files import (DamagedError, IndexFiles, chunk_path, crc_problem, find_store, has_crc,
                                  index_sources, open_array, run_id_problems)
from hookrun.format.layout import (ADDED_COLUMNS, ADDED_FROM, BATCH_COLUMNS, COMPLETE, DTYPE_ATTR, INDEX_COLUMNS,
                                   INDEX_DIR,
                                   JOB_RECORD, METRIC_COLUMNS, MISSING, RUNNING, STATUS, bf16_bits_to_float32,
                                   layer_group, newer_version, parse_key)
from hookrun.storage import Location, is_url
from hookrun.format.verify import verify_store
from hookrun.read.checks import check_count, check_index
from hookrun.read.chunks import as_dtype, reader as chunk_reader, subset
from hookrun.read.results import reader, summaries
from hookrun.read.tables import samples_table


class NewerFormatError(ValueError):
    """A store written in a newer format than this hookrun reads."""


class Captures:
    """One run's store: its index, attrs and arrays (of any format version up to this hookrun's)."""

    def __init__(self, path, storage_options: Optional[dict] = None):
        self.location = find_store(path, storage_options)
        self.path = self.location.local or self.location.url  # a Path, or the URL of a remote store
        """The store: a Path (its captures.zarr), or the URL of a remote store."""
        self.root = self._open_root()
        newer = newer_version(self.root.attrs, self.location)
        if newer:
            raise NewerFormatError(newer)
        self._raise_foreign()
        self._forget()

    def _raise_foreign(self, keys=()) -> None:
        """DamagedError when the index group (or an array of `keys`) belongs to another run than the root."""
        foreign = run_id_problems(self.location, self.root.attrs, keys)
        if foreign:
            raise DamagedError(foreign[0])

    def _open_root(self):
        try:
            return self.location.open_group("r")
        except Exception as err:  # noqa: BLE001 - metadata zarr cannot read: say which store, and that it is damaged
            raise DamagedError(f"{self.location}/zarr.json: the store's root metadata does not read "
                               f"({type(err).__name__}: {err}); the store is damaged") from None

    def _forget(self) -> None:
        """Drop what was read (tables, chunk listings): the next use reads the store as it is now."""
        self._index: Optional[pd.DataFrame] = None
        self._batches: Optional[pd.DataFrame] = None
        self._samples: Optional[pd.DataFrame] = None
        self._tokens: Optional[pd.DataFrame] = None
        self._stored: dict = {}  # array key -> names of its stored chunks
        self._readers: dict = {}  # array key -> its ChunkReader (a complete store's)
        self._index_files: Optional[IndexFiles] = None  # which files hold the tables (and each one's crc32c)
        self._ids_checked = False  # the arrays the index names checked to be this run's (_table)

    @property
    def attrs(self) -> dict:
        """The store's root attributes (status, config, summary, format version, ...), as a dict."""
        return dict(self.root.attrs)

    @property
    def sources(self) -> list:
        """Where the committed index parts are (a running or killed store reads just these)."""
        return index_sources(self.location, self.root.attrs)

    @property
    def status(self) -> str:
        """complete, running, interrupted, failed (or replacing): how the run that wrote the store ended."""
        return self.root.attrs.get(STATUS, "unknown")

    @property
    def config(self) -> dict:
        """The config the run was made with, resolved (values of the environment kept as their `${oc.env:}`)."""
        return self.root.attrs.get("config", {})

    @property
    def index(self) -> pd.DataFrame:
        """One row per captured tensor per batch (and call): where it is, its shape and statistics."""
        if self._index is None:
            index = self._table("index", INDEX_COLUMNS)
            for column, value in ADDED_COLUMNS["index"].items():  # a store written before the column: filled
                if column not in index.columns:
                    index[column] = value
            for column, source in ADDED_FROM["index"].items():
                if column not in index.columns:
                    index[column] = index[source]
            self._index = index[INDEX_COLUMNS] if list(index.columns) != INDEX_COLUMNS else index
        return self._index

    @property
    def batches(self) -> pd.DataFrame:
        """One row per batch: sample range, loss, forward and backward seconds."""
        if self._batches is None:
            self._batches = self._table("batches", BATCH_COLUMNS)
        return self._batches

    @property
    def samples(self) -> pd.DataFrame:
        """One row per sample: sample (its position in the data, as in the index's sample_start), batch,
        row (its row in every per-sample array: `cap.load(...)[row]`), token_start / token_stop on a text run
        (its rows in every per-token array: `acts[token_start:token_stop]`), and the fields of data.record.
        A run that stores per-token arrays only has no `row`: asking for it raises an error saying so."""
        if self._samples is None:
            tokens = self.tokens() if "tokens" in self._files().tables() else pd.DataFrame(columns=["sample"])
            units = self.index["unit"] if "unit" in self.index.columns else []
            self._samples = samples_table(self.table("samples"), tokens, units)
        return self._samples

    def tables(self) -> list:
        """The names of the store's side tables (samples, tokens, generations, ...): what table(name) reads."""
        return self._files().tables()

    def table(self, name: str) -> pd.DataFrame:
        """A per-batch side table (e.g. samples, tokens) with the rows of every committed batch."""
        return self._table(name)

    def _table(self, name: str, columns=None) -> pd.DataFrame:
        """A table from its files as recorded (DamagedError names one that is missing or differs). A run that
        committed or closed since the store was opened removes parts: then the store is read again, as it is."""
        try:
            if not self._ids_checked:  # a root and index of another run describe rows these arrays do not hold
                self._raise_foreign(self._files().read("index", ["array"]).array.unique())
                self._ids_checked = True
            return self._files().read(name, columns)
        except DamagedError:
            root = self._open_root()
            if dict(root.attrs) == dict(self.root.attrs):
                raise
            self.root = root
            self._forget()
            return self._files().read(name, columns)

    def _files(self) -> IndexFiles:
        if self._index_files is None:
            self._index_files = IndexFiles(self.location, self.root.attrs)
        return self._index_files

    def verify(self, decode: bool = False) -> list:
        """What is missing or damaged, checked against what the run recorded: one line each, [] if none. Reads
        every index file and chunk and checks it against its crc32c; `decode=True` also decodes every chunk."""
        return verify_store(self.root, self.location, decode=decode)

    def tokens(self) -> pd.DataFrame:
        """One row per stored token: sample, position (among its sequence's real tokens), token_id, token (text)."""
        if self._tokens is None:
            self._tokens = self.table("tokens")
        return self._tokens

    def generations(self) -> pd.DataFrame:
        """A generate run's completions, a row per sample: sample, batch, prompt, prompt_ids, completion,
        completion_ids, stop_reason, new_tokens, logprobs (hookrun.read.results.generation)."""
        return self.read("generate")

    def read(self, key: str, *args, **kwargs):
        """What the method of config key `key` stored, as its reader gives it (hookrun.read.results: no torch):
        `cap.read("patching")` is cap.grid(), `cap.read("generate")` cap.generations(), a plug-in's its own `read`."""
        return reader(key)(self, *args, **kwargs)

    def token_rows(self, hook=None, layer=None, role=None, call=None) -> pd.DataFrame:
        """The array row of every stored token of one per-token array (one call), indexed by (sample, position).

        Row i of the token table is row i of the array when the module runs once per forward; a module
        called k times holds k blocks of rows per batch, one per call."""
        rows = self.rows(hook=hook, layer=layer, role=role, call=call if call is not None else 0)
        keys = rows["array"].unique() if len(rows) else []
        per_token = len(rows) and (rows["unit"] == "token").all()
        if len(keys) != 1 or not per_token:
            raise KeyError(f"token_rows(hook={hook!r}, layer={layer!r}, role={role!r}, call={call!r}) needs exactly one "
                           f"per-token array; found {list(keys)} (per-token arrays have unit == 'token' in the index)")
        rows = rows.sort_values("sample_start")
        tokens = self.tokens()
        block = np.searchsorted(rows["sample_start"].to_numpy(), tokens["sample"].to_numpy(), side="right") - 1
        rank = tokens.groupby(block).cumcount().to_numpy()
        out = pd.DataFrame({"sample": tokens["sample"].to_numpy(), "position": tokens["position"].to_numpy(),
                            "row": rows["row_start"].to_numpy()[block] + rank}).set_index(["sample", "position"])
        out.attrs["array"] = keys[0]
        return out

    def read_rows(self, key: str, rows) -> np.ndarray:
        """Rows of an array by number (any order) or a slice of them, as float32 for bfloat16 arrays."""
        return self._read(key, rows if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64))

    def _checked(self, arr, chunks, read):
        """`read()` of an array whose stored chunks (or shards) `chunks` it reads: DamagedError names a chunk that
        is missing (zarr would read it as zeros; shards may be absent when all zero), fails its crc32c or does
        not decode."""
        missing = [k for k in chunks if arr.shards is None and not self._stored_chunk(arr, k)]
        damage = [f"{chunk_path(arr, k)}: chunk missing" for k in missing]
        if not damage:
            try:
                return read()
            except Exception:  # noqa: BLE001 - find which chunk; unexplained errors are raised as they are
                damage = [p for k in chunks if (p := self._chunk_problem(arr, k))]
                if not damage:
                    raise
        more = f" and {len(damage) - 3} more" if len(damage) > 3 else ""
        raise DamagedError(f"{'; '.join(damage[:3])}{more}: no data is returned from a damaged chunk "
                           "(cap.verify() lists every damaged file)") from None

    def _stored_chunk(self, arr, k: int) -> bool:
        """Whether chunk k of an array is stored (one listing per array, again when a chunk is not in it: a live
        run may have written it since)."""
        name = chunk_path(arr, k).rsplit("/", 1)[1]
        for fresh in (False, True):
            if fresh or arr.path not in self._stored:
                self._stored[arr.path] = set(self.location.children(arr.path))
            if name in self._stored[arr.path]:
                return True
        return False

    def _chunk_problem(self, arr, k: int):
        """Why stored chunk k of an array does not read (None if it does)."""
        path = chunk_path(arr, k)
        data = self.location.get(path)
        if data is None:
            return f"{path}: chunk missing"
        if has_crc(arr) and crc_problem(path, data):
            return crc_problem(path, data)
        rows = (arr.shards or arr.chunks)[0]
        try:
            arr[k * rows:min((k + 1) * rows, arr.shape[0])]
        except Exception as err:  # noqa: BLE001
            return f"{path}: chunk does not decode ({type(err).__name__}: {err})"
        return None

    def top(self, layer=None, role=None, unit: int = 0, k: int = 10, context: int = 5, hook=None,
            call=None, feature: Optional[int] = None) -> pd.DataFrame:
        """The k tokens where feature `unit` of a per-token array is largest, with `context` tokens each side;
        `feature=F`: dictionary feature F of a hook with `dictionary:` (hookrun.read.results.dictionaries.top).

        Columns: value, sample, position, token, context (the token in [[ ]] within its neighbours)."""
        if feature is not None:
            return self.read("dictionaries", "top", feature=feature, hook=hook, layer=layer, k=k, context=context,
                             call=call)
        check_count("top", "k", k)
        lookup = self.token_rows(hook=hook, layer=layer, role=role, call=call)
        data = self._read(lookup.attrs["array"], slice(0, int(lookup["row"].max()) + 1))
        flat = data.reshape(len(data), -1)
        check_index("top", "unit", unit, flat.shape[1], f"{lookup.attrs['array']} has {flat.shape[1]} units a token")
        return self.top_of(flat[lookup["row"].to_numpy(), unit], k, context)

    def top_of(self, values: np.ndarray, k: int = 10, context: int = 5) -> pd.DataFrame:
        """The k tokens where `values` (one a row of cap.tokens()) are largest, with `context` tokens each side."""
        order = np.argsort(-values, kind="stable")[:k]
        tokens = self.tokens()
        by_sample = {s: g for s, g in tokens.groupby("sample")}
        out = []
        for i in order:
            row = tokens.iloc[i]
            seq = by_sample[row["sample"]]
            near = seq[(seq["position"] >= row["position"] - context) & (seq["position"] <= row["position"] + context)]
            text = "".join(f"[[{t}]]" if p == row["position"] else t for p, t in zip(near["position"], near["token"]))
            out.append(dict(value=float(values[i]), sample=int(row["sample"]), position=int(row["position"]),
                            token=row["token"], context=text))
        return pd.DataFrame(out, columns=["value", "sample", "position", "token", "context"])

    def rows(self, hook=None, layer=None, role=None, call=None, **where) -> pd.DataFrame:
        """Index rows matching every given column value; `layer` and `role` also match the native module and role
        a standard site resolved to (`layer="transformer.h.3"` finds `blocks.3`) where no layer or role is named so.

            cap.rows(layer="blocks.0.attn.heads"); cap.rows(layer="transformer.h.0.attn.c_proj", role="input.0")"""
        df = self.index
        for col, val in dict(hook=hook, layer=layer, role=role, call=call, **where).items():
            if val is not None:
                native = {"layer": "module", "role": "module_role"}.get(col)
                hit = df[col] == val
                df = df[hit] if native is None or hit.any() else df[df[native] == val]
        return df

    def to_xarray(self, hook: Optional[str] = None, layer=None, stack: bool = True):
        """A layer's arrays (every role) as a lazy xarray Dataset backed by dask, one dask chunk per zarr chunk:
        nothing is read until asked for. Per-token arrays carry `sample`, `position`, `token_id` and `token_text`
        coordinates on their `token` dim. Slices of whole chunks read fast; random rows read a chunk each (use
        cap.load(rows=) or cap.loader). Needs the `xarray` extra (`pip install "hookrun[xarray]"`).

            cap.to_xarray(layer="blocks.1")                # one layer: a variable per role
            cap.to_xarray(hook="resid")                    # every layer of the hook, stacked on a `layer` dim
            cap.to_xarray(layer=["blocks.0", "blocks.2"])  # these layers (always a `layer` dim, in this order)
            cap.to_xarray(hook="acts", stack=False)        # a variable per layer and role ("conv1/output")

        Several layers (`layer` a list, or None where the hook has several) stack along a new `layer` dim,
        whose coordinate is the layers' names (standard names where captured so; None: model order), with the
        record dim and its token coordinates shared (xr.concat over a new dim). Layers whose arrays differ in
        roles, shape or dtype do not stack (a KeyError names each); `stack=False` merges them instead (xr.merge):
        variables `<layer>/<role>`, each layer's other dims prefixed `<layer>/`."""
        try:
            import xarray as xr
        except ImportError as err:
            raise ImportError('to_xarray needs xarray and dask: pip install "hookrun[xarray]"') from err
        call = f"to_xarray(hook={hook!r}, layer={layer!r})"
        groups = self._xarray_groups(hook, layer, call)
        if isinstance(layer, str) or (layer is None and len(groups) == 1):
            return self._xarray_group(xr, groups[0])
        names = [parse_key(f"{g}/_")[1] for g in groups]
        parts = [self._xarray_group(xr, g) for g in groups]
        if not stack:
            record = {"sample", "token", "batch"}
            renamed = [ds.rename({d: f"{n}/{d}" for d in ds.dims if d not in record})
                       .rename({v: f"{n}/{v}" for v in ds.data_vars}) for n, ds in zip(names, parts)]
            try:
                return xr.merge(renamed, join="exact", compat="no_conflicts", combine_attrs="drop")
            except ValueError as err:
                raise KeyError(f"{call}: the layers {', '.join(names)} do not share their records ({err}); open "
                               "them one at a time (layer=NAME)") from None
        shapes = [{v: (tuple(ds[v].shape), str(ds[v].dtype), ds[v].dims) for v in ds.data_vars} for ds in parts]
        if any(s != shapes[0] for s in shapes[1:]):
            said = "; ".join(f"{n}: " + ", ".join(f"{v} {list(shape)} {dtype}" for v, (shape, dtype, _) in s.items())
                             for n, s in zip(names, shapes))
            raise KeyError(f"{call}: the layers' arrays differ in roles, shape or dtype, so they do not stack along "
                           f"`layer` ({said}); give layers of one shape (layer=[...]), or stack=False for a variable "
                           "per layer and role")
        return xr.concat(parts, dim=xr.DataArray(np.array(names), dims="layer", name="layer"), coords="minimal", compat="equals",
                         join="exact", combine_attrs="drop_conflicts")

    def _xarray_groups(self, hook, layer, call: str) -> list:
        """The `<hook>/<layer>` groups to_xarray opens: one for a layer's name (standard or native), each of a
        list's in its order, every group of the hook in model order for None; KeyError naming the groups else."""
        present = list(dict.fromkeys(parse_key(key)[:2] for key in self.index["array"])) if len(self.index) else []
        listing = f"groups: {', '.join(layer_group(*g) for g in present) or 'none'}"

        def one(name: str) -> str:
            match = [layer_group(h, n) for h, n in present if hook in (None, h) and n == name]
            if not match:  # a standard site's native module name
                found = self.rows(hook=hook, layer=name)
                match = list(dict.fromkeys(layer_group(*parse_key(key)[:2]) for key in found["array"]))
            if len(match) != 1:
                raise KeyError(f"{call} {'is ambiguous' if match else 'matches nothing'}"
                               f"{'' if isinstance(layer, str) else f' at {name!r}'}; {listing}")
            return match[0]

        if isinstance(layer, str):
            return [one(layer)]
        if layer is not None:
            if isinstance(layer, (bytes, dict)) or not hasattr(layer, "__iter__") or \
                    not all(isinstance(n, str) for n in layer) or not len(list(layer)):
                raise TypeError(f"{call}: layer is a layer's name, a list of names, or None (every layer of the "
                                f"hook); {listing}")
            groups = [one(n) for n in layer]
            if len(set(groups)) != len(groups):
                raise KeyError(f"{call}: a layer is named twice ({', '.join(groups)}); {listing}")
            return groups
        present = [g for g in present if not g[0].startswith("_") or hook == g[0]]  # metrics, scores: no layers
        hooks = list(dict.fromkeys(h for h, _ in present))
        if hook is None and len(hooks) > 1:
            raise KeyError(f"{call} is ambiguous: the store has hooks {', '.join(hooks)}; name one (hook=...), "
                           f"or a layer; {listing}")
        match = [layer_group(h, n) for h, n in present if hook in (None, h)]
        if not match:
            raise KeyError(f"{call} matches nothing; {listing}")
        return match

    def _xarray_group(self, xr, group: str):
        """One `<hook>/<layer>` group as a lazy Dataset: bfloat16 as float32, token coordinates on `token`."""
        ds = xr.open_zarr(self.location.reader, group=group, chunks={})
        for name in [n for n, v in ds.data_vars.items() if v.attrs.get(DTYPE_ATTR) == "bfloat16"]:
            ds[name] = ds[name].copy(data=ds[name].data.map_blocks(bf16_bits_to_float32, dtype=np.float32))  # exact
        if "token" in ds.dims:  # per-token arrays: which sample and position each row is (call: a reused module's)
            key = next(k for k in self.index["array"].unique() if k.startswith(f"{group}/"))
            coords = self._token_coords(key)
            ds = ds.assign_coords({name: ("token", col[:ds.sizes["token"]]) for name, col in coords.items()})
        return ds

    def _token_coords(self, key: str) -> dict:
        """{sample, position, token_id, token_text (and call, for a module used several times per forward)} of each
        row of a per-token array, from its index rows and the token table."""
        rows = self.index[self.index["array"] == key].sort_values("row_start")
        tokens = self.tokens()
        ids = tokens["sample"].to_numpy()
        lo = np.searchsorted(ids, rows["sample_start"].to_numpy(), side="left")
        hi = np.searchsorted(ids, rows["sample_stop"].to_numpy(), side="left")
        at = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]) if len(rows) else np.zeros(0, dtype=np.int64)
        coords = {"sample": ids[at], "position": tokens["position"].to_numpy()[at],
                  "token_id": tokens["token_id"].to_numpy()[at], "token_text": tokens["token"].to_numpy()[at]}
        if rows["call"].nunique() > 1:
            coords["call"] = np.repeat(rows["call"].to_numpy(), hi - lo)
        return coords

    def array(self, key: str):
        """The zarr array at `<hook>/<layer>/<role>` (its reads check every chunk's crc32c)."""
        return open_array(self.root, key)

    def _read(self, key: str, rows, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Rows of an array (a slice or row numbers) read from its chunk files in parallel threads, into `out`
        when given; DamagedError names a chunk that is missing, fails its crc32c or does not decode."""
        reader = self._readers.get(key)
        if reader is None:
            reader = chunk_reader(self, key, open_array(self.root, key))  # each chunk checked against the index
            if self.status == COMPLETE:  # nothing a complete store holds changes: its readers are kept
                self._readers[key] = reader
        arr = reader.array
        if reader.direct:
            return reader.read(rows, out)
        start, stop, idx = reader.request(rows)
        chunk_rows = (arr.shards or arr.chunks)[0]
        chunks = range(start // chunk_rows, -(-stop // chunk_rows)) if idx is None else \
            sorted(set((idx // chunk_rows).tolist()))
        return self._checked(arr, chunks, lambda: reader.read(rows, out))

    def read_row(self, row) -> np.ndarray:
        """The tensor one index row describes, as captured (no added batch axis)."""
        data = self._read(row["array"], slice(int(row["row_start"]), int(row["row_stop"])))
        return data if row["per_sample"] else data[0]

    def calls(self, layer: Optional[str] = None, role: Optional[str] = None, hook: Optional[str] = None) -> list:
        """The calls recorded for a layer (more than [0] for a module used several times in one forward)."""
        rows = self.rows(hook=hook, layer=layer, role=role)
        return sorted(int(c) for c in rows["call"].unique()) if len(rows) else []

    def source(self, layer: Optional[str] = None, role: Optional[str] = None, hook: Optional[str] = None,
               call: Optional[int] = None, what: str = "load") -> Tuple[str, object]:
        """(array key, its records in order: a slice of the array's rows, or row numbers for one call of a module
        used several times per forward); KeyError when the arguments match no array, several, or mix calls."""
        rows = self.rows(hook=hook, layer=layer, role=role)
        keys = sorted(rows["array"].unique()) if len(rows) else []
        if len(keys) != 1:
            have = sorted(self.index["array"].unique()) if len(self.index) else []
            found = "matches nothing" if not keys else f"is ambiguous ({', '.join(keys)})"
            writing = "" if keys or self.status != RUNNING else (
                f"; {self.path} is still being written (status running, {len(self.batches)} batch(es) committed): "
                "an array is there once a batch holding it is committed, read it again later")
            raise KeyError(f"{what}(hook={hook!r}, layer={layer!r}, role={role!r}) {found}; "
                           f"arrays in {self.path}: {', '.join(have) or 'none'}{writing}")
        calls = sorted(int(c) for c in rows["call"].unique())
        if call is None and len(calls) > 1:
            raise KeyError(f"{what}(hook={hook!r}, layer={layer!r}, role={role!r}): {keys[0]} holds {len(calls)} calls "
                           f"of a module used several times per forward (calls {calls}); pick one with call=, "
                           f"e.g. {what}(layer={rows['layer'].iloc[0]!r}, role={rows['role'].iloc[0]!r}, call=0)")
        if call is None:
            return keys[0], slice(0, int(rows["row_stop"].max()))
        rows = rows[rows["call"] == call].sort_values("row_start")
        if not len(rows):
            raise KeyError(f"{what}(layer={layer!r}, role={role!r}): no capture with call={call}; calls are {calls}")
        starts, stops = rows["row_start"].to_numpy(np.int64), rows["row_stop"].to_numpy(np.int64)
        if (starts[1:] == stops[:-1]).all():
            return keys[0], slice(int(starts[0]), int(stops[-1]))
        return keys[0], np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)])

    def load(self, layer: Optional[str] = None, role: Optional[str] = None, hook: Optional[str] = None,
             call: Optional[int] = None, rows=None, dtype=None):
        """Records of one array as numpy (axis 0 = sample, token or batch), read from the chunk files in parallel
        into one array: all of them, or `rows` (a slice or record numbers in any order; only their chunks are
        read). bfloat16 comes back as float32 (exact: numpy has no bfloat16); `dtype="bfloat16"` (or any torch
        dtype) gives a torch tensor, the captured bfloat16 values bit for bit; a numpy dtype name casts
        (hookrun.read.chunks.as_dtype).

        A module called several times per forward stores every call in one array; then `call=` is
        required (a KeyError lists the calls) so that calls are never mixed; record i is then the call's i-th."""
        key, records = self.source(layer=layer, role=role, hook=hook, call=call)
        return as_dtype(self._read(key, subset(records, rows)), dtype)


    def first_nonfinite(self) -> Optional["NonFinite"]:
        """Where NaN or inf first appears: the earliest batch whose captures hold one (the index's nan/inf counts),
        in it the first capture in forward order, else in backward order (the output's gradients first), and in that
        capture's records the first sample (and the element) holding one. None when every capture is finite.

            hit = cap.first_nonfinite()    # e.g. batch 3, backward: grads fc4 grad, sample 12 ...
            cap.index.query("nan_count > 0 or inf_count > 0")   # every capture that holds one

        Declared metrics and patching scores (hooks named _metrics, _patching) are not layers and are left out."""
        index = self.index
        bad = index[((index["nan_count"] > 0) | (index["inf_count"] > 0)) & ~index["hook"].str.startswith("_")]
        if not len(bad):
            return None
        batch = bad["batch"].min()
        rows = index[(index["batch"] == batch) & ~index["hook"].str.startswith("_")]
        fired = rows["fired"].astype(float)  # as the hooks fired: forward in forward order, then backward
        order = list(fired.sort_values(kind="stable").index) if fired.notna().all() else _execution_order(rows)
        row = next(r for _, r in rows.loc[order].iterrows() if r["nan_count"] > 0 or r["inf_count"] > 0)
        data = self._read(row["array"], slice(int(row["row_start"]), int(row["row_stop"])))
        finite = np.isfinite(data.reshape(len(data), -1)) if data.ndim else np.isfinite(data.reshape(1, 1))
        record = int(np.argmin(finite.all(axis=1)))  # the first record holding a non-finite value
        element = tuple(int(i) for i in np.unravel_index(int(np.argmin(finite[record])), data.shape[1:]))
        sample = position = None
        if row["unit"] == "token":
            tokens = self.tokens()
            tokens = tokens[(tokens["sample"] >= row["sample_start"]) & (tokens["sample"] < row["sample_stop"])]
            sample, position = (int(v) for v in tokens.iloc[record][["sample", "position"]])
        elif row["per_sample"]:
            sample = int(row["sample_start"]) + record
        else:  # one record a batch (a parameter's gradient): the element is within the whole captured tensor
            element = tuple(int(i) for i in np.unravel_index(int(np.argmin(finite.reshape(-1))), data.shape[1:]))
        value = float(data[record][element]) if data.ndim > 1 else float(data[record])
        return NonFinite(hook=row["hook"], layer=row["layer"], role=row["role"], call=int(row["call"]),
                         batch=int(batch), sample=sample, position=position, element=element, value=value,
                         backward=_is_gradient(row), nan_count=int(row["nan_count"]), inf_count=int(row["inf_count"]),
                         array=row["array"])

    def grid(self, metric: Optional[str] = None):
        """The patching grid of a run with a `patching:` block: a hookrun.read.results.patching.PatchGrid (scores
        [samples, layers, positions | heads], source, target, labelled axes; .to_frame(), .to_xarray(),
        .normalised())."""
        return self.read("patching", metric)

    def loader(self, layer=None, role=None, hook=None, **options):
        """A torch IterableDataset of shuffled minibatches of an array's records, for training (probes, sparse
        autoencoders): see hookrun.read.loader.loader for the options (batch_size, seed, epoch, rank, fields...)."""
        from hookrun.read.loader import loader

        return loader(self, layer=layer, role=role, hook=hook, **options)

    def pool(self, layer=None, role=None, hook=None, call=None, how="mean", block_mb: float = 64.0):
        """Each sample's mean (sum, max, min, first, last) over its tokens of a per-token array, streamed: [n_samples,
        ...] whose row i is cap.samples row i (a dict for a list of `how`). NaN where a sample has no token."""
        from hookrun.read.aggregate import pool

        return pool(self, layer=layer, role=role, hook=hook, call=call, how=how, block_mb=block_mb)

    def export_npy(self, path, layer=None, role=None, hook=None, call=None, rows=None, overwrite=False):
        """An array's records (all, or `rows`) as a .npy file written through a memmap, never whole in memory
        (an existing `path` is refused unless overwrite=True)."""
        from hookrun.read.export import export_npy

        return export_npy(self, path, layer=layer, role=role, hook=hook, call=call, rows=rows, overwrite=overwrite)

    def save(self, path, storage_options: Optional[dict] = None) -> "Captures":
        """This complete store copied to `path` (a new local dir or URL), bytes as they are: a store in memory
        (store.path=memory) kept, the same files a run with store.path=PATH writes; returns the copy, opened.

            cap = hookrun.run("lens", model=model, store={"path": "memory"}); cap.save("runs/lens.zarr")
        """
        from hookrun.read.export import save_store

        save_store(self, path, storage_options)
        return Captures(path, storage_options)

    def export_hf(self, path, layer=None, role=None, hook=None, call=None, rows=None, fields=(), overwrite=False):
        """An array's records as a Hugging Face datasets dataset at `path` (`datasets.load_from_disk` reads it):
        column `acts` (float32, each record flattened) and `fields` (as cap.loader's)."""
        from hookrun.read.export import export_hf

        return export_hf(self, path, layer=layer, role=role, hook=hook, call=call, rows=rows, fields=fields,
                         overwrite=overwrite)

    def _summary(self, most: int = 12) -> tuple:
        """(head line, rows (array, records x record shape, dtype, what a record is), lines about samples, tokens,
        generations and the patching grid) of the repr, from the index and tables alone (no array is read)."""
        import json

        index = self.index
        arrays = []
        for key, rows in (index.groupby("array", sort=False) if len(index) else []):
            first = rows.iloc[0]
            shape = json.loads(first["shape"]) if isinstance(first["shape"], str) else list(first["shape"])
            per = "token" if first.get("unit") == "token" else "sample" if first["per_sample"] else "batch"
            record = shape[1:] if first["per_sample"] else shape
            calls = rows["call"].nunique()
            arrays.append((key, f"[{int(rows['row_stop'].max())}{''.join(f', {d}' for d in record)}]",
                           str(first["dtype"]), f"per {per}" + (f", {calls} calls" if calls > 1 else "")))
        n, b = len(self.samples), len(self.batches)
        lines = [f"{n} sample{'s' * (n != 1)} in {b} batch{'es' * (b != 1)}"]
        tables = self._files().tables()
        if "tokens" in tables:
            lines[0] += f", {len(self.tokens())} tokens"
        if "generations" in tables:
            gens = self.table("generations")
            stops = ", ".join(f"{n} {r}" for r, n in gens["stop_reason"].value_counts().items())
            lines.append(f"generations: {len(gens)} completions ({stops}); cap.generations()")
        grid = self.attrs.get("patching")
        if grid:
            lines.append(f"patching grid: {grid['metric']}, {grid['source']} -> {grid['target']}, "
                         f"{len(grid['layers'])} layers x {len(grid['labels'])} {grid['axis']}s; cap.grid()")
        more = len(arrays) - most
        shown = arrays if more <= 1 else arrays[:most]
        return f"Captures {self.path} ({self.status})", shown, lines + ([f"... {more} more arrays: cap.index"]
                                                                           if more > 1 else [])

    def __repr__(self) -> str:
        head, arrays, lines = self._summary()
        width = max((len(a[0]) for a in arrays), default=0)
        shapes = max((len(a[1]) for a in arrays), default=0)
        out = [head, *(f"  {line}" for line in lines if not line.startswith("..."))]
        out.append(f"  arrays ({self.index['array'].nunique()}):" if arrays else "  arrays: none")
        out += [f"    {k:<{width}}  {shape:<{shapes}}  {dtype:<8}  {per}" for k, shape, dtype, per in arrays]
        out += [f"    {line}" for line in lines if line.startswith("...")]
        return "\n".join(out)

    def _repr_html_(self) -> str:
        import html

        head, arrays, lines = self._summary()
        body = "".join(f"<tr><td><code>{html.escape(k)}</code></td><td>{html.escape(shape)}</td><td>{dtype}</td>"
                       f"<td>{html.escape(per)}</td></tr>" for k, shape, dtype, per in arrays)
        table = (f"<table><thead><tr><th>array</th><th>shape</th><th>dtype</th><th>record</th></tr></thead>"
                 f"<tbody>{body}</tbody></table>") if arrays else "<p>no arrays</p>"
        return (f"<div><b>{html.escape(head)}</b><br>" + "<br>".join(html.escape(line) for line in lines)
                + f"{table}</div>")


@dataclass(frozen=True)
class NonFinite:
    """Where NaN or inf first appears in a run (Captures.first_nonfinite): the capture (hook, layer, role, call), its
    batch, the sample (None for a capture with one record a batch) and, in a per-token array, the token's position;
    `element`: the index of the first non-finite value within the sample's record; `value`: that value (nan, inf or
    -inf); `backward`: whether it is a gradient; nan_count and inf_count of the whole capture."""

    hook: str
    layer: str
    role: str
    call: int
    batch: int
    sample: Optional[int]
    position: Optional[int]
    element: tuple
    value: float
    backward: bool
    nan_count: int
    inf_count: int
    array: str

    def __str__(self) -> str:
        where = f"sample {self.sample}" if self.sample is not None else "the batch's record"
        where += f", position {self.position}" if self.position is not None else ""
        call = f" (call {self.call})" if self.call else ""
        return (f"batch {self.batch}, {'backward' if self.backward else 'forward'}: {self.hook} {self.layer} "
                f"{self.role}{call}, {where}, element {list(self.element)} = {self.value} ({self.nan_count} NaN and "
                f"{self.inf_count} inf in the capture)")


def _is_gradient(row) -> bool:
    """Whether an index row is a gradient (its role is grad, grad.N, grad_input.N or grad_output.N)."""
    return str(row["role"]).startswith("grad")


def _execution_order(rows: pd.DataFrame) -> list:
    """The labels of one batch's index rows in the order the hooks fired, for a store written before the index's
    `fired` column (a guess from the layers each hook stores): forward captures in forward order (a
    module's inputs before its output), then gradients in backward order (the output's first; a module's
    grad_output before its grad_input). Layers are ordered by merging each hook's layers as the index stores them
    (in forward order, hookrun.store.index.forward_order); a parameter goes with its module; the model itself
    (_model) comes first for its inputs and last for its output."""
    sequences = [list(dict.fromkeys(g["layer"])) for _, g in rows.groupby("hook", sort=False)]
    params = set(rows.loc[rows["kind"] == "param_grad", "layer"])
    modules = set(rows.loc[rows["kind"] != "param_grad", "layer"])

    def module_of(name: str) -> str:  # a parameter (fc1.weight) goes where its module (fc1) goes
        owner = name.rsplit(".", 1)[0]
        return owner if name in params and owner in modules else name

    follows: dict = {}  # layer -> the layers that come right before it in some hook
    seen: dict = {}
    for seq in sequences:
        seq = [module_of(n) for n in seq if n != "_model"]
        for i, name in enumerate(seq):
            seen.setdefault(name, len(seen))
            if i:
                follows.setdefault(name, set()).add(seq[i - 1])
    ranks, done = {}, set()
    while len(done) < len(seen):  # Kahn's: a layer once every layer before it is placed (ties: first seen)
        ready = [n for n in seen if n not in done and not (follows.get(n, set()) - done)] or \
            [min((n for n in seen if n not in done), key=seen.get)]  # a cycle (hooks disagree): the first seen
        name = min(ready, key=seen.get)
        ranks[name] = len(ranks)
        done.add(name)

    def key(label) -> tuple:
        row = rows.loc[label]
        role, layer = str(row["role"]), str(row["layer"])
        if layer == "_model" and not _is_gradient(row):  # the model's inputs first, its output last
            rank = -1 if role.startswith(("input", "kwarg")) else len(ranks)
        elif layer == "_model":  # the gradient of its output first, of its inputs last
            rank = -1 if row["kind"] == "input_grad" or role.startswith("grad_input") else len(ranks)
        else:
            rank = ranks.get(module_of(layer), len(ranks))
        if not _is_gradient(row):
            return (0, rank, int(row["call"]), 0 if role.startswith(("input", "kwarg")) else 1)
        return (1, -rank, -int(row["call"]), 0 if role.startswith("grad_output") else 1)

    return sorted(rows.index, key=key)


def open(path, storage_options: Optional[dict] = None) -> Captures:  # noqa: A001 - the public name, hookrun.open
    """Open a run's captures: a run dir or the .zarr path, local or a URL (`storage_options` for fsspec)."""
    return Captures(path, storage_options)


def override_columns(overrides) -> dict:
    """{key: value} of a job's overrides, values parsed as Hydra parses them ('64' -> 64, '[1,2]' -> [1, 2])."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cols = {}
    for override in OverridesParser.create().parse_overrides(list(overrides or [])):
        if override.is_delete() and override.value() is None:
            continue  # ~key removes a key: no value to show
        cols[override.key_or_group] = override.value()
    return cols


def _stores_below(location: Location) -> list:
    """Every hookrun store below a sweep dir (local or a URL), in order."""
    if location.local is not None:
        return [Location(p.parent) for p in sorted(location.local.rglob("zarr.json"))
                if (p.parent / INDEX_DIR).is_dir()]
    keys = location.keys()
    roots = sorted(k[:-len("/zarr.json")] for k in keys if k.endswith("/zarr.json"))
    return [location.child(r) for r in roots if any(k.startswith(f"{r}/{INDEX_DIR}/") for k in keys)]


def _job_of(root: Location, store: Location) -> tuple:
    """(job label, run dir) of a store below a sweep dir: a store named *.zarr inside a job's own dir (the default
    <job>/captures.zarr) belongs to that dir; any other store is its job's dir itself (store.path=.../${hydra:job.num}
    or .../${hydra:job.override_dirname}, with or without .zarr). The label is the job dir's path below the sweep dir,
    sorted as numbers where it is one (2 before 10)."""
    rel = str(store)[len(str(root)):].strip("/").split("/")
    if len(rel) > 1 and rel[-1].endswith(".zarr"):
        rel, run_dir = rel[:-1], str(store).rsplit("/", 1)[0]
    else:
        run_dir = str(store)
    name = "/".join(rel) if rel != [""] else str(store).rsplit("/", 1)[-1]  # the sweep dir is itself a store
    name = name[:-len(".zarr")] if name.endswith(".zarr") else name
    return name, run_dir


def _job_order(job: tuple) -> tuple:
    """Jobs numbered by Hydra in number order (2 before 10), then the others by name."""
    return (0, int(job[0]), "") if job[0].isdigit() else (1, 0, job[0])


def _job_records(root: Location) -> list:
    """(job dir below the sweep dir, its record) of every job record (JOB_RECORD) below a sweep dir."""
    import json

    if root.local is not None:
        found = [(p.parent, p.read_bytes) for p in sorted(root.local.rglob(JOB_RECORD))]
        items = [(str(d.relative_to(root.local)), str(d), read) for d, read in found]
    else:
        keys = [k for k in root.keys() if k.rsplit("/", 1)[-1] == JOB_RECORD]
        items = [(k.rpartition("/")[0], f"{root}/{k.rpartition('/')[0]}".rstrip("/"),
                  lambda k=k: root.get(k)) for k in keys]
    out = []
    for rel, run_dir, read in items:
        try:
            record = json.loads(read())
        except (OSError, ValueError, TypeError):
            continue  # a record written half (a killed job): its store, if any, still says how far it got
        out.append((rel if rel not in ("", ".") else run_dir.rsplit("/", 1)[-1], run_dir, record))
    return out


def _place(location: Location) -> str:
    """A store's place to compare by: its resolved local path, or its URL."""
    return str(location.local.resolve()) if location.local is not None else location.url


def _planned_jobs(root: Location) -> Optional[list]:
    """Every job's overrides as Hydra's basic sweeper planned them, from the sweep dir's multirun.yaml (None where
    there is none, or another sweeper made the sweep)."""
    import yaml
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        hydra = yaml.safe_load(root.get("multirun.yaml") or b"{}").get("hydra") or {}
        sweeper = hydra.get("sweeper") or {}
        if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return None
        params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides(params + list(hydra["overrides"]["task"]))
        return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
    except Exception:  # noqa: BLE001 - a multirun.yaml this cannot plan from: no job is said to be missing
        return None


def sweep_jobs(sweep_dir, storage_options: Optional[dict] = None) -> list:
    """Every job of a multirun, a dict each, in job order: job (its dir below the sweep dir), run_dir, status
    (complete, failed, interrupted, running, missing: planned by the sweep but left neither a store nor a record),
    reason (one line, for a job that did not complete), exit_code, overrides, store (its resolved path) and
    location (its store's, None without one). From the jobs' records (hookrun.engine.jobs) and the stores below."""
    root = Location(sweep_dir, storage_options)
    stores = {_place(store): store for store in _stores_below(root)}
    jobs = []
    for name, run_dir, record in _job_records(root):
        where = record.get("store")
        location = stores.pop(_place(Location(where, storage_options)), None) if where else None
        if location is None and where and not is_url(where) and (Path(where) / "zarr.json").is_file():
            location = Location(where)  # store.path outside the sweep dir
        jobs.append(dict(job=name, run_dir=run_dir, num=record.get("job"), status=record.get("status"),
                         reason=record.get("reason"), exit_code=record.get("exit_code"),
                         overrides=record.get("overrides") or [], store=where, location=location))
    for store in stores.values():  # a store with no record: a sweep made before records, or a job killed hard
        name, run_dir = _job_of(root, store)
        jobs.append(dict(job=name, run_dir=run_dir, num=int(name) if name.isdigit() else None, status=None,
                         reason=None, exit_code=None, overrides=None, store=str(store), location=store))
    planned = _planned_jobs(root)
    if planned is not None and all(j["num"] is not None for j in jobs):
        have = {int(j["num"]) for j in jobs}
        jobs += [dict(job=str(i), run_dir=None, num=i, status=MISSING, exit_code=None, overrides=overrides,
                      reason="planned by the sweep but left no store and no record (not run, or killed before it "
                             "ended)", store=None, location=None)
                 for i, overrides in enumerate(planned) if i not in have]
    for job in jobs:
        if job["location"] is not None and job["status"] in (None, RUNNING, COMPLETE):
            attrs = dict(Captures(job["location"]).attrs)  # the store says how far it got
            job["status"] = attrs.get(STATUS) if job["status"] is None or attrs.get(STATUS) != COMPLETE else COMPLETE
            job["overrides"] = job["overrides"] if job["overrides"] is not None else attrs.get("overrides")
    return sorted(jobs, key=lambda j: _job_order((j["job"],)))


def collect(sweep_dir, with_index: bool = True, storage_options: Optional[dict] = None,
            generations: bool = False) -> pd.DataFrame:
    """Every job of a multirun in one DataFrame: its index rows (with_index=False: one row a job; `generations=True`:
    its completions, a row per sample, cap.generations()) plus a column per overridden key and, for a run with
    declared metrics, a column per metric holding its mean over the job's samples (`metrics.<name>` where a column
    has the name).

    Every job the sweep planned has at least one row: `status` says how it ended (complete, failed, interrupted,
    missing) and `reason` why one did not complete (a job that stored nothing has one row with its job columns
    only); a warning names the jobs that did not complete. `store.path` shows the path each job resolved.

    Override values are parsed as Hydra parses them: `batch_size=64` gives 64 (int), `x=[1,2]` a
    list, `layers=conv1` the string 'conv1'."""
    jobs = sweep_jobs(sweep_dir, storage_options)
    if not jobs:
        raise FileNotFoundError(f"{sweep_dir} holds no hookrun stores")
    frames = []
    for job in jobs:
        cap = Captures(job["location"]) if job["location"] is not None else None
        columns = dict(job=job["job"], run_dir=job["run_dir"], status=job["status"], reason=job["reason"],
                       **override_columns(job["overrides"]))
        if "store.path" in columns and job["store"]:
            columns["store.path"] = job["store"]  # as resolved (${hydra:job.num} and all), not as typed
        if cap is None:
            df = pd.DataFrame([{}])
        else:
            df = cap.generations() if generations else cap.index.copy() if with_index else pd.DataFrame([{}])
            df = df if len(df) else pd.DataFrame([{}])  # a job that stored no row still has its row
        for key, value in columns.items():  # a list or dict value fills every row as one object
            column = [value] * len(df) if isinstance(value, (list, dict)) else value
            df[key if key not in df.columns else f"override.{key}"] = column
        if cap is not None:
            metrics = [c for c in cap.attrs.get(METRIC_COLUMNS, []) if c in cap.samples.columns]
            for metric, mean in cap.samples[metrics].mean().items():
                df[metric if metric not in df.columns else f"metrics.{metric}"] = mean
            for column, value in summaries(cap).items():
                df[column] = value
        frames.append(df)
    bad = [j for j in jobs if j["status"] != COMPLETE]
    if bad:
        shown = "; ".join(f"job {j['job']} {j['status']}" + (f" ({j['reason']})" if j["reason"] else "")
                          for j in bad[:3])
        warnings.warn(f"{len(bad)} of {len(jobs)} jobs in {sweep_dir} did not complete: {shown}"
                      + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "") + " (the status and reason columns)",
                      stacklevel=2)
    return pd.concat(frames, ignore_index=True)
