"""Step positions in generate runs (hookrun.capture.tokens: `{steps: ...}`, prompt | generated | all | last | ints)
against the model's own generate() with plain forward hooks written here: what `select` stores, where edits apply."""
import numpy as np
import pytest
import torch

from hookrun.config.schema import ConfigError
from tests.helpers import make_cfg
from tests.test_generate import NEW, PROMPTS, alone, corpus, overrides, prompt_ids, reference  # noqa: F401

BLOCKS = ["transformer.h.0", "transformer.h.1"]


@pytest.fixture(scope="module")
def plain():
    """Each prompt alone through generate() without hookrun: (prompt ids, new ids, each block's rows per pass)."""
    model = reference("gpt2")
    return [(prompt_ids(t), *alone(model, prompt_ids(t), layers=BLOCKS)) for t in PROMPTS]


def rows_of(n_prompt, n_new):
    """(step, prompt position or None) of every token the model reads: the prompt (step 0), then generated tokens."""
    return [(0, p) for p in range(n_prompt)] + [(k, None) for k in range(1, n_new)]


SELECTS = {  # select.positions -> which (step, prompt position) rows of a sample it keeps (p: the prompt's length)
    "prompt": lambda s, q, p: s == 0,
    "generated": lambda s, q, p: s > 0,
    "all": lambda s, q, p: True,
    "last": lambda s, q, p: s > 0 or q == p - 1,
    "[0,-1]": lambda s, q, p: s == 0 and q in (0, p - 1),
    "first": lambda s, q, p: s == 0 and q == 0,
    "{steps:[0,2]}": lambda s, q, p: s in (0, 2),
    "{steps:3}": lambda s, q, p: s == 3,
    "{steps:{start:1,stop:4}}": lambda s, q, p: 1 <= s < 4,
    "{steps:{start:1,step:2}}": lambda s, q, p: s >= 1 and (s - 1) % 2 == 0,
}


@pytest.mark.parametrize("positions", list(SELECTS))
def test_select_keeps_the_rows_of_the_named_tokens_equal_to_plain_hooks(run_cfg, corpus, plain, positions):
    cap = run_cfg(overrides(corpus, "gpt2", f"+hooks.resid.select={{positions:{positions}}}"), name="select")
    tokens, keep = cap.tokens(), SELECTS[positions]
    acts = {b: cap.load(layer=b, role="output") for b in BLOCKS}
    assert all(len(a) == len(tokens) for a in acts.values())  # the token table lists exactly the stored rows
    for i, (ids, new, ref) in enumerate(plain):
        everything = rows_of(len(ids), len(new))
        wanted = [r for r, (s, q) in enumerate(everything) if keep(s, q, len(ids))]
        got = tokens[tokens["sample"] == i]
        assert got["step"].tolist() == [everything[r][0] for r in wanted]
        assert got["token_id"].tolist() == [(ids + new)[r] for r in wanted]
        assert got["position"].tolist() == wanted  # a sample's r-th token read is at position r
        for b in BLOCKS:
            np.testing.assert_allclose(acts[b][got.index], ref[b].numpy()[wanted], rtol=0, atol=3e-5)


def test_select_with_sequences_stopping_early_keeps_no_row_past_a_stop(run_cfg, corpus, plain):
    stop = plain[0][1][2]  # the third token of the first completion
    cap = run_cfg(overrides(corpus, "gpt2", f"generate.stop=[eos,{stop}]", "+hooks.resid.select={positions:last}"),
                  name="stops")
    tokens, gens = cap.tokens(), cap.generations()
    for i, (ids, new, ref) in enumerate(plain):
        n = gens.iloc[i]["new_tokens"]
        got = tokens[tokens["sample"] == i]
        assert got["step"].tolist() == list(range(n))  # the prompt's last token, then steps 1 .. n-1
        np.testing.assert_allclose(cap.load(layer=BLOCKS[1], role="output")[got.index],
                                   ref[BLOCKS[1]].numpy()[len(ids) - 1:len(ids) + n - 1], rtol=0, atol=3e-5)
    assert gens["new_tokens"].nunique() > 1


def adding_at(model, vector, passes=None, last_of_prompt=False):
    """A plain forward hook on block 0 adding `vector` in the passes listed (0: the prompt; None: every pass), or at
    the prompt's last token only."""
    seen = [0]

    def count(module, args, kwargs):
        seen[0] += 1
    counter = model.register_forward_pre_hook(count, with_kwargs=True)

    def add(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        n = seen[0] - 1
        if last_of_prompt:
            if n:
                return None
            new = hidden.clone()
            new[:, -1] += vector
        elif passes is None or n in passes:
            new = hidden + vector
        else:
            return None
        return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new
    handle = model.transformer.h[0].register_forward_hook(add)

    class Both:
        def remove(self):
            handle.remove()
            counter.remove()
    return Both()


@pytest.mark.parametrize("positions, passes", [
    ("{steps:[2]}", {2}),
    ("{steps:[0,3]}", {0, 3}),
    ("{steps:{start:1,stop:3}}", {1, 2}),
    ("-1", "last of prompt"),
])
def test_an_edit_at_steps_equals_generate_with_a_plain_hook_adding_in_those_passes(run_cfg, corpus, positions,
                                                                                    passes):
    vector = torch.tensor([round(float(v), 4) for v in torch.randn(32, generator=torch.Generator().manual_seed(3))])
    values = "[" + ",".join(f"{v:.4f}" for v in vector.tolist()) + "]"
    steer = (f"+hooks.steer={{kind:forward,layers:[transformer.h.0],capture:[],"
             f"edit:[{{op:add,value:{values},coef:6.0,positions:{positions}}}]}}")
    gens = run_cfg(overrides(corpus, "gpt2", steer), name="steer").generations()
    model = reference("gpt2")
    last = passes == "last of prompt"
    expected = [alone(model, prompt_ids(t), hook=lambda: adding_at(model, 6.0 * vector, None if last else passes,
                                                                   last_of_prompt=last))[0] for t in PROMPTS]
    assert gens["completion_ids"].tolist() == expected
    unsteered = [alone(model, prompt_ids(t))[0] for t in PROMPTS]
    assert expected != unsteered


@pytest.mark.parametrize("extra, key", [
    (["generate.max_new_tokens=0", "+hooks.resid.select={positions:generated}"], "hooks.resid.select.positions:"),
    (["generate.max_new_tokens=0", "+hooks.resid.select={positions:{steps:[1]}}"], "hooks.resid.select.positions:"),
    (["generate.max_new_tokens=0", "+hooks.resid.edit=[{op:scale,value:2,positions:{steps:[1]}}]"],
     "hooks.resid.edit[0].positions:"),
    (["+hooks.resid.select={positions:{steps:-1}}"], "hooks.resid.select.positions.steps:"),
    (["+hooks.resid.select={positions:{steps:{start:3,stop:2}}}"], "hooks.resid.select.positions.steps:"),
    (["+hooks.resid.edit=[{op:scale,value:2,positions:{steps:[]}}]"], "hooks.resid.edit[0].positions.steps:"),
    (["+hooks.resid.select={positions:{step:[1]}}"], "hooks.resid.select.positions:"),
])
def test_step_positions_that_cannot_apply_are_a_config_error_naming_the_key(tmp_path, corpus, extra, key):
    from hookrun.run.runner import run

    with pytest.raises(ConfigError) as err:
        run(make_cfg([*overrides(corpus, "gpt2", *extra), f"store.path={tmp_path / 'x.zarr'}"]))
    assert any(p.startswith(key) for p in err.value.problems), err.value.problems
    assert not (tmp_path / "x.zarr").exists()
