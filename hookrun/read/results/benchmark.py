"""The circuit-discovery benchmark's numbers, CPR and CMD (MIB's circuit localization track, 2025): the areas over
the faithfulness of circuits of {0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100}% of the edges, as its evaluation code
computes them (MIB_circuit_track/evaluation.py `evaluate_area_under_curve`, print_results.py); and faithfulness by
edge class.

    table = benchmark(res.circuits)       # percent, fraction, n, kept and both faithfulness curves; attrs cpr, cmd
    areas([.001, .01, 1], [0.2, 0.5, 1])  # (area under, area from 1): its trapezoids between the given points

The rules, transcribed: a circuit of p% keeps the top int(p / 100 x edges) edges (`apply_topn`, pruned): CPR from
the signed scores (`absolute=False`), CMD from |scores|; faithfulness (m_circuit - m_empty) / (m_full - m_empty) of
the means over the samples (the empty circuit evaluated, the full one the clean run); CPR the area under the signed
curve, CMD the area between the |scores| curve and 1 (|1 - f|), both trapezoids between consecutive percentages on
the fraction axis (0.001 to 1: no point at 0), the x axis the percentages asked, not the edges kept after pruning.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
import pandas as pd

PERCENT = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)  # the benchmark's circuit sizes, % of the edges
FRACTIONS = (.001, .002, .005, .01, .02, .05, .1, .2, .5, 1)  # the same as its code writes them
KINDS = ("percent_signed", "percent_abs", "percent_random")  # top by signed scores (CPR), by |scores| (CMD), random


def fraction(percent: float) -> float:
    """The fraction of the edges a circuit of `percent`% keeps (the benchmark's own literal for its ten sizes)."""
    for p, f in zip(PERCENT, FRACTIONS):
        if float(percent) == p:
            return f
    return float(percent) / 100


def size(percent: float, n_edges: int) -> int:
    """The benchmark's circuit size: int(fraction x edges), as its `curr_num_items = int(pct * n_scored_items)`."""
    return int(fraction(percent) * n_edges)


def name(percent: float, signed: bool) -> str:
    """The circuit's name in a run: `signed_1pct`, `abs_0.1pct`."""
    return f"{'signed' if signed else 'abs'}_{float(percent):g}pct"


def areas(fractions: Sequence[float], faithfulness: Sequence[float], log_scale: bool = False
          ) -> Tuple[float, float]:
    """(area under the curve, area from 1) over the points in the order given: the benchmark's loop (trapezoids
    between consecutive points; |1 - f| for the second)."""
    under = from_1 = 0.0
    for i in range(len(faithfulness) - 1):
        x_1, x_2 = fractions[i], fractions[i + 1]
        if log_scale:
            x_1, x_2 = math.log(x_1), math.log(x_2)
        from_1 += (x_2 - x_1) * ((abs(1. - faithfulness[i]) + abs(1. - faithfulness[i + 1])) / 2)
        under += (x_2 - x_1) * ((faithfulness[i] + faithfulness[i + 1]) / 2)
    return under, from_1


def benchmark(specs: Sequence[dict], means: Sequence[float]) -> Optional[pd.DataFrame]:
    """The benchmark's table of a circuit run from its stored circuit specs (the `circuit` attr's `circuits`: name,
    kind, n, edges, percent) and each circuit's mean metric: a row a percentage (percent, fraction, n, kept_signed,
    kept_abs, signed, abs: the two curves' faithfulness by the benchmark's normalisation; random: the mean of the
    random circuits of that size), `attrs` cpr, cmd (and the other areas: cpr_abs, cmd_signed, and cpr_random,
    cmd_random the random curve's, the benchmark's Random row); None for a run without select.percent."""
    where = {s["name"]: i for i, s in enumerate(specs)}
    if not any(s.get("kind") in KINDS for s in specs) or "full" not in where or "empty" not in where:
        return None
    m_full, m_empty = float(means[where["full"]]), float(means[where["empty"]])
    gap = m_full - m_empty
    rows, randoms = {}, {}
    for i, spec in enumerate(specs):
        if spec.get("kind") not in KINDS:
            continue
        p = float(spec["percent"])
        f = (float(means[i]) - m_empty) / gap if gap != 0 else float("nan")
        r = rows.setdefault(p, {"percent": p, "fraction": fraction(p), "n": int(spec["n"])})
        if spec["kind"] == "percent_random":
            randoms.setdefault(p, []).append(f)
            continue
        side = "signed" if spec["kind"] == "percent_signed" else "abs"
        r[f"kept_{side}"] = len(spec["edges"])
        r[side] = f
    for p, values in randoms.items():
        rows[p]["random"] = float(np.mean(values))
    table = pd.DataFrame(sorted(rows.values(), key=lambda r: r["fraction"]),
                         columns=["percent", "fraction", "n", "kept_signed", "kept_abs", "signed", "abs", "random"])
    x = table.fraction.tolist()
    for side in ("signed", "abs", "random"):
        f = table[side].to_numpy(float)
        under, from_1 = areas(x, f) if np.isfinite(f).all() else (float("nan"), float("nan"))
        table.attrs[{"signed": "cpr", "abs": "cpr_abs", "random": "cpr_random"}[side]] = under
        table.attrs[{"signed": "cmd_signed", "abs": "cmd", "random": "cmd_random"}[side]] = from_1
    return table


def by_class(specs: Sequence[dict], means: Sequence[float]) -> Optional[pd.DataFrame]:
    """Faithfulness by edge class of the circuits of select.by_class: a row a (circuit, class): the class's edges
    in the circuit and in the graph, the class's effect (m_full - m_class, m_class the run with every edge of the
    class ablated) and `faithfulness` (m_circuit|class - m_class) / (m_full - m_class), m_circuit|class the run with
    only the class's edges outside the circuit ablated: 1 where the circuit's edges of that class carry the whole
    effect of the class, 0 where they carry none. None for a run without select.by_class."""
    where = {s["name"]: i for i, s in enumerate(specs)}
    if not any(s.get("kind") == "class_of" for s in specs) or "full" not in where:
        return None
    m_full = float(means[where["full"]])
    rows = []
    for i, spec in enumerate(specs):
        if spec.get("kind") != "class_of":
            continue
        k, of = spec["edge_class"], spec["of"]
        ablated = specs[where[f"class:{k}"]]
        m_k = float(means[where[f"class:{k}"]])
        in_class = set(range(int(specs[where["full"]]["n"]))) - set(ablated["edges"])
        kept = len(set(specs[where[of]]["edges"]) & in_class)
        effect = m_full - m_k
        rows.append({"circuit": of, "class": k, "edges": kept, "class_edges": len(in_class), "effect": effect,
                     "faithfulness": (float(means[i]) - m_k) / effect if effect != 0 else float("nan")})
    return pd.DataFrame(rows, columns=["circuit", "class", "edges", "class_edges", "effect", "faithfulness"])
