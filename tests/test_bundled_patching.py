"""The bundled patching_grid and ablate_heads experiments, run through the CLI, against plain PyTorch.

The reference patches one site of one pair at a time with its own forward hooks (no hookrun code but the
experiment's model factory and tokenizer); the analysis scripts run as a user runs them and write their PNGs.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import hookrun
from tests.helpers import REPO, run_cli

pytestmark = pytest.mark.slow  # trains or runs bundled models in its fixtures (tens of seconds): CI's tier

PAIRS = REPO / "experiments" / "data" / "pairs.jsonl"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both experiments, as `python -m hookrun +experiment=NAME hydra.run.dir=DIR` runs them."""
    base = tmp_path_factory.mktemp("bundled_patching")
    for name in ("patching_grid", "ablate_heads"):
        run_cli(f"+experiment={name}", f"hydra.run.dir={base / name}")
    return base


@pytest.fixture(scope="module")
def task():
    """The trained model, and per pair: clean ids, corrupt ids, answer id, wrong id (each [1, T] / int)."""
    from hookrun.experiments.lm import tokenizer
    from hookrun.experiments.recall import trained_lm

    tok = tokenizer()
    ids = lambda text: torch.tensor([[tok.bos_token_id, *tok(text)["input_ids"]]])  # noqa: E731
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    one = lambda text: tok(text)["input_ids"][0]  # noqa: E731
    return trained_lm(), [(ids(p["clean"]), ids(p["corrupt"]), one(p["answer"]), one(p["wrong"])) for p in pairs]


def logit_diff(model, ids, a, b, module=None, hook=None, pre=False):
    """logit(a) - logit(b) at the last token, with `hook` on `module` (forward, or forward_pre) if given."""
    handle = None
    if module is not None:
        m = model.get_submodule(module)
        handle = m.register_forward_pre_hook(hook) if pre else m.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1]
    finally:
        if handle is not None:
            handle.remove()
    return float(logits[a] - logits[b])


def patched(model, clean, corrupt, module, position):
    """A forward hook putting the clean run's output of `module` at `position` into the corrupt run."""
    kept = {}
    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    handle = model.get_submodule(module).register_forward_hook(lambda m, a, o: kept.setdefault("x", first(o)))
    with torch.no_grad():
        model(input_ids=clean)
    handle.remove()

    def put(m, args, out):
        x = first(out).clone()
        x[:, position] = kept["x"][:, position]
        return (x, *out[1:]) if isinstance(out, tuple) else x
    return put


def test_patching_grid_equals_one_site_at_a_time(runs, task):
    model, pairs = task
    grid = hookrun.open(runs / "patching_grid").grid()
    assert grid.scores.shape == (64, 5, 8) and grid.axis == "position" and grid.labels == list(range(8))
    assert grid.layers == ["blocks.0.resid_pre", *(f"blocks.{i}" for i in range(4))]  # standard names
    native = ["transformer.drop", *(f"transformer.h.{i}" for i in range(4))]  # GPT-2's modules of those sites
    for sample, layer, position in [(0, 0, 2), (5, 0, 7), (17, 1, 3), (40, 2, 7), (63, 4, 7), (9, 3, 2)]:
        clean, corrupt, a, b = pairs[sample]
        hook = patched(model, clean, corrupt, native[layer], position)
        want = logit_diff(model, corrupt, a, b, native[layer], hook)
        np.testing.assert_allclose(grid.scores[sample, layer, position], want, atol=1e-4)
    for sample in (0, 31, 63):
        clean, corrupt, a, b = pairs[sample]
        np.testing.assert_allclose(grid.source[sample], logit_diff(model, clean, a, b), atol=1e-4)
        np.testing.assert_allclose(grid.target[sample], logit_diff(model, corrupt, a, b), atol=1e-4)
    assert grid.source.mean() > 10 > -10 > grid.target.mean()  # the model learnt the task: the grid can show it
    norm = np.nanmean(grid.normalised(), axis=0)
    assert norm[0, 2] > 0.99 and (norm[1:, 7] > 0.99).all()  # the key at the embeddings, then the last position


def test_ablate_heads_equals_zeroing_the_columns(runs, task):
    model, pairs = task
    grid = hookrun.open(runs / "ablate_heads").grid()
    assert grid.scores.shape == (64, 4, 4) and grid.axis == "head" and grid.labels == [0, 1, 2, 3]
    for sample, layer, head in [(0, 0, 1), (7, 0, 3), (22, 1, 2), (50, 3, 0)]:
        clean, _, a, b = pairs[sample]

        def zero(m, args, head=head):
            x = args[0].clone()
            x[..., head * 16:(head + 1) * 16] = 0  # 64 wide, 4 heads of 16
            return (x,)
        want = logit_diff(model, clean, a, b, f"transformer.h.{layer}.attn.c_proj", zero, pre=True)
        np.testing.assert_allclose(grid.scores[sample, layer, head], want, atol=1e-4)
        np.testing.assert_allclose(grid.source[sample], logit_diff(model, clean, a, b), atol=1e-4)


@pytest.mark.parametrize("name, header", [("patching_grid", "last-position patching"),
                                          ("ablate_heads", "the heads whose ablation lowers it most")])
def test_analysis_scripts_print_the_table_and_write_the_png(runs, name, header):
    out = subprocess.run([sys.executable, "-m", f"hookrun.experiments.{name}", str(runs / name)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert header in out and "blocks.3" in out  # the rows in standard names
    png = runs / name / "plots" / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in out
