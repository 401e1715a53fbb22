"""Models larger than one device, and half precision: device-mapped runs (CPU and disk offload through accelerate)
against the same model without a map, bitwise; bf16 / fp16 runs against a plain-PyTorch run of the same model.

The models are tiny GPT-2 and Llama configs with random weights, saved with save_pretrained into a temporary folder and
loaded the way a user loads a big one: transformers' from_pretrained(..., device_map=..., max_memory=...,
offload_folder=..., dtype=...). On this CPU-only machine every block runs on the CPU, loaded from memory or from disk
at its forward; GPU + CPU maps need a machine with a GPU.
"""
import numpy as np
import pytest
import torch

from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import causal_lm, tokenizer
from hookrun.format.layout import DTYPE_ATTR
from tests.helpers import make_cfg, same_store

DOCS = ["Hookrun stores every capture one row per real token.", "Pads never reach the store.", "A short one",
        "Language models read text token by token.", "x", "The index statistics cover real tokens only.",
        "big models", "half precision reads back"]
GPT2_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu", "transformer.h.0": "cpu",
            "transformer.h.1": "disk", "transformer.h.2": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}
FROM = "transformers.AutoModelForCausalLM.from_pretrained"
UNSET = ["~model.n_layer", "~model.n_embd", "~model.n_head", "~model.vocab_size", "~model.n_positions"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: folder} of a tiny GPT-2 and a tiny Llama saved with save_pretrained (float32, random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    causal_lm(n_layer=3, n_embd=32, n_head=4, vocab_size=512, n_positions=64).save_pretrained(root / "gpt2")
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager"))
    llama.save_pretrained(root / "llama")
    return {"gpt2": root / "gpt2", "llama": root / "llama"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


def pretrained(folder, *extra):
    """The model overrides of lm_tokens replaced by from_pretrained(folder, ...)."""
    return [f"model._target_={FROM}", *UNSET, f"+model.pretrained_model_name_or_path={folder}",
            "+model.attn_implementation=eager", *extra]


def mapped(kind, offload):
    """The device-map overrides: a dict putting block 1 on disk, or auto with max_memory forcing offload."""
    if kind is None:
        return []
    if kind == "dict":
        entries = ",".join(f"{k}:{v}" for k, v in GPT2_MAP.items())
        return [f"+model.device_map={{{entries}}}", f"+model.offload_folder={offload}"]
    return ["+model.device_map=auto", "+model.max_memory={cpu:150KB}", f"+model.offload_folder={offload}"]


def run(tmp_path, name, overrides):
    import hookrun
    from hookrun.engine.runner import run as run_cfg

    path = tmp_path / f"{name}.zarr"
    run_cfg(make_cfg([*overrides, f"store.path={path}"]))
    return hookrun.open(path)


def masked_logit_sum(output, batch):
    """A loss reaching every real token's logits (pads excluded): gradients flow back through every block."""
    mask = batch.kwargs["attention_mask"][..., None].to(output.logits.dtype)
    return (output.logits * mask * torch.linspace(-1, 1, output.logits.shape[-1], device=mask.device)).sum()


# -- device maps --------------------------------------------------------------------------------------------------
def capture_run(saved, corpus, kind, offload):
    return ["+experiment=lm_tokens", *pretrained(saved["gpt2"], *mapped(kind, offload)), f"data.text.files=[{corpus}]",
            "data.batch_size=4", "layers=[transformer.h.0,transformer.h.1,transformer.h.2]",
            "+hooks.g={kind:output_grad,layers:[transformer.wte,transformer.h.1]}",
            "+hooks.steer={kind:forward,layers:transformer.h.1,capture:[],edit:[{op:add,value:0.5,positions:last}]}",
            "+hooks.attn={kind:forward,layers:transformer.h.1.attn,capture:[output.1]}",
            "+loss._target_=tests.test_bigmodels.masked_logit_sum"]


@pytest.mark.parametrize("kind", ["dict", "auto"])
def test_offloaded_captures_edits_and_gradients_equal_the_unmapped_run(tmp_path, saved, corpus, kind, caplog):
    plain = run(tmp_path, "plain", capture_run(saved, corpus, None, None))
    with caplog.at_level("INFO", logger="hookrun"):
        offloaded = run(tmp_path, kind, capture_run(saved, corpus, kind, tmp_path / "offload"))
    placed = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model placed by its device map"))
    assert ("'transformer.h.1': 'disk'" if kind == "dict" else "'disk'") in placed  # blocks really run from disk
    assert placed.endswith("inputs go to cpu (device=cpu is not used)")  # make_cfg's device (tests run on the CPU)
    assert set(plain.index.array) == {f"{h}/{layer}/{r}" for h, layer, r in
                                      [("resid", "transformer.h.0", "output"), ("resid", "transformer.h.1", "output"),
                                       ("resid", "transformer.h.2", "output"), ("g", "transformer.wte", "grad"),
                                       ("g", "transformer.h.1", "grad"), ("attn", "transformer.h.1.attn", "output.1")]}
    same_store(plain, offloaded)  # captures, the edit's effect and the gradients, bitwise; the losses too
    assert np.abs(plain.load(hook="g", layer="transformer.wte", role="grad")).max() > 0
    assert offloaded.config["model"]["device_map"] == (GPT2_MAP if kind == "dict" else "auto")


@pytest.mark.slow
def test_offloaded_patching_grid_equals_the_unmapped_one(tmp_path, saved):
    def grid(kind):
        return ["+experiment=patching_grid", f"model._target_={FROM}", "~model.n_layer", "~model.n_embd",
                "~model.n_head", "~model.steps", "~model.batch", "~model.lr", "~model.seed",
                f"+model.pretrained_model_name_or_path={saved['gpt2']}", "+model.attn_implementation=eager",
                *mapped(kind, tmp_path / "offload"), "data.max_samples=8", "data.batch_size=8",
                "patching.sites_per_forward=6"]
    plain, offloaded = run(tmp_path, "plain", grid(None)), run(tmp_path, "dict", grid("dict"))
    a, b = plain.grid(), offloaded.grid()
    assert a.scores.shape == (8, 4, 8) and np.isfinite(a.scores).all()
    np.testing.assert_array_equal(a.scores, b.scores)
    np.testing.assert_array_equal(a.source, b.source)
    np.testing.assert_array_equal(a.target, b.target)
    same_store(plain, offloaded)


def test_offloaded_generation_equals_the_unmapped_one(tmp_path, saved, corpus):
    def gen(kind):
        return ["+experiment=lm_tokens", *pretrained(saved["gpt2"], *mapped(kind, tmp_path / "offload")),
                f"data.text.files=[{corpus}]", "data.batch_size=4", "layers=[transformer.h.1]",
                "generate.max_new_tokens=5"]
    plain, offloaded = run(tmp_path, "plain", gen(None)), run(tmp_path, "dict", gen("dict"))
    a, b = plain.generations(), offloaded.generations()
    assert len(a) == len(DOCS) and (a.new_tokens == 5).all()
    assert a[["completion", "stop_reason", "new_tokens"]].equals(b[["completion", "stop_reason", "new_tokens"]])
    assert [list(x) for x in a.completion_ids] == [list(x) for x in b.completion_ids]
    same_store(plain, offloaded)


@pytest.mark.parametrize("device_map, key", [("{transformer.h.1:'cuda:5'}", "model.device_map.transformer.h.1"),
                                             ("{lm_head:7}", "model.device_map.lm_head"),
                                             ("'cuda:3'", "model.device_map")])
def test_a_device_map_naming_a_missing_device_is_refused_before_loading(tmp_path, corpus, device_map, key):
    from hookrun.engine.runner import run as run_cfg

    missing = tmp_path / "no-such-model"  # never read: the map is refused before the model is built
    cfg = make_cfg(["+experiment=lm_tokens", *pretrained(missing), f"+model.device_map={device_map}",
                    f"data.text.files=[{corpus}]", f"store.path={tmp_path / 'x.zarr'}"])
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has the devices the map names")
    with pytest.raises(ConfigError) as err:
        run_cfg(cfg)
    problem = next(p for p in err.value.problems if p.startswith("model.device_map"))  # (and the missing folder)
    assert problem.startswith(f"{key}: ") and "CUDA" in problem and "name devices this machine has: cpu, disk" in problem
    assert not (tmp_path / "x.zarr").exists()


def test_param_grad_on_offloaded_parameters_is_refused(tmp_path, saved, corpus):
    from hookrun.engine.runner import run as run_cfg

    cfg = make_cfg(["+experiment=lm_tokens", *pretrained(saved["gpt2"], *mapped("dict", tmp_path / "off")),
                    f"data.text.files=[{corpus}]", "+hooks.w={kind:param_grad,layers:['transformer.h.1.mlp.c_fc.*']}",
                    "+loss._target_=tests.test_bigmodels.masked_logit_sum", f"store.path={tmp_path / 'x.zarr'}"])
    with pytest.raises(ConfigError) as err:
        run_cfg(cfg)
    assert err.value.problems == [
        "hooks.w.layers: transformer.h.1.mlp.c_fc.weight, transformer.h.1.mlp.c_fc.bias are offloaded by "
        "model.device_map (loaded onto a device only during their forward), so no gradient accumulates in them; hook "
        "parameters of layers the map keeps on a device, or give them more max_memory"]


# -- half precision -----------------------------------------------------------------------------------------------
def plain_half(folder, dtype, layers, batch_size=4):
    """The run's batches through from_pretrained(folder, dtype=dtype) with own forward hooks: each layer's output
    rows of real tokens, and the last real position's logits, per batch in order."""
    from transformers import AutoModelForCausalLM

    from hookrun.data.text import pad

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    tok = tokenizer()
    seqs = [[tok.bos_token_id] + tok(d, add_special_tokens=False)["input_ids"] for d in DOCS]
    rows, last = {name: [] for name in layers}, []
    for start in range(0, len(seqs), batch_size):
        ids, mask = pad(seqs[start:start + batch_size], tok.pad_token_id, "right")
        seen = {}
        handles = [model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: seen.__setitem__(n, (o[0] if isinstance(o, tuple) else o).detach())) for n in layers]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        for h in handles:
            h.remove()
        for n in layers:
            rows[n].append(seen[n][mask.bool()])
        last.append(logits[torch.arange(len(ids)), mask.sum(1) - 1])
    return {n: torch.cat(v) for n, v in rows.items()}, torch.cat(last)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_captures_equal_a_plain_run_of_the_same_model(tmp_path, saved, corpus, dtype, caplog):
    layers = ["model.layers.0", "model.layers.1"]
    with caplog.at_level("INFO", logger="hookrun"):
        cap = run(tmp_path, dtype, ["+experiment=lm_tokens", *pretrained(saved["llama"], f"+model.dtype={dtype}"),
                                    f"data.text.files=[{corpus}]", "data.batch_size=4", f"layers=[{','.join(layers)}]",
                                    "+metrics={lp:{metric:logprob,target:5,position:last},"
                                    "ld:{metric:logit_diff,a:5,b:9,position:last}}"])
    want, logits = plain_half(saved["llama"], getattr(torch, dtype), layers)
    for layer in layers:
        ref = want[layer]
        assert ref.dtype == getattr(torch, dtype)
        key = f"resid/{layer}/output"
        stored = cap.array(key)[:]  # the bits as stored: bf16 as uint16, fp16 as float16
        bits = ref.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else ref.numpy()
        np.testing.assert_array_equal(stored, bits)
        assert (cap.array(key).attrs.get(DTYPE_ATTR), str(cap.array(key).dtype)) == \
            (("bfloat16", "uint16") if dtype == "bfloat16" else (None, "float16"))
        loaded = cap.load(hook="resid", layer=layer, role="output")
        assert loaded.dtype == (np.float32 if dtype == "bfloat16" else np.float16)  # numpy has no bfloat16: float32
        np.testing.assert_array_equal(loaded, ref.float().numpy())  # exactly the captured values
        exact = cap.load(hook="resid", layer=layer, role="output", dtype=dtype if dtype == "bfloat16" else torch.float16)
        assert isinstance(exact, torch.Tensor) and exact.dtype == getattr(torch, dtype)
        assert torch.equal(exact, ref)
        rows = cap.rows(hook="resid", layer=layer)
        assert set(rows.dtype) == {dtype}
        np.testing.assert_allclose(rows["mean"].to_numpy() @ rows["numel"].to_numpy() / rows["numel"].sum(),
                                   ref.double().mean().item(), rtol=1e-6)  # statistics in float32 of the values
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("captures:"))
    assert table.count(f" {dtype} ") == 2 and "uint16" not in table
    x = logits.float()  # metrics: float32 from the half-precision logits
    samples = cap.samples
    np.testing.assert_allclose(samples["lp"], torch.log_softmax(x, -1)[:, 5].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(samples["ld"], (x[:, 5] - x[:, 9]).numpy())
    assert samples["lp"].dtype == np.float32


def test_store_dtype_still_casts_half_precision_captures(tmp_path, saved, corpus):
    cap = run(tmp_path, "cast", ["+experiment=lm_tokens", *pretrained(saved["llama"], "+model.dtype=bfloat16"),
                                 f"data.text.files=[{corpus}]", "data.batch_size=4", "layers=[model.layers.0]",
                                 "+hooks.resid.dtype=float32"])
    want, _ = plain_half(saved["llama"], torch.bfloat16, ["model.layers.0"])
    loaded = cap.load(hook="resid", layer="model.layers.0", role="output")
    assert cap.array("resid/model.layers.0/output").dtype == np.float32
    np.testing.assert_array_equal(loaded, want["model.layers.0"].float().numpy())
    assert set(cap.rows(hook="resid").dtype) == {"float32"}


def test_every_reader_gives_the_bf16_values(tmp_path, saved, corpus):
    layer = "model.layers.1"
    cap = run(tmp_path, "bf16", ["+experiment=lm_tokens", *pretrained(saved["llama"], "+model.dtype=bfloat16"),
                                 f"data.text.files=[{corpus}]", "data.batch_size=4", f"layers=[{layer}]"])
    want = plain_half(saved["llama"], torch.bfloat16, [layer])[0][layer]
    exact = want.float().numpy()
    ds = cap.to_xarray(hook="resid", layer=layer)
    assert ds["output"].dtype == np.float32
    np.testing.assert_array_equal(ds["output"].values, exact)  # not the uint16 bits zarr holds
    batches = list(cap.loader(layer=layer, hook="resid", batch_size=1000, shuffle=False, dtype=torch.bfloat16))
    assert torch.equal(torch.cat(batches), want)
    np.testing.assert_array_equal(np.load(cap.export_npy(tmp_path / "x.npy", layer=layer, hook="resid")), exact)
    spans = cap.samples[["token_start", "token_stop"]].to_numpy()
    pooled = np.stack([exact[a:b].mean(0) for a, b in spans])
    np.testing.assert_allclose(cap.pool(layer=layer, hook="resid"), pooled, rtol=1e-6, atol=1e-7)
    top = cap.top(layer=layer, hook="resid", unit=3, k=4)
    np.testing.assert_array_equal(top["value"].to_numpy(), np.sort(exact[:, 3])[::-1][:4])


def test_inputs_go_where_the_embedding_runs():
    """The rule for GPU maps, checked without a GPU: an offloaded embedding runs on the map's first device."""
    from hookrun.engine.placement import input_device

    model = causal_lm(n_layer=2, n_embd=16, n_head=2)
    model.hf_device_map = {"transformer.wte": 1, "transformer.wpe": 0, "transformer.h": 0, "lm_head": "cpu"}
    assert input_device(model) == torch.device("cuda:1")
    model.hf_device_map = {"transformer.wte": "cpu", "transformer.wpe": "disk", "transformer.h": "cuda:1", "lm_head": 0}
    assert input_device(model) == torch.device("cuda:1")  # accelerate's main device: the first one not offloaded
    model.hf_device_map = {"": "disk"}
    assert input_device(model) == torch.device("cpu")
