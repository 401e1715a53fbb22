"""Language models on text: per-token captures of padded / packed batches against each sequence run alone.

A tiny GPT-2 (hookrun.experiments.lm.causal_lm, random init) and the bundled BPE tokenizer, built in code.
Padded and unpadded runs are compared with a tight allclose, not bitwise: the padded batch runs the
same matmuls on larger shapes, whose blocking (and so float summation order) differs.
"""
import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import hookrun
from hookrun.experiments.lm import causal_lm, tokenizer
from hookrun.config.checks import ConfigError
from tests.helpers import REPO, on_cpu

MODEL = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=512, n_positions=64)
DOCS = ["Hookrun stores every capture one row per real token.",
        "Pads never reach the store.",
        "A short one",
        "Language models read text token by token, and interpretability work collects their activations.",
        "x",
        "The index statistics cover real tokens only, so the means are honest."]
BLOCKS = ["transformer.h.0", "transformer.h.1"]
ATOL = 2e-5


def overrides(corpus, *extra, side="right", bos=True):
    return ["+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in MODEL.items()), f"data.text.files=[{corpus}]",
            f"data.text.bos={str(bos).lower()}", f"data.text.padding_side={side}", "data.batch_size=4",
            "layers=[transformer.h.0,transformer.h.1]", *extra]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


def reference_model():
    """The run's model: the runner seeds torch with cfg.seed (0) right before building it."""
    torch.manual_seed(0)
    return causal_lm(**MODEL).eval()


def alone(model, ids, modules):
    """Outputs of `modules` for one unpadded sequence: {name: [T, ...]} (role output.1 for attention)."""
    out, handles = {}, []
    for name in modules:
        mod = model.get_submodule(name)
        handles.append(mod.register_forward_hook(
            lambda m, a, o, name=name: out.__setitem__(name, (o[1] if isinstance(o, tuple) else o)[0].detach())))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in handles:
        h.remove()
    return out


def doc_ids(tok, doc, bos=True, max_length=64):
    return ([tok.bos_token_id] if bos else []) + tok(doc, add_special_tokens=False)["input_ids"][: max_length - bos]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batches_equal_each_sequence_alone(run_cfg, corpus, side):
    attn = "+hooks.attn={kind:forward,layers:transformer.h.0.attn,capture:[output.1]}"
    heads = "+hooks.head1={kind:forward,layers:transformer.h.1.attn,capture:[output.1],select:{heads:[1]}}"
    cap = run_cfg(overrides(corpus, attn, heads, side=side), name=side)
    tok, model = tokenizer(), reference_model()
    tokens = cap.tokens()
    expected = [doc_ids(tok, d) for d in DOCS]
    assert len(tokens) == sum(map(len, expected))  # no pad row stored
    assert list(tokens.columns) == ["sample", "position", "token_id", "token"]
    for i, (doc, ids) in enumerate(zip(DOCS, expected)):
        rows = tokens[tokens["sample"] == i]
        assert rows["token_id"].tolist() == ids and rows["position"].tolist() == list(range(len(ids)))
        assert "".join(rows["token"].iloc[1:]) == doc  # decodes back to the text (after BOS)
        ref = alone(model, ids, BLOCKS + ["transformer.h.0.attn", "transformer.h.1.attn"])
        for block in BLOCKS:
            got = cap.load(layer=block, role="output")[rows.index]
            np.testing.assert_allclose(got, ref[block].numpy(), rtol=0, atol=ATOL)
        att = cap.load(layer="transformer.h.0.attn", role="output.1")[rows.index]  # [tokens, heads, max_length]
        assert att.shape == (len(ids), 4, 64)
        np.testing.assert_allclose(att[:, :, :len(ids)], ref["transformer.h.0.attn"].permute(1, 0, 2).numpy(),
                                   rtol=0, atol=1e-6)
        assert not att[:, :, len(ids):].any()
        h1 = cap.load(layer="transformer.h.1.attn", role="output.1")[rows.index]
        np.testing.assert_allclose(h1[:, 0, :len(ids)], ref["transformer.h.1.attn"][1].numpy(), rtol=0, atol=1e-6)
    index = cap.rows(layer="transformer.h.1", role="output")
    assert (index["unit"] == "token").all() and index["row_stop"].max() == len(tokens)
    data = cap.load(layer="transformer.h.1", role="output")
    assert np.isclose(index["mean"].iloc[0], data[: index["row_stop"].iloc[0]].mean(), atol=1e-6)  # real tokens only
    assert cap.array("resid/transformer.h.1/output").metadata.dimension_names[0] == "token"


def test_pack_windows_equal_the_tokenized_concatenation(run_cfg, corpus):
    cap = run_cfg(overrides(corpus, "data.text.batching=pack", "data.text.max_length=16", bos=False))
    tok = tokenizer()
    stream = [t for d in DOCS for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    windows = [stream[s:s + 16] for s in range(0, len(stream) - 15, 16)]
    tokens = cap.tokens()
    assert [g["token_id"].tolist() for _, g in tokens.groupby("sample")] == windows
    assert cap.load(layer="transformer.h.0", role="output").shape == (16 * len(windows), 32)
    model = reference_model()
    ref = alone(model, windows[1], BLOCKS)["transformer.h.1"]
    np.testing.assert_allclose(cap.load(layer="transformer.h.1", role="output")[16:32], ref.numpy(), rtol=0, atol=ATOL)


@pytest.mark.parametrize("side", ["right", "left"])
def test_positions_pick_each_sequences_real_tokens(run_cfg, corpus, side):
    last = "+hooks.last={kind:forward,layers:transformer.h.1,select:{positions:last}}"
    ends = "+hooks.ends={kind:forward,layers:transformer.h.1,select:{positions:[0,-1]}}"
    att = "+hooks.att={kind:forward,layers:transformer.h.0.attn,capture:[output.1]}"
    att_last = "+hooks.att_last={kind:forward,layers:transformer.h.0.attn,capture:[output.1],select:{positions:last}}"
    cap = run_cfg(overrides(corpus, last, ends, att, att_last, side=side))
    tokens, full = cap.tokens(), cap.load(hook="resid", layer="transformer.h.1", role="output")
    last_rows = tokens.groupby("sample").tail(1).index
    first_rows = tokens.groupby("sample").head(1).index
    got = cap.load(hook="last", layer="transformer.h.1", role="output")
    assert got.shape == (len(DOCS), 32)
    np.testing.assert_array_equal(got, full[last_rows])
    both = cap.load(hook="ends", layer="transformer.h.1", role="output")
    np.testing.assert_array_equal(both[:, 0], full[first_rows])
    np.testing.assert_array_equal(both[:, 1], full[last_rows])
    assert (cap.rows(hook="last")["unit"] == "sample").all()
    np.testing.assert_array_equal(cap.load(hook="att_last", layer="transformer.h.0.attn", role="output.1"),
                                  cap.load(hook="att", layer="transformer.h.0.attn", role="output.1")[last_rows])


def test_patching_the_last_position_changes_only_its_downstream_values(run_cfg, corpus):
    noisy = "+hooks.resid.edit=[{op:noise,std:1.0,roles:[output]}]"
    src = run_cfg(overrides(corpus, "layers=[transformer.h.0]", noisy), name="source")
    clean = run_cfg(overrides(corpus), name="clean")
    patch = (f"+hooks.patch={{kind:forward,layers:transformer.h.0,edit:[{{op:replace,store:'{src.path}',hook:resid,"
             "positions:last}]}")
    patched = run_cfg(overrides(corpus, patch), name="patched")
    tokens = clean.tokens()
    last = tokens.groupby("sample").tail(1).index
    other = tokens.index.difference(last)
    h0 = patched.load(hook="patch", layer="transformer.h.0", role="output")
    np.testing.assert_array_equal(h0[last], src.load(layer="transformer.h.0", role="output")[last])
    np.testing.assert_array_equal(h0[other], clean.load(hook="resid", layer="transformer.h.0", role="output")[other])
    h1, h1_clean = (c.load(hook="resid", layer="transformer.h.1", role="output") for c in (patched, clean))
    np.testing.assert_allclose(h1[other], h1_clean[other], rtol=0, atol=1e-6)  # causal: earlier tokens unchanged
    assert (np.abs(h1[last] - h1_clean[last]).max(axis=1) > 1e-3).all()


def masked_logit_sum(output, batch):
    """Sum of the logits of real tokens (pads excluded): a loss whose gradients are per real token."""
    mask = batch.kwargs["attention_mask"][..., None].to(output.logits.dtype)
    return (output.logits * mask * torch.linspace(-1, 1, output.logits.shape[-1])).sum()


@pytest.mark.parametrize("side", ["right", "left"])
def test_gradients_on_token_runs_agree_with_autograd(run_cfg, corpus, side):
    grads = "+hooks.g={kind:output_grad,layers:[transformer.wte,transformer.h.0]}"
    cap = run_cfg(overrides(corpus, grads, "+loss._target_=tests.test_lm.masked_logit_sum", side=side))
    tok, model = tokenizer(), reference_model()
    seqs = [doc_ids(tok, d) for d in DOCS]
    tokens = cap.tokens()
    for start in range(0, len(seqs), 4):
        batch = seqs[start:start + 4]
        from hookrun.data.text import pad

        ids, mask = pad(batch, tok.pad_token_id, side)
        kept = {}

        def keep(module, args, output, kept=kept):
            output.retain_grad()
            kept[names[module]] = output

        names = {model.get_submodule(n): n for n in ("transformer.wte", "transformer.h.0")}
        handles = [m.register_forward_hook(keep) for m in names]
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
        model.zero_grad()
        masked_logit_sum(out, type("B", (), {"kwargs": {"attention_mask": mask}})).backward()
        for h in handles:
            h.remove()
        rows = tokens[(tokens["sample"] >= start) & (tokens["sample"] < start + len(batch))].index
        for name in kept:
            want = kept[name].grad[mask.bool()].numpy()
            got = cap.load(hook="g", layer=name, role="grad")[rows]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_exclude_special_tokens_applies_to_the_table_and_every_array(run_cfg, corpus):
    cap = run_cfg(overrides(corpus, "data.text.exclude_special=true",
                            "+hooks.attn={kind:forward,layers:transformer.h.0.attn,capture:[output.1]}"))
    tok = tokenizer()
    tokens = cap.tokens()
    assert tok.bos_token_id not in set(tokens["token_id"]) and tokens["position"].min() == 1
    assert len(tokens) == sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in DOCS)
    for key in cap.index["array"].unique():
        assert cap.array(key).shape[0] == len(tokens)


def test_top_lists_the_largest_values_with_context(run_cfg, corpus):
    cap = run_cfg(overrides(corpus))
    data = cap.load(layer="transformer.h.1", role="output")
    top = cap.top(layer="transformer.h.1", role="output", unit=3, k=5, context=2)
    np.testing.assert_allclose(top["value"], np.sort(data[:, 3])[::-1][:5], rtol=1e-6)
    sweep = hookrun.collect(cap.path.parent)  # the index and collect() work on token runs unchanged
    assert set(sweep["unit"]) == {"token"} and len(sweep) == len(cap.index)
    tokens = cap.tokens().set_index(["sample", "position"])
    for row in top.itertuples():
        assert row.token == tokens.loc[(row.sample, row.position), "token"]
        assert f"[[{row.token}]]" in row.context


def test_jsonl_files_a_datasets_dataset_and_a_ragged_token_dataset(run_cfg, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)))
    cap = run_cfg(overrides(path, "data.text.field=text"), name="jsonl")
    assert cap.tokens()["sample"].nunique() == len(DOCS)
    hf = run_cfg([*overrides(path), "data.text.files=null", "+data.text.dataset._target_=tests.test_lm.hf_docs"],
                 name="hf")
    assert hf.tokens()["token_id"].tolist() == cap.tokens()["token_id"].tolist()
    ragged = ["+data.dataset._target_=tests.test_lm.RaggedTokens", "data.text=null", "data.batch_size=3",
              "+hooks.emb={kind:forward,layers:transformer.wte}"]
    cap = run_cfg([*overrides(path), *ragged], name="ragged")
    lengths = [len(RaggedTokens()[i]) for i in range(len(RaggedTokens()))]
    tokens = cap.tokens()
    assert len(tokens) == sum(lengths) == len(cap.load(layer="transformer.wte", role="output"))
    assert tokens["token_id"].tolist() == [t for i in range(len(RaggedTokens())) for t in RaggedTokens()[i].tolist()]


def hf_docs():
    """DOCS as a Hugging Face datasets.Dataset (built in memory, offline)."""
    import datasets

    return datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})


class RaggedTokens(torch.utils.data.Dataset):
    """Token sequences of lengths 5..40, as a user's pre-tokenized dataset."""

    def __len__(self):
        return 7

    def __getitem__(self, i):
        return torch.arange(5 + 5 * i) % 500 + 2


class Empty(torch.utils.data.Dataset):
    def __len__(self):
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


def test_empty_corpus_fails_clearly_and_long_documents_are_truncated(run_cfg, corpus, tmp_path):
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg

    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match=r"data.text: the corpus is empty"):
        run(make_cfg([*overrides(empty), f"store.path={tmp_path / 'e.zarr'}"]))
    with pytest.raises(ConfigError, match=r"data.dataset: Empty has no items \(len 0\)"):
        run(make_cfg([*overrides(corpus), "data.text=null", "+data.dataset._target_=tests.test_lm.Empty",
                      f"store.path={tmp_path / 'd.zarr'}"]))
    cap = run_cfg(overrides(corpus, "data.text.max_length=8"))
    tok = tokenizer()
    tokens = cap.tokens()
    for i, doc in enumerate(DOCS):
        assert tokens[tokens["sample"] == i]["token_id"].tolist() == doc_ids(tok, doc, max_length=8)


class SlowLM(torch.nn.Module):
    """The tiny LM, sleeping in every forward so a run can be killed part-way."""

    def __init__(self, seconds: float = 0.05):
        super().__init__()
        self.lm, self.seconds = causal_lm(**MODEL), seconds

    def forward(self, **kwargs):
        time.sleep(self.seconds)
        return self.lm(**kwargs)


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_kill_then_resume_a_token_run_is_bitwise_identical(tmp_path, caplog):
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg, same_store

    docs = tmp_path / "many.txt"
    rng = random.Random(0)
    words = " ".join(DOCS).split()
    docs.write_text("\n".join(" ".join(rng.choices(words, k=rng.randint(1, 30))) for _ in range(90)))
    args = [*overrides(docs, "model._target_=tests.test_lm.SlowLM", "~model.n_layer", "~model.n_embd",
                       "~model.n_head", "~model.vocab_size", "~model.n_positions", "layers=[lm.transformer.h.0]",
                       "data.batch_size=3", "store.commit_s=0", "store.chunk_rows=64")]
    run(make_cfg([*args, f"store.path={tmp_path / 'ref.zarr'}"]))  # uninterrupted, in process
    ref = hookrun.open(tmp_path / "ref.zarr")
    store = tmp_path / "killed.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu(args), f"store.path={store}",
                             f"hydra.run.dir={tmp_path / 'killed'}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (store / "_index" / "batches-000002.parquet").exists() and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(random.Random(1).uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = hookrun.open(store)
    assert killed.status == "running" and 0 < len(killed.batches) < 30
    assert len(killed.tokens()) == killed.index["row_stop"].max()  # the token table committed with its batches
    with caplog.at_level("INFO", logger="hookrun"):
        run(make_cfg([*args, f"store.path={store}", "store.mode=resume"]))
    assert f"starting at batch {len(killed.batches)}\n" in caplog.text
    before = int(killed.batches.sample_stop.max())  # the summary counts the whole store, not the resumed part
    assert f"90 samples in the store ({90 - before} run now, {before} before the resume); " in caplog.text
    resumed = hookrun.open(store)
    same_store(resumed, ref)
    assert resumed.tokens().equals(ref.tokens())


def test_bad_text_config_is_reported_at_once_before_any_work(tmp_path):
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg

    bad = ["+experiment=lm_tokens", "data.text.files=[nope.txt,notes.md]", "data.text.batching=packed",
           "data.text.max_length=1", "data.text.padding_side=middle", "+hooks.resid.select={positions:lst}",
           "+hooks.resid.edit=[{op:scale,value:2,positions:[last]}]", f"store.path={tmp_path / 's.zarr'}"]
    with pytest.raises(ConfigError) as err:
        run(make_cfg(bad))
    text = str(err.value)
    for expected in ["data.text.files: 'nope.txt' does not exist", "data.text.files: 'notes.md' is not .txt",
                     "data.text.batching: 'packed' is unknown", "did you mean: pack",
                     "data.text.max_length: 1 is too small; give an integer in [2, 10_000_000]", "data.text.padding_side: 'middle'",
                     "hooks.resid.select.positions: 'lst' is not a position"]:
        assert expected in text, text
    assert not (tmp_path / "s.zarr").exists()


def test_small_runs_are_stored_small(run_cfg, tmp_path):
    """Chunks are sized to the rows a run will store (tokens counted up front): no padded last chunk, so an
    uncompressed per-token array is stored at its raw size plus checksums and metadata."""
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCS * 5))
    cap = run_cfg(overrides(docs, "store.codec=none", "data.batch_size=4", "+hooks.last.kind=forward",
                            "+hooks.last.layers=transformer.h.1", "+hooks.last.select={positions: last}"))
    arrays = cap.attrs["summary"]["arrays"]
    assert len(arrays) == 3 and all(a["raw_bytes"] > 0 for a in arrays)
    for a in arrays:  # 4 bytes of crc32c a chunk, and zarr.json
        assert a["raw_bytes"] < a["stored_bytes"] < 1.02 * a["raw_bytes"] + 4096, a
    tokens = cap.load(hook="resid", layer="transformer.h.0", role="output")
    assert len(tokens) == len(cap.tokens()) and cap.load(hook="last", layer="transformer.h.1").shape[0] == len(DOCS) * 5
