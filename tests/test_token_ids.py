"""Prompts as token ids from YAML (hookrun/data/text.py): a .npy, a .pt (a tensor, a list of 1-D tensors, a dict of
columns) or a .jsonl of ids, paired roles and answer fields as ids, with no tokenizer; each run stores what the
same run from texts stores. Texts beside ids of another vocabulary are refused."""
import json

import numpy as np
import pytest
import torch

from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import tokenizer
from tests.helpers import PAIRS, write_pairs
from tests.test_patching_run import grid_run, model_overrides

TEXTS = ["the hooks run on a model", "a store of captures", "every layer writes an array"]
HOOKS = ["hooks.resid.layers=[transformer.h.0,transformer.h.1]", "data.batch_size=2", "data.text.bos=false"]
NO_TOKENIZER = ["data.text.tokenizer=null"]


def ids(texts):
    tok = tokenizer()
    return [[tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def arrays(cap):
    return {k: cap.array(k)[:] for k in cap.index.array.unique()}


def same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def from_texts(tmp_path_factory):
    """The lm_tokens run of TEXTS (BOS prepended by data.text.bos), the reference of every form of ids."""
    import hookrun
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg

    path = tmp_path_factory.mktemp("texts")
    (path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    run(make_cfg(["+experiment=lm_tokens", f"data.text.files=[{path / 't.jsonl'}]", *HOOKS, "data.text.bos=true",
                  f"store.path={path / 'r.zarr'}"]))
    return hookrun.open(path / "r.zarr")


def write(path, form):
    seqs = ids(TEXTS)
    if form == "jsonl":
        path = path / "ids.jsonl"
        path.write_text("".join(json.dumps({"text": s, "n": len(s)}) + "\n" for s in seqs))
    elif form == "pt-list":
        path = path / "ids.pt"
        torch.save([torch.tensor(s) for s in seqs], path)
    elif form == "pt-dict":
        path = path / "ids.pt"
        torch.save({"text": [torch.tensor(s) for s in seqs], "n": torch.tensor([len(s) for s in seqs])}, path)
    return path


@pytest.mark.parametrize("form", ["jsonl", "pt-list", "pt-dict"])
def test_ids_from_a_file_store_what_the_texts_store(run_cfg, tmp_path, from_texts, form):
    path = write(tmp_path, form)
    cap = run_cfg(["+experiment=lm_tokens", f"data.text.files=[{path}]", *HOOKS, *NO_TOKENIZER,
                   *(["data.record=[n]"] if form != "pt-list" else [])])
    same(arrays(cap), arrays(from_texts))
    assert cap.tokens()["token_id"].tolist() == from_texts.tokens()["token_id"].tolist()
    if form != "pt-list":
        assert cap.samples["n"].tolist() == [len(s) for s in ids(TEXTS)]


def test_a_tensor_of_ids_every_token_real(run_cfg, tmp_path, from_texts):
    """A [samples, sequence] .npy / .pt: every token real; the same as those rows given as lists."""
    seqs = [s[:5] for s in ids(TEXTS)]  # one length
    np.save(tmp_path / "ids.npy", np.array(seqs, dtype=np.int64))
    torch.save(torch.tensor(seqs), tmp_path / "ids.pt")
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in seqs))
    caps = [run_cfg(["+experiment=lm_tokens", f"data.text.files=[{tmp_path / name}]", *HOOKS, *NO_TOKENIZER],
                    name=name) for name in ("ids.npy", "ids.pt", "ids.jsonl")]
    for cap in caps[1:]:
        same(arrays(cap), arrays(caps[0]))
    assert len(caps[0].tokens()) == 15


def write_id_pairs(path, pairs=PAIRS):
    """PAIRS as ids: clean and corrupt with BOS, the answer an id."""
    tok = tokenizer()
    one = lambda s: tok(s, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    rows = [{"clean": ids([c])[0], "corrupt": ids([x])[0], "answer": one(a)} for c, x, a in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, one(" store")


@pytest.mark.slow
@pytest.mark.parametrize("form", ["jsonl", "pt"])
def test_a_paired_patching_grid_from_ids_equals_the_grid_from_texts(run_cfg, tmp_path, form):
    texts = run_cfg(grid_run(write_pairs(tmp_path / "pairs.jsonl"), "gpt2", "{layers:['blocks.*'],positions:all}"),
                    name="texts")
    path, store = write_id_pairs(tmp_path / "ids.jsonl")
    if form == "pt":
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        torch.save({"clean": [torch.tensor(r["clean"]) for r in rows], "corrupt": [torch.tensor(r["corrupt"])
                    for r in rows], "answer": torch.tensor([r["answer"] for r in rows])}, tmp_path / "ids.pt")
        path = tmp_path / "ids.pt"
    overrides = [o for o in grid_run(path, "gpt2", "{layers:['blocks.*'],positions:all}") if not o.startswith(
        "+metrics.ld")] + [f"+metrics.ld={{metric:logit_diff,a:{{field:answer}},b:{store}}}", "data.text.bos=false",
                           *NO_TOKENIZER]
    from_ids = run_cfg(overrides, name="ids")
    a, b = from_ids.grid(), texts.grid()
    assert a.layers == b.layers and a.scores.shape == b.scores.shape
    np.testing.assert_allclose(a.scores, b.scores, atol=1e-5, equal_nan=True)
    np.testing.assert_allclose(a.source, b.source, atol=1e-5)
    np.testing.assert_allclose(a.target, b.target, atol=1e-5)


def test_texts_beside_ids_of_another_vocabulary_are_refused(run_cfg, tmp_path):
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"text": "the hooks run"}) + "\n" +
                                          json.dumps({"text": [5, 100000]}) + "\n")
    with pytest.raises(ConfigError, match=r"texts and token ids in one run, but the ids \[5, 100000\] hold 100000, "
                                          r"not a token of data.text.tokenizer \(\d+ tokens\)"):
        run_cfg(["+experiment=lm_tokens", f"data.text.files=[{tmp_path / 'mixed.jsonl'}]", *HOOKS])
    (tmp_path / "ok.jsonl").write_text(json.dumps({"text": "the hooks run"}) + "\n" + json.dumps({"text": [5, 9]}))
    cap = run_cfg(["+experiment=lm_tokens", f"data.text.files=[{tmp_path / 'ok.jsonl'}]", *HOOKS], name="ok")
    assert cap.tokens()["token_id"].tolist()[-2:] == [5, 9]


@pytest.mark.parametrize("bad,message", [
    ("bos", "data.text.bos: true, but the prompts are token ids and the run has no tokenizer"),
    ("float", "is tensor\\(\\[0.5000, 1.0000\\]\\) \\(Tensor\\); a document is a str, a dict holding one under "
              "data.text.field \\('text'\\), or token ids"),
    ("text", "data.text.tokenizer: missing, but the documents are text"),
    ("txt", "data.text.tokenizer: missing; give"),
])
def test_ids_without_a_tokenizer_refused_with_the_fix(run_cfg, tmp_path, bad, message):
    if bad == "float":
        torch.save([torch.tensor([0.5, 1.0])], tmp_path / "f.pt")
        files, extra = tmp_path / "f.pt", []
    elif bad == "txt":
        (tmp_path / "c.txt").write_text("the hooks\n")
        files, extra = tmp_path / "c.txt", []
    else:
        (tmp_path / "c.jsonl").write_text(json.dumps({"text": "the hooks" if bad == "text" else [1, 2]}) + "\n")
        files, extra = tmp_path / "c.jsonl", (["data.text.bos=true"] if bad == "bos" else [])
    with pytest.raises(ConfigError, match=message):
        run_cfg(["+experiment=lm_tokens", f"data.text.files=[{files}]", *HOOKS, *NO_TOKENIZER, *extra])
