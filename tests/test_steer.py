"""The bundled steer experiment (conf/experiment/steer*.yaml, experiments/steer.py, experiments/moods.py): the sweep
equals the model's own generate() (coef 0 plain greedy generation, a nonzero coef generate() with a plain hook
adding coef * (mean(happy) - mean(sad))), and steering does what steering does: the completions turn happy as coef
rises, sad as it falls, and stay sentences of the language."""
import random

import numpy as np
import pytest
import torch

import hookrun
from hookrun.config.checks import resolve_file
from hookrun.experiments import moods, steer
from tests.helpers import run_here

DATA = "pkg://hookrun.experiments/data/"
NEW = 12
LAYER = 1  # transformer.h.1, the experiment's layer


def completions(hook=None):
    """generate() of each bundled prompt alone, greedy, without hookrun; `hook(model)` registers a plain hook."""
    model, tok, out = moods.trained_lm(), moods.tokenizer(), []
    handle = hook(model) if hook else None
    for text in resolve_file(DATA + "steer_prompts.txt").read_text().splitlines():
        ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            new = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                 use_cache=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out.append(new[0, len(ids):].tolist())
    if handle:
        handle.remove()
    return out


def adding(vector):
    """A plain forward hook on block 1 adding `vector` at the decoding steps (one token a pass), not the prompt."""
    def hook(model):
        def add(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output  # a tuple in older transformers
            if hidden.shape[1] > 1:
                return None
            return (hidden + vector,) + tuple(output[1:]) if isinstance(output, tuple) else hidden + vector
        return model.transformer.h[LAYER].register_forward_hook(add)
    return hook


@pytest.mark.slow
def test_the_steer_sweep_equals_generate_with_a_plain_hook_and_turns_the_completions_happy(tmp_path):
    for run, name in steer.SETS.items():  # the source runs in process (the script skips complete ones)
        run_here(tmp_path / "runs" / run, "+experiment=steer_source", f"data.text.files=[{DATA}{name}]")
    gens = hookrun.collect(steer.sweep(tmp_path, "-4,0,4"), generations=True)  # the sweep through the CLI
    mean = {run: hookrun.open(tmp_path / "runs" / run).load(layer=f"transformer.h.{LAYER}", role="output").mean(0)
            for run in steer.SETS}
    direction = torch.from_numpy((mean["steer_happy"] - mean["steer_sad"]).astype(np.float32))
    for coef in (-4, 0, 4):
        got = gens[gens[steer.COEF] == coef].sort_values("sample")["completion_ids"].tolist()
        assert got == completions(adding(coef * direction) if coef else None), coef
    measured = steer.moods_per_coef(gens)
    # 8 completions of 7 words; coef 0: the 4 happy-leaning subjects happy, the 4 others sad; +-4: all one mood
    assert measured["happy"].tolist() == pytest.approx([0, 12 / 56, 24 / 56])
    assert measured["sad"].tolist() == pytest.approx([24 / 56, 12 / 56, 0])
    assert measured["grammatical"].tolist() == [1, 1, 1]
    plain = gens[gens[steer.COEF] == 0].sort_values("sample")
    assert plain["completion"].str.strip().tolist() == ["was great . we laughed . it felt great ."] * 4 + \
        ["was dark . we cried . it felt dark ."] * 4  # steer_prompts.txt: party, holiday, song, trip, then sad ones


def test_the_mood_language_is_one_token_a_word_and_its_bundled_files_are_its_sentences():
    tok = moods.tokenizer()
    vocab = {w for ws in (*moods.ADJECTIVES.values(), *moods.VERBS.values()) for w in ws} | set(moods.LEANS)
    assert all(len(tok.tokenize(f" {w}")) == 1 for w in vocab | {"was", "we", "it", "felt", "."})
    rng = random.Random(0)
    assert resolve_file(moods.CORPUS).read_text().splitlines() == [moods.draw(rng) for _ in range(256)]
    happy, sad = (resolve_file(f"{DATA}{m}.txt").read_text().splitlines() for m in ("happy", "sad"))
    assert [s.split()[1] for s in happy] == [s.split()[1] for s in sad] == list(moods.LEANS)
    for sentence, mood in [*((s, moods.HAPPY) for s in happy), *((s, moods.SAD) for s in sad)]:
        assert moods.grammatical(sentence.split(" ", 2)[2])  # after "The <subject>"
        assert len([w for w in moods.words(sentence) if w in mood]) == 3


def test_a_new_sweep_never_replaces_what_is_in_multirun_steer(tmp_path):
    from hookrun.experiments.steer import free_dir

    first = tmp_path / "multirun" / "steer"
    assert free_dir(first) == first
    first.mkdir(parents=True)
    (first / "notes.txt").write_text("mine")
    assert free_dir(first) == tmp_path / "multirun" / "steer-2"
    (tmp_path / "multirun" / "steer-2").mkdir()
    assert free_dir(first) == tmp_path / "multirun" / "steer-3"
    assert (first / "notes.txt").read_text() == "mine"
