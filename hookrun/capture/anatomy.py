"""Model anatomy: where a model keeps its parts, and the standard site names every method accepts.

One table per architecture family (module names, block parts relative to the block) says where the embeddings,
blocks, norms, attention (its projections and heads), MLP, final norm and unembedding are; `model.anatomy` in YAML
declares the same fields for any other model. Every method asks this module, none keeps its own table.

    anat = anatomy(model)                          # found from model.config.model_type, or anatomy(model, declared)
    anat.names(["blocks.0-1.attn.heads"])          # ['blocks.0.attn.heads', 'blocks.1.attn.heads']
    p = anat.point("blocks.1.attn.heads")          # Point(module='transformer.h.1.attn.c_proj', side='input', view=...)
    value = p.get(t, batch_shape)                  # [B, T, 768] -> [B, T, 12, 64]; p.put(t, new, batch_shape) back

The standard names (TransformerLens's hook names beside them in docs/anatomy.md):

| name | what it is |
|---|---|
| `embed` | the token embedding's output (OPT with project_in: its output) |
| `pos_embed` | learned position embeddings' output, where the model has them |
| `blocks.N` | the residual stream after block N (the block's output) |
| `blocks.N.resid_pre` | the residual stream into block N (the block's input) |
| `blocks.N.resid_mid` | after attention's add (sequential blocks only) |
| `blocks.N.ln1`, `blocks.N.ln2` | the norms' outputs (before attention, before the MLP) |
| `blocks.N.attn` | attention's output as added to the residual stream |
| `blocks.N.attn.heads` | the output projection's input, split by head: [..., heads, d_head] |
| `blocks.N.attn.q`, `.k`, `.v` | the projections' outputs, split by head (k, v by key-value head) |
| `blocks.N.attn.pattern` | the attention probabilities [B, heads, T, T] (attn_implementation=eager) |
| `blocks.N.mlp` | the MLP's output as added to the residual stream |
| `blocks.N.mlp.hidden` | the input of the MLP's output projection (after the activation and the gate) |
| `final_norm` | the final norm's output |
| `unembed` | the logits |
"""
from __future__ import annotations

import dataclasses
import functools
import re
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from hookrun.config.checks import suggest

ROOTS = ("embed", "pos_embed", "blocks", "final_norm", "unembed")  # the first segment of every standard name
BLOCK_SITES = ("resid_pre", "resid_mid", "ln1", "attn", "attn.heads", "attn.q", "attn.k", "attn.v", "attn.pattern",
               "ln2", "mlp", "mlp.hidden")  # blocks.N.<site>; blocks.N itself is the block's output


class AnatomyError(ValueError):
    """A part the model lacks, an unknown architecture, or a declared anatomy that does not fit the model; the
    message names the key to set and what the model has."""


# ------------------------------------------------------------------------------------------- the family tables
@dataclass(frozen=True)
class Family:
    """Where one architecture keeps its parts: module names, block parts relative to the block (`attn.c_proj`).

    A part set to None is absent (GPT-J's ln2, Llama's pos_embed); `model.anatomy` in YAML gives these fields."""

    blocks: str  # the ModuleList of blocks
    embed: Tuple[str, ...]  # the token embedding's write: the first of these the model has
    attn: str  # the attention module: its output (output.0) is what attention computes
    mlp: Optional[str]  # the MLP: its output is what the MLP computes (OPT: fc2); None: attention-only blocks
    pos_embed: Tuple[str, ...] = ()  # learned position embeddings
    ln1: Optional[str] = None  # the norm before attention
    ln2: Optional[str] = None  # the norm before the MLP (in parallel blocks: on the block's input too)
    attn_out: Optional[str] = None  # attention's output projection: its input holds the heads side by side
    q: Optional[str] = None  # the query / key / value projections
    k: Optional[str] = None
    v: Optional[str] = None
    qkv: Optional[str] = None  # a fused projection instead of q, k, v
    qkv_layout: str = "concat"  # concat: [q | k | v] (GPT-2, Phi-3); per_head: [heads, 3, d_head] (GPT-NeoX)
    attn_write: Optional[str] = None  # a norm after attention whose output is what reaches the stream (Gemma 2/3)
    mlp_write: Optional[str] = None  # the same after the MLP (Gemma 2/3, OLMo 2)
    mlp_out: Optional[str] = None  # the MLP's output projection: its input is mlp.hidden
    final_norm: Optional[str] = None  # the final norm
    post: Tuple[str, ...] = ()  # modules between the final norm and the unembedding (OPT's project_out)
    unembed: Optional[str] = None  # None: model.get_output_embeddings()
    parallel: object = False  # attention and MLP both read the block's input: True, or a config attribute's name
    logits_times: Optional[str] = None  # a config attribute the unembedding's output is multiplied by (Cohere)
    logits_over: Optional[str] = None  # a config attribute it is divided by (Granite's logits_scaling)


_LLAMA = Family(blocks="model.layers", embed=("model.embed_tokens",), ln1="input_layernorm", attn="self_attn",
                attn_out="self_attn.o_proj", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                ln2="post_attention_layernorm", mlp="mlp", mlp_out="mlp.down_proj", final_norm="model.norm")
_GEMMA2 = dataclasses.replace(_LLAMA, ln2="pre_feedforward_layernorm", attn_write="post_attention_layernorm",
                              mlp_write="post_feedforward_layernorm")
FAMILIES: Dict[str, Family] = {
    "gpt2": Family(blocks="transformer.h", embed=("transformer.wte",), pos_embed=("transformer.wpe",), ln1="ln_1",
                   attn="attn", attn_out="attn.c_proj", qkv="attn.c_attn", ln2="ln_2", mlp="mlp",
                   mlp_out="mlp.c_proj", final_norm="transformer.ln_f"),
    "gpt_neo": Family(blocks="transformer.h", embed=("transformer.wte",), pos_embed=("transformer.wpe",), ln1="ln_1",
                      attn="attn", attn_out="attn.attention.out_proj", q="attn.attention.q_proj",
                      k="attn.attention.k_proj", v="attn.attention.v_proj", ln2="ln_2", mlp="mlp",
                      mlp_out="mlp.c_proj", final_norm="transformer.ln_f"),
    "gptj": Family(blocks="transformer.h", embed=("transformer.wte",), ln1="ln_1", attn="attn",
                   attn_out="attn.out_proj", q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", mlp="mlp",
                   mlp_out="mlp.fc_out", final_norm="transformer.ln_f", parallel=True),
    "gpt_neox": Family(blocks="gpt_neox.layers", embed=("gpt_neox.embed_in",), ln1="input_layernorm",
                       attn="attention", attn_out="attention.dense", qkv="attention.query_key_value",
                       qkv_layout="per_head", ln2="post_attention_layernorm", mlp="mlp", mlp_out="mlp.dense_4h_to_h",
                       final_norm="gpt_neox.final_layer_norm", parallel="use_parallel_residual"),
    # OPT: token embeddings go through project_in when word_embed_proj_dim != hidden_size; the MLP is inline
    # (fc1 -> act -> fc2) on tokens flattened to [B*T, d]
    "opt": Family(blocks="model.decoder.layers", embed=("model.decoder.project_in", "model.decoder.embed_tokens"),
                  pos_embed=("model.decoder.embed_positions",), ln1="self_attn_layer_norm", attn="self_attn",
                  attn_out="self_attn.out_proj", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                  ln2="final_layer_norm", mlp="fc2", mlp_out="fc2", final_norm="model.decoder.final_layer_norm",
                  post=("model.decoder.project_out",)),
    "phi": Family(blocks="model.layers", embed=("model.embed_tokens",), ln1="input_layernorm", attn="self_attn",
                  attn_out="self_attn.dense", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                  mlp="mlp", mlp_out="mlp.fc2", final_norm="model.final_layernorm", parallel=True),
    "phi3": dataclasses.replace(_LLAMA, q=None, k=None, v=None, qkv="self_attn.qkv_proj"),
    "cohere": dataclasses.replace(_LLAMA, ln2=None, parallel=True, logits_times="logit_scale"),
    "stablelm": dataclasses.replace(_LLAMA, parallel="use_parallel_residual"),
    "mixtral": dataclasses.replace(_LLAMA, mlp_out=None),  # experts' weights are fused: no mlp.hidden
    "olmo2": dataclasses.replace(_LLAMA, ln1=None, ln2=None, attn_write="post_attention_layernorm",
                                 mlp_write="post_feedforward_layernorm"),
    **{t: _GEMMA2 for t in ("gemma2", "gemma3_text")},
    "granite": dataclasses.replace(_LLAMA, logits_over="logits_scaling"),
    **{t: _LLAMA for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo")},
    # the bundled induction model (hookrun.experiments.induction.AttnOnly): attention-only blocks, a fused [q | k | v]
    "hookrun_attn_only": Family(blocks="blocks", embed=("embed",), pos_embed=("pos_embed",), ln1="ln", attn="attn",
                                attn_out="attn.out", qkv="attn.qkv", mlp=None, final_norm="ln_f", unembed="unembed"),
}
FIELDS = tuple(f.name for f in dataclasses.fields(Family))


def declared(spec: Mapping, key: str = "model.anatomy") -> Family:
    """A Family from `model.anatomy` in YAML (str or list for the tuple fields); AnatomyError naming unknown or
    missing keys.

        declared({"blocks": "layers", "embed": "tok", "attn": "attn", "mlp": "ff", "final_norm": "norm"})
    """
    spec = dict(spec)
    unknown = [k for k in spec if k not in FIELDS]
    problems = [f"{key}.{k}: unknown part{suggest(k, FIELDS)}; the parts are {', '.join(FIELDS)}" for k in unknown]
    missing = [k for k in ("blocks", "embed", "attn", "mlp") if k not in spec]
    problems += [f"{key}.{k}: missing; {key} needs blocks, embed, attn and mlp (dotted module names; block parts "
                 f"relative to a block, e.g. attn: self_attn)" for k in missing]
    if problems:
        raise AnatomyError("; ".join(problems))
    tuples = {k: tuple([spec[k]] if isinstance(spec[k], str) else spec[k]) for k in ("embed", "pos_embed", "post")
              if k in spec}
    return Family(**{**spec, **tuples})


# ---------------------------------------------------------------------------------------------- views and points
@dataclass(frozen=True)
class View:
    """A part of a module's tensor [..., width]: heads of a projection, or a slice of a fused one, split by head.

    `start`/`stop` pick features (a concat-fused q/k/v), `per_head` picks one of `parts` slices inside every head
    (GPT-NeoX's [heads, 3, d_head]); the part is returned as [..., heads, d_head]. OPT's MLP flattens tokens to
    [B*T, d]: with `batch_shape` the rows come back as [B, T, ...]."""

    heads: int = 0  # 0: no head split
    start: int = 0
    stop: Optional[int] = None
    per_head: Optional[Tuple[int, int]] = None  # (which, parts)

    def get(self, t: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The part of t (a view where torch allows it)."""
        t = unflatten(t, batch_shape)
        if self.per_head is not None:
            which, parts = self.per_head
            t = t.unflatten(-1, (self.heads, -1))
            d = t.shape[-1] // parts
            return t[..., which * d:(which + 1) * d]
        if self.start or self.stop is not None:
            t = t[..., self.start:self.stop]
        return t.unflatten(-1, (self.heads, -1)) if self.heads else t

    def put(self, t: torch.Tensor, part: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """t with its part replaced by `part` (shaped as get() returns it): a new tensor, t's shape."""
        shape = t.shape
        full = unflatten(t, batch_shape)
        if self.per_head is not None:
            which, parts = self.per_head
            new = full.unflatten(-1, (self.heads, -1)).clone()
            d = new.shape[-1] // parts
            new[..., which * d:(which + 1) * d] = part
            return new.flatten(-2).reshape(shape)
        flat = part.flatten(-2) if self.heads else part
        if self.start or self.stop is not None:
            new = full.clone()
            new[..., self.start:self.stop] = flat
            return new.reshape(shape)
        return flat.reshape(shape)


def unflatten(t: torch.Tensor, batch_shape: Optional[Sequence[int]]) -> torch.Tensor:
    """Rows of flattened tokens [B*T, ...] (OPT's MLP) as [B, T, ...] when batch_shape is (B, T); else t."""
    if batch_shape is not None and len(batch_shape) == 2 and t.dim() >= 2 and t.shape[0] != batch_shape[0] \
            and t.shape[0] == batch_shape[0] * batch_shape[1]:
        return t.unflatten(0, tuple(batch_shape))
    return t


@dataclass(frozen=True)
class Point:
    """Where a standard site's tensor is met: a module, the side (output | input), the element of a tuple output
    (the attention pattern is output.1) and the view of the tensor; `role` is the native role it stands for.

        p = anatomy(gpt2).point("blocks.0.resid_mid")   # Point(module='transformer.h.0.ln_2', side='input', ...)
    """

    name: str
    module: str
    side: str = "output"  # output: what the module returns; input: its first argument (or hidden_states keyword)
    index: int = 0  # the element of a tuple output (or the positional argument)
    view: Optional[View] = None
    layer: Optional[int] = None  # the block, for blocks.N...
    heads: int = 0  # the heads axis (-2) when the view splits heads, else 0

    @property
    def role(self) -> str:
        """The native role this point reads: output / output.<i> / input.<i> (a tuple output's element)."""
        return f"{self.side}.{self.index}" if self.side == "input" or self.index else self.side

    def get(self, t: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        return self.view.get(t, batch_shape) if self.view is not None else unflatten(t, batch_shape)

    def put(self, t: torch.Tensor, new: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        return self.view.put(t, new, batch_shape) if self.view is not None else new.reshape(t.shape)

    def read(self, args: tuple, kwargs: dict, output=None) -> torch.Tensor:
        """The module's tensor this point reads from a call (the pre-view tensor): output[index] or the input."""
        if self.side == "output":
            return output[self.index] if isinstance(output, (tuple, list)) else output
        if len(args) > self.index:
            return args[self.index]
        if "hidden_states" in kwargs:
            return kwargs["hidden_states"]
        return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))

    def write(self, args: tuple, kwargs: dict, output, new: torch.Tensor):
        """The call's (args, kwargs) for an input point, or its output for an output point, with the read tensor
        replaced by `new` (same container types)."""
        if self.side == "output":
            if isinstance(output, (tuple, list)):
                items = list(output)
                items[self.index] = new
                return type(output)(items)
            return new
        if len(args) > self.index:
            args = (*args[:self.index], new, *args[self.index + 1:])
            return args, kwargs
        key = "hidden_states" if "hidden_states" in kwargs else \
            next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        return args, {**kwargs, key: new}


# ---------------------------------------------------------------------------------------------- the anatomy
def _config(model: nn.Module):
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def model_type(model: nn.Module) -> Optional[str]:
    """The Hugging Face model_type of a model (of its text config), None for other models."""
    return getattr(_config(model), "model_type", None)


def _count(config, *names) -> Optional[int]:
    return next((int(getattr(config, n)) for n in names if isinstance(getattr(config, n, None), int)), None)


@dataclass
class Anatomy:
    """A model's parts by standard name, resolved against its modules (anatomy(model) builds it).

        anat.points(["blocks.*"]); anat.block_modules(0)["attn_out"]; anat.n_layers, anat.n_heads, anat.d_head
    """

    model_class: str
    arch: str  # the model_type, or "declared"
    family: Family = field(repr=False)
    modules: Dict[str, nn.Module] = field(repr=False)  # every named module but the root
    root: "weakref.ref" = field(repr=False, default=None)  # the model (weakly: anatomies are cached per model)
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    d_head: int = 0
    parallel: bool = False
    eager: bool = True  # the attention pattern is returned (attn_implementation eager)
    logit_scale: float = 1.0  # the logits are the unembedding's output times this (Cohere, 1 / Granite's scaling)
    softcap: Optional[float] = None  # then tanh(logits / softcap) * softcap (Gemma 2/3's final_logit_softcapping)

    # -- names ------------------------------------------------------------------------------------------------
    def part(self, name: Optional[str], i: Optional[int] = None) -> Optional[str]:
        """The module name of a part (a block part of block i), None where the model has none."""
        if name is None:
            return None
        full = f"{self.family.blocks}.{i}.{name}" if i is not None else name
        return full if full in self.modules else None

    def block_modules(self, i: int) -> Dict[str, Optional[str]]:
        """Block i's parts: block, ln1, attn, attn_out, q, k, v, qkv, attn_write, ln2, mlp, mlp_out, mlp_write."""
        parts = {p: self.part(getattr(self.family, p), i) for p in
                 ("ln1", "attn", "attn_out", "q", "k", "v", "qkv", "attn_write", "ln2", "mlp", "mlp_out", "mlp_write")}
        return {"block": f"{self.family.blocks}.{i}", **parts}

    def embed_modules(self) -> Tuple[Optional[str], Optional[str]]:
        """(the token embedding's write, the position embedding) module names."""
        first = lambda names: next((n for n in names if self.modules.get(n) is not None), None)  # noqa: E731
        return first(self.family.embed), first(self.family.pos_embed)

    def standard_names(self) -> List[str]:
        """Every standard name this model has, in model order."""
        return list(self._standard_names)

    @functools.cached_property
    def _standard_names(self) -> Tuple[str, ...]:  # once per anatomy (each method's sites ask, every batch)
        embed, pos = self.embed_modules()
        names = ["embed"] + (["pos_embed"] if pos else [])
        for i in range(self.n_layers):
            names += [f"blocks.{i}"] + [f"blocks.{i}.{s}" for s in BLOCK_SITES if self._lacks(s, i) is None]
        return tuple(names + (["final_norm"] if self.part(self.family.final_norm) else []) + ["unembed"])

    def names(self, patterns, key: str = "layers") -> List[str]:
        """The standard names a list of patterns selects, in model order (AnatomyError for one that matches
        nothing, naming the nearest names and why the model lacks it)."""
        every = self.standard_names()
        out: List[str] = []
        for pattern in [patterns] if isinstance(patterns, str) else list(patterns):
            regex = pattern_regex(str(pattern))
            found = [n for n in every if regex.fullmatch(n)]
            if not found:
                self.point(str(pattern), key)  # raises the reason for a plain name the model lacks
                raise AnatomyError(f"{key}: {pattern!r} matches no standard site of {self.model_class}"
                                   f"{suggest(pattern, every)}; patterns: blocks.*, blocks.0-3.attn, "
                                   "blocks.*.attn.heads")
            out += [n for n in found if n not in out]
        order = {n: i for i, n in enumerate(every)}
        return sorted(out, key=order.__getitem__)

    # -- points -----------------------------------------------------------------------------------------------
    def points(self, patterns, key: str = "layers") -> List[Point]:
        """Every Point the patterns select, in model order."""
        return [self.point(n, key) for n in self.names(patterns, key)]

    def point(self, name: str, key: str = "layers") -> Point:
        """The Point of one standard name; AnatomyError naming the name, the architecture and the nearest names."""
        if name == "embed" or name == "pos_embed":
            module = self.embed_modules()[name == "pos_embed"]
            if module is None:
                raise self._refuse(name, key, "it has no learned position embeddings (its positions are rotary or "
                                              "relative)" if name == "pos_embed" else "no token embedding was found")
            return Point(name, module)
        if name in ("final_norm", "unembed"):
            module = self.part(self.family.final_norm) if name == "final_norm" else self.unembed_name()
            if module is None:
                raise self._refuse(name, key, "it has no final norm")
            return Point(name, module)
        m = re.fullmatch(r"blocks\.(\d+)(?:\.(.+))?", name)
        if m is None or int(m.group(1)) >= self.n_layers:
            why = f"it has {self.n_layers} blocks (0..{self.n_layers - 1})" if m else "it is no standard name"
            raise self._refuse(name, key, why)
        i, site = int(m.group(1)), m.group(2)
        if site is None:
            return Point(name, f"{self.family.blocks}.{i}", layer=i)
        if site not in BLOCK_SITES:
            raise self._refuse(name, key, f"{site!r} is no block site ({', '.join(BLOCK_SITES)})")
        lack = self._lacks(site, i)
        if lack is not None:
            raise self._refuse(name, key, lack)
        return self._block_point(name, i, site)

    def _block_point(self, name: str, i: int, site: str) -> Point:
        b = self.block_modules(i)
        if site == "resid_pre":
            return Point(name, b["block"], "input", layer=i)
        if site == "resid_mid":  # the input of what the MLP path reads first: its norm, else the MLP
            return Point(name, b["ln2"] or b["mlp"], "input", layer=i)
        if site in ("ln1", "ln2"):
            return Point(name, b[site], layer=i)
        if site == "attn":
            return Point(name, b["attn_write"] or b["attn"], layer=i)
        if site == "mlp":
            return Point(name, b["mlp_write"] or b["mlp"], layer=i)
        if site == "mlp.hidden":
            return Point(name, b["mlp_out"], "input", layer=i)
        if site == "attn.heads":
            return Point(name, b["attn_out"], "input", view=View(self.n_heads), layer=i, heads=self.n_heads)
        if site == "attn.pattern":
            return Point(name, b["attn"], index=1, layer=i, heads=self.n_heads)
        which = "qkv".index(site[-1])
        heads = self.n_heads if which == 0 else self.n_kv_heads
        if b[site[-1]] is not None:
            return Point(name, b[site[-1]], view=View(heads), layer=i, heads=heads)
        if self.family.qkv_layout == "per_head":
            return Point(name, b["qkv"], view=View(self.n_heads, per_head=(which, 3)), layer=i, heads=heads)
        q, kv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        start, stop = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][which]
        return Point(name, b["qkv"], view=View(heads, start, stop), layer=i, heads=heads)

    def _lacks(self, site: str, i: int) -> Optional[str]:
        """Why block i has no `site` (None when it has it)."""
        b = self.block_modules(i)
        if site == "resid_mid" and self.parallel:
            return (f"its blocks are parallel ({self.arch}: attention and the MLP both read the block's input), so "
                    "there is no residual stream between them; use blocks.N.resid_pre or blocks.N")
        need = {"ln1": ("ln1",), "ln2": ("ln2",), "attn.heads": ("attn_out",), "mlp.hidden": ("mlp_out",),
                "resid_mid": ("mlp",), "mlp": ("mlp",)}.get(site, ())
        if site in ("attn.q", "attn.k", "attn.v"):
            need = (site[-1],) if b[site[-1]] is not None or b["qkv"] is None else ("qkv",)
        missing = [p for p in need if b[p] is None]
        if missing:
            what = {"ln1": "no norm before attention", "ln2": "no norm before the MLP",
                    "attn_out": "no attention output projection", "mlp_out": "no MLP output projection (mlp_out)",
                    "q": "no query projection", "k": "no key projection", "v": "no value projection",
                    "qkv": "no q/k/v projections", "mlp": "no MLP (its blocks are attention-only)"}[missing[0]]
            return f"it has {what} (model.anatomy.{missing[0]} names one)"
        if site in ("attn.heads", "attn.q", "attn.k", "attn.v", "attn.pattern") and not self.n_heads:
            return "its config names no number of attention heads (num_attention_heads)"
        if site == "attn.pattern" and not self.eager:
            return ("its attention implementation returns no probabilities; load it with attn_implementation=eager "
                    "(model.attn_implementation=eager, or from_pretrained(..., attn_implementation='eager'))")
        return None

    def _refuse(self, name: str, key: str, why: str) -> AnatomyError:
        near = suggest(name, self.standard_names())
        return AnatomyError(f"{key}: {name!r} is not a site of {self.model_class} ({self.arch}): {why}{near}")

    def unembed_name(self) -> str:
        """The unembedding's module name (the family's, else get_output_embeddings())."""
        if self.family.unembed:
            return self.family.unembed
        root = self.root() if self.root is not None else None
        get = getattr(root, "get_output_embeddings", None)
        head = get() if get is not None else None
        name = next((n for n, m in self.modules.items() if m is head and n), None)
        if name is None:
            raise AnatomyError(f"model.anatomy.unembed: {self.model_class} has no output embedding "
                               "(get_output_embeddings()); name the unembedding module")
        return name

    def table(self) -> List[Tuple[str, str, str]]:
        """(standard name, module, native role) for every standard name: inspect=true's table."""
        return [(p.name, p.module, p.role + (" (split by head)" if p.view is not None else ""))
                for p in (self.point(n) for n in self.standard_names())]


def pattern_regex(pattern: str) -> "re.Pattern":
    """A standard-name pattern as a regex: `*` one dotted segment, `**` any segments, `N-M` a range of blocks,
    `re:<regex>` as it is.

        pattern_regex("blocks.0-2.attn").fullmatch("blocks.1.attn")
    """
    if pattern.startswith("re:"):
        return re.compile(pattern[3:])
    out = []
    for seg in pattern.split("."):
        r = re.fullmatch(r"(\d+)-(\d+)", seg)
        if seg == "**":
            out.append(r".+")
        elif r:
            lo, hi = int(r.group(1)), int(r.group(2))
            out.append("(?:" + "|".join(str(n) for n in range(lo, hi + 1)) + ")")
        else:
            out.append("".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in seg))
    return re.compile(r"\.".join(out))


def is_standard(pattern: str) -> bool:
    """Whether a layer pattern is in the standard vocabulary (its first segment is embed, blocks, unembed, ...)."""
    return not pattern.startswith("re:") and pattern.split(".", 1)[0] in ROOTS


def _top_levels(model: nn.Module, depth: int = 2) -> str:
    names = [n for n, _ in model.named_modules() if n and n.count(".") < depth]
    return ", ".join(names[:30]) + (" ..." if len(names) > 30 else "")


_CACHE: "weakref.WeakKeyDictionary[nn.Module, Anatomy]" = weakref.WeakKeyDictionary()


def anatomy(model: nn.Module, declared_parts: Optional[Mapping] = None) -> Anatomy:
    """The model's anatomy: its family's table (by config.model_type) or `declared_parts` (model.anatomy in YAML,
    which wins and is remembered for the model); AnatomyError for an unknown architecture naming the key to add and
    the module tree's top levels. Found once per model (cached weakly): every method asks here.

        anatomy(gpt2).point("blocks.0.attn").module == "transformer.h.0.attn"
    """
    cached = _CACHE.get(model)
    if cached is not None and not declared_parts:
        return cached
    found = _find(model, declared_parts)
    _CACHE[model] = found
    return found


def _find(model: nn.Module, declared_parts: Optional[Mapping]) -> Anatomy:
    mtype = model_type(model)
    cls = type(model).__name__
    if declared_parts:
        family, arch = declared(declared_parts), "declared"
    elif mtype in FAMILIES:
        family, arch = FAMILIES[mtype], mtype
    else:
        raise AnatomyError(f"model.anatomy: {cls} (model_type {mtype!r}) is not an architecture hookrun knows "
                           f"({', '.join(sorted(FAMILIES))}); declare its parts, e.g. model.anatomy: {{blocks: "
                           f"model.layers, embed: model.embed_tokens, attn: self_attn, mlp: mlp, final_norm: "
                           f"model.norm}}. Its top-level modules: {_top_levels(model)}")
    modules = {n: m for n, m in model.named_modules() if n}
    blocks = modules.get(family.blocks)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise AnatomyError(f"model.anatomy.blocks: {family.blocks!r} is not a ModuleList of {cls}"
                           f"{suggest(family.blocks, [n for n in modules if n])}; its top-level modules: "
                           f"{_top_levels(model)}")
    config = _config(model)
    for part in ("attn", "mlp"):
        if (part == "attn" or family.mlp is not None) and f"{family.blocks}.0.{getattr(family, part)}" not in modules:
            raise AnatomyError(f"model.anatomy.{part}: {getattr(family, part)!r} is no module of block 0 "
                               f"({family.blocks}.0){suggest(getattr(family, part), _children(modules, family.blocks + '.0'))}")
    parallel = family.parallel
    parallel = bool(getattr(config, parallel, False)) if isinstance(parallel, str) else bool(parallel)
    n_heads = _count(config, "num_attention_heads", "n_head", "num_heads") or 0
    n_kv = _count(config, "num_key_value_heads", "multi_query_group_num") or n_heads
    d_head = _count(config, "head_dim") or 0
    proj = modules.get(f"{family.blocks}.0.{family.attn_out}") if family.attn_out else None
    width = getattr(proj, "in_features", None) or (proj.weight.shape[0] if type(proj).__name__ == "Conv1D" else None)
    if width and n_heads:
        d_head = width // n_heads
    impl = getattr(config, "_attn_implementation", None) or "eager"
    scale = float(getattr(config, family.logits_times, 1.0)) if family.logits_times else 1.0
    scale /= float(getattr(config, family.logits_over, 1.0)) if family.logits_over else 1.0
    cap = getattr(config, "final_logit_softcapping", None)
    return Anatomy(cls, arch, family, modules, weakref.ref(model), len(blocks), n_heads, n_kv, d_head, parallel,
                   impl == "eager", scale, float(cap) if cap else None)


def _children(modules: Mapping[str, nn.Module], prefix: str) -> List[str]:
    return [n[len(prefix) + 1:] for n in modules if n.startswith(prefix + ".")]

