"""Logit lens and direct logit attribution (DLA) on Hugging Face causal LMs: the `lens:` block (Lens) and its core.

In a run (docs/lens.md):

    lens: {sites: {layers: ['blocks.*'], positions: all}, top_k: 5, tokens: [" Paris"], dla: {tokens: [" Paris"]}}
    lens = cap.read("lens"); lens.sample_table(0); lens.to_frame(); lens.dla.frame()     # LensResult, DLAResult

The core below is plain torch on any model:

The readout is the model's own final norm and unembedding, from its anatomy (hookrun.capture.anatomy: GPT-2,
Llama, Qwen2/3, Mistral, Gemma 1-3, GPT-NeoX, OPT, ..., or model.anatomy) or named by `lens.norm` / `lens.unembed`;
the lens's sites are standard names (`blocks.*`, hookrun.capture.targets) or module names:

    readout = find_readout(model)                       # or find_readout(model, norm="model.norm", unembed="lm_head")
    logits = lens_logits(readout, resid)                # [..., d_model] -> [..., vocab], the model's own readout
    ids, probs = top_k(logits, 5)
    logprob, rank = logprob_and_rank(logits, token_ids)
    table = lens_table(readout, gather_sites(layer_outputs, positions), k=5, tokens=answer_ids)   # one pass

DLA splits the final residual stream into the outputs of `components(model)` (the anatomy's embeddings, every
block's attention and MLP writes; each head through `head_outputs`) and projects each on the answer direction with the final
norm's scale frozen from the real run (TransformerLens's `apply_ln_to_stack`), so the parts plus `bias` sum to
the model's logit (difference):

    att = attribute(readout, stack, final_resid, token, other)     # stack [C, ..., d_model]
    att.parts.sum(0) + att.bias == logits[..., token] - logits[..., other]   (before any final soft-cap)
"""
from __future__ import annotations

import difflib
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from hookrun.capture import tokens as tok
from hookrun.capture.checks import k_problems, repeat_problems
from hookrun.capture.anatomy import FAMILIES, Anatomy, AnatomyError, Point, anatomy
from hookrun.capture.layers import module_names
from hookrun.capture.scope import HookScope
from hookrun.capture.targets import Batch, Target, attach, resolve_sites
from hookrun.capture.tokens import check_positions, positions_spec
from hookrun.config.checks import HUGE, ConfigError, as_list, check_choice, check_number, suggest
from hookrun.config.schema import Frozen, setting
from hookrun.format.layout import DLA, LENS, LENS_ATTR
from hookrun.methods import Method, emit, run_shape
from hookrun.methods.metrics import one_token, token_problems, logits_of
from hookrun.read.results.lens import LensResult, load_lens

Tensor = torch.Tensor


class LensError(ValueError):
    """A model whose readout or components cannot be found or used; the message names the keys to set."""


# ---------------------------------------------------------------------------------------------- architectures
# Where the final norm, the unembedding, the blocks and their attention and MLP are: the model's anatomy
# (hookrun.capture.anatomy), the one table of architectures.
def _config(model: nn.Module):
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def _model_type(model: nn.Module) -> Optional[str]:
    return getattr(_config(model), "model_type", None)


def _named(model: nn.Module) -> Dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if name}


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in name and "batchnorm" not in name


def _candidates(model: nn.Module) -> str:
    """The last few norm-like modules and the Linear layers whose out_features equal the vocabulary, for messages."""
    named = _named(model)
    norms = [n for n, m in named.items() if _is_norm(m)][-4:]
    vocab = getattr(_config(model), "vocab_size", None)
    linear = [n for n, m in named.items() if isinstance(m, nn.Linear)]
    if vocab:
        heads = [n for n in linear if named[n].out_features == vocab]
        found = f"Linear layers with out_features == vocab_size {vocab}: {', '.join(heads) or 'none'}"
    else:
        found = f"the last Linear layers: {', '.join(linear[-2:]) or 'none'}"
    return f"norm-like modules (last {len(norms)}): {', '.join(norms) or 'none'}; {found}"


def _module(model: nn.Module, name: str, key: str) -> nn.Module:
    named = _named(model)
    if name not in named:
        near = difflib.get_close_matches(name, list(named), n=3)
        hint = f" (did you mean: {', '.join(near)}?)" if near else ""
        raise LensError(f"{key}: {name!r} is no module of {type(model).__name__}{hint}; give a dotted name from "
                        f"model.named_modules(); {_candidates(model)}")
    return named[name]


def _name_of(model: nn.Module, module: nn.Module) -> Optional[str]:
    return next((n for n, m in model.named_modules() if m is module and n), None)


def _anatomy(model: nn.Module) -> Optional[Anatomy]:
    """The model's anatomy, None for a model of no known (or declared) architecture."""
    try:
        found = anatomy(model)
    except AnatomyError:
        return None
    if found.prefix:  # its modules' tensors hold positions before the tokens' (the lens reads modules)
        raise LensError(f"lens: {found.model_class} ({found.arch}) prepends {found.prefix} positions to the tokens "
                        f"inside ({found.family.prefix}), so its modules' outputs are not the tokens' rows; the lens "
                        "and DLA are not built there (hooks on its standard sites read the tokens' rows)")
    return found


# ---------------------------------------------------------------------------------------------------- readout
@dataclass(frozen=True)
class NormForm:
    """A final norm as arithmetic: ((x - mean(x) if center) / sqrt(var_or_ms(x) + eps)) * gain + bias."""

    center: bool  # LayerNorm: True; RMSNorm: False
    gain: Tensor  # [d_model]; Gemma's RMSNorm: 1 + weight
    bias: Optional[Tensor]  # [d_model] or None
    eps: float

    def scale(self, x: Tensor) -> Tensor:
        """The norm's divisor for x [..., d_model], in float32: [..., 1] (sigma for LayerNorm, rms for RMSNorm)."""
        x = x.float()
        second = x.var(-1, unbiased=False, keepdim=True) if self.center else x.pow(2).mean(-1, keepdim=True)
        return torch.sqrt(second + self.eps)


@dataclass
class Readout:
    """The model's final norm, the linear maps after it (OPT's project_out) and its unembedding.

        readout = find_readout(model); logits = lens_logits(readout, resid)
    """

    model_class: str
    norm_name: Optional[str]  # None: the model applies no final norm (post-LN OPT)
    norm: Optional[nn.Module]
    unembed_name: str
    unembed: nn.Module
    post: Tuple[Tuple[str, nn.Module], ...] = ()  # applied between norm and unembed, in order
    softcap: Optional[float] = None  # Gemma 2/3: logits = tanh(logits / cap) * cap
    scale: float = 1.0  # the logits are the unembedding's output times this (Cohere, Granite), before the cap
    _form: Optional[NormForm] = field(default=None, repr=False)

    def norm_form(self) -> Optional[NormForm]:
        """The final norm's arithmetic (found once, by matching the module's output), None without a norm."""
        if self.norm is not None and self._form is None:
            self._form = _norm_form(self.norm, self.norm_name)
        return self._form

    def direction(self, token, other=None) -> Tuple[Tensor, Tensor]:
        """(w [..., d_model], b [...]): the answer's direction in the final norm's output space and the
        unembedding bias, so that logit[token] - logit[other] = norm(x) . w + b (before any soft-cap).
        token / other: ints or LongTensors of any (broadcastable) shape."""
        weight = getattr(self.unembed, "weight", None)
        if weight is None or weight.dim() != 2:
            raise LensError(f"lens.unembed: {self.unembed_name} ({type(self.unembed).__name__}) has no 2-d weight "
                            f"[vocab, d]; name a Linear unembedding")
        token = torch.as_tensor(token, device=weight.device)
        w = weight[token].float()
        bias = getattr(self.unembed, "bias", None)
        b = bias[token].float() if bias is not None else torch.zeros(token.shape, device=weight.device)
        if other is not None:
            other = torch.as_tensor(other, device=weight.device)
            w = w - weight[other].float()
            b = b - (bias[other].float() if bias is not None else 0)
        if self.scale != 1.0:
            w, b = w * self.scale, b * self.scale
        for name, module in reversed(self.post):  # back through bias-free linear maps: (P^T w)
            if getattr(module, "bias", None) is not None:
                raise LensError(f"DLA: {name} between the final norm and the unembedding has a bias; not supported")
            w = w @ module.weight.float()
        return w, b


def _norm_form(module: nn.Module, name: str) -> NormForm:
    """Which of LayerNorm / RMSNorm(weight) / RMSNorm(1 + weight) the module computes, checked on a probe."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    eps = next((float(getattr(module, a)) for a in ("eps", "variance_epsilon", "epsilon") if
                isinstance(getattr(module, a, None), (float, int))), None)
    d = weight.shape[-1] if weight is not None else getattr(module, "normalized_shape", (None,))[-1]
    if eps is None or d is None:
        raise LensError(f"DLA: the final norm {name} ({type(module).__name__}) has no eps or width to read; DLA "
                        f"needs a LayerNorm or an RMSNorm (the logit lens itself still works)")
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    ones = torch.ones(d, device=device)
    w = weight.detach().float() if weight is not None else ones
    b = bias.detach().float() if bias is not None else None
    forms = [NormForm(True, w, b, eps), NormForm(False, w, b, eps), NormForm(False, 1 + w, b, eps)]
    gen = torch.Generator().manual_seed(0)
    probe = (torch.randn(3, d, generator=gen) * 2 + 0.5).to(device)
    with torch.no_grad():
        out = module(probe.to(param.dtype if param is not None else torch.float32)).float()
    for form in forms:
        x = probe - probe.mean(-1, keepdim=True) if form.center else probe
        mine = x / form.scale(probe) * form.gain + (form.bias if form.bias is not None else 0)
        if torch.allclose(mine, out, rtol=1e-3, atol=1e-3 * float(out.abs().max().clamp(min=1))):
            return form
    raise LensError(f"DLA: the final norm {name} ({type(module).__name__}) is neither a LayerNorm nor an RMSNorm "
                    f"(weight or 1 + weight) on a probe; DLA cannot freeze its scale (the logit lens still works)")


def find_readout(model: nn.Module, norm: Optional[str] = None, unembed: Optional[str] = None) -> Readout:
    """The model's final norm and unembedding: found for Hugging Face causal LMs, or named (dotted module names).

        find_readout(gpt2).norm_name == "transformer.ln_f"; find_readout(model, norm="decoder.ln", unembed="head")
    """
    anat = _anatomy(model)
    named = _named(model)
    cls = type(model).__name__
    if unembed is not None:
        head = _module(model, unembed, "lens.unembed")
    else:
        get = getattr(model, "get_output_embeddings", None)
        head = get() if get is not None else None
        unembed = anat.family.unembed if anat is not None and anat.family.unembed else \
            _name_of(model, head) if head is not None else None
        head = named.get(unembed) if unembed is not None else None
        if head is None:
            raise LensError(f"lens: cannot find the unembedding of {cls} (model_type {_model_type(model)!r}): set "
                            f"lens.unembed (and lens.norm) to dotted module names; {_candidates(model)}")
    if norm is not None:
        norm_module = _module(model, norm, "lens.norm")
    elif anat is not None:  # the anatomy's final norm; none (post-LN OPT): the stream is read as it is
        norm = anat.part(anat.family.final_norm)
        norm_module = named.get(norm) if norm is not None else None
    else:
        raise LensError(f"lens: cannot find the final norm of {cls} (model_type {_model_type(model)!r} is not one "
                        f"hookrun knows): set lens.norm and lens.unembed to dotted module names (or declare "
                        f"model.anatomy); {_candidates(model)}")
    post = tuple((n, named[n]) for n in (anat.family.post if anat is not None else ()) if named.get(n) is not None)
    if anat is not None:
        return Readout(cls, norm, norm_module, unembed, head, post, anat.softcap, anat.logit_scale)
    softcap = getattr(_config(model), "final_logit_softcapping", None)
    return Readout(cls, norm, norm_module, unembed, head, post, float(softcap) if softcap else None)


# ---------------------------------------------------------------------------------------------------- lens
def lens_logits(readout: Readout, resid: Tensor) -> Tensor:
    """A residual stream [..., d_model] read out as the model reads its last one: norm, post maps, unembed, cap."""
    x = resid if readout.norm is None else readout.norm(resid)
    for _, module in readout.post:
        x = module(x)
    logits = readout.unembed(x)
    if readout.scale != 1.0:
        logits = logits * readout.scale
    if readout.softcap:
        logits = torch.tanh(logits / readout.softcap) * readout.softcap
    return logits


def top_k(logits: Tensor, k: int = 5) -> Tuple[Tensor, Tensor]:
    """(token ids [..., k], probabilities [..., k]) of the k most likely tokens, softmax in float32."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = probs.topk(k, dim=-1)
    return ids, values


def logprob_and_rank(logits: Tensor, token_ids) -> Tuple[Tensor, Tensor]:
    """(log-probability, rank) of given tokens: token_ids [..., T] broadcast against logits [..., vocab]; rank 0 is
    the top token (the count of tokens with a strictly larger logit)."""
    logits = logits.float()
    ids = torch.as_tensor(token_ids, device=logits.device)
    ids = ids.unsqueeze(-1) if ids.dim() == 0 else ids
    shape = np.broadcast_shapes(logits.shape[:-1], ids.shape[:-1])  # (torch's runs ~0.15 ms of Python checks)
    logits = logits.expand(*shape, logits.shape[-1])
    ids = ids.expand(*shape, ids.shape[-1])
    chosen = logits.gather(-1, ids)
    logprob = chosen - torch.logsumexp(logits, dim=-1, keepdim=True)
    rank = _rank(logits, chosen)
    return logprob, rank


def _rank(scores: Tensor, chosen: Tensor) -> Tensor:
    """Rank of each chosen score [..., T] among scores [..., vocab]: the count of strictly larger ones (int64),
    counted in int32 (summing booleans into int64 takes twice the time)."""
    return (scores.unsqueeze(-2) > chosen.unsqueeze(-1)).sum(-1, dtype=torch.int32).long()


def gather_sites(hidden: Sequence[Tensor], positions) -> Tensor:
    """Residual streams of chosen layers at chosen positions: hidden, one [B, T, d] per layer (a block's output
    tuple is unwrapped), positions LongTensor [B, P] or [P] -> [L, B, P, d]."""
    h = torch.stack([t[0] if isinstance(t, tuple) else t for t in hidden])  # [L, B, T, d]
    pos = torch.as_tensor(positions, device=h.device)
    pos = pos.expand(h.shape[1], -1) if pos.dim() == 1 else pos
    index = pos[None, :, :, None].expand(h.shape[0], -1, -1, h.shape[-1])
    return h.gather(2, index)


@dataclass
class LensTable:
    """The logit lens at sites [...] (e.g. layers x batch x positions): top-k tokens, given tokens' logprob/rank, and
    with the final distribution given, each site's KL divergence to it and its entropy."""

    top_ids: Tensor  # [..., k]
    top_probs: Tensor  # [..., k] float32
    logprob: Optional[Tensor]  # [..., T] float32, None without tokens
    rank: Optional[Tensor]  # [..., T]
    kl: Optional[Tensor] = None  # [...] float32: KL(final || lens) in nats, None without `final`
    entropy: Optional[Tensor] = None  # [...] float32: the lens distribution's entropy in nats


def lens_table(readout: Readout, resid: Tensor, k: int = 5, tokens=None, chunk: int = 2 ** 27,
               final: Optional[Tensor] = None) -> LensTable:
    """The lens at every site of resid [..., d] in one vectorised pass (rows split only to keep a [rows, vocab]
    block under `chunk` elements): top-k ids and probabilities, and for tokens (ids broadcast to [..., T], e.g.
    [T], [B, 1, T] against [L, B, P]) their log-probability and rank. `final`: the model's own logits at the same
    sites without their leading axes (e.g. [B, P, vocab] against [L, B, P]): each site's KL(final || lens) and the
    lens distribution's entropy, in nats.

        table = lens_table(readout, gather_sites([out[l] for l in layers], positions), k=5, tokens=ids)
    """
    sites = resid.shape[:-1]
    flat = resid.reshape(-1, resid.shape[-1])
    ids = None
    if tokens is not None:
        ids = torch.as_tensor(tokens, device=resid.device)
        ids = ids.unsqueeze(-1) if ids.dim() == 0 else ids
        ids = ids.expand(*sites, ids.shape[-1]).reshape(flat.shape[0], -1)
    ref = None
    if final is not None:  # the final distribution's log-probabilities, once a (sample, position)
        inner = final.shape[:-1]
        if tuple(sites[len(sites) - len(inner):]) != tuple(inner):
            raise ValueError(f"lens_table: final {list(final.shape)} must be the sites' trailing axes "
                             f"{list(sites)} + [vocab]")
        ref = torch.log_softmax(final.reshape(-1, final.shape[-1]).float(), dim=-1)
        ref_p = ref.exp()
        ref_sum = (ref_p * ref).sum(-1, keepdim=True)  # sum p log p of the final distribution, once a site
    vocab = readout.unembed.weight.shape[0] if hasattr(readout.unembed, "weight") else 1
    rows = max(1, chunk // max(vocab, 1))
    parts = []
    for start in range(0, flat.shape[0], rows):
        logp = torch.log_softmax(lens_logits(readout, flat[start:start + rows]).float(), dim=-1)  # once a block
        top_lp, top_ids = logp.topk(k, dim=-1)
        lp = rk = kl = ent = None
        if ids is not None:
            lp = logp.gather(-1, ids[start:start + rows])
            rk = _rank(logp, lp)
        if ref is not None:
            n, m = ref.shape[0], logp.shape[0]
            if start % n == 0 and m % n == 0:  # whole layers: the final distribution broadcast, not gathered
                cross = (logp.view(m // n, n, -1) * ref_p).sum(-1).reshape(m, 1)
                kl = ref_sum.repeat(m // n, 1) - cross
            else:
                at = torch.arange(start, start + m, device=ref.device) % n
                kl = ref_sum[at] - (ref_p[at] * logp).sum(-1, keepdim=True)
            ent = -(logp.exp() * logp).sum(-1, keepdim=True)
        parts.append((top_ids, top_lp.exp(), lp, rk, kl, ent))
    cat = [(p[0] if len(p) == 1 else torch.cat(p)) if p[0] is not None else None for p in zip(*parts)]
    shape = lambda t: t.reshape(*sites, t.shape[-1]) if t is not None else None  # noqa: E731
    top_ids, top_probs, lp, rk, kl, ent = map(shape, cat)
    return LensTable(top_ids, top_probs, lp, rk, kl[..., 0] if kl is not None else None,
                     ent[..., 0] if ent is not None else None)


# ---------------------------------------------------------------------------------------- components and DLA
@dataclass(frozen=True)
class Component:
    """A module whose output is added into the residual stream (kind: embed | pos_embed | attn | mixer | mlp; a
    mixer: a hybrid's state-space or linear-attention block).

    For attn, out_proj is the output projection whose input z holds the heads' outputs side by side
    (None where the heads cannot be split linearly, e.g. Gemma 2's norm after attention)."""

    name: str
    module: nn.Module = field(repr=False)
    kind: str
    layer: Optional[int] = None
    out_proj_name: Optional[str] = None
    out_proj: Optional[nn.Module] = field(default=None, repr=False)
    n_heads: Optional[int] = None
    scale: float = 1.0  # the block multiplies the module's output by this before the add (MiniCPM3, Granite)


def component_output(output, batch_shape: Optional[Sequence[int]] = None) -> Tensor:
    """The residual-stream write of a component's forward output: the first element of a tuple (attention
    modules); tokens flattened to [B*T, d] (OPT's fc2) are unflattened to [*batch_shape, d] when batch_shape is
    given. Other shapes come back as they are (GPT-2's wpe gives [1, T, d]: broadcast it)."""
    out = output[0] if isinstance(output, (tuple, list)) else output
    if batch_shape is not None and out.dim() - 1 != len(batch_shape):
        out = out.reshape(*batch_shape, out.shape[-1])
    return out


def components(model: nn.Module) -> List[Component]:
    """Every module whose outputs sum to the final residual stream (the final norm's input), in model order:
    embeddings, then per block its attention and MLP.

        [c.name for c in components(gpt2)][:4] == ["transformer.wte", "transformer.wpe", "transformer.h.0.attn",
                                                   "transformer.h.0.mlp"]
    """
    cls = type(model).__name__
    anat = _anatomy(model)
    if anat is None:
        raise LensError(f"lens.dla: {cls} (model_type {_model_type(model)!r}) has no known component layout; DLA "
                        f"supports {', '.join(sorted(FAMILIES))}, or a model that declares model.anatomy")
    if not getattr(_config(model), "do_layer_norm_before", True):
        raise LensError(f"lens.dla: {cls} normalises after each block (do_layer_norm_before=False), so the blocks' "
                        f"outputs do not sum to the final residual stream; DLA needs a pre-norm model")
    named = _named(model)
    embed, pos = anat.embed_modules()
    if embed is None:
        raise LensError(f"lens.dla: {cls} has none of {anat.family.embed} (model.anatomy.embed names it)")
    out: List[Component] = [Component(embed, named[embed], "embed", scale=anat.family.embed_scale or 1.0)]
    if pos is not None:
        out.append(Component(pos, named[pos], "pos_embed"))
    for i in range(anat.n_layers):
        b = anat.block_modules(i)
        if b["attn"] is None and b["mixer"] is not None:  # a hybrid's state-space or linear-attention block
            mixer = b["attn_write"] or b["mixer"]
            out.append(Component(mixer, named[mixer], "mixer", i, scale=anat.write_scale(i, "attn")))
        elif b["attn"] is not None:
            attn = b["attn_write"] or b["attn"]
            proj = b["attn_out"] if not b["attn_write"] else None  # a norm after attention: no linear per-head split
            out.append(Component(attn, named[attn], "attn", i, proj, named[proj] if proj else None,
                                 anat.heads_of(i)[0] if proj else None, anat.write_scale(i, "attn")))
        mlp = b["mlp_write"] or b["mlp"]
        if mlp is not None:
            out.append(Component(mlp, named[mlp], "mlp", i, scale=anat.write_scale(i, "mlp")))
        if b["mlp_plus"] is not None:  # a second module the block adds to the MLP's (Granite 4's shared_mlp)
            out.append(Component(b["mlp_plus"], named[b["mlp_plus"]], "mlp", i, scale=anat.write_scale(i, "mlp")))
    return out


def _out_weight(proj: nn.Module) -> Tensor:
    """The output projection's weight as [in, out] (GPT-2's Conv1D stores [in, out]; nn.Linear [out, in])."""
    if isinstance(proj, nn.Linear):
        return proj.weight.t()
    if type(proj).__name__ == "Conv1D":
        return proj.weight
    raise LensError(f"lens.dla: output projection {type(proj).__name__} is neither nn.Linear nor Conv1D")


def head_outputs(component: Component, z: Tensor) -> Tensor:
    """Each head's write into the residual stream, without the projection's bias: z [..., n_heads * d_head] (the
    out projection's input) -> [..., n_heads, d_model]; head h is z[..., h*dh:(h+1)*dh] @ W_O[h*dh:(h+1)*dh]."""
    if component.out_proj is None:
        raise LensError(f"lens.dla: {component.name} has no linear per-head split (heads: false for this model)")
    w = _out_weight(component.out_proj)  # [n_heads * d_head, d_model]
    h = component.n_heads
    w = w.reshape(h, w.shape[0] // h, w.shape[1])
    return torch.einsum("...hk,hkd->...hd", z.reshape(*z.shape[:-1], h, -1).to(w.dtype), w)


def out_bias(component: Component) -> Optional[Tensor]:
    """The attention output projection's bias [d_model] (attributed apart from the heads), None if it has none."""
    return getattr(component.out_proj, "bias", None) if component.out_proj is not None else None


def stack_parts(comps: Sequence[Component], outputs: Mapping[str, object], z: Optional[Mapping[str, Tensor]] = None,
                batch_shape: Optional[Sequence[int]] = None) -> Tuple[List[str], Tensor]:
    """(names, stack [C, ..., d_model]) of the residual-stream writes for `attribute`: outputs maps each
    component's name to its forward output; with z (out_proj name -> its input) an attention component is split
    into its heads `<name>.head<h>` plus `<out_proj>.bias` where the projection has one.

        names, stack = stack_parts(components(model), outs, z=ins, batch_shape=input_ids.shape)
    """
    names, parts = [], []
    for c in comps:
        if z is not None and c.kind == "attn" and c.out_proj_name in z:
            heads = head_outputs(c, component_output(z[c.out_proj_name], batch_shape))
            names += [f"{c.name}.head{h}" for h in range(c.n_heads)]
            parts += list((heads * c.scale).movedim(-2, 0))
            bias = out_bias(c)
            if bias is not None:
                names.append(f"{c.out_proj_name}.bias")
                parts.append(bias * c.scale)
        else:
            names.append(c.name)
            parts.append(component_output(outputs[c.name], batch_shape) * c.scale)
    parts = [p.float() for p in parts]
    return names, torch.stack(torch.broadcast_tensors(*parts))


@dataclass
class Attribution:
    """Each part's contribution to the logit (difference) [C, ...] and the constant `bias` [...] (the final norm's
    and the unembedding's biases along the direction); parts.sum(0) + bias is the model's logit (difference)."""

    parts: Tensor
    bias: Tensor
    names: Optional[List[str]] = None

    def total(self) -> Tensor:
        return self.parts.sum(0) + self.bias

    def as_dict(self) -> Dict[str, Tensor]:
        names = self.names or [str(i) for i in range(len(self.parts))]
        return {**dict(zip(names, self.parts)), "bias": self.bias}


def attribute(readout: Readout, parts: Union[Tensor, Mapping[str, Tensor]], final: Tensor, token,
              other=None) -> Attribution:
    """Direct logit attribution with the final norm's scale frozen from the real run.

    parts: [C, ..., d_model] (or {name: [..., d_model]}, broadcast), the residual-stream writes at the chosen
    positions; final: [..., d_model], the final norm's input there; token / other: answer ids broadcast to [...].
    LayerNorm: part_c = ((x_c - mean(x_c)) / sigma(final)) * gamma . w; RMSNorm: x_c / rms(final) * gain . w,
    w the unembedding row of token (minus other's), mapped back through OPT's project_out. Contributions are to
    the logit before a final soft-cap (Gemma 2/3).

        att = attribute(readout, stack, resid_final, token=paris, other=rome); att.total() ~ logit difference
    """
    names = None
    if isinstance(parts, Mapping):
        names = list(parts)
        parts = torch.stack(torch.broadcast_tensors(*[p.float() for p in parts.values()]))
    w, b = readout.direction(token, other)
    w, b = w.to(parts.device), b.to(parts.device)
    sites = np.broadcast_shapes(parts.shape[1:-1], final.shape[:-1], w.shape[:-1], b.shape)  # (torch's: ~0.15 ms)
    parts = parts.float().expand(parts.shape[0], *sites, parts.shape[-1])
    form = readout.norm_form()
    if form is None:  # no final norm: the logit is linear in the residual stream
        return Attribution(torch.einsum("c...d,...d->c...", parts, w.expand(*sites, -1)), b.expand(sites), names)
    if form.center:
        parts = parts - parts.mean(-1, keepdim=True)
    scale = form.scale(final.to(parts.device)).squeeze(-1).expand(sites)  # frozen: the real run's sigma / rms
    contrib = torch.einsum("c...d,...d->c...", parts, (form.gain.to(parts.device) * w).expand(*sites, -1)) / scale
    if form.bias is not None:
        b = b + (form.bias.to(parts.device) * w).sum(-1)
    return Attribution(contrib, b.expand(sites), names)


def residual_gap(parts: Tensor, final: Tensor) -> float:
    """The largest |sum of parts - final residual| relative to the final's largest entry: ~1e-6 when the
    components cover the residual stream (a check before trusting DLA on a new architecture)."""
    gap = (parts.float().sum(0) - final.float()).abs().max()
    return float(gap / final.float().abs().max().clamp(min=1e-12))


# ------------------------------------------------------------------------------ one batch, as a run stores it
def lens_batch(readout: Readout, layers: Sequence[str], resid: Sequence[Tensor], info, positions: Sequence[int],
               every: bool, k: int, ids: Optional[Tensor] = None, logits: Optional[Tensor] = None
               ) -> Dict[Tuple[str, str], Tensor]:
    """The lens of one text batch as a run stores it: resid, one [B, T, d] per layer (the residual stream there),
    read at `positions` (over real tokens; every=True: positions 0..len(positions)-1, past a sample's end empty);
    ids [B, T] tokens whose logprob and rank are kept; logits [B, T, vocab] the model's own output, for each
    site's KL to it and its entropy. -> (layer, role): ("top", "ids" | "probs") [B, L, P, k], ("tokens",
    "logprob" | "rank") [B, L, P, T], ("dist", "kl" | "entropy") [B, L, P]; ids -1 and numbers NaN where empty."""
    b, t = info.mask.shape
    d = _width(readout)
    if every:
        cols = info.first[:, None] + torch.arange(int(info.lengths.max()), device=info.mask.device)[None, :]
        valid = cols < (info.first + info.lengths)[:, None]
        cols = cols.clamp(max=t - 1)
    else:
        cols = tok.columns(info, positions, "lens.sites.positions")
        valid = torch.ones_like(cols, dtype=torch.bool)
    rows = torch.arange(b, device=cols.device)[:, None]
    every_column = every and cols.shape[1] == t and not bool(info.first.any())  # right padding: no gather to make
    kept = []
    for name, out in zip(layers, resid):
        if out.dim() != 3 or tuple(out.shape[:2]) != (b, t) or (d is not None and out.shape[-1] != d):
            raise LensRunError("lens.sites.layers", f"lens.sites.layers: {name}'s output is {list(out.shape)}, "
                               f"not the residual stream [batch {b}, sequence {t}, d_model {d}]; name blocks "
                               "whose output the final norm could read (e.g. the transformer blocks)")
        kept.append(out.detach() if every_column else out.detach()[rows, cols])
    final = None if logits is None else logits.detach() if every_column else logits.detach()[rows, cols]
    table = lens_table(readout, torch.stack(kept), k=k, tokens=ids[None, :, None, :] if ids is not None else None,
                       final=final)
    width = len(positions) - cols.shape[1]  # every position: the run's longest sequence
    arrays = {("top", "ids"): (table.top_ids, -1), ("top", "probs"): (table.top_probs, float("nan"))}
    if ids is not None:
        arrays.update({("tokens", "logprob"): (table.logprob, float("nan")), ("tokens", "rank"): (table.rank, -1)})
    if final is not None:
        arrays.update({("dist", "kl"): (table.kl[..., None], float("nan")),
                       ("dist", "entropy"): (table.entropy[..., None], float("nan"))})
    out = {}
    for (layer, role), (values, empty) in arrays.items():  # [L, B, P, k | T | 1] -> the stored [B, L, P, ...]
        dtype = torch.int32 if role in ("ids", "rank") else torch.float32  # token ids exact past 2**24
        if every:  # positions past a sample's end
            values = torch.where(valid[None, :, :, None], values, empty)
        stored = values.permute(1, 0, 2, 3).to(dtype, memory_format=torch.contiguous_format)
        if width > 0:  # the positions past this batch's longest sequence, up to the run's
            stored = torch.nn.functional.pad(stored, (0, 0, 0, width), value=empty)
        out[layer, role] = stored[..., 0] if layer == "dist" else stored
    return out


def dla_batch(readout: Readout, comps: Sequence[Component], heads: Sequence[Component], kept, info, position,
              ids: Tensor, logits: Tensor, tolerance: float = 1e-3, index: int = 0
              ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """DLA of one text batch as a run stores it: kept(kind, name) the forward's ("out", component) outputs and
    ("in", module) inputs (the final norm's, each split attention's output projection's); position (last, first,
    an int, over real tokens); ids [B, 1 | 2] the answer (and the wrong token); logits [B, T, vocab] the model's.
    -> (parts [B, components + 1] (the last the bias), logit [B], heads [B, layers, heads] or None); LensRunError
    when the parts miss the residual stream or the logit by more than `tolerance` (relative)."""
    b, t = info.mask.shape
    col = tok.columns(info, positions_spec(position)[0], "lens.dla.position")[:, 0]
    rows = torch.arange(b, device=col.device)

    def at(value):
        x = component_output(value, (b, t)).detach()
        return x.expand(b, t, x.shape[-1])[rows, col]

    outs = {c.name: at(kept("out", c.name)) for c in comps}
    final = at(kept("in", readout.norm_name))
    names, stack = stack_parts(comps, outs, batch_shape=(b,))
    gap = residual_gap(stack, final)
    if gap > tolerance:
        raise LensRunError("lens.dla", f"lens.dla: batch {index}: the {len(names)} components of "
                           f"{readout.model_class} (embeddings, each block's attention and MLP) do not sum "
                           f"to the final norm's input (gap {gap:.3g} of its largest entry > lens.dla.tolerance "
                           f"{tolerance:g}): an edit on the residual stream (hooks.*.edit), or an architecture whose "
                           "blocks add more than these; drop the edit or set lens.dla.tokens=[] (a model in "
                           "float16/bfloat16: raise lens.dla.tolerance)")
    token, other = ids[:, 0], (ids[:, 1] if ids.shape[1] > 1 else None)
    n_parts = len(stack)
    if heads:  # each head's write [L * H, B, d], attributed with the components in one pass
        per = torch.stack([head_outputs(c, at(kept("in", c.out_proj_name))) * c.scale for c in heads])  # [L, B, H, d]
        n_layers, _, n_heads, d = per.shape
        stack = torch.cat([stack, per.permute(0, 2, 1, 3).reshape(n_layers * n_heads, b, d).float()])
    att = attribute(readout, stack, final, token, other)
    logits = logits.detach()[rows, col].float()
    if readout.softcap:  # attribution is of the logit before Gemma 2's cap
        cap = readout.softcap
        logits = torch.atanh((logits / cap).clamp(-1 + 1e-7, 1 - 1e-7)) * cap
    logit = logits.gather(1, token[:, None])[:, 0]
    if other is not None:
        logit = logit - logits.gather(1, other[:, None])[:, 0]
    contrib = att.parts[:n_parts]
    off = float((contrib.sum(0) + att.bias - logit).abs().max() / logit.abs().max().clamp(min=1))
    if off > tolerance:
        what = "logit difference" if other is not None else "logit"
        raise LensRunError("lens.dla", f"lens.dla: batch {index}: the parts sum to the {what} "
                           f"within {off:.3g} (relative), beyond lens.dla.tolerance {tolerance:g}; the final norm "
                           f"{readout.norm_name} or the unembedding {readout.unembed_name} is not what "
                           "the model's logits come from: set lens.norm / lens.unembed, or raise the tolerance "
                           "for a float16/bfloat16 model")
    parts = torch.cat([contrib.t(), att.bias[:, None]], 1)
    if not heads:
        return parts, logit, None
    return parts, logit, att.parts[n_parts:].reshape(n_layers, n_heads, b).permute(2, 0, 1)


# ================================================================================== the `lens:` block in a run
HEADS = ("auto", True, False)


@dataclass
class LensSites(Frozen):
    """Where the logit lens reads the residual stream: which layers' outputs, at which positions."""

    layers: Any = setting(help="modules whose output is the residual stream read through the lens (names, globs or "
                               "`re:` patterns, e.g. `${layers}`), or `blocks`: every block of a known architecture; "
                               "`[]` = no lens", factory=list)
    positions: Any = setting("last", "`last`, `first`, an int or a list of them (counted over real tokens: 0 the "
                                     "first, -1 the last), or `all` (every real position; empty past a sample's end)")


@dataclass
class DLAConfig(Frozen):
    """Direct logit attribution: each component's write projected on the answer's direction (on when tokens are set)."""

    tokens: List[Any] = setting(help="the answer: `[A]` attributes logit(A), `[A, B]` logit(A) - logit(B); each a "
                                     "string of one token, an id or `{field: NAME}` (one per sample); `[]` = no DLA",
                                factory=list)
    position: Any = setting("last", "the one position attributed: `last`, `first` or an int (over real tokens)")
    heads: Any = setting("auto", "split each attention block into its heads (their slice of the output projection): "
                                 "`auto` where the architecture allows it, `true` (refused where it cannot), `false`",
                         HEADS)
    tolerance: float = setting(1e-3, "largest gap, relative to the largest value, between the parts' sum and the "
                                     "model's logit (difference), and between the components' sum and the final "
                                     "residual stream, checked every batch (raise it for float16 / bfloat16 models)")


@dataclass
class LensConfig(Frozen):
    """The logit lens (and direct logit attribution) at each batch's forward; on when `sites.layers` or `dla.tokens`
    is set."""

    sites: LensSites = setting(factory=LensSites)
    top_k: int = setting(5, "most likely tokens stored per site (ids and probabilities)")
    tokens: List[Any] = setting(help="tokens whose log-probability and rank are stored per site: strings of one "
                                     "token, ids, or `{field: NAME}` (one per sample)", factory=list)
    norm: Optional[str] = setting(None, "the final norm's module name; null = found for Hugging Face causal LMs "
                                        "(GPT-2, Llama, Qwen2/3, Mistral, Gemma, GPT-NeoX, OPT, ...)")
    unembed: Optional[str] = setting(None, "the unembedding's module name; null = the model's "
                                           "`get_output_embeddings()`")
    dla: DLAConfig = setting(factory=DLAConfig)


class LensRunError(RuntimeError):
    """A batch the lens or DLA cannot read as configured; `key` names the setting (lens.sites.layers, lens.dla)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


def _token_label(token) -> str:
    """How a token setting is named in attrs and columns: 'text' (repr), an id, or the field's name."""
    if isinstance(token, dict):
        return str(token["field"])
    return repr(token) if isinstance(token, str) else str(token)


class _Tokens:
    """Token settings (strings of one token, ids, {field: NAME}) resolved per batch to ids [B, T]."""

    def __init__(self, key: str, specs: Sequence, tokenizer, vocab: int, fields: Sequence[str]):
        self.key, self.tokenizer, self.vocab = key, tokenizer, vocab
        problems, self.specs = [], []
        for j, spec in enumerate(specs):
            where = f"{key}[{j}]"
            problems += token_problems(where, spec, tokenizer)
            if isinstance(spec, str) and tokenizer is None:
                problems.append(f"{where}: {spec!r} is a string but this run has no tokenizer to read it; give its id")
            elif isinstance(spec, str) and not problems:
                spec = one_token(spec, tokenizer)
            if isinstance(spec, int) and not isinstance(spec, bool) and spec >= vocab:
                problems.append(f"{where}: token id {spec} is outside the model's {vocab} logits; give an id below "
                                f"{vocab}")
            if isinstance(spec, dict) and spec.get("field") not in fields:
                problems.append(f"{where}: {{field: {spec.get('field')}}} but the data has no such field "
                                f"({', '.join(fields) or 'none'}){suggest(str(spec.get('field')), fields)}")
            self.specs.append(spec)
        self.problems = problems
        self.labels = [_token_label(s) for s in specs]
        self.fixed = not any(isinstance(spec, dict) for spec in self.specs)  # no token is a field's
        self.made: Dict[tuple, torch.Tensor] = {}  # (batch size, device) -> ids, where fixed

    def ids(self, batch, size: int, device) -> torch.Tensor:
        """[B, T] ids of the batch's samples (LensRunError naming the key for a field value that is no token); the
        same tensor for every batch of one size where no token comes from a field (it is only read)."""
        if self.fixed and (size, str(device)) in self.made:
            return self.made[size, str(device)]
        columns = []
        for j, spec in enumerate(self.specs):
            if not isinstance(spec, dict):
                columns.append([spec] * size)
                continue
            values = batch.fields[spec["field"]]
            values = values.tolist() if hasattr(values, "tolist") else list(values)
            columns.append([self._field_id(f"{self.key}[{j}]", spec["field"], v, batch.start + b)
                            for b, v in enumerate(values)])
        ids = torch.as_tensor(columns, dtype=torch.long, device=device).reshape(len(self.specs), size).t()
        if self.fixed:
            self.made[size, str(device)] = ids
        return ids

    def _field_id(self, key: str, name: str, value, sample: int) -> int:
        where = f"{key}: field {name!r} of sample {sample}"
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str):
            if self.tokenizer is None:
                raise LensRunError(key, f"{where} is the string {value!r} but this run has no tokenizer to read it")
            try:
                value = one_token(value, self.tokenizer)
            except ValueError as err:
                raise LensRunError(key, f"{where}: {err}") from None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab:
            raise LensRunError(key, f"{where} is {value!r}, not a token of the model's {self.vocab}; give one string "
                                    "of one token or an id per sample")
        return value


class Recorder:
    """Keeps, for the run's own forward of each batch, the outputs and inputs of named modules.

    Two hooks on the model itself: before its forward (when armed, and not in inference mode, where the metrics'
    references and the patching grid run) they register the module hooks, after their last of the other hooks (so
    a layer is seen with the run's edits applied), and after the forward remove them; `take()` hands what they kept
    over and arms the next forward."""

    _live: "weakref.WeakKeyDictionary" = None

    def __init__(self, model: nn.Module, outputs: Sequence[str], inputs: Sequence[str],
                 sites: Sequence[Target] = ()):
        named = _named(model)
        self.sites = list(sites)  # kept as ("site", name): the value a site's Point reads (hookrun.capture.targets)
        self.batch = Batch()
        self.outputs = [(n, named[n]) for n in dict.fromkeys(outputs)]
        self.inputs = [(n, named[n]) for n in dict.fromkeys(inputs)]
        self.kept: Dict[tuple, Tensor] = {}
        self.armed, self.live, self.root = True, HookScope(), HookScope()
        if Recorder._live is None:
            Recorder._live = weakref.WeakKeyDictionary()
        old = Recorder._live.get(model)
        if old is not None:  # an earlier run's lens on the same model object: its hooks go
            old.close()
        Recorder._live[model] = self
        self.root.pre(model, self._begin, with_kwargs=True)
        self.root.forward(model, self._end)

    def _begin(self, module, args, kwargs):
        if not self.armed or torch.is_inference_mode_enabled():
            return
        self.live.remove()
        self.armed, self.kept = False, {}
        self.batch(module, args, kwargs)
        keep = lambda name: lambda value: self.kept.__setitem__(("site", name), value) or value  # noqa: E731
        attach(self.live, module, self.sites, [keep(t.name) for t in self.sites], LensError, self.batch)
        for name, mod in self.outputs:
            self.live.forward(mod, lambda m, a, out, name=name: self.kept.__setitem__(("out", name), _kept(out)))
        for name, mod in self.inputs:
            self.live.pre(mod, lambda m, a, name=name: self.kept.__setitem__(("in", name), a[0] if a else None))

    def _end(self, module, args, output):
        self.live.remove()

    def take(self) -> Dict[tuple, Tensor]:
        self.live.remove()
        kept, self.kept, self.armed = self.kept, {}, True
        return kept

    def close(self):
        self.live.remove()
        self.root.remove()


def _kept(output):
    """A component's write as it is returned, copied: a later in-place add into it (Falcon adds attention into the
    MLP's output) must not change what was kept."""
    out = output[0] if isinstance(output, (tuple, list)) else output
    return out.detach().clone() if isinstance(out, Tensor) else out


def default_layers(model: nn.Module) -> Optional[List[str]]:
    """`lens.sites.layers: blocks`: every block's module (the residual stream after each), None for a model of no
    known architecture (`blocks.*` names the same sites by their standard names)."""
    anat = _anatomy(model)
    return [anat.block_modules(i)["block"] for i in range(anat.n_layers)] if anat is not None else None


def _width(readout: Readout) -> Optional[int]:
    """d_model as the readout takes it: the final norm's width, else the unembedding's input width."""
    for module in (readout.norm, readout.unembed):
        weight = getattr(module, "weight", None) if module is not None else None
        if weight is not None:
            return int(weight.shape[-1])
    return None


class Lens(Method):
    """The `lens:` block: the logit lens at chosen layers x positions, and direct logit attribution, at each
    batch's forward (hooks of its own keep the residual streams; nothing else is stored). Stores `_lens/...` and
    `_dla/...` (hookrun.format.layout), their axes in the root attr `lens`; read back by cap.read("lens")
    (LensResult, with .dla a DLAResult)."""

    key = "lens"
    annotation = LensConfig
    factory = LensConfig
    help = "the logit lens and direct logit attribution (docs/lens.md)"
    config_errors = (LensRunError,)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.readout: Optional[Readout] = None
        self.layers: List[str] = []
        self.sites: List[Target] = []  # the lens's sites (lens.sites.layers: blocks: the blocks' modules)
        self.comps: List[Component] = []
        self.heads: List[Component] = []
        self.recorder: Optional[Recorder] = None
        self.tokens: Optional[_Tokens] = None
        self.answer: Optional[_Tokens] = None
        self.positions: List[int] = []
        self.all = False
        self.width = 0

    # -- checks ---------------------------------------------------------------------------------------------------
    @classmethod
    def active(cls, cfg) -> bool:
        spec = getattr(cfg, "lens", None)
        return spec is not None and bool(as_list(spec.sites.layers) or as_list(spec.dla.tokens))

    @classmethod
    def check(cls, cfg) -> List[str]:
        spec: Optional[LensConfig] = getattr(cfg, "lens", None)
        if spec is None or not cls.active(cfg):
            return [] if spec is None or not as_list(spec.tokens) else [
                f"lens.tokens: {spec.tokens!r} but the lens reads no layers; set lens.sites.layers (e.g. blocks, or "
                "${layers})"]
        problems = []
        if as_list(spec.tokens) and not as_list(spec.sites.layers):
            problems.append(f"lens.tokens: {spec.tokens!r} but the lens reads no layers; set lens.sites.layers (e.g. "
                            "blocks, or ${layers})")
        problems += check_number("lens.top_k", spec.top_k, whole=True, low=1, high=HUGE,
                                 fix="the most likely tokens stored per site")
        positions = spec.sites.positions
        if positions != "all":
            problems += [p + "; or all (every real position)" for p in
                         check_positions("lens.sites.positions", positions)]
        problems += [p for j, t in enumerate(as_list(spec.tokens)) for p in token_problems(f"lens.tokens[{j}]", t,
                                                                                              None)]
        dla = spec.dla
        if as_list(dla.tokens):
            if len(as_list(dla.tokens)) not in (1, 2):
                problems.append(f"lens.dla.tokens: {dla.tokens!r}; give the answer [A] (its logit) or [A, B] (logit A "
                                "- logit B), e.g. [' Paris', ' Rome'] or [{field: answer}, {field: wrong}]")
            problems += [p for j, t in enumerate(as_list(dla.tokens)) for p in
                         token_problems(f"lens.dla.tokens[{j}]", t, None)]
            problems += repeat_problems("lens.dla.tokens", as_list(dla.tokens))
            if isinstance(dla.position, list):
                problems.append(f"lens.dla.position: {dla.position!r}; DLA attributes one position: last, first or "
                                "an int")
            else:
                problems += check_positions("lens.dla.position", dla.position)
            problems += check_choice("lens.dla.heads", dla.heads, HEADS, "use auto, true or false")
            problems += check_number("lens.dla.tolerance", dla.tolerance, low=0, high=10 ** 6, open_low=True,
                                     fix="the largest gap, relative to the largest value; raise it for float16")
        if cfg.data.text is None:
            problems.append("lens: reads real-token positions of text batches; give the data as data.text (files or a "
                            "dataset, and a tokenizer)")
        return problems

    @classmethod
    def generation_problems(cls, cfg) -> List[str]:
        return ["lens: the lens reads one forward pass of the prompts, not generation; drop lens or set "
                "generate.max_new_tokens=0"] if cls.active(cfg) else []

    def model_problems(self, model) -> List[str]:
        spec = self.spec
        try:
            self.readout = find_readout(model, spec.norm, spec.unembed)
        except LensError as err:
            return [str(err)]
        problems = []
        layers = spec.sites.layers
        if layers == "blocks":
            found = default_layers(model)
            if found is None:
                return [f"lens.sites.layers: blocks picks every block of a known architecture, and "
                        f"{type(model).__name__} (model_type {_model_type(model)!r}) is none; name the modules whose "
                        "output is the residual stream, e.g. lens.sites.layers=[model.blocks.0, model.blocks.1]"]
            self.layers = found
        elif as_list(layers):
            self.sites, problems = resolve_sites(model, layers, None, "lens.sites.layers")
            self.layers = [t.name for t in self.sites]
        if as_list(spec.dla.tokens):
            try:
                self.comps = components(model)
                self.readout.norm_form()
            except LensError as err:
                return problems + [str(err)]
            split = [c for c in self.comps if c.kind == "attn" and c.out_proj is not None]
            attn = [c for c in self.comps if c.kind == "attn"]
            if spec.dla.heads is True and len(split) < len(attn):
                problems.append(f"lens.dla.heads: true, but {type(model).__name__}'s attention blocks have no linear "
                                f"per-head split ({attn[0].name} is followed by a norm); set lens.dla.heads=auto or "
                                "false")
            self.heads = split if spec.dla.heads in ("auto", True) else []
        return problems

    def compile(self, job) -> None:
        """The tokens against the tokenizer, the vocabulary and the data's fields; positions against the sequences;
        the hooks that keep the residual streams."""
        spec, inputs = self.spec, job.inputs
        tokenizer = getattr(inputs, "tokenizer", None)
        vocab = int(self.readout.unembed.weight.shape[0]) if hasattr(self.readout.unembed, "weight") else 1 << 62
        fields = inputs.field_names() if hasattr(inputs, "field_names") else []
        self.tokens = _Tokens("lens.tokens", as_list(spec.tokens), tokenizer, vocab, fields)
        problems = list(self.tokens.problems) + repeat_problems("lens.tokens", as_list(spec.tokens))
        if vocab < 1 << 62:
            problems += k_problems("lens.top_k", spec.top_k, vocab, "tokens in the model's vocabulary")
        if self.comps:
            self.answer = _Tokens("lens.dla.tokens", as_list(spec.dla.tokens), tokenizer, vocab, fields)
            problems += self.answer.problems
        lengths = [len(inputs.seqs[i]) for a, b in inputs.ranges() for i in range(a, b)]
        positions = spec.sites.positions
        self.all = positions == "all"
        self.positions = list(range(max(lengths))) if self.all else positions_spec(positions)[0]
        wanted = [] if self.all else self.positions
        if self.comps:
            wanted = wanted + positions_spec(spec.dla.position)[0]
        short = min(lengths)
        for p in wanted:
            if not -short <= p < short:
                key = "lens.sites.positions" if p in self.positions and not self.all else "lens.dla.position"
                problems.append(f"{key}: position {p} is beyond a sequence of {short} real tokens in this run; use "
                                "positions inside every sequence (first, last, or -1, -2, ...)")
        if problems:
            raise ConfigError(problems)
        outputs = [c.name for c in self.comps]
        ins = ([self.readout.norm_name] if self.comps else []) + [c.out_proj_name for c in self.heads]
        sites = self.sites or [Target(n, module_names(job.model)[n], Point(n, n), False) for n in self.layers]
        self.recorder = Recorder(job.model, outputs, ins, sites)

    def memory_need(self, job) -> List[tuple]:
        """The lens's parts held at once: the residual streams its hooks keep of a batch (every site, every kept
        position), the final logits the KL is taken against, and the readout's [rows, vocab] block (under
        2**27 values: its logits and log-probabilities)."""
        s = run_shape(job)
        sites = max(1, len(self.sites or self.layers)) + len(self.comps)
        positions = s.tokens if self.all else max(1, len(self.positions))
        block = 2 * 4.0 * min(max(2 ** 27, s.vocab), sites * s.batch * positions * s.vocab)
        return [(float(s.itemsize) * sites * s.batch * s.tokens * s.d_model, "data.batch_size",
                 f"the residual streams of {sites} sites x {s.batch} prompts x {s.tokens} tokens"),
                (3 * 4.0 * s.batch * positions * s.vocab, "lens.sites.positions",
                 f"the final logits of {s.batch} prompts x {positions} positions"),
                (block, "data.batch_size", "the readout's block of logits")]

    def skip(self, job) -> None:
        """What the recorder kept of a forward that is not measured goes; the next forward is recorded."""
        self.recorder.take()

    def close(self, job) -> None:
        """The recorder's two hooks off the model: nothing of the run stays on it."""
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    # -- per batch ------------------------------------------------------------------------------------------------
    def measure(self, job, i: int, batch, output, hookset) -> Dict[str, np.ndarray]:
        """The lens at the sites (`_lens/...`) and the DLA at its position (`_dla/...`) of batch `i`'s forward."""
        kept = self.recorder.take()
        info = tok.require(batch.tokens, "lens")
        columns = {}
        with torch.no_grad():
            if self.layers:
                self._lens(i, batch, info, kept, output, hookset)
            if self.comps:
                columns = self._dla(i, batch, info, kept, output, hookset)
        return columns

    def _kept(self, kept, kind: str, name: str, key: str):
        if (kind, name) not in kept:
            raise LensRunError(key, f"{key}: {name} did not run in the model's forward pass, so there is nothing to "
                                    "read; name modules the forward calls (inspect=true lists them)")
        return kept[kind, name]

    def _lens(self, i, batch, info, kept, output, hookset) -> None:
        ids = self.tokens.ids(batch, info.mask.shape[0], info.mask.device) if self.tokens.specs else None
        resid = [self._kept(kept, "site", name, "lens.sites.layers") for name in self.layers]
        arrays = lens_batch(self.readout, self.layers, resid, info, self.positions, self.all, self.spec.top_k, ids,
                            logits_of(output))
        for (layer, role), values in arrays.items():
            emit(hookset, i, batch, LENS, layer, role, values)

    def _dla(self, i, batch, info, kept, output, hookset) -> Dict[str, np.ndarray]:
        ids = self.answer.ids(batch, info.mask.shape[0], info.mask.device)
        parts, logit, heads = dla_batch(self.readout, self.comps, self.heads, lambda kind, name: self._kept(
            kept, kind, name, "lens.dla"), info, self.spec.dla.position, ids, logits_of(output),
            self.spec.dla.tolerance, i)
        emit(hookset, i, batch, DLA, "answer", "parts", parts)
        emit(hookset, i, batch, DLA, "answer", "logit", logit)
        if heads is not None:
            emit(hookset, i, batch, DLA, "answer", "heads", heads)
        return {"dla.logit": logit.cpu().numpy()}

    # -- what it writes, and its reader ---------------------------------------------------------------------------
    def columns(self) -> List[str]:
        return ["dla.logit"] if self.comps else []

    def attrs(self) -> dict:
        spec, r = self.spec, self.readout
        attrs = {"layers": self.layers, "positions": self.positions, "positions_spec": spec.sites.positions,
                 "k": spec.top_k, "tokens": self.tokens.labels if self.tokens else [],
                 "readout": {"norm": r.norm_name, "unembed": r.unembed_name, "post": [n for n, _ in r.post],
                             "softcap": r.softcap},
                 "axes": {"top": ["sample", "layer", "position", "k"],
                          "tokens": ["sample", "layer", "position", "token"],
                          "dist": ["sample", "layer", "position"]},
                 "dla": None}
        if self.comps:
            attrs["dla"] = {"tokens": self.answer.labels, "position": spec.dla.position,
                            "components": [c.name for c in self.comps] + ["bias"],
                            "kinds": [c.kind for c in self.comps] + ["bias"],
                            "component_layers": [c.layer for c in self.comps] + [None],
                            "head_layers": [c.layer for c in self.heads],
                            "n_heads": self.heads[0].n_heads if self.heads else 0,
                            "axes": {"parts": ["sample", "component"], "heads": ["sample", "layer", "head"],
                                     "logit": ["sample"]}}
        return {LENS_ATTR: attrs}

    @staticmethod
    def read(cap, tokenizer=None) -> "LensResult":
        return load_lens(cap, tokenizer)
