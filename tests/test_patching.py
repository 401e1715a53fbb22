"""hookrun.methods.patching.patch_grid against plain PyTorch written here: its own forward hooks, one site patched a
forward, on a GPT-2 and a Llama built from configs (random weights, eager attention) and the bundled tokenizer."""
import pytest
import torch

from hookrun.capture.tokens import TokenInfo
from hookrun.experiments.lm import causal_lm, tokenizer
from hookrun.methods.patching import Noise, PatchError, patch_grid

TEXTS = ["the hooks run on a model", "a store of captures", "every layer writes an array", "tokens"]
CHANGE = 2  # the corrupt prompt differs from the clean one in the token at this real position


def gpt2():
    torch.manual_seed(0)
    return causal_lm(n_layer=3, n_embd=32, n_head=4).eval()


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


MODELS = {"gpt2": (gpt2, "transformer.h.{}", "transformer.h.{}.attn.c_proj"),
          "llama": (llama, "model.layers.{}", "model.layers.{}.self_attn.o_proj")}


def batch(seqs, side):
    """Keyword inputs and TokenInfo of token id lists, padded as hookrun.data.text pads them (written out here)."""
    longest = max(map(len, seqs))
    ids = torch.full((len(seqs), longest), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(longest - len(s), longest)
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    return kwargs, TokenInfo.of_batch(mask.bool(), mask.bool(), 64)


def pairs(side, texts=TEXTS):
    """Clean and corrupt batches: BOS + each text, the corrupt one with another token at real position CHANGE."""
    tok = tokenizer()
    clean = [[tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    corrupt = [s[:CHANGE] + [(s[CHANGE] + 7) % 500] + s[CHANGE + 1:] if len(s) > CHANGE else s for s in clean]
    return batch(clean, side), batch(corrupt, side)


def first_col(kwargs):
    return (kwargs["attention_mask"].cumsum(1) == 0).sum(1)


def last_col(kwargs):
    return first_col(kwargs) + kwargs["attention_mask"].sum(1) - 1


def logit_diff(kwargs, good=5, bad=7):
    """The metric: logit of token `good` minus `bad` at each row's sample's last real token."""
    last = last_col(kwargs)
    return lambda logits, ids: (logits[torch.arange(len(ids)), last[ids], good]
                                - logits[torch.arange(len(ids)), last[ids], bad])


def capture(model, names, inputs, pre=False):
    got = {}
    mods = dict(model.named_modules())
    if pre:
        hs = [mods[n].register_forward_pre_hook(lambda m, a, n=n: got.__setitem__(n, a[0])) for n in names]
    else:
        hs = [mods[n].register_forward_hook(lambda m, a, o, n=n: got.__setitem__(n, o)) for n in names]
    with torch.no_grad():
        model(**inputs)
    for h in hs:
        h.remove()
    return got


def run_patched(model, name, inputs, fn, metric, pre=False):
    """The metric of `inputs` with the module's output (or first input, pre=True) replaced by fn(it)."""
    module = dict(model.named_modules())[name]
    if pre:
        h = module.register_forward_pre_hook(lambda m, a: (fn(a[0]), *a[1:]))
    else:
        h = module.register_forward_hook(lambda m, a, o: fn(o))
    with torch.no_grad():
        logits = model(**inputs).logits
    h.remove()
    return metric(logits, torch.arange(len(logits)))


def loop_grid(model, names, src, tgt, rel_positions, metric, src_rel=None):
    """[B, layers, P]: one forward per (layer, position), the source's value at that real position patched in."""
    src_rel = rel_positions if src_rel is None else src_rel
    got = capture(model, names, src)
    b = len(tgt["input_ids"])
    out = torch.full((b, len(names), len(rel_positions)), float("nan"))
    lt, ls = tgt["attention_mask"].sum(1), src["attention_mask"].sum(1)
    for li, name in enumerate(names):
        for j, (p, q) in enumerate(zip(rel_positions, src_rel)):
            pt = torch.tensor([p if p >= 0 else int(n) + p for n in lt])
            ps = torch.tensor([q if q >= 0 else int(n) + q for n in ls])
            rows = (pt < lt).nonzero().squeeze(1)
            tcol, scol = first_col(tgt)[rows] + pt[rows], first_col(src)[rows] + ps[rows]

            def put(o, rows=rows, tcol=tcol, scol=scol, name=name):
                o = o.clone()
                o[rows, tcol] = got[name][rows, scol]
                return o
            values = run_patched(model, name, tgt, put, metric)
            out[rows, li, j] = values[rows]
    return out


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


@pytest.fixture(scope="module", params=list(MODELS))
def lm(request):
    build, block, proj = MODELS[request.param]
    return build(), [block.format(i) for i in range(3)], [proj.format(i) for i in range(3)]


@pytest.mark.parametrize("side", ["right", "left"])
def test_layer_by_position_grid_equals_one_site_a_forward(lm, side):
    """Exact at one site a forward; several sites stacked along the batch axis agree within 1e-5 (float noise of
    matrix products over more rows)."""
    model, blocks, _ = lm
    (src, isrc), (tgt, itgt) = pairs(side)
    longest = int(itgt.lengths.max())
    want = loop_grid(model, blocks, src, tgt, list(range(longest)), logit_diff(tgt))
    assert want.shape == (4, 3, longest) and int(want.isnan().sum()) == sum(longest - int(n) for n in itgt.lengths) * 3
    one = patch_grid(model, src, tgt, isrc, itgt, blocks, metric=logit_diff(tgt), sites_per_forward=1)
    assert torch.equal(one.scores.isnan(), want.isnan())
    assert torch.equal(one.scores.nan_to_num(), want.nan_to_num())
    assert one.forwards == 3 * longest and one.labels == list(range(longest))
    for k in (5, "auto"):
        many = patch_grid(model, src, tgt, isrc, itgt, blocks, metric=logit_diff(tgt), sites_per_forward=k)
        torch.testing.assert_close(many.scores, want, atol=1e-5, rtol=0, equal_nan=True)
        assert many.forwards < one.forwards
    with torch.no_grad():
        clean = logit_diff(tgt)(model(**src).logits, torch.arange(4))
        corrupt = logit_diff(tgt)(model(**tgt).logits, torch.arange(4))
    assert torch.equal(one.clean, clean) and torch.equal(one.corrupt, corrupt)
    # before the corrupted token nothing changes; the last block's last position restores the clean metric
    torch.testing.assert_close(one.scores[:, :, :CHANGE], corrupt[:, None, None].expand(-1, 3, CHANGE))
    last = itgt.lengths - 1
    torch.testing.assert_close(one.normalised()[torch.arange(4), 2, last], torch.ones(4))
    frame = one.to_frame()
    assert len(frame) == 4 * 3 * longest and list(frame.columns) == ["sample", "layer", "position", "score", "clean",
                                                                     "corrupt"]


def test_last_position_grid_and_a_per_sample_tensor_of_positions(lm):
    model, blocks, _ = lm
    (src, isrc), (tgt, itgt) = pairs("left")
    want = loop_grid(model, blocks, src, tgt, [-1], logit_diff(tgt))
    got = patch_grid(model, src, tgt, isrc, itgt, blocks, metric=logit_diff(tgt), positions="last")
    assert got.scores.shape == (4, 3, 1) and got.labels == [-1]
    torch.testing.assert_close(got.scores, want, atol=1e-5, rtol=0)
    per_sample = torch.tensor([[CHANGE, -1]] * 4)  # e.g. a subject's token, then the last token
    got = patch_grid(model, src, tgt, isrc, itgt, blocks, metric=logit_diff(tgt), positions=per_sample,
                     sites_per_forward=1)
    assert torch.equal(got.scores, loop_grid(model, blocks, src, tgt, [CHANGE, -1], logit_diff(tgt)))


@pytest.mark.parametrize("positions", ["all", "last"])
def test_heads_grid_equals_replacing_the_heads_columns_by_hand(lm, positions):
    model, _, projs = lm
    (src, isrc), (tgt, itgt) = pairs("right")
    metric = logit_diff(tgt)
    got = patch_grid(model, src, tgt, isrc, itgt, projs, role="input", heads="all", positions=positions,
                     metric=metric, sites_per_forward=1)
    assert got.scores.shape == (4, 3, 4) and got.axis == "head" and got.labels == [0, 1, 2, 3]
    source = capture(model, projs, src, pre=True)
    width = source[projs[0]].shape[-1] // 4
    real = tgt["attention_mask"].bool() if positions == "all" else torch.zeros_like(tgt["attention_mask"]).bool()
    if positions == "last":
        real[torch.arange(4), last_col(tgt)] = True
    for li, name in enumerate(projs):
        for h in range(4):
            def put(x, name=name, h=h):
                x = x.clone()
                cols = slice(h * width, (h + 1) * width)
                x[..., cols] = torch.where(real[..., None], source[name][..., cols], x[..., cols])
                return x
            assert torch.equal(got.scores[:, li, h], run_patched(model, name, tgt, put, metric, pre=True))
    subset = patch_grid(model, src, tgt, isrc, itgt, projs, role="input", heads=[3, 1], positions=positions,
                        metric=metric, sites_per_forward=4)
    torch.testing.assert_close(subset.scores, got.scores[:, :, [3, 1]], atol=1e-5, rtol=0)


def test_zeroing_a_head_equals_zeroing_its_columns_by_hand(lm):
    model, _, projs = lm
    (src, isrc), _ = pairs("right")
    metric = logit_diff(src)
    got = patch_grid(model, src, src, isrc, isrc, projs, role="input", heads="all", metric=metric, donor="zero",
                     sites_per_forward=3)
    width = 32 // 4  # hidden size / heads, both models
    for h in range(4):
        def put(x, h=h):
            x = x.clone()
            x[..., h * width:(h + 1) * width] = 0
            return x
        torch.testing.assert_close(got.scores[:, 1, h], run_patched(model, projs[1], src, put, metric, pre=True),
                                   atol=1e-5, rtol=0)


def test_noise_source_is_seeded_and_is_the_documented_noise(lm):
    """Causal tracing: the clean prompt with noise on positions 1-2 of the embedding output as the target."""
    model, blocks, _ = lm
    (src, isrc), _ = pairs("left")
    metric = logit_diff(src)
    noise = Noise(positions=[1, 2], seed=3)
    a = patch_grid(model, src, src, isrc, isrc, blocks, metric=metric, positions="last", target_noise=noise)
    b = patch_grid(model, src, src, isrc, isrc, blocks, metric=metric, positions="last", target_noise=noise)
    c = patch_grid(model, src, src, isrc, isrc, blocks, metric=metric, positions="last",
                   target_noise=Noise(positions=[1, 2], seed=4))
    assert torch.equal(a.scores, b.scores) and torch.equal(a.corrupt, b.corrupt)
    assert not torch.equal(a.corrupt, c.corrupt)
    emb = model.get_input_embeddings()
    with torch.no_grad():
        out = emb(src["input_ids"])
    std = 3 * out[src["attention_mask"].bool()].std()
    draw = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)) * std
    where = torch.zeros(out.shape[:2], dtype=torch.bool)
    where[torch.arange(4)[:, None], first_col(src)[:, None] + torch.tensor([1, 2])] = True
    h = emb.register_forward_hook(lambda m, args, o: o + draw * where[..., None])
    with torch.no_grad():
        noisy = metric(model(**src).logits, torch.arange(4))
    h.remove()
    torch.testing.assert_close(a.corrupt, noisy, atol=1e-5, rtol=0)
    # the last block's last position carries everything the logits see: restoring it restores the clean value
    torch.testing.assert_close(a.scores[:, 2, 0], a.clean, atol=1e-5, rtol=0)
    # noise as the source: the noisy run's values patched into the clean prompt
    d = patch_grid(model, src, src, isrc, isrc, blocks, metric=metric, positions="last", source_noise=noise)
    torch.testing.assert_close(d.clean, a.corrupt)
    torch.testing.assert_close(d.scores[:, 2, 0], a.corrupt)


def test_mean_and_resample_donors(lm):
    model, blocks, _ = lm
    (src, isrc), (tgt, itgt) = pairs("right", [TEXTS[0], TEXTS[0].replace("model", "layer"), TEXTS[1]])
    metric = logit_diff(tgt)
    got = capture(model, blocks[1:2], src)[blocks[1]]
    last = last_col(src)
    mean = got[torch.arange(3), last].mean(0)

    def put(o):
        o = o.clone()
        o[torch.arange(3), last_col(tgt)] = mean
        return o
    m = patch_grid(model, src, tgt, isrc, itgt, blocks, metric=metric, positions="last", donor="mean")
    assert m.donors is None
    torch.testing.assert_close(m.scores[:, 1, 0], run_patched(model, blocks[1], tgt, put, metric), atol=1e-5, rtol=0)
    with pytest.raises(PatchError, match=r"sample \d has \d+ real tokens in the source \(sample \d\) but \d+ in"):
        patch_grid(model, src, tgt, isrc, itgt, blocks, metric=metric, positions="last", donor="resample", seed=1)
    r = patch_grid(model, src, tgt, isrc, itgt, blocks, metric=metric, positions="last", donor="resample", seed=1,
                   source_positions="last")
    donors = r.donors
    assert sorted(donors.tolist()) == [0, 1, 2] and all(d != i for i, d in enumerate(donors.tolist()))
    assert torch.equal(donors, patch_grid(model, src, tgt, isrc, itgt, blocks, metric=metric, positions="last",
                                          donor="resample", seed=1, source_positions="last").donors)

    def put(o):
        o = o.clone()
        o[torch.arange(3), last_col(tgt)] = got[donors, last[donors]]
        return o
    torch.testing.assert_close(r.scores[:, 1, 0], run_patched(model, blocks[1], tgt, put, metric), atol=1e-5, rtol=0)


def test_length_mismatch_is_refused_and_an_explicit_mapping_is_taken(lm):
    model, blocks, _ = lm
    (src, isrc), _ = pairs("right")
    (tgt, itgt), _ = pairs("right", ["the hooks run on a model", "a store of the captures", TEXTS[2], TEXTS[3]])
    metric = logit_diff(tgt)
    with pytest.raises(PatchError, match=r"sample 1 has 5 real tokens in the source \(sample 1\) but 6 in the target"):
        patch_grid(model, src, tgt, isrc, itgt, blocks, metric=metric, positions="last")
    got = patch_grid(model, src, tgt, isrc, itgt, blocks, metric=metric, positions="last", source_positions="last",
                     source_metric=logit_diff(src), sites_per_forward=1)
    assert torch.equal(got.scores, loop_grid(model, blocks, src, tgt, [-1], metric))
    with pytest.raises(PatchError, match="layers: 'transformer.h.9' matches no module"):
        patch_grid(model, src, tgt, isrc, itgt, ["transformer.h.9"], metric=metric)
    with pytest.raises(PatchError, match=r"positions: \[9\] reaches beyond a sequence of 3 real tokens"):
        patch_grid(model, src, src, isrc, isrc, blocks, metric=metric, positions=9)
