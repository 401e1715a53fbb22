"""Per-capture statistics for the index: mean, std, min, max, L2 norm, nan and inf counts.

    stats(a)                          # a numpy array, in the writer (one thread)
    sums = device_sums(t)             # a tensor, on its own device, without waiting for it
    stats_from_sums(sums.tolist(), n) # the same dict as stats(a), once the sums are on the host

A CUDA capture's statistics are computed on the GPU beside its copy to the host, so the writer's
CPU does not read it a second time; both ways give the same values (to float rounding).
Statistics leave NaN and inf out and count them (`norm` is the L2 norm of the finite values: sqrt of their
sum of squares, over the whole captured tensor of a batch). A complex capture's statistics cover its real and
imaginary parts together (each part one value; nan/inf count values, numel counts complex elements).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch


def _empty(nan: int = 0, inf: int = 0, numel: int = 0) -> dict:
    """The statistics of a capture without a finite value: NaN, and the counts."""
    return dict(mean=np.nan, std=np.nan, min=np.nan, max=np.nan, norm=np.nan, nan_count=nan, inf_count=inf,
                numel=numel)


# values in a block of `stats` (256 KB of float32, within L2): read from memory once, then from the cache; float32
# sums of squares over more values lose digits (BLAS dot products accumulate in float32)
BLOCK = 1 << 16


def stats(a: np.ndarray) -> dict:
    """Per-capture statistics for the index: mean, std, min, max, L2 norm, nan and inf counts (numpy, one thread).

        stats(rows)   # {"mean": ..., "std": ..., "min": ..., "max": ..., "norm": ..., "nan_count": 0, ...}
    """
    n = a.size
    if n == 0:
        return _empty()
    flat = a.reshape(-1)
    if flat.dtype.kind == "c":
        flat = flat.view(flat.real.dtype)  # real and imaginary parts, interleaved
    if flat.dtype.kind != "f" or flat.dtype.itemsize < 4:
        flat = flat.astype(np.float32)
    lo, hi, total, squares = _sums(flat)
    nan = inf = 0
    if not (math.isfinite(lo) and math.isfinite(hi)):  # min/max propagate NaN and show inf
        finite = flat[np.isfinite(flat)]
        nan = int(np.count_nonzero(np.isnan(flat)))
        inf = flat.size - finite.size - nan
        flat = finite
        if not flat.size:
            return _empty(nan, inf, n)
        lo, hi, total, squares = _sums(flat)
    mean, squares = total / flat.size, squares / flat.size
    return dict(mean=mean, std=_std(flat, mean, squares), min=float(lo), max=float(hi),
                norm=(squares * flat.size) ** 0.5, nan_count=nan, inf_count=inf, numel=n)


def _sums(flat: np.ndarray) -> tuple:
    """(min, max, sum, sum of squares) of a 1-D float array in one pass over BLOCK-value blocks (each block's four
    reductions read it from the cache, not from memory: ~35% less CPU than four passes over a capture), the sums
    within a block by einsum (SIMD lanes of float32 partial sums, 2x as fast as add.reduce's pairwise loop; the
    block's size bounds their rounding) and in float64 across blocks; a block with values beyond 1e16 squared in
    float64 (its float32 sums of squares would overflow: masks of -3e38, exploding gradients). NaN or inf propagate
    to min/max."""
    lo, hi, total, squares = math.inf, -math.inf, 0.0, 0.0
    low, high, add, dot = np.minimum.reduce, np.maximum.reduce, np.einsum, np.dot
    for i in range(0, flat.size, BLOCK):
        block = flat[i:i + BLOCK]
        b_lo, b_hi = float(low(block)), float(high(block))
        if b_lo < lo or b_lo != b_lo:  # a NaN is kept (it fails every later comparison)
            lo = b_lo
        if b_hi > hi or b_hi != b_hi:
            hi = b_hi
        if block.dtype.itemsize == 4 and max(-b_lo, b_hi) > 1e16:
            block = block.astype(np.float64)
        total += float(add("i->", block))
        squares += float(dot(block, block))
    return lo, hi, total, squares


def _std(flat: np.ndarray, mean: float, sq: float) -> float:
    """sqrt(E[x^2] - mean^2) from the mean square `sq`; falls back to the two-pass formula where the
    subtraction would cancel."""
    var = sq - mean * mean
    if var <= 1e-3 * mean * mean:  # two passes in float64, as flat.std(dtype=float64) (its Python steps: ~10 us)
        deviations = flat.astype(np.float64)
        deviations -= float(np.add.reduce(deviations)) / flat.size
        return (float(np.dot(deviations, deviations)) / flat.size) ** 0.5
    return var ** 0.5


def device_sums(t: torch.Tensor) -> Optional[torch.Tensor]:
    """[nan count, inf count, finite count, min, max, sum, sum of squared deviations] of `t` (finite values
    only) as float64 on t's device, queued without a sync; None for an empty tensor."""
    if t.numel() == 0:
        return None
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)  # real and imaginary parts, as `stats` counts them
    if not x.is_floating_point() or x.element_size() < 4:
        x = x.float()  # as `stats` computes half precision and integers
    finite = torch.isfinite(x)
    count = finite.sum()
    nan = torch.isnan(x).sum()
    inf = x.numel() - count - nan
    kept = torch.where(finite, x, 0)
    total = kept.sum(dtype=torch.float64)
    exact_mean = total / count.clamp(min=1)
    mean = exact_mean.to(x.dtype)  # deviations in the capture's precision: no float64 copy of it on the device
    lo = torch.where(finite, x, torch.inf).amin()
    hi = torch.where(finite, x, -torch.inf).amax()
    # values beyond 2^60 (masks of -3e38) are scaled by 2^-100 (exact) so that their squares do not overflow
    scale = torch.where(torch.maximum(-lo, hi) > 2.0**60, 2.0**100, 1.0).to(torch.float64)
    deviations = torch.where(finite, kept - mean, 0) / scale.to(x.dtype)
    squares = (deviations * deviations).sum(dtype=torch.float64) * scale**2 - count * (exact_mean - mean.double()) ** 2
    return torch.stack([nan.double(), inf.double(), count.double(), lo.double(), hi.double(), total, squares])


def stats_from_sums(sums: Sequence[float], numel: int) -> dict:
    """The `stats` dict from the values of `device_sums`."""
    nan, inf, count, lo, hi, total, squares = sums
    if not count:
        return _empty(int(nan), int(inf), numel)
    # sum of x^2 = sum of (x - mean)^2 + count * mean^2: the norm from the same sums, no second pass on the device
    return dict(mean=total / count, std=(max(squares, 0.0) / count) ** 0.5, min=lo, max=hi,
                norm=(max(squares, 0.0) + total * total / count) ** 0.5, nan_count=int(nan), inf_count=int(inf),
                numel=numel)
