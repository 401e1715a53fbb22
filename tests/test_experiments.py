"""Every bundled experiment, with the numbers its seed article prints.

Run in process, as `python -m hookrun +experiment=NAME` composes them (the CLI itself is tested in
test_failures, test_sweep, test_install and test_own_experiments); the analysis scripts run as
`python -m hookrun.experiments.NAME RUN_DIR` does, through runpy.
"""
import contextlib
import io
import logging
import runpy
import sys

import numpy as np
import pytest

import hookrun
from hookrun.engine.runner import run
from tests.helpers import REPO, make_cfg

pytestmark = pytest.mark.slow  # trains or runs bundled models in its fixtures (tens of seconds): CI's tier

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")
                     if p.stem not in ("steer", "train_sae", "trained_circuit"))  # steer needs its two source runs
# first (tests/test_steer.py runs it whole), train_sae sae_source's store and trained_circuit train_sae's folder
# (tests/test_train_sae.py runs the three as one sweep)


SHARED_SCRIPT = {"intermediate_grad_pow": "intermediate_grad", "steer_source": "lm_tokens", "sae_source": "lm_tokens",
                 "recall_circuit": "induction_circuit", "induction_circuit_post_norm": "induction_circuit"}
# experiment -> the analysis script it shares (steer_source stores per-token captures of the bundled LM, as lm_tokens
# does)


def run_experiment(run_dir, *overrides) -> str:
    """Run an experiment into run_dir/captures.zarr in process; returns what it logged (the summary)."""
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logger = logging.getLogger("hookrun")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        run(make_cfg([*overrides, f"store.path={run_dir / 'captures.zarr'}"]))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return log.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run every experiment once, as `python -m hookrun +experiment=NAME` would."""
    base = tmp_path_factory.mktemp("experiments")
    out = {}
    for name in EXPERIMENTS:
        logged = run_experiment(base / name, f"+experiment={name}")
        out[name] = (hookrun.open(base / name), logged)
    return out


def analysis(name, run_dir) -> str:
    """Output of the experiment's analysis script, run as `python -m hookrun.experiments.NAME RUN_DIR`."""
    script = name if (REPO / "experiments" / f"{name}.py").exists() else SHARED_SCRIPT[name]
    out, argv = io.StringIO(), sys.argv
    sys.argv = [f"experiments/{script}.py", str(run_dir)]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(f"hookrun.experiments.{script}", run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_every_experiment_completes_and_has_an_analysis_script(runs):
    assert len(EXPERIMENTS) >= 9
    for name, (cap, logged) in runs.items():
        assert cap.status == "complete", name
        assert len(cap.index) > 0, name
        assert "captures:" in logged  # the end-of-run summary table
        assert analysis(name, cap.path.parent).strip(), name


def test_conv_fmaps_seed_003(runs):
    cap, _ = runs["conv_fmaps"]
    fmap = cap.load(layer="conv1", role="output")
    assert fmap.shape == (1, 2, 2, 2)
    np.testing.assert_array_equal(fmap[0, 0], np.full((2, 2), 9.0))
    np.testing.assert_array_equal(fmap[0, 1], np.full((2, 2), 18.0))
    out = cap.load(layer="_model", role="output")
    assert out.shape == (1, 2, 1, 1) and out.ravel().tolist() == [9.0, 18.0]
    np.testing.assert_array_equal(cap.load(layer="conv1", role="input.0"), np.ones((1, 1, 4, 4)))
    row = cap.rows(layer="conv1", role="output").iloc[0]
    assert (row["mean"], row["min"], row["max"], row["shape"]) == (13.5, 9.0, 18.0, "[1, 2, 2, 2]")
    text = analysis("conv_fmaps", cap.path.parent)
    assert "output value: [9.0, 18.0]" in text and "[1, 2, 2, 2]" in text


def test_pool_activations_seed_001(runs):
    cap, _ = runs["pool_activations"]
    feat = cap.load(layer="pool", role="output")
    assert feat.shape == (1, 8, 4, 4)
    assert (feat >= 0).all()  # average of ReLU outputs
    assert "[1, 8, 4, 4]" in analysis("pool_activations", cap.path.parent)


def test_add_one_seed_002(runs):
    cap, _ = runs["add_one"]
    assert cap.load(role="input.0").ravel().tolist() == [1.0]
    assert cap.load(role="output").ravel().tolist() == [2.0]


def test_intermediate_grad_seeds_000_004(runs):
    cap, _ = runs["intermediate_grad"]
    grad = cap.load(hook="y_grad", layer="shift", role="grad")[0]
    y = cap.load(hook="y", layer="shift", role="output")[0]
    assert grad.shape == (2, 1)
    np.testing.assert_allclose(grad, y, rtol=1e-6)  # dz/dy = 2y/2 = y
    import torch

    x = torch.randn(2, 1, generator=torch.Generator().manual_seed(0))  # the run's seeded x
    np.testing.assert_allclose(grad, (x + 2).numpy(), rtol=1e-6)
    np.testing.assert_allclose(cap.batches.loss.iloc[0], float(torch.mean((x + 2) ** 2)), rtol=1e-6)


def test_intermediate_grad_pow_seed_003(runs):
    cap, _ = runs["intermediate_grad_pow"]
    assert cap.load(hook="y_grad", role="grad")[0].tolist() == [0.25, 0.25, 0.25, 0.25]
    assert cap.batches.loss.iloc[0] == 4.0


def test_grad_edit_seed_001(runs):
    cap, _ = runs["grad_edit"]
    assert cap.load(hook="c_grad", role="grad").item() == 3.0
    assert cap.load(hook="ab_grad", role="grad.0").item() == 39.0
    assert cap.load(hook="ab_grad", role="grad.1").item() == 21.0
    assert "tensor(39) tensor(21) tensor(3)" in analysis("grad_edit", cap.path.parent)


def test_grad_edit_without_the_edit(tmp_path):
    run_experiment(tmp_path, "+experiment=grad_edit", "hooks.c_grad.edit=[]")
    cap = hookrun.open(tmp_path)
    grads = [cap.load(hook="c_grad", role="grad").item(), cap.load(hook="ab_grad", role="grad.0").item(),
             cap.load(hook="ab_grad", role="grad.1").item()]
    assert grads == [1.0, 13.0, 7.0]


def test_leaf_grad_double_seed_003(runs):
    cap, _ = runs["leaf_grad_double"]
    assert cap.load(hook="x_grad", role="grad.0")[0].tolist() == [2.0, 2.0, 2.0, 2.0]


def test_linear_backward_seed_000(runs):
    cap, _ = runs["linear_backward"]
    assert cap.batches.loss.tolist() == [5.0]
    assert cap.load(hook="bwd", role="grad_output.0").tolist() == [[1.0], [3.0]]
    assert cap.load(hook="bwd", role="grad_input.0").tolist() == [[2.0], [6.0]]
    assert cap.load(hook="weight_grad", layer="weight", role="grad").tolist() == [[[7.0]]]
    text = analysis("linear_backward", cap.path.parent)
    assert "loss   : 5.0" in text and "grad   : [[7.0]]" in text


def test_fwd_bwd_combined_join(runs):
    cap, _ = runs["fwd_bwd_combined"]
    keys = ["layer", "batch", "call", "sample_start", "sample_stop"]
    pairs = cap.rows(hook="in_data").merge(cap.rows(hook="out_grads"), on=keys, suffixes=("_in", "_grad"))
    assert pairs.batch.tolist() == [0, 1]
    assert pairs.sample_start.tolist() == [0, 2]
    # y_p = 2x, dl/dy_p = 2 (2x - 1) / 2 = 2x - 1 for each batch of 2
    np.testing.assert_allclose(pairs.mean_grad, 2 * pairs.mean_in - 1)
    assert cap.load(hook="out_grads", role="grad").ravel().tolist() == [1.0, 3.0, 5.0, 7.0]
    assert "sum(x * grad) = 43" in analysis("fwd_bwd_combined", cap.path.parent)



def test_superposition_the_trained_sae_recovers_the_planted_features(runs):
    cap, _ = runs["superposition"]
    printed = analysis("superposition", cap.path.parent)
    mean = float(printed.split("mean max cosine similarity: ")[1].split()[0])
    assert mean >= 0.99   # measured 0.9984 (min 0.9959): every planted direction has a decoder row along it
    assert (cap.path.parent / "superposition.png").is_file()
