"""The patching: block in real runs, against plain PyTorch written here (its own hooks and loops, one site patched
a forward, each prompt alone, no hookrun code) on a GPT-2 and a Llama built from configs."""
import os

import numpy as np
import pytest
import torch

import hookrun
from hookrun.experiments.lm import causal_lm, tokenizer
from tests.helpers import PAIRS, make_cfg, paired_data, write_pairs

GPT2 = {"n_layer": 3, "n_embd": 32, "n_head": 4}
LLAMA = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2}
NAMES = {"gpt2": ("transformer.h.{}", "transformer.h.{}.attn.c_proj"),
         "llama": ("model.layers.{}", "model.layers.{}.self_attn.o_proj")}
LD = "+metrics.ld={metric:logit_diff,a:{field:answer},b:' store'}"


def llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**config, attn_implementation="eager"))


def fail_at(logits, inputs, a=5, b=7):
    """A user metric (logit a - logit b at the last real token) that fails at sample 4 when asked to."""
    if os.environ.get("HOOKRUN_TEST_FAIL_AT") == str(inputs.sample_start):
        raise RuntimeError("failing on purpose")
    cols = inputs.info.first + inputs.info.lengths - 1
    rows = torch.arange(len(cols))
    return logits[rows, cols, a] - logits[rows, cols, b]


def model_overrides(kind):
    if kind == "gpt2":
        return ["+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in GPT2.items())]
    return ["+experiment=lm_tokens", "model._target_=tests.test_patching_run.llama",  # (GPT-2's keys: ignored)
            *(f"+model.{k}={v}" for k, v in LLAMA.items() if k != "vocab_size")]


def reference(kind):
    torch.manual_seed(0)
    return (causal_lm(**GPT2) if kind == "gpt2" else llama(**LLAMA)).eval()


@pytest.fixture
def pairs(tmp_path):
    return write_pairs(tmp_path / "pairs.jsonl")


def grid_run(path, kind, sites, *extra):
    return [*model_overrides(kind), *paired_data(path), "hooks.resid=null", LD,
            f"+patching={{source:clean,target:corrupt,sites:{sites},metric:ld}}", *extra]


def ids_of(text):
    tok = tokenizer()
    return torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]])


def plain_ld(logits, answer):
    tok = tokenizer()
    one = lambda s: tok(s, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    return float(logits[0, -1, one(answer)] - logits[0, -1, one(" store")])


def plain_grid(model, module_name, clean, corrupt, answer, n_layers, heads=None):
    """[layers, positions | heads]: the metric of `corrupt` with one site taken from `clean`, one forward a site.
    heads: None patches a block's output at one position; an int H patches head h's slice of the module's input."""
    mods = dict(model.named_modules())
    src, tgt = ids_of(clean), ids_of(corrupt)
    kept = {}
    handles = [mods[module_name.format(i)].register_forward_pre_hook(
        lambda m, a, i=i: kept.__setitem__(i, a[0].clone())) if heads else
        mods[module_name.format(i)].register_forward_hook(
            lambda m, a, o, i=i: kept.__setitem__(i, (o[0] if isinstance(o, tuple) else o).clone()))
        for i in range(n_layers)]
    with torch.no_grad():
        model(input_ids=src)
    for h in handles:
        h.remove()
    sites = range(heads) if heads else range(tgt.shape[1])
    out = np.zeros((n_layers, len(sites)))
    for layer in range(n_layers):
        for s in sites:
            def pre(m, a):
                x = a[0].clone()
                d = x.shape[-1] // heads
                x[..., s * d:(s + 1) * d] = kept[layer][..., s * d:(s + 1) * d]
                return (x, *a[1:])

            def post(m, a, o):
                first = (o[0] if isinstance(o, tuple) else o).clone()
                first[:, s] = kept[layer][:, s]
                return (first, *o[1:]) if isinstance(o, tuple) else first
            mod = mods[module_name.format(layer)]
            h = mod.register_forward_pre_hook(pre) if heads else mod.register_forward_hook(post)
            with torch.no_grad():
                out[layer, s] = plain_ld(model(input_ids=tgt).logits, answer)
            h.remove()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind,side", [("gpt2", "right"), ("llama", "left")])
def test_layers_by_positions_grid_equals_one_site_at_a_time(run_cfg, pairs, kind, side):
    block = NAMES[kind][0]
    layers = ",".join(block.format(i) for i in range(3))
    cap = run_cfg(grid_run(pairs, kind, f"{{layers:[{layers}],positions:all}}", f"data.text.padding_side={side}"))
    grid, model = cap.grid(), reference(kind)
    assert grid.layers == [block.format(i) for i in range(3)] and grid.axis == "position"
    longest = max(ids_of(c).shape[1] for c, _, _ in PAIRS)
    assert grid.scores.shape == (len(PAIRS), 3, longest) and grid.labels == list(range(longest))
    for i, (clean, corrupt, answer) in enumerate(PAIRS):
        want = plain_grid(model, block, clean, corrupt, answer, 3)
        n = want.shape[1]
        np.testing.assert_allclose(grid.scores[i, :, :n], want, atol=2e-4, rtol=1e-4)
        assert np.isnan(grid.scores[i, :, n:]).all()
        with torch.no_grad():
            assert grid.source[i] == pytest.approx(plain_ld(model(input_ids=ids_of(clean)).logits, answer), abs=2e-4)
            assert grid.target[i] == pytest.approx(plain_ld(model(input_ids=ids_of(corrupt)).logits, answer), abs=2e-4)
    assert cap.samples["ld.clean"].to_numpy() == pytest.approx(grid.source)
    frame = grid.to_frame()
    assert len(frame) == grid.scores.size and list(frame.columns) == ["sample", "layer", "position", "score",
                                                                      "normalised", "change"]
    row = frame[(frame["sample"] == 1) & (frame["layer"] == block.format(2)) & (frame["position"] == 3)].iloc[0]
    assert row["score"] == grid.scores[1, 2, 3]
    xr = grid.to_xarray()
    assert float(xr.sel(sample=1, layer=block.format(2), position=3)) == grid.scores[1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_heads_grid_equals_patching_each_heads_columns_by_hand(run_cfg, pairs, kind):
    proj = NAMES[kind][1]
    layers = ",".join(proj.format(i) for i in range(3))
    cap = run_cfg(grid_run(pairs, kind, f"{{layers:[{layers}],role:input,heads:all}}"))
    grid, model = cap.grid(), reference(kind)
    assert grid.axis == "head" and grid.labels == [0, 1, 2, 3] and grid.scores.shape == (len(PAIRS), 3, 4)
    for i, (clean, corrupt, answer) in enumerate(PAIRS):
        np.testing.assert_allclose(grid.scores[i], plain_grid(model, proj, clean, corrupt, answer, 3, heads=4),
                                   atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_pairs_of_other_lengths_are_refused_before_any_store(cli, tmp_path):
    path = write_pairs(tmp_path / "p.jsonl", [*PAIRS[:2], ("a store of captures", "a store of layers", " captures")])
    proc = cli(*grid_run(path, "gpt2", "{layers:[transformer.h.0],positions:all}"), f"hydra.run.dir={tmp_path}/r",
               check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert "patching.sites.positions: sample 2 has 5 tokens in 'clean' but 6 in 'corrupt'" in out
    assert "positions: last" in out and not list(tmp_path.rglob("zarr.json"))
    # positions: last maps last to last: other lengths are fine
    cap = hookrun.open(run_grid(tmp_path / "last.zarr", grid_run(path, "gpt2",
                                                                  "{layers:[transformer.h.0],positions:last}")))
    assert cap.grid().scores.shape == (3, 1, 1)


def run_grid(path, overrides):
    from hookrun.engine.runner import run

    return run(make_cfg([*overrides, f"store.path={path}"]))


@pytest.mark.slow
def test_a_grid_killed_mid_way_and_resumed_equals_the_whole_run(pairs, tmp_path, monkeypatch):
    from tests.helpers import same_store

    overrides = grid_run(pairs, "gpt2", "{layers:[transformer.h.0,transformer.h.2],positions:all}", "store.commit_s=0",
                         "+metrics.f={_target_:tests.test_patching_run.fail_at}", "patching.metric=f",
                         "+patching.sites_per_forward=4")
    run_grid(tmp_path / "whole.zarr", overrides)
    monkeypatch.setenv("HOOKRUN_TEST_FAIL_AT", "4")
    with pytest.raises(Exception, match="failing on purpose"):
        run_grid(tmp_path / "cut.zarr", overrides)
    assert hookrun.open(tmp_path / "cut.zarr").grid().scores.shape[0] == 4
    monkeypatch.delenv("HOOKRUN_TEST_FAIL_AT")
    run_grid(tmp_path / "cut.zarr", [*overrides, "store.mode=resume"])
    whole, cut = hookrun.open(tmp_path / "whole.zarr"), hookrun.open(tmp_path / "cut.zarr")
    same_store(whole, cut)
    np.testing.assert_array_equal(whole.grid().scores, cut.grid().scores)


def test_plot_draws_the_grid(run_cfg, pairs, tmp_path):
    cap = run_cfg(grid_run(pairs, "gpt2", "{layers:[transformer.h.0,transformer.h.1,transformer.h.2],positions:all}"))
    from hookrun import plot

    assert plot.main([str(cap.path), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "patching.png").stat().st_size > 0

    fig = plot.patching_grid(cap)
    fig.savefig(tmp_path / "grid.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"transformer.h.{i}" for i in range(3)]
    assert ax.images[0].get_cmap().name == "RdBu_r"
    vmin, vmax = ax.images[0].get_clim()
    assert vmin == -vmax


def test_batch_stats_legend_names_hookruns_own_arrays(run_cfg, pairs):
    from hookrun import plot

    cap = run_cfg(grid_run(pairs, "gpt2", "{layers:[transformer.h.0],positions:last}"))
    fig = plot.batch_stats(cap)
    legend = fig.axes[0].get_legend() or fig.legends[0]  # matplotlib hides labels starting with "_"
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels and all(label.split(": ")[0] in ("metrics", "patching") for label in labels)
    assert "patching: ld/scores" in labels
