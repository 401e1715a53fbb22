"""Pictures of a circuit run (a `circuit:` block): a circuit as a layered graph and the faithfulness curve.

    from hookrun.read.plots import circuit
    res = cap.read("circuit")
    circuit.circuit_graph(res, "top_16")   # input at the bottom, a row of heads (and MLPs) a layer, logits on top;
                                           # edge width by |mean score|, colour by the receiver's input q/k/v/mlp/logits
    circuit.faithfulness_curve(res)        # faithfulness by circuit size, top n against random circuits of that size
    circuit.pictures(cap)                  # (figure maker, file name) of what `python -m hookrun.plot RUN_DIR` draws
    circuit.faithfulness_per_job(circuit.sweep_circuits(SWEEP_DIR))   # a sweep: each job's circuits' faithfulness
    circuit.benchmark_curves({"eap": res_eap, "eap_ig": res_ig})   # select.percent runs: CPR / CMD curves

They read `cap.read("circuit")` (hookrun.read.results.circuits.CircuitResult: its `edges` table and circuits' masks), or
a sweep's jobs, and return matplotlib Figures built without pyplot.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from hookrun.format.layout import CIRCUIT_ATTR, COMPLETE
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


NODE_SIZE = 620  # scatter's marker area (points^2): a node's radius is sqrt(NODE_SIZE) / 2 points
KIND_BEND = {"q": -0.14, "k": 0.0, "v": 0.14}  # q, k and v edges between one pair of nodes bend apart


def _group(row, pos: dict, graph: dict) -> Optional[tuple]:
    """(x from, x to, y) of the heads a key-value receiver feeds (grouped-query attention: a{L}.kv{G}<k> feeds the
    group's heads), None for any other receiver."""
    if ".kv" not in row.receiver:
        return None
    size = int(graph["n_heads"]) // max(int(graph.get("n_kv_heads") or graph["n_heads"]), 1)
    heads = [pos[f"a{row.receiver_layer}.h{h}"] for h in range(row.receiver_head * size, (row.receiver_head + 1) * size)]
    return heads[0][0], heads[-1][0], heads[0][1]


def circuit_graph(res, name: Optional[str] = None, title: Optional[str] = None, most: int = MOST) -> Figure:
    """The circuit `name` (None: the whole graph) drawn in layers: nodes in the circuit filled, the others hollow;
    each edge an arrow from its sender into the node it feeds (bent where it passes a layer, or stays in one; q, k
    and v edges of one pair bent apart), its width by |mean score| (the largest widest), its colour by the
    receiver's input (q, k, v, mlp, logits), dashed where its score works against the metric's gap (the sign of
    full minus empty circuit; so a loss metric's helpful negative scores are solid). A key-value receiver of
    grouped-query attention feeds every head of its group: its arrows end on a bracket under the group. At most
    `most` edges are drawn, the largest by |score| (the title says so); the legend says all of this."""
    edges = res.edges
    mask = np.ones(len(edges), bool) if name is None else np.asarray(res.masks[name], bool)
    graph = res.attrs["graph"]
    n_layers = int(graph["n_layers"])
    pos = _positions(edges, n_layers)
    fig = Figure(figsize=(1.3 * max(4, len(pos) ** 0.5 * 2) + 1.6, 1.6 * (n_layers + 2) + 0.8))
    ax = fig.add_subplot()
    shown = edges[mask]
    if len(shown) > most:
        shown = shown.loc[shown["score"].abs().sort_values(ascending=False, kind="stable").index[:most]]
    top = float(np.abs(shown["score"]).max()) if len(shown) else 1.0
    direction = _direction(res)
    radius = NODE_SIZE ** 0.5 / 2
    used = set(shown["sender"])
    brackets = {}
    for row in shown.itertuples(index=False):
        group = _group(row, pos, graph)
        if group is not None:
            x1, y1 = (group[0] + group[1]) / 2, group[2] - 0.3
            brackets[(row.receiver_layer, row.receiver_head)] = group
            used.update(f"a{row.receiver_layer}.h{h}" for h in range(len(pos)) if f"a{row.receiver_layer}.h{h}" in pos
                        and group[0] <= pos[f"a{row.receiver_layer}.h{h}"][0] <= group[1])
        else:
            target = row.node if row.node in pos else row.receiver
            x1, y1 = pos.get(target, pos["logits"])
            used.add(target)
        x0, y0 = pos[row.sender]
        w = 0.4 + 5.6 * abs(row.score) / (top or 1.0)
        span = y1 - y0  # edges past a layer (or within one: attention -> MLP) bend, off the nodes between
        rad = (0.0 if span == 1 else 0.25 if x1 >= x0 else -0.25) + KIND_BEND.get(row.kind, 0.0)
        against = row.score * direction < 0
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=1,
                    arrowprops=dict(arrowstyle="-|>", mutation_scale=6 + 2 * w, color=KIND_COLOURS[row.kind], lw=w,
                                    alpha=0.75, ls=(0, (3, 1.5)) if against else "-", shrinkA=radius,
                                    shrinkB=0 if group is not None else radius + 1,
                                    connectionstyle=f"arc3,rad={rad}"))
    for (layer, g), (a, b, y) in brackets.items():
        ax.plot([a - 0.3, a - 0.3, b + 0.3, b + 0.3], [y - 0.2, y - 0.3, y - 0.3, y - 0.2], color="#555555", lw=1,
                zorder=1.5)
        ax.text(b + 0.34, y - 0.3, f"kv{g}", fontsize=6, va="center", color="#555555")
    for node, (x, y) in pos.items():
        inside = node in used
        ax.scatter([x], [y], s=NODE_SIZE, zorder=2, color="#333333" if inside else "white", edgecolors="#333333")
        ax.text(x, y, node, ha="center", va="center", fontsize=7, zorder=3, color="white" if inside else "#333333")
    ax.set_ylim(-0.6, n_layers + 1.6)
    xs = [x for x, _ in pos.values()]
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_yticks(range(n_layers + 2), ["input", *[f"layer {i}" for i in range(n_layers)], "logits"])
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=_legend(shown, against=bool((shown["score"] * direction < 0).any())), loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, title="edge: sender -> receiver", title_fontsize=8)
    row = res.circuits.set_index("name").loc[name] if name is not None else None
    what = f"circuit {name}: {int(mask.sum())} of {len(edges)} edges" if name else f"the graph: {len(edges)} edges"
    if row is not None:
        what += f", faithfulness {row.faithfulness:.3f}"
    if len(shown) < mask.sum():
        what += f"; the {len(shown)} largest drawn"
    ax.set_title(title or f"{what}\n(width: |mean {res.attrs['method']} score| of {res.attrs['metric']})", fontsize=9)
    fig.tight_layout()
    return fig


def _direction(res) -> float:
    """+1 where the full circuit's metric is above the empty one's (a logit difference), -1 below (a loss): the
    sign of a score that helps the circuit restore the source's metric."""
    c = res.circuits.set_index("name")
    if {"full", "empty"} <= set(c.index) and "metric" in c:
        gap = float(c.loc["full", "metric"]) - float(c.loc["empty", "metric"])
        if np.isfinite(gap) and gap != 0:
            return 1.0 if gap > 0 else -1.0
    return 1.0


def _legend(shown, against: bool) -> list:
    """The legend's entries: a colour for each receiver input drawn, what a line's width and dash say, and what a
    filled and a hollow node are."""
    handles = [Line2D([], [], color=c, lw=3, label=f"into {k}" if k != "mlp" else "into an MLP")
               for k, c in KIND_COLOURS.items() if (shown["kind"] == k).any()]
    handles.append(Line2D([], [], color="#555555", lw=0.8, label="width: |score|"))
    handles.append(Line2D([], [], color="#555555", lw=1.5, ls=(0, (3, 1.5)),
                          label="dashed: works against\nthe metric" if against else "solid: helps the metric"))
    handles.append(Line2D([], [], ls="", marker="o", markersize=9, color="#333333", label="node in the circuit"))
    handles.append(Line2D([], [], ls="", marker="o", markersize=9, markerfacecolor="white", markeredgecolor="#333333",
                          label="node not in it"))
    return handles


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
    `circuit.<name>` column, as hookrun.collect gives it), method, steps and reason; a job that did not complete (a
    failed, interrupted or missing one) is one row of kind `failed`, its status as name and its one-line reason, so
    the picture shows it; no rows for a sweep without a circuit run."""
    rows, others = [], []
    for job in sweep_jobs(sweep_dir):
        if job["status"] not in (COMPLETE, None):
            others.append({"job": job["job"], "name": job["status"], "kind": "failed", "n": 0,
                           "faithfulness": float("nan"), "method": None, "steps": None,
                           "reason": job.get("reason") or ""})
            continue
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
                         "method": attrs["method"], "steps": attrs.get("steps"), "reason": ""})
    if rows:  # a sweep of circuit runs: its jobs that did not complete, in job order among the others
        rows = sorted(rows + others, key=lambda r: _job_key(r["job"]))
    return pd.DataFrame(rows, columns=["job", "name", "kind", "n", "faithfulness", "method", "steps", "reason"])


def _job_key(job: str):
    return (0, int(job), "") if job.isdigit() else (1, 0, job)


def faithfulness_per_job(table: pd.DataFrame, labels: Optional[Dict[str, str]] = None) -> Figure:
    """Bars of each job's circuits' faithfulness (sweep_circuits' table), a group a job labelled `labels[job]`
    (default: job, method, steps): its top-n, threshold and explicit circuits, each with its name and value, and
    beside each top-n circuit the mean of the random circuits of its size (a grey bar, their values dots); the full
    and empty circuits are the lines at 1 and 0. A job that did not complete is a hatched slot saying so."""
    if not len(table):
        raise KeyError("no circuit runs in the sweep: faithfulness_per_job draws jobs with a circuit: block")
    jobs = list(dict.fromkeys(table["job"]))
    fig = Figure(figsize=(max(8.0, 1.6 * len(jobs) + 2.5), 5.4), layout="constrained")
    ax = fig.add_subplot()
    ticks, names, x, highest = [], [], 0.0, 1.0
    for job in jobs:
        rows = table[table.job == job]
        start = x
        failed = rows[rows.kind == "failed"]
        if len(failed):
            r = failed.iloc[0]
            ax.bar(x, 1.0, width=0.8, color="white", edgecolor="#999999", hatch="//", label="did not complete")
            ax.text(x, 0.5, r["name"], ha="center", va="center", fontsize=8, rotation=90, color="#555555",
                    bbox=dict(facecolor="white", edgecolor="none", pad=2))
            ticks.append(x)
            names.append(((labels or {}).get(job) or f"job {job}").replace(": ", ":\n").replace(", ", "\n")
                         + f"\n({r['name']})")
            x += 1.8
            continue
        for r in rows[rows.kind.isin(["top_n", "threshold", "explicit"])].itertuples(index=False):
            ax.bar(x, r.faithfulness, width=0.8, color=CIRCUIT_COLOURS[r.kind], label=r.kind)
            ax.text(x, max(r.faithfulness, 0) + 0.02, f"{r.name}\n{r.faithfulness:.2f}", ha="center", va="bottom",
                    fontsize=7)
            highest = max(highest, r.faithfulness if np.isfinite(r.faithfulness) else highest)
            x += 1
            rnd = rows[(rows.kind == "random") & (rows.n == r.n)] if r.kind == "top_n" else rows.iloc[:0]
            if len(rnd):
                ax.bar(x, rnd.faithfulness.mean(), width=0.8, color=CIRCUIT_COLOURS["random"], label="random")
                ax.scatter([x] * len(rnd), rnd.faithfulness, s=10, color="black", zorder=3)
                highest = max(highest, float(np.nanmax(rnd.faithfulness)))
                x += 1
        ticks.append((start + x - 1) / 2)
        first = rows.iloc[0]
        steps = "" if pd.isna(first.steps) or first.steps is None else f", steps {int(first.steps)}"
        names.append(((labels or {}).get(job) or f"job {job}: {first.method}{steps}").replace(": ", ":\n")
                     .replace(", ", "\n"))
        x += 0.8  # a gap between jobs
    ax.axhline(1, color="black", lw=0.6)
    ax.axhline(0, color="black", lw=0.6)
    bottom, _ = ax.get_ylim()
    ax.set_ylim(min(bottom, 0.0), highest + 0.25)  # room for the value labels inside the axes, under the title
    ax.set_xticks(ticks, names, fontsize=7)
    ax.set_ylabel("faithfulness")
    ax.set_xlabel("job (the values it swept)")
    handles, seen = [], set()
    for h, lab in zip(*ax.get_legend_handles_labels()):
        if lab not in seen:
            seen.add(lab)
            handles.append(h)
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("faithfulness of each job's circuits: (m_circuit - m_target) / (m_source - m_target)\n1: the "
                 "source's metric, 0: the target's; beside a top-n circuit, the random circuits\nof its size (grey "
                 "bar: their mean, dots: each)", fontsize=8, pad=10)
    return fig


def benchmark_curves(results: Dict[str, object], title: Optional[str] = None) -> Figure:
    """The circuit-discovery benchmark's curves of circuit runs with select.percent (`results`: label -> a
    CircuitResult): for each, the faithfulness of its circuits at the benchmark's percentages, by signed scores
    (CPR's curve, solid) and by |scores| (CMD's, dashed), and the first run's random circuits (dotted, where it has
    them), on a log axis of the fraction of edges; the legend gives each curve's area."""
    fig = Figure(figsize=(7.2, 4.4))
    ax = fig.add_subplot()
    colours = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    random = None
    for i, (label, res) in enumerate(results.items()):
        t = res.benchmark
        if t is None:
            raise KeyError(f"{label}: the run has no select.percent circuits (benchmark_curves draws CPR / CMD curves)")
        colour = colours[i % len(colours)]
        ax.plot(t.fraction, t.signed, "o-", color=colour, ms=4, label=f"{label}: CPR {t.attrs['cpr']:.3f} (signed)")
        ax.plot(t.fraction, t["abs"], "s--", color=colour, ms=4, alpha=0.8,
                label=f"{label}: CMD {t.attrs['cmd']:.3f} (|score|)")
        if i == 0 and t["random"].notna().all():  # random circuits depend on the graph and seed, not the scores
            random = t
    if random is not None:
        ax.plot(random.fraction, random["random"], "^:", color="#7f7f7f", ms=4,
                label=f"random circuits: CPR {random.attrs['cpr_random']:.3f}, CMD {random.attrs['cmd_random']:.3f}")
    ax.axhline(1, color="black", lw=0.6)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("circuit size: fraction of the graph's edges (the benchmark's 0.1% .. 100%)")
    ax.set_ylabel("faithfulness (1: full model, 0: empty circuit)")
    ax.set_title(title or "faithfulness at the benchmark's circuit sizes", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
