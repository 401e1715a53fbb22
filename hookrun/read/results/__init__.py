"""Readers of what each method stored, one module per result kind, with no torch: what `cap.read(key, ...)`,
`cap.grid()` and `cap.generations()` give, on a machine that has zarr and pandas but not torch.

    from hookrun.read.results import reader
    reader("patching")(cap)          # a PatchGrid (patching.py); "attribution" too
    reader("lens")(cap)              # a LensResult (lens.py); "circuit": a CircuitResult (circuits.py, graph.py)
    reader("dictionaries")(cap)      # the evaluations (dictionaries.py); "generate": the completions (generation.py)

hookrun's own methods' readers are listed here by dotted path and imported when asked for, never the method (its
module, hookrun.methods.*, holds its core and config block; its `read` delegates here); a plug-in method (entry
point group `hookrun.methods`) keeps its own `read` staticmethod, found through hookrun.config.registry.
"""
from __future__ import annotations

import importlib
from typing import Callable

from hookrun.config.registry import BUILTIN, names, plugin

READERS = {  # config key -> "module:function" of the reader cap.read(key, ...) calls
    "patching": "hookrun.read.results.patching:load_grid",
    "attribution": "hookrun.read.results.patching:load_attribution",
    "lens": "hookrun.read.results.lens:load_lens",
    "circuit": "hookrun.read.results.circuits:load_circuit",
    "dictionaries": "hookrun.read.results.dictionaries:read",
    "generate": "hookrun.read.results.generation:generations",
    "train": "hookrun.read.results.training:read",
}

SUMMARIES = {  # config key -> "module:function" of a run's numbers that are no mean over samples (collect's columns)
    "circuit": "hookrun.read.results.circuits:summary",
}


def summaries(cap) -> dict:
    """The run-level numbers of the methods a run used that are no mean over its samples (a circuit run's CPR and
    CMD), column -> value: what hookrun.collect adds beside the metric columns' means."""
    out = {}
    for key, target in SUMMARIES.items():
        if key in cap.attrs:
            module, _, name = target.partition(":")
            out.update(getattr(importlib.import_module(module), name)(cap))
    return out


def reader(key: str) -> Callable:
    """The reader of method `key`'s results, called as reader(key)(cap, *args, **kwargs); KeyError for a method that
    stores none of its own (metrics: their columns are in cap.samples) or that is not registered."""
    if key in READERS:
        module, _, name = READERS[key].partition(":")
        return getattr(importlib.import_module(module), name)
    if key in BUILTIN:
        raise KeyError(f"cap.read({key!r}): the {key} method stores no result of its own to read; its numbers are "
                       f"columns of cap.samples (and arrays cap.load reads); readers: {', '.join(READERS)}")
    cls = plugin(key)
    if cls is None:
        raise KeyError(f"no hookrun method {key!r}; registered: {', '.join(names())}")
    return cls.read
