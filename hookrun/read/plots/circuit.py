"""Pictures of a circuit run (a `circuit:` block): a circuit as a layered graph and the faithfulness curve.

    from hookrun.read.plots import circuit
    res = cap.read("circuit")
    circuit.circuit_graph(res, "top_16")   # input at the bottom, a row of heads (and MLPs) a layer, logits on top;
                                           # edge width by |mean score|, colour by the receiver's input q/k/v/mlp/logits
    circuit.faithfulness_curve(res)        # faithfulness by circuit size, top n against random circuits of that size
    circuit.pictures(cap)                  # (figure maker, file name) of what `python -m hookrun.plot RUN_DIR` draws
    circuit.faithfulness_per_job(circuit.sweep_circuits(SWEEP_DIR))   # a sweep: each job's circuits' faithfulness

They read `cap.read("circuit")` (hookrun.methods.circuits.CircuitResult: its `edges` table and circuits' masks), or
a sweep's jobs, and return matplotlib Figures built without pyplot.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from hookrun.format.layout import CIRCUIT_ATTR
from hookrun.read.captures import Captures, sweep_jobs

KIND_COLOURS = {"q": "#1f77b4", "k": "#d62728", "v": "#2ca02c", "mlp": "#9467bd", "logits": "#7f7f7f"}
CIRCUIT_COLOURS = {"top_n": "#d62728", "random": "#7f7f7f", "threshold": "#ff7f0e", "explicit": "#1f77b4"}
MOST = 300  # the most edges circuit_graph draws (the largest by |score|): a GPT-2-small graph has 32,000


def _positions(edges, n_layers: int):
    """(x, y) of each node: input at y 0, layer L's heads (and MLP) at y L + 1, logits at y n_layers + 1."""
    heads = sorted({int(h) for h in edges["sender_head"] if h >= 0} | {int(h) for h in edges["receiver_head"] if
                                                                        h >= 0})
    n_heads = max(heads) + 1 if heads else 1
    mlp = bool((edges["kind"] == "mlp").any())
    width = n_heads + (1 if mlp else 0)
    pos = {"input": ((width - 1) / 2, 0.0), "logits": ((width - 1) / 2, n_layers + 1.0)}
    for layer in range(n_layers):
        for h in range(n_heads):
            pos[f"a{layer}.h{h}"] = (float(h), layer + 1.0)
        if mlp:
            pos[f"m{layer}"] = (float(n_heads), layer + 1.0)
    return pos


def circuit_graph(res, name: Optional[str] = None, title: Optional[str] = None, most: int = MOST) -> Figure:
    """The circuit `name` (None: the whole graph) drawn in layers: nodes in the circuit filled, the others hollow;
    each edge a line from its sender to the node it feeds (bent where it passes a layer, or stays in one), its width
    by |mean score| (the largest widest), its colour by the receiver's input (q, k, v, mlp, logits), its score's
    sign by the line style (dashed: lowers the metric). At most `most` edges are drawn, the largest by |score|
    (the title says so)."""
    edges = res.edges
    mask = np.ones(len(edges), bool) if name is None else np.asarray(res.masks[name], bool)
    n_layers = int(res.attrs["graph"]["n_layers"])
    pos = _positions(edges, n_layers)
    fig = Figure(figsize=(1.3 * max(4, len(pos) ** 0.5 * 2), 1.6 * (n_layers + 2) + 0.8))
    ax = fig.add_subplot()
    shown = edges[mask]
    if len(shown) > most:
        shown = shown.loc[shown["score"].abs().sort_values(ascending=False, kind="stable").index[:most]]
    top = float(np.abs(shown["score"]).max()) if len(shown) else 1.0
    used = set(shown["sender"])
    for row in shown.itertuples(index=False):
        target = row.node if row.node in pos else row.receiver
        (x0, y0), (x1, y1) = pos[row.sender], pos.get(target, pos["logits"])
        offset = {"q": -0.12, "k": 0.0, "v": 0.12}.get(row.kind, 0.0)
        w = 0.4 + 5.6 * abs(row.score) / (top or 1.0)
        span = y1 - y0  # edges past a layer (or within one: attention -> MLP) bend, off the nodes between
        rad = 0.0 if span == 1 else 0.25 if x1 >= x0 else -0.25
        ax.annotate("", xy=(x1 + offset, y1 - 0.12), xytext=(x0, y0 + 0.08), zorder=1,
                    arrowprops=dict(arrowstyle="-", color=KIND_COLOURS[row.kind], lw=w, alpha=0.75,
                                    ls="-" if row.score >= 0 else (0, (3, 1.5)), shrinkA=0, shrinkB=0,
                                    connectionstyle=f"arc3,rad={rad}"))
        used.add(target)
    for node, (x, y) in pos.items():
        inside = node in used
        ax.scatter([x], [y], s=620, zorder=2, color="#333333" if inside else "white", edgecolors="#333333")
        ax.text(x, y, node, ha="center", va="center", fontsize=7, zorder=3, color="white" if inside else "#333333")
    ax.set_ylim(-0.6, n_layers + 1.6)
    xs = [x for x, _ in pos.values()]
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_yticks(range(n_layers + 2), ["input", *[f"layer {i}" for i in range(n_layers)], "logits"])
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [Line2D([], [], color=c, lw=3, label=k) for k, c in KIND_COLOURS.items() if (shown["kind"] == k).any()]
    if (shown["score"] < 0).any():
        handles.append(Line2D([], [], color="black", lw=1.5, ls=(0, (3, 1.5)), label="score < 0"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="receiver input")
    row = res.circuits.set_index("name").loc[name] if name is not None else None
    what = f"circuit {name}: {int(mask.sum())} of {len(edges)} edges" if name else f"the graph: {len(edges)} edges"
    if row is not None:
        what += f", faithfulness {row.faithfulness:.3f}"
    if len(shown) < mask.sum():
        what += f"; the {len(shown)} largest drawn"
    ax.set_title(title or f"{what}\n(width: |mean {res.attrs['method']} score| of {res.attrs['metric']})", fontsize=9)
    fig.tight_layout()
    return fig


def faithfulness_curve(res, title: Optional[str] = None) -> Figure:
    """Faithfulness ((m_circuit - m_target) / (m_source - m_target)) against the fraction of edges in the circuit:
    the top-n circuits, the random circuits of each size (each a dot, their mean a line), the areas under both."""
    f = res.faithfulness
    c = res.circuits
    total = len(res.edges)
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    ends = c.set_index("name").loc[["empty", "full"], "faithfulness"].to_numpy()
    x = np.r_[0, f["fraction"], 1]
    ax.plot(x, np.r_[ends[0], f["faithfulness"], ends[1]], "o-", color="#d62728",
            label=f"top n ({res.attrs['method']}), area {f.attrs.get('area', float('nan')):.3f}")
    rnd = c[c.kind == "random"]
    ax.scatter(rnd["n"] / total, rnd["faithfulness"], s=12, color="#7f7f7f", alpha=0.6, label="random circuits")
    ax.plot(x, np.r_[ends[0], f["random"], ends[1]], "s--", color="#7f7f7f",
            label=f"random, mean; area {f.attrs.get('area_random', float('nan')):.3f}")
    ax.axhline(1, color="black", lw=0.6)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel(f"circuit size: fraction of the graph's {total} edges")
    ax.set_ylabel("faithfulness (1: the source's metric, 0: the target's)")
    ax.set_title(title or f"faithfulness of circuits ({res.attrs['metric']}, ablated edges: donor "
                          f"{res.attrs['donor']})", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def shown_circuit(res) -> Optional[str]:
    """The circuit `python -m hookrun.plot` draws as circuit.png: the smallest top-n circuit with faithfulness
    >= 0.9, else the most faithful top-n one, else the threshold's; None (the whole graph) for a run without."""
    c = res.circuits
    top = c[c.kind == "top_n"].sort_values("n", kind="stable")
    if len(top):
        good = top[top.faithfulness >= 0.9]
        return str((good.iloc[0] if len(good) else top.loc[top.faithfulness.fillna(-np.inf).idxmax()])["name"])
    rest = c[c.kind == "threshold"]
    return str(rest["name"].iloc[0]) if len(rest) else None


def pictures(cap) -> List[tuple]:
    """(figure function, file name) of every picture of a circuit run: circuit.png (shown_circuit's circuit),
    circuit-<name>.png for each explicit circuit, faithfulness.png where the run selected top-n circuits."""
    res = cap.read("circuit")
    name = shown_circuit(res)
    out = [(lambda: circuit_graph(res, name), "circuit.png")]
    for given in res.circuits.loc[res.circuits.kind == "explicit", "name"]:
        out.append((lambda given=given: circuit_graph(res, given), f"circuit-{given}.png"))
    if len(res.faithfulness):
        out.append((lambda: faithfulness_curve(res), "faithfulness.png"))
    return out


def sweep_circuits(sweep_dir) -> pd.DataFrame:
    """A row per job and circuit of a sweep's circuit runs: job, name, kind, n, faithfulness (the job's mean of its
    `circuit.<name>` column, as hookrun.collect gives it), method and steps; no rows for a sweep without."""
    rows = []
    for job in sweep_jobs(sweep_dir):
        if job["location"] is None:
            continue
        cap = Captures(job["location"])
        attrs = cap.attrs.get(CIRCUIT_ATTR)
        if attrs is None:
            continue
        samples = cap.samples
        for spec in attrs["circuits"]:
            column = f"circuit.{spec['name']}"
            rows.append({"job": job["job"], "name": spec["name"], "kind": spec["kind"], "n": spec["n"],
                         "faithfulness": float(samples[column].mean()) if column in samples else float("nan"),
                         "method": attrs["method"], "steps": attrs.get("steps")})
    return pd.DataFrame(rows, columns=["job", "name", "kind", "n", "faithfulness", "method", "steps"])


def faithfulness_per_job(table: pd.DataFrame, labels: Optional[Dict[str, str]] = None) -> Figure:
    """Bars of each job's circuits' faithfulness (sweep_circuits' table), a group a job labelled `labels[job]`
    (default: job, method, steps): its top-n, threshold and explicit circuits, and beside each top-n circuit the mean
    of the random circuits of its size (their values dots); the full and empty circuits are the lines at 1 and 0."""
    if not len(table):
        raise KeyError("no circuit runs in the sweep: faithfulness_per_job draws jobs with a circuit: block")
    jobs = list(dict.fromkeys(table["job"]))
    fig = Figure(figsize=(max(8.0, 1.6 * len(jobs) + 2.5), 5.0), layout="constrained")
    ax = fig.add_subplot()
    ticks, names, x = [], [], 0.0
    for job in jobs:
        rows = table[table.job == job]
        start = x
        for r in rows[rows.kind.isin(["top_n", "threshold", "explicit"])].itertuples(index=False):
            ax.bar(x, r.faithfulness, width=0.8, color=CIRCUIT_COLOURS[r.kind], label=r.kind)
            ax.text(x, max(r.faithfulness, 0) + 0.02, f"{r.name}\n{r.faithfulness:.2f}", ha="center", va="bottom",
                    fontsize=7)
            x += 1
            rnd = rows[(rows.kind == "random") & (rows.n == r.n)] if r.kind == "top_n" else rows.iloc[:0]
            if len(rnd):
                ax.bar(x, rnd.faithfulness.mean(), width=0.8, color=CIRCUIT_COLOURS["random"], label="random")
                ax.scatter([x] * len(rnd), rnd.faithfulness, s=10, color="black", zorder=3)
                ax.text(x, max(rnd.faithfulness.max(), 0) + 0.02, f"random\n{rnd.faithfulness.mean():.2f}",
                        ha="center", va="bottom", fontsize=7)
                x += 1
        ticks.append((start + x - 1) / 2)
        first = rows.iloc[0]
        steps = "" if pd.isna(first.steps) or first.steps is None else f", steps {int(first.steps)}"
        names.append(((labels or {}).get(job) or f"job {job}: {first.method}{steps}").replace(": ", ":\n")
                     .replace(", ", "\n"))
        x += 0.8  # a gap between jobs
    ax.axhline(1, color="black", lw=0.6)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(ticks, names, fontsize=7)
    ax.set_ylabel("faithfulness")
    ax.set_xlabel("job (the values it swept)")
    handles, seen = [], set()
    for h, lab in zip(*ax.get_legend_handles_labels()):
        if lab not in seen:
            seen.add(lab)
            handles.append(h)
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("faithfulness of each job's circuits: (m_circuit - m_target) / (m_source - m_target)\n1: the source's "
                 "metric, 0: the target's; beside a top-n circuit,\nthe random circuits of its size (bar: their mean, "
                 "dots: each)", fontsize=8)
    return fig
