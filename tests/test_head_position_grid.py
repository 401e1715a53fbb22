"""Per-position head grids (sites.per_position: layers x heads x positions) against plain PyTorch written here.

Exact: each (layer, head, position) patched alone by a loop with a plain forward_pre hook on the attention output
projection, on a GPT-2 built from a transformers config and on the bundled induction model (standard site
blocks.N.attn.heads). Attribution: AtP by hand (plain hooks, torch.autograd.grad) per (layer, head, position), and
its sum over positions equal to the layers x heads grid. Then a run holding both blocks, read back and plotted, and
the refusals."""
import numpy as np
import pytest
import torch

from hookrun.capture.tokens import TokenInfo
from hookrun.config.checks import ConfigError
from hookrun.experiments import induction
from hookrun.methods.attribution import AttributionError, attribution_grid
from hookrun.methods.patching import PatchError, patch_grid
from tests.helpers import PAIRS, paired_data, write_pairs
from tests.test_patching import capture, first_col, gpt2, logit_diff, pairs

HEADS = "blocks.*.attn.heads"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def gpt2_case(side):
    """(model, output projections, source, its TokenInfo, target, its TokenInfo, metric, heads, d_head)."""
    (src, isrc), (tgt, itgt) = pairs(side)
    return gpt2(), [f"transformer.h.{i}.attn.c_proj" for i in range(3)], src, isrc, tgt, itgt, logit_diff(tgt), 4, 8


def induction_case(n=3):
    """The bundled induction model, n of its clean (BOS + A + A) / corrupt (BOS + B + A) pairs, the repeated-half
    loss as the metric."""
    data = induction.repeated(n=n, half=16, vocab_size=64, seed=1)
    clean, corrupt = (torch.stack([d[k] for d in data]) for k in ("clean", "corrupt"))
    mask = torch.ones_like(clean)
    info = TokenInfo.of_batch(mask.bool(), mask.bool(), 33)
    repeat = torch.as_tensor(induction.halves(33)["repeat"])

    def loss(logits, rows):
        return induction.token_losses(logits, corrupt[rows])[:, repeat].mean(1)
    model = induction.model()
    return (model, [f"blocks.{i}.attn.out" for i in range(2)], {"input_ids": clean, "attention_mask": mask}, info,
            {"input_ids": corrupt, "attention_mask": mask}, info, loss, 4, 16)


def loop_grid(model, projs, src, tgt, metric, heads, d_head, positions):
    """[B, layers, heads, P]: one forward per (layer, head, real position), that head's columns of the projection's
    input at that position replaced by the source's, by a plain forward_pre hook; NaN past a sample's end."""
    source = capture(model, projs, src, pre=True)
    lengths = tgt["attention_mask"].sum(1)
    out = torch.full((len(lengths), len(projs), heads, len(positions)), float("nan"))
    mods = dict(model.named_modules())
    for li, name in enumerate(projs):
        for h in range(heads):
            cols = slice(h * d_head, (h + 1) * d_head)
            for j, p in enumerate(positions):
                rel = torch.tensor([p if p >= 0 else int(n) + p for n in lengths])
                rows = (rel < lengths).nonzero().squeeze(1)
                tcol, scol = first_col(tgt)[rows] + rel[rows], first_col(src)[rows] + rel[rows]

                def put(mod, args, rows=rows, tcol=tcol, scol=scol, name=name, cols=cols):
                    x = args[0].clone()
                    x[rows, tcol, cols] = source[name][rows, scol, cols]
                    return (x, *args[1:])
                handle = mods[name].register_forward_pre_hook(put)
                with torch.no_grad():
                    values = metric(logits_of(model(**tgt)), torch.arange(len(lengths)))
                handle.remove()
                out[rows, li, h, j] = values[rows]
    return out


def hand_atp(model, projs, src, tgt, metric, heads, d_head):
    """[B, layers, heads, T] by hand: the gradient of the metric's sum w.r.t. each projection's input in the target
    run (torch.autograd.grad), times (source - target) at the same column, summed over the head's d_head columns."""
    source = capture(model, projs, src, pre=True)
    mods, kept = dict(model.named_modules()), {}
    handles = [mods[n].register_forward_pre_hook(lambda m, a, n=n: kept.__setitem__(n, a[0])) for n in projs]
    values = metric(logits_of(model(**tgt)), torch.arange(len(tgt["input_ids"])))
    grads = torch.autograd.grad(values.sum(), [kept[n] for n in projs])
    for h in handles:
        h.remove()
    out = []
    for name, g in zip(projs, grads):
        prod = (g * (source[name] - kept[name].detach())).detach()  # [B, T, H * Dh]
        out.append(prod.reshape(*prod.shape[:2], heads, d_head).sum(-1).transpose(1, 2))  # [B, H, T]
    return torch.stack(out, 1)


def real(t, tgt):
    """[B, ..., T] columns -> [B, ..., P] real positions (right padding: real position p is column p)."""
    return t[..., :int(tgt["attention_mask"].sum(1).max())]


@pytest.mark.parametrize("case", ["gpt2-right", "gpt2-left", "induction"])
def test_exact_grid_equals_one_head_at_one_position_a_forward(case):
    model, projs, src, isrc, tgt, itgt, metric, heads, d_head = \
        induction_case() if case == "induction" else gpt2_case(case.split("-")[1])
    width = int(itgt.lengths.max())
    got = patch_grid(model, src, tgt, isrc, itgt, [HEADS], heads="all", per_position=True, metric=metric,
                     sites_per_forward=1)
    want = loop_grid(model, projs, src, tgt, metric, heads, d_head, list(range(width)))
    assert got.scores.shape == (len(itgt.lengths), len(projs), heads, width)
    assert got.axis == "head" and got.labels == list(range(heads)) and got.positions == list(range(width))
    torch.testing.assert_close(got.scores, want, atol=1e-5 if case == "induction" else 0, rtol=0, equal_nan=True)
    assert torch.isnan(got.scores).sum() == torch.isnan(want).sum() == \
        len(projs) * heads * int((width - itgt.lengths).sum())  # NaN exactly past each sample's end
    stacked = patch_grid(model, src, tgt, isrc, itgt, [HEADS], heads=[3, 1], per_position=True, positions=[0, -1],
                         metric=metric, sites_per_forward="auto")  # several sites a forward, a subset of both axes
    assert stacked.forwards < stacked.scores[0].numel() and stacked.positions == [0, -1]
    torch.testing.assert_close(stacked.scores, loop_grid(model, projs, src, tgt, metric, heads, d_head, [0, -1])[
        :, :, [3, 1]], atol=1e-5, rtol=0)
    if case == "induction":  # the later head patched at the repeated half restores more than at the first half
        with torch.no_grad():
            restored = want - metric(logits_of(model(**tgt)), torch.arange(3))[:, None, None, None]
        assert restored[:, 1, :, 17:].mean() < restored[:, 1, :, 1:16].mean()


@pytest.mark.parametrize("case", ["gpt2-right", "gpt2-left", "induction"])
def test_attribution_per_position_equals_atp_by_hand_and_sums_to_the_heads_grid(case):
    model, projs, src, isrc, tgt, itgt, metric, heads, d_head = \
        induction_case() if case == "induction" else gpt2_case(case.split("-")[1])
    est = attribution_grid(model, src, tgt, isrc, itgt, [HEADS], heads="all", per_position=True, metric=metric)
    hand = hand_atp(model, projs, src, tgt, metric, heads, d_head)  # [B, L, H, T] by column
    lengths, first = itgt.lengths, first_col(tgt)
    width = int(lengths.max())
    want = torch.full((len(lengths), len(projs), heads, width), float("nan"))
    for b in range(len(lengths)):
        n = int(lengths[b])
        want[b, ..., :n] = hand[b, ..., int(first[b]):int(first[b]) + n]
    assert est.positions == list(range(width)) and est.labels == list(range(heads))
    torch.testing.assert_close(est.estimate, want, atol=2e-6, rtol=1e-5, equal_nan=True)
    heads_grid = attribution_grid(model, src, tgt, isrc, itgt, [HEADS], heads="all", metric=metric)
    torch.testing.assert_close(est.estimate.nansum(-1), heads_grid.estimate, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(est.scores, est.corrupt[:, None, None, None] + est.estimate, equal_nan=True)


def test_python_refusals_name_the_argument():
    model, projs, src, isrc, tgt, itgt, metric, _, _ = gpt2_case("right")
    with pytest.raises(PatchError, match="per_position: true splits a heads grid by position"):
        patch_grid(model, src, tgt, isrc, itgt, ["blocks.*"], per_position=True, metric=metric)
    with pytest.raises(PatchError, match="blocks.0 is not split into heads"):  # the shared heads check
        patch_grid(model, src, tgt, isrc, itgt, ["blocks.0"], heads="all", per_position=True, metric=metric)
    with pytest.raises(AttributionError, match="attribution.sites.per_position: true splits a heads grid"):
        attribution_grid(model, src, tgt, isrc, itgt, ["blocks.0.mlp.hidden"], neurons="all", per_position=True,
                         metric=metric)


# -- a run: both blocks in one store, read back, plotted, refused ---------------------------------------------------
GPT2 = {"n_layer": 3, "n_embd": 32, "n_head": 4}
LD = "+metrics.ld={metric:logit_diff,a:{field:answer},b:' store'}"
SITES = "{layers:['blocks.*.attn.heads'],heads:all,per_position:true}"
SAME_LENGTH = [("the store writes a model", "the store writes a hook", " model"),
               ("every layer writes an array", "every layer writes a model", " array"),
               ("the hooks run on a model", "the hooks run on a store", " model")]  # 7 tokens, 7, 8: NaN past 7


def overrides(path, *extra):
    return ["+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in GPT2.items()), *paired_data(path),
            "hooks.resid=null", LD, *extra]


def both(sites=SITES, verify=4):
    return (f"+patching={{source:clean,target:corrupt,sites:{sites},metric:ld}}",
            f"+attribution={{source:clean,target:corrupt,sites:{sites},metric:ld,verify:{verify}}}")


def pair_batch(clean, corrupt):
    """One pair's kwargs and TokenInfo as the run tokenizes it (BOS + the text)."""
    from hookrun.experiments.lm import tokenizer

    tok = tokenizer()
    out = []
    for text in (clean, corrupt):
        ids = torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]])
        mask = torch.ones_like(ids)
        out.append(({"input_ids": ids, "attention_mask": mask}, TokenInfo.of_batch(mask.bool(), mask.bool(), 64)))
    return out


@pytest.mark.slow
def test_a_run_stores_both_grids_and_reads_them_back(run_cfg, tmp_path):
    from tests.test_attribution import one, reference

    pairs_file = write_pairs(tmp_path / "pairs.jsonl", SAME_LENGTH)
    cap = run_cfg(overrides(pairs_file, *both()))
    grid, est = cap.grid(), cap.read("attribution")
    model, projs = reference(), [f"transformer.h.{i}.attn.c_proj" for i in range(3)]
    assert grid.scores.shape == est.scores.shape == (3, 3, 4, 8)  # 3 samples x 3 layers x 4 heads x 8 positions
    assert grid.layers == [f"blocks.{i}.attn.heads" for i in range(3)] and grid.positions == list(range(8))
    assert (grid.axis, grid.labels, est.method) == ("head", [0, 1, 2, 3], "gradient")
    for i, (clean, corrupt, answer) in enumerate(SAME_LENGTH):  # each pair alone, by hand
        (src, _), (tgt, _) = pair_batch(clean, corrupt)

        def ld(logits, rows):
            return logits[rows, -1, one(answer)] - logits[rows, -1, one(" store")]
        n = src["input_ids"].shape[1]
        want = loop_grid(model, projs, src, tgt, ld, 4, 8, list(range(n)))[0]
        np.testing.assert_allclose(grid.scores[i, ..., :n], want.numpy(), atol=2e-5, rtol=0)
        assert np.isnan(grid.scores[i, ..., n:]).all() and np.isnan(est.scores[i, ..., n:]).all()
        np.testing.assert_allclose(est.change()[i, ..., :n], hand_atp(model, projs, src, tgt, ld, 4, 8)[0].numpy(),
                                   atol=2e-5, rtol=1e-4)
        done = np.isfinite(est.exact[i])  # the verified cells: the exact grid's value there
        np.testing.assert_allclose(est.exact[i][done], grid.scores[i][done], atol=2e-5, rtol=0)
    assert np.isfinite(est.exact).any(axis=0).sum() >= 4  # 4 cells a batch, 2 batches
    verified = est.verified()
    assert list(verified.columns) == ["layer", "head", "position", "samples", "estimate", "exact", "error"]
    frame = grid.to_frame()
    assert list(frame.columns[:4]) == ["sample", "layer", "head", "position"] and len(frame) == grid.scores.size
    row = frame[(frame["sample"] == 1) & (frame["layer"] == "blocks.2.attn.heads") & (frame["head"] == 3)
                & (frame["position"] == 5)]
    assert float(row["score"].iloc[0]) == grid.scores[1, 2, 3, 5]
    xr = grid.to_xarray()
    assert xr.dims == ("sample", "layer", "head", "position")
    assert float(xr.sel(sample=2, layer="blocks.1.attn.heads", head=0, position=7)) == grid.scores[2, 1, 0, 7]
    top = grid.top(3)
    assert list(top.columns) == ["layer", "head", "position", "change", "normalised"]
    mean = np.nanmean(grid.change(), 0)
    assert abs(top["change"].iloc[0]) == pytest.approx(np.nanmax(np.abs(mean)))
    assert "3 layers x 4 heads x 8 positions" in repr(grid) and "positions: 0, 1, 2, 3" in repr(grid)
    assert grid.change().shape == grid.normalised().shape == (3, 3, 4, 8)
    assert np.isfinite(est.corr(grid)) and est.corr(grid, mean=True) > 0.5
    with pytest.raises(ValueError, match="the grids' sites differ"):  # a 2-axis grid is another grid
        est.corr(run_cfg(overrides(pairs_file, both("{layers:['blocks.*.attn.heads'],heads:all}")[0]), "heads").grid())


@pytest.mark.slow
def test_plot_draws_a_panel_a_layer_with_token_labels(run_cfg, tmp_path):
    from hookrun import plot

    pairs_file = write_pairs(tmp_path / "pairs.jsonl", SAME_LENGTH[:2])  # one length: the tokens label positions
    cap = run_cfg(overrides(pairs_file, *both()))
    assert plot.main([str(cap.path), "--out", str(tmp_path / "plots")]) == 0
    for name, method in (("patching.png", "patching"), ("attribution.png", "attribution")):
        assert (tmp_path / "plots" / name).stat().st_size > 0
        fig = plot.patching_grid(cap, method=method)
        panels = [ax for ax in fig.axes if ax.images]
        assert [ax.get_title(loc="left") for ax in panels] == [f"blocks.{i}.attn.heads" for i in range(3)]
        for ax in panels:
            assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2", "3"]
            assert ax.get_ylabel() == "head"
            assert ax.images[0].get_array().shape == (4, 7)
            lo, hi = ax.images[0].get_clim()
            assert lo == -hi and (lo, hi) == panels[0].images[0].get_clim()  # one scale for every panel
        ticks = [t.get_text() for t in panels[-1].get_xticklabels()]
        assert ticks[0].startswith("0 ") and ticks[3] == "3 ' store'" and panels[-1].get_xlabel() == "position"
        mean = np.nanmean(cap.read(method).change(), 0)
        np.testing.assert_allclose(panels[1].images[0].get_array(), mean[1], rtol=1e-6)
        assert "outlined" in fig.get_suptitle() if method == "attribution" else "patching" in fig.get_suptitle()


@pytest.mark.slow
def test_bad_per_position_blocks_are_refused_before_any_store(tmp_path, cli):
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg

    pairs_file = write_pairs(tmp_path / "pairs.jsonl", PAIRS)

    def refused(*blocks):
        path = tmp_path / "bad.zarr"
        with pytest.raises(ConfigError) as err:
            run(make_cfg([*overrides(pairs_file, *blocks), f"store.path={path}"]))
        assert not path.exists()
        return "\n".join(err.value.problems)

    out = refused(*both("{layers:['blocks.*'],per_position:true}"))
    assert "patching.sites.per_position: true splits a heads grid by position" in out
    assert "attribution.sites.per_position: true splits a heads grid by position" in out
    out = refused(both("{layers:['blocks.*'],heads:all,per_position:true}")[0])  # the shared heads check
    assert "patching.sites.heads: blocks.0 is not split into heads" in out
    out = refused(both("{layers:[transformer.h.0.mlp.act],neurons:all,per_position:true}")[1])
    assert "attribution.sites.per_position: true splits a heads grid" in out
    out = refused(both("{layers:['blocks.*.attn.heads'],heads:all,per_position:yes}")[0])
    assert "patching.sites.per_position: 'yes' is not true or false" in out
    out = refused(both(SITES, verify=97)[1])
    assert "attribution.verify: 97 but the grid has 96 sites (3 layers x 4 heads x 8 positions); give at most 96" \
        in out
    proc = cli(*overrides(pairs_file, both("{layers:['blocks.*'],per_position:true}")[0]),
               f"hydra.run.dir={tmp_path}/cli", check=False)
    assert proc.returncode == 2 and "patching.sites.per_position: true" in proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("zarr.json"))
