"""Per-sample metadata: the rows of `cap.samples`, one per sample (sample, batch, row, recorded fields).

    data:
      record: [label, path]   # per-sample fields to keep; default (null): data.targets

`sample` is the sample's position in the data (the numbering of the index's sample_start and
sample_stop, so the dataset index), `batch` its batch and `row` its row in every per-sample
array (`cap.load(...)[row]`; they differ from `sample` with data.stride or data.max_samples).
A recorded field must hold one scalar per sample (a tensor of shape [n] or [n, 1], or a list
of n numbers or strings); a field named in data.record that holds more is refused with a
ConfigError (capture it with a hook instead); the default (the targets) skips such fields.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import pandas as pd
import torch

from hookrun.config.checks import ConfigError, suggest

TABLE = "samples"  # the side table's name in the store (_index/samples.parquet)


def record_fields(data_cfg) -> List[str]:
    """The fields to record: data.record, or data.targets when it is null."""
    return [str(f) for f in (data_cfg.targets if data_cfg.record is None else data_cfg.record)]


def check_spec(data_cfg) -> List[str]:
    """Problems with data.record that show without loading data (names that no input or field has)."""
    if data_cfg.record is None:
        return []
    known = list(data_cfg.inputs or {}) or list(data_cfg.fields or [])
    if not known:
        return []  # a dataset's fields are known at its first batch (sample_table checks them there)
    return [f"data.record: {name!r} is not one of the inputs/fields ({', '.join(known)}){suggest(name, known)}"
            for name in record_fields(data_cfg) if name not in known]


def sample_table(fields: Dict[str, object], names: List[str], batch: int, start: int, stop: int,
                 row: int, strict: bool = True) -> pd.DataFrame:
    """One row per sample of a batch: sample, batch, row and each recorded field as a column.

    strict=False (the default record, data.targets) skips fields that are not one scalar per sample."""
    return pd.DataFrame(sample_columns(fields, names, batch, start, stop, row, strict))


def sample_columns(fields: Dict[str, object], names: List[str], batch: int, start: int, stop: int,
                   row: int, strict: bool = True) -> Dict[str, object]:
    """sample_table's columns, name -> values, before they become a table (the runner adds the methods' columns
    and makes one DataFrame a batch)."""
    n = stop - start
    columns = {"sample": np.arange(start, stop, dtype=np.int64), "batch": np.full(n, batch, dtype=np.int64),
               "row": np.arange(row, row + n, dtype=np.int64)}
    for name in names:
        if name not in fields:
            raise ConfigError([f"data.record: {name!r} is not a field of the batch; it has "
                               f"{', '.join(fields) or 'none'}{suggest(name, fields)}"])
        try:
            columns[name] = _column(name, fields[name], n)
        except ConfigError:
            if strict:
                raise
    return columns


def _column(name: str, value, n: int):
    if isinstance(value, torch.Tensor):
        if value.numel() == n and (value.dim() == 0 or value.shape[0] == n):
            value = value.detach().cpu()
            return (value.float() if value.dtype == torch.bfloat16 else value).reshape(n).numpy()
        shape = list(value.shape[1:]) if value.dim() else []
        raise ConfigError([f"data.record: {name!r} has per-sample shape {shape}, not one scalar per sample; "
                           "record keeps labels, ids and paths: drop it from data.record and capture the tensor "
                           "with a hook instead (e.g. kind: forward_pre on layers: _model)"])
    scalars = isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value)
    if scalars and len(value) == n:
        return list(value)
    if isinstance(value, (list, tuple)) and len(value) == n:  # name the sample, not the list the batch made
        i, bad = next((i, v) for i, v in enumerate(value) if not isinstance(v, (str, int, float, bool)))
        raise ConfigError([f"data.record: {name!r} of the batch's sample {i} is {bad!r:.60} "
                           f"({'null in the data' if bad is None else type(bad).__name__}), not a scalar; record keeps "
                           "one number or string per sample: give every sample one, or drop it from data.record"])
    raise ConfigError([f"data.record: {name!r} is a {type(value).__name__}, not one scalar per sample "
                       "(a tensor of shape [n] or a list of n numbers or strings)"])
