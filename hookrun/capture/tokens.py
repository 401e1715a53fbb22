"""Per-token layout of captures on text batches: real-token rows, positions, heads, attention patterns.

A text batch carries a TokenInfo (built by hookrun.data.text, moved to the device with the batch):
`mask` [B, T] marks real tokens (not padding), `keep` the real tokens that are stored (minus
BOS/EOS/pad ids when data.text.exclude_special). Everything here runs on the device, in the hook.

    t = heads(t, info, [0, 2])          # attention heads: axis 1 of [B, H, T, T], axis 2 of [B, T, H, Dh]
    t = at_positions(t, info, "last")   # [B, T, ...] -> [B, ...]: each sequence's last real token
    rows, is_token = per_token(t, info) # [B, T, ...] -> [n_kept, ...]; [B, H, T, T] -> [n_kept, H, max_length]

Positions count real tokens only: position 0 is a sequence's first real token (its BOS if one was
prepended) whatever the padding side; -1 is its last real token.

In a generate run (hookrun.methods.generation) the model reads the prompts in pass (step) 0, then one token a sequence in
each decoding pass k >= 1: the k-th token it wrote (nnsight's `tracer.iter[k]`). Each pass has its own TokenInfo whose
`step` gives, per token, the pass that reads it first (0: the prompt), which is its `step` in the token table;
`generated` is step > 0. The plain loop re-reads the whole sequence in every pass: its pass k keeps (stores) only the
tokens of step k, and an edit applies to a token in every pass that re-reads it, as to the cached state it stands for.
`positions:` (edits, and a generate run's `select`) name tokens by what they are, the same in every pass:

    prompt | generated | all     the prompt's real tokens (step 0), the written ones (steps >= 1), both
    last                        the prompt's last real token and every generated token (each pass's newest)
    first, ints, [ints]         prompt positions (-1: the prompt's last real token)
    {steps: 2} | {steps: [0, 2]} | {steps: {start: 1, stop: 4}}   the tokens of those steps (stop excluded)
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from hookrun.config.checks import as_list, is_int

NAMED_POSITIONS = {"first": 0, "last": -1}
TOKEN_SETS = ("prompt", "generated", "all")  # named sets of a pass's tokens (a generate run's prompt and steps)
STEPS = "steps"  # positions: {steps: ...} the tokens the model reads in those passes of a generate run
STEP_RANGE = ("start", "stop", "step")  # {steps: {start: 1, stop: 4}}: passes 1, 2, 3 (`step`: a stride)


def tokenizer_digest(tokenizer) -> Optional[str]:
    """What a tokenizer is, as 16 hex digits of BLAKE2b: its class and definition (a fast tokenizer's JSON, else its
    vocabulary and special tokens); None without a tokenizer. Two objects built alike have one digest: the store's
    fingerprint of the tokenizer (hookrun.engine.fingerprint), and the key of the token texts decoded with it.

        tokenizer_digest(tok) == tokenizer_digest(copy.deepcopy(tok))  # True"""
    if tokenizer is None:
        return None
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}".encode())
    backend = _fast_backend(tokenizer)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        special = getattr(tokenizer, "special_tokens_map", {})
        h.update(json.dumps([sorted(vocab.items()), special], sort_keys=True, default=str).encode())
    return h.hexdigest()


_DECODED: "collections.OrderedDict[str, dict]" = collections.OrderedDict()  # digest -> {token id: text}
DECODED_KEPT = 8  # tokenizer definitions whose decoded token texts a process keeps
_DECODED_BY_OBJECT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizers without a definition


def decoded_texts(tokenizer, digest: Optional[str]) -> dict:
    """The token id -> text cache (token_texts' answers) of a tokenizer whose tokenizer_digest is `digest`, shared by
    the runs of one process whose tokenizers are built alike (a config's tokenizer is a new object each run): a
    rerun decodes no token again; the last DECODED_KEPT definitions' are kept. A tokenizer without a definition to
    digest (no fast backend, no vocabulary) keeps its own, by object; a fresh dict for None.

        texts = decoded_texts(tok, tokenizer_digest(tok))"""
    if tokenizer is None:
        return {}
    if not _defined(tokenizer):
        try:
            return _DECODED_BY_OBJECT.setdefault(tokenizer, {})
        except TypeError:  # no weak reference to it
            return {}
    texts = _DECODED.pop(digest, None)
    _DECODED[digest] = texts = {} if texts is None else texts
    while len(_DECODED) > DECODED_KEPT:
        _DECODED.popitem(last=False)
    return texts


def _fast_backend(tokenizer):
    """A fast tokenizer's backend, whose JSON (to_str) is its whole definition; None for others."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if backend is not None and hasattr(backend, "to_str") else None


def _defined(tokenizer) -> bool:
    """Whether tokenizer_digest reads what the tokenizer decodes by: a fast backend's JSON, or a vocabulary."""
    return _fast_backend(tokenizer) is not None or hasattr(tokenizer, "get_vocab")


class TokenError(RuntimeError):
    """A token selection does not fit the batch (a position beyond a sequence, no head axis)."""


@dataclass
class TokenInfo:
    """Which entries of a [B, T] text batch are real tokens, and which of them are stored."""

    mask: torch.Tensor  # [B, T] bool: real tokens
    keep: torch.Tensor  # [B, T] bool: real tokens that are stored (a subset of mask)
    max_length: int  # the longest a sequence can be: the key axis of stored attention patterns
    all_kept: bool  # every entry is stored (no pads, nothing excluded): rows are a reshape, not a gather
    kept_rows: Optional[torch.Tensor]  # [n_kept] flat indices of keep (made once a batch, on the host); None: all kept
    ids: Optional[torch.Tensor] = None  # [B, T] the input token ids (a patch from another run compares them)
    step: Optional[torch.Tensor] = None  # generate runs: [B, T] long, the pass that reads each token (0: the prompt)

    def to(self, device) -> "TokenInfo":
        """The same tokens on `device`: itself where they are (what it worked out once, kept)."""
        if self.mask.device == torch.device(device):
            return self
        move = lambda t: t.to(device, non_blocking=True) if t is not None else None  # noqa: E731
        return TokenInfo(move(self.mask), move(self.keep), self.max_length, self.all_kept, move(self.kept_rows),
                         move(self.ids), move(self.step))

    @property
    def generated(self) -> Optional[torch.Tensor]:
        """[B, T] bool: the tokens the model wrote (generate runs; else None)."""
        return self.step > 0 if self.step is not None else None

    @staticmethod
    def of_batch(mask: torch.Tensor, keep: torch.Tensor, max_length: int, ids: Optional[torch.Tensor] = None,
                 kept_rows: Optional[torch.Tensor] = None, lengths: Optional[torch.Tensor] = None,
                 first: Optional[torch.Tensor] = None) -> "TokenInfo":
        """A text batch's tokens, with the flat indices of the stored ones worked out once (or given: `kept_rows`,
        and the sequences' `lengths` and `first` columns, where the batch was made knowing them)."""
        if kept_rows is not None:
            all_kept = len(kept_rows) == keep.numel()
        else:
            all_kept = bool(keep.all())
            kept_rows = None if all_kept else keep.reshape(-1).nonzero().squeeze(1)
        info = TokenInfo(mask, keep, max_length, all_kept, None if all_kept else kept_rows, ids)
        if lengths is not None:
            info.__dict__["lengths"] = lengths  # the cached properties, filled
        if first is not None:
            info.__dict__["first"] = first
        return info

    def head(self, n: int) -> "TokenInfo":
        """The tokens of the batch's first `n` sequences."""
        cut = TokenInfo.of_batch(self.mask[:n], self.keep[:n], self.max_length,
                                 self.ids[:n] if self.ids is not None else None)
        cut.step = self.step[:n] if self.step is not None else None
        return cut

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """Each sequence's real tokens [B] (worked out once a batch: the hooks and methods ask for it often)."""
        return self.mask.sum(1)

    @functools.cached_property
    def first(self) -> torch.Tensor:
        """The column of each sequence's first real token (> 0 under left padding)."""
        return (self.mask.cumsum(1) == 0).sum(1)


def require(info: Optional[TokenInfo], key: str) -> TokenInfo:
    """The batch's tokens, for a setting that needs them (positions, heads); TokenError on a run without text."""
    if info is None:
        raise TokenError(f"{key}: this run has no text (no data.text, no dataset of token ids), so its tensors have "
                         "no real-token positions or heads; use select: {dim: 1, index: -1} (a column) or edit "
                         "with dim/index instead, or give the data as data.text")
    return info


def positions_spec(spec) -> Tuple[List[int], bool]:
    """(relative positions, squeeze) from `last | first | int | [ints]`; squeeze for a single name or int."""
    if isinstance(spec, str):
        return [NAMED_POSITIONS[spec]], True
    if isinstance(spec, int):
        return [spec], True
    return [NAMED_POSITIONS.get(p, p) for p in as_list(spec)], False


def check_positions(key: str, spec, sets: bool = False) -> List[str]:
    """Problems with a `positions:` setting; `sets`: the TOKEN_SETS names and {steps: ...} are taken too (edits,
    select: a generate run's passes)."""
    if sets and (isinstance(spec, str) and spec in TOKEN_SETS or is_steps(spec)):
        return [] if not is_steps(spec) or step_filter(spec[STEPS]) else [
            f"{key}.steps: {spec[STEPS]!r} is not a set of passes; give a pass (0: the prompt, k: the one reading the "
            "k-th generated token), a list of them, e.g. [0, 2], or {start: 1, stop: 4} (stop excluded)"]
    items = spec if isinstance(spec, list) else [spec]
    bad = [p for p in items if not (isinstance(p, str) and p in NAMED_POSITIONS or is_int(p))]
    if bad or not items:
        also = f", one of {', '.join(TOKEN_SETS)}, or {{steps: [0, 2]}} (a generate run's passes)" if sets else ""
        return [f"{key}: {spec!r} is not a position; use last, first, an int (0 = first real token, -1 = last) "
                f"or a list of them, e.g. [0, -1]{also}"]
    return []


def is_steps(spec) -> bool:
    """Whether a `positions:` setting names passes of a generate run ({steps: ...})."""
    return isinstance(spec, dict) and set(spec) == {STEPS}


def step_filter(value) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """`steps:` (a pass, a list of them, {start, stop, step}) as a function of a [B, T] step tensor -> [B, T] bool;
    None if `value` is none of these."""
    listed = [value] if is_int(value) else value
    if isinstance(listed, list) and listed and all(is_int(v) and v >= 0 for v in listed):
        return lambda s: torch.isin(s, torch.as_tensor(listed, device=s.device))
    if not (isinstance(value, dict) and value and set(value) <= set(STEP_RANGE) and
            all(is_int(v) and v >= 0 for v in value.values())):
        return None
    start, stop, stride = value.get("start", 0), value.get("stop"), value.get("step", 1)
    if stride < 1 or stop is not None and stop <= start:
        return None
    return lambda s: (s >= start) & ((s - start) % stride == 0) & (s < stop if stop is not None else True)


def token_set(info: TokenInfo, name: str) -> torch.Tensor:
    """[B, T] bool: the real tokens of this pass in the set `name` (prompt | generated | all)."""
    generated = info.generated if info.generated is not None else torch.zeros_like(info.mask)
    return info.mask & {"all": torch.ones_like(generated), "generated": generated, "prompt": ~generated}[name]


def is_tokens(t: torch.Tensor, info: TokenInfo) -> bool:
    """Whether the leading axes of `t` are the batch's [batch, sequence]."""
    return t.dim() >= 2 and tuple(t.shape[:2]) == tuple(info.mask.shape)


def is_attention(t: torch.Tensor, info: TokenInfo) -> bool:
    """Whether `t` is an attention pattern [batch, heads, query, key] of the batch's sequences."""
    b, n = info.mask.shape
    return t.dim() == 4 and t.shape[0] == b and t.shape[2] == n and t.shape[3] == n and t.shape[1] != n


def columns(info: TokenInfo, positions: List[int], key: str = "positions") -> torch.Tensor:
    """[B, P] columns of the relative positions in each sequence; raises if one falls outside a sequence."""
    rel = torch.as_tensor(positions, device=info.mask.device, dtype=torch.long)[None, :]
    lengths = info.lengths[:, None]
    rel = torch.where(rel < 0, lengths + rel, rel)
    if bool(((rel < 0) | (rel >= lengths)).any()):
        shortest = int(info.lengths.min())
        raise TokenError(f"{key}: {positions} reaches beyond a sequence of {shortest} real tokens in this batch; "
                         "use positions inside every sequence (e.g. first / last) or drop short documents")
    return info.first[:, None] + rel


def at_positions(t: torch.Tensor, info: TokenInfo, spec, key: str = "select.positions") -> torch.Tensor:
    """The entries of `t` at each sequence's positions: [B, T, ...] -> [B, P, ...] (or [B, ...] for one)."""
    if spec in TOKEN_SETS or is_steps(spec):
        raise TokenError(f"{key}: {spec} names tokens of a generate run's passes; a run without generate stores every "
                         "real token anyway (drop select.positions)")
    positions, squeeze = positions_spec(spec)
    cols = columns(info, positions, key)
    rows = torch.arange(len(cols), device=cols.device)[:, None]
    if is_attention(t, info):  # query positions, keys realigned to real positions: [B, P, H, max_length]
        out = _real_keys(t.permute(0, 2, 1, 3), info)[rows, cols]
    elif is_tokens(t, info):
        out = t[rows, cols]
    else:
        raise TokenError(f"{key}: a capture of shape {list(t.shape)} has no [batch, sequence] axes of this "
                         f"batch {list(info.mask.shape)}; positions apply to per-token tensors")
    return out[:, 0] if squeeze else out


def position_mask(t: torch.Tensor, info: TokenInfo, spec, key: str = "edit.positions") -> torch.Tensor:
    """A bool mask broadcastable to `t` [B, T, ...], true at each sequence's positions."""
    if not is_tokens(t, info):
        raise TokenError(f"{key}: a tensor of shape {list(t.shape)} has no [batch, sequence] axes of this batch "
                         f"{list(info.mask.shape)}; edits at positions apply to per-token tensors")
    mask = token_mask(info, spec, key).to(t.device)
    return mask.reshape(*mask.shape, *([1] * (t.dim() - 2)))


def token_mask(info: TokenInfo, spec, key: str = "positions") -> torch.Tensor:
    """[B, T] bool: the tokens of this pass that `spec` names (the module docstring's table)."""
    if spec in TOKEN_SETS:
        return token_set(info, spec)
    step = info.step if info.step is not None else torch.zeros_like(info.mask, dtype=torch.long)
    if is_steps(spec):
        return info.mask & step_filter(spec[STEPS])(step)
    prompt = info.mask & (step == 0)
    mask = torch.zeros(info.mask.shape, dtype=torch.bool, device=info.mask.device)
    if bool(prompt.any()):  # positions count the prompt's real tokens: none in a decoding pass
        part = TokenInfo(prompt, prompt, info.max_length, False, None)
        cols = columns(part, positions_spec(spec)[0], key)
        mask[torch.arange(len(cols), device=cols.device)[:, None], cols] = True
    return mask | (info.mask & (step > 0)) if spec == "last" else mask


def head_axis(t: torch.Tensor, info: TokenInfo) -> Optional[int]:
    """Axis 1 of an attention pattern [B, H, T, T]; axis 2 of a per-head tensor [B, T, H, Dh]; else None."""
    if is_attention(t, info):
        return 1
    if t.dim() == 4 and is_tokens(t, info):
        return 2
    return None


def heads(t: torch.Tensor, info: TokenInfo, spec, key: str = "select.heads") -> torch.Tensor:
    """`t` with only the listed heads (the head axis is kept)."""
    axis = head_axis(t, info)
    if axis is None:
        raise TokenError(f"{key}: a capture of shape {list(t.shape)} has no head axis; heads apply to attention "
                         "patterns [batch, heads, seq, seq] and per-head tensors [batch, seq, heads, d_head]")
    return t.index_select(axis, torch.as_tensor(as_list(spec), device=t.device, dtype=torch.long))


def _real_keys(t: torch.Tensor, info: TokenInfo) -> torch.Tensor:
    """[B, Q, H, T] with keys at padded columns -> [B, Q, H, max_length] with key j = real position j (0 past the end)."""
    b, n = info.mask.shape
    j = torch.arange(info.max_length, device=t.device)
    cols = (info.first[:, None] + j).clamp(max=n - 1)  # [B, L]
    out = t.gather(3, cols[:, None, None, :].expand(*t.shape[:3], info.max_length))
    valid = j[None, :] < info.lengths[:, None]
    return torch.where(valid[:, None, None, :], out, torch.zeros((), dtype=out.dtype, device=out.device))


def per_token(t: torch.Tensor, info: TokenInfo) -> Tuple[torch.Tensor, bool]:
    """(rows of the kept tokens, True) for a per-token tensor or attention pattern; (t, False) otherwise."""
    if is_attention(t, info):
        return _kept(_real_keys(t.permute(0, 2, 1, 3), info), info), True
    if is_tokens(t, info):
        return _kept(t, info), True
    return t, False


def _kept(t: torch.Tensor, info: TokenInfo) -> torch.Tensor:
    """[B, T, ...] -> [n_kept, ...]: a view when every token is kept, else one gather of the kept rows (a
    boolean mask would search the mask again for every capture: ~4x slower)."""
    flat = t.reshape(-1, *t.shape[2:])
    return flat if info.all_kept else flat.index_select(0, info.kept_rows)
