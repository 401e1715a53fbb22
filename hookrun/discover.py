"""Layer discovery for `inspect=true`: every module with its type, parameters and output shape, and every parameter.

    python -m hookrun +experiment=conv_fmaps inspect=true
"""
from __future__ import annotations

from collections import defaultdict

import pandas as pd
import torch

from hookrun.hooks import flatten
from hookrun.select import module_names


def _shapes(output) -> str:
    items = flatten(output, "output")
    if not items:
        return f"({type(output).__name__})"
    return ", ".join(f"{role[len('output.'):] or ''}{'=' if role != 'output' else ''}{list(t.shape)}"
                     for role, t in items)


def describe(model: torch.nn.Module, args: list, kwargs: dict) -> str:
    """Two tables: modules (name, type, parameters, calls, output shape on one batch) and parameters."""
    modules = module_names(model)
    shapes, calls = {}, defaultdict(int)

    def record(name):
        def hook(module, inputs, output):
            calls[name] += 1
            shapes.setdefault(name, _shapes(output))
        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in modules.items()]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    layers = pd.DataFrame([
        dict(layer=n, type=type(m).__name__, params=sum(p.numel() for p in m.parameters(recurse=False)),
             calls=calls.get(n, 0), output=shapes.get(n, "(not called)"))
        for n, m in modules.items()])
    params = pd.DataFrame([dict(parameter=n, shape=list(p.shape), numel=p.numel(), requires_grad=p.requires_grad)
                           for n, p in model.named_parameters()])
    total = int(params.numel.sum()) if len(params) else 0
    return (f"{len(layers)} modules (hook them by these names; the model itself is _model):\n"
            f"{layers.to_string(index=False)}\n\n{len(params)} parameters, {total} values (param_grad layers):\n"
            f"{params.to_string(index=False) if len(params) else '(none)'}")
