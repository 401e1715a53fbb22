"""Pictures of a text run: the figures carry the stored tokens and values of the sample asked for, signed values
on a colour scale symmetric about 0, attention over the document's real tokens only."""
import numpy as np
import pytest
from matplotlib import colormaps
from matplotlib.image import imread

from hookrun import plot
from hookrun.read.plots.colour import scale

MODEL = dict(n_layer=1, n_embd=16, n_head=4, vocab_size=512, n_positions=32)
DOCS = ["Pads never reach the store.", "A short one", "Language models read text token by token.", "x"]
ATTN = "+hooks.attn={kind:forward,layers:transformer.h.0.attn,capture:[output.1]}"


def lm_run(run_cfg, tmp_path, *extra, name="lm"):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(DOCS) + "\n")
    return run_cfg(["+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in MODEL.items()), f"data.text.files=[{corpus}]",
                    "data.text.max_length=32", "data.batch_size=3", "layers=[transformer.h.0]", ATTN, *extra],
                   name=f"{name}/captures")


@pytest.fixture
def lm(run_cfg, tmp_path):
    return lm_run(run_cfg, tmp_path)


def doc(cap, sample):
    tokens = cap.tokens()
    return tokens[tokens["sample"] == sample]


def test_text_colours_each_token_of_the_sample_by_the_unit(lm):
    acts = lm.load(layer="transformer.h.0", role="output")
    tokens = doc(lm, 2)
    fig = plot.text(lm, layer="transformer.h.0", sample=2, unit=3)
    texts = fig.axes[0].texts
    assert texts[0].get_text() == "sample 2" and [t.get_text() for t in texts[1:]] == tokens["token"].tolist()
    values = acts[tokens.index, 3]
    bound = np.abs(values).max()
    assert fig.axes[1].get_ylim() == pytest.approx((-bound, bound)) and values.min() < 0 < values.max()  # colour bar
    for text, value in zip(texts[1:], values):
        want = colormaps["RdBu_r"]((value + bound) / (2 * bound))
        np.testing.assert_allclose(text.get_bbox_patch().get_facecolor(), want, atol=1e-2)


def test_heatmap_of_a_per_token_array_is_the_samples_tokens(lm):
    acts = lm.load(layer="transformer.h.0", role="output")
    tokens = doc(lm, 3)  # not the first rows of the store
    fig = plot.heatmap(lm, layer="transformer.h.0", sample=3)
    ax = fig.axes[0]
    np.testing.assert_array_equal(ax.images[0].get_array(), acts[tokens.index])
    assert [t.get_text() for t in ax.get_yticklabels()] == [repr(t) for t in tokens["token"]]
    lo, hi = ax.images[0].get_clim()
    assert lo == -hi == -np.abs(acts[tokens.index]).max() and ax.images[0].get_cmap().name == "RdBu_r"
    fig = plot.heatmap(lm, layer="transformer.h.0", sample=[0, 1])  # two documents: a line at the boundary
    first = len(doc(lm, 0))
    assert [line.get_ydata()[0] for line in fig.axes[0].lines] == [first - 0.5]
    assert len(fig.axes[0].get_yticklabels()) == first + len(doc(lm, 1))


def test_attention_panels_are_the_documents_real_tokens_per_head(lm):
    att = lm.load(layer="transformer.h.0.attn", role="output.1")
    assert att.shape[1:] == (4, 32)
    tokens = doc(lm, 2)
    n = len(tokens)
    fig = plot.attention(lm, layer="transformer.h.0.attn", sample=2)
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["head 0", "head 1", "head 2", "head 3"]
    for h, ax in enumerate(panels):
        assert ax.images[0].get_array().shape == (n, n)  # no padding columns
        np.testing.assert_array_equal(ax.images[0].get_array(), att[tokens.index, h, :n])
        assert [t.get_text() for t in ax.get_xticklabels()] == [repr(t) for t in tokens["token"]]
    assert "sample 2" in fig._suptitle.get_text() and ax.images[0].get_cmap().name == "viridis"  # unsigned


def test_top_contexts_box_the_top_token_of_each_context(lm):
    top = lm.top(layer="transformer.h.0", role="output", unit=1, k=3)
    fig = plot.top_contexts(lm, layer="transformer.h.0", unit=1, k=3)
    boxed = [t for t in fig.axes[0].texts if t.get_bbox_patch() and t.get_bbox_patch().get_edgecolor()[3] > 0]
    assert [t.get_text() for t in boxed] == top["token"].tolist()
    labels = [t.get_text() for t in fig.axes[0].texts if t.get_bbox_patch() is None]
    assert labels == [f"{r.value:+.3g} s{r.sample}:{r.position}" for r in top.itertuples()]


@pytest.mark.slow
def test_cli_draws_the_sample_and_unit_asked_for(lm, capsys):
    run_dir = lm.path.parent
    assert plot.main([str(run_dir), "--sample", "2", "--unit", "5"]) == 0
    names = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert names == ["attn-transformer.h.0.attn-output.1-attention-sample2.png",
                     "resid-transformer.h.0-output-heatmap-sample2.png",
                     "resid-transformer.h.0-output-text-sample2-unit5.png", "resid-transformer.h.0-output-top-unit5.png",
                     "stats.png"]
    for name in names:
        assert imread(run_dir / "plots" / name)[..., :3].std() > 0.05, name
    assert plot.main([str(run_dir), "--sample", "4"]) == 2
    assert "sample 4 is out of range" in capsys.readouterr().err


def test_batch_stats_of_one_batch_has_one_tick(run_cfg, tmp_path):
    one = lm_run(run_cfg, tmp_path, "data.text.max_documents=2", name="one")
    for ax in plot.batch_stats(one).axes:
        assert list(ax.get_xticks()) == [0]  # not -0.04 .. 0.04


def test_colour_scale_is_diverging_for_signed_and_sequential_for_unsigned_data():
    assert scale([-1.0, 3.0]) == dict(cmap="RdBu_r", vmin=-3.0, vmax=3.0)
    assert scale([0.0, 0.5, np.nan]) == dict(cmap="viridis", vmin=0.0, vmax=0.5)
