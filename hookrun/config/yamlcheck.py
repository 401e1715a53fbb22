"""YAML syntax errors in the config files a command will load, found before Hydra loads them: one line naming the
file, line and column (and how to quote `${...}` inside `{...}`) instead of PyYAML's traceback.

Usage: `problems = yaml_problems(["+experiment=mine"], config_dirs=["my_conf"])` -> [] when every file parses.
"""
import dataclasses
import re
from pathlib import Path
from typing import Iterable, List, Optional

import yaml

from hookrun.config.schema import run_schema, unknown_key

QUOTE_HINT = ("an interpolation inside a flow mapping or list must be quoted: "
              "`sites: {layers: '${layers}', positions: all}`, not `{layers: ${layers}, ...}`")


FLOW_INTERPOLATION = re.compile(r"[{\[][^'\"]*?\$\{")  # an unquoted ${...} inside {...} or [...]
GLOBAL = re.compile(r"^#\s*@package\s+_global_\s*$", re.M)  # an experiment file: its top-level keys are the run's


def syntax_problem(path: Path) -> Optional[str]:
    """The one-line problem of a YAML file that does not parse (file:line:column, what PyYAML expected, and the
    quoting hint where the line holds an unquoted `${` inside a flow mapping or list), or None when it parses."""
    try:
        yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = "; ".join(x for x in (err.problem, err.context) if x)
        lines = path.read_text().splitlines()
        line = lines[mark.line] if mark and mark.line < len(lines) else ""
        hint = f" ({QUOTE_HINT})" if FLOW_INTERPOLATION.search(line) else ""
        return f"{where}: YAML syntax error: {what}{hint}"
    except yaml.YAMLError as err:
        return f"{path}: YAML syntax error: {err}"
    return None


def top_level_problems(path: Path, data) -> List[str]:
    """Top-level keys of an experiment file (`# @package _global_`) that the run's schema lacks (`hook:` for
    `hooks:`), each with the nearest keys, before Hydra's `Key 'hook' not in 'RunConfig'`."""
    if not isinstance(data, dict) or not GLOBAL.search(path.read_text()):
        return []
    schema = run_schema()
    known = {f.name for f in dataclasses.fields(schema)} | {"defaults", "hydra"}
    return [f"{path}: {unknown_key('', str(key), schema)}" for key in data if str(key) not in known]


def defaults_of(data) -> List[tuple]:
    """(group or None, name, absolute) of each entry of a loaded config's defaults list."""
    entries = data.get("defaults") if isinstance(data, dict) else None
    out = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, str) and entry != "_self_":
            out.append((None, entry.lstrip("/"), entry.startswith("/")))
        elif isinstance(entry, dict) and len(entry) == 1:
            (key, value), = entry.items()
            group = str(key).replace("override ", "").strip().split("@")[0]
            for name in value if isinstance(value, list) else [value]:
                if isinstance(name, str):
                    out.append((group.lstrip("/"), name, group.startswith("/")))
    return out


def yaml_problems(overrides: Iterable[str], config_dirs: Iterable[str] = (), config_name: Optional[str] = None,
                  search: Iterable[Path] = ()) -> List[str]:
    """Syntax problems of the YAML files the command line selects: the primary config `config_name`, the group
    options named by `group=name` overrides (sweeps: each name) in `config_dirs` (`--config-dir`, `file://`
    entries of hydra.searchpath) and `search` (the bundled conf), and the defaults lists of those, recursively."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    overrides = list(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return []  # Hydra says what is malformed itself
    dirs = [Path(d) for d in config_dirs]
    for o in parsed:
        if o.key_or_group == "hydra.searchpath" and isinstance(o.value(), list):
            dirs += [Path(str(p)[len("file://"):]) for p in o.value() if str(p).startswith("file://")]
    dirs += list(search)
    todo = [(None, config_name)] if config_name else []
    for o in parsed:
        if o.is_delete() or o.is_hydra_override() or "." in o.key_or_group:
            continue
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        todo += [(o.key_or_group, v) for v in values if isinstance(v, str)]
    seen, problems = set(), []
    while todo:
        group, name = todo.pop()
        for d in dirs:
            path = d / (group or "") / f"{name}.yaml"
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            problem = syntax_problem(path)
            if problem:
                problems.append(problem)
                continue
            data = yaml.safe_load(path.read_text())
            problems += top_level_problems(path, data)
            for sub, subname, absolute in defaults_of(data):
                if sub is None:  # `- conv_fmaps` in experiment/mine.yaml: experiment/conv_fmaps.yaml
                    sub = group
                elif not absolute and group is not None:  # `- model: x` in experiment/: experiment/model/x
                    sub = f"{group}/{sub}"
                todo.append((sub, subname))
    return problems
