"""The `train:` block's keys, their defaults and checks: every problem found from the config alone, one line each.

    spec, problems = parse_block(cfg.train, "train")      # a TrainSpec, and ["train.k: 300 must be < width ...", ...]

Every numeric key is refused on NaN, inf, 0, a negative or a huge value (`null` is how a key is switched off);
an unknown key or choice is named with the nearest ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from hookrun.config.checks import HUGE, check_choice, check_number, is_int, is_number, suggest, unknown_keys
from hookrun.methods.training.kinds import KINDS

SCHEDULERS = ("constant", "cosineannealing")
DECODER_NORMS = ("free", "unit")
B_DEC_INITS = ("geometric_median", "mean", "zeros")
NORMALIZATIONS = ("none", "expected_average_only_in")
DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class Site:
    """One dictionary's sites: an SAE reads and writes `input`; a transcoder reads `input` and writes `output`."""

    input: str
    output: Optional[str] = None

    @property
    def name(self) -> str:
        return self.input if self.output is None else f"{self.input}->{self.output}"


@dataclass(frozen=True)
class TrainSpec:
    """The train block, typed (see KEYS for each key's meaning)."""

    sites: Tuple[Site, ...]
    width: int
    steps: int
    out: Optional[str] = None        # None: <the run dir>/sae (hookrun.methods.training.Train.compile)
    kind: str = "relu"
    k: Optional[float] = None
    source: Optional[str] = None     # the `from` key: a finished store (None: streamed from the model)
    hook: Optional[str] = None
    role: Optional[str] = None
    batch_size: int = 4096
    lr: float = 3e-4
    lr_scheduler: str = "constant"
    lr_warm_up_steps: Optional[int] = None
    lr_decay_steps: Optional[int] = None
    lr_end: Optional[float] = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    l1_coefficient: float = 1.0
    l0_coefficient: float = 1.0
    l1_warm_up_steps: Optional[int] = None
    aux_coefficient: float = 1.0
    topk_threshold_lr: float = 0.01
    jumprelu_bandwidth: float = 0.05
    jumprelu_init_threshold: float = 0.01
    dead_feature_window: int = 1000
    dense_density: float = 0.1
    clip_grad: Optional[float] = 1.0
    decoder_norm: str = "free"
    decoder_init_norm: Optional[float] = 0.1
    rescale_acts_by_decoder_norm: bool = True
    b_dec_init: str = "geometric_median"
    normalize_activations: str = "none"
    skip: bool = False
    buffer_tokens: int = 500_000
    evaluate_every: Optional[int] = None
    evaluate_batches: Optional[int] = 1
    checkpoint_every: int = 1000
    seed: Optional[int] = None
    dtype: str = "float32"
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def transcoder(self) -> bool:
        return any(s.output is not None for s in self.sites)

    def out_path(self, site: Site) -> str:
        """The SAELens folder of one site's dictionary: `out` itself for one site, `out/<site>` for several."""
        if len(self.sites) == 1:
            return self.out
        return f"{str(self.out).rstrip('/')}/{site.name.replace('->', '__')}"

    def hashed(self) -> dict:
        """What a resume must find unchanged (every key but the evaluation's)."""
        skip = {"evaluate_every", "evaluate_batches", "checkpoint_every", "extra"}
        return {f.name: (list(map(str, getattr(self, f.name))) if f.name == "sites" else getattr(self, f.name))
                for f in fields(self) if f.name not in skip}


# key -> (kind, default, the most it may be, help); kind: int | float | prob | bool | str | choice tuple
KEYS: Dict[str, tuple] = {
    "from": ("str?", None, None, "a finished store (a run dir or .zarr) to read activations from; null: streamed "
                                  "from the model, batch by batch, never written"),
    "sites": ("sites", None, None, "one dictionary each: a site name (an SAE), or `{in: SITE, out: SITE}` (a transcoder)"),
    "hook": ("str?", None, None, "with `from`: the store's hook the site's array is under"),
    "role": ("str?", None, None, "the site's role (a native module's output | input; with `from`: the stored role)"),
    "kind": (KINDS, "relu", None, "relu (SAELens's standard L1) | topk | batchtopk | jumprelu"),
    "width": ("int", None, 2 ** 24, "features of each dictionary (d_sae)"),
    "k": ("float", None, 2 ** 24, "topk / batchtopk: features kept per token (batchtopk: on average); < width"),
    "steps": ("int", None, 10 ** 9, "optimiser steps"),
    "batch_size": ("int", 4096, 2 ** 24, "tokens a step"),
    "lr": ("float", 3e-4, 10.0, "Adam's learning rate"),
    "lr_scheduler": (SCHEDULERS, "constant", None, "constant | cosineannealing (to lr_end) between warm-up and decay"),
    "lr_warm_up_steps": ("int?", None, 10 ** 9, "linear warm-up steps (SAELens's: lr * (s + 1) / w); null: none"),
    "lr_decay_steps": ("int?", None, 10 ** 9, "linear decay to 0 over the last steps; null: none"),
    "lr_end": ("float?", None, 10.0, "cosineannealing's last lr (null: lr / 10)"),
    "adam_beta1": ("prob", 0.9, None, "Adam's beta1, in (0, 1)"),
    "adam_beta2": ("prob", 0.999, None, "Adam's beta2, in (0, 1)"),
    "l1_coefficient": ("float", 1.0, 1e6, "relu: the L1 penalty's coefficient (SAELens's l1_coefficient)"),
    "l0_coefficient": ("float", 1.0, 1e6, "jumprelu: the L0 penalty's coefficient (SAELens's l0_coefficient)"),
    "l1_warm_up_steps": ("int?", None, 10 ** 9, "the sparsity coefficient's linear warm-up (relu and jumprelu)"),
    "aux_coefficient": ("float", 1.0, 1e6, "topk / batchtopk: AuxK's coefficient (dead features)"),
    "topk_threshold_lr": ("prob", 0.01, None, "batchtopk: the running threshold's EMA rate"),
    "jumprelu_bandwidth": ("float", 0.05, 1e3, "jumprelu: the straight-through estimator's bandwidth"),
    "jumprelu_init_threshold": ("float", 0.01, 1e3, "jumprelu: the threshold's start"),
    "dead_feature_window": ("int", 1000, 10 ** 9, "steps without firing after which a feature is dead"),
    "dense_density": ("prob", 0.1, None, "a feature firing on more than this fraction of tokens is dense"),
    "clip_grad": ("float?", 1.0, 1e6, "the gradients' norm clipped to this (SAELens: 1.0); null: none"),
    "decoder_norm": (DECODER_NORMS, "free", None, "unit: decoder rows kept at norm 1 (sparsify's); free: SAELens's"),
    "decoder_init_norm": ("float?", 0.1, 1e3, "decoder rows' norm at the start (SAELens's heuristic 0.1); null: "
                                              "kaiming uniform as drawn"),
    "rescale_acts_by_decoder_norm": ("bool", True, None, "topk / batchtopk: pre-activations times the decoder "
                                                         "rows' norms (SAELens's default)"),
    "b_dec_init": (B_DEC_INITS, "geometric_median", None, "b_dec's start from the first buffer: geometric_median "
                                                          "| mean | zeros"),
    "normalize_activations": (NORMALIZATIONS, "none", None, "expected_average_only_in: inputs scaled to mean norm "
                                                           "sqrt(d_in) (SAELens's), folded into the saved weights"),
    "skip": ("bool", False, None, "a transcoder with a skip connection W_skip (SAELens's skip_transcoder)"),
    "buffer_tokens": ("int", 500_000, 2 ** 34, "the shuffle buffer's rows: memory bounded by it, not by the store"),
    "evaluate_every": ("int?", None, 10 ** 9, "evaluate on the held-out batches every this many steps (and at the "
                                              "end); null: at the end only"),
    "evaluate_batches": ("int?", 1, 10 ** 6, "the first data batches held out for evaluation (L0, variance "
                                             "explained, CE loss recovered); never trained on; null: none"),
    "checkpoint_every": ("int", 1000, 10 ** 9, "with `from`: steps between checkpoints (streamed: every batch)"),
    "seed": ("int?", None, 2 ** 31, "the dictionaries' init and the shuffle (null: the run's seed)"),
    "dtype": (DTYPES, "float32", None, "the dictionaries' dtype"),
    "out": ("str?", None, None, "the SAELens folder (several sites: one folder each below it); null: `sae` in the "
                                "run dir, beside captures.zarr"),
}
REQUIRED = ("sites", "width", "steps")
KEY_TO_FIELD = {"from": "source"}


def _number_problem(key: str, value, kind: str, most) -> Optional[str]:
    """The key's number checked by kind (config.checks.check_number): int >= 1, float > 0, prob in (0, 1); null
    only where the kind ends in `?` (null switches it off); at most `most`."""
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if kind == "prob":
        found = check_number(f"train.{key}", value, low=0, high=1, open_low=True, open_high=True,
                             null="off" if optional else "")
    else:
        found = check_number(f"train.{key}", value, whole=kind == "int", low=1 if kind == "int" else 0,
                             high=HUGE if most is None else most, open_low=kind != "int",
                             null="null switches it off" if optional else "")
    return found[0] if found else None


def _sites(value) -> Tuple[Tuple[Site, ...], List[str]]:
    items = value if isinstance(value, (list, tuple)) else [value]
    sites, problems = [], []
    for i, item in enumerate(items):
        key = f"train.sites[{i}]"
        if isinstance(item, str) and item:
            sites.append(Site(item))
        elif isinstance(item, dict):
            bad = unknown_keys(key, item, ("in", "out"), "a transcoder's sites take")
            if bad or not all(isinstance(item.get(k), str) and item.get(k) for k in ("in", "out")):
                problems += bad or [f"{key}: {item!r}; a transcoder is {{in: SITE, out: SITE}}, e.g. "
                                    "{in: blocks.0.ln2, out: blocks.0.mlp}"]
            else:
                sites.append(Site(item["in"], item["out"]))
        else:
            problems.append(f"{key}: {item!r} is not a site; give a site name (blocks.6) or {{in: SITE, out: SITE}}")
    if not items:
        problems.append("train.sites: empty; name at least one site, e.g. sites: [blocks.0]")
    if len({s.name for s in sites}) < len(sites):
        problems.append(f"train.sites: {[s.name for s in sites]} names a site twice; one dictionary a site")
    return tuple(sites), problems


def parse_block(block, run_seed: int = 0) -> Tuple[Optional[TrainSpec], List[str]]:
    """The train block typed, and every problem the config alone shows (a spec only where there are none)."""
    if not isinstance(block, dict):
        return None, [f"train: {block!r} is not a mapping; write train: {{sites: [blocks.0], width: 256, steps: "
                      "1000, out: runs/sae}}"]
    problems = unknown_keys("train", block, list(KEYS), "train takes")
    problems += [f"train.{k}: missing; {KEYS[k][3]}" for k in REQUIRED if block.get(k) is None]
    values: Dict[str, Any] = {}
    sites: Tuple[Site, ...] = ()
    for key, (kind, default, most, _) in KEYS.items():
        value = block.get(key, default)
        if key == "sites":
            if value is not None:
                sites, found = _sites(value)
                problems += found
            continue
        if value is None and key in REQUIRED:
            continue
        if isinstance(kind, tuple):
            problems += [f"train.{p}" for p in check_choice(key, value, kind)]
        elif kind == "bool":
            if not isinstance(value, bool):
                problems.append(f"train.{key}: {value!r} is not true or false")
        elif kind.startswith("str"):
            if value is not None and not (isinstance(value, str) and value):
                problems.append(f"train.{key}: {value!r} is not a non-empty string")
        else:
            if key == "k" and value is None:
                pass
            else:
                problem = _number_problem(key, value, kind, most)
                if problem:
                    problems.append(problem)
        values[KEY_TO_FIELD.get(key, key)] = value
    kind = values.get("kind")
    width, k = values.get("width"), values.get("k")
    if kind in ("topk", "batchtopk") and k is None:
        problems.append(f"train.k: missing; kind {kind} keeps k features a token: give k < width")
    if kind == "topk" and k is not None and not is_int(k):
        problems.append(f"train.k: {k!r}; topk keeps a whole number of features a token: give an integer")
    if kind in ("relu", "jumprelu") and k is not None:
        problems.append(f"train.k: {k!r} with kind {kind}; k is a topk / batchtopk setting: drop it (the sparsity "
                        f"is the {'l1' if kind == 'relu' else 'l0'}_coefficient's)")
    if is_int(width) and is_number(k) and k >= width and not any(p.startswith("train.k:") for p in problems):
        problems.append(f"train.k: {k!r} must be < width ({width}); keep fewer features than the dictionary has")
    transcoder = any(s.output is not None for s in sites)
    if values.get("skip") and not transcoder:
        problems.append("train.skip: true for an SAE; skip is a transcoder's: give sites as {in: SITE, out: SITE}")
    if transcoder and kind == "topk":
        problems.append("train.kind: topk for a transcoder; SAELens reads no TopK transcoder: use kind batchtopk "
                        "(saved as a JumpReLU transcoder), relu or jumprelu")
    steps = values.get("steps")
    for key in ("lr_warm_up_steps", "lr_decay_steps"):
        v = values.get(key)
        if is_int(v) and is_int(steps) and v > steps:
            problems.append(f"train.{key}: {v} is more than steps ({steps}); give at most steps")
    if is_int(values.get("lr_warm_up_steps")) and is_int(values.get("lr_decay_steps")) and is_int(steps) and \
            values["lr_warm_up_steps"] + values["lr_decay_steps"] > steps:
        problems.append("train.lr_decay_steps: warm-up and decay together are more than steps; shorten one")
    bs, buf = values.get("batch_size"), values.get("buffer_tokens")
    if is_int(bs) and is_int(buf) and buf < bs:
        problems.append(f"train.buffer_tokens: {buf} is less than batch_size ({bs}); the shuffle buffer holds at "
                        "least one batch: raise it")
    if problems:
        return None, problems
    values["seed"] = run_seed if values.get("seed") is None else values["seed"]
    values["k"] = float(k) if kind == "batchtopk" else k
    return TrainSpec(sites=sites, **{k: v for k, v in values.items() if k != "sites"}), []


def help_line() -> str:
    return ("`{sites: [blocks.6], kind: relu|topk|batchtopk|jumprelu, width, k, steps, out: DIR, from: STORE, ...}`: "
            "sparse autoencoders and transcoders trained from a store or the model, saved as SAELens folders "
            "(docs/training.md)")


def nearest(word: str) -> str:
    return suggest(word, list(KEYS))
