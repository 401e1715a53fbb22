"""Issue 53 item 4's last clause: the induction circuit reproduced on the post-norm variant of the bundled model
(a LayerNorm on attention's output before the residual add, as Gemma 2/3; the induction_circuit_post_norm
experiment, on 64 of its 128 pairs). The model's own attention (read here with plain hooks) names its previous-token
head and its induction heads; EAP-IG, each head's edges through the post-norm, selects the previous-token head ->
induction head edges into the induction heads' keys (K-composition) in the smallest faithful circuit, which random
circuits of its size are not."""
import numpy as np
import pytest
import torch

import hookrun
from hookrun.engine.runner import run
from hookrun.experiments import induction, induction_circuit
from tests.helpers import make_cfg

pytestmark = pytest.mark.slow  # runs a bundled model's circuit experiment in its fixture (tens of seconds)
STEPS = 4000  # the post-norm variant's training steps (conf/experiment/induction_circuit_post_norm.yaml)


def attention_scores(net, half: int) -> dict:
    """{(layer, head): (induction, prev_token)} on 64 BOS + A + A sequences of `half` tokens, from the patterns read
    by plain hooks on the model's Softmax modules, and the repeated half's loss."""
    ids = torch.stack([x["clean"] for x in induction.repeated(64, half=half)])
    pats, hs = {}, []
    for i, block in enumerate(net.blocks):
        hs.append(block.attn.pattern.register_forward_hook(lambda m, a, o, i=i: pats.__setitem__(i, o.numpy())))
    with torch.no_grad():
        logits = net(input_ids=ids)
    for h in hs:
        h.remove()
    q, every = np.arange(half + 1, 2 * half + 1), np.arange(1, 2 * half + 1)
    out = {(layer, h): (float(p[:, h, q, q - half + 1].mean()), float(p[:, h, every, every - 1].mean()))
           for layer, p in pats.items() for h in range(p.shape[1])}
    loss = induction.token_losses(logits, ids)[:, induction.halves(ids.shape[1])["repeat"]].mean()
    return out, float(loss)


@pytest.fixture(scope="module")
def net():
    return induction.model(steps=STEPS, post_norm=True)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    base = tmp_path_factory.mktemp("induction_circuit_post_norm")
    run(make_cfg(["+experiment=induction_circuit_post_norm", "data.text.dataset.n=64",
                  f"store.path={base / 'captures.zarr'}"]))
    cap = hookrun.open(base / "captures.zarr")
    return cap, induction_circuit.report(cap, base)


def test_the_post_norm_variant_does_induction_by_content_not_position(net):
    from hookrun.capture.anatomy import anatomy
    from hookrun.methods.circuits.graph import circuit_graph

    assert anatomy(net).family.attn_write == "post" and set(circuit_graph(net).post_norms()) == {0, 1}
    for half in (12, 16):  # two repeat distances: a head keyed on a fixed offset would fail one of them
        scores, loss = attention_scores(net, half)
        assert loss < 1.0, (half, loss)  # far below log(63) = 4.14
        assert max(scores[(1, h)][0] for h in range(4)) > 0.5, scores
        assert max(scores[(0, h)][1] for h in range(4)) > 0.3, scores


def test_eap_ig_selects_k_composition_in_a_small_faithful_circuit(net, result):
    cap, numbers = result
    res = cap.read("circuit")
    scores, _ = attention_scores(net, 16)
    prev = max(range(4), key=lambda h: scores[(0, h)][1])  # the previous-token head
    heads = [h for h in range(4) if scores[(1, h)][0] > 0.5]  # the induction heads
    f = res.faithfulness
    first = f[f.faithfulness >= 0.9]
    assert len(first) and float(first.fraction.iloc[0]) <= 0.35 and float(first.random.iloc[0]) < 0.4
    assert f.attrs["area"] > f.attrs["area_random"] + 0.2
    kept = set(res.circuit(f"top_{int(first.n.iloc[0])}"))  # the smallest faithful circuit's edges
    k_edges = {f"a0.h{prev}->a1.h{h}<k>" for h in heads}
    assert k_edges & kept, (sorted(k_edges), sorted(kept))
    assert {f"a1.h{h}->logits" for h in heads} & kept
    assert numbers["area"] == pytest.approx(f.attrs["area"])
