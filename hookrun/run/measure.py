"""Declared metrics and a patching grid in a real run: compiled before any work, computed per batch in the pass.

    metrics:                           # per-sample numbers from the model's output logits (hookrun.capture.metrics)
      ld: {metric: logit_diff, a: {field: answer}, b: " store", position: last}
    patching:                          # a whole grid a batch (hookrun.run.patching.patch_grid)
      source: clean                    # a role of data.text.fields: the run whose sites are patched in
      target: corrupt                  # the run they are patched into
      sites: {layers: ${layers}, positions: all}   # or {hook: resid}, heads: all (role input of attn.c_proj)
      metric: ld

    measures = compile_measures(job)               # ConfigError naming the key, before the store exists
    columns = measure(job, batch, output, hookset)   # after the batch's forward: pieces to the sink, sample columns

Each metric is computed on the batch's forward (the first role of paired data, with the hooks and edits) and
stored as the array `_metrics/<role>/<name>` (a row per sample; <role> is `output` for unpaired data) and a
column of `cap.samples`; `kl` compares to the logits of the reference role (patching.source, else `clean`,
else the first role) run without hooks. A patching run stores the grid `_patching/<metric>/scores` [samples,
layers, positions | heads] (NaN past a sample's end), the source and target runs' metric (`.../source`,
`.../target`, columns `<metric>.<source>`, `<metric>.<target>`), and its axes in the root attr `patching`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

from hookrun.capture.hooks import Piece
from hookrun.capture.layers import module_names, resolve
from hookrun.capture.metrics import Metric, MetricInputs, check_metrics, compile_metrics, needing_reference
from hookrun.capture.site import Site
from hookrun.capture.tokens import TokenInfo, check_positions, positions_spec
from hookrun.config.schema import ConfigError, check_choice, either, to_plain
from hookrun.format.layout import METRICS, METRIC_COLUMNS, PATCHING, PATCHING_ATTR, array_key
from hookrun.run.patching import DONORS, ROLES, Noise, logits_of, patch_grid

PATCH_KEYS = {"source": "the role whose sites are patched in (a key of data.text.fields)",
              "target": "the role they are patched into", "sites": "{layers | hook, positions, heads, role}",
              "metric": "a name of the metrics block", "donor": "same | mean | resample | zero",
              "noise": "{positions, std, seed, on: target | source}: causal tracing",
              "source_positions": "the source's position for each patched position (prompts of other lengths)",
              "seed": "the resample and noise seed (plus the batch number)",
              "sites_per_forward": "sites patched in one forward (copies along the batch axis); auto"}
SITE_KEYS = ("layers", "hook", "positions", "heads", "role")
RESERVED = (METRICS, PATCHING)


@dataclass
class PatchPlan:
    """A `patching:` block resolved against the model and the data."""

    source: str
    target: str
    metric: str
    layers: List[str]
    role: str
    positions: object
    source_positions: object
    heads: object
    donor: str
    seed: int
    noise: Optional[dict]
    sites_per_forward: object
    axis: str  # position | head
    labels: List[int]
    width: int  # positions (or heads) a stored row has


@dataclass
class Measures:
    """What a run measures besides its hooks: compiled metrics, the role they are computed on, the reference role
    of `kl`, and the patching grid."""

    metrics: Dict[str, Metric] = field(default_factory=dict)
    role: str = "output"  # the array group of the metrics: the role fed (paired data), else output
    reference: Optional[str] = None
    patching: Optional[PatchPlan] = None

    def columns(self) -> List[str]:
        """The columns of cap.samples that hold metrics (collect() averages them per job)."""
        cols = [c for name, m in self.metrics.items() for c in _metric_columns(name, m)]
        if self.patching is not None:
            p = self.patching
            cols += [f"{p.metric}.{p.source}", f"{p.metric}.{p.target}"]
        return cols

    def attrs(self) -> dict:
        """Root attrs: the metric columns, and the grid's axes."""
        attrs = {METRIC_COLUMNS: self.columns()} if self.metrics else {}
        if self.patching is not None:
            p = self.patching
            attrs[PATCHING_ATTR] = {"key": array_key(PATCHING, p.metric, "scores"), "metric": p.metric,
                                 "source": p.source, "target": p.target, "layers": p.layers, "axis": p.axis,
                                 "labels": p.labels, "role": p.role}
        return attrs


def _metric_columns(name: str, metric: Metric) -> List[str]:
    return [name] if metric.squeeze else [f"{name}[{p}]" for p in metric.positions]


# -- checks without a model -------------------------------------------------------------------------------------
def check_spec(cfg) -> List[str]:
    """Problems with `metrics:` and `patching:` that show without the model or the data."""
    problems = check_metrics(cfg.get("metrics"))
    problems += [f"metrics.{name}: a metric's name holds no '/' or '.'; rename it" for name in (cfg.get("metrics") or {})
                 if "/" in str(name) or "." in str(name)]
    problems += [f"hooks.{name}: {name} is the name of hookrun's own arrays; rename the hook"
                 for name in (cfg.hooks or {}) if name in RESERVED]
    spec = to_plain(cfg.get("patching"))
    if spec is None:
        return problems
    if not isinstance(spec, dict):
        return problems + [f"patching: {spec!r} is not a mapping; write patching: {{source: clean, target: corrupt, "
                           "sites: {layers: ${layers}, positions: all}, metric: ld}"]
    problems += [f"patching.{k}: unknown key; patching takes {', '.join(PATCH_KEYS)}" for k in spec if k not in PATCH_KEYS]
    problems += [f"patching.{k}: missing ({PATCH_KEYS[k]})" for k in ("source", "target", "sites", "metric")
                 if k not in spec]
    if "metric" in spec and spec["metric"] not in (cfg.get("metrics") or {}):
        problems.append(f"patching.metric: {spec['metric']!r} is not a metric of the metrics block "
                        f"({', '.join(cfg.get('metrics') or {}) or 'none'}); declare it there, e.g. metrics: "
                        "{ld: {metric: logit_diff, a: ' Paris', b: ' Rome'}}")
    problems += check_choice("patching.donor", spec.get("donor", "same"), DONORS, either(DONORS))
    return problems + _site_problems(spec.get("sites"))


def _site_problems(sites) -> List[str]:
    if sites is None:
        return []
    if not isinstance(sites, dict):
        return [f"patching.sites: {sites!r} is not a mapping; write {{layers: [...], positions: all}}"]
    problems = [f"patching.sites.{k}: unknown key; sites take {', '.join(SITE_KEYS)}" for k in sites if k not in SITE_KEYS]
    if "layers" not in sites and "hook" not in sites:
        problems.append("patching.sites: name the layers (layers: [...]) or a hook whose layers to patch (hook: NAME)")
    positions = sites.get("positions", "all")
    if positions != "all" and not _is_field(positions):
        problems += [p + "; or all, or {field: NAME} (per-sample positions)"
                     for p in check_positions("patching.sites.positions", positions)]
    problems += check_choice("patching.sites.role", sites.get("role", "output"), ROLES, either(ROLES))
    return problems


def _is_field(value) -> bool:
    return isinstance(value, dict) and set(value) == {"field"}


# -- compile against the model and the data ---------------------------------------------------------------------
def compile_measures(job) -> Measures:
    """The run's metrics and patching plan; ConfigError naming the key for a string token that is not one token,
    a role the data lacks, layers the model lacks, or paired prompts of other lengths where a patch needs one."""
    cfg, inputs = job.cfg, job.inputs
    metrics = compile_metrics(cfg.get("metrics"), getattr(inputs, "tokenizer", None))
    roles = list(getattr(inputs, "roles", None) or [])
    spec = to_plain(cfg.get("patching"))
    measures = Measures(metrics, roles[0] if roles else "output")
    if spec is not None:
        measures.patching = _plan(job, spec, metrics, roles)
    if needing_reference(metrics):
        if not roles:
            names = ", ".join(needing_reference(metrics))
            raise ConfigError([f"metrics.{names}: kl compares to a reference run's logits, and this run has none; "
                               "give paired prompts (data.text.fields: {clean: ..., corrupt: ...}): the clean role "
                               "is the reference"])
        measures.reference = (measures.patching.source if measures.patching else
                              "clean" if "clean" in roles else roles[0])
    return measures


def _plan(job, spec: dict, metrics: Dict[str, Metric], roles: List[str]) -> PatchPlan:
    have = ", ".join(roles) or "none: give paired prompts with data.text.fields: {clean: ..., corrupt: ...}"
    problems = [f"patching.{k}: {spec[k]!r} is not a role of the data ({have})" for k in ("source", "target")
                if spec[k] not in roles]
    if metrics[spec["metric"]].needs_reference:
        problems.append(f"patching.metric: {spec['metric']} is a kl, which the grid cannot score (each patched copy "
                        "would need its own reference); use logit_diff, logprob, prob, rank or loss")
    sites = spec["sites"]
    layers, role = _layers(job, sites, problems)
    positions = sites.get("positions", "all")
    source_positions = spec.get("source_positions")
    if source_positions is None and positions in ("last", "first"):
        source_positions = positions  # named positions map by name: prompts may differ in length
    if source_positions is None and not problems and spec.get("donor", "same") != "zero":
        problems += job.inputs.length_problems(spec["source"], spec["target"], "patching.sites.positions")
    if problems:
        raise ConfigError(problems)
    heads = sites.get("heads")
    axis, labels = _labels(job, spec, positions, heads)
    return PatchPlan(spec["source"], spec["target"], spec["metric"], layers, role, positions, source_positions, heads,
                     spec.get("donor", "same"), int(spec.get("seed", 0)), spec.get("noise"),
                     spec.get("sites_per_forward", "auto"), axis, labels, len(labels))


def _layers(job, sites: dict, problems: List[str]):
    """(resolved layer names, role) of the sites: `layers`, or the layers and role of the hook `hook`."""
    role = sites.get("role")
    patterns = sites.get("layers")
    if "hook" in sites:
        hook = job.specs.get(sites["hook"])
        if hook is None:
            problems.append(f"patching.sites.hook: {sites['hook']!r} is not a hook of the hooks block "
                            f"({', '.join(job.specs) or 'none'})")
            return [], "output"
        patterns = hook.layers if patterns is None else patterns
        role = role or ("input" if hook.kind == "forward_pre" else "output")
    names, found = resolve(to_plain(patterns), module_names(job.model), "module", "patching.sites.layers")
    problems += found
    return names, role or "output"


def _labels(job, spec: dict, positions, heads):
    """(axis, labels) of the grid's last axis."""
    if heads is not None:
        n = getattr(getattr(job.model, "config", None), "num_attention_heads", None)
        if heads == "all" and not n:
            raise ConfigError(["patching.sites.heads: all, but the model's config has no num_attention_heads; list "
                               "the heads"])
        return "head", list(range(n)) if heads == "all" else [int(h) for h in heads]
    if positions == "all":
        seqs = job.inputs.role_seqs[spec["target"]]
        longest = max(len(seqs[i]) for a, b in job.inputs.ranges() for i in range(a, b))
        return "position", list(range(longest))
    if _is_field(positions):
        first = job.inputs.meta.get(positions["field"]) if job.inputs.meta else None
        if not first:
            raise ConfigError([f"patching.sites.positions: {{field: {positions['field']}}} but the data has no such "
                               f"field ({', '.join(job.inputs.field_names()) or 'none'})"])
        return "position", list(range(len(first[0])))
    return "position", positions_spec(positions)[0]


# -- per batch ------------------------------------------------------------------------------------------------
@contextmanager
def _unhooked(hookset):
    """The run's own hooks off (no capture, no edit) while other forwards run: the reference, the grid."""
    hookset.remove()
    try:
        yield
    finally:
        hookset.attach()


def measure(job, index: int, batch, output, hookset) -> Dict[str, np.ndarray]:
    """Batch `index`'s metrics (and grid) handed to the hooks' sink as pieces; returns the cap.samples columns."""
    measures: Measures = job.measures
    if not measures.metrics:
        return {}
    logits = logits_of(output).detach()
    reference = reference_info = None
    with _unhooked(hookset), torch.inference_mode():
        if measures.reference is not None:
            kwargs, reference_info = batch.roles[measures.reference]
            reference = logits_of(job.model(**kwargs))
        grid = _grid(job, index, batch) if measures.patching is not None else None
    inputs = MetricInputs(batch.tokens, batch.kwargs.get("input_ids"), batch.fields, reference, reference_info,
                          batch.start)
    columns: Dict[str, np.ndarray] = {}
    for name, metric in measures.metrics.items():
        values = metric(logits, inputs).float()
        _emit(hookset, index, batch, METRICS, measures.role, name, values)
        host = values.cpu().numpy()
        for j, col in enumerate(_metric_columns(name, metric)):
            columns[col] = host if metric.squeeze else host[:, j]
    if grid is not None:
        plan = measures.patching
        for role, values in (("scores", grid.scores), ("source", grid.clean), ("target", grid.corrupt)):
            _emit(hookset, index, batch, PATCHING, plan.metric, role, values)
        columns[f"{plan.metric}.{plan.source}"] = grid.clean.numpy()
        columns[f"{plan.metric}.{plan.target}"] = grid.corrupt.numpy()
    return columns


def _emit(hookset, index: int, batch, hook: str, layer: str, role: str, values: torch.Tensor) -> None:
    site = Site(hook, layer, role, 0, index, batch.start, batch.stop)
    hookset.sink(Piece(site, "metric" if hook == METRICS else "patching", values.detach().float(), True, "sample"))


def _grid(job, index: int, batch):
    """The patching grid of one batch, its last axis padded with NaN to the run's width."""
    plan: PatchPlan = job.measures.patching
    metric = job.measures.metrics[plan.metric]
    (skw, sinfo), (tkw, tinfo) = batch.roles[plan.source], batch.roles[plan.target]
    noise = dict(plan.noise or {})
    on = noise.pop("on", "target")
    if noise:
        noise["positions"] = _positions(noise.get("positions", "all"), batch)
        noise = Noise(**{**noise, "seed": int(noise.get("seed", plan.seed)) + index})
    grid = patch_grid(job.model, skw, tkw, sinfo, tinfo, plan.layers, role=plan.role,
                      metric=_rows(metric, tkw, tinfo, batch), source_metric=_rows(metric, skw, sinfo, batch),
                      positions=_positions(plan.positions, batch), source_positions=_positions(plan.source_positions,
                                                                                             batch),
                      heads=plan.heads, donor=plan.donor, seed=plan.seed + index,
                      source_noise=noise if on == "source" and noise else None,
                      target_noise=noise if on == "target" and noise else None,
                      sites_per_forward=plan.sites_per_forward)
    missing = plan.width - grid.scores.shape[2]
    if missing > 0:
        grid.scores = torch.cat([grid.scores, torch.full((*grid.scores.shape[:2], missing), float("nan"))], 2)
    return grid


def _positions(spec, batch):
    """A positions setting as patch_grid takes it: {field: NAME} -> the per-sample LongTensor [B, P]."""
    if not _is_field(spec):
        return spec
    return torch.as_tensor(batch.fields[spec["field"]], dtype=torch.long, device=batch.tokens.mask.device)


def _rows(metric: Metric, kwargs: dict, info: TokenInfo, batch):
    """patch_grid's metric(logits, sample_ids) from a compiled Metric: row r is a copy of sample sample_ids[r]."""
    def score(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = ids.tolist()
        fields = {k: [batch.fields[k][i] for i in rows] for k in metric.fields if k in batch.fields}
        inputs = MetricInputs(TokenInfo.of_batch(info.mask[ids], info.keep[ids], info.max_length),
                              kwargs["input_ids"][ids], fields, sample_start=batch.start)
        return metric(logits, inputs)
    return score
