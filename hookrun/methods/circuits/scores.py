"""Edge scores, the entry point: every method (EAP, EAP-IG inputs and activations, clean-corrupted, exact) with the
gradient on either run, the IG points declared and the other end ablated or not, and information-flow routes (no
gradient: hookrun.methods.circuits.routes) (docs/circuits.md).

    s = edge_scores(model, g, clean, corrupt, metric)                               # EAP: s.scores [B, E]
    s = edge_scores(model, g, clean, corrupt, metric, method="eap_ig", steps=16, points="left", gradient="source")
    s = edge_scores(model, g, clean, corrupt, metric, method="exact", gradient="source")   # the EAP-IG code's exact
    s = edge_scores(model, g, clean, corrupt, metric, neurons=True)    # s.neurons [B, S, D]: senders' dimensions

The gradient methods are hookrun.methods.circuits.attribute's; `exact` patches every edge with
hookrun.methods.circuits.evaluate.patch_edges, one forward a chunk of edges.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from hookrun.methods.circuits.attribute import (GRADIENTS, IG_METHODS, METHODS, EdgeScores, gradient_scores,
                                                ig_points)
from hookrun.methods.circuits.evaluate import copies_per_forward, patch_edges
from hookrun.methods.circuits.graph import Graph
from hookrun.methods.circuits.routes import METHOD as ROUTES, route_scores
from hookrun.methods.metrics import logits_of


def edge_scores(model: nn.Module, graph: Graph, source: dict, target: dict, metric: Callable, *,
                method: str = "eap", steps: Optional[int] = None, points: Union[str, Sequence[float], None] = None,
                gradient: str = "target", per_position: bool = False, valid: Optional[torch.Tensor] = None,
                copies: int = 0, source_metric: Optional[Callable] = None,
                donor: Optional[torch.Tensor] = None, neurons: bool = False, input: str = "stream") -> EdgeScores:
    """Every edge's score for one batch of paired inputs (see the module's docstring). `metric` scores the target
    run, `source_metric` the source run (default `metric`); `gradient`: the run whose gradient is taken and whose
    edges the score patches (target: (a_source - a_target) . dM/dx at the target; source, the EAP-IG code's: (a_target
    - a_source) . dM/dx at the source); `steps`, `points` (eap_ig, eap_ig_activations): the IG points (ig_points);
    `valid` [B, T]: positions that count (both runs' real tokens); `copies`: IG passes (or exact's edges) a forward
    (0: as many as keep ~4k tokens a forward); `donor` [S, B | 1, T, D] (eap, exact): what the edges carry in place of
    the other run's senders (an ablation: hookrun.methods.circuits.ablation; the EAP-IG code's `intervention`);
    `neurons`: each sender's output dimensions scored too (`.neurons` [B, S, D], the EAP-IG code's `neuron=True`;
    hookrun.methods.circuits.levels), a gradient method's, on a model without post-norm blocks; `input`
    (information_flow_routes): the input sender's activation, the stream into block 0 or its token embedding (the
    other methods take a difference of the two runs, the same under both)."""
    if method not in METHODS:
        raise ValueError(f"circuit.method: {method!r} is not one of {', '.join(METHODS)}")
    if method not in IG_METHODS and (steps is not None or points is not None):
        raise ValueError(f"circuit.steps / circuit.points: given ({steps!r}, {points!r}) but method {method} takes "
                         "no IG points; use method eap_ig or eap_ig_activations, or drop them")
    if gradient not in GRADIENTS:
        raise ValueError(f"circuit.gradient: {gradient!r} is not one of {', '.join(GRADIENTS)}")
    if method == "exact" and per_position:
        raise ValueError("circuit.positions: exact scores patch an edge at every position at once; use positions: sum")
    if donor is not None and method not in ("eap", "exact"):
        raise ValueError(f"circuit.score_donor: an ablation at the scores' other end with method {method}; it is "
                         "built for eap and exact (the EAP-IG code refuses it for EAP-IG-inputs and clean-corrupted)")
    if neurons and (method in ("exact", ROUTES) or graph.post_norms()):
        raise ValueError("circuit.level: neuron scores are a gradient method's on a model without a norm after "
                         f"attention (method {method}, {graph.model_class}); use method eap or eap_ig, or level node")
    if method == ROUTES or input != "stream":
        return _routes(model, graph, source, target, metric, method, gradient, per_position, valid, source_metric,
                       input)
    alphas = ig_points(16 if steps is None else steps, points) if method in IG_METHODS else None
    if gradient == "source":  # the pair swapped: the source's run differentiated, the target's its other end
        out = _dispatch(model, graph, target, source, source_metric or metric, method,
                      None if alphas is None else [1.0 - a for a in alphas], per_position, valid, copies, metric,
                      donor, neurons)
        return EdgeScores(out.scores, out.target, out.source, out.passes, out.neurons)
    return _dispatch(model, graph, source, target, metric, method, alphas, per_position, valid, copies, source_metric,
                     donor, neurons)


def _routes(model, graph, source, target, metric, method, gradient, per_position, valid, source_metric,
            input) -> EdgeScores:
    """information_flow_routes: the routes of the source run (its one forward gives its metric), the target's
    metric from a plain forward."""
    if method != ROUTES:
        raise ValueError(f"circuit.input: {input!r} with method {method}, whose scores take the difference of the two "
                         "runs' senders (the same under both inputs); give the ablation's donor built with "
                         "hookrun.methods.circuits.ablation.ablated, or drop input")
    if gradient != "target":
        raise ValueError(f"circuit.gradient: {gradient!r} with method {ROUTES}, which takes no gradient (its routes "
                         "are the source run's); drop gradient")
    rows = torch.arange(source["input_ids"].shape[0], device=source["input_ids"].device)
    scores, m_s = route_scores(model, graph, source, valid, per_position, input, source_metric or metric, rows)
    with torch.no_grad():
        m_t = metric(logits_of(model(**target)), rows).detach().float()
    return EdgeScores(scores, m_s.cpu(), m_t.cpu(), 2)


def _dispatch(model, graph, source, target, metric, method, alphas, per_position, valid, copies, source_metric,
              donor, neurons=False) -> EdgeScores:
    """gradient_scores, and for `exact` every edge patched exactly into the target run."""
    out = gradient_scores(model, graph, source, target, metric, method, alphas, per_position, valid, copies,
                          source_metric, donor, neurons)
    if method != "exact":
        return out
    b, t = target["input_ids"].shape[:2]
    with torch.no_grad():
        m = patch_edges(model, graph, target, out.scores, range(len(graph)), metric, copies)
    per = copies_per_forward(copies, b, t, model, graph)
    return EdgeScores(m - out.target[:, None], out.source, out.target, 2 + -(-len(graph) // per))
