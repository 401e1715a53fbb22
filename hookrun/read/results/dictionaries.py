"""The readers of dictionary features and evaluations: cap.read("dictionaries", ...). Needs numpy and pandas, not
torch.

    cap.read("dictionaries")                                             # the evaluations, a row a hook and layer
    acts = cap.read("dictionaries", "features", hook="feats", features=[12, 40])   # dense [tokens, 2] float32
    cap.read("dictionaries", "top", feature=12, hook="feats", k=10)      # a feature's top contexts
    densify(indices, values, d_sae, features=[17, 3])                    # any stored indices/values pair, dense
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from hookrun.read.checks import warn_nonfinite

SUMS = ("tokens", "l0", "l1", "mse", "sum_sq", "cossim")   # eval.sums: these, then x_sum [d_in], fired [d_sae]
# (a transcoder's: x_sum of the output site, [d_out])
CE = ("pairs", "clean", "spliced", "zero")                 # eval.ce: predicted tokens, summed losses


def read(cap, what: str = "evaluations", **kwargs):
    """cap.read("dictionaries") the evaluations table; ("dictionaries", "features", hook=, features=[...]) the
    chosen features dense; ("dictionaries", "top", feature=F, hook=) a feature's top contexts (cap.top)."""
    readers = {"evaluations": evaluations, "features": features, "top": top}
    if what not in readers:
        raise KeyError(f"cap.read('dictionaries', {what!r}): read one of {', '.join(readers)}")
    return readers[what](cap, **kwargs)


def densify(indices: np.ndarray, values: np.ndarray, d_sae: int, features: Optional[Sequence[int]] = None) -> np.ndarray:
    """Dense features [n, d_sae] from sparse (indices, values) [n, k] as stored (index -1: nothing), numpy; with
    `features`, only those columns [n, len(features)], in that order (hookrun.methods.saes.densify: torch).

        acts = densify(idx, val, 24, features=[17, 3])   # feature 17's and 3's activation per row
    """
    idx, val = np.asarray(indices).astype(np.int64), np.asarray(values)
    if idx.shape != val.shape or idx.ndim != 2:
        raise ValueError(f"densify: indices {tuple(idx.shape)} and values {tuple(val.shape)} must be one [n, k]")
    bad = (idx < -1) | (idx >= d_sae)
    if bad.any():
        raise ValueError(f"densify: index {int(idx[bad][0])} is out of range for d_sae={d_sae}")
    cols = np.arange(d_sae) if features is None else np.asarray(list(features), dtype=np.int64)
    if cols.size and (cols.min() < 0 or cols.max() >= d_sae):
        raise ValueError(f"densify: features {list(features)} must be in 0..{d_sae - 1}")
    if features is not None:  # each chosen column on its own: no [n, d_sae] array for a few features
        out = np.zeros((idx.shape[0], len(cols)), dtype=val.dtype)
        for j, f in enumerate(cols.tolist()):
            out[:, j] = np.where(idx == f, val, 0).sum(1, dtype=val.dtype)
        return out
    n, width = idx.shape[0], d_sae + 1   # column d_sae takes the fills, then is dropped
    flat = (np.arange(n)[:, None] * width + np.where(idx >= 0, idx, d_sae)).ravel()
    dense = np.bincount(flat, weights=np.where(idx >= 0, val, 0).ravel(), minlength=n * width)
    return dense.reshape(n, width)[:, :d_sae].astype(val.dtype)


def ce_loss_recovered(clean, spliced, zero_ablated) -> float:
    """SAELens's ce_loss_score: (zero_ablated - spliced) / (zero_ablated - clean), from the model's mean
    next-token losses clean, with the reconstruction spliced in, and with the layer zero-ablated. 1: nothing
    lost; 0: as bad as zeroing the layer; NaN when zero ablation costs nothing (nothing to recover)."""
    clean, spliced, zero = (float(v) for v in (clean, spliced, zero_ablated))
    if zero == clean:
        return math.nan
    return (zero - spliced) / (zero - clean)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _use(cap, hook: Optional[str] = None, layer: Optional[str] = None) -> Tuple[str, str, dict]:
    """(hook, layer, its attrs) of a dictionary hook of the run: the one there is, or the one named."""
    uses = cap.attrs.get("dictionaries") or {}
    if not uses:
        raise KeyError(f"{cap.path} holds no dictionary features: its run had no hook with dictionary:")
    if hook is None and len(uses) > 1:
        raise KeyError(f"several hooks hold dictionary features ({', '.join(uses)}); name one with hook=")
    hook = hook if hook is not None else next(iter(uses))
    if hook not in uses:
        raise KeyError(f"hook {hook!r} holds no dictionary features; these do: {', '.join(uses)}")
    meta = uses[hook]
    layers = meta["layers"]
    if layer is None and len(layers) > 1:
        raise KeyError(f"hooks.{hook} reads several layers ({', '.join(layers)}); name one with layer=")
    layer = layer if layer is not None else layers[0]
    if layer not in layers:
        raise KeyError(f"hooks.{hook} does not read layer {layer!r}; it reads {', '.join(layers)}")
    return hook, layer, meta


def _features_in_range(chosen, meta: dict, hook: str) -> List[int]:
    chosen = [chosen] if _is_int(chosen) else list(chosen)
    d_sae = meta["d_sae"]
    bad = [f for f in chosen if not (_is_int(f) and 0 <= f < d_sae)]
    if bad:
        raise ValueError(f"feature {bad[0]!r} is out of range: hooks.{hook}'s dictionary {meta['dictionary']} has "
                         f"{d_sae} features (0..{d_sae - 1})")
    return chosen


def features(cap, features, hook: Optional[str] = None, layer: Optional[str] = None,
             call: Optional[int] = None) -> np.ndarray:
    """The chosen features dense, [stored tokens (rows), len(features)] float32, row i of cap.tokens() (or of the
    samples, without text); a feature that did not fire (or was not among a token's top_k) is 0.

        acts = cap.read("dictionaries", "features", hook="sae", features=[17, 3])
    """
    hook, layer, meta = _use(cap, hook, layer)
    chosen = _features_in_range(features, meta, hook)
    idx = cap.load(hook=hook, layer=layer, role="features.indices", call=call)
    val = cap.load(hook=hook, layer=layer, role="features.values", call=call)
    warn_nonfinite("cap.read('dictionaries', 'features')", {f"{hook}/{layer} features.values": val})
    return densify(idx, val, meta["d_sae"], chosen)


def top(cap, feature: int, hook: Optional[str] = None, layer: Optional[str] = None, k: int = 10, context: int = 5,
        call: Optional[int] = None):
    """A feature's k largest activations with their tokens and `context` tokens each side (cap.top(feature=F)):
    value, sample, position, token, context."""
    hook, layer, meta = _use(cap, hook, layer)
    feature = _features_in_range(feature, meta, hook)[0]
    lookup = cap.token_rows(hook=hook, layer=layer, role="features.indices", call=call)
    stop = int(lookup["row"].max()) + 1
    idx = cap.read_rows(f"{hook}/{layer}/features.indices", slice(0, stop))
    val = cap.read_rows(f"{hook}/{layer}/features.values", slice(0, stop))
    acts = densify(idx, val, meta["d_sae"], [feature])[:, 0]
    return cap.top_of(acts[lookup["row"].to_numpy()], k, context)


def evaluations(cap):
    """SAELens's evaluations of each layer read through a dictionary with `evaluate: true`, a row each: hook, layer,
    dictionary, tokens, l0, l1, mse (summed over d_in, SAELens's), explained_variance, cossim, dead_features,
    ce_clean, ce_spliced, ce_zero (mean next-token losses) and ce_loss_recovered."""
    rows = []
    for hook, meta in (cap.attrs.get("dictionaries") or {}).items():
        if not meta.get("evaluate"):
            continue
        for layer in meta["layers"]:
            if not len(cap.rows(hook=hook, layer=layer, role="eval.sums")):
                continue
            sums = cap.load(hook=hook, layer=layer, role="eval.sums").astype(np.float64).sum(0)
            n, d_in = sums[0], meta.get("d_out") or meta["d_in"] or (len(sums) - len(SUMS) - meta["d_sae"])
            head = dict(zip(SUMS, sums[:len(SUMS)]))
            x_sum, fired = sums[len(SUMS):len(SUMS) + d_in], sums[len(SUMS) + d_in:]
            variance = head["sum_sq"] / n - float(((x_sum / n) ** 2).sum())
            mse = head["mse"] / n
            row = dict(hook=hook, layer=layer, dictionary=meta["dictionary"], tokens=int(n), l0=head["l0"] / n,
                       l1=head["l1"] / n, mse=mse, explained_variance=1.0 - mse / variance if variance > 1e-10 else
                       math.nan, cossim=head["cossim"] / n, dead_features=int((fired == 0).sum()))
            ce = cap.load(hook=hook, layer=layer, role="eval.ce").astype(np.float64).sum(0)
            warn_nonfinite("cap.read('dictionaries')", {f"{hook}/{layer} eval.sums": sums, f"{hook}/{layer} eval.ce": ce})
            clean, spliced, zero = (ce[j] / ce[0] for j in (1, 2, 3))
            row.update(ce_clean=clean, ce_spliced=spliced, ce_zero=zero,
                       ce_loss_recovered=ce_loss_recovered(clean, spliced, zero))
            rows.append(row)
    return pd.DataFrame(rows, columns=["hook", "layer", "dictionary", "tokens", "l0", "l1", "mse",
                                       "explained_variance", "cossim", "dead_features", "ce_clean", "ce_spliced",
                                       "ce_zero", "ce_loss_recovered"])
