"""Pictures of a text run's per-token arrays: a document's text coloured by one unit, its tokens x units heatmap,
a unit's top-k contexts and attention patterns per head, every token shown as text.

`sample` is the sample-th stored document (row `sample` of cap.samples), or a list of them; `unit` a column of
the array's flattened per-token record.
"""
from __future__ import annotations

from typing import List, Sequence, Union

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from hookrun.read.captures import Captures
from hookrun.read.plots.colour import scale

CHAR_IN, LINE_IN, FONT = 0.092, 0.26, 11  # monospace 11 pt: inches per character and per line of text
COLUMNS = 90  # characters per line of text before a document wraps


def shown(token: str) -> str:
    """A token as drawn in text: newlines and tabs made visible, everything else (leading spaces too) as it is."""
    return token.replace("\n", "\u23ce").replace("\t", "\u2192")


def label(token: str) -> str:
    """A token as an axis tick label: quoted, so that leading spaces show."""
    return repr(token)


def document(cap: Captures, sample: int, layer=None, role=None, hook=None, call=None):
    """(id, tokens, values) of the sample-th stored document: its sample id, its rows of cap.tokens() and their
    records of a per-token array ([n_tokens, ...], in position order)."""
    samples = cap.samples
    if not 0 <= sample < len(samples):
        raise IndexError(f"sample {sample} is out of range: {cap.path} holds {len(samples)} documents")
    sid = int(samples["sample"].iloc[sample])
    lookup = cap.token_rows(hook=hook, layer=layer, role=role, call=call)
    tokens = cap.tokens()
    tokens = tokens[tokens["sample"] == sid]
    rows = lookup.loc[sid].loc[tokens["position"], "row"].to_numpy()
    return sid, tokens, cap.read_rows(lookup.attrs["array"], rows)


def _documents(cap, samples, layer, role, hook, call) -> list:
    return [document(cap, s, layer, role, hook, call) for s in ([samples] if np.isscalar(samples) else samples)]


def _array(cap: Captures, layer, role, hook, call) -> str:
    return cap.token_rows(hook=hook, layer=layer, role=role, call=call).attrs["array"]


def _wrap(tokens: Sequence[str], start: int) -> List[tuple]:
    """(line, column) of each token laid out from column `start`, wrapped at COLUMNS characters."""
    line, col, out = 0, start, []
    for token in tokens:
        if col + len(token) > COLUMNS and col > start:
            line, col = line + 1, start
        out.append((line, col))
        col += len(token)
    return out


def _draw_lines(fig: Figure, lines: list, norm: Normalize, cmap: str, title: str, cbar: str) -> None:
    """Rows of coloured token text: each of `lines` is (left label, tokens, values, index of a token to box or
    None); a row wraps onto more lines of text when long. A colour bar on the right."""
    margin = max((len(left) for left, *_ in lines), default=0) + 1
    laid = [_wrap([shown(t) for t in tokens], margin) for _, tokens, _, _ in lines]
    height = sum(lay[-1][0] + 1 for lay in laid if lay) + len(lines) * 0.4
    width_in, height_in = (COLUMNS + 2) * CHAR_IN + 1.4, height * LINE_IN + 0.9
    fig.set_size_inches(width_in, height_in)
    ax = fig.add_axes([0.1 / width_in, 0.2 / height_in, (COLUMNS + 2) * CHAR_IN / width_in,
                       1 - 0.75 / height_in])
    ax.set_xlim(0, COLUMNS + 2)
    ax.set_ylim(max(height, 1), 0)
    ax.set_axis_off()
    colours = colormaps[cmap]
    y = 0.5
    for (left, tokens, values, box), lay in zip(lines, laid):
        ax.text(0, y, left, family="monospace", fontsize=FONT - 2, va="center", color="0.3")
        for i, (token, value, (line, col)) in enumerate(zip(tokens, values, lay)):
            level = float(norm(value))
            ax.text(col, y + line, shown(token), family="monospace", fontsize=FONT, va="center",
                    color="white" if abs(level - 0.5) > 0.35 else "black", zorder=3 if i == box else 2,
                    bbox=dict(boxstyle="square,pad=0.08", fc=colours(level), ec="black" if i == box else "none", lw=2))
        y += (lay[-1][0] + 1 if lay else 1) + 0.4
    cax = fig.add_axes([1 - 1.0 / width_in, 0.2 / height_in, 0.15 / width_in, 1 - 0.75 / height_in])
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=cax, label=cbar)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left", y=1 - 0.12 / height_in, va="top")


def _norm(values) -> tuple:
    s = scale(np.concatenate([np.ravel(v) for v in values]) if len(values) else [])
    return Normalize(s["vmin"], s["vmax"]), s["cmap"]


def text(cap: Captures, layer=None, role="output", hook=None, sample: Union[int, Sequence[int]] = 0, unit: int = 0,
         call=None) -> Figure:
    """A document's text (or several documents', one after another), each token coloured by unit `unit`'s value
    at it (a diverging map centred at 0 for signed values), with a colour bar."""
    docs = _documents(cap, sample, layer, role, hook, call)
    values = [v.reshape(len(v), -1)[:, unit] for _, _, v in docs]
    norm, cmap = _norm(values)
    lines = [(f"sample {sid}", tokens["token"].tolist(), vals, None) for (sid, tokens, _), vals in zip(docs, values)]
    fig = Figure()
    name = _array(cap, layer, role, hook, call)
    _draw_lines(fig, lines, norm, cmap, f"{name}: unit {unit} at each token", f"unit {unit}")
    return fig


def top_contexts(cap: Captures, layer=None, role="output", hook=None, unit: int = 0, k: int = 10, context: int = 8,
                 call=None) -> Figure:
    """The k tokens where unit `unit` is largest, each in its context (`context` tokens each side, within its
    document): every token coloured by the unit's value, the top token boxed; left, the value and the sample."""
    top = cap.top(layer=layer, role=role, hook=hook, unit=unit, k=k, context=context, call=call)
    lookup = cap.token_rows(hook=hook, layer=layer, role=role, call=call)
    tokens = cap.tokens().set_index(["sample", "position"])["token"]
    lines = []
    for row in top.itertuples():
        near = lookup.loc[row.sample]
        near = near[(near.index >= row.position - context) & (near.index <= row.position + context)]
        values = cap.read_rows(lookup.attrs["array"], near["row"].to_numpy())
        lines.append((f"{row.value:+.3g} s{row.sample}:{row.position}",
                      [tokens[(row.sample, p)] for p in near.index], values.reshape(len(values), -1)[:, unit],
                      list(near.index).index(row.position)))
    norm, cmap = _norm([values for _, _, values, _ in lines])
    fig = Figure()
    _draw_lines(fig, lines, norm, cmap, f"{lookup.attrs['array']}: top {len(lines)} tokens of unit {unit} "
                f"(value, sample:position; the top token boxed)", f"unit {unit}")
    return fig


def heatmap(cap: Captures, layer=None, role="output", hook=None, sample: Union[int, Sequence[int]] = 0, call=None,
            max_units: int = 512) -> Figure:
    """Tokens x units of a document (or of several, with lines at their boundaries), every token's text on the y
    axis; a record with more axes is flattened. Signed values in a diverging map centred at 0."""
    docs = _documents(cap, sample, layer, role, hook, call)
    data = np.concatenate([v.reshape(len(v), -1)[:, :max_units] for _, _, v in docs])
    labels = [label(t) for _, tokens, _ in docs for t in tokens["token"]]
    fig = Figure(figsize=(min(14.0, 4 + data.shape[1] * 0.03), min(40.0, 1.5 + 0.17 * len(labels))),
                 layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(data, aspect="auto", interpolation="nearest", **scale(data))
    ax.set_yticks(range(len(labels)), labels, fontsize=7, family="monospace")
    starts = np.cumsum([0] + [len(t) for _, t, _ in docs])
    for start, (sid, tokens, _) in zip(starts, docs):
        if start:
            ax.axhline(start - 0.5, color="black", lw=1.5)
        ax.annotate(f"sample {sid}", (1.01, start - 0.5), xycoords=("axes fraction", "data"), fontsize=8, va="top")
    ax.set_xlabel("unit" + (f" (first {max_units})" if data.shape[1] == max_units else ""))
    ax.set_ylabel("token")
    fig.colorbar(image, ax=ax, pad=0.08)
    ids = ", ".join(str(sid) for sid, _, _ in docs)
    ax.set_title(f"{_array(cap, layer, role, hook, call)}: sample {ids}, {len(labels)} tokens x units", fontsize=10)
    return fig


def attention(cap: Captures, layer=None, role="output.1", hook=None, sample: int = 0, call=None,
              max_heads: int = 16) -> Figure:
    """Attention patterns of one document per head: query x key over its real tokens (the key columns at the
    tokens' positions; padding left out), token text on both axes, one colour scale; heads as the hook selected."""
    sid, tokens, data = document(cap, sample, layer, role, hook, call)
    name = _array(cap, layer, role, hook, call)
    keys = tokens["position"].to_numpy()
    keys = keys[keys < data.shape[-1]]
    heads = _heads(cap, name, data.shape[1])[:max_heads]
    pattern = data[:, :len(heads)][:, :, keys].transpose(1, 0, 2)  # [heads, query, key]
    cols = min(len(heads), 4)
    rows = -(-len(heads) // cols)
    side = min(4.5, 1.2 + 0.14 * len(tokens))
    fig = Figure(figsize=(side * cols + 1.2, side * rows + 0.8), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    colours = scale(pattern)
    labels = [label(t) for t in tokens["token"]]
    step = max(1, len(labels) // 40)
    for ax in axes[len(heads):]:
        ax.set_axis_off()
    for ax, head, panel in zip(axes, heads, pattern):
        image = ax.imshow(panel, interpolation="nearest", **colours)
        ax.set_title(f"head {head}", fontsize=9)
        ax.set_xticks(range(0, len(keys), step), labels[:len(keys):step], rotation=90, fontsize=6, family="monospace")
        ax.set_yticks(range(0, len(labels), step), labels[::step], fontsize=6, family="monospace")
    axes[0].set_ylabel("query")
    axes[0].set_xlabel("key")
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="attention")
    fig.suptitle(f"{name}: sample {sid} ({len(tokens)} tokens), query x key per head", fontsize=10)
    return fig


def _heads(cap: Captures, name: str, count: int) -> list:
    """The model's head numbers of an array's head axis: those its hook's select.heads kept, else 0..count-1."""
    hook = name.split("/", 1)[0]
    select = (cap.config.get("hooks", {}).get(hook) or {}).get("select") or {}
    heads = select.get("heads")
    return [int(h) for h in heads] if isinstance(heads, list) and len(heads) == count else list(range(count))


def is_attention(cap: Captures, rows: pd.DataFrame) -> bool:
    """Whether a per-token array holds attention patterns: [tokens, heads, keys] with keys = data.text.max_length."""
    shape = cap.array(rows["array"].iloc[0]).shape
    length = ((cap.config.get("data") or {}).get("text") or {}).get("max_length")
    return len(shape) == 3 and shape[-1] == length
