"""The floor that patching, attribution and circuits stand on side by side: a clean/corrupt (source/target) pair of
runs over the same sites, plain torch, and the `sites:` block they share.

    targets = check_sites(model, layers, role, donor, info_source, info_target, heads)   # PatchError if not
    captured, logits = source_run(model, source, targets, info_source, noise)            # every site, one forward
    sites = sites_of(captured, info_source, info_target, positions, source_positions, heads, n_heads, donor, seed,
                     model)                                  # Sites: target columns, valid, source values a layer
    with HookScope() as scope:
        attach(scope, model, targets, [fn, ...], PatchError)  # fn(value) -> value, or a new value written back
        out = model(**repeat(target, b, k))                  # k copies of the batch along its axis

Positions count real tokens (resolve_positions: all | last | first | int | [ints] | {field: NAME} as
batch_positions | a [B, P] tensor), donors are same | mean | resample | zero (donors_of, mean_donor), Noise is
causal tracing's seeded noise on the embeddings (Noised); grouped splits a site's tensor by head, pick_heads checks
the heads. In a run: the block's checks (site_problems, no model; site_layers, axis_labels against the model and
the data), SitePlan (what a resolved block holds), metric_rows and grad_rows (a compiled Metric scoring the rows of
copies of a batch, without or with the graph), pad (a batch's grid to the run's width), named_dictionary (the
dictionaries block's module, through that method) and a dictionary's features at a site (dims, decoder_direction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import pandas as pd
import torch

from hookrun.capture import tokens as tok
from hookrun.capture.checks import block_number_problems
from hookrun.capture.layers import module_names
from hookrun.capture.scope import HookScope
from hookrun.capture.targets import Target, attach, n_heads as heads_of, patterns_standard, resolve_sites, \
    heads_problems
from hookrun.capture.tokens import TokenInfo, check_positions, positions_spec
from hookrun.config.checks import ConfigError, as_list, check_choice, either, is_int, suggest, unknown_keys
from hookrun.methods import MetricUse, free_memory
from hookrun.methods.metrics import Metric, MetricInputs, logits_of


DONORS = ("same", "mean", "resample", "zero")  # what a target site takes: its source sample, their mean, another, 0
ROLES = ("output", "input")  # a native module's tensor a site is: what it returns, its first argument
AUTO_TOKENS = {"cpu": 2048, "cuda": 1 << 17}  # rows x tokens a forward "auto" goes up to (a CPU gains nothing past
# ~2k on the bundled LM: its caches overflow; a GPU gains while the forward is launch-bound)


class PatchError(ValueError):
    """A patching grid that cannot run as asked (a length mismatch, an unknown layer, no head axis); `key`: the
    config key it is about, once a run's patching block raised it (config_key)."""

    def __init__(self, message: str, key: Optional[str] = None):
        self.key = key
        super().__init__(message)


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
class Sites:
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


SITE_KEYS = ("layers", "hook", "positions", "heads", "role", "dictionary", "features", "per_position")


# -- the pair of runs --------------------------------------------------------------------------------------------
def per_position_check(per_position, heads, dictionary=None, features=None, neurons=None) -> None:
    """PatchError for per_position that is not a bool, or not on a heads grid."""
    if not isinstance(per_position, bool):
        raise PatchError(f"per_position: {per_position!r} is not true or false")
    if per_position and (heads is None or dictionary is not None or features is not None or neurons is not None):
        raise PatchError("per_position: true splits a heads grid by position (layers x heads x positions); give "
                         "heads (all or a list) on a site split by head, or drop per_position (a grid without heads "
                         "is already layers x positions)")


def check_sites(model, layers, role, donor, info_source, info_target, heads=None) -> List[Target]:
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


def source_run(model, source, targets: List[Target], info, noise) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """The source's tensor at every site ([B, T, ...], in memory) and its logits."""
    captured: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(targets))}

    def keep(i):
        return lambda t: captured[i].append(t) or t

    with HookScope() as scope:
        attach(scope, model, targets, [keep(i) for i in range(len(targets))], PatchError)
        with Noised(model, info, noise):
            logits = logits_of(model(**source))
    for i, got in captured.items():
        if len(got) != 1:
            raise PatchError(f"layers: {targets[i].name} was called {len(got)} times in one forward; patch_grid "
                             "patches modules called once a forward (name one that is)")
    return [captured[i][0] for i in range(len(targets))], logits


def resolve_positions(info: tok.TokenInfo, spec, key: str, width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
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


def donors_of(donor: str, b: int, seed: int, device) -> Optional[torch.Tensor]:
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


def check_lengths(info_source, info_target, donors: torch.Tensor) -> None:
    """PatchError naming the first target sample whose donor has another real length."""
    src, tgt = info_source.lengths[donors], info_target.lengths
    bad = (src != tgt).nonzero()
    if len(bad):
        i = int(bad[0])
        raise PatchError(f"sample {i} has {int(src[i])} real tokens in the source (sample {int(donors[i])}) but "
                         f"{int(tgt[i])} in the target; position-wise patching takes the same real position, so "
                         "paired prompts need equal lengths: pair prompts of one length, or map positions with "
                         "source_positions= (e.g. positions='last', source_positions='last')")


def sites_of(captured, info_source, info_target, positions, source_positions, heads, n_heads, donor, seed,
           model, dictionary=None, features=None, per_position=False) -> Sites:
    """Target columns and the source value patched at every (layer, position | head)."""
    cols, valid = resolve_positions(info_target, positions, "positions")
    donors = donors_of(donor, len(cols), seed, cols.device)
    if source_positions is None and donors is not None:
        check_lengths(info_source, info_target, donors)
    src_cols, src_valid = resolve_positions(info_source, positions if source_positions is None else source_positions,
                                   "source_positions", width=cols.shape[1])
    if src_cols.shape[1] != cols.shape[1]:
        raise PatchError(f"source_positions: {src_cols.shape[1]} positions but positions has {cols.shape[1]}; "
                         "give one source position for each target position")
    values = []
    for t in captured:
        split = grouped(t, info_source, heads, n_heads, model)
        if features is not None:  # the source's activations of the features, one group a feature
            split = encode_features(dictionary, t, features)
        at = split[torch.arange(len(src_cols), device=t.device)[:, None], src_cols.to(t.device)]  # [Bs, P, G, F]
        at = at.to(cols.device)  # the sites live on the inputs' device (a device map runs layers elsewhere)
        if donor == "zero":
            values.append(torch.zeros_like(at))
        elif donor == "mean":
            values.append(mean_donor(at, src_valid, valid))
        else:
            values.append(at[donors])
    return Sites(cols, valid, values, None if heads is None else pick_heads(heads, values[0].shape[2]), donors,
                  features, dictionary, per_position)


def encode_features(dictionary, t: torch.Tensor, features: List[int]) -> torch.Tensor:
    """[..., len(features), 1]: the features' activations of t [..., d_in] (PatchError if t is not d_in wide)."""
    d_in = dims(dictionary)[0]
    if d_in is not None and t.shape[-1] != d_in:
        raise PatchError(f"layers: the dictionary reads {d_in}-wide activations but this layer's tensor is "
                         f"{list(t.shape)}; patch features at the layer the dictionary was trained on")
    return dictionary.encode(t)[..., features, None].to(t.dtype)


def mean_donor(at: torch.Tensor, src_valid: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, P, G, F] -> the mean over the samples that have each position, for every sample."""
    count = src_valid.sum(0)
    if bool((count[valid.any(0)] == 0).any()):
        raise PatchError("donor=mean: a target position is past the end of every source sample")
    mean = (at * src_valid[:, :, None, None].to(at.dtype)).sum(0) / count.clamp(min=1)[:, None, None].to(at.dtype)
    return mean[None].expand(*at.shape)


def grouped(t: torch.Tensor, info, heads, n_heads, model) -> torch.Tensor:
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


def pick_heads(spec, n: int) -> List[int]:
    """The heads of a heads grid: every one of the n for "all", else the list given (checked against n)."""
    listed = list(range(n)) if spec == "all" else as_list(spec)
    bad = [h for h in listed if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < n]
    if bad or not listed:
        raise PatchError(f"heads: {spec!r} is not all or a list of heads in 0..{n - 1}")
    return listed


def labels_of(positions, n: int) -> List[int]:
    if isinstance(positions, (int, str, list, tuple)) and positions != "all":
        return tok.positions_spec(positions)[0]
    return list(range(n))


class Noised:
    """While active, adds seeded noise to the output of the Noise's module at its positions; drawn at the first
    call (the batch itself, whose real tokens set std "auto"), the same for every copy of the batch after it."""

    def __init__(self, model, info: tok.TokenInfo, noise: Optional[Noise]):
        self.info, self.noise, self.draw, self.scope = info, noise, None, HookScope()
        if noise is not None:
            named = module_names(model)
            self.module = model.get_input_embeddings() if noise.module is None else named.get(noise.module)
            if self.module is None:
                raise PatchError(f"Noise.module: {noise.module!r} is not a module of the model")

    def __enter__(self):
        if self.noise is not None:
            self.scope.forward(self.module, lambda m, a, out: out + self._draw(out))
        return self

    def __exit__(self, *exc):
        self.scope.remove()

    def _draw(self, out: torch.Tensor) -> torch.Tensor:
        if self.draw is None:
            info, noise = self.info, self.noise
            info = info.to(out.device)  # the noised module may run on another device than the inputs (device map)
            std = 3 * float(out[info.mask].float().std()) if noise.std == "auto" else float(noise.std)
            cols, valid = resolve_positions(info, noise.positions, "Noise.positions")
            mask = torch.zeros(info.mask.shape, dtype=torch.bool, device=out.device)
            mask[torch.arange(len(cols), device=cols.device)[:, None].expand_as(cols)[valid], cols[valid]] = True
            gen = torch.Generator().manual_seed(noise.seed)  # drawn on the CPU: the same numbers on every device
            draw = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.device, out.dtype) * std
            self.draw = draw * mask.reshape(*mask.shape, *([1] * (out.dim() - 2)))
        return self.draw.repeat(out.shape[0] // self.draw.shape[0], *([1] * (out.dim() - 1)))


def repeat(inputs: Dict[str, torch.Tensor], b: int, k: int) -> Dict[str, torch.Tensor]:
    """The batch's keyword inputs with every [B, ...] tensor repeated k times along the batch axis."""
    return {key: v.repeat(k, *([1] * (v.dim() - 1))) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b
            else v for key, v in inputs.items()}


# -- the block in a run: its metric, its `sites:`, the rows a metric scores ----------------------------------------
def paired_uses(key: str, spec, gradient: bool = False, fix: str = "", reference: bool = False) -> List[MetricUse]:
    """A paired block's metric (`<key>.metric`), measured on its source and target runs (Method.metric_uses)."""
    if not isinstance(spec, dict) or "metric" not in spec:
        return []
    roles = tuple(spec[k] for k in ("source", "target") if isinstance(spec.get(k), str))
    return [MetricUse(f"{key}.metric", spec["metric"], roles, gradient, fix, reference)]


def length_key(spec: dict, key: str = "patching") -> str:
    """The key a length refusal names where the block patches position by position (no source_positions, no last
    / first, a donor other than zero), else "" (any lengths do)."""
    positions = site_positions(spec.get("sites") or {}) if isinstance(spec.get("sites"), dict) else "all"
    if spec.get("source_positions") is None and positions not in ("last", "first") and \
            spec.get("donor", "same") != "zero":
        return f"{key}.sites.positions"
    return ""


def role_problems(key: str, spec, inputs, length_key: str = "", fix: Optional[str] = None) -> List[str]:
    """The block's source and target against the data, before the model is built: each a role of the data, and
    (with `length_key`: a position-wise patch) every pair of one token length, `fix` naming the method's own keys.

        problems += role_problems("circuit", spec, inputs, "circuit.source", fix="give pairs of one token length")
    """
    if not isinstance(spec, dict) or inputs is None:
        return []
    roles = list(getattr(inputs, "roles", None) or [])
    have = ", ".join(roles) or "none: give paired prompts with data.text.fields: {clean: ..., corrupt: ...}"
    problems = [f"{key}.{k}: {spec[k]!r} is not a role of the data ({have}){suggest(str(spec[k]), roles)}"
                for k in ("source", "target") if k in spec and spec[k] not in roles]
    if not problems and length_key and "source" in spec and "target" in spec:
        problems += inputs.length_problems(spec["source"], spec["target"], length_key, fix)
    return problems


def site_problems(sites, key: str = "patching", keys: Sequence[str] = SITE_KEYS) -> List[str]:
    """Problems with a `sites:` block (of `key`: patching, or attribution with its own `keys`)."""
    if sites is None:
        return []
    if not isinstance(sites, dict):
        return [f"{key}.sites: {sites!r} is not a mapping; write {{layers: [...], positions: all}}"]
    problems = unknown_keys(f"{key}.sites", sites, keys, "sites take")
    if "layers" not in sites and "hook" not in sites:
        problems.append(f"{key}.sites: name the layers (layers: [...]) or a hook whose layers to patch (hook: NAME)")
    problems += block_number_problems(f"{key}.sites.layers", [str(x) for x in as_list(sites.get("layers"))])
    positions = site_positions(sites)
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
    if positions != "all" and not is_field(positions):
        problems += [p + "; or all, or {field: NAME} (per-sample positions)"
                     for p in check_positions(f"{key}.sites.positions", positions)]
    problems += check_choice(f"{key}.sites.role", sites.get("role", "output"), ROLES, either(ROLES))
    return problems + heads_spec_problems(sites.get("heads"), key) + features_spec_problems(sites, key)


def heads_spec_problems(heads, key: str = "patching") -> List[str]:
    """<key>.sites.heads: all, a head index or a list of them."""
    if heads is None or heads == "all":
        return []
    listed = heads if isinstance(heads, list) else [heads]
    if listed and all(is_int(h) and h >= 0 for h in listed):
        return []
    return [f"{key}.sites.heads: {heads!r} is not all or a list of head indices (e.g. [0, 3]); give heads: all "
            "for every head"]


def features_spec_problems(sites: dict, key: str) -> List[str]:
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


def site_positions(sites: dict):
    """The positions of a sites block: all where not given (or null, which drops an inherited grid's)."""
    return "all" if sites.get("positions") is None else sites["positions"]


def is_field(value) -> bool:
    return isinstance(value, dict) and set(value) == {"field"}


def site_layers(job, sites: dict, problems: List[str], key: str = "patching") -> Tuple[List[Target], Optional[str]]:
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


def axis_labels(job, spec: dict, positions, heads, key: str = "patching", targets=()):
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
    if is_field(positions):
        first = job.inputs.meta.get(positions["field"]) if job.inputs.meta else None
        if not first:
            raise ConfigError([f"{key}.sites.positions: {{field: {positions['field']}}} but the data has no such "
                               f"field ({', '.join(job.inputs.field_names()) or 'none'})"])
        return "position", list(range(len(first[0])))
    return "position", positions_spec(positions)[0]


def batch_positions(spec, batch):
    """A positions setting as patch_grid takes it: {field: NAME} -> the per-sample LongTensor [B, P]."""
    if not is_field(spec):
        return spec
    return torch.as_tensor(batch.fields[spec["field"]], dtype=torch.long, device=batch.tokens.mask.device)


def metric_rows(metric: Metric, kwargs: dict, info: TokenInfo, batch):
    """patch_grid's metric(logits, sample_ids) from a compiled Metric: row r is a copy of sample sample_ids[r]."""
    def score(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = ids.tolist()
        fields = {k: [batch.fields[k][i] for i in rows] for k in metric.fields if k in batch.fields}
        inputs = MetricInputs(TokenInfo.of_batch(info.mask[ids], info.keep[ids], info.max_length),
                              kwargs["input_ids"][ids], fields, sample_start=batch.start)
        return metric(logits, inputs)
    return score


def grad_rows(metric: Metric, kwargs: dict, info: TokenInfo, batch):
    """metric_rows keeping the graph (a Metric called as a value runs under no_grad): attribution's and circuits'
    metric(logits, sample_ids), differentiable in the logits."""
    def score(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = ids.tolist()
        fields = {k: [batch.fields[k][i] for i in rows] for k in metric.fields if k in batch.fields}
        sub = TokenInfo.of_batch(info.mask[ids], info.keep[ids], info.max_length)
        inputs = MetricInputs(sub, kwargs["input_ids"][ids], fields, sample_start=batch.start)
        return metric.value(logits, sub, inputs)
    return score


def pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """A grid [B, layers, ..., n] padded with NaN along its last axis to the run's width (a batch's positions:
    up to its longest sample)."""
    missing = width - t.shape[-1]
    return torch.cat([t, torch.full((*t.shape[:-1], missing), float("nan"))], -1) if missing > 0 else t


def named_dictionary(job, name: str):
    """The dictionary `name` of the run's dictionaries block, loaded once by that method (asked through the protocol:
    job.method("dictionaries").load), whichever method asks first."""
    return job.method("dictionaries").load(job, name)


# -- the exact grid: every site of the source patched into the target, one site a copy of the batch ----------
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
    per_position_check(per_position, heads, dictionary, features)
    targets = check_sites(model, layers, role, donor, info_source, info_target, heads if n_heads is None else None)
    names = [t.name for t in targets]
    features = _features(dictionary, features, heads)
    b = info_target.mask.shape[0]
    with torch.inference_mode():
        captured, src_logits = source_run(model, source, targets, info_source, source_noise)
        clean = (source_metric or metric)(src_logits, torch.arange(b, device=src_logits.device)).float().cpu()
        del src_logits
        sites = sites_of(captured, info_source, info_target, positions, source_positions, heads, n_heads, donor,
                       seed, model, dictionary, features, per_position)
        del captured
        with Noised(model, info_target, target_noise):
            corrupt, per_copy = _target_run(model, target, b, metric, sites_per_forward == "auto")
            k = _sites_per_forward(sites_per_forward, per_copy, sites, info_target)
            scores, forwards = _grid(model, target, targets, sites, metric, k, only)
    if sites.features is not None:
        return Grid(scores, clean, corrupt, names, "feature", sites.features, k, forwards, sites.donors)
    labels = labels_of(positions, sites.cols.shape[1])
    if sites.heads is not None:
        return Grid(scores, clean, corrupt, names, "head", sites.heads, k, forwards, sites.donors,
                    labels if per_position else None)
    return Grid(scores, clean, corrupt, names, "position", labels, k, forwards, sites.donors)


def _features(dictionary, features, heads) -> Optional[List[int]]:
    """The features of a features grid (None without a dictionary); PatchError for a feature out of the dictionary's
    range, features without a dictionary, or features and heads together."""
    if dictionary is None and features is None:
        return None
    if dictionary is None or features is None:
        raise PatchError("features: a features grid needs both dictionary= (the module) and features= (their ids)")
    if heads is not None:
        raise PatchError("features: a grid's last axis is heads or features; drop one")
    d_sae = dims(dictionary)[1]
    listed = as_list(features)
    bad = [f for f in listed if not is_int(f) or f < 0 or (d_sae is not None and f >= d_sae)]
    if bad or not listed:
        raise PatchError(f"features: {features!r} is not a list of feature ids in 0..{(d_sae or 0) - 1} (the "
                         f"dictionary has {d_sae} features); pick features it has")
    return [int(f) for f in listed]


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
    with HookScope() as scope:
        if measure and not cuda:
            for m in model.modules():
                scope.forward(m, lambda m, a, o: sizes.append(_nbytes(o)))
        values = metric(logits_of(model(**target)), torch.arange(b, device=device)).float().cpu()
    per_copy = torch.cuda.max_memory_allocated(device) - base if cuda else sum(sizes)
    return values, max(int(per_copy), 1)


def _nbytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return 0


def _sites_per_forward(spec, per_copy: int, sites: Sites, info) -> int:
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
        free = free_memory(device)
    tokens = AUTO_TOKENS["cuda" if device.type == "cuda" else "cpu"]
    by_tokens = tokens // max(info.mask.numel(), 1)
    return max(1, min(total, int(free // 2 // per_copy), by_tokens))


def _grid(model, target, targets, sites: Sites, metric, k: int, only=None) -> Tuple[torch.Tensor, int]:
    """The metric [B, layers, sites a layer] with one site patched per copy of the target, k copies a forward
    (`only`: just those (layer, site) pairs, NaN elsewhere)."""
    b = sites.cols.shape[0]
    n_layers, per_layer = sites.count
    order = [(layer, s) for layer in range(n_layers) for s in range(per_layer)] if only is None else \
        [(int(layer), int(s)) for layer, s in only]
    plan: Dict[int, tuple] = {}
    patcher = _patcher if sites.features is None else _feature_patcher(sites)
    repeated: Dict[int, dict] = {}
    values = []  # [copies, B] a forward, kept on the device until the end (no sync a forward)
    with HookScope() as scope:
        attach(scope, model, targets, [patcher(plan, i) for i in range(len(targets))], PatchError)
        for start in range(0, len(order), k):
            chunk = order[start:start + k]
            plan.clear()
            plan.update(_plan(sites, chunk, b))
            if len(chunk) not in repeated:
                repeated[len(chunk)] = repeat(target, b, len(chunk))
            ids = torch.arange(b, device=sites.cols.device).repeat(len(chunk))
            values.append(metric(logits_of(model(**repeated[len(chunk)])), ids).float().reshape(len(chunk), b))
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


def _plan(sites: Sites, chunk: List[Tuple[int, int]], b: int) -> Dict[int, tuple]:
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


def _feature_patcher(sites: Sites):
    """_patcher for a features grid: at each patched (row, column) adds (f_source - f_target) * the feature's
    decoder direction, f_target encoded from the tensor there (the reconstruction error kept)."""
    dictionary = sites.dictionary
    directions = torch.stack([decoder_direction(dictionary, f) for f in sites.features])  # [G, d_in]
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



# -- a dictionary's features at a site (features grids: patching's, circuits') ----------------------------------
def dims(dictionary) -> Tuple[Optional[int], Optional[int]]:
    """(d_in, d_sae) of a dictionary, where it says: attributes d_in/d_sae, a cfg with them (SAELens), or the
    shape of W_enc [d_in, d_sae]; None for what cannot be told (then run encode on one row)."""
    for holder in (dictionary, getattr(dictionary, "cfg", None)):
        d_in, d_sae = getattr(holder, "d_in", None), getattr(holder, "d_sae", None)
        if isinstance(d_in, int) and isinstance(d_sae, int):
            return d_in, d_sae
    w = getattr(dictionary, "W_enc", None)
    if isinstance(w, torch.Tensor) and w.ndim == 2:
        return int(w.shape[0]), int(w.shape[1])
    return None, None


def linear_decoder(dictionary) -> bool:
    """Whether a feature's decoder direction is W_dec's row (a SAELens SAE without the decoder-norm rescale)."""
    w = getattr(dictionary, "W_dec", None)
    return isinstance(w, torch.Tensor) and not getattr(dictionary, "rescale_acts_by_decoder_norm", False)


def decoder_direction(dictionary, feature: int) -> torch.Tensor:
    """A feature's decoder direction [d_in]: W_dec's row (linear_decoder), or decode(one-hot) - decode(0)."""
    if linear_decoder(dictionary):
        return dictionary.W_dec[feature].detach()
    zero = torch.zeros(1, dims(dictionary)[1], dtype=getattr(dictionary, "dtype", torch.float32))
    one = zero.clone()
    one[0, feature] = 1.0
    return (dictionary.decode(one) - dictionary.decode(zero))[0].detach()
