"""Pictures of what a run captured: feature-map grids, heatmaps, per-batch statistics, sweep comparisons; this
package is hookrun.plot, and its modules draw by kind (tokens, lens, circuit, generation; colour: the scales).

    python -m hookrun.plot RUN_DIR [--layer L] [--sample 0] [--unit 0] [--out DIR]   # PNGs (default: RUN_DIR/plots)
    python -m hookrun.plot SWEEP_DIR             # compare.png across the jobs (a generate sweep: generations.png;
                                                 # a circuit sweep: circuits.png)

    from hookrun import plot
    plot.feature_maps(cap, layer="conv1", sample=0)   # [N, C, H, W] captures: one image per channel
    plot.heatmap(cap, layer="fc1")                   # 2-D captures: rows x units; [N, T, D]: one sample
    plot.heatmap(cap, layer="transformer.h.1", sample=3)   # per-token: document 3's tokens x units (or samples=[..])
    plot.text(cap, layer="transformer.h.1", sample=3, unit=7)   # document 3's text coloured by unit 7
    plot.top_contexts(cap, layer="transformer.h.1", unit=7)     # the unit's top-k tokens in their contexts
    plot.attention(cap, layer="transformer.h.0.attn", sample=3)  # role output.1: query x key per head
    plot.batch_stats(cap)                            # mean, std, min, max per batch, from the index
    plot.patching_grid(cap)                          # a patching run: mean change from the unpatched target (an
                                                     # ablation: from the unablated run), layers x positions | heads
    plot.patching_grid(cap, method="attribution")   # an attribution run: the estimated change, verified sites outlined
                                                     # (a per-position heads grid: a heads x positions panel a layer)
    plot.lens_table(cap); plot.dla_blocks(cap); plot.dla_heads(cap)   # a lens run (plots.lens)
    plot.circuit_graph(cap.read("circuit"), "top_20"); plot.faithfulness_curve(cap.read("circuit"))  # plots.circuit
    plot.compare(hookrun.collect(SWEEP_DIR))         # the same statistics per job of a sweep
    plot.completions(cap)                            # a generate run: prompt, completion, stop reason (a table)
    plot.steering(hookrun.collect(SWEEP_DIR, generations=True))   # a generate sweep: words, tokens per coef

Each function returns a matplotlib Figure, built without pyplot (no global state, no display):
`fig.savefig("x.png")` renders it with Agg. `sample` is a row of the array: the row-th stored
sample, as in `cap.samples.row` (for per-token arrays: the sample-th stored document, row `sample` of
cap.samples). Signed values are drawn in a diverging map centred at 0 (RdBu_r), unsigned ones in viridis. Read side only: this module imports analysis, never the writer.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle as _Rect
from matplotlib.ticker import MaxNLocator

from hookrun.format.files import find_store
from hookrun.read.captures import Captures, override_columns, collect, sweep_jobs
from hookrun.read.plots import circuit as _circuit
from hookrun.read.plots import lens as _lens
from hookrun.read.plots import tokens as _tokens
from hookrun.read.plots import train as _train
from hookrun.read.plots.colour import scale
from hookrun.read.plots.circuit import circuit_graph, faithfulness_curve  # noqa: F401 - plot.circuit_graph
from hookrun.read.plots.generation import completions, steering
from hookrun.read.plots.lens import dla_blocks, dla_heads, lens_table  # noqa: F401 - plot.lens_table
from hookrun.read.plots.tokens import attention, document, top_contexts
from hookrun.format.layout import CIRCUIT_ATTR, INDEX_COLUMNS, LENS_ATTR, PATCHING_ATTR
from hookrun.storage import is_url

STATS = ("mean", "std", "min", "max")


def _rows(cap: Captures, layer, role, hook, call) -> pd.DataFrame:
    """The index rows of one array and one call, in row order (errors as load() raises them)."""
    rows = cap.rows(hook=hook, layer=layer, role=role)
    if rows["array"].nunique() != 1 or (call is None and rows["call"].nunique() > 1):
        cap.load(layer=layer, role=role, hook=hook, call=call)  # raises the KeyError that says what to pass
    rows = rows if call is None else rows[rows["call"] == call]
    if not len(rows):
        raise KeyError(f"{layer!r} {role!r}: no capture with call={call}")
    return rows.sort_values("row_start")


def _title(rows: pd.DataFrame) -> str:
    r = rows.iloc[0]
    return f"{r['array']}" + (f" call {r['call']}" if rows["call"].iloc[0] else "")


def one_sample(cap: Captures, sample: int = 0, layer=None, role="output", hook=None, call=None) -> np.ndarray:
    """The capture of one stored sample (row `sample` of the array), read from its batch alone."""
    rows = _rows(cap, layer, role, hook, call)
    if not bool(rows["per_sample"].iloc[0]):
        raise ValueError(f"{rows['array'].iloc[0]} holds one record per batch, not per sample")
    seen = 0
    for r in rows.to_dict("records"):
        n = int(r["row_stop"] - r["row_start"])
        if sample < seen + n:
            return cap.read_row(r)[sample - seen]
        seen += n
    raise IndexError(f"sample {sample} is out of range: {rows['array'].iloc[0]} holds {seen} samples")


def feature_maps(cap: Captures, layer=None, role: str = "output", hook=None, sample: int = 0, call=None,
                 max_maps: int = 64) -> Figure:
    """A grid of one sample's feature maps of an [N, C, H, W] capture, one image per channel, one colour scale."""
    rows = _rows(cap, layer, role, hook, call)
    maps = one_sample(cap, sample, layer, role, hook, call)
    if maps.ndim != 3:
        raise ValueError(f"feature_maps draws [N, C, H, W] captures; {rows['array'].iloc[0]} has per-sample shape "
                         f"{list(maps.shape)}: use heatmap()")
    count = min(len(maps), max_maps)
    cols = math.ceil(math.sqrt(count))
    nrows = math.ceil(count / cols)
    fig = Figure(figsize=(1.8 * cols + 1.2, 1.8 * nrows + 0.8), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False).ravel()
    colours = scale(maps[:count])
    for c, ax in enumerate(axes):
        ax.set_axis_off()
        if c < count:
            image = ax.imshow(maps[c], interpolation="nearest", **colours)
            ax.set_title(f"channel {c}", fontsize=8)
    fig.colorbar(image, ax=list(axes), shrink=0.8)
    shown = f"{count} of {len(maps)} channels" if count < len(maps) else f"{count} channels"
    fig.suptitle(f"{_title(rows)}: sample {sample}, {shown}", fontsize=10)
    return fig


def heatmap(cap: Captures, layer=None, role: str = "output", hook=None, sample: int = 0, call=None,
            max_rows: int = 256) -> Figure:
    """A heatmap of a 2-D capture (first `max_rows` rows x units), of one sample of a capture with more axes
    ([N, T, D]: positions x units; more axes are flattened after the first), or, for a per-token array, of
    document `sample` (or a list of them): its tokens x units, with the token text (tokens.heatmap)."""
    rows = _rows(cap, layer, role, hook, call)
    if _per_token(rows):
        return _tokens.heatmap(cap, layer=layer, role=role, hook=hook, sample=sample, call=call)
    ndim = cap.array(rows["array"].iloc[0]).ndim
    if ndim <= 2:
        data = cap.load(layer=layer, role=role, hook=hook, call=call)[:max_rows]
        data = data.reshape(len(data), -1)
        what, ylabel = f"rows 0..{len(data) - 1}", "row (sample or token)"
    else:
        data = one_sample(cap, sample, layer, role, hook, call)
        data = data.reshape(data.shape[0], -1)
        what, ylabel = f"sample {sample}", "axis 1 (position or channel)"
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(data, aspect="auto", interpolation="nearest", **scale(data))
    ax.set_xlabel("unit")
    ax.set_ylabel(ylabel)
    fig.colorbar(image, ax=ax)
    ax.set_title(f"{_title(rows)}: {what}", fontsize=10)
    return fig


def _per_token(rows: pd.DataFrame) -> bool:
    """Whether the index rows are a per-token array's (one record per stored token of a text run)."""
    return "unit" in rows.columns and bool((rows["unit"] == "token").all())


def text(cap: Captures, layer=None, role: str = "output", hook=None, sample=0, unit: int = 0, call=None) -> Figure:
    """A document's text with each token coloured by unit `unit` of a per-token array (see plots.tokens.text)."""
    return _tokens.text(cap, layer=layer, role=role, hook=hook, sample=sample, unit=unit, call=call)


VALUES = ("change", "normalised", "score")


def patching_grid(cap: Captures, value: str = "change", normalised: bool = False, method: str = "patching") -> Figure:
    """The patching grid's mean over samples: layers on y, positions (or heads) on x, a diverging map centred at 0,
    each cell's value written in it when the grid is small. `value`: "change" (score - the unpatched target run;
    for an ablation, the change from the unablated run, whose mean is printed in the title), "normalised"
    (1 = the source's metric restored; not defined for an ablation) or "score" (the raw metric).
    Positions are labelled with the first sample's tokens when every sample has the same length (one template).
    method="attribution": the run's attribution grid (its estimated change), verified sites outlined."""
    value = "normalised" if normalised else value
    if value not in VALUES:
        raise ValueError(f"patching_grid(value={value!r}): value is one of {', '.join(VALUES)}")
    grid = cap.grid() if method == "patching" else cap.read(method)
    if value == "normalised" and grid.ablation:
        raise ValueError(f"patching_grid(value='normalised'): {grid.roles[0]} -> {grid.roles[1]} is an ablation "
                         "(source = target), where normalised is 0 / 0; draw value='change'")
    data = {"change": grid.change, "normalised": grid.normalised, "score": lambda: grid.scores}[value]()
    if grid.positions is not None:
        return heads_by_positions(cap, grid, data, *_grid_words(grid, value))
    mean = _nanmean0(data) if len(data) else np.zeros((len(grid.layers), len(grid.labels)))
    what, title = _grid_words(grid, value)
    wide = max(len(line) for line in title.splitlines()) * 0.075 + 1.4  # the title's width (9 pt) and the bar's
    fig = Figure(figsize=(max(5.0, 0.6 * len(grid.labels) + 3.4, wide), max(3.0, 0.45 * len(grid.layers) + 2.0)),
                 layout="constrained")
    ax = fig.subplots()
    bound = float(np.nanmax(np.abs(mean))) if np.isfinite(mean).any() else 1.0
    bound = bound or 1.0
    image = ax.imshow(mean, aspect="auto", cmap="RdBu_r", vmin=-bound, vmax=bound, interpolation="nearest")
    if mean.size <= 200:
        for (i, j), v in np.ndenumerate(mean):
            if np.isfinite(v):
                ax.text(j, i, f"{v:+.2f}" if abs(v) < 100 else f"{v:+.3g}", ha="center", va="center", fontsize=7,
                        color="white" if abs(v) > 0.6 * bound else "black")
    if grid.exact is not None:  # an attribution grid's verified sites: outlined
        for i, j in zip(*np.nonzero(np.isfinite(grid.exact).any(0))):
            ax.add_patch(_Rect((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.2))
    ax.set_yticks(range(len(grid.layers)), grid.layers, fontsize=8)
    turn = dict(rotation=45, ha="right") if grid.axis == "position" else {}
    ax.set_xticks(range(len(grid.labels)), grid_ticks(cap, grid), fontsize=8, **turn)
    ax.set_xlabel(grid.axis)
    ax.set_ylabel("layer")
    fig.colorbar(image, ax=ax, label=what)
    ax.set_title(title, fontsize=9)
    return fig


def heads_by_positions(cap: Captures, grid, data: np.ndarray, what: str, title: str) -> Figure:
    """A per-position heads grid (sites.per_position; patching_grid draws it so) as one panel a layer: heads on y,
    positions on x (labelled with the first sample's tokens when the samples share one length), the mean over
    samples of `data` [samples, layers, heads, positions] on one diverging scale centred at 0 for every panel; an
    attribution grid's verified cells outlined."""
    mean = _nanmean0(data) if len(data) else np.zeros(data.shape[1:])
    n_layers, n_heads, n_pos = mean.shape
    bound = float(np.nanmax(np.abs(mean))) if np.isfinite(mean).any() else 1.0
    bound = bound or 1.0
    wide = max(len(line) for line in title.splitlines()) * 0.075 + 1.4
    fig = Figure(figsize=(max(6.0, 0.32 * n_pos + 2.8, wide), (0.22 * n_heads + 0.7) * n_layers + 1.6),
                 layout="constrained")
    axes = fig.subplots(n_layers, 1, squeeze=False, sharex=True)[:, 0]
    verified = np.isfinite(grid.exact).any(0) if grid.exact is not None else None
    image = None
    for li, ax in enumerate(axes):
        image = ax.imshow(mean[li], aspect="auto", cmap="RdBu_r", vmin=-bound, vmax=bound, interpolation="nearest")
        if n_pos <= 12 and n_heads * n_pos <= 120:
            for (i, j), v in np.ndenumerate(mean[li]):
                if np.isfinite(v):
                    ax.text(j, i, f"{v:+.2g}", ha="center", va="center", fontsize=6,
                            color="white" if abs(v) > 0.6 * bound else "black")
        if verified is not None:
            for i, j in zip(*np.nonzero(verified[li])):
                ax.add_patch(_Rect((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.2))
        ax.set_yticks(range(n_heads), [str(h) for h in grid.labels], fontsize=7)
        ax.set_ylabel("head", fontsize=8)
        ax.set_title(grid.layers[li], fontsize=8, loc="left")
    axes[-1].set_xticks(range(n_pos), position_ticks(cap, grid.positions), fontsize=7, rotation=60, ha="right")
    axes[-1].set_xlabel("position")
    fig.colorbar(image, ax=list(axes), label=what, shrink=min(1.0, 3.0 / n_layers) if n_layers > 3 else 1.0)
    fig.suptitle(title, fontsize=9)
    return fig


def _grid_words(grid, value: str) -> tuple:
    """(colour bar label, title) of a patching grid picture: what is drawn and the baseline(s) it is measured from."""
    m, n = grid.metric, len(grid.scores)
    target = float(np.nanmean(grid.target)) if n else float("nan")
    source = float(np.nanmean(grid.source)) if n else float("nan")
    if grid.ablation:
        site = "head" if grid.axis == "head" else "site"
        what = {"change": f"mean change of {m}", "score": f"mean {m}"}[value]
        title = (f"ablation (donor {grid.donor}) of {grid.roles[1]}, one {site} at a time: "
                 + (f"{m} - unablated" if value == "change" else m)
                 + f"\nunablated {m} = {target:.3f} (mean over {n} samples)")
        return what, title
    if grid.method != "patching":
        what = {"change": f"estimated mean change of {m}", "normalised": "estimated normalised",
                "score": f"estimated mean {m}"}[value]
        verified = "" if grid.exact is None else "; outlined: verified by exact patching"
        return what, (f"attribution ({grid.method}) {grid.roles[0]} -> {grid.roles[1]}: estimated "
                      f"{'change' if value == 'change' else value}{verified}\nunpatched {m}: {grid.roles[1]} = "
                      f"{target:.3f}, {grid.roles[0]} = {source:.3f} (means over {n} samples)")
    what = {"change": f"mean change of {m} (0 = no effect)", "normalised": "normalised (1 = source restored)",
            "score": f"mean {m}"}[value]
    first = {"change": f"{m} - unpatched {grid.roles[1]}", "normalised": "normalised", "score": m}[value]
    donor = "" if grid.donor == "same" else f" (donor {grid.donor})"
    title = (f"patching {grid.roles[0]} -> {grid.roles[1]}{donor}: {first}\nunpatched {m}: {grid.roles[1]} = "
             f"{target:.3f}, {grid.roles[0]} = {source:.3f} (means over {n} samples)")
    return what, title


def _nanmean0(values: np.ndarray) -> np.ndarray:
    """The mean over axis 0 leaving NaN out; NaN, without a warning, where a column holds NaN only."""
    count = (~np.isnan(values)).sum(0)
    total = np.nansum(values, axis=0)
    return np.divide(total, count, out=np.full(total.shape, np.nan), where=count > 0)


def grid_ticks(cap: Captures, grid) -> List[str]:
    """The x tick labels: the first sample's tokens at the positions when the samples share one length."""
    if grid.axis != "position":
        return [str(label) for label in grid.labels]
    return position_ticks(cap, grid.labels)


def position_ticks(cap: Captures, positions) -> List[str]:
    """Tick labels of real positions: "p 'token'" (the first sample's) when the samples share one length."""
    labels = [str(p) for p in positions]
    if "tokens" not in cap.tables():
        return labels
    tokens = cap.tokens()
    lengths = tokens.groupby("sample").size()
    if lengths.nunique() != 1:
        return labels
    first = tokens[tokens["sample"] == tokens["sample"].iloc[0]].set_index("position")["token"]
    return [f"{label} {first[p]!r}" if p in first.index else label
            for label, p in zip(labels, [p if p >= 0 else len(first) + p for p in positions])]


def _label(key) -> str:
    """A legend entry for an array (and call); hookrun's own arrays (_metrics, _patching) as `metrics: ...`, since
    matplotlib hides labels that start with an underscore."""
    hook, layer, role, call = key
    name = f"{hook[1:]}: {layer}/{role}" if hook.startswith("_") else f"{hook}/{layer}/{role}"
    return name + (f" call {call}" if call else "")


MARKERS = "osD^vPX*<>ph"  # one marker per series of batch_stats, drawn hollow: points that coincide stay visible


def batch_stats(cap: Captures, layer=None, role=None, hook=None) -> Figure:
    """Mean, std, min and max of every capture per batch (from the index alone), one line per array and call.
    Each series has its own hollow marker and, when batches are few, its own small x offset within its batch, so
    that series with equal values (one batch, or the source and target metric of an ablation) all show."""
    index = cap.rows(hook=hook, layer=layer, role=role)
    if not len(index):
        raise KeyError(f"no index rows for hook={hook!r}, layer={layer!r}, role={role!r} in {cap.path}"
                       + ("" if len(cap.index) else ": the run captured no arrays (a generate run's completions "
                          "are drawn by plot.generations)"))
    fig = Figure(figsize=(11, 6.5), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).ravel()
    groups = list(index.groupby(["hook", "layer", "role", "call"], sort=False))
    batches = index["batch"].unique()
    offsets = _dodge(len(groups)) if len(batches) <= 12 else np.zeros(len(groups))
    for ax, stat in zip(axes, STATS):
        for k, (key, rows) in enumerate(groups):
            ax.plot(rows["batch"].to_numpy() + offsets[k], rows[stat].to_numpy(), marker=MARKERS[k % len(MARKERS)],
                    markersize=6, markerfacecolor="none", markeredgewidth=1.3, lw=1, label=_label(key),
                    color=f"C{k % 10}")
        ax.set_title(stat, fontsize=10)
        ax.set_xlabel("batch")
        _batch_ticks(ax, batches)
    if len(groups) <= 12:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", fontsize=8,
                   ncols=min(len(groups), 3))
    fig.suptitle(f"per-batch statistics: {cap.path}", fontsize=10)
    return fig


def _dodge(count: int) -> np.ndarray:
    """x offsets of `count` series within a batch: spread over at most 0.5 of the batch's width, centred."""
    if count <= 1:
        return np.zeros(count)
    step = min(0.1, 0.5 / (count - 1))
    return (np.arange(count) - (count - 1) / 2) * step


def _batch_ticks(ax, batches) -> None:
    """x ticks at the batch numbers themselves when there are few (one batch: one tick, not -0.04..0.04)."""
    if len(batches) <= 12:
        ax.set_xticks(sorted(int(b) for b in batches))
        ax.set_xlim(min(batches) - 0.5, max(batches) + 0.5)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def job_stats(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per job and array: mean, std (pooled over batches, weighted by numel), min and max of every capture."""
    df = sweep.assign(_sum=sweep["mean"] * sweep["numel"],
                      _sq=(sweep["std"] ** 2 + sweep["mean"] ** 2) * sweep["numel"])
    out = df.groupby(["job", "hook", "layer", "role", "call"], sort=False).agg(
        numel=("numel", "sum"), _sum=("_sum", "sum"), _sq=("_sq", "sum"), min=("min", "min"), max=("max", "max"))
    out["mean"] = out["_sum"] / out["numel"]
    out["std"] = np.sqrt(np.maximum(out["_sq"] / out["numel"] - out["mean"] ** 2, 0.0))
    return out[list(STATS)].reset_index()


def _job_label(sweep: pd.DataFrame, job: str, swept: List[str]) -> str:
    row = sweep[sweep["job"] == job].iloc[0]
    return f"job {job}: " + ", ".join(f"{k}={row[k]}" for k in swept) if swept else f"job {job}"


def compare(sweep, layer=None, role=None) -> Figure:
    """Bars of each job's statistics per array (see job_stats), labelled with the values the job swept.

    `layer` picks one layer; in a sweep over layers (`-m layers=conv1,pool1`: the other jobs captured another
    layer with the same hook instead) each job's own layer of that hook is compared, and the title says so."""
    sweep = collect(sweep) if not isinstance(sweep, pd.DataFrame) else sweep
    sweep = sweep[(sweep["role"] == role) if role else slice(None)]
    sweep, own = _own_layers(sweep, layer)
    if not len(sweep):
        raise KeyError(f"no captures for layer={layer!r}, role={role!r} in the sweep")
    stats = job_stats(sweep)
    per_job = sweep.groupby("job").first().astype(str)
    varying = [c for c in per_job.columns if c not in _INDEX_AND_JOB and per_job[c].nunique() > 1]  # swept keys
    labels = [f"{_job_label(sweep, r.job, varying)}\n{_label((r.hook, r.layer, r.role, r.call))}"
              for r in stats.itertuples()]
    fig = Figure(figsize=(max(8.0, 1.3 * len(stats) + 3), 7.5), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).ravel()
    x = np.arange(len(stats))
    jobs = list(dict.fromkeys(stats["job"]))
    colors = [f"C{jobs.index(j) % 10}" for j in stats["job"]]  # one colour per job
    for ax, stat in zip(axes, STATS):
        ax.bar(x, stats[stat].to_numpy(), color=colors)
        ax.set_title(stat, fontsize=10)
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
    fig.suptitle("sweep: statistics per job and array" + (f"; each job's own layer of hook {own} (a sweep over "
                                                          "layers)" if own else ""), fontsize=10)
    return fig


def _override_labels(sweep_dir) -> dict:
    """job -> "job J: key=value, ..." of the overrides the sweep's jobs differ in, a dict value (a whole block,
    `+circuit={..}`) as its dotted keys (circuit.method=eap), so that only what was swept is named."""
    def flat(key, value):
        if isinstance(value, dict):
            return {k: v for sub, item in value.items() for k, v in flat(f"{key}.{sub}", item).items()}
        return {key: str(value)}

    jobs = {str(j["job"]): {k: v for key, value in override_columns(j["overrides"]).items()
                            for k, v in flat(key, value).items()} for j in sweep_jobs(sweep_dir)}
    keys = list(dict.fromkeys(k for values in jobs.values() for k in values))
    swept = [k for k in keys if len({values.get(k) for values in jobs.values()}) > 1]
    return {job: f"job {job}: " + ", ".join(f"{k}={values.get(k, '-')}" for k in swept) if swept else f"job {job}"
            for job, values in jobs.items()}


def _own_layers(sweep: pd.DataFrame, layer) -> tuple:
    """(the sweep's rows of `layer`, None), or in a sweep over layers, where some jobs hold `layer` under a hook
    and others another layer under that hook instead, (each job's rows of its own layer of that hook, the hook)."""
    if not layer:
        return sweep, None
    picked = sweep[sweep["layer"] == layer]
    hooks = set(picked["hook"])
    others = sweep[~sweep["job"].isin(set(picked["job"])) & sweep["hook"].isin(hooks)]
    if not len(picked) or not len(others) or any(g["layer"].nunique() != 1 for _, g in others.groupby("job")):
        return picked, None
    rows = pd.concat([picked, others])
    return rows.sort_values("job", key=lambda j: j.map(list(dict.fromkeys(sweep["job"])).index), kind="stable"), \
        ", ".join(sorted(hooks))


_INDEX_AND_JOB = {*INDEX_COLUMNS, "job", "run_dir", "status", "reason"}  # not swept keys: the index's and collect()'s own columns


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)


def write_run(cap: Captures, out: Path, layer: Optional[str] = None, sample: int = 0, unit: int = 0) -> List[Path]:
    """Every picture of one run as PNGs under `out`: stats.png, then per array (per call for a reused module) a
    feature-map grid ([N, C, H, W]) or a heatmap (2-D, 3-D); for a per-token array, document `sample`'s text
    coloured by unit `unit`, its tokens x units heatmap and the unit's top contexts, or its attention per head.
    A patching, attribution, lens or circuit run also gets its method's pictures (circuit: plots.circuit.pictures)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Figure, name: str) -> None:
        path = out / name
        fig.savefig(path, dpi=100)
        written.append(path)

    if len(cap.rows(layer=layer)):
        save(batch_stats(cap, layer=layer), "stats.png")
    if layer is None and _generated(cap):
        save(completions(cap), "completions.png")
    if PATCHING_ATTR in cap.attrs and layer is None:
        save(patching_grid(cap), "patching.png")
    if "attribution" in cap.attrs and layer is None:
        save(patching_grid(cap, method="attribution"), "attribution.png")
    if LENS_ATTR in cap.attrs and layer is None:
        for fig, name in _lens.pictures(cap):
            save(fig(), name)
    if CIRCUIT_ATTR in cap.attrs and layer is None:
        for fig, name in _circuit.pictures(cap):
            save(fig(), _safe(name))
    if "train" in cap.attrs and layer is None:
        save(_train.curves(cap), "train.png")
    for (hook, lay, role, call), rows in cap.rows(layer=layer).groupby(["hook", "layer", "role", "call"], sort=False):
        if hook.startswith("_") or not bool(rows["per_sample"].iloc[0]):
            continue  # metrics and the patching grid (patching.png, cap.samples); per-batch records: in stats.png
        call_arg = int(call) if cap.rows(hook=hook, layer=lay, role=role)["call"].nunique() > 1 else None
        stem = _stem(hook, lay, role, call_arg)
        where = dict(layer=lay, role=role, hook=hook, call=call_arg)
        for fig, name in _pictures(cap, rows, where, stem, sample, unit):
            save(fig(), name)
    if not written:
        raise KeyError(f"nothing to draw in {cap.path}: " + (f"no captures of layer {layer!r}" if layer else
                                                            "it captured no arrays and generated nothing"))
    return written


def _generated(cap: Captures) -> bool:
    try:
        cap.generations()
    except KeyError:
        return False
    return True


def write_sweep(sweep_dir, out: Path, layer: Optional[str] = None) -> List[Path]:
    """The pictures of a sweep under `out`: compare.png (the jobs' captures, when they captured any), for a
    generate sweep generations.png (plot.steering: its completions per swept value), for a sweep of circuit runs
    circuits.png (plots.circuit.faithfulness_per_job: each job's circuits' faithfulness, labelled by what it swept),
    for a training sweep frontier.png (plots.train.frontier: L0 against variance explained, a point a job)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    index = collect(sweep_dir)  # a row a job at least (its status), a row a capture where it captured
    if "array" in index.columns and index["array"].notna().any():
        compare(index, layer=layer).savefig(out / "compare.png", dpi=100)
        written.append(out / "compare.png")
    try:
        generated = collect(sweep_dir, generations=True)
    except KeyError:
        generated = None
    if generated is not None and generated["job"].nunique() > 1:
        steering(generated).savefig(out / "generations.png", dpi=100)
        written.append(out / "generations.png")
    jobs = collect(sweep_dir, with_index=False)
    if jobs.filter(like="train.l0").notna().any().any():  # a training sweep: the L0 / variance explained frontier
        _train.frontier(jobs).savefig(out / "frontier.png", dpi=100)
        written.append(out / "frontier.png")
    circuits = _circuit.sweep_circuits(sweep_dir)
    if len(circuits):
        _circuit.faithfulness_per_job(circuits, _override_labels(sweep_dir)).savefig(out / "circuits.png", dpi=100)
        written.append(out / "circuits.png")
    if not written:
        raise KeyError(f"nothing to draw in {sweep_dir}: its jobs captured no arrays and generated nothing")
    return written


def _stem(hook: str, layer: str, role: str, call: Optional[int]) -> str:
    """The file name stem of an array's pictures: hook-layer-role[-callN], a part that repeats the one before it
    left out (hook conv1 on layer conv1: conv1-output)."""
    parts = [hook, layer, role] + ([f"call{call}"] if call is not None else [])
    return _safe("-".join(p for i, p in enumerate(parts) if p not in parts[:i]))


def _pictures(cap: Captures, rows: pd.DataFrame, where: dict, stem: str, sample: int, unit: int) -> list:
    """(figure maker, file name) of each picture of one array (see write_run): `<stem>.png` for its one feature-map
    grid or heatmap, `<stem>-<picture>-....png` for the several pictures of a per-token array."""
    ndim = cap.array(rows["array"].iloc[0]).ndim
    if _per_token(rows) and _tokens.is_attention(cap, rows):
        return [(lambda: attention(cap, sample=sample, **where), f"{stem}-attention-sample{sample}.png")]
    if _per_token(rows):
        return [(lambda: text(cap, sample=sample, unit=unit, **where), f"{stem}-text-sample{sample}-unit{unit}.png"),
                (lambda: heatmap(cap, sample=sample, **where), f"{stem}-heatmap-sample{sample}.png"),
                (lambda: top_contexts(cap, unit=unit, **where), f"{stem}-top-unit{unit}.png")]
    if ndim == 4:
        return [(lambda: feature_maps(cap, sample=sample, **where), f"{stem}.png")]
    if ndim in (2, 3):
        return [(lambda: heatmap(cap, sample=sample, **where), f"{stem}.png")]
    return []


def main(argv=None) -> int:
    """`python -m hookrun.plot RUN_DIR [--layer L] [--sample 0] [--out DIR]`: write PNGs, print their paths."""
    parser = argparse.ArgumentParser(prog="python -m hookrun.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run dir (or its captures.zarr), or a sweep dir for compare.png")
    parser.add_argument("--layer", help="only this layer (default: every captured layer)")
    parser.add_argument("--sample", type=int, default=0, help="the stored sample (row) to draw (default 0)")
    parser.add_argument("--unit", type=int, default=0, help="the unit of a per-token array to colour text by "
                        "and find top contexts of (default 0)")
    parser.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    run_dir = args.run_dir  # a path, or a URL of a remote run
    out = Path(args.out) if args.out else (Path("plots") if is_url(run_dir) else Path(run_dir) / "plots")
    try:
        store = find_store(run_dir)
    except FileNotFoundError:
        store = None
    try:
        if store is None:
            written = write_sweep(run_dir, out, layer=args.layer)
        else:
            written = write_run(Captures(store), out, layer=args.layer, sample=args.sample, unit=args.unit)
    except (KeyError, ValueError, IndexError, FileNotFoundError) as err:
        print(f"hookrun.plot: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
