"""Declared metrics: per-sample numbers computed from a language model's output logits in the same pass.

    metrics:
      ld: {metric: logit_diff, a: " hooks", b: " model", position: last}  # logit of a minus logit of b
      lp: {metric: logprob, target: {field: answer}}                      # log p(target), one answer per sample
      p:  {metric: prob, target: 270, position: [0, -1]}                  # [B, 2]: one column per position
      r:  {metric: rank, target: " the"}                                  # 0: target is the most likely token
      ce: {metric: loss}                                                  # mean next-token cross-entropy
      kl: {metric: kl, position: all}                                     # KL(reference || this), mean over tokens
      f:  {_target_: mypkg.metrics.fn, k: 3}                              # fn(logits, inputs, k=3) -> [B] tensor

A token is a string of exactly one token, an int id, or {field: NAME}: a per-sample field of the data holding one
string or id per sample. The logits at a position predict the token after it; positions count real tokens
(hookrun.capture.tokens: 0 is a sequence's first real token whatever the padding side, -1 its last); default last.
Every value is computed per sample in float32 (from logits of any dtype), so it is the value of the sample run
alone: it depends neither on the batch nor on the padding. `loss` is NaN for a one-token sequence (nothing to predict).

    metrics = compile_metrics(cfg.metrics, tokenizer)   # ConfigError listing every bad spec, before any work
    value = metrics["ld"](logits, MetricInputs(info, input_ids, fields))   # [B] float32 (or [B, P])

In a run (the method `Metrics`), each metric is computed on the batch's forward (the first role of paired data, with
the hooks and edits) and stored as the array `_metrics/<role>/<name>` (a row per sample; <role> is `output` for
unpaired data) and a column of `cap.samples`; `kl` compares to the logits of the reference role (patching.source,
else `clean`, else the first role) run without hooks.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from hookrun.capture import tokens
from hookrun.config.registry import methods
from hookrun.config.checks import ConfigError, check_target, suggest, target_of, to_plain
from hookrun.format.layout import METRICS, PATCHING
from hookrun.methods import Method, MetricUse, emit

ARGS = {  # metric -> (required args, optional args)
    "logit_diff": ({"a", "b"}, {"position"}),
    "logprob": ({"target"}, {"position"}),
    "prob": ({"target"}, {"position"}),
    "rank": ({"target"}, {"position"}),
    "loss": (set(), set()),
    "kl": (set(), {"position"}),
}
TOKEN_ARGS = ("a", "b", "target")
EXAMPLES = {
    "logit_diff": '{metric: logit_diff, a: " hooks", b: " model"}',
    "logprob": '{metric: logprob, target: " hooks"}',
    "prob": '{metric: prob, target: {field: answer}}',
    "rank": "{metric: rank, target: 270}",
}
# the metric kinds whose gradient is of no use to a method that takes gradients (attribution, circuits)
NO_GRADIENT = {"rank": "rank counts the logits above the target's: a step function, zero gradient almost "
                       "everywhere; use logit_diff, logprob or prob",
               "kl": "kl compares to a reference run's logits, which the grid cannot give each estimate; use "
                     "logit_diff, logprob, prob or loss"}
TOKEN_FORMS = "a string of one token, an int id or {field: NAME} (one string or id per sample)"


class MetricError(RuntimeError):
    """A metric could not be computed on a batch (a position beyond a sequence, a field it lacks, no reference);
    `key` names the metric (metrics.<name>)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


@dataclass
class MetricInputs:
    """What a metric reads besides the logits, for one batch."""

    info: Optional[tokens.TokenInfo]  # the batch's real tokens; None: every entry of [B, T] is a real token
    input_ids: Optional[torch.Tensor] = None  # [B, T]: what `loss` predicts
    fields: Dict[str, object] = field(default_factory=dict)  # name -> one value per sample (list, array, tensor)
    reference: Optional[torch.Tensor] = None  # [B, T', V] logits `kl` compares to (a reference run, the clean pass)
    reference_info: Optional[tokens.TokenInfo] = None  # the reference's real tokens when they differ from `info`
    sample_start: int = 0  # the batch's first sample, for messages


def check_spec(key: str, spec, tokenizer=None) -> List[str]:
    """Problems with one entry of a `metrics:` block (key: metrics.<name>), each naming the key and the fix. A string
    token is checked to be one token when the tokenizer is given."""
    spec = spec
    if not isinstance(spec, dict):
        return [f"{key}: {spec!r} is not a metric; write {{metric: logprob, target: \" hooks\"}} or "
                "{_target_: pkg.fn}"]
    if "_target_" in spec:
        if "metric" in spec:
            return [f"{key}: has both metric ({spec['metric']!r}) and _target_; give one of them"]
        return check_target(key, spec, "give an importable function fn(logits, inputs, **args) -> [batch] tensor",
                            {"logits": None, "inputs": None}, call_fix="a metric function takes (logits, inputs, "
                            "**args) and returns one value per sample")
    kind = spec.get("metric")
    if kind not in ARGS:
        what = "missing" if kind is None else f"{kind!r} is unknown{suggest(kind, ARGS)}"
        return [f"{key}.metric: {what}; use one of {', '.join(ARGS)}, or {{_target_: pkg.fn}} for your own"]
    required, optional = ARGS[kind]
    problems = [f"{key}: metric {kind} needs {r!r} ({TOKEN_FORMS}), e.g. {EXAMPLES[kind]}"
                for r in sorted(required - set(spec))]
    for extra in sorted(set(spec) - required - optional - {"metric"}):
        takes = ", ".join(sorted(required | optional)) or "nothing else"
        problems.append(f"{key}.{extra}: metric {kind} takes no {extra!r}; it takes {takes}")
    for arg in sorted(required & set(spec)):
        problems += token_problems(f"{key}.{arg}", spec[arg], tokenizer)
    if kind == "logit_diff" and not problems:
        problems += same_token_problems(key, spec["a"], spec["b"], tokenizer)
    if "position" in spec and "position" in optional and not (kind == "kl" and spec["position"] == "all"):
        position = spec["position"]
        for problem in tokens.check_positions(f"{key}.position", position):
            hint = suggest(position, [*tokens.NAMED_POSITIONS, "all"]) if isinstance(position, str) else ""
            problems.append(problem + hint + ("; kl also takes all (the mean over real tokens)" * (kind == "kl")))
    return problems


def token_problems(key: str, token, tokenizer) -> List[str]:
    """Problems with one token argument: its form, and (given the tokenizer) that a string is exactly one token."""
    if isinstance(token, dict):
        if set(token) != {"field"} or not isinstance(token["field"], str):
            return [f"{key}: {token!r} is not a token; a per-sample token is {{field: NAME}} (a field of the data)"]
        return []
    if isinstance(token, bool) or not isinstance(token, (str, int)):
        return [f"{key}: {token!r} is not a token; give {TOKEN_FORMS}"]
    if isinstance(token, int):
        return [] if token >= 0 else [f"{key}: {token} is not a token id; ids are >= 0"]
    if tokenizer is None:
        return []
    try:
        one_token(token, tokenizer)
    except ValueError as err:
        return [f"{key}: {err}"]
    return []


def same_token_problems(key: str, a, b, tokenizer=None) -> List[str]:
    """[the problem] of a logit_diff whose a and b are one token (the same string, id or field; with the tokenizer,
    two strings read as one id): logit a - logit b is 0 on every sample, so every score and faithfulness is 0 or
    0 / 0."""
    same = to_plain(a) == to_plain(b)
    ids = ""
    if not same and tokenizer is not None and not isinstance(a, dict) and not isinstance(b, dict):
        ia, ib = (one_token(t, tokenizer) if isinstance(t, str) else int(t) for t in (a, b))
        same, ids = ia == ib, f" (both token id {ia})"
    if not same:
        return []
    return [f"{key}.b: {to_plain(b)!r} is the same token as {key}.a{ids}: logit a - logit b is 0 on every sample, "
            f"so every score would be 0 and every faithfulness 0 / 0; give two different tokens (e.g. the answer and "
            f"a wrong one)"]


def one_token(text: str, tokenizer) -> int:
    """The id of a string that the tokenizer reads as exactly one token; ValueError naming its pieces otherwise."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1:
        return int(ids[0])
    if not ids:
        raise ValueError(f"{text!r} is no token at all; give a string of one token or its id")
    pieces = [tokenizer.decode([i]) for i in ids]
    raise ValueError(f"{text!r} is {len(ids)} tokens {pieces} (ids {ids}), not one; give a single token (e.g. "
                     f"{pieces[0]!r}) or its id")


def check_metrics(specs, tokenizer=None) -> List[str]:
    """Problems with a whole `metrics:` block (name -> spec)."""
    specs = specs
    if specs is None:
        return []
    if not isinstance(specs, dict):
        return [f"metrics: {specs!r} is not a mapping; write metrics: {{name: {{metric: loss}}, ...}}"]
    return [p for name, spec in specs.items() for p in check_spec(f"metrics.{name}", spec, tokenizer)]


def compile_metrics(specs, tokenizer=None) -> Dict[str, "Metric"]:
    """The metrics of a `metrics:` block by name; ConfigError listing every problem (a string token that is not one
    token of `tokenizer`, or that has no tokenizer to read it) before any work."""
    problems = check_metrics(specs, tokenizer)
    specs = specs or {}
    if tokenizer is None and isinstance(specs, dict):
        problems += [f"metrics.{name}.{arg}: {spec[arg]!r} is a string but this run has no tokenizer to read it; give "
                     "its token id, or the data as data.text with a tokenizer"
                     for name, spec in specs.items() if isinstance(spec, dict) and "_target_" not in spec
                     for arg in TOKEN_ARGS if isinstance(spec.get(arg), str)]
    if problems:
        raise ConfigError(problems)
    return {str(name): Metric(str(name), spec, tokenizer) for name, spec in specs.items()}


def needing_reference(metrics: Dict[str, "Metric"]) -> List[str]:
    """The names of the metrics that compare to reference logits (kl): the runner keeps a reference for them."""
    return [name for name, m in metrics.items() if m.needs_reference]


def fields_needed(metrics: Dict[str, "Metric"]) -> List[str]:
    """The data fields that the metrics' per-sample tokens read ({field: NAME}), for MetricInputs.fields."""
    return sorted({f for m in metrics.values() for f in m.fields})


class Metric:
    """One compiled metric: `metric(logits [B, T, V], inputs) -> [B] float32` ([B, P] for a list of positions)."""

    def __init__(self, name: str, spec: dict, tokenizer=None):
        spec = dict(spec)
        self.name, self.key, self.spec = name, f"metrics.{name}", spec
        self.tokenizer = tokenizer
        self.kind = "_target_" if "_target_" in spec else spec["metric"]
        self.needs_reference = self.kind == "kl"
        self._ids: Dict[str, int] = {}  # string -> token id (strings of the spec and of per-sample fields)
        self.tokens = {arg: self._token(spec[arg]) for arg in TOKEN_ARGS if arg in spec and self.kind != "_target_"}
        self.fields = sorted({t["field"] for t in self.tokens.values() if isinstance(t, dict)})
        position = spec.get("position", "last")
        self.all = position == "all"
        self.positions, self.squeeze = ([], True) if self.all or self.kind == "loss" else \
            tokens.positions_spec(position)
        self.width = None if self.squeeze else len(self.positions)  # [B] or [B, width]
        if self.kind == "_target_":
            self.fn = target_of(spec["_target_"])
            self.args = {k: v for k, v in spec.items() if k != "_target_"}

    def _token(self, token):
        return self._id(token) if isinstance(token, str) else token

    def _id(self, text: str) -> int:
        if text not in self._ids:
            self._ids[text] = one_token(text, self.tokenizer)
        return self._ids[text]

    def __call__(self, logits: torch.Tensor, inputs: MetricInputs) -> torch.Tensor:
        info = inputs.info if inputs.info is not None else _all_real(logits)
        with torch.no_grad():  # a value to store: no graph, even when the pass itself needs one
            return self.value(logits, info, inputs)

    def value(self, logits: torch.Tensor, info: tokens.TokenInfo, inputs: MetricInputs) -> torch.Tensor:
        """The metric [B] of the logits with its graph kept (calling the metric gives a value under no_grad)."""
        try:
            if self.kind == "_target_":
                return self._user(logits, inputs)
            if self.kind == "loss":
                return _loss(logits, info, self._input_ids(inputs))
            if self.kind == "kl":
                return self._kl(logits, info, inputs)
            at = self._at(logits, info)  # [B, P, V] float32
            if self.kind == "logit_diff":
                out = _pick(at, self._ids_of("a", inputs, at)) - _pick(at, self._ids_of("b", inputs, at))
            else:
                target = self._ids_of("target", inputs, at)
                if self.kind == "rank":
                    out = (at > _pick(at, target)[..., None]).sum(-1).float()
                else:
                    out = _pick(torch.log_softmax(at, -1), target)
                    out = out.exp() if self.kind == "prob" else out
            return out[:, 0] if self.squeeze else out
        except tokens.TokenError as err:
            raise MetricError(f"{self.key}.position", str(err)) from err

    def _at(self, logits: torch.Tensor, info: tokens.TokenInfo, key: str = "") -> torch.Tensor:
        """[B, P, V] float32: the logits at each sequence's positions."""
        cols = tokens.columns(info, self.positions, key or f"{self.key}.position")
        cols = cols.to(logits.device)  # logits of a device-mapped model may come on another device than the inputs
        return logits[torch.arange(len(cols), device=cols.device)[:, None], cols].float()

    def _ids_of(self, arg: str, inputs: MetricInputs, at: torch.Tensor) -> torch.Tensor:
        """[B] token ids of a token argument: a constant, or one per sample from a field; checked against the vocab."""
        token, (n, vocab) = self.tokens[arg], (at.shape[0], at.shape[-1])
        if isinstance(token, dict):
            ids = [self._field_id(token["field"], v, i, inputs, arg) for i, v in enumerate(self._field(token, n, inputs))]
        else:
            ids = [token] * n
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                where = f" (sample {inputs.sample_start + i})" if isinstance(token, dict) else ""
                raise MetricError(f"{self.key}.{arg}", f"{self.key}.{arg}: token id {t}{where} is outside the model's "
                                  f"{vocab} logits; give an id below {vocab}")
        return torch.as_tensor(ids, dtype=torch.long, device=at.device)

    def _field(self, token: dict, n: int, inputs: MetricInputs) -> list:
        name = token["field"]
        if name not in inputs.fields:
            known = list(inputs.fields)
            raise MetricError(self.key, f"{self.key}: {{field: {name}}} but the batch has no field {name!r} (it has "
                              f"{', '.join(known) or 'none'}){suggest(name, known)}; name a per-sample field of the "
                              "data")
        values = inputs.fields[name]
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != n:
            raise MetricError(self.key, f"{self.key}: field {name!r} has {len(values)} values for a batch of {n} "
                              "samples; it needs one token per sample")
        return values

    def field_problems(self, names: Dict[str, list], samples: List[int], vocab: Optional[int]) -> List[str]:
        """Problems with the per-sample tokens ({field: NAME}) of every sample the run sees (`samples`, indices into
        `names`: field -> one value per sample), read before any work: a field the data lacks, a value that is not
        one token of the tokenizer (several tokens, none, null) or an id past the model's `vocab`; the first sample
        of each argument is named."""
        problems = []
        for arg, token in self.tokens.items():
            if not isinstance(token, dict):
                if vocab is not None and is_id(token) and token >= vocab:
                    problems.append(f"{self.key}.{arg}: token id {token} is outside the model's {vocab}-token "
                                    f"vocabulary; give an id below {vocab}")
                continue
            key, name = f"{self.key}.{arg}", token["field"]
            if name not in names:
                problems.append(f"{key}: {{field: {name}}} but the data has no field {name!r} (it has "
                                f"{', '.join(names) or 'none'}){suggest(name, list(names))}; name a per-sample field "
                                "of the data (a column of the .jsonl beside the prompts)")
                continue
            for i in samples:
                value = names[name][i]
                try:
                    t = self._field_id(name, value, i, MetricInputs(None), arg)
                except MetricError as err:
                    problems.append(str(err))
                    break
                if vocab is not None and t >= vocab:
                    problems.append(f"{key}: field {name!r} of sample {i} is token id {t}, outside the model's "
                                    f"{vocab}-token vocabulary; give ids below {vocab} (or the token as a string)")
                    break
        return problems

    def _field_id(self, name: str, value, i: int, inputs: MetricInputs, arg: str = "") -> int:
        """The token id of one sample's field value: an int id, or a string of one token."""
        where = f"{self.key}{'.' + arg if arg else ''}: field {name!r} of sample {inputs.sample_start + i}"
        if value is None:
            raise MetricError(self.key, f"{where} is None (null in the data), not a token; give every sample its "
                              "token (one string or id), or drop the sample")
        if isinstance(value, str):
            if self.tokenizer is None:
                raise MetricError(self.key, f"{where} is the string {value!r} but this run has no tokenizer to read "
                                  "it; give token ids in the field, or the data as data.text with a tokenizer")
            try:
                return self._id(value)
            except ValueError as err:
                raise MetricError(self.key, f"{where}: {err}") from None
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # a [n, 1] column of ids
        if not is_id(value):
            raise MetricError(self.key, f"{where} is {value!r}, not a token; give one string or id per sample")
        return value

    def _input_ids(self, inputs: MetricInputs) -> torch.Tensor:
        if inputs.input_ids is None:
            raise MetricError(self.key, f"{self.key}: metric loss needs the batch's input_ids (the tokens it "
                              "predicts), but MetricInputs has none")
        return inputs.input_ids

    def _kl(self, logits: torch.Tensor, info: tokens.TokenInfo, inputs: MetricInputs) -> torch.Tensor:
        """KL(reference || this) of the next-token distributions, at the positions or averaged over real tokens."""
        if inputs.reference is None:
            raise MetricError(self.key, f"{self.key}: metric kl needs reference logits (a reference run's stored "
                              "logits, or the clean pass in patching), but none were given")
        ref = torch.as_tensor(inputs.reference, device=logits.device)  # stored logits may come as numpy, on the host
        ref_info = inputs.reference_info or (info if ref.shape[:2] == logits.shape[:2] else None)
        if ref_info is None or ref.shape[0] != logits.shape[0] or ref.shape[-1] != logits.shape[-1]:
            raise MetricError(self.key, f"{self.key}: reference logits {list(ref.shape)} do not fit these "
                              f"{list(logits.shape)}; they need the same samples and vocabulary (and their own "
                              "TokenInfo when their sequences differ)")
        if self.all:
            if not torch.equal(ref_info.lengths.cpu(), info.lengths.cpu()):
                raise MetricError(self.key, f"{self.key}: kl over all positions compares token by token, but the "
                                  "reference's sequences have other lengths; use position: last (or a list)")
            kl = _kl(_real(ref, ref_info), _real(logits, info))  # [B, L] aligned on real positions
            valid = torch.arange(kl.shape[1], device=kl.device)[None, :] < info.lengths[:, None]
            return torch.where(valid, kl, torch.zeros_like(kl)).sum(1) / info.lengths
        kl = _kl(self._at(ref, ref_info, f"{self.key}.position (in the reference)"), self._at(logits, info))
        return kl[:, 0] if self.squeeze else kl

    def _user(self, logits: torch.Tensor, inputs: MetricInputs) -> torch.Tensor:
        try:
            out = self.fn(logits, inputs, **self.args)
        except Exception as err:  # noqa: BLE001 - a failing user metric names the metric
            raise MetricError(self.key, f"{self.key}: {self.spec['_target_']} failed: {type(err).__name__}: "
                              f"{err}") from err
        if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.shape[0] != logits.shape[0]:
            got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise MetricError(self.key, f"{self.key}: {self.spec['_target_']} returned {got}; a metric function "
                              f"returns a tensor of one value per sample, shape [{logits.shape[0]}]")
        return out.float()


def is_id(value) -> bool:
    """A token id: an int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def vocabulary(model, tokenizer=None) -> Optional[int]:
    """The token ids a model's logits cover: its output embedding's rows, else its config's vocab_size, else the
    tokenizer's length; None when none of them says."""
    try:
        out = model.get_output_embeddings()
    except Exception:  # noqa: BLE001 - not a Hugging Face model
        out = None
    for rows in (getattr(out, "out_features", None), getattr(out, "num_embeddings", None),
                 getattr(getattr(model, "config", None), "vocab_size", None),
                 len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None):
        if is_id(rows) and rows > 0:
            return rows
    return None


def _all_real(logits: torch.Tensor) -> tokens.TokenInfo:
    """The TokenInfo of a batch without padding."""
    mask = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)
    return tokens.TokenInfo(mask, mask, logits.shape[1], True, None)


def _pick(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, P, V] values, [B] ids -> [B, P]: each sample's value of its id."""
    return values.gather(-1, ids[:, None, None].expand(*values.shape[:2], 1)).squeeze(-1)


def _loss(logits: torch.Tensor, info: tokens.TokenInfo, input_ids: torch.Tensor) -> torch.Tensor:
    """[B] mean cross-entropy of each real token after the first, predicted from the one before it."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, input_ids[:, 1:, None].to(logits.device)).squeeze(-1)
    pairs = info.mask[:, :-1] & info.mask[:, 1:]
    return torch.where(pairs, nll, torch.zeros_like(nll)).sum(1) / pairs.sum(1)


def _kl(ref: torch.Tensor, this: torch.Tensor) -> torch.Tensor:
    """[..., V] logits of both -> [...] KL(ref || this) = sum p_ref (log p_ref - log p_this), in float32."""
    log_ref, log_this = torch.log_softmax(ref.float(), -1), torch.log_softmax(this.float(), -1)
    terms = log_ref.exp() * (log_ref - log_this)
    return torch.where(log_ref == float("-inf"), torch.zeros_like(terms), terms).sum(-1)  # 0 log 0 = 0


def _real(t: torch.Tensor, info: tokens.TokenInfo) -> torch.Tensor:
    """[B, T, ...] -> [B, L, ...] with column j = real position j (the first L of each sequence; L the longest)."""
    j = torch.arange(int(info.lengths.max()), device=t.device)
    cols = (info.first[:, None] + j).clamp(max=t.shape[1] - 1)
    return t[torch.arange(t.shape[0], device=t.device)[:, None], cols]


def logits_of(out) -> torch.Tensor:
    """The logits of a model's output: .logits, the first element of a tuple, or the tensor itself."""
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


@contextmanager
def unhooked(hookset):
    """The run's own hooks off (no capture, no edit) while other forwards run: a reference, a patching grid."""
    hookset.remove()
    try:
        yield
    finally:
        hookset.attach()


RESERVED = (METRICS, PATCHING)  # hookrun's own array groups: no hook takes their names


class Metrics(Method):
    """The `metrics:` block in a run: compiled before any work, computed per batch on the forward's logits."""

    key = "metrics"
    annotation = Dict[str, Any]
    factory = dict
    help = ("name → `{metric: logit_diff|logprob|prob|rank|loss|kl, ...}` or `{_target_: fn, **args}`: per-sample "
            "numbers from the output logits, stored in `cap.samples` and `_metrics/...` (docs/patching.md)")
    config_errors = (MetricError,)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.metrics: Dict[str, Metric] = {}
        self.role = "output"  # the array group of the metrics: the role fed (paired data), else output
        self.reference: Optional[str] = None  # the role `kl` compares to

    @classmethod
    def check(cls, cfg) -> List[str]:
        metrics = cfg.metrics
        problems = check_metrics(metrics)
        problems += [f"metrics.{name}: a metric's name holds no '/' or '.'; rename it" for name in (metrics or {})
                     if "/" in str(name) or "." in str(name)]
        problems += [f"hooks.{name}: {name} is the name of hookrun's own arrays; rename the hook"
                     for name in (cfg.hooks or {}) if name in RESERVED]
        return problems + use_problems(cfg, [u for c in methods().values() for u in c.metric_uses(cfg)])

    @classmethod
    def generation_problems(cls, cfg) -> List[str]:
        metrics = getattr(cfg, cls.key, None)
        return [] if not metrics else [
            f"metrics: {', '.join(metrics)} are computed from one forward pass of the prompts, not from generation "
            "(cap.generations() has each chosen token's log-probability); drop metrics or set "
            "generate.max_new_tokens=0"]

    def data_problems(self, inputs) -> List[str]:
        """The metrics against the data's tokenizer, before the model: each string one token, logit_diff's two
        tokens different."""
        tokenizer = getattr(inputs, "tokenizer", None)
        return check_metrics(self.spec, tokenizer) if tokenizer is not None else []

    def compile(self, job) -> None:
        """The metrics against the tokenizer, the role they are computed on and the reference role of `kl`."""
        inputs = job.inputs
        tokenizer = getattr(inputs, "tokenizer", None)
        self.metrics = compile_metrics(self.spec, tokenizer)
        meta = getattr(inputs, "meta", None)
        if meta is not None:  # text data: every sample's per-sample tokens read now, before the store exists
            samples = [i for a, b in inputs.ranges() for i in range(a, b)]
            vocab = vocabulary(job.model, tokenizer)
            problems = [p for m in self.metrics.values() for p in m.field_problems(meta, samples, vocab)]
            if problems:
                raise ConfigError(problems)
        roles = list(getattr(inputs, "roles", None) or [])
        self.role = roles[0] if roles else "output"
        if needing_reference(self.metrics):
            if not roles:
                names = ", ".join(needing_reference(self.metrics))
                raise ConfigError([f"metrics.{names}: kl compares to a reference run's logits, and this run has none; "
                                   "give paired prompts (data.text.fields: {clean: ..., corrupt: ...}): the clean "
                                   "role is the reference"])
            declared = next((u.roles[0] for m in job.methods for u in type(m).metric_uses(m.cfg)
                             if u.reference and u.roles), None)  # a patching grid's source
            self.reference = declared if declared is not None else "clean" if "clean" in roles else roles[0]
        written = set()
        for method in job.methods:  # one writer a <metric>.<role> column: the first method declaring it
            mine = [c for u in type(method).metric_uses(method.cfg) for c in u.columns if c not in written]
            written.update(mine)
            method.metric_columns = tuple(dict.fromkeys(mine))

    def measure(self, job, i: int, batch, output, hookset) -> Dict[str, np.ndarray]:
        """Batch `i`'s metrics handed to the store as `_metrics/<role>/<name>`; returns the cap.samples columns."""
        logits = logits_of(output).detach()
        reference = reference_info = None
        if self.reference is not None:
            with unhooked(hookset), torch.inference_mode():
                kwargs, reference_info = batch.roles[self.reference]
                reference = logits_of(job.model(**kwargs))
        inputs = MetricInputs(batch.tokens, batch.kwargs.get("input_ids"), batch.fields, reference, reference_info,
                              batch.start)
        columns: Dict[str, np.ndarray] = {}
        for name, metric in self.metrics.items():
            values = metric(logits, inputs).float()
            emit(hookset, i, batch, METRICS, self.role, name, values)
            host = values.cpu().numpy()
            for j, col in enumerate(metric_columns(name, metric)):
                columns[col] = host if metric.squeeze else host[:, j]
        return columns

    def columns(self) -> List[str]:
        return [c for name, m in self.metrics.items() for c in metric_columns(name, m)]

    def attrs(self) -> dict:
        return {}  # the engine writes METRIC_COLUMNS from every method's columns()


def use_problems(cfg, uses: List[MetricUse]) -> List[str]:
    """The metrics methods score with (their MetricUse) that the metrics block lacks, or that have no useful gradient
    where one is taken (NO_GRADIENT)."""
    metrics = cfg.metrics or {}
    problems = []
    for use in uses:
        if not isinstance(use.metric, str) or use.metric not in metrics:
            problems.append(f"{use.key}: {use.metric!r} is not a metric of the metrics block "
                            f"({', '.join(metrics) or 'none'}); declare it there, e.g. metrics: "
                            "{ld: {metric: logit_diff, a: ' Paris', b: ' Rome'}}")
            continue
        spec = metrics[use.metric]
        kind = spec.get("metric") if isinstance(spec, dict) else None
        if use.gradient and kind in NO_GRADIENT:
            problems.append(f"{use.key}: {use.metric} is a {kind} metric, which has no useful gradient "
                            f"({NO_GRADIENT[kind]}){use.fix}")
    return problems


def metric_columns(name: str, metric: Metric) -> List[str]:
    """The cap.samples columns of one metric: its name, or name[position] for each of a list of positions."""
    return [name] if metric.squeeze else [f"{name}[{p}]" for p in metric.positions]
