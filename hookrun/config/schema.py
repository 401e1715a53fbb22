"""The config's schema: every key a hookrun experiment takes, typed, registered with Hydra's ConfigStore.

The schema types every top-level key of the config and is its one source of truth: each field holds its default,
its allowed values (the tuples beside it, which the checks use) and its help text (the README's tables:
hookrun.config.table); the YAML files set only what differs. Beside it in this bottom layer (no other hookrun
module imported): the words of every check (hookrun.config.checks), the parse and the hash
(hookrun.config.parsing), the command line's checks (hookrun.config.commandline); `hookrun.engine.checks` gathers
every module's checks above it.

    from hookrun.config.schema import StoreConfig, run_schema
    run_schema()                      # RunConfig: CoreConfig's keys and each method's block
    StoreConfig().codec               # 'lz4', the default
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hookrun.config.checks import unknown_keys


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


@functools.lru_cache(maxsize=None)
def type_hints(schema: type) -> dict:
    """A schema dataclass's field types (typing.get_type_hints, evaluated once a class: ~0.7 ms a call, 80 calls a
    parse)."""
    return typing.get_type_hints(schema)


def schema_field(schema: type, name: str) -> Optional[type]:
    """The dataclass a schema field is typed as (through Optional), or None for a free-form or plain field."""
    hint = type_hints(schema)[name]
    return next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)


def named_item(schema: type, name: str) -> Optional[type]:
    """The dataclass of the named entries of a field: HookConfig for `hooks` (untyped in the schema, so that
    `+hooks.x.kind=...` works), a Dict[str, dataclass]'s value type; else None."""
    if name == "hooks":
        return HookConfig
    hint = type_hints(schema)[name]
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


def conf_dir() -> Path:
    """The folder of the bundled Hydra configs (the package hookrun.conf: conf/ in a clone, inside the wheel)."""
    from importlib.resources import files

    return Path(str(files("hookrun.conf")))
