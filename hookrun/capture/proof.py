"""The anatomy's proof: one tiny forward with plain hooks on every module, and the identities a model's parts must
satisfy on it (the residual stream adds up, the heads are the pattern applied to the values, the logits are the
unembedding of the final norm), each site's worst relative error and the sites that did not add up.

    seen = trace(model)                      # every module's first call on 2 x 5 token ids (eager attention)
    found = check(anat, seen)                # Proof: errors by site, failed sites with why and the key to declare

An inferred anatomy (hookrun.capture.inference) is used only where its proof holds; a table's or a declared one is
proved the same way when the anatomy is found (hookrun.capture.anatomy), and a site whose identity fails is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

ROWS, COLUMNS = 2, 5  # the tiny forward's token ids: [2, 5]
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # the largest relative error that adds up; 16-bit: 5e-2


def call_input(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The tensor a module's call reads: its first positional tensor, else hidden_states, else the first tensor
    keyword (None: none).

        x = call_input(args, kwargs)   # in a forward hook's (args, kwargs)
    """
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


@dataclass
class Call:
    """A module's first call in the trace: its positional and keyword arguments and its output (references)."""

    order: int
    args: tuple
    kwargs: dict
    output: object

    def input(self) -> Optional[torch.Tensor]:
        """The tensor the module reads (call_input)."""
        return call_input(self.args, self.kwargs)

    def out(self, index: int = 0) -> Optional[torch.Tensor]:
        """The output's element `index` (the output itself when it is a tensor and index is 0)."""
        o = self.output
        if isinstance(o, torch.Tensor):
            return o if index == 0 else None
        if isinstance(o, (tuple, list)) and len(o) > index and isinstance(o[index], torch.Tensor):
            return o[index]
        return None


@dataclass
class Trace:
    """One tiny forward: module name -> its first Call, the logits, the ids; `error` says why there is none."""

    calls: Dict[str, Call] = field(default_factory=dict)
    logits: Optional[torch.Tensor] = None
    ids: Optional[torch.Tensor] = None
    error: Optional[str] = None

    @property
    def batch_shape(self):
        return tuple(self.ids.shape) if self.ids is not None else None


def _configs(model: nn.Module) -> List[object]:
    """Every config object the model and its modules hold (and their sub-configs), once each."""
    seen, out = set(), []
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        c = stack.pop()
        if c is None or id(c) in seen or not hasattr(c, "_attn_implementation_internal"):
            continue
        seen.add(id(c))
        out.append(c)
        stack += [getattr(c, k, None) for k in getattr(c, "sub_configs", {}) or {}]
    return out


def _vocab(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    v = getattr(text, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    return int(getattr(emb, "num_embeddings", 2) or 2)


def trace(model: nn.Module) -> Trace:
    """Every module's first call on one forward of [2, 5] token ids (attention forced to eager for the call, dropout
    off, no gradient; the model's modes and settings restored); Trace.error says why it could not be called (weights
    not loaded, a forward that takes no token ids); an error of the model's own forward propagates."""
    params = [p for p in model.parameters()]
    if any(p.is_meta for p in params):
        return Trace(error="its weights are on the meta device (not loaded)")
    device = params[0].device if params else torch.device("cpu")
    vocab = _vocab(model)
    ids = ((torch.arange(ROWS * COLUMNS).reshape(ROWS, COLUMNS) * 7 + 3) % max(vocab - 1, 1) + 1).to(device)
    found = Trace(ids=ids)
    order = iter(range(1 << 30))

    def record(name):
        def hook(module, args, kwargs, output):  # copies: a later in-place add (Falcon's) must not change them
            if name not in found.calls:
                found.calls[name] = Call(next(order), _copy(args), {k: _copy(v) for k, v in kwargs.items()},
                                         _copy(output))
        return hook

    configs = _configs(model)
    impl = [(c, c._attn_implementation_internal) for c in configs]
    training = [(m, m.training) for m in model.modules()]
    handles = [m.register_forward_hook(record(n), with_kwargs=True) for n, m in model.named_modules() if n]
    try:
        for c in configs:
            c._attn_implementation_internal = "eager"
        model.eval()
        mask = torch.ones_like(ids)
        out, refused = None, None
        with torch.no_grad():  # a model's own error propagates (and is not remembered); a call it refuses does not
            for call in (dict(input_ids=ids, attention_mask=mask, use_cache=False), dict(input_ids=ids), None):
                try:
                    out = model(**call) if call is not None else model(ids)
                    break
                except TypeError as err:
                    found.calls.clear()
                    refused = err
        if out is None:
            return Trace(error=f"a forward on [{ROWS}, {COLUMNS}] token ids failed: {type(refused).__name__}: "
                               f"{refused}"[:400])
    finally:
        for h in handles:
            h.remove()
        for c, value in impl:
            c._attn_implementation_internal = value
        for m, mode in training:
            m.training = mode
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    found.logits = logits if isinstance(logits, torch.Tensor) else None
    return found


def _copy(value):
    """A tensor (or a tuple/list of them) copied, anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_copy(v) for v in value) if type(value) in (tuple, list) else value
    return value


def same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether two traced tensors hold the same values (a reshaped view of the other counts)."""
    if a is None or b is None:
        return False
    if a is b:
        return True
    if a.numel() != b.numel() or a.shape[-1:] != b.shape[-1:] or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.reshape(b.shape), b))


def rel(a, b) -> float:
    """max |a - b| / max |b| (in float32): the relative error of a against b; inf when they cannot be compared
    (a may be a function making it: one whose shapes do not broadcast cannot be compared)."""
    if callable(a):
        try:
            a = a()
        except (RuntimeError, TypeError):
            return float("inf")
    if a is None or b is None:
        return float("inf")
    if a.numel() != b.numel():
        return float("inf")
    a, b = a.detach().float().reshape(b.shape), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def tolerance(t: Optional[torch.Tensor]) -> float:
    """The relative error up to which a identity holds for values of t's dtype."""
    return TOLERANCE.get(getattr(t, "dtype", torch.float32), 5e-2)


@dataclass
class Proof:
    """What the tiny forward showed: each site's worst relative error, and the sites that did not add up (site ->
    the identity and the model.anatomy key to declare). `error`: why there was no forward (nothing proved)."""

    errors: Dict[str, float] = field(default_factory=dict)
    failed: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    tolerance: float = 1e-3

    def add(self, sites: Sequence[str], err: float, what: str, key: str, strict: bool = True) -> None:
        """Record one identity over `sites` (its relative error; over the tolerance: those sites failed, unless
        not `strict`: a diagnostic, such as pattern @ v for a value projection of its own)."""
        for s in sites:
            self.errors[s] = max(self.errors.get(s, 0.0), err)
            if strict and err > self.tolerance and s not in self.failed:
                self.failed[s] = (f"the anatomy's check on one tiny forward failed: {what} does not add up "
                                  f"(relative error {err:.2g}); declare the part: {key}")

    def worst(self) -> Optional[float]:
        """The largest relative error of any identity (None when nothing was checked)."""
        return max(self.errors.values()) if self.errors else None


def check(anat, seen: Trace) -> Proof:
    """The identities of the anatomy's sites on the traced forward (anat: hookrun.capture.anatomy.Anatomy, its
    sites located without the proof): embeddings into block 0, each block's residual adds, the norms feed what
    follows them, heads through the output projection, pattern @ v == heads, the MLP's hidden through its output
    projection, the router's logits, the final norm into the unembedding, the logits from the unembedding."""
    proof = Proof(tolerance=tolerance(seen.logits))
    if seen.error is not None or seen.logits is None:
        proof.error = seen.error or "the forward returned no logits"
        return proof
    shape = seen.batch_shape
    names = set(anat.located_names())

    def value(name):
        if name not in names:
            return None
        p = anat.locate(name)
        call = seen.calls.get(p.module)
        if call is None:
            return None
        with torch.no_grad():  # a site that adds a second module's output (mlp_plus) calls it
            t = p.read(call.args, call.kwargs, call.output)
        return p.get(t, shape) if isinstance(t, torch.Tensor) else None

    def raw(module, index=0, side="output"):
        call = seen.calls.get(module) if module else None
        if call is None:
            return None
        t = call.input() if side == "input" else call.out(index)
        t = None if t is None else t.unflatten(0, shape) if t.dim() >= 1 and t.shape[0] == shape[0] * shape[1] \
            and t.shape[0] != shape[0] else t
        return tokens(t, shape, anat.prefix)

    first = value("blocks.0.resid_pre")
    if anat.family.start and first is not None:  # the stream starts at a norm in block 0: the embeddings are its input
        first = raw(anat.block_modules(0)["block"], side="input")
    embed = value("embed")
    if embed is not None and first is not None:
        pos = value("pos_embed")
        scale = anat.family.embed_scale or 1.0
        if anat.family.pos_fixed:  # what the embedding does not give depends on the position alone
            rest = lambda: first.float() - embed.float() * scale  # noqa: E731
            proof.add(["embed"], rel(lambda: rest()[:1].expand_as(first), rest()) if first.shape[0] > 1 else
                      float("inf"), "blocks.0.resid_pre - embed is the same on every row (fixed positions)",
                      "model.anatomy.embed (embed_scale)")
        else:
            proof.add(["embed"] + (["pos_embed"] if pos is not None else []),
                      rel(lambda: embed * scale + (pos if pos is not None else 0), first),
                      "embed (+ pos_embed) == blocks.0.resid_pre", "model.anatomy.embed (pos_embed)")
    for i in range(anat.n_layers):
        b = f"blocks.{i}"
        parts = anat.block_modules(i)
        pre, out = value(f"{b}.resid_pre"), value(b)
        if pre is None or out is None:
            continue
        if i:
            proof.add([f"{b}.resid_pre"], rel(pre, value(f"blocks.{i - 1}")), f"blocks.{i - 1} == {b}.resid_pre",
                      "model.anatomy.blocks")
        attn = value(f"{b}.attn")
        other = None  # a hybrid's mixer (beside attention, or alone: through its write norm, LFM's)
        if parts.get("mixer"):
            other = raw(parts["attn_write"]) if parts.get("attn_write") and not parts.get("attn") else \
                raw(parts["mixer"])
            k = anat.write_scale(i, "attn")  # the mixer's write scaled as attention's (a hybrid of MiniCPM's)
            other = other * k if other is not None and k != 1.0 else other
        mixer = attn if other is None else other if attn is None else (attn + other if attn.shape == other.shape
                                                                       else None)
        mlp = value(f"{b}.mlp")
        mid = value(f"{b}.resid_mid")
        sites_a = [f"{b}.attn"] if attn is not None else []
        if mixer is None and mlp is None:
            continue
        if anat.parallel:
            proof.add(sites_a + [f"{b}.mlp"], rel(lambda: pre + (mixer if mixer is not None else 0) +
                                                  (mlp if mlp is not None else 0), out),
                      f"{b} == {b}.resid_pre + {b}.attn + {b}.mlp (parallel)",
                      "model.anatomy.attn, model.anatomy.mlp (attn_write, mlp_write, parallel)")
        elif mlp is not None and mid is not None:
            if mixer is not None:
                proof.add(sites_a + [f"{b}.resid_mid"], rel(lambda: pre + mixer, mid),
                          f"{b}.resid_mid == {b}.resid_pre + {b}.attn", "model.anatomy.attn (attn_write; ln2)")
            proof.add([f"{b}.mlp"], rel(lambda: mid + mlp, out), f"{b} == {b}.resid_mid + {b}.mlp",
                      "model.anatomy.mlp (mlp_write)")
        elif mixer is not None and mlp is None:
            proof.add(sites_a, rel(lambda: pre + mixer, out), f"{b} == {b}.resid_pre + {b}.attn (no MLP)",
                      "model.anatomy.attn (attn_write)")
        for norm, reader, key in (("ln1", parts.get("attn"), "ln1"), ("ln2", parts.get("mlp"), "ln2")):
            got = value(f"{b}.{norm}")
            if got is not None:
                proof.add([f"{b}.{norm}"], _fed(seen, got, parts["block"], parts.get(norm), anat.prefix),
                          f"{b}.{norm} read by what follows it", f"model.anatomy.{key}")
        n_heads, n_kv, d_head, d_qk = anat.heads_of(i)
        heads = value(f"{b}.attn.heads")
        if heads is not None:
            proof.add([f"{b}.attn.heads"], 0.0 if heads.shape[-2:] == (n_heads, d_head) else float("inf"),
                      f"{b}.attn.heads split to [.., {n_heads}, {d_head}]", "model.anatomy.attn_out")
            writes = [raw(parts["attn"])] + ([raw(parts["attn_write"], side="input"), raw(parts["attn_write"])]
                                             if parts["attn_write"] else [])
            proof.add([f"{b}.attn.heads"], min(rel(raw(parts["attn_out"]), w) for w in writes),
                      f"{b}.attn.heads through the output projection == attention's output", "model.anatomy.attn_out")
        for s, n in (("q", n_heads), ("k", n_kv), ("v", n_kv)):
            t = value(f"{b}.attn.{s}")
            if t is not None:  # q and k may be wider heads than v's (MiMo's v_head_dim)
                d = d_head if s == "v" or parts["qkv"] else d_qk
                proof.add([f"{b}.attn.{s}"], 0.0 if t.shape[-2:] == (n, d) else float("inf"),
                          f"{b}.attn.{s} split to [.., {n}, {d}]", f"model.anatomy.{s} (qkv, qkv_layout)")
                if s == "q" and anat.family.block_part("q_parts", i) > 1:  # a part of q_proj: the one read as q
                    proof.add([f"{b}.attn.q"], _fed(seen, t, parts["attn"], None, anat.prefix),
                              f"{b}.attn.q (the first of q_proj's parts per head) read by its attention",
                              "model.anatomy.q (q_parts)")
        v, pattern = value(f"{b}.attn.v"), value(f"{b}.attn.pattern")
        if pattern is not None:
            ok = pattern.dim() == 4 and pattern.shape[1] == n_heads and pattern.shape[-1] == pattern.shape[-2]
            proof.add([f"{b}.attn.pattern"], 0.0 if ok else float("inf"),
                      f"{b}.attn.pattern is [B, {n_heads}, T, T]", "model.anatomy.pattern")
        if v is not None and pattern is not None and heads is not None and pattern.dim() == 4 and \
                v.shape[-2] and n_heads % v.shape[-2] == 0 and pattern.shape[-1] == v.shape[1]:
            v = v.repeat_interleave(n_heads // v.shape[-2], dim=-2)
            z = lambda: torch.einsum("bhts,bshk->bthk", pattern.float(), v.float())  # noqa: E731
            proof.add([f"{b}.attn.v"], rel(z, heads), f"{b}.attn.pattern @ {b}.attn.v == {b}.attn.heads",
                      "model.anatomy.v (qkv and qkv_layout)", strict=parts["v"] is None)  # a fused one's layout
        hidden = value(f"{b}.mlp.hidden")
        if hidden is not None and parts.get("mlp_out"):
            writes = [raw(parts["mlp"])] + ([raw(parts["mlp_write"], side="input"), raw(parts["mlp_write"])]
                                            if parts["mlp_write"] else [])
            proof.add([f"{b}.mlp.hidden"], min(rel(raw(parts["mlp_out"]), w) for w in writes),
                      f"{b}.mlp.hidden through the MLP's output projection == the MLP's output",
                      "model.anatomy.mlp_out")
        router = value(f"{b}.mlp.router")
        if router is not None:
            gate = anat.modules.get(parts["router"])
            weight = getattr(gate, "weight", None)
            x = raw(parts["router"], side="input")
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and x is not None and \
                    weight.shape == (router.shape[-1], x.shape[-1]):
                bias = getattr(gate, "bias", None)
                want = lambda: nn.functional.linear(x.float(), weight.float(),  # noqa: E731
                                                    bias.float() if isinstance(bias, torch.Tensor) else None)
                proof.add([f"{b}.mlp.router"], rel(want, router), f"{b}.mlp.router == the router's linear map",
                          "model.anatomy.router")
            else:
                proof.add([f"{b}.mlp.router"], 0.0 if router.shape[:2] == tuple(shape) else float("inf"),
                          f"{b}.mlp.router is [B, T, experts]", "model.anatomy.router")
    last = value(f"blocks.{anat.n_layers - 1}")
    norm, unembed = value("final_norm"), value("unembed")
    feeds = raw(anat.unembed_name(), side="input")
    post = anat.family.post
    if norm is not None:
        into = raw(anat.final_norm_module(), side="input")
        tail = next((raw(p) for p in reversed(post) if p in seen.calls), norm)
        k = anat.final_scale  # the unembedding reads the final norm's output times this (Inkling's 1 / mup width)
        proof.add(["final_norm"], max(rel(into, last), rel(lambda: tail.float() * k, feeds) if k != 1.0 else
                                      rel(tail, feeds)),
                  "the last block -> final_norm -> the unembedding's input", "model.anatomy.final_norm (post)")
    if unembed is not None:
        logits = unembed.float() * anat.logit_scale
        if anat.softcap:
            logits = torch.tanh(logits / anat.softcap) * anat.softcap
        proof.add(["unembed"], rel(logits, seen.logits), "the unembedding (soft-cap, scale) == the logits",
                  "model.anatomy.unembed (logits_times, logits_over)")
    return proof


def tokens(t: Optional[torch.Tensor], shape, prefix: int) -> Optional[torch.Tensor]:
    """A traced [B, prefix + T, ...] tensor on the token positions alone (CPM-Ant prepends its prompt inside); any
    other as it is."""
    if prefix and t is not None and t.dim() >= 2 and t.shape[0] == shape[0] and t.shape[1] == prefix + shape[1]:
        return t[:, prefix:]
    return t


def _fed(seen: Trace, got: torch.Tensor, block: str, norm: Optional[str], prefix: int = 0) -> float:
    """0 when a module of the block (other than the norm) reads `got`, else the smallest relative error of any."""
    best = float("inf")
    for name, call in seen.calls.items():
        if not name.startswith(block + ".") or name == norm or (norm and name.startswith(norm + ".")):
            continue
        x = tokens(call.input(), seen.batch_shape, prefix)
        if x is not None and x.numel() == got.numel() and x.shape[-1] == got.shape[-1]:
            best = min(best, rel(x, got))
            if best == 0.0:
                break
    return best
