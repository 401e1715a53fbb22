"""Edits that take their values from somewhere (hookrun.capture.sources) and edits on heads, against plain PyTorch
written here (its own hooks, each prompt run alone), on a GPT-2 and a Llama built from configs and the bundled
tokenizer: cross-prompt patching with an explicit source, the token-mismatch refusal, source runs refused before any
work, vectors with coef, steering directions from two runs, head ablation, and edit-only hooks (capture: [])."""
import numpy as np
import pytest
import torch

from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import tokenizer
from tests.test_patching import gpt2, llama  # 3-layer models built from configs, random weights

TARGETS = ["the hooks run on a model", "a store of captures"]
DONORS = ["every layer of the model writes one array", "tokens"]  # longer than its target, then shorter
ATOL = 2e-5


MODELS = {"gpt2": (gpt2, "transformer.h.0", "transformer.h.0.attn.c_proj"),
          "llama": (llama, "model.layers.0", "model.layers.0.self_attn.o_proj")}


def corpus(tmp_path, name, docs):
    path = tmp_path / f"{name}.txt"
    path.write_text("\n".join(docs) + "\n")
    return path


def overrides(kind, docs, *extra):
    return [f"+model._target_=tests.test_patching.{kind}", f"data.text.files=[{docs}]",
            "data.text.tokenizer={_target_:hookrun.experiments.lm.tokenizer}", "data.text.max_length=32",
            "data.text.bos=true",
            "data.batch_size=2", *extra]


def resid(kind):
    return f"+hooks.resid={{kind:forward,layers:[{MODELS[kind][1]}]}}"


LOGITS = "+hooks.out={kind:forward,layers:_model,capture:[output.logits]}"


def ids(doc):
    tok = tokenizer()
    return [tok.bos_token_id] + tok(doc, add_special_tokens=False)["input_ids"]


def alone(model, doc, module, fn=None, pre=False):
    """(logits [T, V], the module's output (or input) [T, D]) of one prompt alone; fn(tensor [1, T, D]) -> tensor
    replaces what the module returns (or, pre, takes)."""
    seen = {}

    def post(m, args, out):
        t = out[0] if isinstance(out, tuple) else out
        new = fn(t) if fn else t
        seen["t"] = new[0].detach()
        return ((new, *out[1:]) if isinstance(out, tuple) else new) if fn else None

    def before(m, args):
        new = fn(args[0]) if fn else args[0]
        seen["t"] = new[0].detach()
        return (new, *args[1:]) if fn else None

    mod = model.get_submodule(module)
    handle = mod.register_forward_pre_hook(before) if pre else mod.register_forward_hook(post)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids(doc)])).logits[0]
    handle.remove()
    return logits.numpy(), seen["t"].numpy()


def per_token(cap, role="output.logits", hook="out"):
    """A per-token array split by sample."""
    rows, tokens = cap.load(hook=hook, role=role), cap.tokens()
    return [rows[tokens.index[tokens["sample"] == s]] for s in sorted(tokens["sample"].unique())]


def at(position, value):
    """fn setting one position of [1, T, D] to `value` [D]."""
    def fn(t):
        t = t.clone()
        t[0, position] = torch.as_tensor(value)
        return t
    return fn


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_patch_from_a_longer_and_a_shorter_donor_at_the_last_position(run_cfg, tmp_path, kind):
    build, layer, _ = MODELS[kind]
    donor = run_cfg(overrides(kind, corpus(tmp_path, "d", DONORS), resid(kind)), name="donor")
    patch = (f"+hooks.patch={{kind:forward,layers:[{layer}],capture:[],edit:[{{op:replace,store:'{donor.path}',"
             "hook:resid,positions:last,source:{position:last}}]}")
    cap = run_cfg(overrides(kind, corpus(tmp_path, "t", TARGETS), patch, LOGITS), name="patched")
    model = build()
    for target, d, got in zip(TARGETS, DONORS, per_token(cap)):
        h = alone(model, d, layer)[1][-1]  # the donor's own last token
        want = alone(model, target, layer, at(-1, h))[0]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
        assert not np.allclose(got[-1], alone(model, target, layer)[0][-1], atol=1e-3)  # the patch changed it
    assert [a for a in cap.index["array"].unique() if a.startswith("patch/")] == []  # capture: [] stores nothing


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_an_explicit_position_mapping_takes_that_donor_position(run_cfg, tmp_path, kind):
    build, layer, _ = MODELS[kind]
    donor = run_cfg(overrides(kind, corpus(tmp_path, "d", DONORS[:1] * 2), resid(kind)), name="donor")
    patch = (f"+hooks.patch={{kind:forward,layers:[{layer}],capture:[],edit:[{{op:replace,store:'{donor.path}',"
             "hook:resid,positions:[1,-1],source:{sample:0,position:[4,2]}}]}")
    cap = run_cfg(overrides(kind, corpus(tmp_path, "t", TARGETS), patch, LOGITS), name="patched")
    model = build()
    h = alone(model, DONORS[0], layer)[1]
    for target, got in zip(TARGETS, per_token(cap)):
        want = alone(model, target, layer, lambda t: at(-1, h[2])(at(1, h[4])(t)))[0]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_patching_another_token_at_the_same_position_is_refused(run_cfg, tmp_path):
    donor = run_cfg(overrides("gpt2", corpus(tmp_path, "d", DONORS), resid("gpt2")), name="donor")
    patch = (f"+hooks.patch={{kind:forward,layers:[transformer.h.0],capture:[],edit:[{{op:replace,"
             f"store:'{donor.path}',hook:resid,positions:last,source:{{sample:0,position:same}}}}]}}")
    with pytest.raises(ConfigError) as err:
        run_cfg(overrides("gpt2", corpus(tmp_path, "t", TARGETS), patch, LOGITS), name="patched")
    tok = tokenizer()
    target, donor_ids = ids(TARGETS[0]), ids(DONORS[0])
    p = len(target) - 1
    here, there = target[p], donor_ids[p]
    assert (f"hooks.patch.edit[0]: source position same, but sample 0 position {p} is {tok.decode([here])!r} "
            f"(id {here}) here and {tok.decode([there])!r} (id {there})") in str(err.value)
    assert not (tmp_path / "patched.zarr").exists()


@pytest.mark.slow
def test_source_runs_of_another_tokenizer_or_corpus_are_refused_before_any_work(run_cfg, cli, tmp_path):
    docs = corpus(tmp_path, "t", TARGETS)
    other = run_cfg(overrides("gpt2", docs, resid("gpt2"), "+data.text.tokenizer.vocab_size=300"), name="tok")
    donor = run_cfg(overrides("gpt2", corpus(tmp_path, "d", DONORS), resid("gpt2")), name="donor")
    corpus_refusal = "holds other tokens than this run (source sample: same, position: same): sample 0 position 1 is"
    for source, expected in [(other, "was made with the tokenizer"), (donor, corpus_refusal)]:
        patch = (f"+hooks.patch={{kind:forward,layers:[transformer.h.0],capture:[],edit:[{{op:replace,"
                 f"store:'{source.path}',hook:resid}}]}}")
        out = tmp_path / "refused.zarr"
        proc = cli(*overrides("gpt2", docs, patch, LOGITS), f"store.path={out}", f"hydra.run.dir={tmp_path / 'h'}",
                   check=False)
        said = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "hooks.patch.edit[0].store" in said and expected in said, said
        assert not out.exists()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_vector_times_coef_equals_a_hook_adding_it(run_cfg, tmp_path, kind):
    build, layer, _ = MODELS[kind]
    v = np.random.default_rng(0).standard_normal(32).round(3)
    edit = (f"+hooks.steer={{kind:forward,layers:[{layer}],capture:[],edit:[{{op:add,value:{v.tolist()},coef:2.5,"
            "positions:last}]}").replace(" ", "")
    cap = run_cfg(overrides(kind, corpus(tmp_path, "t", TARGETS), edit, LOGITS))
    model = build()
    for target, got in zip(TARGETS, per_token(cap)):
        def add(t):
            t = t.clone()
            t[0, -1] += 2.5 * torch.as_tensor(v, dtype=t.dtype)
            return t
        np.testing.assert_allclose(got, alone(model, target, layer, add)[0], atol=ATOL, rtol=0)


def test_a_vector_of_the_wrong_width_is_refused_naming_both_widths(run_cfg, tmp_path):
    edit = "+hooks.steer={kind:forward,layers:[transformer.h.0],capture:[],edit:[{op:add,value:[1,2,3]}]}"
    with pytest.raises(ConfigError, match=r"hooks.steer.edit\[0\].value: a vector of width 3 does not fit .*last axis "
                                          r"32 wide"):
        run_cfg(overrides("gpt2", corpus(tmp_path, "t", TARGETS), edit, LOGITS))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_steering_direction_is_the_difference_of_two_runs_means(run_cfg, tmp_path, kind):
    build, layer, _ = MODELS[kind]
    a = run_cfg(overrides(kind, corpus(tmp_path, "a", DONORS), resid(kind)), name="a")
    b = run_cfg(overrides(kind, corpus(tmp_path, "b", TARGETS), resid(kind)), name="b")
    direction = a.load(hook="resid").astype(np.float64).mean(0) - b.load(hook="resid").astype(np.float64).mean(0)
    edit = (f"+hooks.steer={{kind:forward,layers:[{layer}],capture:[],edit:[{{op:add,value:{{diff:[{{store:'{a.path}',"
            f"hook:resid}},{{store:'{b.path}',hook:resid}}],reduce:mean}},coef:4.0,positions:last}}]}}")
    mean = (f"+hooks.mean={{kind:forward,layers:[{layer}],edit:[{{op:replace,value:{{store:'{a.path}',hook:resid,"
            "reduce:mean},positions:last}]}")
    cap = run_cfg(overrides(kind, corpus(tmp_path, "t", TARGETS), edit, LOGITS), name="steered")
    model = build()
    for target, got in zip(TARGETS, per_token(cap)):
        want = alone(model, target, layer, _adding(4.0 * direction))[0]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    replaced = run_cfg(overrides(kind, corpus(tmp_path, "t", TARGETS), mean), name="mean")
    for rows in per_token(replaced, role="output", hook="mean"):
        np.testing.assert_allclose(rows[-1], a.load(hook="resid").astype(np.float64).mean(0), atol=1e-6, rtol=0)


def _adding(v):
    def fn(t):
        t = t.clone()
        t[0, -1] += torch.as_tensor(v, dtype=t.dtype)
        return t
    return fn


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("heads,positions", [([1], None), ([0, 2], "last")])
def test_head_ablation_zeroes_that_heads_columns(run_cfg, tmp_path, kind, heads, positions):
    build, _, proj = MODELS[kind]
    where = f",positions:{positions}" if positions else ""
    edit = (f"+hooks.ablate={{kind:forward_pre,layers:[{proj}],capture:[],edit:[{{op:zero,heads:{heads}{where}}}]}}"
            ).replace(" ", "")
    cap = run_cfg(overrides(kind, corpus(tmp_path, "t", TARGETS), edit, LOGITS))
    model, dh = build(), 32 // 4

    def zero(t):
        t = t.clone()
        rows = slice(-1, None) if positions else slice(None)
        for h in heads:
            t[0, rows, h * dh:(h + 1) * dh] = 0
        return t

    for target, got in zip(TARGETS, per_token(cap)):
        np.testing.assert_allclose(got, alone(model, target, proj, zero, pre=True)[0], atol=ATOL, rtol=0)
        assert not np.allclose(got, alone(model, target, proj)[0], atol=1e-4)


def test_an_edit_only_run_stores_no_array_and_is_a_complete_store(run_cfg, tmp_path):
    edit_only = "+hooks.ablate={kind:forward,layers:[transformer.h.0],capture:[],edit:[{op:scale,value:2}]}"
    cap = run_cfg(overrides("gpt2", corpus(tmp_path, "t", TARGETS), edit_only))
    assert cap.status == "complete" and len(cap.index) == 0
    assert sorted(cap.samples["sample"]) == [0, 1]
    assert cap.verify() == []


def test_a_per_sample_patch_takes_the_named_donor_sample(run_cfg, npy):
    x = np.random.default_rng(3).standard_normal((6, 6)).astype("float32")
    base = ["+model._target_=tests.models.MLP", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=3"]
    donor = run_cfg([*base, "+hooks.acts={kind:forward,layers:fc1}"], name="donor")
    cap = run_cfg([*base, f"+hooks.acts={{kind:forward,layers:fc1,edit:[{{op:replace,store:'{donor.path}',hook:acts,"
                          "source:{sample:4}}]}"], name="patched")
    want = donor.load(hook="acts")[4]
    np.testing.assert_array_equal(cap.load(hook="acts"), np.broadcast_to(want, (6, *want.shape)))
