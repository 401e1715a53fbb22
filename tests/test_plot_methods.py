"""Pictures of the methods: a head ablation drawn as the change from the unablated run (values from plain PyTorch
hooks written here), generate runs and a steering sweep drawn (completions as a table, words per coefficient), and
the short reprs of a grid and a run; no warning anywhere (warnings are errors in these tests)."""
import json
import warnings

import numpy as np
import pytest
import torch
from matplotlib.image import imread

import hookrun
from hookrun import plot
from hookrun.experiments.lm import causal_lm, tokenizer
from tests.helpers import run_here

PAIRS = [("the hooks run on a model", " model"), ("a store of captures", " captures"),
         ("every layer writes an array", " array"), ("tokens of the model", " model"), ("the model writes", " the")]
GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=512, n_positions=64)
BOOST = (1, 2)  # (layer, head): its c_proj rows scaled up, so that zeroing it moves the metric most
PROJ = "transformer.h.{}.attn.c_proj"


def boosted_lm(**_):
    """The tiny GPT-2 with every head but head 2 of block 1 writing 50x quieter into the residual stream."""
    model = causal_lm(**GPT2)
    d = GPT2["n_embd"] // GPT2["n_head"]
    with torch.no_grad():
        for layer, block in enumerate(model.transformer.h):
            for head in range(GPT2["n_head"]):
                if (layer, head) != BOOST:
                    block.attn.c_proj.weight[head * d:(head + 1) * d] *= 0.02
    return model


@pytest.fixture(autouse=True)
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # third-party imports
        yield


def ablation(tmp_path, batch_size=5):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"clean": c, "corrupt": c, "answer": a}) + "\n" for c, a in PAIRS))
    run_dir = tmp_path / "ablate"
    run_here(run_dir, "+experiment=lm_tokens", "model._target_=tests.test_plot_methods.boosted_lm",
             f"data.text.files=[{pairs}]", "data.text.fields={clean:clean,corrupt:corrupt}",
             f"data.batch_size={batch_size}", "hooks.resid=null", "+metrics.ld={metric:logit_diff,a:{field:answer},"
             "b:' store'}", f"+patching={{source:clean,target:clean,donor:zero,metric:ld,sites:{{layers:["
             f"{PROJ.format(0)},{PROJ.format(1)}],role:input,heads:all}}}}")
    return hookrun.open(run_dir)


def plain_ablation():
    """[samples, layers, heads] ld with one head's columns of c_proj's input zeroed, and [samples] unablated."""
    torch.manual_seed(0)
    model, tok = boosted_lm().eval(), tokenizer()
    store = tok(" store", add_special_tokens=False)["input_ids"][0]
    d = GPT2["n_embd"] // GPT2["n_head"]
    out, base = np.zeros((len(PAIRS), 2, 4)), np.zeros(len(PAIRS))

    def ld(ids, answer):
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1]
        return float(logits[answer] - logits[store])

    for s, (text, answer) in enumerate(PAIRS):
        ids = torch.tensor([[tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]])
        a = tok(answer, add_special_tokens=False)["input_ids"][0]
        base[s] = ld(ids, a)
        for layer in range(2):
            for head in range(4):
                def zero(m, args, head=head):
                    x = args[0].clone()
                    x[..., head * d:(head + 1) * d] = 0
                    return (x,)
                handle = model.get_submodule(PROJ.format(layer)).register_forward_pre_hook(zero)
                out[s, layer, head] = ld(ids, a)
                handle.remove()
    return out, base


def test_a_head_ablation_is_drawn_as_the_change_from_the_unablated_run(tmp_path):
    cap = ablation(tmp_path)
    grid = cap.grid()
    scores, base = plain_ablation()
    np.testing.assert_allclose(grid.scores, scores, atol=1e-4)
    np.testing.assert_allclose(grid.target, base, atol=1e-4)
    change = (scores - base[:, None, None]).mean(0)
    np.testing.assert_allclose(grid.change().mean(0), change, atol=1e-4)
    assert grid.ablation and np.isnan(grid.normalised()).all()  # 0 / 0: NaN, and no divide warning
    frame = grid.to_frame()
    assert frame["normalised"].isna().all() and np.allclose(frame["change"], frame["score"] - np.repeat(base, 8),
                                                             atol=1e-4)

    fig = plot.patching_grid(cap)
    ax = fig.axes[0]
    np.testing.assert_allclose(ax.images[0].get_array(), change, atol=1e-4)
    bound = np.abs(change).max()
    assert ax.images[0].get_clim() == pytest.approx((-bound, bound), abs=1e-4)  # diverging, centred at 0
    assert abs(change[BOOST]) == pytest.approx(bound, abs=1e-4)  # the head that matters is the darkest cell ...
    others = np.delete(np.abs(change).ravel(), BOOST[0] * 4 + BOOST[1])
    assert others.max() < 0.2 * bound  # ... and the only dark one
    assert f"unablated ld = {base.mean():.3f}" in ax.get_title()
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    assert cells[BOOST] == f"{change[BOOST]:+.2f}"
    with pytest.raises(ValueError, match="is an ablation .* draw value='change'"):
        plot.patching_grid(cap, value="normalised")

    text = repr(grid)
    assert len(text.splitlines()) <= 12 and "[[" not in text  # a summary, not arrays
    assert f"unablated ld: mean {base.mean():.4g}" in text
    top = grid.top(1).iloc[0]
    assert (top["layer"], top["head"]) == (PROJ.format(BOOST[0]), BOOST[1])
    assert f"{PROJ.format(BOOST[0])} head {BOOST[1]}: {change[BOOST]:+.4g}" in text.splitlines()[5]
    assert "<table" in grid._repr_html_() and f"{change[BOOST]:+.4g}" in grid._repr_html_()


def test_one_batch_statistics_show_every_series_and_files_are_named_once(tmp_path, capsys):
    cap = ablation(tmp_path)  # one batch of 5; source, target and the metric are the same numbers
    fig = plot.batch_stats(cap)
    series = cap.index.groupby(["hook", "layer", "role", "call"], sort=False)
    for ax, stat in zip(fig.axes, plot.STATS):
        xs = [line.get_xdata()[0] for line in ax.lines]
        assert len(ax.lines) == len(series) == 4 and len(set(xs)) == 4 and max(map(abs, xs)) < 0.5  # offsets
        assert len({line.get_marker() for line in ax.lines}) == 4  # and a marker each
        for line, (_, rows) in zip(ax.lines, series):
            np.testing.assert_array_equal(line.get_ydata(), rows[stat].to_numpy())
        assert list(ax.get_xticks()) == [0]
    assert plot.main([str(cap.path.parent)]) == 0
    assert sorted(p.name for p in (cap.path.parent / "plots").glob("*.png")) == ["patching.png", "stats.png"]
    assert "RuntimeWarning" not in capsys.readouterr().err


PROMPTS = ["the hooks run on a", "a store of", "every layer writes"]
NEW = 4


def plain_greedy(model, tok, text):
    ids = torch.tensor([[tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]])
    for _ in range(NEW):
        with torch.no_grad():
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    return tok.decode(ids[0, -NEW:].tolist(), skip_special_tokens=True)


def generate_run(run_dir, corpus, coef):
    steer = ("+hooks.steer={kind:forward,layers:[transformer.h.0],capture:[],"
             f"edit:[{{op:add,value:[{','.join(['0.5', '-0.5'] * 16)}],coef:{coef},positions:all}}]}}")
    run_here(run_dir, "+experiment=lm_tokens", "model._target_=tests.test_plot_methods.gpt2_lm", *UNSET,
             f"data.text.files=[{corpus}]", "data.text.bos=true", "data.batch_size=3", "hooks.resid=null",
             f"generate.max_new_tokens={NEW}", steer)
    return hookrun.open(run_dir)


def gpt2_lm():
    return causal_lm(**GPT2)


UNSET = ["~model.n_layer", "~model.n_embd", "~model.n_head", "~model.vocab_size", "~model.n_positions"]


@pytest.mark.slow
def test_generate_runs_and_a_steering_sweep_are_drawn(tmp_path, capsys):
    corpus = tmp_path / "prompts.txt"
    corpus.write_text("\n".join(PROMPTS) + "\n")
    caps = {coef: generate_run(tmp_path / "sweep" / str(i), corpus, coef) for i, coef in enumerate((0, 6, 12))}
    cap = caps[0]
    assert not len(cap.index)  # edit-only: it stored completions and no array
    torch.manual_seed(0)
    model, tok = gpt2_lm().eval(), tokenizer()
    want = [plain_greedy(model, tok, p).strip() for p in PROMPTS]  # coef 0 adds nothing

    fig = plot.completions(cap)
    cells = fig.axes[0].tables[0].get_celld()
    assert [cells[0, c].get_text().get_text() for c in range(5)] == ["sample", "prompt", "completion",
                                                                     "stop reason", "new tokens"]
    cell = lambda r, c: cells[r + 1, c].get_text().get_text().replace("\n", " ")  # noqa: E731 - wrapped lines
    assert [cell(r, 2) for r in range(3)] == want
    assert [cell(r, 1) for r in range(3)] == [f"<|endoftext|>{p}" for p in PROMPTS]
    assert [cells[r + 1, 3].get_text().get_text() for r in range(3)] == ["length"] * 3
    assert plot.main([str(tmp_path / "sweep" / "0")]) == 0  # not "no index rows for hook=None ..."
    assert [p.name for p in (tmp_path / "sweep" / "0" / "plots").glob("*.png")] == ["completions.png"]
    assert "Captures" in repr(cap) and "generations: 3 completions (3 length)" in repr(cap) and "arrays: none" in \
        repr(cap)

    frame = hookrun.collect(tmp_path / "sweep", generations=True)
    frame["coef"] = frame["job"].map({str(i): c for i, c in enumerate((0, 6, 12))})
    mark = {"the", "a", "of"}
    fig = plot.steering(frame, words={"marked": mark})
    left, right = fig.axes[0], fig.axes[1]
    for coef, cap in caps.items():
        words = [w.lower() for t in cap.generations()["completion"] for w in t.split() if any(c.isalnum() for c in w)]
        i = [0, 6, 12].index(coef)
        assert left.lines[0].get_ydata()[i] == pytest.approx(sum(w in mark for w in words) / len(words))
        assert right.lines[0].get_ydata()[i] == NEW
    assert list(left.lines[0].get_xdata()) == [0, 6, 12] and left.get_xlabel() == "coef"
    assert plot.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "pics")]) == 0
    assert [p.name for p in (tmp_path / "pics").glob("*.png")] == ["generations.png"]  # no index: no compare.png
    for png in (tmp_path / "pics" / "generations.png", tmp_path / "sweep" / "0" / "plots" / "completions.png"):
        assert imread(png)[..., :3].std() > 0.05
