"""Logit lens and direct logit attribution (DLA) on Hugging Face causal LMs: plain torch, no hookrun internals.

The readout is the model's own final norm and unembedding, found per architecture (GPT-2, Llama, Qwen2/3,
Mistral, Gemma 1-3, GPT-NeoX, OPT, ...) or named by `lens.norm` / `lens.unembed`:

    readout = find_readout(model)                       # or find_readout(model, norm="model.norm", unembed="lm_head")
    logits = lens_logits(readout, resid)                # [..., d_model] -> [..., vocab], the model's own readout
    ids, probs = top_k(logits, 5)
    logprob, rank = logprob_and_rank(logits, token_ids)
    table = lens_table(readout, gather_sites(layer_outputs, positions), k=5, tokens=answer_ids)   # one pass

DLA splits the final residual stream into the outputs of `components(model)` (embeddings, every block's
attention and MLP; each head through `head_outputs`) and projects each on the answer direction with the final
norm's scale frozen from the real run (TransformerLens's `apply_ln_to_stack`), so the parts plus `bias` sum to
the model's logit (difference):

    att = attribute(readout, stack, final_resid, token, other)     # stack [C, ..., d_model]
    att.parts.sum(0) + att.bias == logits[..., token] - logits[..., other]   (before any final soft-cap)
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

Tensor = torch.Tensor


class LensError(ValueError):
    """A model whose readout or components cannot be found or used; the message names the keys to set."""


# ---------------------------------------------------------------------------------------------- architectures
# model_type -> (final norm, modules between the norm and the unembedding); the unembedding itself comes from
# model.get_output_embeddings(). A path absent from the model (OPT's project_out) is skipped.
_LLAMA_LIKE = ("model.norm", ())
READOUTS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "gpt2": ("transformer.ln_f", ()),
    "gpt_neo": ("transformer.ln_f", ()),
    "gptj": ("transformer.ln_f", ()),
    "gpt_neox": ("gpt_neox.final_layer_norm", ()),
    "opt": ("model.decoder.final_layer_norm", ("model.decoder.project_out",)),
    "phi": ("model.final_layernorm", ()),
    **{t: _LLAMA_LIKE for t in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                                "phi3", "olmo", "olmo2", "granite", "cohere", "stablelm")},
}

# model_type -> component layout. {i} is the block index. attn_out: the attention's output projection (its
# input is the heads' concatenated outputs z), None where a norm follows it inside the block (heads then
# cannot be split linearly). Gemma 2/3 add a norm after attention and after the MLP: those norms' outputs are
# what reaches the residual stream.
_LAYOUT_LLAMA = dict(embed=("model.embed_tokens",), blocks="model.layers", attn="model.layers.{i}.self_attn",
                     attn_out="model.layers.{i}.self_attn.o_proj", mlp="model.layers.{i}.mlp")
LAYOUTS: Dict[str, dict] = {
    "gpt2": dict(embed=("transformer.wte",), pos=("transformer.wpe",), blocks="transformer.h",
                 attn="transformer.h.{i}.attn", attn_out="transformer.h.{i}.attn.c_proj",
                 mlp="transformer.h.{i}.mlp"),
    "gpt_neox": dict(embed=("gpt_neox.embed_in",), blocks="gpt_neox.layers", attn="gpt_neox.layers.{i}.attention",
                     attn_out="gpt_neox.layers.{i}.attention.dense", mlp="gpt_neox.layers.{i}.mlp"),
    # OPT: token embeddings go through project_in when word_embed_proj_dim != hidden_size; the MLP is inline
    # (fc1 -> act -> fc2), so fc2's output is the MLP's write. Post-LN OPT (do_layer_norm_before=False, 350m)
    # does not decompose: refused in components().
    "opt": dict(embed=("model.decoder.project_in", "model.decoder.embed_tokens"),
                pos=("model.decoder.embed_positions",), blocks="model.decoder.layers",
                attn="model.decoder.layers.{i}.self_attn", attn_out="model.decoder.layers.{i}.self_attn.out_proj",
                mlp="model.decoder.layers.{i}.fc2"),
    **{t: _LAYOUT_LLAMA for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo", "granite")},
    **{t: dict(_LAYOUT_LLAMA, attn="model.layers.{i}.post_attention_layernorm", attn_out=None,
               mlp="model.layers.{i}.post_feedforward_layernorm") for t in ("gemma2", "gemma3_text")},
}


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
    mtype = _model_type(model)
    known_norm, post_names = READOUTS.get(mtype, (None, ()))
    named = _named(model)
    cls = type(model).__name__
    if unembed is not None:
        head = _module(model, unembed, "lens.unembed")
    else:
        get = getattr(model, "get_output_embeddings", None)
        head = get() if get is not None else None
        unembed = _name_of(model, head) if head is not None else None
        if head is None or unembed is None:
            raise LensError(f"lens: cannot find the unembedding of {cls} (model_type {mtype!r}): set lens.unembed "
                            f"(and lens.norm) to dotted module names; {_candidates(model)}")
    if norm is not None:
        norm_module = _module(model, norm, "lens.norm")
    elif known_norm is not None:
        norm_module = named.get(known_norm)
        norm = known_norm if norm_module is not None else None
        if norm_module is None and mtype != "opt":  # post-LN OPT has final_layer_norm = None
            raise LensError(f"lens: {cls} has no module {known_norm!r}: set lens.norm; {_candidates(model)}")
    else:
        raise LensError(f"lens: cannot find the final norm of {cls} (model_type {mtype!r} is not one hookrun knows): "
                        f"set lens.norm and lens.unembed to dotted module names; {_candidates(model)}")
    post = tuple((n, named[n]) for n in post_names if named.get(n) is not None)
    config = _config(model)
    softcap = getattr(config, "final_logit_softcapping", None)
    return Readout(cls, norm, norm_module, unembed, head, post, float(softcap) if softcap else None)


# ---------------------------------------------------------------------------------------------------- lens
def lens_logits(readout: Readout, resid: Tensor) -> Tensor:
    """A residual stream [..., d_model] read out as the model reads its last one: norm, post maps, unembed, cap."""
    x = resid if readout.norm is None else readout.norm(resid)
    for _, module in readout.post:
        x = module(x)
    logits = readout.unembed(x)
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
    shape = torch.broadcast_shapes(logits.shape[:-1], ids.shape[:-1])
    logits = logits.expand(*shape, logits.shape[-1])
    ids = ids.expand(*shape, ids.shape[-1])
    chosen = logits.gather(-1, ids)
    logprob = chosen - torch.logsumexp(logits, dim=-1, keepdim=True)
    rank = (logits.unsqueeze(-2) > chosen.unsqueeze(-1)).sum(-1)
    return logprob, rank


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
    """The logit lens at sites [...] (e.g. layers x batch x positions): top-k tokens, and given tokens' logprob/rank."""

    top_ids: Tensor  # [..., k]
    top_probs: Tensor  # [..., k] float32
    logprob: Optional[Tensor]  # [..., T] float32, None without tokens
    rank: Optional[Tensor]  # [..., T]


def lens_table(readout: Readout, resid: Tensor, k: int = 5, tokens=None, chunk: int = 2 ** 27) -> LensTable:
    """The lens at every site of resid [..., d] in one vectorised pass (rows split only to keep a [rows, vocab]
    block under `chunk` elements): top-k ids and probabilities, and for tokens (ids broadcast to [..., T], e.g.
    [T], [B, 1, T] against [L, B, P]) their log-probability and rank.

        table = lens_table(readout, gather_sites([out[l] for l in layers], positions), k=5, tokens=ids)
    """
    sites = resid.shape[:-1]
    flat = resid.reshape(-1, resid.shape[-1])
    ids = None
    if tokens is not None:
        ids = torch.as_tensor(tokens, device=resid.device)
        ids = ids.unsqueeze(-1) if ids.dim() == 0 else ids
        ids = ids.expand(*sites, ids.shape[-1]).reshape(flat.shape[0], -1)
    vocab = readout.unembed.weight.shape[0] if hasattr(readout.unembed, "weight") else 1
    rows = max(1, chunk // max(vocab, 1))
    parts = []
    for start in range(0, flat.shape[0], rows):
        logits = lens_logits(readout, flat[start:start + rows]).float()
        top_ids, top_probs = top_k(logits, k)
        lp, rk = logprob_and_rank(logits, ids[start:start + rows]) if ids is not None else (None, None)
        parts.append((top_ids, top_probs, lp, rk))
    cat = [torch.cat(p) if p[0] is not None else None for p in zip(*parts)]
    shape = lambda t: t.reshape(*sites, t.shape[-1]) if t is not None else None  # noqa: E731
    return LensTable(*map(shape, cat))


# ---------------------------------------------------------------------------------------- components and DLA
@dataclass(frozen=True)
class Component:
    """A module whose output is added into the residual stream (kind: embed | pos_embed | attn | mlp).

    For attn, out_proj is the output projection whose input z holds the heads' outputs side by side
    (None where the heads cannot be split linearly, e.g. Gemma 2's norm after attention)."""

    name: str
    module: nn.Module = field(repr=False)
    kind: str
    layer: Optional[int] = None
    out_proj_name: Optional[str] = None
    out_proj: Optional[nn.Module] = field(default=None, repr=False)
    n_heads: Optional[int] = None


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
    mtype = _model_type(model)
    cls = type(model).__name__
    layout = LAYOUTS.get(mtype)
    if layout is None:
        raise LensError(f"lens.dla: {cls} (model_type {mtype!r}) has no known component layout; DLA supports "
                        f"{', '.join(sorted(LAYOUTS))}")
    config = _config(model)
    if mtype == "opt" and not getattr(config, "do_layer_norm_before", True):
        raise LensError(f"lens.dla: {cls} normalises after each block (do_layer_norm_before=False), so the blocks' "
                        f"outputs do not sum to the final residual stream; DLA needs a pre-norm model")
    named = _named(model)
    out: List[Component] = []
    embed = next((n for n in layout["embed"] if named.get(n) is not None), None)
    if embed is None:
        raise LensError(f"lens.dla: {cls} has none of {layout['embed']}")
    out.append(Component(embed, named[embed], "embed"))
    for name in layout.get("pos", ()):
        if named.get(name) is not None:
            out.append(Component(name, named[name], "pos_embed"))
    blocks = _module(model, layout["blocks"], "lens.dla")
    n_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    for i in range(len(blocks)):
        attn = layout["attn"].format(i=i)
        proj = layout["attn_out"].format(i=i) if layout["attn_out"] else None
        out.append(Component(attn, _module(model, attn, "lens.dla"), "attn", i, proj,
                             _module(model, proj, "lens.dla") if proj else None, n_heads if proj else None))
        mlp = layout["mlp"].format(i=i)
        out.append(Component(mlp, _module(model, mlp, "lens.dla"), "mlp", i))
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
            parts += list(heads.movedim(-2, 0))
            bias = out_bias(c)
            if bias is not None:
                names.append(f"{c.out_proj_name}.bias")
                parts.append(bias)
        else:
            names.append(c.name)
            parts.append(component_output(outputs[c.name], batch_shape))
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
    sites = torch.broadcast_shapes(parts.shape[1:-1], final.shape[:-1], w.shape[:-1], b.shape)
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
