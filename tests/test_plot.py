"""Pictures: the plotted values are the stored ones, and the PNGs are not blank."""
import numpy as np
import pytest
from matplotlib.image import imread

from hookrun import plot

N = 7


@pytest.fixture
def cnn(npy):
    x = np.random.default_rng(4).standard_normal((N, 3, 6, 6)).astype("float32")
    return ["+model._target_=tests.models.CNN", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=5",
            "+hooks.acts.kind=forward", "+hooks.acts.layers=[conv1,fc]"]


def test_feature_maps_heatmap_and_batch_stats_show_the_stored_values(run_cfg, cnn):
    cap = run_cfg(cnn)
    fmap = cap.load(layer="conv1", role="output")
    fig = plot.feature_maps(cap, layer="conv1", sample=6)  # sample 6 lies in the second batch
    assert len(fig.axes) == 4 + 1  # 2 x 2 grid of 4 channels, and the colour bar
    for c in range(4):
        np.testing.assert_array_equal(fig.axes[c].images[0].get_array(), fmap[6, c])
    bound = float(np.abs(fmap[6]).max())
    assert fig.axes[0].images[0].get_clim() == (-bound, bound)  # one colour scale, centred at 0 for signed values
    fig = plot.heatmap(cap, layer="fc")
    np.testing.assert_array_equal(fig.axes[0].images[0].get_array(), cap.load(layer="fc", role="output"))
    fig = plot.batch_stats(cap)
    for ax, stat in zip(fig.axes, plot.STATS):
        assert ax.get_title() == stat
        for line, (_, rows) in zip(ax.lines, cap.index.groupby(["hook", "layer", "role", "call"], sort=False)):
            assert np.round(line.get_xdata()).tolist() == [0, 1]  # each series a small offset within its batch
            np.testing.assert_array_equal(line.get_ydata(), rows[stat].to_numpy())
    with pytest.raises(ValueError, match=r"feature_maps draws \[N, C, H, W\] captures; acts/fc/output has per-sample shape \[5\]"):
        plot.feature_maps(cap, layer="fc")


def test_heatmap_of_one_sample_of_a_sequence_capture(run_cfg, npy):
    x = np.random.default_rng(5).standard_normal((4, 3, 6)).astype("float32")  # [N, T, D]
    cap = run_cfg(["+model._target_=tests.models.MLP", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=2",
                   "+hooks.a.kind=forward", "+hooks.a.layers=fc1"])
    fig = plot.heatmap(cap, layer="fc1", sample=3)
    np.testing.assert_array_equal(fig.axes[0].images[0].get_array(), cap.load(layer="fc1", role="output")[3])
    with pytest.raises(IndexError, match="sample 4 is out of range: a/fc1/output holds 4 samples"):
        plot.heatmap(cap, layer="fc1", sample=4)


def test_reused_module_is_drawn_per_call(run_cfg, npy):
    x = np.random.default_rng(0).standard_normal((4, 4)).astype("float32")
    cap = run_cfg(["+model._target_=tests.models.Reuse", f"+data.inputs.x={{file: '{npy('x', x)}'}}",
                   "+hooks.a.kind=forward", "+hooks.a.layers=shared"])
    with pytest.raises(KeyError, match="calls"):
        plot.heatmap(cap, layer="shared")
    fig = plot.heatmap(cap, layer="shared", call=1)
    np.testing.assert_array_equal(fig.axes[0].images[0].get_array(), cap.load(layer="shared", role="output", call=1))


def test_cli_writes_pngs_that_are_not_blank_and_compares_a_sweep(run_cfg, cnn, tmp_path, capsys):
    caps = [run_cfg([*cnn, f"seed={seed}"], name=f"sweep/{seed}/captures") for seed in (0, 1)]
    assert plot.main([str(caps[0].path.parent), "--sample", "6"]) == 0
    out = caps[0].path.parent / "plots"
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["acts-conv1-output.png", "acts-fc-output.png", "stats.png"]
    assert capsys.readouterr().out.split() == [str(out / n) for n in ("stats.png", "acts-conv1-output.png",
                                                                      "acts-fc-output.png")]
    for name in names:
        pixels = imread(out / name)
        assert pixels.ndim == 3 and pixels[..., :3].std() > 0.05, name  # not blank
    assert plot.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "cmp")]) == 0
    assert imread(tmp_path / "cmp" / "compare.png")[..., :3].std() > 0.05
    fig = plot.compare(tmp_path / "sweep", layer="conv1")
    for ax, stat in zip(fig.axes, plot.STATS):  # one bar per job: the statistic of the whole stored array
        want = [getattr(np, stat)(c.load(layer="conv1", role="output").astype(np.float64)) for c in caps]
        np.testing.assert_allclose([bar.get_height() for bar in ax.patches], want, rtol=1e-5)
    assert plot.main([str(tmp_path / "nothing")]) == 2
    assert "holds no hookrun stores" in capsys.readouterr().err


def test_file_names_do_not_repeat_the_hook_and_the_layer(run_cfg, cnn, tmp_path):
    cap = run_cfg([*cnn[:3], "+hooks.conv1={kind:forward,layers:[conv1]}", "+hooks.fmaps={kind:forward,layers:[fc]}"])
    assert plot.main([str(cap.path), "--out", str(tmp_path / "p")]) == 0
    assert sorted(p.name for p in (tmp_path / "p").glob("*.png")) == ["conv1-output.png", "fmaps-fc-output.png",
                                                                      "stats.png"]


def test_compare_on_a_layer_sweep_takes_each_jobs_own_layer(run_cfg, cnn, tmp_path):
    layers = {"0": "conv1", "1": "fc"}  # `-m layers=conv1,fc`: one hook, another layer each job
    caps = [run_cfg([*cnn[:3], f"+hooks.acts={{kind:forward,layers:[{layer}]}}"], name=f"sweep/{job}/captures")
            for job, layer in layers.items()]
    fig = plot.compare(tmp_path / "sweep", layer="conv1")
    assert "each job's own layer of hook acts" in fig._suptitle.get_text()
    labels = [t.get_text() for t in fig.axes[2].get_xticklabels()]
    assert labels == ["job 0\nacts/conv1/output", "job 1\nacts/fc/output"]
    for ax, stat in zip(fig.axes, plot.STATS):
        want = [getattr(np, stat)(c.load(layer=layer, role="output").astype(np.float64))
                for c, layer in zip(caps, layers.values())]
        np.testing.assert_allclose([bar.get_height() for bar in ax.patches], want, rtol=1e-5)
    fig = plot.compare(tmp_path / "sweep", layer="fc", role="output")
    assert len(fig.axes[0].patches) == 2 and "own layer" in fig._suptitle.get_text()
