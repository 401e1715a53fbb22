"""Circuits: edge attribution (EAP, EAP-IG inputs and activations) over a transformer's graph of heads, MLPs, input and logits, exact edge
patching of the largest edges, and circuits found (top n, threshold) or given (explicit edges) tested for
faithfulness against random circuits of the same size (docs/circuits.md).

    circuit: {source: clean, target: corrupt, metric: ld, method: eap_ig, steps: 16, verify: 8,
              select: {top_n: [10, 20, 40]}, circuits: {kcomp: {edges: ["a0.h1->a1.h0<k>"]}},
              features: {dictionary: sae1, layer: blocks.1, method: ig, steps: 16, top_k: 8, verify: 3}}
    c = cap.read("circuit")      # c.edges (DataFrame), c.circuits, c.faithfulness, c.graph("top_20") (networkx)
    c.features                   # the dictionary's features: sample, node (f12 | error), feature, score, exact

The parts: graph.py (the graph from the anatomy), attribute.py (edge scores), evaluate.py (exact edge patching,
circuits run with the edges outside ablated), select.py (circuits from scores, pruning), levels.py (node, neuron
and per-position circuits: `level`), acdc.py (ACDC's pruning:
`finder: acdc`), benchmark.py (the
benchmark's percent circuits, circuits by edge class, circuits from the EAP-IG code's graph files),
features.py and features_block.py (a dictionary's features as nodes: the `features` block); this module is the
`circuit:` block (its checks, its per-batch step, what it stores: its shape, senders, receivers and edge names in
the root attrs). The reader, CircuitResult, is hookrun.read.results.circuits (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

from hookrun.capture.anatomy import AnatomyError
from hookrun.capture.tokens import TokenInfo
from hookrun.config.checks import (HUGE, ConfigError, as_list, check_choice, check_differ, check_names, check_number,
                                   check_unique, either, is_int, unknown_keys)
from hookrun.format.layout import CIRCUIT, CIRCUIT_ATTR, array_key
from hookrun.methods import Method, MetricUse, emit, nonfinite_cause
from hookrun.methods.circuits.acdc import acdc_circuits
from hookrun.methods.circuits.ablation import ABLATIONS, INPUTS, Means, ablated, kept_positions
from hookrun.methods.circuits.attribute import (GRADIENTS, IG_METHODS, METHODS, POINTS, normed_delta,
                                                post_norm_inputs, sender_activations)
from hookrun.methods.circuits.benchmark import (check_by_class, check_given, check_percent, class_circuits, d_model,
                                                given_mask, percent_circuits)
from hookrun.methods.circuits.features_block import (KEY as KEY_FEATURES, FeaturePlan, batch_features, check_features,
                                                     plan_features)
from hookrun.methods.circuits.evaluate import DONORS, donor_activations, evaluate_circuits, patch_edges
from hookrun.methods.circuits.graph import Graph, GraphError, circuit_graph
from hookrun.methods.circuits.levels import (FORMS, UNITS, exact_node_scores, form, level_circuits, level_need,
                                             level_problems, node_scores, position_problems, run_circuits)
from hookrun.methods.circuits.routes import METHOD as ROUTES
from hookrun.methods.circuits.scores import edge_scores
from hookrun.methods.circuits.select import HOW, random_circuit, threshold, top_n
from hookrun.methods.metrics import MetricInputs, logits_of, unhooked
from hookrun.methods.paired import grad_rows, metric_rows, named_dictionary, paired_uses, role_problems
from hookrun.read.results.circuits import CircuitResult, load_circuit

__all__ = ["Circuit", "check_block", "circuit_graph", "edge_scores", "evaluate_circuits", "patch_edges"]

KEYS = {"source": "the role whose activations are the clean end (a key of data.text.fields)",
        "target": "the role whose activations are the corrupt end, where EAP's gradient is taken",
        "metric": "a name of the metrics block (differentiable: logit_diff, logprob, prob, loss, a function)",
        "method": "eap | eap_ig | eap_ig_activations | clean_corrupted | exact | information_flow_routes",
        "steps": "eap_ig, eap_ig_activations: interpolation steps (default 16)",
        "points": "eap_ig, eap_ig_activations: midpoint | left | right (of steps) | [alphas]: the IG points",
        "gradient": "target | source: the run whose gradient is taken and whose edges a score patches (refused "
                    "with information_flow_routes: no gradient)",
        "positions": "sum | per_position: edge scores summed over positions, or kept per position",
        "level": "edge | node | neuron | edge_position: what a selected circuit is a set of (edges; nodes: heads, "
                 "MLPs, the input; neurons: their output dimensions; (edge, position) pairs) "
                 "(docs/circuits.md#levels)",
        "donor": "same | mean | zero | mean_positional: what an ablated edge carries in a circuit's run",
        "score_donor": "same | zero | mean | mean_positional (eap, exact): what a score's edge carries in place of "
                       "the other run's sender",
        "eval_metrics": "[NAMES]: more metrics of the metrics block measured in every circuit's run, each with its "
                        "faithfulness (kl and functions reading inputs.reference compare to the source run's logits)",
        "means": "{role: ROLE, prompts: all | N}: the prompts whose senders' means mean and mean_positional take",
        "input": "stream | token_embedding: what ablating the input sender removes (token_embedding: the "
                 "positions kept, as the EAP-IG code); information_flow_routes: the input sender's activation",
        "verify": "K: exact patching of each batch's K largest edges",
        "select": "{top_n: [..], threshold: x, how: greedy | top, random: R, seed: S, prompts: all | N, "
                  "percent: [0.1, .., 100] (the benchmark's sizes: CPR, CMD), by_class: [circuit names]}",
        "circuits": "{name: {edges: [..]} | {but_from: [nodes]} | {but_into: [nodes or receivers]} | "
                    "{file: graph.json | graph.pt}}",
        "finder": "attribution | acdc: how circuits are found beside the explicit ones (acdc: ACDC's pruning, "
                  "one circuit acdc_TAU a threshold; the edge scores are stored either way)",
        "acdc": "{threshold: TAU | [TAUS], prompts: all | N, metric: NAME}: ACDC's thresholds (|change of the "
                "metric| below which an edge is removed), the prompts it measures on and its metric (default the "
                "block's; kl: KL to the source run's logits, as the original) (docs/circuits.md#acdc)",
        "copies": "edges or circuits a forward, stacked along the batch axis (0: auto)",
        "features": "{dictionary, layer, method: atp | ig, steps, top_k, verify}: a dictionary's features and its "
                    "error term as nodes, each sample's top_k stored (docs/circuits.md#feature-circuits)"}
EVAL_DONORS = (*DONORS, "mean_positional")  # a circuit's run: the target's senders, their mean, zero, by position
SCORE_DONORS = ("same", *ABLATIONS)
SELECT_KEYS = ("top_n", "threshold", "how", "random", "seed", "prompts", "percent", "by_class")
POSITIONS = ("sum", "per_position")
RESERVED, RESERVED_FORMS = ("full", "empty"), ("top_N", "random_N", "random_N_N", "threshold_N",  # names _select makes
                                                "signed_Npct", "abs_Npct", "random_Npct", "random_Npct_N", "acdc_N")
FINDERS = ("attribution", "acdc")
MAX_STEPS = 10 ** 5  # interpolation steps past any use (papers use 5 to 100); the memory estimate bounds the rest
MAX_RANDOM = 10 ** 4  # random circuits a size
AHEAD_BYTES = 2 ** 28  # the scores the faithfulness denominator's pass computes ahead and keeps (256 MiB), at most
LENGTH_FIX = ("an edge's score, (a_source - a_target) x gradient, and a circuit's run take the same position from both "
              "prompts, whatever circuit.donor: give pairs of the same token length (circuit takes no "
              "source_positions), or set circuit.source / circuit.target to roles of one length")


def check_block(spec) -> List[str]:
    """Problems with a `circuit:` block that show without the model or the data (its metric and its features'
    dictionary are checked by those methods: Circuit.metric_uses, Circuit.dictionary_uses)."""
    if not isinstance(spec, dict):
        return [f"circuit: {spec!r} is not a mapping; write circuit: {{source: clean, target: corrupt, metric: ld, "
                "method: eap_ig, select: {top_n: [10, 20]}}"]
    problems = unknown_keys("circuit", spec, KEYS, "circuit takes")
    problems += [f"circuit.{k}: missing ({KEYS[k]})" for k in ("source", "target", "metric") if k not in spec]
    method = spec.get("method", "eap")
    problems += check_choice("circuit.method", method, METHODS, either(METHODS))
    if spec.get("steps") is not None:  # null: absent (a sweep's eap block over an experiment's eap_ig one)
        if method in METHODS and method not in IG_METHODS:
            problems.append(f"circuit.steps: {spec['steps']!r} but method is {method}, which takes no steps; set "
                            "circuit.method=eap_ig (or eap_ig_activations) or drop steps ('~circuit.steps' on the command "
                            "line; circuit.steps=null in a sweep's block over an experiment that sets steps)")
        else:
            problems += check_number("circuit.steps", spec["steps"], whole=True, low=1, high=MAX_STEPS,
                                     fix="the interpolation steps, e.g. 16")
    for k in ("verify", "copies"):
        if k in spec:
            problems += check_number(f"circuit.{k}", spec[k], whole=True, low=0, high=HUGE, fix="0: none / auto")
    problems += scoring_problems(spec)
    problems += check_choice("circuit.donor", spec.get("donor", "same"), EVAL_DONORS, either(EVAL_DONORS))
    problems += ablation_problems(spec) + eval_metric_problems(spec)
    problems += check_choice("circuit.positions", spec.get("positions", "sum"), POSITIONS, either(POSITIONS))
    problems += level_problems(spec)
    problems += check_differ("circuit.source", spec.get("source"), "circuit.target", spec.get("target"),
                             "every edge's score is (a_source - a_target) x gradient = 0 whatever the donor, and every "
                             "faithfulness 0 / 0", "give two roles of data.text.fields (e.g. circuit.source=clean "
                             "circuit.target=corrupt)")
    sel = spec.get("select")
    if sel is not None:
        if not isinstance(sel, dict):
            problems.append(f"circuit.select: {sel!r} is not a mapping; write select: {{top_n: [10, 20, 40]}}")
        else:
            problems += unknown_keys("circuit.select", sel, SELECT_KEYS, "select takes")
            tn = sel.get("top_n", [])
            tn = [tn] if is_int(tn) else tn
            if not isinstance(tn, list) or any(not (is_int(n) and n >= 1) for n in tn):
                problems.append(f"circuit.select.top_n: {sel.get('top_n')!r}; give circuit sizes, integers >= 1 "
                                "(e.g. [10, 20, 40])")
            else:
                problems += check_unique("circuit.select.top_n", tn, "size")
            if "threshold" in sel:
                problems += check_number("circuit.select.threshold", sel["threshold"], low=0, high=HUGE,
                                         fix="the |mean score| an edge needs to be kept")
            problems += check_choice("circuit.select.how", sel.get("how", "greedy"), HOW, either(HOW))
            if "random" in sel:
                problems += check_number("circuit.select.random", sel["random"], whole=True, low=0, high=MAX_RANDOM,
                                         fix="random circuits a size, the baseline of each top_N")
            if "seed" in sel:
                problems += check_number("circuit.select.seed", sel["seed"], whole=True, low=0, high=2 ** 31)
            problems += check_percent(sel.get("percent")) + check_by_class(sel.get("by_class"))
            prompts = sel.get("prompts", "all")
            if prompts != "all" and not (is_int(prompts) and prompts >= 1):
                problems.append(f"circuit.select.prompts: {prompts!r}; give all or a number of prompts >= 1")
    problems += check_features(spec.get("features")) + finder_problems(spec)
    given = spec.get("circuits")
    if given is not None:
        if not isinstance(given, dict):
            problems.append(f"circuit.circuits: {given!r} is not a mapping of names to circuits; write circuits: "
                            "{kcomp: {edges: ['a0.h1->a1.h0<k>']}, no_h0: {but_from: [a1.h0]}}")
        else:
            problems += check_names("circuit.circuits", list(given), reserved=RESERVED, patterns=RESERVED_FORMS,
                                    what="a name hookrun gives its own circuits")
            for name, c in given.items():
                problems += check_given(name, c)
    return problems


def finder_problems(spec: dict) -> List[str]:
    """Problems with circuit.finder and circuit.acdc (its thresholds, its prompts)."""
    finder, block = spec.get("finder", "attribution"), spec.get("acdc")
    problems = check_choice("circuit.finder", finder, FINDERS, either(FINDERS))
    if finder == "acdc" and block is None:
        return problems + ["circuit.finder: acdc takes its thresholds; add circuit.acdc: {threshold: [0.01, 0.1]} "
                           "(the |change of the metric| below which ACDC removes an edge)"]
    if block is None:
        return problems
    if finder != "acdc":
        return problems + [f"circuit.acdc: given but circuit.finder is {finder}; set circuit.finder=acdc or drop "
                           "circuit.acdc"]
    if not isinstance(block, dict):
        return problems + [f"circuit.acdc: {block!r} is not a mapping; write acdc: {{threshold: [0.01, 0.1]}}"]
    problems += unknown_keys("circuit.acdc", block, ("threshold", "prompts", "metric"), "acdc takes")
    if "metric" in block and not isinstance(block["metric"], str):
        problems.append(f"circuit.acdc.metric: {block['metric']!r}; give a name of the metrics block, e.g. kl")
    if "threshold" not in block:
        problems.append("circuit.acdc.threshold: missing; give ACDC's threshold(s), e.g. [0.01, 0.1] (in the "
                        "metric's units)")
    taus = as_list(block.get("threshold", []))
    for t in taus:
        problems += check_number("circuit.acdc.threshold", t, low=0, high=HUGE,
                                 fix="the |change of the metric| below which an edge is removed, e.g. 0.05")
    if not problems:
        problems += check_unique("circuit.acdc.threshold", [float(t) for t in taus], "threshold")
    prompts = block.get("prompts", "all")
    if prompts != "all" and not (is_int(prompts) and prompts >= 1):
        problems.append(f"circuit.acdc.prompts: {prompts!r}; give all or a number of prompts >= 1")
    return problems


def scoring_problems(spec: dict) -> List[str]:
    """Problems with the keys that declare how edges are scored: `points` (the IG points) and `gradient` (the run
    differentiated), and `positions: per_position` with `exact`."""
    problems = check_choice("circuit.gradient", spec.get("gradient", "target"), GRADIENTS, either(GRADIENTS))
    method, points = spec.get("method", "eap"), spec.get("points")
    if points is not None:
        if method in METHODS and method not in IG_METHODS:
            problems.append(f"circuit.points: {points!r} but method is {method}, which takes no IG points; set "
                            "circuit.method=eap_ig (or eap_ig_activations) or drop points")
        elif isinstance(points, str):
            problems += check_choice("circuit.points", points, POINTS, either(POINTS) + " or a list of numbers")
        elif not isinstance(points, (list, tuple)) or not points or any(
                isinstance(a, bool) or not isinstance(a, (int, float)) for a in points):
            problems.append(f"circuit.points: {points!r}; give midpoint, left, right or a list of interpolation "
                            "points (the share of the source), e.g. [0.25, 0.75]")
    if method == ROUTES and "gradient" in spec:
        problems.append(f"circuit.gradient: {spec['gradient']!r} but method is {ROUTES}, which takes no gradient "
                        "(its routes are the source run's); drop gradient")
    if method == ROUTES and spec.get("level") == "neuron":
        problems.append(f"circuit.level: neuron with method {ROUTES}; neuron scores are a gradient method's: use "
                        "circuit.method=eap or eap_ig, or level node")
    if method == "exact" and spec.get("positions") == "per_position":
        problems.append("circuit.positions: per_position with method exact; exact patches an edge at every "
                        "position at once: use positions: sum")
    return problems


def ablation_problems(spec: dict) -> List[str]:
    """Problems with the ablation keys: score_donor (and the methods that take it), means, input."""
    problems = check_choice("circuit.score_donor", spec.get("score_donor", "same"), SCORE_DONORS,
                            either(SCORE_DONORS))
    problems += check_choice("circuit.input", spec.get("input", "stream"), INPUTS, either(INPUTS))
    method, score_donor = spec.get("method", "eap"), spec.get("score_donor", "same")
    if score_donor != "same" and method in METHODS and method not in ("eap", "exact"):
        problems.append(f"circuit.score_donor: {score_donor!r} with method {method}; an ablation at the scores' "
                        "other end is built for eap and exact: set circuit.method=eap or drop score_donor")
    means = spec.get("means")
    needs = [k for k in ("donor", "score_donor") if spec.get(k) == "mean_positional" or
             (k == "score_donor" and spec.get(k) == "mean")]
    if means is None:
        problems += [f"circuit.{k}: {spec[k]} takes the means over declared prompts; add circuit.means: {{role: "
                     "ROLE}} (a role of data.text.fields, e.g. corrupt)" for k in needs]
    elif not isinstance(means, dict) or not isinstance(means.get("role"), str):
        problems.append(f"circuit.means: {means!r}; write means: {{role: ROLE, prompts: all | N}} (the prompts "
                        "whose senders' means the mean ablations take)")
    else:
        problems += unknown_keys("circuit.means", means, ("role", "prompts"), "means takes")
        prompts = means.get("prompts", "all")
        if prompts != "all" and not (is_int(prompts) and prompts >= 1):
            problems.append(f"circuit.means.prompts: {prompts!r}; give all or a number of prompts >= 1")
    return problems


def means_problems(spec: dict, inputs) -> List[str]:
    """circuit.means.role against the data's roles (before the model)."""
    means = spec.get("means")
    if not isinstance(means, dict) or "role" not in means:
        return []
    roles = list(getattr(inputs, "roles", None) or [])
    if means["role"] in roles:
        return []
    return [f"circuit.means.role: {means['role']!r} is not a role of the data ({', '.join(roles) or 'none'}); give "
            "one of data.text.fields' roles"]


def eval_metric_problems(spec: dict) -> List[str]:
    """Problems with circuit.eval_metrics (the names themselves are checked by the metrics method)."""
    extra = spec.get("eval_metrics")
    if extra is not None and (not isinstance(extra, list) or any(not isinstance(m, str) for m in extra)):
        return [f"circuit.eval_metrics: {extra!r}; give a list of names of the metrics block, e.g. [kl, acc]"]
    return []


class EvalMetrics:
    """A circuit run's metric callable that also measures the eval metrics on the same logits: called as the
    block's metric (logits, rows) -> [N], it keeps each eval metric's values, with the source run's logits as every
    metric's reference (a kl metric: KL(source || this run)); values() gives them [B, C], ends() the source and
    target runs' own."""

    def __init__(self, job, plan, batch, skw, sinfo, tkw, tinfo, primary, names=None):
        self.metrics = {m: job.method("metrics").metrics[m] for m in (plan.eval_metrics if names is None else names)}
        self.primary, self.batch, self.kept = primary, batch, {m: [] for m in self.metrics}
        self.runs = {"source": (skw, sinfo), "target": (tkw, tinfo)}
        self.model = job.model
        with torch.no_grad():
            self.reference = logits_of(job.model(**skw))

    def _measure(self, name, logits, ids, kw, info):
        metric = self.metrics[name]
        rows = ids.tolist()
        sub = TokenInfo.of_batch(info.mask[ids], info.keep[ids], info.max_length)
        ref = TokenInfo.of_batch(self.runs["source"][1].mask[ids], self.runs["source"][1].keep[ids],
                                  info.max_length)
        fields = {k: [self.batch.fields[k][i] for i in rows] for k in metric.fields if k in self.batch.fields}
        return metric(logits, MetricInputs(sub, kw["input_ids"][ids], fields, self.reference[ids], ref,
                                           self.batch.start)).float()

    def measure(self, name: str, logits, ids):
        """[N] eval metric `name` of a source-run variant's logits (rows `ids` of the batch)."""
        return self._measure(name, logits, ids, *self.runs["source"])

    def __call__(self, logits, ids):
        skw, sinfo = self.runs["source"]
        for name in self.metrics:
            self.kept[name].append(self._measure(name, logits, ids, skw, sinfo).cpu())
        return self.primary(logits, ids)

    def values(self, n_circuits: int) -> Dict[str, torch.Tensor]:
        """{name: [B, C]} the eval metrics of the circuits' runs since the last call."""
        out = {}
        for name, parts in self.kept.items():
            v = torch.cat(parts) if parts else torch.empty(0)
            out[name] = v.reshape(n_circuits, -1).t()
            self.kept[name] = []
        return out

    def ends(self, names=None) -> Dict[str, tuple]:
        """{name: (m_source [B], m_target [B])}: the eval metrics of the plain source and target runs."""
        out = {}
        with torch.no_grad():
            logits = {r: logits_of(self.model(**kw)) for r, (kw, _) in self.runs.items()}
        for name in names or self.metrics:
            ids = torch.arange(len(logits["source"]), device=logits["source"].device)
            out[name] = tuple(self._measure(name, logits[r], ids, *self.runs[r]).cpu() for r in ("source", "target"))
        return out


@dataclass
class CircuitPlan:
    """A `circuit:` block resolved against the model and the data."""

    source: str
    target: str
    metric: str
    method: str
    steps: int
    points: object  # midpoint | left | right | [alphas]
    gradient: str
    score_donor: str
    means: Optional[dict]  # {role, prompts}
    input: str  # stream | token_embedding
    eval_metrics: List[str]
    positions: str
    donor: str
    verify: int
    copies: int
    select: dict
    given: dict
    graph: Graph = field(repr=False)
    features: Optional[FeaturePlan] = None
    circuits: Optional[List[dict]] = None  # name, kind, n, edges (indices): found at the first batch
    acdc: Optional[dict] = None  # {threshold, prompts}: finder acdc
    level: str = "edge"  # edge | node | neuron | edge_position (levels.py)


class Circuit(Method):
    """The `circuit:` block (see the module's docstring). Stores `_circuit/<metric>/scores` [samples, edges]
    (per_position: [samples, positions, edges]; the estimated change of the metric when the edge is patched),
    `.../source`, `.../target` [samples], `.../exact` [samples, edges] (verify: the exact change, NaN elsewhere) and
    `.../circuits` [samples, circuits] (the metric of each circuit's run); at level node or neuron `.../nodes`
    [samples, senders] and at neuron `.../neurons` [samples, senders, d_model] (levels.py); with `features`, `.../features.ids`,
    `.../features.scores` [samples, top_k], `.../features.error` [samples] and, verified, `.../features.exact`,
    `.../features.error_exact` (features_block.py); read back by cap.read("circuit")."""

    key = "circuit"
    help = ("`{source: ROLE, target: ROLE, metric: NAME, method: eap|eap_ig|eap_ig_activations, steps, verify, "
            "level: edge|node|neuron|edge_position, select: {top_n: [..]}, circuits: {..}, finder: attribution|acdc, "
            "acdc: {threshold: [..]}, features: {dictionary, layer, method: atp|ig, top_k, verify}}`: "
            "edge attribution, circuits' faithfulness (of edges, nodes, neurons or edges at each position) and a "
            "dictionary's features as nodes (docs/circuits.md)")
    config_errors = (GraphError,)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.plan: Optional[CircuitPlan] = None
        self.job = None
        self._cache: Dict[tuple, object] = {}

    @classmethod
    def check(cls, cfg) -> List[str]:
        spec = getattr(cfg, "circuit", None)
        return [] if spec is None else check_block(spec)

    @classmethod
    def dictionary_uses(cls, cfg) -> List[tuple]:
        """The dictionary whose features are nodes (circuit.features.dictionary)."""
        spec = getattr(cfg, cls.key, None)
        features = spec.get("features") if isinstance(spec, dict) else None
        return [(f"{KEY_FEATURES}.dictionary", features["dictionary"])] if isinstance(features, dict) and \
            "dictionary" in features else []

    @classmethod
    def metric_uses(cls, cfg) -> List[MetricUse]:
        """The block's metric, measured on the source and target runs, differentiated along the graph's edges."""
        spec = getattr(cfg, cls.key, None)
        extra = spec.get("eval_metrics") if isinstance(spec, dict) else None
        roles = tuple(spec[k] for k in ("source", "target") if isinstance(spec.get(k), str)) if extra else ()
        acdc = spec.get("acdc") if isinstance(spec, dict) and spec.get("finder") == "acdc" else None
        own = [acdc["metric"]] if isinstance(acdc, dict) and isinstance(acdc.get("metric"), str) else []
        return paired_uses(cls.key, spec, gradient=True) + [
            MetricUse(f"{cls.key}.eval_metrics", m, roles, False, "", True) for m in (extra or [])
            if isinstance(m, str)] + [MetricUse(f"{cls.key}.acdc.metric", m, (), False, "", True) for m in own]

    def data_problems(self, inputs) -> List[str]:
        """The roles against the data and, whatever the donor, every pair of one token length (an edge's score is
        taken position by position), before the model is built."""
        return (role_problems("circuit", self.spec, inputs, "circuit.source", LENGTH_FIX) +
                means_problems(self.spec, inputs) + position_problems(self.spec, inputs))

    def compile(self, job) -> None:
        """The block against the model (its graph, the edges named); the data's roles and lengths were checked
        before the model (data_problems)."""
        spec = self.spec
        try:
            graph = circuit_graph(job.model)
        except (GraphError, AnatomyError) as err:
            raise ConfigError([str(err)]) from None
        problems = plan_problems(graph, spec)
        if problems:
            raise ConfigError(problems)
        features = plan_features(job, spec["features"], named_dictionary) if spec.get("features") else None
        self.job = job
        self.plan = CircuitPlan(spec["source"], spec["target"], spec["metric"], spec.get("method", "eap"),
                                int(spec.get("steps") or 16), spec.get("points") or "midpoint",
                                spec.get("gradient", "target"), spec.get("score_donor", "same"),
                                dict(spec["means"]) if spec.get("means") else None, spec.get("input", "stream"),
                                list(spec.get("eval_metrics") or []),
                                spec.get("positions", "sum"), spec.get("donor", "same"),
                                int(spec.get("verify", 0)), int(spec.get("copies", 0)), dict(spec.get("select") or {}),
                                dict(spec.get("circuits") or {}), graph, features,
                                acdc=dict(spec["acdc"]) if spec.get("finder") == "acdc" else None,
                                level=spec.get("level", "edge"))
        if self.plan.level == "edge_position":
            self.plan.positions = "per_position"

    def memory_need(self, job) -> List[tuple]:
        """The block's parts held at once: the IG points and passes (circuit.steps), a forward of the copies stacked
        along the batch axis (circuit.copies; auto keeps ~4k tokens a forward), the senders' activations of a
        batch (data.batch_size) and the circuits' edge lists (circuit.select.random and top_n)."""
        p = self.plan
        cfg = self.cfg.data
        b, t = int(cfg.batch_size), int(cfg.text.max_length) if cfg.text else 1
        embed = job.model.get_input_embeddings() if hasattr(job.model, "get_input_embeddings") else None
        d = int(embed.weight.shape[1]) if embed is not None else 1024
        layers = p.graph.anat.n_layers
        per_token = d * layers * 4 * 24  # a block's activations and their gradients, float32
        points = len(p.points) if isinstance(p.points, (list, tuple)) else p.steps
        passes = points * ((2 * layers + 1) if p.method == "eap_ig_activations" else 1) if p.method in IG_METHODS else 1
        copies = p.copies or max(1, 4096 // max(1, b * t))
        sizes = as_list(p.select.get("top_n"))
        rounds = int(p.select.get("random", 1))
        listed = sum(int(n) for n in sizes) * (1 + rounds) + 2 * len(p.graph)
        return [(passes * 64.0, "circuit.steps", f"{passes} IG passes"),
                (float(copies) * b * t * per_token, "circuit.copies",
                 f"{copies} copies x {b} prompts x {t} tokens stacked along the batch axis"),
                (2.0 * b * t * len(p.graph.senders) * d * 4, "data.batch_size",
                 f"the senders' activations of {b} prompts"),
                (listed * 40.0 + len(sizes) * (1 + rounds) * len(p.graph), "circuit.select.random",
                 f"{len(sizes) * (1 + rounds) + 2} circuits' edge lists"), *self._acdc_need(job, t, d),
                *level_need(p.graph, p.level, b, t, d, copies)]

    def _acdc_need(self, job, t: int, d: int) -> List[tuple]:
        """finder acdc: the target senders of ACDC's prompts, held while it prunes (every prompt's, or acdc.prompts)."""
        if not self.plan.acdc:
            return []
        limit = self.plan.acdc.get("prompts", "all")
        ranges = job.inputs.ranges() if hasattr(job.inputs, "ranges") else None
        n = sum(b - a for a, b in ranges) if ranges else int(self.cfg.data.batch_size)
        n = n if limit == "all" else min(n, int(limit))
        return [(float(n) * t * len(self.plan.graph.senders) * d * 4, "circuit.acdc.prompts",
                 f"the senders of ACDC's {n} prompts")]

    # -- per batch ------------------------------------------------------------------------------------------------
    def _metrics(self, job, batch):
        p = self.plan
        metric = job.method("metrics").metrics[p.metric]
        (skw, sinfo), (tkw, tinfo) = batch.roles[p.source], batch.roles[p.target]
        return (skw, sinfo, tkw, tinfo, grad_rows(metric, tkw, tinfo, batch), metric_rows(metric, skw, sinfo, batch),
                metric_rows(metric, tkw, tinfo, batch), grad_rows(metric, skw, sinfo, batch))

    def _scores(self, job, i: int, batch):
        """The batch's EdgeScores (kept from the selection pass where it ran this batch)."""
        key = (i, batch.start, batch.stop)
        if key in self._cache:
            return self._cache[key]
        p = self.plan
        skw, sinfo, tkw, tinfo, grad, _, _, sgrad = self._metrics(job, batch)
        valid = sinfo.mask.bool() & tinfo.mask.bool()
        ig = p.method in IG_METHODS
        donor = self._score_donor(job, skw, sinfo, tkw, tinfo)
        out = edge_scores(job.model, p.graph, skw, tkw, grad, method=p.method, steps=p.steps if ig else None,
                          points=p.points if ig else None, gradient=p.gradient,
                          per_position=p.positions == "per_position", valid=valid, source_metric=sgrad,
                          donor=donor, neurons=p.level == "neuron",
                          input=p.input if p.method == ROUTES else "stream")
        if p.level in ("node", "neuron"):
            out.nodes = self._node_scores(job, out, skw, tkw, donor, sgrad if p.gradient == "source" else grad)
        self._cache[key] = out
        return out

    def _node_scores(self, job, est, skw, tkw, donor, grad) -> torch.Tensor:
        """[B, S]: each sender's score, its outgoing edges' summed (exact: its output patched alone into the
        gradient's run, one forward a sender)."""
        p = self.plan
        flat = est.scores.sum(1) if est.scores.dim() == 3 else est.scores
        if p.method != "exact":
            return node_scores(p.graph, flat)
        run, other = (skw, tkw) if p.gradient == "source" else (tkw, skw)
        with torch.no_grad():
            if donor is None:
                donor, _ = sender_activations(job.model, p.graph, other)
            m_run = est.source if p.gradient == "source" else est.target
            return exact_node_scores(job.model, p.graph, run, donor, grad, m_run, p.copies)

    def _select(self, job) -> List[dict]:
        """The circuits to evaluate: full and empty (the curve's ends), each top_n (and its random baselines), the
        threshold's and the explicit ones. Top n and threshold from the mean scores over select.prompts."""
        p = self.plan
        if p.circuits is not None:
            return p.circuits
        g, sel = p.graph, p.select
        n_edges = len(g)
        out = [dict(name="full", kind="full", n=n_edges, edges=list(range(n_edges))),
               dict(name="empty", kind="empty", n=0, edges=[])]
        sizes = sel.get("top_n", [])
        sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        ranked = bool(sizes) or "threshold" in sel or sel.get("percent") is not None  # circuits from the scores
        if ranked and p.level != "edge":
            mean = self._mean_scores(job)
            out += level_circuits(g, p.level, mean, sel, self._gap(job), d_model=mean.shape[-1] if p.level ==
                                  "neuron" else None, positions=len(mean) if p.level == "edge_position" else None)
        elif ranked:
            out += self._edge_circuits(job, sizes)
        out += acdc_circuits(job.model, g, self._acdc_runs(job), p.acdc, p.copies) if p.acdc else []
        for name, c in p.given.items():
            mask = given_mask(g, name, c)
            out.append(dict(name=str(name), kind="explicit", n=int(mask.sum()), edges=_idx(mask)))
        out += class_circuits(g, out, sel.get("by_class"))
        p.circuits = out
        return out

    def _edge_circuits(self, job, sizes: List[int]) -> List[dict]:
        """The edge-level circuits of the mean scores: each top_n with its random baselines, the threshold's and
        the percent curve's."""
        p = self.plan
        g, sel, out = p.graph, p.select, []
        mean = self._mean_scores(job)
        how, rounds, seed = sel.get("how", "greedy"), int(sel.get("random", 1)), int(sel.get("seed", 0))
        for n in sizes:
            out.append(dict(name=f"top_{n}", kind="top_n", n=n, edges=_idx(top_n(g, mean, n, how))))
            for r in range(rounds):
                out.append(dict(name=f"random_{n}" + (f"_{r}" if rounds > 1 else ""), kind="random", n=n,
                                edges=_idx(random_circuit(g, n, how, seed + r))))
        if "threshold" in sel:
            t = float(sel["threshold"])
            out.append(dict(name=f"threshold_{t:g}", kind="threshold", n=None, edges=_idx(threshold(g, mean, t))))
        # routes' scores are importances, no change of the metric: nothing to orient toward the source's
        gap = 1.0 if p.method == ROUTES else self._gap(job)
        return out + (percent_circuits(g, mean, sel, gap) if sel.get("percent") is not None else [])

    def _acdc_runs(self, job) -> List[tuple]:
        """ACDC's prompts (all, or the first acdc.prompts): a (source inputs, donor, metric) a batch."""
        p, runs, count = self.plan, [], 0
        limit = p.acdc.get("prompts", "all")
        for batch in job.inputs.batches(0):
            if limit != "all" and count >= limit:
                break
            batch = batch.to(job.device)
            skw, sinfo, tkw, tinfo, _, src, _, _ = self._metrics(job, batch)
            name = p.acdc.get("metric")
            if name:  # a metric of its own (kl: to the source run's logits), measured as eval metrics are
                ev = EvalMetrics(job, p, batch, skw, sinfo, tkw, tinfo, None, [name])
                src = lambda logits, ids, ev=ev, name=name: ev.measure(name, logits, ids)  # noqa: E731
            take = len(sinfo.mask) if limit == "all" else min(len(sinfo.mask), limit - count)
            with torch.no_grad():
                a_t, _ = sender_activations(job.model, p.graph, tkw)
                donor = self._donor(job, a_t, skw, sinfo, tkw, sinfo.mask.bool() & batch.roles[p.target][1].mask.bool())
            if take < len(sinfo.mask):
                skw = {k: v[:take] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in skw.items()}
                donor = donor[:, :take] if donor.shape[1] > 1 else donor
            runs.append((skw, donor, src))
            count += take
        return runs

    def _mean_scores(self, job) -> np.ndarray:
        """The mean score over the selection prompts (all, or the first select.prompts), batch by batch, at the
        block's level: [E] an edge's, [S] a node's, [S, D] a neuron's, [T, E] an edge's at each position."""
        limit, level = self.plan.select.get("prompts", "all"), self.plan.level
        total, count = None, 0
        for i, batch in enumerate(job.inputs.batches(0)):
            if limit != "all" and count >= limit:
                break
            batch = batch.to(job.device)
            est = self._scores(job, i, batch)
            s = {"node": est.nodes, "neuron": est.neurons}.get(level, est.scores)
            if level == "edge_position" and total is not None and s.shape[1] != total.shape[0]:
                raise GraphError("circuit.level", f"circuit.level: edge_position but batch {i} has {s.shape[1]} "
                                 f"positions where the first had {total.shape[0]}; give prompts of one token length")
            s = s.sum(1) if s.dim() == 3 and level == "edge" else s
            if limit != "all":
                s = s[:limit - count]
            total = s.double().sum(0) if total is None else total + s.double().sum(0)
            count += len(s)
        return (total / count).cpu().numpy()

    def first_batch_problems(self, job) -> List[str]:
        """The circuits selected, and the first batch's scores and metric before the store exists: NaN or inf
        (naming the array and the likely cause) and a gap of 0 on every sample (a metric that cannot tell the
        two roles apart) are refused, never stored as a `complete` run of NaN faithfulness."""
        try:
            with torch.inference_mode(False):
                self._select(job)
                batch = next(iter(job.inputs.batches(0))).to(job.device)
                est = self._scores(job, 0, batch)
        except GraphError as err:
            return [str(err)]
        p = self.plan
        for role, values in (("source", est.source), ("target", est.target), ("scores", est.scores)):
            bad = ~torch.isfinite(values)
            if bad.any():
                cause = nonfinite_cause(job.model, p.metric)
                return [f"circuit: {array_key(CIRCUIT, p.metric, role)} holds {int(bad.sum())} NaN or inf value(s) "
                        f"in the first batch (samples {batch.start}..{batch.stop - 1}); likely cause: {cause}"]
        if bool((est.source == est.target).all()):
            return [f"circuit.metric: {p.metric} is the same on {p.source!r} and {p.target!r} for every sample of the "
                    f"first batch (samples {batch.start}..{batch.stop - 1}, gap 0): every edge's score would be 0 and "
                    f"every faithfulness 0 / 0; give pairs whose answers differ (circuit.source / circuit.target "
                    f"roles that are not the same prompts), or a metric that tells them apart (metrics.{p.metric})"]
        return []

    def measure(self, job, i: int, batch, output, hookset) -> Dict[str, np.ndarray]:
        """Batch `i`'s edge scores, the verified edges' exact change and each circuit's metric, to the store."""
        p = self.plan
        with unhooked(hookset):
            circuits = self._select(job)
            gap = self._gap(job, ahead=i)  # before this batch's kept scores are dropped: they hold its two ends
            est = self._scores(job, i, batch)
            for key in [k for k in self._cache if k[0] < i or k == (i, batch.start, batch.stop)]:
                del self._cache[key]  # this batch's, and any before it (a resumed run's)
            skw, sinfo, tkw, tinfo, grad, src, tgt, _ = self._metrics(job, batch)
            arrays = {"scores": est.scores, "source": est.source, "target": est.target}
            if est.nodes is not None:
                arrays["nodes"] = est.nodes
            if est.neurons is not None:
                arrays["neurons"] = est.neurons
            if p.verify:
                arrays["exact"] = self._verify(job, est, skw, tkw, src, tgt)
            # the full circuit is the source run and the empty one under donor same the target run: no forward
            known = {c: "source" for c, spec in enumerate(circuits) if spec["kind"] == "full"}
            known.update({c: "target" for c, spec in enumerate(circuits) if spec["kind"] == "empty" and
                          p.donor == "same"})
            runs = [c for c in range(len(circuits)) if c not in known]
            runs = sorted(runs, key=lambda c: FORMS.index(form(circuits[c])))  # one circuit_metric a form
            valid = (sinfo.mask.bool() & tinfo.mask.bool())
            both = EvalMetrics(job, p, batch, skw, sinfo, tkw, tinfo, src) if p.eval_metrics else None
            with torch.no_grad():
                if runs:
                    a_t, _ = sender_activations(job.model, p.graph, tkw)
                    donor = self._donor(job, a_t, skw, sinfo, tkw, valid)
                    ran = run_circuits(job.model, p.graph, skw, donor, [circuits[c] for c in runs], both or src,
                                       p.copies)
                else:
                    ran = torch.empty((len(est.source), 0))
            ends = {"source": est.source, "target": est.target}
            arrays["circuits"] = _assemble(len(circuits), runs, ran, known, ends)
            if both is not None:
                extra, ends_extra = both.values(len(runs)), both.ends()
                arrays.update({f"circuits_{m}": _assemble(len(circuits), runs, extra[m], known,
                                                          dict(zip(("source", "target"), ends_extra[m])))
                               for m in p.eval_metrics})
            if p.features is not None:
                arrays.update(batch_features(job.model, p.features, skw, tkw, grad, src, tgt, valid))
        for role, values in arrays.items():
            emit(hookset, i, batch, CIRCUIT, p.metric, role, values, kind="circuit")
        out = {f"circuit.{c['name']}": ((arrays["circuits"][:, k] - est.target) / gap).cpu().numpy()
               for k, c in enumerate(circuits)}
        values = {f"{p.metric}.{p.source}": est.source, f"{p.metric}.{p.target}": est.target}
        if p.eval_metrics:
            for m in p.eval_metrics:
                m_s, m_t = ends_extra[m]
                values.update({f"{m}.{p.source}": m_s, f"{m}.{p.target}": m_t})
                emit(hookset, i, batch, CIRCUIT, p.metric, f"source_{m}", m_s, kind="circuit")
                emit(hookset, i, batch, CIRCUIT, p.metric, f"target_{m}", m_t, kind="circuit")
                g = self._gap_of(job, m)
                out.update({f"circuit.{c['name']}.{m}": ((arrays[f"circuits_{m}"][:, k] - m_t) / g).cpu().numpy()
                            for k, c in enumerate(circuits)})
        return {**{c: values[c].cpu().numpy() for c in self.metric_columns}, **out}

    # -- ablations (hookrun.methods.circuits.ablation) -----------------------------------------------------------
    def _means(self, job) -> Means:
        """The senders' means over the prompts of means.role (all, or the first means.prompts), once."""
        if getattr(self, "_means_value", None) is not None:
            return self._means_value
        p = self.plan
        acc, limit, count = Means(len(p.graph.senders)), p.means.get("prompts", "all"), 0
        for batch in job.inputs.batches(0):
            if limit != "all" and count >= limit:
                break
            batch = batch.to(job.device)
            kw, info = batch.roles[p.means["role"]]
            take = len(info.mask) if limit == "all" else min(len(info.mask), limit - count)
            kw = {k: v[:take] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in kw.items()}
            a, _ = sender_activations(job.model, p.graph, kw)
            kept = kept_positions(job.model, p.graph, kw) if p.input == "token_embedding" else None
            acc.add(a, info.mask[:take].bool(), kept)
            count += take
        self._means_value = acc
        return acc

    def _ablated(self, job, kind: str, kw: dict, info, a_t=None, valid=None, tkw=None) -> torch.Tensor:
        """[S, B | 1, T, D] what ablated edges carry in the run of `kw` (real tokens info.mask): `kind` over the
        declared means, or (mean without means) the batch's target senders' mean at each position."""
        p = self.plan
        kept = kept_positions(job.model, p.graph, kw) if p.input == "token_embedding" else None
        if kind == "mean" and p.means is None:
            if kept is None:
                return donor_activations("mean", a_t, valid)
            a = a_t.clone()
            a[0] = a[0] - kept_positions(job.model, p.graph, tkw)
            d = donor_activations("mean", a, valid).expand(-1, a.shape[1], -1, -1).clone()
            d[0] = d[0] + kept
            return d
        return ablated(kind, len(p.graph.senders), info.mask.bool(), kept,
                       None if kind == "zero" else self._means(job), a_t.shape[-1] if a_t is not None else
                       job.model.get_input_embeddings().weight.shape[-1])

    def _donor(self, job, a_t, skw, sinfo, tkw, valid) -> torch.Tensor:
        """What an edge outside a circuit carries in the circuit's run (the source's)."""
        p = self.plan
        if p.donor == "same" or (p.donor == "zero" and p.input == "stream"):
            return donor_activations(p.donor, a_t, valid)
        return self._ablated(job, p.donor, skw, sinfo, a_t, valid, tkw)

    def _score_donor(self, job, skw, sinfo, tkw, tinfo) -> Optional[torch.Tensor]:
        """What a score's edge carries in place of the other run's sender (None: the other run's, score_donor
        same), in the run the gradient is taken on."""
        p = self.plan
        if p.score_donor == "same":
            return None
        kw, info = (skw, sinfo) if p.gradient == "source" else (tkw, tinfo)
        return self._ablated(job, p.score_donor, kw, info)

    def _gap_of(self, job, name: str) -> float:
        """The faithfulness denominator of eval metric `name`: mean(m_source) - mean(m_target) over every prompt
        (two forwards a batch, once)."""
        gaps = self.__dict__.setdefault("_gaps", {})
        if name not in gaps:
            total, count = 0.0, 0
            for batch in job.inputs.batches(0):
                batch = batch.to(job.device)
                skw, sinfo, tkw, tinfo, *_ = self._metrics(job, batch)
                with torch.no_grad():
                    m_s, m_t = EvalMetrics(job, self.plan, batch, skw, sinfo, tkw, tinfo, None).ends([name])[name]
                total += float((m_s - m_t).double().sum())
                count += len(m_s)
            gaps[name] = total / count if total else float("nan")
        return gaps[name]

    def _gap(self, job, ahead: Optional[int] = None) -> float:
        """mean(m_source) - mean(m_target) over every prompt of the run (the faithfulness columns' denominator, so
        that their mean over a job's samples is its faithfulness), once: from the scores kept (the selection
        pass's), else, for batches `ahead` on (those the run measures next), from their scores computed now and
        kept for their measure while they fit AHEAD_BYTES, else two forwards a batch."""
        if getattr(self, "_gap_value", None) is not None:
            return self._gap_value
        total, count, held = 0.0, 0, sum(_nbytes(e) for e in self._cache.values())
        for i, batch in enumerate(job.inputs.batches(0)):
            batch = batch.to(job.device)
            kept = self._cache.get((i, batch.start, batch.stop))
            if kept is None and ahead is not None and i >= ahead and held < AHEAD_BYTES:
                kept = self._scores(job, i, batch)  # the passes its scores make measure both ends
                held += _nbytes(kept)
            if kept is not None:
                m_s, m_t = kept.source, kept.target
            else:
                skw, _, tkw, _, _, src, tgt, _ = self._metrics(job, batch)
                with torch.no_grad():
                    rows = torch.arange(batch.stop - batch.start, device=job.device)
                    m_s = src(logits_of(job.model(**skw)), rows).float().cpu()
                    m_t = tgt(logits_of(job.model(**tkw)), rows).float().cpu()
            total += float((m_s - m_t).double().sum())
            count += len(m_s)
        self._gap_value = total / count if total else float("nan")
        return self._gap_value

    def _verify(self, job, est, skw, tkw, src, tgt) -> torch.Tensor:
        """[B, E]: the exact change of the metric at the batch's K edges with the largest mean |score|, NaN
        elsewhere (patched into the run the gradient was taken on)."""
        p = self.plan
        s = est.scores.sum(1) if est.scores.dim() == 3 else est.scores
        order = torch.argsort(-s.abs().mean(0), stable=True)[:p.verify].tolist()
        with torch.no_grad():
            a_s, _ = sender_activations(job.model, p.graph, skw)
            a_t, _ = sender_activations(job.model, p.graph, tkw)
            post = p.graph.post_norms()
            if post:  # a post-norm layer's heads: their change of the norm's output in the run patched
                run = skw if p.gradient == "source" else tkw
                d = normed_delta(job.model, p.graph, post, post_norm_inputs(job.model, p.graph, run),
                                 a_t - a_s if p.gradient == "source" else a_s - a_t)
            else:
                d = a_t - a_s if p.gradient == "source" else a_s - a_t
            if p.gradient == "source":
                patched = patch_edges(job.model, p.graph, skw, d, order, src, p.copies) - est.source[:, None]
            else:
                patched = patch_edges(job.model, p.graph, tkw, d, order, tgt, p.copies) - est.target[:, None]
        out = torch.full(s.shape, float("nan"))
        out[:, order] = patched
        return out

    def columns(self) -> List[str]:
        """The two runs' metric and, a column a circuit, `circuit.<name>`: (m_circuit - m_target) of the sample
        over the run's mean gap m_source - m_target, so that a job's mean (hookrun.collect) is its faithfulness."""
        extra = [f"circuit.{c['name']}.{m}" for m in self.plan.eval_metrics for c in self._select(self.job)]
        return [*self.metric_columns, *(f"circuit.{c['name']}" for c in self._select(self.job)), *extra]

    def attrs(self) -> dict:
        p = self.plan
        a = p.graph.anat
        return {CIRCUIT_ATTR: {
            "key": array_key(CIRCUIT, p.metric, "scores"), "metric": p.metric, "source": p.source,
            "target": p.target, "method": p.method, "steps": p.steps if p.method in IG_METHODS else None,
            "points": p.points if p.method in IG_METHODS else None, "gradient": p.gradient,
            "positions": p.positions, "donor": p.donor, "verify": p.verify, "score_donor": p.score_donor,
            "means": p.means, "input": p.input, "eval_metrics": p.eval_metrics, "acdc": p.acdc, "level": p.level,
            "graph": {"n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
                      "parallel": bool(a.parallel), "mlp": any(s.kind == "mlp" for s in p.graph.senders),
                      "edges": len(p.graph), "model": a.model_class, "d_model": d_model(self.job.model),
                      **p.graph.data().stored()},
            "circuits": self._select(self.job),
            "features": None if p.features is None else p.features.attrs()}}

    @staticmethod
    def read(cap, metric: Optional[str] = None) -> "CircuitResult":
        return load_circuit(cap, metric)


def _assemble(n: int, runs: List[int], ran: torch.Tensor, known: Dict[int, str], ends: dict) -> torch.Tensor:
    """[B, n] each circuit's metric: the circuits run (columns `runs` of `ran`), the others one of the two runs'."""
    out = torch.empty((ran.shape[0] if runs else len(ends["source"]), n))
    if runs:
        out[:, runs] = ran.float().cpu()
    for c, run in known.items():
        out[:, c] = ends[run].float().cpu()
    return out


def _nbytes(est) -> int:
    """The bytes an EdgeScores holds (its scores, its two ends)."""
    return sum(t.numel() * t.element_size() for t in (est.scores, est.source, est.target))


def _idx(mask: torch.Tensor) -> List[int]:
    return [int(e) for e in torch.as_tensor(mask).nonzero().flatten().tolist()]


def plan_problems(graph: Graph, spec: dict) -> List[str]:
    """Problems of the block against the graph: verify or a circuit size larger than the graph, explicit edges and
    nodes not in it."""
    n = len(graph)
    problems = []
    method = spec.get("method", "eap")
    if graph.post_norms() and method not in ("eap", "eap_ig", "exact"):
        problems.append(f"circuit.method: {method} on {graph.model_class}, a post-norm model (a norm after "
                        "attention): eap, eap_ig and exact are built there (docs/circuits.md#post-norm-blocks); set "
                        "circuit.method=eap_ig")
    if int(spec.get("verify", 0)) > n:
        problems.append(f"circuit.verify: {spec['verify']} but the graph has {n} edges; give at most {n}")
    sizes = (spec.get("select") or {}).get("top_n", [])
    level = spec.get("level", "edge")
    units = {"edge": n, "node": len(graph.senders)}.get(level)  # neurons, pairs: checked on selecting
    for size in [sizes] if isinstance(sizes, int) else sizes if units is not None else []:
        if size > units:
            problems.append(f"circuit.select.top_n: {size} is larger than the graph ({units} {UNITS[level]} of "
                            f"{graph.model_class}); give sizes up to {units}")
    if level in ("neuron", "edge_position") and graph.post_norms():
        problems.append(f"circuit.level: {level} on {graph.model_class}, a post-norm model (a norm after attention): "
                        "its neuron and per-position circuits are not built; set circuit.level=edge or node")
    for name, c in (spec.get("circuits") or {}).items():
        try:
            given_mask(graph, name, c)
        except GraphError as err:
            problems.append(str(err))
    return problems
