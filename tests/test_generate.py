"""Generation (hookrun.methods.generation) against the model's own generate() and plain forward hooks written here, on a
tiny GPT-2 and a tiny Llama built from configs and the bundled tokenizer."""
import os

import numpy as np
import pytest
import torch

from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import causal_lm, tokenizer
from tests.helpers import make_cfg

PROMPTS = ["the hooks run on a model", "a store", "every layer writes an array of captures", "tokens",
           "x", "generation is a loop"]
NEW = 6
GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=512, n_positions=64)


def gpt2_lm():
    return causal_lm(**GPT2)


def llama_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    return LlamaForCausalLM(config)


UNSET = ["~model.n_layer", "~model.n_embd", "~model.n_head", "~model.vocab_size", "~model.n_positions"]
MODELS = {"gpt2": (gpt2_lm, "transformer.h"), "llama": (llama_lm, "model.layers")}


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def overrides(corpus, name="gpt2", *extra, side="right", new=NEW):
    blocks = MODELS[name][1]
    return ["+experiment=lm_tokens", f"model._target_=tests.test_generate.{name}_lm", *UNSET,
            f"data.text.files=[{corpus}]", "data.text.bos=true", f"data.text.padding_side={side}",
            "data.batch_size=4", f"layers=[{blocks}.0,{blocks}.1]", f"generate.max_new_tokens={new}", *extra]


def refused(tmp_path, corpus, *extra):
    """The problems of the ConfigError a generate run with `extra` overrides raises, checked to come before its store
    exists."""
    from hookrun.engine.runner import run

    with pytest.raises(ConfigError) as err:
        run(make_cfg([*overrides(corpus, "gpt2", *extra), f"store.path={tmp_path / 'x.zarr'}"]))
    assert not (tmp_path / "x.zarr").exists()
    return err.value.problems


def reference(name):
    torch.manual_seed(0)  # the runner seeds torch with cfg.seed right before building the model
    return MODELS[name][0]().eval()


def prompt_ids(text):
    tok = tokenizer()
    return [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]


def alone(model, ids, new=NEW, hook=None, layers=(), **kw):
    """generate() of one prompt without hookrun: new token ids, and each layer's output at every pass."""
    seen = {name: [] for name in layers}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: seen[n].append((o[0] if isinstance(o, tuple) else o)[0].detach().clone()))
        for n in layers]
    if hook is not None:
        handles.append(hook())
    tok = tokenizer()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, do_sample=False, use_cache=True,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
    for h in handles:
        h.remove()
    return out[0, len(ids):].tolist(), {n: torch.cat(v) for n, v in seen.items()}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_greedy_completions_and_per_step_captures_equal_generate_alone(run_cfg, corpus, name, side):
    cap = run_cfg(overrides(corpus, name, side=side), name=f"{name}-{side}")
    model, blocks = reference(name), [f"{MODELS[name][1]}.{i}" for i in range(2)]
    gens = cap.generations()
    tokens = cap.tokens()
    assert list(tokens.columns) == ["sample", "position", "token_id", "token", "generated", "step"]
    acts = {b: cap.load(layer=b, role="output") for b in blocks}
    for i, text in enumerate(PROMPTS):
        ids = prompt_ids(text)
        new, ref = alone(model, ids, layers=blocks)
        row = gens.iloc[i]
        assert row["completion_ids"] == new and row["new_tokens"] == NEW and row["stop_reason"] == "length"
        assert row["prompt_ids"] == ids
        rows = tokens[tokens["sample"] == i]
        assert rows["token_id"].tolist() == ids + new[:-1]  # the last token is never read by the model
        assert rows["generated"].tolist() == [False] * len(ids) + [True] * (NEW - 1)
        assert rows["step"].tolist() == [0] * len(ids) + list(range(1, NEW))  # the pass that reads each token
        assert rows["position"].tolist() == list(range(len(ids) + NEW - 1))
        for b in blocks:  # prompt pass [T, D], then one row per decoding step
            np.testing.assert_allclose(acts[b][rows.index], ref[b].numpy(), rtol=0, atol=3e-5)
    assert len(acts[blocks[0]]) == len(tokens)


def test_logprobs_are_the_chosen_tokens_and_sampling_is_seeded(run_cfg, corpus):
    cap = run_cfg(overrides(corpus), name="greedy")
    model, tok = reference("gpt2"), tokenizer()
    row = cap.generations().iloc[2]
    seq = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].log_softmax(-1)
    n = len(row["prompt_ids"])
    expected = [float(logits[n - 1 + k, t]) for k, t in enumerate(row["completion_ids"])]
    np.testing.assert_allclose(row["logprobs"], expected, atol=1e-4)
    assert row["completion"] == tok.decode(row["completion_ids"], skip_special_tokens=True)
    sample = ["generate.do_sample=true", "generate.temperature=2.0", "generate.top_k=50"]
    a = run_cfg(overrides(corpus, "gpt2", *sample), name="s1").generations()
    b = run_cfg(overrides(corpus, "gpt2", *sample), name="s2").generations()
    assert a["completion_ids"].tolist() == b["completion_ids"].tolist()
    assert a["completion_ids"].tolist() != cap.generations()["completion_ids"].tolist()


def test_sequences_stopping_at_different_steps_store_no_rows_past_their_stop(run_cfg, corpus):
    model = reference("gpt2")
    refs = [alone(model, prompt_ids(t))[0] for t in PROMPTS]
    stop = refs[0][2]  # the third token of the first completion
    cap = run_cfg(overrides(corpus, "gpt2", f"generate.stop=[eos,{stop}]"), name="stops")
    gens, tokens = cap.generations(), cap.tokens()
    for i, new in enumerate(refs):
        n = new.index(stop) + 1 if stop in new else NEW
        row = gens.iloc[i]
        assert row["completion_ids"] == new[:n] and row["new_tokens"] == n
        assert row["stop_reason"] == ("stop" if stop in new else "length")
        assert int(tokens[(tokens["sample"] == i)]["generated"].sum()) == n - 1
    assert gens["new_tokens"].nunique() > 1
    assert len(cap.load(layer="transformer.h.0", role="output")) == len(tokens)


@pytest.mark.parametrize("positions", ["generated", "all"])
def test_a_steering_edit_at_every_step_equals_generate_with_a_plain_hook(run_cfg, corpus, positions):
    torch.manual_seed(1)
    vector = torch.randn(32)
    values = "[" + ",".join(f"{v:.6f}" for v in vector.tolist()) + "]"
    vector = torch.tensor([float(f"{v:.6f}") for v in vector.tolist()])
    steer = (f"+hooks.steer={{kind:forward,layers:[transformer.h.0],capture:[],"
             f"edit:[{{op:add,value:{values},coef:4.0,positions:{positions}}}]}}")
    cap = run_cfg(overrides(corpus, "gpt2", steer), name=f"steer-{positions}")
    model = reference("gpt2")
    plain = run_cfg(overrides(corpus, "gpt2"), name="plain").generations()

    def hook():
        def add(m, a, o):
            hidden = o[0] if isinstance(o, tuple) else o
            if positions == "generated" and hidden.shape[1] > 1:  # the prompt pass
                return None
            return (hidden + 4.0 * vector,) + tuple(o[1:]) if isinstance(o, tuple) else hidden + 4.0 * vector
        return model.transformer.h[0].register_forward_hook(add)
    gens = cap.generations()
    for i, text in enumerate(PROMPTS):
        assert gens.iloc[i]["completion_ids"] == alone(model, prompt_ids(text), hook=hook)[0]
    assert gens["completion_ids"].tolist() != plain["completion_ids"].tolist()


@pytest.mark.parametrize("extra, key", [
    (["loss=sum"], "loss:"),
    (["data.text.batching=pack"], "data.text.batching:"),
    (["+hooks.more={kind:forward,layers:[transformer.h.0],select:{positions:last}}"],
     "hooks.resid.select.positions:"),  # hooks that capture keep one set of tokens (one token table)
    (["generate.stop=[eos,'']"], "generate.stop:"),
    (["generate.top_k=-1"], "generate.top_k:"),
])
def test_what_generation_cannot_take_is_a_config_error_naming_the_key(tmp_path, corpus, extra, key):
    problems = refused(tmp_path, corpus, *extra)
    assert any(p.startswith(key) for p in problems), problems


def test_a_model_without_generate_is_refused(tmp_path, corpus):
    from hookrun.engine.runner import run

    args = [*overrides(corpus, "gpt2"), "model._target_=tests.test_generate.plain_lm", "layers=[0]",
            "generate.loop=hf"]  # generate.loop=auto runs any other model through the plain loop
    with pytest.raises(ConfigError, match="generate.loop: hf but the model"):
        run(make_cfg([*args, f"store.path={tmp_path / 'x.zarr'}"]))


def plain_lm():
    return torch.nn.Sequential(torch.nn.Embedding(512, 8), torch.nn.Linear(8, 512))


def failing_lm():
    """gpt2_lm whose generate() raises at the call named by $HOOKRUN_TEST_FAIL_AT (a batch mid-way)."""
    model, calls = gpt2_lm(), [0]
    generate = model.generate

    def failing(**kwargs):
        calls[0] += 1
        if str(calls[0]) == os.environ.get("HOOKRUN_TEST_FAIL_AT"):
            raise RuntimeError("killed here")
        return generate(**kwargs)
    model.generate = failing
    return model


@pytest.mark.slow
def test_a_sampling_run_failed_mid_way_resumes_to_the_same_completions(tmp_path, corpus, monkeypatch):
    import hookrun
    from hookrun.engine.runner import run
    from tests.helpers import same_store

    args = [*overrides(corpus, "gpt2", "generate.do_sample=true", "generate.temperature=1.5"),
            "model._target_=tests.test_generate.failing_lm", "data.batch_size=2",
            "store.commit_s=0"]
    run(make_cfg([*args, f"store.path={tmp_path / 'ref.zarr'}"]))
    monkeypatch.setenv("HOOKRUN_TEST_FAIL_AT", "3")
    with pytest.raises(Exception, match="killed here"):
        run(make_cfg([*args, f"store.path={tmp_path / 'cut.zarr'}"]))
    assert len(hookrun.open(tmp_path / "cut.zarr").batches) == 2
    monkeypatch.delenv("HOOKRUN_TEST_FAIL_AT")
    run(make_cfg([*args, f"store.path={tmp_path / 'cut.zarr'}", "store.mode=resume"]))
    ref, resumed = hookrun.open(tmp_path / "ref.zarr"), hookrun.open(tmp_path / "cut.zarr")
    same_store(resumed, ref)
    assert resumed.tokens().equals(ref.tokens())
    assert resumed.generations().equals(ref.generations())


def test_collect_brings_each_jobs_completions_beside_its_swept_key(tmp_path, corpus):
    import hookrun
    from tests.helpers import run_here

    for coef in (0, 8):
        steer = ("+hooks.steer={kind:forward,layers:[transformer.h.0],capture:[],"
                 f"edit:[{{op:add,value:[{','.join(['0.5', '-0.5'] * 16)}],coef:{coef},positions:all}}]}}")
        run_here(tmp_path / "sweep" / str(coef), *overrides(corpus, "gpt2", steer))
    df = hookrun.collect(tmp_path / "sweep", generations=True)
    assert len(df) == 2 * len(PROMPTS) and {"completion", "stop_reason", "job"} <= set(df.columns)
    by_job = {job: g["completion_ids"].tolist() for job, g in df.groupby("job")}
    assert by_job["0"] != by_job["8"]
