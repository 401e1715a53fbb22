"""The reader of a training run (a `train:` block), with no torch: its curves, its evaluations and the last
evaluation of each site, from the run's side tables.

    cap.read("train")                  # a row per site and step: loss, mse, aux, l0, dead_fraction, lr, ...
    cap.read("train", "evaluations")   # a row per site and evaluation; "final": each site's last
"""
from __future__ import annotations

import pandas as pd

CURVES, EVALS = "train", "train_eval"   # the side tables: a row per site and step / per site and evaluation


def read(cap, what: str = "curves") -> pd.DataFrame:
    """cap.read("train"): the curves (a row per site and step); "evaluations": a row per site and evaluation;
    "final": the last evaluation of each site."""
    name = {"curves": CURVES, "evaluations": EVALS, "final": EVALS}.get(what)
    if name is None:
        raise ValueError(f"cap.read('train', {what!r}): give curves, evaluations or final")
    if "train" not in cap.attrs:
        raise KeyError(f"{cap.path} holds no training: its run had no train block (cap.read('train') reads the "
                       "curves of a run that had one)")
    table = cap.table(name)
    if what == "final":
        return table.sort_values("step").groupby("site", sort=False).tail(1).reset_index(drop=True)
    return table.reset_index(drop=True)
