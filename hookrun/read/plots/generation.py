"""Pictures of generate runs: one run's completions as a table image, and a sweep's completions measured against
the swept value (a steering coefficient).

    from hookrun import plot
    plot.completions(cap)                                     # prompt | completion | stop reason | new tokens
    plot.steering(hookrun.collect(SWEEP_DIR, generations=True))             # words, distinct words, tokens per coef
    plot.steering(sweep, words={"happy": {"great", "nice"}, "sad": {"bad"}})  # the fraction of words in each set
"""
from __future__ import annotations

import textwrap
from typing import Dict, Iterable, List, Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from hookrun.format.layout import GENERATION_COLUMNS

WIDTHS = {"sample": 6, "prompt": 28, "completion": 60, "stop reason": 11, "new tokens": 10}  # characters a column
_NOT_SWEPT = {*GENERATION_COLUMNS, "job", "run_dir", "status"}


def words(text: str) -> List[str]:
    """A completion's words: its whitespace-separated pieces that hold a letter or digit, lower-cased."""
    return [w.lower() for w in str(text).split() if any(ch.isalnum() for ch in w)]


def completions(cap_or_table, max_rows: int = 24) -> Figure:
    """A generate run's completions as a table image, a row a sample (the first `max_rows`): sample, prompt,
    completion (wrapped), stop reason (eos | stop | length) and new tokens. Takes a run's Captures or its
    cap.generations() table."""
    table = cap_or_table if isinstance(cap_or_table, pd.DataFrame) else cap_or_table.generations()
    shown = table.head(max_rows)
    cells = [[str(r.sample), *_wrapped(r.prompt, WIDTHS["prompt"]), *_wrapped(r.completion, WIDTHS["completion"]),
              str(r.stop_reason), str(r.new_tokens)] for r in shown.itertuples()]
    heights = [max(c.count("\n") + 1 for c in row) for row in cells]
    total = sum(heights) + 1
    fig = Figure(figsize=(sum(WIDTHS.values()) * 0.085 + 0.4, 0.2 * total + 0.9))
    ax = fig.add_axes([0.01, 0.01, 0.98, 1 - 0.6 / (0.2 * total + 0.9)])
    ax.set_axis_off()
    widths = np.array(list(WIDTHS.values()), dtype=float)
    out = ax.table(cellText=cells, colLabels=list(WIDTHS), colWidths=list(widths / widths.sum()), loc="upper left",
                   cellLoc="left", bbox=[0, 0, 1, 1])
    out.auto_set_font_size(False)
    for (row, col), cell in out.get_celld().items():
        cell.set_fontsize(8)
        cell.PAD = 0.8 / list(WIDTHS.values())[col]  # matplotlib pads a tenth of the cell's width: a character here
        cell.get_text().set_family("monospace")
        cell.set_height((1 if row == 0 else heights[row - 1]) / total)
        if row == 0:
            cell.set_facecolor("0.88")
            cell.get_text().set_weight("bold")
    more = f" (the first {len(shown)} of {len(table)})" if len(shown) < len(table) else ""
    where = "" if isinstance(cap_or_table, pd.DataFrame) else f": {cap_or_table.path}"
    fig.suptitle(f"completions{more}{where}", fontsize=10, x=0.01, ha="left")
    return fig


def _wrapped(text: str, width: int) -> List[str]:
    return ["\n".join(textwrap.wrap(str(text).strip().replace("\n", "\u23ce"), width) or [""])]


def swept_key(frame: pd.DataFrame) -> str:
    """The column a sweep varies (an override column with more than one value), numeric ones first; "job" when
    there is none; KeyError when there are several (then the caller names one with key=)."""
    per_job = frame.groupby("job").first()
    varying = [c for c in per_job.columns if c not in _NOT_SWEPT and not c.startswith("metrics.")
               and per_job[c].astype(str).nunique() > 1]
    numeric = [c for c in varying if pd.api.types.is_numeric_dtype(per_job[c])]
    found = numeric or varying
    if not found:
        return "job"  # jobs that recorded no overrides: one point a job
    if len(found) != 1:
        raise KeyError(f"the sweep varies {', '.join(varying) or 'no override'}; name the key to draw against with "
                       "key=")
    return found[0]


def per_value(frame: pd.DataFrame, key: str, sets: Optional[Dict[str, Iterable[str]]] = None) -> pd.DataFrame:
    """Per value of `key` (the index, sorted): `new tokens` and `words` (the mean per completion), `distinct words`
    (the mean fraction of a completion's words that differ: repetition lowers it) and, per set of `sets`, the
    fraction of all completion words in it; the metric columns collect added (the mean over the jobs of a value)."""
    sets = {name: frozenset(w.lower() for w in ws) for name, ws in (sets or {}).items()}
    metrics = [c for c in frame.columns if c not in _NOT_SWEPT and c != key and frame.groupby("job")[c].nunique()
               .le(1).all() and pd.api.types.is_float_dtype(frame[c])]

    def measure(group: pd.DataFrame) -> pd.Series:
        split = [words(t) for t in group["completion"]]
        every = [w for ws in split for w in ws]
        out = {"new tokens": group["new_tokens"].mean(), "words": np.mean([len(ws) for ws in split]),
               "distinct words": np.mean([len(set(ws)) / len(ws) if ws else np.nan for ws in split])}
        out.update({f"{name} words": sum(w in ws for w in every) / max(len(every), 1) for name, ws in sets.items()})
        out.update({m: group[m].mean() for m in metrics})
        return pd.Series(out)

    return frame.groupby(key, sort=True)[[c for c in frame.columns if c != key]].apply(measure)


def steering(sweep, key: Optional[str] = None, words: Optional[Dict[str, Iterable[str]]] = None) -> Figure:
    """A generate sweep's completions measured per swept value (`key`, default the one override the jobs vary, e.g.
    hooks.steer.edit.0.coef): left, the fraction of completion words in each set of `words` (or, without sets, the
    mean words per completion) and the run's metrics; right, the mean new tokens and the fraction of distinct
    words per completion (repetition, when a steer overshoots, lowers it). `sweep`: a sweep dir, or
    hookrun.collect(SWEEP_DIR, generations=True)."""
    from hookrun.read.captures import collect

    frame = sweep if isinstance(sweep, pd.DataFrame) else collect(sweep, generations=True)
    if "completion" not in frame.columns:
        raise KeyError("plot.steering draws completions: pass hookrun.collect(SWEEP_DIR, generations=True)")
    key = key or swept_key(frame)
    table = per_value(frame, key, words)
    x = table.index.to_numpy()
    if not pd.api.types.is_numeric_dtype(table.index):
        x = np.arange(len(table))
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    firsts = [c for c in table.columns if c.endswith(" words") and c not in ("distinct words",)] or ["words"]
    firsts += [c for c in table.columns if c not in ("new tokens", "words", "distinct words") and c not in firsts]
    for k, column in enumerate(firsts):
        left.plot(x, table[column].to_numpy(), marker="osD^v"[k % 5], label=column)
    left.set_ylabel("fraction of completion words" if words else "per completion (mean)")
    ax2 = right.twinx()
    right.plot(x, table["new tokens"].to_numpy(), marker="o", color="C0", label="new tokens")
    ax2.plot(x, table["distinct words"].to_numpy(), marker="s", color="C3", label="distinct words")
    right.set_ylabel("new tokens per completion (mean)", color="C0")
    ax2.set_ylabel("distinct / all words per completion (mean)", color="C3")
    ax2.set_ylim(0, 1.05)
    right.set_ylim(0, max(1.0, float(np.nanmax(table["new tokens"]))) * 1.1)
    for ax in (left, right):
        ax.set_xlabel(key)
        if not pd.api.types.is_numeric_dtype(table.index):
            ax.set_xticks(x, [str(v) for v in table.index])
        else:
            ax.set_xticks(x)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.legend(handles=right.lines + ax2.lines, fontsize=8, loc="lower center")
    jobs = frame["job"].nunique()
    fig.suptitle(f"completions per {key} ({jobs} jobs, {len(frame)} completions)", fontsize=10)
    return fig
