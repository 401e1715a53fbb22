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

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from hookrun.config.schema import ConfigError, to_plain
from hookrun.capture.shrink import DTYPES

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
    table: Optional[object] = None  # text batches: the token table rows (sample, position, token_id, token)

    def head(self, n: int) -> "Batch":
        """The model inputs of the first `n` samples (tensors with the batch's sample count on axis 0 are cut)."""
        size = self.stop - self.start
        cut = lambda v: v[:n] if isinstance(v, torch.Tensor) and v.dim() and len(v) == size else v  # noqa: E731
        return Batch([cut(a) for a in self.args], {k: cut(v) for k, v in self.kwargs.items()}, {}, self.start,
                     self.start + min(n, size))

    def to(self, device: torch.device) -> "Batch":
        move = lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return Batch([move(a) for a in self.args], {k: move(v) for k, v in self.kwargs.items()},
                     {k: move(v) for k, v in self.targets.items()}, self.start, self.stop,
                     {k: move(v) for k, v in self.fields.items()},
                     self.tokens.to(device) if self.tokens is not None else None, self.table)


def check_spec(data) -> List[str]:
    """Problems with the `data` entry (inputs, dataset, batching), found without loading anything."""
    from hookrun.config.schema import check_target, suggest

    problems = []
    if data.batch_size is None or data.batch_size <= 0:
        problems.append(f"data.batch_size: {data.batch_size} must be a positive integer")
    if data.num_workers < 0:
        problems.append(f"data.num_workers: {data.num_workers} must be >= 0 (0 = load in the main process)")
    if data.stride <= 0:
        problems.append(f"data.stride: {data.stride} must be >= 1")
    if data.max_samples is not None and data.max_samples <= 0:
        problems.append(f"data.max_samples: {data.max_samples} must be a positive integer or null")
    sources = [k for k in ("inputs", "dataset", "text") if data.get(k)]
    if not sources:
        problems.append("data: no inputs; give data.inputs {name: tensor spec}, data.dataset {_target_: ...} "
                        "or data.text {files: [...], tokenizer: ...}")
    if len(sources) > 1:
        problems.append(f"data: {' and '.join(sources)} are set; keep one of them")
    for name, spec in (data.inputs or {}).items():
        problems += check_tensor_spec(f"data.inputs.{name}", to_plain(spec))
    if data.dataset is not None:
        problems += check_target("data.dataset", data.dataset)
    for t in data.targets:
        if data.inputs and t not in data.inputs:
            problems.append(f"data.targets: {t!r} is not one of data.inputs{suggest(t, data.inputs.keys())}")
    if data.inputs and data.targets and len(data.targets) == len(data.inputs):
        problems.append("data.targets: every input is a target; the model needs at least one input")
    return problems


def check_tensor_spec(key: str, spec) -> List[str]:
    """Problems with one input spec."""
    if isinstance(spec, (int, float, list)) or (isinstance(spec, dict) and "value" in spec):
        value = spec["value"] if isinstance(spec, dict) else spec
        bad = _non_numbers(value)
        if bad:
            return [f"{key}: {bad[0]!r} is not a number; a literal input holds numbers (nested lists of them); "
                    "write nan or inf (unquoted) for non-finite values"]
        if not isinstance(spec, dict):
            return []
    if not isinstance(spec, dict):
        return [f"{key}: {spec!r} is not a tensor spec; write a number, a list, {{fill, shape}}, "
                "{random: normal, shape}, {file: path} or {value, dtype}"]
    problems = []
    if "dtype" in spec and spec["dtype"] not in DTYPES:
        problems.append(f"{key}.dtype: {spec['dtype']!r} is unknown; use one of {', '.join(DTYPES)}")
    if "file" in spec and not Path(spec["file"]).exists():
        problems.append(f"{key}.file: {spec['file']!r} does not exist")
    if "random" in spec and spec["random"] not in RANDOM:
        problems.append(f"{key}.random: {spec['random']!r} is unknown; use one of {', '.join(RANDOM)}")
    if ("fill" in spec or "random" in spec) and not isinstance(spec.get("shape"), list):
        problems.append(f"{key}.shape: missing; give the full shape, e.g. shape: [8, 3, 32, 32]")
    if spec.get("random") == "randint" and "high" not in spec:
        problems.append(f"{key}.high: random: randint needs high (exclusive), e.g. high: 1000")
    if not {"value", "fill", "random", "file"} & set(spec):
        problems.append(f"{key}: needs one of value, fill, random or file")
    return problems


def make_tensor(spec, seed: int) -> torch.Tensor:
    """A tensor from a spec (see the module docstring)."""
    if not isinstance(spec, dict):
        spec = {"value": spec}
    dtype = DTYPES.get(spec.get("dtype")) if spec.get("dtype") else None
    if "value" in spec:
        value = spec["value"]
        t = torch.tensor(value, dtype=dtype or (torch.float32 if _has_float(value) else None))
    elif "fill" in spec:
        t = torch.full(spec["shape"], spec["fill"], dtype=dtype or torch.float32)
    elif "file" in spec:
        path = Path(spec["file"])
        t = torch.load(path) if path.suffix == ".pt" else torch.from_numpy(np.load(path))
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


class Inputs:
    """Batches for a run: `len(samples)` if known, and an iterator over `Batch`es on the CPU."""

    def __init__(self, data_cfg, seed: int):
        self.cfg = data_cfg
        self.seed = seed
        self.tensors: Optional[Dict[str, torch.Tensor]] = None
        self.dataset = None
        self._shapes: Dict[str, Optional[tuple]] = {}  # per-sample shape of each input in the first batch
        if data_cfg.inputs:
            self.tensors = {name: make_tensor(to_plain(spec), seed + i)
                            for i, (name, spec) in enumerate(data_cfg.inputs.items())}
        else:
            from hydra.utils import instantiate

            self.dataset = instantiate(data_cfg.dataset)

    @property
    def batched(self) -> bool:
        return bool(self.cfg.batched) or self.dataset is not None

    def sample_count(self) -> Optional[int]:
        """Samples the run will see (after max_samples and stride), None if the dataset has no len()."""
        ranges = self.ranges()
        return None if ranges is None else sum(stop - start for start, stop in ranges)

    def batch_count(self) -> Optional[int]:
        """Batches the run will see, None if unknown."""
        ranges = self.ranges()
        return None if ranges is None else len(ranges)

    def check_lengths(self) -> List[str]:
        """Problems with how many samples there are: none at all, or inputs of different lengths."""
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
        bs, out, left = self.cfg.batch_size, [], self.cfg.max_samples
        for start in range(0, n, bs * self.cfg.stride):
            size = min(bs, n - start) if left is None else min(bs, n - start, left)
            out.append((start, start + size))
            if left is not None:
                left -= size
                if left <= 0:
                    break
        return out

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

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
        items, start, i, done = iter(self.dataset), 0, 0, 0
        bs, limit = self.cfg.batch_size, self.cfg.max_samples
        while limit is None or done < limit:
            kept = i % self.cfg.stride == 0  # stride skips whole batches; max_samples cuts only kept ones
            seed_everything(self.seed + i // self.cfg.stride)  # the run's batch number, as for map-style data
            size = bs if limit is None or not kept else min(bs, limit - done)
            chunk = [item for _, item in zip(range(size), items)]
            if not chunk:
                return
            if kept:
                if i // self.cfg.stride >= first:
                    yield self._checked(self._fields(self.collate(chunk)), start, start + len(chunk))
                done += len(chunk)
            start += len(chunk)
            i += 1
            if len(chunk) < size:
                return

    def collate(self, items: list):
        """Items of one batch as one batched structure (torch's default collate)."""
        return torch.utils.data.default_collate(items)

    def _fields(self, item) -> Dict[str, torch.Tensor]:
        """A collated batch as {field name: tensor}: a tensor, a dict, or a tuple named by data.fields."""
        if isinstance(item, torch.Tensor):
            return {(self.cfg.fields or ["input"])[0]: item}
        if isinstance(item, dict):
            return dict(item)
        names = list(self.cfg.fields or [str(i) for i in range(len(item))])
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
    """Seed torch, numpy's global RNG and random: what a batch's loading and forward may draw from."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


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
