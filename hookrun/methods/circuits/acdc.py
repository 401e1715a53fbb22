"""ACDC (Conmy et al. 2023, "Towards Automated Circuit Discovery"): a circuit found by pruning the full graph one edge
at a time, each edge's removal measured in a forward, kept off where the metric barely moves.

    runs = [(clean_kw, donor, metric)]                   # donor [S, B | 1, T, D]: evaluate.donor_activations
    mask = acdc(model, g, runs, tau=0.05)                 # [E] bool: the edges ACDC keeps
    circuit: {finder: acdc, acdc: {threshold: [0.01, 0.1], prompts: all}, ...}   # circuits acdc_0.01, acdc_0.1

The loop: receivers in reverse topological order (the logits first, back to the first layer's); at a receiver whose
node no longer reaches the logits (no edge out of it left) every edge into it goes without a forward; else each edge
into it still in the graph, from the latest sender to the earliest, is ablated on top of the edges already removed
(the circuit's run of hookrun.methods.circuits.evaluate.circuit_metric: the source run, the edges outside carrying
the donor's senders) and removed for good when |m(new) - m(current)| < tau, m the block's metric averaged over the
prompts (the original's KL to the clean output, or its `abs_value_threshold` with a task metric). One forward per
edge tried and batch of prompts.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hookrun.methods.circuits.evaluate import circuit_metric
from hookrun.methods.circuits.graph import Graph

Run = Tuple[dict, torch.Tensor, Callable]  # (source inputs, donor [S, B | 1, T, D], metric (logits, rows) -> [B])


def mean_metric(model: nn.Module, graph: Graph, runs: Sequence[Run], mask: torch.Tensor, copies: int = 0) -> float:
    """The metric of the circuit `mask` [E] averaged over every prompt of `runs` (one forward a run)."""
    total, count = 0.0, 0
    for kw, donor, metric in runs:
        m = circuit_metric(model, graph, kw, donor, mask[None], metric, copies)[:, 0]
        total += float(m.double().sum())
        count += len(m)
    return total / max(count, 1)


def acdc(model: nn.Module, graph: Graph, runs: Sequence[Run], tau: float, copies: int = 0,
         start: Optional[float] = None) -> torch.Tensor:
    """[E] bool: the circuit ACDC keeps at threshold `tau` (see the module's docstring); `start`: the full graph's
    mean metric where the caller has it (else one forward a run)."""
    n = len(graph)
    mask = torch.ones(n, dtype=torch.bool)
    into: List[List[int]] = [[] for _ in graph.receivers]
    out_of: Dict[str, List[int]] = {}
    for e, (s, r) in enumerate(zip(graph.edge_s.tolist(), graph.edge_r.tolist())):
        into[r].append(e)
        out_of.setdefault(graph.senders[s].name, []).append(e)
    with torch.no_grad():
        current = mean_metric(model, graph, runs, mask, copies) if start is None else float(start)
        for r in reversed(range(len(graph.receivers))):
            rec = graph.receivers[r]
            feeds = set(rec.heads or (rec.node,))
            if "logits" not in feeds and not any(bool(mask[out_of.get(f, [])].any()) for f in feeds):
                mask[into[r]] = False  # the node reaches no output: its inputs cannot move the metric
                continue
            for e in reversed(into[r]):
                mask[e] = False
                new = mean_metric(model, graph, runs, mask, copies)
                if abs(new - current) < tau:
                    current = new
                else:
                    mask[e] = True
    return mask


def acdc_circuits(model: nn.Module, graph: Graph, runs: Sequence[Run], spec: dict, copies: int = 0) -> List[dict]:
    """The `circuit:` block's ACDC circuits: one `acdc_TAU` a threshold of spec["threshold"] (the block's circuit
    entries: name, kind acdc, n None, edges)."""
    taus = spec["threshold"] if isinstance(spec["threshold"], (list, tuple)) else [spec["threshold"]]
    start = mean_metric(model, graph, runs, torch.ones(len(graph), dtype=torch.bool), copies) if runs else 0.0
    out = []
    for t in taus:
        mask = acdc(model, graph, runs, float(t), copies, start)
        out.append(dict(name=f"acdc_{float(t):g}", kind="acdc", n=None,
                        edges=[int(e) for e in mask.nonzero().flatten().tolist()]))
    return out
