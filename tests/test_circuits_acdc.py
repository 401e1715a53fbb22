"""ACDC (Conmy et al. 2023) as the circuit block's finder, against a plain-PyTorch transcription of its loop on a tiny
GPT-2 built in code: every circuit run by hand (forward hooks feeding each receiver its input along its own path
minus the removed edges' (a_u - a_corrupt[u]), a_u the sender in this run), the loop over receivers in reverse
topological order written again here; a threshold of 0 keeps every edge, a huge one none; a declared run stores
the acdc circuits and reads them back with their faithfulness; bad acdc keys are refused."""
import numpy as np
import pytest
import torch

import hookrun
from hookrun.experiments.lm import causal_lm
from hookrun.methods.circuits import check_block
from hookrun.methods.circuits.acdc import acdc
from hookrun.methods.circuits.attribute import sender_activations
from hookrun.methods.circuits.evaluate import circuit_metric, donor_activations
from hookrun.methods.circuits.graph import circuit_graph
from tests.test_circuits import H, gpt2, hand_senders, metric, metric_under, pair, parts
from tests.test_circuits_run import GPT2, encode, ld, overrides, pairs, refusals, run_into  # noqa: F401  (pairs)

pytestmark = pytest.mark.usefixtures("one_thread")


def hand_circuit(model, g, ids, donor, removed):
    """The metric [B] of the run of `ids` with every edge of `removed` (names sender->receiver) ablated: each
    receiver reads its input along its own path + sum of (donor[u] - a_u) over its removed edges, a_u sender u's
    output in this same run (plain hooks on GPT-2's modules)."""
    by_r = {}
    for name in removed:
        s, r = name.split("->")
        by_r.setdefault(r, []).append(s)
    acts, handles, kept = {}, [], {}

    def delta(r):
        return sum(donor[s] - acts[s] for s in by_r.get(r, [])) if r in by_r else None

    p0 = parts(model, "gpt2", 0)
    handles.append(p0["block"].register_forward_pre_hook(
        lambda m, a, kw: acts.__setitem__("input", a[0] if a else kw["hidden_states"]), with_kwargs=True))
    for i in range(2):
        p = parts(model, "gpt2", i)
        handles.append(p["ln1"].register_forward_pre_hook(lambda m, a, i=i: kept.__setitem__(i, a[0])))

        def splice(m, a, out, i=i, p=p):
            out = out.clone()
            for kind in "qkv":
                for h in range(H):
                    d = delta(f"a{i}.h{h}<{kind}>")
                    if d is not None:
                        cols = p["cols"](kind, h)
                        out[..., cols] = m.forward(p["ln1"].forward(kept[i] + d))[..., cols]
            return out
        handles.append(p["proj"]["q"].register_forward_hook(splice))

        def heads(m, a, i=i, wo=p["wo"]):
            z = a[0].reshape(*a[0].shape[:2], H, 8)
            for h in range(H):
                acts[f"a{i}.h{h}"] = z[..., h, :] @ wo[h]
        handles.append(p["out"].register_forward_pre_hook(heads))
        handles.append(p["ln2"].register_forward_pre_hook(
            lambda m, a, i=i: None if delta(f"m{i}") is None else (a[0] + delta(f"m{i}"),)))
        handles.append(p["mlp"].register_forward_hook(lambda m, a, o, i=i: acts.__setitem__(f"m{i}", o)))
    handles.append(p0["final"].register_forward_pre_hook(
        lambda m, a: None if delta("logits") is None else (a[0] + delta("logits"),)))
    return metric_under(handles, model, ids, metric)


def hand_acdc(model, g, clean, corrupt, tau):
    """ACDC's loop typed out: the receivers from the logits back (graph order reversed), a receiver whose node has
    no edge out left loses its inputs untried, else each of its edges (latest sender first) is removed on top of
    those removed so far and stays removed when the mean metric moves by less than tau."""
    donor = hand_senders(model, "gpt2", corrupt)
    edges = list(g.edges.itertuples())
    present = {e.name for e in edges}
    current = hand_circuit(model, g, clean, donor, []).mean().item()
    for rec in reversed(g.receivers):
        incoming = [e.name for e in edges if e.receiver == rec.name]
        nodes = set(rec.heads or (rec.node,))
        if "logits" not in nodes and not any(n.split("->")[0] in nodes for n in present):
            present -= set(incoming)
            continue
        for name in reversed(incoming):
            if name not in present:
                continue
            trial = present - {name}
            new = hand_circuit(model, g, clean, donor, [e.name for e in edges if e.name not in trial]).mean().item()
            if abs(new - current) < tau:
                present, current = trial, new
    return [e.name for e in edges if e.name in present]


def runs_of(model, g, src, tgt):
    a_t, _ = sender_activations(model, g, tgt)
    return [(src, donor_activations("same", a_t), metric)]


def test_acdc_is_the_transcribed_loop():
    model = gpt2()
    g = circuit_graph(model)
    src, tgt = pair(b=3, t=7)
    runs = runs_of(model, g, src, tgt)
    full = circuit_metric(model, g, src, runs[0][1], torch.ones((1, len(g)), dtype=torch.bool), metric)
    empty = circuit_metric(model, g, src, runs[0][1], torch.zeros((1, len(g)), dtype=torch.bool), metric)
    gap = float((full - empty).mean().abs())
    for share in (0.02, 0.1):
        tau = share * gap
        got = acdc(model, g, runs, tau)
        want = hand_acdc(model, g, src["input_ids"], tgt["input_ids"], tau)
        assert [g.names[e] for e in got.nonzero().flatten().tolist()] == want
        assert 0 < int(got.sum()) < len(g)
        # the circuit kept moves the metric by what its edges removed moved it (each < tau), hand and hookrun alike
        m = circuit_metric(model, g, src, runs[0][1], got[None], metric).mean()
        h = hand_circuit(model, g, src["input_ids"], hand_senders(model, "gpt2", tgt["input_ids"]),
                         [n for n in g.names if n not in want]).mean()
        assert float(m) == pytest.approx(float(h), abs=1e-4)


def test_a_threshold_of_zero_keeps_every_edge_and_a_huge_one_none():
    model = gpt2()
    g = circuit_graph(model)
    src, tgt = pair(b=2, t=5)
    runs = runs_of(model, g, src, tgt)
    assert bool(acdc(model, g, runs, 0.0).all())
    assert not bool(acdc(model, g, runs, 1e9).any())


def test_a_declared_acdc_run_stores_its_circuits_with_their_faithfulness(pairs, tmp_path):  # noqa: F811
    block = "{source:clean,target:corrupt,metric:ld,finder:acdc,acdc:{threshold:[0.0,0.05,1e9]}}"
    run_into(tmp_path / "run.zarr", overrides(pairs, block, "data.batch_size=1"))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    c = res.circuits.set_index("name")
    assert list(c.index) == ["full", "empty", "acdc_0", "acdc_0.05", "acdc_1e+09"]
    assert set(c.loc[["acdc_0", "acdc_0.05", "acdc_1e+09"], "kind"]) == {"acdc"}
    torch.manual_seed(0)
    model = causal_lm(**GPT2).eval()
    g = circuit_graph(model)
    from tests.test_circuits_run import PAIRS
    runs = []
    for clean, corrupt in PAIRS:  # the run's batches of one pair
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        a_t, _ = sender_activations(model, g, tgt)
        runs.append((src, donor_activations("same", a_t), ld))
    mask = acdc(model, g, runs, 0.05)
    assert np.array_equal(res.masks["acdc_0.05"], mask.numpy())
    assert res.masks["acdc_0"].all() and not res.masks["acdc_1e+09"].any()
    assert c.loc["acdc_0", "faithfulness"] == pytest.approx(1, abs=1e-5)
    assert c.loc["acdc_1e+09", "faithfulness"] == pytest.approx(c.loc["empty", "faithfulness"], abs=1e-5)
    m = torch.cat([circuit_metric(model, g, kw, d, mask[None], ld)[:, 0] for kw, d, _ in runs])
    gap = float(res.source.mean() - res.target.mean())
    assert c.loc["acdc_0.05", "faithfulness"] == pytest.approx(float((m.mean() - res.target.mean()) / gap), abs=1e-4)
    # every removed edge moved the metric by < 0.05, so the circuit stays within edges removed x 0.05 of the full run
    assert abs(float(m.mean()) - float(res.source.mean())) < 0.05 * (len(g) - int(mask.sum())) + 1e-6


def test_bad_acdc_blocks_are_refused():
    base = {"source": "clean", "target": "corrupt", "metric": "ld"}
    assert check_block({**base, "finder": "acdc", "acdc": {"threshold": [0.01, 0.1]}}) == []
    cases = {"finder": ("nope", None), "threshold": ("acdc", {"threshold": -1}),
             "missing": ("acdc", {}), "acdc takes": ("acdc", {"threshold": 0.1, "tau": 2}),
             "prompts": ("acdc", {"threshold": 0.1, "prompts": 0}), "twice": ("acdc", {"threshold": [0.1, 0.1]}),
             "takes its thresholds": ("acdc", None), "circuit.finder is attribution": (None, {"threshold": 0.1}),
             "inf": ("acdc", {"threshold": float("inf")}),
             "circuit.acdc.metric": ("acdc", {"threshold": 0.1, "metric": 3})}
    for word, (finder, block) in cases.items():
        spec = {**base, **({"finder": finder} if finder else {}), **({"acdc": block} if block is not None else {})}
        problems = check_block(spec)
        assert problems and any(word in p for p in problems), (word, problems)
    named = check_block({**base, "circuits": {"acdc_0.1": {"edges": ["m1->logits"]}}})
    assert any("acdc_0.1" in p and "rename" in p for p in named)


def test_acdc_with_the_kl_to_the_clean_run_as_the_original(pairs, tmp_path):  # noqa: F811
    """acdc.metric: kl prunes on KL(clean || circuit run) at the last token (the original ACDC's metric): the
    declared run's circuit equals acdc() with that KL written in the test."""
    block = "{source:clean,target:corrupt,metric:ld,finder:acdc,acdc:{threshold:0.002,metric:kl}}"
    run_into(tmp_path / "run.zarr", overrides(pairs, block, "data.batch_size=1", "+metrics.kl={metric:kl}"))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    torch.manual_seed(0)
    model = causal_lm(**GPT2).eval()
    g = circuit_graph(model)
    from tests.test_circuits_run import PAIRS
    runs = []
    for clean, corrupt in PAIRS:
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        with torch.no_grad():
            p = torch.log_softmax(model(**src).logits[:, -1], -1)
        a_t, _ = sender_activations(model, g, tgt)
        runs.append((src, donor_activations("same", a_t), lambda logits, rows, p=p: (
            p.exp() * (p - torch.log_softmax(logits[:, -1], -1))).sum(-1)))
    mask = acdc(model, g, runs, 0.002)
    assert 0 < int(mask.sum()) < len(g)
    assert np.array_equal(res.masks["acdc_0.002"], mask.numpy())
    out = refusals(pairs, tmp_path, "{source:clean,target:corrupt,metric:ld,finder:acdc,acdc:{threshold:0.1,"
                                    "metric:nope}}")
    assert "circuit.acdc.metric: 'nope' is not a metric of the metrics block" in out
