"""Per-sample reductions of per-token captures, streamed: one row per document, in the order of cap.samples.

    X = cap.pool(layer="transformer.h.1", role="output", how="mean")      # [n_samples, d], row i: cap.samples row i
    out = cap.pool(layer=..., role=..., how=["mean", "last", "max"])      # {how: [n_samples, d]}
    probe_data = cap.samples.assign(y=labels)                            # fields line up with X's rows

The array is read in blocks of whole chunks (block_mb at a time) into one reused buffer: memory is the
block plus the per-sample results, whatever the number of tokens. A sample with no stored token gets NaN.
"""
from __future__ import annotations

from typing import Dict, Union

import numpy as np

from hookrun.read.chunks import reader as reader_of, subset

HOWS = ("mean", "sum", "max", "min", "first", "last")


def pool(cap, layer=None, role=None, hook=None, call=None, how="mean",
         block_mb: float = 64.0) -> Union[np.ndarray, Dict[str, np.ndarray]]:
    """Each sample's mean / sum / max / min / first / last over its tokens of one per-token array (`how`: one
    name, or a list of them for a dict), row i for cap.samples row i."""
    hows = [how] if isinstance(how, str) else list(how)
    bad = [h for h in hows if h not in HOWS]
    if bad or not hows:
        raise ValueError(f"pool(how={how!r}): each must be one of {', '.join(HOWS)}")
    key, records = cap.source(layer=layer, role=role, hook=hook, call=call, what="pool")
    units = set(cap.index.loc[cap.index["array"] == key, "unit"])
    if units != {"token"}:
        raise ValueError(f"pool: {key} is stored per {', '.join(sorted(units))}, not per token; pool reduces the "
                         "tokens of each sample of a per-token array (a text run)")
    samples = cap.samples
    start, stop = samples["token_start"].to_numpy(np.int64), samples["token_stop"].to_numpy(np.int64)
    reader = reader_of(cap, key)
    n = records.stop - records.start if isinstance(records, slice) else len(records)
    if len(stop) and stop[-1] != n:
        raise ValueError(f"pool: {key} has {n} records and the token table {stop[-1]} rows")
    block = reader.block_rows(block_mb)
    acc = _Pooled(hows, len(samples), reader.row_shape)
    buf = np.empty((min(block, n), *reader.row_shape), dtype=reader.dtype)
    for a in range(0, n, block):
        b = min(n, a + block)
        data = reader.read(subset(records, slice(a, b)), out=buf[:b - a])
        acc.add(data, a, b, start, stop)
    out = acc.result(stop - start, np.result_type(reader.dtype, np.float32))
    return out[hows[0]] if isinstance(how, str) else out


class _Pooled:
    """The running reductions of every sample."""

    def __init__(self, hows, n: int, shape):
        self.hows, self.shape = hows, tuple(shape)
        self.sum = np.zeros((n, *shape)) if {"mean", "sum"} & set(hows) else None
        self.max = np.full((n, *shape), -np.inf) if "max" in hows else None
        self.min = np.full((n, *shape), np.inf) if "min" in hows else None
        self.first = np.full((n, *shape), np.nan) if "first" in hows else None
        self.last = np.full((n, *shape), np.nan) if "last" in hows else None

    def add(self, data: np.ndarray, a: int, b: int, start: np.ndarray, stop: np.ndarray) -> None:
        """Rows a:b of the array (`data`) into the samples they belong to."""
        lo, hi = np.searchsorted(stop, a, side="right"), np.searchsorted(start, b, side="left")
        seg = np.arange(lo, hi)
        seg = seg[stop[seg] > start[seg]]  # samples with rows here, in row order: they tile a:b
        if not len(seg):
            return
        offsets = np.maximum(start[seg], a) - a
        if self.sum is not None:
            self.sum[seg] += np.add.reduceat(data, offsets, axis=0, dtype=np.float64)
        if self.max is not None:
            self.max[seg] = np.maximum(self.max[seg], np.maximum.reduceat(data, offsets, axis=0))
        if self.min is not None:
            self.min[seg] = np.minimum(self.min[seg], np.minimum.reduceat(data, offsets, axis=0))
        if self.first is not None:
            here = seg[start[seg] >= a]
            self.first[here] = data[start[here] - a]
        if self.last is not None:
            here = seg[stop[seg] <= b]
            self.last[here] = data[stop[here] - 1 - a]

    def result(self, counts: np.ndarray, dtype) -> Dict[str, np.ndarray]:
        """{how: [n, ...]}; NaN for a sample with no rows."""
        counts = counts.reshape(-1, *([1] * len(self.shape)))
        out = {}
        for how in self.hows:
            value = self.sum / np.maximum(counts, 1) if how == "mean" else getattr(self, how)
            out[how] = np.where(counts == 0, np.nan, value).astype(dtype)
        return out
