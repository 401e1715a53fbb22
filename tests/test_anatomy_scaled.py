"""Writes that are no one module's output: scaled before the residual add (Granite's residual_multiplier, MiniCPM3's
residual_scale) and an MLP write that is the sum of two modules (Granite 4's experts and shared MLP). blocks.N.attn
and .mlp are what the stream receives, so the residual identity holds on them; an edit there is what the stream
receives, a gradient there is the stream's; DLA's parts still sum to the final norm's input. Checked with plain
hooks and autograd written here, the multiplier read from the model's own block."""
import numpy as np
import pytest
import torch
import transformers as tf

from hookrun.capture.anatomy import anatomy
from hookrun.capture.scope import HookScope
from tests.test_anatomy import LLAMA

MULT = 0.22  # Granite 3's residual_multiplier


def tiny_granite(**ignored):
    """A tiny random Granite whose writes are scaled by 0.22 (over the bundled tokenizer's 512 tokens)."""
    torch.manual_seed(0)
    config = tf.GraniteConfig(**{**LLAMA, "vocab_size": 512}, residual_multiplier=MULT, embedding_multiplier=2.0,
                              logits_scaling=4.0)
    return tf.GraniteForCausalLM(config).eval()


def tiny_minicpm3():
    torch.manual_seed(0)
    config = tf.MiniCPM3Config(**{**LLAMA, "num_hidden_layers": 4, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=8,
                               qk_nope_head_dim=4, qk_rope_head_dim=4, head_dim=4, v_head_dim=8, scale_depth=1.4,
                               dim_model_base=8)
    return tf.MiniCPM3ForCausalLM(config).eval()


def plain(model, ids):
    """Per block (its input, attention's module output, the MLP's input stream, the MLP's module output, its
    output), read with plain hooks on the Llama-style modules."""
    got, hs = {}, []
    for i, layer in enumerate(model.model.layers):
        hs += [layer.register_forward_pre_hook(lambda m, a, kw, i=i: got.__setitem__((i, "pre"), kw.get(
                   "hidden_states", a[0] if a else None)), with_kwargs=True),
               layer.self_attn.register_forward_hook(lambda m, a, o, i=i: got.__setitem__((i, "attn"), o[0])),
               layer.post_attention_layernorm.register_forward_pre_hook(
                   lambda m, a, i=i: got.__setitem__((i, "mid"), a[0])),
               layer.mlp.register_forward_hook(lambda m, a, o, i=i: got.__setitem__((i, "mlp"), o)),
               layer.register_forward_hook(lambda m, a, o, i=i: got.__setitem__((i, "out"), o[0] if isinstance(
                   o, tuple) else o))]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        for h in hs:
            h.remove()
    return got, logits


@pytest.mark.parametrize("make, attr, source", [(tiny_granite, "residual_multiplier", "table"),
                                                (tiny_minicpm3, "residual_scale", "inferred")])
def test_a_scaled_write_is_the_site_and_the_stream_adds_up_on_it(make, attr, source):
    model = make()
    anat = anatomy(model)
    assert anat.source == source and anat.proof.failed == {}, anat.proof.failed
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    got, _ = plain(model, ids)
    for i, layer in enumerate(model.model.layers):
        k = getattr(layer, attr)  # the model's own multiplier
        assert k != 1.0
        attn, mlp = anat.point(f"blocks.{i}.attn"), anat.point(f"blocks.{i}.mlp")
        assert attn.scale == mlp.scale == pytest.approx(k)
        torch.testing.assert_close(got[(i, "mid")], got[(i, "pre")] + got[(i, "attn")] * k)
        torch.testing.assert_close(got[(i, "out")], got[(i, "mid")] + got[(i, "mlp")] * k)
        torch.testing.assert_close(attn.get(got[(i, "attn")]), got[(i, "attn")] * k)


def test_an_edit_of_a_scaled_write_is_what_the_stream_receives():
    model = tiny_granite()
    anat = anatomy(model)
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    clean, _ = plain(model, ids)
    u = torch.randn(LLAMA["hidden_size"])
    p = anat.point("blocks.1.attn")
    with HookScope() as scope:  # add u to the site: the stream into block 1's MLP moves by exactly u
        scope.value(model.get_submodule(p.module), p, lambda v: v + u)
        edited, _ = plain(model, ids)
    torch.testing.assert_close(edited[(1, "mid")], clean[(1, "mid")] + u)


def tiny_granite_hybrid(**ignored):
    """A tiny random Granite 4 hybrid (a Mamba block, then an attention block; experts and a shared MLP summed in each,
    writes scaled by 0.5) over the bundled tokenizer's 512 tokens."""
    torch.manual_seed(0)
    config = tf.GraniteMoeHybridConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layers_block_type=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=48, residual_multiplier=0.5, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        attn_implementation="eager")
    return tf.GraniteMoeHybridForCausalLM(config).eval()


def test_an_mlp_write_summed_from_two_modules_is_one_site():
    model = tiny_granite_hybrid()
    anat = anatomy(model)
    assert anat.source == "inferred" and anat.proof.failed == {}, anat.proof.failed
    layer = model.model.layers[1]
    assert anat.family.mlp_plus == "shared_mlp" and anat.point("blocks.1.mlp").module == "model.layers.1.block_sparse_moe"
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    got, hs = {}, []
    hs += [layer.block_sparse_moe.register_forward_hook(lambda m, a, o: got.__setitem__("moe", o)),
           layer.shared_mlp.register_forward_hook(lambda m, a, o: got.__setitem__("shared", o)),
           layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a: got.__setitem__("mid", a[0])),
           layer.register_forward_hook(lambda m, a, o: got.__setitem__("out", o[0] if isinstance(o, tuple) else o))]
    p = anat.point("blocks.1.mlp")
    u = torch.randn(32)
    with torch.no_grad():
        with HookScope() as scope:
            scope.value(model.get_submodule(p.module), p, lambda v: got.__setitem__("site", v.clone()))
            model(input_ids=ids)
        clean = {k: v.clone() for k, v in got.items()}
        write = (clean["moe"] + clean["shared"]) * layer.residual_multiplier  # the model's own sum and multiplier
        torch.testing.assert_close(clean["site"], write)
        torch.testing.assert_close(clean["out"], clean["mid"] + write)
        with HookScope() as scope:  # add u to the site: the block's output moves by exactly u
            scope.value(model.get_submodule(p.module), p, lambda v: v + u)
            model(input_ids=ids)
    for h in hs:
        h.remove()
    torch.testing.assert_close(got["out"], clean["out"] + u)


@pytest.mark.parametrize("make,site,stream", [("tiny_granite", "blocks.1.attn", "blocks.1.resid_mid"),
                                              ("tiny_granite_hybrid", "blocks.1.mlp", "blocks.1")])
def test_the_gradient_at_a_scaled_or_summed_write_is_the_streams(run_cfg, make, site, stream):
    """output_grad at a scaled write (Granite's blocks.1.attn) or a summed one (Granite 4's experts + shared MLP,
    blocks.1.mlp) adds into the stream: its gradient is the stream's just after the add (autograd's d loss / d the
    module's output over the multiplier)."""
    on = [f"model._target_=tests.test_anatomy_scaled.{make}", "data.max_samples=2", "data.batch_size=2",
          "loss=sum", f"+hooks.g={{kind: output_grad, layers: [{site}, {stream}]}}"]
    cap = run_cfg(["+experiment=lm_tokens", *on], "grad")
    got, want = cap.load(hook="g", layer=site), cap.load(hook="g", layer=stream)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("make", [tiny_granite, tiny_granite_hybrid])
def test_dla_parts_of_scaled_and_summed_writes_sum_to_the_final_stream(make):
    from hookrun.methods.lens import components, stack_parts

    model = make()
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    comps = components(model)
    outs, handles = {}, []
    for c in comps:
        handles.append(c.module.register_forward_hook(lambda m, a, o, n=c.name: outs.__setitem__(n, o)))
    final = {}
    handles.append(model.model.norm.register_forward_pre_hook(lambda m, a: final.__setitem__("x", a[0])))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    _, stack = stack_parts(comps, outs, batch_shape=ids.shape)
    if make is tiny_granite:
        assert [c.scale for c in comps] == [2.0] + [MULT] * 4  # the embedding's multiplier, then each write's
    torch.testing.assert_close(stack.sum(0), final["x"].float(), rtol=1e-4, atol=1e-5)
