"""Node-, neuron- and per-position circuits (circuit.level) against the EAP-IG code (hannamw/EAP-IG,
src/eap/attribute_node.py, graph.py's apply_topn / prune, evaluate.py's evaluate_graph) transcribed here in plain
PyTorch on a tiny GPT-2 built in code: its node and neuron scores (EAP and EAP-IG inputs, the gradient on the clean
run), its node and neuron circuits' selection and evaluation, and per-position circuits against a hand loop that
patches (edge, position) pairs with plain hooks; the refusals of the level's keys."""
import numpy as np
import pytest
import torch

from hookrun.methods.circuits import check_block
from hookrun.methods.circuits.attribute import sender_activations
from hookrun.methods.circuits.evaluate import circuit_metric
from hookrun.methods.circuits.graph import circuit_graph
from hookrun.methods.circuits.levels import Levels, exact_node_scores, neuron_masks, node_scores, pair_masks
from hookrun.methods.circuits.scores import edge_scores
from tests.test_circuits import D, H, gpt2, hand_senders, metric, pair, parts

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the reference's node and neuron attribution (attribute_node.get_scores_eap / get_scores_eap_ig) -------------
def out_modules(model):
    """The reference's forward nodes' out hooks, by hand: hook_embed (the token embedding), each layer's
    hook_result (a head's z_h @ W_O[h]: its gradient is the attention output's, the heads summed into it) and
    hook_mlp_out; and hook_mlp_in (the MLP's input, where its gradient hook for an MLP node sits)."""
    out = {"input": model.transformer.wte}
    for i in range(2):
        p = parts(model, "gpt2", i)
        out[f"attn{i}"], out[f"m{i}"] = p["out"], p["mlp"]
    return out


def output_gradients(model, ids, replace_embed=None):
    """{node: dM/d its output [B, T, D]} on the run of ids (a zero added at each out hook, plain hooks), and the
    MLPs' gradient at their input hook (`m{i}<in>`); replace_embed: hook_embed's output replaced (a constant)."""
    eps, handles = {}, []
    for name, mod in out_modules(model).items():
        eps[name] = torch.zeros(*ids.shape, D, requires_grad=True)

        def add(m, a, o, n=name):
            base = replace_embed if n == "input" and replace_embed is not None else o
            return base + eps[n]
        handles.append(mod.register_forward_hook(add))
    for i in range(2):
        eps[f"m{i}<in>"] = torch.zeros(*ids.shape, D, requires_grad=True)
        handles.append(parts(model, "gpt2", i)["ln2"].register_forward_pre_hook(
            lambda m, a, n=f"m{i}<in>": (a[0] + eps[n],)))
    try:
        value = metric(model(input_ids=ids).logits, None).sum()
        grads = dict(zip(eps, torch.autograd.grad(value, list(eps.values()))))
    finally:
        for h in handles:
            h.remove()
    return grads


def reference_neurons(model, g, clean, corrupted, steps=None):
    """[S, D]: the reference's neuron scores, sum over batch and positions of (corrupted - clean) x the gradient
    at the node's hook, / items (/ steps: EAP-IG inputs, hook_embed = corrupted + k / steps (clean - corrupted),
    k = 0 .. steps - 1), with its MLP rule as written and with the MLP's output gradient (`own`)."""
    a_c, a_x = hand_senders(model, "gpt2", clean), hand_senders(model, "gpt2", corrupted)
    emb = model.transformer.wte
    if steps is None:
        grads = output_gradients(model, clean)
    else:
        with torch.no_grad():
            e_c, e_x = emb(clean), emb(corrupted)
        runs = [output_gradients(model, clean, e_x + (k / steps) * (e_c - e_x)) for k in range(steps)]
        grads = {n: sum(r[n] for r in runs) / steps for n in runs[0]}
    ref, own = [], []
    for s in g.senders:
        d = a_x[s.name] - a_c[s.name]
        hook = "input" if s.kind == "input" else f"attn{s.layer}" if s.kind == "head" else s.name
        ref.append((d * grads[f"{s.name}<in>" if s.kind == "mlp" else hook]).sum((0, 1)) / len(clean))
        own.append((d * grads[hook]).sum((0, 1)) / len(clean))
    return torch.stack(ref), torch.stack(own)


@pytest.mark.parametrize("method", ["eap", "eap_ig"])
def test_node_and_neuron_scores_are_the_references(method):
    """EAP and EAP-IG inputs with the gradient on the clean run (points left): hookrun's neuron scores are the
    reference's `neuron=True` scores, its node scores their sums (= the sums of the nodes' outgoing edges'
    scores), at the input and every head; at an MLP the reference multiplies its output's difference by the
    gradient at its input hook (hook_mlp_in), hookrun by its output's gradient (docs/circuits.md#levels)."""
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    kw = dict(method="eap_ig", steps=3, points="left") if method == "eap_ig" else {}
    got = edge_scores(model, g, clean, corrupted, metric, gradient="source", neurons=True, **kw)
    ref, own = reference_neurons(model, g, clean["input_ids"], corrupted["input_ids"],
                                 3 if method == "eap_ig" else None)
    neurons = got.neurons.mean(0)
    scale = ref.abs().max()
    not_mlp = [i for i, s in enumerate(g.senders) if s.kind != "mlp"]
    mlp = [i for i, s in enumerate(g.senders) if s.kind == "mlp"]
    torch.testing.assert_close(neurons[not_mlp], ref[not_mlp], rtol=0, atol=2e-6 * scale)
    torch.testing.assert_close(neurons, own, rtol=0, atol=2e-6 * scale)
    assert (ref[mlp] - own[mlp]).abs().max() > 1e-3 * scale  # the reference's MLP rule is another quantity
    nodes = node_scores(g, got.scores).mean(0)
    torch.testing.assert_close(nodes, own.sum(1), rtol=0, atol=2e-5 * scale)
    torch.testing.assert_close(node_scores(g, got.scores), got.neurons.sum(2), rtol=0, atol=2e-5 * scale)


def test_exact_node_scores_patch_each_node_alone():
    """get_scores_exact: every edge out of a node removed, the clean run's metric minus the baseline: the node's
    output replaced by the corrupted run's at every receiver (a plain hook on its module)."""
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    a_x, _ = sender_activations(model, g, corrupted)
    with torch.no_grad():
        base = metric(model(**clean).logits, None)
    got = exact_node_scores(model, g, clean, a_x, lambda logits, rows: metric(logits, rows), base)
    kept = {}
    b0 = model.transformer.h[0]
    with torch.no_grad():
        hooks = [b0.attn.c_proj.register_forward_pre_hook(lambda m, a: kept.__setitem__("z", a[0].clone())),
                 b0.mlp.register_forward_hook(lambda m, a, o: kept.__setitem__("m", o.clone()))]
        model(**corrupted)
        for h in hooks:
            h.remove()

        def head(m, a):
            z = a[0].clone()
            z[..., 8:16] = kept["z"][..., 8:16]
            return (z,)
        h = b0.attn.c_proj.register_forward_pre_hook(head)
        want_head = metric(model(**clean).logits, None) - base
        h.remove()
        h = b0.mlp.register_forward_hook(lambda m, a, o: kept["m"])
        want_mlp = metric(model(**clean).logits, None) - base
        h.remove()
    names = [s.name for s in g.senders]
    torch.testing.assert_close(got[:, names.index("a0.h1")], want_head, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[:, names.index("m0")], want_mlp, rtol=1e-4, atol=1e-5)


# -- the reference's selection (graph.apply_topn, level node / neuron, then prune) ------------------------------
def reference_matrices(g):
    """The reference's real_edge_mask [S, R] and forward_to_backward [S, R] (a node's own inputs) on hookrun's
    senders and receivers (the same nodes and edges on GPT-2: no grouped-query attention)."""
    real = g.mask.clone()
    f2b = torch.zeros_like(real)
    for s, snd in enumerate(g.senders):
        for r, rec in enumerate(g.receivers):
            f2b[s, r] = rec.node == snd.name
    return real, f2b


def reference_prune(nodes, in_graph, f2b, neurons=None):
    """Graph.prune: neuronless nodes out, then nodes without outgoing or (but the input) incoming edges and edges
    missing a parent or child, until nothing changes; the removed nodes' neurons out."""
    nodes, in_graph = nodes.clone(), in_graph.clone()
    if neurons is not None:
        nodes &= neurons.any(1)
    while True:
        out_ = in_graph.any(1)
        in_ = (in_graph.any(0).float() @ f2b.float().t()) > 0
        in_[0] = True
        old_nodes, old_edges = nodes.clone(), in_graph.clone()
        nodes = out_ & in_
        backward = nodes.float() @ f2b.float()
        backward[-1] = 1
        in_graph &= (nodes.float()[:, None] * backward[None]) > 0
        if bool((old_nodes == nodes).all() and (old_edges == in_graph).all()):
            break
    return nodes, in_graph, None if neurons is None else neurons & nodes[:, None]


def reference_topn(scores, n):
    """apply_topn(n, level=node | neuron, absolute): the n largest |scores| in, the rest out (reset first)."""
    flat = scores.abs().reshape(-1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[torch.argsort(flat, descending=True)[:n]] = True
    return keep.reshape(scores.shape)


# -- the reference's evaluate_graph, by hand ----------------------------------------------------------------------
def reference_evaluate(model, g, clean, corrupted, weight, hooked=None):
    """The metric [B] of evaluate_graph's run (intervention patching): the clean run in which each receiver r
    reads its input plus sum over senders u of weight[u, r] * (a_corrupted[u] - a_u), a_u the sender in this run
    (weight [S, R, T | 1, D | 1]: 1 - in_graph (x the neurons out)), receivers only of the nodes in `hooked` (and
    the logits): plain hooks on a GPT-2's modules."""
    a_x = hand_senders(model, "gpt2", corrupted["input_ids"])
    names = [s.name for s in g.senders]
    cur, handles, kept = {}, [], {}

    def update(r):
        return sum(weight[u, r] * (a_x[n] - cur[n]) for u, n in enumerate(names) if n in cur and
                   bool(weight[u, r].any()))

    p0 = parts(model, "gpt2", 0)
    handles.append(p0["block"].register_forward_pre_hook(
        lambda m, a, kw: cur.__setitem__("input", (a[0] if a else kw["hidden_states"])), with_kwargs=True))
    rid = {r.name: i for i, r in enumerate(g.receivers)}
    for i in range(2):
        p = parts(model, "gpt2", i)

        def heads(m, a, i=i, wo=p["wo"]):
            z = a[0].reshape(*a[0].shape[:2], H, 8)
            for h in range(H):
                cur[f"a{i}.h{h}"] = z[..., h, :] @ wo[h]
        handles.append(p["out"].register_forward_pre_hook(heads))
        handles.append(p["mlp"].register_forward_hook(lambda m, a, o, i=i: cur.__setitem__(f"m{i}", o)))
        handles.append(p["ln1"].register_forward_pre_hook(lambda m, a, i=i: kept.__setitem__(i, a[0])))

        def qkv(m, a, out, i=i, p=p):
            out = out.clone()
            for h in range(H):
                if hooked is not None and f"a{i}.h{h}" not in hooked:
                    continue
                for kind in "qkv":
                    d = update(rid[f"a{i}.h{h}<{kind}>"])
                    if not isinstance(d, int):
                        cols = p["cols"](kind, h)
                        out[..., cols] = m.forward(p["ln1"].forward(kept[i] + d))[..., cols]
            return out
        handles.append(p["proj"]["q"].register_forward_hook(qkv))
        if hooked is None or f"m{i}" in hooked:
            handles.append(p["ln2"].register_forward_pre_hook(lambda m, a, i=i: (a[0] + update(rid[f"m{i}"]),)))
    handles.append(p0["final"].register_forward_pre_hook(lambda m, a: (a[0] + update(rid["logits"]),)))
    try:
        with torch.no_grad():
            return metric(model(**clean).logits, None)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("n", [1, 3, 6])
def test_node_circuits_are_the_references(n):
    """apply_topn(n, level='node') on the node scores, evaluate_graph (its prune, then every receiver of a node
    in the graph reading 1 - in_graph of each edge's difference): hookrun's node circuit (its nodes, its edges)
    and its circuit run."""
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    got = edge_scores(model, g, clean, corrupted, metric, gradient="source")
    scores = node_scores(g, got.scores).mean(0)
    real, f2b = reference_matrices(g)
    nodes = reference_topn(scores, n)
    in_graph = nodes[:, None].expand_as(real).clone()  # in_graph += nodes_in_graph.view(-1, 1): whole rows
    nodes, in_graph, _ = reference_prune(nodes, in_graph, f2b)
    spec = Levels(g, "node").top(scores.numpy(), n)
    assert spec["nodes"] == [s.name for s, k in zip(g.senders, nodes) if k]
    assert spec["edges"] == [int(e) for e in (in_graph & real)[g.edge_s, g.edge_r].nonzero().flatten()]
    weight = (1.0 - in_graph.float())[:, :, None, None]
    hooked = {s.name for s, k in zip(g.senders, nodes) if k}
    want = reference_evaluate(model, g, clean, corrupted, weight, hooked)
    a_x, _ = sender_activations(model, g, corrupted)
    mask = torch.zeros(1, len(g), dtype=torch.bool)
    mask[0, spec["edges"]] = True
    torch.testing.assert_close(circuit_metric(model, g, clean, a_x, mask, metric)[:, 0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [5, 40, 200])
def test_neuron_circuits_are_the_references(n):
    """apply_topn(n, level='neuron') on the neuron scores and evaluate_graph with neurons_in_graph (in_graph x
    node_fully_in_graph, each edge's difference times 1 - neurons of its sender): hookrun's neuron circuit and its
    run with neuron masks."""
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    got = edge_scores(model, g, clean, corrupted, metric, gradient="source", neurons=True)
    scores = got.neurons.mean(0)
    real, f2b = reference_matrices(g)
    neurons = reference_topn(scores, n)
    nodes = neurons.any(1)
    in_graph = nodes[:, None].expand_as(real).clone()
    nodes, in_graph, neurons = reference_prune(nodes, in_graph, f2b, neurons)
    spec = Levels(g, "neuron", d_model=D).top(scores.numpy(), n)
    assert spec["neurons"] == {g.senders[s].name: neurons[s].nonzero().flatten().tolist()
                               for s in range(len(g.senders)) if neurons[s].any()}
    full = (neurons.sum(1) == D).float()
    weight = (1.0 - in_graph.float() * full[:, None])[:, :, None, None] * (1.0 - neurons.float())[:, None, None, :]
    want = reference_evaluate(model, g, clean, corrupted, weight, {s.name for s, k in zip(g.senders, nodes) if k})
    a_x, _ = sender_activations(model, g, corrupted)
    masks = neuron_masks(g, [spec], D)
    run = circuit_metric(model, g, clean, a_x, masks[:, :0], metric, neurons=masks)[:, 0]
    torch.testing.assert_close(run, want, rtol=1e-4, atol=1e-5)


def test_per_position_circuits_equal_a_hand_loop_patching_each_pair():
    """A per-position circuit's run: each (edge, position) pair outside carries the donor at that position alone
    (auto-circuit's seq_len masks); against the hand run with the same weights [S, R, T], and the circuit of every
    pair but one (edge, position) against a hand patch of that edge at that position only."""
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    t = clean["input_ids"].shape[1]
    got = edge_scores(model, g, clean, corrupted, metric, gradient="source", per_position=True)
    scores = got.scores.mean(0)  # [T, E]
    pick = Levels(g, "edge_position", positions=t)
    specs = [pick.top(scores.numpy(), 12), pick.top(scores.numpy(), 30, how="greedy")]
    e0 = int(scores.abs().sum(0).argmax())
    every = np.ones((t, len(g)), bool)
    every[t - 1, e0] = False
    specs.append(pick.parts(every))
    masks = pair_masks(g, specs, t)
    a_x, _ = sender_activations(model, g, corrupted)
    run = circuit_metric(model, g, clean, a_x, masks, metric)
    for c, mask in enumerate(masks):
        weight = torch.zeros(len(g.senders), len(g.receivers), t, 1)
        off = ~mask  # [T, E]
        for e in range(len(g)):
            weight[g.edge_s[e], g.edge_r[e], :, 0] = off[:, e].float()
        want = reference_evaluate(model, g, clean, corrupted, weight)
        torch.testing.assert_close(run[:, c], want, rtol=1e-4, atol=1e-5)
    assert len(specs[0]["pairs"]) == 12 and len(specs[1]["pairs"]) == 30


def test_the_level_s_refusals():
    base = {"source": "clean", "target": "corrupt", "metric": "ld"}
    said = lambda spec: " ".join(check_block({**base, **spec}))  # noqa: E731
    assert "circuit.level: 'nodes' is not one of edge, node, neuron, edge_position" in said({"level": "nodes"})
    assert "circuit.level: neuron with method exact" in said({"level": "neuron", "method": "exact"})
    assert "circuit.positions: 'sum' with level edge_position" in said({"level": "edge_position",
                                                                         "positions": "sum"})
    assert "circuit.level: edge_position with method exact" in said({"level": "edge_position", "method": "exact"})
    assert said({"level": "node", "select": {"top_n": [2]}}) == ""


# -- in a run: stored, read back, equal to the plain functions; refused before the model -----------------------
@pytest.fixture
def pairs(tmp_path):
    import json

    from tests.test_circuits_run import PAIRS
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x}) + "\n" for c, x in PAIRS))
    return path


def plain_model():
    from hookrun.experiments.lm import causal_lm
    from tests.test_circuits_run import GPT2

    torch.manual_seed(0)
    model = causal_lm(**GPT2).eval()
    return model, circuit_graph(model)


@pytest.mark.parametrize("level", ["node", "neuron"])
def test_a_node_or_neuron_run_stores_its_sets_and_equals_the_plain_functions(pairs, tmp_path, level):
    """A run at level node / neuron (one batch a pair): the stored node (and neuron) scores are edge_scores'; the
    top-n circuits are Levels' selection from their mean over every prompt, read back by res.selected; each
    circuit's stored metric is circuit_metric's with its edges (node) or neuron masks (neuron)."""
    import hookrun
    from tests.test_circuits_run import PAIRS, encode, ld, overrides, run_into

    sizes = [2, 5] if level == "node" else [10, 60]
    block = (f"{{source:clean,target:corrupt,metric:ld,method:eap,level:{level},select:{{top_n:{sizes},random:1,"
             "percent:[20]}}")
    run_into(tmp_path / "run.zarr", overrides(pairs, block, "data.batch_size=1"))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    model, g = plain_model()
    d = model.get_input_embeddings().weight.shape[1]
    ests, donors, runs = [], [], []
    for clean, corrupt in PAIRS:
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        ests.append(edge_scores(model, g, src, tgt, ld, neurons=level == "neuron"))
        donors.append(sender_activations(model, g, tgt)[0])
        runs.append(src)
    nodes = torch.cat([node_scores(g, e.scores) for e in ests])
    np.testing.assert_allclose(res.nodes["score"], nodes.mean(0).numpy(), rtol=1e-4, atol=1e-6)
    pick = Levels(g, level, d_model=d)
    if level == "neuron":
        neurons = torch.cat([e.neurons for e in ests])
        np.testing.assert_allclose(res.neurons, neurons.mean(0).numpy(), rtol=1e-4, atol=1e-6)
        mean = res.neurons
    else:
        mean = res.nodes["score"].to_numpy()
    specs = {c["name"]: c for c in res.attrs["circuits"]}
    for n in sizes:
        want = pick.top(mean, n)
        assert specs[f"top_{n}"][level + "s"] == want[level + "s"] and specs[f"top_{n}"]["level"] == level
        assert res.selected(f"top_{n}") == want[level + "s"]
        assert res.circuit(f"top_{n}") == [g.names[e] for e in want["edges"]]
    n_pct = {"node": len(g.senders), "neuron": len(g.senders) * d}[level] * 20 // 100
    assert specs["abs_20pct"]["n"] == n_pct
    names = list(res.circuits["name"])
    ran = [c for c in names if c not in ("full", "empty")]
    for b, (src, donor) in enumerate(zip(runs, donors)):
        if level == "neuron":
            masks = neuron_masks(g, [specs[c] for c in ran], d)
            m = circuit_metric(model, g, src, donor, masks[:, :0], ld, neurons=masks)
        else:
            masks = torch.zeros(len(ran), len(g), dtype=torch.bool)
            for k, c in enumerate(ran):
                masks[k, specs[c]["edges"]] = True
            m = circuit_metric(model, g, src, donor, masks, ld)
        np.testing.assert_allclose(res.metrics[b, [names.index(c) for c in ran]], m[0].numpy(), rtol=1e-4,
                                   atol=1e-5)
    c = res.circuits.set_index("name")
    assert c.loc["full", "faithfulness"] == pytest.approx(1, abs=1e-5) and c.loc["top_2" if level == "node" else
                                                                               "top_10", "level"] == level
    assert list(res.faithfulness.n) == sizes


def test_a_per_position_run_and_its_refusal_before_the_model(tmp_path):
    """level edge_position: prompts of one length (a template), the scores kept per position, each circuit's pairs
    stored and its metric circuit_metric's with pair masks; prompts of two lengths refused before the model."""
    import json

    import hookrun
    from hookrun.config.checks import ConfigError
    from tests.test_circuits_run import encode, ld, overrides, run_into

    same = [("my model writes", "my store writes"), ("the model writes", "the store writes")]
    path = tmp_path / "same.jsonl"
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x}) + "\n" for c, x in same))
    block = "{source:clean,target:corrupt,metric:ld,method:eap,level:edge_position,select:{top_n:[4,20],random:1}}"
    run_into(tmp_path / "run.zarr", overrides(path, block, "data.batch_size=2"))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    model, g = plain_model()
    src, tgt = {"input_ids": encode([c for c, _ in same])}, {"input_ids": encode([x for _, x in same])}
    t = src["input_ids"].shape[1]
    est = edge_scores(model, g, src, tgt, ld, per_position=True)
    assert res.scores.shape == (2, t, len(g)) and res.attrs["positions"] == "per_position"
    np.testing.assert_allclose(res.scores, est.scores.numpy(), rtol=1e-4, atol=1e-6)
    specs = {c["name"]: c for c in res.attrs["circuits"]}
    want = Levels(g, "edge_position", positions=t).top(est.scores.mean(0).numpy(), 20, how="greedy")
    assert specs["top_20"]["pairs"] == want["pairs"]
    table = res.selected("top_20")
    assert list(table.columns) == ["edge", "position"] and len(table) == 20
    ran = [c for c in res.circuits["name"] if c not in ("full", "empty")]
    a_t, _ = sender_activations(model, g, tgt)
    m = circuit_metric(model, g, src, a_t, pair_masks(g, [specs[c] for c in ran], t), ld)
    names = list(res.circuits["name"])
    np.testing.assert_allclose(res.metrics[:, [names.index(c) for c in ran]], m.numpy(), rtol=1e-4, atol=1e-5)
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"clean": c, "corrupt": x}) + "\n" for c, x in
                           [*same, ("every layer writes an array", "every layer writes a model")]))
    with pytest.raises(ConfigError, match="circuit.level: edge_position but the prompts of 'clean' have 2 token "
                                          "lengths"):
        run_into(tmp_path / "bad.zarr", overrides(two, block))
    assert not (tmp_path / "bad.zarr").exists()


def test_a_node_circuit_under_grouped_query_attention_is_its_nodes_outputs_ablated():
    """Llama with key-value groups: the node circuit of every node but one head (its key-value receivers kept for
    the group's other head) runs as the circuit of every edge but those out of that head, and the exact node
    scores are those runs' change of the metric."""
    from tests.test_circuits import llama

    model = llama()
    g = circuit_graph(model)
    clean, corrupted = pair()
    pick = Levels(g, "node")
    names = [s.name for s in g.senders]
    for head in ("a1.h1", "a0.h2"):
        keep = np.array([n != head for n in names])
        spec = pick.parts(keep)
        assert spec["nodes"] == [n for n in names if n != head]
        masks = torch.zeros(2, len(g), dtype=torch.bool)
        masks[0, spec["edges"]] = True
        masks[1] = g.circuit(exclude_from=[head])
        a_x, _ = sender_activations(model, g, corrupted)
        m = circuit_metric(model, g, clean, a_x, masks, metric)
        torch.testing.assert_close(m[:, 0], m[:, 1], rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            base = metric(model(**clean).logits, None)
        exact = exact_node_scores(model, g, clean, a_x, metric, base)
        torch.testing.assert_close(exact[:, names.index(head)], m[:, 1] - base, rtol=1e-4, atol=1e-5)


def test_an_exact_node_run_stores_each_node_patched_alone(pairs, tmp_path):
    """method exact at level node: the stored node scores are each node's output patched alone into the target run
    (exact_node_scores with the source's senders as the donor), its top-n nodes selected from their mean."""
    import hookrun
    from tests.test_circuits_run import PAIRS, encode, ld, overrides, run_into

    block = "{source:clean,target:corrupt,metric:ld,method:exact,level:node,select:{top_n:[3],random:0}}"
    run_into(tmp_path / "run.zarr", overrides(pairs, block, "data.batch_size=1"))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    model, g = plain_model()
    want = []
    for clean, corrupt in PAIRS:
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        a_s, _ = sender_activations(model, g, src)
        with torch.no_grad():
            m_t = ld(model(**tgt).logits, None)
        want.append(exact_node_scores(model, g, tgt, a_s, ld, m_t))
    np.testing.assert_allclose(res.nodes["score"], torch.cat(want).mean(0).numpy(), rtol=1e-4, atol=1e-5)
    assert res.selected("top_3") == Levels(g, "node").top(res.nodes["score"].to_numpy(), 3)["nodes"]
