"""The lens: block in real runs, against plain PyTorch written here (own forward hooks, the final norm and the
unembedding applied by hand, each prompt run alone) on a GPT-2 and a Llama built from configs; and its refusals."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import tokenizer
from tests.helpers import make_cfg
from tests.test_patching_run import model_overrides, reference

LAYERS = {"gpt2": "transformer.h.{}", "llama": "model.layers.{}"}
TOKENS = [" the", 7]  # a string of one token and an id
DLA_TOKENS = [" model", " the"]


def lens_run(kind, *extra):
    side = "left" if kind == "llama" else "right"
    return [*model_overrides(kind), "hooks.resid=null", "data.max_samples=5", "data.batch_size=2",
            "data.text.max_length=12", f"data.text.padding_side={side}", "lens.sites.layers=blocks",
            "lens.sites.positions=all", "lens.top_k=4", f"lens.tokens=[' the',{TOKENS[1]}]",
            "lens.dla.tokens=[' model',' the']", *extra]


def sample_ids(cap):
    """Each stored sample's token ids, from the run's token table."""
    tokens = cap.tokens()
    return [torch.tensor([g.sort_values("position")["token_id"].tolist()]) for _, g in tokens.groupby("sample")]


def plain_lens(model, kind, ids):
    """[layers, T, V] log-probabilities of each block's output read through the final norm and unembedding by
    hand, and the model's own logits [T, V]: one prompt alone, own forward hooks."""
    blocks = model.transformer.h if kind == "gpt2" else model.model.layers
    norm = model.transformer.ln_f if kind == "gpt2" else model.model.norm
    outs = []
    handles = [b.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
               for b in blocks]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
        lens = torch.stack([torch.log_softmax(norm(h)[0] @ model.lm_head.weight.T, -1) for h in outs])
    for h in handles:
        h.remove()
    return lens, logits


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_lens_equals_a_lens_written_here_and_the_last_layer_the_models_logits(run_cfg, kind):
    cap = run_cfg(lens_run(kind))
    lens = cap.read("lens")
    model = reference(kind)
    n_layers = len(lens.layers)
    assert lens.layers == [LAYERS[kind].format(i) for i in range(n_layers)] and n_layers == 3
    assert lens.top_ids.shape[:3] == (5, 3, 12) and lens.top_ids.shape[3] == 4
    stored = {key: cap.array(key).dtype for key in cap.index.array.unique() if key.endswith(("/ids", "/rank"))}
    assert stored and set(stored.values()) == {np.dtype("int32")}, stored  # token ids stored exact, not as float
    tok = tokenizer()
    the = tok(" the", add_special_tokens=False)["input_ids"][0]
    checked = 0
    for row, ids in enumerate(sample_ids(cap)):
        t = ids.shape[1]
        mine, logits = plain_lens(model, kind, ids)
        # the last layer read out is the model's own output
        assert torch.allclose(torch.log_softmax(logits, -1), mine[-1], atol=1e-4)
        own = torch.softmax(logits, -1).topk(4)
        assert np.array_equal(lens.top_ids[row, -1, :t], own.indices.numpy())
        np.testing.assert_allclose(lens.top_probs[row, -1, :t], own.values.numpy(), atol=1e-5)
        for layer in range(n_layers):
            top = mine[layer].topk(4)
            assert np.array_equal(lens.top_ids[row, layer, :t], top.indices.numpy())
            np.testing.assert_allclose(lens.top_probs[row, layer, :t], top.values.exp().numpy(), atol=1e-5)
            for j, token in enumerate([the, TOKENS[1]]):
                np.testing.assert_allclose(lens.logprob[row, layer, :t, j], mine[layer][:, token].numpy(), atol=1e-4)
                want = (mine[layer] > mine[layer][:, token:token + 1]).sum(-1).numpy()
                assert np.array_equal(lens.rank[row, layer, :t, j], want)
        assert (lens.top_ids[row, :, t:] == -1).all() and np.isnan(lens.top_probs[row, :, t:]).all()
        checked += t
    assert checked == len(cap.tokens())
    frame = lens.to_frame()
    assert len(frame) == checked * n_layers  # positions past a sample's end are left out
    first = frame.iloc[0]
    assert first["token"] == tok.decode([lens.top_ids[0, 0, 0, 0]]) and first["top_ids"] == list(lens.top_ids[0, 0, 0])
    assert first["logprob[' the']"] == lens.logprob[0, 0, 0, 0] and first["rank[7]"] == lens.rank[0, 0, 0, 1]


def plain_dla(model, kind, ids, a, b):
    """The logit difference at the last token, and the last MLP's share by the frozen-scale formula written out here."""
    last_mlp = (model.transformer.h[-1].mlp if kind == "gpt2" else model.model.layers[-1].mlp)
    norm = model.transformer.ln_f if kind == "gpt2" else model.model.norm
    kept = {}
    h1 = last_mlp.register_forward_hook(lambda m, x, o: kept.__setitem__("mlp", o))
    h2 = norm.register_forward_pre_hook(lambda m, x: kept.__setitem__("final", x[0]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    h1.remove()
    h2.remove()
    with torch.no_grad():
        w = model.lm_head.weight[a] - model.lm_head.weight[b]
        x, final = kept["mlp"][0, -1], kept["final"][0, -1]
        if kind == "gpt2":
            share = (x - x.mean()) / torch.sqrt(final.var(unbiased=False) + norm.eps) * norm.weight @ w
        else:
            share = x / torch.sqrt(final.pow(2).mean() + norm.variance_epsilon) * norm.weight @ w
    return float(logits[a] - logits[b]), float(share)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_dla_parts_sum_to_the_logit_difference_as_stored(run_cfg, kind):
    cap = run_cfg(lens_run(kind, "lens.sites.layers=[]", "lens.tokens=[]"))
    dla = cap.read("lens").dla
    n = 3
    want_names = ({"gpt2": ["transformer.wte", "transformer.wpe"], "llama": ["model.embed_tokens"]}[kind] +
                  [f"{LAYERS[kind].format(i)}.{part}" for i in range(n) for part in
                   (("attn", "mlp") if kind == "gpt2" else ("self_attn", "mlp"))] + ["bias"])
    assert dla.components == want_names
    assert dla.parts.shape == (5, len(want_names)) and dla.heads.shape == (5, n, 4)
    tok = tokenizer()
    a, b = (tok(s, add_special_tokens=False)["input_ids"][0] for s in DLA_TOKENS)
    model = reference(kind)
    for row, ids in enumerate(sample_ids(cap)):
        ld, share = plain_dla(model, kind, ids, a, b)
        assert abs(dla.parts[row].sum() - ld) < 1e-4  # the parts, as stored, sum to the model's logit difference
        assert abs(dla.logit[row] - ld) < 1e-4
        assert abs(dla.parts[row, -2] - share) < 1e-4  # the last MLP's part, by hand
    frame = dla.frame()
    np.testing.assert_allclose(frame["total"], frame["logit"], atol=1e-4)
    np.testing.assert_allclose(cap.samples["dla.logit"], dla.logit)
    attn = [j for j, kind_ in enumerate(dla.kinds) if kind_ == "attn"]
    # the heads sum to the block's attention part (Llama's o_proj has no bias; GPT-2's c_proj bias is 0 at init)
    np.testing.assert_allclose(dla.heads.sum(2), dla.parts[:, attn], atol=1e-5)
    tidy = dla.to_frame()
    assert len(tidy) == 5 * len(want_names) + 5 * n * 4
    assert list(dla.blocks().columns) == ["attn", "mlp"] and len(dla.blocks()) == n


@pytest.mark.slow
def test_per_sample_answer_fields_and_the_picture_cli(tmp_path, cli):

    rows = [("the hooks run on a", " model", " store"), ("a store of", " hooks", " the")]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"text": t, "answer": a, "wrong": w}) + "\n" for t, a, w in rows))
    run_dir = tmp_path / "r"
    cli(*model_overrides("gpt2"), "hooks.resid=null", f"data.text.files=[{path}]", "data.batch_size=2",
        "lens.sites.layers=blocks", "lens.tokens=[{field:answer}]",
        "lens.dla.tokens=[{field:answer},{field:wrong}]", f"hydra.run.dir={run_dir}")
    cap = hookrun.open(run_dir)
    lens = cap.read("lens")
    tok = tokenizer()
    model = reference("gpt2")
    for row, ((text, answer, wrong), ids) in enumerate(zip(rows, sample_ids(cap))):
        a, b = (tok(s, add_special_tokens=False)["input_ids"][0] for s in (answer, wrong))
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1]
        assert abs(lens.dla.logit[row] - float(logits[a] - logits[b])) < 1e-4
        np.testing.assert_allclose(lens.logprob[row, -1, 0, 0], torch.log_softmax(logits, -1)[a], atol=1e-4)
    out = subprocess.run([sys.executable, "-m", "hookrun.plot", str(run_dir)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name in ("lens.png", "dla.png", "dla_heads.png"):
        assert (run_dir / "plots" / name).stat().st_size > 5000


class Residual(nn.Module):
    """x + linear(x): a block whose output is the residual stream."""

    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return x + self.linear(x)


class TinyLM(nn.Module):
    """A language model of no known architecture: embed -> block -> norm -> head."""

    def __init__(self, vocab: int = 512, d: int = 16, **ignored):  # (the lm_tokens experiment's GPT-2 keys)
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = Residual(d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.ln(self.block(self.embed(input_ids))))


TINY = ["+experiment=lm_tokens", "model._target_=tests.test_lens.TinyLM", "hooks.resid=null", "data.max_samples=3",
        "data.text.max_length=8"]


def problems(overrides):
    from hookrun.engine.runner import run

    with pytest.raises(ConfigError) as err:
        run(make_cfg([*overrides, "store.path=/nonexistent/never.zarr"]))
    return err.value.problems


def test_a_model_without_a_known_unembedding_is_refused_with_the_keys_to_set(cli, tmp_path):
    proc = cli(*TINY, "lens.sites.layers=[block]", f"hydra.run.dir={tmp_path}/r", check=False)
    assert proc.returncode == 2
    assert ("lens: cannot find the unembedding of TinyLM (model_type None): set lens.unembed (and lens.norm) to "
            "dotted module names; norm-like modules (last 1): ln; the last Linear layers: block.linear, head") in \
        proc.stdout + proc.stderr
    assert not (tmp_path / "r" / "captures.zarr").exists()


def test_a_model_named_by_norm_and_unembed_reads_its_own_output(run_cfg):
    cap = run_cfg([*TINY, "lens.sites.layers=[block]", "lens.norm=ln", "lens.unembed=head", "lens.top_k=2"])
    lens = cap.read("lens")
    torch.manual_seed(0)
    model = TinyLM().eval()
    for row, ids in enumerate(sample_ids(cap)):
        with torch.no_grad():
            top = torch.softmax(model(ids)[0, -1], -1).topk(2)
        assert np.array_equal(lens.top_ids[row, 0, 0], top.indices.numpy())  # the block's output -> ln -> head
        np.testing.assert_allclose(lens.top_probs[row, 0, 0], top.values.numpy(), atol=1e-6)


def test_refusals_name_the_key_and_the_fix():
    found = problems([*TINY, "lens.sites.layers=blocks", "lens.norm=ln", "lens.unembed=head"])
    assert found == ["lens.sites.layers: blocks picks every block of a known architecture, and TinyLM (model_type "
                     "None) is none; name the modules whose output is the residual stream, e.g. "
                     "lens.sites.layers=[model.blocks.0, model.blocks.1]"]
    found = problems([*TINY, "lens.norm=ln_f", "lens.unembed=head", "lens.sites.layers=[block]"])
    assert found[0].startswith("lens.norm: 'ln_f' is no module of TinyLM (did you mean: ln?)")
    found = problems([*TINY, "lens.norm=ln", "lens.unembed=head", "lens.dla.tokens=[1]"])
    assert found[0].startswith("lens.dla: TinyLM (model_type None) has no known component layout; DLA supports")
    gpt2 = [*model_overrides("gpt2"), "hooks.resid=null", "data.max_samples=2", "data.text.max_length=8"]
    found = problems([*gpt2, "lens.sites.layers=[transformer.h.9]"])
    assert found == ["lens.sites.layers: 'transformer.h.9' matches no module (did you mean: transformer.h.0?)"] or \
        found[0].startswith("lens.sites.layers: 'transformer.h.9' matches no module")
    found = problems([*gpt2, "lens.sites.layers=blocks", "lens.tokens=[' hooks model']"])
    assert found == ["lens.tokens[0]: ' hooks model' is 2 tokens [' hooks', ' model'] (ids [" + ", ".join(
        str(i) for i in tokenizer()(" hooks model", add_special_tokens=False)["input_ids"]) + "]), not one; give a "
        "single token (e.g. ' hooks') or its id"]
    found = problems([*gpt2, "lens.dla.tokens=[' model',' the',' a']", "lens.dla.position=[0]"])
    assert found[0].startswith("lens.dla.tokens: [' model', ' the', ' a']; give the answer [A] (its logit) or [A, B]")
    assert found[1] == "lens.dla.position: [0]; DLA attributes one position: last, first or an int"
    found = problems([*gpt2, "lens.sites.layers=blocks", "lens.sites.positions=[40]"])
    assert found == ["lens.sites.positions: position 40 is beyond a sequence of 8 real tokens in this run; use "
                     "positions inside every sequence (first, last, or -1, -2, ...)"]
    found = problems([*gpt2, "lens.sites.layers=blocks", "lens.tokens=[600]", "lens.top_k=0"])
    assert found[0] == ("lens.top_k: 0 is too small; give an integer in [1, 1_000_000_000] (the most likely tokens "
                        "stored per site)")
    found = problems([*gpt2, "lens.sites.layers=blocks", "lens.tokens=[600]"])
    assert found == ["lens.tokens[0]: token id 600 is outside the model's 512 logits; give an id below 512"]
    found = problems([*gpt2, "lens.sites.layers=blocks", "generate.max_new_tokens=2"])
    assert "lens: the lens reads one forward pass of the prompts, not generation; drop lens or set " \
           "generate.max_new_tokens=0" in found


def post_ln_opt(**ignored):
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(vocab_size=512, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                    num_attention_heads=2, max_position_embeddings=64, do_layer_norm_before=False))


def test_dla_on_an_architecture_it_cannot_decompose_is_refused():
    found = problems(["+experiment=lm_tokens", "model._target_=tests.test_lens.post_ln_opt", "hooks.resid=null",
                      "data.max_samples=2", "lens.dla.tokens=[' the']"])
    assert found[0].startswith("lens.dla: OPTForCausalLM normalises after each block (do_layer_norm_before=False), "
                               "so the blocks' outputs do not sum to the final residual stream")


def test_an_edit_on_the_residual_stream_is_refused_for_dla_at_the_first_batch():
    found = problems([*model_overrides("gpt2"), "hooks.resid=null", "data.max_samples=2", "data.text.max_length=8",
                      "lens.dla.tokens=[' model',' the']", "+hooks.push={kind:forward,layers:[transformer.h.1],"
                      "capture:[],edit:[{op:add,value:3.0}]}"])
    assert len(found) == 1 and found[0].startswith("lens.dla: batch 0: the 8 components of GPT2LMHeadModel")
    assert "drop the edit or set lens.dla.tokens=[]" in found[0]


def test_the_bundled_lens_experiment_and_its_analysis(tmp_path):
    from hookrun.experiments.moods import ADJECTIVES
    from tests.test_experiments import analysis, run_experiment

    run_experiment(tmp_path, "+experiment=lens")
    cap = hookrun.open(tmp_path)
    lens = cap.read("lens")
    assert lens.layers == ["blocks.0.resid_pre", "blocks.0", "blocks.1"] and len(lens.samples) == 8
    dla = lens.dla
    np.testing.assert_allclose(dla.parts.sum(1), dla.logit, atol=1e-4)
    assert (dla.logit > 1).all()  # the trained model prefers the prompt's mood word: " good" on happy, " bad" on sad
    frame = lens.to_frame()
    last = frame[(frame["layer"] == "blocks.1") &
                 (frame["position"] == frame.groupby("sample")["position"].transform("max"))]
    moods = cap.samples.set_index("sample")["mood"]
    for row in last.itertuples():  # the last layer's top token after "it felt" is an adjective of the prompt's mood
        assert row.token.strip() in ADJECTIVES[moods[row.sample]], (row.sample, row.token)
    out = analysis("lens", tmp_path)
    assert "logit lens of sample 0" in out and "DLA of logit(answer) - logit(wrong) at position last" in out
    assert "top parts (mean over all prompts):" in out and "transformer.h.0.mlp" in out
    for name in ("lens.png", "dla.png", "dla_heads.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 5000
