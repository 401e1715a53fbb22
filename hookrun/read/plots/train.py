"""Pictures of dictionary training (the `train:` block): one run's curves, and a sweep's sparsity frontier.

    from hookrun.read.plots import train as plots
    plots.curves(cap)                                  # per site: MSE, L0, dead fraction, lr against the step
    plots.frontier(hookrun.collect(SWEEP_DIR, with_index=False))   # L0 vs variance explained (and CE recovered)

Read from the store's tables and columns alone (no torch): the `train` table (a row a site and step) and the
`train.*` columns hookrun.collect gives, one row a job.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

CURVES = "train"   # the side table of hookrun.methods.training (a row a site and step)
_NOT_SWEPT = {"job", "run_dir", "status", "reason", "store.path"}
FINAL = ("l0", "mse", "explained_variance", "fvu", "dead_features", "dense_features", "ce_loss_recovered", "steps")


def _final(column: str) -> bool:
    """Whether a collect() column is a train run's final number (train.l0, train.mse@blocks.1, ...)."""
    return column.startswith("train.") and column[6:].split("@")[0] in FINAL


def curves(cap) -> Figure:
    """A run's training curves: MSE (log), L0, the dead fraction and the lr against the step, a line a site."""
    table = cap.table(CURVES)
    fig = Figure(figsize=(13, 3.2))
    axes = fig.subplots(1, 4)
    for site, rows in table.groupby("site", sort=False):
        for ax, column in zip(axes, ("mse", "l0", "dead_fraction", "lr")):
            ax.plot(rows["step"], rows[column], label=str(site))
    for ax, (title, label) in zip(axes, [("reconstruction error", "MSE (summed over d)"), ("sparsity", "L0"),
                                         ("dead features", "fraction dead"), ("learning rate", "lr")]):
        ax.set(title=title, xlabel="step", ylabel=label)
    axes[0].set_yscale("log")
    if table["site"].nunique() > 1:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _swept(sweep: pd.DataFrame) -> List[str]:
    """The override columns that differ between jobs."""
    keys = [c for c in sweep.columns if c not in _NOT_SWEPT and not _final(c)]
    return [c for c in keys if sweep[c].astype(str).nunique() > 1]


def frontier(sweep: pd.DataFrame, sites: Optional[str] = None) -> Figure:
    """A sweep's dictionaries on the sparsity frontier: L0 against variance explained (and against CE loss
    recovered where the runs measured it), a point a job, labelled by what it swept."""
    l0, ev, ce = (f"train.{n}{sites or ''}" for n in ("l0", "explained_variance", "ce_loss_recovered"))
    jobs = sweep.drop_duplicates("job") if "job" in sweep.columns else sweep
    jobs = jobs[jobs[l0].notna()] if l0 in jobs.columns else jobs.iloc[:0]
    if not len(jobs):
        raise KeyError("no job of the sweep has train.* columns (a train run's final numbers)")
    panels = [(ev, "fraction of variance explained")]
    if ce in jobs.columns and jobs[ce].notna().any():
        panels.append((ce, "CE loss recovered"))
    swept = _swept(jobs)
    fig = Figure(figsize=(5.6 * len(panels), 4.2))
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (column, label) in zip(axes, panels):
        ax.scatter(jobs[l0], jobs[column], color="tab:blue")
        for _, job in jobs.iterrows():
            text = ", ".join(f"{k.split('.')[-1]}={job[k]}" for k in swept) or str(job.get("job", ""))
            ax.annotate(text, (job[l0], job[column]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="L0 (features on per token)", ylabel=label, title=f"{label} against L0, a point a job")
        if jobs[l0].min() > 0 and jobs[l0].max() / jobs[l0].min() > 10:
            ax.set_xscale("log")
    fig.tight_layout()
    return fig
