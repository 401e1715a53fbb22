"""A built wheel, installed into a fresh venv, runs the bundled experiment from an empty directory."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

import hookrun
from tests.helpers import REPO

RUN = """
import runpy, sys
import hookrun, hookrun.experiments as experiments
site = sys.argv.pop(1)
for module in (hookrun, experiments):  # the wheel's copy, never the checkout's
    assert module.__file__.startswith(site), f"{module.__name__} imported from {module.__file__}, not {site}"
sys.argv = ["hookrun", "+experiment=conv_fmaps", "hydra.run.dir=run"]
runpy.run_module("hookrun", run_name="__main__")
"""


def _isolation() -> list:
    """Build with this environment's setuptools when it is recent enough (fast, offline), else in isolation."""
    try:
        import setuptools
    except ImportError:
        return []
    return ["--no-build-isolation"] if int(setuptools.__version__.split(".")[0]) >= 68 else []


def test_wheel_runs_conv_fmaps_from_an_empty_directory(tmp_path):
    src = tmp_path / "src"  # a copy of what the wheel is built from, so no build/ lands in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("hookrun",):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", *_isolation(), "-q", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("hookrun-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # torch, hydra, zarr ... come from the test environment's site-packages, added as a plain path: its .pth files
    # (an editable install of hookrun among them) are not run, so hookrun can come only from the wheel
    (site / "test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--force-reinstall", "-q", str(wheel)],
                   check=True, capture_output=True)

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    proc = subprocess.run([python, "-c", RUN, str(site)], cwd=empty, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    cap = hookrun.open(empty / "run")
    assert cap.status == "complete" and cap.config["seed"] == 0
    assert cap.load(layer="conv1", role="output")[0, :, 0, 0].tolist() == [9.0, 18.0]
    assert np.array_equal(cap.load(layer="_model", role="output").ravel(), [9.0, 18.0])
    assert sorted(p.name for p in empty.iterdir()) == ["run"]
