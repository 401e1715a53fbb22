"""A sweep runs every job whatever one job does: a failed job records why (hookrun-job.json) and the others run; the
sweep's end says how many jobs ended how and exits non-zero; hookrun.collect has a row and a status for every job
(complete, failed with its reason, interrupted, missing) and warns when some did not complete."""
import json
import shutil

import numpy as np
import pytest
import torch

import hookrun
from hookrun.engine.jobs import one_line, tally
from tests.helpers import RANDOM, run_cli

CONV9 = "hooks.fmaps.layers: 'conv9' matches no module (did you mean: conv1?)"


def conv_fmaps_pool1() -> np.ndarray:
    """ConvFmapsNet's pool1 output on the experiment's all-ones image, computed here with plain torch."""
    from hookrun.experiments.models import ConvFmapsNet

    with torch.no_grad():
        model = ConvFmapsNet()
        return model.pool1(model.conv1(torch.ones(1, 1, 4, 4))).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "joblib"])
def test_a_bad_job_does_not_stop_the_sweep(tmp_path, launcher):
    proc = run_cli("-m", "+experiment=conv_fmaps", "layers=conv1,conv9,pool1", f"hydra/launcher={launcher}",
                   f"hydra.sweep.dir={tmp_path}", "store.path=${hydra:sweep.dir}/stores/${hydra:job.num}.zarr",
                   check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said  # every failed job is a config error: the exit code a single run gives
    assert f"3 jobs: 2 complete, 1 failed (job 1: {CONV9})" in said
    record = json.loads((tmp_path / "1" / "hookrun-job.json").read_text())
    overrides = record.pop("overrides")  # as Hydra gives a sweep's job them (its `${...}` escaped)
    assert overrides[:2] == ["+experiment=conv_fmaps", "layers=conv9"] and overrides[2].startswith("store.path=")
    assert record == {"job": 1, "status": "failed", "reason": CONV9, "exit_code": 2,
                      "store": str(tmp_path / "stores" / "1.zarr")}  # store.path resolved
    assert json.loads((tmp_path / "2" / "hookrun-job.json").read_text())["status"] == "complete"

    with pytest.warns(UserWarning, match=r"1 of 3 jobs in .* did not complete: job 1 failed \(hooks\.fmaps"):
        df = hookrun.collect(tmp_path)
    jobs = df.groupby("job", sort=False).first()
    assert list(jobs.index) == ["0", "1", "2"]
    assert jobs.status.tolist() == ["complete", "failed", "complete"]
    assert jobs.reason.tolist()[1] == CONV9 and jobs.reason.isna().tolist() == [True, False, True]
    assert jobs["layers"].tolist() == ["conv1", "conv9", "pool1"]
    assert jobs["store.path"].tolist() == [str(tmp_path / "stores" / f"{n}.zarr") for n in range(3)]  # resolved
    assert df[df.job == "1"].shape[0] == 1 and df[df.job == "1"].layer.isna().all()  # one row, no captures
    job2 = hookrun.open(tmp_path / "stores" / "2.zarr")
    np.testing.assert_array_equal(job2.load(layer="pool1", role="output"), conv_fmaps_pool1())


def test_a_job_gone_is_missing_and_an_old_sweep_still_collects(tmp_path):
    """A job that left neither a store nor a record is `missing` (with the overrides the sweep planned for it);
    a sweep made before job records (no hookrun-job.json) collects from its stores as before."""
    run_cli("-m", "+experiment=conv_fmaps", "layers=conv1,pool1", f"hydra.sweep.dir={tmp_path}")
    for job in ("0", "1"):
        (tmp_path / job / "hookrun-job.json").unlink()  # as a sweep made before records
    shutil.rmtree(tmp_path / "1")
    with pytest.warns(UserWarning, match=r"1 of 2 jobs .* job 1 missing \(planned by the sweep"):
        df = hookrun.collect(tmp_path, with_index=False)
    assert df.job.tolist() == ["0", "1"] and df.status.tolist() == ["complete", "missing"]
    assert df.layers.tolist() == ["conv1", "pool1"] and df.run_dir.tolist()[1] is None


def test_an_interrupted_job_stops_the_sweep_and_is_recorded(tmp_path):
    """SIGTERM in job 0 (the test dataset sends it while loading item 13): the sweep stops there (exit 143, as a
    single run), job 0 is interrupted with its committed batches, job 1 never ran: missing."""
    proc = run_cli("-m", *RANDOM, "seed=1,2", f"hydra.sweep.dir={tmp_path}", check=False,
                   env={"HOOKRUN_TEST_STOP_AT": "13"})
    assert proc.returncode == 143, proc.stderr
    record = json.loads((tmp_path / "0" / "hookrun-job.json").read_text())
    assert (record["status"], record["exit_code"], record["reason"]) == ("interrupted", 143, "interrupted by SIGTERM")
    with pytest.warns(UserWarning, match="2 of 2 jobs"):
        df = hookrun.collect(tmp_path, with_index=False)
    assert df.status.tolist() == ["interrupted", "missing"] and df.seed.tolist() == [1, 2]
    assert len(hookrun.open(tmp_path / "0").batches) == 3  # batches 0..2 (items 0..11) committed before item 13


def test_tally_line_and_exit_code():
    jobs = [{"job": 0, "status": "complete", "reason": None, "exit_code": 0},
            {"job": 1, "status": "failed", "reason": "x: bad", "exit_code": 2},
            {"job": 2, "status": "failed", "reason": "run failed: RuntimeError: boom", "exit_code": 1},
            {"job": 3, "status": "missing", "reason": None, "exit_code": float("nan")}]
    assert tally(jobs[:1]) == ("1 job: 1 complete", 0)
    assert tally(jobs[:2]) == ("2 jobs: 1 complete, 1 failed (job 1: x: bad)", 2)
    assert tally(jobs) == ("4 jobs: 1 complete, 2 failed, 1 missing (job 1: x: bad; job 2: run failed: "
                           "RuntimeError: boom; job 3: missing)", 1)
    assert one_line("2 problem(s) in the config:\n  - a: b\n  - c: d") == "a: b; c: d"
    assert one_line("run failed: E: x\n(set HYDRA_FULL_ERROR=1 for the full traceback)") == "run failed: E: x"
