"""Every check that needs no model, gathered from each module into one list of problems.

Sits above config, data, edits, hooks, losses, samples and store (which each check their own keys),
so the arrows run one way: config is the bottom layer and imports none of them.

    checked = check(cfg, store_path)    # typed hooks, and each problem with the config section it is about
    if checked.clean("model", "seed"): ...  # what can be built to find more problems (the layers, the inputs)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from hookrun.data import inputs as data
from hookrun.capture import edits
from hookrun.capture import hooks
from hookrun.config.registry import methods
from hookrun.engine import losses
from hookrun.engine import ranks
from hookrun.data import samples
from hookrun import store
from hookrun.data import text
from hookrun.config.schema import (NONFINITE, RUN_MODES, STORE_MODES, ConfigError, check_choice,
                                   check_target, config_hash, either, hook_specs, resolved, run_schema, schema_field, settle_text,
                                   unknown_key)

SEED_MAX = 2**63 - 2**32  # torch takes 64-bit seeds; each batch adds its index to the seed


@dataclass
class Checked:
    """What check() found: the typed hooks, and each problem with the top-level config key it is about."""

    specs: Dict[str, object]
    found: List[Tuple[str, str]] = field(default_factory=list)  # (section, problem), in the order found

    def add(self, section: str, problems: List[str]) -> None:
        self.found += [(section, p) for p in problems]

    @property
    def problems(self) -> List[str]:
        return [p for _, p in self.found]

    def clean(self, *sections: str) -> bool:
        """Whether none of `sections` has a problem (what they describe can be built)."""
        return not any(section in sections for section, _ in self.found)


def unknown_keys(node, schema: Optional[type] = None, prefix: str = "") -> List[Tuple[str, str]]:
    """(key of `node`, problem) for each key below it that its schema dataclass does not have (a
    `+store.compresion=zstd` typo), recursively into the keys typed as dataclasses; free-form keys (model, loss,
    hooks, dataset) are not walked."""
    schema = schema or run_schema()
    found = []
    for key in node.keys():
        if key not in schema.__dataclass_fields__:
            found.append((key, unknown_key(prefix, key, schema)))
            continue
        typed = schema_field(schema, key)
        if typed and OmegaConf.is_dict(node._get_node(key)) and node[key] is not None:
            found += [(key, p) for _, p in unknown_keys(node[key], typed, f"{prefix}{key}.")]
    return found


def check(cfg, store_path=None) -> Checked:
    """The typed hooks and every problem that shows without building the model, one line each (by the config
    section it is about). Sets data.text to None where it was left at the schema's defaults (config.settle_text)."""
    settle_text(cfg)
    try:
        planned = {name: spec for cls in methods().values() if cls.active(cfg) for name, spec in cls(cfg).hooks().items()}
        checked = Checked(hook_specs(cfg, hooks.KINDS, planned))
        hook_problems = []
    except ConfigError as err:
        checked, hook_problems = Checked({}), err.problems
    checked.found += unknown_keys(cfg)
    checked.add("environment", ranks.env_problems())
    if not 0 <= cfg.seed < SEED_MAX:
        checked.add("seed", [f"seed: {cfg.seed} is out of range; use an integer from 0 to {SEED_MAX - 1}"])
    checked.add("hooks", hook_problems)
    checked.add("device", device_problems(str(cfg.device)))
    checked.add("mode", check_choice("mode", cfg.mode, RUN_MODES, either(RUN_MODES)))
    if cfg.progress_s < 0:
        checked.add("progress_s", [f"progress_s: {cfg.progress_s} is negative; give seconds between progress lines "
                                   "(0: none)"])
    checked.add("on_nonfinite", check_choice("on_nonfinite", cfg.on_nonfinite, NONFINITE, either(NONFINITE)))
    if OmegaConf.is_missing(cfg, "model") or cfg.model is None:
        checked.add("model", ["model: missing; pick an experiment with +experiment=NAME (conf/experiment/), a model "
                              "with model=NAME (conf/model/), or give model={_target_: your.module.Class}"])
    else:
        checked.add("model", check_target("model", cfg.model))
    _check_parts(cfg, checked)
    if store_path is not None and not cfg.inspect and cfg.store.mode in STORE_MODES:
        config = resolved(cfg)
        checked.add("store", store.check_path(store_path, cfg.store.mode, config_hash(config), config))
    return checked


def _check_parts(cfg, checked: Checked) -> None:
    """Each module's check of its own section: hooks and their edits, the loss, the store, the data."""
    measured = any(cls.active(cfg) and not cls.runs_batch for cls in methods().values())  # a method stores arrays
    if not any(h is not None for h in (cfg.hooks or {}).values()) and not cfg.inspect and not measured:
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
    if cfg.data.get("text"):
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
