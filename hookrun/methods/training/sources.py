"""Where training rows come from: a finished store read chunk by chunk, or the model's own forwards, both
through a shuffle buffer of bounded size.

    src = StoreRows(cap, spec, site)          # cap.loader underneath: memory ~ buffer_tokens rows, not the store
    x, y = src.next()                         # a batch_size-row minibatch (y: a transcoder's output rows, else None)
    buf = ShuffleBuffer(capacity, batch_size, seed); buf.add(rows); for rows in buf.batches(): ...

Both are resumable to the row: StoreRows by (epoch, batches served) (the loader's order is a function of the seed and
the epoch), ShuffleBuffer by its rows and its generator's state (state_dict / load_state_dict).
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

PREFETCH = 2   # minibatches a StoreRows reads ahead of the training step, in its own thread


class StoreRows:
    """Minibatches of one site's rows from a store (a transcoder: its two sites' rows side by side), epoch after
    epoch, each epoch in the loader's shuffled order (hookrun.read.loader, drop_last: full batches only). A thread
    reads PREFETCH minibatches ahead (the loader's chunk reads and its row gathers behind the training step); the
    order is the loader's, whatever the thread's pace."""

    def __init__(self, cap, layers, hook: Optional[str], role: Optional[str], batch_size: int, buffer_tokens: int,
                 seed: int, device=None):
        self.cap, self.layers, self.hook, self.role = cap, list(layers), hook, role
        self.batch_size, self.seed, self.device = int(batch_size), int(seed), device
        probe = self._loader(1, 0)
        self.records = probe.n
        self.shapes = probe.shapes
        chunk = int(np.diff(probe.cuts).max()) if len(probe.cuts) > 1 else 1
        self.buffer_chunks = max(1, int(buffer_tokens) // max(chunk, 1))
        self.epoch, self.served = 0, 0
        self._reader: Optional[_Ahead] = None

    def _loader(self, buffer_chunks: int, epoch: int):
        layer = self.layers[0] if len(self.layers) == 1 else self.layers
        return self.cap.loader(layer=layer, hook=self.hook, role=self.role, batch_size=self.batch_size, seed=self.seed,
                               epoch=epoch, buffer_chunks=buffer_chunks, drop_last=True, rank=0, world_size=1,
                               device=self.device)

    def width(self) -> Tuple[int, ...]:
        """The row shape of the stored arrays."""
        return next(iter(self.shapes))[0]

    def _epochs(self, epoch: int, skip: int):
        """(epoch, rows) from `epoch` on, its first `skip` minibatches left out (a resume: the same order)."""
        while True:
            it = iter(self._loader(self.buffer_chunks, epoch))
            for _ in range(skip):
                next(it)
            got = False
            for rows in it:
                got = True
                yield epoch, rows
            if not got and skip == 0:
                return   # an empty epoch: the store holds fewer rows than batch_size, refused before
            epoch, skip = epoch + 1, 0

    def next(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self._reader is None:
            self._reader = _Ahead(self._epochs(self.epoch, self.served), PREFETCH)
        epoch, rows = self._reader.next()
        if epoch != self.epoch:
            self.epoch, self.served = epoch, 0
        self.served += 1
        if len(self.layers) == 1:
            return rows.reshape(len(rows), -1), None
        return rows[:, 0].reshape(len(rows), -1), rows[:, 1].reshape(len(rows), -1)

    def close(self) -> None:
        """Stop the reading thread (a later next() starts it again where the rows served end)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.epoch, self.served = int(state["epoch"]), int(state["served"])


class _Ahead:
    """An iterator run in a daemon thread, `depth` items ahead of next(); its exception raised by next()."""

    _END = object()

    def __init__(self, items, depth: int):
        self.items, self.queue, self.stop = items, queue.Queue(maxsize=depth), threading.Event()
        self.thread = threading.Thread(target=self._run, name="hookrun-train-rows", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.items:
                while not self.stop.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
            self._put(self._END)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread, which raises it
            self._put(err)

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self):
        item = self.queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class ShuffleBuffer:
    """Rows of the model's forwards mixed before they are served (SAELens's mixing buffer): once `capacity` rows
    are in, they are shuffled and the first half served in minibatches; the rest waits for the next rows."""

    def __init__(self, capacity: int, batch_size: int, seed: int):
        self.capacity, self.batch_size = int(capacity), int(batch_size)
        self.rows: Optional[torch.Tensor] = None
        self.generator = torch.Generator().manual_seed(int(seed))

    def __len__(self) -> int:
        return 0 if self.rows is None else len(self.rows)

    def add(self, rows: torch.Tensor) -> None:
        rows = rows.detach().to("cpu")
        self.rows = rows.clone() if self.rows is None else torch.cat([self.rows, rows])

    def batches(self, drain: bool = False) -> Iterator[torch.Tensor]:
        """Minibatches while the buffer is full (drain: of every row left, full batches only)."""
        while len(self) >= max(self.capacity, self.batch_size) or (drain and len(self) >= self.batch_size):
            perm = torch.randperm(len(self), generator=self.generator)
            self.rows = self.rows[perm]
            half = len(self) if drain else max(self.batch_size, (len(self) // 2) // self.batch_size * self.batch_size)
            served = self.rows[:half]
            self.rows = self.rows[half:]
            for a in range(0, len(served) - self.batch_size + 1, self.batch_size):
                yield served[a:a + self.batch_size]
            if drain:
                self.rows = served[len(served) // self.batch_size * self.batch_size:]
                return

    def state_dict(self) -> dict:
        return {"rows": None if self.rows is None else self.rows.clone(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.rows = state["rows"]
        self.generator.set_state(state["generator"])
