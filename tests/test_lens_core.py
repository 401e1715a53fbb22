"""hookrun.methods.lens against the models' own forward passes: tiny Hugging Face causal LMs built from config
classes (random weights, every norm weight/bias and linear bias perturbed so gains and biases matter), with the
component outputs captured here by plain forward hooks and the references (logits, logit differences, layer
norms) computed with plain torch in this file."""
import pytest
import torch
import transformers as tf
from torch import nn

from hookrun.methods.lens import (LensError, attribute, component_output, components, find_readout,
                                  gather_sites, head_outputs, lens_logits, lens_table, logprob_and_rank, out_bias,
                                  residual_gap, stack_parts, top_k)

V, D, H = 100, 32, 4
COMMON = dict(vocab_size=V, num_hidden_layers=2, num_attention_heads=H, attn_implementation="eager")
LLAMA = dict(COMMON, hidden_size=D, intermediate_size=64, num_key_value_heads=2)
CONFIGS = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_layer=2, n_embd=D, n_head=H, n_positions=64,
                                                     layer_norm_epsilon=0.05, attn_implementation="eager")),
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA, rms_norm_eps=0.05)),  # eps that matters
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**LLAMA)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**LLAMA)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**LLAMA, head_dim=8)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**LLAMA, head_dim=8, final_logit_softcapping=3.0)),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**COMMON, hidden_size=D, intermediate_size=64)),
    "gpt_neox_seq": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**COMMON, hidden_size=D, intermediate_size=64,
                                                                   use_parallel_residual=False)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(**COMMON, hidden_size=D, ffn_dim=64, max_position_embeddings=64)),
    "opt_proj": lambda: tf.OPTForCausalLM(tf.OPTConfig(**COMMON, hidden_size=D, ffn_dim=64, word_embed_proj_dim=16,
                                                       max_position_embeddings=64)),
}
NORMS = {"gpt2": "transformer.ln_f", "gpt_neox": "gpt_neox.final_layer_norm", "gpt_neox_seq":
         "gpt_neox.final_layer_norm", "opt": "model.decoder.final_layer_norm",
         "opt_proj": "model.decoder.final_layer_norm"}
IDS = torch.tensor([[5, 17, 42, 3, 99, 8, 61], [1, 2, 3, 4, 5, 6, 7]])


def build(name):
    torch.manual_seed(0)
    model = CONFIGS[name]().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm gains/biases and linear biases away from their 1/0 init
                p.add_(torch.randn_like(p) * 0.3)
            else:  # weights 5x their init (std 0.1): logit differences of a few units, not hundredths
                p.mul_(5)
    return model


def run(model, hooked):
    """logits, {name: output} of hooked modules, {name: input} of the same (plain forward hooks)."""
    outs, ins, handles = {}, {}, []
    for name, module in model.named_modules():
        if name in hooked:
            def keep(mod, args, output, name=name):
                ins[name], outs[name] = args[0] if args else None, output
            handles.append(module.register_forward_hook(keep))
    try:
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
    finally:
        for h in handles:
            h.remove()
    return logits, outs, ins


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_lens_on_the_final_residual_is_the_models_own_logits(name):
    model = build(name)
    readout = find_readout(model)
    assert readout.norm_name == NORMS.get(name, "model.norm")
    assert readout.unembed_name == "lm_head"  # GPT-NeoX's embed_out is lm_head in transformers 5
    assert [n for n, _ in readout.post] == (["model.decoder.project_out"] if name == "opt_proj" else [])
    assert readout.softcap == (3.0 if name == "gemma2" else None)
    logits, _, ins = run(model, {readout.norm_name})
    final = ins[readout.norm_name]
    with torch.no_grad():
        mine = lens_logits(readout, final)
    assert (mine - logits).abs().max() < 1e-5
    ids, probs = top_k(mine, 3)
    assert torch.equal(ids, logits.topk(3, dim=-1).indices)
    assert torch.allclose(probs, torch.softmax(logits, -1).topk(3, dim=-1).values, atol=1e-6)


def test_logprob_and_rank_equal_a_sort_written_here():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, V)
    tokens = torch.tensor([[7, 50]])  # broadcast over [2, 3]
    lp, rank = logprob_and_rank(logits, tokens)
    assert lp.shape == rank.shape == (2, 3, 2)
    for i in range(2):
        for j in range(3):
            order = logits[i, j].argsort(descending=True).tolist()
            for t_i, t in enumerate([7, 50]):
                assert rank[i, j, t_i] == order.index(t)
                assert torch.isclose(lp[i, j, t_i], torch.log_softmax(logits[i, j], -1)[t], atol=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_lens_table_at_layers_x_positions_equals_one_site_at_a_time(name):
    model = build(name)
    readout = find_readout(model)
    blocks = [c.name.rsplit(".", 1)[0] for c in components(model) if c.kind == "attn"]
    _, outs, _ = run(model, set(blocks))
    positions = torch.tensor([[0, 3, 6], [1, 2, 5]])
    tokens = torch.tensor([[[11, 12]], [[13, 14]]])  # [B, 1, T]: per prompt
    with torch.no_grad():
        table = lens_table(readout, gather_sites([outs[b] for b in blocks], positions), k=4, tokens=tokens,
                           chunk=3 * V)  # 3 rows a block: the chunking is exercised
    assert table.top_ids.shape == (2, 2, 3, 4) and table.logprob.shape == (2, 2, 3, 2)
    for layer, block in enumerate(blocks):
        for b in range(2):
            for p_i, p in enumerate(positions[b].tolist()):
                h = component_output(outs[block])[b, p]
                with torch.no_grad():
                    logp = torch.log_softmax(lens_logits(readout, h), -1)
                assert torch.equal(table.top_ids[layer, b, p_i], logp.topk(4).indices)
                assert torch.allclose(table.logprob[layer, b, p_i], logp[tokens[b, 0]], atol=1e-5)
                ranks = [(logp > logp[t]).sum() for t in tokens[b, 0]]
                assert table.rank[layer, b, p_i].tolist() == ranks


DLA_MODELS = ["gpt2", "llama", "qwen2", "mistral", "gemma", "gemma2", "gpt_neox", "gpt_neox_seq", "opt", "opt_proj"]


@pytest.mark.parametrize("name", DLA_MODELS)
def test_dla_parts_sum_to_the_logit_difference(name):
    model = build(name)
    readout = find_readout(model)
    comps = components(model)
    logits, outs, ins = run(model, {c.name for c in comps} | {readout.norm_name})
    final = ins[readout.norm_name]
    stack = torch.stack(torch.broadcast_tensors(*[component_output(outs[c.name], IDS.shape) for c in comps]))
    assert residual_gap(stack, final) < 1e-5
    token, other = torch.tensor([[23], [64]]), torch.tensor([[40], [2]])  # per prompt, all positions
    att = attribute(readout, stack, final, token, other)
    assert att.parts.shape == (len(comps), 2, 7)
    pre_cap = logits
    if readout.softcap:  # attribution is of the logit before Gemma 2's tanh cap: undo it by hand
        pre_cap = torch.atanh(logits / readout.softcap) * readout.softcap
    want = pre_cap.gather(-1, token.expand(2, 7)[..., None]) - pre_cap.gather(-1, other.expand(2, 7)[..., None])
    assert (att.total() - want[..., 0]).abs().max() < 1e-4
    # one token (no difference) too, as a dict of parts
    att1 = attribute(readout, {c.name: component_output(outs[c.name], IDS.shape) for c in comps}, final, 23)
    assert list(att1.as_dict())[-1] == "bias" and (att1.total() - pre_cap[..., 23]).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_dla_with_a_layernorm_written_out_by_hand(name):
    """Each part's contribution equals the frozen-scale formula written out here from the norm's parameters."""
    model = build(name)
    readout = find_readout(model)
    comps = components(model)
    _, outs, ins = run(model, {c.name for c in comps} | {readout.norm_name})
    final = ins[readout.norm_name]
    norm, head = readout.norm, readout.unembed
    w = head.weight[23] - head.weight[40]
    x = component_output(outs[comps[-1].name])  # the last MLP's output
    if name == "gpt2":
        sigma = torch.sqrt(final.var(-1, unbiased=False, keepdim=True) + norm.eps)
        want = ((x - x.mean(-1, keepdim=True)) / sigma * norm.weight) @ w
        bias = norm.bias @ w
    else:
        rms = torch.sqrt(final.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        want, bias = (x / rms * norm.weight) @ w, torch.tensor(0.0)
    att = attribute(readout, component_output(outs[comps[-1].name])[None], final, 23, 40)
    assert torch.allclose(att.parts[0], want, atol=1e-5)
    assert torch.allclose(att.bias, bias.expand(2, 7), atol=1e-5)


HEAD_MODELS = ["gpt2", "llama", "qwen2", "mistral", "gemma", "gpt_neox", "opt"]


@pytest.mark.parametrize("name", HEAD_MODELS)
def test_heads_of_a_block_sum_to_its_attention_contribution(name):
    model = build(name)
    readout = find_readout(model)
    comps = components(model)
    attn = [c for c in comps if c.kind == "attn"][1]
    logits, outs, ins = run(model, {attn.name, attn.out_proj_name, readout.norm_name})
    final, z = ins[readout.norm_name], ins[attn.out_proj_name]
    heads = head_outputs(attn, z)  # [B, T, H, d]
    assert heads.shape == (2, 7, H, D)
    # head 1 by hand: its slice of z through its slice of the projection's weight
    dh = z.shape[-1] // H
    weight = attn.out_proj.weight
    w_o = weight[dh:2 * dh, :] if name == "gpt2" else weight[:, dh:2 * dh].t()
    assert torch.allclose(heads[:, :, 1], z[..., dh:2 * dh] @ w_o, atol=1e-6)
    bias = out_bias(attn)
    parts = [heads.movedim(-2, 0)[h] for h in range(H)] + ([bias.expand(2, 7, D)] if bias is not None else [])
    assert (name in ("gpt2", "gpt_neox", "opt")) == (bias is not None)
    att_heads = attribute(readout, torch.stack(parts), final, 23, 40)
    att_block = attribute(readout, component_output(outs[attn.name])[None], final, 23, 40)
    assert (att_heads.parts.sum(0) - att_block.parts[0]).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt"])
def test_every_head_plus_embeddings_mlps_and_biases_sums_to_the_logit_difference(name):
    model = build(name)
    readout = find_readout(model)
    comps = components(model)
    projs = {c.out_proj_name for c in comps if c.out_proj_name}
    logits, outs, ins = run(model, {c.name for c in comps} | projs | {readout.norm_name})
    names, stack = stack_parts(comps, outs, z={p: ins[p] for p in projs}, batch_shape=IDS.shape)
    heads = [n for n in names if ".head" in n]
    assert len(heads) == 2 * H and names[-1] == comps[-1].name
    assert (f"{comps[-2].out_proj_name}.bias" in names) == (name != "llama")
    att = attribute(readout, stack, ins[readout.norm_name], 23, 40)
    want = logits[..., 23] - logits[..., 40]
    assert (att.total() - want).abs().max() < 1e-4


def test_gemma2_heads_are_refused_since_a_norm_follows_attention():
    model = build("gemma2")
    attn = [c for c in components(model) if c.kind == "attn"][0]
    assert attn.name == "model.layers.0.post_attention_layernorm" and attn.out_proj is None
    with pytest.raises(LensError, match="no linear per-head split"):
        head_outputs(attn, torch.zeros(1, 32))


class Tiny(nn.Module):
    """A model of no known architecture: embed -> block -> ln -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.block = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        return self.head(self.ln(x + self.block(x)))


def test_a_model_without_a_known_readout_is_refused_naming_the_keys_and_candidates():
    model = Tiny()
    with pytest.raises(LensError) as err:
        find_readout(model)
    msg = str(err.value)
    assert msg.startswith("lens: cannot find the unembedding of Tiny (model_type None): set lens.unembed (and "
                          "lens.norm)")
    assert msg.endswith("norm-like modules (last 1): ln; the last Linear layers: block, head")
    with pytest.raises(LensError, match=r"lens.norm: 'ln_f' is no module of Tiny \(did you mean: ln\?\)"):
        find_readout(model, norm="ln_f", unembed="head")
    readout = find_readout(model, norm="ln", unembed="head")  # named: then it works
    x = torch.randn(3, D)
    assert torch.allclose(lens_logits(readout, x), model.head(model.ln(x)))
    with pytest.raises(LensError, match="lens.dla: Tiny .* has no known component layout"):
        components(model)


def test_post_ln_opt_is_refused_for_dla_but_read_through_no_norm():
    model = tf.OPTForCausalLM(tf.OPTConfig(**COMMON, hidden_size=D, ffn_dim=64, do_layer_norm_before=False)).eval()
    readout = find_readout(model)
    assert readout.norm is None
    logits, outs, _ = run(model, {"model.decoder.layers.1"})
    assert (lens_logits(readout, component_output(outs["model.decoder.layers.1"])) - logits).abs().max() < 1e-5
    with pytest.raises(LensError, match="do_layer_norm_before=False"):
        components(model)
