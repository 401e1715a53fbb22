"""Finding circuits in a graph from edge scores: the top n edges (greedy from the logits, as EAP-IG's apply_greedy,
or plainly the largest), a threshold, random circuits of the same size, and pruning (the area under a
faithfulness curve is the reader's: hookrun.read.results.circuits).

    mask = top_n(g, scores, 40)               # greedy: grown from the logits by the largest |score| among edges into
                                              # nodes already in the circuit; nodes with no input -> logits path pruned
    mask = threshold(g, scores, 0.05)         # every edge with |score| >= 0.05, pruned
    rnd = random_circuit(g, 40, seed=0)       # the same procedure on random scores: a baseline of the same budget
"""
from __future__ import annotations

import heapq
from typing import Dict, List

import numpy as np
import torch

from hookrun.methods.circuits.graph import Graph

HOW = ("greedy", "top")  # greedy: grown from the logits (EAP-IG's apply_greedy); top: the n largest |scores|


def prune(graph: Graph, mask: torch.Tensor) -> torch.Tensor:
    """The circuit without edges off every input -> logits path (a node with no path from input or none to the
    logits through the circuit's edges takes its edges with it)."""
    keep = np.asarray(mask, bool)
    senders, nodes = graph.edges["sender"].to_numpy(), _feeds(graph)
    reached = {"input"}
    for e in np.flatnonzero(keep):  # edges are receiver-major in layer order: one pass forward
        if senders[e] in reached:
            reached.update(nodes[e])
    live = {"logits"}
    for e in np.flatnonzero(keep)[::-1]:  # and one backward
        if any(n in live for n in nodes[e]):
            live.add(senders[e])
    out = [bool(keep[e] and senders[e] in reached and any(n in live for n in nodes[e])) for e in range(len(keep))]
    return torch.tensor(out, dtype=torch.bool)


def _feeds(graph: Graph) -> List[tuple]:
    """The node(s) each edge's receiver feeds (a key-value receiver: every head of its group)."""
    rec = graph.receivers
    return [rec[r].heads or (rec[r].node,) for r in graph.edge_r.tolist()]


def top_n(graph: Graph, scores, n: int, how: str = "greedy", absolute: bool = True) -> torch.Tensor:
    """The n-edge circuit (before pruning) by score; `how` greedy (from the logits: at each step the best edge into
    a node already in the circuit) or top (the n largest)."""
    s = np.asarray(scores, np.float64)
    s = np.abs(s) if absolute else s
    s = np.where(np.isnan(s), -np.inf, s)
    mask = np.zeros(len(s), bool)
    if how == "top":
        mask[np.argsort(-s, kind="stable")[:n]] = True
        return prune(graph, torch.as_tensor(mask))
    into: Dict[str, List[int]] = {}
    for e, nodes in enumerate(_feeds(graph)):
        for node in nodes:
            into.setdefault(node, []).append(e)
    senders = graph.edges["sender"].to_numpy()
    heap = [(-s[e], e) for e in into.get("logits", [])]
    heapq.heapify(heap)
    inside = {"logits"}
    taken = 0
    while heap and taken < n:
        _, e = heapq.heappop(heap)
        if mask[e]:
            continue
        mask[e] = True
        taken += 1
        parent = senders[e]
        if parent not in inside:
            inside.add(parent)
            for p in into.get(parent, []):
                heapq.heappush(heap, (-s[p], p))
    return prune(graph, torch.as_tensor(mask))


def threshold(graph: Graph, scores, tau: float, absolute: bool = True) -> torch.Tensor:
    """Every edge whose (|score|) is at least tau, pruned."""
    s = np.asarray(scores, np.float64)
    s = np.abs(s) if absolute else s
    return prune(graph, torch.as_tensor(np.nan_to_num(s, nan=-np.inf) >= tau))


def random_circuit(graph: Graph, n: int, how: str = "greedy", seed: int = 0) -> torch.Tensor:
    """A baseline: the same selection from random scores (uniform, seeded)."""
    rng = np.random.default_rng(seed)
    return top_n(graph, rng.random(len(graph)), n, how)
