"""Feature attribution at a site read through a dictionary (a sparse autoencoder): each feature and the
dictionary's error term as nodes (Marks et al. 2024), scored by AtP or integrated gradients, kept sparse (each
sample's top features), checked by patching one feature at a time; plain torch functions usable without a run.

    s = feature_scores(model, "blocks.0", sae, clean, corrupt, metric)            # AtP: s.scores [B, d_sae], s.error
    s = feature_scores(model, "blocks.0", sae, clean, corrupt, metric, method="ig", steps=32)
    ids, vals = s.top(8)                                                            # [B, 8] each: the sparse form
    exact = patch_features(model, "blocks.0", sae, clean, corrupt, [3, 17], metric)   # [B, 2]

At the site the activation x is written x = decode(f) + e, f = encode(x), e the error term. AtP:
score_i = sum over positions of (f_source - f_target)_i * dM/df_i on the target run (dM/df_i = dM/dx . W_dec[i]),
error = sum (e_source - e_target) . dM/de. IG (method "ig"): the gradients averaged over x = x_target + alpha
(x_source - x_target), f and e interpolated together, alpha = (k + 0.5) / steps: the scores and the error then sum
to the exact effect of patching the whole site (completeness). One feature's exact patch: the target run with
(f_source - f_target)_i W_dec[i] added at the site at every position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Tuple

import torch
from torch import nn

from hookrun.capture.anatomy import anatomy
from hookrun.methods.metrics import logits_of

FEATURE_METHODS = ("atp", "ig")


@dataclass
class FeatureScores:
    """One batch's feature attribution: `scores` [B, d_sae] and `error` [B] (the error node's), the estimated change
    of the metric when the feature (the error term) is patched target -> source; `source`, `target` [B]."""

    scores: torch.Tensor
    error: torch.Tensor
    source: torch.Tensor
    target: torch.Tensor

    def top(self, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """([B, k] feature ids, [B, k] scores) of each sample's k largest |scores|: what a store keeps."""
        ids = self.scores.abs().topk(min(k, self.scores.shape[1]), dim=1).indices
        return ids, self.scores.gather(1, ids)


def _site(model: nn.Module, site: str):
    point = anatomy(model).point(site, "circuit.features.site")
    return point, dict(model.named_modules())[point.module]


def _run(model, site, inputs, metric, edit=None, grad=False):
    """(metric [N], the site's activation [N, T, D]) of one forward; edit(x) -> new x at the site."""
    point, module = _site(model, site)
    kept = {}

    def hook(m, args, out):
        x = point.get(point.read(args, {}, out))
        new = edit(x) if edit is not None else None
        kept["x"] = x.detach()
        return None if new is None else point.write(args, {}, out, point.put(point.read(args, {}, out), new))
    h = module.register_forward_hook(hook)
    try:
        with torch.set_grad_enabled(grad):
            logits = logits_of(model(**inputs))
            rows = torch.arange(inputs["input_ids"].shape[0], device=logits.device)
            return metric(logits, rows), kept["x"]
    finally:
        h.remove()


def feature_scores(model: nn.Module, site: str, dictionary, source: dict, target: dict, metric: Callable, *,
                   method: str = "atp", steps: int = 16) -> FeatureScores:
    """Each feature's and the error term's score at `site` (a standard name whose value the dictionary reads;
    see the module's docstring)."""
    if method not in FEATURE_METHODS:
        raise ValueError(f"circuit.features.method: {method!r} is not one of {', '.join(FEATURE_METHODS)}")
    m_s, x_s = _run(model, site, source, metric)
    m_t, x_t = _run(model, site, target, metric)
    with torch.no_grad():
        f_s, f_t = dictionary.encode(x_s), dictionary.encode(x_t)
        e_s, e_t = x_s - dictionary.decode(f_s), x_t - dictionary.decode(f_t)
    alphas = [0.0] if method == "atp" else [(k + 0.5) / steps for k in range(steps)]
    g_f, g_e = torch.zeros_like(f_t), torch.zeros_like(e_t)
    for alpha in alphas:
        f = (f_t + alpha * (f_s - f_t)).detach().requires_grad_(True)
        e = (e_t + alpha * (e_s - e_t)).detach().requires_grad_(True)
        with torch.inference_mode(False), torch.enable_grad():
            value, _ = _run(model, site, target, metric, edit=lambda x: (dictionary.decode(f) + e).to(x.dtype),
                            grad=True)
            gf, ge = torch.autograd.grad(value.float().sum(), [f, e])
        g_f += gf
        g_e += ge
    n = len(alphas)
    scores = ((f_s - f_t) * g_f / n).sum(1)  # [B, d_sae]: summed over positions
    error = ((e_s - e_t) * g_e / n).sum((1, 2))
    return FeatureScores(scores.detach().float().cpu(), error.detach().float().cpu(), m_s.detach().float().cpu(),
                         m_t.detach().float().cpu())


def patch_features(model: nn.Module, site: str, dictionary, source: dict, target: dict, features: Sequence[int],
                   metric: Callable) -> torch.Tensor:
    """[B, K]: the target run's metric with feature features[k] alone patched source -> target at every position
    (its decoder direction times the change of its activation added at the site), one forward per feature."""
    _, x_s = _run(model, site, source, metric)
    _, x_t = _run(model, site, target, metric)
    with torch.no_grad():
        change = dictionary.encode(x_s) - dictionary.encode(x_t)
        w = dictionary.W_dec
        out = []
        for i in features:
            add = change[..., i, None] * w[i]
            value, _ = _run(model, site, target, metric, edit=lambda x, add=add: x + add.to(x.dtype))
            out.append(value.float().cpu())
    return torch.stack(out, 1)
