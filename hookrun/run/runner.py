"""Orchestration of one run: validate, build, register hooks, loop over batches, close the store.

    from hookrun.run.runner import run
    store_path = run(cfg)            # cfg: a composed hookrun config (see conf/config.yaml)

Under torchrun (or SLURM tasks) every rank runs this with its share of the batches (hookrun.run.ranks);
rank 0 probes the first batch so every array can be made before any rank writes (hookrun.store.parallel).
"""
from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tqdm import tqdm

from hookrun.run import losses
from hookrun.run import summary
from hookrun.run.checks import check
from hookrun.config.schema import ConfigError, config_hash, resolved
from hookrun.run.cores import cores, job_threads, spare_core
from hookrun.run.inspect import describe
from hookrun.run.heap import HeapTrimmer
from hookrun.run.preflight import first_batch_problems, numbered, step
from hookrun.capture.hooks import BatchError, HookSet, build_plans, layer_problems
from hookrun.run.ranks import Ranks
from hookrun.data.samples import TABLE, record_fields, sample_table
from hookrun.format.location import Location
from hookrun.store import Store, finish_close, is_complete, versions, writer_mode
from hookrun.store.parallel import Share
from hookrun.store.spec import storage_options
from hookrun.data.text import make_inputs

log = logging.getLogger("hookrun")


class Interrupted(BaseException):
    """The run was stopped by SIGTERM (a scheduler's notice) or SIGINT (Ctrl-C); exit code 128 + signal."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextmanager
def signals_raise_interrupted():
    """While running, SIGTERM and SIGINT raise Interrupted in the main thread, so the run ends like any
    other failure: hooks removed, finished batches committed, status interrupted. Yields a dict whose
    "armed" set to False holds later signals back (while the store closes)."""
    state = {"armed": True}
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(signum, frame):
        if state["armed"]:
            state["armed"] = False
            raise Interrupted(signum)
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)


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
    return {"output_dir": hc.runtime.output_dir, "choices": dict(hc.runtime.choices),  # overrides as typed, not
            "overrides": OmegaConf.to_container(hc.overrides.task), "threads": job_threads(hc)}  # resolved (${oc.env:})


def store_location(cfg, context: dict) -> Optional[Location]:
    """Where the store goes: store.path (a path, `~` expanded, or a URL with store.storage_options resolved), else
    <hydra output dir>/captures.zarr."""
    options = storage_options(cfg.store)
    if cfg.store.path:
        try:
            return Location(cfg.store.path, options, retry_s=cfg.store.retry_s)
        except (ValueError, ImportError, TypeError, RuntimeError) as err:  # unknown protocol, package missing, no ~
            raise ConfigError([f"store.path: {cfg.store.path!r} cannot be opened ({type(err).__name__}: {err}); give "
                               "a local path or a URL of an installed fsspec protocol (s3:// needs "
                               "pip install \"hookrun[s3]\")"]) from None
    if "output_dir" in context:
        return Location(Path(context["output_dir"]) / "captures.zarr")
    if cfg.inspect:
        return None
    raise ConfigError(["store.path: not set and no Hydra output dir; set store.path=... when running outside the CLI"])


def _stored(override: str) -> str:
    """A command-line override as the store keeps it: one of store.storage_options without its value."""
    key = override.split("=", 1)[0]
    return f"{key}=<not stored>" if key.lstrip("+~").startswith("store.storage_options") else override


def run(cfg):
    """Run one experiment from a composed config; returns the store's Path, or its URL for a remote store
    (None for inspect=true)."""
    context = hydra_context()
    if context.get("threads"):  # parallel sweep jobs on one machine split its cores
        torch.set_num_threads(context["threads"])
        log.info("%d torch threads: this machine's cores are shared by the sweep's parallel jobs", context["threads"])
    path = store_location(cfg, context)
    hook_specs, problems = check(cfg, path)
    model = None
    if not any(p.startswith(("model", "seed")) for p in problems):
        # building is not running: build the model to check the layers too, and report everything at once
        torch.manual_seed(cfg.seed)
        model = instantiate(cfg.model)
        problems += layer_problems(model, hook_specs)
    inputs = None
    if not any(p.startswith(("data", "seed")) for p in problems):
        try:
            inputs = make_inputs(cfg.data, cfg.seed)
            problems += inputs.check(model, cfg.model)
        except ConfigError as err:  # a corpus that cannot be read or tokenized
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    ranks = Ranks.from_env()  # check() refused variables it cannot read
    if ranks.parallel and inputs.batch_count() is None:
        raise ConfigError([f"data: a data-parallel run ({ranks.world} ranks) splits the batches by number, but the "
                           "dataset has no len(); give it __len__ and __getitem__, or run one process"])
    device = ranks.device(resolve_device(cfg.device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model.to(device)
    model.train(cfg.mode == "train")
    if cfg.inspect:
        batch = next(iter(inputs)).to(device)
        print(describe(model, batch.args, batch.kwargs))
        return None
    if cfg.store.mode == "resume" and is_complete(path):
        finish_close(path)  # what a close killed after marking the store complete left
        log.info("%s is complete: nothing to resume", path)
        return path.local or path.url
    plans = build_plans(model, hook_specs, device)
    loss_fn = losses.build(cfg.loss) if cfg.loss is not None else None
    problems = first_batch_problems(model, inputs, device, plans, loss_fn, cfg)  # before the store exists
    if problems:
        raise ConfigError(problems)

    config = resolved(cfg)
    if config["store"].get("storage_options"):  # credentials stay out of the store: only the option names are kept
        config["store"]["storage_options"] = {k: "<not stored>" for k in config["store"]["storage_options"]}
    attrs = {"config": config, "config_hash": config_hash(config), "choices": context.get("choices", {}),
             "overrides": [_stored(o) for o in context.get("overrides", [])], "versions": versions(),
             "device": str(device),
             "threads": torch.get_num_threads(),
             "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    ranks.start(device.type)
    share = _share(ranks, cfg, model, inputs, plans, loss_fn, device) if ranks.parallel else None
    jobs = max(1, cores() // context["threads"]) if context.get("threads") else 1
    writer = writer_mode(cfg.store.writer, device.type, path.local is not None, spare_core(jobs))
    if cfg.store.writer == "auto":
        log.info("store.writer=auto: %s", "writing in the hooks (sync): torch's threads take every core, and a "
                 "writer thread would slow the forward pass more than its own work" if writer == "sync" else
                 "writing on a thread beside the run")
    with signals_raise_interrupted() as signals:
        store = Store.open(path, cfg.store, attrs, writer, expected_samples=inputs.sample_count(),
                           expected_batches=inputs.batch_count(), on_nonfinite=cfg.on_nonfinite, share=share)
        if store.resumed or store.next_batch > (share.first_batch if share else 0):  # (killed before a commit: 0)
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
        progress = {"samples": 0, "batches": store.next_batch}
        try:
            _loop(cfg, model, inputs, plans, loss_fn, store, device, sink, timing, progress, started, submitted,
                  stop_batch=share.stop_batch if share else None)
            status = "complete"
        except Interrupted as stop:
            status = "interrupted"
            log.error("interrupted by %s after batch %d: finished batches are committed in %s (status interrupted); "
                      "continue with the same command plus store.mode=resume%s", stop, progress["batches"] - 1, path,
                      "" if cfg.store.path else f" store.path={path}")
            raise
        finally:
            signals["armed"] = False
            timing["loop_s"] = time.perf_counter() - started
            store.close(status, summary={"samples": progress["samples"], "timing": timing})
    ranks.stop()
    timing["wall_s"] = time.perf_counter() - started
    timing["write_s"] = store.write_seconds
    if store.rank != 0:
        log.info("rank %d of %d: batches %d..%d, %d samples in %.3f s; rank 0 finished the store %s", ranks.rank,
                 ranks.world, share.first_batch, share.stop_batch - 1, progress["samples"], timing["wall_s"], path)
        return path.local or path.url
    log.info("%s", summary.text(path, store.root.attrs["summary"]["arrays"], timing, progress["samples"],
                                store.writer))
    return path.local or path.url


def _share(ranks: Ranks, cfg, model, inputs, plans, loss_fn, device) -> Share:
    """This rank's batches, the samples, tokens and batches of the ranks before each rank (rows follow from
    them), and what the first batch captures (rank 0 probes it: every rank needs the calls per forward)."""
    ranges = inputs.ranges()
    first, stop = ranks.share(len(ranges))
    tokens = 0
    for batch in itertools.islice(inputs.batches(first), stop - first):  # stored tokens: text runs only
        if batch.table is None:
            break
        tokens += len(batch.table)
    counts = ranks.gather(tokens)
    sizes = [b - a for a, b in ranges]
    starts = [r * len(ranges) // ranks.world for r in range(ranks.world)]
    before = [{"sample": sum(sizes[:f]), "token": sum(counts[:r]), "batch": f} for r, f in enumerate(starts)]
    totals = {"sample": sum(sizes), "token": sum(counts), "batch": len(ranges)}
    probe = _probe(cfg, model, inputs, plans, loss_fn, device) if ranks.rank == 0 else {}
    calls = ranks.gather({k: c for k, (_, _, c) in probe.items()})[0]
    return Share(ranks.rank, ranks.world, ranks.gather, first, stop, before, totals, calls,
                 {k: (cap, host) for k, (cap, host, _) in probe.items()})


def _probe(cfg, model, inputs, plans, loss_fn, device) -> dict:
    """What the first batch captures, without keeping anything: array key -> (capture, host tensor, calls).
    The model's buffers (BatchNorm statistics) are put back, so the real first batch sees them unchanged."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    found: dict = {}

    def sink(capture):
        site = capture.site
        key = f"{site.hook}/{site.layer}/{site.role}"
        cap, host, calls = found.get(key, (capture, capture.tensor.detach().to("cpu", copy=True), 0))
        found[key] = (cap, host, max(calls, site.call + 1))
    with HookSet(model, plans, sink, has_loss=loss_fn is not None) as hookset, \
            torch.set_grad_enabled(loss_fn is not None):
        step(cfg.seed, 0, next(iter(inputs.batches(0))), model, hookset, loss_fn, plans, device, inputs.batched)
    model.load_state_dict(saved)
    model.zero_grad(set_to_none=True)
    return found


def _loop(cfg, model, inputs, plans, loss_fn, store, device, sink, timing, progress, started, submitted,
          stop_batch=None) -> None:
    """Every batch from the store's next one on (up to `stop_batch`, a rank's share): forward, loss,
    backward, hooks, the batch's record. A failing batch raises BatchError (or the hooks' or the store's own
    errors) naming the batch, its samples and what failed."""
    with HookSet(model, plans, sink, has_loss=loss_fn is not None) as hookset, \
            torch.set_grad_enabled(loss_fn is not None):
        total = inputs.batch_count() if stop_batch is None else stop_batch
        batches = inputs.batches(store.next_batch)
        if stop_batch is not None:
            batches = itertools.islice(batches, max(stop_batch - store.next_batch, 0))
        bar = tqdm(batches, desc="hookrun", unit="batch", total=total, initial=store.next_batch,
                   disable=None if store.rank == 0 else True, dynamic_ncols=True)
        row = store.committed_samples  # the first row of the next batch in every per-sample array (cap.samples.row)
        heap = HeapTrimmer()  # peak RSS flat in the run's length
        record = record_fields(cfg.data)
        for i, batch in numbered(bar, inputs, store.next_batch):
            size = batch.stop - batch.start
            try:
                table = sample_table(batch.fields, record, i, batch.start, batch.stop, row,
                                     strict=cfg.data.record is not None)
            except ConfigError as err:
                raise BatchError(f"batch {i} (samples {batch.start}..{batch.stop}): {'; '.join(err.problems)}") from err
            batch, loss, forward_s, backward_s = step(cfg.seed, i, batch, model, hookset, loss_fn, plans, device,
                                                      inputs.batched)
            timing["forward_s"] += forward_s
            timing["backward_s"] += backward_s
            store.end_batch({"batch": i, "sample_start": batch.start, "sample_stop": batch.stop,
                             "loss": float(loss.detach()) if loss is not None else float("nan"),
                             "forward_s": forward_s, "backward_s": backward_s},
                            tables={TABLE: table, **({"tokens": batch.table} if batch.table is not None else {})})
            heap.between_batches()
            row += size
            progress["samples"] += size
            progress["batches"] = i + 1
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(samples_s=f"{progress['samples'] / elapsed:.0f}",
                            MB_s=f"{submitted[0] / elapsed / 2**20:.1f}")
