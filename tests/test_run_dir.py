"""The run folder's name: outputs/<date>/<H-M-S> as the README shows it, -2 for a second launch in the same
second, one mkdir deciding between two processes."""
import multiprocessing
import os
import re
import subprocess
import sys

from hookrun.config.rundir import fresh

from tests.helpers import REPO, on_cpu


def _claim(base):
    return fresh(base)


def test_fresh_claims_the_name_then_numbers_the_next(tmp_path):
    base = str(tmp_path / "outputs" / "2026-11-22" / "10-00-00")
    assert fresh(base) == base
    assert fresh(base) == f"{base}-2"  # asked again (a second hookrun.run in the same second): the next one
    (tmp_path / "outputs" / "2026-11-22" / "10-00-00-3").mkdir()  # another launch's folder
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:  # three fresh processes at once: each gets its own folder
        got = pool.map(_claim, [base] * 3)
    assert sorted(got) == [f"{base}-{n}" for n in (4, 5, 6)]


def test_two_launches_in_one_second_get_two_folders(tmp_path):
    cmd = [sys.executable, "-m", "hookrun", *on_cpu(["+experiment=add_one", "hydra.run.dir='${hookrun.fresh:out/"
                                                     "${now:%Y-%m-%d}/10-00-00}'"])]
    env = {"PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    days = list((tmp_path / "out").iterdir())
    assert len(days) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\d", days[0].name)
    assert sorted(d.name for d in days[0].iterdir()) == ["10-00-00", "10-00-00-2"]
    assert all((d / "captures.zarr").is_dir() for d in days[0].iterdir())


def test_default_folder_is_date_and_seconds(tmp_path, cli):
    cli("+experiment=add_one", cwd=tmp_path)
    (run,) = (tmp_path / "outputs").glob("*/*")
    assert re.fullmatch(r"\d\d-\d\d-\d\d(-\d+)?", run.name), run.name
    assert (run / "captures.zarr").is_dir()


def test_python_runs_leave_no_empty_folder(tmp_path, monkeypatch):
    import hookrun

    monkeypatch.chdir(tmp_path)
    hookrun.compose("add_one")
    cap = hookrun.run("add_one", store={"path": str(tmp_path / "elsewhere.zarr")})
    assert cap.status == "complete"
    assert not (tmp_path / "outputs").exists()  # composed, and a store written elsewhere: no folder left behind
    first, second = hookrun.run("add_one"), hookrun.run("add_one")  # two runs, maybe in one second: two folders
    assert first.path != second.path and len(list((tmp_path / "outputs").glob("*/*"))) == 2
