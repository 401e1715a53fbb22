"""Standard site names in hooks (hookrun.capture.anatomy through hookrun.capture.hooks): the bundled LM experiments
run unchanged apart from the model (`model=hf model.path=DIR`) on tiny random models of six families saved with
save_pretrained beside a tokenizer built offline, and what a standard name captures equals, bit for bit, what the
native module captures in the same run; edits and gradients at standard sites against plain PyTorch; the refusals;
the readers taking either name; inspect=true's anatomy table."""
import numpy as np
import pytest
import torch
import transformers as tf

import hookrun
from hookrun.capture.anatomy import anatomy
from hookrun.config.checks import ConfigError
from hookrun.engine.runner import run
from hookrun.experiments.hf import causal_lm
from hookrun.experiments.lm import tokenizer
from tests.helpers import make_cfg, run_cli

V, D = 512, 64  # the bundled tokenizer's vocabulary at most; d_model
LLAMA = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
FAMILIES = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_layer=2, n_embd=D, n_head=4, n_positions=64)),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=V, hidden_size=D, intermediate_size=128,
                                                               num_hidden_layers=2, num_attention_heads=4)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=V, hidden_size=D, ffn_dim=128, num_hidden_layers=2,
                                                  num_attention_heads=4, max_position_embeddings=64)),
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**LLAMA)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**LLAMA, head_dim=16)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a folder holding a tiny random model (save_pretrained) and the mood language's tokenizer."""
    tok = tokenizer("pkg://hookrun.experiments/data/moods.txt", V)
    out = {}
    for name, build in FAMILIES.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        model = build()
        for config in (model.config, model.generation_config):  # the tokenizer's special tokens, not GPT-2's 50256
            config.bos_token_id, config.eos_token_id, config.pad_token_id = \
                tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        model.save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = path
    return out


def _run(where, *overrides):
    return hookrun.open(run(make_cfg([*overrides, f"store.path={where}", "hydra.run.dir=."])))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bundled_lm_experiments_run_unchanged_on_each_family(folders, family, tmp_path):
    model = ["model=hf", f"model.path={folders[family]}"]
    loaded = causal_lm(str(folders[family]))
    anat = anatomy(loaded)
    native = [anat.point(f"blocks.{i}").module for i in range(2)]
    # lm_tokens (every block's output) with a hook on the native block modules beside it: the same tensors
    cap = _run(tmp_path / "lm", "+experiment=lm_tokens", *model, "data.max_samples=16",
               f"+hooks.native={{kind: forward, layers: [{native[0]}, {native[1]}]}}")
    assert sorted(cap.index.query("hook == 'resid'")["array"].unique()) == ["resid/blocks.0/output",
                                                                               "resid/blocks.1/output"]
    for i in range(2):
        rows = cap.index.query(f"hook == 'resid' and layer == 'blocks.{i}'")
        assert set(rows["module"]) == {native[i]} and set(rows["module_role"]) <= {"output", "output.0"}
        role = cap.rows(hook="native", layer=native[i])["role"].iloc[0]
        standard, mod = cap.load(hook="resid", layer=f"blocks.{i}"), cap.load(hook="native", layer=native[i], role=role)
        assert standard.shape[0] > 100 and standard.tobytes() == mod.tobytes()
        assert cap.load(hook="resid", layer=native[i]).tobytes() == standard.tobytes()  # either name reads it
    # steer_source twice (the direction's two sides), then steer with the direction added while generating
    for mood in ("happy", "sad"):
        src = _run(tmp_path / f"steer_{mood}" / "captures.zarr", "+experiment=steer_source", *model,
                   f"data.text.files=[pkg://hookrun.experiments/data/{mood}.txt]",
                   f"+hooks.native={{kind: forward, layers: [{native[1]}]}}")
        assert src.load(hook="resid", layer="blocks.1").tobytes() == src.load(hook="native", layer=native[1]).tobytes()
    steered = _run(tmp_path / "steer" / "captures.zarr", "+experiment=steer", *model,
                   f"hooks.steer.edit.0.value.diff.0.store={tmp_path / 'steer_happy'}",
                   f"hooks.steer.edit.0.value.diff.1.store={tmp_path / 'steer_sad'}")
    assert list(steered.index["array"].unique()) == ["resid/blocks.1/output"]
    assert len(steered.generations()) == 8


@pytest.fixture(scope="module")
def gpt2(folders):
    return ["+experiment=lm_tokens", "model=hf", f"model.path={folders['gpt2']}", "data.max_samples=8",
            "data.text.max_length=16"]


def test_sites_equal_the_native_tensors_they_stand_for(gpt2, tmp_path):
    """Heads, q/k/v (a slice of GPT-2's fused c_attn), mlp.hidden, resid_pre and resid_mid against native roles."""
    sites = "[blocks.1.attn.heads, blocks.1.attn.q, blocks.1.attn.k, blocks.1.attn.v, blocks.0.mlp.hidden, " \
            "blocks.1.resid_pre, blocks.1.resid_mid, embed, unembed]"
    cap = _run(tmp_path, *gpt2, f"+hooks.std={{kind: forward, layers: {sites}}}",
               "+hooks.nat={kind: forward, layers: [transformer.h.1.attn.c_proj, transformer.h.1.attn.c_attn, "
               "transformer.h.0.mlp.c_proj, transformer.h.0, transformer.h.1.ln_2, transformer.wte, lm_head], "
               "capture: [input.0, output]}")
    heads = cap.load(hook="std", layer="blocks.1.attn.heads")
    assert heads.shape[1:] == (4, 16)
    assert heads.reshape(len(heads), -1).tobytes() == cap.load(hook="nat", layer="transformer.h.1.attn.c_proj",
                                                               role="input.0").tobytes()
    qkv = cap.load(hook="nat", layer="transformer.h.1.attn.c_attn", role="output")
    for j, part in enumerate("qkv"):
        got = cap.load(hook="std", layer=f"blocks.1.attn.{part}")
        assert np.array_equal(got.reshape(len(got), -1), qkv[:, j * D:(j + 1) * D])
    pairs = [("blocks.0.mlp.hidden", "transformer.h.0.mlp.c_proj", "input.0"),
             ("blocks.1.resid_pre", "transformer.h.0", "output"),
             ("blocks.1.resid_mid", "transformer.h.1.ln_2", "input.0"),
             ("embed", "transformer.wte", "output"), ("unembed", "lm_head", "output")]
    for site, module, role in pairs:
        assert cap.load(hook="std", layer=site).tobytes() == cap.load(hook="nat", layer=module, role=role).tobytes()
    index = cap.rows(hook="std", layer="blocks.1.attn.heads")
    assert set(index["module"]) == {"transformer.h.1.attn.c_proj"} and set(index["module_role"]) == {"input.0"}
    arr = cap.array("std/blocks.1.attn.heads/output") if hasattr(cap, "array") else None
    if arr is not None:
        assert arr.attrs["module"] == "transformer.h.1.attn.c_proj" and arr.attrs["module_role"] == "input.0"
    # a native name and role read the standard capture (no native hook holds that role of that module)
    assert cap.load(hook="std", layer="transformer.h.1.ln_2", role="input.0").tobytes() == \
        cap.load(hook="std", layer="blocks.1.resid_mid").tobytes()


def test_heads_edit_needs_no_n_heads(gpt2, tmp_path):
    """Zeroing head 1 at blocks.0.attn.heads (no n_heads: the site is split by head) gives block 0's output that
    zeroing columns 16:32 of c_proj's input gives natively, and another than no edit."""
    outs = []
    for edit in ("{kind: forward, layers: [blocks.0.attn.heads], capture: [], edit: [{op: zero, heads: [1]}]}",
                 "{kind: forward_pre, layers: [transformer.h.0.attn.c_proj], capture: [], edit: [{op: zero, dim: -1, "
                 "index: [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]}]}", None):
        extra = [f"+hooks.ablate={edit}"] if edit else []
        cap = _run(tmp_path / str(len(outs)), *gpt2, "layers=[blocks.0]", *extra)
        outs.append(cap.load(hook="resid", layer="blocks.0"))
    assert outs[0].tobytes() == outs[1].tobytes() and not np.array_equal(outs[0], outs[2])


def test_output_grad_at_a_standard_site_is_autograd(gpt2, folders, tmp_path):
    cap = _run(tmp_path, *gpt2, "data.max_samples=4", "data.batch_size=4", "loss=sum",
               "+hooks.g={kind: output_grad, layers: [blocks.1.attn.heads, blocks.1.resid_pre]}",
               "+hooks.ng={kind: output_grad, layers: [transformer.h.0]}")
    assert set(cap.index.query("hook == 'g'")["role"]) == {"grad"}
    pre, block0 = cap.load(hook="g", layer="blocks.1.resid_pre"), cap.load(hook="ng", layer="transformer.h.0")
    assert pre.tobytes() == block0.tobytes()
    heads = cap.load(hook="g", layer="blocks.1.attn.heads")
    assert heads.shape[1:] == (4, 16) and np.abs(heads).sum() > 0


@pytest.mark.parametrize("layers, said", [
    ("[blocks.0.resid_mid]", ["'blocks.0.resid_mid' is not a site of GPTNeoXForCausalLM (gpt_neox)", "parallel",
                              "blocks.N.resid_pre"]),
    ("[blocks.7]", ["'blocks.7'", "2 blocks", "did you mean"]),
    ("[blocks.0.attn.pattern]", ["attn_implementation=eager"]),
])
def test_a_site_the_architecture_lacks_is_refused_before_the_run(folders, layers, said, tmp_path):
    with pytest.raises(ConfigError) as err:
        run(make_cfg(["+experiment=lm_tokens", "model=hf", f"model.path={folders['gpt_neox']}",
                      f"layers={layers}", f"store.path={tmp_path}"]))
    text = "\n".join(err.value.problems)
    assert text.startswith("hooks.resid.layers: ") and all(s in text for s in said), text
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.slow
def test_cli_exit_2_for_a_lacking_site_and_for_an_unknown_architecture(folders, tmp_path):
    proc = run_cli("+experiment=lm_tokens", "model=hf", f"model.path={folders['gpt_neox']}",
                   "layers=[blocks.1.resid_mid]", f"hydra.run.dir={tmp_path}", check=False)
    assert proc.returncode == 2 and "resid_mid" in proc.stderr + proc.stdout and "gpt_neox" in proc.stderr + proc.stdout
    proc = run_cli("+model._target_=tests.models.MLP", "+data.inputs.x={random:normal,shape:[8,4]}",
                   "+hooks.a={kind:forward,layers:[blocks.0]}", f"hydra.run.dir={tmp_path}", check=False)
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2 and "model.anatomy" in out and "fc1" in out, out


def test_backward_kind_on_a_standard_site_names_output_grad(gpt2, tmp_path):
    with pytest.raises(ConfigError) as err:
        run(make_cfg([*gpt2, "loss=sum", "+hooks.b={kind: backward, layers: [blocks.0.resid_mid]}",
                      f"store.path={tmp_path}"]))
    assert any(p.startswith("hooks.b.kind: backward cannot hook") and "output_grad" in p
               for p in err.value.problems), err.value.problems


class Tiny(torch.nn.Module):
    """A model hookrun does not know: embed, layers[i].attn / .mlp (residual adds), head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": torch.nn.Linear(8, 8),
                                                               "mlp": torch.nn.Linear(8, 8)}) for _ in range(2))
        self.head = torch.nn.Linear(8, 20)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer["attn"](x)
            x = x + layer["mlp"](x)
        return self.head(x)


def test_declared_anatomy_for_an_unknown_model(tmp_path):
    """model.anatomy names the parts of a model hookrun does not know (it never reaches the constructor)."""
    cap = _run(tmp_path, "+model._target_=tests.test_standard_sites.Tiny",
               "+model.anatomy={blocks: layers, embed: embed, attn: attn, mlp: mlp, unembed: head}",
               "+data.inputs.ids={random: randint, high: 20, shape: [8, 5]}", "data.batch_size=4",
               "+hooks.a={kind: forward, layers: ['blocks.*.mlp', embed]}",
               "+hooks.n={kind: forward, layers: [layers.1.mlp]}")
    assert sorted(cap.index["array"].unique()) == ["a/blocks.0.mlp/output", "a/blocks.1.mlp/output", "a/embed/output",
                                                   "n/layers.1.mlp/output"]
    assert cap.load(hook="a", layer="blocks.1.mlp").tobytes() == cap.load(hook="n", layer="layers.1.mlp").tobytes()
    with pytest.raises(ConfigError) as err:
        run(make_cfg(["+model._target_=tests.test_standard_sites.Tiny", "+model.anatomy={blocks: layers, atn: attn}",
                      "+data.inputs.ids={random: randint, high: 20, shape: [8, 5]}", "+hooks.a={kind: forward, "
                      "layers: [blocks.0]}", f"store.path={tmp_path / 'bad'}"]))
    text = "\n".join(err.value.problems)
    assert "model.anatomy.atn: unknown part (did you mean: attn" in text and "model.anatomy.embed: missing" in text


@pytest.mark.slow
def test_inspect_prints_the_anatomy(folders):
    proc = run_cli("+experiment=lm_tokens", "model=hf", f"model.path={folders['llama']}", "inspect=true")
    out = proc.stdout
    assert "standard sites of LlamaForCausalLM (llama, from a table;" in out
    line = next(row for row in out.splitlines() if row.split()[:1] == ["blocks.1.attn.heads"])
    assert "model.layers.1.self_attn.o_proj" in line and "input.0 (split by head)" in line and "[8, 64, 4, 16]" in line
    assert hookrun.anatomy(causal_lm(str(folders["llama"]))).point("unembed").module == "lm_head"
