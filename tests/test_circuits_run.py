"""The circuit: block end to end: a run's stored edge scores, verified edges and circuits' metric equal the plain
functions (hookrun.methods.circuits) run here on the same pairs; cap.read("circuit") gives the edge table, the
circuits, the faithfulness curve and networkx graphs; a killed run resumed is bitwise the whole run; bad blocks
are refused before any store (exit 2 on the command line)."""
import json
import os

import numpy as np
import pytest
import torch

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import causal_lm, tokenizer
from hookrun.methods.circuits.attribute import sender_activations
from hookrun.methods.circuits.scores import edge_scores
from hookrun.methods.circuits.evaluate import circuit_metric, donor_activations, patch_edges
from hookrun.methods.circuits.graph import circuit_graph
from tests.helpers import make_cfg

PAIRS = [("the hooks run on a model", "the hooks run on a store"),
         ("a store of captures", "a store of hooks"),
         ("every layer writes an array", "every layer writes a model"),
         ("tokens of the model", "tokens of the store"),
         ("the model writes", "the store writes")]
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4}
LD = "+metrics.ld={metric:logit_diff,a:' model',b:' store'}"


def fail_at(logits, inputs, a=5, b=7):
    """A differentiable metric (logit a - logit b at the last real token) that fails at sample 4 when asked for
    4 copies of it or more (the forward of its batch's 4 circuits that run: after the passes before the store)."""
    if os.environ.get("HOOKRUN_TEST_FAIL_AT") == str(inputs.sample_start) and len(logits) >= 4:
        raise RuntimeError("failing on purpose")
    cols = inputs.info.first + inputs.info.lengths - 1
    rows = torch.arange(len(cols))
    return logits[rows, cols, a] - logits[rows, cols, b]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x}) + "\n" for c, x in PAIRS))
    return path


def overrides(path, block, *extra):
    return ["+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in GPT2.items()), f"data.text.files=[{path}]",
            "data.text.fields={clean:clean,corrupt:corrupt}", "data.batch_size=2", "hooks.resid=null", LD,
            f"+circuit={block}", *extra]


def run_into(path, items):
    from hookrun.engine.runner import run

    return run(make_cfg([*items, f"store.path={path}"]))


def encode(texts):
    tok = tokenizer()
    return torch.tensor([[tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"] for t in texts])


def ld(logits, rows):
    tok = tokenizer()
    a, b = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (" model", " store"))
    return logits[:, -1, a] - logits[:, -1, b]


def declared_run(pairs, tmp_path, block, *extra):
    """(cap.read("circuit"), the run's model rebuilt as the run built it, its graph) of a run of the circuit
    BLOCK on the pairs file, for a test to compare with the plain functions."""
    run_into(tmp_path / "run.zarr", overrides(pairs, block, *extra))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    torch.manual_seed(0)
    model = causal_lm(**GPT2).eval()
    return res, model, circuit_graph(model)


def test_a_circuit_run_equals_the_plain_functions(pairs, tmp_path):
    block = ("{source:clean,target:corrupt,metric:ld,method:eap_ig,steps:3,verify:4,select:{top_n:[5,20],random:2},"
             "circuits:{k_of_h0:{edges:['a0.h1->a1.h0<k>','input->a0.h1<v>','a1.h0->logits']},"
             "no_m0:{but_from:[m0]}}}")
    run_into(tmp_path / "run.zarr", overrides(pairs, block, "data.batch_size=1"))
    cap = hookrun.open(tmp_path / "run.zarr")
    res = cap.read("circuit")
    torch.manual_seed(0)
    model = causal_lm(**GPT2).eval()
    g = circuit_graph(model)
    assert len(res.edges) == len(g) and list(res.edges["name"]) == g.names
    scores, exact, circ = [], [], []
    masks = torch.stack([torch.as_tensor(res.masks[n]) for n in res.circuits["name"]])
    for clean, corrupt in PAIRS:  # the run's batches of one pair
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        est = edge_scores(model, g, src, tgt, ld, method="eap_ig", steps=3)
        scores.append(est.scores)
        top = torch.argsort(-est.scores.abs().mean(0), stable=True)[:4].tolist()
        a_s, _ = sender_activations(model, g, src)
        a_t, _ = sender_activations(model, g, tgt)
        e = torch.full(est.scores.shape, float("nan"))
        e[:, top] = patch_edges(model, g, tgt, a_s - a_t, top, ld) - est.target[:, None]
        exact.append(e)
        circ.append(circuit_metric(model, g, src, donor_activations("same", a_t), masks, ld))
    np.testing.assert_allclose(res.scores, torch.cat(scores).numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(res.exact, torch.cat(exact).numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(res.metrics, torch.cat(circ).numpy(), rtol=1e-4, atol=1e-5)
    c = res.circuits.set_index("name")
    assert c.loc["full", "faithfulness"] == pytest.approx(1, abs=1e-5)
    assert c.loc["empty", "faithfulness"] == pytest.approx(0, abs=1e-4)
    assert list(c.kind) == ["full", "empty", "top_n", "random", "random", "top_n", "random", "random",
                            "explicit", "explicit"]
    assert res.circuit("k_of_h0") == ["input->a0.h1<v>", "a0.h1->a1.h0<k>", "a1.h0->logits"]  # graph order
    assert c.loc["no_m0", "kept"] == len(g) - int((res.edges.sender == "m0").sum())
    f = res.faithfulness
    assert list(f.n) == [5, 20] and {"area", "area_random"} <= set(f.attrs)
    # the top-n circuits were selected from the mean scores over every prompt
    from hookrun.methods.circuits.select import top_n
    assert np.array_equal(res.masks["top_20"], top_n(g, res.edges["score"].to_numpy(), 20).numpy())
    net = res.graph("top_20")
    assert net.number_of_edges() >= c.loc["top_20", "kept"] and "logits" in net
    assert cap.samples["ld.clean"].to_numpy() == pytest.approx(res.source)


def test_an_eap_ig_activations_run_stores_what_the_function_gives(pairs, tmp_path):
    """method: eap_ig_activations in a run: the stored scores are edge_scores' on the same pairs, the method and its
    steps in the attrs; a bad steps or a misspelt method is refused before any store."""
    block = "{source:clean,target:corrupt,metric:ld,method:eap_ig_activations,steps:2,select:{top_n:[6]}}"
    res, model, g = declared_run(pairs, tmp_path, block)
    assert res.attrs["method"] == "eap_ig_activations" and res.attrs["steps"] == 2
    want = [edge_scores(model, g, {"input_ids": encode([c])}, {"input_ids": encode([x])}, ld,
                        method="eap_ig_activations", steps=2).scores for c, x in PAIRS]
    np.testing.assert_allclose(res.scores, torch.cat(want).numpy(), rtol=1e-4, atol=1e-6)
    assert not np.allclose(res.scores, 0)
    for bad, said in (("method:eap_ig_activations,steps:0",
                       "circuit.steps: 0 is too small; give an integer in [1, 100_000] (the interpolation steps"),
                      ("method:eap_ig_activation,steps:2", "circuit.method: 'eap_ig_activation' is unknown; use "
                                                           "eap, eap_ig, eap_ig_activations, clean_corrupted, exact or "
                                                           "information_flow_routes")):
        out = refusals(pairs, tmp_path, f"{{source:clean,target:corrupt,metric:ld,{bad}}}")
        assert said in out and "which takes no steps" not in out


def test_one_declared_run_is_the_reference_pipeline(pairs, tmp_path):
    """gradient: source, points: left: the EAP-IG code's EAP-IG-inputs scores (the gradient on the clean run,
    corrupted - clean; tests/test_circuits_reference.py checks the function against its loop), the verified edges
    patched into the clean run, and the circuits evaluated on the clean run with the corrupted donor, in one run;
    the attrs say how the scores were taken."""
    block = ("{source:clean,target:corrupt,metric:ld,method:eap_ig,steps:2,points:left,gradient:source,verify:3,"
             "select:{top_n:[5]}}")
    res, model, g = declared_run(pairs, tmp_path, block, "data.batch_size=1")
    assert res.attrs["points"] == "left" and res.attrs["gradient"] == "source"
    masks = torch.stack([torch.as_tensor(res.masks[n]) for n in res.circuits["name"]])
    scores, exact, circ = [], [], []
    for clean, corrupt in PAIRS:
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        est = edge_scores(model, g, src, tgt, ld, method="eap_ig", steps=2, points="left", gradient="source")
        scores.append(est.scores)
        top = torch.argsort(-est.scores.abs().mean(0), stable=True)[:3].tolist()
        a_s, _ = sender_activations(model, g, src)
        a_t, _ = sender_activations(model, g, tgt)
        e = torch.full(est.scores.shape, float("nan"))
        e[:, top] = patch_edges(model, g, src, a_t - a_s, top, ld) - est.source[:, None]
        exact.append(e)
        circ.append(circuit_metric(model, g, src, donor_activations("same", a_t), masks, ld))
    np.testing.assert_allclose(res.scores, torch.cat(scores).numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(res.exact, torch.cat(exact).numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(res.metrics, torch.cat(circ).numpy(), rtol=1e-4, atol=1e-5)
    from hookrun.methods.circuits.select import top_n
    assert np.array_equal(res.masks["top_5"], top_n(g, res.edges["score"].to_numpy(), 5).numpy())
    for bad, said in (("method:eap,points:left", "circuit.points: 'left' but method is eap, which takes no IG points"),
                      ("method:eap,gradient:clean", "circuit.gradient: 'clean' is unknown")):
        out = refusals(pairs, tmp_path, f"{{source:clean,target:corrupt,metric:ld,{bad}}}")
        assert said in out, out


def test_ablations_declared_in_a_run(pairs, tmp_path):
    """score_donor mean_positional over the means of a declared role, donor zero, input token_embedding: the stored
    scores and circuits equal the functions with the donors built here from the same prompts."""
    from hookrun.methods.circuits.ablation import Means, ablated, kept_positions

    block = ("{source:clean,target:corrupt,metric:ld,method:eap,gradient:source,score_donor:mean_positional,"
             "means:{role:corrupt},donor:zero,input:token_embedding,select:{top_n:[5]}}")
    res, model, g = declared_run(pairs, tmp_path, block, "data.batch_size=1")
    assert res.attrs["score_donor"] == "mean_positional" and res.attrs["means"] == {"role": "corrupt"}
    acc = Means(len(g.senders))
    for _, corrupt in PAIRS:
        x = {"input_ids": encode([corrupt])}
        acc.add(sender_activations(model, g, x)[0], torch.ones(x["input_ids"].shape, dtype=torch.bool),
                kept_positions(model, g, x))
    masks = torch.stack([torch.as_tensor(res.masks[n]) for n in res.circuits["name"]])
    scores, circ = [], []
    for clean, corrupt in PAIRS:
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        valid, kept = torch.ones(src["input_ids"].shape, dtype=torch.bool), kept_positions(model, g, src)
        scores.append(edge_scores(model, g, src, tgt, ld, gradient="source",
                                  donor=ablated("mean_positional", len(g.senders), valid, kept, acc)).scores)
        circ.append(circuit_metric(model, g, src, ablated("zero", len(g.senders), valid, kept), masks, ld))
    np.testing.assert_allclose(res.scores, torch.cat(scores).numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(res.metrics, torch.cat(circ).numpy(), rtol=1e-4, atol=1e-5)
    for bad, said in (("score_donor:mean", "circuit.score_donor: mean takes the means over declared prompts"),
                      ("method:eap_ig,score_donor:zero", "an ablation at the scores' other end is built for eap"),
                      ("means:{role:noisy},donor:mean", "circuit.means.role: 'noisy' is not a role of the data"),
                      ("input:embed", "circuit.input: 'embed' is unknown")):
        out = refusals(pairs, tmp_path, f"{{source:clean,target:corrupt,metric:ld,{bad}}}")
        assert said in out, out


def test_eval_metrics_read_the_clean_run_and_each_has_its_faithfulness(pairs, tmp_path):
    """eval_metrics [kl, acc]: every circuit's run measured also by KL(clean || circuit run) and by the agreement of
    its top token with the clean run's (compare.clean_top1), each stored [samples, circuits] and with a faithfulness
    column a circuit; here against the circuits' logits taken with a metric that keeps them."""
    from hookrun.methods.circuits.compare import clean_top1

    block = "{source:clean,target:corrupt,metric:ld,eval_metrics:[kl,acc],select:{top_n:[5]}}"
    run_into(tmp_path / "run.zarr", overrides(pairs, block, "+metrics.kl={metric:kl}",
                                              "+metrics.acc={_target_:hookrun.methods.circuits.compare.clean_top1}"))
    cap = hookrun.open(tmp_path / "run.zarr")
    res = cap.read("circuit")
    kl, acc = (cap.load(hook="_circuit", layer="ld", role=f"circuits_{m}") for m in ("kl", "acc"))
    torch.manual_seed(0)
    model = causal_lm(**GPT2).eval()
    g = circuit_graph(model)
    masks = torch.stack([torch.as_tensor(res.masks[n]) for n in res.circuits["name"]])
    want_kl, want_acc, ends = [], [], []
    for clean, corrupt in PAIRS:
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        with torch.no_grad():
            ref = model(**src).logits[:, -1]
            x = model(**tgt).logits[:, -1]
        a_t, _ = sender_activations(model, g, tgt)
        kept = []
        circuit_metric(model, g, src, donor_activations("same", a_t), masks,
                       lambda logits, rows: kept.append(logits[:, -1].clone()) or ld(logits, rows))
        last = torch.cat(kept)  # [C, V]
        p = torch.log_softmax(ref, -1)
        want_kl.append((p.exp() * (p - torch.log_softmax(last, -1))).sum(-1)[None])
        want_acc.append((last.argmax(-1) == ref.argmax(-1)).float()[None])
        ends.append(float((p.exp() * (p - torch.log_softmax(x, -1))).sum()))
    np.testing.assert_allclose(np.asarray(kl), torch.cat(want_kl).numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acc), torch.cat(want_acc).numpy())
    samples = cap.samples
    np.testing.assert_allclose(samples["kl.corrupt"], ends, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(samples["kl.clean"], 0, atol=1e-6)
    full = list(res.circuits["name"]).index("full")
    assert samples["circuit.full.kl"].mean() == pytest.approx(1, abs=1e-5)
    gap = 0 - np.mean(ends)
    np.testing.assert_allclose(samples["circuit.top_5.kl"], (torch.cat(want_kl)[:, list(res.circuits["name"])
                                                              .index("top_5")].numpy() - ends) / gap, rtol=1e-4)
    assert np.all(np.asarray(acc)[:, full] == 1) and callable(clean_top1)
    out = refusals(pairs, tmp_path, "{source:clean,target:corrupt,metric:ld,eval_metrics:kl}")
    assert "circuit.eval_metrics: 'kl'; give a list of names" in out


def test_a_circuit_run_killed_and_resumed_equals_the_whole_run(pairs, tmp_path, monkeypatch):
    from tests.helpers import same_store

    items = overrides(pairs, "{source:clean,target:corrupt,metric:f,method:eap_ig,steps:2,verify:3,"
                             "select:{top_n:[10],random:3}}", "store.commit_s=0",
                      "+metrics.f={_target_:tests.test_circuits_run.fail_at}")
    run_into(tmp_path / "whole.zarr", items)
    monkeypatch.setenv("HOOKRUN_TEST_FAIL_AT", "4")
    with pytest.raises(Exception, match="failing on purpose"):
        run_into(tmp_path / "cut.zarr", items)
    assert hookrun.open(tmp_path / "cut.zarr").read("circuit").scores.shape[0] == 4
    monkeypatch.delenv("HOOKRUN_TEST_FAIL_AT")
    run_into(tmp_path / "cut.zarr", [*items, "store.mode=resume"])
    whole, cut = hookrun.open(tmp_path / "whole.zarr"), hookrun.open(tmp_path / "cut.zarr")
    same_store(whole, cut)
    a, b = whole.read("circuit"), cut.read("circuit")
    for name in ("scores", "exact", "metrics", "source", "target"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.circuits.equals(b.circuits)


def refusals(pairs, tmp_path, block, *extra):
    with pytest.raises(ConfigError) as err:
        run_into(tmp_path / "bad.zarr", overrides(pairs, block, *extra))
    assert not (tmp_path / "bad.zarr").exists()
    return "\n".join(err.value.problems)


def test_bad_circuit_blocks_are_refused_before_any_store(pairs, tmp_path, cli):
    out = refusals(pairs, tmp_path, "{source:clean,target:corrupt,metric:r,method:eap,steps:4,verify:-1,donor:x,"
                                    "select:{top_n:[0],how:best}}", "+metrics.r={metric:rank,target:' model'}")
    assert "circuit.metric: r is a rank metric, which has no useful gradient" in out
    assert "circuit.steps: 4 but method is eap, which takes no steps" in out
    assert "circuit.verify: -1" in out and "circuit.donor" in out and "circuit.select.how" in out
    assert "circuit.select.top_n: [0]; give circuit sizes, integers >= 1" in out
    out = refusals(pairs, tmp_path, "{source:clean,target:clean,metric:ld}")
    assert "circuit.target: 'clean' is also circuit.source" in out
    out = refusals(pairs, tmp_path, "{source:clean,target:corrupt,metric:ld,verify:1000,select:{top_n:[5,999]},"
                                    "circuits:{bad:{edges:['a0.h1->a1.h0<j>']},gone:{but_from:[a7.h0]}}}")
    assert "circuit.verify: 1000 but the graph has 110 edges; give at most 110" in out
    assert "circuit.select.top_n: 999 is larger than the graph (110 edges of GPT2LMHeadModel)" in out
    assert "circuit.circuits.bad.edges: 'a0.h1->a1.h0<j>' is not an edge of the graph" in out
    assert "nearest: a0.h1->a1.h0<v>, a0.h1->a1.h0<q>, a0.h1->a1.h0<k>" in out
    assert "circuit.circuits.gone: 'a7.h0' is not a sender of the graph" in out
    out = refusals(pairs, tmp_path, "{source:clean,target:nothing,metric:ld}")
    assert "circuit.target: 'nothing' is not a role of the data (clean, corrupt)" in out
    proc = cli(*overrides(pairs, "{source:clean,target:corrupt,metric:ld,method:acdc}"),
               f"hydra.run.dir={tmp_path}/cli", check=False)
    assert proc.returncode == 2 and "circuit.method: 'acdc'" in proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("zarr.json"))


@pytest.mark.slow
def test_a_sweep_over_method_steps_and_size_collects_faithfulness_per_job(pairs, tmp_path):
    """hookrun.sweep over four (method, steps) blocks x two circuit sizes: one DataFrame, a row a job, whose
    circuit.top_<n> column is that job's faithfulness as cap.read('circuit') computes it."""
    base = {"source": "clean", "target": "corrupt", "metric": "ld", "select": {"random": 1}}
    blocks = [{**base, "method": "eap"}, {**base, "method": "eap_ig", "steps": 2},
              {**base, "method": "eap_ig", "steps": 6}, {**base, "method": "eap_ig_activations", "steps": 2}]
    items = [o for o in overrides(pairs, "") if not o.startswith("+circuit=")]
    df = hookrun.sweep(None, {"+circuit": blocks, "+circuit.select.top_n": [[4], [12]]}, overrides=items,
                       sweep_dir=tmp_path / "sweep", with_index=False)
    assert len(df) == 8 and set(df.status) == {"complete"}
    for _, row in df.iterrows():
        res = hookrun.open(tmp_path / "sweep" / str(row.job)).read("circuit")
        n = int(res.faithfulness.n.iloc[0])
        assert row[f"circuit.top_{n}"] == pytest.approx(
            res.circuits.set_index("name").loc[f"top_{n}", "faithfulness"], rel=1e-5, abs=1e-6)
        assert res.attrs["method"] == row.circuit["method"] and res.attrs["steps"] == row.circuit.get("steps")
    assert df["circuit.full"].to_numpy() == pytest.approx(1, abs=1e-5)


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_two_ranks_of_a_circuit_run_write_the_store_one_process_writes(pairs, tmp_path):
    """circuit: under torchrun: each rank selects the same circuits (from every prompt's scores) and scores and
    evaluates its own batches into one store, bitwise the one a single process writes."""
    from tests.test_parallel import same_store, torchrun

    args = [*overrides(pairs, "{source:clean,target:corrupt,metric:ld,method:eap_ig,steps:2,verify:2,"
                              "select:{top_n:[6]}}"), "store.chunk_rows=2", "store.commit_s=0", "data.batch_size=1"]
    torchrun(1, *args, f"hydra.run.dir={tmp_path / 'one'}")  # one process on one thread, as each rank runs
    torchrun(2, *args, f"hydra.run.dir={tmp_path / 'two'}")
    one, two = hookrun.open(tmp_path / "one"), hookrun.open(tmp_path / "two")
    same_store(one, two)
    a, b = one.read("circuit"), two.read("circuit")
    assert a.circuits.equals(b.circuits) and np.array_equal(a.scores, b.scores) and a.scores.shape[0] == 5
