"""A data-parallel run's store: which rows each rank writes, and the chunks two ranks share.

Rank r takes batches [first_batch, stop_batch) and, in every array, the rows a one-process run gives
those batches: from `before[r][unit] * calls` on (unit: sample, token or batch). It writes every
chunk (or shard) that lies wholly in its rows, and its index parts into `_index/rank-RRR/`. The
rows before its first chunk boundary share a chunk with the rank before: it keeps them beside the
array (`_index/rank-RRR/heads/<array>.npy`), and when every rank has committed, rank 0 writes each
shared chunk whole (`stitch`), so the store is the one a single process writes.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

import numpy as np

from hookrun.format.layout import head_key
from hookrun.storage import Location


@dataclass
class Share:
    """This rank's part of the run, and what every rank needs to know of the others."""

    rank: int
    world: int
    gather: Callable[[Any], List[Any]]  # every rank's value, in rank order (a collective)
    first_batch: int
    stop_batch: int
    before: List[Dict[str, int]]  # per rank: samples, tokens and batches of the ranks before it
    totals: Dict[str, int]  # samples, tokens and batches of the whole run
    calls: Dict[str, int] = field(default_factory=dict)  # array key -> calls per forward (rank 0's first batch)
    first: Dict[str, tuple] = field(default_factory=dict)  # rank 0: array key -> (capture, host tensor)

    def first_row(self, rank: int, unit: str, key: str) -> int:
        return self.before[rank][unit] * self.calls[key]

    def total_rows(self, unit: str, key: str) -> int:
        return self.totals[unit] * self.calls[key]


def stitch(location: Location, streams, share: Share) -> None:
    """Rank 0, once every rank has committed: write each shared chunk whole from what the rank before wrote
    into it (a padded last chunk) and the head rows of the ranks that start inside it."""
    for key, stream in streams.by_key.items():
        unit = stream.array.attrs.get("unit", "sample")
        rows = stream.key_rows
        total = share.total_rows(unit, key)
        starts: Dict[int, List[int]] = {}
        for r in range(1, share.world):
            first = share.first_row(r, unit, key)
            if first % rows and first < total:
                starts.setdefault(first // rows, []).append(r)
        for k, ranks in sorted(starts.items()):
            lo, hi = k * rows, min((k + 1) * rows, total)
            block = np.array(stream.array[lo:hi])
            for r in ranks:
                raw = location.get(head_key(r, key))
                if raw is not None:
                    head = np.load(io.BytesIO(raw), allow_pickle=False)
                    first = share.first_row(r, unit, key)
                    block[first - lo:first - lo + len(head)] = head
            if not stream.sharded and len(block) < rows:
                padded = np.zeros((rows, *block.shape[1:]), dtype=block.dtype)
                padded[:len(block)] = block
                block = padded
            streams.put_chunk(stream, k, block)
