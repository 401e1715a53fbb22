"""The registry of methods: which analyses a run can declare, each one a class behind hookrun.methods.Method.

    from hookrun.config.registry import methods, method
    methods()                  # {"metrics": Metrics, "patching": Patching, "generate": Generation, ...}
    method("patching")         # the method class of a config key
    names(); plugin("l2norm")  # the keys, and one plug-in's class, importing no method of hookrun's own

hookrun's own methods are listed here by dotted path; a user's package adds its own through the entry point group
`hookrun.methods` (in its pyproject.toml: `[project.entry-points."hookrun.methods"] l2 = "mypkg.l2:L2Norm"`). Both
are imported only when asked for (this is the bottom layer: it names the method modules, it imports none of them
statically); the read side finds hookrun's own readers in hookrun.read.results and a plug-in's `read` through
plugin(key), without importing the run or torch.
"""
from __future__ import annotations

import functools
import importlib
from importlib import metadata
from typing import Dict, List, Optional

GROUP = "hookrun.methods"
BUILTIN = {  # config key -> "module:Class"; the order is the order each batch runs them in
    "metrics": "hookrun.methods.metrics:Metrics",
    "patching": "hookrun.methods.patching:Patching",
    "generate": "hookrun.methods.generation:Generation",
    "dictionaries": "hookrun.methods.dictionaries:Dictionaries",
    "attribution": "hookrun.methods.attribution:Attribution",
    "lens": "hookrun.methods.lens:Lens",
    "circuit": "hookrun.methods.circuits:Circuit",
    "train": "hookrun.methods.training:Train",
}


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _entry_class(entry) -> type:
    """The method class of a `hookrun.methods` entry point: ImportError naming one that does not load, or whose key
    is not its name."""
    try:
        cls = entry.load()
    except Exception as err:  # noqa: BLE001 - a broken plug-in is named, not hidden
        raise ImportError(f"the hookrun method {entry.name!r} ({entry.value}) does not load: "
                          f"{type(err).__name__}: {err}") from err
    key = getattr(cls, "key", None)
    if key != entry.name:
        raise ImportError(f"the hookrun method entry point {entry.name!r} ({entry.value}) has key {key!r}; "
                          "name the entry point as the method's key")
    return cls


@functools.lru_cache(maxsize=None)
def methods() -> Dict[str, type]:
    """Every registered method class by its config key: hookrun's own, then the `hookrun.methods` entry points.
    A plug-in whose key is taken, or that does not load, raises ImportError naming its entry point."""
    found = {key: _load(path) for key, path in BUILTIN.items()}
    for entry in metadata.entry_points(group=GROUP):
        cls = _entry_class(entry)
        key = cls.key
        if key in found and found[key] is not cls:
            raise ImportError(f"the hookrun method {key!r} ({entry.value}) takes a config key that "
                              f"{found[key].__module__}.{found[key].__name__} has; rename one")
        found[key] = cls
    return found


def names() -> List[str]:
    """Every registered method's config key, hookrun's own and the plug-ins', without importing any of them."""
    return [*BUILTIN, *(e.name for e in metadata.entry_points(group=GROUP) if e.name not in BUILTIN)]


def plugin(key: str) -> Optional[type]:
    """The plug-in method (entry point) of config key `key`, importing only it (not hookrun's own methods: the read
    side finds a plug-in's reader without torch); None where no plug-in has that key."""
    for entry in metadata.entry_points(group=GROUP):
        if entry.name == key and key not in BUILTIN:
            return _entry_class(entry)
    return None


def method(key: str) -> type:
    """The method class of config key `key` (KeyError naming the registered ones)."""
    found = methods()
    if key not in found:
        raise KeyError(f"no hookrun method {key!r}; registered: {', '.join(found)}")
    return found[key]
