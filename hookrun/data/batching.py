"""The batching rule: which samples each batch of a run holds (data.batch_size, data.stride, data.max_samples).

    for start, stop, kept in slices(batch_size=4, stride=2, max_samples=6, length=20):
        ...  # (0, 4, True) (4, 8, False) (8, 10, True), then the end: 6 samples were kept

The data is cut into slices of batch_size samples; every stride-th slice is kept (a batch of the run,
numbered i // stride), the others are skipped whole; max_samples cuts the kept slices (the last one
shorter) and ends the run. With `length=None` (a dataset without len()) the slices go on until the
caller runs out of data.
"""
from __future__ import annotations

import itertools
from typing import Iterator, List, Optional, Tuple


def slices(batch_size: int, stride: int, max_samples: Optional[int] = None,
           length: Optional[int] = None) -> Iterator[Tuple[int, int, bool]]:
    """(start, stop, kept) of every slice of the data in order, skipped ones included."""
    left = max_samples
    for i in itertools.count():
        start = i * batch_size
        if (length is not None and start >= length) or (left is not None and left <= 0):
            return
        stop = start + batch_size if length is None else min(start + batch_size, length)
        kept = i % stride == 0
        if kept and left is not None:
            stop = min(stop, start + left)
            left -= stop - start
        yield start, stop, kept


def batch_ranges(batch_size: int, stride: int, max_samples: Optional[int], length: int) -> List[Tuple[int, int]]:
    """The sample range [start, stop) of every batch a run sees of `length` samples."""
    return [(start, stop) for start, stop, kept in slices(batch_size, stride, max_samples, length) if kept]


class Batches:
    """What every input source shares: counts and iteration from its `ranges()` and `batches(first)`."""

    tokenizer_digest: Optional[str] = None  # text inputs: their tokenizer's (the store's fingerprint of it)

    def ranges(self) -> Optional[List[Tuple[int, int]]]:
        """The sample range [start, stop) of every batch the run sees, None if unknown."""
        raise NotImplementedError

    def batches(self, first: int = 0) -> Iterator:
        """The batches from batch `first` on."""
        raise NotImplementedError

    def sample_count(self) -> Optional[int]:
        """Samples the run will see (after max_samples and stride), None if unknown."""
        ranges = self.ranges()
        return None if ranges is None else sum(stop - start for start, stop in ranges)

    def token_count(self) -> Optional[int]:
        """Tokens the run will store one row each (text inputs), None if not text or unknown."""
        return None

    def batch_count(self) -> Optional[int]:
        """Batches the run will see, None if unknown."""
        ranges = self.ranges()
        return None if ranges is None else len(ranges)

    def __iter__(self) -> Iterator:
        return self.batches()
