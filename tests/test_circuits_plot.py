"""`python -m hookrun.plot` on a circuit run and on a sweep of circuit runs: the PNGs it writes hold the layered
circuit graph (the circuit it names, its edges coloured by receiver input and widest where |score| is largest),
the faithfulness curve against the random baseline, and each job's faithfulness; checked from the Figures against
cap.read("circuit") and the PNGs' pixel sizes against those Figures."""
import matplotlib.image as mpimg
import numpy as np
import pytest
from matplotlib.text import Annotation

import hookrun
from hookrun.read import plots as plot
from hookrun.read.plots import circuit as pictures
from tests.test_circuits_run import overrides, pairs, run_into  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread

BLOCK = ("{source:clean,target:corrupt,metric:ld,method:eap,select:{top_n:[5,20],random:2},"
         "circuits:{k_of_h0:{edges:['a0.h1->a1.h0<k>','input->a0.h1<v>','a1.h0->logits']}}}")
NODES = {"input", "logits", "m0", "m1", *(f"a{layer}.h{h}" for layer in range(2) for h in range(4))}


def drawn(fig):
    """(the edges drawn: Annotations, the node labels) of a circuit_graph Figure."""
    ax = fig.axes[0]
    arrows = [t for t in ax.texts if isinstance(t, Annotation)]
    return arrows, {t.get_text() for t in ax.texts if not isinstance(t, Annotation)}


def same_size(png, fig, dpi=100):
    height, width = mpimg.imread(png).shape[:2]
    expected = fig.get_size_inches() * dpi
    assert abs(width - expected[0]) < 1 and abs(height - expected[1]) < 1


@pytest.mark.slow
def test_plot_draws_a_circuit_runs_graph_and_faithfulness_curve(pairs, tmp_path, capsys):
    store = tmp_path / "run.zarr"
    run_into(store, overrides(pairs, BLOCK))
    assert plot.main([str(store), "--out", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out.split()
    names = ["stats.png", "circuit.png", "circuit-k_of_h0.png", "faithfulness.png"]
    assert printed == [str(tmp_path / "plots" / n) for n in names]
    cap = hookrun.open(store)
    res = cap.read("circuit")
    figures = {name: make() for make, name in pictures.pictures(cap)}
    assert list(figures) == names[1:]
    for name, fig in figures.items():
        same_size(tmp_path / "plots" / name, fig)

    # circuit.png: the smallest top-n circuit reaching 0.9, else the most faithful one (chosen here by hand)
    c = res.circuits.set_index("name")
    top = c[c.kind == "top_n"].sort_values("n")
    good = top[top.faithfulness >= 0.9]
    shown = good.index[0] if len(good) else top.faithfulness.idxmax()
    arrows, labels = drawn(figures["circuit.png"])
    assert labels == NODES
    edges = res.edges[res.masks[shown]]
    assert len(arrows) == len(edges) == c.loc[shown, "kept"]
    colours = sorted(tuple(a.arrow_patch.get_edgecolor()[:3]) for a in arrows)
    from matplotlib.colors import to_rgb
    assert colours == sorted(to_rgb(pictures.KIND_COLOURS[k]) for k in edges["kind"])
    widths = np.array([a.arrow_patch.get_linewidth() for a in arrows])
    assert widths.max() == pytest.approx(0.4 + 5.6) and widths.argmax() == int(np.argmax(np.abs(edges["score"])))
    ax = figures["circuit.png"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["input", "layer 0", "layer 1", "logits"]
    assert f"circuit {shown}: {int(c.loc[shown, 'kept'])} of 110 edges, faithfulness " \
           f"{c.loc[shown, 'faithfulness']:.3f}" in ax.get_title()

    # circuit-k_of_h0.png: the explicit circuit's three edges, a v, a k and a logits edge
    arrows, _ = drawn(figures["circuit-k_of_h0.png"])
    assert sorted(tuple(a.arrow_patch.get_edgecolor()[:3]) for a in arrows) == \
        sorted(to_rgb(pictures.KIND_COLOURS[k]) for k in ("v", "k", "logits"))

    # faithfulness.png: the top-n curve and the random circuits' mean, from the empty circuit to the full one
    ax = figures["faithfulness.png"].axes[0]
    top_line, random_line = ax.get_lines()[:2]
    ends = [c.loc["empty", "faithfulness"], c.loc["full", "faithfulness"]]
    np.testing.assert_allclose(top_line.get_xdata(), [0, 5 / 110, 20 / 110, 1])
    np.testing.assert_allclose(top_line.get_ydata(), [ends[0], c.loc["top_5", "faithfulness"],
                                                      c.loc["top_20", "faithfulness"], ends[1]])
    randoms = [c.loc[[f"random_{n}_0", f"random_{n}_1"], "faithfulness"].mean() for n in (5, 20)]
    np.testing.assert_allclose(random_line.get_ydata(), [ends[0], *randoms, ends[1]])
    assert ax.get_xlabel() == "circuit size: fraction of the graph's 110 edges"
    assert ax.get_ylabel().startswith("faithfulness")
    assert len(ax.collections[0].get_offsets()) == 4  # a dot per random circuit

    # a large circuit is drawn by its `most` largest edges, and the title says so
    arrows, _ = drawn(pictures.circuit_graph(res, "full", most=10))
    assert len(arrows) == 10
    largest = np.sort(np.abs(res.edges["score"].to_numpy()))[-10:]
    assert sorted(a.arrow_patch.get_linewidth() for a in arrows) == pytest.approx(
        0.4 + 5.6 * largest / largest.max())
    assert "the 10 largest drawn" in pictures.circuit_graph(res, "full", most=10).axes[0].get_title()


@pytest.mark.slow
def test_plot_draws_each_jobs_faithfulness_of_a_circuit_sweep(pairs, tmp_path, capsys):
    base = {"source": "clean", "target": "corrupt", "metric": "ld", "select": {"top_n": [4], "random": 2}}
    items = [o for o in overrides(pairs, "") if not o.startswith("+circuit=")]
    hookrun.sweep(None, {"+circuit": [{**base, "method": "eap"}, {**base, "method": "eap_ig", "steps": 2}]},
                  overrides=items, sweep_dir=tmp_path / "sweep", with_index=False)
    assert plot.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "plots")]) == 0
    assert str(tmp_path / "plots" / "circuits.png") in capsys.readouterr().out.split()
    table = pictures.sweep_circuits(tmp_path / "sweep")
    assert list(table.job) == ["0"] * 5 + ["1"] * 5 and list(table.method) == ["eap"] * 5 + ["eap_ig"] * 5
    fig = pictures.faithfulness_per_job(table, plot._override_labels(tmp_path / "sweep"))
    same_size(tmp_path / "plots" / "circuits.png", fig)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    expected = []
    for job in ("0", "1"):  # each job's top_4 bar, then its random circuits' mean, as its reader computes them
        c = hookrun.open(tmp_path / "sweep" / job).read("circuit").circuits.set_index("name")
        expected += [c.loc["top_4", "faithfulness"], c.loc[["random_4_0", "random_4_1"], "faithfulness"].mean()]
    np.testing.assert_allclose(heights, expected, rtol=1e-5, atol=1e-6)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["job 0:\ncircuit.method=eap\ncircuit.steps=-",
                                                            "job 1:\ncircuit.method=eap_ig\ncircuit.steps=2"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"top_n", "random"}
