"""Every check that needs no model, gathered from each module into one list of problems.

Sits above config, data, edits, hooks, losses, samples and store (which each check their own keys),
so the arrows run one way: config is the bottom layer and imports none of them.

    specs, problems = check(cfg, store_path)    # the runner adds layer checks, then raises ConfigError
"""
from __future__ import annotations

from typing import List

import torch
from omegaconf import OmegaConf

from hookrun.data import inputs as data
from hookrun.capture import edits
from hookrun.capture import hooks
from hookrun.run import losses
from hookrun.run import ranks
from hookrun.data import samples
from hookrun import store
from hookrun.data import text
from hookrun.config.schema import (NONFINITE, RUN_MODES, STORE_MODES, ConfigError, RunConfig, check_choice,
                                   check_target, config_hash, either, hook_specs, resolved, schema_field, settle_text,
                                   unknown_key)

SEED_MAX = 2**63 - 2**32  # torch takes 64-bit seeds; each batch adds its index to the seed


def unknown_keys(node, schema: type = RunConfig, prefix: str = "") -> List[str]:
    """Keys of `node` that its schema dataclass does not have (a `+store.compresion=zstd` typo), recursively
    into the keys typed as dataclasses; free-form keys (model, loss, hooks, dataset) are not walked."""
    problems = []
    for key in node.keys():
        if key not in schema.__dataclass_fields__:
            problems.append(unknown_key(prefix, key, schema))
            continue
        typed = schema_field(schema, key)
        if typed and OmegaConf.is_dict(node._get_node(key)) and node[key] is not None:
            problems += unknown_keys(node[key], typed, f"{prefix}{key}.")
    return problems


def check(cfg, store_path=None) -> tuple:
    """(typed hooks, problems): everything that can be checked without building the model, one line each.
    Sets data.text to None where it was left at the schema's defaults (config.settle_text)."""
    settle_text(cfg)
    problems: List[str] = unknown_keys(cfg) + ranks.env_problems()
    if not 0 <= cfg.seed < SEED_MAX:
        problems.append(f"seed: {cfg.seed} is out of range; use an integer from 0 to {SEED_MAX - 1}")
    try:
        specs = hook_specs(cfg, hooks.KINDS)
    except ConfigError as err:
        problems += err.problems
        specs = {}
    device = str(cfg.device)
    if device not in ("auto", "cpu", "cuda", "mps") and not (device.startswith("cuda:") and device[5:].isdigit()):
        problems.append(f"device: {device!r} is not a device; use auto, cpu, cuda, cuda:N or mps")
    elif device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(f"device: {device!r} but CUDA is not available here; use device=cpu or device=auto")
    elif device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        problems.append(f"device: {device!r} but there are {torch.cuda.device_count()} CUDA devices")
    elif device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        problems.append("device: 'mps' but MPS is not available here; use device=cpu or device=auto")
    problems += check_choice("mode", cfg.mode, RUN_MODES, either(RUN_MODES))
    problems += check_choice("on_nonfinite", cfg.on_nonfinite, NONFINITE, either(NONFINITE))
    if OmegaConf.is_missing(cfg, "model") or cfg.model is None:
        problems.append("model: missing; pick an experiment with +experiment=NAME (conf/experiment/), a model with "
                        "model=NAME (conf/model/), or give model={_target_: your.module.Class}")
    else:
        problems += check_target("model", cfg.model)
    if not any(h is not None for h in (cfg.hooks or {}).values()) and not cfg.inspect:
        problems.append("hooks: empty (or every entry null); declare at least one, e.g. "
                        "hooks: {acts: {kind: forward, layers: ${layers}}}")
    for name, hook in specs.items():
        problems += hooks.check_spec(name, hook, has_loss=cfg.loss is not None)
        for i, spec in enumerate(hook.edit):
            problems += edits.check_spec(f"hooks.{name}.edit[{i}]", spec)
    problems += losses.check_spec(cfg.loss, cfg.data)
    problems += store.check_spec(cfg.store)
    problems += data.check_spec(cfg.data)
    problems += samples.check_spec(cfg.data)
    if cfg.data.get("text"):
        problems += text.check_spec(cfg.data.text)
    if store_path is not None and not cfg.inspect and cfg.store.mode in STORE_MODES:
        config = resolved(cfg)
        problems += store.check_path(store_path, cfg.store.mode, config_hash(config), config)
    return specs, problems
