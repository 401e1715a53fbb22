"""Circuits' core against plain hooks and autograd on tiny models: the graph, EAP equal to a hand-written EAP on
three families (GPT-2, Llama with grouped-query attention, GPT-NeoX with parallel blocks and a per-head fused qkv),
the q/k/v split losing nothing, EAP equal to exact edge patching on a model linear in its edges, EAP-IG tending to
the exact value, EAP-IG "activations" equal to a transcription of the reference's loop (GPT-2, Llama), and the
faithfulness of circuits (full, empty, all but a node's edges) against plain patching."""
import pytest
import torch
import transformers as tf

from hookrun.methods.circuits.attribute import sender_activations
from hookrun.methods.circuits.scores import edge_scores
from hookrun.methods.circuits.evaluate import circuit_metric, donor_activations, evaluate_circuits, patch_edges
from hookrun.methods.circuits.graph import GraphError, circuit_graph

V, D, H = 64, 32, 4
COMMON = dict(vocab_size=V, num_hidden_layers=2, num_attention_heads=H, attn_implementation="eager")


def gpt2(**kw):
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_layer=2, n_embd=D, n_head=H, n_positions=64,
                                            attn_implementation="eager", **kw)).eval()


def llama():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, hidden_size=D, intermediate_size=48, num_key_value_heads=2,
                                              max_position_embeddings=64)).eval()


def neox():
    torch.manual_seed(0)
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**COMMON, hidden_size=D, intermediate_size=48)).eval()


def pair(b=3, t=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(1, V, (b, t), generator=gen)
    tgt = src.clone()
    tgt[:, 1:3] = torch.randint(1, V, (b, 2), generator=gen)
    return {"input_ids": src}, {"input_ids": tgt}


def metric(logits, rows):
    return logits[:, -1, 5] - logits[:, -1, 7]


# -- hand-written parts: module layouts typed out here per family, not asked of the anatomy ----------------------
def parts(model, family, i):
    """(block, ln1, [(projection, which-slice fn)], attn_out, W_O [H, dh, D], mlp norm, mlp, the attention module,
    the module whose output is the stream into block 0) of block i, by hand."""
    if family == "gpt2":
        b = model.transformer.h[i]
        cols = lambda kind, h: slice("qkv".index(kind) * D + h * 8, "qkv".index(kind) * D + (h + 1) * 8)  # noqa
        return dict(block=b, ln1=b.ln_1, proj={k: b.attn.c_attn for k in "qkv"}, cols=cols, out=b.attn.c_proj,
                    wo=b.attn.c_proj.weight.reshape(H, 8, D), ln2=b.ln_2, mlp=b.mlp, final=model.transformer.ln_f,
                    attn=b.attn, embed=model.transformer.drop)
    if family == "llama":
        b = model.model.layers[i]
        a = b.self_attn
        return dict(block=b, ln1=b.input_layernorm, proj={"q": a.q_proj, "k": a.k_proj, "v": a.v_proj},
                    cols=lambda kind, h: slice(h * 8, (h + 1) * 8), out=a.o_proj,
                    wo=a.o_proj.weight.t().reshape(H, 8, D), ln2=b.post_attention_layernorm, mlp=b.mlp,
                    final=model.model.norm, attn=a, embed=model.model.embed_tokens)
    b = model.gpt_neox.layers[i]
    a = b.attention
    cols = lambda kind, h: slice(h * 24 + "qkv".index(kind) * 8, h * 24 + ("qkv".index(kind) + 1) * 8)  # noqa
    return dict(block=b, ln1=b.input_layernorm, proj={k: a.query_key_value for k in "qkv"}, cols=cols, out=a.dense,
                wo=a.dense.weight.t().reshape(H, 8, D), ln2=b.post_attention_layernorm, mlp=b.mlp,
                final=model.gpt_neox.final_layer_norm, attn=a, embed=model.gpt_neox.emb_dropout)


def metric_under(handles, model, ids, metric):
    """The metric of one no-grad forward of the hand loops, with their plain torch hooks `handles` on, every one
    removed after, whatever happens. Usage: return metric_under(handles, model, ids, metric)."""
    try:
        with torch.no_grad():
            return metric(model(input_ids=ids).logits, None)
    finally:
        for h in handles:
            h.remove()


def hand_senders(model, family, ids):
    """{sender name: [B, T, D]} with plain hooks: block 0's input, z_h @ W_O[h], the MLPs' outputs."""
    acts, handles = {}, []
    p0 = parts(model, family, 0)
    handles.append(p0["block"].register_forward_pre_hook(
        lambda m, a, kw: acts.__setitem__("input", (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True))
    for i in range(2):
        p = parts(model, family, i)

        def heads(m, a, i=i, wo=p["wo"]):
            z = a[0].reshape(*a[0].shape[:2], H, 8)
            for h in range(H):
                acts[f"a{i}.h{h}"] = (z[..., h, :] @ wo[h]).detach()
        handles.append(p["out"].register_forward_pre_hook(heads))
        handles.append(p["mlp"].register_forward_hook(lambda m, a, o, i=i: acts.__setitem__(f"m{i}", o.detach())))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return acts


def hand_gradient(model, family, ids, rec, during=()):
    """dM/d(receiver's input along its own path) [B, T, D]: a zero tensor added on that path only (plain hooks),
    torch.autograd.grad of the metric with respect to it; `during`: (module, forward hook) pairs also hooked."""
    eps = torch.zeros(*ids.shape, D, requires_grad=True)
    handles = [mod.register_forward_hook(fn) for mod, fn in during]
    if rec.kind == "logits":
        fin = parts(model, family, 0)["final"]
        handles.append(fin.register_forward_pre_hook(lambda m, a: (a[0] + eps,)))
    elif rec.kind == "mlp":
        p = parts(model, family, rec.layer)
        handles.append(p["ln2"].register_forward_pre_hook(lambda m, a: (a[0] + eps,)))
    else:
        layer, kind, h = rec.layer, rec.kind, rec.head
        p = parts(model, family, layer)
        kept = {}
        handles.append(p["ln1"].register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0])))
        proj = p["proj"][kind]
        cols = p["cols"](kind, h)  # Llama's k and v: h is the key-value head, columns h*8:(h+1)*8 of k_proj

        def splice(m, a, out):
            moved = m.forward(p["ln1"].forward(kept["x"] + eps)) - out.detach()
            extra = torch.zeros_like(out)
            extra[..., cols] = moved[..., cols]
            return out + extra
        handles.append(proj.register_forward_hook(splice))
    try:
        value = metric(model(input_ids=ids).logits, None).sum()
        g, = torch.autograd.grad(value, eps, allow_unused=True)  # unused: a node pinned downstream cuts the path
    finally:
        for hd in handles:
            hd.remove()
    return torch.zeros_like(eps) if g is None else g


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "neox"])
def test_eap_equals_a_hand_written_eap(family):
    model = {"gpt2": gpt2, "llama": llama, "neox": neox}[family]()
    g = circuit_graph(model)
    src, tgt = pair()
    got = edge_scores(model, g, src, tgt, metric)
    a_s, a_t = hand_senders(model, family, src["input_ids"]), hand_senders(model, family, tgt["input_ids"])
    grads = {r.name: hand_gradient(model, family, tgt["input_ids"], r) for r in g.receivers}
    want = torch.stack([((a_s[row.sender] - a_t[row.sender]) * grads[row.receiver]).sum((1, 2))
                        for row in g.edges.itertuples()], 1)
    assert got.scores.shape == (3, len(g))
    torch.testing.assert_close(got.scores, want, rtol=1e-4, atol=1e-6)
    assert want.abs().max() > 1e-3  # the edges carry something
    with torch.no_grad():
        torch.testing.assert_close(got.source, metric(model(**src).logits, None))
        torch.testing.assert_close(got.target, metric(model(**tgt).logits, None))


def test_the_graph_of_each_family():
    g = circuit_graph(gpt2())  # 2 sequential layers of 4 heads and an MLP
    assert len(g.senders) == 11 and len(g.receivers) == 2 * (12 + 1) + 1
    assert len(g) == 12 + 5 + 12 * 6 + 10 + 11
    assert "a0.h1->a1.h0<k>" in g.names and "a0.h1->m0" in g.names and "a1.h0->a0.h0<q>" not in g.names
    gq = circuit_graph(llama())  # grouped-query: k and v per key-value head
    assert [r.name for r in gq.receivers if r.layer == 0][:9] == [
        "a0.h0<q>", "a0.h1<q>", "a0.h2<q>", "a0.h3<q>", "a0.kv0<k>", "a0.kv1<k>", "a0.kv0<v>", "a0.kv1<v>", "m0"]
    assert next(r for r in gq.receivers if r.name == "a1.kv1<k>").heads == ("a1.h2", "a1.h3")
    gp = circuit_graph(neox())  # parallel: no attention -> MLP edge inside a layer
    assert "a0.h1->m0" not in gp.names and "a0.h1->m1" in gp.names
    row = g.edges.set_index("name").loc["a0.h2->a1.h3<v>"]
    assert (row.kind, row.sender_layer, row.receiver_layer, row.sender_head, row.receiver_head) == ("v", 0, 1, 2, 3)


def test_senders_add_up_to_the_residual_stream():
    model = gpt2()
    g = circuit_graph(model)
    ids = pair()[0]["input_ids"]
    acts, _ = sender_activations(model, g, {"input_ids": ids})
    biases = sum(b.attn.c_proj.bias + b.mlp.c_proj.bias for b in model.transformer.h)
    torch.testing.assert_close(acts.sum(0) + biases, _final_in(model, ids), rtol=1e-5, atol=1e-5)


def _final_in(model, ids):
    kept = {}
    h = model.transformer.ln_f.register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0]))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    return kept["x"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_qkv_split_loses_nothing(family):
    """A sender's scores summed over a layer's q/k/v receivers equal its delta dotted with the gradient along the
    whole attention's input (a zero added to the layer norm's input: that norm feeds attention only)."""
    model = {"gpt2": gpt2, "llama": llama}[family]()
    g = circuit_graph(model)
    src, tgt = pair()
    got = edge_scores(model, g, src, tgt, metric).scores
    a_s, a_t = hand_senders(model, family, src["input_ids"]), hand_senders(model, family, tgt["input_ids"])
    eps = torch.zeros(3, 7, D, requires_grad=True)
    hd = parts(model, family, 1)["ln1"].register_forward_pre_hook(lambda m, a: (a[0] + eps,))
    grad, = torch.autograd.grad(metric(model(**tgt).logits, None).sum(), eps)
    hd.remove()
    heads_of_1 = g.edges.receiver_layer.eq(1) & g.edges.kind.isin(["q", "k", "v"])
    for sender in ["input", "a0.h0", "a0.h3", "m0"]:
        rows = torch.as_tensor((heads_of_1 & g.edges.sender.eq(sender)).to_numpy())
        want = ((a_s[sender] - a_t[sender]) * grad).sum((1, 2))
        torch.testing.assert_close(got[:, rows].sum(1), want, rtol=1e-4, atol=1e-6)


def linear_gpt2():
    """GPT-2 made linear in its edges: norms are identities, the MLP's activation is linear, the queries and keys
    are zero (a uniform causal pattern whatever the stream), the metric a logit difference."""
    model = gpt2(activation_function="linear", initializer_range=0.3)
    with torch.no_grad():
        for b in model.transformer.h:
            b.attn.c_attn.weight[:, :2 * D] = 0
            b.attn.c_attn.bias[:2 * D] = 0
            b.ln_1, b.ln_2 = torch.nn.Identity(), torch.nn.Identity()
        model.transformer.ln_f = torch.nn.Identity()
    return model


def test_eap_equals_exact_edge_patching_on_a_model_linear_in_its_edges():
    model = linear_gpt2()
    g = circuit_graph(model)
    src, tgt = pair()
    est = edge_scores(model, g, src, tgt, metric)
    a_s, _ = sender_activations(model, g, src)
    a_t, _ = sender_activations(model, g, tgt)
    exact = patch_edges(model, g, tgt, a_s - a_t, list(range(len(g))), metric)
    # atol: float32 rounding of a metric of ~20 (exact is a difference of two such values), 1e-6 of it
    scale = float(est.target.abs().max())
    torch.testing.assert_close(exact - est.target[:, None], est.scores, rtol=1e-4, atol=max(1e-5, 2e-6 * scale))
    assert est.scores.abs().max() > 1e-2


def test_exact_edge_patching_against_a_plain_hook():
    """Patching a0.h1 -> a1.h2<k> by hand: layer 1's k slice of head 2 recomputed from ln_1(x + delta)."""
    model = gpt2()
    g = circuit_graph(model)
    src, tgt = pair()
    a_s, a_t = hand_senders(model, "gpt2", src["input_ids"]), hand_senders(model, "gpt2", tgt["input_ids"])
    delta = a_s["a0.h1"] - a_t["a0.h1"]
    b = model.transformer.h[1]
    kept = {}
    h1 = b.ln_1.register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0]))

    def splice(m, a, out):
        out = out.clone()
        cols = slice(D + 16, D + 24)
        out[..., cols] = m.forward(b.ln_1.forward(kept["x"] + delta))[..., cols]
        return out
    h2 = b.attn.c_attn.register_forward_hook(splice)
    with torch.no_grad():
        want = metric(model(**tgt).logits, None)
    h1.remove(), h2.remove()
    ga_s, _ = sender_activations(model, g, src)
    ga_t, _ = sender_activations(model, g, tgt)
    got = patch_edges(model, g, tgt, ga_s - ga_t, g.index(["a0.h1->a1.h2<k>", "input->logits"]), metric)
    torch.testing.assert_close(got[:, 0], want)
    with torch.no_grad():
        torch.testing.assert_close(got[:, 1], metric(model.lm_head(model.transformer.ln_f(
            _final_in(model, tgt["input_ids"]) + a_s["input"] - a_t["input"])), None))


def test_eap_ig_tends_to_the_exact_value_where_edges_do_not_interact():
    """Heads and MLPs write nothing (their output projections are zero): input -> logits is the only edge that
    moves the metric, through the final norm and the unembedding, nonlinear. EAP misses the exact patch; EAP-IG
    comes to it as the steps grow (and the input's edges sum to m_source - m_target)."""
    model = gpt2()
    every = lambda logits, rows: (logits[..., 5] - logits[..., 7]).sum(1)  # noqa: E731 (the changed positions too)
    with torch.no_grad():
        for b in model.transformer.h:
            for lin in (b.attn.c_proj, b.mlp.c_proj):
                lin.weight.zero_(), lin.bias.zero_()
    g = circuit_graph(model)
    src, tgt = pair()
    a_s, _ = sender_activations(model, g, src)
    a_t, _ = sender_activations(model, g, tgt)
    e = g.index(["input->logits"])[0]
    exact = patch_edges(model, g, tgt, a_s - a_t, [e], every)[:, 0]
    est = edge_scores(model, g, src, tgt, every)
    change = exact - est.target
    errors = [float((edge_scores(model, g, src, tgt, every, method="eap_ig", steps=s).scores[:, e] - change)
                    .abs().max()) for s in (1, 4, 32)]
    eap_error = float((est.scores[:, e] - change).abs().max())
    assert eap_error > 50 * errors[-1] and errors[0] > errors[1] > errors[2]
    assert errors[-1] < 1e-3 * float(change.abs().max())
    torch.testing.assert_close(change, est.source - est.target, rtol=1e-4, atol=1e-6)


# -- EAP-IG "activations" ------------------------------------------------------------------------------------------
def hand_nodes(model, family, ids):
    """{layer node: its output [B, T, D]} with plain hooks: the stream into block 0, each attention's and MLP's."""
    acts, handles = {}, []
    handles.append(parts(model, family, 0)["embed"].register_forward_hook(
        lambda m, a, o: acts.__setitem__("input", o.detach())))
    for i in range(2):
        p = parts(model, family, i)
        handles.append(p["attn"].register_forward_hook(lambda m, a, o, i=i: acts.__setitem__(f"a{i}", o[0].detach())))
        handles.append(p["mlp"].register_forward_hook(lambda m, a, o, i=i: acts.__setitem__(f"m{i}", o.detach())))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return acts


def replace_output(model, family, node, value):
    """(module, forward hook) returning `value` as the layer node's output (a constant: nothing flows back)."""
    p = parts(model, family, 0 if node == "input" else int(node[1:]))
    module = p["embed" if node == "input" else "attn" if node[0] == "a" else "mlp"]
    return module, lambda m, a, o: (value, *o[1:]) if isinstance(o, tuple) else value


def hand_ig_activations(model, family, g, src, tgt, alphas):
    """EAP-IG "activations" written out as the reference code runs it: for each layer node and alpha, the target
    run with that node's output replaced by target + alpha (source - target), every receiver's gradient by
    hand_gradient; every pass's gradients into every edge, averaged over the passes."""
    n_s, n_t = hand_nodes(model, family, src), hand_nodes(model, family, tgt)
    a_s, a_t = hand_senders(model, family, src), hand_senders(model, family, tgt)
    total = {r.name: 0 for r in g.receivers}
    passes = [(n, a) for n in n_t for a in alphas]
    for node, alpha in passes:
        hook = replace_output(model, family, node, n_t[node] + alpha * (n_s[node] - n_t[node]))
        for r in g.receivers:
            total[r.name] = total[r.name] + hand_gradient(model, family, tgt, r, [hook])
    return torch.stack([((a_s[row.sender] - a_t[row.sender]) * total[row.receiver]).sum((1, 2)) / len(passes)
                        for row in g.edges.itertuples()], 1)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eap_ig_activations_equals_a_hand_written_one(family):
    model = {"gpt2": gpt2, "llama": llama}[family]()
    g = circuit_graph(model)
    src, tgt = pair()
    got = edge_scores(model, g, src, tgt, metric, method="eap_ig_activations", steps=2, copies=3)
    want = hand_ig_activations(model, family, g, src["input_ids"], tgt["input_ids"], [0.25, 0.75])
    torch.testing.assert_close(got.scores, want, rtol=1e-4, atol=1e-6)
    assert want.abs().max() > 1e-3 and got.passes == 2 + 4  # 5 nodes x 2 steps, 3 copies a forward
    inputs = edge_scores(model, g, src, tgt, metric, method="eap_ig", steps=2)
    assert (inputs.scores - got.scores).abs().max() > 0.05 * want.abs().max()  # another quantity than "inputs"


def test_eap_ig_activations_at_the_ends_of_the_path():
    """alphas [1]: each pass is the target run with one layer node's output patched to the source's, so an edge
    into the logits scores its delta . the mean over the nodes of the final norm's input gradient in those runs
    (plain hooks here); alphas [0]: each pass is the target run with one node pinned, the logits' edges EAP's, the
    others not (a pinned node's paths are cut)."""
    model = gpt2()
    g = circuit_graph(model)
    src, tgt = pair()
    n_s = hand_nodes(model, "gpt2", src["input_ids"])
    a_s, a_t = hand_senders(model, "gpt2", src["input_ids"]), hand_senders(model, "gpt2", tgt["input_ids"])
    logits = g.receivers[-1]
    grads = [hand_gradient(model, "gpt2", tgt["input_ids"], logits, [replace_output(model, "gpt2", n, v)])
             for n, v in n_s.items()]
    into = g.edges.receiver == "logits"
    want = torch.stack([((a_s[u] - a_t[u]) * sum(grads) / len(grads)).sum((1, 2)) for u in g.edges.sender[into]], 1)
    got = edge_scores(model, g, src, tgt, metric, method="eap_ig_activations", points=[1.0])
    torch.testing.assert_close(got.scores[:, into.to_numpy()], want, rtol=1e-4, atol=1e-6)
    eap = edge_scores(model, g, src, tgt, metric).scores
    ends = edge_scores(model, g, src, tgt, metric, method="eap_ig_activations", points=[0.0]).scores
    torch.testing.assert_close(ends[:, into.to_numpy()], eap[:, into.to_numpy()], rtol=1e-4, atol=1e-6)
    assert (ends[:, ~into.to_numpy()] - eap[:, ~into.to_numpy()]).abs().max() > 1e-3


def test_eap_ig_activations_pools_every_pass_into_every_edge():
    """Heads and MLPs write nothing: only input -> logits moves the metric. Its gradient at the logits is EAP's in
    the 2L passes interpolating an attention or an MLP and IG's in the input's, so the activations variant scores it
    (IG + 2L EAP) / (2L + 1): the reference's pooling of every pass into every edge."""
    model = gpt2()
    every = lambda logits, rows: (logits[..., 5] - logits[..., 7]).sum(1)  # noqa: E731
    with torch.no_grad():
        for b in model.transformer.h:
            for lin in (b.attn.c_proj, b.mlp.c_proj):
                lin.weight.zero_(), lin.bias.zero_()
    g = circuit_graph(model)
    src, tgt = pair()
    e = g.index(["input->logits"])[0]
    eap = edge_scores(model, g, src, tgt, every).scores[:, e]
    ig = edge_scores(model, g, src, tgt, every, method="eap_ig", steps=4).scores[:, e]
    act = edge_scores(model, g, src, tgt, every, method="eap_ig_activations", steps=4).scores[:, e]
    torch.testing.assert_close(act, (ig + 4 * eap) / 5, rtol=1e-4, atol=1e-6)
    assert (ig - eap).abs().max() > 1e-2 * ig.abs().max()


# -- faithfulness ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "neox"])
def test_full_circuit_gives_the_source_and_the_empty_one_the_target(family):
    model = {"gpt2": gpt2, "neox": neox}[family]()
    g = circuit_graph(model)
    src, tgt = pair()
    full = torch.ones(len(g), dtype=torch.bool)
    m, m_s, m_t = evaluate_circuits(model, g, src, tgt, torch.stack([full, ~full]), metric)
    torch.testing.assert_close(m[:, 0], m_s, rtol=0, atol=0)
    torch.testing.assert_close(m[:, 1], m_t, rtol=1e-4, atol=1e-5)
    assert (m_s - m_t).abs().min() > 1e-4


def test_all_edges_but_those_out_of_a_node_equal_patching_its_output_alone():
    model = gpt2()
    g = circuit_graph(model)
    src, tgt = pair()
    circuits = torch.stack([g.circuit(exclude_from=["a0.h2"]), g.circuit(exclude_from=["m0"])])
    m, _, _ = evaluate_circuits(model, g, src, tgt, circuits, metric)
    kept = {}
    b0 = model.transformer.h[0]
    with torch.no_grad():
        h = b0.attn.c_proj.register_forward_pre_hook(lambda mod, a: kept.__setitem__("z", a[0].clone()))
        hm = b0.mlp.register_forward_hook(lambda mod, a, o: kept.__setitem__("m", o.clone()))
        model(**tgt)
        h.remove(), hm.remove()

        def head(mod, a):
            z = a[0].clone()
            z[..., 16:24] = kept["z"][..., 16:24]
            return (z,)
        h = b0.attn.c_proj.register_forward_pre_hook(head)
        want_head = metric(model(**src).logits, None)
        h.remove()
        h = b0.mlp.register_forward_hook(lambda mod, a, o: kept["m"])
        want_mlp = metric(model(**src).logits, None)
        h.remove()
    torch.testing.assert_close(m[:, 0], want_head, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m[:, 1], want_mlp, rtol=1e-4, atol=1e-5)


def test_all_edges_but_those_into_a_receiver_equal_patching_its_input_alone():
    model = gpt2()
    g = circuit_graph(model)
    src, tgt = pair()
    m, _, _ = evaluate_circuits(model, g, src, tgt, torch.stack([g.circuit(exclude_into=["a1.h3<q>"]),
                                                                  g.circuit(exclude_into=["m1"])]), metric)
    b1 = model.transformer.h[1]
    kept = {}
    with torch.no_grad():
        hs = [b1.attn.c_attn.register_forward_hook(lambda mod, a, o: kept.__setitem__("qkv", o.clone())),
              b1.ln_2.register_forward_pre_hook(lambda mod, a: kept.__setitem__("mid", a[0].clone()))]
        model(**tgt)
        [h.remove() for h in hs]

        def q_of_head3(mod, a, o):
            o = o.clone()
            o[..., 24:32] = kept["qkv"][..., 24:32]
            return o
        h = b1.attn.c_attn.register_forward_hook(q_of_head3)
        want_q = metric(model(**src).logits, None)
        h.remove()
        h = b1.ln_2.register_forward_pre_hook(lambda mod, a: (kept["mid"],))
        want_m = metric(model(**src).logits, None)
        h.remove()
    torch.testing.assert_close(m[:, 0], want_q, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m[:, 1], want_m, rtol=1e-4, atol=1e-5)


def test_circuits_batched_as_copies_equal_one_at_a_time_and_donors():
    model = llama()
    g = circuit_graph(model)
    src, tgt = pair()
    gen = torch.Generator().manual_seed(3)
    circuits = torch.rand(5, len(g), generator=gen) < 0.5
    a_t, _ = sender_activations(model, g, tgt)
    for donor in ("same", "mean", "zero"):
        d = donor_activations(donor, a_t)
        together = circuit_metric(model, g, src, d, circuits, metric)
        alone = torch.cat([circuit_metric(model, g, src, d, circuits[i:i + 1], metric, copies=1) for i in range(5)], 1)
        torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)
    zero = circuit_metric(model, g, src, donor_activations("zero", a_t), (~circuits[:1]) & False, metric)
    with torch.no_grad():  # every edge ablated to zero: each receiver reads only the biases (none in Llama): zeros
        h = model.model.norm.register_forward_pre_hook(lambda mod, a: (torch.zeros_like(a[0]),))
        torch.testing.assert_close(zero[:, 0], metric(model(**src).logits, None))
        h.remove()


# -- selection ------------------------------------------------------------------------------------------------------
def test_pruning_keeps_only_edges_on_an_input_to_logits_path():
    from hookrun.methods.circuits.graph import graph_of_shape
    from hookrun.methods.circuits.select import prune
    g = graph_of_shape(2, 4, 4, False, True)
    path = ["input->a0.h1<v>", "a0.h1->a1.h0<k>", "a1.h0->logits"]
    assert g.names_of(prune(g, g.circuit(path))) == sorted(path, key=g.names.index)
    assert g.names_of(prune(g, g.circuit(path[1:]))) == []  # a0.h1 has no input
    assert g.names_of(prune(g, g.circuit(path[:2]))) == []  # a1.h0 reaches no logits
    assert g.names_of(prune(g, g.circuit([*path, "input->a1.h3<q>", "m0->m1"]))) == sorted(path, key=g.names.index)


def test_greedy_selection_grows_from_the_logits_as_eap_igs():
    from hookrun.methods.circuits.graph import graph_of_shape
    from hookrun.methods.circuits.select import random_circuit, threshold, top_n
    from hookrun.read.results.circuits import area
    g = graph_of_shape(2, 4, 4, False, True)
    scores = torch.zeros(len(g))
    for name, s in [("a0.h2->a1.h3<q>", 9.0), ("a1.h0->logits", -3.0), ("a0.h1->a1.h0<k>", 2.0),
                    ("input->a0.h1<v>", 1.0), ("input->logits", 0.5)]:
        scores[g.index([name])[0]] = s
    # greedy: the 9 goes into a1.h3, which never joins (nothing of it reaches the logits); |-3| first
    assert g.names_of(top_n(g, scores, 4)) == ["input->a0.h1<v>", "a0.h1->a1.h0<k>", "input->logits", "a1.h0->logits"]
    # top: the 4 largest |scores|, the unreachable 9 pruned away
    assert g.names_of(top_n(g, scores, 4, how="top")) == ["input->a0.h1<v>", "a0.h1->a1.h0<k>", "a1.h0->logits"]
    assert g.names_of(top_n(g, scores, 3, how="top")) == []  # 9, -3, 2: a0.h1 has no input edge: all pruned
    assert g.names_of(threshold(g, scores, 0.9)) == ["input->a0.h1<v>", "a0.h1->a1.h0<k>", "a1.h0->logits"]
    assert int(random_circuit(g, 30, seed=1).sum()) <= 30
    assert torch.equal(random_circuit(g, 30, seed=1), random_circuit(g, 30, seed=1))
    assert area([0, 0.5, 1], [0, 1, 1]) == pytest.approx(0.75)


def test_a_head_under_but_into_means_its_group_s_k_and_v_under_grouped_query_attention():
    """Llama with 4 heads in 2 key-value groups: but_into a1.h2 and a1.h3 (one group) both cut that group's k and v
    and their own q; a per-head k/v receiver or edge is refused, the did-you-mean its own group's."""
    g = circuit_graph(llama())
    cut = lambda node: sorted(set(g.edges.receiver[~g.circuit(exclude_into=[node]).numpy()]))  # noqa: E731
    assert cut("a1.h3") == ["a1.h3<q>", "a1.kv1<k>", "a1.kv1<v>"]
    assert cut("a1.h2") == ["a1.h2<q>", "a1.kv1<k>", "a1.kv1<v>"] and cut("a1.h0") == ["a1.h0<q>", "a1.kv0<k>",
                                                                                        "a1.kv0<v>"]
    with pytest.raises(GraphError, match=r"'a1.h3<k>' is not a receiver of the graph; nearest: a1.kv1<k>$"):
        g.circuit(exclude_into=["a1.h3<k>"])
    with pytest.raises(GraphError, match=r"nearest: a0.h1->a1.kv1<v>;"):
        g.circuit(["a0.h1->a1.h3<v>"])
