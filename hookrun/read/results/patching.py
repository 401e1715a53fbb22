"""The readers of grids: a patching run's (cap.grid(), cap.read("patching")) and an attribution run's
(cap.read("attribution")), both a PatchGrid. Needs numpy and pandas, not torch.

    grid = cap.grid(); grid.change().mean(0); grid.normalised(); grid.to_frame(); grid.top(5)
    est = cap.read("attribution"); est.verified(); est.corr(exact_cap.grid())
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from hookrun.format.layout import ATTRIBUTION, ATTRIBUTION_ATTR, PATCHING, PATCHING_ATTR, array_key
from hookrun.read.checks import warn_nonfinite


@dataclass(repr=False)
class PatchGrid:
    """The grid's metric with one site patched (`scores`, NaN past a sample's end), the unpatched source and
    target runs' metric (`source`, `target` [samples]), and the axes: `layers`, `axis` (position | head) and
    `labels` (the positions, counted over real tokens, or the heads). `samples` numbers the rows as cap.samples.
    A per-position heads grid (sites.per_position) has one more axis: scores [samples, layers, heads, positions],
    `positions` its labels (None for the two-axis grids).

        grid = cap.grid(); grid                 # a short summary: shape, axes, baselines, the top sites
        grid.change().mean(0)                   # layers x sites: the change from the unpatched target run
        grid.normalised()                       # 1 = the source's metric restored (NaN where source == target)

    An ablation (source and target the same prompts, e.g. donor zero with source = target) has source == target:
    read it with change() (the change from the unablated run); normalised() is NaN there (0 / 0), never inf.

    An attribution grid (cap.read("attribution"), load_attribution) is this type too: `method` is gradient
    or integrated_gradients, `scores` = target + the estimated change (so change() is the estimate), and `exact`
    holds the exact patched metric at the verified sites (NaN elsewhere): `grid.verified()`, `grid.corr(exact)`."""

    scores: np.ndarray
    source: np.ndarray
    target: np.ndarray
    layers: List[str]
    axis: str
    labels: List[int]
    samples: np.ndarray
    metric: str
    roles: tuple  # (source role, target role)
    donor: str = "same"  # patching.donor: same | mean | resample | zero
    method: str = "patching"  # patching (exact) | gradient | integrated_gradients (an attribution estimate)
    exact: Optional[np.ndarray] = None  # an attribution grid's verified sites: the exact patched metric, NaN elsewhere
    positions: Optional[List[int]] = None  # per_position: the labels of the last axis (after the heads)

    @property
    def axes(self) -> List[Tuple[str, list]]:
        """The site axes after the layers as (name, labels): [(axis, labels)], then ("position", positions) for a
        per-position heads grid."""
        extra = [] if self.positions is None else [("position", list(self.positions))]
        return [(self.axis, list(self.labels))] + extra

    def _per_sample(self, values: np.ndarray) -> np.ndarray:
        """[samples] -> broadcastable against scores."""
        return values.reshape(-1, *[1] * (self.scores.ndim - 1))

    @property
    def ablation(self) -> bool:
        """Whether the sites are ablated in the very run they are taken from (source and target the same role)."""
        return self.roles[0] == self.roles[1]

    def change(self) -> np.ndarray:
        """scores - target per sample: the change of the metric from the unpatched (for an ablation: unablated)
        target run; 0 = the site has no effect."""
        return self.scores - self._per_sample(self.target)

    def normalised(self) -> np.ndarray:
        """(scores - target) / (source - target) per sample: 0 = no effect, 1 = the source's metric restored.
        NaN for a sample whose source and target metrics are equal (every sample of an ablation, where source
        and target are one run: use change()), and past a sample's end; no division warning."""
        gap = self._per_sample(self.source - self.target)
        out = np.full(np.broadcast_shapes(self.scores.shape, gap.shape), np.nan, dtype=np.float64)
        return np.divide(self.change(), gap, out=out, where=gap != 0)

    def to_frame(self) -> pd.DataFrame:
        """A tidy view: one row a (sample, layer, position | head[, position]) with score, change (score - target)
        and normalised (NaN where source == target, as in an ablation: see normalised())."""
        idx = pd.MultiIndex.from_product([self.samples, self.layers, *[labels for _, labels in self.axes]],
                                         names=["sample", "layer", *[name for name, _ in self.axes]])
        return pd.DataFrame({"score": self.scores.reshape(-1), "normalised": self.normalised().reshape(-1),
                             "change": self.change().reshape(-1)}, index=idx).reset_index()

    def to_xarray(self):
        """An xarray.DataArray of the scores, dims (sample, layer, position | head[, position]), with source and
        target."""
        import xarray as xr

        return xr.DataArray(self.scores, dims=("sample", "layer", *[name for name, _ in self.axes]),
                            coords={"sample": self.samples, "layer": self.layers, **dict(self.axes),
                                    "source": ("sample", self.source), "target": ("sample", self.target)},
                            name=self.metric)

    def corr(self, other: "PatchGrid", mean: bool = False) -> float:
        """Pearson's r of this grid's change() and another's over the same sites (layers and labels), over every
        (sample, layer, site) cell finite in both, or (mean=True) over the sites' means over samples.

            cap.read("attribution").corr(exact_cap.grid())   # how well the estimate tracks exact patching"""
        if (self.layers, self.axes) != (other.layers, other.axes):
            raise ValueError(f"corr: the grids' sites differ ({len(self.layers)} layers x {_axes_words(self)} against "
                             f"{len(other.layers)} layers x {_axes_words(other)}); compare grids over the same layers "
                             "and positions | heads")
        a, b = self.change(), other.change()
        if mean:
            with np.errstate(all="ignore"):
                a, b = _nanmean0(a), _nanmean0(b)
        elif a.shape != b.shape:
            raise ValueError(f"corr: {a.shape[0]} samples against {b.shape[0]}; give runs over the same samples, or "
                             "mean=True")
        keep = np.isfinite(a) & np.isfinite(b)
        return float(np.corrcoef(a[keep], b[keep])[0, 1])

    def verified(self) -> pd.DataFrame:
        """An attribution grid's verified sites (the K largest estimates of each batch, patched exactly): layer,
        position | head | neuron (and position, per_position), samples (how many were verified there), estimate and
        exact (their mean change over those samples) and error (estimate - exact)."""
        columns = ["layer", *[name for name, _ in self.axes], "samples", "estimate", "exact", "error"]
        if self.exact is None:
            return pd.DataFrame(columns=columns)
        done = np.isfinite(self.exact)
        rows = []
        for cell in np.argwhere(done.any(0)):
            at = done[(slice(None), *cell)]
            est = float(np.mean(self.change()[(at, *cell)]))
            ex = float(np.mean(self.exact[(at, *cell)] - self.target[at]))
            sites = {name: labels[i] for (name, labels), i in zip(self.axes, cell[1:])}
            rows.append({"layer": self.layers[cell[0]], **sites, "samples": int(at.sum()), "estimate": est,
                         "exact": ex, "error": est - ex})
        return pd.DataFrame(rows, columns=columns)

    def top(self, k: int = 5) -> pd.DataFrame:
        """The k sites whose mean change over samples is largest in size: layer, position | head (and position,
        per_position), change (signed), normalised (the mean over samples; NaN for an ablation)."""
        with np.errstate(all="ignore"):
            change = _nanmean0(self.change())
            norm = _nanmean0(self.normalised())
        flat = np.where(np.isnan(change), -np.inf, np.abs(change)).ravel()
        order = np.argsort(-flat, kind="stable")[:k]
        order = order[np.isfinite(flat[order])]
        cells = np.unravel_index(order, change.shape)
        sites = {name: [labels[i] for i in at] for (name, labels), at in zip(self.axes, cells[1:])}
        return pd.DataFrame({"layer": [self.layers[i] for i in cells[0]], **sites, "change": change[cells],
                             "normalised": norm[cells]})

    def _summary(self) -> tuple:
        """(head line, baseline line, top sites) of the repr."""
        kind = f"ablation of {self.roles[1]} (donor {self.donor})" if self.ablation else \
            f"{self.roles[0]} -> {self.roles[1]}" + (f" (donor {self.donor})" if self.donor != "same" else "")
        kind += "" if self.method == "patching" else f", attribution estimate ({self.method})"
        head = f"PatchGrid {self.metric}: {kind}, {len(self.scores)} samples x {len(self.layers)} layers x " + \
            _axes_words(self, counts=True)
        base = f"unablated {self.metric}: mean {_finite_mean(self.target):.4g}" if self.ablation else \
            f"{self.metric} unpatched: {self.roles[0]} mean {_finite_mean(self.source):.4g}, {self.roles[1]} mean " \
            f"{_finite_mean(self.target):.4g}"
        return head, base, self.top(5)

    def __repr__(self) -> str:
        head, base, top = self._summary()
        lines = [head, f"  layers: {_short(self.layers)}",
                 *[f"  {name}s: {_short(labels)}" for name, labels in self.axes], f"  {base}",
                 "  top sites (mean change from the unpatched target" + (")" if self.ablation else "; normalised)")]
        for r in top.itertuples(index=False):
            norm = "" if self.ablation or np.isnan(r.normalised) else f"  normalised {r.normalised:+.3f}"
            site = " ".join(f"{name} {r[1 + i]}" for i, (name, _) in enumerate(self.axes))
            lines.append(f"    {r.layer} {site}: {r.change:+.4g}{norm}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        head, base, top = self._summary()
        if self.ablation:
            top = top.drop(columns="normalised")
        table = top.to_html(index=False, float_format=lambda v: f"{v:+.4g}", border=0)
        axes = "".join(f"{name}s: {html.escape(_short(labels))}<br>" for name, labels in self.axes)
        return (f"<div><b>{html.escape(head)}</b><br>layers: {html.escape(_short(self.layers))}<br>"
                f"{axes}{html.escape(base)}<br>"
                f"top sites (mean change from the unpatched target):{table}</div>")


def _axes_words(grid: PatchGrid, counts: bool = False) -> str:
    """A grid's site axes in words: "[0, 1] heads x [0, 1, 2] positions" (counts: "2 heads x 3 positions")."""
    return " x ".join(f"{len(labels) if counts else labels} {name}s" for name, labels in grid.axes)


def _nanmean0(values: np.ndarray) -> np.ndarray:
    """The mean over axis 0 leaving NaN out, NaN (no warning) where a column holds only NaN."""
    count = (~np.isnan(values)).sum(0)
    total = np.nansum(values, axis=0)
    return np.divide(total, count, out=np.full(total.shape, np.nan), where=count > 0)


def _finite_mean(values: np.ndarray) -> float:
    """The mean of the finite values of a summary's column (NaN where none is)."""
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def _short(items: Sequence, most: int = 8) -> str:
    """A list for a summary line: the first and last few items when long."""
    items = [str(i) for i in items]
    if len(items) <= most:
        return ", ".join(items)
    return ", ".join(items[:most // 2]) + f", ... ({len(items)} in all), " + ", ".join(items[-2:])


NAN_METRIC = "a metric of a token of probability 0, a non-finite weight"  # why a stored run's metric is NaN


def load_grid(cap, metric: Optional[str] = None) -> PatchGrid:
    """The grid of a patching run (KeyError for a run without one)."""
    attrs = cap.attrs.get(PATCHING_ATTR)
    if attrs is None and metric is None and cap.attrs.get("attribution"):  # a run with an attribution grid only
        return load_attribution(cap)
    if attrs is None or (metric is not None and metric != attrs["metric"]):
        raise KeyError(f"{cap.path} has no patching grid{'' if metric is None else f' of {metric!r}'}; a run with a "
                       "patching: block stores one")
    name = attrs["metric"]
    load = lambda role: cap.load(hook=PATCHING, layer=name, role=role)  # noqa: E731
    samples = cap.samples["sample"].to_numpy() if len(cap.samples) else np.arange(0)
    assert attrs["key"] == array_key(PATCHING, name, "scores")
    donor = str(((cap.config or {}).get("patching") or {}).get("donor") or "same")
    positions = attrs.get("positions")
    source, target = load("source"), load("target")
    warn_nonfinite("cap.grid()", {f"{name} (source run)": source, f"{name} (target run)": target}, NAN_METRIC)
    return PatchGrid(load("scores"), source, target, list(attrs["layers"]), attrs["axis"],
                     list(attrs["labels"]), samples, name, (attrs["source"], attrs["target"]), donor,
                     positions=None if positions is None else list(positions))


def load_attribution(cap, metric: Optional[str] = None) -> PatchGrid:
    """The attribution grid of a run (KeyError for a run without one), as a PatchGrid."""
    attrs = cap.attrs.get(ATTRIBUTION_ATTR)
    if attrs is None or (metric is not None and metric != attrs["metric"]):
        raise KeyError(f"{cap.path} has no attribution grid{'' if metric is None else f' of {metric!r}'}; a run with "
                       "an attribution: block stores one")
    name = attrs["metric"]
    load = lambda role: cap.load(hook=ATTRIBUTION, layer=name, role=role)  # noqa: E731
    samples = cap.samples["sample"].to_numpy() if len(cap.samples) else np.arange(0)
    exact = load("exact") if attrs.get("verify") else None
    positions = attrs.get("positions")
    source, target = load("source"), load("target")
    warn_nonfinite("cap.read('attribution')", {f"{name} (source run)": source, f"{name} (target run)": target},
                   NAN_METRIC)
    return PatchGrid(load("scores"), source, target, list(attrs["layers"]), attrs["axis"],
                     list(attrs["labels"]), samples, name, (attrs["source"], attrs["target"]),
                     attrs.get("donor", "same"), attrs["method"], exact, None if positions is None else list(positions))
