"""The command line checked before Hydra acts on it: overrides of keys the schema lacks, and a sweep's launcher
settings that joblib would refuse only once the sweep started (LauncherCheck, a Hydra callback in conf/config.yaml).

    override_problems(["data.text.max_len=64"])   # ['data.text.max_len: unknown key (did you mean: max_length?); ...']
    launcher_problems(cfg.hydra.launcher)          # ['hydra.launcher.n_jobs: 0 runs no job; ...']
"""
from __future__ import annotations

import logging
import sys
from typing import Any, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from hookrun.config.checks import ConfigError, check_choice, check_number
from hookrun.config.schema import conf_dir, named_item, run_schema, schema_field, unknown_key


def override_problems(overrides: List[str]) -> List[str]:
    """Command-line overrides without `+` (`data.text.max_len=64`, `sed=1`) of keys that the schema of a typed
    node lacks, with check()'s suggestion (Hydra refuses them with OmegaConf's own message and a hint to add `+`,
    after which check() names the key)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return []  # Hydra says what is malformed itself
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir()}  # experiment=...: Hydra's
    problems = []
    for o in parsed:
        if o.is_add() or o.is_force_add() or o.is_delete() or o.package is not None or o.is_hydra_override():
            continue
        schema, prefix = run_schema(), ""
        *path, last = o.key_or_group.split(".")
        parts = iter(path)
        for part in parts:
            if schema is None or part not in schema.__dataclass_fields__:
                break
            if not prefix and schema_field(schema, part) is None and named_item(schema, part) is None:
                problems += block_key_problems(part, [*path[1:], last])  # a method's free-form block: its keys
                schema = None
                break
            item = named_item(schema, part)  # hooks.NAME.x: the entry NAME is the user's, its keys the schema's
            if item is not None:
                name = next(parts, None)
                if name is None:
                    schema = None  # hooks.NAME=...: the whole entry, checked by check()
                    break
                schema, prefix = item, f"{prefix}{part}.{name}."
                continue
            schema, prefix = schema_field(schema, part), f"{prefix}{part}."
        else:
            if schema is not None and last not in schema.__dataclass_fields__ and (path or last not in groups):
                problems.append(unknown_key(prefix, last, schema))
            elif schema is not None and last in schema.__dataclass_fields__ and not o.is_sweep_override():
                problems += typed_value_problems(f"{prefix}{last}", o.value(), schema, last)
    return problems


def typed_value_problems(key: str, value, schema: type, name: str) -> List[str]:
    """[the problem] of a value OmegaConf would refuse with its own words (`data.batch_size=nan`: "could not be
    converted to Integer"): an integer field given NaN, inf, a fraction or a word, in check_number's words."""
    import typing

    hint = typing.get_type_hints(schema)[name]
    kinds = set(typing.get_args(hint)) or {hint}
    if int not in kinds or isinstance(value, int) and not isinstance(value, bool) or value is None and \
            type(None) in kinds:
        return []
    if isinstance(value, str) and (value.lstrip("-").isdigit() or "${" in value):
        return []  # a quoted integer (OmegaConf converts it), an interpolation (resolved later, checked then)
    if not isinstance(value, (float, str)):
        return []  # a list or a mapping: OmegaConf's own message
    return check_number(key, value, whole=True)


def block_key_problems(block: str, path: List[str]) -> List[str]:
    """Unknown keys of a method's free-form block given on the command line without `+` (`circuit.methd=eap`): the
    method's own check of a block holding that key names it with its did-you-mean (Hydra would advise `+`)."""
    from types import SimpleNamespace

    from hookrun.config.registry import methods

    cls = methods().get(block)
    if cls is None or not path:
        return []
    spec: Any = None
    for part in reversed(path):
        spec = {part: spec}
    key = ".".join([block, *path])
    try:
        found = cls.check(SimpleNamespace(**{block: spec}))
    except Exception:  # noqa: BLE001 - a check that needs more of the config than one key: Hydra's message stands
        return []
    return [p for p in found if p.startswith(f"{key}: unknown key")]


JOBLIB = {"prefer": (None, "processes", "threads"), "require": (None, "sharedmem"),
          "mmap_mode": (None, "r+", "r", "w+", "c")}


def launcher_problems(launcher) -> List[str]:
    """Settings of the joblib launcher that joblib would refuse only once the sweep starts, with a traceback."""
    if "joblib" not in str(launcher.get("_target_", "")).lower():
        return []
    problems = [p for key, allowed in JOBLIB.items() if key in launcher
                for p in check_choice(f"hydra.launcher.{key}", launcher[key], allowed, hint=False)]
    if launcher.get("n_jobs") == 0:
        problems.append("hydra.launcher.n_jobs: 0 runs no job; give how many jobs run at once, or -1 for one per "
                        "core (-2: all cores but one)")
    batch = str(launcher.get("batch_size", "auto"))
    if batch != "auto" and not (batch.isdigit() and int(batch) > 0):
        problems.append(f"hydra.launcher.batch_size: {batch!r}; use auto or a positive number of jobs a worker takes")
    dispatch = str(launcher.get("pre_dispatch", "all"))
    if dispatch != "all" and not (dispatch.replace("n_jobs", "1").strip()
                                  and set(dispatch.replace("n_jobs", "1")) <= set("0123456789+-*/() ")):
        problems.append(f"hydra.launcher.pre_dispatch: {dispatch!r}; use all, a number or an expression of n_jobs "
                        "such as 2*n_jobs")
    if launcher.get("timeout") is not None and launcher.timeout <= 0:
        problems.append(f"hydra.launcher.timeout: {launcher.timeout}; give seconds > 0 or null (no limit)")
    return problems


class LauncherCheck(Callback):
    """Hydra callback (conf/config.yaml): a multirun's launcher settings checked before any job starts."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problems = launcher_problems(config.hydra.launcher)
        if problems:  # exit here: Hydra would print an exception raised from a callback as a traceback
            logging.getLogger("hookrun").error("%s", ConfigError(problems))
            sys.exit(2)
