"""Input builders: literal tensors, constant or random tensors, files, and any torch Dataset; batching.

    data:
      inputs:                                   # name -> tensor spec, passed in this order
        x: [[1.0], [2.0]]                       # a literal (numbers, nested lists)
        ones: {fill: 1.0, shape: [8, 1, 4, 4]}  # a constant
        noise: {random: normal, shape: [64, 3, 32, 32], seed: 0}   # normal | uniform | randint
        img: {file: batch.npy}                  # .npy or .pt
      targets: [y]                              # fields for the loss, not the model
      batch_size: 16
    data:
      dataset: {_target_: torchvision.datasets.FakeData, size: 100, transform: ...}
      fields: [image, label]                    # names of the dataset's tuple items
      targets: [label]
"""
from __future__ import annotations

import functools
import itertools
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from hookrun.config.checks import (ConfigError, Number, check_choice, check_number, check_numbers, is_int,
                                   suggest)
from hookrun.capture.shrink import DTYPES
from hookrun.data.batching import Batches, batch_ranges, slices

RANDOM = ("normal", "uniform", "randint")



@dataclass
class Batch:
    """One batch: positional and keyword model inputs, targets for the loss, and its sample range."""

    args: list
    kwargs: dict
    targets: Dict[str, torch.Tensor]
    start: int
    stop: int
    fields: Dict[str, torch.Tensor] = field(default_factory=dict)  # every field by name
    tokens: Optional[object] = None  # text batches: a tokens.TokenInfo (real and stored tokens)
    table: Optional[object] = None  # text batches: the token table rows (sample, position, token_id, token), Columns
    roles: Optional[dict] = None  # paired prompts (data.text.fields): role -> (keyword inputs, TokenInfo)

    def head(self, n: int) -> "Batch":
        """The model inputs of the first `n` samples (tensors with the batch's sample count on axis 0 are cut)."""
        size = self.stop - self.start
        cut = lambda v: v[:n] if isinstance(v, torch.Tensor) and v.dim() and len(v) == size else v  # noqa: E731
        roles = {r: ({k: cut(v) for k, v in kw.items()}, _head_tokens(info, n)) for r, (kw, info) in
                 self.roles.items()} if self.roles else None
        return Batch([cut(a) for a in self.args], {k: cut(v) for k, v in self.kwargs.items()}, {}, self.start,
                     self.start + min(n, size), roles=roles)

    def to(self, device: torch.device) -> "Batch":
        move = lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return Batch([move(a) for a in self.args], {k: move(v) for k, v in self.kwargs.items()},
                     {k: move(v) for k, v in self.targets.items()}, self.start, self.stop,
                     {k: move(v) for k, v in self.fields.items()},
                     self.tokens.to(device) if self.tokens is not None else None, self.table,
                     {r: ({k: move(v) for k, v in kw.items()}, info.to(device)) for r, (kw, info) in self.roles.items()}
                     if self.roles else None)


def _head_tokens(info, n: int):
    """The TokenInfo of a text batch's first `n` samples."""
    return type(info).of_batch(info.mask[:n], info.keep[:n], info.max_length)


NUMBERS = {"batch_size": Number(whole=True, low=1, fix="samples per forward pass"),
           "max_samples": Number(whole=True, low=1, null="every sample"),
           "stride": Number(whole=True, low=1, fix="every stride-th batch"),
           "num_workers": Number(whole=True, low=0, high=1024, fix="0 = load in the main process")}


def check_spec(data) -> List[str]:
    """Problems with the `data` entry (inputs, dataset, batching), found without loading anything."""
    from hookrun.config.checks import check_target

    problems = check_numbers("data", data, NUMBERS)
    sources = [k for k in ("inputs", "dataset", "text") if getattr(data, k)]
    if not sources:
        problems.append("data: no inputs; give data.inputs {name: tensor spec}, data.dataset {_target_: ...} "
                        "or data.text {files: [...], tokenizer: ...}")
    if len(sources) > 1:
        drop = {"inputs": " ".join(f"~data.inputs.{n}" for n in data.inputs or {}), "dataset": "data.dataset=null",
                "text": "data.text=null"}
        problems.append(f"data: {' and '.join(sources)} are set; keep one of them (on the command line, drop one with "
                        f"{' or '.join(drop[k] for k in sources)})")
    for name, spec in (data.inputs or {}).items():
        problems += check_tensor_spec(f"data.inputs.{name}", spec)
    if data.dataset is not None:
        problems += check_target("data.dataset", data.dataset)
    for t in data.targets:
        if data.inputs and t not in data.inputs:
            problems.append(f"data.targets: {t!r} is not one of data.inputs{suggest(t, data.inputs.keys())}")
    if data.inputs and data.targets and len(data.targets) == len(data.inputs):
        problems.append("data.targets: every input is a target; the model needs at least one input")
    return problems


SOURCES = {"value": ("dtype",), "fill": ("shape", "dtype"), "random": ("shape", "dtype", "seed", "low", "high"),
           "file": ("dtype",)}  # a spec's source and the keys that go with it
SUFFIXES = (".npy", ".pt")


def check_tensor_spec(key: str, spec) -> List[str]:
    """Problems with one input spec, found without making the tensor."""
    if not isinstance(spec, dict):
        if isinstance(spec, (int, float, list)):
            return _literal_problems(key, spec)
        return [f"{key}: {spec!r} is not a tensor spec; write a number, a list, {{fill, shape}}, "
                "{random: normal, shape}, {file: path} or {value, dtype}"]
    sources = [k for k in SOURCES if k in spec]
    if len(sources) != 1:
        return [f"{key}: {'has ' + ' and '.join(sources) if sources else 'needs one of value, fill, random or file'}; "
                "give exactly one of value, fill, random or file"]
    source = sources[0]
    allowed = (source, *SOURCES[source])
    problems = [f"{key}.{k}: unknown key for a {source} input{suggest(k, allowed)}; it takes {', '.join(allowed)}"
                for k in spec if k not in allowed]
    if "dtype" in spec:
        problems += check_choice(f"{key}.dtype", spec["dtype"], DTYPES, hint=False)
    if source == "value":
        problems += _literal_problems(f"{key}.value", spec["value"])
    elif source == "file":
        path = Path(str(spec["file"]))
        if path.suffix not in SUFFIXES:
            problems.append(f"{key}.file: {str(path)!r} is not .npy or .pt; save the array with numpy.save or the "
                            "tensor with torch.save")
        else:
            problems += missing_file(f"{key}.file", path)
    else:
        problems += _drawn_problems(key, spec)
    return problems


def _literal_problems(key: str, value) -> List[str]:
    bad = _non_numbers(value)
    if bad:
        return [f"{key}: {bad[0]!r} is not a number; a literal input holds numbers (nested lists of them); "
                "write nan or inf (unquoted) for non-finite values"]
    if _shape_of(value) is None:
        return [f"{key}: {value!r} is ragged (lists of different lengths at one depth); a tensor's rows all have "
                "one length: pad them"]
    return []


def _drawn_problems(key: str, spec: dict) -> List[str]:
    """Problems of a fill or random spec: its shape, fill value, distribution, bounds, seed and dtype."""
    shape, kind = spec.get("shape"), spec.get("random")
    problems = []
    if not isinstance(shape, list):
        problems.append(f"{key}.shape: {'missing' if shape is None else repr(shape) + ' is not a list'}; give the "
                        "full shape, e.g. shape: [8, 3, 32, 32]")
    elif not all(is_int(d) and d >= 0 for d in shape):
        problems.append(f"{key}.shape: {shape} must hold whole numbers >= 0, e.g. shape: [8, 3, 32, 32]")
    if "fill" in spec:
        problems += check_number(f"{key}.fill", spec["fill"], high=None, fix="the value every element holds")
    if "random" in spec:
        problems += check_choice(f"{key}.random", kind, RANDOM)
    if kind == "randint" and "high" not in spec:
        problems.append(f"{key}.high: random: randint needs high (exclusive), e.g. high: 1000")
    if kind in ("randint", "uniform"):
        low, high = spec.get("low", 0), spec.get("high", 1)
        whole = kind == "randint"
        for name, v in (("low", low), ("high", high)):
            problems += check_number(f"{key}.{name}", v, whole, high=None)
        if not check_number("", low, whole, high=None) and not check_number("", high, whole, high=None) and \
                low >= high:
            problems.append(f"{key}: low {low} >= high {high}; random: {kind} draws from [low, high): give low < high")
    elif kind == "normal":
        problems += [f"{key}.{k}: random: normal takes no {k} (it draws from N(0, 1))" for k in ("low", "high")
                     if k in spec]
    if kind in ("normal", "uniform") and spec.get("dtype") in DTYPES and not DTYPES[spec["dtype"]].is_floating_point:
        problems.append(f"{key}.dtype: random: {kind} draws real numbers, not {spec['dtype']}; use a float dtype, "
                        "or random: randint for integers")
    if "seed" in spec and not is_int(spec["seed"]):
        problems.append(f"{key}.seed: {spec['seed']!r} is not a whole number")
    return problems


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), or its type's name."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def build(key: str, node):
    """`instantiate(node)`; a failure is a ConfigError naming `key` (what it was given is the user's to fix)."""
    from hydra.utils import instantiate

    try:
        return instantiate(node)
    except Exception as err:  # noqa: BLE001 - Hydra's InstantiationException wraps the target's own error
        cause = err.__cause__ or err
        target = node.get("_target_") if isinstance(node, dict) else node
        if isinstance(cause, ModuleNotFoundError):
            raise ConfigError([missing_module(key, target, cause)]) from err
        if isinstance(cause, ConfigError):  # the target's own refusal (model.path: not a folder): said as it is
            raise ConfigError(cause.problems) from None
        raise ConfigError([f"{key}: building {target} failed ({type(cause).__name__}: {first_line(cause)}); check "
                           f"{key}'s arguments (HYDRA_FULL_ERROR=1 shows the traceback)"]) from err


EXTRAS = {"transformers": "lm", "tokenizers": "lm", "datasets": "lm", "s3fs": "s3", "xarray": "xarray",
          "dask": "xarray"}  # modules hookrun's extras bring (pyproject.toml)


def missing_module(key: str, target, err: ModuleNotFoundError) -> str:
    """The line for a `_target_` that needs a package that is not installed, with the install command."""
    top = (err.name or "").split(".")[0]
    fix = f'pip install "hookrun[{EXTRAS[top]}]"' if top in EXTRAS else f"pip install {top}"
    return f"{key}: building {target} needs the module {top!r}, which is not installed; {fix}"


def make_tensor(key: str, spec, seed: int) -> torch.Tensor:
    """A tensor from a spec (see the module docstring) that check_tensor_spec passed; `key` names it in errors."""
    if not isinstance(spec, dict):
        spec = {"value": spec}
    dtype = DTYPES.get(spec.get("dtype")) if spec.get("dtype") else None
    if "value" in spec:
        value = spec["value"]
        t = torch.tensor(value, dtype=dtype or (torch.float32 if _has_float(value) else None))
    elif "fill" in spec:
        t = torch.full(spec["shape"], spec["fill"], dtype=dtype or torch.float32)
    elif "file" in spec:
        t = load_file(f"{key}.file", Path(spec["file"]))
        t = t.to(dtype) if dtype else t
    else:
        g = torch.Generator().manual_seed(int(spec.get("seed", seed)))
        shape, kind = spec["shape"], spec["random"]
        if kind == "normal":
            t = torch.randn(shape, generator=g, dtype=dtype or torch.float32)
        elif kind == "uniform":
            low, high = spec.get("low", 0.0), spec.get("high", 1.0)
            t = low + (high - low) * torch.rand(shape, generator=g, dtype=dtype or torch.float32)
        else:
            t = torch.randint(spec.get("low", 0), spec["high"], shape, generator=g, dtype=dtype or torch.long)
    return t


def load_file(key: str, path: Path) -> torch.Tensor:
    """The one tensor a .npy (numpy.save) or .pt (torch.save) file holds; a .pt file is read with
    weights_only=True (no code in it runs), onto the CPU."""
    try:
        if path.suffix == ".pt":
            t = torch.load(path, map_location="cpu", weights_only=True)
        else:
            t = np.load(path)  # allow_pickle=False: no code in the file runs
            t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
    except Exception as err:  # noqa: BLE001 - what a file holds is the user's to fix
        reason = f"{type(err).__name__}: {first_line(err)}"
        if isinstance(err, pickle.UnpicklingError):
            reason = ("not a torch.save file of tensors alone: .pt files are read with weights_only=True, so no "
                      "code in them runs")
        raise ConfigError([f"{key}: {str(path)!r} does not load ({reason}); give an array saved with numpy.save "
                           "(numbers, no Python objects) or one tensor saved with torch.save"]) from None
    if not isinstance(t, torch.Tensor):
        raise ConfigError([f"{key}: {str(path)!r} holds a {type(t).__name__}, not one array or tensor; save a single "
                           "tensor (torch.save(tensor, path)) or array (numpy.save), one file per input"])
    return t


def _shape_of(value) -> Optional[tuple]:
    """The shape of nested lists, None if ragged."""
    if not isinstance(value, list):
        return ()
    shapes = {_shape_of(v) for v in value}
    if None in shapes or len(shapes) > 1:
        return None
    return (len(value), *next(iter(shapes), ()))


def missing_file(key: str, path: Path, given=None) -> List[str]:
    """The problem with a file a key names (`given`, as the user wrote it) that is not there, else none."""
    if path.is_file():
        return []
    return [f"{key}: {str(given or path)!r} {'is a directory' if path.is_dir() else 'does not exist'} "
            "(relative paths start at the launch directory)"]


def _non_numbers(value) -> list:
    if isinstance(value, list):
        return [b for v in value for b in _non_numbers(v)]
    return [] if isinstance(value, (int, float, bool)) else [value]


def _has_float(value) -> bool:
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return isinstance(value, float)


def token_sequences(dataset) -> Optional[list]:
    """A map-style dataset of 1-D integer tensors (token ids, any lengths) as lists of ids; None otherwise."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__") or not len(dataset):
        return None
    first = dataset[0]
    if not (isinstance(first, torch.Tensor) and first.dim() == 1 and not first.is_floating_point()
            and first.dtype != torch.bool):
        return None
    return [dataset[i].tolist() for i in range(len(dataset))]


class Inputs(Batches):
    """Batches for a run: `len(samples)` if known, and an iterator over `Batch`es on the CPU."""

    def __init__(self, data_cfg, seed: int):
        self.cfg = data_cfg
        self.seed = seed
        self.tensors: Optional[Dict[str, torch.Tensor]] = None
        self.dataset = None
        self._shapes: Dict[str, Optional[tuple]] = {}  # per-sample shape of each input in the first batch
        if data_cfg.inputs:
            self.tensors = {}
            for i, (name, spec) in enumerate(data_cfg.inputs.items()):
                key, spec = f"data.inputs.{name}", spec
                try:
                    self.tensors[name] = make_tensor(key, spec, seed + i)
                except ConfigError:
                    raise
                except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError) as err:  # what checks miss
                    raise ConfigError([f"{key}: {spec!r} cannot be made ({type(err).__name__}: {first_line(err)}); "
                                       "check its shape, dtype and values"]) from None
        else:
            self.dataset = build("data.dataset", data_cfg.dataset)

    @property
    def batched(self) -> bool:
        return bool(self.cfg.batched) or self.dataset is not None

    def check(self, model=None, model_cfg=None) -> List[str]:
        """Problems with how many samples there are: none at all, or inputs of different lengths (the model is
        TextInputs.check's to check against)."""
        if self.dataset is not None and hasattr(self.dataset, "__len__") and len(self.dataset) == 0:
            return [f"data.dataset: {type(self.dataset).__name__} has no items (len 0); point it at data that "
                    "holds samples"]
        if self.tensors is None or not self.batched:
            return []
        lengths = {name: (len(t) if t.dim() else 0) for name, t in self.tensors.items()}
        if len(set(lengths.values())) > 1 or 0 in lengths.values():
            return [f"data.inputs: axis 0 is the sample axis but the inputs have {lengths} samples; "
                    "give every input the same number of rows, or set data.batched=false to pass each whole"]
        return []

    def _split(self, fields: Dict[str, torch.Tensor], start: int, stop: int) -> Batch:
        targets = {k: v for k, v in fields.items() if k in self.cfg.targets}
        model_in = {k: v for k, v in fields.items() if k not in self.cfg.targets}
        if self.cfg.keyword:
            return Batch([], model_in, targets, start, stop, fields)
        return Batch(list(model_in.values()), {}, targets, start, stop, fields)

    def ranges(self) -> Optional[List[Tuple[int, int]]]:
        """The sample range [start, stop) of every batch the run sees (stride and max_samples applied),
        or None for a dataset without len()."""
        if self.tensors is not None and not self.batched:
            return [(0, 1)]
        if self.tensors is not None:
            n = len(next(iter(self.tensors.values())))
        elif hasattr(self.dataset, "__len__") and hasattr(self.dataset, "__getitem__"):
            n = len(self.dataset)
        else:
            return None
        return batch_ranges(self.cfg.batch_size, self.cfg.stride, self.cfg.max_samples, n)

    def batches(self, first: int = 0) -> Iterator[Batch]:
        """Batches from batch `first` on. Every batch's items are loaded right after seeding torch, numpy
        and random with seed + batch (in the DataLoader worker that loads them), so a dataset that draws
        random numbers gives the same batch whether the run starts at batch 0 or resumes at `first`."""
        ranges = self.ranges()
        if self.tensors is not None and not self.batched:
            yield self._split(dict(self.tensors), 0, 1)
            return
        if self.tensors is not None:
            for start, stop in ranges[first:]:
                yield self._checked({k: v[start:stop] for k, v in self.tensors.items()}, start, stop)
            return
        if ranges is None:
            yield from self._iterable_batches(first)
            return
        loader = torch.utils.data.DataLoader(_SeededBatches(self.dataset, ranges, self.seed, self.collate),
                                             batch_size=None, sampler=range(first, len(ranges)),
                                             num_workers=self.cfg.num_workers)
        for (start, stop), item in zip(ranges[first:], loader):
            yield self._checked(self._fields(item), start, stop)

    def _iterable_batches(self, first: int) -> Iterator[Batch]:
        """A dataset without len(): read in order, each batch seeded before its items are drawn; batches
        before `first` are drawn (the same way) and dropped, so the stream stays the same."""
        items, stride = iter(self.dataset), self.cfg.stride
        for i, (start, stop, kept) in enumerate(slices(self.cfg.batch_size, stride, self.cfg.max_samples)):
            seed_everything(self.seed + i // stride)  # the run's batch number, as for map-style data
            chunk = list(itertools.islice(items, stop - start))
            if not chunk:
                return
            if kept and i // stride >= first:
                yield self._checked(self._fields(self.collate(chunk)), start, start + len(chunk))
            if len(chunk) < stop - start:
                return

    def collate(self, items: list):
        """Items of one batch as one batched structure (torch's default collate)."""
        return torch.utils.data.default_collate(items)

    def _fields(self, item) -> Dict[str, torch.Tensor]:
        """A collated batch as {field name: tensor}: a tensor, a dict, or a tuple named by data.fields."""
        fields = list(self.cfg.fields or [])
        if isinstance(item, torch.Tensor) and len(fields) > 1:
            raise ConfigError([f"data.fields: {fields} names {len(fields)} items but the dataset yields one tensor; "
                               "give one name (data.fields=[image]) or none"])
        if isinstance(item, torch.Tensor):
            return {(fields or ["input"])[0]: item}
        if isinstance(item, dict) and fields:
            raise ConfigError([f"data.fields: {fields} names tuple items but the dataset yields dicts (keys "
                               f"{', '.join(map(str, item))}), whose keys name the fields; drop data.fields"])
        if isinstance(item, dict):
            return dict(item)
        names = fields or [str(i) for i in range(len(item))]
        if len(names) != len(item):
            raise ConfigError([f"data.fields: {names} names {len(names)} items but the dataset yields {len(item)}; "
                               "name each item, e.g. data.fields=[image,label]"])
        return dict(zip(names, item))

    def _checked(self, fields: Dict[str, torch.Tensor], start: int, stop: int) -> Batch:
        """The batch, after checking that every input keeps the per-sample shape of the first batch."""
        for name, value in fields.items():
            shape = tuple(value.shape[1:]) if isinstance(value, torch.Tensor) else None
            if self._shapes.setdefault(name, shape) != shape:
                raise ConfigError(
                    [f"data: input {name!r} has per-sample shape {list(shape)} in the batch at sample {start} but "
                     f"{list(self._shapes[name])} in the first batch; captures need one shape per array: pad or crop "
                     "the inputs to a fixed size (e.g. in the dataset's transform)"])
        return self._split(fields, start, stop)


def seed_everything(seed: int) -> None:
    """Seed torch, numpy's global RNG and random: what a batch's loading and forward may draw from. Where torch has
    no accelerator to seed, only its CPU generator (torch.manual_seed queues a lazy seed of each absent accelerator
    with a formatted stack: ~1 ms, a run's batches each)."""
    if _accelerators():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@functools.lru_cache(maxsize=None)
def _accelerators() -> bool:
    """Whether torch.manual_seed has more than the CPU generator to seed in this process: CUDA, MPS, XPU, MTIA or a
    custom (privateuse1) backend."""
    kinds = [getattr(torch, name, None) for name in ("cuda", "xpu", "mtia")] + [torch.backends.mps]
    if any(kind is not None and kind.is_available() for kind in kinds):
        return True
    return hasattr(torch, torch._C._get_privateuse1_backend_name())


class _SeededBatches(torch.utils.data.Dataset):
    """Batch i of a map-style dataset, loaded right after seeding with seed + i (in whichever process
    loads it), then collated: what makes a dataset's randomness replay on resume."""

    def __init__(self, dataset, ranges: List[Tuple[int, int]], seed: int, collate):
        self.dataset, self.ranges, self.seed, self.collate = dataset, ranges, seed, collate

    def __len__(self) -> int:
        return len(self.ranges)

    def __getitem__(self, i: int):
        seed_everything(self.seed + i)
        start, stop = self.ranges[i]
        return self.collate([self.dataset[j] for j in range(start, stop)])
