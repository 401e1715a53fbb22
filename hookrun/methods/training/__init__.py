"""Dictionary training: the `train:` block trains one sparse autoencoder (or transcoder) per site, from a finished
store or from the model's own forwards, and writes each as a SAELens folder (docs/training.md).

    train: {sites: [blocks.1], kind: topk, width: 256, k: 8, steps: 2000, batch_size: 256, out: runs/sae}
    train: {from: runs/acts, hook: resid, sites: [blocks.1], kind: relu, width: 256, steps: 2000, out: runs/sae}
    cap.read("train")                    # the curves: a row per site and step (loss, mse, aux, l0, dead_fraction, lr)
    cap.read("train", "evaluations")     # a row per site and evaluation (l0, mse, explained_variance, ..., ce)

How a run goes: the run's data batches are run one by one, as any run's. The first `evaluate_batches` of them are held
out: never trained on, the dictionaries are evaluated on them (hookrun.methods.training.evaluate). Streamed (no
`from`), every later batch's site values go to a shuffle buffer and the dictionaries step as it fills (one forward
feeds every site); from a store, the training runs at the run's last batch, reading the store through the loader.
At the end each dictionary is written (hookrun.methods.training.output) and its final numbers are the run's
`train.*` columns of cap.samples (on the last batch's samples: hookrun.collect gives them, one row a job).
Checkpoints (`out/checkpoint.pt`, after each streamed batch, every checkpoint_every steps from a store) make a
killed run resume (store.mode=resume) bitwise as if it had not stopped; they are removed once the run's store is
complete (close). Under torchrun, from a store every rank takes its share of each minibatch; streamed, every rank
fills its own buffer from its own batches and the ranks step in lockstep (_parallel_call), and rank 0's final
checkpoint lets a rank killed as it finishes resume without the ranks that finished; rank 0 alone writes the folders
and curves.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from hookrun.capture.hooks import BatchInfo, forward
from hookrun.capture.scope import HookScope
from hookrun.capture.targets import attach, patterns_standard, resolve_sites
from hookrun.config.checks import ConfigError
from hookrun.methods import BatchResult, Method
from hookrun.methods.metrics import unhooked
from hookrun.methods.training.evaluate import HeldOut, rows_of
from hookrun.methods.training.kinds import TrainingDictionary, geometric_median
from hookrun.methods.training.output import MARKER, folder_problems, marker, write_folder, write_marker
from hookrun.methods.training.sources import ShuffleBuffer, StoreRows
from hookrun.methods.training.spec import TrainSpec, help_line, parse_block
from hookrun.methods.training.trainer import Schedule, Trainer, small
from hookrun.read.results.training import CURVES, EVALS
from hookrun.read.results.training import read as read_training
from hookrun.store import is_complete
from hookrun.store.index import Columns
from hookrun.threads import one_thread

log = logging.getLogger("hookrun")

CHECKPOINT = "checkpoint.pt"
FINAL_CHECKPOINT = "checkpoint.final.pt"   # streamed under torchrun: rank 0's, after every rank's last steps
FINAL = ("l0", "mse", "explained_variance", "fvu", "dead_features", "dense_features", "ce_loss_recovered", "steps")


def _store_of(spec: TrainSpec):
    from hookrun.read.captures import Captures

    return Captures(spec.source)


def _source_problems(spec: TrainSpec) -> List[str]:
    """A store that is not there or not finished, sites it does not hold, transcoder sites of other lengths."""
    try:
        cap = _store_of(spec)
    except (FileNotFoundError, KeyError, ValueError, OSError) as err:
        return [f"train.from: {spec.source!r} is not a hookrun store ({type(err).__name__}: {err}); give a run dir "
                "or .zarr a finished run wrote"]
    if cap.status != "complete":
        return [f"train.from: {spec.source!r} has status {cap.status}; train reads a finished store (finish it with "
                "store.mode=resume)"]
    problems = []
    for i, site in enumerate(spec.sites):
        counts = []
        for name in [site.input] + ([site.output] if site.output else []):
            try:
                key, records = cap.source(layer=name, role=spec.role, hook=spec.hook, what="train")
            except KeyError as err:
                problems.append(f"train.sites[{i}]: {name!r} (hook {spec.hook!r}) is not in {spec.source}: "
                                f"{str(err).strip(chr(34))}; name a stored site (and train.hook)")
                continue
            counts.append(records.stop - records.start if isinstance(records, slice) else len(records))
        if len(counts) == 2 and counts[0] != counts[1]:
            problems.append(f"train.sites[{i}]: a transcoder's sites need one row a token each; {site.input} has "
                            f"{counts[0]} rows and {site.output} {counts[1]} in {spec.source}: store both from one run")
        if counts and min(counts) < spec.batch_size:
            problems.append(f"train.batch_size: {spec.batch_size} is more than the {min(counts)} rows of "
                            f"{site.name} in {spec.source}; give at most {min(counts)}")
    return problems


def identity(spec: TrainSpec) -> str:
    """What a resume must find unchanged: the block's training keys and the store it reads (its config hash)."""
    body = spec.hashed()
    if spec.source is not None:
        try:
            body["from_store"] = _store_of(spec).attrs.get("config_hash")
        except Exception:  # noqa: BLE001 - refused by _source_problems already
            pass
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _out_problems(spec: TrainSpec, resume: bool) -> List[str]:
    problems = folder_problems("train.out", spec.out)
    for site in spec.sites if len(spec.sites) > 1 else ():
        problems += folder_problems("train.out", spec.out_path(site))
    if problems:
        return problems
    found = marker(Path(spec.out).expanduser())
    if resume and found is not None and found.get("identity") != identity(spec):
        return [f"train.out: {spec.out!r} holds a training started with other inputs or hyperparameters (its "
                f"{MARKER}: {found.get('identity')}, this run: {identity(spec)}); resume with the block it started "
                "with, or give another out (or store.mode=overwrite to start again)"]
    return []


class Train(Method):
    """The `train:` block (see the module's docstring)."""

    key = "train"
    annotation = Any
    default = None
    help = help_line()
    runs_batch = True
    stores_own = True   # its tables and columns are what the run stores: no hooks needed

    def __init__(self, cfg):
        super().__init__(cfg)
        self.parsed: Optional[TrainSpec] = None
        self.targets: list = []        # per site: (input Target, output Target or None)
        self.trainers: List[Trainer] = []
        self.buffer: Optional[ShuffleBuffer] = None
        self.held: Optional[HeldOut] = None
        self.recorded: Dict[int, torch.Tensor] = {}
        self.recording = False
        self.scope = HookScope()   # the recorders on the sites, for the whole run (removed in close)
        self.last_batch = 0
        self.curves: List[dict] = []
        self.evals: List[dict] = []
        self.final: Dict[str, float] = {}
        self.started = False
        self.resume = False
        self.rank, self.world = 0, 1
        # streamed under torchrun (see _parallel_call): this rank's served minibatches not yet stepped on, its
        # buffer's rows when it first filled (the dictionaries' b_dec and scale), the calls every rank syncs, the
        # calls a resume found done
        self.queue: List[torch.Tensor] = []
        self.first_rows: Optional[torch.Tensor] = None
        self.synced, self.done_calls = 0, 0
        self.widths: Optional[List[int]] = None   # each site's input (and output) width, once the trainers are made
        self.alone: Optional[dict] = None   # resumed after rank 0's final checkpoint: finished from it, no collective

    @classmethod
    def active(cls, cfg) -> bool:
        return getattr(cfg, "train", None) not in (None, {})

    @classmethod
    def check(cls, cfg) -> List[str]:
        if not cls.active(cfg):
            return []
        spec, problems = parse_block(cfg.train, getattr(cfg, "seed", 0))
        gen = getattr(cfg, "generate", None)
        if gen is not None and getattr(gen, "max_new_tokens", 0):
            problems.append("train: with generate; a training run runs each batch's forward itself: drop one")
        if spec is None:
            return problems
        if spec.source is not None:
            problems += _source_problems(spec)
        if spec.out is None:  # the run dir's sae/: checked in compile, where the run dir is known
            return problems
        return problems + _out_problems(spec, cfg.store.mode == "resume")

    # -- against the model -----------------------------------------------------------------------------------------
    def compile(self, job) -> None:
        spec, problems = parse_block(self.spec, job.cfg.seed)
        if spec is None:
            raise ConfigError(problems)
        self.resume = job.cfg.store.mode == "resume"
        if spec.out is None:
            local = job.path.local if job.path is not None else None
            if local is None:
                raise ConfigError(["train.out: null with a remote store; give a local folder for the SAELens "
                                   "folder (train.out=DIR)"])
            spec = dataclasses.replace(spec, out=str(Path(local).parent / "sae"))
            found = _out_problems(spec, self.resume)
            if found:
                raise ConfigError(found)
        self.parsed = spec
        batches = job.inputs.batch_count()
        if batches is None:
            raise ConfigError(["data: train needs a dataset of known length (the last batch ends the training)"])
        self.rank, self.world = (job.ranks.rank, job.ranks.world) if job.ranks.parallel else (0, 1)
        if self.world > 1:
            if spec.batch_size % self.world:
                raise ConfigError([f"train.batch_size: {spec.batch_size} does not split into {self.world} ranks; give "
                                   f"a multiple of {self.world} (each rank takes an equal share of every minibatch)"])
            if batches < self.world:
                raise ConfigError([f"data: {batches} batch(es) for {self.world} ranks; every rank needs one"])
            self.synced = min(b - a for a, b in (dataclasses.replace(job.ranks, rank=r).share(batches)
                                                 for r in range(self.world)))   # the calls every rank makes
        held = spec.evaluate_batches or 0
        if spec.source is None and batches <= held:
            raise ConfigError([f"train.evaluate_batches: {held} of the data's {batches} batches are held out, none is "
                               "left to train on; hold out fewer (or give more data)"])
        self.last_batch = batches - 1
        for i, site in enumerate(spec.sites):
            pair = []
            for name in [site.input] + ([site.output] if site.output else []):
                targets, found = resolve_sites(job.model, [name], spec.role if not _standard(name) else None,
                                               f"train.sites[{i}]")
                if found or len(targets) != 1:
                    problems += found or [f"train.sites[{i}]: {name!r} names {len(targets)} sites; give one"]
                    continue
                pair.append(targets[0])
            self.targets.append(tuple(pair) + (None,) * (2 - len(pair)))
        tokens = job.inputs.token_count() if spec.source is None else None
        if tokens is not None:
            held_tokens = sum(len(b.table) for b, _ in zip(job.inputs.batches(0), range(held))
                              if b.table is not None)
            need = spec.steps * spec.batch_size
            if tokens - held_tokens < need:
                problems.append(f"train.steps: {spec.steps} steps of {spec.batch_size} tokens need {need} tokens; the "
                                f"data gives {tokens - held_tokens} after the {held} held-out batch(es): give more data "
                                "or fewer steps")
        if problems:
            raise ConfigError(problems)
        self.held = HeldOut(job, spec, self.targets, held)

    def memory_need(self, job) -> List[tuple]:
        """The block's parts held at once (Method.memory_need): the shuffle buffer (train.buffer_tokens rows of
        every site side by side, twice while it is shuffled; from a store, the loader's buffer of as many rows), each dictionary's parameters with their gradients and
        Adam's two moments (train.width), and a minibatch's activations and their gradients (train.batch_size).
        Site widths: the store's arrays, else the module's (out_features, embedding_dim, normalized_shape) or the
        model's hidden size."""
        spec = self.parsed
        size = 8 if spec.dtype == "float64" else 4
        widths = [[self._site_width(job, site, t, j) for j, t in enumerate(pair) if t is not None]
                  for site, pair in zip(spec.sites, self.targets)]
        rows = sum(sum(w) for w in widths)
        params = sum(2 * spec.width * w[0] + spec.width + w[-1] + (w[0] * w[-1] if spec.skip else 0)
                     for w in widths)
        activations = sum(spec.batch_size * (4 * spec.width + 3 * sum(w)) for w in widths) * size
        held = spec.buffer_tokens if spec.source is not None else 2 * (spec.buffer_tokens // self.world)
        buffer = float(held) * rows * 4   # from a store: the loader's buffer; streamed: this rank's, shuffled
        return [(buffer, "train.buffer_tokens", f"the shuffle buffer's {spec.buffer_tokens} rows of {rows} values"),
                (4.0 * params * size, "train.width",
                 f"{len(widths)} dictionar{'y' if len(widths) == 1 else 'ies'} of width {spec.width}: parameters, "
                 "gradients and Adam's moments"),
                (float(activations), "train.batch_size",
                 f"a minibatch of {spec.batch_size} rows through width {spec.width} (lower train.width too)")]

    def _site_width(self, job, site, target, j: int) -> int:
        """A site's row width, as far as it is known before any forward (see memory_need)."""
        spec = self.parsed
        if spec.source is not None:
            try:
                return int(np.prod(StoreRows(_store_of(spec), [site.output if j else site.input], spec.hook,
                                             spec.role, spec.batch_size, spec.buffer_tokens, spec.seed).width()))
            except Exception:  # noqa: BLE001 - first_batch_problems names a store of another width
                pass
        module, side = target.module, getattr(target.point, "side", "output") if target.standard else "output"
        names = ("out_features", "embedding_dim", "num_features") if side == "output" else ("in_features",)
        for name in names + ("normalized_shape",):
            value = getattr(module, name, None)
            if isinstance(value, int):
                return value
            if isinstance(value, (tuple, list)) and value:
                return int(value[-1])
        config = getattr(job.model, "config", None)
        for name in ("hidden_size", "n_embd", "d_model"):
            if isinstance(getattr(config, name, None), int):
                return int(getattr(config, name))
        return 1024

    def first_batch_problems(self, job) -> List[str]:
        """The sites' widths (and a transcoder's token counts) on the first batch, against the store's arrays."""
        spec = self.parsed
        values = self.held.site_values(job, next(iter(job.inputs.batches(0))))
        problems = []
        first = next(iter(job.inputs.batches(0)))
        samples, held = job.inputs.sample_count(), spec.evaluate_batches or 0
        if spec.source is None and job.inputs.token_count() is None and samples and values:
            per_sample = len(values[0][0]) / max(first.stop - first.start, 1)
            held_samples = sum(b.stop - b.start for b, _ in zip(job.inputs.batches(0), range(held)))
            have, need = int(per_sample * (samples - held_samples)), spec.steps * spec.batch_size
            if have < need:
                problems.append(f"train.steps: {spec.steps} steps of {spec.batch_size} rows need {need} rows; the data "
                                f"gives about {have} after the {held} held-out batch(es): give more data or fewer "
                                "steps")
        for i, (site, rows) in enumerate(zip(spec.sites, values)):
            x, y = rows
            if y is not None and len(x) != len(y):
                problems.append(f"train.sites[{i}]: {site.input} gives {len(x)} rows and {site.output} {len(y)} on the "
                                "first batch; a transcoder needs one row a token at both sites")
            if spec.source is not None:
                stored = StoreRows(_store_of(spec), [site.input] + ([site.output] if site.output else []), spec.hook,
                                   spec.role, spec.batch_size, spec.buffer_tokens, spec.seed).width()
                width = int(np.prod(stored))
                if width != x.shape[-1]:
                    problems.append(f"train.sites[{i}]: {site.input} is {x.shape[-1]} wide in the model but its array "
                                    f"in {spec.source} is {width} wide; read the store of this model's site")
        return problems

    # -- per batch -------------------------------------------------------------------------------------------------
    def step(self, job, i: int, batch, hookset) -> BatchResult:
        spec = self.parsed
        batch = batch.to(job.device)
        streaming = spec.source is None
        if not self.started:
            self.started = True
            self._begin(job, i)
        held = spec.evaluate_batches or 0
        learn = streaming and i >= held
        last = job.share.stop_batch - 1 if job.share is not None else self.last_batch
        info = BatchInfo(i, batch.start, batch.stop, job.inputs.batched, batch.tokens, batch.fields)
        args, kwargs = hookset.begin_batch(info, batch.args, batch.kwargs)
        t0 = time.perf_counter()
        self.recorded.clear()
        self.recording = learn
        try:
            with torch.no_grad():
                forward(job.model, args, kwargs, job.plans)
        finally:
            self.recording = False
        forward_s = time.perf_counter() - t0
        hookset.end_batch()
        first = len(self.curves), len(self.evals)
        with unhooked(hookset):
            checkpointed = streaming and (self.world > 1 or (i != last and i >= held))
            if streaming and self.world > 1:
                self._parallel_call(job, i, batch, learn, last)   # checkpoints and finishes in step with the ranks
            else:
                if learn:
                    self._feed(job, batch)
                if i == last:
                    self._finish(job)
                elif checkpointed:
                    self._checkpoint(job, batch=i)
        size = batch.stop - batch.start
        columns = {name: np.full(size, self.final.get(name, np.nan) if i == last else np.nan)
                   for name in self.columns()}
        tables = {}
        if self.rank == 0 and len(self.curves) > first[0]:
            tables[CURVES] = _columns(self.curves[first[0]:])
        if self.rank == 0 and len(self.evals) > first[1]:
            tables[EVALS] = _columns(self.evals[first[1]:])
        self.curves, self.evals = [], []
        # a checkpoint of batch i is one batch ahead of the store at most: the store commits i before i + 1 runs
        return BatchResult(batch, None, forward_s, 0.0, columns=columns, tables=tables, commit=checkpointed)

    def _begin(self, job, i: int) -> None:
        """The recorders on the sites, the marker in `out`, and (a resumed streamed run) its checkpoint."""
        spec = self.parsed
        out = Path(spec.out).expanduser()
        if self.rank == 0:  # one writer of the folders, their marker and the checkpoints
                write_marker(out, {"written_by": "hookrun", "identity": identity(spec),
                                   "sites": [s.name for s in spec.sites]})
        if not self.resume:   # an earlier run's, left by a kill: never read as this run's
            self._remove_checkpoints()
        if spec.source is None:
            fns, targets = [], []
            for s, (a, b) in enumerate(self.targets):
                fns.append(self._recorder(2 * s))
                targets.append(a)
                if b is not None:
                    fns.append(self._recorder(2 * s + 1))
                    targets.append(b)
            attach(self.scope, job.model, targets, fns)
            if self.world > 1:  # each rank its own buffer of its share of the rows, its own shuffle
                self.buffer = ShuffleBuffer(spec.buffer_tokens // self.world, spec.batch_size // self.world,
                                            spec.seed + self.rank)
                self.alone = self._final_checkpoint() if self.resume else None
                if self.alone is not None:   # every rank took its last steps: some may have finished, none waits
                    return
                job.ranks.gather(None)   # rank 0 has made `out` before any rank writes its checkpoint there
                if self.resume:
                    self._parallel_restore(job, i)
                return
            self.buffer = ShuffleBuffer(spec.buffer_tokens, spec.batch_size, spec.seed)
            if i > 0 and self.resume:
                self._restore(job, batch=i - 1)

    def _recorder(self, slot: int):
        def record(value):
            if self.recording:
                self.recorded[slot] = value.detach()
            return value
        return record

    def _feed(self, job, batch, train: bool = True) -> None:
        """The batch's site rows into the buffer (every site's side by side), then the steps the buffer allows."""
        parts = []
        for s, (a, b) in enumerate(self.targets):
            parts.append(rows_of(self.recorded[2 * s], batch.tokens))
            if b is not None:
                parts.append(rows_of(self.recorded[2 * s + 1], batch.tokens))
        self.widths = [p.shape[-1] for p in parts]
        self.buffer.add(torch.cat([p.float() for p in parts], dim=-1))
        if train:
            self._train_from_buffer(job, drain=False)

    # -- streamed under torchrun -----------------------------------------------------------------------------------
    def _parallel_call(self, job, i: int, batch, learn: bool, last: int) -> None:
        """One batch of a streamed data-parallel run. Each rank feeds its own batches' rows to its own buffer
        (buffer_tokens / W rows, seed + rank) and queues the minibatches of batch_size / W rows it serves. On the
        calls every rank makes (the shortest share's count), the ranks agree on the steps all can make (the fewest
        queued) and take them together: step t's global minibatch is every rank's t-th served minibatch, in rank
        order; a rank's later batch feeds without waiting, and the drain at every rank's last batch then takes the
        steps left, up to the fewest any rank can make (the rest of the rows is dropped).

        Every rank checkpoints each call (its own file) and, on the calls every rank makes, waits until all have
        before committing it. At the last batch rank 0 writes the final checkpoint (the trainers after the last
        step, its rows) and every rank waits until it has, so a rank that committed its last batch proves it is
        there: resumed, a rank that finds it finishes from it with no collective (the finished ranks run no batch);
        one that does not finds every rank resuming, at the last call all ranks checkpointed (_parallel_restore)."""
        j = i - job.share.first_batch
        if self.alone is not None:
            if i == last:
                self._from_final(job)
                self._finish(job)
            return
        if j < self.done_calls:   # resumed: this batch's rows and steps are in the checkpoint already
            if j == self.done_calls - 1:   # checkpointed, then killed before its batch was committed: its rows
                self.curves, self.evals = self.pending
        else:
            if learn:
                self._feed(job, batch, train=False)
            self._serve(drain=False)
            if j < self.synced:
                self._sync(job)
            if j < self.synced or i != last:
                self.done_calls = j + 1
                self._save(job, {"mode": "stream-parallel", "batch": i, "calls": j + 1, **self._trained(),
                                 "buffer": self.buffer.state_dict(), "queue": list(self.queue),
                                 "first_rows": self.first_rows, "rows": (list(self.curves), list(self.evals))},
                           every_rank=True)
                if j < self.synced:
                    job.ranks.gather(None)   # every rank's checkpoint of this call written before any commits it
        if i != last:
            return
        self._serve(drain=True)
        self._sync(job)
        self._save(job, {"mode": "stream-final", "batch": i, **self._trained(),
                         "rows": (list(self.curves), list(self.evals))}, final=True)
        job.ranks.gather(None)   # rank 0's final checkpoint written before any rank commits its last batch
        self._finish(job)

    def _final_checkpoint(self) -> Optional[dict]:
        """Rank 0's final checkpoint of this training in `out` (every rank reads it), or None."""
        path = Path(self.parsed.out).expanduser() / FINAL_CHECKPOINT
        if not path.is_file():
            return None
        state = torch.load(path, weights_only=False)
        if state.get("identity") != identity(self.parsed) or state.get("mode") != "stream-final":
            return None
        return state

    def _from_final(self, job) -> None:
        """The trainers as the last step left them (the same on every rank), rank 0's rows of its last call."""
        state = self.alone
        self._load_trainers(job, state)
        if self.rank == 0:
            self.curves, self.evals = (list(rows) for rows in state["rows"])

    def _serve(self, drain: bool) -> None:
        """The minibatches this rank's buffer serves now into its queue (its rows kept when it first fills)."""
        buffer = self.buffer
        if self.first_rows is None and len(buffer) >= (buffer.batch_size if drain else buffer.capacity):
            self.first_rows = buffer.rows.clone()
        if self.trainers and self.trainers[0].n >= self.parsed.steps:
            self.queue.clear()
            return
        self.queue.extend(buffer.batches(drain=drain))

    def _sync(self, job) -> None:
        """With every rank: the dictionaries made (once every rank's buffer has filled: from all ranks' first rows,
        in rank order), then the steps every rank can make, each on this rank's next queued minibatch."""
        spec = self.parsed
        found = job.ranks.gather((self.first_rows is not None, len(self.queue)))
        if not self.trainers:
            if not all(full for full, _ in found):
                return
            self._make_trainers(job, self._split(torch.cat(job.ranks.gather(self.first_rows))))
        for _ in range(min(n for _, n in found)):
            if self.trainers[0].n >= spec.steps:
                break
            rows = self.queue.pop(0)
            self._step(job, [(x.to(job.device), None if y is None else y.to(job.device))
                             for x, y in self._split(rows)])

    def _parallel_restore(self, job, i: int) -> None:
        """A resumed streamed data-parallel run: every rank back at the last call all ranks checkpointed (a rank
        whose last checkpoint is one call later takes its previous one); the calls it holds are not run again."""
        path = self._checkpoint_path()
        mine = []
        for candidate in (path, path.with_suffix(".prev.pt")):
            if candidate.is_file():
                state = torch.load(candidate, weights_only=False)
                if state.get("identity") == identity(self.parsed) and state.get("mode") == "stream-parallel":
                    mine.append(state)
        calls = min(job.ranks.gather(max((s["calls"] for s in mine), default=0)))
        start = i - job.share.first_batch
        state = next((s for s in mine if s["calls"] == calls), None)
        if calls < start or (calls and state is None):
            raise ConfigError([f"train.out: rank {self.rank} resumes at batch {i} but the ranks' checkpoints in "
                               f"{self.parsed.out} end at call {calls} of its share; start again with "
                               "store.mode=overwrite"])
        if state is None:
            return
        self.buffer.load_state_dict(state["buffer"])
        self.queue, self.first_rows = list(state["queue"]), state["first_rows"]
        self.done_calls, self.pending = calls, state["rows"]
        self._load_trainers(job, state)

    def _split(self, rows: torch.Tensor):
        """Buffer rows cut back into each site's (x, y) (y: a transcoder's output rows, else None)."""
        widths, at, result = iter(self.widths), 0, []
        for s, (a, b) in enumerate(self.targets):
            w = next(widths)
            x = rows[:, at:at + w]
            at += w
            y = None
            if b is not None:
                w = next(widths)
                y = rows[:, at:at + w]
                at += w
            result.append((x, y))
        return result

    def _train_from_buffer(self, job, drain: bool) -> None:
        spec = self.parsed
        if not self.trainers:
            if len(self.buffer) < (spec.buffer_tokens if not drain else spec.batch_size):
                return
            self._make_trainers(job, self._split(self.buffer.rows))
        for rows in self.buffer.batches(drain=drain):
            if self.trainers[0].n >= spec.steps:
                return
            self._step(job, [(x.to(job.device), None if y is None else y.to(job.device))
                             for x, y in self._split(rows)])

    def _make_trainers(self, job, samples) -> None:
        """One trainer a site: the dictionary seeded, b_dec and the input scale from the first rows."""
        spec = self.parsed
        dtype = torch.float64 if spec.dtype == "float64" else torch.float32
        sched = Schedule(steps=spec.steps, lr=spec.lr, lr_warm_up_steps=spec.lr_warm_up_steps or 0,
                         lr_decay_steps=spec.lr_decay_steps or 0, lr_end=spec.lr_end, lr_scheduler=spec.lr_scheduler,
                         adam_beta1=spec.adam_beta1, adam_beta2=spec.adam_beta2,
                         coefficient=spec.l0_coefficient if spec.kind == "jumprelu" else spec.l1_coefficient,
                         coefficient_warm_up_steps=spec.l1_warm_up_steps or 0,
                         dead_feature_window=spec.dead_feature_window, clip_grad=spec.clip_grad,
                         decoder_norm=spec.decoder_norm)
        for s, (site, (x, y)) in enumerate(zip(spec.sites, samples)):
            x = x.double()
            target = (x if y is None else y.double())
            scale_in = scale_out = 1.0
            if spec.normalize_activations == "expected_average_only_in":
                scale_in = float(x.shape[-1] ** 0.5 / x.norm(dim=-1).mean())
                scale_out = scale_in if y is None else float(target.shape[-1] ** 0.5 / target.norm(dim=-1).mean())
            torch.manual_seed(spec.seed + s)
            d = TrainingDictionary(x.shape[-1], spec.width, spec.kind, k=spec.k,
                                   d_out=None if y is None else target.shape[-1], skip=spec.skip,
                                   transcoder=y is not None,
                                   rescale_acts_by_decoder_norm=spec.rescale_acts_by_decoder_norm,
                                   decoder_init_norm=spec.decoder_init_norm,
                                   jumprelu_init_threshold=spec.jumprelu_init_threshold,
                                   jumprelu_bandwidth=spec.jumprelu_bandwidth, aux_coefficient=spec.aux_coefficient,
                                   topk_threshold_lr=spec.topk_threshold_lr, dtype=dtype, device=job.device)
            with torch.no_grad():
                scaled = target * scale_out
                if spec.b_dec_init == "mean":
                    d.b_dec.copy_(scaled.mean(0))
                elif spec.b_dec_init == "geometric_median":
                    d.b_dec.copy_(geometric_median(scaled))
            self.trainers.append(Trainer(d, sched, scale_in, scale_out))

    def _step(self, job, rows) -> None:
        spec = self.parsed
        with one_thread(small(self.trainers[0], spec.batch_size)):
            for site, trainer, (x, y) in zip(spec.sites, self.trainers, rows):
                row = trainer.step(x.to(trainer.d.W_dec.dtype), None if y is None else y.to(trainer.d.W_dec.dtype))
                self.curves.append({"site": site.name, **row})
        n = self.trainers[0].n
        if spec.evaluate_every and n % spec.evaluate_every == 0 and n < spec.steps:
            self._evaluate(job)

    def _evaluate(self, job) -> List[dict]:
        spec = self.parsed
        found = self.held.evaluate(job, self.trainers) if self.held.batches else [{} for _ in self.trainers]
        rows = []
        for site, trainer, numbers in zip(spec.sites, self.trainers, found):
            row = {"site": site.name, "step": trainer.n, **numbers}
            rows.append(row)
            self.evals.append(row)
        return rows

    def _finish(self, job) -> None:
        """The last batch: the remaining steps (the buffer drained, or the whole training from the store), the final
        evaluation, the folders written."""
        spec = self.parsed
        if spec.source is None and self.world > 1:
            pass   # drained and synced in _parallel_call
        elif spec.source is None:
            self._train_from_buffer(job, drain=True)
        else:
            self._train_from_store(job)
        if not self.trainers:
            raise ConfigError([f"train.batch_size: the data gave fewer than {spec.batch_size} rows to train on; give "
                               "more data or a smaller batch_size"])
        if self.trainers[0].n < spec.steps:
            log.warning("train: the data ran out after %d of %d steps; the dictionaries are saved as they are",
                        self.trainers[0].n, spec.steps)
        rows = self._evaluate(job)
        for site, trainer, row in zip(spec.sites, self.trainers, rows):
            folder = Path(spec.out_path(site)).expanduser()
            suffix = "" if len(spec.sites) == 1 else f"@{site.name}"
            for name in FINAL:
                value = trainer.n if name == "steps" else row.get(name, np.nan)
                self.final[f"train.{name}{suffix}"] = float(value) if value is not None else np.nan
            if self.rank != 0:
                continue
            write_folder(trainer, folder, hook_name=site.input, hook_name_out=site.output,
                         meta={"hookrun_site": site.name, "hookrun_steps": trainer.n,
                               "hookrun_tokens": trainer.tokens})
            if len(spec.sites) > 1:
                write_marker(folder, {"written_by": "hookrun", "identity": identity(spec), "sites": [site.name]})
        if self.rank != 0:
            return
        log.info("train: %s written (%d steps)", ", ".join(spec.out_path(s) for s in spec.sites), self.trainers[0].n)

    def _train_from_store(self, job) -> None:
        spec = self.parsed
        cap = _store_of(spec)
        sources = [StoreRows(cap, [s.input] + ([s.output] if s.output else []), spec.hook, spec.role, spec.batch_size,
                             spec.buffer_tokens, spec.seed + i) for i, s in enumerate(spec.sites)]
        state = self._load(job) if self.resume else None
        if state is not None and state.get("mode") == "store":
            self._make_trainers(job, self._store_sample(spec, cap))
            for trainer, saved in zip(self.trainers, state["trainers"]):
                trainer.load_state_dict(saved)
            for src, saved in zip(sources, state["sources"]):
                src.load_state_dict(saved)
            self.curves, self.evals = state["curves"], state["evals"]
        else:
            self._make_trainers(job, self._store_sample(spec, cap))
        r, w = self.rank, self.world   # data-parallel: every rank takes every w-th row of the same minibatch
        try:
            while self.trainers[0].n < spec.steps:
                self._step(job, [(x[r::w].to(job.device), None if y is None else y[r::w].to(job.device))
                                 for x, y in (src.next() for src in sources)])
                if self.trainers[0].n % spec.checkpoint_every == 0 and self.trainers[0].n < spec.steps:
                    self._save(job, {"mode": "store", "trainers": [t.state_dict() for t in self.trainers],
                                     "sources": [s.state_dict() for s in sources], "curves": list(self.curves),
                                     "evals": list(self.evals)})
        finally:
            for src in sources:
                src.close()

    def _store_sample(self, spec, cap):
        """The first rows of each site (epoch 0's first buffer of batches), for b_dec and the scale."""
        samples = []
        n = max(1, min(spec.buffer_tokens // spec.batch_size, 32))
        for i, s in enumerate(spec.sites):
            src = StoreRows(cap, [s.input] + ([s.output] if s.output else []), spec.hook, spec.role, spec.batch_size,
                            spec.buffer_tokens, spec.seed + i)
            try:
                got = [src.next() for _ in range(min(n, max(1, src.records // spec.batch_size)))]
            finally:
                src.close()
            xs = torch.cat([x for x, _ in got])
            ys = None if got[0][1] is None else torch.cat([y for _, y in got])
            samples.append((xs, ys))
        return samples

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def _checkpoint(self, job, batch: int) -> None:
        self._save(job, {"mode": "stream", "batch": batch, **self._trained(), "buffer": self.buffer.state_dict()})

    def _trained(self) -> dict:
        """What a checkpoint holds of the dictionaries: the trainers' states (none before they are made), the widths."""
        return {"trainers": [t.state_dict() for t in self.trainers], "widths": self.widths}

    def _load_trainers(self, job, state: dict) -> None:
        """The trainers (and widths) of a checkpoint's state: made with its shapes, then every number replaced."""
        self.widths = state["widths"]
        if state["trainers"]:
            self._make_trainers(job, self._split(torch.zeros(1, sum(self.widths))))
            for trainer, saved in zip(self.trainers, state["trainers"]):
                trainer.load_state_dict(saved)

    def _checkpoint_path(self) -> Path:
        """out/checkpoint.pt; a streamed data-parallel run's rank R > 0: out/checkpoint.rank-R.pt (its own buffer)."""
        out = Path(self.parsed.out).expanduser()
        return out / (CHECKPOINT if self.rank == 0 else f"checkpoint.rank-{self.rank}.pt")

    def _save(self, job, state: dict, every_rank: bool = False, final: bool = False) -> None:
        """This rank's checkpoint (rank 0's only unless every_rank), the previous one kept as .prev.pt; final: rank
        0's out/checkpoint.final.pt."""
        if self.rank != 0 and not every_rank:
            return
        path = Path(self.parsed.out).expanduser() / FINAL_CHECKPOINT if final else self._checkpoint_path()
        state = {**state, "identity": identity(self.parsed)}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        if path.is_file() and not final:
            os.replace(path, path.with_suffix(".prev.pt"))
        os.replace(tmp, path)

    def _own_checkpoints(self) -> List[Path]:
        """The checkpoint files this rank writes (rank 0: the final one too), those there."""
        path = self._checkpoint_path()
        names = [path, path.with_suffix(".prev.pt"), path.with_suffix(".tmp")]
        if self.rank == 0:
            final = path.parent / FINAL_CHECKPOINT
            names += [final, final.with_suffix(".tmp")]
        return [p for p in names if p.is_file()]

    def _remove_checkpoints(self) -> None:
        for path in self._own_checkpoints():   # (the final one last: while it is there, a resume finishes from it)
            path.unlink()

    def _load(self, job, batch: Optional[int] = None) -> Optional[dict]:
        path = Path(self.parsed.out).expanduser() / CHECKPOINT
        for candidate in (path, path.with_suffix(".prev.pt")):
            if not candidate.is_file():
                continue
            state = torch.load(candidate, weights_only=False)
            if state.get("identity") != identity(self.parsed):
                continue
            if batch is None or state.get("batch") == batch:
                return state
        return None

    def _restore(self, job, batch: int) -> None:
        state = self._load(job, batch)
        if state is None:
            raise ConfigError([f"train.out: resuming at batch {batch + 1} but {self.parsed.out} holds no checkpoint of "
                               f"batch {batch}; start again with store.mode=overwrite"])
        self.buffer.load_state_dict(state["buffer"])
        self._load_trainers(job, state)

    def close(self, job) -> None:
        """The recorders off the model; once the run's store is complete (every rank's last batch committed: no
        resume can need them), this rank's checkpoints removed."""
        self.scope.remove()
        if self.parsed is None or job.path is None or not self._own_checkpoints():
            return
        if is_complete(job.path):
            self._remove_checkpoints()

    # -- what it writes --------------------------------------------------------------------------------------------
    def columns(self) -> List[str]:
        spec = self.parsed or parse_block(self.spec, getattr(self.cfg, "seed", 0))[0]
        if spec is None:
            return []
        suffixes = [""] if len(spec.sites) == 1 else [f"@{s.name}" for s in spec.sites]
        return [f"train.{name}{suffix}" for suffix in suffixes for name in FINAL]

    def attrs(self) -> dict:
        spec = self.parsed
        return {"train": {"sites": [s.name for s in spec.sites], "kind": spec.kind, "width": spec.width,
                          "out": [spec.out_path(s) for s in spec.sites], "source": spec.source}}

    @staticmethod
    def read(cap, what: str = "curves"):
        """cap.read("train"): the read side's reader (hookrun.read.results.training)."""
        return read_training(cap, what)


def _standard(name: str) -> bool:
    return patterns_standard([name])


def _columns(rows: List[dict]) -> Columns:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    ints = ("step", "tokens", "dead_features", "dense_features")
    return Columns({k: (np.array([r.get(k) for r in rows], dtype=object) if k == "site" else
                        np.array([r.get(k) for r in rows], dtype=np.int64) if k in ints else
                        np.array([np.nan if r.get(k) is None else r.get(k) for r in rows], dtype=np.float64))
                    for k in keys})
