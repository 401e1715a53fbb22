"""Config schemas for a hookrun experiment, registered with Hydra's ConfigStore, and the helpers every check shares.

The schema types every top-level key of the config and is its one source of truth: each field holds its default,
its allowed values (the tuples beside it, which the checks use) and its help text (the README's tables:
hookrun.config.table); the YAML files set only what differs. This is the bottom layer: it imports no other hookrun
module; `hookrun.engine.checks` gathers every module's checks above it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import difflib
import functools
import logging
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, open_dict


def setting(default: Any = MISSING, help: str = "", choices: tuple = (), factory=None, own_table: bool = False):
    """A schema field: its default (`factory` for a list, dict or dataclass), its help text (the README's config
    tables, python -m hookrun.config.table) and its allowed values (the checks use the same tuple)."""
    meta = {"help": help, "choices": choices, "own_table": own_table}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8")


class Frozen:
    """A schema dataclass: Hydra composes it; once parse() made the typed config its fields cannot be set."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_sealed"):
            raise dataclasses.FrozenInstanceError(f"cannot set {name!r}: a parsed config is frozen (compose another "
                                                  "one, or dataclasses.replace() a copy)")
        object.__setattr__(self, name, value)


@dataclass
class HookConfig(Frozen):
    """One named entry of `hooks`: which kind of PyTorch hook, on which layers, recording what."""

    kind: str = setting(help="which PyTorch hook, one of the kinds in the table below")
    layers: Any = setting(None, "names, globs (`layer*.conv?`), `re:<regex>`; the model itself is `_model`; "
                                "usually `${layers}`")
    capture: Any = setting(None, "roles to record; null = the kind's default roles")
    edit: List[Any] = setting(help="interventions, applied in order; the capture records the edited value",
                              factory=list)
    dtype: Optional[str] = setting(None, "store captures in this dtype (bfloat16 is stored as its bits, loaded as "
                                         "float32)", DTYPES)
    reduce: Any = setting(None, "`{op: mean|max|min|sum|norm, dims: [2, 3]}`; dims are ints >= 1 or `spatial`, "
                                "`channel`, `sequence`, `hidden`")
    select: Any = setting(None, "`{dim: 1, index: 3 | [0, 2] | {start, stop, step}}`, or `{positions: last, "
                                "heads: [0]}` for text")
    dictionary: Optional[str] = setting(None, "a name in `dictionaries:`: store the layer's features sparse per token "
                                               "(`features.indices`, `features.values`, `error_norm`) instead of the "
                                               "dense activation (docs/dictionaries.md)")
    top_k: Optional[int] = setting(None, "with `dictionary`: keep each token's k largest features; null = every "
                                         "nonzero one (up to the SAE's k, or 64; more is an error)")
    splice: Optional[str] = setting(None, "with `dictionary`: `replace` the layer's output with the reconstruction, "
                                          "or `replace_with_error` (plus the error term: the output is unchanged)",
                                    ("replace", "replace_with_error"))
    evaluate: bool = setting(False, "with `dictionary`: SAELens's evaluations (L0, variance explained, MSE, dead "
                                    "features, CE loss recovered: 2 more forwards a batch a layer)")


BATCHING = {"pad": "one document a sample, padded", "pack": "windows of max_length"}
PADDING_SIDES = ("left", "right")


@dataclass
class TextConfig(Frozen):
    """A text corpus, tokenized: where the documents come from and how they become batches of token ids."""

    files: Optional[List[str]] = setting(None, "`.txt` (one document per line, blank lines skipped), `.jsonl` / "
                                               "`.parquet` (text, or a list of token ids, in `field`), `.pt` / `.npy` "
                                               "(token ids: a [samples, sequence] tensor, a list of 1-D ones, or a "
                                               "dict of columns); ids need no tokenizer; `pkg://package/path` for a "
                                               "file inside an installed package")
    field: str = setting("text", "key / column of a document's text (`.jsonl`, `.parquet`, dict items)")
    fields: Any = setting(None, "paired prompts: role → column, e.g. `{clean: clean, corrupt: "
                                                     "corrupt}`; each is tokenized, the first is what the model is fed "
                                                     "(`patching` runs the others); replaces `field`")
    dataset: Any = setting(None, "`{_target_: ...}` instead of files: a `datasets.Dataset` or torch Dataset of str, "
                                 "dicts, or 1-D token tensors")
    tokenizer: Any = setting(None, "`{_target_: ...}` any Hugging Face tokenizer (a local directory, or built in "
                                   "code; built offline)")
    max_length: int = setting(128, "`pad`: documents longer than this are **truncated** to their first `max_length` "
                                   "tokens (BOS included; the count is logged); `pack`: the window")
    batching: str = setting("pad", "`pad` makes each document a sample, padded to the batch's longest "
                                   "(`attention_mask` passed); `pack` joins documents with EOS (BOS if there is no EOS) "
                                   "and cuts them into windows of `max_length` tokens, no padding, dropping the "
                                   "incomplete last window (as SAELens)", BATCHING)
    bos: bool = setting(False, "prepend BOS to each document (`pad`) or window (`pack`)")
    padding_side: Optional[str] = setting(None, "null = the tokenizer's own", PADDING_SIDES)
    position_ids: bool = setting(True, "pass `position_ids` counted over real tokens, so left-padded tokens keep the "
                                       "positions they have alone")
    exclude_special: bool = setting(False, "store no BOS / EOS / pad tokens (SAELens' `exclude_special_tokens`), in "
                                           "the token table and every per-token array alike")
    max_documents: Optional[int] = setting(None, "read at most this many documents")


@dataclass
class DataConfig(Frozen):
    """Where the model's inputs come from and how they are batched."""

    inputs: Dict[str, Any] = setting(help="name → literal, `{fill, shape}`, `{random: normal|uniform|randint, "
                                          "shape}`, `{file: x.npy|x.pt}`", factory=dict)
    dataset: Any = setting(None, "`{_target_: ...}` a torch Dataset instead of inputs; items are tensors, tuples or "
                                 "dicts")
    fields: Optional[List[str]] = setting(None, "names of a dataset's tuple items, e.g. `[image, label]`")
    targets: List[str] = setting(help="fields that go to the loss, not the model", factory=list)
    keyword: bool = setting(False, "pass inputs to `forward()` by name instead of positionally")
    batched: bool = setting(True, "axis 0 of every input is the sample axis; false: each input is one sample")
    batch_size: int = setting(1, "samples per forward pass")
    max_samples: Optional[int] = setting(None, "stop after this many samples")
    stride: int = setting(1, "use every stride-th batch only")
    num_workers: int = setting(0, "DataLoader workers for a dataset (0 = load in the main process)")
    record: Optional[List[str]] = setting(None, "per-sample fields kept in `cap.samples`; null = `data.targets`")
    # Left at its defaults it is no text (check() sets it to None): a block is there so `data.text.files=[...]` works
    # on the command line, as for every other key
    text: Optional[TextConfig] = setting(help="a tokenized text corpus instead of inputs / dataset (Language models, below)",
                                         factory=TextConfig, own_table=True)


STORE_MODES = ("create", "overwrite", "resume")
CODECS = ("none", "lz4", "zstd", "blosclz", "lz4hc", "zlib")
SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")  # in blosc's order: its shuffle constant is the index
WRITERS = ("auto", "thread", "sync")


@dataclass
class StoreConfig(Frozen):
    """Where and how captures are written."""

    path: Optional[str] = setting(None, "null = `<hydra output dir>/captures.zarr`; or a URL "
                                        "(`s3://bucket/runs/a.zarr`, any fsspec protocol); `memory` = a fresh store "
                                        "in this process's memory (hookrun.run: read it back, `cap.save(path)` to keep "
                                        "it; its close skips the read-back check, which the saved copy gets)")
    storage_options: Any = setting(None, "fsspec options of a URL, e.g. `{key: ..., secret: ${oc.env:MY_SECRET}}`; "
                                         "null = the `AWS_*` environment variables")
    mode: str = setting("create", "`create` refuses an existing store, `overwrite` replaces it, `resume` continues "
                                  "a killed run after its last committed batch", STORE_MODES)
    codec: str = setting("lz4", "compression, all through blosc", CODECS)
    level: int = setting(5, "compression level 0..9")
    shuffle: str = setting("bitshuffle", "blosc shuffle (lz4 + bitshuffle: ~1.2 GB/s here)", SHUFFLES)
    min_saving: float = setting(0.2, "compress an array only if its first chunk shrinks by this fraction (dense "
                                     "float32 saves ~10%); 0 = always")
    chunk_mb: float = setting(1.0, "uncompressed MB per chunk along the sample axis")
    chunk_rows: Optional[int] = setting(None, "fixed rows per chunk instead of `chunk_mb`")
    shard_mb: Optional[float] = setting(None, "MB per shard (one file holding many chunks, zarr sharding); null = "
                                              "one file per chunk")
    writer: str = setting("auto", "`thread` writes off the hot path, `sync` inside the hook; `auto` picks sync on a "
                                  "CPU with no core to spare, else thread", WRITERS)
    queue_mb: float = setting(64.0, "most MB of captures waiting for the writer before hooks wait (backpressure)")
    commit_s: float = setting(5.0, "seconds between index commits (0 = after every batch); a kill loses at most "
                                   "this much")
    retry_s: float = setting(60.0, "seconds an object store that stops answering (no connection, 5xx) is retried, "
                                   "then the run fails")


RUN_MODES = ("eval", "train")
NONFINITE = ("record", "warn", "error")


@dataclass
class CoreConfig(Frozen):
    """The top-level keys of every run; run_schema() adds each method's block (hookrun.methods)."""

    device: str = setting("auto", "`auto` (cuda, then mps, then cpu), `cpu`, `cuda`, `cuda:N`, `mps`")
    seed: int = setting(0, "seeds model init, random inputs, and each batch's randomness (`seed + batch`)")
    mode: str = setting("eval", "the model's mode (dropout, batch norm)", RUN_MODES)
    layers: Any = setting(None, "what an experiment's hooks target by default (`layers: ${layers}`), so "
                                "`-m layers=a,b` sweeps")
    hooks: Dict[str, Any] = setting(help="named hooks (below); `hooks.NAME=null` removes one", factory=dict)
    model: Any = setting(help="`{_target_: any.importable.Class_or_factory, **kwargs}`")
    data: DataConfig = setting(factory=DataConfig)  # its keys are rows of their own in the table
    loss: Any = setting(None, "null (forward only, no autograd), `sum`, `mean`, `mse`/`cross_entropy` (with "
                              "`target`), `index` (a logit or element), or `_target_: fn(output, batch)`")
    store: StoreConfig = setting(factory=StoreConfig)
    on_nonfinite: str = setting("record", "what a capture holding NaN or inf does: `record` its counts in the index "
                                          "(always done), `warn` as well, `error` stops the run", NONFINITE)
    progress_s: float = setting(30.0, "seconds between progress lines in the log when stderr is not a terminal "
                                      "(`| tee`, nohup, SLURM logs; a terminal gets a progress bar); 0: none")
    inspect: bool = setting(False, "true: list every layer (type, output shape) and parameter, write nothing")
    vars: Dict[str, Any] = setting(help="your own interpolation variables (`${vars.NAME}`); free-form", factory=dict)


@functools.lru_cache(maxsize=None)
def run_schema() -> type:
    """The whole experiment's schema, `RunConfig`: every top-level key, the core ones (CoreConfig) and each
    registered method's block (hookrun.config.registry: its `key`, `annotation`, default and help)."""
    from hookrun.config.registry import methods

    blocks = [(key, cls.annotation, setting(cls.default, cls.help, factory=cls.factory, own_table=cls.own_table))
              for key, cls in methods().items()]
    return dataclasses.make_dataclass("RunConfig", blocks, bases=(CoreConfig,))


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore; conf/config.yaml lists it first in its defaults."""
    ConfigStore.instance().store(name="hookrun_schema", node=run_schema())


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


def named_item(schema: type, name: str) -> Optional[type]:
    """The dataclass of the named entries of a field: HookConfig for `hooks` (untyped in the schema, so that
    `+hooks.x.kind=...` works), a Dict[str, dataclass]'s value type; else None."""
    if name == "hooks":
        return HookConfig
    hint = typing.get_type_hints(schema)[name]
    for t in (hint, *typing.get_args(hint)):
        if typing.get_origin(t) in (dict, Dict):
            args = typing.get_args(t)
            if len(args) == 2 and dataclasses.is_dataclass(args[1]):
                return args[1]
    return None


def unknown_key(prefix: str, key: str, schema: type) -> str:
    """The problem line of `prefix + key`, a key that its schema dataclass lacks: the closest names and all of them."""
    names = [f.name for f in dataclasses.fields(schema)]
    return unknown_keys(prefix.rstrip("."), [key], names, f"{prefix.rstrip('.') or 'the config'} takes")[0]


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
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir()}  # experiment=...: Hydra's
    problems = []
    for o in parsed:
        if o.is_add() or o.is_force_add() or o.is_delete() or o.package is not None or o.is_hydra_override():
            continue
        schema, prefix = run_schema(), ""
        *path, last = o.key_or_group.split(".")
        parts = iter(path)
        for part in parts:
            if schema is None or part not in schema.__dataclass_fields__:
                break
            item = named_item(schema, part)  # hooks.NAME.x: the entry NAME is the user's, its keys the schema's
            if item is not None:
                name = next(parts, None)
                if name is None:
                    schema = None  # hooks.NAME=...: the whole entry, checked by check()
                    break
                schema, prefix = item, f"{prefix}{part}.{name}."
                continue
            schema, prefix = schema_field(schema, part), f"{prefix}{part}."
        else:
            if schema is not None and last not in schema.__dataclass_fields__ and (path or last not in groups):
                problems.append(unknown_key(prefix, last, schema))
    return problems


def conf_dir() -> Path:
    """The folder of the bundled Hydra configs (the package hookrun.conf: conf/ in a clone, inside the wheel)."""
    from importlib.resources import files

    return Path(str(files("hookrun.conf")))


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
    problems = [p for key, allowed in JOBLIB.items() if key in launcher
                for p in check_choice(f"hydra.launcher.{key}", launcher[key], allowed, hint=False)]
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


def unknown_keys(key: str, spec, keys, takes: str) -> List[str]:
    """A problem for each key of the mapping `spec` (at config key `key`) that is not one of `keys`: it names the key,
    the nearest ones, and what `takes` them ("a hook takes", "sites take") with every key: every block's message.

        unknown_keys("patching", {"sorce": "clean"}, PATCH_KEYS, "patching takes")  # ['patching.sorce: unknown ...']
    """
    return [f"{key + '.' if key else ''}{k}: unknown key{suggest(k, keys)}; {takes} {', '.join(map(str, keys))}"
            for k in spec if k not in keys]


def check_choice(key: str, value, choices, use: str = "", hint: bool = True) -> List[str]:
    """[the problem] when `value` is not one of `choices` (a tuple of the schema's, or a dict's keys), else []: it names
    the key, the value, what to use (every choice, or `use`) and, with `hint`, the closest choices."""
    if value in choices:
        return []
    use = use or f"one of {', '.join(map(str, choices))}"
    return [f"{key}: {value!r} is unknown; use {use}{suggest(value, choices) if hint else ''}"]


def either(choices) -> str:
    """'a, b or c': choices as a sentence says them."""
    words = [str(c) for c in choices]
    return f"{', '.join(words[:-1])} or {words[-1]}" if len(words) > 1 else "".join(words)


def is_int(value) -> bool:
    """An int from YAML, not a bool (YAML's true is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or float from YAML, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


def typed_hooks(hooks, kinds) -> Tuple[Dict[str, "HookConfig"], List[str]]:
    """Entries of a hooks block (name -> mapping; `hooks` of the config, or the hooks a method plans) typed as
    HookConfig (kept untyped in the schema so `+hooks.x.kind=...` works), and the problems of those that are not
    hooks; `kinds`: the names of the hook kinds (hookrun.capture.hooks.KINDS, a layer above this one). An entry set
    to null (`hooks.NAME: null` in YAML, `hooks.NAME=null` on the command line) is removed."""
    specs, problems = {}, []
    for name, hook in (hooks or {}).items():
        if hook is None:
            continue  # `hooks.NAME: null` removes a hook an experiment inherited
        if isinstance(hook, dict):
            hook = OmegaConf.create(hook)
        if not isinstance(hook, DictConfig):
            problems.append(f"hooks.{name}: {to_plain(hook)!r} is not a hook; write {{kind: forward, layers: [conv1]}}")
            continue
        unknown = unknown_keys(f"hooks.{name}", hook, HOOK_KEYS, "a hook takes")
        problems += unknown
        if "kind" not in hook:
            problems.append(f"hooks.{name}.kind: missing; set one of {', '.join(kinds)}")
        if unknown or "kind" not in hook:
            continue
        try:
            specs[name] = _seal(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HookConfig),
                                                                    to_plain(hook))))
        except Exception as err:  # noqa: BLE001 - omegaconf type errors name the key
            problems.append(f"hooks.{name}: {err}".splitlines()[0])
    return specs, problems


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
    if not (plain.get("generate") or {}).get("max_new_tokens"):  # no generation: stored and hashed as before it was
        plain.pop("generate", None)
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


UNHASHED = ("store", "progress_s")  # where and how a run is stored, how often it logs: not what it computes
# Keys added after stores were written, with the value that means "not used": left at it, they are not part of the
# hash, so old stores resume (generate: resolved() leaves it out when off)
LATER_KEYS = {("data", "text", "fields"): None, ("generate", "loop"): "auto"}  # and every method's block (below)


def unused_block(method: type):
    """A method's config block as resolved() gives it when the run does not use it (its default)."""
    value = method.factory() if method.factory is not None else method.default
    return json.loads(json.dumps(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value))


def without_later_defaults(config: dict) -> dict:
    """A resolved config without the LATER_KEYS and the methods' blocks left at their unused value: a method added
    after a store was written leaves its hash (and a resume) as it was."""
    from hookrun.config.registry import methods

    config = dict(config)
    for key, method in methods().items():
        if key in config and config[key] == unused_block(method):
            del config[key]
    for path, unused in LATER_KEYS.items():
        node = config
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                break
            node[key] = dict(node[key])
            node = node[key]
        else:
            if path[-1] in node and node[path[-1]] == unused:
                del node[path[-1]]
    return config


def config_hash(resolved: dict) -> str:
    """A short hash of the resolved config, minus what does not change the captures (UNHASHED; resume compares it)."""
    import hashlib
    import json

    body = without_later_defaults({k: v for k, v in resolved.items() if k not in UNHASHED})
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Parsed:
    """A composed config parsed once, at the edge (python -m hookrun, hookrun.run): what everything below reads.

        parsed = parse(cfg)          # cfg: the DictConfig Hydra composed
        parsed.config.store.codec    # the typed, frozen config: RunConfig of dataclasses and plain containers
        parsed.resolved              # the JSON-safe form the store keeps (values of the environment as their ${oc.env:})
        parsed.problems              # (section, problem): unknown keys, entries that are not hooks, a missing model
    """

    config: Any
    resolved: dict
    problems: Tuple[Tuple[str, str], ...] = ()

    def with_store_path(self, path: str) -> "Parsed":
        """This parse with store.path set to `path`, in the typed config and the stored form: what parsing the config
        composed with that path gives (no step of parse reads the path), without parsing it again.

            parsed.with_store_path("runs/a.zarr").config.store.path   # 'runs/a.zarr'
        """
        store = dataclasses.replace(self.config.store, path=path)
        resolved = copy.deepcopy(self.resolved)
        resolved["store"]["path"] = path
        return dataclasses.replace(self, config=_seal(dataclasses.replace(self.config, store=store)), resolved=resolved)


MODEL_MISSING = ("model: missing; pick an experiment with +experiment=NAME (conf/experiment/), a model with "
                 "model=NAME (conf/model/), or give model={_target_: your.module.Class}")


def parse(cfg, kinds=()) -> Parsed:
    """The composed config `cfg` typed and frozen in one step, with every problem of its shape gathered (keys the
    schema lacks are dropped, hooks that are not hooks left out, each with its problem); a value that cannot be
    typed or resolved raises ConfigError naming its key. `kinds`: the hook kinds, for the messages.

        parsed = parse(compose(config_name="config", overrides=["+experiment=conv_fmaps"]))
    """
    if isinstance(cfg, Parsed):
        return cfg
    problems: List[Tuple[str, str]] = []
    plain = OmegaConf.to_container(cfg, resolve=False)
    problems += _drop_unknown(plain, run_schema(), "")
    if problems:  # typed anew without the keys the schema lacks (a structured node cannot drop a key)
        cfg = OmegaConf.merge(OmegaConf.structured(run_schema()), plain)
    else:
        cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        settle_text(cfg)
        options = _storage_option_problems(cfg.store)
        if options:
            problems += [("store", p) for p in options]
            cfg.store.storage_options = None
        if OmegaConf.is_missing(cfg, "model") or cfg.model is None:
            problems.append(("model", MODEL_MISSING))
            cfg.model = None
        try:
            stored = resolved(cfg)
            hooks, hook_problems = typed_hooks(cfg.hooks, kinds)
            cfg.hooks = {}
            config = OmegaConf.to_object(cfg)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - omegaconf's errors name the key
            key = getattr(err, "full_key", "") or "config"
            raise ConfigError([*(p for _, p in problems),
                               f"{key}: {str(err).splitlines()[0]}; fix that value (an interpolation must name a "
                               "key that exists, or give a default: ${oc.env:NAME,default})"]) from None
    problems += [("hooks", p) for p in hook_problems]
    config.hooks = hooks
    return Parsed(_seal(config), stored, tuple(problems))


def _seal(node):
    """`node` with every schema dataclass in it frozen (Frozen); returns it."""
    if isinstance(node, Frozen):
        for f in dataclasses.fields(node):
            _seal(getattr(node, f.name))
        object.__setattr__(node, "_sealed", True)
    elif isinstance(node, dict):
        for value in node.values():
            _seal(value)
    elif isinstance(node, list):
        for value in node:
            _seal(value)
    return node


def _drop_unknown(node: dict, schema: type, prefix: str) -> List[Tuple[str, str]]:
    """(section, problem) for each key of `node` (a plain, unresolved config) that its schema dataclass does not
    have (a `+store.compresion=zstd` typo), recursively into the keys typed as dataclasses, each dropped from `node`;
    free-form keys (model, loss, hooks, dataset) are not walked."""
    found = []
    for key in list(node):
        section = prefix.split(".")[0] or key
        if key not in schema.__dataclass_fields__:
            found.append((section, unknown_key(prefix, key, schema)))
            del node[key]
            continue
        typed = schema_field(schema, key)
        if typed and isinstance(node[key], dict):
            found += _drop_unknown(node[key], typed, f"{prefix}{key}.")
    return found


def _storage_option_problems(store) -> List[str]:
    """store.storage_options that are not a mapping of options, or whose values do not resolve."""
    node = store.get("storage_options")
    if node is None:
        return []
    if not isinstance(node, DictConfig):
        return [f"store.storage_options: {to_plain(node)!r} is not a mapping of fsspec options; give "
                "store.storage_options={key: ..., secret: ...} or +store.storage_options.key=..."]
    for key in node:
        try:
            to_plain(node[key])
        except Exception as err:  # noqa: BLE001 - an interpolation that does not resolve (an unset variable)
            raw = OmegaConf.to_container(node)[key]
            return [f"store.storage_options.{key}: {raw!r} does not resolve ({str(err).splitlines()[0]}); set the "
                    "variable, or give a default: ${oc.env:NAME,default}"]
    return []


TARGET_META = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")  # Hydra's keys, not arguments
IMPORT_FIX = "check the dotted path and that its package is installed"


def target_of(path: str):
    """The function or class a `_target_` names, for the targets hookrun calls itself (edits, losses, metrics).

        fn = target_of("mypkg.edits.flip")
    """
    from hydra.utils import get_method

    return get_method(path)


def check_target(key: str, node, fix: str = IMPORT_FIX, args: Optional[Dict[str, Any]] = None, skip=(),
                 call_fix: str = "") -> List[str]:
    """Problems with a `{_target_: ..., **kwargs}` node: its target must import, be callable and take its arguments.

    Without `args` the node is built as Hydra builds it, `target(*_args_, **kwargs)`; with `args` (by name: an edit's
    {"tensor": ...}) hookrun calls `target(*args, **kwargs)` itself. Keys in `skip` are not arguments; `fix` ends the
    line of a target that does not import, `call_fix` (if any) the line of one that cannot take those arguments."""
    import inspect

    from hydra._internal.utils import _locate

    spec = to_plain(node)
    if not isinstance(spec, dict) or "_target_" not in spec:
        return [f"{key}: {spec!r} has no _target_; give {{_target_: package.module.Class, ...}}"]
    path = spec["_target_"]
    try:
        target = _locate(path)
    except Exception as err:  # noqa: BLE001 - any import failure is the user's to fix
        return [f"{key}._target_: {path!r} does not import ({str(err).strip().splitlines()[-1]}); {fix}"]
    if not callable(target):
        return [f"{key}._target_: {path!r} is a {type(target).__name__}, not a function or class; {fix}"]
    meta = TARGET_META if args is None else ("_target_",)
    kwargs = {k: v for k, v in spec.items() if k not in meta and k not in skip}
    try:
        signature = inspect.signature(target)
    except ValueError:
        return []  # no signature to check (builtins)
    try:
        signature.bind(*(spec.get("_args_", []) if args is None else args.values()), **kwargs)
    except TypeError as err:
        if args is not None:
            return [f"{key}: {path} cannot be called as fn({', '.join([*args, *sorted(kwargs)])}) ({err})"
                    + (f"; {call_fix}" if call_fix else "")]
        return [f"{key}: {path}({', '.join(kwargs)}) does not match its signature ({err}); "
                f"it takes ({', '.join(signature.parameters)})"]
    return pretrained_problems(key, spec) if path.endswith(".from_pretrained") else []


def pretrained_problems(key: str, spec: dict) -> List[str]:
    """A `from_pretrained` whose folder does not exist, said at once (Hugging Face would try the hub for it, ~60 s of
    retries offline). A name that may be the hub's (`gpt2`, `org/name`) and is in no local folder or cache: a warning.

        model: {_target_: transformers.AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path: ./my-llama}
    """
    import os

    arg = "pretrained_model_name_or_path"
    name = spec.get(arg, (spec.get("_args_") or [None])[0])
    where = f"{key}.{arg}" if arg in spec else f"{key}._args_[0]"
    if not isinstance(name, str) or Path(os.path.expanduser(name)).is_dir():
        return []
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name:
        return [f"{where}: {name!r} is not a folder; give the folder save_pretrained wrote (absolute, or relative to "
                f"the directory you run from: {os.getcwd()})"]
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(name, "config.json"), str) or \
            isinstance(try_to_load_from_cache(name, "tokenizer_config.json"), str)
    except Exception:  # noqa: BLE001 - no huggingface_hub, or a name it refuses: from_pretrained says what it says
        return []
    if not cached:
        logging.getLogger("hookrun").warning(
            "%s: %r is no local folder and not in the Hugging Face cache: from_pretrained will download it from the "
            "hub (without a network it retries for about a minute; set HF_HUB_OFFLINE=1 to fail at once)", where, name)
    return []
