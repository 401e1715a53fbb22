"""One-call analyses in memory: the logit lens, DLA and dictionary features of a model on token ids or texts, equal
to what a declared run of the same analysis stores, without a config or a store (docs/lens.md, docs/dictionaries.md).

    lens = hookrun.lens(model, ["The cat sat on"], tokenizer=tok, layers="blocks.*", positions="all", k=5)
    lens.sample_table(0); lens.kl; lens.to_frame()                        # a LensResult, as cap.read("lens") gives it
    dla = hookrun.dla(model, ids, answer=[" Paris", " Rome"], tokenizer=tok)   # a DLAResult (cap.read("lens").dla)
    feats = hookrun.features(model, ids, sae, site="blocks.1", k=16, evaluate=True)   # a Features
    feats.evaluations                                            # l0, mse, ..., ce_loss_recovered (one row)

`inputs`: a LongTensor [B, T] (every token real) or [T], a list of token-id lists (or 1-D tensors), or a list of
strings with `tokenizer` (tokenized without special tokens, as data.text does). The samples are padded per batch
of `batch_size` as a run pads them (right side, position_ids over real tokens), the model is put in eval mode for
the call (its modes restored after) and every hook the call adds is removed, also on errors.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch
from torch import nn

from hookrun.capture.anatomy import Point
from hookrun.capture.layers import module_names
from hookrun.capture.scope import HookScope
from hookrun.capture.targets import Target, attach, resolve_sites
from hookrun.capture.tokens import TokenInfo, positions_spec
from hookrun.data.text import encode_batch
from hookrun.format.tokens import token_texts
from hookrun.methods.dictionaries import DictionaryUse, dims, nll
from hookrun.methods.saes import Evaluation, load_dictionary
from hookrun.methods.lens import LensError, Recorder, components, default_layers, dla_batch, find_readout, lens_batch
from hookrun.methods.metrics import one_token, logits_of
from hookrun.read.results.dictionaries import ce_loss_recovered, densify
from hookrun.read.results.lens import DLAResult, LensResult

Inputs = Union[torch.Tensor, Sequence[Union[str, Sequence[int], torch.Tensor]]]

__all__ = ["lens", "dla", "features", "Features"]


# ------------------------------------------------------------------------------------------------------ inputs
def sequences(inputs: Inputs, tokenizer=None) -> List[List[int]]:
    """Token ids per sample from a tensor, id lists or texts (texts need the tokenizer; no special tokens added)."""
    if isinstance(inputs, torch.Tensor):
        if inputs.is_floating_point() or inputs.dim() not in (1, 2) or not inputs.numel():
            raise ValueError(f"inputs: a tensor of token ids is [batch, sequence] or [sequence] of integers, not "
                             f"{inputs.dtype} {list(inputs.shape)}")
        return (inputs[None] if inputs.dim() == 1 else inputs).tolist()
    items = list(inputs)
    if not items:
        raise ValueError("inputs: empty; give texts (with tokenizer=), token-id lists or a [batch, sequence] tensor")
    texts = [x for x in items if isinstance(x, str)]
    if texts and len(texts) < len(items):
        raise ValueError("inputs: texts and token ids mixed in one list; give one kind")
    if texts:
        if tokenizer is None:
            raise ValueError("inputs: texts need tokenizer=; or give token ids (a [batch, sequence] tensor or lists)")
        seqs = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        seqs = [x.tolist() if isinstance(x, torch.Tensor) else [int(t) for t in x] for x in items]
    empty = [i for i, s in enumerate(seqs) if not s]
    if empty:
        raise ValueError(f"inputs: sample {empty[0]} has no token; give each sample at least one")
    return [list(map(int, s)) for s in seqs]


def _pad_id(tokenizer) -> int:
    return next((i for i in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
                 if i is not None), 0)


def batches(seqs: List[List[int]], batch_size: int, pad_id: int, device) -> Iterator[Tuple[int, dict, TokenInfo]]:
    """(first sample, forward keywords, TokenInfo) of each batch, padded on the right as data.text pads."""
    for start in range(0, len(seqs), batch_size):
        part = seqs[start:start + batch_size]
        kwargs, info, *_ = encode_batch(part, pad_id, "right", max(map(len, part)))
        yield start, {k: v.to(device) for k, v in kwargs.items()}, info.to(device)


def _device(model: nn.Module):
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@contextlib.contextmanager
def _evaluating(model: nn.Module):
    """The model in eval mode for the call, each module's mode as it was afterwards."""
    training = [m for m in model.modules() if m.training]  # (the others are left in eval mode as they were)
    if training:
        model.eval()
    try:
        yield
    finally:
        for m in training:
            m.training = True


def _token_ids(key: str, tokens, tokenizer, vocab: int, n: int) -> Optional[torch.Tensor]:
    """[n, T] ids of token arguments: strings of one token, ids, or one list a sample (per-sample answers)."""
    if tokens is None:
        return None
    tokens = [tokens] if isinstance(tokens, (str, int)) else list(tokens)
    columns = []
    for j, t in enumerate(tokens):
        values = t if isinstance(t, (list, tuple, torch.Tensor, np.ndarray)) else [t] * n
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != n:
            raise ValueError(f"{key}[{j}]: {len(values)} values for {n} samples; give one a sample")
        ids = []
        for v in values:
            if isinstance(v, str):
                if tokenizer is None:
                    raise ValueError(f"{key}[{j}]: {v!r} is a string but no tokenizer= was given; give its id")
                v = one_token(v, tokenizer)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
                raise ValueError(f"{key}[{j}]: {v!r} is not a token of the model's {vocab}; give a string of one "
                                 "token or an id")
            ids.append(v)
        columns.append(ids)
    return torch.as_tensor(columns, dtype=torch.long).t().reshape(n, len(columns))


def _labels(key: str, tokens) -> List[str]:
    """How each token argument is named in a result, as a run names its settings: ' text' (repr), an id, and a list of
    one a sample (where a run names its field) by its place, `key[j]`."""
    tokens = [tokens] if isinstance(tokens, (str, int)) else list(tokens)
    return [repr(t) if isinstance(t, str) else str(int(t)) if isinstance(t, (int, np.integer)) else f"{key}[{j}]"
            for j, t in enumerate(tokens)]


def _vocab(readout) -> int:
    w = getattr(readout.unembed, "weight", None)
    return int(w.shape[0]) if w is not None else 1 << 62


# --------------------------------------------------------------------------------------------------------- lens
def lens(model: nn.Module, inputs: Inputs, *, tokenizer=None, layers="blocks", positions="last", k: int = 5,
         tokens=None, dla=None, norm: Optional[str] = None, unembed: Optional[str] = None,
         batch_size: int = 32) -> LensResult:
    """The logit lens of `model` on `inputs`, as a run with `lens: {sites: {layers, positions}, top_k: k, tokens}`
    stores it: top-k tokens, the given tokens' log-probability and rank, and each site's KL to the model's output
    and entropy; a LensResult (to_frame(), top(sample)). `dla`: the DLA too, from the same forwards (`lens.dla`):
    its answer as hookrun.dla takes it, or a dict of hookrun.dla's answer, position, heads and tolerance; in `.dla`.

        r = hookrun.lens(gpt2, ids, layers="blocks.*", positions="all", tokens=[" Paris"], tokenizer=tok)
        r.top_ids[0, -1, -1]; r.logprob[..., 0]; r.kl.shape == (samples, layers, positions)
        r = hookrun.lens(gpt2, ids, positions="all", dla=[" Paris", " Rome"], tokenizer=tok); r.dla.frame()
    """
    seqs = sequences(inputs, tokenizer)
    readout = find_readout(model, norm, unembed)
    sites, names = _lens_sites(model, layers)
    every = positions == "all"
    pos = list(range(max(map(len, seqs)))) if every else positions_spec(positions)[0]
    _check_positions("positions", [] if every else pos, seqs)
    ids = _token_ids("tokens", tokens, tokenizer, _vocab(readout), len(seqs))
    if ids is not None and ids.shape[1] == 0:
        ids = None
    gather = _dla_pass(model, seqs, dla, tokenizer, readout)
    out: Dict[Tuple[str, str], List[torch.Tensor]] = {}
    recorder = Recorder(model, gather.outputs if gather else [], gather.inputs if gather else [], sites)
    try:
        with _evaluating(model), torch.no_grad():
            for start, kwargs, info in batches(seqs, batch_size, _pad_id(tokenizer), _device(model)):
                output = model(**kwargs)
                kept = recorder.take()
                resid = [kept["site", n] for n in names]
                b = info.mask.shape[0]
                chosen = ids[start:start + b].to(info.mask.device) if ids is not None else None
                logits = logits_of(output)
                for key, values in lens_batch(readout, names, resid, info, pos, every, k, chosen, logits).items():
                    out.setdefault(key, []).append(values.cpu())
                if gather is not None:
                    gather.add(kept, info, start, start // batch_size, logits)
    finally:
        recorder.close()
    cat = {key: torch.cat(v).numpy() for key, v in out.items()}
    labels = [] if ids is None else _labels("tokens", tokens)
    get = lambda layer, role, dtype: cat[layer, role].astype(dtype) if (layer, role) in cat else None  # noqa: E731
    return LensResult(get("top", "ids", np.int64), get("top", "probs", np.float32), get("tokens", "logprob", np.float32),
                      get("tokens", "rank", np.int64), names, pos, labels, np.arange(len(seqs)),
                      gather.result(len(seqs)) if gather is not None else None, tokenizer,
                      kl=get("dist", "kl", np.float32), entropy=get("dist", "entropy", np.float32))


def _lens_sites(model: nn.Module, layers) -> Tuple[List[Target], List[str]]:
    if layers == "blocks":
        found = default_layers(model)
        if found is None:
            raise LensError(f"layers: blocks picks every block of a known architecture, and {type(model).__name__} is "
                            "none; give standard names (blocks.*) or module names")
        named = module_names(model)
        return [Target(n, named[n], Point(n, n), False) for n in found], found
    targets, problems = resolve_sites(model, layers, None, "layers")
    if problems:
        raise LensError("; ".join(problems))
    return targets, [t.name for t in targets]


def _check_positions(key: str, positions: Sequence[int], seqs: List[List[int]]) -> None:
    short = min(map(len, seqs))
    bad = [p for p in positions if not -short <= p < short]
    if bad:
        raise ValueError(f"{key}: position {bad[0]} is beyond a sample of {short} tokens; use positions inside "
                         "every sample (first, last, or -1, -2, ...)")


# ---------------------------------------------------------------------------------------------------------- DLA
DLA_KEYS = ("answer", "position", "heads", "tolerance")  # lens(dla={...})'s keys: hookrun.dla's, as lens.dla's


class _DLAPass:
    """The DLA of `answer` gathered batch by batch from forwards recorded for it: hookrun.dla, and hookrun.lens's
    `dla=` (the lens and the DLA from one forward a batch, as a run's `lens:` block computes them); `key` prefixes
    the argument names in its errors (`dla.` for lens's).

        d = _DLAPass(model, seqs, [" good", " bad"], tok, "last", "auto", 1e-3, readout)
        d.add(kept, info, start, batch_index, logits) ...; d.result(len(seqs))
    """

    def __init__(self, model: nn.Module, seqs: List[List[int]], answer, tokenizer, position, heads, tolerance: float,
                 readout, key: str = ""):
        answer = [answer] if isinstance(answer, (str, int)) else list(answer)
        if len(answer) not in (1, 2):
            raise ValueError(f"{key}answer: {answer!r}; give [A] (its logit) or [A, B] (logit A - logit B)")
        self.ids = _token_ids(f"{key}answer", answer, tokenizer, _vocab(readout), len(seqs))
        if isinstance(position, list):
            raise ValueError(f"{key}position: {position!r}; DLA attributes one position: last, first or an int")
        _check_positions(f"{key}position", positions_spec(position)[0], seqs)
        comps = components(model)
        readout.norm_form()
        split = [c for c in comps if c.kind == "attn" and c.out_proj is not None]
        if heads is True and len(split) < len([c for c in comps if c.kind == "attn"]):
            raise LensError(f"{key}heads: true, but {type(model).__name__}'s attention blocks have no linear per-head "
                            "split; give heads='auto' or False")
        self.comps, self.split = comps, split if heads in ("auto", True) else []
        self.readout, self.position, self.tolerance = readout, position, tolerance
        self.labels = _labels("answer", answer)
        self.outputs = [c.name for c in comps]  # what the recorder keeps for it: outputs, then inputs
        self.inputs = [readout.norm_name] + [c.out_proj_name for c in self.split]
        self.parts: List[torch.Tensor] = []
        self.logit: List[torch.Tensor] = []
        self.heads: List[torch.Tensor] = []

    def add(self, kept: dict, info: TokenInfo, start: int, index: int, logits: torch.Tensor) -> None:
        """One batch's parts, logit and heads, from what the recorder kept of its forward."""
        b = info.mask.shape[0]
        p, lg, h = dla_batch(self.readout, self.comps, self.split, lambda kind, name: kept[kind, name], info,
                             self.position, self.ids[start:start + b].to(info.mask.device), logits, self.tolerance,
                             index)
        self.parts.append(p.cpu()), self.logit.append(lg.cpu())
        if h is not None:
            self.heads.append(h.cpu())

    def result(self, n: int) -> DLAResult:
        comps = self.comps
        return DLAResult(torch.cat(self.parts).numpy(), torch.cat(self.logit).numpy(),
                         torch.cat(self.heads).numpy() if self.heads else None, [c.name for c in comps] + ["bias"],
                         [c.kind for c in comps] + ["bias"], [c.layer for c in comps] + [None],
                         [c.layer for c in self.split], self.labels, self.position, np.arange(n))


def _dla_pass(model: nn.Module, seqs: List[List[int]], dla, tokenizer, readout) -> Optional[_DLAPass]:
    """lens(dla=...): the answer (as hookrun.dla's), or a dict of hookrun.dla's keywords (answer, position, heads,
    tolerance); None without one."""
    if dla is None:
        return None
    spec = dict(dla) if isinstance(dla, dict) else {"answer": dla}
    unknown = sorted(set(spec) - set(DLA_KEYS))
    if unknown or "answer" not in spec:
        raise ValueError(f"dla: {dla!r}; give the answer ([A] or [A, B]) or a dict of {', '.join(DLA_KEYS)} (answer "
                         f"required){f'; unknown: {unknown}' if unknown else ''}")
    return _DLAPass(model, seqs, spec["answer"], tokenizer, spec.get("position", "last"), spec.get("heads", "auto"),
                    spec.get("tolerance", 1e-3), readout, key="dla.")


def dla(model: nn.Module, inputs: Inputs, answer, *, tokenizer=None, position="last", heads: Any = "auto",
        tolerance: float = 1e-3, norm: Optional[str] = None, unembed: Optional[str] = None,
        batch_size: int = 32) -> DLAResult:
    """Direct logit attribution of `answer` ([A]: logit(A); [A, B]: logit(A) - logit(B); each a string of one token,
    an id, or a list of one a sample) at `position`, as a run with `lens: {dla: {tokens: answer, position, heads}}`
    stores it: each component's (embeddings, every block's attention and MLP) and head's part; a DLAResult. With the
    lens too, `hookrun.lens(..., dla=answer)` computes both from one forward a batch.

        d = hookrun.dla(gpt2, ["The capital of France is"], [" Paris", " Rome"], tokenizer=tok)
        d.frame(); d.blocks(); d.heads.shape == (samples, layers, heads)
    """
    seqs = sequences(inputs, tokenizer)
    readout = find_readout(model, norm, unembed)
    gather = _DLAPass(model, seqs, answer, tokenizer, position, heads, tolerance, readout)
    recorder = Recorder(model, gather.outputs, gather.inputs)
    try:
        with _evaluating(model), torch.no_grad():
            for start, kwargs, info in batches(seqs, batch_size, _pad_id(tokenizer), _device(model)):
                output = model(**kwargs)
                gather.add(recorder.take(), info, start, start // batch_size, logits_of(output))
    finally:
        recorder.close()
    return gather.result(len(seqs))


# ------------------------------------------------------------------------------------------- dictionary features
@dataclass(repr=False)
class Features:
    """A dictionary's features at one site, a row a real token (the rows of `tokens`): `indices` int32 / `values`
    float32 [tokens, k] (largest first; index -1 where fewer fired), `error_norm` [tokens] (|x - x_hat|), and with
    evaluate, `evaluations` (one row: tokens, l0, l1, mse, explained_variance, cossim, dead_features, ce_clean,
    ce_spliced, ce_zero, ce_loss_recovered), as cap.read("dictionaries") gives them.

        f = hookrun.features(model, ids, sae, site="blocks.1", k=16); f.dense([12, 40]); f.top(12)
    """

    indices: np.ndarray
    values: np.ndarray
    error_norm: np.ndarray
    tokens: pd.DataFrame  # sample, position, token_id (and token with a tokenizer)
    d_sae: int
    evaluations: Optional[pd.DataFrame] = None

    def dense(self, features: Optional[Sequence[int]] = None) -> np.ndarray:
        """The features dense [tokens, d_sae] (or only the ones given, in that order)."""
        return densify(self.indices, self.values, self.d_sae, features)

    def top(self, feature: int, k: int = 10) -> pd.DataFrame:
        """The k tokens where `feature` is largest: their rows of `tokens` and the value."""
        acts = self.dense([feature])[:, 0]
        order = np.argsort(-acts, kind="stable")[:k]
        return self.tokens.iloc[order].assign(value=acts[order]).reset_index(drop=True)

    def __repr__(self) -> str:
        return (f"Features: {len(self.indices)} tokens x top {self.indices.shape[1]} of {self.d_sae}"
                + (f"\n{self.evaluations.to_string(index=False)}" if self.evaluations is not None else ""))


def features(model: nn.Module, inputs: Inputs, dictionary, *, site: str, tokenizer=None, k: Optional[int] = None,
             evaluate: bool = False, batch_size: int = 32) -> Features:
    """The features of `dictionary` (a module with encode/decode, a SAELens folder or a spec dict) on the tensor at
    `site` (a standard name, e.g. blocks.1, or a module name), a row a real token, as a run with a hook
    `{layers: [site], dictionary: NAME, top_k: k, evaluate: evaluate}` stores them. k None: every nonzero feature
    (up to a TopK SAE's k, else 64 a token, as a hook's top_k: null).

        f = hookrun.features(gpt2, ids, "runs/sae", site="blocks.1", k=16, evaluate=True); f.evaluations
    """
    seqs = sequences(inputs, tokenizer)
    module = dictionary if isinstance(dictionary, nn.Module) else load_dictionary(dictionary, device=_device(model))
    d_in, d_sae = dims(module)
    use = DictionaryUse(site, "dictionary", module, k, None, evaluate)  # what a hook with top_k: k keeps
    targets, problems = resolve_sites(model, [site], None, "site")
    if problems or len(targets) != 1:
        raise ValueError("; ".join(problems) or f"site: {site!r} names {len(targets)} sites; give one")
    seen: Dict[str, torch.Tensor] = {}
    keep = lambda value: seen.__setitem__("x", value) or value  # noqa: E731
    ev = Evaluation(d_sae) if evaluate and d_sae is not None else None
    ce = np.zeros(4)
    idx_parts, val_parts, err_parts, rows = [], [], [], []  # rows: (sample, position, token id) of each batch
    with _evaluating(model), torch.no_grad():
        for start, kwargs, info in batches(seqs, batch_size, _pad_id(tokenizer), _device(model)):
            with HookScope() as scope:
                attach(scope, model, targets, [keep])
                output = model(**kwargs)
            x = seen.pop("x")
            if d_in is not None and x.shape[-1] != d_in:
                raise ValueError(f"site: {site} is {list(x.shape)}, but the dictionary reads {d_in}-wide activations")
            real = info.keep
            xr = x[real]  # the real tokens only: pads are never encoded, as a hook's stored rows
            fr = module.encode(xr)
            xhr = module.decode(fr)
            xr = xr.to(xhr.dtype)
            i, v = use.sparse(fr)
            idx_parts.append(i.cpu()), val_parts.append(v.cpu())
            err_parts.append((xr - xhr).norm(dim=-1).float().cpu())
            sample, col = real.nonzero(as_tuple=True)
            rows.append(torch.stack([sample + start, col, kwargs["input_ids"][sample, col]]).cpu())
            if ev is not None:
                ev.add(xr, xhr, fr)
                ce += _ce_losses(model, kwargs, info, targets, module, logits_of(output))
    sample, position, token_id = torch.cat(rows, 1).numpy()
    table = pd.DataFrame({"sample": sample, "position": position, "token_id": token_id})  # one frame, not one a batch
    if tokenizer is not None:
        table["token"] = token_texts(tokenizer, table["token_id"].tolist())
    evaluations = None
    if ev is not None:
        r = ev.result()
        clean, spliced, zero = ce[1] / ce[0], ce[2] / ce[0], ce[3] / ce[0]
        evaluations = pd.DataFrame([dict(layer=targets[0].name, tokens=r["tokens"], l0=r["l0"], l1=r["l1"],
                                         mse=r["mse"], explained_variance=r["explained_variance"], cossim=r["cossim"],
                                         dead_features=r["dead_features"], ce_clean=clean, ce_spliced=spliced,
                                         ce_zero=zero, ce_loss_recovered=ce_loss_recovered(clean, spliced, zero))])
    return Features(torch.cat(idx_parts).numpy(), torch.cat(val_parts).numpy(), torch.cat(err_parts).numpy(), table,
                    int(d_sae if d_sae is not None else idx_parts[0].shape[1]), evaluations)


def _ce_losses(model, kwargs, info, targets, module, clean_logits) -> np.ndarray:
    """(predicted tokens, summed next-token loss clean, with the reconstruction spliced, with the site zeroed)."""
    ids = kwargs["input_ids"]
    pairs, clean = nll(clean_logits, ids, info)
    losses = []
    for fn in (lambda t: module.decode(module.encode(t)).to(t.dtype), torch.zeros_like):
        with HookScope() as scope:
            attach(scope, model, targets, [fn])
            losses.append(nll(model(**kwargs), ids, info)[1])
    return np.array([pairs, clean, *losses], dtype=np.float64)
