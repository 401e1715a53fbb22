"""feature_circuit analysis: a circuit run's dictionary features (circuit.features), the features that carry the
metric most over the pairs, the error node beside them, and the estimates against the exact one-feature patches.

    python -m hookrun +experiment=feature_circuit hydra.run.dir=runs/feature_circuit
    python -m hookrun.experiments.feature_circuit runs/feature_circuit

A feature's mean score is over every pair, counting 0 where it is not among the pair's stored top_k (so a lower
bound of its size where it is often left out); `pairs` says in how many pairs' top_k it is.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from hookrun.experiments._cli import open_run


def summary(res, top: int = 8) -> dict:
    """The numbers the docs quote, printed: the gap, the top features, the error node, estimate against exact."""
    f = res.features
    meta = res.attrs["features"]
    n = len(res.source)
    gap = float(np.mean(res.source - res.target))
    by = f.groupby("node", sort=False)
    table = pd.DataFrame({"feature": by.feature.first(), "pairs": by.size(), "score": by.score.sum() / n,
                          "exact": by.exact.mean(), "verified": by.exact.count()})
    table = table.reindex(table.score.abs().sort_values(ascending=False, kind="stable").index)
    stored = float(f.groupby("sample").score.sum().mean())
    verified = f[f.exact.notna() & (f.node != "error")]
    corr = float(np.corrcoef(verified.score, verified.exact)[0, 1]) if len(verified) > 1 else float("nan")
    error = table.loc["error"]
    print(f"{res!r}\n\n{res.attrs['metric']}: clean {res.source.mean():.3f}, corrupt {res.target.mean():.3f}, gap "
          f"{gap:.3f} (mean over {n} pairs); features of {meta['dictionary']} at {meta['layer']} ({meta['d_sae']} "
          f"features), {meta['method']}" + (f" with {meta['steps']} steps" if meta["steps"] else ""))
    print(f"\nthe {top} largest nodes by |mean score| (score: mean over the {n} pairs, 0 where not stored; exact: "
          "mean where patched alone):")
    print(table.head(top).to_string(float_format=lambda v: f"{v:.3f}"))
    print(f"\nerror node: score {error.score:.3f}, exact {error.exact:.3f}; a pair's stored {meta['top_k']} features "
          f"+ error node sum to {stored:.3f} on average, {stored / gap:.3f} of the gap")
    print(f"estimate against exact over the {len(verified)} verified (pair, feature) cells: Pearson {corr:.3f}, mean "
          f"|estimate - exact| {float(np.mean(np.abs(verified.score - verified.exact))):.3f}")
    return {"gap": gap, "top": table.index[0], "top_score": float(table.score.iloc[0]), "error": float(error.score),
            "covered": stored / gap, "corr": corr}


def main(argv=None):
    summary(open_run(argv).read("circuit"))


if __name__ == "__main__":
    main()
