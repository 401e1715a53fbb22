"""The command line takes inputs and whole blocks as documented (docs/tutorials/vision.md, docs/patching.md): a
mapping merges into a free-form block instead of Hydra's `not in struct`; sites with both positions and heads are
refused; patching errors name the full key; a corpus that tokenizes to nothing is refused with the tokenizer named."""
import re

import numpy as np
import pytest
import torch

import hookrun
from hookrun.__main__ import open_block
from hookrun.config.checks import ConfigError
from tests.helpers import make_cfg, run_cli


def test_open_block_rewrites_mappings_on_free_form_blocks_only():
    for free in ("data.inputs={x: {fill: 1.0, shape: [2]}}", "vars={n: 3}", "hooks={a: {kind: forward}}",
                 "model={_target_: a.B}", "patching.sites={heads: all, role: input}", "metrics.ld={metric: loss}"):
        assert open_block(free) == f"++{free}"
    for kept in ("store={path: x}", "data.batch_size=4", "+data.inputs={x: 1}", "~data.inputs.x", "layers=a,b",
                 "data.inputs.x=[1, 2]", "hydra.run.dir=x", "nokey={a: 1}"):
        assert open_block(kept) == kept


def fc1(seed: int, x: np.ndarray) -> np.ndarray:
    """tests.models.MLP's fc1 on x, the model built as a run builds it (torch.manual_seed(seed) first)."""
    from tests.models import MLP

    torch.manual_seed(seed)
    with torch.no_grad():
        return MLP().fc1(torch.from_numpy(x)).numpy()


@pytest.mark.slow
def test_documented_input_forms_run(tmp_path):
    hooks = "+hooks.acts={kind: forward, layers: fc1, capture: [input, output]}"
    run_cli("+model._target_=tests.models.MLP", "data.inputs={x: {random: normal, shape: [4, 6]}}", hooks,
            f"hydra.run.dir={tmp_path / 'block'}")
    run_cli("+model._target_=tests.models.MLP", "+data.inputs.x={random: normal, shape: [4, 6]}", hooks,
            f"hydra.run.dir={tmp_path / 'key'}")
    block, key = hookrun.open(tmp_path / "block"), hookrun.open(tmp_path / "key")
    x = block.load(layer="fc1", role="input.0")
    assert x.shape == (4, 6) and x.std() > 0.3
    np.testing.assert_array_equal(key.load(layer="fc1", role="input.0"), x)  # one seed, one input
    np.testing.assert_allclose(block.load(layer="fc1", role="output"), fc1(0, x), rtol=1e-6)

    run_cli("+experiment=conv_fmaps", "~data.inputs.fake_img", "+data.inputs.x={fill: 2.0, shape: [1, 1, 4, 4]}",
            f"hydra.run.dir={tmp_path / 'replaced'}")
    from hookrun.experiments.models import ConvFmapsNet

    with torch.no_grad():
        truth = ConvFmapsNet().conv1(torch.full((1, 1, 4, 4), 2.0)).numpy()
    replaced = hookrun.open(tmp_path / "replaced")
    np.testing.assert_array_equal(replaced.load(layer="conv1", role="output"), truth)  # 18s and 36s
    assert truth.ravel().tolist() == [18.0] * 4 + [36.0] * 4


def model_free_problems(overrides):
    from hookrun.capture.hooks import KINDS
    from hookrun.config.parsing import parse
    from hookrun.engine.checks import check

    return check(parse(make_cfg(overrides), tuple(KINDS))).problems


def test_sites_with_both_positions_and_heads_are_refused():
    """What `'patching.sites={..., heads: all, role: input}'` on the command line makes of patching_grid's sites
    (the CLI turns it into ++patching.sites=...): positions kept beside heads, refused with the fix."""
    problems = model_free_problems(["+experiment=patching_grid", "++patching.sites={heads: all, role: input}"])
    assert [p for p in problems if p.startswith("patching.sites:")] == [
        "patching.sites: both positions ('all') and heads ('all'); a grid's last axis is positions or heads: drop "
        "one (on the command line '~patching.sites.positions', or positions: null in an experiment that inherits a "
        "grid), or add per_position: true for a layers x heads x positions grid"]
    assert not [p for p in model_free_problems(["+experiment=ablate_heads"]) if p.startswith("patching")]
    switched = ["+experiment=patching_grid", "~patching.sites.positions", "++patching.sites={heads: all, role: input}"]
    assert not [p for p in model_free_problems(switched) if p.startswith("patching")]
    assert make_cfg(["+experiment=ablate_heads"]).patching.sites.positions is None


def test_patch_errors_name_the_full_key():
    from hookrun.methods.patching import PatchError, config_key

    cases = {"positions: [11] reaches beyond a sequence of 8 real tokens": "patching.sites.positions: [11] reaches",
             "heads: [1, 7] is not all or a list of heads in 0..3": "patching.sites.heads: [1, 7] is not",
             "source_positions: 2 positions but positions has 3": "patching.source_positions: 2 positions",
             "sample 3 has 5 real tokens in the source": "patching.sites.positions: sample 3 has 5",
             "donor=resample needs at least two samples": "patching.donor: resample needs",
             "role input: Linear was called without a tensor": "patching.sites.role: input: Linear",
             "source has 2 samples but target 3": "patching: source has 2"}
    for said, named in cases.items():
        err = config_key(PatchError(said))
        assert str(err).startswith(named) and err.key == named.split(":")[0]


def word_tokenizer(words=("[UNK]", "[BOS]", "[EOS]", "[PAD]", "zebra")):
    """A WordLevel tokenizer that knows only `words` (the rest are [UNK]): most corpora tokenize to specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]",
                                   pad_token="[PAD]")


def test_a_corpus_that_tokenizes_to_nothing_is_refused(tmp_path):
    from hookrun.data.text import words_problem

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat\nzebra zebra\nhello world\n")
    lm = ["+experiment=lm_tokens", f"data.text.files=[{corpus}]", "model.n_layer=1"]
    known = ["[UNK]", "[BOS]", "[EOS]", "[PAD]", "the", "cat", "sat", "zebra", "hello", "world"]
    from hookrun.engine.runner import run

    with pytest.raises(ConfigError) as err:  # a tokenizer that knows none of the words: [BOS] [UNK]...
        run(make_cfg([*lm, "data.text.tokenizer._target_=tests.test_command_line_blocks.word_tokenizer",
                      "~data.text.tokenizer.vocab_size", "+data.text.tokenizer.words=['[UNK]','[BOS]','[EOS]','[PAD]']",
                      f"store.path={tmp_path / 'a.zarr'}"]))
    message = str(err.value)
    assert "data.text.tokenizer: every one of the 3 documents tokenizes to at most one token or to special tokens " \
           "alone (first: ['[BOS]', '[UNK]', '[UNK]', '[UNK]'], ['[BOS]', '[UNK]', '[UNK]'])" in message
    assert "PreTrainedTokenizerFast" in message and "keep the tokenizer in a folder of its own" in message
    assert not (tmp_path / "a.zarr").exists()  # refused before any work

    tok = word_tokenizer(known)
    seqs = [[1, *tok(line, add_special_tokens=False)["input_ids"]] for line in corpus.read_text().splitlines()]
    assert words_problem(seqs, tok) is None and seqs[0] == [1, 4, 5, 6]
    assert words_problem([[1], [1]], tok) is not None and words_problem([[7]], tok) is not None  # one token each
    assert re.search(r"every one of the 1 documents", words_problem([[0, 0, 3]], tok))
