"""The words every check of a config says its problems in, and the readings of a config's values they share.

ConfigError gathers the problems (one line each: key, value, what to do); suggest, unknown_keys, check_choice,
either, check_target and pretrained_problems write those lines; is_int, is_number, as_list, to_plain, target_of and
resolve_file read a value as hookrun means it. The checks by kind, one each for every block: check_number (finite,
int or float, in a range with open or closed ends, below a huge bound), check_names and check_unique (names a user
gives: each once, none hookrun's own), check_differ (two roles that must differ). Every module's check (data, capture, store, engine, methods) speaks
through these, so one kind of mistake reads alike wherever it is made. Bottom layer: no other hookrun module.

    from hookrun.config.checks import ConfigError, check_choice, as_list
    problems = check_choice("store.codec", "lz5", ("lz4", "zstd"))   # ["store.codec: 'lz5' is unknown; use ..."]
    if problems: raise ConfigError(problems)
"""
from __future__ import annotations

import difflib
import math
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """Every problem found in a config, one line each: key, value, what to do."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the config:\n{lines}")


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


def resolve_file(name) -> Path:
    """A file a config names: the path as given, or `pkg://package/path` inside an installed package (bundled
    corpora). Usage: `resolve_file("pkg://hookrun.experiments/data/corpus.txt").read_text()`."""
    name = str(name)
    if name.startswith("pkg://"):
        from importlib.resources import files

        package, _, rest = name[len("pkg://"):].partition("/")
        return Path(str(files(package).joinpath(rest)))
    return Path(name)


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


# --- checks by kind: every block's numbers, names and roles say their problems through these ---------------------

HUGE = 10 ** 9  # the default `high` of a count no run needs more of (steps, samples, copies): a typo'd exponent


def _bound(v) -> str:
    return f"{v:g}" if isinstance(v, float) else (f"{v:,}".replace(",", "_") if abs(v) >= 10 ** 5 else str(v))


def number_range(whole: bool, low=None, high=None, open_low: bool = False, open_high: bool = False) -> str:
    """'an integer >= 1', 'a number in (0, 1)': what check_number asks for, as a sentence says it."""
    what = "an integer" if whole else "a number"
    if low is not None and high is not None:
        return f"{what} in {'(' if open_low else '['}{_bound(low)}, {_bound(high)}{')' if open_high else ']'}"
    if low is not None:
        return f"{what} {'>' if open_low else '>='} {_bound(low)}"
    if high is not None:
        return f"{what} {'<' if open_high else '<='} {_bound(high)}"
    return f"a finite {what[2:].lstrip('n ')}" if not whole else "an integer"


def check_number(key: str, value, whole: bool = False, low=None, high=None, open_low: bool = False,
                 open_high: bool = False, null: str = "", fix: str = "") -> List[str]:
    """[the problem] when `value` is not a finite number (an int with `whole`) in its range, else []: the one check of
    every block's numbers. It knows NaN and inf (NaN passes every `<`), a bool (YAML's true is an int to Python), a
    string, and a huge value (past `high`: a typo'd exponent, a run that would not fit). `null` (what null means,
    e.g. "off") accepts None; `fix` (the key's meaning, an example) ends the line.

        problems += check_number("circuit.steps", spec.get("steps"), whole=True, low=1, high=HUGE, fix="e.g. 16")
        problems += check_number("train.adam_beta1", b1, low=0, high=1, open_low=True, open_high=True)
    """
    ask = number_range(whole, low, high, open_low, open_high) + (f" or null ({null})" if null else "")
    tail = f"; give {ask}" + (f" ({fix})" if fix else "")
    if value is None:
        return [] if null else [f"{key}: null{tail}"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return [f"{key}: {value!r} is not a number{tail}"]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{key}: {value!r} is not a finite number (NaN passes every comparison, inf every bound){tail}"]
    if whole and not isinstance(value, int):
        return [f"{key}: {value!r} is not an integer{tail}"]
    if low is not None and (value < low or (open_low and value == low)):
        return [f"{key}: {value!r} is too small{tail}"]
    if high is not None and (value > high or (open_high and value == high)):
        return [f"{key}: {value!r} is too large{tail}"]
    return []


def check_names(key: str, names, reserved=(), patterns=(), what: str = "a name hookrun gives") -> List[str]:
    """Problems with names a user gives (circuits, dictionaries, metrics): each once, none a name hookrun makes itself
    (`reserved`: exact names; `patterns`: names with N for any number, e.g. "top_N", "threshold_N"), which the
    user's would replace silently. `key` is the mapping's key; the line names `key.NAME`, the name and a rename.

        problems += check_names("circuit.circuits", given, reserved=("full", "empty"), patterns=("top_N",))
    """
    import re

    number = r"[0-9][0-9.e+-]*"  # N: any number as hookrun writes it (top_20, threshold_0.05, threshold_1e-05)
    forms = [re.compile("".join(number if c == "N" else re.escape(c) for c in p)) for p in patterns]

    problems, seen = [], set()
    for name in as_list(names):
        text = str(name)
        if text in seen:
            problems.append(f"{key}: {text!r} is given twice; give each name once")
            continue
        seen.add(text)
        if text in reserved or any(f.fullmatch(text) for f in forms):
            made = either([*reserved, *patterns])
            problems.append(f"{key}.{text}: {text!r} is {what} ({made}), which yours would replace silently; "
                            f"rename it (e.g. my_{text})")
    return problems


def check_unique(key: str, values, what: str = "value") -> List[str]:
    """[the problem] when a list a user gives holds a value twice (top_n: [2, 2] would make two circuits top_2)."""
    seen, twice = set(), []
    for v in as_list(values):
        if v in seen and v not in twice:
            twice.append(v)
        seen.add(v)
    if not twice:
        return []
    return [f"{key}: {to_plain(values)!r} lists {either(map(repr, twice))} twice; give each {what} once"]


def check_differ(key_a: str, a, key_b: str, b, why: str, fix: str) -> List[str]:
    """[the problem] when two roles that must differ are the same (`why`: what the run would give; `fix`: the keys to
    set), whatever else the block says (a donor changes nothing here).

        check_differ("circuit.source", "clean", "circuit.target", "clean", "every edge's score is 0", "set ...")
    """
    if a is None or b is None or a != b:
        return []
    return [f"{key_b}: {b!r} is also {key_a}: {why}; {fix}"]


@dataclass(frozen=True)
class Number:
    """What a numeric key takes (check_number's arguments): a block's table of them is its numbers' one check, and
    what the suite's walk over every block's schema reads.

        NUMBERS = {"batch_size": Number(whole=True, low=1), "min_saving": Number(low=0, high=1, open_high=True)}
    """

    whole: bool = False
    low: Any = None
    high: Any = HUGE
    open_low: bool = False
    open_high: bool = False
    null: str = ""
    fix: str = ""


def check_numbers(prefix: str, block, table: Dict[str, Number]) -> List[str]:
    """check_number of each key of `table` in `block` (a mapping: only the keys it has; a dataclass: every field),
    named `prefix.key`.

        problems += check_numbers("store", cfg.store, STORE_NUMBERS)
    """
    problems = []
    for key, n in table.items():
        if isinstance(block, (dict, DictConfig)):
            if key not in block:
                continue
            value = block[key]
        else:
            value = getattr(block, key, None)
        problems += check_number(f"{prefix}.{key}" if prefix else key, value, n.whole, n.low, n.high, n.open_low,
                                 n.open_high, n.null, n.fix)
    return problems
