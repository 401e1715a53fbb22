"""Paired prompts, recorded fields and declared metrics in real runs, against plain PyTorch written here (its own
forward passes, one prompt at a time, no hookrun code) on a GPT-2 and a Llama built from configs."""
import json

import numpy as np
import pandas as pd
import pytest
import torch

import hookrun
from hookrun.experiments.lm import causal_lm, tokenizer
from tests.helpers import make_cfg, run_cli

PAIRS = [("the hooks run on a model", "the hooks run on a store", " model", "a"),
         ("a store of captures", "a store of hooks", " captures", "b"),
         ("every layer writes an array", "every layer writes a model", " array", "a"),
         ("tokens of the model", "tokens of the store", " model", "b"),
         ("the model writes", "the store writes", " the", "a")]
GPT2 = {"n_layer": 3, "n_embd": 32, "n_head": 4}
LLAMA = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**config, attn_implementation="eager"))


def model_overrides(kind):
    if kind == "gpt2":
        return ["+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in GPT2.items()), "layers=[transformer.h.1]"]
    return ["+experiment=lm_tokens", "model._target_=tests.test_paired_metrics.llama",  # (GPT-2's keys: ignored)
            *(f"+model.{k}={v}" for k, v in LLAMA.items() if k != "vocab_size"), "layers=[model.layers.1]"]


def reference(kind):
    torch.manual_seed(0)  # the runner seeds torch with cfg.seed right before building the model
    return (causal_lm(**GPT2) if kind == "gpt2" else llama(**LLAMA)).eval()


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x, "answer": a, "label": lab, "id": i}) + "\n"
                            for i, (c, x, a, lab) in enumerate(PAIRS)))
    return path


def paired(path, *extra, kind="gpt2", fields="{clean:clean,corrupt:corrupt}"):
    return [*model_overrides(kind), f"data.text.files=[{path}]", f"data.text.fields={fields}",
            "data.batch_size=2", *extra]


def alone(model, text, bos=True):
    """Logits [T, V] of one prompt run alone (BOS first, as data.text.bos=true), and its ids."""
    tok = tokenizer()
    ids = ([tok.bos_token_id] if bos else []) + tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float(), ids


def test_record_fields_of_jsonl_and_parquet(run_cfg, pairs, tmp_path):
    cap = run_cfg(paired(pairs, "data.record=[label,id,answer]"))
    assert list(cap.samples["label"]) == [p[3] for p in PAIRS]
    assert list(cap.samples["id"]) == list(range(len(PAIRS)))
    assert list(cap.samples["answer"]) == [p[2] for p in PAIRS]
    # the first role (clean) is what the model is fed: the token table holds the clean prompts
    tok = tokenizer()
    first = cap.tokens()[cap.tokens()["sample"] == 1]["token_id"].tolist()
    assert first == [tok.bos_token_id] + tok(PAIRS[1][0], add_special_tokens=False)["input_ids"]
    frame = pd.DataFrame({"text": [p[0] for p in PAIRS], "label": [p[3] for p in PAIRS]})
    frame.to_parquet(tmp_path / "docs.parquet")
    one = run_cfg([*model_overrides("gpt2"), f"data.text.files=[{tmp_path / 'docs.parquet'}]",
                   "data.record=[label]"], name="parquet")
    assert list(one.samples["label"]) == [p[3] for p in PAIRS]


@pytest.mark.slow
def test_record_a_field_that_is_not_there(cli, pairs, tmp_path):
    proc = cli(*paired(pairs, "data.record=[lable]"), f"hydra.run.dir={tmp_path}/r", check=False)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "data.record: 'lable' is not a field of the batch" in out and "did you mean: label" in out


def logit_of(logits, inputs, token=5):
    """A user metric: the logit of `token` at each sample's last real token (fails at sample 4 when asked to)."""
    import os

    if os.environ.get("HOOKRUN_TEST_FAIL_AT") == str(inputs.sample_start):
        raise RuntimeError("failing on purpose")
    cols = inputs.info.first + inputs.info.lengths - 1
    return logits[torch.arange(len(cols)), cols, token]


METRICS = ["+metrics.ld={metric:logit_diff,a:{field:answer},b:' store'}", "+metrics.lp={metric:logprob,target:' the'}",
           "+metrics.p={metric:prob,target:{field:answer},position:[1,-1]}", "+metrics.r={metric:rank,target:7}",
           "+metrics.ce={metric:loss}", "+metrics.kl={metric:kl}", "+metrics.kla={metric:kl,position:all}",
           "+metrics.user={_target_:tests.test_paired_metrics.logit_of,token:9}"]


def plain_metrics(model, fed, ref, answer):
    """Every metric of METRICS for one pair, from the fed prompt's and the reference prompt's logits run alone."""
    tok = tokenizer()
    (logits, ids), (reference, _) = alone(model, fed), alone(model, ref)
    one = lambda s: tok(s, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    logp = torch.log_softmax(logits, -1)
    kl = lambda r, t: (torch.softmax(r, -1) * (torch.log_softmax(r, -1) - torch.log_softmax(t, -1))).sum(-1)  # noqa
    ce = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    out = {"ld": logits[-1, one(answer)] - logits[-1, one(" store")], "lp": logp[-1, one(" the")],
           "p[1]": logp[1, one(answer)].exp(), "p[-1]": logp[-1, one(answer)].exp(),
           "r": (logits[-1] > logits[-1, 7]).sum(), "ce": ce, "kl": kl(reference[-1], logits[-1]),
           "user": logits[-1, 9]}
    out["kla"] = kl(reference, logits).mean()  # the pairs have one length: kl over all positions
    return {k: float(v) for k, v in out.items()}


@pytest.mark.parametrize("kind,side", [("gpt2", "right"), ("llama", "left")])
def test_every_metric_equals_plain_pytorch(run_cfg, pairs, kind, side):
    # the fed role is corrupt (first in data.text.fields); kl's reference is the clean role, run without hooks
    cap = run_cfg([*paired(pairs, kind=kind, fields="{corrupt:corrupt,clean:clean}"),
                   f"data.text.padding_side={side}", *METRICS])
    model = reference(kind)
    samples = cap.samples
    for i, (clean, corrupt, answer, _) in enumerate(PAIRS):
        want = plain_metrics(model, corrupt, clean, answer)
        for name, value in want.items():
            assert samples[name][i] == pytest.approx(value, abs=2e-4, rel=1e-4), (name, i)
    stored = cap.load(hook="_metrics", layer="corrupt", role="p")
    np.testing.assert_array_equal(stored, samples[["p[1]", "p[-1]"]].to_numpy(np.float32))
    np.testing.assert_array_equal(cap.load(hook="_metrics", role="ld"), samples["ld"].to_numpy(np.float32))
    assert cap.attrs["metric_columns"] == ["ld", "lp", "p[1]", "p[-1]", "r", "ce", "kl", "kla", "user"]


@pytest.mark.slow
def test_metric_problems_exit_2_before_any_store(cli, pairs, tmp_path):
    proc = cli(*paired(pairs), "+metrics.x={metric:logprob,target:' corpus'}", "+metrics.y={metric:rnk}",
               f"hydra.run.dir={tmp_path}/a", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert "metrics.y.metric: 'rnk' is unknown" in out and "did you mean: rank" in out
    proc = cli(*paired(pairs), "+metrics.x={metric:logprob,target:' corpus'}", f"hydra.run.dir={tmp_path}/b",
               check=False)
    assert proc.returncode == 2 and "metrics.x.target: ' corpus' is 4 tokens" in proc.stdout + proc.stderr
    proc = cli(*model_overrides("gpt2"), f"data.text.files=[{pairs}]", "data.text.field=clean", "+metrics.kl={metric:kl}",
               f"hydra.run.dir={tmp_path}/c", check=False)
    assert proc.returncode == 2 and "metrics.kl: kl compares to a reference run's logits" in proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("zarr.json"))


def test_metrics_of_a_resumed_run_equal_the_uninterrupted_run(pairs, tmp_path, monkeypatch):
    from tests.helpers import same_store
    from hookrun.engine.runner import run

    overrides = [*paired(pairs), *METRICS, "store.commit_s=0"]
    run(make_cfg([*overrides, f"store.path={tmp_path}/whole.zarr"]))
    monkeypatch.setenv("HOOKRUN_TEST_FAIL_AT", "4")
    with pytest.raises(Exception, match="failing on purpose"):
        run(make_cfg([*overrides, f"store.path={tmp_path}/cut.zarr"]))
    assert hookrun.open(tmp_path / "cut.zarr").samples["sample"].tolist() == [0, 1, 2, 3]
    monkeypatch.delenv("HOOKRUN_TEST_FAIL_AT")
    run(make_cfg([*overrides, f"store.path={tmp_path}/cut.zarr", "store.mode=resume"]))
    whole, cut = hookrun.open(tmp_path / "whole.zarr"), hookrun.open(tmp_path / "cut.zarr")
    same_store(whole, cut)
    pd.testing.assert_frame_equal(whole.samples, cut.samples)


@pytest.mark.slow
def test_collect_returns_each_jobs_metric_means(pairs, tmp_path):
    sweep = tmp_path / "sweep"
    run_cli("-m", *paired(pairs), "+metrics.ld={metric:logit_diff,a:{field:answer},b:' store'}",
            "+metrics.ce={metric:loss}", "data.text.max_documents=2,5", f"hydra.sweep.dir={sweep}")
    jobs = hookrun.collect(sweep, with_index=False).sort_values("data.text.max_documents")
    assert list(jobs["data.text.max_documents"]) == [2, 5]
    for _, job in jobs.iterrows():
        samples = hookrun.open(job["run_dir"]).samples
        assert len(samples) == job["data.text.max_documents"]
        assert job["ld"] == pytest.approx(samples["ld"].mean()) and job["ce"] == pytest.approx(samples["ce"].mean())
    rows = hookrun.collect(sweep)  # with the index: the job's means on each of its rows
    assert set(rows.groupby("job")["ld"].nunique()) == {1}


def test_the_fed_role_is_said_and_a_cleared_dict_replaces_an_experiments_roles(pairs, caplog):
    """A command-line dict is merged into the experiment's (Hydra); the log names the fed role, and null first
    replaces the roles."""
    from hookrun.config.parsing import parse
    from hookrun.data import make_inputs

    merged = make_cfg(paired(pairs, "data.text.fields={corrupt:corrupt}"))
    assert list(merged.data.text.fields) == ["clean", "corrupt"]
    with caplog.at_level("INFO", logger="hookrun"):
        make_inputs(parse(merged).config.data, 0)
    assert "roles clean, corrupt; the model's own pass (hooks, captures, metrics) runs on 'clean'" in caplog.text
    cleared = make_cfg(paired(pairs, "data.text.fields=null", "data.text.fields={corrupt:corrupt}"))
    first = next(iter(make_inputs(parse(cleared).config.data, 0).batches()))
    tok = tokenizer()
    assert first.kwargs["input_ids"][0, 1:].tolist()[:len(tok(PAIRS[0][1])["input_ids"])] == \
        tok(PAIRS[0][1], add_special_tokens=False)["input_ids"]
