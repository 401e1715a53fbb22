"""The anatomy against plain hooks on tiny random models of every supported family: every standard name resolves,
and what each reads obeys the model's own arithmetic (the residual stream adds up, heads through W_O sum to
attention's write, pattern @ v gives the heads, the MLP's hidden through its projection gives its write)."""
import pytest
import torch
import transformers as tf

from hookrun.capture.anatomy import AnatomyError, anatomy, pattern_regex

V, D, H = 64, 32, 4
COMMON = dict(vocab_size=V, num_hidden_layers=2, num_attention_heads=H, attn_implementation="eager")
LLAMA = dict(**COMMON, hidden_size=D, intermediate_size=48, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_layer=2, n_embd=D, n_head=H, n_positions=64,
                                                     attn_implementation="eager")),
    "gpt_neo": lambda: tf.GPTNeoForCausalLM(tf.GPTNeoConfig(vocab_size=V, num_layers=2, hidden_size=D, num_heads=H,
                                                            attention_types=[[["global", "local"], 1]],
                                                            max_position_embeddings=64, attn_implementation="eager")),
    "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=V, n_layer=2, n_embd=D, n_head=H, n_positions=64,
                                                     rotary_dim=4, attn_implementation="eager")),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**COMMON, hidden_size=D, intermediate_size=48)),
    "gpt_neox_seq": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**COMMON, hidden_size=D, intermediate_size=48,
                                                                   use_parallel_residual=False)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(**COMMON, hidden_size=D, ffn_dim=48, max_position_embeddings=64)),
    "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(**COMMON, hidden_size=D, intermediate_size=48)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**LLAMA, pad_token_id=0)),
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**LLAMA)),
    "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**LLAMA, num_local_experts=2, num_experts_per_tok=1)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**LLAMA)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**LLAMA, head_dim=8)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**LLAMA, head_dim=8)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**LLAMA, head_dim=8)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**LLAMA, head_dim=8)),
    "olmo": lambda: tf.OlmoForCausalLM(tf.OlmoConfig(**LLAMA, pad_token_id=0)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**LLAMA, pad_token_id=0)),
    "granite": lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**LLAMA)),
    "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**LLAMA, pad_token_id=0)),
    "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**LLAMA)),
}
PARALLEL = {"gptj", "gpt_neox", "phi", "cohere"}


def build(name):
    torch.manual_seed(0)
    return FAMILIES[name]().eval()


def read_all(model, anat, ids):
    """Every standard site's value on one forward, read with plain hooks written here (not hookrun's)."""
    got, handles = {}, []
    named = dict(model.named_modules())
    for p in anat.points(anat.standard_names()):
        mod = named[p.module]
        if p.side == "output":
            def hook(m, a, out, p=p):
                t = out[p.index] if isinstance(out, tuple) else out
                got[p.name] = p.get(t, ids.shape)
            handles.append(mod.register_forward_hook(hook))
        else:
            def pre(m, a, kw, p=p):
                got[p.name] = p.get(a[0] if a else kw["hidden_states"], ids.shape)
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()
    return got, logits


def weight_io(module):
    """A projection's weight as [in, out] (GPT-2's Conv1D stores it so; Linear stores [out, in])."""
    return module.weight if type(module).__name__ == "Conv1D" else module.weight.t()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_site_obeys_the_models_own_arithmetic(name):
    model = build(name)
    anat = anatomy(model)
    ids = torch.randint(0, V, (2, 7))
    got, logits = read_all(model, anat, ids)
    named = dict(model.named_modules())
    close = dict(atol=2e-5, rtol=1e-4)
    assert anat.parallel == (name in PARALLEL)
    embeddings = got["embed"] + (got["pos_embed"] if "pos_embed" in got else 0)  # as added to the stream
    torch.testing.assert_close(embeddings, got["blocks.0.resid_pre"])
    for i in range(anat.n_layers):
        b = f"blocks.{i}"
        pre, out, attn, mlp = (got[f"{b}.resid_pre"], got[b], got[f"{b}.attn"], got[f"{b}.mlp"])
        if anat.parallel:
            torch.testing.assert_close(out, pre + attn + mlp, **close)
            assert f"{b}.resid_mid" not in got
        else:
            torch.testing.assert_close(got[f"{b}.resid_mid"], pre + attn, **close)
            torch.testing.assert_close(out, got[f"{b}.resid_mid"] + mlp, **close)
        if i + 1 < anat.n_layers:
            torch.testing.assert_close(got[f"blocks.{i + 1}.resid_pre"], out)
        # attention's write: each head's output through its slice of W_O, plus the bias
        parts = anat.block_modules(i)
        if parts["attn_write"] is None:
            proj = named[parts["attn_out"]]
            w = weight_io(proj).reshape(anat.n_heads, anat.d_head, -1)
            heads = got[f"{b}.attn.heads"]
            assert heads.shape == (2, 7, anat.n_heads, anat.d_head)
            by_head = torch.einsum("bthk,hkd->bthd", heads, w)
            bias = proj.bias if proj.bias is not None else 0
            torch.testing.assert_close(by_head.sum(2) + bias, attn, **close)
        # the heads are the pattern applied to the values (key-value heads repeated for grouped queries)
        v = got[f"{b}.attn.v"]
        assert v.shape[-2] == anat.n_kv_heads
        v = v.repeat_interleave(anat.n_heads // anat.n_kv_heads, dim=-2)
        pattern = got[f"{b}.attn.pattern"]
        assert pattern.shape == (2, anat.n_heads, 7, 7)
        torch.testing.assert_close(torch.einsum("bhts,bshk->bthk", pattern, v), got[f"{b}.attn.heads"], **close)
        assert got[f"{b}.attn.q"].shape[-2:] == (anat.n_heads, anat.d_head)
        assert got[f"{b}.attn.k"].shape[-2:] == (anat.n_kv_heads, anat.d_head)
        # the MLP's write is its hidden through the output projection
        if parts["mlp_out"] is not None and parts["mlp_write"] is None:
            proj = named[parts["mlp_out"]]
            hidden = got[f"{b}.mlp.hidden"]
            torch.testing.assert_close(hidden @ weight_io(proj) + (proj.bias if proj.bias is not None else 0), mlp,
                                       **close)
    unembed, config = got["unembed"], model.config  # the unembedding's output: the logits before a final scale
    if getattr(config, "logit_scale", None):  # Cohere
        unembed = unembed * config.logit_scale
    if getattr(config, "logits_scaling", None):  # Granite
        unembed = unembed / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2 / 3
        unembed = torch.tanh(unembed / config.final_logit_softcapping) * config.final_logit_softcapping
    torch.testing.assert_close(unembed, logits)
    torch.testing.assert_close(got[f"blocks.{anat.n_layers - 1}"].shape, got["final_norm"].shape)


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "phi3", "llama", "opt"])
def test_put_of_get_gives_the_tensor_back_and_writes_only_its_part(name):
    model = build(name)
    anat = anatomy(model)
    torch.manual_seed(1)
    for site in ("attn.q", "attn.k", "attn.v", "attn.heads", "mlp.hidden"):
        p = anat.point(f"blocks.1.{site}")
        width = {"attn.heads": anat.n_heads * anat.d_head}.get(site)
        mod = dict(model.named_modules())[p.module]
        width = width or getattr(mod, "out_features", None) or getattr(mod, "nf", None) or mod.in_features
        if site == "mlp.hidden":
            width = getattr(mod, "in_features", None) or mod.weight.shape[0]
        t = torch.randn(2, 5, width)
        part = p.get(t, (2, 5))
        torch.testing.assert_close(p.put(t, part, (2, 5)), t, rtol=0, atol=0)
        new = p.put(t, torch.zeros_like(part), (2, 5))
        assert new.shape == t.shape
        assert int((new != t).sum()) == part.numel() - int((part == 0).sum())  # only the part changed


def test_patterns_ranges_and_segments():
    anat = anatomy(build("gpt2"))
    assert anat.names(["blocks.*"]) == ["blocks.0", "blocks.1"]
    assert anat.names("blocks.0-1.attn") == ["blocks.0.attn", "blocks.1.attn"]
    assert anat.names(["blocks.*.attn.heads", "embed"]) == ["embed", "blocks.0.attn.heads", "blocks.1.attn.heads"]
    assert "blocks.1.mlp.hidden" in anat.names(["blocks.1.**"])
    assert pattern_regex("blocks.*").fullmatch("blocks.0.attn") is None


def test_what_the_model_lacks_is_refused_naming_the_architecture_and_near_names():
    with pytest.raises(AnatomyError, match=r"blocks.0.resid_mid.*GPTJForCausalLM \(gptj\).*parallel"):
        anatomy(build("gptj")).point("blocks.0.resid_mid")
    with pytest.raises(AnatomyError, match=r"pos_embed.*LlamaForCausalLM.*no learned position embeddings"):
        anatomy(build("llama")).names(["pos_embed"])
    with pytest.raises(AnatomyError, match=r"blocks.5.*2 blocks"):
        anatomy(build("llama")).point("blocks.5.attn")
    with pytest.raises(AnatomyError, match=r"blocks.0.atn.*did you mean: blocks.0.attn"):
        anatomy(build("gpt2")).point("blocks.0.atn")
    torch.manual_seed(0)
    sdpa = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_layer=1, n_embd=D, n_head=H, attn_implementation="sdpa"))
    with pytest.raises(AnatomyError, match="attn_implementation=eager"):
        anatomy(sdpa).point("blocks.0.attn.pattern")


def test_an_unknown_model_names_the_key_and_its_top_modules_and_a_declared_one_works():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mix, self.ff = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            x = x + self.mix(self.norm(x))
            return x + self.ff(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(10, 8)
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.head = torch.nn.Linear(8, 10)

        def forward(self, ids):
            x = self.tok(ids)
            for blk in self.layers:
                x = blk(x)
            return self.head(x)

    net = Net()
    with pytest.raises(AnatomyError, match=r"model.anatomy: Net .*not an architecture.*top-level modules: tok, layers"):
        anatomy(net)
    with pytest.raises(AnatomyError, match=r"model.anatomy.atn: unknown part \(did you mean: attn"):
        anatomy(net, {"blocks": "layers", "embed": "tok", "atn": "mix", "attn": "mix", "mlp": "ff"})
    anat = anatomy(net, {"blocks": "layers", "embed": "tok", "attn": "mix", "mlp": "ff", "ln1": "norm",
                         "unembed": "head"})
    assert anat.point("blocks.1.attn").module == "layers.1.mix"
    assert anat.point("blocks.0.resid_mid").module == "layers.0.ff"
    assert anat.point("unembed").module == "head"
    assert "blocks.0.ln2" not in anat.standard_names()


@pytest.mark.parametrize("name", ["cohere", "granite", "gemma2", "llama"])
def test_logit_scale_and_softcap_take_the_unembeddings_output_to_the_logits(name):
    model = build(name) if name != "granite" else \
        tf.GraniteForCausalLM(tf.GraniteConfig(**LLAMA, logits_scaling=4.0)).eval()  # a scale that is not 1
    anat = anatomy(model)
    want = model.config.logit_scale if name == "cohere" else 0.25 if name == "granite" else 1.0
    assert anat.logit_scale == pytest.approx(want)
    assert anat.softcap == (model.config.final_logit_softcapping if name == "gemma2" else None)
    got, logits = read_all(model, anat, torch.tensor([[3, 9, 27, 4]]))
    out = got["unembed"] * anat.logit_scale
    if anat.softcap:
        out = torch.tanh(out / anat.softcap) * anat.softcap
    torch.testing.assert_close(out, logits)


def test_an_attention_only_model_has_no_mlp_sites():
    """The bundled induction model (no MLP): its table resolves, MLP sites are refused naming why."""
    from hookrun.experiments.induction import AttnOnly, AttnOnlyConfig
    torch.manual_seed(0)
    model = AttnOnly(AttnOnlyConfig(vocab_size=V, d_model=D, num_attention_heads=H, n_layer=2, n_positions=16))
    anat = anatomy(model)
    assert (anat.n_layers, anat.n_heads, anat.d_head, anat.parallel) == (2, H, D // H, False)
    assert anat.point("blocks.1.attn.k").module == "blocks.1.attn.qkv"
    assert "blocks.0.mlp" not in anat.standard_names() and "blocks.0.resid_mid" not in anat.standard_names()
    with pytest.raises(AnatomyError, match="no MLP"):
        anat.point("blocks.0.mlp")
    ids = torch.randint(0, V, (2, 5))
    got, named, handles = {}, dict(model.named_modules()), []
    for p in anat.points(["blocks.0.attn.heads", "blocks.0.attn", "blocks.1.resid_pre", "blocks.1.attn", "blocks.1"]):
        if p.side == "output":
            handles.append(named[p.module].register_forward_hook(
                lambda m, a, out, p=p: got.__setitem__(p.name, p.get(out))))
        else:
            handles.append(named[p.module].register_forward_pre_hook(
                lambda m, a, p=p: got.__setitem__(p.name, p.get(a[0]))))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    w = model.blocks[0].attn.out.weight
    assert got["blocks.0.attn.heads"].shape == (2, 5, H, D // H)
    torch.testing.assert_close(got["blocks.0.attn"], got["blocks.0.attn.heads"].flatten(-2) @ w.t() +
                               model.blocks[0].attn.out.bias)
    torch.testing.assert_close(got["blocks.1"], got["blocks.1.resid_pre"] + got["blocks.1.attn"])
