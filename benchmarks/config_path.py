"""Config path: the way a run's config takes through hookrun's modules, followed from hookrun.engine.runner.run.

A tiny run (`hookrun.run("add_one", store={"path": "memory"})` by default) is traced with sys.setprofile from the
moment hookrun.engine.runner.run is entered until it returns. A *stop* is a call of a hookrun function that receives
the config as an argument: the parsed config (Parsed), its typed config or any block inside it (a dataclass, a
dict or list of it, by identity), its resolved form or a block of that, or a copy of the whole resolved config (a
dict with its top-level keys). Consecutive calls in one module are one stop. Counted:

    stops      the stops, in call order
    modules    the distinct modules among them
    climbs     stops in a higher layer than the stop before them (the layers of pyproject.toml's first
               import-linter contract: entry points > engine > methods > data > capture > store | read > format
               > config): each time the config's way climbs back up
    entries    how many stops each module is

Figures on this machine (stops / modules / climbs), before and after config/schema.py was split by job, the hash
made once a run (Parsed.config_hash), the run's methods made once and the parse passed along:
add_one 59 / 24 / 18 -> 43 / 25 / 11 (config.schema entered 9 times -> config.checks 3, config.parsing 1);
conv_fmaps 64 / 25 / 19 -> 48 / 26 / 12; lm_tokens 68 / 26 / 20 -> 52 / 27 / 13.

    python benchmarks/config_path.py                 # the counts, and the path one stop a line
    python benchmarks/config_path.py --experiment conv_fmaps --calls   # another run; every call of each stop too
    python benchmarks/config_path.py --callers       # every call, with the line that made it

Run from the repository root; it takes a few seconds (the experiment's run, traced).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = (("hookrun.__main__", "hookrun.api", "hookrun.analyses"), ("hookrun.engine",), ("hookrun.methods",),
          ("hookrun.data",), ("hookrun.capture",), ("hookrun.store", "hookrun.read"), ("hookrun.format",),
          ("hookrun.config",))  # pyproject.toml, the first [[tool.importlinter.contracts]], top first


def layer(module: str) -> int | None:
    """The layer of a hookrun module (0: the entry points, 7: config), or None for one outside the layers."""
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


class Follow:
    """A profile function recording each call of a hookrun function that receives the config (see the module
    docstring), while hookrun.engine.runner.run runs."""

    def __init__(self):
        self.ids: set = set()
        self.kept: list = []  # the tracked objects, held so that their ids stay theirs
        self.top_keys: frozenset = frozenset()
        self.calls: list = []  # (module, function) of each stop's call, in order
        self.callers: list = []  # "module:line" of each call's caller
        self.seen: dict = {}  # id(frame) -> frame: a generator's resumptions are not new calls
        self.depth = 0  # runner.run frames on the stack

    def add(self, node, depth: int = 0) -> None:
        """Track `node` and every block inside it."""
        if depth > 12 or id(node) in self.ids:
            return
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            children = [getattr(node, f.name) for f in dataclasses.fields(node)]
        elif isinstance(node, dict):
            children = list(node.values())
        elif isinstance(node, (list, tuple)):
            children = list(node)
        elif type(node).__name__ in ("DictConfig", "ListConfig"):
            children = []
        else:
            return
        if not children and not type(node).__name__ in ("DictConfig", "ListConfig"):
            return  # an empty container is no block: any {} would match
        self.ids.add(id(node))
        self.kept.append(node)
        for child in children:
            self.add(child, depth + 1)

    def is_config(self, value) -> bool:
        if id(value) in self.ids:
            return True
        name = type(value).__name__
        if name == "Parsed" and type(value).__module__.startswith("hookrun.config"):
            self.add(value)
            self.add(value.config)
            self.add(value.resolved)
            self.top_keys = frozenset(value.resolved)
            return True
        if type(value).__module__.startswith("hookrun.config") and dataclasses.is_dataclass(value):
            self.add(value)  # a schema block made anew (dataclasses.replace)
            return True
        if name == "DictConfig" and "store" in value and "hooks" in value:
            self.add(value)  # the composed config
            return True
        if isinstance(value, dict) and self.top_keys and frozenset(value) == self.top_keys:
            self.add(value)  # a copy of the resolved config (the store's form)
            return True
        return False

    def __call__(self, frame, event, arg):
        if event == "return" and self.depth and _is_run(frame):
            self.depth -= 1
            return
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("hookrun"):
            return
        if _is_run(frame):
            self.depth += 1
        if not self.depth or id(frame) in self.seen and self.seen[id(frame)] is frame:
            return
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        values = [frame.f_locals.get(name) for name in code.co_varnames[:count]]
        if code.co_flags & 4:  # *args
            values += list(frame.f_locals.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount]) or ())
        if any(self.is_config(v) for v in values):
            self.seen[id(frame)] = frame
            self.calls.append((module, code.co_qualname if hasattr(code, "co_qualname") else code.co_name))
            back = frame.f_back
            self.callers.append(f"{back.f_globals.get('__name__', '?')}:{back.f_lineno}" if back else "?")


def _is_run(frame) -> bool:
    return frame.f_code.co_name == "run" and frame.f_globals.get("__name__") == "hookrun.engine.runner"


def stops(calls: list) -> list:
    """The calls grouped into stops: (module, [functions]) for each run of consecutive calls in one module."""
    found: list = []
    for module, function in calls:
        if found and found[-1][0] == module:
            found[-1][1].append(function)
        else:
            found.append((module, [function]))
    return found


def named_callers(follow: "Follow") -> list:
    """(module, "function (from caller)") of each call: the stops with where each was called from."""
    return [(m, f"{f} <- {c.removeprefix('hookrun.')}") for (m, f), c in zip(follow.calls, follow.callers)]


def measure(experiment: str, overrides: list) -> "Follow":
    """What followed the config in one run of `experiment` (Follow.calls: (module, function), in order)."""
    import logging

    import hookrun

    logging.getLogger("hookrun").setLevel(logging.WARNING)
    hookrun.run(experiment, overrides, quiet=True, store={"path": "memory"})  # warm: imports, the composition
    follow = Follow()
    sys.setprofile(follow)
    try:
        hookrun.run(experiment, overrides, quiet=True, store={"path": "memory"})
    finally:
        sys.setprofile(None)
    return follow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="add_one")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run")
    parser.add_argument("--calls", action="store_true", help="list every call of each stop")
    parser.add_argument("--callers", action="store_true", help="list every call of each stop with its caller")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # hookrun.run writes its Hydra output dir below the working directory
        follow = measure(args.experiment, args.overrides)
    path = stops(follow.calls)
    climbs = sum(1 for (a, _), (b, _) in zip(path, path[1:])
                 if layer(a) is not None and layer(b) is not None and layer(b) < layer(a))
    modules = sorted({m for m, _ in path})
    print(f"{len(path)} stops in {len(modules)} modules, {climbs} climbing back to a higher layer "
          f"({sum(len(f) for _, f in path)} calls)")
    entries = {m: sum(1 for s, _ in path if s == m) for m in modules}
    print("entries: " + ", ".join(f"{m.removeprefix('hookrun.')} {n}" for m, n in
                                  sorted(entries.items(), key=lambda kv: (-kv[1], kv[0]))))
    previous = None
    shown = stops(named_callers(follow)) if args.callers else path
    for module, functions in shown:
        up = previous is not None and layer(previous) is not None and layer(module) is not None and \
            layer(module) < layer(previous)
        names = functions if args.calls or args.callers else sorted(set(functions), key=functions.index)
        print(f"  {'^' if up else ' '} {module:34} {', '.join(names)}")
        previous = module


if __name__ == "__main__":
    main()
