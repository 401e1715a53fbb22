"""The samples table as the read side gives it: where each sample's rows are, in every kind of array.

    cap.samples                    sample, batch, row (per-sample arrays), token_start, token_stop (text runs), fields
    acts = cap.load(layer=..., role=...)          # a per-token array
    s = cap.samples.iloc[5]; acts[s.token_start:s.token_stop]   # the rows of sample 5's tokens

`row` is a sample's row in every per-sample array. A text run that stores per-token arrays only has none:
there `row` is refused with an error that says what to use, rather than given as numbers that are the rows
of other documents' tokens.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import pandas as pd

from hookrun.format.files import DamagedError

NO_ROW = ("cap.samples has no 'row' on this run: it stores per-token arrays only, where a sample has many rows; "
          "sample i's rows are token_start:token_stop (acts[s.token_start:s.token_stop]), its token table rows "
          "alike; cap.pool(layer=..., how='mean') gives one row per sample, in the order of cap.samples")


SPECIAL = ("record", "token_id", "position")  # loader and export fields that are not cap.samples columns


class Samples(pd.DataFrame):
    """cap.samples: a DataFrame (and so is every frame made from it) that refuses `row` where it has no
    meaning, naming what to use instead."""

    @property
    def _constructor(self):
        return Samples

    def __getattr__(self, name):
        if name == "row" and "row" not in self.columns:
            raise AttributeError(NO_ROW)
        return super().__getattr__(name)

    def __getitem__(self, key):
        if isinstance(key, str) and key == "row" and "row" not in self.columns:
            raise KeyError(NO_ROW)
        return super().__getitem__(key)


def token_spans(samples: pd.DataFrame, tokens: pd.DataFrame) -> Tuple[np.ndarray, np.ndarray]:
    """(token_start, token_stop) of each sample: its rows in the token table, which are its rows in every
    per-token array of a module run once per forward (and of `cap.load(..., call=c)` for any call)."""
    ids = samples["sample"].to_numpy()
    tok = tokens["sample"].to_numpy()
    counts = pd.Series(tok).value_counts(sort=False).reindex(ids, fill_value=0).to_numpy(np.int64)
    stop = np.cumsum(counts)
    if stop[-1:].sum() != len(tok) or not np.array_equal(np.repeat(ids, counts), tok):
        raise DamagedError("_index: the token table's samples do not follow the samples table's order (damaged)")
    return stop - counts, stop


def samples_table(raw: pd.DataFrame, tokens: pd.DataFrame, units) -> Samples:
    """cap.samples from the stored table: token_start/token_stop added on a text run, `row` dropped where the
    run stores per-token arrays and no per-sample one (`units`: the index's unit column)."""
    table = Samples(raw if len(raw.columns) else pd.DataFrame(columns=["sample", "batch", "row"]))
    units = set(units)
    if len(tokens) and len(table):
        start, stop = token_spans(table, tokens)
        at = list(table.columns).index("row") + 1 if "row" in table.columns else 2
        table.insert(at, "token_start", start)
        table.insert(at + 1, "token_stop", stop)
    if "token" in units and "sample" not in units and "row" in table.columns:
        table = table.drop(columns="row")
    return table


def field_columns(cap, key: str, n: int, fields: List[str]) -> Dict[str, np.ndarray]:
    """Each field's value for each of the n records of an array (as `cap.load()` gives them): the loader's and
    export_hf's `fields` (record, token_id, position, or a column of cap.samples)."""
    if not fields:
        return {}
    unit = cap.index.loc[cap.index["array"] == key, "unit"].iloc[0] if "unit" in cap.index.columns else "sample"
    samples = cap.samples
    if unit == "token":
        tokens = cap.tokens()
        if len(tokens) != n:
            raise ValueError(f"loader: {key} has {n} records and the token table {len(tokens)} rows")
        which = np.repeat(np.arange(len(samples)), samples["token_stop"] - samples["token_start"])
    elif unit == "sample" and len(samples) == n:
        tokens, which = None, np.arange(n)
    else:
        raise ValueError(f"loader: fields join per-sample and per-token arrays; {key} is per {unit} with {n} records "
                         f"and cap.samples has {len(samples)} rows")
    out = {}
    for name in fields:
        if name == "record":
            out[name] = np.arange(n)
        elif name in ("token_id", "position"):
            if tokens is None:
                raise ValueError(f"loader: field {name!r} needs a per-token array; {key} is per {unit}")
            out[name] = tokens[name].to_numpy()
        elif name in samples.columns:
            out[name] = samples[name].to_numpy()[which]
        else:
            raise ValueError(f"loader: field {name!r} is none of {', '.join(SPECIAL)} and no column of cap.samples "
                             f"({', '.join(samples.columns)})")
        if not (np.issubdtype(out[name].dtype, np.number) or out[name].dtype == bool):
            raise ValueError(f"loader: field {name!r} holds {out[name].dtype} values; only numbers become tensors")
    return out
