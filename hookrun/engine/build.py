"""What one run is made of, built from its checked config: the model on its device, the batches, the hooks'
plans, the loss, this process's place among the ranks, and where it writes.

    job = build(cfg, path, context)    # check, build the model and the inputs: ConfigError names every problem
    job.prepare()                      # the hooks' plans, the loss, the first batch checked against them
    with job.hooked(sink) as hookset:  # the hooks registered, gradients on where a loss is computed
        result = job.step(i, batch, hookset)   # a BatchResult (engine.preflight.step, or a method's own step)

Building is not running: the config is checked first (every problem that needs no model, at once, before the
model is built), then the model is built to check the layers, and the inputs against the model, before anything is
written.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import torch
from hydra.utils import instantiate

from hookrun.capture.anatomy import AnatomyError, anatomy, before_load, is_standard
from hookrun.capture.hooks import KINDS, HookSet, build_plans, layer_problems
from hookrun.capture.layers import parameter_names, resolve
from hookrun.config.checks import ConfigError, as_list
from hookrun.config.parsing import MODEL_MISSING, Parsed, parse
from hookrun.data import make_inputs
from hookrun.data.inputs import missing_module
from hookrun.data.samples import record_fields
from hookrun.data.text import TOKENIZER_MISSING
from hookrun.format.layout import INPUTS, INPUTS_RULE, METRIC_COLUMNS
from hookrun.methods import memory_problems
from hookrun.storage import Location
from hookrun.engine import losses
from hookrun.engine.checks import check
from hookrun.engine.fingerprint import RULE, fingerprints
from hookrun.engine.cores import cores, spare_core
from hookrun.engine.placement import device_map_problems, dispatched, input_device, offload_note, \
    offloaded_parameters, with_plain_maps
from hookrun.engine.preflight import first_batch_problems, step
from hookrun.engine.ranks import Ranks
from hookrun.store import versions, writer_mode
from hookrun.store.parallel import Share

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


def _stored(override: str) -> str:
    """A command-line override as the store keeps it: one of store.storage_options without its value."""
    key = override.split("=", 1)[0]
    return f"{key}=<not stored>" if key.lstrip("+~").startswith("store.storage_options") else override


@dataclass
class Run:
    """What was built for one run: its config, where it writes, the model on its device, the inputs, the hooks'
    plans and the loss (prepare), and this process's rank (with its share of the batches, in a data-parallel run)."""

    cfg: object  # the typed, frozen config (Parsed.config)
    path: Optional[Location]  # None: inspect=true outside Hydra
    context: dict  # the Hydra job's output dir, choices, overrides, threads (__main__.hydra_context); model_given
    # (hookrun.run(model=...)): the class of the model passed in, kept in the store's attrs
    specs: dict  # typed hooks (hookrun.engine.checks)
    model: torch.nn.Module
    inputs: object  # hookrun.data.inputs.Inputs
    ranks: Ranks
    device: torch.device
    config_hash: str  # the config's hash (Parsed.config_hash: made once a run, by the parse), the store's
    plans: List = field(default_factory=list)  # prepare(): hookrun.capture.hooks.HookPlan per hook
    loss_fn: Optional[Callable] = None  # prepare(): fn(output, batch) -> scalar, or None
    share: Optional[Share] = None  # a data-parallel run: this rank's batches and rows
    resolved: dict = field(default_factory=dict)  # the config as the store keeps it (Parsed.resolved)
    methods: List = field(default_factory=list)  # the run's methods (hookrun.methods.Method), in the registry's order
    found: Optional[dict] = None  # prepare(): the inputs' digests (hookrun.engine.fingerprint), for the attrs

    @functools.cached_property
    def record(self) -> List[str]:
        """The per-sample fields kept in cap.samples (hookrun.data.samples.record_fields), read once a run."""
        return record_fields(self.cfg.data)

    def method(self, key: str):
        """The run's method of config key `key` (KeyError if the run does not use it)."""
        found = next((m for m in self.methods if m.key == key), None)
        if found is None:
            raise KeyError(f"this run has no {key!r} block")
        return found

    @property
    def runner(self):
        """The method that runs each batch itself (generation), or None: one forward (and backward) a batch."""
        return next((m for m in self.methods if m.runs_batch), None)

    def step(self, i: int, batch, hookset):
        """Batch `i` run with the hooks of `hookset`: a BatchResult (hookrun.engine.preflight.step, or the method
        that runs batches)."""
        runner = self.runner
        return runner.step(self, i, batch, hookset) if runner is not None else step(self, i, batch, hookset)

    def close(self) -> None:
        """The end of the run, also on an error: each method removes what it left on the model."""
        for method in self.methods:
            method.close(self)

    @property
    def where(self):
        """What run() returns: the store's Path, or its URL for a remote store."""
        return self.path.local or self.path.url

    def prepare(self) -> None:
        """The hooks resolved on the model, the loss, and the first batch checked against them, before the store
        exists (a ConfigError naming every problem)."""
        self.plans = build_plans(self.model, self.specs, self.inputs)
        self.loss_fn = losses.build(self.cfg.loss) if self.cfg.loss is not None else None
        for method in self.methods:
            method.compile(self)
        problems = memory_problems(self.methods, self)  # before the first batch: a figure, not the allocator
        if problems:
            raise ConfigError(problems)
        config = self.stored_config()
        started = time.perf_counter()
        self.found = fingerprints(config, self.model, self.inputs.tokenizer_digest)
        log.debug("fingerprints of the inputs: %.3f s", time.perf_counter() - started)
        problems = first_batch_problems(self, same=(self.config_hash, json.dumps(self.found, sort_keys=True),
                                                    str(self.device)))
        for method in self.methods:
            problems = problems or method.first_batch_problems(self)
        if problems:
            raise ConfigError(problems)

    @contextmanager
    def hooked(self, sink, observe: bool = False):
        """The hooks registered with `sink` (a HookSet), and gradients on where a loss is computed."""
        with HookSet(self.model, self.plans, sink, has_loss=self.loss_fn is not None, observe=observe) as hookset, \
                torch.set_grad_enabled(self.loss_fn is not None):
            yield hookset

    def writer_mode(self) -> str:
        """thread or sync: store.writer, with auto decided here, once (hookrun.store.spec.writer_mode)."""
        threads = self.context.get("threads")
        jobs = max(1, cores() // threads) if threads else 1  # parallel sweep jobs on one machine split its cores
        mode = writer_mode(self.cfg.store.writer, self.device.type, self.path.local is not None, spare_core(jobs))
        if self.cfg.store.writer == "auto":
            log.debug("store.writer=auto: %s", "writing in the hooks (sync): torch's threads take every core, and a "
                      "writer thread would slow the forward pass more than its own work" if mode == "sync" else
                      "writing on a thread beside the run")
        return mode

    def stored_config(self) -> dict:
        """The resolved config as the store keeps it (without storage option values)."""
        config = json.loads(json.dumps(self.resolved))
        if config["store"].get("storage_options"):  # credentials stay out of the store: only the option names
            config["store"]["storage_options"] = {k: "<not stored>" for k in config["store"]["storage_options"]}
        return config

    def attrs(self) -> dict:
        """The store's root attrs for this run: the resolved config (without storage option values), its hash, the
        Hydra choices and overrides, package versions, device, threads and start time."""
        config = self.stored_config()
        return {"config": config, "config_hash": self.config_hash, "choices": self.context.get("choices", {}),
                "overrides": [_stored(o) for o in self.context.get("overrides", [])], "versions": versions(),
                "device": str(self.device),
                "threads": torch.get_num_threads(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S"), **self.method_attrs(), **self.input_attrs(),
                **({"model_given": self.context["model_given"]} if "model_given" in self.context else {})}

    def input_attrs(self) -> dict:
        """What the store is made from (hookrun.engine.fingerprint, taken by prepare): the inputs' digests and the
        rule that made them; a resume from other inputs is refused (hookrun.store.place.check_path)."""
        return {INPUTS: self.found, INPUTS_RULE: RULE}

    def method_attrs(self) -> dict:
        """The root attrs of the run's methods, and the cap.samples columns that hold their numbers."""
        attrs = {k: v for method in self.methods for k, v in method.attrs().items()}
        columns = [c for method in self.methods for c in method.columns()]
        return {METRIC_COLUMNS: columns, **attrs} if columns else attrs


def _model(node) -> torch.nn.Module:
    """The model its config names; a package it needs that is not installed is a ConfigError with the install line
    (other failures of the user's code stay run failures, with their traceback under HYDRA_FULL_ERROR=1)."""
    if isinstance(node, dict) and "anatomy" in node:  # hookrun's, not the constructor's
        node = {k: v for k, v in node.items() if k != "anatomy"}
    try:
        return instantiate(with_plain_maps(node))
    except Exception as err:  # noqa: BLE001 - Hydra's InstantiationException wraps the target's own error
        cause = err.__cause__ or err
        if isinstance(cause, ModuleNotFoundError):
            raise ConfigError([missing_module("model", node.get("_target_"), cause)]) from err
        if isinstance(cause, ConfigError):  # the target's own refusal of its arguments (model=hf's model.path)
            raise ConfigError(cause.problems) from None
        raise


def _anatomy_problems(model: torch.nn.Module, model_cfg) -> list:
    """The declared anatomy (`model.anatomy`) found and proved once, remembered for the model (every method's
    anatomy(model) gets it); one that does not fit the model is a problem. Without one, the anatomy (a table's or
    inferred, with its check's tiny forward) is found where a standard site name is first used, before any hook."""
    spec = model_cfg.get("anatomy") if isinstance(model_cfg, dict) else None
    if not spec:
        return []
    try:
        anatomy(model, spec)
    except AnatomyError as err:
        return [str(err)] if spec else []
    return []


def _standard_names_used(node) -> bool:
    """Whether a config names a standard site (blocks.*, embed, ...) under any `layers` key."""
    if isinstance(node, dict):
        return any(_standard_names_used(v) if k != "layers" else
                   any(isinstance(p, str) and is_standard(p) for p in as_list(v)) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        return any(_standard_names_used(v) for v in node)
    return False


def _anatomy_before_load(node, resolved: dict) -> Optional[str]:
    """The anatomy's refusal from a Hugging Face folder's config.json (model.path) before its weights load, where the
    run (`resolved`: its config as the store keeps it) names standard sites and the config alone shows hookrun
    cannot find the parts; None otherwise."""
    if not isinstance(node, dict) or not isinstance(node.get("path"), str) or node.get("anatomy"):
        return None
    folder = Path(node["path"]).expanduser()
    if not (folder / "config.json").is_file():
        return None
    used = _standard_names_used({k: v for k, v in resolved.items() if k != "model"})
    return before_load(str(folder)) if used else None


def _offload_problems(model: torch.nn.Module, specs) -> list:
    """param_grad hooks on parameters a device map offloaded (kept on "meta" between forwards: no gradient)."""
    if not dispatched(model):
        return []
    problems = []
    for name, h in specs.items():
        if h.kind == "param_grad":
            off = offloaded_parameters(model, resolve(h.layers, parameter_names(model), "parameter", "")[0])
            if off:
                problems.append(f"hooks.{name}.layers: {', '.join(off[:3])}{' ...' if len(off) > 3 else ''} "
                                "are offloaded by model.device_map (loaded onto a device only during their forward), "
                                "so no gradient accumulates in them; hook parameters of layers the map keeps on a "
                                "device, or give them more max_memory")
    return problems


def build(parsed: Parsed, path: Optional[Location], context: dict, model: Optional[torch.nn.Module] = None,
          tokenizer=None) -> Run:
    """Check the config, build the model (checking its layers) and the inputs (checking them against the model),
    and put the model on this rank's device; a ConfigError names every problem found (a composed config is parsed
    here). `model`: a model already loaded (hookrun.run(model=...)), used in place of cfg.model (then null);
    `tokenizer`: its tokenizer, used where data.text.tokenizer is not given. The problems that need no model are
    raised before the model is built (a config mistake costs seconds, whatever the model's size), and so are those
    of the data (made before the model: roles, token lengths, Method.data_problems); those against the model after
    it, together."""
    if not isinstance(parsed, Parsed):  # the runner passes its parse along
        parsed = parse(parsed, tuple(KINDS))
    cfg = parsed.config
    checked = check(parsed, path)
    given = [MODEL_MISSING] * (model is not None) + [TOKENIZER_MISSING] * (tokenizer is not None)
    checked.found = [(section, p) for section, p in checked.found if p not in given]
    problems = checked.problems + device_map_problems(cfg.model)  # a map naming devices this machine lacks
    if problems:  # what needs no model is refused before it is built: seconds, whatever its size
        raise ConfigError(problems)
    if model is None:  # an architecture whose config.json alone shows it has no anatomy: before the weights load
        early = _anatomy_before_load(cfg.model, parsed.resolved)
        if early:
            raise ConfigError([early])
    used = checked.methods
    try:  # the data before the model: the tokenizer is cheap, the model is not
        inputs = make_inputs(cfg.data, cfg.seed, tokenizer)
    except ConfigError as err:  # a corpus that cannot be read or tokenized
        raise ConfigError(err.problems) from None
    problems = inputs.check(None, cfg.model) + [p for method in used for p in method.data_problems(inputs)]
    if problems:
        raise ConfigError(problems)
    torch.manual_seed(cfg.seed)
    model = _model(cfg.model) if model is None else model
    problems += _anatomy_problems(model, cfg.model)
    problems += layer_problems(model, checked.specs)
    problems += _offload_problems(model, checked.specs)
    problems += [p for method in used for p in method.model_problems(model)]
    problems += inputs.check(model, cfg.model)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # one paragraph once (an unknown architecture, every site)
    ranks = Ranks.from_env()  # check() refused variables it cannot read
    if ranks.parallel and inputs.batch_count() is None:
        raise ConfigError([f"data: a data-parallel run ({ranks.world} ranks) splits the batches by number, but the "
                           "dataset has no len(); give it __len__ and __getitem__, or run one process"])
    note = offload_note(cfg.model, model)
    if note:
        log.warning(note)
    if dispatched(model):  # placed by accelerate (model.device_map): left where it is, inputs to its first device
        if ranks.parallel:
            raise ConfigError([f"model.device_map: a data-parallel run ({ranks.world} ranks) gives each rank one "
                               "device, but the model is spread over devices by its device map; run one process"])
        device = input_device(model)
        log.info("model placed by its device map %s: inputs go to %s (device=%s is not used)",
                 dict(model.hf_device_map), device, cfg.device)
    else:
        device = ranks.device(resolve_device(cfg.device))
        model.to(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model.train(cfg.mode == "train")
    return Run(cfg, path, context, checked.specs, model, inputs, ranks, device, parsed.config_hash,
               resolved=parsed.resolved, methods=used)
