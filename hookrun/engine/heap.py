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

The trimmer also lifts glibc's two thresholds, once per process, to the ceiling its own rule would reach
(`raise_thresholds`): a block under 128 KB is taken from the heap, a larger one is mapped for itself, and a
free that leaves more than 128 KB at the heap's top gives it back, until the process frees a mapped block,
which lifts both to that block's size (and twice it). A run whose batches allocate and free a few MB of
tensors (the lens's [sites, vocab] blocks) otherwise gave them back to the OS at every free and faulted every
page in again: on the bundled LM, 2,300 page faults and 10 ms of a lens batch's 20 ms.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from typing import Optional


@functools.cache
def _libc_name() -> str:
    """The C library's file name, looked up once per process (find_library runs ldconfig: ~6 ms a call)."""
    return ctypes.util.find_library("c") or "libc.so.6"


def _libc():
    """The C library (ctypes.CDLL); OSError where it cannot be loaded."""
    return ctypes.CDLL(_libc_name())


def _malloc_trim() -> Optional[object]:
    """glibc's malloc_trim, or None where there is none."""
    try:
        return _libc().malloc_trim
    except (OSError, AttributeError):
        return None


_MMAP_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's DEFAULT_MMAP_THRESHOLD_MAX (32 MB on 64 bits)


@functools.cache  # once per process (a fork's child inherits the lifted thresholds, and this answer)
def raise_thresholds() -> bool:
    """Lifts glibc's mmap and trim thresholds to the ceiling of their own dynamic rule (32 MB and 64 MB on 64
    bits), once per process, by freeing one mapped block of that size (never touched, so never in RSS): what
    glibc does itself the first time a program frees such a block; later frees can only lift them further.
    False where there is no glibc.

        raise_thresholds()      # then blocks up to 32 MB come from the heap, and its top is kept up to 64 MB
    """
    try:
        libc = _libc()
        malloc, free = libc.malloc, libc.free
        libc.gnu_get_libc_version  # glibc's own: musl's malloc has no such thresholds
    except (OSError, AttributeError):
        return False
    malloc.restype, free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    block = malloc(_MMAP_MAX - 2 * 4096)  # mapped (over the threshold), under the ceiling with its header
    if block:
        free(block)
    return True


class HeapTrimmer:
    """Calls malloc_trim(0) between batches, at most once every `every_s` seconds and once the main thread has run
    `share` x the last call's CPU seconds since."""

    def __init__(self, every_s: float = 0.25, share: float = 100.0):
        self.every_s, self.share = every_s, share
        self.wait = 0.0  # CPU seconds the main thread runs before the next call
        self.trim = _malloc_trim()
        if self.trim is not None:
            raise_thresholds()
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
