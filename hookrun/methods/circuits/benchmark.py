"""The circuit block's side of the circuit-discovery benchmark (MIB's circuit track, run on the EAP-IG code): the
circuits at its edge percentages (`select.percent`, read back as CPR and CMD: hookrun.read.results.benchmark) and
circuits given as its graph files (`circuits: {NAME: {file: PATH}}`: hookrun.read.results.interchange).

    select: {percent: [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]}   # 20 circuits: signed_1pct, abs_1pct, ...
    circuits: {theirs: {file: importances.json}}                     # a graph file's circuit (in_graph), pruned
"""
from __future__ import annotations

from pathlib import Path
from typing import List

import numpy as np
import torch
from torch import nn

from hookrun.methods.circuits.graph import Graph, GraphError
from hookrun.methods.circuits.select import prune, random_circuit, top_n
from hookrun.read.results.benchmark import PERCENT, name, size
from hookrun.read.results.interchange import SUFFIXES, read_graph

CIRCUIT_KINDS = ("edges", "but_from", "but_into", "file")  # what an explicit circuit is given as


def check_percent(value) -> List[str]:
    """Problems with select.percent (without the model)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 100 for p in items):
        return [f"circuit.select.percent: {value!r}; give percentages of the edges in (0, 100], e.g. the benchmark's "
                f"{list(PERCENT)}"]
    return []


def percent_circuits(graph: Graph, scores: np.ndarray, sel: dict, gap: float = 1.0) -> List[dict]:
    """The circuits at select.percent: for each p, the top int(p / 100 x edges) edges by signed score
    (`signed_{p}pct`, CPR's) and by |score| (`abs_{p}pct`, CMD's), pruned, and select.random random circuits of
    that size (`random_{p}pct`, default 1: the baseline); `select.how` where given (default top: the benchmark's
    apply_topn). Signed: oriented toward the source's metric (scores x the sign of `gap`,
    m_source - m_target), as the benchmark's scores of the metric it maximises (logit difference: the edges that
    raise it first; a loss, where the source's is the lower: those that lower it)."""
    items = sel.get("percent")
    if items is None:
        return []
    how = sel.get("how", "top")
    scores = np.asarray(scores, np.float64) * (-1.0 if gap < 0 else 1.0)
    rounds, seed = int(sel.get("random", 1)), int(sel.get("seed", 0))
    out = []
    for p in items if isinstance(items, list) else [items]:
        n = size(p, len(graph))
        for signed in (True, False):
            mask = top_n(graph, scores, n, how, absolute=not signed) if n else torch.zeros(len(graph), dtype=bool)
            out.append(dict(name=name(p, signed), kind="percent_signed" if signed else "percent_abs", n=n,
                            percent=float(p), edges=_idx(mask)))
        for r in range(rounds):  # the baseline: the same selection from random scores
            mask = random_circuit(graph, n, how, seed + r) if n else torch.zeros(len(graph), dtype=bool)
            out.append(dict(name=f"random_{float(p):g}pct" + (f"_{r}" if rounds > 1 else ""), kind="percent_random",
                            n=n, percent=float(p), edges=_idx(mask)))
    return out


def _idx(mask) -> List[int]:
    return [int(e) for e in torch.as_tensor(mask).nonzero().flatten()]


def check_given(name_: str, c) -> List[str]:
    """Problems with an explicit circuit `circuits.NAME` (without the model)."""
    if not isinstance(c, dict) or len(c) != 1 or next(iter(c)) not in CIRCUIT_KINDS:
        return [f"circuit.circuits.{name_}: {c!r}; give one of {{edges: [..]}}, {{but_from: [nodes]}}, "
                "{but_into: [nodes or receivers]}, {file: graph.json | graph.pt}"]
    (how, items), = c.items()
    if how == "file":
        if not isinstance(items, str) or Path(items).suffix not in SUFFIXES:
            return [f"circuit.circuits.{name_}.file: {items!r}; give the path of a reference graph file (.json or .pt, "
                    "the EAP-IG code's Graph.to_json / to_pt)"]
        if not Path(items).is_file():
            return [f"circuit.circuits.{name_}.file: {items!r} is not a file; give the path of a graph file written by "
                    "the EAP-IG code (Graph.to_json / to_pt) or by hookrun (cap.read('circuit').to_json(path))"]
        return []
    if not isinstance(items, list):
        return [f"circuit.circuits.{name_}.{how}: {items!r} is not a list"]
    return []


def given_mask(graph: Graph, name_: str, c: dict) -> torch.Tensor:
    """[E] bool: an explicit circuit of the block (edges, but_from, but_into, or a graph file's in_graph edges,
    pruned as the reference's evaluate_graph prunes); GraphError naming the key."""
    (how, items), = c.items()
    key = f"circuit.circuits.{name_}"
    if how != "file":
        return graph.circuit(items if how == "edges" else None, exclude_from=items if how == "but_from" else (),
                             exclude_into=items if how == "but_into" else (), key=key)
    try:
        ref = read_graph(items)
    except (ValueError, OSError) as err:
        raise GraphError(f"{key}.file", f"{key}.file: {err}") from None
    mask, problems = ref.circuit(graph.data(), f"{key}.file")
    if problems:
        raise GraphError(f"{key}.file", "; ".join(problems))
    return prune(graph, torch.as_tensor(mask))


def d_model(model: nn.Module) -> int:
    """The residual stream's width (the input embedding's), the `d_model` of the reference's graph cfg."""
    return int(model.get_input_embeddings().weight.shape[-1])



def check_by_class(value) -> List[str]:
    """Problems with select.by_class (without the model): a list of circuit names."""
    if value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return []
    return [f"circuit.select.by_class: {value!r}; give the names of circuits to break down by edge class, e.g. "
            "[top_16, abs_10pct]"]


def class_circuits(graph: Graph, circuits: List[dict], names) -> List[dict]:
    """Faithfulness by edge class (q, k, v, mlp, logits): for each class present, the run with only that class's
    edges ablated (`class:k`, the class's whole effect), and for each circuit named in `names` the run with only the
    class's edges outside the circuit ablated (`<name>|k`); the reader's `by_class` divides the two. GraphError for
    a name that is not a circuit of the run."""
    if not names:
        return []
    where = {c["name"]: c for c in circuits}
    missing = [n for n in names if n not in where]
    if missing:
        raise GraphError("circuit.select.by_class", f"circuit.select.by_class: {', '.join(map(repr, missing))} is "
                         f"not a circuit of the run; its circuits: {', '.join(where)}")
    kinds = graph.edges["kind"].to_numpy()
    out = []
    for kind in dict.fromkeys(kinds):
        other = kinds != kind
        out.append(dict(name=f"class:{kind}", kind="class", n=int(other.sum()), edge_class=str(kind), of=None,
                        edges=[int(e) for e in np.flatnonzero(other)]))
        for name_ in names:
            keep = other.copy()
            keep[where[name_]["edges"]] = True
            out.append(dict(name=f"{name_}|{kind}", kind="class_of", n=int(keep.sum()), edge_class=str(kind),
                            of=name_, edges=[int(e) for e in np.flatnonzero(keep)]))
    return out
