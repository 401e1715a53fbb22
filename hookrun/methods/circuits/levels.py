"""Circuits at other levels than edges (`circuit.level`): sets of nodes (the senders: input, heads, MLPs), of
neurons (the dimensions of each sender's output) or of (edge, position) pairs; their scores, their selection and
the masks a circuit's run takes (docs/circuits.md#levels).

    nodes = node_scores(g, s.scores)                       # [B, S]: each sender's outgoing edges' scores summed
    pick = Levels(g, "node")                               # or "neuron" (d_model=D), "edge_position" (positions=T)
    spec = pick.top(mean_node_scores, 5)                   # {"nodes": [...], "edges": [...]}: its nodes and edges
    m = circuit_metric(model, g, clean, donor, neuron_masks(g, [spec], D), metric, neurons=...)  # neuron circuits

A **node** circuit keeps every edge between its nodes and into the logits (the EAP-IG code's `apply_topn(level=
'node')`, whose `prune` then removes none of them: every node feeds the logits, and its rows of `in_graph` are
whole): a node outside has its output replaced by the donor's at every receiver. A **neuron** circuit keeps
dimensions of the senders' outputs; every edge carries the donor on the dimensions outside (the EAP-IG code's
`neurons_in_graph` in `evaluate_graph`), a sender with no dimension kept on all. A **per-position** circuit keeps
(edge, position) pairs: an edge outside at position t carries the donor at t alone (auto-circuit's `seq_len`
masks, not pruned). Node scores are the sums of the edges'
(the change of the metric along every path out of the node: delta . dM/d output); neuron scores the same per
dimension (attribute.gradient_scores' `neurons`); exact node scores patch each node's output alone.
"""
from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from hookrun.config.checks import as_list
from hookrun.methods.circuits.evaluate import circuit_metric
from hookrun.methods.circuits.graph import Graph, GraphError
from hookrun.methods.circuits.select import prune, top_n
from hookrun.read.results.benchmark import name as percent_name, size

LEVELS = ("edge", "node", "neuron", "edge_position")  # what a circuit is a set of
UNITS = {"edge": "edges", "node": "nodes", "neuron": "neurons", "edge_position": "(edge, position) pairs"}
FORMS = ("edge", "neuron", "pair")  # how a circuit's run masks it (form()), the order run_circuits runs them in


def node_scores(graph: Graph, scores: torch.Tensor) -> torch.Tensor:
    """[..., S]: each sender's outgoing edges' scores summed (scores [..., E]; per position [B, T, E] too)."""
    out = torch.zeros((*scores.shape[:-1], len(graph.senders)), dtype=scores.dtype, device=scores.device)
    return out.index_add_(-1, graph.edge_s.to(scores.device), scores)


def exact_node_scores(model: nn.Module, graph: Graph, run: dict, donor: torch.Tensor, metric, m_run: torch.Tensor,
                      copies: int = 0) -> torch.Tensor:
    """[B, S]: the change of the metric of the run of `run` when one sender's output is replaced by `donor`'s at
    every receiver (every edge out of it ablated; the EAP-IG code's exact node scores), one circuit a sender."""
    every = torch.ones((len(graph.senders), len(graph)), dtype=torch.bool)
    every[graph.edge_s, torch.arange(len(graph))] = False  # circuit s: all but the edges out of sender s
    with torch.no_grad():
        return circuit_metric(model, graph, run, donor, every, metric, copies) - m_run.cpu()[:, None]


def node_edges(graph: Graph, nodes) -> torch.Tensor:
    """[E] bool: the edges between `nodes` ([S] bool) and into the logits (a key-value receiver: where any head of
    its group is one of them)."""
    keep = np.asarray(nodes, bool)
    names = {s.name for s, k in zip(graph.senders, keep) if k} | {"logits"}
    rec = graph.receivers
    into = np.array([any(n in names for n in (rec[r].heads or (rec[r].node,))) for r in graph.edge_r.tolist()])
    return torch.as_tensor(keep[graph.edge_s.numpy()] & into)


def _idx(mask) -> List[int]:
    return [int(e) for e in np.flatnonzero(np.asarray(mask, bool))]


class Levels:
    """Selection at one level of a graph: top(scores, n), threshold(scores, tau), random(n, seed), each a circuit's
    parts (its edges and its set at the level: nodes, neurons {node: [dims]} or pairs [[edge, position]]);
    `units` the level's count (nodes, senders x d_model, positions x edges)."""

    def __init__(self, graph: Graph, level: str, d_model: Optional[int] = None, positions: Optional[int] = None):
        if level not in LEVELS:
            raise ValueError(f"circuit.level: {level!r} is not one of {', '.join(LEVELS)}")
        self.graph, self.level, self.d, self.t = graph, level, d_model, positions
        self.shape = {"edge": (len(graph),), "node": (len(graph.senders),), "neuron": (len(graph.senders), d_model),
                      "edge_position": (positions, len(graph))}[level]
        self.units = int(np.prod(self.shape))

    def parts(self, keep: np.ndarray) -> dict:
        """A selection (bool of the level's shape) as a circuit's stored parts (edges pruned, the other levels not:
        see the module's docstring)."""
        g = self.graph
        if self.level == "edge":
            return {"edges": _idx(prune(g, torch.as_tensor(keep)))}
        if self.level == "node":
            return {"nodes": [s.name for s, k in zip(g.senders, keep) if k], "edges": _idx(node_edges(g, keep))}
        if self.level == "neuron":
            return {"neurons": {g.senders[s].name: _idx(keep[s]) for s in np.flatnonzero(keep.any(1))},
                    "edges": _idx(node_edges(g, keep.any(1)))}
        return {"pairs": [[int(e), int(t)] for t, e in zip(*np.nonzero(keep))], "edges": _idx(keep.any(0))}

    def top(self, scores, n: int, how: str = "top", absolute: bool = True) -> dict:
        """The n units with the largest (|) score (|); `how` greedy (edges: select.top_n's; pairs: grown from the
        logits the same way) or top. Every node feeds the logits, so for nodes and neurons greedy is the top n."""
        if self.level == "edge":
            return {"edges": _idx(top_n(self.graph, scores, n, how, absolute))}
        s = np.asarray(scores, np.float64).reshape(self.shape)
        s = np.abs(s) if absolute else s
        s = np.where(np.isnan(s), -np.inf, s)
        keep = np.zeros(self.units, bool)
        if how == "greedy" and self.level == "edge_position":
            keep = self._greedy(s, n)
        else:
            keep[np.argsort(-s.ravel(), kind="stable")[:n]] = True
        return self.parts(keep.reshape(self.shape))

    def _greedy(self, s: np.ndarray, n: int) -> np.ndarray:
        """[T x E] bool: grown from the logits, at each step the best (edge, position) into a node already in."""
        g, t = self.graph, s.shape[0]
        rec, senders = g.receivers, g.edges["sender"].to_numpy()
        into: Dict[str, List[int]] = {}
        for e, r in enumerate(g.edge_r.tolist()):
            for node in rec[r].heads or (rec[r].node,):
                into.setdefault(node, []).append(e)
        keep = np.zeros((t, len(g)), bool)
        heap = [(-s[p, e], p, e) for e in into.get("logits", []) for p in range(t)]
        heapq.heapify(heap)
        inside, taken = {"logits"}, 0
        while heap and taken < n:
            _, p, e = heapq.heappop(heap)
            if keep[p, e]:
                continue
            keep[p, e], taken = True, taken + 1
            if senders[e] not in inside:
                inside.add(senders[e])
                for f in into.get(senders[e], []):
                    for q in range(t):
                        heapq.heappush(heap, (-s[q, f], q, f))
        return keep.ravel()

    def threshold(self, scores, tau: float, absolute: bool = True) -> dict:
        """Every unit whose (|) score (|) is at least tau."""
        s = np.asarray(scores, np.float64).reshape(self.shape)
        s = np.abs(s) if absolute else s
        return self.parts(np.nan_to_num(s, nan=-np.inf) >= tau)

    def random(self, n: int, how: str = "top", seed: int = 0) -> dict:
        """A baseline: the same selection from random scores (uniform, seeded)."""
        return self.top(np.random.default_rng(seed).random(self.shape), n, how)


def level_circuits(graph: Graph, level: str, mean, sel: dict, gap: float, d_model: Optional[int] = None,
                   positions: Optional[int] = None) -> List[dict]:
    """The circuits of select at a level other than edge (sizes in the level's units): top_N and its random
    baselines, threshold_TAU, and at select.percent the signed_Ppct / abs_Ppct / random_Ppct circuits (P% of the
    units), each spec with its `level` and set. `mean`: the mean scores at the level ([S], [S, D], [T, E])."""
    pick = Levels(graph, level, d_model, positions)
    for n in as_list(sel.get("top_n")):
        if n > pick.units:
            raise GraphError("circuit.select.top_n", f"circuit.select.top_n: {n} is larger than the graph's "
                             f"{pick.units} {UNITS[level]} (level {level}); give sizes up to {pick.units}")
    how, rounds, seed = sel.get("how", "greedy"), int(sel.get("random", 1)), int(sel.get("seed", 0))
    out = []
    sizes = sel.get("top_n", [])
    for n in [sizes] if isinstance(sizes, int) else list(sizes):
        out.append(dict(name=f"top_{n}", kind="top_n", n=int(n), level=level, **pick.top(mean, n, how)))
        for r in range(rounds):
            out.append(dict(name=f"random_{n}" + (f"_{r}" if rounds > 1 else ""), kind="random", n=int(n),
                            level=level, **pick.random(n, how, seed + r)))
    if "threshold" in sel:
        t = float(sel["threshold"])
        out.append(dict(name=f"threshold_{t:g}", kind="threshold", n=None, level=level, **pick.threshold(mean, t)))
    items = sel.get("percent")
    how = sel.get("how", "top")
    oriented = np.asarray(mean, np.float64) * (-1.0 if gap < 0 else 1.0)
    empty = pick.parts(np.zeros(pick.shape, bool))
    for p in [] if items is None else items if isinstance(items, list) else [items]:
        n = size(p, pick.units)
        for signed in (True, False):
            out.append(dict(name=percent_name(p, signed), kind="percent_signed" if signed else "percent_abs", n=n,
                            percent=float(p), level=level,
                            **(pick.top(oriented, n, how, absolute=not signed) if n else empty)))
        for r in range(rounds):
            out.append(dict(name=f"random_{float(p):g}pct" + (f"_{r}" if rounds > 1 else ""), kind="percent_random",
                            n=n, percent=float(p), level=level, **(pick.random(n, how, seed + r) if n else empty)))
    return out


def neuron_masks(graph: Graph, specs: Sequence[dict], d_model: int) -> torch.Tensor:
    """[C, S, D] bool: the neurons of each spec (a full circuit: every neuron)."""
    index = {s.name: i for i, s in enumerate(graph.senders)}
    out = torch.zeros((len(specs), len(graph.senders), d_model), dtype=torch.bool)
    for c, spec in enumerate(specs):
        if spec.get("kind") == "full":
            out[c] = True
        for node, dims in (spec.get("neurons") or {}).items():
            out[c, index[node], dims] = True
    return out


def pair_masks(graph: Graph, specs: Sequence[dict], positions: int) -> torch.Tensor:
    """[C, T, E] bool: the (edge, position) pairs of each spec (one without pairs: its edges at every position)."""
    out = torch.zeros((len(specs), positions, len(graph)), dtype=torch.bool)
    for c, spec in enumerate(specs):
        if "pairs" in spec:
            for e, t in spec["pairs"]:
                out[c, t, e] = True
        else:
            out[c, :, spec["edges"]] = True
    return out


def level_problems(spec: dict) -> List[str]:
    """Problems with circuit.level against the block's other keys (without the model or the data)."""
    level = spec.get("level", "edge")
    if level not in LEVELS:
        return [f"circuit.level: {level!r} is not one of {', '.join(LEVELS)}; a circuit is a set of edges, nodes "
                "(heads, MLPs, the input), neurons (their output dimensions) or (edge, position) pairs"]
    method, problems = spec.get("method", "eap"), []
    if level == "neuron" and method == "exact":
        problems.append("circuit.level: neuron with method exact; exact scores would take a forward a neuron: use a "
                        "gradient method (circuit.method=eap or eap_ig) or level node")
    if level == "edge_position":
        if method == "exact":
            problems.append("circuit.level: edge_position with method exact; exact patches an edge at every position "
                            "at once: use a gradient method (circuit.method=eap or eap_ig)")
        if spec.get("positions", "per_position") != "per_position":
            problems.append(f"circuit.positions: {spec['positions']!r} with level edge_position; per-position "
                            "circuits select from the scores at each position: drop positions (edge_position keeps "
                            "them) or set circuit.positions=per_position")
    if level != "edge" and spec.get("features") is not None:
        problems.append(f"circuit.level: {level} with circuit.features; feature circuits are their own nodes: drop "
                        "one of them")
    return problems


def position_problems(spec: dict, inputs) -> List[str]:
    """level edge_position against the data (before the model): every prompt of the source role of one token
    length (a position means the same token in every prompt, as auto-circuit's seq_len)."""
    if not isinstance(spec, dict) or spec.get("level") != "edge_position":
        return []
    seqs = (getattr(inputs, "role_seqs", None) or {}).get(spec.get("source"))
    ranges = inputs.ranges() if hasattr(inputs, "ranges") else None
    if seqs is None or not ranges:
        return []
    lengths = sorted({len(seqs[i]) for start, stop in ranges for i in range(start, stop)})
    if len(lengths) > 1:
        return [f"circuit.level: edge_position but the prompts of {spec['source']!r} have {len(lengths)} token lengths "
                f"({', '.join(map(str, lengths[:5]))}{', ...' if len(lengths) > 5 else ''}); a per-position circuit "
                "keeps an edge at a position of every prompt: give prompts of one token length (data.text."
                "max_length cuts them, or a template of fixed length), or use level edge"]
    return []


def position_bytes(graph: Graph, positions: int, copies: int) -> float:
    """The bytes of a chunk's per-position masks in a circuit run: copies x senders x receivers x positions."""
    return float(copies) * len(graph.senders) * len(graph.receivers) * positions * 4


def level_need(graph: Graph, level: str, b: int, t: int, d: int, copies: int) -> List[tuple]:
    """Memory parts (Method.memory_need's) of a level: the neuron scores of a batch, or a chunk's per-position
    masks and a batch's scores at each position."""
    if level == "neuron":
        return [(3.0 * b * len(graph.senders) * d * 4, "data.batch_size (or circuit.level=node)",
                 f"neuron scores of {b} prompts x {len(graph.senders)} senders x {d} dimensions")]
    if level == "edge_position":
        return [(position_bytes(graph, t, copies) + 2.0 * b * t * len(graph) * 4,
                 "circuit.copies or data.batch_size (or circuit.level=edge)",
                 f"per-position masks of {copies} circuits x {t} positions and the scores of {len(graph)} edges at "
                 "each position")]
    return []


def form(spec: dict) -> str:
    """How a circuit's run masks it: edge (edge and node circuits), neuron or pair (per position)."""
    return "neuron" if "neurons" in spec else "pair" if "pairs" in spec else "edge"


def run_circuits(model: nn.Module, graph: Graph, run: dict, donor: torch.Tensor, specs: Sequence[dict], metric,
                 copies: int = 0) -> torch.Tensor:
    """[B, C] the metric of each circuit's run (circuit_metric): edge circuits (node circuits as their edges), then
    neuron circuits with their neuron masks, then per-position ones with their (edge, position) masks; `specs` in
    that order (sorted by FORMS.index(form(spec)))."""
    groups = {f: [s for s in specs if form(s) == f] for f in FORMS}
    parts = []
    if groups["edge"]:
        masks = torch.zeros((len(groups["edge"]), len(graph)), dtype=torch.bool)
        for k, s in enumerate(groups["edge"]):
            masks[k, s["edges"]] = True
        parts.append(circuit_metric(model, graph, run, donor, masks, metric, copies))
    if groups["neuron"]:
        n = neuron_masks(graph, groups["neuron"], donor.shape[-1])
        parts.append(circuit_metric(model, graph, run, donor, n[:, :0], metric, copies, neurons=n))
    if groups["pair"]:
        parts.append(circuit_metric(model, graph, run, donor, pair_masks(graph, groups["pair"], run["input_ids"]
                                                                       .shape[1]), metric, copies))
    return torch.cat(parts, 1)
