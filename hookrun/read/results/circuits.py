"""The reader of a circuit run: cap.read("circuit"), a CircuitResult: the edge table (the edge names stored with the
run, read back as they are), the circuits and their faithfulness, networkx graphs and, with circuit.features, the
dictionary's feature nodes. Needs numpy, pandas (and networkx for graph()), not torch.

    c = cap.read("circuit"); c.edges; c.circuits; c.faithfulness; c.circuit("top_20"); c.graph("top_20"); c.features
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import pandas as pd

from hookrun.format.files import DamagedError, root_meta, root_problem
from hookrun.format.layout import CIRCUIT, CIRCUIT_ATTR
from hookrun.read.results.benchmark import KINDS, benchmark, by_class
from hookrun.read.results.graph import CircuitGraph
from hookrun.read.results.interchange import write_graph
from hookrun.read.results.levels import kept, node_table, selected, units as level_units


def _circuits_said(circuits: pd.DataFrame, shown: int = 6) -> str:
    """`12 circuits: full, empty, top_10, top_20, threshold, ind (and 7 random)`: the named ones (at most `shown`,
    then a count), the random ones counted; a repr's line, not the list (res.circuits has every one)."""
    named = [n for n, k in zip(circuits["name"], circuits["kind"]) if k != "random"]
    randoms = int((circuits["kind"] == "random").sum())
    listed = ", ".join(named[:shown]) + (f", ... {len(named) - shown} more" if len(named) > shown else "")
    return f"{len(circuits)} circuits: {listed}" + (f" (and {randoms} random)" if randoms else "")


@dataclass(repr=False)
class CircuitResult:
    """A circuit run read back: `edges` (the edge table with each edge's mean score, |score| rank and, verified,
    mean exact change), `scores` [samples, edges] (per_position: [samples, positions, edges]), `exact`, `source`
    and `target` [samples], `circuits` (a table: name, kind, n asked, edges kept, faithfulness, metric),
    `faithfulness` (the curve: top_n and random circuits by size, with the area under each), `circuit(name)` (its
    edge names), `graph(name)` (a networkx MultiDiGraph) and, with circuit.features, `features` (a row a sample's
    stored feature or error node: sample, node, feature, score, exact). With circuit.level (node, neuron,
    edge_position): `selected(name)` a circuit's set at its level, `nodes` the node scores, `neurons` [senders,
    d_model] the neuron scores' means, and the circuits table's `level`, `kept` (units at the level) and `edges`."""

    edges: pd.DataFrame
    scores: np.ndarray
    exact: Optional[np.ndarray]
    source: np.ndarray
    target: np.ndarray
    metrics: np.ndarray  # [samples, circuits]
    circuits: pd.DataFrame
    masks: Dict[str, np.ndarray]
    attrs: dict
    _graph: CircuitGraph = field(repr=False)
    features: Optional[pd.DataFrame] = None
    nodes: Optional[pd.DataFrame] = None  # level node / neuron: a row a sender, its mean score and rank
    neurons: Optional[np.ndarray] = None  # level neuron: [senders, d_model] the mean neuron scores

    def __repr__(self) -> str:
        a = self.attrs
        return (f"CircuitResult({a['graph']['edges']} edges, {len(self.source)} samples, {a['method']}, metric "
                f"{a['metric']!r}, {_circuits_said(self.circuits)}"
                + (f", features of {f['dictionary']} at {f['layer']} ({f['method']}, top {f['top_k']})"
                   if (f := a.get("features")) else "") + ")")

    def circuit(self, name: str) -> List[str]:
        """The edge names of a circuit."""
        return list(self.edges["name"][self.masks[name]])

    def selected(self, name: str):
        """A circuit's set at its level (hookrun.read.results.levels.selected): node names (level node), {node:
        [dims]} (neuron), a table edge, position (edge_position), edge names (edge)."""
        specs = {c["name"]: c for c in self.attrs["circuits"]}
        if name not in specs:
            raise KeyError(f"no circuit {name!r} in this run; its circuits: {', '.join(specs)}")
        return selected(specs[name], self.edges["name"].to_numpy())

    def graph(self, name: Optional[str] = None):
        """The circuit (None: the whole graph) as a networkx MultiDiGraph, each edge with its mean score; under
        grouped-query attention a key-value edge feeds each head of its group, one networkx edge a head with the
        edge's name (g.graph["edges"]: the circuit's own count, len(res.circuit(name)))."""
        mask = None if name is None else self.masks[name]
        return self._graph.to_networkx(mask, self.edges["score"].to_numpy())

    @property
    def faithfulness(self) -> pd.DataFrame:
        """top_n and random circuits by size: n, edges kept, fraction of the graph, faithfulness, random's, and
        the areas under both curves (the empty and full circuits' points included)."""
        c = self.circuits.set_index("name")
        rows = []
        for name, row in c[c.kind == "top_n"].iterrows():
            rnd = c[(c.kind == "random") & (c.n == row.n)]
            rows.append({"n": int(row.n), "edges": int(row.edges if "edges" in c else row.kept),
                         "fraction": row.n / self.units,
                         "faithfulness": row.faithfulness, "random": float(rnd.faithfulness.mean())
                         if len(rnd) else float("nan")})
        table = pd.DataFrame(rows, columns=["n", "edges", "fraction", "faithfulness", "random"])
        if len(table):
            ends = [c.loc["empty", "faithfulness"], c.loc["full", "faithfulness"]]
            f = [0.0, *table.fraction, 1.0]
            table.attrs["area"] = area(f, [ends[0], *table.faithfulness, ends[1]])
            table.attrs["area_random"] = area(f, [ends[0], *table.random, ends[1]])
        return table

    @property
    def units(self) -> int:
        """The count of the run's level (edges, nodes, neurons, (edge, position) pairs): the faithfulness curve's
        denominator."""
        a = self.attrs
        return level_units(a.get("level") or "edge", len(self._graph.senders), len(self.edges),
                           a["graph"].get("d_model"), self.scores.shape[1] if self.scores.ndim == 3 else None)

    @property
    def benchmark(self) -> Optional[pd.DataFrame]:
        """The benchmark's table (select.percent; hookrun.read.results.benchmark): a row a percentage, both curves'
        faithfulness normalised by the full and empty circuits; attrs cpr, cmd. None without select.percent."""
        return benchmark(self.attrs["circuits"], self.metrics.mean(0, dtype=np.float64))

    @property
    def by_class(self) -> Optional[pd.DataFrame]:
        """Faithfulness by edge class (q, k, v, mlp, logits) of the circuits of select.by_class: a row a (circuit,
        class); hookrun.read.results.benchmark.by_class. None without select.by_class."""
        return by_class(self.attrs["circuits"], self.metrics.mean(0, dtype=np.float64))

    @property
    def cpr(self) -> float:
        """CPR: the area under the faithfulness of the signed-score circuits at select.percent (NaN without)."""
        table = self.benchmark
        return float("nan") if table is None else table.attrs["cpr"]

    @property
    def cmd(self) -> float:
        """CMD: the area between 1 and the faithfulness of the |score| circuits at select.percent (NaN without)."""
        table = self.benchmark
        return float("nan") if table is None else table.attrs["cmd"]

    def to_json(self, path, circuit: Optional[str] = None, d_model: Optional[int] = None):
        """Write the graph as the EAP-IG code's Graph.to_json file (MIB's submission format): every edge's mean
        score and, in_graph, the circuit `circuit` (None: every edge); hookrun.read.results.interchange."""
        return self._write(path, ".json", circuit, d_model)

    def to_pt(self, path, circuit: Optional[str] = None, d_model: Optional[int] = None):
        """Write the graph as the EAP-IG code's Graph.to_pt file (needs torch); see to_json."""
        return self._write(path, ".pt", circuit, d_model)

    def _write(self, path, suffix: str, circuit: Optional[str], d_model: Optional[int]):
        if not str(path).endswith(suffix):
            raise ValueError(f"{path}: give a path ending in {suffix}")
        if circuit is not None and circuit not in self.masks:
            raise KeyError(f"no circuit {circuit!r} in this run; its circuits: {', '.join(self.masks)}")
        width = d_model if d_model is not None else self.attrs["graph"].get("d_model")
        if width is None:
            raise ValueError("this store does not hold the model's width (written before d_model was stored): "
                             "give d_model=, the model's hidden size")
        return write_graph(path, self._graph, self.edges["score"].to_numpy(),
                           None if circuit is None else self.masks[circuit], int(width))


def load_circuit(cap, metric: Optional[str] = None) -> CircuitResult:
    """A circuit run's result (KeyError for a run without one)."""
    attrs = cap.attrs.get(CIRCUIT_ATTR)
    if attrs is None or (metric is not None and metric != attrs["metric"]):
        raise KeyError(f"{cap.path} has no circuit{'' if metric is None else f' of {metric!r}'}; a run with a "
                       "circuit: block stores one")
    problem = root_problem(root_meta(cap.location))  # the attrs' checksum before the graph is built from them
    if problem:
        raise DamagedError(f"{problem}; cap.read('circuit') builds its graph from the root attr {CIRCUIT_ATTR!r}: no "
                           "result is read from it (cap.verify() lists every damaged file)")
    name = attrs["metric"]
    load = lambda role: cap.load(hook=CIRCUIT, layer=name, role=role)  # noqa: E731
    sh = attrs["graph"]
    graph = CircuitGraph.from_attrs(sh)  # as stored; a store written before the names were: rebuilt from the shape
    if len(graph) != sh["edges"]:
        raise ValueError(f"{cap.path}: the stored circuit has {sh['edges']} edges, its graph "
                         f"{'rebuilt from its shape ' if 'edge_names' not in sh else ''}{len(graph)}: written by "
                         "another hookrun")
    scores, source, target = load("scores"), load("source"), load("target")
    exact = load("exact") if attrs.get("verify") else None
    metrics = load("circuits")
    flat = scores.sum(1) if scores.ndim == 3 else scores
    edges = graph.edges.copy()
    edges["score"] = flat.mean(0)
    edges["rank"] = (-np.abs(edges["score"])).rank(method="first", na_option="bottom").astype(int)  # NaN: last
    nonfinite = int((~np.isfinite(edges["score"].to_numpy())).sum())
    if nonfinite:
        warnings.warn(f"cap.read('circuit'): {nonfinite} of {len(edges)} edges' mean scores are NaN or inf (ranked "
                      "last): a non-finite weight or metric in the run", RuntimeWarning, stacklevel=3)
    if exact is not None:
        flat_exact = exact.sum(1) if exact.ndim == 3 else exact
        seen = np.isfinite(flat_exact).sum(0)
        edges["exact"] = np.where(seen > 0, np.nansum(flat_exact, 0) / np.maximum(seen, 1), np.nan)
    m_s, m_t = float(np.mean(source)), float(np.mean(target))
    rows, masks, level = [], {}, attrs.get("level") or "edge"
    for c, spec in enumerate(attrs["circuits"]):
        mask = np.zeros(len(graph), bool)
        mask[spec["edges"]] = True
        masks[spec["name"]] = mask
        m = float(np.mean(metrics[:, c]))
        row = {"name": spec["name"], "kind": spec["kind"], "n": spec["n"], "kept": int(mask.sum()),
               "metric": m, "faithfulness": (m - m_t) / (m_s - m_t) if m_s != m_t else float("nan")}
        if level != "edge":  # the units kept at the circuit's level beside its edges
            whole = spec["kind"] in ("full", "empty")  # the run's level, all of its units or none
            row.update(level=level if whole else spec.get("level", "edge"), edges=int(mask.sum()),
                       kept=(spec["kind"] == "full") * level_units(
                           level, len(graph.senders), len(graph), sh.get("d_model"),
                           scores.shape[1] if scores.ndim == 3 else None)
                       if whole else kept(spec))
        rows.append(row)
    features = None
    if attrs.get("features"):
        samples = cap.samples["sample"].to_numpy() if len(cap.samples) else None
        features = features_table(load, attrs["features"], samples)
    nodes = node_table(graph.senders, load("nodes")) if level in ("node", "neuron") else None
    neurons = load("neurons").mean(0, dtype=np.float64) if level == "neuron" else None
    return CircuitResult(edges, scores, exact, source, target, metrics, pd.DataFrame(rows), masks, attrs, graph,
                         features, nodes, neurons)


def features_table(load: Callable[[str], np.ndarray], attrs: dict, samples: Optional[np.ndarray]) -> pd.DataFrame:
    """The stored features as a long table, a row a (sample, node): sample, node (`f<id>` or `error`), feature
    (its id; -1 for the error node), score, exact (NaN where not patched); a sample's features by |score|, then its
    error node. `samples`: cap.samples' sample numbers (None: 0..n-1)."""
    ids, scores, error = load("features.ids"), load("features.scores"), load("features.error")
    verified = bool(attrs.get("verify"))
    exact = load("features.exact") if verified else np.full(scores.shape, np.nan, np.float32)
    error_exact = load("features.error_exact") if verified else np.full(error.shape, np.nan, np.float32)
    n, k = ids.shape
    samples = np.arange(n) if samples is None or len(samples) != n else samples
    feature = np.concatenate([ids, np.full((n, 1), -1, ids.dtype)], 1).astype(np.int64)
    keep = np.concatenate([ids >= 0, np.ones((n, 1), bool)], 1)
    table = pd.DataFrame({
        "sample": np.repeat(samples, k + 1)[keep.ravel()],
        "node": np.where(feature < 0, "error", np.char.add("f", feature.astype(str)))[keep].astype(object),
        "feature": feature[keep],
        "score": np.concatenate([scores, error[:, None]], 1)[keep],
        "exact": np.concatenate([exact, error_exact[:, None]], 1)[keep]})
    return table


def area(fractions: Sequence[float], values: Sequence[float]) -> float:
    """The area under a faithfulness curve: trapezoids over the points sorted by the fraction of edges kept (the
    caller includes the empty (0) and full (1) circuits)."""
    f, v = np.asarray(fractions, float), np.asarray(values, float)
    order = np.argsort(f, kind="stable")
    f, v = f[order], v[order]
    return float(np.sum((f[1:] - f[:-1]) * (v[1:] + v[:-1]) / 2))


def summary(cap) -> dict:
    """A circuit run's numbers that are no mean over its samples, for hookrun.collect: `circuit.cpr`,
    `circuit.cmd` with select.percent ({} without; only the circuits' metric array is read)."""
    attrs = cap.attrs.get(CIRCUIT_ATTR) or {}
    if not any(c.get("kind") in KINDS for c in attrs.get("circuits") or []):
        return {}
    metrics = cap.load(hook=CIRCUIT, layer=attrs["metric"], role="circuits")
    table = benchmark(attrs["circuits"], metrics.mean(0, dtype=np.float64))
    return {} if table is None else {"circuit.cpr": table.attrs["cpr"], "circuit.cmd": table.attrs["cmd"],
                                     "circuit.cpr_random": table.attrs["cpr_random"],
                                     "circuit.cmd_random": table.attrs["cmd_random"]}
