"""Captures exported to the formats training tools read, streamed block by block (never the whole array in memory),
and a store copied whole (a store in memory kept on disk).

    cap.export_npy("acts.npy", layer="transformer.h.1", role="output")    # np.load(..., mmap_mode="r") reads it
    cap.export_npy("acts.npy", ..., overwrite=True)                       # an existing path is refused otherwise
    cap.export_hf("acts_hf", layer="transformer.h.1", role="output", fields=["sample", "position", "token_id"])
    datasets.load_from_disk("acts_hf")                                    # one row per record: acts, fields
    cap.save("runs/lens.zarr")                                            # the store's files, as they are

The .npy is written through a memmap: each block of chunks is read straight into it. The Hugging Face
dataset (needs `datasets`) is one Arrow file written batch by batch with datasets' own ArrowWriter, plus the
two JSON files `datasets.load_from_disk` reads; `acts` is a fixed-length list of float32 per row.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import numpy as np

from hookrun.format.files import DamagedError
from hookrun.format.layout import COMPLETE
from hookrun.storage import Location
from hookrun.format.verify import verify_store
from hookrun.read.chunks import reader as reader_of, subset
from hookrun.read.tables import field_columns

BLOCK_MB = 64.0


def _blocks(cap, layer, role, hook, call, rows, block_mb: float):
    """(reader, records to read, their count, rows per block) of one array."""
    key, records = cap.source(layer=layer, role=role, hook=hook, call=call, what="export")
    records = subset(records, rows)
    reader = reader_of(cap, key)
    n = records.stop - records.start if isinstance(records, slice) else len(records)
    block = reader.block_rows(block_mb)
    return key, reader, records, n, block


def _refuse_existing(path: Path, overwrite: bool, what: str) -> None:
    """FileExistsError for an export over something already at `path` (a user's file is never replaced unasked)."""
    if not overwrite and (path.exists() or path.is_symlink()):
        raise FileExistsError(f"{what}: {path} already exists and hookrun does not replace it; give another path, "
                              f"or overwrite=True to replace it")


def export_npy(cap, path, layer=None, role=None, hook=None, call=None, rows=None,
               block_mb: float = BLOCK_MB, overwrite: bool = False) -> Path:
    """One array's records (all, or `rows`) as a .npy file, written through a memmap into a temp file beside `path`,
    then renamed onto it (an existing `path` is refused unless overwrite=True); returns its path."""
    path = Path(path)
    _refuse_existing(path, overwrite, "export_npy")
    _, reader, records, n, block = _blocks(cap, layer, role, hook, call, rows, block_mb)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=reader.dtype, shape=(n, *reader.row_shape))
        for a in range(0, n, block):
            b = min(n, a + block)
            reader.read(subset(records, slice(a, b)), out=out[a:b])
        out.flush()
        del out
        _refuse_existing(path, overwrite, "export_npy")  # (made meanwhile)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def export_hf(cap, path, layer=None, role=None, hook=None, call=None, rows=None, fields: Sequence[str] = (),
              block_mb: float = BLOCK_MB, overwrite: bool = False):
    """One array's records as a Hugging Face `datasets` dataset saved at `path` (column `acts`: each record
    flattened to float32, plus `fields` as in `cap.loader`); returns it, memory-mapped. An existing `path` is
    refused unless overwrite=True (then its three files are replaced; nothing else in it is removed)."""
    _refuse_existing(Path(path), overwrite, "export_hf")
    try:
        import datasets
        import pyarrow as pa
        from datasets.arrow_writer import ArrowWriter
    except ImportError as err:
        raise ImportError('export_hf needs the datasets package: pip install "hookrun[lm]"') from err
    key, reader, records, n, block = _blocks(cap, layer, role, hook, call, rows, block_mb)
    width = int(np.prod(reader.row_shape, dtype=np.int64))
    total = _count(cap, layer, role, hook, call)
    numbers = subset(slice(0, total), rows)  # the record number of each row exported
    numbers = np.arange(numbers.start, numbers.stop) if isinstance(numbers, slice) else numbers
    columns = {k: v[numbers] for k, v in field_columns(cap, key, total, list(fields)).items()}
    features = datasets.Features({"acts": datasets.Sequence(datasets.Value("float32"), length=width),
                                  **{k: datasets.Value(str(v.dtype)) for k, v in columns.items()}})
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    name = "data-00000-of-00001.arrow"
    buf = np.empty((min(block, n), *reader.row_shape), dtype=reader.dtype)
    with ArrowWriter(features=features, path=str(path / name)) as writer:
        for a in range(0, n, block):
            b = min(n, a + block)
            data = reader.read(subset(records, slice(a, b)), out=buf[:b - a]).reshape(b - a, width)
            acts = pa.FixedSizeListArray.from_arrays(pa.array(data.astype(np.float32, copy=False).reshape(-1)), width)
            writer.write_table(pa.table({"acts": acts, **{k: pa.array(v[a:b]) for k, v in columns.items()}}))
        writer.finalize()
    ds = datasets.Dataset.from_file(str(path / name))
    _save_state(ds, path, name)
    return ds


def _count(cap, layer, role, hook, call) -> int:
    records = cap.source(layer=layer, role=role, hook=hook, call=call, what="export")[1]
    return records.stop - records.start if isinstance(records, slice) else len(records)


def _save_state(ds, path: Path, name: str) -> None:
    """The state.json and dataset_info.json that `datasets.load_from_disk` reads (as Dataset.save_to_disk writes
    them) beside the Arrow file."""
    keys = ["_fingerprint", "_format_columns", "_format_kwargs", "_format_type", "_output_all_columns"]
    state = {k: ds.__dict__[k] for k in keys}
    state["_split"] = None
    state["_data_files"] = [{"filename": name}]
    (path / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    info = asdict(ds.info)
    (path / "dataset_info.json").write_text(json.dumps({k: info[k] for k in sorted(info)}, indent=2))


def save_store(cap, path, storage_options=None) -> None:
    """Copy the complete store of `cap` to `path` (a local dir or a URL) file by file, bytes as they are: the store
    a run with store.path=PATH writes. The root metadata goes last, so a copy cut short is no store; an existing
    `path` is refused (hookrun never writes into what it did not create)."""
    if cap.status != COMPLETE:
        raise ValueError(f"{cap.path} is {cap.status}: only a complete store is saved; run it to completion first")
    target = Location(path, storage_options)
    if (target.local is not None and (target.local.exists() or target.local.is_symlink())) or \
            (target.local is None and target.keys()):
        raise FileExistsError(f"{path} exists; cap.save writes a new store: give a path that does not exist")
    keys = [k for k in cap.location.keys() if not k.startswith(".")]  # .hookrun.lock: the writer's, not the store's
    for key in sorted(keys, key=lambda k: k == "zarr.json"):
        target.put(key, cap.location.get(key))
    damaged = verify_store(target.open_group("r"), target)  # every file against its crc32c, as cap.verify()
    if damaged:  # a copy that does not read back is no store: what this call wrote goes
        for key in keys:
            target.delete(key)
        if target.local is not None:  # and the folders it made (rmdir: only empty ones)
            for folder in sorted((p for p in target.local.rglob("*") if p.is_dir()), reverse=True) + [target.local]:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise DamagedError(f"the copy of {cap.path} at {path} does not read back as written ({'; '.join(damaged)}); "
                         "it was removed: check the target's free space and save again")

