"""A circuit's graph as data, with no torch: its senders, receivers and edges as a run stores them (the `circuit`
root attr's `graph`) and as a reader reads them back, the layout of a transformer's graph from its shape, and the
networkx view. hookrun.methods.circuits.graph builds a model's graph on this layout (with torch, for the run).

    senders, receivers, edge_s, edge_r = layout(2, 4, 4, parallel=False, has_mlp=True)
    g = CircuitGraph.of(senders, receivers, edge_s, edge_r, n_layers=2)   # g.edges: name, sender, receiver, kind, ...
    attrs = g.stored()                          # senders, receivers, edge_names: what the run's attrs hold
    g = CircuitGraph.from_attrs(shape_attrs)    # read back as stored (a store before them: rebuilt from the shape)
    net = g.to_networkx(mask, scores)           # a networkx MultiDiGraph of the graph or a circuit of it
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

EDGE_COLUMNS = ["name", "sender", "receiver", "kind", "node", "sender_layer", "receiver_layer", "sender_head",
                "receiver_head"]
STORED = ("senders", "receivers", "edge_names")  # the graph attrs that hold the graph itself (older stores: none)


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


def layout(L: int, H: int, KV: int, parallel: bool, has_mlp: bool
           ) -> Tuple[List[Sender], List[Receiver], np.ndarray, np.ndarray]:
    """The senders, receivers and edges (edge e: sender edge_s[e] -> receiver edge_r[e], receiver-major: the edges
    into the logits last) of `L` blocks of `H` heads (`KV` key-value heads), parallel or sequential, with or
    without MLPs: an edge u -> v for every sender upstream of the receiver (an earlier layer, or attention -> the
    MLP of the same layer in sequential blocks)."""
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
    s_layer = np.array([s.layer for s in senders])
    r_layer = np.array([r.layer for r in receivers])
    mask = s_layer[:, None] < r_layer[None, :]
    if not parallel:  # attention -> the MLP of the same layer
        heads = np.array([s.kind == "head" for s in senders])
        mlps = np.array([r.kind == "mlp" for r in receivers])
        mask |= (s_layer[:, None] == r_layer[None, :]) & heads[:, None] & mlps[None, :]
    edge_r, edge_s = np.nonzero(mask.T)  # receiver-major
    return senders, receivers, edge_s.astype(np.int64), edge_r.astype(np.int64)


@dataclass
class CircuitGraph:
    """Senders, receivers and edges (edge e: senders[edge_s[e]] -> receivers[edge_r[e]]; `edges` the table: name,
    sender, receiver, kind, node, sender_layer, receiver_layer, sender_head, receiver_head)."""

    senders: List[Sender]
    receivers: List[Receiver]
    edge_s: np.ndarray  # [E] int64
    edge_r: np.ndarray  # [E] int64
    edges: pd.DataFrame
    n_layers: int
    model_class: str = ""

    @classmethod
    def of(cls, senders: Sequence[Sender], receivers: Sequence[Receiver], edge_s, edge_r, n_layers: int,
           model_class: str = "", names: Optional[Sequence[str]] = None) -> "CircuitGraph":
        """The graph of these nodes and edges; `names`: the edges' names as stored (default 'sender->receiver')."""
        edge_s, edge_r = np.asarray(edge_s, np.int64), np.asarray(edge_r, np.int64)
        rows = []
        for e, (s, r) in enumerate(zip(edge_s.tolist(), edge_r.tolist())):
            snd, rcv = senders[s], receivers[r]
            rows.append((f"{snd.name}->{rcv.name}" if names is None else str(names[e]), snd.name, rcv.name, rcv.kind,
                         rcv.node, snd.layer, rcv.layer, -1 if snd.head is None else snd.head,
                         -1 if rcv.head is None else rcv.head))
        return cls(list(senders), list(receivers), edge_s, edge_r, pd.DataFrame(rows, columns=EDGE_COLUMNS), n_layers,
                   model_class)

    @classmethod
    def of_shape(cls, L: int, H: int, KV: int, parallel: bool, has_mlp: bool, model_class: str = "") -> "CircuitGraph":
        """The graph of a shape (layout)."""
        return cls.of(*layout(L, H, KV, parallel, has_mlp), n_layers=L, model_class=model_class)

    @classmethod
    def from_attrs(cls, shape: dict) -> "CircuitGraph":
        """The graph a run stored (the `circuit` root attr's `graph`): its senders, receivers and edge names as they
        are; a store written before they were stored holds only the shape, and the graph is rebuilt from it."""
        if not all(k in shape for k in STORED):
            return cls.of_shape(shape["n_layers"], shape["n_heads"], shape["n_kv_heads"], shape["parallel"],
                                shape["mlp"], shape.get("model", ""))
        s, r = shape["senders"], shape["receivers"]
        senders = [Sender(n, k, int(layer), None if h < 0 else int(h))
                   for n, k, layer, h in zip(s["name"], s["kind"], s["layer"], s["head"])]
        receivers = [Receiver(n, k, int(layer), None if h < 0 else int(h), node, tuple(heads))
                     for n, k, layer, h, node, heads in zip(r["name"], r["kind"], r["layer"], r["head"], r["node"],
                                                            r["heads"])]
        where_s = {x.name: i for i, x in enumerate(senders)}
        where_r = {x.name: i for i, x in enumerate(receivers)}
        names = list(shape["edge_names"])
        try:
            ends = [name.split("->", 1) for name in names]
            edge_s = [where_s[a] for a, _ in ends]
            edge_r = [where_r[b] for _, b in ends]
        except (KeyError, ValueError) as err:
            raise ValueError(f"the stored circuit graph names an edge whose end is not among its nodes ({err}): "
                             "the store's attrs were edited or written by another hookrun") from None
        return cls.of(senders, receivers, edge_s, edge_r, int(shape["n_layers"]), shape.get("model", ""), names)

    def __len__(self) -> int:
        return len(self.edge_s)

    def stored(self) -> dict:
        """The graph as the run stores it beside its shape: senders and receivers as columns, the edges' names."""
        return {"senders": {"name": [s.name for s in self.senders], "kind": [s.kind for s in self.senders],
                            "layer": [s.layer for s in self.senders],
                            "head": [-1 if s.head is None else s.head for s in self.senders]},
                "receivers": {"name": [r.name for r in self.receivers], "kind": [r.kind for r in self.receivers],
                              "layer": [r.layer for r in self.receivers],
                              "head": [-1 if r.head is None else r.head for r in self.receivers],
                              "node": [r.node for r in self.receivers], "heads": [list(r.heads) for r in self.receivers]},
                "edge_names": list(self.edges["name"])}

    def to_networkx(self, mask=None, scores: Optional[np.ndarray] = None):
        """The graph (or the circuit `mask` [E] of it) as a networkx MultiDiGraph over nodes input, a{L}.h{H}, m{L},
        logits: an edge per graph edge (key: its kind q/k/v/mlp/logits; attrs name, receiver, score), node attrs
        layer, kind and head. A key-value receiver of grouped-query attention (a{L}.kv{G}<k>) feeds every head of
        its group, so its one graph edge is a networkx edge into each of those heads, all with its `name`: then
        g.number_of_edges() exceeds the circuit's edge count, which g.graph["edges"] holds.

            g = res.graph("top_10"); g.graph["edges"] == len(res.circuit("top_10"))
        """
        import networkx as nx

        g = nx.MultiDiGraph()
        for s in self.senders:
            g.add_node(s.name, layer=s.layer, kind=s.kind, head=-1 if s.head is None else s.head)
        g.add_node("logits", layer=self.n_layers, kind="logits", head=-1)
        keep = np.ones(len(self), bool) if mask is None else np.asarray(mask, bool)
        g.graph["edges"] = int(keep.sum())  # the graph's (or circuit's) edges; a key-value edge is one per head here
        for e, row in enumerate(self.edges.itertuples(index=False)):
            if keep[e]:
                r = self.receivers[int(self.edge_r[e])]
                for node in r.heads or (row.node,):
                    g.add_edge(row.sender, node, key=row.kind, name=row.name, receiver=row.receiver,
                               score=float("nan") if scores is None else float(scores[e]))
        return g
