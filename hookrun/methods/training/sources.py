"""Where training rows come from: a finished store read chunk by chunk, or the model's own forwards, both
through a shuffle buffer of bounded size.

    src = StoreRows(cap, spec, site)          # cap.loader underneath: memory ~ buffer_tokens rows, not the store
    x, y = src.next()                         # a batch_size-row minibatch (y: a transcoder's output rows, else None)
    buf = ShuffleBuffer(capacity, batch_size, seed); buf.add(rows); for rows in buf.batches(): ...

Both are resumable to the row: StoreRows by (epoch, batches served) (the loader's order is a function of the seed and
the epoch), ShuffleBuffer by its rows and its generator's state (state_dict / load_state_dict).
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import numpy as np
import torch


class StoreRows:
    """Minibatches of one site's rows from a store (a transcoder: its two sites' rows side by side), epoch after
    epoch, each epoch in the loader's shuffled order (hookrun.read.loader, drop_last: full batches only)."""

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
        self._it: Optional[Iterator] = None

    def _loader(self, buffer_chunks: int, epoch: int):
        layer = self.layers[0] if len(self.layers) == 1 else self.layers
        return self.cap.loader(layer=layer, hook=self.hook, role=self.role, batch_size=self.batch_size, seed=self.seed,
                               epoch=epoch, buffer_chunks=buffer_chunks, drop_last=True, rank=0, world_size=1,
                               device=self.device)

    def width(self) -> Tuple[int, ...]:
        """The row shape of the stored arrays."""
        return next(iter(self.shapes))[0]

    def _open(self) -> None:
        self._it = iter(self._loader(self.buffer_chunks, self.epoch))
        for _ in range(self.served):  # a resume: the same order, the rows served before skipped
            next(self._it)

    def next(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self._it is None:
            self._open()
        try:
            rows = next(self._it)
        except StopIteration:
            self.epoch, self.served = self.epoch + 1, 0
            self._open()
            rows = next(self._it)  # (an empty epoch: the store holds fewer rows than batch_size, refused before)
        self.served += 1
        if len(self.layers) == 1:
            return rows.reshape(len(rows), -1), None
        return rows[:, 0].reshape(len(rows), -1), rows[:, 1].reshape(len(rows), -1)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.served = int(state["epoch"]), int(state["served"])
        self._it = None


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
