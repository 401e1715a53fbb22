"""Activation patching grids in one pass over a batch: every site (layer x position, or layer x head) of a
source run patched into a target run, one site at a time, several sites sharing a forward.

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
(hookrun.methods.sites). Heads: a standard site split by head (blocks.N.attn.heads: the output projection's input;
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

import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch

from hookrun.capture import tokens as tok
from hookrun.capture.checks import same_role_problems
from hookrun.capture.layers import module_names
from hookrun.capture.tokens import TokenInfo, check_positions, positions_spec
from hookrun.config.checks import ConfigError, as_list, check_choice, either, is_int, is_number, unknown_keys
from hookrun.format.layout import PATCHING, PATCHING_ATTR, array_key
from hookrun.methods import Method, emit
from hookrun.methods.metrics import Metric, MetricInputs, logits_of, unhooked
from hookrun.methods.sites import Target, attach, heads_problems, n_heads as heads_of, patterns_standard, resolve_sites

DONORS = ("same", "mean", "resample", "zero")
ROLES = ("output", "input")
AUTO_TOKENS = {"cpu": 2048, "cuda": 1 << 17}  # rows x tokens a forward "auto" goes up to (a CPU gains nothing past
# ~2k on the bundled LM: its caches overflow; a GPU gains while the forward is launch-bound)


class PatchError(ValueError):
    """A patching grid that cannot run as asked (a length mismatch, an unknown layer, no head axis); `key`: the
    config key it is about, once a run's patching block raised it (config_key)."""

    def __init__(self, message: str, key: Optional[str] = None):
        self.key = key
        super().__init__(message)


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


@dataclass(frozen=True)
class Noise:
    """Seeded gaussian noise added at real-token `positions` of the embedding output (`module`, default the
    model's input embedding); std "auto" = 3x the std of that output over the batch's real tokens (per batch:
    give a float for one level across batches)."""

    positions: object = "all"
    std: Union[float, str] = "auto"
    seed: int = 0
    module: Optional[str] = None


@dataclass
class Grid:
    """A patching grid's metric values: `scores` [B, layers, positions | heads] (per_position: [B, layers, heads,
    positions]; NaN where a position is past a sample's end), `clean` [B] (the source run), `corrupt` [B] (the
    unpatched target run)."""

    scores: torch.Tensor
    clean: torch.Tensor
    corrupt: torch.Tensor
    layers: List[str]
    axis: str  # "position" | "head" | "feature"
    labels: List[int]  # the relative positions (or their index in a per-sample tensor) or the heads
    sites_per_forward: int
    forwards: int
    donors: Optional[torch.Tensor]  # [B] the source sample each target sample took from (None: the mean)
    positions: Optional[List[int]] = None  # per_position: the last axis's positions (axis "head" before it)

    def normalised(self) -> torch.Tensor:
        """(scores - corrupt) / (clean - corrupt) per sample: 0 = no effect, 1 = the clean metric restored."""
        per = (-1, *[1] * (self.scores.dim() - 1))
        return (self.scores - self.corrupt.reshape(per)) / (self.clean - self.corrupt).reshape(per)

    def to_frame(self) -> pd.DataFrame:
        """One row a (sample, layer, position | head[, position]): score, clean, corrupt."""
        axes = [self.labels] + ([] if self.positions is None else [self.positions])
        names = ["sample", "layer", self.axis] + ([] if self.positions is None else ["position"])
        idx = pd.MultiIndex.from_product([range(self.scores.shape[0]), self.layers, *axes], names=names)
        frame = pd.DataFrame({"score": self.scores.reshape(-1).cpu().numpy()}, index=idx).reset_index()
        cells = self.scores[0].numel() if len(self.scores) else 0
        frame["clean"] = self.clean.cpu().numpy().repeat(cells)
        frame["corrupt"] = self.corrupt.cpu().numpy().repeat(cells)
        return frame


@dataclass
class _Sites:
    """What every site patches: target columns [B, P], valid [B, P], source values per layer [B, P, G, F], and
    the heads (a heads grid: site s of a layer is head heads[s] at every position; else site s is position s)."""

    cols: torch.Tensor
    valid: torch.Tensor
    values: List[torch.Tensor]
    heads: Optional[List[int]]
    donors: Optional[torch.Tensor]
    features: Optional[List[int]] = None  # a features grid: site s of a layer is features[s] at every position
    dictionary: Optional[torch.nn.Module] = None  # values there are [B, P, features, 1]: the source's activations
    per_position: bool = False  # a heads grid split by position: site s of a layer is head heads[s // P] at
    # position s % P

    @property
    def groups(self) -> Optional[List[int]]:
        """The sites of a layer patched at every position: the heads, or the features' indices in `features`."""
        return self.heads if self.features is None else list(range(len(self.features)))

    @property
    def count(self) -> Tuple[int, int]:  # (layers, sites a layer)
        n_pos = self.cols.shape[1]
        if self.groups is None:
            return len(self.values), n_pos
        return len(self.values), len(self.groups) * (n_pos if self.per_position else 1)


def patch_grid(model: torch.nn.Module, source: Dict[str, torch.Tensor], target: Dict[str, torch.Tensor],
               info_source: tok.TokenInfo, info_target: tok.TokenInfo, layers: Sequence[str], *,
               metric: Callable, role: Optional[str] = None, positions="all", source_positions=None, heads=None,
               n_heads: Optional[int] = None, donor: str = "same", seed: int = 0, source_noise: Optional[Noise] = None,
               target_noise: Optional[Noise] = None, sites_per_forward: Union[int, str] = "auto",
               source_metric: Optional[Callable] = None, only: Optional[Sequence[Tuple[int, int]]] = None,
               dictionary: Optional[torch.nn.Module] = None, features: Optional[Sequence[int]] = None,
               per_position: bool = False) -> Grid:
    """The metric with each site of `layers` (x positions, or x heads) patched from `source` into `target`.

    layers: standard names (`blocks.*`, `blocks.0-3.attn.heads`: hookrun.capture.anatomy) or native module names.
    role: a native module's output | input (a tuple output: its first element; input: the first positional
    argument, else the first tensor keyword); None = output; refused with a standard name (it has one value).
    heads: None (a layers x positions grid) | "all" | [ints] (layers x heads: a standard site split by head, or a
    native tensor [B, T, H*Dh] split into the anatomy's heads, or n_heads). source_metric: the metric of the source run (default:
    `metric`; give one when it finds positions from the target's lengths and the prompts differ). only: patch just
    these (layer index, site index) pairs (NaN at the other sites): attribution's verify. dictionary, features: a
    layers x features grid (one feature at every position of `positions` a site; the module docstring).
    per_position: with heads, each (head, position of `positions`) patched alone: scores [B, layers, heads,
    positions] (site index h * P + p for `only`)."""
    _per_position_check(per_position, heads, dictionary, features)
    targets = _check(model, layers, role, donor, info_source, info_target, heads if n_heads is None else None)
    names = [t.name for t in targets]
    features = _features(dictionary, features, heads)
    b = info_target.mask.shape[0]
    with torch.inference_mode():
        captured, src_logits = _source_run(model, source, targets, info_source, source_noise)
        clean = (source_metric or metric)(src_logits, torch.arange(b, device=src_logits.device)).float().cpu()
        del src_logits
        sites = _sites(captured, info_source, info_target, positions, source_positions, heads, n_heads, donor,
                       seed, model, dictionary, features, per_position)
        del captured
        with _noised(model, info_target, target_noise):
            corrupt, per_copy = _target_run(model, target, b, metric, sites_per_forward == "auto")
            k = _sites_per_forward(sites_per_forward, per_copy, sites, info_target)
            scores, forwards = _grid(model, target, targets, sites, metric, k, only)
    if sites.features is not None:
        return Grid(scores, clean, corrupt, names, "feature", sites.features, k, forwards, sites.donors)
    labels = _labels(positions, sites.cols.shape[1])
    if sites.heads is not None:
        return Grid(scores, clean, corrupt, names, "head", sites.heads, k, forwards, sites.donors,
                    labels if per_position else None)
    return Grid(scores, clean, corrupt, names, "position", labels, k, forwards, sites.donors)


def _per_position_check(per_position, heads, dictionary=None, features=None, neurons=None) -> None:
    """PatchError for per_position that is not a bool, or not on a heads grid."""
    if not isinstance(per_position, bool):
        raise PatchError(f"per_position: {per_position!r} is not true or false")
    if per_position and (heads is None or dictionary is not None or features is not None or neurons is not None):
        raise PatchError("per_position: true splits a heads grid by position (layers x heads x positions); give "
                         "heads (all or a list) on a site split by head, or drop per_position (a grid without heads "
                         "is already layers x positions)")


def _check(model, layers, role, donor, info_source, info_target, heads=None) -> List[Target]:
    """The resolved sites; PatchError for an unknown layer, role or donor, a heads grid at a site not split by
    head, or batches of different sizes."""
    problems = (check_choice("role", role, ROLES, "output (what the module returns) or input (its first argument)")
                if role is not None else []) + \
        check_choice("donor", donor, DONORS, "same (sample b into sample b), mean, resample or zero")
    if problems:
        raise PatchError("; ".join(problems))
    targets, problems = resolve_sites(model, list(layers), role, "layers")
    if heads is not None and not problems:
        problems = heads_problems(model, targets, "heads")
    if problems:
        raise PatchError("; ".join(problems))
    bs, bt = info_source.mask.shape[0], info_target.mask.shape[0]
    if bs != bt:
        raise PatchError(f"source has {bs} samples but target {bt}; give batches of paired prompts, one a sample")
    return targets


def _features(dictionary, features, heads) -> Optional[List[int]]:
    """The features of a features grid (None without a dictionary); PatchError for a feature out of the dictionary's
    range, features without a dictionary, or features and heads together."""
    if dictionary is None and features is None:
        return None
    if dictionary is None or features is None:
        raise PatchError("features: a features grid needs both dictionary= (the module) and features= (their ids)")
    if heads is not None:
        raise PatchError("features: a grid's last axis is heads or features; drop one")
    from hookrun.methods.dictionaries import dims

    d_sae = dims(dictionary)[1]
    listed = as_list(features)
    bad = [f for f in listed if not is_int(f) or f < 0 or (d_sae is not None and f >= d_sae)]
    if bad or not listed:
        raise PatchError(f"features: {features!r} is not a list of feature ids in 0..{(d_sae or 0) - 1} (the "
                         f"dictionary has {d_sae} features); pick features it has")
    return [int(f) for f in listed]


def _source_run(model, source, targets: List[Target], info, noise) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """The source's tensor at every site ([B, T, ...], in memory) and its logits."""
    captured: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(targets))}

    def keep(i):
        return lambda t: captured[i].append(t) or t

    handles = _attach(model, targets, [keep(i) for i in range(len(targets))])
    try:
        with _noised(model, info, noise):
            logits = logits_of(model(**source))
    finally:
        for h in handles:
            h.remove()
    for i, got in captured.items():
        if len(got) != 1:
            raise PatchError(f"layers: {targets[i].name} was called {len(got)} times in one forward; patch_grid "
                             "patches modules called once a forward (name one that is)")
    return [captured[i][0] for i in range(len(targets))], logits


def _attach(model, targets: List[Target], fns: List[Callable[[torch.Tensor], torch.Tensor]]) -> list:
    """Hooks applying fns[i] to the value of targets[i] (and passing on what it returns): hookrun.methods.sites."""
    return attach(model, targets, fns, PatchError)


def _resolve(info: tok.TokenInfo, spec, key: str, width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(columns [B, P], valid [B, P]) of real-token positions: all (P = width, default the longest sequence) |
    last | first | int | [ints] | LongTensor [B, P]."""
    lengths = info.lengths[:, None]
    if isinstance(spec, str) and spec == "all":
        rel = torch.arange(width or int(lengths.max()), device=lengths.device)[None, :].expand(len(lengths), -1)
        valid = rel < lengths
        return torch.where(valid, info.first[:, None] + rel, 0), valid  # column 0 where past the end: never patched
    if isinstance(spec, torch.Tensor):
        rel = spec.to(lengths.device).long()
        if rel.shape[0] != len(lengths) or rel.dim() != 2:
            raise PatchError(f"{key}: a tensor of positions is [samples, P]; got {list(rel.shape)} for "
                             f"{len(lengths)} samples")
        rel = torch.where(rel < 0, lengths + rel, rel)
        bad = ((rel < 0) | (rel >= lengths)).any(1).nonzero()
        if len(bad):
            i = int(bad[0])
            raise PatchError(f"{key}: sample {i} has {int(lengths[i])} real tokens; positions {spec[i].tolist()} "
                             "reach beyond it")
        return info.first[:, None] + rel, torch.ones_like(rel, dtype=torch.bool)
    problems = tok.check_positions(key, spec)
    if problems:
        raise PatchError(problems[0].replace("first, an int", "first, all, an int"))
    try:
        cols = tok.columns(info, tok.positions_spec(spec)[0], key)
    except tok.TokenError as err:
        raise PatchError(str(err)) from None
    return cols, torch.ones_like(cols, dtype=torch.bool)


def _donors(donor: str, b: int, seed: int, device) -> Optional[torch.Tensor]:
    """The source sample each target sample takes from (None for mean and zero): b itself, or a seeded derangement."""
    if donor == "same":
        return torch.arange(b, device=device)
    if donor in ("mean", "zero"):
        return None
    if b < 2:
        raise PatchError("donor=resample needs at least two samples in the batch")
    order = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    cycle = torch.empty(b, dtype=torch.long)
    cycle[order] = order.roll(-1)  # one cycle through every sample: nobody is their own donor
    return cycle.to(device)


def _check_lengths(info_source, info_target, donors: torch.Tensor) -> None:
    """PatchError naming the first target sample whose donor has another real length."""
    src, tgt = info_source.lengths[donors], info_target.lengths
    bad = (src != tgt).nonzero()
    if len(bad):
        i = int(bad[0])
        raise PatchError(f"sample {i} has {int(src[i])} real tokens in the source (sample {int(donors[i])}) but "
                         f"{int(tgt[i])} in the target; position-wise patching takes the same real position, so "
                         "paired prompts need equal lengths: pair prompts of one length, or map positions with "
                         "source_positions= (e.g. positions='last', source_positions='last')")


def _sites(captured, info_source, info_target, positions, source_positions, heads, n_heads, donor, seed,
           model, dictionary=None, features=None, per_position=False) -> _Sites:
    """Target columns and the source value patched at every (layer, position | head)."""
    cols, valid = _resolve(info_target, positions, "positions")
    donors = _donors(donor, len(cols), seed, cols.device)
    if source_positions is None and donors is not None:
        _check_lengths(info_source, info_target, donors)
    src_cols, src_valid = _resolve(info_source, positions if source_positions is None else source_positions,
                                   "source_positions", width=cols.shape[1])
    if src_cols.shape[1] != cols.shape[1]:
        raise PatchError(f"source_positions: {src_cols.shape[1]} positions but positions has {cols.shape[1]}; "
                         "give one source position for each target position")
    values = []
    for t in captured:
        grouped = _grouped(t, info_source, heads, n_heads, model)
        if features is not None:  # the source's activations of the features, one group a feature
            grouped = _encode(dictionary, t, features)
        at = grouped[torch.arange(len(src_cols), device=t.device)[:, None], src_cols.to(t.device)]  # [Bs, P, G, F]
        at = at.to(cols.device)  # the sites live on the inputs' device (a device map runs layers elsewhere)
        if donor == "zero":
            values.append(torch.zeros_like(at))
        elif donor == "mean":
            values.append(_mean(at, src_valid, valid))
        else:
            values.append(at[donors])
    return _Sites(cols, valid, values, None if heads is None else _heads(heads, values[0].shape[2]), donors,
                  features, dictionary, per_position)


def _encode(dictionary, t: torch.Tensor, features: List[int]) -> torch.Tensor:
    """[..., len(features), 1]: the features' activations of t [..., d_in] (PatchError if t is not d_in wide)."""
    from hookrun.methods.dictionaries import dims

    d_in = dims(dictionary)[0]
    if d_in is not None and t.shape[-1] != d_in:
        raise PatchError(f"layers: the dictionary reads {d_in}-wide activations but this layer's tensor is "
                         f"{list(t.shape)}; patch features at the layer the dictionary was trained on")
    return dictionary.encode(t)[..., features, None].to(t.dtype)


def _direction(dictionary, feature: int) -> torch.Tensor:
    """A feature's decoder direction [d_in] (hookrun.methods.dictionaries.FeatureEdit.direction)."""
    from hookrun.methods.dictionaries import FeatureEdit

    return FeatureEdit(dictionary, "patching", feature, "add", 1.0).direction()


def _mean(at: torch.Tensor, src_valid: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, P, G, F] -> the mean over the samples that have each position, for every sample."""
    count = src_valid.sum(0)
    if bool((count[valid.any(0)] == 0).any()):
        raise PatchError("donor=mean: a target position is past the end of every source sample")
    mean = (at * src_valid[:, :, None, None].to(at.dtype)).sum(0) / count.clamp(min=1)[:, None, None].to(at.dtype)
    return mean[None].expand(*at.shape)


def _grouped(t: torch.Tensor, info, heads, n_heads, model) -> torch.Tensor:
    """[B, T, G, F]: G = 1 for a positions grid; the heads for a heads grid ([B, T, H*Dh] or [B, T, H, Dh])."""
    if not tok.is_tokens(t, info):
        raise PatchError(f"layers: a tensor of shape {list(t.shape)} has no [batch, sequence] axes of the batch "
                         f"{list(info.mask.shape)}; patch a per-token tensor (role output or input)")
    if heads is None:
        return t.reshape(*t.shape[:2], 1, -1)
    if t.dim() == 4:
        return t
    if t.dim() != 3:
        raise PatchError(f"heads: a tensor of shape {list(t.shape)} has no head axis; name the module whose input "
                         "or output is [batch, seq, heads*d_head] (e.g. attn.c_proj / self_attn.o_proj, role input)")
    h = n_heads or heads_of(model, [])
    if not h or t.shape[2] % h:
        raise PatchError(f"heads: cannot split {t.shape[2]} features into {h} heads; give n_heads=")
    return t.reshape(*t.shape[:2], h, -1)


def _heads(spec, n: int) -> List[int]:
    """The heads of a heads grid: every one of the n for "all", else the list given (checked against n)."""
    listed = list(range(n)) if spec == "all" else as_list(spec)
    bad = [h for h in listed if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < n]
    if bad or not listed:
        raise PatchError(f"heads: {spec!r} is not all or a list of heads in 0..{n - 1}")
    return listed


def _labels(positions, n: int) -> List[int]:
    if isinstance(positions, (int, str, list, tuple)) and positions != "all":
        return tok.positions_spec(positions)[0]
    return list(range(n))


class _noised:
    """While active, adds seeded noise to the output of the Noise's module at its positions; drawn at the first
    call (the batch itself, whose real tokens set std "auto"), the same for every copy of the batch after it."""

    def __init__(self, model, info: tok.TokenInfo, noise: Optional[Noise]):
        self.info, self.noise, self.draw, self.handle = info, noise, None, None
        if noise is not None:
            named = module_names(model)
            self.module = model.get_input_embeddings() if noise.module is None else named.get(noise.module)
            if self.module is None:
                raise PatchError(f"Noise.module: {noise.module!r} is not a module of the model")

    def __enter__(self):
        if self.noise is not None:
            self.handle = self.module.register_forward_hook(lambda m, a, out: out + self._draw(out))
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()

    def _draw(self, out: torch.Tensor) -> torch.Tensor:
        if self.draw is None:
            info, noise = self.info, self.noise
            info = info.to(out.device)  # the noised module may run on another device than the inputs (device map)
            std = 3 * float(out[info.mask].float().std()) if noise.std == "auto" else float(noise.std)
            cols, valid = _resolve(info, noise.positions, "Noise.positions")
            mask = torch.zeros(info.mask.shape, dtype=torch.bool, device=out.device)
            mask[torch.arange(len(cols), device=cols.device)[:, None].expand_as(cols)[valid], cols[valid]] = True
            gen = torch.Generator().manual_seed(noise.seed)  # drawn on the CPU: the same numbers on every device
            draw = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.device, out.dtype) * std
            self.draw = draw * mask.reshape(*mask.shape, *([1] * (out.dim() - 2)))
        return self.draw.repeat(out.shape[0] // self.draw.shape[0], *([1] * (out.dim() - 1)))


def _repeat(inputs: Dict[str, torch.Tensor], b: int, k: int) -> Dict[str, torch.Tensor]:
    """The batch's keyword inputs with every [B, ...] tensor repeated k times along the batch axis."""
    return {key: v.repeat(k, *([1] * (v.dim() - 1))) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b
            else v for key, v in inputs.items()}


def _target_run(model, target, b: int, metric, measure: bool) -> Tuple[torch.Tensor, int]:
    """(the unpatched target's metric [B], bytes one copy of the batch needs in a forward if `measure`: the peak
    on CUDA, the sum of every module's output on a CPU)."""
    device = target["input_ids"].device if "input_ids" in target else next(model.parameters()).device
    cuda = measure and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    sizes = []
    handles = [m.register_forward_hook(lambda m, a, o: sizes.append(_nbytes(o)))
               for m in model.modules()] if measure and not cuda else []
    try:
        values = metric(logits_of(model(**target)), torch.arange(b, device=device)).float().cpu()
    finally:
        for h in handles:
            h.remove()
    per_copy = torch.cuda.max_memory_allocated(device) - base if cuda else sum(sizes)
    return values, max(int(per_copy), 1)


def _nbytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return 0


def _sites_per_forward(spec, per_copy: int, sites: _Sites, info) -> int:
    """k: the number given, or "auto": as many copies as half the free memory holds, at most AUTO_TOKENS rows x
    tokens a forward (beyond it a CPU gains nothing) and at most the sites of the grid."""
    n_layers, per_layer = sites.count
    total = n_layers * per_layer
    if spec != "auto":
        if not isinstance(spec, int) or isinstance(spec, bool) or spec < 1:
            raise PatchError(f"sites_per_forward: {spec!r} must be a positive integer or auto")
        return min(spec, total)
    device = info.mask.device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = _available_memory()
    tokens = AUTO_TOKENS["cuda" if device.type == "cuda" else "cpu"]
    by_tokens = tokens // max(info.mask.numel(), 1)
    return max(1, min(total, int(free // 2 // per_copy), by_tokens))


def _available_memory() -> int:
    """Bytes the OS can still give this process (MemAvailable; 1 GiB when it cannot say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30


def _grid(model, target, targets, sites: _Sites, metric, k: int, only=None) -> Tuple[torch.Tensor, int]:
    """The metric [B, layers, sites a layer] with one site patched per copy of the target, k copies a forward
    (`only`: just those (layer, site) pairs, NaN elsewhere)."""
    b = sites.cols.shape[0]
    n_layers, per_layer = sites.count
    order = [(layer, s) for layer in range(n_layers) for s in range(per_layer)] if only is None else \
        [(int(layer), int(s)) for layer, s in only]
    plan: Dict[int, tuple] = {}
    patcher = _patcher if sites.features is None else _feature_patcher(sites)
    handles = _attach(model, targets, [patcher(plan, i) for i in range(len(targets))])
    repeated: Dict[int, dict] = {}
    values = []  # [copies, B] a forward, kept on the device until the end (no sync a forward)
    try:
        for start in range(0, len(order), k):
            chunk = order[start:start + k]
            plan.clear()
            plan.update(_plan(sites, chunk, b))
            if len(chunk) not in repeated:
                repeated[len(chunk)] = _repeat(target, b, len(chunk))
            ids = torch.arange(b, device=sites.cols.device).repeat(len(chunk))
            values.append(metric(logits_of(model(**repeated[len(chunk)])), ids).float().reshape(len(chunk), b))
    finally:
        for h in handles:
            h.remove()
    every = torch.cat(values).cpu() if values else torch.zeros(0, b)  # [sites, B] in `order`
    if only is None:
        scores = every.T.reshape(b, n_layers, per_layer).clone()
    else:
        scores = torch.full((b, n_layers, per_layer), float("nan"))
        if order:
            scores[:, [layer for layer, _ in order], [s for _, s in order]] = every.T
    if sites.groups is None:
        scores[~sites.valid.cpu()[:, None, :].expand_as(scores)] = float("nan")
    elif sites.per_position:  # [B, layers, heads, positions], NaN past a sample's end
        scores = scores.reshape(b, n_layers, len(sites.groups), -1)
        scores[~sites.valid.cpu()[:, None, None, :].expand_as(scores)] = float("nan")
    return scores, len(values)


def _plan(sites: _Sites, chunk: List[Tuple[int, int]], b: int) -> Dict[int, tuple]:
    """layer -> (rows, columns, groups, values) of the copies in `chunk` that patch that layer."""
    device = sites.cols.device
    plan = {}
    for layer in sorted({layer for layer, _ in chunk}):
        copies = torch.tensor([c for c, (lay, _) in enumerate(chunk) if lay == layer], device=device)
        which = torch.tensor([s for lay, s in chunk if lay == layer], device=device)
        n_pos = sites.cols.shape[1]
        if sites.per_position:  # the copy's head at the copy's position
            pos = (which % n_pos)[:, None]
            group = torch.as_tensor(sites.groups, device=device)[which // n_pos][:, None]
        elif sites.groups is not None:  # every position of the copy's head (or feature)
            pos = torch.arange(n_pos, device=device)[None, :].expand(len(copies), -1)  # [C, P]
            group = torch.as_tensor(sites.groups, device=device)[which][:, None].expand(-1, n_pos)
        else:  # the copy's position, the only group
            pos, group = which[:, None], torch.zeros_like(which)[:, None]
        sample = torch.arange(b, device=device)[None, :, None]  # [1, B, 1] against [C, 1, J]
        rows = (copies[:, None, None] * b + sample).expand(-1, -1, pos.shape[1])
        cols = sites.cols[sample, pos[:, None, :]]
        keep = sites.valid[sample, pos[:, None, :]]
        groups = group[:, None, :].expand_as(cols)
        values = sites.values[layer][sample, pos[:, None, :], groups]  # [C, B, J, F]
        plan[layer] = (rows[keep], cols[keep], groups[keep], values[keep])
    return plan


def _patcher(plan: Dict[int, tuple], layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The hook function of one layer: its tensor with this forward's sites of that layer replaced."""
    def patch(t: torch.Tensor) -> torch.Tensor:
        if layer not in plan:
            return t
        rows, cols, groups, values = (x.to(t.device) for x in plan[layer])  # no copy on the inputs' device
        out = t.clone(memory_format=torch.contiguous_format)
        out.view(*t.shape[:2], -1, values.shape[-1])[rows, cols, groups] = values.to(out.dtype)
        return out
    return patch


def _feature_patcher(sites: _Sites):
    """_patcher for a features grid: at each patched (row, column) adds (f_source - f_target) * the feature's
    decoder direction, f_target encoded from the tensor there (the reconstruction error kept)."""
    dictionary = sites.dictionary
    directions = torch.stack([_direction(dictionary, f) for f in sites.features])  # [G, d_in]
    ids = torch.as_tensor(sites.features)

    def make(plan: Dict[int, tuple], layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def patch(t: torch.Tensor) -> torch.Tensor:
            if layer not in plan:
                return t
            rows, cols, groups, values = (x.to(t.device) for x in plan[layer])
            at = t[rows, cols]  # [N, d_in]
            feature = ids.to(t.device)[groups]
            now = dictionary.encode(at).gather(-1, feature[:, None])  # [N, 1]
            delta = (values.to(now.dtype) - now) * directions.to(t.device)[groups].to(now.dtype)
            out = t.clone(memory_format=torch.contiguous_format)
            out[rows, cols] = at + delta.to(t.dtype)
            return out
        return patch
    return make


# -- the `patching:` block in a run ------------------------------------------------------------------------------
PATCH_KEYS = {"source": "the role whose sites are patched in (a key of data.text.fields)",
              "target": "the role they are patched into",
              "sites": "{layers | hook, positions, heads | dictionary + features, role, per_position}",
              "metric": "a name of the metrics block", "donor": "same | mean | resample | zero",
              "noise": "{positions, std, seed, on: target | source}: causal tracing",
              "source_positions": "the source's position for each patched position (prompts of other lengths)",
              "seed": "the resample and noise seed (plus the batch number)",
              "sites_per_forward": "sites patched in one forward (copies along the batch axis); auto"}
SITE_KEYS = ("layers", "hook", "positions", "heads", "role", "dictionary", "features", "per_position")


@dataclass
class SitePlan:
    """What a block of sites resolved against the model and the data holds, patching's and attribution's alike."""

    source: str
    target: str
    metric: str
    layers: List[str]
    role: Optional[str]  # a native site's role; None: output, or a standard site (which takes none)
    positions: object
    source_positions: object
    heads: object
    donor: str
    seed: int
    per_position: bool  # a heads grid split by position: layers x heads x positions


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
        if "metric" in spec and spec["metric"] not in (cfg.metrics or {}):
            problems.append(f"patching.metric: {spec['metric']!r} is not a metric of the metrics block "
                            f"({', '.join(cfg.metrics or {}) or 'none'}); declare it there, e.g. metrics: "
                            "{ld: {metric: logit_diff, a: ' Paris', b: ' Rome'}}")
        donor = spec.get("donor", "same")
        problems += check_choice("patching.donor", donor, DONORS, either(DONORS))
        problems += same_role_problems("patching", spec.get("source"), spec.get("target"), donor)
        if "seed" in spec and not is_int(spec["seed"]):
            problems.append(f"patching.seed: {spec['seed']!r} is not an integer; give the resample and noise seed, "
                            "e.g. patching.seed=0")
        sites = spec.get("sites")
        named = sites.get("dictionary") if isinstance(sites, dict) else None
        if named is not None:
            from hookrun.methods.dictionaries import unknown_problems

            problems += unknown_problems("patching.sites.dictionary", named,
                                         list(getattr(cfg, "dictionaries", None) or {}))
        return problems + _noise_problems(spec.get("noise")) + _site_problems(sites)

    def compile(self, job) -> None:
        roles = list(getattr(job.inputs, "roles", None) or [])
        self.plan = _plan_block(job, self.spec, job.method("metrics").metrics, roles)

    def measure(self, job, i: int, batch, output, hookset) -> Dict[str, np.ndarray]:
        """Batch `i`'s grid, and the source and target runs' metric, handed to the store; their sample columns."""
        plan = self.plan
        with unhooked(hookset), torch.inference_mode():
            grid = _batch_grid(job, i, batch)
        for role, values in (("scores", grid.scores), ("source", grid.clean), ("target", grid.corrupt)):
            emit(hookset, i, batch, PATCHING, plan.metric, role, values, kind="patching")
        return {f"{plan.metric}.{plan.source}": grid.clean.cpu().numpy(),
                f"{plan.metric}.{plan.target}": grid.corrupt.cpu().numpy()}

    def columns(self) -> List[str]:
        p = self.plan
        return [f"{p.metric}.{p.source}", f"{p.metric}.{p.target}"]

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
    if positions != "all" and not _is_field(positions):
        problems += [p + "; or all, or {field: NAME} (per-sample positions)"
                     for p in check_positions("patching.noise.positions", positions)]
    std = noise.get("std", "auto")
    if std != "auto" and not (is_number(std) and math.isfinite(std) and std >= 0):
        problems.append(f"patching.noise.std: {std!r} must be auto (3x the embeddings' std) or a finite number >= 0")
    if "seed" in noise and not is_int(noise["seed"]):
        problems.append(f"patching.noise.seed: {noise['seed']!r} is not an integer")
    problems += check_choice("patching.noise.on", noise.get("on", "target"), ("target", "source"),
                             "target (the run patched into) or source")
    if "module" in noise and not isinstance(noise["module"], str):
        problems.append(f"patching.noise.module: {noise['module']!r} is not a module name")
    return problems


def _heads_spec_problems(heads, key: str = "patching") -> List[str]:
    """<key>.sites.heads: all, a head index or a list of them."""
    if heads is None or heads == "all":
        return []
    listed = heads if isinstance(heads, list) else [heads]
    if listed and all(is_int(h) and h >= 0 for h in listed):
        return []
    return [f"{key}.sites.heads: {heads!r} is not all or a list of head indices (e.g. [0, 3]); give heads: all "
            "for every head"]


def _site_problems(sites, key: str = "patching", keys: Sequence[str] = SITE_KEYS) -> List[str]:
    """Problems with a `sites:` block (of `key`: patching, or attribution with its own `keys`)."""
    if sites is None:
        return []
    if not isinstance(sites, dict):
        return [f"{key}.sites: {sites!r} is not a mapping; write {{layers: [...], positions: all}}"]
    problems = unknown_keys(f"{key}.sites", sites, keys, "sites take")
    if "layers" not in sites and "hook" not in sites:
        problems.append(f"{key}.sites: name the layers (layers: [...]) or a hook whose layers to patch (hook: NAME)")
    positions = _site_positions(sites)
    per_position = sites.get("per_position", False)
    if not isinstance(per_position, bool):
        problems.append(f"{key}.sites.per_position: {per_position!r} is not true or false; per_position: true "
                        "splits a heads grid by position (layers x heads x positions)")
    elif per_position and (sites.get("heads") is None or any(sites.get(k) is not None for k in
                                                             ("neurons", "features", "dictionary"))):
        problems.append(f"{key}.sites.per_position: true splits a heads grid by position (layers x heads x "
                        "positions); give heads: all (or a list) with layers split by head (blocks.*.attn.heads), "
                        "or drop per_position (a grid without heads is already layers x positions)")
    if sites.get("heads") is not None and sites.get("positions") is not None and not per_position:
        problems.append(f"{key}.sites: both positions ({sites['positions']!r}) and heads ({sites['heads']!r}); a "
                        "grid's last axis is positions or heads: drop one (on the command line "
                        f"'~{key}.sites.positions', or positions: null in an experiment that inherits a grid), or "
                        "add per_position: true for a layers x heads x positions grid")
    if positions != "all" and not _is_field(positions):
        problems += [p + "; or all, or {field: NAME} (per-sample positions)"
                     for p in check_positions(f"{key}.sites.positions", positions)]
    problems += check_choice(f"{key}.sites.role", sites.get("role", "output"), ROLES, either(ROLES))
    return problems + _heads_spec_problems(sites.get("heads"), key) + _features_spec_problems(sites, key)


def _features_spec_problems(sites: dict, key: str) -> List[str]:
    """<key>.sites.dictionary and .features: both or neither, features a list of feature ids, no heads beside them."""
    dictionary, features = sites.get("dictionary"), sites.get("features")
    if dictionary is None and features is None:
        return []
    if dictionary is None or features is None:
        return [f"{key}.sites.{'features' if features is None else 'dictionary'}: missing; a features grid names the "
                "dictionary and its features, e.g. sites: {layers: [transformer.h.1], dictionary: sae1, "
                "features: [12, 40]}"]
    problems = []
    if not isinstance(dictionary, str):
        problems.append(f"{key}.sites.dictionary: {dictionary!r} is not a name of the dictionaries block")
    listed = features if isinstance(features, list) else [features]
    if not listed or not all(is_int(f) and f >= 0 for f in listed):
        problems.append(f"{key}.sites.features: {features!r} is not a list of feature ids (e.g. [12, 40])")
    if sites.get("heads") is not None:
        problems.append(f"{key}.sites: both heads and features; a grid's last axis is one of them: drop one")
    return problems


def _site_positions(sites: dict):
    """The positions of a sites block: all where not given (or null, which drops an inherited grid's)."""
    return "all" if sites.get("positions") is None else sites["positions"]


def _is_field(value) -> bool:
    return isinstance(value, dict) and set(value) == {"field"}


def _plan_block(job, spec: dict, metrics: Dict[str, Metric], roles: List[str]) -> PatchPlan:
    have = ", ".join(roles) or "none: give paired prompts with data.text.fields: {clean: ..., corrupt: ...}"
    problems = [f"patching.{k}: {spec[k]!r} is not a role of the data ({have})" for k in ("source", "target")
                if spec[k] not in roles]
    if metrics[spec["metric"]].needs_reference:
        problems.append(f"patching.metric: {spec['metric']} is a kl, which the grid cannot score (each patched copy "
                        "would need its own reference); use logit_diff, logprob, prob, rank or loss")
    sites = spec["sites"]
    targets, role = _layers(job, sites, problems)
    layers = [t.name for t in targets]
    if sites.get("heads") is not None and not problems:
        problems += heads_problems(job.model, targets, "patching.sites.heads")
    problems += _field_problems(job, spec)
    positions = _site_positions(sites)
    source_positions = spec.get("source_positions")
    if source_positions is None and positions in ("last", "first"):
        source_positions = positions  # named positions map by name: prompts may differ in length
    if source_positions is None and not problems and spec.get("donor", "same") != "zero":
        problems += job.inputs.length_problems(spec["source"], spec["target"], "patching.sites.positions")
    if problems:
        raise ConfigError(problems)
    heads = sites.get("heads")
    dictionary, features = sites.get("dictionary"), sites.get("features")
    if dictionary is not None:
        features = [int(f) for f in as_list(features)]
        _check_features(job, dictionary, features)
        axis, labels = "feature", features
    else:
        axis, labels = _axis_labels(job, spec, positions, heads, targets=targets)
    per_position = bool(sites.get("per_position", False))
    position_labels = _axis_labels(job, spec, positions, None)[1] if per_position else None
    width = len(position_labels) if per_position else len(labels)
    return PatchPlan(spec["source"], spec["target"], spec["metric"], layers, role, positions, source_positions, heads,
                     spec.get("donor", "same"), int(spec.get("seed", 0)), per_position, spec.get("noise"),
                     spec.get("sites_per_forward", "auto"), axis, labels, width, dictionary, features,
                     position_labels)


def _dictionary(job, name: str):
    """The dictionary `name` of the run's dictionaries block, loaded once (here, before that method compiles)."""
    from hookrun.methods.dictionaries import DictionaryError, load_dictionary

    method = job.method("dictionaries")
    if name not in method.loaded:
        try:
            method.loaded[name] = load_dictionary(method.spec[name], device=job.device)
        except DictionaryError as err:
            raise ConfigError([f"dictionaries.{name}: {err}"]) from None
    return method.loaded[name]


def _check_features(job, name: str, features: List[int]) -> None:
    """ConfigError for a feature beyond the dictionary's width (a layer of another width: PatchError at batch 0)."""
    from hookrun.methods.dictionaries import dims

    d_in, d_sae = dims(_dictionary(job, name))
    bad = [f for f in features if d_sae is not None and f >= d_sae]
    if bad:
        raise ConfigError([f"patching.sites.features: {bad[0]} is out of range: dictionary {name} has {d_sae} "
                           f"features (0..{d_sae - 1}); pick features it has"])


def _field_problems(job, spec: dict) -> List[str]:
    """Per-sample positions ({field: NAME}) of patching.noise and patching.source_positions that name no field of
    the data (patching.sites.positions: _axis_labels)."""
    have = job.inputs.field_names() if hasattr(job.inputs, "field_names") else []
    named = {"patching.noise.positions": (spec.get("noise") or {}).get("positions"),
             "patching.source_positions": spec.get("source_positions")}
    return [f"{key}: {{field: {value['field']}}} but the data has no such field ({', '.join(have) or 'none'}); name "
            "a per-sample field of the data (a column of the .jsonl beside the prompts)"
            for key, value in named.items() if _is_field(value) and value["field"] not in have]


def _layers(job, sites: dict, problems: List[str], key: str = "patching") -> Tuple[List[Target], Optional[str]]:
    """(resolved sites, role: None for output or a standard site) of a sites block: `layers`, or the layers and
    role of the hook `hook`."""
    role = sites.get("role")
    patterns = sites.get("layers")
    if "hook" in sites:
        hook = job.specs.get(sites["hook"])
        if hook is None:
            problems.append(f"{key}.sites.hook: {sites['hook']!r} is not a hook of the hooks block "
                            f"({', '.join(job.specs) or 'none'})")
            return [], "output"
        patterns = hook.layers if patterns is None else patterns
        if role is None and hook.kind == "forward_pre" and not patterns_standard(patterns):
            role = "input"
    targets, found = resolve_sites(job.model, patterns, role, f"{key}.sites.layers", f"{key}.sites.role")
    problems += found
    return targets, role


def _axis_labels(job, spec: dict, positions, heads, key: str = "patching", targets=()):
    """(axis, labels) of the grid's last axis (a heads grid: the sites' heads, else the anatomy's)."""
    if heads is not None:
        n = heads_of(job.model, targets)
        if heads == "all" and not n:
            raise ConfigError([f"{key}.sites.heads: all, but the model has no known number of heads (no anatomy, no "
                               "num_attention_heads in its config); list the heads"])
        return "head", list(range(n)) if heads == "all" else [int(h) for h in as_list(heads)]
    if positions == "all":
        seqs = job.inputs.role_seqs[spec["target"]]
        longest = max(len(seqs[i]) for a, b in job.inputs.ranges() for i in range(a, b))
        return "position", list(range(longest))
    if _is_field(positions):
        first = job.inputs.meta.get(positions["field"]) if job.inputs.meta else None
        if not first:
            raise ConfigError([f"{key}.sites.positions: {{field: {positions['field']}}} but the data has no such "
                               f"field ({', '.join(job.inputs.field_names()) or 'none'})"])
        return "position", list(range(len(first[0])))
    return "position", positions_spec(positions)[0]


def _batch_grid(job, index: int, batch):
    """The patching grid of one batch, its last axis padded with NaN to the run's width."""
    plan: PatchPlan = job.method("patching").plan
    metric = job.method("metrics").metrics[plan.metric]
    (skw, sinfo), (tkw, tinfo) = batch.roles[plan.source], batch.roles[plan.target]
    noise = dict(plan.noise or {})
    on = noise.pop("on", "target")
    if noise:
        noise["positions"] = _positions(noise.get("positions", "all"), batch)
        noise = Noise(**{**noise, "seed": int(noise.get("seed", plan.seed)) + index})
    try:
        grid = _patch_grid(job, plan, metric, skw, tkw, sinfo, tinfo, batch, noise, on, index)
    except PatchError as err:
        raise config_key(err) from None
    grid.scores = pad(grid.scores, plan.width)
    return grid


def pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """A grid [B, layers, ..., n] padded with NaN along its last axis to the run's width (a batch's positions:
    up to its longest sample)."""
    missing = width - t.shape[-1]
    return torch.cat([t, torch.full((*t.shape[:-1], missing), float("nan"))], -1) if missing > 0 else t


def _patch_grid(job, plan, metric, skw, tkw, sinfo, tinfo, batch, noise, on, index):
    """patch_grid of one batch as the plan says."""
    return patch_grid(job.model, skw, tkw, sinfo, tinfo, plan.layers, role=plan.role,
                      metric=_rows(metric, tkw, tinfo, batch), source_metric=_rows(metric, skw, sinfo, batch),
                      positions=_positions(plan.positions, batch), source_positions=_positions(plan.source_positions,
                                                                                             batch),
                      heads=plan.heads, donor=plan.donor, seed=plan.seed + index,
                      source_noise=noise if on == "source" and noise else None,
                      target_noise=noise if on == "target" and noise else None,
                      sites_per_forward=plan.sites_per_forward, features=plan.features, per_position=plan.per_position,
                      dictionary=None if plan.dictionary is None else _dictionary(job, plan.dictionary))


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


# -- the reader: cap.grid() ----------------------------------------------------------------------------------------
@dataclass(repr=False)
class PatchGrid:
    """The grid's metric with one site patched (`scores`, NaN past a sample's end), the unpatched source and
    target runs' metric (`source`, `target` [samples]), and the axes: `layers`, `axis` (position | head) and
    `labels` (the positions, counted over real tokens, or the heads). `samples` numbers the rows as cap.samples.
    A per-position heads grid (sites.per_position) has one more axis: scores [samples, layers, heads, positions],
    `positions` its labels (None for the two-axis grids).

        grid = cap.grid(); grid                 # a short summary: shape, axes, baselines, the top sites
        grid.change().mean(0)                   # layers x sites: the change from the unpatched target run
        grid.normalised()                       # 1 = the source's metric restored (NaN where source == target)

    An ablation (source and target the same prompts, e.g. donor zero with source = target) has source == target:
    read it with change() (the change from the unablated run); normalised() is NaN there (0 / 0), never inf.

    An attribution grid (cap.read("attribution"), hookrun.methods.attribution) is this type too: `method` is gradient
    or integrated_gradients, `scores` = target + the estimated change (so change() is the estimate), and `exact`
    holds the exact patched metric at the verified sites (NaN elsewhere): `grid.verified()`, `grid.corr(exact)`."""

    scores: np.ndarray
    source: np.ndarray
    target: np.ndarray
    layers: List[str]
    axis: str
    labels: List[int]
    samples: np.ndarray
    metric: str
    roles: tuple  # (source role, target role)
    donor: str = "same"  # patching.donor: same | mean | resample | zero
    method: str = "patching"  # patching (exact) | gradient | integrated_gradients (an attribution estimate)
    exact: Optional[np.ndarray] = None  # an attribution grid's verified sites: the exact patched metric, NaN elsewhere
    positions: Optional[List[int]] = None  # per_position: the labels of the last axis (after the heads)

    @property
    def axes(self) -> List[Tuple[str, list]]:
        """The site axes after the layers as (name, labels): [(axis, labels)], then ("position", positions) for a
        per-position heads grid."""
        extra = [] if self.positions is None else [("position", list(self.positions))]
        return [(self.axis, list(self.labels))] + extra

    def _per_sample(self, values: np.ndarray) -> np.ndarray:
        """[samples] -> broadcastable against scores."""
        return values.reshape(-1, *[1] * (self.scores.ndim - 1))

    @property
    def ablation(self) -> bool:
        """Whether the sites are ablated in the very run they are taken from (source and target the same role)."""
        return self.roles[0] == self.roles[1]

    def change(self) -> np.ndarray:
        """scores - target per sample: the change of the metric from the unpatched (for an ablation: unablated)
        target run; 0 = the site has no effect."""
        return self.scores - self._per_sample(self.target)

    def normalised(self) -> np.ndarray:
        """(scores - target) / (source - target) per sample: 0 = no effect, 1 = the source's metric restored.
        NaN for a sample whose source and target metrics are equal (every sample of an ablation, where source
        and target are one run: use change()), and past a sample's end; no division warning."""
        gap = self._per_sample(self.source - self.target)
        out = np.full(np.broadcast_shapes(self.scores.shape, gap.shape), np.nan, dtype=np.float64)
        return np.divide(self.change(), gap, out=out, where=gap != 0)

    def to_frame(self) -> pd.DataFrame:
        """A tidy view: one row a (sample, layer, position | head[, position]) with score, change (score - target)
        and normalised (NaN where source == target, as in an ablation: see normalised())."""
        idx = pd.MultiIndex.from_product([self.samples, self.layers, *[labels for _, labels in self.axes]],
                                         names=["sample", "layer", *[name for name, _ in self.axes]])
        return pd.DataFrame({"score": self.scores.reshape(-1), "normalised": self.normalised().reshape(-1),
                             "change": self.change().reshape(-1)}, index=idx).reset_index()

    def to_xarray(self):
        """An xarray.DataArray of the scores, dims (sample, layer, position | head[, position]), with source and
        target."""
        import xarray as xr

        return xr.DataArray(self.scores, dims=("sample", "layer", *[name for name, _ in self.axes]),
                            coords={"sample": self.samples, "layer": self.layers, **dict(self.axes),
                                    "source": ("sample", self.source), "target": ("sample", self.target)},
                            name=self.metric)

    def corr(self, other: "PatchGrid", mean: bool = False) -> float:
        """Pearson's r of this grid's change() and another's over the same sites (layers and labels), over every
        (sample, layer, site) cell finite in both, or (mean=True) over the sites' means over samples.

            cap.read("attribution").corr(exact_cap.grid())   # how well the estimate tracks exact patching"""
        if (self.layers, self.axes) != (other.layers, other.axes):
            raise ValueError(f"corr: the grids' sites differ ({len(self.layers)} layers x {_axes_words(self)} against "
                             f"{len(other.layers)} layers x {_axes_words(other)}); compare grids over the same layers "
                             "and positions | heads")
        a, b = self.change(), other.change()
        if mean:
            with np.errstate(all="ignore"):
                a, b = _nanmean0(a), _nanmean0(b)
        elif a.shape != b.shape:
            raise ValueError(f"corr: {a.shape[0]} samples against {b.shape[0]}; give runs over the same samples, or "
                             "mean=True")
        keep = np.isfinite(a) & np.isfinite(b)
        return float(np.corrcoef(a[keep], b[keep])[0, 1])

    def verified(self) -> pd.DataFrame:
        """An attribution grid's verified sites (the K largest estimates of each batch, patched exactly): layer,
        position | head | neuron (and position, per_position), samples (how many were verified there), estimate and
        exact (their mean change over those samples) and error (estimate - exact)."""
        columns = ["layer", *[name for name, _ in self.axes], "samples", "estimate", "exact", "error"]
        if self.exact is None:
            return pd.DataFrame(columns=columns)
        done = np.isfinite(self.exact)
        rows = []
        for cell in np.argwhere(done.any(0)):
            at = done[(slice(None), *cell)]
            est = float(np.mean(self.change()[(at, *cell)]))
            ex = float(np.mean(self.exact[(at, *cell)] - self.target[at]))
            sites = {name: labels[i] for (name, labels), i in zip(self.axes, cell[1:])}
            rows.append({"layer": self.layers[cell[0]], **sites, "samples": int(at.sum()), "estimate": est,
                         "exact": ex, "error": est - ex})
        return pd.DataFrame(rows, columns=columns)

    def top(self, k: int = 5) -> pd.DataFrame:
        """The k sites whose mean change over samples is largest in size: layer, position | head (and position,
        per_position), change (signed), normalised (the mean over samples; NaN for an ablation)."""
        with np.errstate(all="ignore"):
            change = _nanmean0(self.change())
            norm = _nanmean0(self.normalised())
        flat = np.where(np.isnan(change), -np.inf, np.abs(change)).ravel()
        order = np.argsort(-flat, kind="stable")[:k]
        order = order[np.isfinite(flat[order])]
        cells = np.unravel_index(order, change.shape)
        sites = {name: [labels[i] for i in at] for (name, labels), at in zip(self.axes, cells[1:])}
        return pd.DataFrame({"layer": [self.layers[i] for i in cells[0]], **sites, "change": change[cells],
                             "normalised": norm[cells]})

    def _summary(self) -> tuple:
        """(head line, baseline line, top sites) of the repr."""
        kind = f"ablation of {self.roles[1]} (donor {self.donor})" if self.ablation else \
            f"{self.roles[0]} -> {self.roles[1]}" + (f" (donor {self.donor})" if self.donor != "same" else "")
        kind += "" if self.method == "patching" else f", attribution estimate ({self.method})"
        head = f"PatchGrid {self.metric}: {kind}, {len(self.scores)} samples x {len(self.layers)} layers x " + \
            _axes_words(self, counts=True)
        base = f"unablated {self.metric}: mean {_finite_mean(self.target):.4g}" if self.ablation else \
            f"{self.metric} unpatched: {self.roles[0]} mean {_finite_mean(self.source):.4g}, {self.roles[1]} mean " \
            f"{_finite_mean(self.target):.4g}"
        return head, base, self.top(5)

    def __repr__(self) -> str:
        head, base, top = self._summary()
        lines = [head, f"  layers: {_short(self.layers)}",
                 *[f"  {name}s: {_short(labels)}" for name, labels in self.axes], f"  {base}",
                 "  top sites (mean change from the unpatched target" + (")" if self.ablation else "; normalised)")]
        for r in top.itertuples(index=False):
            norm = "" if self.ablation or np.isnan(r.normalised) else f"  normalised {r.normalised:+.3f}"
            site = " ".join(f"{name} {r[1 + i]}" for i, (name, _) in enumerate(self.axes))
            lines.append(f"    {r.layer} {site}: {r.change:+.4g}{norm}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        head, base, top = self._summary()
        if self.ablation:
            top = top.drop(columns="normalised")
        table = top.to_html(index=False, float_format=lambda v: f"{v:+.4g}", border=0)
        axes = "".join(f"{name}s: {html.escape(_short(labels))}<br>" for name, labels in self.axes)
        return (f"<div><b>{html.escape(head)}</b><br>layers: {html.escape(_short(self.layers))}<br>"
                f"{axes}{html.escape(base)}<br>"
                f"top sites (mean change from the unpatched target):{table}</div>")


def _axes_words(grid: PatchGrid, counts: bool = False) -> str:
    """A grid's site axes in words: "[0, 1] heads x [0, 1, 2] positions" (counts: "2 heads x 3 positions")."""
    return " x ".join(f"{len(labels) if counts else labels} {name}s" for name, labels in grid.axes)


def _nanmean0(values: np.ndarray) -> np.ndarray:
    """The mean over axis 0 leaving NaN out, NaN (no warning) where a column holds only NaN."""
    count = (~np.isnan(values)).sum(0)
    total = np.nansum(values, axis=0)
    return np.divide(total, count, out=np.full(total.shape, np.nan), where=count > 0)


def _finite_mean(values: np.ndarray) -> float:
    """The mean of the finite values of a summary's column (NaN where none is)."""
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def _short(items: Sequence, most: int = 8) -> str:
    """A list for a summary line: the first and last few items when long."""
    items = [str(i) for i in items]
    if len(items) <= most:
        return ", ".join(items)
    return ", ".join(items[:most // 2]) + f", ... ({len(items)} in all), " + ", ".join(items[-2:])


def load_grid(cap, metric: Optional[str] = None) -> PatchGrid:
    """The grid of a patching run (KeyError for a run without one)."""
    attrs = cap.attrs.get(PATCHING_ATTR)
    if attrs is None and metric is None and cap.attrs.get("attribution"):  # a run with an attribution grid only
        from hookrun.config.registry import method

        return method("attribution").read(cap)
    if attrs is None or (metric is not None and metric != attrs["metric"]):
        raise KeyError(f"{cap.path} has no patching grid{'' if metric is None else f' of {metric!r}'}; a run with a "
                       "patching: block stores one")
    name = attrs["metric"]
    load = lambda role: cap.load(hook=PATCHING, layer=name, role=role)  # noqa: E731
    samples = cap.samples["sample"].to_numpy() if len(cap.samples) else np.arange(0)
    assert attrs["key"] == array_key(PATCHING, name, "scores")
    donor = str(((cap.config or {}).get("patching") or {}).get("donor") or "same")
    positions = attrs.get("positions")
    return PatchGrid(load("scores"), load("source"), load("target"), list(attrs["layers"]), attrs["axis"],
                     list(attrs["labels"]), samples, name, (attrs["source"], attrs["target"]), donor,
                     positions=None if positions is None else list(positions))
