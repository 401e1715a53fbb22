"""A training loader over captures: shuffled minibatches of rows, for probes, sparse autoencoders, crosscoders.

    ds = cap.loader(layer="transformer.h.1", role="output", batch_size=4096, seed=0)   # a torch IterableDataset
    for x in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):          # x: float32 [4096, d]
        ...
    ds.set_epoch(1)                                     # another order (call it before each epoch)
    hookrun.loader(cap, layer=["transformer.h.0", "transformer.h.1"])   # layers side by side: [4096, 2, d]
    hookrun.loader([cap_a, cap_b], layer="blocks.3")                    # the same layer of two runs
    cap.loader(layer=..., fields=["token_id", "sample", "label"])       # a dict: acts, and each field

How: the chunks of the (first) array are dealt in an order drawn from (seed, epoch); rank r of world_size
takes every world_size-th of them, and DataLoader worker w of a rank every num_workers-th of those, so ranks
and workers read disjoint chunks and, together, every row once per epoch. Each one reads `buffer_chunks`
chunks at a time (straight from their files, in parallel threads, the next group while the current one is
served), shuffles their rows with the rows left over from the last group, and serves full batches; the
rows of its last partial batch come last (dropped with drop_last=True, which also gives every rank the same
number of batches, as data-parallel training needs). Memory is two buffers of buffer_chunks chunks.

`device` and `pin_memory` act where the loader is iterated in the training process (num_workers=0). With
DataLoader workers, pinned memory does not survive the trip between processes and CUDA cannot start in a
forked worker: give the DataLoader pin_memory=True and move each batch in the loop (the loader says so).
pin_memory on a machine without an accelerator is ignored with a warning, as DataLoader does.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

import numpy as np
import torch

from hookrun.read.chunks import ChunkReader, read_all, reader, subset
from hookrun.read.tables import field_columns



def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def loader(captures, layer=None, role=None, hook=None, call=None, rows=None, batch_size: int = 4096,
           shuffle: bool = True, seed: int = 0, epoch: int = 0, buffer_chunks: int = 8, drop_last: bool = False,
           rank: Optional[int] = None, world_size: Optional[int] = None, fields: Sequence[str] = (),
           dtype=torch.float32, device=None, pin_memory: bool = False) -> "Loader":
    """A torch IterableDataset of shuffled minibatches of one array's records, or of several side by side
    (a list of captures and/or of layers: one array each, with the same number of records).

    rows: which records (as `cap.load(rows=)`: a slice, numbers or a boolean mask; e.g. a train split).
    fields: joined to each row and yielded in a dict beside `acts`: any cap.samples column, `record` (the
    row's number in `cap.load()`), and on per-token arrays `token_id` and `position`.
    rank / world_size: default from the RANK / WORLD_SIZE environment variables (torchrun sets them)."""
    caps = _as_list(captures)
    layers = _as_list(layer)
    if len(caps) > 1 and len(layers) > 1:
        raise ValueError("loader: give several captures or several layers, not both")
    pairs = [(c, layer) for c in caps for layer in layers]
    sources = [(cap, *cap.source(layer=lay, role=role, hook=hook, call=call, what="loader")) for cap, lay in pairs]
    world = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
    rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
    if not 0 <= rank < world:
        raise ValueError(f"loader: rank {rank} is not in 0..{world - 1} (world_size {world})")
    if batch_size < 1 or buffer_chunks < 1:
        raise ValueError(f"loader: batch_size ({batch_size}) and buffer_chunks ({buffer_chunks}) must be >= 1")
    return Loader(sources, rows, batch_size, shuffle, seed, epoch, buffer_chunks, drop_last, rank, world,
                  list(fields), dtype, device, pin_memory)


def _pinnable(pin_memory: bool) -> bool:
    """Whether batches are pinned: asked for, and an accelerator here (else a warning, as DataLoader gives)."""
    if pin_memory and not torch.accelerator.is_available():
        warnings.warn("loader: pin_memory=True but no accelerator is here; batches are not pinned", stacklevel=3)
        return False
    return bool(pin_memory)


class Loader(torch.utils.data.IterableDataset):
    """Shuffled minibatches of captured rows (see the module docstring); `set_epoch(e)` before each epoch."""

    def __init__(self, sources, rows, batch_size, shuffle, seed, epoch, buffer_chunks, drop_last, rank, world,
                 fields, dtype, device, pin_memory):
        super().__init__()
        self.stores = [(cap.location.url, cap.location.storage_options) for cap, _, _ in sources]
        self._open = type(sources[0][0])  # Captures: a worker started by spawn opens the stores again with it
        self.keys = [key for _, key, _ in sources]
        self.records = [subset(records, rows) for _, _, records in sources]
        counts = {len(range(r.start, r.stop)) if isinstance(r, slice) else len(r) for r in self.records}
        if len(counts) > 1:
            raise ValueError(f"loader: side by side arrays need as many records each; {self.keys} have {counts}")
        self.n = counts.pop()
        self.batch_size, self.shuffle, self.seed, self.epoch = int(batch_size), shuffle, seed, int(epoch)
        self.buffer_chunks, self.drop_last, self.rank, self.world = int(buffer_chunks), drop_last, rank, world
        self.dtype, self.device, self.pin_memory = dtype, device, _pinnable(pin_memory)
        self._caps = [cap for cap, _, _ in sources]
        first = self._readers()[0]
        self.cuts = self._pieces(self.records[0], first.rows)
        total = self._total(sources[0][2])
        record_no = subset(slice(0, total), rows)  # the record number of each position served
        if isinstance(record_no, slice):
            record_no = np.arange(record_no.start, record_no.stop)
        self.fields = {name: col[record_no] for name, col in
                       field_columns(self._caps[0], self.keys[0], total, fields).items()}
        self.shapes = {(r.row_shape, r.dtype) for r in self._readers()}
        if len(self.shapes) > 1:
            raise ValueError(f"loader: side by side arrays need one row shape and dtype; {self.keys} have {self.shapes}")

    @staticmethod
    def _total(records) -> int:
        return records.stop - records.start if isinstance(records, slice) else len(records)

    @staticmethod
    def _pieces(records, chunk_rows: int) -> np.ndarray:
        """Where the records cross into another chunk of the first array: piece i is records cuts[i]:cuts[i+1]."""
        rows = np.arange(records.start, records.stop) if isinstance(records, slice) else np.asarray(records)
        if not len(rows):
            return np.zeros(1, dtype=np.int64)
        chunk = rows // chunk_rows
        inner = np.flatnonzero(chunk[1:] != chunk[:-1]) + 1
        return np.concatenate([[0], inner, [len(rows)]]).astype(np.int64)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_caps"] = None  # a worker started by spawn opens the stores again
        return state

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration serves (as DistributedSampler.set_epoch)."""
        self.epoch = int(epoch)

    def _readers(self) -> List[ChunkReader]:
        if self._caps is None:
            self._caps = [self._open(url, options) for url, options in self.stores]
        return [reader(cap, key) for cap, key in zip(self._caps, self.keys)]

    def pieces(self, rank: int, worker: int = 0, workers: int = 1) -> np.ndarray:
        """The pieces (chunks of the first array) that a rank's worker reads this epoch, in order."""
        count = len(self.cuts) - 1
        order = np.random.default_rng([self.seed, self.epoch]).permutation(count) if self.shuffle else np.arange(count)
        return order[rank::self.world][worker::workers]

    def _limit(self, worker: int, workers: int) -> Optional[int]:
        """With drop_last, the full batches this worker serves: the fewest any rank's same worker has."""
        if not self.drop_last:
            return None
        sizes = np.diff(self.cuts)
        return min(int(sizes[self.pieces(r, worker, workers)].sum()) // self.batch_size for r in range(self.world))

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None and (self.pin_memory or torch.device(self.device or "cpu").type != "cpu"):
            raise ValueError(f"loader: device={self.device!r}, pin_memory={self.pin_memory} in a DataLoader worker "
                             "process; give the loader neither, the DataLoader pin_memory=True, and move each batch "
                             "with .to(device, non_blocking=True) in the training loop")
        mine = self.pieces(self.rank, worker, workers)
        limit = self._limit(worker, workers)
        groups = [mine[i:i + self.buffer_chunks] for i in range(0, len(mine), self.buffer_chunks)]
        if not groups or limit == 0:
            return
        readers = self._readers()
        biggest = int(np.diff(self.cuts).max())
        size = self.batch_size + self.buffer_chunks * biggest
        buffers = [[np.empty((size, *r.row_shape), dtype=r.dtype) for r in readers] for _ in range(2)]
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, 1])
        yielded, left, left_where = 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        with ThreadPoolExecutor(1, thread_name_prefix="hookrun-prefetch") as prefetch:
            pending = prefetch.submit(self._fill, readers, buffers[0], groups[0])
            for g in range(len(groups)):
                cur, previous = buffers[g % 2], buffers[(g + 1) % 2]
                where = pending.result()  # record positions of the rows now in cur[batch_size:]
                start = self.batch_size - len(left)
                for buf, old in zip(cur, previous):
                    buf[start:self.batch_size] = old[left]
                where = np.concatenate([left_where, where]) if len(left) else where
                if g + 1 < len(groups):
                    pending = prefetch.submit(self._fill, readers, previous, groups[g + 1])
                order = rng.permutation(len(where)) if self.shuffle else np.arange(len(where))
                full = len(where) // self.batch_size
                for i in range(full):
                    if limit is not None and yielded >= limit:
                        return
                    pick = order[i * self.batch_size:(i + 1) * self.batch_size]
                    yield self._batch(cur, pick + start, where[pick])
                    yielded += 1
                rest = order[full * self.batch_size:]
                left, left_where = rest + start, where[rest]
            if len(left) and not self.drop_last:
                yield self._batch(buffers[(len(groups) - 1) % 2], left, left_where)

    def _fill(self, readers, buffers, pieces) -> np.ndarray:
        """Read `pieces` of every array into `buffers` after their first batch_size rows; the record positions."""
        jobs, at, where = [], self.batch_size, []
        for p in pieces:
            lo, hi = int(self.cuts[p]), int(self.cuts[p + 1])
            for array_reader, records, buf in zip(readers, self.records, buffers):
                jobs.append((array_reader, subset(records, slice(lo, hi)), buf[at:at + hi - lo]))
            where.append(np.arange(lo, hi))
            at += hi - lo
        read_all(jobs)
        return np.concatenate(where)

    def _batch(self, buffers, pick: np.ndarray, where: np.ndarray):
        """One minibatch: rows `pick` of the buffers (stacked on axis 1 for several arrays), with its fields."""
        if len(buffers) == 1:
            acts = np.take(buffers[0], pick, axis=0)
        else:
            acts = np.empty((len(pick), len(buffers), *buffers[0].shape[1:]), dtype=buffers[0].dtype)
            for s, buf in enumerate(buffers):
                np.take(buf, pick, axis=0, out=acts[:, s], mode="clip")
        x = self._tensor(torch.from_numpy(acts), self.dtype)
        if not self.fields:
            return x
        return {"acts": x, **{name: self._tensor(torch.from_numpy(col[where]), None)
                              for name, col in self.fields.items()}}

    def _tensor(self, t: torch.Tensor, dtype) -> torch.Tensor:
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        if self.pin_memory:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=self.pin_memory) if self.device is not None else t

