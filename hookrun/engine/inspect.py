"""Layer discovery for `inspect=true`: every module with its type, parameters and output shape, every parameter, and
the anatomy (standard site name -> module, native role, shape on one batch) of a model that has one.

    python -m hookrun +experiment=conv_fmaps inspect=true
"""
from __future__ import annotations

from collections import defaultdict

import pandas as pd
import torch

from hookrun.capture.anatomy import AnatomyError, anatomy
from hookrun.capture.hooks import flatten
from hookrun.capture.layers import module_names
from hookrun.capture.scope import HookScope


def _shapes(output) -> str:
    items = flatten(output, "output")
    if not items:
        return f"({type(output).__name__})"
    return ", ".join(f"{role[len('output.'):] or ''}{'=' if role != 'output' else ''}{list(t.shape)}"
                     for role, t in items)


def describe(model: torch.nn.Module, args: list, kwargs: dict) -> str:
    """Two tables: modules (name, type, own parameter count, calls, output shape on one batch) and
    parameters, with the model's total parameter count."""
    modules = module_names(model)
    shapes, calls = {}, defaultdict(int)

    def record(name):
        def hook(module, inputs, output):
            calls[name] += 1
            shapes.setdefault(name, _shapes(output))
        return hook

    with HookScope() as scope, torch.no_grad():
        for n, m in modules.items():
            scope.forward(m, record(n))
        model(*args, **kwargs)
    layers = pd.DataFrame([
        dict(layer=n, type=type(m).__name__, params=sum(p.numel() for p in m.parameters(recurse=False)),
             calls=calls.get(n, 0), output=shapes.get(n, "(not called)"))
        for n, m in modules.items()])
    params = pd.DataFrame([dict(parameter=n, shape=list(p.shape), numel=p.numel(), requires_grad=p.requires_grad)
                           for n, p in model.named_parameters()])
    total = int(params.numel.sum()) if len(params) else 0
    return (f"{len(layers)} modules (hook them by these names; the model itself is _model; params: the module's "
            f"own parameter values, not its submodules'; the model's total is below):\n"
            f"{layers.to_string(index=False)}\n\n{len(params)} parameters, {total} values in all (param_grad layers):\n"
            f"{params.to_string(index=False) if len(params) else '(none)'}")


def describe_anatomy(model: torch.nn.Module, args: list, kwargs: dict, batch_shape=None) -> str:
    """The anatomy table: each standard site name (what hooks, patching, the lens take), its native module and
    role, and its value's shape on one batch; for a model without an anatomy, why (model.anatomy to declare)."""
    try:
        anat = anatomy(model)
    except AnatomyError as err:
        return f"standard site names (blocks.N, ...): none for this model: {err}"
    rows = anat.report()
    points = [anat.locate(r["name"]) for r in rows]
    shapes = {}

    def record(point):
        def keep(value):  # returns None: the value flows on unchanged
            shapes.setdefault(point.name, list(value.shape))
        return keep

    modules = dict(model.named_modules())
    with HookScope() as scope, torch.no_grad():
        for p in points:
            scope.value(modules[p.module], p, record(p), lambda: batch_shape)
        model(*args, **kwargs)
    table = pd.DataFrame([dict(site=r["name"], module=r["module"], role=r["role"],
                               shape=shapes.get(r["name"], "(not called)"), source=r["source"],
                               error="-" if r["error"] is None else f"{r['error']:.1e}",
                               refused=(r["refused"] or "")[:60]) for r in rows])
    if not table.refused.any():
        table = table.drop(columns="refused")
    worst = anat.proof.worst() if anat.proof is not None else None
    checked = (f"checked on one tiny forward, worst relative error {worst:.1e}" if worst is not None else
               f"not checked: {anat.proof.error if anat.proof is not None else 'no forward'}")
    return (f"{len(table)} standard sites of {anat.model_class} ({anat.arch}, from {'a table' if anat.source == 'table' else 'its declaration' if anat.source == 'declared' else 'inference'}; "
            f"{checked}; hook them by these names in any config: layers: [blocks.*], docs/anatomy.md):\n"
            f"{table.to_string(index=False)}")


def discard_run_dir(output_dir, keep_dir: bool = False, since: float = 0.0) -> bool:
    """Remove what Hydra wrote for an inspect run (.hydra/ and the job's log) if that is all its output dir
    holds, so `inspect=true` leaves nothing behind, then parents below the launch dir left empty
    (outputs/<date>). Only Hydra's own new run dir (claimed by this launch: hookrun.config.rundir) goes:
    with `keep_dir` (a dir the user named with hydra.run.dir) nothing is removed.
    A dir holding anything else, or any file older than `since` (this launch's start: an earlier run's
    log), is left as it is. Returns whether anything was removed."""
    import logging
    import shutil
    from pathlib import Path

    out = Path(output_dir).resolve()
    if not out.is_dir() or any(p.name != ".hydra" and p.suffix != ".log" for p in out.iterdir()):
        return False
    if any(p.stat().st_mtime < since for p in out.rglob("*")):
        return False
    if any(not p.is_file() or p.suffix != ".yaml" for p in (out / ".hydra").glob("*")):
        return False
    for handler in logging.getLogger().handlers[:]:  # Hydra's file handler holds the job's log open
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == out:
            handler.close()
            logging.getLogger().removeHandler(handler)
    if keep_dir:
        return False  # a dir the user named may hold an earlier run's .hydra/ and log: not ours to delete
    shutil.rmtree(out)
    parent = out.parent
    while Path.cwd() in parent.parents and not any(parent.iterdir()):  # only below the launch dir
        parent.rmdir()
        parent = parent.parent
    return True
