"""circuit.features end to end: a run's stored sparse feature scores (each sample's top_k, the error node beside
them) equal feature_scores() run here and an AtP written here with a plain hook and torch.autograd.grad; the
verified features equal a plain one-feature patch loop; IG's stored features and error node add up to patching
the whole layer; cap.read("circuit").features is the table; a run failed mid-way and resumed is bitwise the
whole run; bad blocks are refused before any store (exit 2 on the command line)."""
import json
import os

import numpy as np
import pytest
import torch

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import causal_lm, tokenizer
from hookrun.methods.circuits.features import feature_scores
from hookrun.methods.saes import SparseAutoencoder, save_saelens
from tests.helpers import block0, make_cfg, same_store

PAIRS = [("the hooks run on a model", "the hooks run on a store"),
         ("a store of captures", "a store of hooks"),
         ("every layer writes an array", "every layer writes a model"),
         ("tokens of the model", "tokens of the store"),
         ("the model writes", "the store writes")]
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4}
D_SAE = 48
LD = "+metrics.ld={metric:logit_diff,a:' model',b:' store'}"
GRAD_CALLS = {"n": 0}


def fail_in_features(logits, inputs):
    """logit(' model') - logit(' store') at the last real token, failing in the batch at sample 4 at its second
    metric taken with a gradient (the feature scores' backward; the first is the edges' EAP) while
    HOOKRUN_TEST_FAIL_AT is 4."""
    if os.environ.get("HOOKRUN_TEST_FAIL_AT") == str(inputs.sample_start) and logits.requires_grad:
        GRAD_CALLS["n"] += 1
        if GRAD_CALLS["n"] == 2:
            raise RuntimeError("failing on purpose")
    a, b = (tokenizer()(w, add_special_tokens=False)["input_ids"][0] for w in (" model", " store"))
    cols = inputs.info.first + inputs.info.lengths - 1
    rows = torch.arange(len(cols))
    return logits[rows, cols, a] - logits[rows, cols, b]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


def make_sae(hook_name="blocks.0"):
    torch.manual_seed(3)
    sae = SparseAutoencoder(GPT2["n_embd"], D_SAE, hook_name=hook_name)
    with torch.no_grad():
        sae.b_enc.normal_(std=0.3)
        sae.W_enc.normal_(std=0.5)
    return sae.eval()


@pytest.fixture
def setup(tmp_path):
    """(pairs file, SAE folder: 48 features of the model's block 0 output)."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x}) + "\n" for c, x in PAIRS))
    save_saelens(make_sae(), tmp_path / "sae")
    return path, tmp_path / "sae"


def overrides(setup, features, *extra, circuit="source:clean,target:corrupt,metric:ld,method:eap"):
    pairs, sae = setup
    return ["+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in GPT2.items()), f"data.text.files=[{pairs}]",
            "data.text.fields={clean:clean,corrupt:corrupt}", "data.batch_size=2", "hooks.resid=null", LD,
            f"+dictionaries.sae1={{path:{sae}}}", f"+circuit={{{circuit},features:{features}}}", *extra]


def run_into(path, items):
    from hookrun.engine.runner import run

    return run(make_cfg([*items, f"store.path={path}"]))


def encode(text):
    tok = tokenizer()
    return torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]])


def ld(logits, rows):
    a, b = (tokenizer()(w, add_special_tokens=False)["input_ids"][0] for w in (" model", " store"))
    return logits[:, -1, a] - logits[:, -1, b]


def model_and_sae():
    torch.manual_seed(0)
    return causal_lm(**GPT2).eval(), make_sae()


def test_stored_sparse_features_equal_feature_scores_a_hand_written_atp_and_a_plain_patch_loop(setup, tmp_path):
    run_into(tmp_path / "run.zarr", overrides(setup, "{dictionary:sae1,layer:blocks.0,top_k:6,verify:3}"))
    cap = hookrun.open(tmp_path / "run.zarr")
    res = cap.read("circuit")
    table = res.features
    assert res.attrs["features"] == {"dictionary": "sae1", "layer": "blocks.0", "method": "atp", "steps": None,
                                     "top_k": 6, "verify": 3, "d_in": 32, "d_sae": D_SAE}
    ids, scores = cap.load(hook="_circuit", layer="ld", role="features.ids"), \
        cap.load(hook="_circuit", layer="ld", role="features.scores")
    exact = cap.load(hook="_circuit", layer="ld", role="features.exact")
    assert ids.shape == scores.shape == exact.shape == (5, 6)
    model, sae = model_and_sae()
    for s, (clean, corrupt) in enumerate(PAIRS):  # each pair alone, no padding (the run pads its batches of 2)
        src, tgt = encode(clean), encode(corrupt)
        direct = feature_scores(model, "blocks.0", sae, {"input_ids": src}, {"input_ids": tgt}, ld)
        # AtP by hand: dM/dx at block 0's output on the corrupt run, through the decoder to each feature
        _, x_s = block0(model, src, ld)
        eps = torch.zeros_like(x_s, requires_grad=True)
        m_t, x_t = block0(model, tgt, ld, eps=eps)
        g, = torch.autograd.grad(m_t.sum(), eps)
        with torch.no_grad():
            f_s, f_t = sae.encode(x_s), sae.encode(x_t)
            e_s, e_t = x_s - sae.decode(f_s), x_t - sae.decode(f_t)
            hand = ((f_s - f_t) * (g @ sae.W_dec.T)).sum(1)[0]  # [d_sae]
            hand_error = ((e_s - e_t) * g).sum()
        torch.testing.assert_close(direct.scores[0], hand, rtol=1e-4, atol=1e-6)
        top = torch.sort(hand.abs(), descending=True, stable=True).indices[:6]
        fired = hand[top] != 0
        assert fired[:3].all()  # the verified ones are real features
        assert ids[s][fired.numpy()].astype(int).tolist() == top[fired].tolist()
        assert (ids[s][~fired.numpy()] == -1).all()
        np.testing.assert_allclose(scores[s], hand[top].numpy(), rtol=1e-4, atol=1e-6)
        rows = table[table["sample"] == s]
        assert list(rows.node) == [f"f{i}" for i in top[fired].tolist()] + ["error"]
        assert rows.score.iloc[-1] == pytest.approx(float(hand_error), rel=1e-4, abs=1e-6)
        assert float(direct.error[0]) == pytest.approx(float(hand_error), rel=1e-4, abs=1e-6)
        # the exact patches: a plain loop, one feature's decoder direction times its change added at block 0
        with torch.no_grad():
            for k, i in enumerate(top[:3].tolist()):
                patched, _ = block0(model, tgt, ld, replace=x_t + (f_s - f_t)[..., i, None] * sae.W_dec[i])
                assert exact[s, k] == pytest.approx(float(patched - m_t), rel=1e-4, abs=1e-6)
                assert rows.exact.iloc[k] == exact[s, k]
            patched, _ = block0(model, tgt, ld, replace=x_t + (e_s - e_t))
            assert rows.exact.iloc[-1] == pytest.approx(float(patched - m_t), rel=1e-4, abs=1e-6)
        assert np.isnan(exact[s, 3:]).all() and rows.exact.iloc[3:-1].isna().all()
    assert abs(scores).max() > 1e-3 and np.nanmax(abs(exact)) > 1e-3
    assert "features of sae1 at blocks.0 (atp, top 6)" in repr(res)


@pytest.mark.slow
def test_ig_stores_every_feature_and_the_error_node_which_add_up_to_patching_the_layer(setup, tmp_path):
    run_into(tmp_path / "run.zarr", overrides(setup, f"{{dictionary:sae1,method:ig,steps:24,top_k:{D_SAE}}}",
                                              "data.batch_size=1"))
    res = hookrun.open(tmp_path / "run.zarr").read("circuit")
    assert res.attrs["features"]["layer"] == "blocks.0"  # from the dictionary's cfg.json (hook_name)
    model, sae = model_and_sae()
    for s, (clean, corrupt) in enumerate(PAIRS):
        src, tgt = {"input_ids": encode(clean)}, {"input_ids": encode(corrupt)}
        direct = feature_scores(model, "blocks.0", sae, src, tgt, ld, method="ig", steps=24)
        rows = res.features[res.features["sample"] == s]
        got = dict(zip(rows.node, rows.score))
        want = {f"f{i}": v for i, v in enumerate(direct.scores[0].tolist()) if v != 0}
        assert set(got) == set(want) | {"error"}
        assert [got[k] for k in want] == pytest.approx(list(want.values()), rel=1e-4, abs=1e-6)
        assert got["error"] == pytest.approx(float(direct.error[0]), rel=1e-4, abs=1e-6)
        with torch.no_grad():
            m_t, _ = block0(model, tgt["input_ids"], ld)
            _, x_s = block0(model, src["input_ids"], ld)
            whole, _ = block0(model, tgt["input_ids"], ld, replace=x_s)
        assert rows.score.sum() == pytest.approx(float(whole - m_t), rel=5e-3, abs=1e-4)  # completeness


@pytest.mark.slow
def test_a_feature_circuit_run_failed_mid_way_and_resumed_equals_the_whole_run(setup, tmp_path, monkeypatch):
    items = overrides(setup, "{dictionary:sae1,method:atp,top_k:5,verify:2}", "store.commit_s=0",
                      "+metrics.f={_target_:tests.test_feature_circuits.fail_in_features}",
                      circuit="source:clean,target:corrupt,metric:f,method:eap")
    run_into(tmp_path / "whole.zarr", items)
    monkeypatch.setenv("HOOKRUN_TEST_FAIL_AT", "4")
    GRAD_CALLS["n"] = 0
    with pytest.raises(Exception, match="failing on purpose"):
        run_into(tmp_path / "cut.zarr", items)
    assert hookrun.open(tmp_path / "cut.zarr").read("circuit").features["sample"].max() == 3
    monkeypatch.delenv("HOOKRUN_TEST_FAIL_AT")
    run_into(tmp_path / "cut.zarr", [*items, "store.mode=resume"])
    whole, cut = hookrun.open(tmp_path / "whole.zarr"), hookrun.open(tmp_path / "cut.zarr")
    same_store(whole, cut)
    a, b = whole.read("circuit").features, cut.read("circuit").features
    assert a.equals(b) and a["sample"].max() == 4 and a.exact.notna().sum() == 5 * 3


def refused(setup, tmp_path, features, *extra):
    with pytest.raises(ConfigError) as err:
        run_into(tmp_path / "bad.zarr", overrides(setup, features, *extra))
    assert not (tmp_path / "bad.zarr").exists()
    return "\n".join(err.value.problems)


@pytest.mark.slow
def test_bad_feature_blocks_are_refused_before_any_store(setup, tmp_path, cli):
    out = refused(setup, tmp_path, "{dictionary:sae2,layer:blocks.0}")
    assert ("circuit.features.dictionary: 'sae2' is not in the dictionaries: block ({sae1}) (did you mean: sae1?); "
            "add dictionaries: {sae2: {path: DIR}}") in out
    out = refused(setup, tmp_path, "{dictionary:sae1,layer:blocks.1}")
    assert ("circuit.features.layer: dictionary sae1 was trained on blocks.0 (cfg.json's hook_name), but "
            "circuit.features reads it at blocks.1; read it at blocks.0, or set dictionaries.sae1.any_layer=true") \
        in out
    out = refused(setup, tmp_path, "{dictionary:sae1,layer:blocks.0.mlp.hidden}", "+dictionaries.sae1.any_layer=true")
    assert ("circuit.features.layer: blocks.0.mlp.hidden is 128 wide, but dictionary sae1 reads 32-wide activations "
            "(d_in); give the layer it was trained on (cfg.json's hook_name: blocks.0)") in out
    out = refused(setup, tmp_path, "{dictionary:sae1,layer:blocks.0.attn.heads}")
    assert "circuit.features.layer: 'blocks.0.attn.heads' is split by head" in out
    out = refused(setup, tmp_path, "{dictionary:sae1,layer:blocks.7}")
    assert "circuit.features.layer: 'blocks.7' is not a site of GPT2LMHeadModel" in out
    out = refused(setup, tmp_path, f"{{dictionary:sae1,top_k:{D_SAE + 1}}}")
    assert (f"circuit.features.top_k: {D_SAE + 1} is more than the {D_SAE} features of dictionary sae1; give at most "
            f"{D_SAE}") in out
    out = refused(setup, tmp_path, "{dictionary:sae1,top_k:4,verify:5,method:atp,steps:8,site:blocks.0}")
    assert ("circuit.features.verify: 5 but top_k is 4: only a sample's stored features are patched; give "
            "verify <= 4, or raise top_k") in out
    assert "circuit.features.steps: 8 but method is atp, which takes no steps; set circuit.features.method=ig" in out
    assert "circuit.features.site: unknown key (did you mean: steps?); features take dictionary, layer, method" in out
    out = refused(setup, tmp_path, "{dictionary:sae1,method:eap,verify:-1,top_k:0}")
    assert "circuit.features.method: 'eap' is unknown; use atp or ig" in out
    assert "circuit.features.verify: -1 is too small; give an integer in [0, 16_777_216] (0: none)" in out
    assert "circuit.features.top_k: 0 is too small; give an integer in [1, 1_000_000_000]" in out
    out = refused(setup, tmp_path, "{dictionary:sae1,verify:17}")  # top_k's default is 16
    assert "circuit.features.verify: 17 but top_k is 16 (the default)" in out
    proc = cli(*overrides(setup, "{dictionary:sae1,layer:blocks.0,method:atp,steps:4}"),
               f"hydra.run.dir={tmp_path}/cli", check=False)
    assert proc.returncode == 2 and "circuit.features.steps: 4 but method is atp" in proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("zarr.json"))


@pytest.mark.slow
def test_the_bundled_feature_circuit_prints_what_the_docs_show(tmp_path):
    """conf/experiment/feature_circuit.yaml run in process and its analysis, against the block docs/circuits.md
    shows (every number within ±0.01, the page's tolerance, plus its printed rounding)."""
    import contextlib
    import io
    import re

    from hookrun.engine.runner import run
    from tests.helpers import REPO

    run(make_cfg(["+experiment=feature_circuit", f"store.path={tmp_path / 'captures.zarr'}"]))
    from hookrun.experiments import feature_circuit

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        feature_circuit.main([str(tmp_path)])
    page = (REPO / "docs" / "circuits.md").read_text()
    shown = re.search(r"The second command prints \(a fresh run matches within ±0\.01\):\n\n```text\n(.*?)```",
                      page, re.S)[1]
    fresh = [line for line in out.getvalue().splitlines() if line.strip()]
    shown = [line for line in shown.splitlines() if line.strip()]
    assert len(fresh) == len(shown), out.getvalue()
    number = re.compile(r"-?\d+\.\d+|-?\d+")
    for said, got in zip(shown, fresh):
        a, b = number.findall(said), number.findall(got)
        assert len(a) == len(b) and re.sub(number, "#", said).split() == re.sub(number, "#", got).split(), (said, got)
        for x, y in zip(a, b):
            half = 0.5 * 10 ** -len(x.split(".")[1]) if "." in x else 0
            assert abs(float(x) - float(y)) <= 0.01 + half, (said, got)
