"""Gives the memory that a run's freed captures leave in the C heap back to the OS, between batches.

    heap = HeapTrimmer(every_s=0.25)
    heap.between_batches()      # after each batch: malloc_trim(0) at most every `every_s` seconds

glibc keeps freed heap memory for reuse and raises its own trim threshold up to 64 MB as large
blocks come and go, so a run's peak RSS grew with its length (~3 MB a batch on the benchmark's
CNN: 390 MB after 9 batches, 440-480 MB after 35) although nothing was kept. `malloc_trim(0)`
returns it (331-338 MB through 70 batches). A call costs ~1.5 ms, so it runs at most every
`every_s` seconds; elsewhere than glibc (macOS, musl) this does nothing.
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
    """Calls malloc_trim(0) between batches, at most once every `every_s` seconds."""

    def __init__(self, every_s: float = 0.25):
        self.every_s = every_s
        self.trim = _malloc_trim()
        self.last = time.perf_counter()
        self.calls = 0

    def between_batches(self) -> None:
        now = time.perf_counter()
        if self.trim is None or now - self.last < self.every_s:
            return
        self.trim(0)
        self.calls += 1
        self.last = time.perf_counter()
