"""Where an edit's values come from: numbers, a file, the mean of another run's captures (or the difference of two
runs' means: a steering direction), and another run's per-token rows (patching across prompts).

    edit: [{op: add, value: [0.1, -0.2, 0.3], coef: 2}]                       # a vector over the last axis
    edit: [{op: add, file: direction.npy, coef: 4, positions: last}]
    edit: [{op: add, value: {store: runs/a, hook: resid, layer: transformer.h.1, reduce: mean}, coef: 4}]
    edit: [{op: add, value: {diff: [{store: runs/pos}, {store: runs/neg}], reduce: mean}}]   # mean(pos) - mean(neg)
    edit: [{op: replace, store: runs/clean, hook: resid, positions: last, source: {position: last}}]

A value is loaded once, when the edits are compiled. A patch (`replace` with `store:`) reads, each batch, the
source run's rows of the mapped (sample, position): `source.sample` same (the target's own sample number) | an
int | a per-sample field of the data; `source.position` same | last | first | an int | a list (one per target
position). With `position: same` the token ids under the patch must be the same in both runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import pandas as pd
import torch

from hookrun.capture import tokens
from hookrun.capture.checks import finite_problems
from hookrun.config.checks import ConfigError, as_list, is_int, is_number
from hookrun.format.layout import COMPLETE
from hookrun.format.files import find_store
from hookrun.read.captures import open as open_captures

REF_KEYS = ("store", "hook", "layer", "role", "call", "reduce")
REDUCTIONS = ("mean",)
SOURCE_KEYS = ("sample", "position")


class SourceError(RuntimeError):
    """A value that does not fit the tensor it meets, or a patch that cannot take its rows from the source run (a
    sample or position it lacks, other tokens); `key` names the setting (hooks.<name>.edit[<i>].value)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


def _numbers(v) -> bool:
    return is_number(v) or \
        (isinstance(v, list) and bool(v) and all(_numbers(x) for x in v))


def store_problems(key: str, store) -> List[str]:
    """Problems with a source run: it must exist and be complete."""
    return _complete(key, store)[1]


def _complete(key: str, store) -> tuple:
    """(the source run's captures or None, its problems): it must exist and be complete."""
    try:
        cap = open_captures(find_store(store))
    except (FileNotFoundError, ValueError, KeyError) as err:
        return None, [f"{key}: {store!r} is not a hookrun store or run dir ({err}); give the run dir (or its "
                      "captures.zarr) of a finished run"]
    if cap.status != COMPLETE:
        return None, [f"{key}: {store!r} has status {cap.status!r}; take values from a complete run (finish it, e.g. "
                      "with store.mode=resume)"]
    return cap, []


def value_problems(key: str, value) -> List[str]:
    """Problems with an edit's `value`: a number, a (nested) list of numbers of one shape, {store: ...} or
    {diff: [{store: ...}, {store: ...}]}."""
    if isinstance(value, dict):
        return _diff_problems(key, value) if "diff" in value else ref_problems(key, value)
    if _numbers(value):
        try:
            torch.as_tensor(value, dtype=torch.float64)  # one shape
        except (ValueError, TypeError):
            pass
        else:
            return finite_problems(key, value)
    return [f"{key}: {value!r} is not a number, a list of numbers (a vector over the last axis) or a nested list of "
            "one shape; or give {store: RUN, hook: NAME, reduce: mean} (another run's mean capture)"]


def file_problems(key: str, file) -> List[str]:
    """Problems with an edit's `file`: it must exist and load as a tensor of finite numbers (.npy, or .pt)."""
    if not Path(str(file)).exists():
        return [f"{key}: {str(file)!r} does not exist; give a .npy or .pt file"]
    try:
        value = _load_file(Path(str(file)))
    except ConfigError as err:
        return [f"{key}: {p}" for p in err.problems]
    return finite_problems(key, value)


def _load_file(path: Path) -> torch.Tensor:
    """The tensor a .npy or .pt file holds (no pickled objects); ConfigError saying why it is none."""
    if path.suffix not in (".npy", ".pt"):
        raise ConfigError([f"{str(path)!r} is not a .npy or .pt file; save the vector with numpy.save('v.npy', v) or "
                           "torch.save(v, 'v.pt') and give that file"])
    try:
        value = torch.load(path, weights_only=True) if path.suffix == ".pt" else \
            torch.from_numpy(np.load(path, allow_pickle=False))
    except Exception as err:  # noqa: BLE001 - whatever numpy or torch says of a file that is not a tensor
        raise ConfigError([f"{str(path)!r} does not load as a tensor ({type(err).__name__}: {str(err)[:120]}); "
                           "give a .npy file of numbers (numpy.save) or a .pt file holding one tensor (torch.save)"]) \
            from None
    if not isinstance(value, torch.Tensor):
        raise ConfigError([f"{str(path)!r} holds {type(value).__name__}, not a tensor"])
    return value


def ref_problems(key: str, ref: dict) -> List[str]:
    """Problems with {store: RUN, hook:, layer:, role:, call:, reduce: mean}: one array of a complete run."""
    extra = sorted(set(ref) - set(REF_KEYS))
    if extra or "store" not in ref:
        return [f"{key}: {ref!r} needs store and takes {', '.join(REF_KEYS)} (e.g. {{store: runs/a, hook: resid, "
                "layer: transformer.h.1, reduce: mean}})" + (f"; not {extra}" if extra else "")]
    if ref.get("reduce", "mean") not in REDUCTIONS:
        return [f"{key}.reduce: {ref['reduce']!r} is not a reduction; use mean (the mean over the run's rows)"]
    cap, problems = _complete(f"{key}.store", ref["store"])
    if cap is not None:
        try:
            cap.source(layer=ref.get("layer"), role=ref.get("role"), hook=ref.get("hook"), call=ref.get("call"))
        except KeyError as err:
            problems.append(f"{key}: {err.args[0]}; name one array with hook, layer and role")
    return problems


def _diff_problems(key: str, value: dict) -> List[str]:
    refs = value.get("diff")
    if set(value) - {"diff", "reduce"} or not isinstance(refs, list) or len(refs) != 2:
        return [f"{key}: {value!r} is not a difference of two runs; write {{diff: [{{store: A, hook: resid}}, "
                "{store: B, hook: resid}], reduce: mean}"]
    reduce = {"reduce": value["reduce"]} if "reduce" in value else {}
    return [p for i, ref in enumerate(refs) for p in
            (ref_problems(f"{key}.diff[{i}]", {**reduce, **ref}) if isinstance(ref, dict) else
             [f"{key}.diff[{i}]: {ref!r} is not {{store: RUN, ...}}"])]


def load_value(key: str, spec: dict) -> torch.Tensor:
    """The tensor of an edit's `value` or `file`, times its `coef`; ConfigError when two runs' means differ in shape."""
    if "file" in spec:
        try:
            value = _load_file(Path(str(spec["file"])))
        except ConfigError as err:
            raise ConfigError([f"{key}.file: {p}" for p in err.problems]) from None
        problems = finite_problems(f"{key}.file", value)
    else:
        value = _value(f"{key}.value", spec["value"])
        problems = finite_problems(f"{key}.value", value)
    if problems:  # a file's numbers, or another run's mean (a store with NaN rows)
        raise ConfigError(problems)
    return value * spec["coef"] if "coef" in spec else value


def _value(key: str, value) -> torch.Tensor:
    if not isinstance(value, dict):
        return torch.as_tensor(value, dtype=torch.float32)
    if "diff" not in value:
        return _mean(value)
    reduce = {"reduce": value["reduce"]} if "reduce" in value else {}
    a, b = (_mean({**reduce, **ref}) for ref in value["diff"])
    if a.shape != b.shape:
        raise ConfigError([f"{key}.diff: the two runs' means have shapes {list(a.shape)} and {list(b.shape)}; take "
                           "them from the same layer and role"])
    return a - b


def _mean(ref: dict) -> torch.Tensor:
    """The mean over every stored row (sample, token or batch) of one array of a run."""
    cap = open_captures(find_store(ref["store"]))
    rows = cap.load(layer=ref.get("layer"), role=ref.get("role"), hook=ref.get("hook"), call=ref.get("call"))
    return torch.from_numpy(rows.astype(np.float64).mean(0)).float()


def fit(value: torch.Tensor, t: torch.Tensor, key: str) -> torch.Tensor:
    """`value` on `t`'s device (and dtype, for a floating `t`), checked to broadcast over `t`'s last axes; SourceError
    naming `key` and both shapes."""
    try:
        fits = value.dim() <= t.dim() and np.broadcast_shapes(value.shape, t.shape) == t.shape  # (torch's: ~0.15 ms)
    except ValueError:
        fits = False
    if not fits:
        width = f"a vector of width {value.shape[0]}" if value.dim() == 1 else f"a value of shape {list(value.shape)}"
        raise SourceError(key, f"{key}: {width} does not fit the tensor it edits, of shape "
                         f"{list(t.shape)} (last axis {t.shape[-1] if t.dim() else 'none'} wide); give "
                         f"{t.shape[-1] if t.dim() else 'one'} numbers (a vector over the last axis) or a shape that "
                         "broadcasts over its last axes")
    floating = t.is_floating_point() or t.is_complex()  # integer ids + 0.5 stay float: refused as another dtype
    return value.to(device=t.device, dtype=t.dtype if floating else value.dtype)


def source_problems(key: str, source, positions) -> List[str]:
    """Problems with a patch's `source: {sample, position}` given the edit's target `positions`."""
    if not isinstance(source, dict) or set(source) - set(SOURCE_KEYS):
        return [f"{key}: {source!r} is not a source; write {{sample: same | <int> | <field>, position: same | last | "
                "first | <int> | [..]}"]
    problems = []
    sample = source.get("sample", "same")
    if not (isinstance(sample, str) or (is_int(sample) and sample >= 0)):
        problems.append(f"{key}.sample: {sample!r} is not same, a sample number or a per-sample field of the data")
    position = source.get("position", "same")
    if position == "same":
        return problems
    problems += tokens.check_positions(f"{key}.position", position)
    if positions is None:
        problems.append(f"{key}.position: {position!r} needs the target positions; give the edit positions: (e.g. "
                        "positions: last with source: {position: last})")
    elif isinstance(position, list) and len(as_list(positions)) != len(position):
        problems.append(f"{key}.position: {position} maps {len(position)} positions but the edit's positions "
                        f"{positions!r} are {len(as_list(positions))}; give one source position per target position")
    return problems


class Patch:
    """The rows a `replace` from a store puts in: another run's captures at the mapped sample and position."""

    def __init__(self, spec: dict, key: str, decode: Optional[Callable[[int], str]] = None):
        self.key, self.store, self.decode = key, spec["store"], decode
        self.hook, self.layer, self.role, self.call = (spec.get(k) for k in ("hook", "layer", "role", "call"))
        source = spec.get("source") or {}
        self.sample, self.position = source.get("sample", "same"), source.get("position", "same")
        self.cap = open_captures(find_store(self.store))
        self._lookups: dict = {}

    def _error(self, message: str) -> SourceError:
        return SourceError(self.key, f"{self.key}: {message}")

    def where(self, site) -> dict:
        return dict(hook=self.hook, layer=self.layer or site.layer, role=self.role or site.role,
                    call=self.call if self.call is not None else site.call)

    # -- before any work --------------------------------------------------------------------------
    def problems(self, layers: List[str], inputs=None) -> List[str]:
        """What the source run lacks for this run: a capture of the layers, the same tokenizer, the same corpus."""
        index = self.cap.index
        problems = []
        for layer in [self.layer] if self.layer else layers:
            rows = self.cap.rows(hook=self.hook, layer=layer, role=self.role)
            if not len(rows):
                have = sorted(index["array"].unique()) if len(index) else []
                problems.append(f"{self.key}.store: {self.store!r} has no capture of hook={self.hook!r} layer="
                                f"{layer!r} role={self.role!r}; it holds {', '.join(have) or 'nothing'}: name the "
                                "source with hook, layer and role")
        text = getattr(inputs, "text", None)
        if text is not None:
            mine = text.tokenizer
            theirs = ((self.cap.config.get("data") or {}).get("text") or {}).get("tokenizer")
            if mine != theirs:
                problems.append(f"{self.key}.store: {self.store!r} was made with the tokenizer {theirs!r}, this run "
                                f"uses {mine!r}; patch between runs of one tokenizer")
            elif self.sample == "same" and self.position == "same" and getattr(inputs, "seqs", None) is not None:
                problems += self._corpus_problems(inputs.seqs, inputs.ranges())
        return problems

    def _corpus_problems(self, seqs: List[List[int]], ranges) -> List[str]:
        """The first token where the source run's corpus differs from this run's (source {sample, position: same})."""
        table = self.cap.tokens()
        used = np.concatenate([np.arange(a, b) for a, b in ranges]) if ranges else np.zeros(0, dtype=np.int64)
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        theirs = table.groupby("sample")["position"].max().reindex(used).to_numpy()
        short = np.nonzero(np.isnan(theirs) | (theirs + 1 < lengths[used]))[0]
        table = table[table["sample"].isin(used)]
        s, p, ids = (table[c].to_numpy() for c in ("sample", "position", "token_id"))
        flat = np.fromiter((t for seq in seqs for t in seq), dtype=np.int64, count=int(lengths.sum()))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        inside = p < lengths[s]
        here = np.where(inside, flat[np.minimum(offsets[s] + p, len(flat) - 1)], -1)
        bad = np.nonzero(here != ids)[0]
        fix = ("name where the patch takes from (source: {position: last} or an int, with the edit's positions), or "
               "patch from a run of the same data")
        if len(bad):
            k = bad[0]
            return [f"{self.key}.store: {self.store!r} holds other tokens than this run (source sample: same, "
                    f"position: same): sample {s[k]} position {p[k]} is {self._text(int(here[k]))} here and "
                    f"{self._text(int(ids[k]), table['token'].iloc[k])} there; {fix}"]
        if len(short):
            return [f"{self.key}.store: {self.store!r} lacks tokens of this run (source sample: same, position: same): "
                    f"sample {used[short[0]]} has {lengths[used[short[0]]]} tokens here; {fix}"]
        return []

    def _text(self, token_id: int, text: Optional[str] = None) -> str:
        if token_id < 0:
            return "past its end"
        text = text if text is not None else (self.decode(token_id) if self.decode else None)
        return f"{text!r} (id {token_id})" if text is not None else f"id {token_id}"

    # -- each batch -----------------------------------------------------------------------------
    def per_token(self, site) -> bool:
        """Whether the source array at this site holds a row per token."""
        rows = self.cap.rows(**self.where(site))
        return bool(len(rows)) and (rows["unit"] == "token").all()

    def _lookup(self, site) -> pd.DataFrame:
        """Row, token id and text of every source token by (sample, position) (one per-token array, read once)."""
        key = tuple(self.where(site).values())
        if key not in self._lookups:
            table = self.cap.tokens()
            lookup = self.cap.token_rows(**self.where(site))
            lookup["token_id"], lookup["token"] = table["token_id"].to_numpy(), table["token"].to_numpy()
            lengths = table.groupby("sample")["position"].max() + 1
            self._lookups[key] = (lookup, lengths)
        return self._lookups[key]

    def samples(self, site, b: np.ndarray) -> np.ndarray:
        """The source sample of each target entry (b: the entry's sample within the batch)."""
        if self.sample == "same":
            return site.sample_start + b
        if is_int(self.sample):
            return np.full(len(b), self.sample, dtype=np.int64)
        fields = site.fields or {}
        if self.sample not in fields:
            key = f"{self.key}.source.sample"
            raise SourceError(key, f"{key}: {self.sample!r} is not a per-sample field of this run's data (it has "
                                   f"{', '.join(fields) or 'none'}); give same, a sample number or a field")
        return torch.as_tensor(fields[self.sample]).reshape(-1).cpu().numpy().astype(np.int64)[b]

    def _positions(self, lengths: pd.Series, samples: np.ndarray, rel: np.ndarray, slot: np.ndarray) -> np.ndarray:
        if self.position == "same":
            return rel
        spec = [tokens.NAMED_POSITIONS.get(p, p) for p in as_list(self.position)]
        want = np.asarray(spec, dtype=np.int64)[slot if isinstance(self.position, list) else 0]
        n = lengths.reindex(samples).fillna(0).to_numpy().astype(np.int64)
        return np.where(want < 0, n + want, want)

    def at_tokens(self, t: torch.Tensor, site, info, b: torch.Tensor, cols: torch.Tensor,
                  slot: torch.Tensor) -> torch.Tensor:
        """`t` [B, T, ...] with the source rows put at the target entries (b, cols) [n]; slot: each entry's index
        among the edit's positions (a list of source positions pairs with them)."""
        lookup, lengths = self._lookup(site)
        bn = b.cpu().numpy()
        rel = (cols - info.first[b]).cpu().numpy()
        samples = self.samples(site, bn)
        positions = self._positions(lengths, samples, rel, slot.cpu().numpy())
        idx = lookup.index.get_indexer(pd.MultiIndex.from_arrays([samples, positions]))
        if (idx < 0).any():
            k = int(np.nonzero(idx < 0)[0][0])
            n = int(lengths.get(samples[k], 0))
            raise self._error(f"sample {site.sample_start + bn[k]} position {rel[k]} takes sample "
                             f"{samples[k]} position {positions[k]} of {self.store}, which has no such token row (that "
                             f"sample has {n} stored tokens); map positions inside the source (source: {{position: "
                             "last}}) or store every token there")
        if self.position == "same":
            self._check_tokens(site, info, lookup, idx, b, cols, rel, samples)
        value = torch.from_numpy(self.cap.read_rows(lookup.attrs["array"], lookup["row"].to_numpy()[idx]))
        if value.shape[1:] != t.shape[2:]:
            raise self._error(f"the source rows have shape {list(value.shape[1:])}, this tensor's tokens "
                             f"{list(t.shape[2:])}; patch from the same layer and role")
        out = t.clone()
        out[b, cols] = value.to(device=t.device, dtype=t.dtype)
        return out

    def _check_tokens(self, site, info, lookup, idx, b, cols, rel, samples) -> None:
        """Refuse a patch at the same position of another token: names the sample, position and both tokens."""
        if info.ids is None:
            raise self._error("this run's batches carry no token ids to compare with the source's; give "
                             "source: {position: ...} explicitly")
        here = info.ids[b, cols].cpu().numpy()
        there = lookup["token_id"].to_numpy()[idx]
        bad = np.nonzero(here != there)[0]
        if len(bad):
            k = bad[0]
            raise SourceError(self.key, 
                f"{self.key}: source position same, but sample {site.sample_start + int(b[k])} position {rel[k]} is "
                f"{self._text(int(here[k]))} here and {self._text(int(there[k]), lookup['token'].iloc[idx[k]])} in "
                f"{self.store} (sample {samples[k]}); the prompts differ there: name the source position "
                "(source: {position: last}, an int or a list) or patch where they agree")

    def whole(self, t: torch.Tensor, site) -> torch.Tensor:
        """The source capture of the same samples (a per-sample or per-batch array): the batch's rows, in order."""
        where = self.where(site)
        rows = self.cap.rows(**where)
        if len(rows) and (rows["unit"] == "sample").all() and self.sample != "same":
            records = self.cap.samples.set_index("sample")["row"]
            b = np.arange(site.sample_stop - site.sample_start)
            wanted = records.loc[self.samples(site, b)].to_numpy()
            value = torch.from_numpy(self.cap.read_rows(rows["array"].iloc[0], wanted))
        else:
            rows = rows[rows["sample_start"] == site.sample_start]
            if len(rows) != 1 or self.sample != "same":
                raise self._error(f"the source store {self.store} has {len(rows)} captures of {where} for "
                                 f"samples {site.sample_start}..{site.sample_stop}; it needs exactly one (same data, "
                                 "batch size and hook as this run)")
            value = torch.from_numpy(self.cap.read_row(rows.iloc[0]))
        if value.shape != t.shape:
            raise self._error(f"the source capture has shape {list(value.shape)}, this tensor "
                             f"{list(t.shape)}")
        return value.to(device=t.device, dtype=t.dtype)
