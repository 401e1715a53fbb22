"""Information-flow routes against the EAP-IG code's get_scores_information_flow_routes (hannamw/EAP-IG,
src/eap/attribute.py) transcribed here in plain PyTorch on a tiny GPT-2 and a tiny Llama built in code: its output
activations [batch, pos, forward, d_model] (hook_embed, every head's hook_result, every hook_mlp_out), its input
hooks (every head's q, k and v input, hook_mlp_in, the last block's resid_post), its proximity, importance, padding
mask and mean over positions, summed over the batch over the items; hookrun's `method: information_flow_routes`
(input: token_embedding) equals it edge for edge; a declared run stores what the function gives; the keys that do
not apply are refused."""
import numpy as np
import pytest
import torch

from hookrun.methods.circuits import check_block, edge_scores
from hookrun.methods.circuits.graph import circuit_graph
from hookrun.methods.circuits.routes import route_scores
from hookrun.methods.circuits.select import top_n
from tests.test_circuits import H, gpt2, hand_senders, llama, metric, pair, parts
from tests.test_circuits_reference import token_embedding
from tests.test_circuits_run import PAIRS, declared_run, encode, pairs  # noqa: F401 - pairs: a fixture

pytestmark = pytest.mark.usefixtures("one_thread")
MODELS = {"gpt2": gpt2, "llama": llama}


def reference_inputs(model, family, ids):
    """{hook: [B, T, D]} with plain hooks: each block's input (hook_q/k/v_input's stream), each MLP norm's input
    (hook_mlp_in), the final norm's input (the last block's resid_post)."""
    acts, handles = {}, []
    for i in range(2):
        p = parts(model, family, i)
        handles.append(p["ln1"].register_forward_pre_hook(lambda m, a, i=i: acts.__setitem__(f"attn_in{i}", a[0])))
        handles.append(p["ln2"].register_forward_pre_hook(lambda m, a, i=i: acts.__setitem__(f"mlp_in{i}", a[0])))
    handles.append(parts(model, family, 0)["final"].register_forward_pre_hook(
        lambda m, a: acts.__setitem__("resid_post", a[0])))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return acts


def routes_reference(model, family, g, ids, input_lengths):
    """get_scores_information_flow_routes on one batch: scores [n_forward, n_backward] (forward: input, a0.h*, m0,
    a1.h*, m1; backward: each layer's q, k, v of every head, then its MLP, then the logits), as its loop computes
    them, and the graph's edges read from it (a k/v group's edge from the group's first head)."""
    senders = hand_senders(model, family, ids)
    emb = token_embedding(model, family)
    kept = {}
    handle = emb.register_forward_hook(lambda m, a, o: kept.__setitem__("e", o.detach()))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    senders["input"] = kept["e"]  # the reference's input node is hook_embed
    fwd = ["input"] + [n for i in range(2) for n in [*(f"a{i}.h{h}" for h in range(H)), f"m{i}"]]
    output_activations = torch.stack([senders[n] for n in fwd], dim=2)  # batch pos forward hidden
    ins = reference_inputs(model, family, ids)
    bwd = [n for i in range(2) for n in [*(f"a{i}.h{h}<{x}>" for x in "qkv" for h in range(H)), f"m{i}"]]
    bwd.append("logits")
    scores = torch.zeros(len(fwd), len(bwd))

    def input_hook(prev_index, bwd_index, acts):  # its input_hook, line for line
        if acts.ndim == 3:
            acts = acts.unsqueeze(2)
        acts = acts.unsqueeze(2)
        unsqueezed_output_activations = output_activations.unsqueeze(3)
        proximity = torch.clamp(- torch.linalg.vector_norm(unsqueezed_output_activations[:, :, :prev_index] - acts,
                                                           ord=1, dim=-1) + torch.linalg.vector_norm(acts, ord=1,
                                                                                                     dim=-1), min=0)
        importance = proximity / torch.sum(proximity, dim=2, keepdim=True)
        max_len = input_lengths.max()
        mask = torch.arange(max_len, dtype=input_lengths.dtype).expand(len(input_lengths), max_len) < \
            input_lengths.unsqueeze(1)
        mask = mask.unsqueeze(-1).unsqueeze(-1)
        importance *= mask
        importance = importance.sum(1) / input_lengths.view(-1, 1, 1)
        importance = importance.sum(0)
        importance = importance.squeeze(1)
        scores[:prev_index, bwd_index] += importance

    for i in range(2):  # its hooks: each of q, k, v of every head at once ([B, T, heads, D], a slice), the MLP's
        qkv = ins[f"attn_in{i}"].unsqueeze(2).expand(-1, -1, H, -1)
        for x in "qkv":
            lo = bwd.index(f"a{i}.h0<{x}>")
            input_hook(fwd.index(f"a{i}.h0"), slice(lo, lo + H), qkv)
        input_hook(fwd.index(f"m{i}"), bwd.index(f"m{i}"), ins[f"mlp_in{i}"])
    input_hook(len(fwd), len(bwd) - 1, ins["resid_post"])
    scores /= len(ids)
    out = []
    for e in g.edges.itertuples():
        rec = e.receiver  # llama: a group's k / v edge from its first head's (every head reads the same stream)
        if ".kv" in rec:
            grp = int(e.receiver.split(".kv")[1][0])
            rec = e.receiver.replace(f".kv{grp}", f".h{grp * (H // g.anat.n_kv_heads)}")
        out.append(scores[fwd.index(e.sender), bwd.index(rec)])
    return torch.stack(out)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_routes_are_the_references(family):
    model = MODELS[family]()
    g = circuit_graph(model)
    clean, corrupted = pair()
    got = edge_scores(model, g, clean, corrupted, metric, method="information_flow_routes", input="token_embedding")
    lengths = torch.full((len(clean["input_ids"]),), clean["input_ids"].shape[1])
    want = routes_reference(model, family, g, clean["input_ids"], lengths)
    torch.testing.assert_close(got.scores.mean(0), want, rtol=1e-5, atol=1e-6)
    assert want.min() >= 0 and want.max() > 0.1 and got.passes == 2
    # the importances into a receiver add up to 1 at every position where any sender is near its stream
    per = route_scores(model, g, clean, per_position=True, input="token_embedding")
    torch.testing.assert_close(per.sum(1), got.scores)
    # the two runs' metric, as the other methods give them
    eap = edge_scores(model, g, clean, corrupted, metric)
    torch.testing.assert_close(got.source, eap.source), torch.testing.assert_close(got.target, eap.target)
    stream = edge_scores(model, g, clean, corrupted, metric, method="information_flow_routes").scores
    if family == "llama":  # no position embedding: the stream into block 0 is the token embedding
        torch.testing.assert_close(stream, got.scores)
    else:  # GPT-2's stream holds the positions: the proximity of the input sender differs
        assert (stream - got.scores).abs().max() > 1e-3


def test_routes_mean_over_each_samples_real_tokens_as_the_reference_masks():
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair(b=3, t=7)
    lengths = torch.tensor([7, 4, 5])
    valid = torch.arange(7)[None] < lengths[:, None]
    got = edge_scores(model, g, clean, corrupted, metric, method="information_flow_routes", input="token_embedding",
                      valid=valid)
    want = routes_reference(model, "gpt2", g, clean["input_ids"], lengths)
    torch.testing.assert_close(got.scores.mean(0), want, rtol=1e-5, atol=1e-6)
    assert (got.scores - edge_scores(model, g, clean, corrupted, metric, method="information_flow_routes",
                                     input="token_embedding").scores).abs().max() > 1e-4


def test_routes_refuse_the_keys_that_do_not_apply():
    model = gpt2()
    g = circuit_graph(model)
    clean, corrupted = pair()
    base = {"source": "clean", "target": "corrupt", "metric": "ld", "method": "information_flow_routes"}
    assert check_block(base) == []
    for extra, said in (({"steps": 4}, "circuit.steps: 4 but method is information_flow_routes, which takes no steps"),
                        ({"points": "left"}, "circuit.points: 'left' but method is information_flow_routes"),
                        ({"gradient": "source"}, "circuit.gradient: 'source' but method is information_flow_routes, "
                                                 "which takes no gradient"),
                        ({"score_donor": "zero"}, "circuit.score_donor: 'zero' with method information_flow_routes")):
        problems = check_block({**base, **extra})
        assert len(problems) == 1 and said in problems[0], problems
    for kw, said in (({"steps": 4}, "takes no IG points"), ({"gradient": "source"}, "takes no gradient"),
                     ({"donor": torch.zeros(1)}, "circuit.score_donor")):
        with pytest.raises(ValueError, match=said):
            edge_scores(model, g, clean, corrupted, metric, method="information_flow_routes", **kw)
    with pytest.raises(ValueError, match="circuit.input: 'token_embedding' with method eap"):
        edge_scores(model, g, clean, corrupted, metric, input="token_embedding")


def test_a_routes_run_stores_what_the_function_gives(pairs, tmp_path):  # noqa: F811
    """method: information_flow_routes in a run: the stored scores are route_scores' of the source run, the
    benchmark's percent circuits taken from them unsigned (importances, not a change of the metric), to_json
    writing them."""
    block = ("{source:clean,target:corrupt,metric:ld,method:information_flow_routes,input:token_embedding,"
             "select:{top_n:[6],percent:[10,50],how:greedy}}")
    res, model, g = declared_run(pairs, tmp_path, block, "data.batch_size=1")
    assert res.attrs["method"] == "information_flow_routes" and res.attrs["gradient"] == "target"
    want = torch.cat([route_scores(model, g, {"input_ids": encode([c])}, input="token_embedding")
                      for c, _ in PAIRS])
    np.testing.assert_allclose(res.scores, want.numpy(), rtol=1e-5, atol=1e-7)
    mean = res.edges["score"].to_numpy()
    assert np.array_equal(res.masks["signed_10pct"], top_n(g, mean, int(0.1 * len(g)), "greedy",
                                                           absolute=False).numpy())
    assert np.array_equal(res.masks["signed_10pct"], res.masks["abs_10pct"])
    assert np.isfinite(res.cpr) and np.isfinite(res.cmd)
    res.to_json(tmp_path / "routes.json")
    assert (tmp_path / "routes.json").stat().st_size > 0
