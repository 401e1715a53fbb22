"""Orchestration of one run: validate, build, register hooks, loop over batches, close the store.

    from hookrun.runner import run
    store_path = run(cfg)            # cfg: a composed hookrun config (see conf/config.yaml)
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
from hydra.utils import instantiate
from tqdm import tqdm

from hookrun import losses
from hookrun.check import check
from hookrun.config import ConfigError, config_hash, resolved
from hookrun.discover import describe
from hookrun.hooks import BatchInfo, HookError, HookSet, build_plans, layer_problems
from hookrun.store import Store, is_complete, versions
from hookrun.text import make_inputs

log = logging.getLogger("hookrun")


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda, then mps, then cpu; anything else as named (check() made sure it exists)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)


def hydra_context() -> dict:
    """Output dir, group choices and overrides of the Hydra job running now ({} outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    hc = HydraConfig.get()
    return {"output_dir": hc.runtime.output_dir, "choices": dict(hc.runtime.choices),
            "overrides": list(hc.overrides.task)}


def store_path(cfg, context: dict) -> Optional[Path]:
    """Where the store goes: store.path, else <hydra output dir>/captures.zarr."""
    if cfg.store.path:
        return Path(cfg.store.path)
    if "output_dir" in context:
        return Path(context["output_dir"]) / "captures.zarr"
    if cfg.inspect:
        return None
    raise ConfigError(["store.path: not set and no Hydra output dir; set store.path=... when running outside the CLI"])


def _forward(model, args, kwargs, plans):
    try:
        return model(*args, **kwargs)
    except RuntimeError as err:
        if "BackwardHookFunction" in str(err):
            hooked = sorted({f"hooks.{p.name} ({', '.join(p.targets)})" for p in plans if p.kind in ("backward", "backward_pre")})
            raise HookError(
                f"a full backward hook broke the forward pass on {'; '.join(hooked)}: PyTorch wraps the output of a "
                "module with a full backward hook in a view, and an in-place op after it (ReLU(inplace=True), "
                "x += shortcut) modified that view. Use kind: output_grad on the same layers instead: it records "
                f"the same gradient (role grad = grad_output.0) with Tensor.register_hook. PyTorch said: {err}"
            ) from err
        raise


def run(cfg) -> Optional[Path]:
    """Run one experiment from a composed config; returns the store path (None for inspect=true)."""
    context = hydra_context()
    path = store_path(cfg, context)
    hook_specs, problems = check(cfg, path)
    torch.manual_seed(cfg.seed)
    model = None
    if not any(p.startswith("model") for p in problems):
        # building is not running: build the model to check the layers too, and report everything at once
        model = instantiate(cfg.model)
        problems += layer_problems(model, hook_specs)
    inputs = None
    if not any(p.startswith("data") for p in problems):
        try:
            inputs = make_inputs(cfg.data, cfg.seed)
            problems += inputs.check_lengths()
        except ConfigError as err:  # a corpus that cannot be read or tokenized
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    device = resolve_device(cfg.device)
    model.to(device)
    model.train(cfg.mode == "train")
    if cfg.inspect:
        batch = next(iter(inputs)).to(device)
        print(describe(model, batch.args, batch.kwargs))
        return None
    if cfg.store.mode == "resume" and is_complete(path):
        log.info("%s is complete: nothing to resume", path)
        return path
    plans = build_plans(model, hook_specs, device)
    loss_fn = losses.build(cfg.loss) if cfg.loss is not None else None

    config = resolved(cfg)
    attrs = {"config": config, "config_hash": config_hash(config), "choices": context.get("choices", {}),
             "overrides": context.get("overrides", []), "versions": versions(), "device": str(device),
             "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    store = Store(path, cfg.store, attrs, expected_samples=inputs.sample_count(),
                  expected_batches=inputs.batch_count(), on_nonfinite=cfg.on_nonfinite)
    if store.next_batch:
        log.info("resuming %s after its last committed batch: starting at batch %d", path, store.next_batch)
    timing = {"forward_s": 0.0, "backward_s": 0.0, "capture_s": 0.0}
    submitted = [0]

    def sink(capture):
        t0 = time.perf_counter()
        submitted[0] += capture.tensor.numel() * capture.tensor.element_size()
        store.submit(capture)
        timing["capture_s"] += time.perf_counter() - t0

    status = "failed"
    started = time.perf_counter()
    samples = 0
    try:
        # a model without trainable parameters (the seeds' y = x + 2) needs its inputs to require grad
        leaf_inputs = loss_fn is not None and not any(p.requires_grad for p in model.parameters())
        with HookSet(model, plans, sink, inputs_require_grad=leaf_inputs) as hookset, \
                torch.set_grad_enabled(loss_fn is not None):
            bar = tqdm(inputs, desc="hookrun", unit="batch", total=inputs.batch_count(), disable=None,
                       dynamic_ncols=True)
            for i, batch in enumerate(bar):
                if i < store.next_batch:
                    continue  # committed by the run this one resumes
                torch.manual_seed(cfg.seed + i)  # each batch's randomness (dropout) is its own: resumable
                batch = batch.to(device)
                info = BatchInfo(i, batch.start, batch.stop, inputs.batched, batch.tokens)
                args, kwargs = hookset.begin_batch(info, batch.args, batch.kwargs)
                t0 = time.perf_counter()
                output = _forward(model, args, kwargs, plans)
                loss = loss_fn(output, batch) if loss_fn is not None else None
                t1 = time.perf_counter()
                if loss is not None:
                    model.zero_grad(set_to_none=True)
                    loss.backward()
                t2 = time.perf_counter()
                hookset.end_batch()
                timing["forward_s"] += t1 - t0
                timing["backward_s"] += t2 - t1
                store.end_batch({"batch": i, "sample_start": batch.start, "sample_stop": batch.stop,
                                 "loss": float(loss.detach()) if loss is not None else float("nan"),
                                 "forward_s": t1 - t0, "backward_s": t2 - t1},
                                tables={"tokens": batch.table} if batch.table is not None else None)
                samples += batch.stop - batch.start
                elapsed = max(time.perf_counter() - started, 1e-9)
                bar.set_postfix(samples_s=f"{samples / elapsed:.0f}", MB_s=f"{submitted[0] / elapsed / 2**20:.1f}")
        status = "complete"
    finally:
        timing["wall_s"] = time.perf_counter() - started
        store.close(status, summary={"samples": samples, "timing": timing})
    timing["write_s"] = store.write_seconds
    _print_summary(path, store, timing, samples)
    return path


def _print_summary(path: Path, store: Store, timing: dict, samples: int) -> None:
    table = pd.DataFrame(store.root.attrs["summary"]["arrays"])
    raw = int(table.raw_bytes.sum()) if len(table) else 0
    stored = int(table.stored_bytes.sum()) if len(table) else 0
    lines = [f"captures: {path}", table.to_string(index=False) if len(table) else "(nothing captured)",
             f"{samples} samples; {raw / 2**20:.2f} MB raw, {stored / 2**20:.2f} MB stored "
             f"(ratio {raw / stored if stored else float('nan'):.2f}); forward {timing['forward_s']:.3f} s, "
             f"backward {timing['backward_s']:.3f} s, hooks {timing['capture_s']:.3f} s, "
             f"writing {timing['write_s']:.3f} s, wall {timing['wall_s']:.3f} s"]
    log.info("\n".join(lines))
