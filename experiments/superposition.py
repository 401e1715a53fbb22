"""The toy model of superposition (Elhage et al. 2022; Sharkey et al. 2022's synthetic data), and what a dictionary
trained on it by the `train:` block recovers (conf/experiment/superposition.yaml, docs/training.md).

    python -m hookrun +experiment=superposition hydra.run.dir=runs/superposition   # trains runs/superposition/sae
    python -m hookrun.experiments.superposition runs/superposition                  # recovery, and the picture

`n_features` sparse features (each on with probability `p`, its size uniform in [0, 1)) are mixed by fixed unit
directions into a `d`-dimensional space (d < n_features: in superposition). The model's `mix` output is the site;
an SAE trained on it recovers a planted direction when one of its decoder rows points the same way: the mean over
the planted directions of the best cosine similarity with any decoder row (1: every one found).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn


def directions(n_features: int = 32, d: int = 16, seed: int = 0) -> torch.Tensor:
    """The planted directions [n_features, d], unit rows, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_features, d, generator=g)
    return w / w.norm(dim=1, keepdim=True)


class Superposition(nn.Module):
    """features [batch, n_features] -> mix [batch, d]: the sum of each feature's size times its direction."""

    def __init__(self, n_features: int = 32, d: int = 16, seed: int = 0):
        super().__init__()
        self.mix = nn.Linear(n_features, d, bias=False)
        with torch.no_grad():
            self.mix.weight.copy_(directions(n_features, d, seed).T)
        self.mix.weight.requires_grad_(False)

    def forward(self, features):
        return self.mix(features)


class SparseFeatures(torch.utils.data.Dataset):
    """`n` samples of `n_features` sparse feature sizes: each on with probability p, uniform in [0, 1) when on."""

    def __init__(self, n: int = 65536, n_features: int = 32, p: float = 0.05, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        on = torch.rand(n, n_features, generator=g) < p
        self.items = torch.rand(n, n_features, generator=g) * on

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def recovery(decoder: torch.Tensor, planted: torch.Tensor) -> torch.Tensor:
    """Each planted direction's best cosine similarity with a decoder row [n_features]."""
    rows = decoder / decoder.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return (planted @ rows.T).max(dim=1).values


def main(argv=None):
    from hookrun.methods.saes import load_saelens
    import hookrun

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m hookrun.experiments.superposition RUN_DIR")
    run = Path(argv[0])
    cap = hookrun.open(run)
    model_cfg = cap.config["model"]
    planted = directions(model_cfg.get("n_features", 32), model_cfg.get("d", 16), model_cfg.get("seed", 0))
    sae = load_saelens(cap.attrs["train"]["out"][0])   # the folder the run wrote (out: null: RUN_DIR/sae)
    best = recovery(sae.W_dec.detach().double(), planted.double())
    print(f"planted features: {len(planted)} in {planted.shape[1]} dimensions; SAE of {sae.d_sae} features")
    print(f"mean max cosine similarity: {float(best.mean()):.4f} (min {float(best.min()):.4f})")
    final = cap.read("train", "final")
    print(final[["site", "step", "l0", "explained_variance", "dead_features"]].to_string(index=False))
    picture(cap, best, run / "superposition.png")
    print(f"picture: {run / 'superposition.png'}")
    return {"mean_max_cos": float(best.mean()), "min_max_cos": float(best.min())}


def picture(cap, best: torch.Tensor, path: Path) -> Path:
    """The training curves (MSE, the dead fraction) and each planted feature's best cosine similarity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = cap.read("train")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    axes[0].plot(curves["step"], curves["mse"])
    axes[0].set(title="reconstruction error", xlabel="step", ylabel="MSE (summed over d)", yscale="log")
    axes[1].plot(curves["step"], curves["dead_fraction"])
    axes[1].set(title="dead features (AuxK revives them)", xlabel="step", ylabel="fraction of the SAE's features",
                ylim=(0, max(0.05, float(curves["dead_fraction"].max()) * 1.1)))
    order = np.sort(best.numpy())[::-1]
    axes[2].bar(np.arange(len(order)), order, color="tab:green")
    axes[2].set(title=f"planted directions found (mean {order.mean():.4f})", xlabel="planted feature (sorted)",
                ylabel="best cosine with a decoder row", ylim=(min(0.98, float(order.min()) - 0.005), 1.0005))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
