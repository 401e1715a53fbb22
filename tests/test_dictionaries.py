"""Dictionaries in runs (hookrun.methods.dictionaries.Dictionaries): a tiny GPT-2 built from a config read through an
SAE saved in the SAELens format, against plain PyTorch written here: the stored features and error norms, the
evaluations and CE loss recovered, the splice, feature edits in a forward run and while generating, the readers,
and the refusals before the store exists."""
import math

import numpy as np
import pytest
import torch

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.engine.runner import run
from hookrun.experiments.lm import causal_lm, tokenizer
from hookrun.methods.saes import SparseAutoencoder, load_saelens, save_saelens
from tests.helpers import make_cfg

PROMPTS = ["the hooks run on a model", "a store", "every layer writes an array of captures", "tokens",
           "x", "generation is a loop"]
D, D_SAE, LAYER = 32, 48, "transformer.h.0"
UNSET = ["~model.n_layer", "~model.n_embd", "~model.n_head", "~model.vocab_size", "~model.n_positions"]


def gpt2_lm():
    return causal_lm(n_layer=2, n_embd=D, n_head=4, vocab_size=512, n_positions=64)


def reference():
    torch.manual_seed(0)  # the runner seeds torch with cfg.seed right before building the model
    return gpt2_lm().eval()


@pytest.fixture
def sae_dir(tmp_path):
    """A ReLU SAE with random biases (about half its features fire), saved as a SAELens folder."""
    torch.manual_seed(3)
    sae = SparseAutoencoder(D, D_SAE, hook_name=LAYER)
    with torch.no_grad():
        sae.b_enc.normal_(std=0.5)
        sae.b_dec.normal_(std=0.1)
    return save_saelens(sae, tmp_path / "sae", hook_name=LAYER)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def overrides(corpus, sae_dir, *extra):
    return ["+experiment=lm_tokens", "model._target_=tests.test_dictionaries.gpt2_lm", *UNSET,
            f"data.text.files=[{corpus}]", "data.batch_size=4", "~hooks.resid",
            f"+dictionaries={{sae1: {{path: {sae_dir}}}}}", *extra]


def run_here(tmp_path, name, *args):
    path = tmp_path / f"{name}.zarr"
    run(make_cfg([*args, f"store.path={path}"]))
    return hookrun.open(path)


def prompt_ids(text):
    tok = tokenizer()
    return [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]


def block_outputs(model, layer=LAYER, edit=None):
    """Each prompt alone: the layer's output [T, D] and the logits [T, V], `edit(x) -> x` applied to the layer."""
    out = []
    for text in PROMPTS:
        seen = {}

        def hook(module, args, output):
            seen["x"] = output.detach().clone()
            return edit(output) if edit is not None else None
        handle = model.get_submodule(layer).register_forward_hook(hook)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids(text)])).logits[0]
        handle.remove()
        out.append((seen["x"][0], logits))
    return out


def by_hand(sae_path, x):
    """Features, reconstruction of rows x with the folder's weights, the maths written out."""
    w = {n: p.detach().double() for n, p in load_saelens(sae_path).named_parameters()}
    f = torch.relu((x.double() - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    return f, f @ w["W_dec"] + w["b_dec"]


def test_features_and_error_norms_equal_encode_by_hand_on_plain_captures(tmp_path, corpus, sae_dir):
    cap = run_here(tmp_path, "feats", *overrides(
        corpus, sae_dir, f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1, top_k: 8}}"))
    tokens = cap.tokens()
    x = torch.cat([x for x, _ in block_outputs(reference())])
    assert len(tokens) == len(x) == sum(len(prompt_ids(t)) for t in PROMPTS)
    f, x_hat = by_hand(sae_dir, x)
    assert float((f > 0).sum(1).float().mean()) > 8   # more fire than top_k keeps: the truncation is exercised
    idx = cap.load(hook="feats", role="features.indices")
    val = cap.load(hook="feats", role="features.values")
    assert idx.dtype == np.int32 and val.dtype == np.float32 and idx.shape == (len(x), 8)
    top = torch.topk(f, 8, dim=1)
    np.testing.assert_array_equal(idx, top.indices.numpy())
    np.testing.assert_allclose(val, top.values.numpy(), atol=1e-5)
    np.testing.assert_allclose(cap.load(hook="feats", role="error_norm"), (x.double() - x_hat).norm(dim=1).numpy(),
                               rtol=1e-5, atol=1e-5)
    # a feature dense (the reader), and its top contexts
    kept = torch.zeros_like(f).scatter(1, top.indices, top.values)
    dense = cap.read("dictionaries", "features", hook="feats", features=[5, 17])
    np.testing.assert_allclose(dense, kept[:, [5, 17]].numpy(), atol=1e-5)
    best = cap.top(feature=17, hook="feats", k=3, context=2)
    order = torch.argsort(-kept[:, 17], stable=True)[:3].numpy()
    assert best["sample"].tolist() == tokens["sample"].to_numpy()[order].tolist()
    assert best["position"].tolist() == tokens["position"].to_numpy()[order].tolist()
    np.testing.assert_allclose(best["value"], kept[order, 17].numpy(), atol=1e-5)
    assert all("[[" in c for c in best["context"])
    with pytest.raises(ValueError, match=r"feature 48 is out of range: hooks.feats's dictionary sae1 has 48 features"):
        cap.top(feature=48, hook="feats")


def test_per_token_features_are_written_into_arrays_made_at_their_size(tmp_path, corpus, sae_dir, monkeypatch):
    """The features' arrays hold a row per stored token and are made that long: no zarr resize (a round trip on its
    event loop) in the run, nor a cut at its end; the rows read back as the features of each prompt run alone."""
    import zarr

    resized = []
    monkeypatch.setattr(zarr.Array, "resize", lambda self, shape: resized.append((self.path, shape)))
    cap = run_here(tmp_path, "feats", *overrides(
        corpus, sae_dir, f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1, top_k: 4}}"))
    assert resized == []
    x = torch.cat([x for x, _ in block_outputs(reference())])
    f, _ = by_hand(sae_dir, x)
    top = torch.topk(f, 4, dim=1)
    for role in ("features.indices", "features.values", "error_norm"):
        assert cap.array(f"feats/{LAYER}/{role}").shape[0] == len(x)
    np.testing.assert_array_equal(cap.load(hook="feats", role="features.indices"), top.indices.numpy())
    np.testing.assert_allclose(cap.load(hook="feats", role="features.values"), top.values.numpy(), atol=1e-5)


def test_every_nonzero_feature_by_default_and_a_refusal_when_more_fire_than_the_width(tmp_path, corpus):
    torch.manual_seed(4)
    topk = save_saelens(SparseAutoencoder(D, D_SAE, "topk", k=5), tmp_path / "topk")
    cap = run_here(tmp_path, "topk", *overrides(
        corpus, topk, f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1}}"))
    x = torch.cat([x for x, _ in block_outputs(reference())])
    sae = load_saelens(topk)
    with torch.no_grad():
        f = sae.encode(x)
    dense = cap.read("dictionaries", "features", hook="feats", features=range(D_SAE))
    assert cap.attrs["dictionaries"]["feats"]["width"] == 5
    np.testing.assert_allclose(dense, f.numpy(), atol=1e-5)
    # a ReLU SAE firing on more than 64 features a token (a bias of +1 on each of 80): refused before the store
    wide = SparseAutoencoder(D, 80)
    with torch.no_grad():
        wide.b_enc.fill_(1.0)
        wide.W_enc.zero_()
    path = save_saelens(wide, tmp_path / "wide")
    with pytest.raises(ConfigError) as err:
        run_here(tmp_path, "wide", *overrides(
            corpus, path, f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1}}"))
    assert "hooks.feats.top_k: null stores every nonzero feature, up to 64 a token, but a token of transformer.h.0 " \
           "has 80 nonzero features of dictionary sae1; set hooks.feats.top_k: K" in str(err.value)
    assert not (tmp_path / "wide.zarr").exists()


def test_evaluations_and_ce_loss_recovered_equal_the_numbers_by_hand(tmp_path, corpus, sae_dir):
    cap = run_here(tmp_path, "eval", *overrides(
        corpus, sae_dir, f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1, evaluate: true}}"))
    model, sae = reference(), load_saelens(sae_dir)
    runs = {"clean": block_outputs(model),
            "spliced": block_outputs(model, edit=lambda x: sae(x)),
            "zero": block_outputs(model, edit=torch.zeros_like)}
    x = torch.cat([x for x, _ in runs["clean"]])
    f, x_hat = by_hand(sae_dir, x)
    losses = {}
    for name, outs in runs.items():
        nll = [torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(prompt_ids(t)[1:]),
                                                 reduction="sum") for t, (_, logits) in zip(PROMPTS, outs)]
        losses[name] = float(sum(nll)) / sum(len(prompt_ids(t)) - 1 for t in PROMPTS)
    mse = float((x.double() - x_hat).pow(2).sum(1).mean())
    variance = float((x.double() - x.double().mean(0)).pow(2).sum(1).mean())
    row = cap.read("dictionaries").iloc[0]
    assert (row["hook"], row["layer"], row["dictionary"], row["tokens"]) == ("feats", LAYER, "sae1", len(x))
    assert row["l0"] == pytest.approx(float((f > 0).sum(1).double().mean()), abs=1e-9)
    assert row["mse"] == pytest.approx(mse, rel=1e-5)
    assert row["explained_variance"] == pytest.approx(1 - mse / variance, rel=1e-5)
    assert row["dead_features"] == int(((f > 0).sum(0) == 0).sum())
    for name in ("clean", "spliced", "zero"):
        assert row[f"ce_{name}"] == pytest.approx(losses[name], abs=1e-5), name
    recovered = (losses["zero"] - losses["spliced"]) / (losses["zero"] - losses["clean"])
    assert row["ce_loss_recovered"] == pytest.approx(recovered, abs=1e-3)
    assert min(abs(losses[a] - losses[b]) for a, b in [("clean", "spliced"), ("clean", "zero"),
                                                        ("spliced", "zero")]) > 1e-3   # three different forwards


def test_splice_with_the_error_term_leaves_the_output_unchanged_and_replace_equals_a_plain_hook(tmp_path, corpus,
                                                                                              sae_dir):
    logits = "+hooks.logits={kind: forward, layers: [lm_head], capture: [output]}"
    feats = f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1"
    plain = run_here(tmp_path, "plain", *overrides(corpus, sae_dir, logits, feats + "}"))
    error = run_here(tmp_path, "error", *overrides(corpus, sae_dir, logits, feats + ", splice: replace_with_error}"))
    replace = run_here(tmp_path, "replace", *overrides(corpus, sae_dir, logits, feats + ", splice: replace}"))
    a, b = plain.load(hook="logits"), error.load(hook="logits")
    assert np.abs(a - b).max() <= 1e-6
    sae = load_saelens(sae_dir).requires_grad_(False)
    want = torch.cat([lg for _, lg in block_outputs(reference(), edit=lambda x: sae(x))]).numpy()
    got = replace.load(hook="logits")
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.abs(got - a).max() > 1e-2   # the reconstruction is not the activation: replace changes the output


@pytest.mark.parametrize("op,value", [("set", 0.0), ("scale", 3.0), ("clamp", [0.1, 0.2]), ("add", 4.0)])
def test_feature_edits_equal_a_plain_hook_editing_the_encoding(tmp_path, corpus, sae_dir, op, value):
    clean = torch.cat([x for x, _ in block_outputs(reference())])
    feature = int((by_hand(sae_dir, clean)[0] > 0.3).sum(0).argmax())   # the feature most often above 0.3
    edit = f"{{op: feature, dictionary: sae1, feature: {feature}, {op}: {value}}}"
    cap = run_here(tmp_path, op, *overrides(
        corpus, sae_dir, "+hooks.logits={kind: forward, layers: [lm_head], capture: [output]}",
        f"+hooks.edit={{kind: forward, layers: [{LAYER}], capture: [], edit: [{edit}]}}"))
    sae = load_saelens(sae_dir)
    row = sae.W_dec.detach()[feature]

    def by_hand_edit(x):
        f, _ = by_hand(sae_dir, x)
        old = f[..., feature].float()
        new = {"set": torch.full_like(old, 0.0), "scale": old * 3.0, "clamp": old.clamp(0.1, 0.2),
               "add": old + 4.0}[op]
        return x + (new - old)[..., None] * row
    want = torch.cat([lg for _, lg in block_outputs(reference(), edit=by_hand_edit)]).numpy()
    plain = torch.cat([lg for _, lg in block_outputs(reference())]).numpy()
    got = cap.load(hook="logits")
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.abs(got - plain).max() > 1e-3   # the edit changed the output


def test_a_feature_steered_while_generating_equals_generate_with_a_plain_hook(tmp_path, corpus, sae_dir):
    feature, coef, new = 7, 6.0, 6
    steer = (f"+hooks.steer={{kind: forward, layers: [{LAYER}], capture: [], edit: [{{op: feature, dictionary: sae1, "
             f"feature: {feature}, add: {coef}}}]}}")
    args = overrides(corpus, sae_dir, f"generate.max_new_tokens={new}", "data.text.bos=true")
    gens = run_here(tmp_path, "steered", *args, steer).generations()
    unsteered = run_here(tmp_path, "unsteered", *args,
                         f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1, top_k: 4}}")
    row = load_saelens(sae_dir).W_dec.detach()[feature]
    model, tok = reference(), tokenizer()
    handle = model.get_submodule(LAYER).register_forward_hook(lambda m, a, out: out + coef * row)
    want = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = prompt_ids(text)
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, do_sample=False, use_cache=True,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            want.append(out[0, len(ids):].tolist())
    handle.remove()
    assert gens["completion_ids"].tolist() == want
    assert unsteered.generations()["completion_ids"].tolist() != want   # the steer changed the completions
    # features stored while generating: a row a token read, prompt and generated
    assert len(unsteered.load(hook="feats", role="features.indices")) == len(unsteered.tokens())


def refused(tmp_path, *args):
    with pytest.raises(ConfigError) as err:
        run_here(tmp_path, "refused", *args)
    assert not (tmp_path / "refused.zarr").exists()
    return "\n".join(err.value.problems)


def test_refusals_name_the_key_and_the_fix_before_the_store_exists(tmp_path, corpus, sae_dir):
    hook = f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1}}"
    narrow = save_saelens(SparseAutoencoder(16, 40), tmp_path / "narrow")
    assert ("hooks.feats.dictionary: dictionary sae1 reads 16-wide activations, but transformer.h.0 output is "
            "[4, 9, 32] float32 (last axis 32); hook the layer the dictionary was trained on") in \
        refused(tmp_path, *overrides(corpus, narrow, hook))
    edit = (f"+hooks.steer={{kind: forward, layers: [{LAYER}], capture: [], edit: [{{op: feature, dictionary: sae1, "
            "feature: 48, add: 1.0}]}")
    assert ("hooks.steer.edit[0].feature: 48 is out of range: dictionary sae1 has 48 features (0..47); pick one of "
            "them") in refused(tmp_path, *overrides(corpus, sae_dir, edit))
    empty = tmp_path / "empty"
    empty.mkdir()
    text = refused(tmp_path, *overrides(corpus, empty, hook))
    assert f"dictionaries.sae1.path: dictionary {empty}: has no cfg.json (a SAELens SAE folder holds cfg.json and " \
           "sae_weights.safetensors); save it with hookrun.methods.saes.save_saelens" in text
    assert f"dictionaries.sae1.path: dictionary {tmp_path / 'nowhere'}: does not exist" in \
        refused(tmp_path, *overrides(corpus, tmp_path / "nowhere", hook))
    text = refused(tmp_path, *overrides(corpus, sae_dir, hook.replace("dictionary: sae1", "dictionary: sae2"),
                                        "+hooks.feats.splice=swap"))
    assert "hooks.feats.dictionary: 'sae2' is not in the dictionaries: block ({sae1}) (did you mean: sae1?); add " \
           "dictionaries: {sae2: {path: DIR}}" in text
    assert "hooks.feats.splice: 'swap' is unknown; use one of replace, replace_with_error" in text
    text = refused(tmp_path, *overrides(corpus, sae_dir, hook, "+hooks.feats.evaluate=true",
                                        "generate.max_new_tokens=3", "+hooks.x={kind: forward, layers: [lm_head], "
                                        "top_k: 3, edit: [{op: feature, dictionary: sae1, feature: 1}]}"))
    assert "hooks.feats.evaluate: runs extra forwards a batch, and a generate run has none" in text
    assert "hooks.x.top_k: set without hooks.x.dictionary" in text
    assert "hooks.x.edit[0]: op feature takes exactly one of set, scale, clamp, add; got none" in text


def test_features_equal_sae_lens_loading_the_same_folder(tmp_path, corpus, sae_dir):
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is not installed: pip install -e '.[saelens]' "
                                                      "(its own extra: it pins transformer-lens < 4)")
    cap = run_here(tmp_path, "feats", *overrides(
        corpus, sae_dir, f"+hooks.feats={{kind: forward, layers: [{LAYER}], dictionary: sae1, top_k: {D_SAE}}}"))
    theirs = sae_lens.SAE.load_from_disk(str(sae_dir), device="cpu")
    x = torch.cat([x for x, _ in block_outputs(reference())])
    with torch.no_grad():
        f = theirs.encode(x)
    dense = cap.read("dictionaries", "features", hook="feats", features=range(D_SAE))
    np.testing.assert_allclose(dense, f.numpy(), atol=1e-5)
    assert math.isfinite(float(f.sum()))
