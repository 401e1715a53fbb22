"""Checks of a reader's arguments, raised with the argument, its value and the valid range (what a bare numpy error
would leave the user to decode): used by Captures and by the readers of methods' results (hookrun.read.results).

    check_index("top", "unit", unit, 32, "the array has 32 units"); check_count("top", "k", k)
    warn_nonfinite("cap.read('lens')", {"_lens/dist/kl": kl})    # a RuntimeWarning where NaN or inf was stored
"""
from __future__ import annotations

import warnings

import numpy as np


def warn_nonfinite(reader: str, arrays: dict, cause: str = "a degenerate metric or a non-finite value the "
                   "first-batch check let through") -> None:
    """A RuntimeWarning naming each stored array (name -> array, None skipped) that holds NaN or inf: those values
    read back as NaN or inf, never as an error. Usage: warn_nonfinite("cap.grid()", {"ld (source)": source})."""
    for name, values in arrays.items():
        if values is None or not np.issubdtype(np.asarray(values).dtype, np.floating):
            continue
        bad = int((~np.isfinite(values)).sum())
        if bad:
            warnings.warn(f"{reader}: {name} holds {bad} NaN or inf value(s) of {np.size(values)} ({cause}); they read "
                          f"back as they were stored", RuntimeWarning, stacklevel=3)


def check_index(call: str, arg: str, value, n: int, what: str) -> None:
    """IndexError naming a reader's argument, its value and the valid range, for an index past `n` (what a bare
    numpy IndexError would leave the user to decode). Usage: check_index("top", "unit", unit, 32, "... 32 units")."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{call}({arg}={value!r}): {arg} must be an integer in 0..{n - 1} ({what})")
    if not -n <= value < n:
        raise IndexError(f"{call}({arg}={value}): out of range: {what}; give {arg} in 0..{n - 1} (or -{n}..-1 from "
                         "the end)" if n else f"{call}({arg}={value}): out of range: {what}, none to choose from")


def check_count(call: str, arg: str, value) -> None:
    """ValueError for a count that would give an empty result (k=0): the result would say nothing."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{call}({arg}={value!r}): {arg} must be an integer >= 1 (how many rows to return)")
