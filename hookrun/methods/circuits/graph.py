"""The computational graph of a transformer for circuit discovery: senders, receivers and the edges between them,
found from the model's anatomy (hookrun.capture.anatomy).

    g = circuit_graph(model)                 # g.senders, g.receivers, g.edges (a DataFrame), len(g) edges
    g.edges.head()                           # name, sender, receiver, kind (q|k|v|mlp|logits), layers, heads
    mask = g.circuit(["input->a1.h0<k>", "a0.h2->a1.h0<k>"])    # a boolean circuit over g.edges
    mask = g.circuit(exclude_from=["a0.h1"])                     # every edge but those out of a0.h1

Senders: `input` (the residual stream into block 0: embeddings as added), every head `a{L}.h{H}` (its output
through its slice of the output projection, the projection's bias left out: it is the same in every run) and every
MLP `m{L}` (its output). Receivers: every head's `q`, `k` and `v` input `a{L}.h{H}<q>` (the residual stream read
through that head's path only, the layer's norm included; under grouped-query attention the k and v receivers are
per key-value head, `a{L}.kv{G}<k>`; OLMo 2: the raw stream, q and k through the full projection and its norm over
all heads, Graph.proj_norms), every MLP's input `m{L}` (through its norm) and `logits` (the final norm's input).
An edge u -> v for every sender upstream of the receiver: an earlier layer, or attention -> MLP of the same
layer in sequential blocks (not in parallel-attention blocks).
"""
from __future__ import annotations

import difflib
import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from hookrun.capture.anatomy import Anatomy, AnatomyError, Point, anatomy
from hookrun.read.results.graph import CircuitGraph, Receiver, Sender

KINDS = ("q", "k", "v", "mlp", "logits")  # the receivers' kinds: a head's three inputs, an MLP's input, the logits


class GraphError(ValueError):
    """A model whose graph cannot be built, or a circuit that is not in the graph; `key` names the config key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


@dataclass
class Graph:
    """Senders, receivers and the edges of one model (circuit_graph builds it); edge e is sender edge_s[e] ->
    receiver edge_r[e], `mask` [senders, receivers] is True on the edges."""

    anat: Optional[Anatomy] = field(repr=False)  # None: built from a shape alone (graph_of_shape, no model)
    senders: List[Sender]
    receivers: List[Receiver]
    mask: torch.Tensor  # [S, R] bool
    edge_s: torch.Tensor  # [E] long: the sender of each edge
    edge_r: torch.Tensor  # [E] long: the receiver of each edge
    edges: pd.DataFrame  # name, sender, receiver, kind, node, sender_layer, receiver_layer, sender_head, receiver_head
    n_layers: int = 0
    model_class: str = ""
    points: dict = field(default_factory=dict, repr=False, compare=False)  # point()'s, once a projection
    proj_norms: dict = field(default_factory=dict, repr=False, compare=False)  # {(layer, q|k): a norm over the
    # whole projection after it (OLMo 2's q_norm / k_norm): a head's q / k receiver is that norm's output}

    def __len__(self) -> int:
        return len(self.edge_s)

    @property
    def names(self) -> List[str]:
        return list(self.edges["name"])

    def index(self, names: Iterable[str], key: str = "circuit.edges") -> List[int]:
        """The edges' positions; GraphError naming an edge that is not in the graph and the nearest ones."""
        where = {n: i for i, n in enumerate(self.edges["name"])}
        out, problems = [], []
        for n in names:
            n = str(n).replace(" ", "")
            if n in where:
                out.append(where[n])
            else:
                own = self._own_group(n)
                near = [own] if own in where else difflib.get_close_matches(n, list(where), n=3, cutoff=0.5)
                problems.append(f"{key}: {n!r} is not an edge of the graph ({len(where)} edges of {self.model_class}"
                                f"){'; nearest: ' + ', '.join(near) if near else ''}; edges are written "
                                "'sender->receiver', e.g. 'a0.h1->a1.h0<k>', 'input->m0', 'm1->logits'")
        if problems:
            raise GraphError(key, "; ".join(problems))
        return out

    def names_of(self, mask) -> List[str]:
        """The edge names of a circuit (a boolean mask), in graph order."""
        return [n for n, keep in zip(self.edges["name"], np.asarray(mask, bool)) if keep]

    def nodes(self) -> List[str]:
        """Every node name: input, heads, MLPs, logits (receivers' q/k/v inputs belong to their head)."""
        return [s.name for s in self.senders] + ["logits"]

    def circuit(self, edges: Optional[Sequence[str]] = None, exclude_from: Sequence[str] = (),
                exclude_into: Sequence[str] = (), key: str = "circuit.circuits") -> torch.Tensor:
        """A circuit as a boolean mask [E]: the listed edges, or (edges None) every edge but those out of the nodes
        `exclude_from` and into the nodes or receivers `exclude_into`."""
        if edges is not None:
            mask = torch.zeros(len(self), dtype=torch.bool)
            mask[self.index(edges, f"{key}.edges")] = True
        else:
            mask = torch.ones(len(self), dtype=torch.bool)
        senders = set(self.edges["sender"])
        feeds = self.inputs_of_nodes()
        receivers = set(self.edges["receiver"]) | set(feeds)
        for name, known, what in ((exclude_from, senders, "sender"), (exclude_into, receivers, "receiver")):
            bad = [n for n in name if n not in known]
            if bad:
                own = self._own_group(bad[0])
                near = [own] if own in known else difflib.get_close_matches(bad[0], sorted(known), n=3, cutoff=0.5)
                raise GraphError(f"{key}.but_{'from' if what == 'sender' else 'into'}",
                                 f"{key}: {bad[0]!r} is not a {what} of the graph"
                                 f"{'; nearest: ' + ', '.join(near) if near else ''}")
        if exclude_from:
            mask &= ~torch.as_tensor(self.edges["sender"].isin(list(exclude_from)).to_numpy(copy=True))
        if exclude_into:
            into = {r for n in exclude_into for r in feeds.get(n, [n])}
            mask &= ~torch.as_tensor(self.edges["receiver"].isin(sorted(into)).to_numpy(copy=True))
        return mask

    def inputs_of_nodes(self) -> dict:
        """{node: its receivers}: a head's q, k and v (under grouped-query attention the k and v of its key-value
        group, the same for every head of the group), an MLP's input, the logits."""
        out: dict = {}
        for r in self.receivers:
            for node in (r.heads or (r.node,)):
                out.setdefault(node, []).append(r.name)
        return out

    def _own_group(self, name: str) -> Optional[str]:
        """A head's k / v receiver named per head (a{L}.h{H}<k>, or an edge into it) under grouped-query attention:
        the same name with its own key-value group's receiver (a{L}.kv{G}<k>); else None."""
        sender, arrow, rec = name.rpartition("->")
        for r in self.receivers:
            if r.kind in "kv" and rec in {f"{h}<{r.kind}>" for h in r.heads}:
                return f"{sender}{arrow}{r.name}"
        return None

    def receivers_of(self, layer: int) -> List[int]:
        return [i for i, r in enumerate(self.receivers) if r.layer == layer]

    def data(self) -> CircuitGraph:
        """The graph as data, without the model: what a run stores (`.stored()`) and a reader reads back."""
        return CircuitGraph(self.senders, self.receivers, self.edge_s.numpy(), self.edge_r.numpy(), self.edges,
                            self.n_layers, self.model_class)

    def post_norms(self) -> dict:
        """{layer: the module after that layer's attention whose output reaches the stream} (post-norm blocks: Gemma
        2/3; a head's sender is then its output before that norm, its edges passing the norm)."""
        if self.anat is None:
            return {}
        out = {layer: self.anat.block_modules(layer)["attn_write"] for layer in range(self.n_layers)}
        return {layer: m for layer, m in out.items() if m}

    def point(self, r: Receiver) -> Point:
        """The anatomy Point of a head receiver's projection (blocks.L.attn.q|k|v), or of the norm over the whole
        projection after it (OLMo 2's q_norm, k_norm: Graph.proj_norms), viewed by head the same way."""
        key = (r.layer, r.kind)
        if key not in self.points:  # (anatomy.point resolves the module tree: ~0.1 ms, for every receiver a batch)
            p = self.anat.point(f"blocks.{r.layer}.attn.{r.kind}")
            norm = self.proj_norms.get(key)
            self.points[key] = dataclasses.replace(p, module=norm[0]) if norm else p
        return self.points[key]

    def stream_module(self, layer: int) -> str:
        """The module whose input is the stream a layer's heads read (its norm before attention; none: OLMo 2, the
        attention module itself, the heads reading the raw stream)."""
        b = self.anat.block_modules(layer)
        return b["ln1"] or b["attn"]


def circuit_graph(model: nn.Module, anat: Optional[Anatomy] = None, key: str = "circuit") -> Graph:
    """The graph of a model (see the module's docstring); GraphError for an architecture that lacks a part it needs.
    Post-norm blocks (Gemma 2/3, OLMo 2): a head's sender is its output before the norm after attention
    (Graph.post_norms), an MLP's the norm's output (what reaches the stream); OLMo 2's receivers read the raw stream,
    its q / k through the norm over the whole projection (Graph.proj_norms)."""
    anat = anat or anatomy(model)
    fam = anat.family
    why = None
    if not anat.n_heads or anat.block_modules(0)["attn_out"] is None:
        why = "it has no attention output projection split by head (model.anatomy.attn_out names one)"
    elif anat.prefix:
        why = (f"it prepends {anat.prefix} positions to the tokens inside ({fam.prefix}): its modules' tensors are not "
               "the tokens' rows")
    elif anat.block_modules(0)["ln1"] is None and (not fam.attn_write or anat.parallel):
        why = ("it has no norm before attention (model.anatomy.ln1 names one), and it is no post-norm block whose "
               "heads read the raw stream (OLMo 2)")
    if why:
        raise GraphError(key, f"{key}: {anat.model_class} ({anat.arch}) has no circuit graph: {why}")
    try:
        for site in ("attn.q", "attn.k", "attn.v"):
            anat.point(f"blocks.0.{site}", key)
    except AnatomyError as err:
        raise GraphError(key, str(err)) from None
    graph = graph_of_shape(anat.n_layers, anat.n_heads, anat.n_kv_heads, anat.parallel,
                           anat.block_modules(0)["mlp"] is not None, anat.model_class)
    graph.anat = anat
    graph.proj_norms = projection_norms(model, anat)
    return graph


def projection_norms(model: nn.Module, anat: Anatomy) -> dict:
    """{(layer, q|k): (norm, projection)}: module names of a norm the attention applies to the whole q (k)
    projection before splitting it by head (OLMo 2's q_norm, k_norm: its weight as wide as the projection's output;
    a per-head norm, Qwen 3's and Gemma 3's, is left out: a head's slice of the projection is all it reads)."""
    mods, out = dict(model.named_modules()), {}
    for layer in range(anat.n_layers):
        b = anat.block_modules(layer)
        for kind in "qk":
            name = f"{b['attn']}.{kind}_norm"
            norm, proj = mods.get(name), mods.get(b[kind]) if b[kind] else None
            w_norm, w_proj = getattr(norm, "weight", None), getattr(proj, "weight", None)
            if isinstance(w_norm, torch.Tensor) and isinstance(w_proj, torch.Tensor) and \
                    w_norm.numel() == w_proj.shape[0]:
                out[(layer, kind)] = (name, b[kind])
    return out


def graph_of_shape(L: int, H: int, KV: int, parallel: bool, has_mlp: bool, model_class: str = "") -> Graph:
    """The graph of `L` blocks of `H` heads (`KV` key-value heads), parallel or sequential, with or without MLPs, laid
    out by hookrun.read.results.graph.layout: what circuit_graph builds."""
    g = CircuitGraph.of_shape(L, H, KV, parallel, has_mlp, model_class)
    es, er = torch.from_numpy(g.edge_s), torch.from_numpy(g.edge_r)
    mask = torch.zeros((len(g.senders), len(g.receivers)), dtype=torch.bool)
    mask[es, er] = True
    return Graph(None, g.senders, g.receivers, mask, es, er, g.edges, L, model_class)
