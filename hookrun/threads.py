"""torch on one intra-op thread for work too small to share, for every layer (the engine's first-batch checks, the
training's small dictionary steps).

    with one_thread():          # a 1-sample forward pass of the first batch's checks
        model(x[:1])
    with one_thread(small):     # one thread only when `small`, else torch's threads as they are
        trainer.step(x)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def one_thread(when: bool = True) -> Iterator[None]:
    """torch on one intra-op thread inside the block (when `when`), its thread count put back after it, an
    exception included. On a busy machine each parallel region of a tiny computation waits for a descheduled OpenMP
    thread: a 1-sample forward pass of a small CNN took 0.11 s of CPU instead of 2 ms, and a 256 x 16 x 64
    dictionary step was 10x slower on 2 threads than on 1."""
    threads = torch.get_num_threads()
    if not when or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
