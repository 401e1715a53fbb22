"""The reader's side of circuits at other levels than edges (circuit.level: node, neuron, edge_position): each
circuit's selected set as stored in the root attr, the node and neuron scores, and the level's unit count. Needs
numpy and pandas, not torch.

    res = cap.read("circuit")
    res.selected("top_5")     # node: ['input', 'a0.h1', ...]; neuron: {'a0.h1': [3, 17], ...};
                              # edge_position: a table edge, position; edge: the edge names
    res.nodes                 # a row a sender: name, kind, layer, head, score (mean), rank (by |score|)
    res.neurons               # [senders, d_model]: each output dimension's mean score (level neuron)
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd


def units(level: str, n_senders: int, n_edges: int, d_model: Optional[int], positions: Optional[int]) -> int:
    """A level's count: edges, nodes (senders), neurons (senders x d_model), (edge, position) pairs."""
    return {"edge": n_edges, "node": n_senders, "neuron": n_senders * int(d_model or 0),
            "edge_position": n_edges * int(positions or 0)}[level]


def kept(spec: dict) -> int:
    """The units a stored circuit keeps at its level (after pruning)."""
    if "nodes" in spec:
        return len(spec["nodes"])
    if "neurons" in spec:
        return int(sum(len(d) for d in spec["neurons"].values()))
    if "pairs" in spec:
        return len(spec["pairs"])
    return len(spec["edges"])


def selected(spec: dict, edge_names, full_units=None):
    """A stored circuit's set at its level: node names, {node: [dims]}, a table of (edge, position), or edge
    names (an edge circuit, and a level's full or empty circuit)."""
    if "nodes" in spec:
        return list(spec["nodes"])
    if "neurons" in spec:
        return {k: list(v) for k, v in spec["neurons"].items()}
    names = np.asarray(edge_names, object)
    if "pairs" in spec:
        pairs = np.asarray(spec["pairs"], np.int64).reshape(-1, 2)
        return pd.DataFrame({"edge": names[pairs[:, 0]], "position": pairs[:, 1]})
    return list(names[np.asarray(spec["edges"], np.int64)])


def node_table(senders, scores: np.ndarray) -> pd.DataFrame:
    """A row a sender: name, kind, layer, head, its mean score over the samples (scores [samples, senders]) and
    its rank by |score| (NaN last)."""
    table = pd.DataFrame({"name": [s.name for s in senders], "kind": [s.kind for s in senders],
                          "layer": [s.layer for s in senders],
                          "head": [-1 if s.head is None else s.head for s in senders],
                          "score": np.asarray(scores, np.float64).mean(0)})
    table["rank"] = (-table["score"].abs()).rank(method="first", na_option="bottom").astype(int)
    return table
