"""A method plugged in from this file, without a line of hookrun changed: the L2 norm of layers' outputs per sample.

It is registered as a user's package registers one, through the entry point group `hookrun.methods` (a dist-info
folder on PYTHONPATH, as `pip install` of a package with `[project.entry-points."hookrun.methods"]` leaves), and run
end to end through the CLI: its config block typed with defaults, its checks, the hook it plans, its per-batch step,
the store, a resume after a kill (bitwise), and its reader.
"""
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch

import hookrun
from hookrun.config.checks import is_int
from hookrun.methods import Method, emit

REPO = Path(__file__).resolve().parents[1]
# tests.helpers is imported inside the tests: it registers the configs at import, which loads this plug-in's module


@dataclass
class L2Config:
    """The block `l2norm: {layers: [...], dims: [...]}`."""

    layers: List[str] = field(default_factory=list)  # the layers whose output's norm is stored
    dims: List[int] = field(default_factory=lambda: [1, 2, 3])  # the axes the norm runs over (1: past the sample)


class L2Norm(Method):
    """The L2 norm of each layer's output per sample, and of the model's output (a cap.samples column)."""

    key = "l2norm"
    annotation = L2Config
    factory = L2Config
    help = "per-sample L2 norm of layers' outputs"

    @classmethod
    def active(cls, cfg) -> bool:
        return bool(cfg.l2norm.layers)

    @classmethod
    def check(cls, cfg) -> List[str]:
        spec = cfg.l2norm
        return [f"l2norm.dims: {d!r} is not an axis past the sample axis; give ints >= 1" for d in spec.dims
                if not (is_int(d) and d >= 1)]

    def hooks(self):
        return {"l2norm": {"kind": "forward", "layers": list(self.spec.layers), "capture": ["output"],
                           "reduce": {"op": "norm", "dims": list(self.spec.dims)}}}

    def measure(self, job, i, batch, output, hookset):
        norms = torch.linalg.vector_norm(output.detach().flatten(1), dim=1)
        emit(hookset, i, batch, "l2norm", "_model", "norm", norms)
        return {"l2norm.output": norms.numpy()}

    def columns(self):
        return ["l2norm.output"]

    @staticmethod
    def read(cap, layer: str) -> np.ndarray:
        """The norms of `layer`'s output, a row per sample."""
        return cap.load(hook="l2norm", layer=layer, role="output")


def plugged(tmp_path, monkeypatch=None) -> dict:
    """The environment of a Python where this file's method is installed as a package's entry point (and, with
    `monkeypatch`, this process made one: its readers are found here too)."""
    site = tmp_path / "site"
    info = site / "l2norm_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: l2norm-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[hookrun.methods]\nl2norm = tests.test_method_plugin:L2Norm\n")
    if monkeypatch is not None:
        from hookrun.config.registry import methods

        monkeypatch.syspath_prepend(str(site))
        methods.cache_clear()
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def hookrun_cli(env, *args, run_dir):
    from tests.helpers import SLOW, on_cpu

    return subprocess.run([sys.executable, "-m", "hookrun", *on_cpu([*SLOW, *args]), f"hydra.run.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_a_method_from_a_test_file_runs_end_to_end_checked_stored_resumed_and_read(tmp_path, monkeypatch):
    from hookrun.config.registry import methods
    from tests.helpers import same_store

    env = plugged(tmp_path, monkeypatch)
    try:
        check_run(tmp_path, env, same_store)
    finally:
        methods.cache_clear()  # the plug-in leaves this process's registry with the test


def check_run(tmp_path, env, same_store):
    from tests.helpers import SLOW, on_cpu

    block = "l2norm.layers=[conv]"
    done = hookrun_cli(env, block, run_dir=tmp_path / "ref")
    assert done.returncode == 0, done.stderr
    cap = hookrun.open(tmp_path / "ref")
    # its reader: the norm of each sample's conv output, as numpy computes it from the full capture of the same layer
    conv = cap.load(hook="acts", layer="conv", role="output")
    np.testing.assert_allclose(cap.read("l2norm", "conv"), np.linalg.norm(conv.reshape(len(conv), -1), axis=1),
                               rtol=1e-5)
    fc = cap.load(hook="acts", layer="fc", role="output")
    # its per-batch step: the model's output norm, an array and a cap.samples column (the model's output is fc's)
    np.testing.assert_allclose(cap.samples["l2norm.output"], np.linalg.norm(fc, axis=1), rtol=1e-5)
    np.testing.assert_allclose(cap.load(hook="l2norm", layer="_model", role="norm"), np.linalg.norm(fc, axis=1),
                               rtol=1e-5)
    assert len(cap.samples) == 120 and cap.attrs["metric_columns"] == ["l2norm.output"]
    assert cap.attrs["config"]["l2norm"] == {"layers": ["conv"], "dims": [1, 2, 3]}  # typed, with defaults

    # killed mid-way and resumed: bitwise the uninterrupted run
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu([*SLOW, block]), f"hydra.run.dir={killed}"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (killed / "captures.zarr" / "_index" / "batches-000000.parquet").exists() and proc.poll() is None:
        time.sleep(0.005)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert hookrun.open(killed).status == "running"
    resumed = hookrun_cli(env, block, "store.mode=resume", run_dir=killed)
    assert resumed.returncode == 0, resumed.stderr
    same_store(hookrun.open(killed), cap)


@pytest.mark.slow
def test_a_plugged_method_checks_its_block_before_any_work(tmp_path):
    env = plugged(tmp_path)
    proc = hookrun_cli(env, "l2norm.layers=[conv]", "l2norm.dims=[0,2]", run_dir=tmp_path / "bad")
    assert proc.returncode == 2, proc.stderr
    assert "l2norm.dims: 0 is not an axis past the sample axis; give ints >= 1" in proc.stdout + proc.stderr
    assert not (tmp_path / "bad" / "captures.zarr").exists()
    # its block is typed: a key its schema lacks is refused with the keys it takes
    proc = hookrun_cli(env, "l2norm.layers=[conv]", "+l2norm.dim=[1]", run_dir=tmp_path / "typo")
    assert proc.returncode == 2 and "l2norm.dim: unknown key" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.slow
def test_without_the_plugin_its_block_is_an_unknown_key(tmp_path):
    proc = hookrun_cli(dict(os.environ), "l2norm.layers=[conv]", run_dir=tmp_path / "plain")
    assert proc.returncode == 2 and "Key 'l2norm' not in 'RunConfig'" in proc.stdout + proc.stderr, proc.stderr
