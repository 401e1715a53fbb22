"""The hand-off between hooks and the writer: a queue with a byte budget and one writer thread.

    queue = WriteQueue(handle, budget_bytes, thread=True)
    queue.put(item, nbytes)    # waits while the queue is over budget (backpressure on the hooks)
    queue.wait()               # returns once every item queued so far is handled (or one failed)
    queue.close()              # stops the thread, then drains the queue in the caller
    queue.error                # the first exception `handle` raised (later items are then skipped)

With `thread=False` (store.writer=sync) `put` calls `handle` itself, inside the hook.
"""
from __future__ import annotations

import collections
import os
import threading
from typing import Callable, Optional


class WriteQueue:
    """Items in arrival order, handled one at a time off the run's thread."""

    def __init__(self, handle: Callable, budget_bytes: int, thread: bool = True):
        self.handle = handle
        self.budget = budget_bytes
        self.items: collections.deque = collections.deque()  # (item, nbytes)
        self.queued_bytes = 0
        self.peak_queued_bytes = 0
        self.error: Optional[BaseException] = None
        self.cond = threading.Condition()
        self.closing = False
        self.busy = False  # the thread is handling an item (close waits for it, then handles the rest itself)
        self.thread = None
        if thread:
            self.thread = threading.Thread(target=self._loop, name="hookrun-writer", daemon=True)
            self.thread.start()

    def put(self, item, nbytes: int) -> None:
        """Queue an item (or handle it now without a thread); raises nothing itself: callers check `error`."""
        if self.thread is None:
            self.handle(item)
            return
        with self.cond:
            while self.items and self.queued_bytes + nbytes > self.budget and self.error is None:
                self.cond.wait(0.1)
            if self.error is not None:
                return
            self.items.append((item, nbytes))
            self.queued_bytes += nbytes
            self.peak_queued_bytes = max(self.peak_queued_bytes, self.queued_bytes)
            self.cond.notify_all()

    def wait(self) -> None:
        """Return once every item queued so far has been handled (or one failed): what a caller that must know
        they are written (a batch committed before a checkpoint of the next) waits for."""
        if self.thread is None:
            return
        with self.cond:
            while (self.items or self.busy) and self.error is None:
                self.cond.wait(0.1)

    def close(self) -> None:
        """Stop the thread once the item it is handling (if any) is done, then handle what is left here, in order:
        the close does not wait for a thread of lower priority to be scheduled (a busy machine may not run it for a
        while) beyond the item it holds."""
        if self.thread is None:
            return
        with self.cond:
            self.closing = True
            self.cond.notify_all()
            while self.busy:
                self.cond.wait()
        while self.items:
            item, nbytes = self.items.popleft()
            self.queued_bytes -= nbytes
            if self.error is None:
                try:
                    self.handle(item)
                except BaseException as err:  # noqa: BLE001 - as the thread hands it over
                    self.error = err

    def _loop(self) -> None:
        try:  # a lower priority than the model's threads: torch's OpenMP barriers stall when a core is taken
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            with self.cond:
                while not self.items and not self.closing:
                    self.cond.wait()
                if self.closing or not self.items:  # the rest is the closing thread's
                    return
                item, nbytes = self.items[0]
                self.busy = True
            try:
                if self.error is None:
                    self.handle(item)
            except BaseException as err:  # noqa: BLE001 - handed to the run thread
                self.error = err
            with self.cond:
                self.items.popleft()
                self.queued_bytes -= nbytes
                self.busy = False
                self.cond.notify_all()
