"""Shared fixtures: run the real CLI in a subprocess, or compose a config and run it in process (the functions
behind them are in tests/helpers.py)."""
import os

import numpy as np
import pytest

from tests.helpers import REPO, make_cfg, run_cli

# trained bundled models (the induction experiment's) kept between test processes, not in the user's ~/.cache
os.environ.setdefault("HOOKRUN_CACHE", str(REPO / ".pytest_cache" / "hookrun"))

pytest_plugins = ["tests.s3"]  # the `s3` fixture: a SeaweedFS server on loopback


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny models
    gain nothing from more, and on a shared machine the threads spin."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def run_cfg(tmp_path):
    """Compose a config from overrides, run it into tmp_path/<name>.zarr, return hookrun.open() of it."""
    import hookrun
    from hookrun.engine.runner import run

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
