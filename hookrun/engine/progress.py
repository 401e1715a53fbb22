"""Where a run is, for whoever watches: a progress bar on a terminal or in Jupyter (tqdm's notebook bar where
ipywidgets is installed), and a log line every `progress_s` seconds when stderr is neither (`| tee`, nohup, SLURM
logs), so a long run is never silent until its end.

    progress = Progress(batches, total=40, initial=0, every_s=30, show=rank == 0)
    for batch in progress:
        ...
        progress.update(batch_number, samples, tokens, captured_bytes)
    # log: progress: batch 12/40 (30%), 96 samples, 1,840 tokens/s, 3.1 MB/s, ETA 0:01:05
"""
from __future__ import annotations

import datetime
import importlib.util
import logging
import sys
import time
import warnings
from typing import Dict, Iterable, Optional

from tqdm import tqdm

log = logging.getLogger("hookrun")


class Progress:
    """A tqdm bar over `batches` on a terminal; log lines every `every_s` seconds elsewhere (0: none)."""

    def __init__(self, batches: Iterable, total: Optional[int], initial: int, every_s: float, show: bool = True):
        self.terminal = sys.stderr.isatty() or in_notebook()
        self.bar = _notebook_bar()(batches, desc="hookrun", unit="batch", total=total, initial=initial,
                        disable=not (show and self.terminal), dynamic_ncols=True)
        self.total, self.initial = total, initial
        self.every_s = every_s if show and not self.terminal else 0
        self.started = self.last = time.perf_counter()

    def __iter__(self):
        return iter(self.bar)

    def update(self, done: int, samples: int, tokens: int, captured_bytes: int,
               methods_s: Optional[Dict[str, float]] = None) -> None:
        """After a batch: `done` batches finished in all, `samples`, `tokens` and `captured_bytes` of this run, and
        the seconds each method's own passes took so far (`methods_s`: {"circuit": 12.5})."""
        now = time.perf_counter()
        elapsed = max(now - self.started, 1e-9)
        if not self.bar.disable:  # shown with the bar's next refresh (tqdm spaces them): not a redraw a batch
            rates = {"samples_s": f"{samples / elapsed:.0f}", "MB_s": f"{captured_bytes / elapsed / 2**20:.1f}"}
            if tokens:
                rates["tokens_s"] = f"{tokens / elapsed:.0f}"
            rates.update({f"{key}_s": f"{spent:.1f}" for key, spent in (methods_s or {}).items() if spent >= 0.05})
            self.bar.set_postfix(refresh=False, **rates)
        if self.every_s and now - self.last >= self.every_s:
            self.last = now
            log.info("progress: %s", self.line(done, samples, tokens, captured_bytes, elapsed, methods_s))

    def line(self, done: int, samples: int, tokens: int, captured_bytes: int, elapsed: float,
             methods_s: Optional[Dict[str, float]] = None) -> str:
        """`batch 12/40 (30%), 96 samples, 1,840 tokens/s, 3.1 MB/s, circuit 41.0 s, ETA 0:01:05` (what is known
        of it; each method's own passes where they took 0.05 s or more)."""
        parts = [f"batch {done}/{self.total} ({100 * done / self.total:.0f}%)" if self.total else f"batch {done}",
                 f"{samples} sample{'' if samples == 1 else 's'}"]
        if tokens:
            parts.append(f"{tokens / elapsed:,.0f} tokens/s")
        parts.append(f"{captured_bytes / elapsed / 2**20:.1f} MB/s")
        parts += [f"{key} {spent:.1f} s" for key, spent in (methods_s or {}).items() if spent >= 0.05]
        ran = done - self.initial
        if self.total and ran > 0:
            eta = (self.total - done) * elapsed / ran
            parts.append(f"ETA {datetime.timedelta(seconds=round(eta))}")
        return ", ".join(parts)

    def close(self) -> None:
        self.bar.close()


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (an IPython shell talking to a notebook front end)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _notebook_bar():
    """tqdm's notebook bar in Jupyter where ipywidgets is installed, else the text bar (Jupyter draws it too)."""
    if not in_notebook() or importlib.util.find_spec("ipywidgets") is None:
        return tqdm  # without ipywidgets tqdm's notebook bar warns "IProgress not found" when it is made
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from tqdm.auto import tqdm as auto
    return auto
