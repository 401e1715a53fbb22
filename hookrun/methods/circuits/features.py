"""Feature attribution at a site read through a dictionary (a sparse autoencoder): each feature and the
dictionary's error term as nodes (Marks et al. 2024), scored by AtP or integrated gradients, kept sparse (each
sample's top features), checked by patching one feature at a time; plain torch functions usable without a run
(the `circuit.features` block runs them a batch: hookrun.methods.circuits).

    s = feature_scores(model, "blocks.0", sae, clean, corrupt, metric)            # AtP: s.scores [B, d_sae], s.error
    s = feature_scores(model, "blocks.0", sae, clean, corrupt, metric, method="ig", steps=32)
    ids, vals = s.top(8)                                                            # [B, 8] each: the sparse form
    exact = patch_features(model, "blocks.0", sae, clean, corrupt, [3, 17], metric)   # [B, 2]: the metric patched
    exact = patch_features(model, "blocks.0", sae, clean, corrupt, ids[:, :2], metric)  # each sample its own ids
    err = patch_error(model, "blocks.0", sae, clean, corrupt, metric)                # [B]: the error term patched

At the site the activation x is written x = decode(f) + e, f = encode(x), e the error term. AtP:
score_i = sum over positions of (f_source - f_target)_i * dM/df_i on the target run (dM/df_i = dM/dx . W_dec[i]),
error = sum (e_source - e_target) . dM/de. IG (method "ig"): the gradients averaged over x = x_target + alpha
(x_source - x_target), f and e interpolated together, alpha = (k + 0.5) / steps: the scores and the error then sum
to the exact effect of patching the whole site (completeness). One feature's exact patch: the target run with
(f_source - f_target)_i W_dec[i] added at the site at every position; the error term's: e_source - e_target added.
`valid` [B, T] (both runs' real tokens): the changes count there only (0 at padding).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hookrun.capture.anatomy import anatomy
from hookrun.capture.scope import HookScope
from hookrun.methods.metrics import logits_of

FEATURE_METHODS = ("atp", "ig")


@dataclass
class FeatureScores:
    """One batch's feature attribution: `scores` [B, d_sae] and `error` [B] (the error node's), the estimated change
    of the metric when the feature (the error term) is patched target -> source; `source`, `target` [B]; `acts`:
    the site's (source, target) activations, which patch_features and patch_error reuse."""

    scores: torch.Tensor
    error: torch.Tensor
    source: torch.Tensor
    target: torch.Tensor
    acts: Optional[Tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    def top(self, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """([B, k] feature ids, [B, k] scores) of each sample's k largest |scores| (ties: the lower id first): what
        a store keeps."""
        order = torch.sort(self.scores.abs(), dim=1, descending=True, stable=True).indices
        ids = order[:, :min(k, self.scores.shape[1])]
        return ids, self.scores.gather(1, ids)


def _site(model: nn.Module, site: str):
    point = anatomy(model).point(site, "circuit.features.layer")
    return point, dict(model.named_modules())[point.module]


def _run(model, site, inputs, metric, edit=None, grad=False):
    """(metric [N], the site's activation [N, T, D]) of one forward; edit(x) -> new x at the site."""
    point, module = _site(model, site)
    kept = {}

    def at(x):
        kept["x"] = x.detach()
        return edit(x) if edit is not None else None
    with HookScope() as scope, torch.set_grad_enabled(grad):
        scope.value(module, point, at)
        logits = logits_of(model(**inputs))
        rows = torch.arange(inputs["input_ids"].shape[0], device=logits.device)
        return metric(logits, rows), kept["x"]


def _masked(change: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """change [B, T, ...] zeroed where valid [B, T] is False."""
    if valid is None:
        return change
    return change * valid.to(change.device, change.dtype).reshape(*valid.shape, *[1] * (change.dim() - 2))


def _acts(model, site, source, target, metric, acts):
    if acts is not None:
        return acts
    return _run(model, site, source, metric)[1], _run(model, site, target, metric)[1]


def feature_scores(model: nn.Module, site: str, dictionary, source: dict, target: dict, metric: Callable, *,
                   method: str = "atp", steps: int = 16, valid: Optional[torch.Tensor] = None,
                   source_metric: Optional[Callable] = None) -> FeatureScores:
    """Each feature's and the error term's score at `site` (a standard name whose value the dictionary reads;
    see the module's docstring). `metric` is taken on the target runs (with its gradient), `source_metric` (default
    `metric`) on the source run."""
    if method not in FEATURE_METHODS:
        raise ValueError(f"circuit.features.method: {method!r} is not one of {', '.join(FEATURE_METHODS)}")
    m_s, x_s = _run(model, site, source, source_metric or metric)
    m_t, x_t = _run(model, site, target, metric)
    with torch.no_grad():
        f_s, f_t = dictionary.encode(x_s), dictionary.encode(x_t)
        e_s, e_t = x_s - dictionary.decode(f_s), x_t - dictionary.decode(f_t)
        d_f, d_e = _masked(f_s - f_t, valid), _masked(e_s - e_t, valid)
    alphas = [0.0] if method == "atp" else [(k + 0.5) / steps for k in range(steps)]
    g_f, g_e = torch.zeros_like(f_t), torch.zeros_like(e_t)
    for alpha in alphas:
        f = (f_t + alpha * d_f).detach().requires_grad_(True)
        e = (e_t + alpha * d_e).detach().requires_grad_(True)
        with torch.inference_mode(False), torch.enable_grad():
            value, _ = _run(model, site, target, metric, edit=lambda x: (dictionary.decode(f) + e).to(x.dtype),
                            grad=True)
            gf, ge = torch.autograd.grad(value.float().sum(), [f, e])
        g_f += gf
        g_e += ge
    n = len(alphas)
    scores = (d_f * g_f / n).sum(1)  # [B, d_sae]: summed over positions
    error = (d_e * g_e / n).sum((1, 2))
    return FeatureScores(scores.detach().float().cpu(), error.detach().float().cpu(), m_s.detach().float().cpu(),
                         m_t.detach().float().cpu(), (x_s, x_t))


def patch_features(model: nn.Module, site: str, dictionary, source: dict, target: dict,
                   features: Union[Sequence[int], torch.Tensor], metric: Callable, *, valid=None,
                   acts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """[B, K]: the target run's metric with one feature alone patched source -> target at every position (its
    decoder direction, decode(one-hot) - decode(0), times the change of its activation added at the site), one
    forward a column: column k
    patches features[k] (a list: the same in every sample) or features[:, k] (a [B, K] tensor: each sample's own).
    `acts`: the site's (source, target) activations where known (FeatureScores.acts), else two forwards more."""
    x_s, x_t = _acts(model, site, source, target, metric, acts)
    with torch.no_grad():
        change = _masked(dictionary.encode(x_s) - dictionary.encode(x_t), valid)  # [B, T, d_sae]
        ids = torch.as_tensor(features, dtype=torch.long, device=change.device)
        ids = ids.expand(change.shape[0], -1) if ids.dim() == 1 else ids
        zero = dictionary.decode(torch.zeros_like(change[:1, 0]))  # [1, d_in]
        out = []
        for k in range(ids.shape[1]):
            col = ids[:, k]  # [B]
            amount = change.gather(2, col[:, None, None].expand(-1, change.shape[1], 1))  # [B, T, 1]
            direction = dictionary.decode(torch.nn.functional.one_hot(col, change.shape[-1]).to(change.dtype)) - zero
            add = amount * direction[:, None, :]  # [B, T, d_in]: decode's change when feature col moves by amount
            value, _ = _run(model, site, target, metric, edit=lambda x, add=add: x + add.to(x.dtype))
            out.append(value.float().cpu())
    return torch.stack(out, 1)


def patch_error(model: nn.Module, site: str, dictionary, source: dict, target: dict, metric: Callable, *,
                valid=None, acts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """[B]: the target run's metric with the error node alone patched: e_source - e_target added at the site."""
    x_s, x_t = _acts(model, site, source, target, metric, acts)
    with torch.no_grad():
        err = lambda x: x - dictionary.decode(dictionary.encode(x))  # noqa: E731
        add = _masked(err(x_s) - err(x_t), valid)
        value, _ = _run(model, site, target, metric, edit=lambda x: x + add.to(x.dtype))
    return value.float().cpu()
