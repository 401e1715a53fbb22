"""Colour scales: signed data in a diverging map centred at 0, unsigned data in a sequential one."""
from __future__ import annotations

import numpy as np

DIVERGING, SEQUENTIAL = "RdBu_r", "viridis"


def scale(data) -> dict:
    """imshow's cmap, vmin and vmax for `data`: RdBu_r from -m to m (m = the largest |value|) when any value is
    negative, else viridis from the smallest to the largest value. NaN and inf are left out."""
    data = np.asarray(data, dtype=np.float64)
    finite = data[np.isfinite(data)]
    if not finite.size:
        return dict(cmap=SEQUENTIAL, vmin=0.0, vmax=1.0)
    lo, hi = float(finite.min()), float(finite.max())
    if lo < 0:
        bound = max(-lo, hi) or 1.0
        return dict(cmap=DIVERGING, vmin=-bound, vmax=bound)
    return dict(cmap=SEQUENTIAL, vmin=lo, vmax=hi if hi > lo else lo + 1.0)
