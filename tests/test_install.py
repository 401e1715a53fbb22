"""The project installed three ways in fresh venvs (editable, a built wheel, a clone run as it is: cd into it, or on
PYTHONPATH) runs a bundled experiment from a directory holding a folder named hookrun (a clone, which used to shadow
an editable install): each way imports its own copy, finds the bundled configs and scripts, and writes the store the
checkout writes, bitwise. And the wheel holds every package, config and data file.

Nothing is downloaded: each venv sees this environment's packages through a .pth file, and the wheel and the editable
install are built with --no-build-isolation by the newest setuptools this environment has."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import hookrun
from tests.helpers import REPO, run_here, same_store

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

SOURCES = ("pyproject.toml", "README.md", "hookrun", "conf", "experiments")  # what a clone holds that the build reads
MODES = ("editable", "wheel", "clone", "pythonpath")

CHECK = """
import importlib.resources, runpy, sys
import hookrun, hookrun.conf, hookrun.experiments, hookrun.experiments.steer
root = sys.argv.pop(1)  # the copy this install must import
for module in (hookrun, hookrun.conf, hookrun.experiments, hookrun.experiments.steer):
    assert str(module.__file__).startswith(root), f"{module.__name__} imported from {module.__path__}, not {root}"
conf = importlib.resources.files("hookrun.conf")
assert conf.joinpath("config.yaml").is_file() and conf.joinpath("experiment", "conv_fmaps.yaml").is_file()
assert importlib.resources.files("hookrun.experiments").joinpath("data", "corpus.txt").is_file()
runpy.run_module("hookrun.experiments.conv_fmaps", run_name="__main__", alter_sys=True)   # as python -m runs it
"""


def _setuptools_major(folder: str) -> int:
    versions = [int(d.name.split("-")[1].split(".")[0]) for d in Path(folder).glob("setuptools-*.dist-info")]
    return max(versions, default=0)


def _site_dirs() -> list:
    """This environment's site-packages folders, the one with the newest setuptools first (a venv made by `python -m
    venv` holds an older setuptools than the build needs; the base environment it sees may hold a newer one)."""
    dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    return sorted(dict.fromkeys(dirs), key=_setuptools_major, reverse=True)


def _venv(path: Path) -> Path:
    """A fresh venv without hookrun that sees torch, hydra, zarr ... of this environment: their folders are written
    into a .pth file as plain paths, whose own .pth files (this environment's editable hookrun among them) are not
    run."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "test_env.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    return python


def _pip(python: Path, *args) -> None:
    """This environment's pip acting for the venv of `python` (the build runs there, with its setuptools)."""
    offline = _setuptools_major(_site_dirs()[0]) >= 68  # pyproject.toml's build requirement; else an isolated build
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args, "--no-deps", "-q",
                           *(["--no-build-isolation"] if offline else [])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _clone(dest: Path) -> Path:
    """What a clone of the checkout holds (the sources the build reads), without build outputs."""
    dest.mkdir(parents=True)
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, dest / name)
    return dest


def _shadowed(path: Path) -> Path:
    """A working directory holding a clone named hookrun: Python takes that folder for a namespace package, which
    used to win over an editable install."""
    _clone(path / "hookrun")
    return path


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    """mode -> (python, working directory, the folder its hookrun must come from, extra environment); and the wheel."""
    tmp = tmp_path_factory.mktemp("install")
    src, clone = _clone(tmp / "src"), _clone(tmp / "clone")  # src: built from (no build/ lands in the checkout)
    bare = _venv(tmp / "bare")
    _pip(bare, "wheel", "-w", str(tmp / "dist"), str(src))
    (wheel,) = (tmp / "dist").glob("hookrun-*.whl")
    wheel_python, editable_python = _venv(tmp / "venv-wheel"), _venv(tmp / "venv-editable")
    _pip(wheel_python, "install", str(wheel))
    _pip(editable_python, "install", "-e", str(src))
    wheel_site = subprocess.run([wheel_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                check=True, capture_output=True, text=True).stdout.strip()
    modes = {"editable": (editable_python, _shadowed(tmp / "work-editable"), src, {}),
             "wheel": (wheel_python, _shadowed(tmp / "work-wheel"), Path(wheel_site), {}),
             "clone": (bare, clone, clone, {}),   # cd into the clone: its hookrun/ is the package
             "pythonpath": (bare, _shadowed(tmp / "work-pythonpath"), clone, {"PYTHONPATH": str(clone)})}
    return modes, wheel


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """conv_fmaps run in this process, from the checkout."""
    path = tmp_path_factory.mktemp("reference")
    run_here(path, "+experiment=conv_fmaps")
    return hookrun.open(path / "captures.zarr")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_each_install_runs_conv_fmaps_from_a_directory_holding_hookrun(installs, reference, mode, tmp_path):
    python, cwd, root, extra = installs[0][mode]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "HYDRA_FULL_ERROR")}
    env.update(extra)
    before = {p.name for p in cwd.iterdir()}
    store = tmp_path / "captures.zarr"
    proc = subprocess.run([python, "-m", "hookrun", "+experiment=conv_fmaps", "hydra.run.dir=run",
                           f"store.path={store}"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([python, "-c", CHECK, str(root), str(store)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "output value: [9.0, 18.0]" in proc.stdout  # the bundled analysis script read the store

    cap = hookrun.open(store)
    assert cap.status == "complete" and cap.config["seed"] == 0
    assert cap.load(layer="conv1", role="output")[0, :, 0, 0].tolist() == [9.0, 18.0]
    assert np.array_equal(cap.load(layer="_model", role="output").ravel(), [9.0, 18.0])
    same_store(reference, cap)
    assert {p.name for p in cwd.iterdir()} - before == {"run"}  # Hydra's run dir, nothing else, where it ran


def _wheel_names(wheel) -> set:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


@pytest.mark.slow
def test_the_wheel_holds_every_module_config_and_data_file(installs):
    names = _wheel_names(installs[1])
    assert {"hookrun/conf/config.yaml", "hookrun/conf/experiment/conv_fmaps.yaml",
            "hookrun/experiments/data/corpus.txt", "hookrun/experiments/steer.py"} <= names
    expected = {f"hookrun/{p.relative_to(REPO / 'hookrun').as_posix()}" for p in (REPO / "hookrun").rglob("*.py")}
    for folder, globs in (("conf", ("*.py", "*.yaml")), ("experiments", ("*.py", "data/*", "weights/*"))):
        expected |= {f"hookrun/{folder}/{p.relative_to(REPO / folder).as_posix()}"
                     for glob in globs for p in (REPO / folder).rglob(glob) if "__pycache__" not in p.parts}
    assert len(expected) > 100
    assert expected - names == set(), "checkout files missing from the wheel: see [tool.setuptools] in pyproject.toml"


def test_the_packages_list_names_every_package():
    """pyproject.toml's [tool.setuptools] packages: each folder of hookrun/ (and conf/, experiments/) holding Python
    is listed, so a new subpackage cannot be left out of the wheel; and each listed one exists."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"hookrun": REPO / "hookrun", **{name: REPO / path for name, path in setup["package-dir"].items()}}
    found = set()
    for name, top in folders.items():
        for init in top.rglob("*.py"):
            if "__pycache__" not in init.parts:
                found.add(".".join([name, *init.parent.relative_to(top).parts]))
    assert {"hookrun", "hookrun.engine", "hookrun.methods", "hookrun.conf", "hookrun.experiments"} <= found
    assert sorted(found - set(setup["packages"])) == [], "folders with Python missing from [tool.setuptools] packages"
    assert sorted(set(setup["packages"]) - found) == [], "[tool.setuptools] packages names a folder that is gone"
