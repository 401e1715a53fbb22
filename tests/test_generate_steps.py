"""Step positions in generate runs (hookrun.capture.tokens: `{steps: ...}`, prompt | generated | all | last | ints)
against the model's own generate() with plain forward hooks written here: what `select` stores, where edits apply."""
import numpy as np
import pytest
import torch

from hookrun.config.checks import ConfigError
from tests.helpers import make_cfg
from tests.test_generate import NEW, PROMPTS, alone, corpus, overrides, prompt_ids, reference, refused  # noqa: F401

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
    problems = refused(tmp_path, corpus, *extra)
    assert any(p.startswith(key) for p in problems), problems


# -- the plain loop: any model mapping token ids to logits -------------------------------------------------------
class Block(torch.nn.Module):
    """One causal self-attention head and an MLP, padding masked out of the keys."""

    def __init__(self, d):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        n = x.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()[None] & mask[:, None, :].bool()
        scores = (q @ k.transpose(1, 2) / x.shape[-1] ** 0.5).masked_fill(~allowed, -1e9)
        x = x + self.out(scores.softmax(-1) @ v)
        return x + self.mlp(x)


class TinyLM(torch.nn.Module):
    """A causal LM that is not a Hugging Face model: ids [B, T] (left padding placed by attention_mask) -> logits."""

    def __init__(self, vocab=512, d=16, n_layer=2, last_only=False):
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(128, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n_layer))
        self.head, self.last_only = torch.nn.Linear(d, vocab), last_only

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        position_ids = (mask.cumsum(1) - 1).clamp(min=0) if position_ids is None else position_ids
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(x)
        return logits[:, -1] if self.last_only else (logits,)  # a tuple: its first item is the logits


def tiny_lm():
    return TinyLM()


def last_only_lm():
    return TinyLM(last_only=True)


TINY = ["model._target_=tests.test_generate_steps.tiny_lm", "layers=[blocks.0,blocks.1]"]
TINY_BLOCKS = ["blocks.0", "blocks.1"]


def by_hand(model, ids, new=NEW, eos=None, add=None):
    """Greedy generation of one prompt written out: the whole sequence each pass; each block's output rows of the
    tokens each pass reads first (pass 0: the prompt; pass k: the newest); `add(pass, hidden)` edits block 0."""
    seen, n = {b: [] for b in TINY_BLOCKS}, [0]

    def keep(name):
        def hook(module, args, output):
            if name == "blocks.0" and add is not None:
                output = add(n[0], output)
            seen[name].append(output[0] if n[0] == 0 else output[0, -1:])
            return output
        return hook
    handles = [model.get_submodule(b).register_forward_hook(keep(b)) for b in TINY_BLOCKS]
    seq = list(ids)
    with torch.no_grad():
        for n[0] in range(new):
            token = int(model(torch.tensor([seq]))[0][0, -1].argmax())
            seq.append(token)
            if token == eos:
                break
    for h in handles:
        h.remove()
    return seq[len(ids):], {b: torch.cat(v) for b, v in seen.items()}


def test_the_plain_loop_generates_as_a_loop_written_by_hand_and_stores_its_rows(run_cfg, corpus):
    cap = run_cfg(overrides(corpus, "gpt2", *TINY), name="tiny")
    torch.manual_seed(0)  # as the runner does before building the model
    model = tiny_lm().eval()
    gens, tokens = cap.generations(), cap.tokens()
    acts = {b: cap.load(layer=b, role="output") for b in TINY_BLOCKS}
    for i, text in enumerate(PROMPTS):
        ids = prompt_ids(text)
        new, ref = by_hand(model, ids)
        assert gens.iloc[i]["completion_ids"] == new
        rows = tokens[tokens["sample"] == i]
        assert rows["token_id"].tolist() == ids + new[:-1] and rows["step"].tolist() == [0] * len(ids) + [1, 2, 3, 4, 5]
        for b in TINY_BLOCKS:
            np.testing.assert_allclose(acts[b][rows.index], ref[b].numpy(), rtol=0, atol=1e-5)
    assert len({tuple(c) for c in gens["completion_ids"]}) > 1


def test_the_plain_loop_stops_each_sequence_at_its_stop(run_cfg, corpus):
    torch.manual_seed(0)
    model = tiny_lm().eval()
    refs = [by_hand(model, prompt_ids(t))[0] for t in PROMPTS]
    stop = refs[0][1]
    gens = run_cfg(overrides(corpus, "gpt2", *TINY, f"generate.stop=[eos,{stop}]"), name="stops").generations()
    for i, text in enumerate(PROMPTS):
        assert gens.iloc[i]["completion_ids"] == by_hand(model, prompt_ids(text), eos=stop)[0]
        assert gens.iloc[i]["stop_reason"] == ("stop" if stop in refs[i] else "length")
    assert gens["new_tokens"].nunique() > 1


def test_an_edit_at_steps_in_the_plain_loop_equals_a_hand_written_loop_adding_where_the_token_is_read(run_cfg,
                                                                                                      corpus):
    vector = torch.tensor([round(float(v), 4) for v in torch.randn(16, generator=torch.Generator().manual_seed(5))])
    values = "[" + ",".join(f"{v:.4f}" for v in vector.tolist()) + "]"
    steer = (f"+hooks.steer={{kind:forward,layers:[blocks.0],capture:[],"
             f"edit:[{{op:add,value:{values},coef:20.0,positions:{{steps:[2]}}}}]}}")
    gens = run_cfg(overrides(corpus, "gpt2", *TINY, steer), name="steer").generations()
    torch.manual_seed(0)
    model = tiny_lm().eval()
    for i, text in enumerate(PROMPTS):
        ids = prompt_ids(text)

        def add(n, hidden, at=len(ids) + 1):  # the token read in pass 2 (the second generated), whenever it is read
            if n < 2:
                return hidden
            hidden = hidden.clone()
            hidden[:, at] += 20.0 * vector
            return hidden
        assert gens.iloc[i]["completion_ids"] == by_hand(model, ids, add=add)[0]
    assert gens["completion_ids"].tolist() != [by_hand(model, prompt_ids(t))[0] for t in PROMPTS]


@pytest.mark.parametrize("extra", [
    [],
    ["+hooks.steer={kind:forward,layers:[transformer.h.0],capture:[],"
     "edit:[{op:add,value:" + "[" + ",".join(["0.9", "-0.7"] * 16) + "],coef:3.0,positions:{steps:[1,3]}}]}",
     "+hooks.resid.select={positions:last}"],
    ["generate.do_sample=true", "generate.temperature=1.5", "generate.top_k=40", "generate.top_p=0.9"],
])
def test_a_hugging_face_model_through_the_plain_loop_stores_what_its_generate_stores(run_cfg, corpus, extra):
    hf = run_cfg(overrides(corpus, "gpt2", *extra), name="hf")
    plain = run_cfg(overrides(corpus, "gpt2", *extra, "generate.loop=plain"), name="plain")
    a, b = hf.generations(), plain.generations()
    assert a.drop(columns="logprobs").equals(b.drop(columns="logprobs"))
    np.testing.assert_allclose(np.concatenate(a["logprobs"].tolist()), np.concatenate(b["logprobs"].tolist()),
                               atol=1e-5)
    assert hf.tokens().equals(plain.tokens())
    for block in BLOCKS:
        np.testing.assert_allclose(plain.load(layer=block, role="output"), hf.load(layer=block, role="output"),
                                   rtol=0, atol=1e-5)


def test_a_model_whose_output_is_not_logits_of_every_position_is_refused_before_the_store(tmp_path, corpus):
    from hookrun.engine.runner import run

    args = [*overrides(corpus, "gpt2", *TINY), "model._target_=tests.test_generate_steps.last_only_lm"]
    with pytest.raises(ConfigError, match=r"generate.loop: plain needs the model's output to be logits \[batch, seq, "
                                          r"vocab\].*it gave shape \[1, 512\]"):
        run(make_cfg([*args, f"store.path={tmp_path / 'x.zarr'}"]))
    assert not (tmp_path / "x.zarr").exists()


@pytest.mark.parametrize("loop", ["hf", "plain"])
def test_an_attention_pattern_during_generation_is_refused_naming_the_hook_and_the_way(run_cfg, corpus, loop):
    from hookrun.capture.hooks import HookError

    attn = "+hooks.attn={kind: forward, layers: [transformer.h.0.attn], capture: [output.1]}"
    with pytest.raises(HookError, match=r"hooks.attn: transformer.h.0.attn output.1 \(shape .*\) is an attention "
                                        r"pattern .*capture attention in a run without generation"):
        run_cfg(overrides(corpus, "gpt2", attn, f"generate.loop={loop}"), name=loop)
