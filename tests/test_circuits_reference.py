"""Circuits against the EAP-IG code (hannamw/EAP-IG, src/eap/attribute.py) transcribed here in plain PyTorch on tiny
models built in code: each of its methods (`EAP`, `EAP-IG-inputs`, `EAP-IG-activations`, `clean-corrupted`,
`exact`) run as its loop runs it (the gradient on the clean run, `corrupted - clean` differences, its `k / steps`
points, the token embedding as its input node) equals hookrun's declared equivalent (`gradient: source`, `points:
left | right`, the methods `clean_corrupted` and `exact`), each sample's scores averaged over the batch as the
reference divides its sums by the items; and the refusals of keys a method does not take."""
import pytest
import torch

from hookrun.methods.circuits import check_block, edge_scores, evaluate_circuits
from hookrun.methods.circuits.ablation import Means, ablated, kept_positions
from hookrun.methods.circuits.attribute import ig_points, sender_activations
from hookrun.methods.circuits.evaluate import circuit_metric
from hookrun.methods.circuits.graph import circuit_graph
from tests.test_circuits import D, gpt2, hand_gradient, hand_senders, llama, metric, metric_under, pair, parts

pytestmark = pytest.mark.usefixtures("one_thread")


def token_embedding(model, family):
    """The reference's input node (TransformerLens's hook_embed): the token embedding module."""
    return model.transformer.wte if family == "gpt2" else model.model.embed_tokens


def run_acts(model, family, ids, modules):
    """{name: output [B, T, D]} of the named modules in one plain forward."""
    acts, handles = {}, []
    for name, mod in modules.items():
        handles.append(mod.register_forward_hook(
            lambda m, a, o, n=name: acts.__setitem__(n, (o[0] if isinstance(o, tuple) else o).detach())))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return acts


def layer_nodes(model, family):
    """The reference's nodeslist: input (the token embedding), then each layer's attention (all heads) and MLP."""
    out = {"input": token_embedding(model, family)}
    for i in range(2):
        p = parts(model, family, i)
        out[f"a{i}"], out[f"m{i}"] = p["attn"], p["mlp"]
    return out


def constant(module, value):
    return module, lambda m, a, o: (value, *o[1:]) if isinstance(o, tuple) else value


def reference_scores(model, family, g, clean, corrupted, grads_of):
    """sum over the batch and positions of (a_corrupted[u] - a_clean[u]) . G[v] / items: get_scores_eap's einsum
    and division, G from grads_of(receiver) [B, T, D]."""
    a_c, a_x = hand_senders(model, family, clean), hand_senders(model, family, corrupted)
    grads = {r.name: grads_of(r) for r in g.receivers}
    return torch.stack([((a_x[e.sender] - a_c[e.sender]) * grads[e.receiver]).sum() / len(clean)
                        for e in g.edges.itertuples()])


def eap_reference(model, family, g, clean, corrupted):
    """get_scores_eap, intervention patching: one backward on the clean run."""
    return reference_scores(model, family, g, clean, corrupted, lambda r: hand_gradient(model, family, clean, r))


def eap_ig_inputs_reference(model, family, g, clean, corrupted, steps):
    """get_scores_eap_ig: for step in range(steps), the clean run with hook_embed replaced by corrupted + (step /
    steps) (clean - corrupted), its gradients summed, over steps."""
    emb = token_embedding(model, family)
    e = run_acts(model, family, clean, {"e": emb})["e"], run_acts(model, family, corrupted, {"e": emb})["e"]
    hooks = [constant(emb, e[1] + (k / steps) * (e[0] - e[1])) for k in range(steps)]
    return reference_scores(model, family, g, clean, corrupted, lambda r: sum(
        hand_gradient(model, family, clean, r, [h]) for h in hooks) / steps)


def eap_ig_activations_reference(model, family, g, clean, corrupted, steps):
    """get_scores_ig_activations, intervention patching: for each node of its nodeslist and step in 1 .. steps,
    the clean run with that node's output alpha clean + (1 - alpha) corrupted (alpha = step / steps, a constant),
    every pass's gradients into every edge, over the passes."""
    nodes = layer_nodes(model, family)
    c, x = run_acts(model, family, clean, nodes), run_acts(model, family, corrupted, nodes)
    hooks = [constant(nodes[n], (k / steps) * c[n] + (1 - k / steps) * x[n]) for n in nodes
             for k in range(1, steps + 1)]
    return reference_scores(model, family, g, clean, corrupted, lambda r: sum(
        hand_gradient(model, family, clean, r, [h]) for h in hooks) / len(hooks))


def clean_corrupted_reference(model, family, g, clean, corrupted):
    """get_scores_clean_corrupted: the gradients of the clean run and of the corrupted run (its own tokens), over 2."""
    return reference_scores(model, family, g, clean, corrupted, lambda r: (
        hand_gradient(model, family, clean, r) + hand_gradient(model, family, corrupted, r)) / 2)


def exact_reference(model, family, g, clean, corrupted):
    """get_scores_exact, intervention patching: for each edge, the clean run with that edge alone carrying the
    corrupted sender (its receiver's input along its own path + a_corrupted[u] - a_clean[u], a plain hook), the mean
    metric minus the clean run's (evaluate_baseline)."""
    a_c, a_x = hand_senders(model, family, clean), hand_senders(model, family, corrupted)
    with torch.no_grad():
        base = metric(model(input_ids=clean).logits, None).mean()
    out = []
    for e in g.edges.itertuples():
        r = g.receivers[[x.name for x in g.receivers].index(e.receiver)]
        d = a_x[e.sender] - a_c[e.sender]
        out.append(patched_metric(model, family, clean, r, d).mean() - base)
    return torch.stack(out)


def patched_metric(model, family, ids, rec, d):
    """The metric [B] of the run of `ids` with receiver rec's input along its own path + d (plain hooks)."""
    handles = []
    if rec.kind == "logits":
        handles.append(parts(model, family, 0)["final"].register_forward_pre_hook(lambda m, a: (a[0] + d,)))
    elif rec.kind == "mlp":
        handles.append(parts(model, family, rec.layer)["ln2"].register_forward_pre_hook(lambda m, a: (a[0] + d,)))
    else:
        p = parts(model, family, rec.layer)
        kept, cols = {}, p["cols"](rec.kind, rec.head)
        handles.append(p["ln1"].register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0])))

        def splice(m, a, out):
            out = out.clone()
            out[..., cols] = m.forward(p["ln1"].forward(kept["x"] + d))[..., cols]
            return out
        handles.append(p["proj"][rec.kind].register_forward_hook(splice))
    return metric_under(handles, model, ids, metric)


MODELS = {"gpt2": gpt2, "llama": llama}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eap_with_the_gradient_on_the_clean_run_is_the_references(family):
    model = MODELS[family]()
    g = circuit_graph(model)
    clean, corrupted = pair()
    got = edge_scores(model, g, clean, corrupted, metric, gradient="source")
    want = eap_reference(model, family, g, clean["input_ids"], corrupted["input_ids"])
    torch.testing.assert_close(got.scores.mean(0), want, rtol=1e-4, atol=1e-6)
    assert want.abs().max() > 1e-3
    usual = edge_scores(model, g, clean, corrupted, metric)  # the gradient on the target: another quantity
    assert (usual.scores.mean(0) + want).abs().max() > 1e-2 * want.abs().max()
    torch.testing.assert_close(got.source, usual.source), torch.testing.assert_close(got.target, usual.target)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eap_ig_inputs_left_points_on_the_clean_run_are_the_references(family):
    model = MODELS[family]()
    g = circuit_graph(model)
    clean, corrupted = pair()
    got = edge_scores(model, g, clean, corrupted, metric, method="eap_ig", steps=3, points="left", gradient="source")
    want = eap_ig_inputs_reference(model, family, g, clean["input_ids"], corrupted["input_ids"], 3)
    torch.testing.assert_close(got.scores.mean(0), want, rtol=1e-4, atol=1e-6)
    mid = edge_scores(model, g, clean, corrupted, metric, method="eap_ig", steps=3, gradient="source")
    assert (mid.scores.mean(0) - want).abs().max() > 1e-3 * want.abs().max()  # the points matter


@pytest.mark.slow
def test_eap_ig_activations_right_points_on_the_clean_run_are_the_references():
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    got = edge_scores(model, g, clean, corrupted, metric, method="eap_ig_activations", steps=2, points="right",
                      gradient="source", copies=3)
    want = eap_ig_activations_reference(model, "gpt2", g, clean["input_ids"], corrupted["input_ids"], 2)
    torch.testing.assert_close(got.scores.mean(0), want, rtol=1e-4, atol=1e-6)
    assert want.abs().max() > 1e-3


@pytest.mark.parametrize("gradient", ["source", "target"])
def test_clean_corrupted_is_the_references(gradient):
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    got = edge_scores(model, g, clean, corrupted, metric, method="clean_corrupted", gradient=gradient)
    want = clean_corrupted_reference(model, "gpt2", g, clean["input_ids"], corrupted["input_ids"])
    torch.testing.assert_close(got.scores.mean(0), want if gradient == "source" else -want, rtol=1e-4, atol=1e-6)
    assert want.abs().max() > 1e-3 and got.passes == 4


def test_exact_is_the_references_and_evaluates_each_edge_alone():
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    got = edge_scores(model, g, clean, corrupted, metric, method="exact", gradient="source", copies=16)
    want = exact_reference(model, "gpt2", g, clean["input_ids"], corrupted["input_ids"])
    torch.testing.assert_close(got.scores.mean(0), want, rtol=1e-4, atol=1e-5)
    assert want.abs().max() > 1e-3
    # an edge's exact score is the faithfulness run of the circuit of every edge but it, minus the clean run's
    every = torch.ones(len(g), dtype=torch.bool)
    some = torch.stack([every.clone() for _ in range(3)])
    for i, e in enumerate((0, len(g) // 2, len(g) - 1)):
        some[i, e] = False
    m, m_s, _ = evaluate_circuits(model, g, clean, corrupted, some, metric)
    torch.testing.assert_close(m - m_s[:, None], got.scores[:, [0, len(g) // 2, len(g) - 1]], rtol=1e-4, atol=1e-5)


def test_the_ig_points():
    assert ig_points(4) == [0.125, 0.375, 0.625, 0.875]
    assert ig_points(4, "left") == [0.0, 0.25, 0.5, 0.75] and ig_points(4, "right") == [0.25, 0.5, 0.75, 1.0]
    assert ig_points(4, [0.3]) == [0.3]
    with pytest.raises(ValueError, match="circuit.points"):
        ig_points(4, "ends")


def test_keys_a_method_does_not_take_are_refused():
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    for kw in (dict(steps=5), dict(points=[0.3]), dict(steps=5, points=[0.3])):
        for method in ("eap", "clean_corrupted", "exact"):
            with pytest.raises(ValueError, match="takes no IG points"):
                edge_scores(model, g, clean, corrupted, metric, method=method, **kw)
    with pytest.raises(ValueError, match="circuit.gradient"):
        edge_scores(model, g, clean, corrupted, metric, gradient="clean")
    base = {"source": "clean", "target": "corrupt", "metric": "ld"}
    assert check_block({**base, "method": "eap_ig", "points": "left", "gradient": "source"}) == []
    assert check_block({**base, "method": "eap_ig", "points": [0.0, 0.5]}) == []
    problems = check_block({**base, "method": "eap", "points": "left"})
    assert len(problems) == 1 and "takes no IG points" in problems[0]
    problems = check_block({**base, "method": "eap_ig", "points": "ends", "gradient": "clean"})
    assert any("circuit.points" in p and "midpoint" in p for p in problems)
    assert any("circuit.gradient" in p and "source" in p for p in problems)
    assert any("circuit.points" in p for p in check_block({**base, "method": "eap_ig", "points": [True]}))
    assert any("per_position" in p for p in check_block({**base, "method": "exact", "positions": "per_position"}))


def test_evaluate_circuits_is_importable_as_the_docs_write_it():
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    full = torch.ones(1, len(g), dtype=torch.bool)
    m, m_s, m_t = evaluate_circuits(model, g, source=clean, target=corrupted, circuits=full, metric=metric,
                                    donor="same")
    torch.testing.assert_close(m[:, 0], m_s)


# -- ablations: the reference's `intervention` -----------------------------------------------------------------------
def test_zero_ablation_in_eap_is_the_references_with_the_positions_kept():
    """get_scores_eap, intervention zero: activation_difference starts at 0 and the clean hooks subtract the clean
    activations, so each edge scores -a_clean[u] . G_clean[v], the input node being hook_embed (the token embedding
    alone): hookrun's score_donor zero with input: token_embedding."""
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    ids = clean["input_ids"]
    valid = torch.ones(ids.shape, dtype=torch.bool)
    donor = ablated("zero", len(g.senders), valid, kept_positions(model, g, clean))
    got = edge_scores(model, g, clean, corrupted, metric, gradient="source", donor=donor)
    a_c = hand_senders(model, "gpt2", ids)
    a_c["input"] = run_acts(model, "gpt2", ids, {"e": model.transformer.wte})["e"]  # hook_embed
    grads = {r.name: hand_gradient(model, "gpt2", ids, r) for r in g.receivers}
    want = torch.stack([(-a_c[e.sender] * grads[e.receiver]).sum() / len(ids) for e in g.edges.itertuples()])
    torch.testing.assert_close(got.scores.mean(0), want, rtol=1e-4, atol=1e-6)
    stream = edge_scores(model, g, clean, corrupted, metric, gradient="source",
                         donor=ablated("zero", len(g.senders), valid, dim=D))
    from_input = torch.from_numpy((g.edges.sender == "input").to_numpy(copy=True))
    torch.testing.assert_close(stream.scores[:, ~from_input], got.scores[:, ~from_input])
    assert (stream.scores[:, from_input] - got.scores[:, from_input]).abs().max() > 1e-3  # the positions ablated


def test_mean_positional_ablation_in_eap_and_exact_is_the_references():
    """compute_mean_activations(per_position=True) over an intervention set of prompts of one length (each node's
    out_hook summed over the batch at each position, over the items), then get_scores_eap / get_scores_exact with
    intervention mean-positional: the edges carry those means; hookrun's Means over the same prompts."""
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    ids = clean["input_ids"]
    other = torch.randint(1, 64, (5, ids.shape[1]), generator=torch.Generator().manual_seed(9))
    acc = Means(len(g.senders))
    for chunk in (other[:2], other[2:]):  # two batches of the intervention set
        a, _ = sender_activations(model, g, {"input_ids": chunk})
        acc.add(a, torch.ones(chunk.shape, dtype=torch.bool), kept_positions(model, g, {"input_ids": chunk}))
    valid = torch.ones(ids.shape, dtype=torch.bool)
    donor = ablated("mean_positional", len(g.senders), valid, kept_positions(model, g, clean), acc)
    got = edge_scores(model, g, clean, corrupted, metric, gradient="source", donor=donor)
    means = hand_senders(model, "gpt2", other)
    means["input"] = run_acts(model, "gpt2", other, {"e": model.transformer.wte})["e"]
    means = {k: v.sum(0) / len(other) for k, v in means.items()}  # [T, D]: the reference's means[:, index] / total
    a_c = hand_senders(model, "gpt2", ids)
    a_c["input"] = run_acts(model, "gpt2", ids, {"e": model.transformer.wte})["e"]
    grads = {r.name: hand_gradient(model, "gpt2", ids, r) for r in g.receivers}
    want = torch.stack([((means[e.sender][None] - a_c[e.sender]) * grads[e.receiver]).sum() / len(ids)
                        for e in g.edges.itertuples()])
    torch.testing.assert_close(got.scores.mean(0), want, rtol=1e-4, atol=1e-6)
    exact = edge_scores(model, g, clean, corrupted, metric, method="exact", gradient="source", donor=donor)
    with torch.no_grad():
        base = metric(model(input_ids=ids).logits, None)
    for k in (0, len(g) // 3, len(g) - 1):
        e = g.edges.iloc[k]
        r = g.receivers[[x.name for x in g.receivers].index(e.receiver)]
        moved = patched_metric(model, "gpt2", ids, r, means[e.sender][None] - a_c[e.sender]) - base
        torch.testing.assert_close(exact.scores[:, k], moved, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="score_donor"):
        edge_scores(model, g, clean, corrupted, metric, method="eap_ig", donor=donor)


def test_the_empty_circuit_under_zero_ablation_keeps_the_positions_with_token_embedding():
    """evaluate_graph, intervention zero, no edge in the graph: every receiver reads its input minus every
    sender's, what is left the position embedding and the attention output biases (no sender holds them); hookrun's
    donor zero with input: token_embedding, and with input: stream the biases alone."""
    model = gpt2()
    g = circuit_graph(model)
    clean, _ = pair()
    ids = clean["input_ids"]
    valid = torch.ones(ids.shape, dtype=torch.bool)
    empty = torch.zeros(1, len(g), dtype=torch.bool)
    biases = sum(b.attn.c_proj.bias for b in model.transformer.h).detach()
    got = {}
    for mode, kept in (("token_embedding", kept_positions(model, g, clean)), ("stream", None)):
        donor = ablated("zero", len(g.senders), valid, kept, dim=D)
        got[mode] = circuit_metric(model, g, clean, donor, empty, metric)[:, 0]
    pos = model.transformer.wpe(torch.arange(ids.shape[1]))[None].detach()
    with torch.no_grad():
        for mode, left in (("token_embedding", pos + biases), ("stream", biases.expand(*ids.shape, D))):
            h = model.transformer.ln_f.register_forward_pre_hook(lambda m, a, x=left: (x.expand_as(a[0]),))
            want = metric(model(input_ids=ids).logits, None)
            h.remove()
            torch.testing.assert_close(got[mode], want, rtol=1e-4, atol=1e-5)
    assert (got["stream"] - got["token_embedding"]).abs().max() > 1e-3
