"""hookrun.run's arguments, explicit over the experiment (issue 39): a tokenizer or model given replaces the one the
experiment names, with a log line; blocks as keywords; `inputs=` lists of prompts, token ids or records as data;
token texts as the tokenizer decodes them in a text, for SentencePiece (Llama), byte-level BPE (GPT-2) and WordPiece
(BERT) tokenizers built offline: cap.tokens(), cap.top() contexts, plot.text, plot.top_contexts."""
import logging

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import hookrun
from hookrun import plot
from hookrun.format.tokens import token_texts
from hookrun.config.checks import ConfigError
from hookrun.config.checks import resolve_file
from hookrun.experiments.lm import causal_lm
from hookrun.experiments.lm import tokenizer as gpt2_style

TEXTS = ["The cat sat on the mat.", "A singing bird was walking home.", "The dog sat on the log, singing."]
CORPUS = TEXTS * 20


def llama_style():
    """BPE with a Metaspace pre-tokenizer and Llama's decoder (▁ -> space, byte fallback, the first space stripped)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")


def bert_style():
    """WordPiece, lower-cased, BERT's pre-tokenizer and decoder (## joins a word's pieces)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=60, special_tokens=[
        "[UNK]", "[CLS]", "[SEP]", "[PAD]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]")


TOKENIZERS = {"llama": llama_style, "gpt2": gpt2_style, "bert": bert_style}


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_token_texts_are_the_differences_of_decoding_the_text_token_by_token(kind):
    tok = TOKENIZERS[kind]()
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        texts = token_texts(tok, ids)
        grown = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
        truth = [b[len(a):] for a, b in zip(grown, grown[1:])]  # what token k adds to the decoded text
        assert texts[1:] == truth[1:] and texts[0].lstrip() == truth[0]
        assert "".join(texts).lstrip() == tok.decode(ids)
    pieces = tok.convert_ids_to_tokens(tok("singing walking", add_special_tokens=False)["input_ids"])
    if kind == "llama":
        assert pieces[0].startswith("\u2581") and tok.decode(tok.convert_tokens_to_ids(pieces[:1])) == pieces[0][1:]
    if kind == "bert":
        assert any(p.startswith("##") for p in pieces)  # the case decode([id]) gets wrong: "##ing"


def tiny(tok):
    torch.manual_seed(0)
    return causal_lm(n_layer=1, vocab_size=len(tok))


HOOKS = {"resid": {"kind": "forward", "layers": ["transformer.h.0"], "capture": ["output"]}}


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_tokens_contexts_and_pictures_read_as_the_text(kind, tmp_path):
    tok = TOKENIZERS[kind]()
    cap = hookrun.run(model=tiny(tok), tokenizer=tok, hooks=HOOKS, inputs=TEXTS,
                      **{"store.path": str(tmp_path / "a.zarr")})
    tokens = cap.tokens()
    for sample, text in enumerate(TEXTS):
        rows = tokens[tokens["sample"] == sample]
        assert rows["token_id"].tolist() == tok(text, add_special_tokens=False)["input_ids"]
        assert "".join(rows["token"]).lstrip() == tok.decode(rows["token_id"].tolist())
    top = cap.top(layer="transformer.h.0", unit=0, k=3, context=40)
    for row in top.itertuples():
        assert row.context.replace("[[", "").replace("]]", "").lstrip() == tok.decode(
            tokens[tokens["sample"] == row.sample]["token_id"].tolist())
    drawn = {kind: "".join(t.get_text() for ax in fig.axes for t in ax.texts)
             for kind, fig in (("text", plot.text(cap, layer="transformer.h.0", sample=0)),
                               ("top", plot.top_contexts(cap, layer="transformer.h.0", k=2, context=40)))}
    words = tok.decode(tok("sat on the", add_special_tokens=False)["input_ids"])
    assert words in drawn["text"] and words in drawn["top"]


def test_a_tokenizer_given_replaces_the_experiments_with_a_log_line(tmp_path, caplog):
    tok = llama_style()
    with caplog.at_level(logging.INFO, logger="hookrun"):
        cap = hookrun.run("lm_tokens", model=tiny(tok), tokenizer=tok, layers=["transformer.h.0"],
                          **{"data.max_samples": 2, "store.path": str(tmp_path / "a.zarr")})
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("tokenizer=", "model="))]
    assert said == [f"tokenizer=: the tokenizer given ({type(tok).__name__}) replaces the experiment's "
                    "data.text.tokenizer (hookrun.experiments.lm.tokenizer)",
                    "model=: the model given (GPT2LMHeadModel) replaces the experiment's model "
                    "(hookrun.experiments.lm.causal_lm)"]
    first = cap.tokens().query("sample == 0")["token_id"].tolist()
    line = resolve_file("pkg://hookrun.experiments/data/corpus.txt").read_text(encoding="utf-8").splitlines()[0]
    assert first[1:] == tok(line.strip(), add_special_tokens=False)["input_ids"][:len(first) - 1]  # BOS, then its ids


def test_inputs_as_token_ids(tmp_path):
    tok = gpt2_style()
    m = tiny(tok)
    ids = [[1, 5, 9, 7], [1, 7]]
    cap = hookrun.run(model=m, hooks=HOOKS, inputs=ids, **{"store.path": str(tmp_path / "ids.zarr")})
    assert cap.tokens()["token_id"].tolist() == [1, 5, 9, 7, 1, 7]
    seen = []
    handle = m.transformer.h[0].register_forward_hook(lambda mod, args, out: seen.append(
        (out[0] if isinstance(out, tuple) else out)[0].detach().clone()))
    with torch.no_grad():
        m(input_ids=torch.tensor([ids[0]]))
    handle.remove()
    truth = seen[0].numpy()
    np.testing.assert_allclose(cap.load(layer="transformer.h.0", role="output")[:4], truth, rtol=1e-4, atol=1e-5)
    assert cap.config["data"]["text"]["dataset"]["items"] == ids  # the data is in the run's config
    for bad in ("The cat", [1, [2]], [[]], [3.5]):
        with pytest.raises(ConfigError, match="inputs: .* is not a list of prompts"):
            hookrun.run(model=m, hooks=HOOKS, inputs=bad, **{"store.path": str(tmp_path / "bad.zarr")})
    assert not (tmp_path / "bad.zarr").exists()


def test_to_xarray_carries_each_rows_token_text(tmp_path):
    tok = llama_style()
    cap = hookrun.run(model=tiny(tok), tokenizer=tok, hooks=HOOKS, inputs=TEXTS,
                      **{"store.path": str(tmp_path / "a.zarr")})
    ds = cap.to_xarray(layer="transformer.h.0")
    tokens = cap.tokens()
    assert ds["token_text"].values.tolist() == tokens["token"].tolist()
    assert ds["token_id"].values.tolist() == tokens["token_id"].tolist()
    first = ds.where(ds["sample"] == 0, drop=True)
    assert "".join(first["token_text"].values).lstrip() == TEXTS[0]
