"""Orchestration of one run: build it (hookrun.engine.build), open the store, loop over batches, close the store.

    from hookrun.engine.runner import run
    store_path = run(cfg)            # cfg: a composed hookrun config (see conf/config.yaml)
    store, stats = capture(job, attrs, writer)   # a built and prepared Run into its store; RunStats counts it

Under torchrun (or SLURM tasks) every rank runs this with its share of the batches (hookrun.engine.ranks);
rank 0 probes the first batch so every array can be made before any rank writes (hookrun.store.parallel); in a
generate run every rank first generates its batches to count the rows they store (hookrun.methods.generation.count_rows).
"""
from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from hookrun.capture.hooks import KINDS, BatchError
from hookrun.config.checks import ConfigError
from hookrun.config.parsing import parse
from hookrun.data.samples import TABLE, sample_columns
from hookrun.format.layout import COMPLETE, FAILED, INTERRUPTED, array_key
from hookrun.storage import Location
from hookrun.engine import summary
from hookrun.engine.build import Run, build
from hookrun.engine.heap import HeapTrimmer
from hookrun.engine.inspect import describe, describe_anatomy
from hookrun.engine.preflight import numbered
from hookrun.engine.progress import Progress
from hookrun.store import Store, finish_close, is_complete
from hookrun.store.parallel import Share
from hookrun.store.index import Columns
from hookrun.store.spec import MEMORY, MEMORY_ROOT, storage_options

log = logging.getLogger("hookrun")


class Interrupted(BaseException):
    """The run was stopped by SIGTERM (a scheduler's notice) or SIGINT (Ctrl-C); exit code 128 + signal."""

    def __init__(self, signum: int):
        self.signum = signum
        self.store = None  # the store the run was writing (set once it is closed), for hookrun.run's message
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


def store_location(cfg, context: dict) -> Optional[Location]:
    """Where the store goes: store.path (a path, `~` expanded, or a URL with store.storage_options resolved; `memory`:
    a fresh memory:// store of this process), else <hydra output dir>/captures.zarr."""
    options = storage_options(cfg.store)
    if cfg.store.path == MEMORY:  # a fresh name each run: no other run's store is ever reused
        return Location(f"{MEMORY_ROOT}{uuid.uuid4().hex}/captures.zarr")
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


@dataclass
class RunStats:
    """What one process's run counted and timed: the progress bar's rates, the store's summary attrs (timing) and
    the summary logged at the end."""

    batches: int  # the next batch: the last one finished + 1 (where a resume would start)
    samples: int = 0  # samples run by this process
    tokens: int = 0  # tokens stored one row each (text runs)
    samples_before: int = 0  # samples the store held already (a resume)
    captures: int = 0  # captures handed to the store (each one an index row)
    captured_bytes: int = 0  # their bytes
    forward_s: float = 0.0
    backward_s: float = 0.0
    capture_s: float = 0.0  # in the hooks' sink: copying captures off the device, queueing (or writing) them
    methods_s: Dict[str, float] = field(default_factory=dict)  # each method's own passes (its measure), by key
    loop_s: float = 0.0
    loop_cpu_s: float = 0.0  # the process's CPU seconds in the loop (time.process_time: every thread's)
    wall_s: float = 0.0  # with the close, and the ranks' end
    write_s: float = 0.0  # the writer's busy time
    started: float = field(default_factory=time.perf_counter)
    started_cpu: float = field(default_factory=time.process_time)
    launched: Optional[float] = None  # time.time() the command started (python -m hookrun), for the start-up time
    startup_s: Optional[float] = None  # from the launch to the first batch's start: imports, config, building

    def timing(self, closed: bool = False) -> dict:
        """Seconds by stage: the loop's (the store's summary attrs), and `closed`, the wall and writer times too."""
        loop = {"forward_s": self.forward_s, "backward_s": self.backward_s, "capture_s": self.capture_s,
                "loop_s": self.loop_s, "loop_cpu_s": self.loop_cpu_s,
                **({"methods_s": dict(self.methods_s)} if self.methods_s else {}),
                **({"startup_s": self.startup_s} if self.startup_s is not None else {})}
        return {**loop, "wall_s": self.wall_s, "write_s": self.write_s} if closed else loop



def run(cfg, launched: Optional[float] = None, context: Optional[dict] = None, model=None, tokenizer=None):
    """Run one experiment from a parsed config (hookrun.config.parsing.parse; a composed one is parsed here);
    returns the store's Path, or its URL for a remote store (None for inspect=true). `launched`: time.time() the
    command started (default: now), for the start-up time; `context`: the Hydra job's output dir, choices,
    overrides and threads (the entry point's hydra_context; none outside Hydra); `model`, `tokenizer`: already
    loaded, used in place of cfg.model and where data.text.tokenizer is not given (hookrun.run)."""
    launched = time.time() if launched is None else launched
    parsed = parse(cfg, tuple(KINDS))
    cfg = parsed.config
    context = context or {}
    if context.get("threads"):  # parallel sweep jobs on one machine split its cores
        torch.set_num_threads(context["threads"])
        log.info("%d torch threads: this machine's cores are shared by the sweep's parallel jobs", context["threads"])
    path = store_location(cfg, context)
    job = build(parsed, path, context, model, tokenizer)
    try:
        return _run_built(job, launched)
    finally:
        job.close()


def _run_built(job: Run, launched: float):
    """The run of a built job (see run)."""
    cfg, path = job.cfg, job.path
    if cfg.inspect:
        batch = next(iter(job.inputs)).to(job.device)
        print(describe(job.model, batch.args, batch.kwargs))
        tokens = getattr(batch, "tokens", None)
        print("\n" + describe_anatomy(job.model, batch.args, batch.kwargs,
                                      tuple(tokens.mask.shape) if tokens is not None else None))
        return None
    if cfg.store.mode == "resume" and is_complete(path):
        finish_close(path)  # what a close killed after marking the store complete left
        log.info("%s is complete: nothing to resume", path)
        return job.where
    job.prepare()  # the hooks, the loss and the first batch checked: before the store exists
    attrs = job.attrs()
    job.ranks.start(job.device.type)
    job.share = _share(job) if job.ranks.parallel else None
    store, stats = capture(job, attrs, job.writer_mode(), launched)
    job.ranks.stop()
    stats.wall_s = time.perf_counter() - stats.started
    stats.write_s = store.write_seconds
    _report(job, store, stats)
    return job.where


def capture(job: Run, attrs: dict, writer: str, launched: Optional[float] = None) -> Tuple[Store, RunStats]:
    """Open the store (root `attrs`, `writer` thread or sync), run every batch of this process with the hooks
    writing into it, and close it (complete, interrupted or failed); returns the closed store and the counts.
    `launched`: time.time() the command started, for the start-up time in the summary."""
    cfg, share = job.cfg, job.share
    with signals_raise_interrupted() as signals:
        store = Store.open(job.path, cfg.store, attrs, writer, expected_samples=job.inputs.sample_count(),
                           expected_batches=job.inputs.batch_count(), expected_tokens=job.inputs.token_count(),
                           on_nonfinite=cfg.on_nonfinite, share=share)
        if store.resumed or store.next_batch > (share.first_batch if share else 0):  # (killed before a commit: 0)
            log.info("resuming %s after its last committed batch: starting at batch %d", job.path, store.next_batch)
        stats = RunStats(batches=store.next_batch, samples_before=0 if share else store.committed_samples,
                         launched=launched)
        status, stopped_by = FAILED, None
        try:
            _loop(job, store, stats)
            status = COMPLETE
        except Interrupted as stop:
            status, stopped_by = INTERRUPTED, stop
            stop.store = job.where
            raise
        finally:
            signals["armed"] = False
            stats.loop_s = time.perf_counter() - stats.started
            stats.loop_cpu_s = time.process_time() - stats.started_cpu
            store.close(status, summary={"samples": stats.samples, "timing": stats.timing()})
            if stopped_by is not None:  # after the close: the last batch it committed is where a resume goes on
                last = store.index.last_batch if store.index.last_batch is not None else store.next_batch - 1
                log.error("interrupted by %s after batch %d: finished batches are committed in %s (status "
                          "interrupted); continue with the same command plus store.mode=resume%s", stopped_by, last,
                          job.path, "" if cfg.store.path else f" store.path={job.path}")
    return store, stats


def _report(job: Run, store: Store, stats: RunStats) -> None:
    """The end of the run in the log: the summary (rank 0), or this rank's share of it."""
    if not log.isEnabledFor(logging.INFO):  # (the summary's text costs ~5 ms: not made for a quiet logger)
        return
    if store.rank != 0:
        share = job.share
        log.info("rank %d of %d: batches %d..%d, %d samples in %.3f s; rank 0 finished the store %s", job.ranks.rank,
                 job.ranks.world, share.first_batch, share.stop_batch - 1, stats.samples, stats.wall_s, job.path)
        return
    total = job.share.totals["sample"] if job.share else stats.samples_before + stats.samples
    samples = total if total == stats.samples else (
        f"{total} samples in the store ({stats.samples} run by rank 0 of {job.ranks.world})" if job.share else
        f"{total} samples in the store ({stats.samples} run now, {stats.samples_before} before the resume)")
    log.info("%s", summary.text(job.path, store.summary["arrays"], stats.timing(closed=True),
                                samples, store.writer))


def _share(job: Run) -> Share:
    """This rank's batches, the samples, tokens and batches of the ranks before each rank (rows follow from
    them), and what the first batch captures (rank 0 probes it: every rank needs the calls per forward)."""
    inputs, ranks = job.inputs, job.ranks
    ranges = inputs.ranges()
    first, stop = ranks.share(len(ranges))
    if job.runner is not None:  # stored tokens follow from the generated ones: generate to count them
        probe, tokens = _generated_share(job, first, stop)
    else:
        probe, tokens = _probe(job) if ranks.rank == 0 else {}, _prompt_tokens(job, first, stop)
    counts = ranks.gather(tokens)
    sizes = [b - a for a, b in ranges]
    starts = [r * len(ranges) // ranks.world for r in range(ranks.world)]
    before = [{"sample": sum(sizes[:f]), "token": sum(counts[:r]), "batch": f} for r, f in enumerate(starts)]
    totals = {"sample": sum(sizes), "token": sum(counts), "batch": len(ranges)}
    calls = ranks.gather({k: c for k, (_, _, c) in probe.items()})[0]
    return Share(ranks.rank, ranks.world, ranks.gather, first, stop, before, totals, calls,
                 {k: (piece, host) for k, (piece, host, _) in probe.items()})


def _prompt_tokens(job: Run, first: int, stop: int) -> int:
    """The stored tokens of this rank's batches [first, stop) (0 for a run without text)."""
    tokens = 0
    for batch in itertools.islice(job.inputs.batches(first), stop - first):
        if batch.table is None:
            break
        tokens += len(batch.table)
    return tokens


def _generated_share(job: Run, first: int, stop: int) -> Tuple[dict, int]:
    """A generate run's (probe, stored tokens of this rank): its batches generated once before the run to count
    their rows (hookrun.methods.generation.count_rows), rank 0's probing its captures; nothing to count without arrays."""
    if not any(plan.capture for plan in job.plans):
        return {}, 0
    found: dict = {}
    with _kept(job.model):
        sink = _prober(found) if job.ranks.rank == 0 else (lambda capture: None)
        if job.ranks.rank == 0 and first == stop:  # more ranks than batches: rank 0 probes batch 0 all the same
            job.runner.count_rows(job, 0, 1, sink)
        return found, job.runner.count_rows(job, first, stop, sink)


def _prober(found: dict):
    """A sink recording what each array holds: array key -> (first capture, its host tensor, calls per forward)."""
    def sink(capture):
        site = capture.site
        key = array_key(site.hook, site.layer, site.role)
        piece, host, calls = found.get(key, (capture, capture.tensor.detach().to("cpu", copy=True), 0))
        found[key] = (piece, host, max(calls, site.call + 1))
    return sink


@contextmanager
def _kept(model):
    """The model's state (BatchNorm statistics) put back after what runs inside, its gradients cleared."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)


def _probe(job: Run) -> dict:
    """What the first batch captures, without keeping anything: array key -> (capture, host tensor, calls).
    The model's buffers (BatchNorm statistics) are put back, so the real first batch sees them unchanged."""
    found: dict = {}
    with _kept(job.model), job.hooked(_prober(found)) as hookset:
        job.step(0, next(iter(job.inputs.batches(0))), hookset)
    return found


def _loop(job: Run, store: Store, stats: RunStats) -> None:
    """Every batch of this process from the store's next one on: forward, loss, backward, hooks, the batch's
    record. A failing batch raises BatchError (or the hooks' or the store's own errors) naming the batch, its
    samples and what failed."""
    def sink(capture):
        t0 = time.perf_counter()
        stats.captures += 1
        stats.captured_bytes += capture.tensor.numel() * capture.tensor.element_size()
        store.submit(capture)
        stats.capture_s += time.perf_counter() - t0
    with job.hooked(sink) as hookset:
        bar = _progress(job, store)
        row = store.committed_samples  # the first row of the next batch in every per-sample array (cap.samples.row)
        heap = HeapTrimmer()  # peak RSS flat in the run's length
        record = job.record
        for i, batch in numbered(bar, job.inputs, store.next_batch):
            if stats.startup_s is None and stats.launched is not None:
                stats.startup_s = time.time() - stats.launched
            table = _sample_table(job, record, i, batch, row)
            done = job.step(i, batch, hookset)
            batch, loss = done.batch, done.loss
            stats.forward_s += done.forward_s
            stats.backward_s += done.backward_s
            for key, spent in done.methods_s.items():
                stats.methods_s[key] = stats.methods_s.get(key, 0.0) + spent
            store.end_batch({"batch": i, "sample_start": batch.start, "sample_stop": batch.stop,
                             "loss": float(loss.detach()) if loss is not None else float("nan"),
                             "forward_s": done.forward_s, "backward_s": done.backward_s},
                            tables={TABLE: Columns({**table, **done.columns}),
                                    **({"tokens": batch.table} if batch.table is not None else {}), **done.tables},
                            commit=done.commit)
            heap.between_batches()
            row += batch.stop - batch.start
            stats.samples += batch.stop - batch.start
            stats.batches = i + 1
            stats.tokens += len(batch.table) if batch.table is not None else 0
            bar.update(stats.batches, stats.samples, stats.tokens, stats.captured_bytes, stats.methods_s)
        bar.close()


def _progress(job: Run, store: Store) -> Progress:
    """This process's batches from the store's next one on, behind a progress bar or log lines (rank 0's)."""
    stop = job.share.stop_batch if job.share else None
    batches = job.inputs.batches(store.next_batch)
    if stop is not None:
        batches = itertools.islice(batches, max(stop - store.next_batch, 0))
    return Progress(batches, job.inputs.batch_count() if stop is None else stop, store.next_batch,
                    job.cfg.progress_s, show=store.rank == 0)


def _sample_table(job: Run, record, i: int, batch, row: int):
    """Batch i's columns of the samples table (data.record), the first row `row`; a BatchError naming the batch."""
    try:
        return sample_columns(batch.fields, record, i, batch.start, batch.stop, row,
                            strict=job.cfg.data.record is not None)
    except ConfigError as err:
        raise BatchError(f"batch {i} (samples {batch.start}..{batch.stop}): {'; '.join(err.problems)}") from err
