"""Pictures of a circuit run (a `circuit:` block): a circuit as a layered graph and the faithfulness curve.

    from hookrun.read.plots import circuit
    res = cap.read("circuit")
    circuit.circuit_graph(res, "top_16")   # input at the bottom, a row of heads (and MLPs) a layer, logits on top;
                                           # edge width by |mean score|, colour by the receiver's input q/k/v/mlp/logits
    circuit.faithfulness_curve(res)        # faithfulness by circuit size, top n against random circuits of that size

They read `cap.read("circuit")` (hookrun.methods.circuits.CircuitResult: its `edges` table and circuits' masks) and
return matplotlib Figures built without pyplot.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

KIND_COLOURS = {"q": "#1f77b4", "k": "#d62728", "v": "#2ca02c", "mlp": "#9467bd", "logits": "#7f7f7f"}


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


def circuit_graph(res, name: Optional[str] = None, title: Optional[str] = None) -> Figure:
    """The circuit `name` (None: the whole graph) drawn in layers: nodes in the circuit filled, the others hollow;
    each edge a line from its sender to the node it feeds (bent where it passes a layer, or stays in one), its width
    by |mean score| (the largest widest), its colour by the receiver's input (q, k, v, mlp, logits), its score's
    sign by the line style (dashed: lowers the metric)."""
    edges = res.edges
    mask = np.ones(len(edges), bool) if name is None else np.asarray(res.masks[name], bool)
    n_layers = int(res.attrs["graph"]["n_layers"])
    pos = _positions(edges, n_layers)
    fig = Figure(figsize=(1.3 * max(4, len(pos) ** 0.5 * 2), 1.6 * (n_layers + 2) + 0.8))
    ax = fig.add_subplot()
    shown = edges[mask]
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
