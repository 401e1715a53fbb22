"""Circuits on a post-norm family (Gemma 2: a norm after attention and after the MLP, before the residual add) on a
tiny model built from its config: EAP equal to a hand-written EAP in which each edge's first-order effect is taken by
autograd through the model's own norm (a head's sender its output before the norm, its edge the change of the
norm's output; an MLP's sender the norm's output), exact scores equal to patching each edge's norm change with plain
hooks, and a circuit's run equal to evaluating the norm per receiver as the EAP-IG code's evaluate_graph does."""
import pytest
import torch
import transformers as tf

from hookrun.methods.circuits import edge_scores
from hookrun.methods.circuits.attribute import sender_activations
from hookrun.methods.circuits.evaluate import circuit_metric, donor_activations
from hookrun.methods.circuits.graph import circuit_graph
from tests.test_circuits import COMMON, D, H, metric, metric_under, pair

pytestmark = pytest.mark.usefixtures("one_thread")


def gemma2():
    torch.manual_seed(0)
    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**COMMON, hidden_size=D, intermediate_size=48, head_dim=8,
                                                 num_key_value_heads=2, max_position_embeddings=64)).eval()
    return noisy_norms(model)


def olmo2():
    """A tiny OLMo 2: no norm before attention or the MLP, q_norm / k_norm over the whole q / k projection."""
    torch.manual_seed(0)
    model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**COMMON, hidden_size=D, intermediate_size=48, num_key_value_heads=2,
                                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                               eos_token_id=1)).eval()
    return noisy_norms(model)


def noisy_norms(model):
    with torch.no_grad():  # random norm weights: a norm that is no identity
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    return model


def hand(model, ids):
    """Plain hooks: {sender: [B, T, D]} (the stream into block 0, each head's z_h @ W_O[h] before the norm, each
    MLP's post-norm output) and {layer: the post-attention norm's input}."""
    acts, pre, hs = {}, {}, []
    layers = model.model.layers
    hs.append(layers[0].register_forward_pre_hook(
        lambda m, a, kw: acts.__setitem__("input", (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True))
    for i, layer in enumerate(layers):
        wo = layer.self_attn.o_proj.weight.t().reshape(H, 8, D)

        def heads(m, a, i=i, wo=wo):
            z = a[0].reshape(*a[0].shape[:2], H, 8)
            for h in range(H):
                acts[f"a{i}.h{h}"] = (z[..., h, :] @ wo[h]).detach()
        hs.append(layer.self_attn.o_proj.register_forward_pre_hook(heads))
        hs.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: pre.__setitem__(i, a[0].detach())))
        hs.append(layer.post_feedforward_layernorm.register_forward_hook(
            lambda m, a, o, i=i: acts.__setitem__(f"m{i}", o.detach())))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hs:
        h.remove()
    return acts, pre


def along(model, rec, add):
    """(module, hook) pairs adding add() [B, T, D] to receiver rec's input along its own path."""
    if rec.kind == "logits":
        return [(model.model.norm, "pre", lambda m, a: (a[0] + add(),))]
    layer = model.model.layers[rec.layer]
    if rec.kind == "mlp":
        return [(getattr(layer, "pre_feedforward_layernorm", layer.mlp), "pre", lambda m, a: (a[0] + add(),))]
    kept, proj = {}, getattr(layer.self_attn, f"{rec.kind}_proj")
    cols = slice(rec.head * 8, (rec.head + 1) * 8)
    if not hasattr(layer, "input_layernorm"):  # OLMo 2: the raw stream, q / k through the whole projection's norm
        norm = getattr(layer.self_attn, f"{rec.kind}_norm", None)

        def read(m, a, out):
            moved = proj.forward(kept["x"] + add())
            moved = norm.forward(moved) if norm is not None else moved
            out = out.clone()
            out[..., cols] = moved[..., cols]
            return out
        keep = (layer.self_attn, "pre_kw", lambda m, a, kw: kept.__setitem__("x", a[0] if a else kw["hidden_states"]))
        return [keep, (norm if norm is not None else proj, "fwd", read)]

    def splice(m, a, out):
        moved = m.forward(layer.input_layernorm.forward(kept["x"] + add()))
        out = out.clone()
        out[..., cols] = moved[..., cols]
        return out
    return [(layer.input_layernorm, "pre", lambda m, a: kept.__setitem__("x", a[0])), (proj, "fwd", splice)]


def run_with(model, ids, hooks):
    hs = [m.register_forward_pre_hook(f) if kind == "pre" else m.register_forward_pre_hook(f, with_kwargs=True)
          if kind == "pre_kw" else m.register_forward_hook(f) for m, kind, f in hooks]
    try:
        return metric(model(input_ids=ids).logits, None)
    finally:
        for h in hs:
            h.remove()


def change(model, u, pre, a_s, a_t):
    """eps -> what sender u's edge adds to a receiver's input when it carries eps of the source's difference: eps
    (a_s - a_t) for the input and MLPs, norm(R + eps (r_s - r_t)) - norm(R) for a head (R the target run's)."""
    if u.startswith("a"):
        norm = model.model.layers[int(u[1:u.index(".")])].post_attention_layernorm
        r = pre[int(u[1:u.index(".")])]
        return lambda eps: norm(r + eps * (a_s[u] - a_t[u])) - norm(r)
    return lambda eps: eps * (a_s[u] - a_t[u])


@pytest.mark.parametrize("build", [gemma2, olmo2])
def test_a_post_norm_model_has_a_graph_and_eap_equals_a_hand_written_eap(build):
    model = build()
    g = circuit_graph(model)
    assert set(g.post_norms()) == {0, 1}
    src, tgt = pair()
    got = edge_scores(model, g, src, tgt, metric)
    a_s, _ = hand(model, src["input_ids"])
    a_t, pre = hand(model, tgt["input_ids"])
    recs = {r.name: r for r in g.receivers}
    want = []
    for e in g.edges.itertuples():
        eps = torch.zeros((3, 1, 1), requires_grad=True)  # one a sample: d/d eps_b of the batch's sum is sample b's
        f = change(model, e.sender, pre, a_s, a_t)
        value = run_with(model, tgt["input_ids"], along(model, recs[e.receiver], lambda: f(eps))).sum()
        want.append(torch.autograd.grad(value, eps)[0].flatten())
    want = torch.stack(want, 1)
    torch.testing.assert_close(got.scores, want, rtol=1e-4, atol=1e-6)
    heads = torch.from_numpy(g.edges.sender.str.startswith("a").to_numpy(copy=True))
    assert want[:, heads].abs().max() > 1e-3 and want[:, ~heads].abs().max() > 1e-3


@pytest.mark.parametrize("build", [gemma2, olmo2])
def test_exact_scores_patch_each_edge_s_norm_change(build):
    model = build()
    g = circuit_graph(model)
    src, tgt = pair()
    got = edge_scores(model, g, src, tgt, metric, method="exact", copies=32)
    a_s, _ = hand(model, src["input_ids"])
    a_t, pre = hand(model, tgt["input_ids"])
    recs = {r.name: r for r in g.receivers}
    with torch.no_grad():
        base = metric(model(**tgt).logits, None)
        for k in range(0, len(g), 7):
            e = g.edges.iloc[k]
            f = change(model, e.sender, pre, a_s, a_t)
            want = run_with(model, tgt["input_ids"], along(model, recs[e.receiver], lambda: f(1.0))) - base
            torch.testing.assert_close(got.scores[:, k], want, rtol=1e-4, atol=1e-5)
    assert got.scores.abs().max() > 1e-3


@pytest.mark.parametrize("build", [gemma2, olmo2])
def test_a_circuit_run_passes_the_post_norm_per_receiver(build):
    """The full circuit is the source run, the empty one the target run, and every edge but those out of a head is
    that head's output patched from the target run with a plain hook (every receiver then sees the same change of
    the norm's output, as the stream would)."""
    model = build()
    g = circuit_graph(model)
    src, tgt = pair()
    a_t, _ = sender_activations(model, g, tgt)
    full = torch.ones(len(g), dtype=torch.bool)
    masks = torch.stack([full, ~full, g.circuit(exclude_from=["a0.h1"]), g.circuit(exclude_from=["a1.h2"])])
    m = circuit_metric(model, g, src, donor_activations("same", a_t), masks, metric)
    with torch.no_grad():
        torch.testing.assert_close(m[:, 0], metric(model(**src).logits, None), rtol=0, atol=0)
        torch.testing.assert_close(m[:, 1], metric(model(**tgt).logits, None), rtol=1e-4, atol=1e-5)
        for col, (layer, h) in ((2, (0, 1)), (3, (1, 2))):
            o_proj, kept = model.model.layers[layer].self_attn.o_proj, {}
            hk = o_proj.register_forward_pre_hook(lambda mod, a: kept.__setitem__("z", a[0].clone()))
            model(**tgt)
            hk.remove()

            def swap(mod, a, h=h):
                z = a[0].clone()
                z[..., h * 8:(h + 1) * 8] = kept["z"][..., h * 8:(h + 1) * 8]
                return (z,)
            hk = o_proj.register_forward_pre_hook(swap)
            want = metric(model(**src).logits, None)
            hk.remove()
            torch.testing.assert_close(m[:, col], want, rtol=1e-4, atol=1e-5)
    assert (m[:, 0] - m[:, 1]).abs().min() > 1e-4


def hand_circuit(model, ids, g, mask, a_t):
    """The metric [B] of a circuit (mask [E]) run on `ids` with plain hooks, transcribing the EAP-IG code's
    evaluate_graph with use_normalization_before_and_after: each receiver reads its input plus, over the edges into
    it outside the circuit, the target's minus this run's sender (a_t), a post-norm layer's heads passing its norm
    together (norm(R + their differences) - norm(R), R this run's norm input); a head's q / k / v along its own path
    (Gemma 2: its norm, then its slice of the projection; OLMo 2: the raw stream, the whole projection, its norm)."""
    layers, cur, pre, hs = model.model.layers, {}, {}, []
    off = {}
    for e, keep in zip(g.edges.itertuples(), mask.tolist()):
        if not keep:
            off.setdefault(e.receiver, []).append(e.sender)

    def delta(rec):
        d = torch.zeros_like(cur["input"])
        by_layer = {}
        for u in off.get(rec, []):
            if u.startswith("a"):
                by_layer.setdefault(int(u[1:u.index(".")]), []).append(u)
            else:
                d = d + a_t[u] - cur[u]
        for l, us in by_layer.items():
            norm = layers[l].post_attention_layernorm
            d = d + norm.forward(pre[l] + sum(a_t[u] - cur[u] for u in us)) - norm.forward(pre[l])
        return d

    def keep_input(m, a, kw):
        cur["input"] = a[0] if a else kw["hidden_states"]
    hs.append(layers[0].register_forward_pre_hook(keep_input, with_kwargs=True))
    for i, layer in enumerate(layers):
        wo = layer.self_attn.o_proj.weight.t().reshape(H, 8, D)

        def heads(m, a, i=i, wo=wo):
            z = a[0].reshape(*a[0].shape[:2], H, 8)
            for h in range(H):
                cur[f"a{i}.h{h}"] = z[..., h, :] @ wo[h]
        olmo = not hasattr(layer, "input_layernorm")
        kept = {}
        if olmo:
            hs.append(layer.self_attn.register_forward_pre_hook(
                lambda m, a, kw, kept=kept: kept.__setitem__("x", a[0] if a else kw["hidden_states"]),
                with_kwargs=True))
        else:
            hs.append(layer.input_layernorm.register_forward_pre_hook(
                lambda m, a, kept=kept: kept.__setitem__("x", a[0])))
        for kind in "qkv":
            proj = getattr(layer.self_attn, f"{kind}_proj")
            norm = getattr(layer.self_attn, f"{kind}_norm", None) if olmo else None
            if olmo:
                def read(x, proj=proj, norm=norm):
                    return norm.forward(proj.forward(x)) if norm is not None else proj.forward(x)
            else:
                def read(x, proj=proj, ln=layer.input_layernorm):
                    return proj.forward(ln.forward(x))
            recs = [r for r in g.receivers if r.layer == i and r.kind == kind]

            def splice(m, a, out, recs=recs, read=read, kept=kept):
                out = out.clone()
                for r in recs:
                    cols = slice(r.head * 8, (r.head + 1) * 8)
                    out[..., cols] = read(kept["x"] + delta(r.name))[..., cols]
                return out
            hs.append((norm if norm is not None else proj).register_forward_hook(splice))
        hs.append(layer.self_attn.o_proj.register_forward_pre_hook(heads))
        hs.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: pre.__setitem__(i, a[0])))
        hs.append(getattr(layer, "pre_feedforward_layernorm", layer.mlp).register_forward_pre_hook(
            lambda m, a, i=i: (a[0] + delta(f"m{i}"),)))
        hs.append(layer.post_feedforward_layernorm.register_forward_hook(
            lambda m, a, o, i=i: cur.__setitem__(f"m{i}", o)))
    hs.append(model.model.norm.register_forward_pre_hook(lambda m, a: (a[0] + delta("logits"),)))
    return metric_under(hs, model, ids, metric)


@pytest.mark.parametrize("build", [gemma2, olmo2])
def test_circuits_equal_a_hand_loop_of_plain_hooks(build):
    """A top-n circuit of the EAP scores, every edge but those into layer 1's q and k, and a few edges' circuit: the
    circuit run equals hand_circuit's plain hooks (the full circuit the source run, the empty one the target's)."""
    model = build()
    g = circuit_graph(model)
    src, tgt = pair()
    a_t, _ = sender_activations(model, g, tgt)
    hand_t, _ = hand(model, tgt["input_ids"])
    score = edge_scores(model, g, src, tgt, metric).scores.abs().sum(0)
    top = torch.zeros(len(g), dtype=torch.bool)
    top[score.argsort(descending=True)[:len(g) // 3]] = True
    qk = [r.name for r in g.receivers if r.kind in "qk" and r.layer == 1]
    few = g.circuit([n for n in g.names if n.endswith(("<q>", "<k>")) or n.endswith("->logits")][::2])
    full = torch.ones(len(g), dtype=torch.bool)
    masks = torch.stack([full, ~full, top, g.circuit(exclude_into=qk), few])
    m = circuit_metric(model, g, src, donor_activations("same", a_t), masks, metric)
    for c in range(len(masks)):
        want = hand_circuit(model, src["input_ids"], g, masks[c], hand_t)
        torch.testing.assert_close(m[:, c], want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(m[:, 1], metric(model(**tgt).logits, None), rtol=1e-4, atol=1e-5)
    # (q and k move a tiny random model little: 6e-5 on Gemma 2, still 60 times the tolerance)
    assert (m[:, 2:] - m[:, :1]).abs().amax(0).min() > 3e-5 and (m[:, 2:] - m[:, 1:2]).abs().amax(0).min() > 3e-5


def test_olmo2_has_a_graph_whose_q_and_k_receivers_pass_the_whole_projection_s_norm():
    model = olmo2()
    g = circuit_graph(model)
    assert set(g.post_norms()) == {0, 1} and len(g.senders) == 1 + 2 * (4 + 1)
    assert g.proj_norms[(1, "q")] == ("model.layers.1.self_attn.q_norm", "model.layers.1.self_attn.q_proj")
    assert g.point(next(r for r in g.receivers if r.kind == "k")).module == "model.layers.0.self_attn.k_norm"
    assert g.stream_module(0) == "model.layers.0.self_attn"
    assert not circuit_graph(gemma2()).proj_norms  # Gemma 2 has no q_norm; Gemma 3's and Qwen 3's are per head


@pytest.mark.parametrize("build", [gemma2, olmo2])
def test_eap_ig_equals_a_hand_written_eap_ig_through_each_pass_s_norm(build):
    """EAP-IG (inputs) on a post-norm model: the mean over the IG points of the hand-written EAP at the run whose
    stream into block 0 is interpolated target + alpha (source - target), each head's edge through the norm at
    that run's own input (autograd through the model's norm, per pass)."""
    from hookrun.methods.circuits.attribute import ig_points

    model = build()
    g = circuit_graph(model)
    src, tgt = pair()
    steps = 2
    got = edge_scores(model, g, src, tgt, metric, method="eap_ig", steps=steps)
    a_s, _ = hand(model, src["input_ids"])
    a_t, _ = hand(model, tgt["input_ids"])
    first = model.model.layers[0]
    recs = {r.name: r for r in g.receivers}
    want = torch.zeros_like(got.scores)
    for alpha in ig_points(steps):
        x = a_t["input"] + alpha * (a_s["input"] - a_t["input"])
        into = (first, "pre", lambda m, a, kw, x=x: ((x, *a[1:]), kw) if a else (a, {**kw, "hidden_states": x}))
        hs = [first.register_forward_pre_hook(into[2], with_kwargs=True)]
        _, pre = hand(model, tgt["input_ids"])  # the post-norms' inputs at this pass
        for h in hs:
            h.remove()
        for k, e in enumerate(g.edges.itertuples()):
            eps = torch.zeros((3, 1, 1), requires_grad=True)
            f = change(model, e.sender, pre, a_s, a_t)
            hs = [first.register_forward_pre_hook(into[2], with_kwargs=True)]
            try:
                value = run_with(model, tgt["input_ids"], along(model, recs[e.receiver], lambda: f(eps))).sum()
            finally:
                for h in hs:
                    h.remove()
            want[:, k] += torch.autograd.grad(value, eps)[0].flatten() / steps
    torch.testing.assert_close(got.scores, want, rtol=1e-4, atol=1e-6)
    heads = torch.from_numpy(g.edges.sender.str.startswith("a").to_numpy(copy=True))
    assert want[:, heads].abs().max() > 1e-3


@pytest.mark.parametrize("build", [gemma2, olmo2])
def test_methods_not_built_on_post_norm_are_refused(build):
    model = build()
    g = circuit_graph(model)
    src, tgt = pair()
    for method in ("eap_ig_activations", "clean_corrupted"):
        with pytest.raises(ValueError, match="on a post-norm model"):
            edge_scores(model, g, src, tgt, metric, method=method)


def gemma2_lm(**_):
    """A tiny Gemma 2 over the bundled tokenizer's 512 tokens (a run's model: _target_)."""
    torch.manual_seed(0)
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(**{**COMMON, "vocab_size": 512}, hidden_size=D, intermediate_size=48,
                                                head_dim=8, num_key_value_heads=2, max_position_embeddings=64,
                                                bos_token_id=1, eos_token_id=1, pad_token_id=0))


def olmo2_lm(**_):
    """A tiny OLMo 2 over the bundled tokenizer's 512 tokens (a run's model: _target_)."""
    torch.manual_seed(0)
    return tf.Olmo2ForCausalLM(tf.Olmo2Config(**{**COMMON, "vocab_size": 512}, hidden_size=D, intermediate_size=48,
                                              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                                              eos_token_id=1, pad_token_id=0))


@pytest.mark.parametrize("lm", ["gemma2_lm", "olmo2_lm"])
def test_a_circuit_run_on_a_post_norm_model(tmp_path, lm):
    """The circuit block on a post-norm model: its scores, verified edges and circuits equal the functions."""
    import json

    import numpy as np

    import hookrun
    from hookrun.methods.circuits.select import top_n
    from tests.test_circuits_run import PAIRS, encode, ld, refusals, run_into

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x}) + "\n" for c, x in PAIRS))
    items = ["+experiment=lm_tokens", f"model._target_=tests.test_circuits_post_norm.{lm}",
             f"data.text.files=[{path}]", "data.text.fields={clean:clean,corrupt:corrupt}", "data.batch_size=1",
             "hooks.resid=null", "+metrics.ld={metric:logit_diff,a:' model',b:' store'}",
             "+circuit={source:clean,target:corrupt,metric:ld,verify:3,select:{top_n:[8]}}"]
    run_into(tmp_path / "run.zarr", items)
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    model = globals()[lm]().eval()
    g = circuit_graph(model)
    masks = torch.stack([torch.as_tensor(res.masks[n]) for n in res.circuits["name"]])
    scores, circ = [], []
    for clean, corrupt in PAIRS:
        src, tgt = {"input_ids": encode([clean])}, {"input_ids": encode([corrupt])}
        scores.append(edge_scores(model, g, src, tgt, ld).scores)
        a_t, _ = sender_activations(model, g, tgt)
        circ.append(circuit_metric(model, g, src, donor_activations("same", a_t), masks, ld))
    np.testing.assert_allclose(res.scores, torch.cat(scores).numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(res.metrics, torch.cat(circ).numpy(), rtol=1e-4, atol=1e-5)
    assert np.array_equal(res.masks["top_8"], top_n(g, res.edges["score"].to_numpy(), 8).numpy())
    assert np.isfinite(res.exact).sum() == 3 * len(PAIRS)
    c = res.circuits.set_index("name")
    assert c.loc["full", "faithfulness"] == pytest.approx(1, abs=1e-5)
    assert c.loc["empty", "faithfulness"] == pytest.approx(0, abs=1e-4)
    out = refusals(path, tmp_path, "{source:clean,target:corrupt,metric:ld,method:eap_ig_activations}",
                   f"model._target_=tests.test_circuits_post_norm.{lm}")
    assert f"circuit.method: eap_ig_activations on {type(model).__name__}, a post-norm model" in out
