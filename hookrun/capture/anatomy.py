"""Model anatomy: where a model keeps its parts, and the standard site names every method accepts.

A family table (hookrun.capture.families: module names, block parts relative to the block) says where the
embeddings, blocks, norms, attention (its projections and heads), MLP, final norm and unembedding are; `model.anatomy`
in YAML declares the same fields; any other Hugging Face model has them inferred from its module tree
(hookrun.capture.inference). Every anatomy is proved on one tiny forward (hookrun.capture.proof) before it is used,
and a site whose identity does not add up is refused. Every method asks this module, none keeps its own table.

    anat = anatomy(model)                          # table, inferred, or anatomy(model, declared); proved once
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
| `blocks.N.mlp.router` | a mixture of experts' router logits [B, T, experts] |
| `final_norm` | the final norm's output |
| `unembed` | the logits |
"""
from __future__ import annotations

import dataclasses
import functools
import re
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hookrun.capture.families import BLOCK_PARTS, FAMILIES, FIELDS, AnatomyError, Family, declared
from hookrun.capture.inference import (ATTENTION, MLP, NOT_TEXT, SOFTCAPS, count, find_blocks, infer, layer_count,
                                       setting, width_in, width_out)
from hookrun.capture.proof import Proof, Trace, call_input, check, trace
from hookrun.config.checks import suggest

__all__ = ["AnatomyError", "Family", "FAMILIES", "FIELDS", "declared", "View", "Point", "Anatomy", "anatomy",
           "pattern_regex", "is_standard", "model_type", "unflatten", "example", "before_load", "ROOTS", "BLOCK_SITES"]

ROOTS = ("embed", "pos_embed", "blocks", "final_norm", "unembed")  # the first segment of every standard name
BLOCK_SITES = ("resid_pre", "resid_mid", "ln1", "attn", "attn.heads", "attn.q", "attn.k", "attn.v", "attn.pattern",
               "ln2", "mlp", "mlp.hidden", "mlp.router")  # blocks.N.<site>; blocks.N itself is the block's output


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
    groups: int = 0  # per_head's parts are inside each of this many groups of heads (CodeGen's), not each head
    skip: int = 0  # positions the model prepends inside (CPM-Ant's prompt): the tokens' are axis 1 after them

    def get(self, t: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The part of t (a view where torch allows it)."""
        t = unflatten(t, batch_shape)
        if self.skip:
            t = t[:, self.skip:]
        if self.per_head is not None:
            which, parts = self.per_head
            t = t.unflatten(-1, (self.groups or self.heads, -1))
            d = t.shape[-1] // parts
            t = t[..., which * d:(which + 1) * d]
            return t.flatten(-2).unflatten(-1, (self.heads, -1)) if self.groups else t
        if self.start or self.stop is not None:
            t = t[..., self.start:self.stop]
        return t.unflatten(-1, (self.heads, -1)) if self.heads else t

    def put(self, t: torch.Tensor, part: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """t with its part replaced by `part` (shaped as get() returns it): a new tensor, t's shape."""
        if self.skip:
            full = unflatten(t, batch_shape).clone()
            full[:, self.skip:] = dataclasses.replace(self, skip=0).put(full[:, self.skip:], part)
            return full.reshape(t.shape)
        shape = t.shape
        full = unflatten(t, batch_shape)
        if self.per_head is not None:
            which, parts = self.per_head
            new = full.unflatten(-1, (self.groups or self.heads, -1)).clone()
            d = new.shape[-1] // parts
            new[..., which * d:(which + 1) * d] = part.flatten(-2).unflatten(-1, (self.groups, -1)) \
                if self.groups else part
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
    scale: float = 1.0  # the site is the module's tensor times this (a write scaled before the residual add:
    # MiniCPM3's residual_scale, Granite's residual_multiplier); put divides by it, so the stream receives `new`
    plus: Optional[nn.Module] = field(default=None, compare=False, repr=False)  # a module the block adds to this
    # one's output, on its input (Granite 4's shared_mlp beside the experts): the site is their sum; an edit makes
    # the module give the new sum less plus's output, so the block's sum is the new value

    @property
    def role(self) -> str:
        """The native role this point reads: output / output.<i> / input.<i> (a tuple output's element)."""
        return f"{self.side}.{self.index}" if self.side == "input" or self.index else self.side

    def get(self, t: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The site's value in the module's tensor t (its view, times `scale`)."""
        got = self.view.get(t, batch_shape) if self.view is not None else unflatten(t, batch_shape)
        return got if self.scale == 1.0 else got * self.scale

    def put(self, t: torch.Tensor, new: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """t with the site's value replaced by `new` (divided by `scale`: what the module must give for it)."""
        new = new if self.scale == 1.0 else new / self.scale
        return self.view.put(t, new, batch_shape) if self.view is not None else new.reshape(t.shape)

    def get_grad(self, g: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The gradient with respect to the site's value from g, the gradient of the module's tensor (the site is
        the tensor times `scale`: g divided by it)."""
        got = self.view.get(g, batch_shape) if self.view is not None else unflatten(g, batch_shape)
        return got if self.scale == 1.0 else got / self.scale

    def put_grad(self, g: torch.Tensor, new: torch.Tensor, batch_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """g with the site's gradient replaced by `new` (the module tensor's gradient: new times `scale`)."""
        new = new if self.scale == 1.0 else new * self.scale
        return self.view.put(g, new, batch_shape) if self.view is not None else new.reshape(g.shape)

    def read(self, args: tuple, kwargs: dict, output=None) -> torch.Tensor:
        """The module's tensor this point reads from a call (the pre-view tensor): output[index] or the input
        (with `plus`: the output plus plus's output on the call's input)."""
        if self.side == "output":
            t = output[self.index] if isinstance(output, (tuple, list)) else output
            return t if self.plus is None else t + self.plus(call_input(args, kwargs))
        return self._input(args, kwargs)

    def read_grad(self, args: tuple, kwargs: dict, output=None) -> torch.Tensor:
        """The tensor of a call whose gradient is the site's (before the view): read()'s, but the module's own output
        where the site adds `plus` to it (the sum's gradient is each term's)."""
        if self.side == "output" and self.plus is not None:
            return output[self.index] if isinstance(output, (tuple, list)) else output
        return self.read(args, kwargs, output)

    def _input(self, args: tuple, kwargs: dict) -> torch.Tensor:
        if len(args) > self.index:
            return args[self.index]
        if "hidden_states" in kwargs:
            return kwargs["hidden_states"]
        return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))

    def write(self, args: tuple, kwargs: dict, output, new: torch.Tensor):
        """The call's (args, kwargs) for an input point, or its output for an output point, with the read tensor
        replaced by `new` (same container types)."""
        if self.side == "output":
            if self.plus is not None:  # the module gives the new sum less what plus adds
                new = new - self.plus(call_input(args, kwargs))
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


SOURCES = ("table", "declared", "inferred")  # where an anatomy's parts came from


@dataclass
class Anatomy:
    """A model's parts by standard name, resolved against its modules and proved on one tiny forward (anatomy(model)
    builds it); a site whose identity did not add up is refused with the reason.

        anat.points(["blocks.*"]); anat.block_modules(0)["attn_out"]; anat.n_layers, anat.n_heads, anat.d_head
        anat.source, anat.proof.worst(), anat.report()   # table | declared | inferred; the check's errors
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
    source: str = "table"  # table | declared | inferred
    final_scale: float = 1.0  # the unembedding reads the final norm's output times this (Inkling's 1 / mup width)
    prefix: int = 0  # positions the model prepends to the tokens inside (CPM-Ant's prompt): sites skip them
    proof: Optional[Proof] = field(repr=False, default=None)  # the check on one tiny forward (None: not yet)

    # -- names ------------------------------------------------------------------------------------------------
    def part(self, name: Optional[str], i: Optional[int] = None) -> Optional[str]:
        """The module name of a part (a block part of block i), None where the model has none."""
        if name is None:
            return None
        full = f"{self.family.blocks}.{i}.{name}" if i is not None else name
        return full if full in self.modules else None

    def block_modules(self, i: int) -> Dict[str, Optional[str]]:
        """Block i's parts: block, ln1, attn, attn_out, q, k, v, qkv, pattern, attn_write, ln2, mlp, mlp_out,
        mlp_write, router, mixer (None where the block has none)."""
        cache = self.__dict__.setdefault("_blocks", {})
        if i not in cache:
            parts = {p: self.part(self.family.block_part(p, i), i) for p in BLOCK_PARTS}
            cache[i] = {"block": f"{self.family.blocks}.{i}", **parts}
        return dict(cache[i])

    def write_scale(self, i: int, part: str) -> float:
        """What block i multiplies attention's ("attn") or the MLP's ("mlp") output by before the residual add: its
        attribute the family's attn_scale / mlp_scale names (MiniCPM3's residual_scale), else 1."""
        name = self.family.block_part(f"{part}_scale", i)
        block = self.modules.get(f"{self.family.blocks}.{i}")
        value = getattr(block, name, None) if name and block is not None else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0

    def heads_of(self, i: int) -> Tuple[int, int, int, int]:
        """Block i's (heads, key-value heads, d_head of attn.heads, d_head of q and k): a block's own where its
        projections differ from the first attention block's (Gemma 4's global layers' wider heads, MiMo's
        sliding-window layers' more key-value heads and narrower values)."""
        cache = self.__dict__.setdefault("_heads", {})
        if i not in cache:
            b = self.block_modules(i)
            attn = self.modules.get(b["attn"]) if b["attn"] else None
            n = getattr(attn, "num_heads", None)  # Laguna's per-layer head counts: the module's own
            n = n if isinstance(n, int) and n > 0 and not isinstance(n, bool) else self.n_heads
            width = width_in(self.modules.get(b["attn_out"])) if b["attn_out"] else None
            d_head = width // n if width and n and width % n == 0 else self.d_head
            own = getattr(attn, "head_dim", None)
            d_qk = own if isinstance(own, int) and own > 0 else d_head
            k = width_out(self.modules.get(b["k"])) if b["k"] else None
            kv = k // d_qk if k and d_qk and k % d_qk == 0 else self.n_kv_heads
            cache[i] = (n, kv, d_head, d_qk)
        return cache[i]

    def embed_modules(self) -> Tuple[Optional[str], Optional[str]]:
        """(the token embedding's write, the position embedding) module names."""
        first = lambda names: next((n for n in names if self.modules.get(n) is not None), None)  # noqa: E731
        return first(self.family.embed), first(self.family.pos_embed)

    def standard_names(self) -> List[str]:
        """Every standard name this model has (and whose check held), in model order."""
        return list(self._standard_names)

    def located_names(self) -> List[str]:
        """Every standard name the model's parts give, before the check (what the proof checks)."""
        return list(self._located_names)

    @functools.cached_property
    def _standard_names(self) -> Tuple[str, ...]:  # once per anatomy (each method's sites ask, every batch)
        return tuple(n for n in self._located_names if self._failed(n) is None)

    @functools.cached_property
    def _located_names(self) -> Tuple[str, ...]:
        embed, pos = self.embed_modules()
        names = (["embed"] if embed else []) + (["pos_embed"] if pos else [])
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
        """The Point of one standard name; AnatomyError naming the name, the architecture and the nearest names
        (or the identity of the anatomy's check that did not add up for it)."""
        found = self.locate(name, key)
        failed = self._failed(name)
        if failed is not None:
            raise self._refuse(name, key, failed)
        return found

    def locate(self, name: str, key: str = "layers") -> Point:
        """The Point of one standard name from the model's parts alone (before the check: what the proof reads)."""
        p = self._locate(name, key)
        if not self.prefix or name == "unembed":  # the unembedding reads the tokens alone
            return p
        view = dataclasses.replace(p.view, skip=self.prefix) if p.view is not None else View(skip=self.prefix)
        return dataclasses.replace(p, view=view)

    def _locate(self, name: str, key: str) -> Point:
        if name == "embed" or name == "pos_embed":
            module = self.embed_modules()[name == "pos_embed"]
            if module is None:
                raise self._refuse(name, key, "it has no learned position embeddings (its positions are rotary or "
                                              "relative)" if name == "pos_embed" else "no token embedding was found")
            return Point(name, module)
        if name in ("final_norm", "unembed"):
            module = self.final_norm_module() if name == "final_norm" else self.unembed_name()
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

    def _failed(self, name: str) -> Optional[str]:
        """Why the anatomy's check refuses a site (None when it held, or for a site it could not check)."""
        return self.proof.failed.get(name) if self.proof is not None else None

    def _block_point(self, name: str, i: int, site: str) -> Point:
        b = self.block_modules(i)
        if site == "resid_pre":
            start = self.part(self.family.start, 0) if i == 0 else None
            return Point(name, start, layer=i) if start else Point(name, b["block"], "input", layer=i)
        if site == "resid_mid":  # the input of what the MLP path reads first: its norm, else the MLP
            return Point(name, b["ln2"] or b["mlp"], "input", layer=i)
        if site in ("ln1", "ln2"):
            return Point(name, b[site], layer=i)
        if site == "attn":
            return Point(name, b["attn_write"] or b["attn"], layer=i, scale=self.write_scale(i, "attn"))
        if site == "mlp":
            return Point(name, b["mlp_write"] or b["mlp"], layer=i, scale=self.write_scale(i, "mlp"),
                         plus=self.modules[b["mlp_plus"]] if b["mlp_plus"] else None)
        if site == "mlp.hidden":
            return Point(name, b["mlp_out"], "input", layer=i)
        if site == "mlp.router":
            return Point(name, b["router"], index=self.family.block_part("router_index", i), layer=i)
        n_heads, n_kv, d_head, _ = self.heads_of(i)
        if site == "attn.heads":
            return Point(name, b["attn_out"], "input", view=View(n_heads), layer=i, heads=n_heads)
        if site == "attn.pattern":
            if b["pattern"] is not None:
                return Point(name, b["pattern"], layer=i, heads=self.n_heads)
            return Point(name, b["attn"], index=1, layer=i, heads=self.n_heads)
        which = "qkv".index(site[-1])
        heads = n_heads if which == 0 else n_kv
        parts = self.family.block_part("q_parts", i) if which == 0 else 1
        if b[site[-1]] is not None:
            return Point(name, b[site[-1]], view=View(heads, per_head=(0, parts)) if parts > 1 else View(heads),
                         layer=i, heads=heads)
        layout = self.family.block_part("qkv_layout", i)
        if layout == "per_head":
            return Point(name, b["qkv"], view=View(n_heads, per_head=(which, 3)), layer=i, heads=heads)
        if layout.startswith("groups:"):  # CodeGen's [groups, (q | v | k)] of heads side by side
            groups = int(layout.split(":")[1])
            return Point(name, b["qkv"], view=View(n_heads, per_head=((0, 2, 1)[which], 3), groups=groups), layer=i,
                         heads=heads)
        q, kv = n_heads * d_head, n_kv * d_head
        start, stop = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][which]
        return Point(name, b["qkv"], view=View(heads, start, stop), layer=i, heads=heads)

    def layers_with(self, part: str) -> List[int]:
        """The blocks that have a part (attn, mlp, router, ...): a hybrid's attention is on some of them."""
        return [i for i in range(self.n_layers) if self.block_modules(i)[part] is not None]

    def _lacks(self, site: str, i: int) -> Optional[str]:
        """Why block i has no `site` (None when it has it)."""
        b = self.block_modules(i)
        if site == "resid_mid" and self.parallel:
            return (f"its blocks are parallel ({self.arch}: attention and the MLP both read the block's input), so "
                    "there is no residual stream between them; use blocks.N.resid_pre or blocks.N")
        if (site == "attn" or site.startswith("attn.")) and b["attn"] is None:
            having = self.layers_with("attn")
            mixer = f" (its token mixer is {b['mixer']}, {type(self.modules[b['mixer']]).__name__})" \
                if b["mixer"] else ""
            return (f"block {i} has no attention{mixer}; attention is on blocks {_spans(having)}"
                    if having else "it has no attention module (model.anatomy.attn names one)")
        if site == "mlp.router" and b["router"] is None:
            having = self.layers_with("router")
            return (f"block {i}'s MLP is no mixture of experts; the router is on blocks {_spans(having)}"
                    if having else "its MLP is no mixture of experts (model.anatomy.router names a router)")
        if site == "mlp.hidden" and b["mlp_out"] is None and b["router"] is not None:
            fused = any(p.dim() == 3 for p in self.modules[b["mlp"]].parameters())
            return ("its MLP is a mixture of experts whose experts are fused (one weight tensor for all of them), "
                    "so there is no one hidden layer to read" if fused else
                    "its MLP is a mixture of experts: each token's hidden layer is its chosen experts'") + \
                "; use blocks.N.mlp (the mixture's output) or blocks.N.mlp.router (the router's logits)"
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
        if site == "attn.pattern" and self.prefix:
            return (f"its attention also reads the {self.prefix} positions it prepends to the tokens "
                    f"({self.family.prefix}), so no [B, heads, T, T] pattern holds a token's attention")
        if site == "attn.pattern" and not self.eager and b["pattern"] is None:
            return ("its attention implementation returns no probabilities; load it with attn_implementation=eager "
                    "(model.attn_implementation=eager, or from_pretrained(..., attn_implementation='eager'))")
        return None

    def _refuse(self, name: str, key: str, why: str) -> AnatomyError:
        near = suggest(name, self.standard_names())
        return AnatomyError(f"{key}: {name!r} is not a site of {self.model_class} ({self.arch}): {why}{near}")

    def final_norm_module(self) -> Optional[str]:
        """The final norm's module name, None where the model has none."""
        return self.part(self.family.final_norm)

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
        return [(p.name, p.module, p.role + (" (split by head)" if p.view is not None and p.view.heads else ""))
                for p in (self.point(n) for n in self.standard_names())]

    def report(self) -> List[dict]:
        """Every site the parts give, checked or refused: name, module, role, source (table | declared | inferred),
        error (the check's worst relative error over the identities the site is in; None: not checked) and refused
        (why, or None): inspect=true's columns.

            [r for r in hookrun.anatomy(model).report() if r["refused"]]
        """
        proof = self.proof or Proof()
        rows = []
        for n in self.located_names():
            p = self.locate(n)
            split = " (split by head)" if p.view is not None and p.view.heads else ""
            rows.append(dict(name=n, module=p.module, role=p.role + split, source=self.source,
                             error=proof.errors.get(n), refused=proof.failed.get(n)))
        return rows


def _spans(layers: Sequence[int]) -> str:
    """Block numbers as ranges: [0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for j, n in enumerate(layers):
        if start is None:
            start = n
        if j + 1 == len(layers) or layers[j + 1] != n + 1:
            out.append(f"{start}-{n}" if n > start else f"{n}")
            start = None
    return ", ".join(out)


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


def example(model: nn.Module) -> str:
    """A `model.anatomy` declaration built from the model's own modules (its longest text ModuleList as the blocks,
    its input embedding, its last norm outside the blocks, block 0's attention-like and MLP-like children): the
    example an unknown architecture's refusal offers.

        example(falcon)   # '{blocks: transformer.h, embed: transformer.word_embeddings, attn: self_attention, ...}'
    """
    config = _config(model)
    modules = dict(model.named_modules())
    blocks = find_blocks(model, config) if config is not None else None
    if blocks is None:
        lists = [(len(m), n) for n, m in modules.items() if isinstance(m, nn.ModuleList) and len(m) and
                 not NOT_TEXT.search(n)]
        blocks = max(lists, key=lambda x: (x[0], -len(x[1])))[1] if lists else "model.layers"
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        emb = None
    embed = next((n for n, m in modules.items() if m is emb and n), None) or next(
        (n for n, m in modules.items() if isinstance(m, nn.Embedding) and not n.startswith(blocks + ".")), "embed")
    kids = [(n[len(blocks) + 3:], type(m).__name__) for n, m in modules.items() if n.startswith(blocks + ".0.")
            and "." not in n[len(blocks) + 3:]]
    attn = next((n for n, c in kids if ATTENTION.search(n) or ATTENTION.search(c)), "attn")
    mlp = next((n for n, c in kids if n != attn and (MLP.search(n) or MLP.search(c))), "mlp")
    norms = [n for n, m in modules.items() if n and not n.startswith(blocks + ".") and "norm" in type(m).__name__.lower()
             + n.lower()]
    final = f", final_norm: {norms[-1]}" if norms else ""
    return f"{{blocks: {blocks}, embed: {embed}, attn: {attn}, mlp: {mlp}{final}}}"


def _unknown(model: nn.Module, why: str) -> AnatomyError:
    """The refusal of an architecture hookrun cannot find the parts of: why, an example declaration from its own
    modules, its top-level modules."""
    return AnatomyError(f"model.anatomy: {type(model).__name__} (model_type {model_type(model)!r}) is not an "
                        f"architecture hookrun knows ({why}); declare its parts, e.g. model.anatomy: "
                        f"{example(model)} (block parts relative to a block; docs/anatomy.md). Its top-level "
                        f"modules: {_top_levels(model)}")


def before_load(path: str, declared_parts: Optional[Mapping] = None) -> Optional[str]:
    """Why a Hugging Face folder's model has no anatomy, from its config.json alone (the model built on the meta
    device: its module tree, no weights), before the weights load; None where it has a table, a declaration, or
    blocks inference can start from (its check then runs on the loaded model).

        before_load("runs/my-model")   # None, or the refusal naming model.anatomy with an example
    """
    if declared_parts:
        return None
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        text = getattr(config, "text_config", None) or config
        if getattr(text, "model_type", None) in FAMILIES:
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - a config transformers cannot build: from_pretrained says why, as before
        return None
    if layer_count(text) is None:
        return str(_unknown(model, "no table, and no config naming its number of layers to infer it from"))
    if find_blocks(model, text) is None:
        return str(_unknown(model, f"no table, and no ModuleList of its {layer_count(text)} layers "
                                   f"(num_hidden_layers) to infer it from"))
    return None


def _top_levels(model: nn.Module, depth: int = 2) -> str:
    names = [n for n, _ in model.named_modules() if n and n.count(".") < depth]
    return ", ".join(names[:30]) + (" ..." if len(names) > 30 else "")


_CACHE: "weakref.WeakKeyDictionary[nn.Module, Union[Anatomy, AnatomyError]]" = weakref.WeakKeyDictionary()


def anatomy(model: nn.Module, declared_parts: Optional[Mapping] = None) -> Anatomy:
    """The model's anatomy, proved on one tiny forward: `declared_parts` (model.anatomy in YAML, which wins and is
    remembered for the model), else its family's table (by config.model_type), else inferred from its module tree
    and config (a Hugging Face model of any other family). AnatomyError, once per model, where none can be found,
    naming the key to add and the module tree's top levels. Found once per model (cached weakly): every method asks
    here.

        anatomy(gpt2).point("blocks.0.attn").module == "transformer.h.0.attn"
    """
    cached = _CACHE.get(model)
    if cached is not None and not declared_parts:
        if isinstance(cached, AnatomyError):
            raise cached
        return cached
    try:
        found = _find(model, declared_parts)
    except AnatomyError as err:
        if not declared_parts:
            _CACHE[model] = err
        raise
    _CACHE[model] = found
    return found


def _find(model: nn.Module, declared_parts: Optional[Mapping]) -> Anatomy:
    mtype = model_type(model)
    cls = type(model).__name__
    config = _config(model)
    seen: Optional[Trace] = None
    if declared_parts:
        family, arch, source = declared(declared_parts), "declared", "declared"
    elif mtype in FAMILIES:
        family, arch, source = _rebased(model, config, FAMILIES[mtype]), mtype, "table"
    elif mtype is not None and layer_count(config) is not None:
        seen = trace(model)
        try:
            family, arch, source = infer(model, config, seen), mtype, "inferred"
        except AnatomyError as err:  # what inference could not find, and a declaration from the model's modules
            raise AnatomyError(f"{err}; or declare every part, e.g. model.anatomy: {example(model)}") from None
    else:
        raise _unknown(model, "no table, and no config naming its number of layers to infer it from")
    if family.embed_times:  # a config attribute the embedding is scaled by (Granite's embedding_multiplier)
        family = dataclasses.replace(family, embed_scale=float(setting(config, family.embed_times, 1.0)))
    anat = _build(model, config, family, arch, source)
    seen = seen if seen is not None else trace(model)
    anat.proof = check(anat, seen)
    if source == "inferred":
        anat = _prove_layout(model, config, anat, seen)
        if anat.proof.error is not None:
            raise AnatomyError(f"model.anatomy: {cls} ({mtype}) has no table, and its inferred anatomy could not be "
                               f"checked: {anat.proof.error}; declare its parts, e.g. model.anatomy: {example(model)}")
    anat.__dict__.pop("_standard_names", None)
    return anat


def _rebased(model: nn.Module, config, family: Family) -> Family:
    """A table's family with its top-level names moved to where the model keeps its text stack: a multimodal
    wrapper's (Gemma3ForConditionalGeneration: model.language_model.layers for the table's model.layers)."""
    modules = dict(model.named_modules())
    if family.blocks in modules:
        return family
    found = find_blocks(model, config)
    if found is None or found.rsplit(".", 1)[-1] != family.blocks.rsplit(".", 1)[-1]:
        return family
    old, new = family.blocks.rsplit(".", 1)[0] + ".", found.rsplit(".", 1)[0] + "."
    move = lambda name: new + name[len(old):] if name and name.startswith(old) else name  # noqa: E731
    return dataclasses.replace(family, blocks=found, embed=tuple(map(move, family.embed)),
                               pos_embed=tuple(map(move, family.pos_embed)), final_norm=move(family.final_norm),
                               post=tuple(map(move, family.post)), unembed=move(family.unembed))


def _prove_layout(model: nn.Module, config, anat: Anatomy, seen: Trace) -> Anatomy:
    """An inferred fused q/k/v projection's layout: [q | k | v] unless [heads, 3, d_head] is the one the check
    proves (pattern @ v == heads)."""
    if anat.family.qkv is None or not any(k.endswith(".attn.v") for k in anat.proof.failed):
        return anat
    other = _build(model, config, dataclasses.replace(anat.family, qkv_layout="per_head"), anat.arch, anat.source)
    other.proof = check(other, seen)
    return other if len(other.proof.failed) < len(anat.proof.failed) else anat


def _build(model: nn.Module, config, family: Family, arch: str, source: str) -> Anatomy:
    """The Anatomy of a family's parts against the model's modules (the counts from its config and projections)."""
    cls = type(model).__name__
    modules = {n: m for n, m in model.named_modules() if n}
    blocks = modules.get(family.blocks)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise AnatomyError(f"model.anatomy.blocks: {family.blocks!r} is not a ModuleList of {cls}"
                           f"{suggest(family.blocks, [n for n in modules if n])}; its top-level modules: "
                           f"{_top_levels(model)}")
    own = lambda part, i: family.block_part(part, i)  # noqa: E731
    having = [i for i in range(len(blocks)) if own("attn", i) and f"{family.blocks}.{i}.{own('attn', i)}" in modules]
    for part in ("attn", "mlp"):
        name = getattr(family, part)
        if name is None or family.layers or (part == "attn" and (having or family.mixer)):
            continue
        if not any(f"{family.blocks}.{i}.{name}" in modules for i in range(len(blocks))):
            raise AnatomyError(f"model.anatomy.{part}: {name!r} is no module of block 0 ({family.blocks}.0)"
                               f"{suggest(name, _children(modules, family.blocks + '.0'))}")
    parallel = family.parallel
    parallel = bool(setting(config, parallel, False)) if isinstance(parallel, str) else bool(parallel)
    n_heads = count(config, "num_attention_heads", "n_head", "num_heads") or 0
    d_head = count(config, "head_dim") or 0
    at = having[0] if having else 0
    first = f"{family.blocks}.{at}."
    proj = modules.get(first + own("attn_out", at)) if own("attn_out", at) else None
    width = width_in(proj)
    if width and n_heads:
        d_head = width // n_heads
    n_kv = _kv_heads(modules, first, family, at, n_heads, d_head) or count(config, "num_key_value_heads",
                                                                           "multi_query_group_num") or n_heads
    impl = setting(config, "_attn_implementation") or "eager"
    scale = float(setting(config, family.logits_times, 1.0)) if family.logits_times else 1.0
    scale /= float(setting(config, family.logits_over, 1.0)) if family.logits_over else 1.0
    cap = next((setting(config, n) for n in SOFTCAPS if isinstance(setting(config, n), (int, float))
                and setting(config, n)), None)
    final = float(setting(config, family.final_times, 1.0)) if family.final_times else 1.0
    final /= float(setting(config, family.final_over, 1.0)) if family.final_over else 1.0
    prefix = count(config, family.prefix) if family.prefix else None
    return Anatomy(cls, arch, family, modules, weakref.ref(model), len(blocks), n_heads, n_kv, d_head, parallel,
                   impl == "eager", scale, float(cap) if cap else None, source, final, prefix=prefix or 0)


def _kv_heads(modules, first: str, family: Family, at: int, n_heads: int, d_head: int) -> Optional[int]:
    """The key-value heads a config does not name, from block `at`'s projections' widths (GPT-BigCode's
    multi-query)."""
    if not d_head:
        return None
    k = modules.get(first + family.block_part("k", at)) if family.block_part("k", at) else None
    if k is not None and getattr(k, "out_features", None):
        return k.out_features // d_head
    fused = modules.get(first + family.block_part("qkv", at)) if family.block_part("qkv", at) else None
    width = getattr(fused, "out_features", None)
    if width and family.block_part("qkv_layout", at) == "concat" and (width - n_heads * d_head) % (2 * d_head) == 0:
        return (width - n_heads * d_head) // (2 * d_head) or None
    return None


def _children(modules: Mapping[str, nn.Module], prefix: str) -> List[str]:
    return [n[len(prefix) + 1:] for n in modules if n.startswith(prefix + ".")]
