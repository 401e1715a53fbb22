"""A patching run's grid as stored (hookrun.run.measure): scores [samples, layers, positions | heads] with its axes.

    g = cap.grid()          # PatchGrid: scores, source, target, layers, axis, labels
    g.normalised()          # (scores - target) / (source - target): 1 = the site restores the source's metric
    g.to_frame()            # one row a (sample, layer, position | head): score, normalised
    g.to_xarray()           # an xarray.DataArray with dims sample, layer, position | head (needs xarray)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import pandas as pd

from hookrun.format.layout import PATCHING, PATCHING_ATTR, array_key


@dataclass
class PatchGrid:
    """The grid's metric with one site patched (`scores`, NaN past a sample's end), the unpatched source and
    target runs' metric (`source`, `target` [samples]), and the axes: `layers`, `axis` (position | head) and
    `labels` (the positions, counted over real tokens, or the heads). `samples` numbers the rows as cap.samples."""

    scores: np.ndarray
    source: np.ndarray
    target: np.ndarray
    layers: List[str]
    axis: str
    labels: List[int]
    samples: np.ndarray
    metric: str
    roles: tuple  # (source role, target role)

    def normalised(self) -> np.ndarray:
        """(scores - target) / (source - target) per sample: 0 = no effect, 1 = the source's metric restored."""
        return (self.scores - self.target[:, None, None]) / (self.source - self.target)[:, None, None]

    def to_frame(self) -> pd.DataFrame:
        """A tidy view: one row a (sample, layer, position | head) with score and normalised."""
        idx = pd.MultiIndex.from_product([self.samples, self.layers, self.labels], names=["sample", "layer", self.axis])
        return pd.DataFrame({"score": self.scores.reshape(-1), "normalised": self.normalised().reshape(-1)},
                            index=idx).reset_index()

    def to_xarray(self):
        """An xarray.DataArray of the scores, dims (sample, layer, position | head), with source and target."""
        import xarray as xr

        return xr.DataArray(self.scores, dims=("sample", "layer", self.axis),
                            coords={"sample": self.samples, "layer": self.layers, self.axis: self.labels,
                                    "source": ("sample", self.source), "target": ("sample", self.target)},
                            name=self.metric)


def load_grid(cap, metric: Optional[str] = None) -> PatchGrid:
    """The grid of a patching run (KeyError for a run without one)."""
    attrs = cap.attrs.get(PATCHING_ATTR)
    if attrs is None or (metric is not None and metric != attrs["metric"]):
        raise KeyError(f"{cap.path} has no patching grid{'' if metric is None else f' of {metric!r}'}; a run with a "
                       "patching: block stores one")
    name = attrs["metric"]
    load = lambda role: cap.load(hook=PATCHING, layer=name, role=role)  # noqa: E731
    samples = cap.samples["sample"].to_numpy() if len(cap.samples) else np.arange(0)
    assert attrs["key"] == array_key(PATCHING, name, "scores")
    return PatchGrid(load("scores"), load("source"), load("target"), list(attrs["layers"]), attrs["axis"],
                     list(attrs["labels"]), samples, name, (attrs["source"], attrs["target"]))
