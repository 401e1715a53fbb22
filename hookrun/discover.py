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
    """Two tables: modules (name, type, own and total parameter counts, calls, output shape on one batch)
    and parameters."""
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
        dict(layer=n, type=type(m).__name__, own_params=sum(p.numel() for p in m.parameters(recurse=False)),
             total_params=sum(p.numel() for p in m.parameters()), calls=calls.get(n, 0),
             output=shapes.get(n, "(not called)"))
        for n, m in modules.items()])
    params = pd.DataFrame([dict(parameter=n, shape=list(p.shape), numel=p.numel(), requires_grad=p.requires_grad)
                           for n, p in model.named_parameters()])
    total = int(params.numel.sum()) if len(params) else 0
    return (f"{len(layers)} modules (hook them by these names; the model itself is _model; own_params: the "
            f"module's own parameters, total_params: with its submodules'):\n"
            f"{layers.to_string(index=False)}\n\n{len(params)} parameters, {total} values (param_grad layers):\n"
            f"{params.to_string(index=False) if len(params) else '(none)'}")


def discard_run_dir(output_dir) -> bool:
    """Remove an inspect run's output dir if it holds only what Hydra wrote for this job (.hydra/ and the
    job's log), so `inspect=true` leaves nothing behind; a dir holding anything else is kept. Parents
    below the launch dir that are left empty (outputs/<date>) go too. Returns whether it was removed."""
    import logging
    import shutil
    from pathlib import Path

    out = Path(output_dir).resolve()
    if not out.is_dir() or any(p.name != ".hydra" and p.suffix != ".log" for p in out.iterdir()):
        return False
    if any(not p.is_file() or p.suffix != ".yaml" for p in (out / ".hydra").glob("*")):
        return False
    for handler in logging.getLogger().handlers[:]:  # Hydra's file handler holds the job's log open
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == out.resolve():
            handler.close()
            logging.getLogger().removeHandler(handler)
    shutil.rmtree(out)
    parent = out.parent
    while Path.cwd() in parent.parents and not any(parent.iterdir()):  # only below the launch dir
        parent.rmdir()
        parent = parent.parent
    return True
