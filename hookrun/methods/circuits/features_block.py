"""The `circuit.features` block: attribution over a dictionary's features at one layer, a batch at a time (the
functions of features.py), its checks, the arrays it stores (sparse: each sample's top_k features and the error
node), read back as a table by cap.read("circuit").features (hookrun.read.results.circuits.features_table).

    circuit: {source: clean, target: corrupt, metric: ld,
              features: {dictionary: mood, layer: blocks.1, method: ig, steps: 16, top_k: 8, verify: 3}}
    cap.read("circuit").features      # DataFrame: sample, node (f12 | error), feature (-1: error), score, exact
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from torch import nn

from hookrun.capture.anatomy import AnatomyError, anatomy
from hookrun.capture.checks import block_number_problems, k_problems, standard_site
from hookrun.capture.scope import HookScope
from hookrun.config.checks import ConfigError, check_choice, check_number, either, is_int, unknown_keys
from hookrun.methods.circuits.features import FEATURE_METHODS, feature_scores, patch_error, patch_features
from hookrun.methods.paired import dims

KEY = "circuit.features"
DEFAULT_TOP_K = 16
FEATURE_KEYS = {"dictionary": "a name of the dictionaries block (the dictionary whose features are the nodes)",
                "layer": "the standard site it reads (default: its cfg.json's hook_name, where that is one)",
                "method": "atp | ig (default atp)", "steps": "ig: interpolation steps (default 16)",
                "top_k": f"features kept a sample, by |score| (default {DEFAULT_TOP_K})",
                "verify": "K: each sample's K largest features (and the error node) patched exactly, one a forward"}
MAX_IDS = 2 ** 24  # feature ids go to the store as float32 (emit's dtype), exact up to here
MAX_STEPS = 10 ** 5  # interpolation steps past any use; the memory estimate bounds the rest
ROLES = ("features.ids", "features.scores", "features.error", "features.exact", "features.error_exact")


def check_features(spec) -> List[str]:
    """Problems with a `circuit.features` block that show without the model (its dictionary's name is the
    dictionaries method's to check: Circuit.dictionary_uses)."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        return [f"{KEY}: {spec!r} is not a mapping; write features: {{dictionary: sae1, layer: blocks.1, method: "
                "atp, top_k: 16}"]
    problems = unknown_keys(KEY, spec, FEATURE_KEYS, "features take")
    if "dictionary" not in spec:
        problems.append(f"{KEY}.dictionary: missing ({FEATURE_KEYS['dictionary']})")
    if "layer" in spec and not isinstance(spec["layer"], str):
        problems.append(f"{KEY}.layer: {spec['layer']!r} is not a site name; give one standard site, e.g. blocks.1")
    elif "layer" in spec:
        problems += block_number_problems(f"{KEY}.layer", [spec["layer"]])
    method = spec.get("method", "atp")
    problems += check_choice(f"{KEY}.method", method, FEATURE_METHODS, either(FEATURE_METHODS))
    if spec.get("steps") is not None:  # null: absent (a sweep's atp block over an ig one)
        if method != "ig":
            problems.append(f"{KEY}.steps: {spec['steps']!r} but method is {method}, which takes no steps; set "
                            f"{KEY}.method=ig or drop steps ('~{KEY}.steps' on the command line)")
        else:
            problems += check_number(f"{KEY}.steps", spec["steps"], whole=True, low=1, high=MAX_STEPS,
                                     fix="the interpolation steps, e.g. 16")
    if "top_k" in spec:
        problems += k_problems(f"{KEY}.top_k", spec["top_k"], None, "")
    verify = spec.get("verify", 0)
    bad_verify = check_number(f"{KEY}.verify", verify, whole=True, low=0, high=MAX_IDS, fix="0: none")
    problems += bad_verify
    if not bad_verify and is_int(spec.get("top_k")) and verify > spec["top_k"]:
        problems.append(f"{KEY}.verify: {verify} but top_k is {spec['top_k']}: only a sample's stored features are "
                        f"patched; give verify <= {spec['top_k']}, or raise top_k")
    return problems


@dataclass
class FeaturePlan:
    """A `circuit.features` block resolved against the model: the dictionary (its name and module), the layer
    it reads, method, steps, top_k, verify and the dictionary's widths."""

    dictionary: str
    module: nn.Module
    layer: str
    method: str
    steps: int
    top_k: int
    verify: int
    d_in: int
    d_sae: int

    def attrs(self) -> dict:
        return {"dictionary": self.dictionary, "layer": self.layer, "method": self.method,
                "steps": self.steps if self.method == "ig" else None, "top_k": self.top_k, "verify": self.verify,
                "d_in": self.d_in, "d_sae": self.d_sae}


def _probe(model: nn.Module, point, device) -> torch.Tensor:
    """The site's tensor on a one-token input (the site's width, before any batch runs)."""
    module = dict(model.named_modules())[point.module]
    kept = {}
    with HookScope() as scope, torch.no_grad():
        scope.value(module, point, lambda x: kept.__setitem__("x", x))
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    return kept["x"]


def plan_features(job, spec: dict, load: Callable[[object, str], nn.Module]) -> FeaturePlan:
    """The block against the model; ConfigError naming each problem: a layer the anatomy lacks or split by head,
    a layer the dictionary was not trained on or of another width, top_k over the dictionary's features, verify
    over top_k. `load(job, name)`: the dictionaries block's module (loaded once a run)."""
    name = spec["dictionary"]
    module = load(job, name)
    d_in, d_sae = dims(module)
    trained = getattr(module, "hook_name", None)
    layer = spec.get("layer")
    if layer is None:
        if not (trained and standard_site(trained)):
            raise ConfigError([f"{KEY}.layer: missing, and dictionary {name}'s cfg.json names no standard site "
                               f"(hook_name: {trained!r}); give the site it reads, e.g. layer: blocks.1 "
                               "(docs/anatomy.md)"])
        layer = trained
    try:
        point = anatomy(job.model).point(layer, f"{KEY}.layer")
    except AnatomyError as err:
        raise ConfigError([str(err)]) from None
    if point.heads:
        raise ConfigError([f"{KEY}.layer: {layer!r} is split by head; a dictionary reads one vector a position: "
                           "give blocks.N, or its resid_pre, resid_mid, ln1, attn, ln2, mlp or mlp.hidden"])
    problems = job.method("dictionaries").layer_problems(f"{KEY}.layer", name, [layer], reader=KEY)
    x = _probe(job.model, point, job.device)
    if d_in is not None and x.shape[-1] != d_in:
        problems.append(f"{KEY}.layer: {layer} is {x.shape[-1]} wide, but dictionary {name} reads {d_in}-wide "
                        f"activations (d_in); give the layer it was trained on"
                        + (f" (cfg.json's hook_name: {trained})" if trained else ""))
    elif d_sae is None:
        with torch.no_grad():
            d_in, d_sae = x.shape[-1], int(module.encode(x).shape[-1])
    top_k = spec.get("top_k", min(DEFAULT_TOP_K, d_sae or DEFAULT_TOP_K))
    problems += k_problems(f"{KEY}.top_k", top_k, d_sae, f"features of dictionary {name}")
    if d_sae is not None and d_sae > MAX_IDS:
        problems.append(f"{KEY}.dictionary: {name} has {d_sae} features; feature ids are stored as float32, exact up "
                        f"to {MAX_IDS}: give a dictionary of at most {MAX_IDS} features")
    verify = int(spec.get("verify", 0))
    if "top_k" not in spec and verify > top_k:
        problems.append(f"{KEY}.verify: {verify} but top_k is {top_k} (the default): only a sample's stored "
                        f"features are patched; give verify <= {top_k}, or set top_k")
    if problems:
        raise ConfigError(problems)
    return FeaturePlan(name, module, layer, spec.get("method", "atp"), int(spec.get("steps") or 16), int(top_k),
                       verify, int(d_in), int(d_sae))


def batch_features(model: nn.Module, plan: FeaturePlan, source: dict, target: dict, grad: Callable,
                   source_metric: Callable, target_metric: Callable, valid: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One batch's arrays (ROLES): each sample's top_k feature ids (-1 past those with a nonzero score) and scores
    [B, top_k], the error node's score [B]; with verify, the exact change of the metric when each of the sample's
    first `verify` features alone (NaN elsewhere) and the error node alone are patched."""
    with torch.inference_mode(False):
        est = feature_scores(model, plan.layer, plan.module, source, target, grad, method=plan.method,
                             steps=plan.steps, valid=valid, source_metric=source_metric)
    ids, scores = est.top(plan.top_k)
    ids = torch.where(scores != 0, ids, torch.full_like(ids, -1))
    out = {"features.ids": ids.float(), "features.scores": scores, "features.error": est.error}
    if plan.verify:
        cols = ids[:, :plan.verify]
        with torch.no_grad():
            patched = patch_features(model, plan.layer, plan.module, source, target, cols.clamp(min=0),
                                     target_metric, valid=valid, acts=est.acts)
            error = patch_error(model, plan.layer, plan.module, source, target, target_metric, valid=valid,
                                acts=est.acts)
        exact = torch.full(scores.shape, math.nan)
        exact[:, :plan.verify] = torch.where(cols >= 0, patched - est.target[:, None], math.nan)
        out["features.exact"] = exact
        out["features.error_exact"] = error - est.target
    return out
