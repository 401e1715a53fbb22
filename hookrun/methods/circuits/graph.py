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
per key-value head, `a{L}.kv{G}<k>`), every MLP's input `m{L}` (through its norm) and `logits` (the final norm's
input). An edge u -> v for every sender upstream of the receiver: an earlier layer, or attention -> MLP of the same
layer in sequential blocks (not in parallel-attention blocks).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from hookrun.capture.anatomy import Anatomy, AnatomyError, Point, anatomy

KINDS = ("q", "k", "v", "mlp", "logits")  # the receivers' kinds: a head's three inputs, an MLP's input, the logits


class GraphError(ValueError):
    """A model whose graph cannot be built, or a circuit that is not in the graph; `key` names the config key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


@dataclass(frozen=True)
class Sender:
    """A node whose output is added to the residual stream: input, a head, an MLP."""

    name: str  # input | a{L}.h{H} | m{L}
    kind: str  # input | head | mlp
    layer: int  # -1 for input
    head: Optional[int] = None


@dataclass(frozen=True)
class Receiver:
    """A node input that reads the residual stream along its own path: a head's q/k/v, an MLP, the logits."""

    name: str  # a{L}.h{H}<q> | a{L}.kv{G}<k> | m{L} | logits
    kind: str  # q | k | v | mlp | logits
    layer: int  # n_layers for logits
    head: Optional[int] = None  # the head (q) or key-value head (k, v) of the projection's view
    node: str = ""  # the node it feeds: a{L}.h{H} (a key-value receiver: the group's first head), m{L}, logits
    heads: tuple = ()  # the head nodes it feeds (a key-value head feeds its group)


@dataclass
class Graph:
    """Senders, receivers and the edges of one model (circuit_graph builds it); edge e is sender edge_s[e] ->
    receiver edge_r[e], `mask` [senders, receivers] is True on the edges."""

    anat: Optional[Anatomy] = field(repr=False)  # None: rebuilt from its shape by a reader (no model)
    senders: List[Sender]
    receivers: List[Receiver]
    mask: torch.Tensor  # [S, R] bool
    edge_s: torch.Tensor  # [E] long: the sender of each edge
    edge_r: torch.Tensor  # [E] long: the receiver of each edge
    edges: pd.DataFrame  # name, sender, receiver, kind, node, sender_layer, receiver_layer, sender_head, receiver_head
    n_layers: int = 0
    model_class: str = ""

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
                near = difflib.get_close_matches(n, list(where), n=3, cutoff=0.5)
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
        receivers = set(self.edges["receiver"]) | set(r.node for r in self.receivers)
        for name, known, what in ((exclude_from, senders, "sender"), (exclude_into, receivers, "receiver")):
            bad = [n for n in name if n not in known]
            if bad:
                near = difflib.get_close_matches(bad[0], sorted(known), n=3, cutoff=0.5)
                raise GraphError(f"{key}.but_{'from' if what == 'sender' else 'into'}",
                                 f"{key}: {bad[0]!r} is not a {what} of the graph"
                                 f"{'; nearest: ' + ', '.join(near) if near else ''}")
        if exclude_from:
            mask &= ~torch.as_tensor(self.edges["sender"].isin(list(exclude_from)).to_numpy(copy=True))
        if exclude_into:
            hit = self.edges["receiver"].isin(list(exclude_into)) | self.edges["node"].isin(list(exclude_into))
            mask &= ~torch.as_tensor(hit.to_numpy(copy=True))
        return mask

    def receivers_of(self, layer: int) -> List[int]:
        return [i for i, r in enumerate(self.receivers) if r.layer == layer]

    def point(self, r: Receiver) -> Point:
        """The anatomy Point of a head receiver's projection (blocks.L.attn.q|k|v)."""
        return self.anat.point(f"blocks.{r.layer}.attn.{r.kind}")


def circuit_graph(model: nn.Module, anat: Optional[Anatomy] = None, key: str = "circuit") -> Graph:
    """The graph of a model (see the module's docstring); GraphError for an architecture whose heads or MLPs are
    not linear senders (a norm after attention or the MLP: Gemma 2/3, OLMo 2) or that lacks a part it needs."""
    anat = anat or anatomy(model)
    fam = anat.family
    why = None
    if fam.attn_write or fam.mlp_write:
        why = ("a norm after attention or the MLP (post-norm: its attn_write / mlp_write) rescales what the heads and "
               "MLPs write, so their outputs are not summed into the residual stream and cannot be edges' senders")
    elif not anat.n_heads or anat.block_modules(0)["attn_out"] is None:
        why = "it has no attention output projection split by head (model.anatomy.attn_out names one)"
    elif anat.block_modules(0)["ln1"] is None:
        why = "it has no norm before attention (model.anatomy.ln1 names one)"
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
    return graph


def graph_of_shape(L: int, H: int, KV: int, parallel: bool, has_mlp: bool, model_class: str = "") -> Graph:
    """The graph of `L` blocks of `H` heads (`KV` key-value heads), parallel or sequential, with or without MLPs:
    what circuit_graph builds, and what a reader rebuilds from the stored shape."""
    gqa = KV != H
    senders = [Sender("input", "input", -1)]
    receivers: List[Receiver] = []
    for i in range(L):
        senders += [Sender(f"a{i}.h{h}", "head", i, h) for h in range(H)]
        for kind in "qkv":
            n = H if kind == "q" else KV
            for h in range(n):
                if kind != "q" and gqa:
                    group = tuple(range(h * (H // KV), (h + 1) * (H // KV)))
                    receivers.append(Receiver(f"a{i}.kv{h}<{kind}>", kind, i, h, f"a{i}.h{group[0]}",
                                              tuple(f"a{i}.h{g}" for g in group)))
                else:
                    receivers.append(Receiver(f"a{i}.h{h}<{kind}>", kind, i, h, f"a{i}.h{h}", (f"a{i}.h{h}",)))
        if has_mlp:
            senders.append(Sender(f"m{i}", "mlp", i))
            receivers.append(Receiver(f"m{i}", "mlp", i, None, f"m{i}", ()))
    receivers.append(Receiver("logits", "logits", L, None, "logits", ()))
    s_layer = torch.tensor([s.layer for s in senders])
    r_layer = torch.tensor([r.layer for r in receivers])
    mask = s_layer[:, None] < r_layer[None, :]
    if not parallel:  # attention -> the MLP of the same layer
        same = (s_layer[:, None] == r_layer[None, :])
        heads = torch.tensor([s.kind == "head" for s in senders])
        mlps = torch.tensor([r.kind == "mlp" for r in receivers])
        mask |= same & heads[:, None] & mlps[None, :]
    er, es = mask.t().nonzero(as_tuple=True)  # receiver-major: edges into logits last
    rows = []
    for s, r in zip(es.tolist(), er.tolist()):
        snd, rcv = senders[s], receivers[r]
        rows.append((f"{snd.name}->{rcv.name}", snd.name, rcv.name, rcv.kind, rcv.node, snd.layer, rcv.layer,
                     -1 if snd.head is None else snd.head, -1 if rcv.head is None else rcv.head))
    edges = pd.DataFrame(rows, columns=["name", "sender", "receiver", "kind", "node", "sender_layer",
                                        "receiver_layer", "sender_head", "receiver_head"])
    return Graph(None, senders, receivers, mask, es, er, edges, L, model_class)


def to_networkx(graph: Graph, mask: Optional[torch.Tensor] = None, scores: Optional[np.ndarray] = None):
    """The graph (or a circuit of it) as a networkx MultiDiGraph over nodes input, a{L}.h{H}, m{L}, logits: an
    edge per graph edge (key: its kind q/k/v/mlp/logits; attrs name, receiver, score), node attrs layer and kind."""
    import networkx as nx
    g = nx.MultiDiGraph()
    for s in graph.senders:
        g.add_node(s.name, layer=s.layer, kind=s.kind, head=-1 if s.head is None else s.head)
    g.add_node("logits", layer=graph.n_layers, kind="logits", head=-1)
    keep = np.ones(len(graph), bool) if mask is None else np.asarray(mask, bool)
    for e, row in enumerate(graph.edges.itertuples(index=False)):
        if keep[e]:
            r = graph.receivers[int(graph.edge_r[e])]
            for node in r.heads or (row.node,):
                g.add_edge(row.sender, node, key=row.kind, name=row.name, receiver=row.receiver,
                           score=float("nan") if scores is None else float(scores[e]))
    return g
