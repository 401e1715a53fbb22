"""The Python entry point: run, compose and sweep experiments from a script or a notebook, as the CLI runs them.

    import hookrun
    cap = hookrun.run("lm_tokens", layers=["transformer.h.0"])      # the captures, opened (store in outputs/...)
    cfg = hookrun.compose("lm_tokens", ["data.batch_size=4"])        # the typed config, for inspection
    cap = hookrun.run("lm_tokens", model=model, tokenizer=tok)       # a model already loaded, used in place
    df = hookrun.sweep("lm_tokens", {"layers": [["transformer.h.0"], ["transformer.h.1"]]}, model=model)

The same config composition (the bundled conf/ and `config_dir`, as `--config-dir`), the same checks and messages
(a config error raises one ConfigError listing every problem), the same store and the same summary as
`python -m hookrun`; `**keys` are overrides given as Python values (quoted for Hydra here).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import re
import signal
import sys
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple, Union

from omegaconf import OmegaConf, open_dict, read_write

from hookrun.storage import Location
from hookrun.store.spec import MEMORY_ROOT
from hookrun.config.checks import ConfigError
from hookrun.config.commandline import override_problems
from hookrun.config.parsing import MODEL_MISSING, parse
from hookrun.config.rundir import kept_if_used
from hookrun.config.rundir import register as register_run_dir
from hookrun.config.schema import conf_dir, register_configs

log = logging.getLogger("hookrun")
Dirs = Union[str, Path, Sequence[Union[str, Path]], None]
KEYWORDS = {"true", "false", "null", "inf", "nan", "on", "off", "yes", "no"}  # read as values when unquoted
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def run(experiment: Optional[str] = None, overrides: Iterable[str] = (), model=None, tokenizer=None,
        config_dir: Dirs = None, quiet: bool = False, inputs=None, **keys):
    """Run one experiment as `python -m hookrun +experiment=NAME OVERRIDES` would, in this process; returns the
    opened Captures (None for inspect=true).

        cap = hookrun.run("conv_fmaps", ["data.batch_size=2"], layers=["conv1"])

    `overrides`: Hydra override strings; `**keys`: more overrides as Python values (`layers=["conv1"]`);
    `config_dir`: your config dirs (as `--config-dir`); `model`: an nn.Module already loaded, used in place of the
    config's model (not copied; with device=auto the run goes where the model sits, and a model with an
    hf_device_map is not moved; its train/eval modes and gradients as they were afterwards, every hook removed, also
    on errors; an nnsight NNsight/LanguageModel is hooked through the module it wraps); `tokenizer`: its tokenizer.
    Explicit wins: a model or tokenizer given replaces the one the experiment names, and one log line says so.
    `inputs`: the data as a list of prompts, of token-id lists, or of records (paired prompts), e.g.
    `hookrun.run(model=m, tokenizer=tok, hooks={"resid": {...}}, inputs=["The cat", ...])` (data.text.dataset; the
    experiment's data.text.files dropped). Blocks are keywords too (`hooks={...}` merges into the hooks block).
    `quiet`: hookrun's warnings and errors only (else the `hookrun` logger's level, INFO where you set none). The
    store goes to store.path (`memory`: in this process, freed with the Captures returned; `cap.save(path)` keeps
    it), else a fresh outputs/<date>/<time>/captures.zarr (hydra.run.dir) below the working directory."""
    started = time.time()
    with _logging(quiet):  # the log lines of what the arguments replace, shown as the run's
        if inputs is not None:
            keys = {**keys, **_inputs_keys(inputs)}
        names = _explicit(_overrides(experiment, overrides, keys, config_dir, model), model, tokenizer)
    return _run(names, model, tokenizer, started, quiet=quiet)


def _inputs_keys(inputs) -> dict:
    """run(inputs=[...]) as keys: the list as data.text.dataset (hookrun.data.text.listed), no data.text.files."""
    ok = isinstance(inputs, (list, tuple)) and inputs and all(
        isinstance(x, str) or isinstance(x, dict) or
        (isinstance(x, (list, tuple)) and x and all(isinstance(i, int) and not isinstance(i, bool) for i in x))
        for x in inputs)
    if not ok:
        raise ConfigError([f"inputs: {inputs!r:.80} is not a list of prompts, of token-id lists or of records; give "
                           "e.g. inputs=['The cat sat', 'A dog ran'] or inputs=[[1, 5, 9], [1, 7]]"])
    log.info("inputs=: %d prompts given as the data (data.text.dataset)", len(inputs))
    return {"data.text.files": None,
            "data.text.dataset": {"_target_": "hookrun.data.text.listed", "items": [
                list(x) if isinstance(x, tuple) else x for x in inputs]}}


def _explicit(names: list, model, tokenizer) -> list:
    """Explicit wins: with a tokenizer given, data.text.tokenizer dropped where the experiment names one; with a
    model given, the experiment's model (dropped in _parsed); one log line for each replaced."""
    if model is None and tokenizer is None:
        return names
    cfg, _ = _composed(list(_store_path_late(tuple(names))[0]))  # the composition _parsed uses
    text = (cfg.get("data") or {}).get("text") or {}
    named = text.get("tokenizer") if hasattr(text, "get") else None
    if tokenizer is not None and named is not None:
        log.info("tokenizer=: the tokenizer given (%s) replaces the experiment's data.text.tokenizer (%s)",
                 type(tokenizer).__name__, named.get("_target_", named) if hasattr(named, "get") else named)
        names = [*names, "data.text.tokenizer=null"]
    target = cfg.get("model")
    if model is not None and target is not None:
        log.info("model=: the model given (%s) replaces the experiment's model (%s)", type(model).__name__,
                 target.get("_target_", target) if hasattr(target, "get") else target)
    return names


def compose(experiment: Optional[str] = None, overrides: Iterable[str] = (), config_dir: Dirs = None, **keys):
    """The typed, frozen config `hookrun.run` with the same arguments would run (hookrun.config.parsing.parse's
    Parsed.config); a ConfigError lists every problem of its shape (a missing model is none: pass it to run).

        cfg = hookrun.compose("lm_tokens", layers=["transformer.h.1"]); cfg.hooks["resid"].layers
    """
    with kept_if_used():  # composing writes nothing: not even the run folder its hydra.run.dir names
        parsed, _ = _parsed(_overrides(experiment, overrides, keys, config_dir))
    problems = [p for _, p in parsed.problems if p != MODEL_MISSING]
    if problems:
        raise ConfigError(problems)
    return parsed.config


def sweep(experiment: Optional[str], values: dict, overrides: Iterable[str] = (), model=None, tokenizer=None,
          config_dir: Dirs = None, sweep_dir: Union[str, Path, None] = None, with_index: bool = True,
          generations: bool = False, quiet: bool = False, **keys):
    """One run per combination of `values` (key -> the list of values to try, as Python values), in this process
    one after the other, each into <sweep_dir>/<job number>/captures.zarr, `model` reused; returns
    hookrun.collect(sweep_dir)'s frame (with_index, generations: as collect's), its `attrs["sweep_dir"]` the dir.

        df = hookrun.sweep("steer", {"hooks.steer.edit.0.coef": [-4, 0, 4]}, model=model, generations=True)

    `sweep_dir`: default a fresh multirun/<date>/<time> (hydra.sweep.dir), as `python -m hookrun -m ...`."""
    from hookrun.read.captures import collect

    started = time.time()
    if not isinstance(values, dict) or not values:
        raise ConfigError([f"sweep: values {values!r} is not a mapping of key -> values; give e.g. "
                           "{'layers': [['conv1'], ['conv2']]}"])
    problems = [f"sweep: values[{k!r}] = {v!r} is not a list of values; give e.g. [1, 2]"
                for k, v in values.items() if not isinstance(v, (list, tuple)) or not v]
    problems += [f"sweep: {k!r} is both swept and given as a key; drop one" for k in values if k in keys]
    if problems:
        raise ConfigError(problems)
    with _logging(quiet):
        base = _explicit(_overrides(experiment, overrides, keys, config_dir, model), model, tokenizer)
    jobs = [[f"{k}={value_text(v, k)}" for k, v in zip(values, combo)] for combo in itertools.product(*values.values())]
    if model is not None:
        _refuse_model_keys([o for job in jobs for o in job])
    if sweep_dir is None:
        _, hydra = _composed([*base, *jobs[0]])
        sweep_dir = hydra.sweep.dir
    sweep_dir = Path(sweep_dir).expanduser().resolve()
    for num, job in enumerate(jobs):
        log.info("sweep job %d of %d: %s", num + 1, len(jobs), " ".join(job))
        _run([*base, *job], model, tokenizer, started if num == 0 else time.time(), sweep_dir / str(num), num, quiet)
    df = collect(sweep_dir, with_index=with_index, generations=generations)
    df.attrs["sweep_dir"] = str(sweep_dir)
    return df


def value_text(value, key: str = "value") -> str:
    """A Python value as a Hydra override value: ["conv1"] -> [conv1], "a b" -> 'a b', None -> null, True -> true;
    strings quoted where Hydra would read them otherwise (a number, a keyword, spaces, quotes, backslashes)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value and abs(value) != float("inf") else \
            ("nan" if value != value else "inf" if value > 0 else "-inf")
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return value if _bare(value) else _quoted(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(value_text(v, key) for v in value) + "]"
    if isinstance(value, dict):
        bad = [k for k in value if not (isinstance(k, str) and re.fullmatch(r"[A-Za-z_][\w\-]*", k))]
        if bad:
            raise ConfigError([f"{key}: the dict key {bad[0]!r} cannot be given as an override value; use names of "
                               "letters, digits, _ and -, or give the override as a string in overrides=[...]"])
        return "{" + ",".join(f"{k}:{value_text(v, f'{key}.{k}')}" for k, v in value.items()) + "}"
    raise ConfigError([f"{key}: {value!r} ({type(value).__name__}) is not a config value; give a string, number, "
                       "bool, None, list or dict"])


def _bare(text: str) -> bool:
    """Whether `text` reads back as the same string unquoted."""
    return bool(re.fullmatch(r"[A-Za-z_/][\w./\-]*", text)) and text.lower() not in KEYWORDS


def _quoted(text: str) -> str:
    """`text` in single quotes, escaped as Hydra's grammar reads it: quotes as \\', and backslashes before a quote
    or at the end doubled (others stay as they are)."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return f"'{body}'"


def _overrides(experiment, overrides, keys: dict, config_dir: Dirs, model=None) -> list:
    """The override strings of a call: +experiment=NAME, the overrides, the keys, the config dirs' search path;
    with `model` given, any override of the model refused first."""
    if isinstance(overrides, str):
        raise ConfigError([f"overrides: {overrides!r} is one string; give a list, e.g. [{overrides!r}]"])
    names = ([f"+experiment={experiment}"] if experiment else []) + list(overrides)
    names += [f"{'++' if isinstance(value, dict) else ''}{key}={value_text(value, key)}"  # a block merges
              for key, value in keys.items()]
    if model is not None:
        _refuse_model_keys(names)
    if config_dir is not None:
        dirs = [config_dir] if isinstance(config_dir, (str, Path)) else list(config_dir)
        missing = [str(d) for d in dirs if not Path(d).expanduser().is_dir()]
        if missing:
            raise ConfigError([f"config_dir: {missing[0]!r} is not a directory; give the dir holding your experiment/ "
                               "(as python -m hookrun --config-dir DIR takes it)"])
        names.append("hydra.searchpath=[" + ",".join(_quoted(f"file://{Path(d).expanduser().resolve()}")
                                                     for d in dirs) + "]")
    return names


def _refuse_model_keys(names: list) -> None:
    """A ConfigError naming each override of the model: model= passes the model itself."""
    keys = [n.split("=", 1)[0].lstrip("+~") for n in names]
    bad = [k for k in keys if k == "model" or k.startswith("model.")]
    if bad:
        raise ConfigError([f"{k}: given as an override, but model= passes a model already loaded, which the config's "
                           "model block does not build; drop the override or model=" for k in bad])


_CACHE: dict = {}  # (names, the config files' stats[, the model's place]) -> a composition or a parse, per process
_CACHE_MAX = 128  # entries kept, the oldest dropped first
_RESOLVER = re.compile(r"\$\{[\w.]+:")  # ${hydra:...}, ${now:...}, ${oc.env:...}: a value that may differ each call


def _config_files(names: list) -> tuple:
    """(path, mtime_ns, size) of every YAML file a composition of `names` can read: the bundled conf/ and the dirs
    of hydra.searchpath; an edited file gives a new key, so the cache never hands back a stale config."""
    dirs = [conf_dir()]
    for name in names:
        if name.startswith("hydra.searchpath="):
            dirs += [Path(d) for d in re.findall(r"file://([^',\]]+)", name)]
    found = []
    for folder in dirs:
        for path in sorted(folder.rglob("*.yaml")):
            stat = path.stat()
            found.append((str(path), stat.st_mtime_ns, stat.st_size))
    return tuple(found)


def _cached(key, make):
    """The value cached under `key`, made (and kept) on a miss."""
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = make()
    return _CACHE[key]


def _composed(names: list, key: Optional[tuple] = None):
    """(the task config, its hydra node) that `python -m hookrun NAMES` composes; Hydra's own errors (an unknown
    experiment, a malformed override) and keys the schema lacks as one ConfigError. Composed once per process for
    the same names and config files: the cached config itself, which callers read and never change (_parsed
    copies it where a parse needs changes; a deep copy of Hydra's node costs tens of milliseconds a run)."""
    key = key or (tuple(names), _config_files(names))
    cfg = _cached(("composed", key), lambda: _compose(names))
    return cfg, cfg.hydra


def _compose(names: list):
    """The task config Hydra composes for `names`, its hydra node included (see _composed)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException

    register_configs()
    register_run_dir()
    problems = override_problems([n for n in names if not n.startswith("hydra.")])
    if problems:
        raise ConfigError(problems)
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    outer = get_gh_backup() if GlobalHydra.instance().is_initialized() else None  # called inside a Hydra app
    if outer is not None:
        GlobalHydra.instance().clear()
    try:
        with initialize_config_module("hookrun.conf", version_base="1.3"):
            cfg = hydra_compose("config", names, return_hydra_config=True)
    except HydraException as err:
        raise ConfigError([str(err).strip()]) from None
    finally:
        if outer is not None:
            restore_gh_from_backup(outer)
    return cfg


def _parsed(names: list, model=None, output_dir: Optional[Path] = None, num: int = 0):
    """(Parsed, the Hydra context the CLI gives the engine) of one job of `names` into `output_dir` (default
    hydra.run.dir), ${hydra:...} resolved as in the CLI; with `model` given, the config's model block dropped and
    device auto taken as the model's device. A config with no resolver in it (${hydra:}, ${now:}, ${oc.env:}: values
    that may differ between calls) is parsed once per process for the same names, files and model device."""
    from hydra.core.hydra_config import HydraConfig

    reduced, late, task = _store_path_late(tuple(names))
    names = list(reduced)
    key = (tuple(names), _config_files(names))
    base, hydra = _composed(names, key)
    if output_dir is None:
        OmegaConf.clear_cache(base)  # ${now:...} caches its value in the (cached) config: each run its own time
        output_dir = hydra.run.dir
    output_dir = Path(output_dir).expanduser().resolve()
    overrides = list(task) if late is not None else OmegaConf.to_container(hydra.overrides.task)
    context = {"output_dir": str(output_dir), "choices": dict(hydra.runtime.choices), "overrides": overrides}
    device = None
    if model is not None:
        context["model_given"] = f"{type(model).__module__}.{type(model).__qualname__}"
        device = _device_of(model)

    def parse_now(path: Optional[str] = None):
        cfg = copy.deepcopy(base)
        if path is not None:
            cfg.store.path = path
        with read_write(cfg.hydra), open_dict(cfg.hydra):  # what Hydra's run_job sets
            cfg.hydra.runtime.output_dir = str(output_dir)
            cfg.hydra.job.num = num
        if model is not None:
            with open_dict(cfg):
                cfg.model = None
                if device and cfg.device == "auto" and not any(n.lstrip("+").startswith("device=") for n in names):
                    cfg.device = device  # auto: where the model is
        saved = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(cfg)
        try:
            with read_write(cfg), open_dict(cfg):
                del cfg["hydra"]
            return parse(cfg)
        finally:
            HydraConfig.instance().cfg = saved

    if not _cached(("pure", key), lambda: _pure(base)):
        return parse_now(late), context
    parsed = _cached(("parsed", key, model is None, device), parse_now)
    if late is not None:  # the path is set on the parse kept, as on the composition
        return parsed.with_store_path(late), context
    return dataclasses.replace(parsed, resolved=copy.deepcopy(parsed.resolved)), context


@functools.lru_cache(maxsize=32)
def _store_path_late(names: Tuple[str, ...]) -> Tuple[Tuple[str, ...], Optional[str], Optional[Tuple[str, ...]]]:
    """(`names` without a plain store path, that path or None, the task's overrides Hydra lists for `names` or None):
    `store.path=P` and the path of `++store={path: P}` (hookrun.run's store=) are set on the composed config instead
    of composed, so that runs differing only in where they store share one composition (Hydra's takes 0.1-0.25 s a
    run). A path Hydra would read otherwise (an interpolation, a sweep, not a string) leaves `names` as they are
    (Hydra composes every path then); a store dict's other keys stay in `names`. Kept per process: a rerun, and
    _explicit's look at the same names, parse nothing.

        _store_path_late(("+experiment=lens", "++store={path:a.zarr,mode:resume}"))
        # (("+experiment=lens", "++store={mode:resume}"), "a.zarr", ("+experiment=lens", "++store={path:...}"))
    """
    if not any(n.startswith(("store.path=", "++store={")) for n in names):
        return names, None, None
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(names))
    except HydraException:
        return names, None, None  # malformed: Hydra says so when it composes
    out, late = list(names), None
    for i, (name, o) in enumerate(zip(names, parsed)):
        if not name.startswith(("store.path=", "++store={")):
            continue
        value = o.value()
        if isinstance(value, dict):
            if "path" not in value:
                continue  # a store dict without a path: Hydra's
            path, rest = value["path"], {k: v for k, v in value.items() if k != "path"}
        else:
            path, rest = value, {}
        if not isinstance(path, str) or "${" in path:
            return names, None, None
        late = path
        out[i] = f"++store={value_text(rest, 'store')}" if rest else None
    if late is None:
        return names, None, None
    task = tuple(o.input_line for o in parsed if not o.is_hydra_override())  # as Hydra's compose lists them
    return tuple(n for n in out if n is not None), late, task


def _pure(cfg) -> bool:
    """Whether the task config (its hydra node aside) holds no resolver call: its parse is then the same each call."""
    task = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}
    return _RESOLVER.search(repr(task)) is None


def _run(names: list, model, tokenizer, started: float, output_dir: Optional[Path] = None, num: int = 0,
         quiet: bool = False):
    """One job of `names` into `output_dir` (default hydra.run.dir): the engine's run with the context the CLI
    gives it, the model given kept as it was; the opened Captures (None for inspect=true)."""
    from hookrun.engine.runner import Interrupted
    from hookrun.engine.runner import run as run_engine
    from hookrun.read.captures import open as open_store

    model = module_of(model)
    try:
        with kept_if_used():  # the run folder claimed for a refused config or a store.path elsewhere: taken back
            parsed, context = _parsed(names, model, output_dir, num)
            with _logging(quiet), _kept(model):
                where = run_engine(parsed, started, context, model=model, tokenizer=tokenizer)
    except Interrupted as stop:
        if stop.signum == signal.SIGINT:  # Ctrl-C / the notebook's interrupt: what Python raises for it
            where = stop.store if stop.store is not None else context["output_dir"]
            raise KeyboardInterrupt(f"interrupted: the finished batches are committed in {where}; continue with the "
                                    f"same call plus store={{'path': {str(where)!r}, 'mode': 'resume'}}") from stop
        raise
    if where is None:
        return None
    cap = open_store(where)
    if str(where).startswith(MEMORY_ROOT):  # store.path=memory: its memory freed with the Captures returned
        weakref.finalize(cap, _drop_memory, str(where))
    return cap


def _drop_memory(url: str) -> None:
    """Remove a store.path=memory store (once its Captures is gone: nothing else names it): the directory of its own
    that holds it."""
    Location(url.rsplit("/", 1)[0]).delete_all()


WRAPPED = ("_module",)  # where a wrapper that is no nn.Module keeps the module it wraps (nnsight's NNsight, Envoy)
MODULE_NAMES = ("module", "model", "_model", "_orig_mod")  # where others may keep it: named in the refusal


def module_of(model):
    """The nn.Module to hook: `model` itself, or the module an nnsight wrapper (NNsight, LanguageModel) holds; any
    other object is refused, naming the attribute that holds its module where one does."""
    import torch

    if model is None or isinstance(model, torch.nn.Module):
        return model
    inner = next((getattr(model, a) for a in WRAPPED if isinstance(getattr(model, a, None), torch.nn.Module)), None)
    if inner is not None:
        log.debug("model: %s wraps %s: hooking the module it wraps", type(model).__name__, type(inner).__name__)
        return inner
    held = next((a for a in MODULE_NAMES if isinstance(getattr(model, a, None), torch.nn.Module)), None)
    fix = f"pass model=<your {type(model).__name__}>.{held}, the torch.nn.Module it holds" if held else \
        "pass the torch.nn.Module itself"
    raise ConfigError([f"model: {type(model).__module__}.{type(model).__qualname__} is not a torch.nn.Module; {fix}"])


def _device_of(model) -> Optional[str]:
    """The device name of a model on one device (cpu, cuda:N, mps), None for one spread by a device map, split
    across devices, or without parameters (the config's device then decides)."""
    if getattr(model, "hf_device_map", None):
        return None
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    if len(devices) != 1:
        return None
    device = devices.pop()
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    return device.type if device.type in ("cpu", "mps") else None


@contextmanager
def _kept(model):
    """The model given, as it was afterwards, also on an error: each module's train/eval mode, the parameters'
    gradients, and no hook left on any module."""
    if model is None:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]
    hooks = [(m, name, set(getattr(m, name, {}))) for m in model.modules() for name in HOOK_DICTS]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
        for param, grad in grads:
            param.grad = grad
        leaked = [(m, name, k) for m, name, before in hooks for k in list(getattr(m, name, {})) if k not in before]
        for module, name, k in leaked:  # none: the engine's HookSet removes its own; this is the last guard
            getattr(module, name).pop(k, None)
        if leaked:
            log.warning("removed %d hooks the run left on the model given", len(leaked))


@contextmanager
def _logging(quiet: bool = False):
    """hookrun's INFO lines (the summary, progress lines) shown as the CLI shows them, where logging is not set up
    (a notebook, a script): a handler on the `hookrun` logger for the call, at INFO unless the logger has a level of
    yours. `quiet`: warnings and errors only, for the call. Configured logging is left alone otherwise."""
    level = log.level
    handler = None
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        log.addHandler(handler)
        if level == logging.NOTSET:
            log.setLevel(logging.INFO)
    if quiet and log.getEffectiveLevel() < logging.WARNING:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        if handler is not None:
            log.removeHandler(handler)
        log.setLevel(level)
