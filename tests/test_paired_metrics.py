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
         ("a store of captures", "a store of layers", " captures", "b"),
         ("every layer writes an array", "every layer writes a model", " array", "a"),
         ("tokens of the corpus", "tokens of the model", " corpus", "b"),
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
    return ["+experiment=lm_tokens", "model=null", "+model._target_=tests.test_paired_metrics.llama",
            *(f"+model.{k}={v}" for k, v in LLAMA.items()), "layers=[model.layers.1]"]


def reference(kind):
    torch.manual_seed(0)  # the runner seeds torch with cfg.seed right before building the model
    return (causal_lm(**GPT2) if kind == "gpt2" else llama(**LLAMA)).eval()


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x, "answer": a, "label": lab, "id": i}) + "\n"
                            for i, (c, x, a, lab) in enumerate(PAIRS)))
    return path


def paired(path, *extra, kind="gpt2"):
    return [*model_overrides(kind), f"data.text.files=[{path}]", "data.text.fields={clean:clean,corrupt:corrupt}",
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


def test_record_a_field_that_is_not_there(cli, pairs, tmp_path):
    proc = cli(*paired(pairs, "data.record=[lable]"), f"hydra.run.dir={tmp_path}/r", check=False)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "data.record: 'lable' is not a field of the batch" in out and "did you mean: label" in out
