"""The end-of-run summary: what was stored (one line per array) and where the time went.

    captures: outputs/.../captures.zarr
    hook  layer role  calls shape         dtype   raw_bytes stored_bytes
    fmaps conv1 output    1 [1, 2, 2, 2] float32        32          710
    1 sample; 0.00 MB raw, 0.00 MB stored: stored is 22.2x larger than raw (each array's metadata and ...)
    wall 0.05 s: loop 0.04 s (forward 0.001 s, backward 0.000 s, hooks 0.002 s, patching 0.03 s) + closing the
    store 0.01 s;
    writer thread busy 0.003 s in the background, overlapping the loop
    start-up 4.2 s: from the command's start to the first batch (imports, config, model, data and store)

`shape` is what `cap.load(..., call=c)` returns for one call; `calls` > 1 for a reused module. Each method's own
passes (its per-batch measure: a grid's patched forwards, a circuit's scores and evaluations) have their line in the
loop's parentheses, by the method's config key.
"""
from __future__ import annotations

import pandas as pd


def compression(raw: int, stored: int) -> str:
    """How stored bytes compare with raw bytes, in words that cannot be misread."""
    if not raw or not stored:
        return "nothing stored"
    if stored <= raw and raw / stored >= 1.05:
        return f"stored/raw: {raw / stored:.1f}x smaller"
    if stored / raw < 1.05:
        return f"stored within 5% of raw ({100 * (stored - raw) / raw:+.1f}%: not compressed; checksums and metadata)"
    return (f"stored is {stored / raw:.1f}x larger than raw (each array's metadata and chunk headers "
            "outweigh tiny captures)")


def text(path, arrays: list, timing: dict, samples, writer: str) -> str:
    """The summary logged at the end of a run (see the module docstring); `samples`: a count, or words that
    start with one ("144 samples in the store (48 run now, 96 before the resume)")."""
    counted = f"{samples} sample{'' if samples == 1 else 's'}" if isinstance(samples, int) else samples
    table = pd.DataFrame(arrays)
    raw = int(table.raw_bytes.sum()) if len(table) else 0
    stored = int(table.stored_bytes.sum()) if len(table) else 0
    closing = max(timing["wall_s"] - timing["loop_s"], 0.0)
    methods = "".join(f", {key} {spent:.3f} s" for key, spent in timing.get("methods_s", {}).items())  # their passes
    if writer == "thread":
        writing = (f"writer thread busy {timing['write_s']:.3f} s in the background, overlapping the loop "
                   "(and the close)")
    else:
        writing = f"writing {timing['write_s']:.3f} s inside the hooks (sync writer)"
    return "\n".join([
        f"captures: {path}",
        table.to_string(index=False) if len(table) else "(nothing captured)",
        f"{counted}; {raw / 2**20:.2f} MB raw, {stored / 2**20:.2f} MB stored: {compression(raw, stored)}",
        f"wall {timing['wall_s']:.3f} s: loop {timing['loop_s']:.3f} s (forward {timing['forward_s']:.3f} s, "
        f"backward {timing['backward_s']:.3f} s, hooks {timing['capture_s']:.3f} s{methods}) + closing the store "
        f"{closing:.3f} s; {writing}"] + ([f"start-up {timing['startup_s']:.1f} s: from the command's start to the "
                                         "first batch (imports, config, model, data and store)"]
                                        if timing.get("startup_s") is not None else []))
