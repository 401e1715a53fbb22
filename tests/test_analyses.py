"""The one-call analyses (hookrun/analyses.py): hookrun.lens, hookrun.dla and hookrun.features on a model in memory
give what a declared run of the same analysis stores, and the lens's KL and entropy what plain torch computes."""
import json
from copy import deepcopy
from importlib.resources import files

import numpy as np
import pytest
import torch

import hookrun
from hookrun.experiments.moods import tokenizer as mood_tokenizer
from hookrun.experiments.moods import trained_lm as mood_lm
from hookrun.methods.saes import SparseAutoencoder, save_saelens
from tests.test_api import hooks_left

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4}


@pytest.fixture(scope="module")
def mood():
    return mood_lm(**TINY, steps=5, batch=8, lr=0.003, seed=0).eval()


@pytest.fixture(scope="module")
def tok():
    return mood_tokenizer()


@pytest.fixture(scope="module")
def lens_run(mood):
    """The bundled lens experiment (BOS + prompt, every position, two tokens, DLA of answer - wrong) in memory."""
    return hookrun.run("lens", model=mood, store={"path": "memory"}, quiet=True)


def prompts():
    path = files("hookrun.experiments").joinpath("data/lens_prompts.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_ids(cap):
    """The token ids each sample of a run was fed, from its token table."""
    t = cap.tokens()
    return [t[t["sample"] == s].sort_values("position")["token_id"].tolist() for s in sorted(t["sample"].unique())]


def test_lens_equals_the_stored_lens(mood, tok, lens_run):
    stored = lens_run.read("lens")
    ids = run_ids(lens_run)
    got = hookrun.lens(mood, ids, tokenizer=tok, layers=["blocks.0.resid_pre", "blocks.*"], positions="all", k=5,
                       tokens=[" good", " bad"], batch_size=3)  # other batches than the run's 8: the same values
    assert got.layers == stored.layers and got.positions == stored.positions and got.tokens == stored.tokens
    np.testing.assert_array_equal(got.top_ids, stored.top_ids)
    np.testing.assert_array_equal(got.rank, stored.rank)
    for name in ("top_probs", "logprob", "kl", "entropy"):
        a, b = getattr(got, name), getattr(stored, name)
        assert a.shape == b.shape and np.isnan(a).sum() == np.isnan(b).sum()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert got.to_frame().drop(columns=["top_tokens", "token"]).round(4).equals(
        stored.to_frame().drop(columns=["top_tokens", "token"]).round(4))
    assert not hooks_left(mood)


def test_a_samples_lens_table_is_named_for_the_sample(lens_run, tok):
    """lens.sample_table(1) is sample 1's layers x positions table (each cell its top token and probability, read
    here from the stored ids); lens.top(1), its older name, stays the same table."""
    stored = lens_run.read("lens")
    table = stored.sample_table(1)
    assert list(table.index) == stored.layers and list(table.columns) == stored.positions
    a, p = len(stored.layers) - 1, 2
    text = tok.convert_tokens_to_string([tok.convert_ids_to_tokens(int(stored.top_ids[1, a, p, 0]))])
    assert table.iloc[a, p] == f"{text!r} {stored.top_probs[1, a, p, 0]:.2f}"
    assert stored.top(1).equals(table) and not stored.sample_table(0).equals(table)


def test_lens_kl_and_entropy_are_plain_torch(mood, tok):
    ids = tok(["The party was bright . we sang . it felt"], add_special_tokens=False)["input_ids"]
    got = hookrun.lens(mood, torch.tensor(ids), layers=["blocks.*"], positions=[0, -1])
    copy = deepcopy(mood)  # output_hidden_states leaves transformers' own recorder hooks on the model
    with torch.no_grad():
        out = copy(torch.tensor(ids), output_hidden_states=True)
        hidden = copy.lm_head(copy.transformer.ln_f(out.hidden_states[1][0]))
    final = torch.log_softmax(out.logits[0].float(), -1)  # [T, V]
    for layer in range(2):  # hidden_states[l + 1] is block l's output, the last one after ln_f in HF's GPT-2
        h = out.hidden_states[layer + 1][0] if layer < 1 else None
        if h is None:  # the last block's output before ln_f: the model's own logits
            np.testing.assert_allclose(got.kl[0, layer], 0, atol=1e-5)
            p = final
        else:
            p = torch.log_softmax(hidden.float(), -1)
            kl = (final.exp() * (final - p)).sum(-1)
            np.testing.assert_allclose(got.kl[0, layer], kl[[0, -1]].numpy(), rtol=1e-4, atol=1e-6)
        entropy = -(p.exp() * p).sum(-1)
        np.testing.assert_allclose(got.entropy[0, layer], entropy[[0, -1]].numpy(), rtol=1e-4, atol=1e-6)
        assert list(got.top_ids[0, layer, :, 0]) == p.argmax(-1)[[0, -1]].tolist()
    assert (got.kl >= -1e-6).all()


def test_dla_equals_the_stored_dla(mood, tok, lens_run):
    stored = lens_run.read("lens").dla
    rows = prompts()
    got = hookrun.dla(mood, run_ids(lens_run), [[r["answer"] for r in rows], [r["wrong"] for r in rows]],
                      tokenizer=tok, batch_size=5)
    assert got.components == stored.components and got.head_layers == stored.head_layers
    for name in ("parts", "logit", "heads"):
        np.testing.assert_allclose(getattr(got, name), getattr(stored, name), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.parts.sum(1), got.logit, rtol=1e-4, atol=1e-4)
    assert not hooks_left(mood)


def test_lens_with_dla_is_the_stored_lens_block_from_one_forward_a_batch(mood, tok, lens_run):
    """lens(dla=...) is the run's whole `lens:` block (lens and DLA) from one forward a batch, not one each."""
    stored = lens_run.read("lens")
    rows = prompts()
    ids = run_ids(lens_run)
    forwards = []
    counter = mood.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        got = hookrun.lens(mood, ids, tokenizer=tok, layers=["blocks.0.resid_pre", "blocks.*"], positions="all", k=5,
                           tokens=[" good", " bad"], batch_size=4,
                           dla={"answer": [[r["answer"] for r in rows], [r["wrong"] for r in rows]],
                                "position": "last", "heads": "auto"})
    finally:
        counter.remove()
    assert len(forwards) == -(-len(ids) // 4)  # one forward a batch for both
    np.testing.assert_array_equal(got.top_ids, stored.top_ids)
    np.testing.assert_allclose(got.kl, stored.kl, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert got.dla.components == stored.dla.components and got.dla.head_layers == stored.dla.head_layers
    assert got.dla.tokens == ["answer[0]", "answer[1]"] and got.tokens == ["' good'", "' bad'"]  # a list a sample: its place
    for name in ("parts", "logit", "heads"):
        np.testing.assert_allclose(getattr(got.dla, name), getattr(stored.dla, name), rtol=1e-4, atol=1e-5)
    alone = hookrun.dla(mood, ids, [[r["answer"] for r in rows], [r["wrong"] for r in rows]], tokenizer=tok,
                        batch_size=4)
    np.testing.assert_array_equal(got.dla.parts, alone.parts)  # the same arithmetic on the same forwards
    assert hookrun.lens(mood, ids[:2], dla=[" good"], tokenizer=tok).dla.heads.shape == (2, 2, 4)
    with pytest.raises(ValueError, match=r"dla: .*answer, position, heads, tolerance.*unknown: \['tokens'\]"):
        hookrun.lens(mood, ids[:2], dla={"tokens": [" good"]}, tokenizer=tok)
    with pytest.raises(ValueError, match=r"dla.position: \[0\]; DLA attributes one position"):
        hookrun.lens(mood, ids[:2], dla={"answer": [" good"], "position": [0]}, tokenizer=tok)
    assert not hooks_left(mood)


def test_dla_from_texts_and_ids_agree(mood, tok):
    texts = [r["text"] for r in prompts()[:3]]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    a = hookrun.dla(mood, texts, [" good"], tokenizer=tok, heads=False)
    b = hookrun.dla(mood, ids, [tok.convert_tokens_to_ids(tok.tokenize(" good"))[0]])
    np.testing.assert_allclose(a.parts, b.parts, rtol=1e-6)
    assert a.heads is None and b.heads is not None


def test_features_equal_the_stored_features_and_evaluations(mood, tok, tmp_path):
    torch.manual_seed(0)
    sae = SparseAutoencoder(d_in=64, d_sae=96)
    with torch.no_grad():
        sae.b_enc.uniform_(-0.1, 0.2)
    save_saelens(sae, tmp_path / "sae")
    texts = [r["text"] for r in prompts()]
    cap = hookrun.run(model=mood, tokenizer=tok, inputs=texts, store={"path": "memory"}, quiet=True,
                      dictionaries={"sae": {"path": str(tmp_path / "sae")}},
                      hooks={"feats": {"kind": "forward", "layers": ["blocks.1"], "dictionary": "sae", "top_k": 8,
                                       "evaluate": True}}, data={"batch_size": 3})
    got = hookrun.features(mood, texts, sae, site="blocks.1", tokenizer=tok, k=8, evaluate=True, batch_size=4)
    layer = cap.attrs["dictionaries"]["feats"]["layers"][0]
    idx = cap.load(hook="feats", layer=layer, role="features.indices")
    val = cap.load(hook="feats", layer=layer, role="features.values")
    err = cap.load(hook="feats", layer=layer, role="error_norm")
    assert idx.shape == got.indices.shape and (got.indices >= 0).sum() > len(idx)  # several features a token
    np.testing.assert_array_equal(got.indices, idx)
    np.testing.assert_allclose(got.values, val, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.error_norm, err, rtol=1e-5, atol=1e-6)
    table = cap.tokens()
    assert got.tokens[["sample", "position", "token_id"]].equals(table[["sample", "position", "token_id"]]
                                                                 .reset_index(drop=True).astype(got.tokens.dtypes[:3]))
    stored = cap.read("dictionaries").iloc[0]
    mine = got.evaluations.iloc[0]
    for key in ("tokens", "l0", "l1", "mse", "explained_variance", "cossim", "dead_features", "ce_clean",
                "ce_spliced", "ce_zero", "ce_loss_recovered"):
        assert mine[key] == pytest.approx(stored[key], rel=1e-5, abs=1e-7), key
    np.testing.assert_allclose(got.dense([int(got.indices[0, 0])])[0, 0], got.values[0, 0])
    assert not hooks_left(mood)


def test_bad_inputs_are_refused_with_the_fix(mood, tok):
    with pytest.raises(ValueError, match="texts need tokenizer="):
        hookrun.lens(mood, ["The party"])
    with pytest.raises(ValueError, match="mixed"):
        hookrun.lens(mood, ["The party", [1, 2]], tokenizer=tok)
    with pytest.raises(ValueError, match="position 5 is beyond a sample of 2 tokens"):
        hookrun.lens(mood, [[1, 2]], positions=[5])
    with pytest.raises(ValueError, match=r"answer\[0\]: 10\*\*9|answer\[0\]: 1000000000 is not a token"):
        hookrun.dla(mood, [[1, 2]], [10 ** 9])
    assert not hooks_left(mood)


def test_lens_table_kl_the_same_in_blocks_of_any_rows(mood):
    from hookrun.methods.lens import find_readout, lens_table

    readout = find_readout(mood)
    gen = torch.Generator().manual_seed(0)
    resid, final = torch.randn(3, 2, 5, 64, generator=gen), torch.randn(2, 5, 512, generator=gen)
    with torch.no_grad():
        whole = lens_table(readout, resid, final=final)
        rows = lens_table(readout, resid, final=final, chunk=7 * 512)  # 7 rows a block: across layers' ends
    np.testing.assert_allclose(rows.kl, whole.kl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rows.entropy, whole.entropy, rtol=1e-5, atol=1e-6)
    ref = torch.log_softmax(final, -1)
    lp = torch.log_softmax(mood.lm_head(mood.transformer.ln_f(resid[1, 0, 2])).detach(), -1)
    assert float(whole.kl[1, 0, 2]) == pytest.approx(float((ref[0, 2].exp() * (ref[0, 2] - lp)).sum()), rel=1e-4)
