"""Pictures of a lens run (a `lens:` block): the lens table, direct logit attribution per block, and per head.

    from hookrun.read.plots import lens
    lens.lens_table(cap, sample=0)   # layers x positions: the top token's text in each cell, coloured by its probability
    lens.dla_blocks(cap)             # bars: each block's attention and MLP contribution (mean over samples), embeddings
    lens.dla_heads(cap)              # heatmap: layers x heads, each head's mean contribution

They read `cap.read("lens")` (hookrun.read.results.lens.LensResult) and return matplotlib Figures built without pyplot.
"""
from __future__ import annotations

from typing import List

import numpy as np
from matplotlib.figure import Figure

from hookrun.read.plots.colour import DIVERGING, SEQUENTIAL


def _shown(text: str, most: int = 11) -> str:
    """A token's text for a cell: quoted, escapes for newlines and tabs, cut to `most` characters."""
    shown = repr(text)
    return shown if len(shown) <= most else shown[:most - 1] + "…"


def _input_tokens(cap, sample: int) -> dict:
    """position (real tokens, from 0) -> the input token's text of stored sample row `sample` ({} without tokens)."""
    if "tokens" not in cap.tables():
        return {}
    tokens = cap.tokens()
    number = cap.samples["sample"].iloc[sample] if len(cap.samples) > sample else sample
    rows = tokens[tokens["sample"] == number]
    return dict(zip(rows["position"].astype(int), rows["token"]))


def lens_table(cap, sample: int = 0, max_columns: int = 16) -> Figure:
    """The logit lens as a table: a row a layer, a column a position of sample `sample` (its input token below
    it), each cell the top token's text, coloured by its probability (0..1). A lens at one position only (last)
    shows the first `max_columns` samples as columns instead."""
    lens = cap.read("lens")
    by_sample = len(lens.positions) == 1 and len(lens.samples) > 1
    if by_sample:
        rows = list(range(min(len(lens.samples), max_columns)))
        ids, probs = lens.top_ids[rows, :, 0, 0].T, lens.top_probs[rows, :, 0, 0].T  # [layers, samples]
        labels = []
        for r in rows:
            inputs = _input_tokens(cap, r)
            last = inputs[max(inputs)] if inputs else ""
            labels.append(f"sample {lens.samples[r]}\n…{_shown(last)}")
        xlabel = f"sample (position {lens.positions[0]}: its input token)"
    else:
        ids, probs = lens.top_ids[sample, :, :, 0], lens.top_probs[sample, :, :, 0]
        keep = (ids >= 0).any(0)  # positions within the sample
        ids, probs = ids[:, keep], probs[:, keep]
        positions = [p for p, k in zip(lens.positions, keep) if k]
        inputs = _input_tokens(cap, sample)
        length = max(inputs) + 1 if inputs else 0
        labels = [f"{p}\n{_shown(inputs.get(p if p >= 0 else length + p, ''))}" for p in positions]
        xlabel = f"position of sample {lens.samples[sample]} (its input token)"
    texts = np.array(lens.decode(ids), dtype=object).reshape(ids.shape)
    n_layers, n_cols = ids.shape
    fig = Figure(figsize=(max(5.0, 0.95 * n_cols + 3.2), max(2.6, 0.42 * n_layers + 1.9)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(np.nan_to_num(probs, nan=0.0), aspect="auto", cmap=SEQUENTIAL, vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    for (i, j), p in np.ndenumerate(probs):
        if ids[i, j] >= 0:
            ax.text(j, i, _shown(texts[i, j]), ha="center", va="center", fontsize=7,
                    color="black" if p > 0.55 else "white")
    ax.set_yticks(range(n_layers), lens.layers, fontsize=8)
    ax.set_xticks(range(n_cols), labels, fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer (its output, read out)")
    fig.colorbar(image, ax=ax, label="probability of the top token")
    ax.set_title("logit lens: the most likely next token at each layer", fontsize=9)
    return fig


def _dla(cap):
    dla = cap.read("lens").dla
    if dla is None:
        raise KeyError(f"{cap.path} has no direct logit attribution: its lens block had no dla.tokens")
    return dla


def _title(dla) -> str:
    n = len(dla.samples)
    mean = float(np.mean(dla.logit)) if n else float("nan")
    return (f"direct logit attribution to {dla.answer} at position {dla.position}\nthe model's mean = {mean:.3f}; "
            f"the parts sum to it (means over {n} samples)")


def dla_blocks(cap) -> Figure:
    """Bars of the mean contribution (over samples, with the standard deviation) of the embeddings, each block's
    attention and MLP side by side, and the constant bias: together they sum to the model's logit (difference)."""
    dla = _dla(cap)
    mean = dla.parts.mean(0) if len(dla.parts) else np.zeros(len(dla.components))
    std = dla.parts.std(0) if len(dla.parts) else np.zeros(len(dla.components))
    layers = sorted({lay for lay, kind in zip(dla.layers, dla.kinds) if kind in ("attn", "mlp")})
    others = [j for j, kind in enumerate(dla.kinds) if kind not in ("attn", "mlp")]
    fig = Figure(figsize=(max(6.0, 0.75 * (len(layers) + len(others)) + 3.0), 4.2), layout="constrained")
    ax = fig.subplots()
    x_other = np.arange(len(others))
    ax.bar(x_other, mean[others], yerr=std[others], color="0.55", capsize=2, label="embeddings and bias")
    base = len(others) + 0.5
    x = base + np.arange(len(layers))
    for offset, kind, colour in ((-0.2, "attn", "C0"), (0.2, "mlp", "C1")):
        cols = [next(j for j, (lay, k) in enumerate(zip(dla.layers, dla.kinds)) if lay == layer and k == kind)
                for layer in layers]
        ax.bar(x + offset, mean[cols], width=0.4, yerr=std[cols], color=colour, capsize=2,
               label="attention" if kind == "attn" else "MLP")
    short = {"embed": "token embed", "pos_embed": "position embed", "bias": "bias"}
    ax.set_xticks([*x_other, *x], [short.get(dla.kinds[j], dla.components[j]) for j in others] +
                  [f"block {layer}" for layer in layers], rotation=30, ha="right", fontsize=8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel(f"contribution to {dla.answer}\n(mean ± std over samples)")
    ax.legend(fontsize=8)
    ax.set_title(_title(dla), fontsize=9)
    return fig


def dla_heads(cap) -> Figure:
    """Each head's mean contribution over samples: a row a layer, a column a head, a diverging map centred at 0
    (without the output projection's bias, which dla_blocks counts in the block's attention)."""
    dla = _dla(cap)
    if dla.heads is None:
        raise KeyError(f"{cap.path} has no per-head attribution (lens.dla.heads=false, or an architecture whose heads "
                       "cannot be split)")
    mean = dla.heads.mean(0) if len(dla.heads) else np.zeros(dla.heads.shape[1:])
    n_layers, n_heads = mean.shape
    fig = Figure(figsize=(max(7.0, 0.6 * n_heads + 4.0), max(3.0, 0.45 * n_layers + 2.0)), layout="constrained")
    ax = fig.subplots()
    bound = float(np.abs(mean).max()) or 1.0
    image = ax.imshow(mean, aspect="auto", cmap=DIVERGING, vmin=-bound, vmax=bound, interpolation="nearest")
    if mean.size <= 256:
        for (i, j), v in np.ndenumerate(mean):
            ax.text(j, i, f"{v:+.2f}", ha="center", va="center", fontsize=7,
                    color="white" if abs(v) > 0.6 * bound else "black")
    ax.set_yticks(range(n_layers), [f"block {layer}" for layer in dla.head_layers], fontsize=8)
    ax.set_xticks(range(n_heads), [str(h) for h in range(n_heads)], fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.colorbar(image, ax=ax, label="mean contribution (0 = none)")
    ax.set_title(_title(dla).replace("direct logit attribution", "each head's direct logit attribution"), fontsize=9)
    return fig


def pictures(cap) -> List[tuple]:
    """(figure function, file name) of every picture a lens run has: lens.png, dla.png, dla_heads.png."""
    lens = cap.read("lens")
    out = []
    if lens.layers:
        out.append((lambda: lens_table(cap), "lens.png"))
    if lens.dla is not None:
        out.append((lambda: dla_blocks(cap), "dla.png"))
        if lens.dla.heads is not None:
            out.append((lambda: dla_heads(cap), "dla_heads.png"))
    return out
