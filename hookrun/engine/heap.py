"""Gives the memory that a run's freed captures leave in the C heap back to the OS, between batches.

    heap = HeapTrimmer(every_s=0.25)
    heap.between_batches()      # after each batch: malloc_trim(0) at most every `every_s` seconds, and at most
                                # 1% of the time (a trim of 50 ms waits 5 s)

glibc keeps freed heap memory for reuse and raises its own trim threshold up to 64 MB as large
blocks come and go, so a run's peak RSS grew with its length (~3 MB a batch on the benchmark's
CNN: 390 MB after 9 batches, 440-480 MB after 35) although nothing was kept. `malloc_trim(0)`
returns it (331-338 MB through 70 batches). A call costs ~1.5 ms on that CNN, so it runs at most every
`every_s` seconds. Where batches free large blocks (a logit lens's [layers, tokens, vocab] tensors) a call
costs far more (50 ms a batch on an 8-block GPT-2 at 64 tokens x 8), and the next batch pays again to fault
the pages back in: the next call waits until the main thread has run `share` x the last call's CPU seconds
(100: the trims and their refaults a few percent of the run's CPU at most; CPU, not wall seconds, so that a
loaded machine does not make them more frequent). Elsewhere than glibc (macOS, musl) this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Optional


def _malloc_trim() -> Optional[object]:
    """glibc's malloc_trim, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """Calls malloc_trim(0) between batches, at most once every `every_s` seconds and once the main thread has run
    `share` x the last call's CPU seconds since."""

    def __init__(self, every_s: float = 0.25, share: float = 100.0):
        self.every_s, self.share = every_s, share
        self.wait = 0.0  # CPU seconds the main thread runs before the next call
        self.trim = _malloc_trim()
        self.last, self.last_cpu = time.perf_counter(), time.thread_time()
        self.calls = 0

    def between_batches(self) -> None:
        if self.trim is None or time.perf_counter() - self.last < self.every_s:
            return
        cpu = time.thread_time()
        if cpu - self.last_cpu < self.wait:
            return
        self.trim(0)
        self.last_cpu = time.thread_time()
        self.wait = self.share * (self.last_cpu - cpu)
        self.calls += 1
        self.last = time.perf_counter()
