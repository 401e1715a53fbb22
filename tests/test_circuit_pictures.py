"""The circuit picture as a reader meets it (issue 56): each edge an arrow that ends on the node it feeds (no port
beside it), a legend that says what colour, width, dash and a hollow node mean, dashes only for edges that work
against the metric (a loss metric's helpful negative scores are solid), grouped-query key-value receivers drawn into
their whole group; the sweep picture shows a job that did not complete and keeps its labels inside the axes. Built
from hookrun's own graph of a shape (graph_of_shape) with scores set here, checked on the Figure's artists."""
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from matplotlib.patches import FancyArrowPatch
from matplotlib.text import Annotation

from hookrun.methods.circuits.graph import graph_of_shape
from hookrun.read.plots import circuit as pictures


def result(L=2, H=4, KV=4, sign=1.0, chosen=None):
    """A circuit run's reader as circuit_graph reads it: the graph's edges with scores (edge e: sign * (e + 1),
    every third one of the other sign), a circuit `c` of the edges `chosen` (default: the 6 largest), and the full
    and empty circuits' metrics (a gap of the scores' sign)."""
    g = graph_of_shape(L, H, KV, parallel=False, has_mlp=True)
    edges = g.edges.copy()
    scores = sign * (np.arange(len(edges)) + 1.0)
    scores[::3] *= -1
    edges["score"] = scores
    mask = np.zeros(len(edges), bool)
    mask[chosen if chosen is not None else np.argsort(-np.abs(scores))[:6]] = True
    circuits = pd.DataFrame({"name": ["full", "empty", "c"], "kind": ["full", "empty", "explicit"],
                             "n": [len(edges), 0, int(mask.sum())], "kept": [len(edges), 0, int(mask.sum())],
                             "metric": [sign * 2.0, 0.0, sign * 1.5], "faithfulness": [1.0, 0.0, 0.75]})
    attrs = {"graph": {"n_layers": L, "n_heads": H, "n_kv_heads": KV}, "method": "eap", "metric": "ld"}
    return SimpleNamespace(edges=edges, masks={"c": mask}, attrs=attrs, circuits=circuits)


def arrows(fig):
    return [t for t in fig.axes[0].texts if isinstance(t, Annotation)]


def node_xy(fig):
    """node label -> its (x, y) on the axes."""
    return {t.get_text(): t.get_position() for t in fig.axes[0].texts if not isinstance(t, Annotation)}


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_arrows_end_on_the_node_they_feed_and_dashes_mean_against_the_metric(sign):
    res = result(sign=sign)
    fig = pictures.circuit_graph(res, "c")
    shown = res.edges[res.masks["c"]]
    drawn, nodes = arrows(fig), node_xy(fig)
    assert len(drawn) == len(shown) == 6
    for a, row in zip(drawn, shown.itertuples(index=False)):
        assert a.xy == pytest.approx(nodes[row.node]) and a.xyann == pytest.approx(nodes[row.sender])
        patch = a.arrow_patch
        assert isinstance(patch, FancyArrowPatch) and type(patch.get_arrowstyle()).__name__ == "CurveFilledB"
        dashed = patch.get_linestyle() not in ("-", "solid")
        assert dashed == (row.score * sign < 0)  # a loss metric (sign -1): its negative scores help, drawn solid
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert texts[-4:] == ["width: |score|", "dashed: works against\nthe metric", "node in the circuit", "node not in it"]
    assert {"into q", "into k", "into v", "into an MLP", "into logits"} >= set(texts[:-4]) and len(texts) > 4


def test_a_circuit_of_helpful_edges_has_no_dash_and_says_so():
    res = result()
    helpful = np.flatnonzero(res.edges["score"].to_numpy() > 0)[-5:]
    fig = pictures.circuit_graph(result(chosen=helpful), "c")
    assert all(a.arrow_patch.get_linestyle() in ("-", "solid") for a in arrows(fig))
    assert "solid: helps the metric" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_a_key_value_receiver_of_grouped_query_attention_feeds_its_whole_group():
    """H=4 heads in KV=2 groups: an edge into a1.kv1<k> ends under the middle of heads a1.h2 and a1.h3, on a
    bracket labelled kv1, and both heads are drawn in the circuit."""
    g = graph_of_shape(2, 4, 2, parallel=False, has_mlp=True)
    e = int(np.flatnonzero(g.edges["name"] == "a0.h1->a1.kv1<k>")[0])
    fig = pictures.circuit_graph(result(KV=2, chosen=[e]), "c")
    (a,), nodes = arrows(fig), node_xy(fig)
    (x2, y), (x3, _) = nodes["a1.h2"], nodes["a1.h3"]
    assert a.xy == pytest.approx(((x2 + x3) / 2, y - 0.3))
    assert "kv1" in nodes
    filled = {t.get_text() for t in fig.axes[0].texts if not isinstance(t, Annotation) and t.get_color() == "white"}
    assert filled == {"a0.h1", "a1.h2", "a1.h3"}


def test_the_sweep_picture_shows_a_failed_job_and_keeps_labels_under_the_title():
    table = pd.DataFrame([
        {"job": "0", "name": "top_4", "kind": "top_n", "n": 4, "faithfulness": 1.3, "method": "eap", "steps": None,
         "reason": ""},
        {"job": "0", "name": "random_4_0", "kind": "random", "n": 4, "faithfulness": -0.001, "method": "eap",
         "steps": None, "reason": ""},
        {"job": "1", "name": "failed", "kind": "failed", "n": 0, "faithfulness": float("nan"), "method": None,
         "steps": None, "reason": "circuit.steps: 3 with method eap"}])
    fig = pictures.faithfulness_per_job(table)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["top_4\n1.30", "failed"]  # no "random -0.00" label: the grey bar and its dots say it
    assert [t.get_text() for t in ax.get_xticklabels()] == ["job 0:\neap", "job 1\n(failed)"]
    assert ax.get_ylim()[1] >= 1.3 + 0.25  # the top label stays inside the axes, under the title
    assert "did not complete" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_grouped_query_graph_says_its_own_edge_count():
    """A circuit of one key-value edge (a0.h1->a1.kv1<k>, feeding heads a1.h2 and a1.h3) is two networkx edges,
    both with the edge's name, and the graph says it holds one circuit edge."""
    from hookrun.read.results.graph import CircuitGraph

    g = CircuitGraph.of_shape(2, 4, 2, parallel=False, has_mlp=True)
    mask = (g.edges["name"] == "a0.h1->a1.kv1<k>").to_numpy()
    nx_graph = g.to_networkx(mask)
    assert nx_graph.graph["edges"] == 1 and nx_graph.number_of_edges() == 2
    assert sorted((u, v, d["name"]) for u, v, d in nx_graph.edges(data=True)) == [
        ("a0.h1", "a1.h2", "a0.h1->a1.kv1<k>"), ("a0.h1", "a1.h3", "a0.h1->a1.kv1<k>")]
    assert g.to_networkx().graph["edges"] == len(g.edges)


def test_a_circuit_results_repr_counts_its_random_circuits():
    from hookrun.read.results.circuits import CircuitResult

    names = ["full", "empty", *(f"top_{n}" for n in (5, 10, 20, 50, 100, 200, 500)), "mine"]
    kinds = ["full", "empty", *["top_n"] * 7, "explicit"]
    names += [f"random_{n}_{i}" for n in (5, 10) for i in range(20)]
    kinds += ["random"] * 40
    circuits = pd.DataFrame({"name": names, "kind": kinds})
    fake = SimpleNamespace(attrs={"graph": {"edges": 110}, "method": "eap", "metric": "ld"}, source=np.zeros(8),
                           circuits=circuits)
    text = CircuitResult.__repr__(fake)
    assert text == ("CircuitResult(110 edges, 8 samples, eap, metric 'ld', 50 circuits: full, empty, top_5, top_10, "
                    "top_20, top_50, ... 4 more (and 40 random))")
