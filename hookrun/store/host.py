"""Device-to-host copies of CUDA captures that never make the model's stream wait for the copy.

    copier = HostCopier()
    host, sums, event = copier.to_host(t)   # returns at once; event.synchronize() before reading them

A capture is first copied on the device, on the model's stream (device memory is ~50x faster
than the bus, and an in-place op after the hook, like ReLU(inplace=True), runs only after it).
That snapshot then goes to pinned host memory on a side stream of its device: the copy engine
works while the model's stream computes on. Pinned buffers come from torch's caching host
allocator, which hands freed buffers out again (pages are pinned once, not per capture); the
snapshot's device memory is kept from reuse until the side stream is past its copy. The index
statistics of the capture are computed there too (`stats.device_sums`), so the writer's CPU only
reads 7 numbers instead of the whole capture.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from hookrun.store.stats import device_sums


class HostCopier:
    """One side stream per CUDA device, for the copies of that device's captures."""

    def __init__(self):
        self.streams: Dict[int, "torch.cuda.Stream"] = {}

    def to_host(self, t: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor], "torch.cuda.Event"]:
        """Start copying CUDA tensor `t` and its `device_sums` (None if empty) to pinned host memory; the event
        marks the end of both."""
        side = self.streams.get(t.device.index)
        if side is None:
            side = self.streams[t.device.index] = torch.cuda.Stream(device=t.device)
        snapshot = t.detach().clone(memory_format=torch.contiguous_format)  # on the model's stream
        side.wait_stream(torch.cuda.current_stream(t.device))  # the snapshot is taken before it is copied
        with torch.cuda.stream(side):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(snapshot, non_blocking=True)
            sums = device_sums(snapshot)
            if sums is not None:
                sums = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True).copy_(sums, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        snapshot.record_stream(side)  # freed by the allocator only once the side stream is past the copy
        return host, sums, event
