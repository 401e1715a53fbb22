"""The composed config parsed once, at the edge (python -m hookrun, hookrun.run, the runner): typed and frozen, in
the resolved form the store keeps, with its hash (what a resume compares), and every problem of its shape gathered.

    parsed = parse(cfg)           # cfg: the DictConfig Hydra composed
    parsed.config.store.codec     # the typed, frozen config (RunConfig of hookrun.config.schema)
    parsed.resolved               # the JSON-safe form the store keeps
    parsed.config_hash            # config_hash(parsed.resolved), made once: the run holds it

Below this module nothing reads omegaconf (pyproject.toml's import-linter contract).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from hookrun.config.checks import ConfigError, to_plain, unknown_keys
from hookrun.config.schema import Frozen, HookConfig, TextConfig, run_schema, schema_field, unknown_key


def settle_text(cfg) -> None:
    """`data.text` left at the schema's defaults (no key of it given) set to None: the run has no text."""
    text = cfg.data.get("text")
    if text is not None and OmegaConf.to_container(text) == _text_defaults():
        cfg.data.text = None


@functools.lru_cache(maxsize=None)
def _text_defaults() -> dict:
    """The schema's `data.text` defaults as plain containers (made once: ~10 ms of omegaconf a parse); read only."""
    return OmegaConf.to_container(OmegaConf.structured(TextConfig))


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
    """A short hash of the resolved config, minus what does not change the captures (UNHASHED; resume compares it).
    parse() makes it once (Parsed.config_hash); the run holds it."""
    body = without_later_defaults({k: v for k, v in resolved.items() if k not in UNHASHED})
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Parsed:
    """A composed config parsed once, at the edge (python -m hookrun, hookrun.run): what everything below reads.

        parsed = parse(cfg)          # cfg: the DictConfig Hydra composed
        parsed.config.store.codec    # the typed, frozen config: RunConfig of dataclasses and plain containers
        parsed.resolved              # the JSON-safe form the store keeps (values of the environment as their ${oc.env:})
        parsed.problems              # (section, problem): unknown keys, entries that are not hooks, a missing model
        parsed.config_hash           # config_hash(parsed.resolved): the store's config_hash, made once a run
    """

    config: Any
    resolved: dict
    config_hash: str
    problems: Tuple[Tuple[str, str], ...] = ()

    def with_store_path(self, path: str) -> "Parsed":
        """This parse with store.path set to `path`, in the typed config and the stored form: what parsing the config
        composed with that path gives (no step of parse reads the path, the hash leaves the store out), without
        parsing it again.

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
    return Parsed(_seal(config), stored, config_hash(stored), tuple(problems))


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
