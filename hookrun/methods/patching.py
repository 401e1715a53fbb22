"""Activation patching grids in one pass over a batch: every site (layer x position, or layer x head) of a
source run patched into a target run, one site at a time, several sites sharing a forward. The grid itself
(patch_grid, Grid, Noise) is the paired floor's (hookrun.methods.paired), which attribution verifies with too; this
module is the `patching:` block (Patching); the reader of its grid (PatchGrid, cap.grid()) is the read side's
(hookrun.read.results.patching).

    grid = patch_grid(model, clean, corrupt, info_clean, info_corrupt, ["blocks.*"],
                      metric=logit_diff, positions="all")          # grid.scores [B, layers, positions]
    grid = patch_grid(model, clean, corrupt, ic, it, ["blocks.0-3.attn.heads"], heads="all", metric=...)
    grid = patch_grid(model, clean, corrupt, ic, it, ["transformer.h.0.attn.c_proj"], role="input",
                      heads="all", positions="last", metric=...)   # native: a module and its role
    grid = patch_grid(model, clean, corrupt, ic, it, ["blocks.*.attn.heads"], heads="all", per_position=True,
                      metric=...)                                  # grid.scores [B, layers, heads, positions]
    grid.normalised()   # (scores - corrupt) / (clean - corrupt): 1 = the site restores the clean metric

`source` / `target` are a batch's keyword inputs (input_ids, attention_mask, position_ids as
hookrun.data.text makes them) and `info_*` their hookrun.capture.tokens.TokenInfo. The source runs once with
plain forward hooks keeping the sites in memory; the target then runs with one site replaced by the
source's value, `sites_per_forward` sites a forward: the target batch is repeated along the batch axis, copy
c carrying site c. `metric(logits, sample_ids) -> [rows]` scores each row; `sample_ids[r]` is the sample
of the batch that row r is a copy of (index per-sample answers with it).

Positions count real tokens (position 0 = a sequence's first real token whatever the padding side; -1 its
last): `all` (every real position of the target, NaN past a shorter sample's end), `last`, `first`, an int,
a list, or a per-sample LongTensor [B, P] (e.g. the subject's tokens). A position of the target takes the
source's value at the same real position, so the paired prompts must have the same real length per sample
(a PatchError names the sample and both lengths) unless `source_positions` maps them explicitly (e.g.
positions="last", source_positions="last" for prompts of different lengths).

Sites are standard names (`blocks.N`, `blocks.N.attn.heads`, `blocks.N.attn.q`, `blocks.N.mlp.hidden`, ...:
hookrun.capture.anatomy, the same on every supported LM, no role) or native module names with a role
(hookrun.capture.targets). Heads: a standard site split by head (blocks.N.attn.heads: the output projection's input;
blocks.N.attn.q / .k / .v), or natively the module whose input (role="input") or output carries the heads side by
side, [B, T, H*Dh] (GPT-2 `transformer.h.N.attn.c_proj`, Llama `model.layers.N.self_attn.o_proj`, role input), or
[B, T, H, Dh]; head h is columns h*Dh:(h+1)*Dh. A head's `positions` are patched together (default: all of them),
or, with per_position=True, each (head, position) alone: a layers x heads x positions grid.

Features: `dictionary=` a dictionary (hookrun.methods.dictionaries: encode, W_dec or decode) read at the layers and
`features=[ids]`: site f patches that feature at every position of `positions` together, adding
(f_source - f_target) * W_dec[f] to the target's tensor (the reconstruction error kept); grid.scores
[B, layers, features], axis "feature".

Donors: `donor="same"` (source sample b into target sample b), `"mean"` (the mean over the source batch's
samples at each position), `"resample"` (another source sample, a seeded derangement), `"zero"` (zero
ablation: the source run gives only the clean metric). `source_noise` /
`target_noise` = Noise(positions, std, seed) add seeded gaussian noise to the embedding output of that run
(causal tracing: target = the clean prompt with noise on the subject, source = the clean prompt).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from hookrun.capture.checks import same_role_problems
from hookrun.capture.targets import Target, heads_problems
from hookrun.capture.tokens import check_positions
from hookrun.config.checks import ConfigError, as_list, check_choice, check_number, either, unknown_keys
from hookrun.format.layout import PATCHING, PATCHING_ATTR, array_key
from hookrun.methods import Method, MetricUse, emit, run_shape
from hookrun.methods.metrics import Metric, unhooked
from hookrun.methods.paired import (DONORS, Grid, Noise, PatchError, SitePlan, axis_labels,  # noqa: F401 - Grid
                                    batch_positions, dims, is_field, metric_rows, named_dictionary, pad, paired_uses,
                                    length_key, patch_grid, role_problems, site_layers, site_positions,
                                    site_problems)
from hookrun.read.results.patching import PatchGrid, load_grid


# patch_grid's arguments -> the keys of a patching: block that set them (its errors name the block's keys)
CONFIG_KEYS = {"positions": "patching.sites.positions", "source_positions": "patching.source_positions",
               "per_position": "patching.sites.per_position",
               "heads": "patching.sites.heads", "layers": "patching.sites.layers", "role": "patching.sites.role",
               "donor": "patching.donor", "sites_per_forward": "patching.sites_per_forward",
               "Noise.module": "patching.noise.module", "sample": "patching.sites.positions"}
_ARGUMENT = re.compile(r"(Noise\.module|source_positions|sites_per_forward|per_position|positions|heads|layers|role|"
                       r"donor|sample)"
                       r"(?=[:= ])[:=]? ?")


def config_key(err: PatchError) -> PatchError:
    """A PatchError of patch_grid (which names its arguments: `positions: ...`) as the run's config error, naming the
    patching block's full key (`patching.sites.positions: ...`)."""
    message = str(err)
    found = _ARGUMENT.match(message)
    if found is None:
        return PatchError(f"patching: {message}", "patching")
    key = CONFIG_KEYS[found.group(1)]
    rest = message if found.group(1) == "sample" else message[found.end():]  # "sample 3 has ..." stays whole
    return PatchError(f"{key}: {rest}", key)


# -- the `patching:` block in a run ------------------------------------------------------------------------------
PATCH_KEYS = {"source": "the role whose sites are patched in (a key of data.text.fields)",
              "target": "the role they are patched into",
              "sites": "{layers | hook, positions, heads | dictionary + features, role, per_position}",
              "metric": "a name of the metrics block", "donor": "same | mean | resample | zero",
              "noise": "{positions, std, seed, on: target | source}: causal tracing",
              "source_positions": "the source's position for each patched position (prompts of other lengths)",
              "seed": "the resample and noise seed (plus the batch number)",
              "sites_per_forward": "sites patched in one forward (copies along the batch axis); auto"}


@dataclass
class PatchPlan(SitePlan):
    """A `patching:` block resolved against the model and the data."""

    noise: Optional[dict]
    sites_per_forward: object
    axis: str  # position | head
    labels: List[int]
    width: int  # positions (or heads, or features) a stored row has; per_position: the positions
    dictionary: Optional[str] = None  # a features grid: the dictionary (of the dictionaries block) and its features
    features: Optional[List[int]] = None
    position_labels: Optional[List[int]] = None  # per_position: the positions axis after the heads


class Patching(Method):
    """The `patching:` block: a whole grid a batch over paired prompts (patch_grid), scored with a metric of the
    metrics block. Stores `_patching/<metric>/scores` [samples, layers, positions | heads] (per_position: [samples,
    layers, heads, positions]; NaN past a sample's end), the source and target runs' metric (`.../source`,
    `.../target`, columns `<metric>.<source>`, `<metric>.<target>`), and its axes in the root attr `patching`; read
    back by cap.grid() (PatchGrid)."""

    key = "patching"
    help = ("`{source: ROLE, target: ROLE, sites: {layers, positions|heads, per_position}, metric: NAME}`: a "
            "patching grid a batch over paired prompts (docs/patching.md)")
    config_errors = (PatchError,)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.plan: Optional[PatchPlan] = None

    @classmethod
    def check(cls, cfg) -> List[str]:
        """Problems with `patching:` that show without the model or the data."""
        spec = (cfg.patching)
        if spec is None:
            return []
        if not isinstance(spec, dict):
            return [f"patching: {spec!r} is not a mapping; write patching: {{source: clean, target: corrupt, "
                    "sites: {layers: ${layers}, positions: all}, metric: ld}"]
        problems = unknown_keys("patching", spec, PATCH_KEYS, "patching takes")
        problems += [f"patching.{k}: missing ({PATCH_KEYS[k]})" for k in ("source", "target", "sites", "metric")
                     if k not in spec]
        donor = spec.get("donor", "same")
        problems += check_choice("patching.donor", donor, DONORS, either(DONORS))
        problems += same_role_problems("patching", spec.get("source"), spec.get("target"), donor)
        if "seed" in spec:
            problems += check_number("patching.seed", spec["seed"], whole=True, low=0, high=2 ** 31,
                                     fix="the resample and noise seed, e.g. patching.seed=0")
        sites = spec.get("sites")
        return problems + _noise_problems(spec.get("noise")) + site_problems(sites)

    @classmethod
    def generation_problems(cls, cfg) -> List[str]:
        return [] if getattr(cfg, cls.key, None) is None else [
            "patching: a patching grid runs forward passes, not generation; drop patching or set "
            "generate.max_new_tokens=0"]

    @classmethod
    def dictionary_uses(cls, cfg) -> List[Tuple[str, object]]:
        """A features grid's dictionary (patching.sites.dictionary)."""
        spec = getattr(cfg, cls.key, None)
        sites = spec.get("sites") if isinstance(spec, dict) else None
        named = sites.get("dictionary") if isinstance(sites, dict) else None
        return [] if named is None else [("patching.sites.dictionary", named)]

    @classmethod
    def metric_uses(cls, cfg) -> List[MetricUse]:
        """The block's metric, measured on the source and target runs (and the source is what a kl compares to)."""
        return paired_uses(cls.key, getattr(cfg, cls.key, None), reference=True)

    def data_problems(self, inputs) -> List[str]:
        """The roles against the data and, patched position by position, every pair of one token length."""
        return role_problems("patching", self.spec, inputs, length_key(self.spec))

    def compile(self, job) -> None:
        self.plan = _plan_block(job, self.spec, job.method("metrics").metrics)

    def memory_need(self, job) -> List[tuple]:
        """The grid's parts held at once: a forward of sites_per_forward copies of the batch stacked along the
        batch axis (their logits and a block's activations; auto sizes itself to half the free memory, counted as
        one copy here) and the source run's values at every patched layer."""
        p, s = self.plan, run_shape(job)
        per_layer = p.width * (len(p.heads) if p.per_position and isinstance(p.heads, list) else 1)
        sites = len(p.layers) * per_layer
        k = min(int(p.sites_per_forward), sites) if isinstance(p.sites_per_forward, int) else 1
        per_copy = float(s.itemsize) * s.batch * s.tokens * (s.vocab + 4 * s.d_model)  # the model's dtype
        return [(k * per_copy, "patching.sites_per_forward",
                 f"{k} copies of {s.batch} prompts x {s.tokens} tokens stacked along the batch axis, their logits"),
                (float(s.itemsize) * len(p.layers) * s.batch * s.tokens * s.d_model, "patching.sites.layers",
                 f"the source's values at {len(p.layers)} layers"),
                (8.0 * sites * s.batch, "patching.sites", f"the grid's {sites} sites x {s.batch} prompts")]

    def measure(self, job, i: int, batch, output, hookset) -> Dict[str, np.ndarray]:
        """Batch `i`'s grid, and the source and target runs' metric, handed to the store; their sample columns."""
        plan = self.plan
        with unhooked(hookset), torch.inference_mode():
            grid = _batch_grid(job, i, batch)
        for role, values in (("scores", grid.scores), ("source", grid.clean), ("target", grid.corrupt)):
            emit(hookset, i, batch, PATCHING, plan.metric, role, values, kind="patching")
        values = {f"{plan.metric}.{plan.source}": grid.clean, f"{plan.metric}.{plan.target}": grid.corrupt}
        return {c: values[c].cpu().numpy() for c in self.metric_columns}

    def columns(self) -> List[str]:
        return list(self.metric_columns)

    def attrs(self) -> dict:
        p = self.plan
        return {PATCHING_ATTR: {"key": array_key(PATCHING, p.metric, "scores"), "metric": p.metric,
                                "source": p.source, "target": p.target, "layers": p.layers, "axis": p.axis,
                                "labels": p.labels, "positions": p.position_labels, "role": p.role or "output"}}

    @staticmethod
    def read(cap, metric: Optional[str] = None) -> "PatchGrid":
        return load_grid(cap, metric)


NOISE_KEYS = ("positions", "std", "seed", "on", "module")


def _noise_problems(noise) -> List[str]:
    """Problems with patching.noise ({positions, std, seed, on, module}) that show without the model or the data."""
    if noise is None:
        return []
    if not isinstance(noise, dict):
        return [f"patching.noise: {noise!r} is not a mapping; write {{positions: {{field: subject}}, std: auto}}"]
    problems = unknown_keys("patching.noise", noise, NOISE_KEYS, "noise takes")
    positions = noise.get("positions", "all")
    if positions != "all" and not is_field(positions):
        problems += [p + "; or all, or {field: NAME} (per-sample positions)"
                     for p in check_positions("patching.noise.positions", positions)]
    std = noise.get("std", "auto")
    if std != "auto":
        problems += check_number("patching.noise.std", std, low=0, high=10 ** 6, fix="or auto: 3x the embeddings' std")
    if "seed" in noise:
        problems += check_number("patching.noise.seed", noise["seed"], whole=True, low=0, high=2 ** 31)
    problems += check_choice("patching.noise.on", noise.get("on", "target"), ("target", "source"),
                             "target (the run patched into) or source")
    if "module" in noise and not isinstance(noise["module"], str):
        problems.append(f"patching.noise.module: {noise['module']!r} is not a module name")
    return problems


def _plan_block(job, spec: dict, metrics: Dict[str, Metric]) -> PatchPlan:
    problems = []
    if metrics[spec["metric"]].needs_reference:
        problems.append(f"patching.metric: {spec['metric']} is a kl, which the grid cannot score (each patched copy "
                        "would need its own reference); use logit_diff, logprob, prob, rank or loss")
    sites = spec["sites"]
    targets, role = site_layers(job, sites, problems)
    layers = [t.name for t in targets]
    if sites.get("heads") is not None and not problems:
        problems += heads_problems(job.model, targets, "patching.sites.heads")
    problems += _field_problems(job, spec)
    positions = site_positions(sites)
    source_positions = spec.get("source_positions")
    if source_positions is None and positions in ("last", "first"):
        source_positions = positions  # named positions map by name: prompts may differ in length
    if problems:
        raise ConfigError(problems)
    heads = sites.get("heads")
    dictionary, features = sites.get("dictionary"), sites.get("features")
    if dictionary is not None:
        features = [int(f) for f in as_list(features)]
        _check_features(job, dictionary, features)
        axis, labels = "feature", features
    else:
        axis, labels = axis_labels(job, spec, positions, heads, targets=targets)
    per_position = bool(sites.get("per_position", False))
    position_labels = axis_labels(job, spec, positions, None)[1] if per_position else None
    width = len(position_labels) if per_position else len(labels)
    return PatchPlan(spec["source"], spec["target"], spec["metric"], layers, role, positions, source_positions, heads,
                     spec.get("donor", "same"), int(spec.get("seed", 0)), per_position, spec.get("noise"),
                     spec.get("sites_per_forward", "auto"), axis, labels, width, dictionary, features,
                     position_labels)


def _check_features(job, name: str, features: List[int]) -> None:
    """ConfigError for a feature beyond the dictionary's width (a layer of another width: PatchError at batch 0)."""
    d_in, d_sae = dims(named_dictionary(job, name))
    bad = [f for f in features if d_sae is not None and f >= d_sae]
    if bad:
        raise ConfigError([f"patching.sites.features: {bad[0]} is out of range: dictionary {name} has {d_sae} "
                           f"features (0..{d_sae - 1}); pick features it has"])


def _field_problems(job, spec: dict) -> List[str]:
    """Per-sample positions ({field: NAME}) of patching.noise and patching.source_positions that name no field of
    the data (patching.sites.positions: axis_labels)."""
    have = job.inputs.field_names() if hasattr(job.inputs, "field_names") else []
    named = {"patching.noise.positions": (spec.get("noise") or {}).get("positions"),
             "patching.source_positions": spec.get("source_positions")}
    return [f"{key}: {{field: {value['field']}}} but the data has no such field ({', '.join(have) or 'none'}); name "
            "a per-sample field of the data (a column of the .jsonl beside the prompts)"
            for key, value in named.items() if is_field(value) and value["field"] not in have]


def _batch_grid(job, index: int, batch):
    """The patching grid of one batch, its last axis padded with NaN to the run's width."""
    plan: PatchPlan = job.method("patching").plan
    metric = job.method("metrics").metrics[plan.metric]
    (skw, sinfo), (tkw, tinfo) = batch.roles[plan.source], batch.roles[plan.target]
    noise = dict(plan.noise or {})
    on = noise.pop("on", "target")
    if noise:
        noise["positions"] = batch_positions(noise.get("positions", "all"), batch)
        noise = Noise(**{**noise, "seed": int(noise.get("seed", plan.seed)) + index})
    try:
        grid = _patch_grid(job, plan, metric, skw, tkw, sinfo, tinfo, batch, noise, on, index)
    except PatchError as err:
        raise config_key(err) from None
    grid.scores = pad(grid.scores, plan.width)
    return grid


def _patch_grid(job, plan, metric, skw, tkw, sinfo, tinfo, batch, noise, on, index):
    """patch_grid of one batch as the plan says."""
    return patch_grid(job.model, skw, tkw, sinfo, tinfo, plan.layers, role=plan.role,
                      metric=metric_rows(metric, tkw, tinfo, batch), source_metric=metric_rows(metric, skw, sinfo, batch),
                      positions=batch_positions(plan.positions, batch), source_positions=batch_positions(plan.source_positions,
                                                                                             batch),
                      heads=plan.heads, donor=plan.donor, seed=plan.seed + index,
                      source_noise=noise if on == "source" and noise else None,
                      target_noise=noise if on == "target" and noise else None,
                      sites_per_forward=plan.sites_per_forward, features=plan.features, per_position=plan.per_position,
                      dictionary=None if plan.dictionary is None else named_dictionary(job, plan.dictionary))
