"""Attribution patching: a gradient estimate of every site's patching effect from a few passes, declared like the
patching grids (hookrun.methods.patching) and read with the same reader.

    est = attribution_grid(model, clean, corrupt, info_clean, info_corrupt, ["blocks.0", "blocks.1"],
                           metric=logit_diff)                        # est.estimate [B, layers, positions]
    est = attribution_grid(..., ["blocks.*.attn.heads"], heads="all")                      # [B, layers, heads]
    est = attribution_grid(..., ["blocks.*.attn.heads"], heads="all", per_position=True)   # [B, layers, heads, P]
    est = attribution_grid(..., ["blocks.0.mlp.hidden"], neurons="all", positions="last")  # [B, layers, units]
    est = attribution_grid(..., ["transformer.h.0.attn.c_proj"], role="input", heads="all")   # native names too
    est = attribution_grid(..., method="integrated_gradients", steps=16)

`method="gradient"` (AtP; Nanda 2023, Kramar et al. 2024): estimate(site) = grad_a metric(corrupt) . (a_clean -
a_corrupt), summed over the site's features (a head: its columns at every patched position; a neuron: its unit at
every patched position; per_position=True: a head's columns at each position apart). Cost per batch: a clean
forward (no graph), a corrupt forward with a graph and ONE backward, whatever the number of sites: the gradients
are taken w.r.t. the sites' activations (torch.autograd.grad), so parameters without grad are fine.

`method="integrated_gradients"` (IG over the activation path, as Marks et al. 2024): for each layer, every site of
that layer (its positions, or its heads / neurons at the patched positions) is set JOINTLY to a_corrupt + alpha
(a_clean - a_corrupt), the other layers running as the model computes them; the gradient w.r.t. those values is
averaged over alpha = (k + 0.5) / steps, k = 0 .. steps - 1 (the midpoint rule) and dotted with (a_clean -
a_corrupt). So a layer's sites sum to the exact effect of patching the whole layer as steps grow (completeness),
and each site's estimate is its exact effect where the layer's sites do not interact. The layers are stacked along
the batch axis (copy c interpolates layer c), so the cost per batch is a clean and a corrupt forward plus `steps` x
ceil(layers / copies) forward+backward passes of `copies` x the batch (copies: all layers, up to ~2k tokens a
forward on a CPU).

Sites, positions, donors and paired prompts are patch_grid's (same rules, same errors); `metric(logits,
sample_ids) -> [rows]` must be differentiable in the logits (logit_diff, logprob, prob, loss, or a function of
the logits; rank is not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from hookrun.capture import tokens as tok
from hookrun.capture.checks import same_role_problems
from hookrun.capture.scope import HookScope
from hookrun.capture.targets import attach, heads_problems, n_heads as heads_of
from hookrun.capture.tokens import TokenInfo
from hookrun.config.checks import HUGE, ConfigError, check_choice, check_number, either, unknown_keys
from hookrun.format.layout import ATTRIBUTION, ATTRIBUTION_ATTR, array_key
from hookrun.methods import ACTIVATIONS, Method, MetricUse, emit, run_shape
from hookrun.methods.metrics import logits_of, unhooked
from hookrun.methods.paired import (AUTO_TOKENS, DONORS, SITE_KEYS, PatchError, SitePlan, Sites, axis_labels,
                                    batch_positions, check_sites, grad_rows, grouped, labels_of, metric_rows, pad,
                                    paired_uses,
                                    per_position_check, repeat, site_layers, site_positions, site_problems, sites_of,
                                    patch_grid, length_key, role_problems, source_run)
from hookrun.read.results.patching import PatchGrid, load_attribution

METHODS = ("gradient", "integrated_gradients")
KEYS = {"source": "the role whose activations are the clean end (a key of data.text.fields)",
        "target": "the role whose activations are the corrupt end, where the gradient is taken",
        "sites": "{layers | hook, positions, heads | neurons, role, per_position}",
        "metric": "a name of the metrics block",
        "method": "gradient (AtP) | integrated_gradients", "steps": "integrated_gradients: interpolation steps",
        "verify": "K: exact patching of the K sites with the largest |estimate| a batch",
        "donor": "same | mean | resample | zero", "source_positions": "as patching.source_positions",
        "seed": "the resample seed (plus the batch number)"}
SITES = (*SITE_KEYS, "neurons")
MAX_STEPS = 10 ** 5  # interpolation steps past any use; the memory estimate bounds the rest
LENGTH_FIX = ("attributing every position takes the same position from both prompts, so pairs need one length: give "
              "pairs of the same token length, or attribute positions: last (mapped last to last), or map them with "
              "attribution.source_positions")


class AttributionError(ValueError):
    """An attribution grid that cannot run as asked; `key` names the config key (attribution.<key>)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


@dataclass
class Estimate:
    """An attribution grid of one batch: `estimate` [B, layers, positions | heads | neurons] (per_position: [B,
    layers, heads, positions]; the estimated change of the metric when the site is patched source -> target; NaN
    past a sample's end), `clean` and `corrupt` [B]
    (the source and target runs' metric), the axes, and `passes`: forwards run (each IG step's with a backward)."""

    estimate: torch.Tensor
    clean: torch.Tensor
    corrupt: torch.Tensor
    layers: List[str]
    axis: str
    labels: List[int]
    passes: int
    units: Optional[int] = None  # a neurons grid: the layers' width
    positions: Optional[List[int]] = None  # per_position: the last axis's positions (axis "head" before it)

    @property
    def scores(self) -> torch.Tensor:
        """corrupt + estimate: the estimated metric with the site patched (patch_grid's scores)."""
        return self.corrupt.reshape(-1, *[1] * (self.estimate.dim() - 1)) + self.estimate


def attribution_grid(model: torch.nn.Module, source: Dict[str, torch.Tensor], target: Dict[str, torch.Tensor],
                     info_source: TokenInfo, info_target: TokenInfo, layers: Sequence[str], *, metric: Callable,
                     role: Optional[str] = None, positions="all", source_positions=None, heads=None, neurons=None,
                     n_heads: Optional[int] = None, donor: str = "same", seed: int = 0, method: str = "gradient",
                     steps: int = 16, copies="auto", source_metric: Optional[Callable] = None,
                     per_position: bool = False) -> Estimate:
    """Every site's estimated patching effect (see the module's docstring); the arguments are patch_grid's, plus
    `neurons` (None | "all" | [ints]: a layer's units of a [B, T, F] tensor), `method`, `steps` and `copies` (IG:
    layers interpolated in one forward, stacked along the batch axis; auto). per_position (with heads): the
    estimate of each (head, position) apart, [B, layers, heads, positions]."""
    try:
        per_position_check(per_position, heads, neurons=neurons)
    except PatchError as err:
        raise AttributionError("sites.per_position", f"attribution.sites.{err}") from None
    targets = check_sites(model, layers, role, donor, info_source, info_target, heads)
    names = [t.name for t in targets]
    if method not in METHODS:
        raise AttributionError("method", f"attribution.method: {method!r} is not one of {', '.join(METHODS)}")
    if method == "integrated_gradients" and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise AttributionError("steps", f"attribution.steps: {steps!r}; integrated_gradients takes steps >= 1")
    if heads is not None and neurons is not None:
        raise AttributionError("sites", "attribution.sites: heads and neurons both given; give one of them")
    b = info_target.mask.shape[0]
    ids = torch.arange(b, device=info_target.mask.device)
    with torch.no_grad():
        captured, logits = source_run(model, source, targets, info_source, None)
        clean = (source_metric or metric)(logits, ids).float().cpu()
        del logits
        groups, n_groups = _group_spec(captured, names, info_source, heads, neurons, n_heads)
        sites = sites_of(captured, info_source, info_target, positions, source_positions, groups, n_groups, donor, seed,
                       model, per_position=per_position)
        del captured
    if method == "gradient":
        corrupt, prods = _gradient(model, target, targets, sites, metric, info_target, groups, n_groups)
        passes = 2
    else:
        corrupt, prods, passes = _integrated(model, target, targets, sites, metric, info_target, groups, n_groups,
                                             steps, copies)
    estimate = torch.stack([_reduce(p, sites) for p in prods], 1).cpu()
    if neurons is not None:
        return Estimate(estimate, clean, corrupt, names, "neuron", list(sites.heads), passes, n_groups)
    labels = labels_of(positions, sites.cols.shape[1])
    if sites.heads is not None:
        return Estimate(estimate, clean, corrupt, names, "head", list(sites.heads), passes,
                        positions=labels if per_position else None)
    return Estimate(estimate, clean, corrupt, names, "position", labels, passes)


def _group_spec(captured, names, info, heads, neurons, n_heads):
    """(groups, n_groups) as patching's `heads` / `n_heads` take them: neurons are heads of width 1."""
    if neurons is None:
        return heads, n_heads
    widths = {}
    for name, t in zip(names, captured):
        if not tok.is_tokens(t, info) or t.dim() != 3:
            raise AttributionError("sites.neurons", f"attribution.sites.neurons: {name} gives a tensor of shape "
                                   f"{list(t.shape)}; neurons are the units of a [batch, seq, units] tensor (an MLP's "
                                   "hidden layer, e.g. mlp.act or mlp.c_fc)")
        widths[name] = t.shape[2]
    if len(set(widths.values())) != 1:
        raise AttributionError("sites.neurons", f"attribution.sites.neurons: the layers have {widths} units; a "
                               "neurons grid takes layers of one width")
    width = next(iter(widths.values()))
    if neurons != "all":
        bad = [n for n in neurons if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < width]
        if bad or not neurons:
            raise AttributionError("sites.neurons", f"attribution.sites.neurons: {bad or neurons} not units of "
                                   f"{names[0]}'s {width}; give all or neurons in 0..{width - 1}")
    return neurons, width


def _at(t: torch.Tensor, sites: Sites, info, groups, n_groups, model) -> torch.Tensor:
    """[B, P, G, F] float32: a target-run tensor at the sites' columns."""
    split = grouped(t, info, groups, n_groups, model)
    return split[torch.arange(len(sites.cols), device=t.device)[:, None], sites.cols].float()


def _reduce(prod: torch.Tensor, sites: Sites) -> torch.Tensor:
    """[B, P, G] per-entry estimates -> [B, sites]: a position's (NaN past the end), or a head's summed over
    the patched positions; per_position: [B, heads, P], each head at each position (NaN past the end)."""
    valid = sites.valid
    if sites.heads is None:
        return torch.where(valid, prod[..., 0], torch.full_like(prod[..., 0], float("nan")))
    heads = torch.as_tensor(sites.heads, device=prod.device)
    if sites.per_position:
        return torch.where(valid[..., None], prod, torch.full_like(prod, float("nan")))[:, :, heads].transpose(1, 2)
    summed = torch.where(valid[..., None], prod, torch.zeros_like(prod)).sum(1)  # [B, G]
    return summed[:, heads]


def _differentiable(values: torch.Tensor) -> torch.Tensor:
    if not values.requires_grad:
        raise AttributionError("metric", "attribution.metric: the metric has no gradient path from the sites "
                               "(the model's forward or the metric runs under torch.no_grad / inference_mode or "
                               "detaches, or it is not a function of the logits); attribution takes gradients w.r.t. "
                               "the activations: give a differentiable metric (logit_diff, logprob, prob, loss), or "
                               "use an exact grid (patching:)")
    return values


def _gradient(model, target, targets, sites, metric, info, groups, n_groups):
    """(corrupt metric [B], per layer [B, P, G]: grad . (clean - corrupt)) from one forward and one backward."""
    b = info.mask.shape[0]
    kept: Dict[int, torch.Tensor] = {}

    def keep(i):
        def fn(t):
            if not t.requires_grad:  # parameters without grad: the graph starts at the first site
                t = t.detach().requires_grad_(True)
                kept[i] = t
                return t
            kept[i] = t  # a view of the module's tensor (heads split): the forward must go on from the view
            return t.view_as(t)  # itself, or no gradient reaches it

        return fn

    with HookScope() as scope, torch.inference_mode(False), torch.enable_grad():
        attach(scope, model, targets, [keep(i) for i in range(len(targets))], PatchError)
        values = _differentiable(metric(logits_of(model(**target)), torch.arange(b, device=info.mask.device)))
        grads = torch.autograd.grad(values.float().sum(), [kept[i] for i in range(len(targets))], allow_unused=True)
    prods = []
    with torch.no_grad():
        for i, g in enumerate(grads):
            a = _at(kept[i].detach(), sites, info, groups, n_groups, model)
            if g is None:  # the layer is on no path to the metric
                prods.append(torch.zeros(a.shape[:3], device=a.device))
                continue
            delta = sites.values[i].float() - a
            prods.append((_at(g, sites, info, groups, n_groups, model) * delta).sum(-1))
    return values.detach().float().cpu(), prods


def _entries(sites: Sites):
    """(samples, positions, groups) of every interpolated entry: each valid (sample, position) x each site group."""
    bb, pp = sites.valid.nonzero(as_tuple=True)
    gg = torch.as_tensor(sites.heads if sites.heads is not None else [0], device=bb.device)
    return bb.repeat_interleave(len(gg)), pp.repeat_interleave(len(gg)), gg.repeat(len(bb))


def _integrated(model, target, targets, sites, metric, info, groups, n_groups, steps, copies):
    """(corrupt metric [B], per layer [B, P, G]: mean grad over the path . (clean - corrupt), passes)."""
    b = info.mask.shape[0]
    n_layers = len(targets)
    with torch.no_grad():
        corrupt_acts, logits = source_run(model, target, targets, info, None)
        corrupt = metric(logits, torch.arange(b, device=info.mask.device)).float().cpu()
        del logits
    bb, pp, gg = _entries(sites)
    cols = sites.cols[bb, pp]
    starts = [_at(t, sites, info, groups, n_groups, model)[bb, pp, gg] for t in corrupt_acts]  # [n, F] each
    deltas = [sites.values[i][bb, pp, gg].float() - starts[i] for i in range(n_layers)]
    del corrupt_acts
    k = n_layers if copies == "auto" else int(copies)
    if copies == "auto":
        device = info.mask.device.type
        k = max(1, min(n_layers, AUTO_TOKENS["cuda" if device == "cuda" else "cpu"] // max(info.mask.numel(), 1)))
    sums = [torch.zeros_like(d) for d in deltas]
    plan: Dict[int, tuple] = {}  # layer -> (copy, leaf values [n, F])

    def interpolate(i):
        def fn(t):
            if i not in plan:
                return t
            c, x = plan[i]
            out = t.clone(memory_format=torch.contiguous_format)
            view = out.view(*t.shape[:2], -1, x.shape[-1])  # [B, T, G, F] as grouped splits it
            view[bb + c * b, cols, gg] = x.to(out.dtype)
            return out
        return fn

    passes = 2
    with HookScope() as scope:
        attach(scope, model, targets, [interpolate(i) for i in range(n_layers)], PatchError)
        for step in range(steps):
            alpha = (step + 0.5) / steps
            for first in range(0, n_layers, k):
                chunk = list(range(first, min(first + k, n_layers)))
                plan.clear()
                leaves = []
                for c, i in enumerate(chunk):
                    x = (starts[i] + alpha * deltas[i]).detach().requires_grad_(True)
                    plan[i] = (c, x)
                    leaves.append(x)
                rows = torch.arange(b, device=info.mask.device).repeat(len(chunk))
                with torch.inference_mode(False), torch.enable_grad():
                    values = _differentiable(metric(logits_of(model(**repeat(target, b, len(chunk)))), rows))
                    grads = torch.autograd.grad(values.float().sum(), leaves, allow_unused=True)
                passes += 1
                for i, g in zip(chunk, grads):
                    if g is not None:
                        sums[i] += g.float()
    prods = []
    for i in range(n_layers):
        full = torch.zeros((*sites.cols.shape, sites.values[i].shape[2]), device=info.mask.device)  # [B, P, G]
        full[bb, pp, gg] = (sums[i] / steps * deltas[i]).sum(-1)
        prods.append(full)
    return corrupt, prods, passes


# -- the `attribution:` block in a run ---------------------------------------------------------------------------
@dataclass
class AttributionPlan(SitePlan):
    """An `attribution:` block resolved against the model and the data."""

    neurons: object
    method: str
    steps: int
    verify: int
    axis: str  # position | head | neuron
    labels: Optional[List[int]]  # None: neurons "all", known at the first batch
    width: Optional[int]
    position_labels: Optional[List[int]] = None  # per_position: the positions axis after the heads

    @property
    def sites(self) -> int:
        """The sites of a layer: heads x positions (per_position), else the last axis's width."""
        return self.width * (len(self.position_labels) if self.per_position else 1)


class Attribution(Method):
    """The `attribution:` block: an attribution grid a batch over paired prompts (attribution_grid), scored with a
    metric of the metrics block, optionally checked by exact patching at the K largest estimates. Stores
    `_attribution/<metric>/scores` [samples, layers, positions | heads | neurons] (target + the estimated change),
    `.../source`, `.../target` and (verify) `.../exact` (the patched metric at the verified sites, NaN elsewhere);
    per_position: [samples, layers, heads, positions];
    read back by cap.read("attribution") as a hookrun.methods.patching.PatchGrid (docs/attribution.md)."""

    key = "attribution"
    help = ("`{source: ROLE, target: ROLE, sites: {layers, positions|heads|neurons}, metric: NAME, method: "
            "gradient|integrated_gradients, steps, verify}`: attribution patching a batch (docs/attribution.md)")
    config_errors = (PatchError, AttributionError)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.plan: Optional[AttributionPlan] = None

    @classmethod
    def check(cls, cfg) -> List[str]:
        """Problems with `attribution:` that show without the model or the data."""
        spec = cfg.attribution
        if spec is None:
            return []
        if not isinstance(spec, dict):
            return [f"attribution: {spec!r} is not a mapping; write attribution: {{source: clean, target: corrupt, "
                    "sites: {layers: ${layers}, positions: all}, metric: ld, method: gradient}"]
        problems = unknown_keys("attribution", spec, KEYS, "attribution takes")
        problems += [f"attribution.{k}: missing ({KEYS[k]})" for k in ("source", "target", "sites", "metric")
                     if k not in spec]
        method = spec.get("method", "gradient")
        problems += check_choice("attribution.method", method, METHODS, either(METHODS))
        if "steps" in spec:
            steps = spec["steps"]
            if method != "integrated_gradients":
                problems.append(f"attribution.steps: {steps!r} but method is {method}, which takes no steps; set "
                                "method: integrated_gradients or drop steps ('~attribution.steps' on the command line)")
            else:
                problems += check_number("attribution.steps", steps, whole=True, low=1, high=MAX_STEPS,
                                         fix="the interpolation steps, e.g. steps: 16")
        problems += check_number("attribution.verify", spec.get("verify", 0), whole=True, low=0, high=HUGE,
                                 fix="how many sites a batch to patch exactly; 0: none")
        if "seed" in spec:
            problems += check_number("attribution.seed", spec["seed"], whole=True, low=0, high=2 ** 31)
        problems += check_choice("attribution.donor", spec.get("donor", "same"), DONORS, either(DONORS))
        problems += same_role_problems("attribution", spec.get("source"), spec.get("target"), spec.get("donor", "same"))
        sites = spec.get("sites")
        problems += site_problems(sites, "attribution", SITES)
        if isinstance(sites, dict):
            if "heads" in sites and "neurons" in sites:
                problems.append("attribution.sites: heads and neurons both given; a grid's last axis is one of "
                                "positions, heads or neurons")
            neurons = sites.get("neurons")
            if neurons is not None and neurons != "all" and (
                    not isinstance(neurons, list) or not neurons or
                    any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in neurons)):
                problems.append(f"attribution.sites.neurons: {neurons!r}; give all or a list of unit indices >= 0")
        return problems

    @classmethod
    def metric_uses(cls, cfg) -> List[MetricUse]:
        """The block's metric, measured on the source and target runs, differentiated at the target's sites."""
        return paired_uses(cls.key, getattr(cfg, cls.key, None), gradient=True, fix="; or use an exact grid "
                           "(patching:)")

    def data_problems(self, inputs) -> List[str]:
        """The roles against the data and, patched position by position, every pair of one token length."""
        return role_problems("attribution", self.spec, inputs, length_key(self.spec, "attribution"), LENGTH_FIX)

    def compile(self, job) -> None:
        """The block against the model (layers, heads); the data's roles and lengths were checked before the model
        (data_problems)."""
        spec = self.spec
        problems: List[str] = []
        sites = spec["sites"]
        targets, role = site_layers(job, sites, problems, "attribution")
        layers = [t.name for t in targets]
        positions = site_positions(sites)
        source_positions = spec.get("source_positions")
        if source_positions is None and positions in ("last", "first"):
            source_positions = positions
        donor = spec.get("donor", "same")
        heads, neurons = sites.get("heads"), sites.get("neurons")
        if heads is not None and not problems:
            problems += heads_problems(job.model, targets, "attribution.sites.heads")
        n = heads_of(job.model, targets)
        if isinstance(heads, list) and n:
            problems += [f"attribution.sites.heads: {h!r} is not a head of the model's {n} (0..{n - 1}); list heads "
                         f"in 0..{n - 1} or all" for h in heads if not isinstance(h, int) or not 0 <= h < n]
        if problems:
            raise ConfigError(problems)
        if neurons is not None:
            axis, labels = "neuron", (None if neurons == "all" else [int(u) for u in neurons])
        else:
            axis, labels = axis_labels(job, spec, positions, heads, "attribution", targets)
        method = spec.get("method", "gradient")
        per_position = bool(sites.get("per_position", False))
        self.plan = AttributionPlan(spec["source"], spec["target"], spec["metric"], layers, role, positions,
                                    source_positions, heads, donor, int(spec.get("seed", 0)), per_position,
                                    neurons=neurons, method=method, steps=int(spec.get("steps", 16)),
                                    verify=int(spec.get("verify", 0)), axis=axis, labels=labels,
                                    width=None if labels is None else len(labels),
                                    position_labels=axis_labels(job, spec, positions, None, "attribution")[1]
                                    if per_position else None)
        if labels is not None:
            self._verify_problem()

    def _verify_problem(self) -> None:
        p = self.plan
        total = len(p.layers) * p.sites
        if p.verify > total:
            sites = f"{p.width} {p.axis}s" + (f" x {len(p.position_labels)} positions" if p.per_position else "")
            raise ConfigError([f"attribution.verify: {p.verify} but the grid has {total} sites ({len(p.layers)} "
                               f"layers x {sites}); give at most {total}"])

    def memory_need(self, job) -> List[tuple]:
        """The grid's parts held at once: a forward and backward of the batch (integrated_gradients: as many
        copies as layers, up to ~2k tokens (CPU) or ~128k (GPU) a pass, stacked along the batch axis; its steps
        run one after another and cost time, not memory), with the logits' gradient, and both runs' values at
        every layer."""
        p, s = self.plan, run_shape(job)
        copies = 1
        if p.method == "integrated_gradients":
            tokens = AUTO_TOKENS["cuda" if job.device.type == "cuda" else "cpu"]
            copies = max(1, min(len(p.layers), tokens // max(1, s.batch * s.tokens)))
        per_copy = float(s.itemsize) * s.batch * s.tokens * (2 * s.vocab + ACTIVATIONS * s.d_model * s.layers)
        what = f"{copies} cop{'ies' if copies > 1 else 'y'} of {s.batch} prompts x {s.tokens} tokens, forward and " \
               "backward" + (" (the layers stacked along the batch axis)" if copies > 1 else "")
        return [(copies * per_copy, "data.batch_size", what),
                (3 * 4.0 * len(p.layers) * s.batch * s.tokens * s.d_model, "attribution.sites.layers",
                 f"both runs' values and the gradients' sums at {len(p.layers)} layers")]

    def first_batch_problems(self, job) -> List[str]:
        if self.plan.width is None:
            return []
        try:
            self._verify_problem()
        except ConfigError as err:
            return err.problems
        return []

    def measure(self, job, i: int, batch, output, hookset) -> Dict[str, np.ndarray]:
        """Batch `i`'s estimates (and verified sites), the source and target runs' metric, handed to the store."""
        p = self.plan
        metric = job.method("metrics").metrics[p.metric]
        (skw, sinfo), (tkw, tinfo) = batch.roles[p.source], batch.roles[p.target]
        positions, source_positions = batch_positions(p.positions, batch), batch_positions(p.source_positions, batch)
        with unhooked(hookset):
            est = attribution_grid(job.model, skw, tkw, sinfo, tinfo, p.layers, role=p.role,
                                   metric=grad_rows(metric, tkw, tinfo, batch),
                                   source_metric=metric_rows(metric, skw, sinfo, batch), positions=positions,
                                   source_positions=source_positions, heads=p.heads, neurons=p.neurons,
                                   donor=p.donor, seed=p.seed + i, method=p.method, steps=p.steps,
                                   per_position=p.per_position)
            if p.labels is None:  # neurons: all, as wide as the layer
                p.labels, p.width = list(est.labels), len(est.labels)
            scores = pad(est.scores, self._last_width)
            arrays = {"scores": scores, "source": est.clean, "target": est.corrupt}
            if p.verify:
                arrays["exact"] = self._verify(job, i, batch, est, metric, positions, source_positions)
        for role, values in arrays.items():
            emit(hookset, i, batch, ATTRIBUTION, p.metric, role, values, kind="attribution")
        values = {f"{p.metric}.{p.source}": est.clean, f"{p.metric}.{p.target}": est.corrupt}
        return {c: values[c].cpu().numpy() for c in self.metric_columns}

    def _verify(self, job, i, batch, est: Estimate, metric, positions, source_positions) -> torch.Tensor:
        """[B, layers, width] (per_position: [B, layers, heads, positions]): the exact patched metric (patch_grid) at
        this batch's K sites with the largest mean |estimate| over its samples, NaN elsewhere."""
        p = self.plan
        with np.errstate(all="ignore"):
            # [layers, sites] (per_position: [layers, heads, P])
            size = np.nanmean(np.abs(est.estimate.cpu().numpy()), 0)
        size = size.reshape(len(size), -1)  # a layer's site s: head s // P at position s % P, as patch_grid's `only`
        flat = np.where(np.isnan(size), -np.inf, size).ravel()
        order = np.argsort(-flat, kind="stable")[:p.verify]
        order = order[np.isfinite(flat[order])]
        only = [tuple(int(v) for v in np.unravel_index(o, size.shape)) for o in order]
        (skw, sinfo), (tkw, tinfo) = batch.roles[p.source], batch.roles[p.target]
        groups = p.neurons if p.neurons is not None else p.heads
        with torch.inference_mode():
            grid = patch_grid(job.model, skw, tkw, sinfo, tinfo, p.layers, role=p.role,
                              metric=metric_rows(metric, tkw, tinfo, batch), source_metric=metric_rows(metric, skw, sinfo, batch),
                              positions=positions, source_positions=source_positions, heads=groups,
                              n_heads=est.units, donor=p.donor, seed=p.seed + i, only=only,
                              per_position=p.per_position)
        return pad(grid.scores, self._last_width)

    @property
    def _last_width(self) -> int:
        """The stored grid's last axis: the positions (per_position) or the plan's width."""
        p = self.plan
        return len(p.position_labels) if p.per_position else p.width

    def columns(self) -> List[str]:
        return list(self.metric_columns)

    def attrs(self) -> dict:
        p = self.plan
        return {ATTRIBUTION_ATTR: {"key": array_key(ATTRIBUTION, p.metric, "scores"), "metric": p.metric,
                                   "source": p.source, "target": p.target, "layers": p.layers, "axis": p.axis,
                                   "labels": p.labels, "positions": p.position_labels, "role": p.role or "output",
                                   "method": p.method,
                                   "steps": p.steps if p.method == "integrated_gradients" else None,
                                   "verify": p.verify, "donor": p.donor}}

    @staticmethod
    def read(cap, metric: Optional[str] = None) -> PatchGrid:
        return load_attribution(cap, metric)
