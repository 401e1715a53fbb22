"""The methods at standard site names (hookrun.capture.targets) on tiny random Hugging Face LMs of several families:
a standard-name grid equals the native-name grid; q heads and OPT's flattened MLP against patches written here
with plain hooks; the lens at the last block is the model's logits on every family with a readout; DLA's
components (from the anatomy) sum to the final residual stream; and the bundled patching, attribution and lens
experiments run unchanged but for the model on six families."""
import json

import numpy as np
import pytest
import torch
import transformers as tf

from hookrun.capture.anatomy import anatomy
from hookrun.capture.tokens import TokenInfo
from hookrun.methods.attribution import attribution_grid
from hookrun.methods.lens import components, find_readout, lens_logits, residual_gap, stack_parts
from hookrun.methods.patching import PatchError, patch_grid
from tests.helpers import REPO
from tests.test_anatomy import FAMILIES, build

IDS = torch.tensor([[5, 17, 42, 3, 9, 8], [1, 2, 3, 4, 5, 6]])
ALT = torch.tensor([[5, 30, 42, 3, 11, 8], [1, 2, 7, 4, 5, 6]])
METHOD_FAMILIES = ["gpt2", "llama", "gpt_neox", "opt"]


def batch(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, TokenInfo.of_batch(torch.ones_like(ids).bool(), torch.ones_like(ids).bool(), 64)


def ld(logits, rows):
    """logit 3 - logit 7 at the last position: a metric of every row."""
    return logits[:, -1, 3] - logits[:, -1, 7]


def grids(model, layers, **kw):
    (src, isrc), (tgt, itgt) = batch(IDS), batch(ALT)
    return patch_grid(model, src, tgt, isrc, itgt, layers, metric=ld, sites_per_forward=3, **kw)


def natives(model, site, n=None):
    """The native (module, role) of standard sites, as a user of native names writes them."""
    anat = anatomy(model)
    points = [anat.point(f"blocks.{i}{site}") for i in range(n or anat.n_layers)]
    return [p.module for p in points], ("input" if points[0].side == "input" else "output")


@pytest.mark.slow
@pytest.mark.parametrize("family", METHOD_FAMILIES)
def test_patching_at_standard_names_equals_patching_at_the_native_modules(family):
    model = build(family)
    modules, _ = natives(model, "")
    std, nat = grids(model, ["blocks.*"]), grids(model, modules)
    assert std.layers == [f"blocks.{i}" for i in range(2)] and nat.layers == modules
    assert torch.equal(std.scores, nat.scores) and torch.equal(std.clean, nat.clean)
    heads, role = natives(model, ".attn.heads")
    std, nat = grids(model, ["blocks.0-1.attn.heads"], heads="all"), grids(model, heads, role=role, heads="all")
    assert std.axis == "head" and std.labels == list(range(4))
    assert torch.equal(std.scores, nat.scores)
    assert std.scores.std() > 0  # the heads differ: the grid measured something
    if family != "opt":  # OPT's MLP is inline: its hidden is fc2's input, flattened ([B*T, F]) natively
        hidden, role = natives(model, ".mlp.hidden")
        std, nat = grids(model, ["blocks.*.mlp.hidden"], positions="last"), grids(model, hidden, role=role,
                                                                                   positions="last")
        assert torch.equal(std.scores, nat.scores)


def plain_patch(model, module, read, write, pre=False):
    """The metric of ALT with `module`'s tensor changed by write(t_alt, t_ids) (the IDS run's tensor by read):
    plain forward hooks written here, one forward."""
    mod = model.get_submodule(module)
    kept = {}
    grab = (lambda m, a: kept.__setitem__("x", read(a[0]))) if pre else \
        (lambda m, a, o: kept.__setitem__("x", read(o[0] if isinstance(o, tuple) else o)))
    h = mod.register_forward_pre_hook(grab) if pre else mod.register_forward_hook(grab)
    with torch.no_grad():
        model(input_ids=IDS)
    h.remove()
    put = (lambda m, a: (write(a[0].clone(), kept["x"]), *a[1:])) if pre else \
        (lambda m, a, o: write(o.clone(), kept["x"]))
    h = mod.register_forward_pre_hook(put) if pre else mod.register_forward_hook(put)
    with torch.no_grad():
        out = ld(model(input_ids=ALT).logits, None)
    h.remove()
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_q_heads_grid_equals_patching_each_heads_query_columns_by_hand(family):
    model = build(family)
    d, h = 32, 4
    dh = d // h
    module, cols = {"gpt2": ("transformer.h.0.attn.c_attn", lambda j: slice(j * dh, (j + 1) * dh)),
                    "llama": ("model.layers.0.self_attn.q_proj", lambda j: slice(j * dh, (j + 1) * dh)),
                    # GPT-NeoX's fused projection is [heads, (q, k, v), d_head]: head j's query first in its third
                    "gpt_neox": ("gpt_neox.layers.0.attention.query_key_value",
                                 lambda j: slice(j * 3 * dh, j * 3 * dh + dh))}[family]
    grid = grids(model, ["blocks.0.attn.q"], heads="all")
    assert grid.labels == list(range(h))
    for j in range(h):
        def write(t, src, j=j):
            t[..., cols(j)] = src[..., cols(j)]
            return t
        torch.testing.assert_close(grid.scores[:, 0, j], plain_patch(model, module, lambda x: x, write),
                                   atol=1e-5, rtol=0)


def test_opt_mlp_rows_are_unflattened_for_the_grid_and_patched_back():
    model = build("opt")
    grid = grids(model, ["blocks.1.mlp"], positions=[2])
    t = IDS.shape[1]

    def write(out, src):  # fc2 gives [B*T, d]: position 2 of every sample is rows b*T + 2
        rows = torch.arange(IDS.shape[0]) * t + 2
        out[rows] = src[rows]
        return out
    torch.testing.assert_close(grid.scores[:, 0, 0], plain_patch(model, "model.decoder.layers.1.fc2",
                                                                 lambda x: x, write), atol=1e-5, rtol=0)


def test_standard_sites_refuse_a_role_and_heads_where_they_are_not_split():
    model = build("gpt2")
    with pytest.raises(PatchError, match=r"role: 'input' with the standard name 'blocks\.\*'.*drop role"):
        grids(model, ["blocks.*"], role="input")
    with pytest.raises(PatchError, match=r"heads: blocks.0.attn is not split into heads.*blocks.0.attn.heads.*"
                                         r"transformer.h.0.attn.c_proj\], role: input"):
        grids(model, ["blocks.0.attn"], heads="all")
    with pytest.raises(PatchError, match=r"heads: transformer.h.1 output is not split into heads"):
        grids(model, ["transformer.h.1"], heads="all")
    with pytest.raises(PatchError, match=r"blocks.0.attn.pattern is the attention pattern"):
        grids(model, ["blocks.0.attn.pattern"], heads="all")
    with pytest.raises(PatchError, match=r"'blocks.0.resid_mid' is not a site of GPTNeoXForCausalLM.*parallel"):
        grids(build("gpt_neox"), ["blocks.0.resid_mid"])


@pytest.mark.parametrize("family", METHOD_FAMILIES)
def test_attribution_at_standard_names_equals_attribution_at_the_native_modules(family):
    model = build(family)
    (src, isrc), (tgt, itgt) = batch(IDS), batch(ALT)

    def est(layers, **kw):
        return attribution_grid(model, src, tgt, isrc, itgt, layers, metric=ld, **kw)
    modules, _ = natives(model, "")
    a, b = est(["blocks.*"]), est(modules)
    assert a.layers == ["blocks.0", "blocks.1"] and torch.equal(a.estimate, b.estimate)
    heads, role = natives(model, ".attn.heads")
    a = est(["blocks.*.attn.heads"], heads="all", method="integrated_gradients", steps=2)
    b = est(heads, role=role, heads="all", method="integrated_gradients", steps=2)
    torch.testing.assert_close(a.estimate, b.estimate, atol=1e-6, rtol=0)
    assert a.estimate.abs().max() > 0
    if family != "opt":
        hidden, role = natives(model, ".mlp.hidden")
        a, b = est(["blocks.*.mlp.hidden"], neurons="all", positions="last"), \
            est(hidden, role=role, neurons="all", positions="last")
        assert a.axis == "neuron" and torch.equal(a.estimate, b.estimate)
    else:  # OPT's hidden: fc2's input rows unflattened; its neurons are the fc1 width
        a = est(["blocks.*.mlp.hidden"], neurons=[0, 5], positions="last")
        assert a.estimate.shape == (2, 2, 2) and torch.isfinite(a.estimate).all()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_lens_at_the_last_block_is_the_models_logits(family):
    model = build(family)
    anat = anatomy(model)
    readout = find_readout(model)
    kept = {}
    last = model.get_submodule(anat.point(f"blocks.{anat.n_layers - 1}").module)
    h = last.register_forward_hook(lambda m, a, o: kept.__setitem__("x", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
        mine = lens_logits(readout, kept["x"])
    h.remove()
    torch.testing.assert_close(mine, logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dla_components_from_the_anatomy_sum_to_the_final_residual_stream(family):
    model = build(family)
    readout = find_readout(model)
    comps = components(model)
    outs, handles = {}, []
    for c in comps:
        handles.append(c.module.register_forward_hook(lambda m, a, o, n=c.name: outs.__setitem__(n, o)))
    handles.append(readout.norm.register_forward_pre_hook(lambda m, a: outs.__setitem__("final", a[0])))
    with torch.no_grad():
        model(input_ids=IDS)
    for h in handles:
        h.remove()
    _, stack = stack_parts(comps, outs, batch_shape=IDS.shape)
    assert residual_gap(stack, outs["final"]) < 1e-5


# -- the bundled experiments on six families -----------------------------------------------------------------------
SIX = {"gpt2": lambda c: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=512, n_layer=3, n_embd=32, n_head=4,
                                                             n_positions=64, **c)),
       "gpt_neox": lambda c: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SMALL, **c)),
       "opt": lambda c: tf.OPTForCausalLM(tf.OPTConfig(**{k: v for k, v in SMALL.items() if k != "intermediate_size"},
                                                       ffn_dim=64, **c)),
       "llama": lambda c: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, num_key_value_heads=2, **c)),
       "qwen2": lambda c: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, num_key_value_heads=2, **c)),
       "gemma": lambda c: tf.GemmaForCausalLM(tf.GemmaConfig(**SMALL, head_dim=8, num_key_value_heads=2, **c))}
SMALL = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=64)


def tiny(family: str, **ignored):
    """A tiny random LM of `family` over the bundled tokenizer's 512 tokens (the experiment's GPT-2 keys ignored)."""
    torch.manual_seed(0)
    return SIX[family]({"attn_implementation": "eager"}).eval()


def on(family):
    return ["model._target_=tests.test_anatomy_methods.tiny", f"+model.family={family}", "data.max_samples=4",
            "data.batch_size=4"]


def pairs(n=4):
    from hookrun.experiments.lm import tokenizer

    tok = tokenizer()
    rows = [json.loads(line) for line in (REPO / "experiments" / "data" / "pairs.jsonl").read_text().splitlines()][:n]
    ids = lambda text: torch.tensor([[tok.bos_token_id, *tok(text)["input_ids"]]])  # noqa: E731
    return [(ids(r["clean"]), ids(r["corrupt"]), tok(r["answer"])["input_ids"][0], tok(r["wrong"])["input_ids"][0])
            for r in rows]


def block_output_patch(model, family, layer, position, clean, corrupt, a, b):
    """The corrupt run's logit(a) - logit(b) at the last token with block `layer`'s output at `position` from the
    clean run: plain hooks on the model's own block (its ModuleList, written here per family)."""
    blocks = {"gpt2": lambda: model.transformer.h, "gpt_neox": lambda: model.gpt_neox.layers,
              "opt": lambda: model.model.decoder.layers}.get(family, lambda: model.model.layers)()
    kept = {}
    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    h = blocks[layer].register_forward_hook(lambda m, a_, o: kept.__setitem__("x", first(o)))
    with torch.no_grad():
        model(input_ids=clean)
    h.remove()

    def put(m, a_, o):
        x = first(o).clone()
        x[:, position] = kept["x"][:, position]
        return (x, *o[1:]) if isinstance(o, tuple) else x
    h = blocks[layer].register_forward_hook(put)
    with torch.no_grad():
        logits = model(input_ids=corrupt).logits[0, -1]
    h.remove()
    return float(logits[a] - logits[b])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SIX))
def test_bundled_patching_attribution_and_lens_run_on_six_families(run_cfg, family):
    model = tiny(family)
    cap = run_cfg(["+experiment=attribution", *on(family)], "attribution")  # patching_grid's grid rides along
    grid, est = cap.grid(), cap.read("attribution")
    assert grid.layers == ["blocks.0.resid_pre", "blocks.0", "blocks.1", "blocks.2"] == est.layers
    assert grid.scores.shape == (4, 4, 8) and np.isfinite(grid.scores).all()
    for sample, layer, position in [(0, 1, 2), (3, 2, 7), (1, 3, 5)]:
        clean, corrupt, a, b = pairs()[sample]
        want = block_output_patch(model, family, layer - 1, position, clean, corrupt, a, b)
        np.testing.assert_allclose(grid.scores[sample, layer, position], want, atol=1e-4)
    verified = np.isfinite(est.exact)
    assert verified.sum() >= 5  # attribution's exact check of its top sites is patching's grid there
    np.testing.assert_allclose(est.exact[verified], grid.scores[verified], atol=1e-5)
    cap = run_cfg(["+experiment=lens", *on(family)], "lens")
    lens = cap.read("lens")
    assert lens.layers == ["blocks.0.resid_pre", "blocks.0", "blocks.1", "blocks.2"]
    ids = [torch.tensor([g.sort_values("position")["token_id"].tolist()]) for _, g in cap.tokens().groupby("sample")]
    for row, x in enumerate(ids):
        with torch.no_grad():
            own = torch.softmax(model(input_ids=x).logits[0], -1).topk(5)
        t = x.shape[1]
        assert np.array_equal(lens.top_ids[row, -1, :t], own.indices.numpy())  # the last block read = the logits
        np.testing.assert_allclose(lens.top_probs[row, -1, :t], own.values.numpy(), atol=1e-5)
    np.testing.assert_allclose(lens.dla.parts.sum(1), lens.dla.logit, atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_feature_patching_at_standard_names_equals_the_native_modules(family):
    from hookrun.methods.saes import SparseAutoencoder

    model = build(family)
    torch.manual_seed(3)
    sae = SparseAutoencoder(32, 24).eval()
    with torch.no_grad():
        sae.b_enc.normal_(std=0.5)
    modules, _ = natives(model, ".attn")
    std = grids(model, ["blocks.*.attn"], dictionary=sae, features=[0, 7, 23])
    nat = grids(model, modules, dictionary=sae, features=[0, 7, 23])
    assert std.axis == "feature" and std.layers == ["blocks.0.attn", "blocks.1.attn"]
    assert torch.equal(std.scores, nat.scores) and std.scores.std() > 0
