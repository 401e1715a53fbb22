"""Config schemas for a hookrun experiment, registered with Hydra's ConfigStore, and check().

The schema types every top-level key of the config (README: Config). This is the bottom layer: it imports no
other hookrun module; `hookrun.run.checks` gathers every module's checks above it.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf


@dataclass
class HookConfig:
    """One named entry of `hooks`: which kind of PyTorch hook, on which layers, recording what."""

    kind: str = MISSING
    layers: Any = None  # str | list of names, globs, "re:<regex>"; usually ${layers}
    capture: Any = None  # roles to record; None = the kind's default roles
    edit: List[Any] = field(default_factory=list)  # interventions, applied in order
    dtype: Optional[str] = None  # store captures in this dtype (float16, bfloat16, ...)
    reduce: Any = None  # {op: mean|max|sum, dims: [2, 3] | spatial}
    select: Any = None  # {dim: 1, index: 3 | [0, 2] | {start, stop, step}}


@dataclass
class TextConfig:
    """A text corpus, tokenized: where the documents come from and how they become batches of token ids."""

    files: Optional[List[str]] = None  # .txt (one document per line), .jsonl / .parquet (documents in `field`)
    field: str = "text"  # the column / key holding a document's text in .jsonl, .parquet or dict items
    dataset: Any = None  # {_target_: ...} a datasets.Dataset or torch Dataset of str, dict or 1-D token tensors
    tokenizer: Any = None  # {_target_: ...} any Hugging Face tokenizer (built offline)
    max_length: int = 128  # tokens per sequence: longer documents are truncated (pad) / the window size (pack)
    batching: str = "pad"  # pad: one document a sample, padded to the batch's longest | pack: windows of max_length
    bos: bool = False  # prepend the tokenizer's BOS token to every document (pad) or window (pack)
    padding_side: Optional[str] = None  # right | left; null = the tokenizer's own padding_side
    position_ids: bool = True  # pass position_ids counted over real tokens (left padding keeps unpadded positions)
    exclude_special: bool = False  # store no BOS / EOS / pad tokens (the token table and every per-token array)
    max_documents: Optional[int] = None  # read at most this many documents


@dataclass
class DataConfig:
    """Where the model's inputs come from and how they are batched."""

    inputs: Dict[str, Any] = field(default_factory=dict)  # name -> tensor spec (literal, fill, random, file)
    dataset: Any = None  # {_target_: ...} a torch Dataset; items are tensors, tuples or dicts
    fields: Optional[List[str]] = None  # names of a dataset's tuple items, e.g. [image, label]
    targets: List[str] = field(default_factory=list)  # fields that go to the loss, not the model
    keyword: bool = False  # pass inputs to forward() by name instead of positionally
    batched: bool = True  # axis 0 of every input is the sample axis; false: each input is one sample
    batch_size: int = 1
    max_samples: Optional[int] = None  # stop after this many samples
    stride: int = 1  # use every stride-th batch only
    num_workers: int = 0  # DataLoader workers for a dataset
    record: Optional[List[str]] = None  # per-sample fields kept in cap.samples; None = data.targets
    # a tokenized text corpus instead of inputs / dataset (hookrun/text.py). Left at its defaults it is no text (check()
    # sets it to None): a block is there so `data.text.files=[...]` works on the command line, as for every other key
    text: Optional[TextConfig] = field(default_factory=TextConfig)


@dataclass
class StoreConfig:
    """Where and how captures are written."""

    path: Optional[str] = None  # default: <hydra output dir>/captures.zarr; a URL (s3://...) for any fsspec protocol
    storage_options: Any = None  # fsspec options of a URL (key, secret, ...); untyped so every override form composes
    mode: str = "create"  # create | overwrite | resume (continue a killed run after its last committed batch)
    codec: str = "lz4"  # none | lz4 | zstd | blosclz | zlib (all through blosc)
    level: int = 5  # compression level
    shuffle: str = "bitshuffle"  # blosc shuffle: noshuffle | shuffle | bitshuffle
    min_saving: float = 0.2  # compress an array only if its first chunk shrinks by this fraction (0 = always)
    chunk_mb: float = 1.0  # uncompressed bytes per chunk along the sample axis
    chunk_rows: Optional[int] = None  # fixed rows per chunk; overrides chunk_mb
    shard_mb: Optional[float] = None  # MB per shard file of whole chunks (zarr sharding); None = a file per chunk
    writer: str = "auto"  # auto | thread (writes off the hot path) | sync (writes inside the hook)
    queue_mb: float = 64.0  # most MB of captures waiting for the writer (backpressure)
    commit_s: float = 5.0  # seconds between index commits (0 = after every batch)
    retry_s: float = 60.0  # seconds an object store that answered may stay unreachable before the run fails


@dataclass
class RunConfig:
    """The whole experiment: every top-level key of the config."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    seed: int = 0
    mode: str = "eval"  # eval | train
    layers: Any = None  # default targets of an experiment's hooks, so `layers=` sweeps work
    hooks: Dict[str, Any] = field(default_factory=dict)  # name -> HookConfig (typed by hook_specs)
    model: Any = MISSING  # {_target_: ...}
    data: DataConfig = field(default_factory=DataConfig)
    loss: Any = None  # null = forward only, no autograd
    store: StoreConfig = field(default_factory=StoreConfig)
    on_nonfinite: str = "record"  # record | warn | error when a capture holds NaN or inf
    inspect: bool = False  # print every layer and parameter instead of running
    vars: Dict[str, Any] = field(default_factory=dict)  # the user's own interpolation variables: ${vars.NAME}


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore; conf/config.yaml lists it first in its defaults."""
    ConfigStore.instance().store(name="hookrun_schema", node=RunConfig)


class ConfigError(ValueError):
    """Every problem found in a config, one line each: key, value, what to do."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the config:\n{lines}")


def schema_field(schema: type, name: str) -> Optional[type]:
    """The dataclass a schema field is typed as (through Optional), or None for a free-form or plain field."""
    hint = typing.get_type_hints(schema)[name]
    return next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)


def unknown_key(prefix: str, key: str, schema: type) -> str:
    """The problem line of `prefix + key`, a key that its schema dataclass lacks: the closest names and all of them."""
    names = [f.name for f in dataclasses.fields(schema)]
    node = prefix.rstrip(".") or "the config"
    return f"{prefix}{key}: unknown key{suggest(key, names)}; {node} takes {', '.join(names)}"


def override_problems(overrides: List[str]) -> List[str]:
    """Command-line overrides without `+` (`data.text.max_len=64`, `sed=1`) of keys that the schema of a typed
    node lacks, with check()'s suggestion (Hydra refuses them with OmegaConf's own message and a hint to add `+`,
    after which check() names the key)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return []  # Hydra says what is malformed itself
    groups = {p.name for p in (Path(__file__).parents[1] / "conf").iterdir() if p.is_dir()}  # experiment=...: Hydra's
    problems = []
    for o in parsed:
        if o.is_add() or o.is_force_add() or o.is_delete() or o.package is not None or o.is_hydra_override():
            continue
        schema, prefix = RunConfig, ""
        *path, last = o.key_or_group.split(".")
        for part in path:
            if schema is None or part not in schema.__dataclass_fields__:
                break
            schema, prefix = schema_field(schema, part), f"{prefix}{part}."
        else:
            if schema is not None and last not in schema.__dataclass_fields__ and (path or last not in groups):
                problems.append(unknown_key(prefix, last, schema))
    return problems


def settle_text(cfg) -> None:
    """`data.text` left at the schema's defaults (no key of it given) set to None: the run has no text."""
    text = cfg.data.get("text")
    if text is not None and OmegaConf.to_container(text) == OmegaConf.to_container(OmegaConf.structured(TextConfig)):
        cfg.data.text = None


JOBLIB = {"prefer": (None, "processes", "threads"), "require": (None, "sharedmem"),
          "mmap_mode": (None, "r+", "r", "w+", "c")}


def launcher_problems(launcher) -> List[str]:
    """Settings of the joblib launcher that joblib would refuse only once the sweep starts, with a traceback."""
    if "joblib" not in str(launcher.get("_target_", "")).lower():
        return []
    problems = [f"hydra.launcher.{key}: {launcher[key]!r} is unknown; use one of {', '.join(map(str, allowed))}"
                for key, allowed in JOBLIB.items() if key in launcher and launcher[key] not in allowed]
    if launcher.get("n_jobs") == 0:
        problems.append("hydra.launcher.n_jobs: 0 runs no job; give how many jobs run at once, or -1 for one per "
                        "core (-2: all cores but one)")
    batch = str(launcher.get("batch_size", "auto"))
    if batch != "auto" and not (batch.isdigit() and int(batch) > 0):
        problems.append(f"hydra.launcher.batch_size: {batch!r}; use auto or a positive number of jobs a worker takes")
    dispatch = str(launcher.get("pre_dispatch", "all"))
    if dispatch != "all" and not (dispatch.replace("n_jobs", "1").strip()
                                  and set(dispatch.replace("n_jobs", "1")) <= set("0123456789+-*/() ")):
        problems.append(f"hydra.launcher.pre_dispatch: {dispatch!r}; use all, a number or an expression of n_jobs "
                        "such as 2*n_jobs")
    if launcher.get("timeout") is not None and launcher.timeout <= 0:
        problems.append(f"hydra.launcher.timeout: {launcher.timeout}; give seconds > 0 or null (no limit)")
    return problems


class LauncherCheck(Callback):
    """Hydra callback (conf/config.yaml): a multirun's launcher settings checked before any job starts."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problems = launcher_problems(config.hydra.launcher)
        if problems:  # exit here: Hydra would print an exception raised from a callback as a traceback
            logging.getLogger("hookrun").error("%s", ConfigError(problems))
            sys.exit(2)


def suggest(word: str, choices) -> str:
    """' (did you mean: a, b?)' for the closest choices, or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=3, cutoff=0.5)
    return f" (did you mean: {', '.join(close)}?)" if close else ""


def as_list(value) -> list:
    """A str / list / ListConfig / None as a plain list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return list(value)
    return [value]


def to_plain(value):
    """An OmegaConf node as plain Python containers (resolved)."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


HOOK_KEYS = tuple(HookConfig.__dataclass_fields__)


def hook_specs(cfg) -> Dict[str, DictConfig]:
    """Every `hooks` entry typed as a HookConfig (kept untyped in the schema so `+hooks.x.kind=...` works).

    An entry set to null (`hooks.NAME: null` in YAML, `hooks.NAME=null` on the command line) is removed."""
    specs, problems = {}, []
    for name, hook in (cfg.hooks or {}).items():
        if hook is None:
            continue  # `hooks.NAME: null` removes a hook an experiment inherited
        if not isinstance(hook, DictConfig):
            problems.append(f"hooks.{name}: {to_plain(hook)!r} is not a hook; write {{kind: forward, layers: [conv1]}}")
            continue
        unknown = [k for k in hook if k not in HOOK_KEYS]
        problems += [f"hooks.{name}.{k}: unknown key; a hook takes {', '.join(HOOK_KEYS)}{suggest(k, HOOK_KEYS)}"
                     for k in unknown]
        if "kind" not in hook:
            problems.append(f"hooks.{name}.kind: missing; set one of forward_pre, forward, backward, backward_pre, "
                            "output_grad, param_grad, input_grad")
        if unknown or "kind" not in hook:
            continue
        try:
            specs[name] = OmegaConf.merge(OmegaConf.structured(HookConfig), to_plain(hook))
        except Exception as err:  # noqa: BLE001 - omegaconf type errors name the key
            problems.append(f"hooks.{name}: {err}".splitlines()[0])
    if problems:
        raise ConfigError(problems)
    return specs


def resolved(cfg) -> dict:
    """The config with every interpolation resolved, as JSON-safe plain containers (for attrs and hashing), except
    values read from the environment (`${oc.env:NAME}`, directly or through other interpolations): those keep their
    interpolation text, so a store never holds a credential or anything else of the environment."""
    import json

    plain = OmegaConf.to_container(cfg, resolve=True)
    for path, text in _from_environment(cfg):
        node = plain
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = text
    return json.loads(json.dumps(plain, default=str))


def _from_environment(cfg) -> List[tuple]:
    """(key path, interpolation text) of each interpolated value of `cfg` whose resolution reads the environment
    (found by resolving each one with `oc.env` counting its calls)."""
    from omegaconf.resolvers import oc

    reads: List[str] = []

    def env(*args):
        reads.append(args[0])
        return oc.env(*args)

    found: List[tuple] = []

    def walk(node, path):
        for key in (node.keys() if isinstance(node, DictConfig) else range(len(node))):
            child = node._get_node(key)
            if child is None or child._is_missing():
                continue
            if child._is_interpolation():
                reads.clear()
                to_plain(node[key])
                if reads:
                    found.append(([*path, key], child._value()))
            elif isinstance(child, (DictConfig, ListConfig)) and not child._is_none():
                walk(child, [*path, key])

    OmegaConf.register_new_resolver("oc.env", env, replace=True)
    try:
        walk(cfg, [])
    finally:
        OmegaConf.register_new_resolver("oc.env", oc.env, replace=True)
    return found


def config_hash(resolved: dict) -> str:
    """A short hash of the resolved config, minus where and how it is stored (resume compares it)."""
    import hashlib
    import json

    body = {k: v for k, v in resolved.items() if k != "store"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


TARGET_META = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


def check_target(key: str, node) -> List[str]:
    """Problems with a `{_target_: ..., **kwargs}` node: it must import and accept those arguments."""
    import inspect

    from hydra._internal.utils import _locate

    spec = to_plain(node)
    if not isinstance(spec, dict) or "_target_" not in spec:
        return [f"{key}: {spec!r} has no _target_; give {{_target_: package.module.Class, ...}}"]
    try:
        target = _locate(spec["_target_"])
    except Exception as err:  # noqa: BLE001 - any import failure is the user's to fix
        reason = str(err).strip().splitlines()[-1]
        return [f"{key}._target_: {spec['_target_']!r} does not import ({reason}); check the dotted path "
                "and that its package is installed"]
    kwargs = {k: v for k, v in spec.items() if k not in TARGET_META}
    try:
        inspect.signature(target).bind(*spec.get("_args_", []), **kwargs)
    except TypeError as err:
        params = ", ".join(inspect.signature(target).parameters)
        return [f"{key}: {spec['_target_']}({', '.join(kwargs)}) does not match its signature ({err}); "
                f"it takes ({params})"]
    except ValueError:
        pass  # no signature to check (builtins)
    return []
