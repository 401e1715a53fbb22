"""The circuit-discovery benchmark's side of the circuit block: a run's circuits at the benchmark's edge percentages
give CPR and CMD equal to the benchmark's loop (MIB_circuit_track/evaluation.py, transcribed here) over the
faithfulness computed here from the stored metrics; hookrun.collect gives them a column a job; a run's graph written
as the EAP-IG code's graph files (to_json, to_pt) loads in the reference's own Graph.from_json / from_pt with the
same scores and circuit; a reference graph file is a circuit a run evaluates, the same as its edges given by name."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hookrun
from hookrun.experiments.lm import causal_lm
from hookrun.methods.circuits.graph import circuit_graph
from hookrun.methods.circuits.select import prune, random_circuit
from hookrun.read.results.graph import CircuitGraph
from hookrun.read.results.interchange import read_graph, write_graph
from tests.test_circuits_run import GPT2, overrides, pairs, refusals, run_into  # noqa: F401 (pairs: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MIB_PCT = (.001, .002, .005, .01, .02, .05, .1, .2, .5, 1)  # evaluation.py's `percentages`
REPO = Path(os.environ.get("HOOKRUN_EAPIG_REPO", "/work/.mirror/hannamw+EAP-IG/repo"))  # hannamw/EAP-IG, bare


def mib_areas(faithfulnesses):
    """evaluate_area_under_curve's loop (log_scale False), transcribed."""
    area_under = area_from_1 = 0.
    for i in range(len(faithfulnesses) - 1):
        x_1, x_2 = MIB_PCT[i], MIB_PCT[i + 1]
        area_from_1 += (x_2 - x_1) * (((abs(1. - faithfulnesses[i])) + (abs(1. - faithfulnesses[i + 1]))) / 2)
        area_under += (x_2 - x_1) * ((faithfulnesses[i] + faithfulnesses[i + 1]) / 2)
    return area_under, area_from_1


PERCENT = "[0.1,0.2,0.5,1,2,5,10,20,50,100]"


def test_cpr_and_cmd_are_the_benchmarks_areas_over_the_stored_faithfulness(pairs, tmp_path):
    block = f"{{source:clean,target:corrupt,metric:ld,method:eap,select:{{percent:{PERCENT}}}}}"
    run_into(tmp_path / "run.zarr", overrides(pairs, block))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    torch.manual_seed(0)
    g = circuit_graph(causal_lm(**GPT2).eval())
    score = res.edges["score"].to_numpy()
    toward = np.sign(res.source.mean() - res.target.mean())  # signed: toward the source's metric (MIB maximises)
    means = dict(zip(res.circuits["name"], res.metrics.astype(np.float64).mean(0)))
    signed, absolute, randoms = [], [], []
    for p, frac in zip((0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100), MIB_PCT):
        n = int(frac * 110)  # curr_num_items = int(pct * n_scored_items)
        for name, s, out in ((f"signed_{p:g}pct", toward * score, signed), (f"abs_{p:g}pct", np.abs(score), absolute)):
            keep = np.zeros(110, bool)
            keep[np.argsort(-s, kind="stable")[:n]] = True  # apply_topn, then prune
            assert np.array_equal(res.masks[name], prune(g, torch.as_tensor(keep)).numpy()), name
            out.append((means[name] - means["empty"]) / (means["full"] - means["empty"]))
        rnd = random_circuit(g, n, "top", 0).numpy() if n else np.zeros(110, bool)  # select.random: 1, seed 0
        assert np.array_equal(res.masks[f"random_{p:g}pct"], rnd)
        randoms.append((means[f"random_{p:g}pct"] - means["empty"]) / (means["full"] - means["empty"]))
    cpr, _ = mib_areas(signed)
    _, cmd = mib_areas(absolute)
    t = res.benchmark
    assert list(t.n) == [0, 0, 0, 1, 2, 5, 11, 22, 55, 110]
    np.testing.assert_allclose(t.signed, signed, rtol=1e-6)
    np.testing.assert_allclose(t["abs"], absolute, rtol=1e-6)
    assert res.cpr == pytest.approx(cpr, rel=1e-9) and res.cmd == pytest.approx(cmd, rel=1e-9)
    np.testing.assert_allclose(t.random, randoms, rtol=1e-6, atol=1e-9)
    assert (t.attrs["cpr_random"], t.attrs["cmd_random"]) == pytest.approx(mib_areas(randoms), rel=1e-9)
    assert t["abs"].iloc[-1] == pytest.approx(1, abs=1e-5) and t.signed.iloc[0] == pytest.approx(0, abs=1e-6)
    assert 0 < res.cpr < 1 and 0 <= res.cmd < 1
    from hookrun.read.plots.circuit import benchmark_curves
    lines = benchmark_curves({"eap": res}).axes[0].get_lines()
    np.testing.assert_allclose(lines[0].get_ydata(), signed, rtol=1e-6)  # CPR's curve, then CMD's
    np.testing.assert_allclose(lines[1].get_ydata(), absolute, rtol=1e-6)
    np.testing.assert_allclose(lines[0].get_xdata(), MIB_PCT)
    np.testing.assert_allclose(lines[2].get_ydata(), randoms, rtol=1e-6, atol=1e-9)  # the random circuits'


def test_collect_gives_each_jobs_cpr_and_cmd(pairs, tmp_path):
    base = {"source": "clean", "target": "corrupt", "metric": "ld", "select": {"percent": [1, 10, 100]}}
    items = [o for o in overrides(pairs, "") if not o.startswith("+circuit=")]
    df = hookrun.sweep(None, {"+circuit": [{**base, "method": "eap"}, {**base, "method": "eap_ig", "steps": 2}]},
                       overrides=items, sweep_dir=tmp_path / "sweep", with_index=False)
    assert len(df) == 2
    for _, row in df.iterrows():
        res = hookrun.open(tmp_path / "sweep" / str(row.job)).read("circuit")
        t = res.benchmark
        x, f = [.01, .1, 1], t["abs"].tolist()
        assert row["circuit.cmd"] == pytest.approx(sum((x[i + 1] - x[i]) * (abs(1 - f[i]) + abs(1 - f[i + 1])) / 2
                                                       for i in range(2)), rel=1e-9)
        f = t["signed"].tolist()
        assert row["circuit.cpr"] == pytest.approx(sum((x[i + 1] - x[i]) * (f[i] + f[i + 1]) / 2 for i in range(2)),
                                                   rel=1e-9)
        assert row["circuit.cpr_random"] == pytest.approx(t.attrs["cpr_random"], rel=1e-9)


def reference_sizes(n_layers, n_heads):
    return 1 + n_layers * (n_heads + 1), n_layers * (3 * n_heads + 1) + 1  # Graph.from_model's n_forward, n_backward


def test_the_written_files_hold_the_runs_graph_and_read_back(pairs, tmp_path):
    block = "{source:clean,target:corrupt,metric:ld,method:eap,select:{top_n:[12]}}"
    run_into(tmp_path / "run.zarr", overrides(pairs, block))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    res.to_json(tmp_path / "c.json", "top_12")
    res.to_pt(tmp_path / "c.pt", "top_12")
    d = json.loads((tmp_path / "c.json").read_text())
    assert d["cfg"] == {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32}
    assert list(d["nodes"]) == ["input", *[f"a0.h{h}" for h in range(4)], "m0", *[f"a1.h{h}" for h in range(4)],
                                "m1", "logits"]
    assert set(d["edges"]) == set(res.edges["name"])  # GPT-2: the reference's names are hookrun's
    for row, keep in zip(res.edges.itertuples(), res.masks["top_12"]):
        assert d["edges"][row.name] == {"score": pytest.approx(row.score, rel=1e-6), "in_graph": bool(keep)}
    kept = set(res.edges.sender[res.masks["top_12"]])
    assert {n for n, v in d["nodes"].items() if v["in_graph"]} == kept | {"logits"}
    pt = torch.load(tmp_path / "c.pt", weights_only=True)
    assert pt["edges_scores"].shape == reference_sizes(2, 4)
    assert int(pt["edges_in_graph"].sum()) == res.masks["top_12"].sum()
    for path in (tmp_path / "c.json", tmp_path / "c.pt"):
        ref = read_graph(path)
        mask, problems = ref.circuit(CircuitGraph.from_attrs(res.attrs["graph"]))
        assert not problems and np.array_equal(mask, res.masks["top_12"])
    res.to_json(tmp_path / "all.json")  # no circuit: every edge in the graph (a submission MIB selects from)
    assert all(e["in_graph"] for e in json.loads((tmp_path / "all.json").read_text())["edges"].values())
    with pytest.raises(KeyError, match="no circuit 'top_99'"):
        res.to_json(tmp_path / "x.json", "top_99")


def test_grouped_query_and_attention_only_graphs_map_onto_the_references(tmp_path):
    gqa = CircuitGraph.of_shape(2, 4, 2, parallel=False, has_mlp=True)
    scores = np.arange(len(gqa), dtype=float) + 1
    mask = np.zeros(len(gqa), bool)
    kv = gqa.edges.index[gqa.edges.receiver == "a1.kv1<k>"][0]
    mask[[kv, len(gqa) - 1]] = True
    write_graph(tmp_path / "g.json", gqa, scores, mask, 16)
    d = json.loads((tmp_path / "g.json").read_text())
    sender = gqa.edges.sender[kv]
    copies = [f"{sender}->a1.h{h}<k>" for h in (2, 3)]  # the key-value head 1 of 2 feeds heads 2 and 3
    assert [d["edges"][c]["in_graph"] for c in copies] == [True, True]
    assert sum(d["edges"][c]["score"] for c in copies) == pytest.approx(scores[kv])
    back, problems = read_graph(tmp_path / "g.json").circuit(gqa)
    assert not problems and np.array_equal(back, mask)
    np.testing.assert_allclose(read_graph(tmp_path / "g.json").edge_scores(gqa), scores)
    attn_only = CircuitGraph.of_shape(2, 4, 4, parallel=False, has_mlp=False)
    write_graph(tmp_path / "a.json", attn_only, np.ones(len(attn_only)), None, 16)
    d = json.loads((tmp_path / "a.json").read_text())
    assert len(d["edges"]) == 110 and sum(e["in_graph"] for e in d["edges"].values()) == len(attn_only) == 81
    assert d["edges"]["input->m0"] == {"score": 0.0, "in_graph": False}
    full = CircuitGraph.of_shape(2, 4, 4, parallel=False, has_mlp=True)
    write_graph(tmp_path / "m.json", full, np.ones(len(full)), None, 16)
    _, problems = read_graph(tmp_path / "m.json").circuit(attn_only, "circuit.circuits.x.file")
    assert "circuit.circuits.x.file" in problems[0] and "input->m0" in problems[0]
    _, problems = read_graph(tmp_path / "m.json").circuit(CircuitGraph.of_shape(3, 4, 4, False, True))
    assert "2 layers of 4 heads, the model's has 3 of 4" in problems[0]
    _, problems = read_graph(tmp_path / "m.json").circuit(CircuitGraph.of_shape(2, 4, 4, True, True))
    assert "a graph of sequential blocks, the model has parallel attention and MLP" in problems[0]


def test_a_reference_graph_file_is_a_circuit_the_run_evaluates(pairs, tmp_path):
    edges = ["input->a0.h1<v>", "a0.h1->a1.h0<k>", "input->a1.h0<q>", "a1.h0->logits", "m1->logits"]
    d = {"cfg": {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32},
         "nodes": {}, "edges": {e: {"score": 1.0, "in_graph": True} for e in edges}}
    (tmp_path / "theirs.json").write_text(json.dumps(d))
    listed = "[" + ",".join(f"'{e}'" for e in edges) + "]"
    block = (f"{{source:clean,target:corrupt,metric:ld,method:eap,circuits:{{theirs:{{file:'{tmp_path}/theirs.json'}},"
             f"named:{{edges:{listed}}}}}}}")
    run_into(tmp_path / "run.zarr", overrides(pairs, block))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    # m1 -> logits has no path from the input in this circuit: pruned, as the reference's evaluate_graph prunes
    assert res.circuit("theirs") == ["input->a0.h1<v>", "input->a1.h0<q>", "a0.h1->a1.h0<k>", "a1.h0->logits"]
    c = res.circuits.set_index("name")
    assert c.loc["theirs", "metric"] == pytest.approx(c.loc["named", "metric"], rel=1e-5)


def test_bad_graph_files_are_refused_before_any_store(pairs, tmp_path):
    out = refusals(pairs, tmp_path, "{source:clean,target:corrupt,metric:ld,circuits:{"
                                    f"a:{{file:'{tmp_path}/no.json'}},b:{{file:x.csv}},c:{{file:[1]}}}},"
                                    "select:{percent:[0,5]}}")
    assert f"circuit.circuits.a.file: '{tmp_path}/no.json' is not a file" in out
    assert "circuit.circuits.b.file: 'x.csv'; give the path of a reference graph file (.json or .pt" in out
    assert "circuit.circuits.c.file: [1]" in out
    assert "circuit.select.percent: [0, 5]; give percentages of the edges in (0, 100]" in out
    out = refusals(pairs, tmp_path, "{source:clean,target:corrupt,metric:ld,select:{top_n:[4],by_class:top_4}}")
    assert "circuit.select.by_class: 'top_4'; give the names of circuits to break down" in out
    out = refusals(pairs, tmp_path, "{source:clean,target:corrupt,metric:ld,circuits:{signed_1pct:{but_from:[m0]}}}")
    assert "circuit.circuits.signed_1pct: 'signed_1pct' is a name hookrun gives its own circuits" in out
    out = refusals(pairs, tmp_path, "{source:clean,target:corrupt,metric:ld,select:{top_n:[4],by_class:[top_5]}}")
    assert "circuit.select.by_class: 'top_5' is not a circuit of the run; its circuits: full, empty, top_4" in out
    big = CircuitGraph.of_shape(3, 4, 4, False, True)
    write_graph(tmp_path / "big.json", big, np.ones(len(big)), None, 8)
    out = refusals(pairs, tmp_path,
                   f"{{source:clean,target:corrupt,metric:ld,circuits:{{a:{{file:'{tmp_path}/big.json'}}}}}}")
    assert "circuit.circuits.a.file:" in out and "a graph of 3 layers of 4 heads, the model's has 2 of 4" in out


def reference_src(tmp_path):
    """The EAP-IG code exported from its repository (skip where it or transformer_lens is not here)."""
    import importlib.util

    if not REPO.exists() or importlib.util.find_spec("transformer_lens") is None:
        pytest.skip("the EAP-IG repository (HOOKRUN_EAPIG_REPO) or transformer_lens is not here")
    out = tmp_path / "eapig"
    out.mkdir()
    archive = subprocess.run(["git", f"--git-dir={REPO}", "archive", "HEAD", "src/eap"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(out)], input=archive, check=True)
    return out / "src"


LOAD = """
import json, sys
from eap.graph import Graph
out = {}
for path in sys.argv[1:]:
    g = Graph.from_json(path) if path.endswith('.json') else Graph.from_pt(path)
    out[path] = {'edges': {n: [float(e.score), bool(e.in_graph)] for n, e in g.edges.items()},
                 'nodes': {n: bool(v.in_graph) for n, v in g.nodes.items()}, 'n': g.count_included_edges()}
    g.prune()
    out[path]['pruned'] = g.count_included_edges()
    if path.endswith('.json'):  # and the reference's own files: its top 10 |scores|, pruned
        g.apply_topn(10, True)
        g.to_json(path[:-5] + '_ref10.json')
        g.to_pt(path[:-5] + '_ref10.pt')
print(json.dumps(out))
"""


@pytest.mark.slow  # transformer_lens's import: ~20 s
def test_the_written_files_load_in_the_references_graph(pairs, tmp_path):
    src = reference_src(tmp_path)
    block = "{source:clean,target:corrupt,metric:ld,method:eap,select:{top_n:[12],percent:[5]}}"
    run_into(tmp_path / "run.zarr", overrides(pairs, block))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    paths = [res.to_json(tmp_path / "c.json", "top_12"), res.to_pt(tmp_path / "c.pt", "abs_5pct")]
    proc = subprocess.run([sys.executable, "-c", LOAD, *map(str, paths)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(src)}, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for path, name in zip(paths, ("top_12", "abs_5pct")):
        g = got[str(path)]
        assert set(g["edges"]) == set(res.edges["name"])
        for row, keep in zip(res.edges.itertuples(), res.masks[name]):
            assert g["edges"][row.name] == [pytest.approx(row.score, rel=1e-6, abs=1e-9), bool(keep)]
        assert g["n"] == g["pruned"] == int(res.masks[name].sum())  # a pruned circuit stays whole in theirs
        if path.suffix == ".json":
            assert {n for n, v in g["nodes"].items() if v} == set(res.edges.sender[res.masks[name]]) | {"logits"}
    # the reference's own files read back: its apply_topn(10) is hookrun's top 10 |scores|, pruned
    graph = CircuitGraph.from_attrs(res.attrs["graph"])
    keep = np.zeros(len(graph), bool)
    keep[np.argsort(-np.abs(res.edges["score"].to_numpy()), kind="stable")[:10]] = True
    torch.manual_seed(0)
    want = prune(circuit_graph(causal_lm(**GPT2).eval()), torch.as_tensor(keep)).numpy()
    files = [tmp_path / "c_ref10.json", tmp_path / "c_ref10.pt"]
    for path in files:
        mask, problems = read_graph(path).circuit(graph)
        assert not problems and np.array_equal(mask, want), path
    # and evaluated by a run as circuits, the same as their edges given by name
    listed = "[" + ",".join(f"'{e}'" for e in res.edges["name"][want]) + "]"
    block = (f"{{source:clean,target:corrupt,metric:ld,method:eap,circuits:{{j:{{file:'{files[0]}'}},"
             f"p:{{file:'{files[1]}'}},named:{{edges:{listed}}}}}}}")
    run_into(tmp_path / "theirs.zarr", overrides(pairs, block))
    c = hookrun.open(tmp_path / "theirs.zarr").read("circuit").circuits.set_index("name")
    assert c.loc["j", "metric"] == c.loc["p", "metric"] == pytest.approx(c.loc["named", "metric"], rel=1e-6)
    assert c.loc["j", "kept"] == int(want.sum())


def test_faithfulness_by_edge_class_divides_the_class_ablations(pairs, tmp_path):
    """select.by_class: for each class, the run with only that class's edges ablated and the run with only those
    outside the circuit ablated, evaluated here with circuit_metric on masks built by hand."""
    from hookrun.methods.circuits.evaluate import circuit_metric, donor_activations
    from hookrun.methods.circuits.attribute import sender_activations
    from tests.test_circuits_run import PAIRS, encode, ld

    block = ("{source:clean,target:corrupt,metric:ld,method:eap,select:{top_n:[12],by_class:[top_12,mine]},"
             "circuits:{mine:{edges:['input->a0.h1<v>','a0.h1->a1.h0<k>','a1.h0->logits','m1->logits']}}}")
    run_into(tmp_path / "run.zarr", overrides(pairs, block, "data.batch_size=1"))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    t = res.by_class
    assert set(t["class"]) == {"q", "k", "v", "mlp", "logits"} and set(t.circuit) == {"top_12", "mine"}
    torch.manual_seed(0)
    model = causal_lm(**GPT2).eval()
    g = circuit_graph(model)
    kinds = g.edges["kind"].to_numpy()
    masks, names = [np.ones(len(g), bool)], []
    for circuit in ("top_12", "mine"):
        for k in ("q", "k", "v", "mlp", "logits"):
            alone = kinds != k
            with_c = alone | res.masks[circuit]
            masks += [alone, with_c]
            names.append((circuit, k))
    m = []
    for clean, corrupt in PAIRS:  # the run's batches of one pair
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        a_t, _ = sender_activations(model, g, tgt)
        m.append(circuit_metric(model, g, src, donor_activations("same", a_t), torch.as_tensor(np.stack(masks)), ld))
    m = torch.cat(m).double().mean(0).numpy()
    for i, (circuit, k) in enumerate(names):
        m_k, m_ck = m[1 + 2 * i], m[2 + 2 * i]
        row = t[(t.circuit == circuit) & (t["class"] == k)].iloc[0]
        assert row.faithfulness == pytest.approx((m_ck - m_k) / (m[0] - m_k), rel=1e-4, abs=1e-5), (circuit, k)
        assert row.edges == int((res.masks[circuit] & (kinds == k)).sum()) and row.class_edges == (kinds == k).sum()
