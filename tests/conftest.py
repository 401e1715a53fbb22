"""Shared fixtures: run the real CLI in a subprocess, or compose a config and run it in process."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from hookrun.config.schema import register_configs

pytest_plugins = ["tests.s3"]  # the `s3` fixture: a SeaweedFS server on loopback

REPO = Path(__file__).resolve().parents[1]
register_configs()


def run_cli(*args, cwd=None, check=True, env=None):
    """`python -m hookrun ARGS` as a user types it; returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "hookrun", *args], cwd=cwd or REPO, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"hookrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def make_cfg(overrides):
    """The config `python -m hookrun OVERRIDES` would run."""
    with initialize_config_dir(config_dir=str(REPO / "hookrun" / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_here(run_dir, *overrides):
    """The run `python -m hookrun OVERRIDES hydra.run.dir=RUN_DIR` makes, in this process (no interpreter to
    start): for reference runs and resumes where the CLI itself is not what a test is about."""
    from hookrun.run.runner import run

    return run(make_cfg([*overrides, f"store.path={run_dir}/captures.zarr"]))


MLP = ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1,fc2],capture:[input,output]}"]
RANDOM = [*MLP, "+data.dataset._target_=tests.models.RandomItems", "data.batch_size=4",
          "store.chunk_rows=5", "store.commit_s=0"]  # a dataset that draws from the RNG, committed every batch


def run_in(path: Path, overrides, stop_at=None):
    """Run in process into `path`; with stop_at, the dataset sends SIGTERM while loading that item."""
    from hookrun.run.runner import run

    if stop_at is not None:
        os.environ["HOOKRUN_TEST_STOP_AT"] = str(stop_at)
    try:
        return run(make_cfg([*overrides, f"store.path={path}"]))
    finally:
        os.environ.pop("HOOKRUN_TEST_STOP_AT", None)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def run_cfg(tmp_path):
    """Compose a config from overrides, run it into tmp_path/<name>.zarr, return hookrun.open() of it."""
    import hookrun
    from hookrun.run.runner import run

    def _run(overrides, name="run"):
        path = tmp_path / f"{name}.zarr"
        cfg = make_cfg([*overrides, f"store.path={path}"])
        run(cfg)
        return hookrun.open(path)

    return _run


@pytest.fixture
def npy(tmp_path):
    """Save an array as .npy under tmp_path and return its path (for data.inputs.<x>.file)."""
    def _save(name, array):
        path = tmp_path / f"{name}.npy"
        np.save(path, np.asarray(array))
        return path
    return _save
