"""Every check that needs no model, gathered from each module into one list of problems.

Sits above config, data, edits, hooks, losses, samples and store (which each check their own keys),
so the arrows run one way: config is the bottom layer and imports none of them.

    checked = check(parse(cfg), store_path)   # typed hooks, and each problem with the config section it is about
    if checked.clean("model", "seed"): ...  # what can be built to find more problems (the layers, the inputs)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from hookrun.data import inputs as data
from hookrun.capture import edits
from hookrun.capture.anatomy import AnatomyError, declared
from hookrun.capture import hooks
from hookrun.config.registry import methods
from hookrun.engine import losses
from hookrun.engine import ranks
from hookrun.data import samples
from hookrun import store
from hookrun.store.spec import SECONDS
from hookrun.data import text
from hookrun.config.checks import Number, check_choice, check_numbers, check_target, either
from hookrun.config.parsing import Parsed, parse, typed_hooks
from hookrun.config.schema import NONFINITE, RUN_MODES, STORE_MODES

SEED_MAX = 2**63 - 2**32  # torch takes 64-bit seeds; each batch adds its index to the seed


@dataclass
class Checked:
    """What check() found: the typed hooks, and each problem with the top-level config key it is about."""

    specs: Dict[str, object]
    found: List[Tuple[str, str]] = field(default_factory=list)  # (section, problem), in the order found
    methods: List[object] = field(default_factory=list)  # the run's methods (hookrun.methods.Method), made once

    def add(self, section: str, problems: List[str]) -> None:
        self.found += [(section, p) for p in problems]

    @property
    def problems(self) -> List[str]:
        return [p for _, p in self.found]

    def clean(self, *sections: str) -> bool:
        """Whether none of `sections` has a problem (what they describe can be built)."""
        return not any(section in sections for section, _ in self.found)


def check(parsed: Parsed, store_path=None) -> Checked:
    """The typed hooks (the config's and those its methods plan) and every problem that shows without building the
    model, one line each (by the config section it is about), those parse() found included (a composed config is
    parsed here; the runner passes its parse along)."""
    if not isinstance(parsed, Parsed):
        parsed = parse(parsed, tuple(hooks.KINDS))
    cfg = parsed.config
    found = list(parsed.problems)
    used = [cls(cfg) for cls in methods().values() if cls.active(cfg)]  # in the registry's order
    planned = {name: spec for method in used for name, spec in method.hooks().items()}
    planned_specs, hook_problems = typed_hooks(planned, hooks.KINDS)
    hook_problems = [f"hooks.{name}: a method of this run plans a hook of that name; rename yours"
                     for name in planned if name in cfg.hooks] + hook_problems
    hook_problems = [p for section, p in found if section == "hooks"] + hook_problems
    checked = Checked({**cfg.hooks, **planned_specs}, methods=used)
    checked.found += [(section, p) for section, p in found if section not in ("hooks", "model")]
    checked.add("environment", ranks.env_problems())
    checked.add("seed", check_numbers("", cfg, {"seed": Number(whole=True, low=0, high=SEED_MAX - 1)}))
    checked.add("hooks", hook_problems)
    checked.add("device", device_problems(str(cfg.device)))
    checked.add("mode", check_choice("mode", cfg.mode, RUN_MODES, either(RUN_MODES)))
    checked.add("progress_s", check_numbers("", cfg, {"progress_s": Number(low=0, high=SECONDS, fix="seconds between "
                                                                            "progress lines; 0: none")}))
    checked.add("on_nonfinite", check_choice("on_nonfinite", cfg.on_nonfinite, NONFINITE, either(NONFINITE)))
    checked.add("model", [p for section, p in found if section == "model"])
    if cfg.model is not None:
        checked.add("model", check_target("model", cfg.model, skip=("anatomy",)) + anatomy_problems(cfg.model))
    _check_parts(cfg, checked)
    if store_path is not None and not cfg.inspect and cfg.store.mode in STORE_MODES and checked.clean("store"):
        checked.add("store", store.check_path(store_path, cfg.store.mode, parsed.config_hash, parsed.resolved))
    return checked


def anatomy_problems(model_cfg) -> List[str]:
    """Problems with `model.anatomy` (the parts of a model hookrun does not know) that need no model."""
    spec = model_cfg.get("anatomy") if isinstance(model_cfg, dict) else None
    if spec is None:
        return []
    if not isinstance(spec, dict):
        return [f"model.anatomy: {spec!r} is not a mapping; give the model's parts, e.g. model.anatomy: {{blocks: "
                "model.layers, embed: model.embed_tokens, attn: self_attn, mlp: mlp, final_norm: model.norm}"]
    try:
        declared(spec)
    except AnatomyError as err:
        return [str(err)]
    return []


def _check_parts(cfg, checked: Checked) -> None:
    """Each module's check of its own section: hooks and their edits, the loss, the store, the data."""
    measured = any(not method.runs_batch or getattr(method, "stores_own", False)  # a method stores arrays
                   for method in checked.methods)
    if not checked.specs and not cfg.inspect and not measured and checked.clean("hooks"):
        checked.add("hooks", ["hooks: empty (or every entry null); declare at least one, e.g. "
                              "hooks: {acts: {kind: forward, layers: ${layers}}}"])
    for name, hook in checked.specs.items():
        checked.add("hooks", hooks.check_spec(name, hook, has_loss=cfg.loss is not None))
        for i, spec in enumerate(hook.edit):
            checked.add("hooks", edits.check_spec(f"hooks.{name}.edit[{i}]", spec))
    for key, method in methods().items():
        checked.add(key, method.check(cfg))
    checked.add("loss", losses.check_spec(cfg.loss, cfg.data))
    checked.add("store", store.check_spec(cfg.store))
    checked.add("data", data.check_spec(cfg.data) + samples.check_spec(cfg.data))
    if cfg.data.text:
        checked.add("data", text.check_spec(cfg.data.text))


def device_problems(device: str) -> List[str]:
    """Problems with `device`: a name torch does not know, or a device this machine does not have."""
    if device not in ("auto", "cpu", "cuda", "mps") and not (device.startswith("cuda:") and device[5:].isdigit()):
        return [f"device: {device!r} is not a device; use auto, cpu, cuda, cuda:N or mps"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        return [f"device: {device!r} but CUDA is not available here; use device=cpu or device=auto"]
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        return [f"device: {device!r} but there are {torch.cuda.device_count()} CUDA devices"]
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        return ["device: 'mps' but MPS is not available here; use device=cpu or device=auto"]
    return []
