"""Sweeps written to an object store: each job's store in its own prefix (store.path=s3://.../${hydra:job.num}),
collected with the job's number and swept values, each job's run dir opening as a run."""
import numpy as np
import pytest

import hookrun
from tests.helpers import run_cli

MLP = ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1],capture:[output]}",
       "+data.inputs.x={random:normal,shape:[6,6]}", "data.batch_size=3"]


@pytest.mark.slow
def test_a_multirun_with_store_path_on_s3_collects_each_job(s3, tmp_path):
    prefix = s3.url("sweeps/s1")
    run_cli("-m", *MLP, "seed=3,4", f"store.path={prefix}/${{hydra:job.num}}", f"hydra.sweep.dir={tmp_path}",
            env=s3.env)
    sweep = hookrun.collect(prefix, storage_options=s3.storage_options)
    jobs = sweep.groupby("job", sort=False).first()
    assert list(jobs.index) == ["0", "1"] and list(jobs["seed"]) == [3, 4]
    assert list(jobs["run_dir"]) == [f"{prefix}/0", f"{prefix}/1"] and set(jobs["status"]) == {"complete"}
    loaded = [hookrun.open(d, storage_options=s3.storage_options).load(layer="fc1", role="output")
              for d in jobs["run_dir"]]
    assert loaded[0].shape == (6, 8) and not np.array_equal(loaded[0], loaded[1])  # two seeds, two stores
    assert hookrun.open(jobs["run_dir"].iloc[1], storage_options=s3.storage_options).config["seed"] == 4


def test_job_labels_for_every_store_layout(tmp_path):
    from hookrun.storage import Location
    from hookrun.read.captures import _job_of

    root = Location(tmp_path)
    for rel, job, run_dir in [("0/captures.zarr", "0", "0"), ("3", "3", "3"), ("seed=1.zarr", "seed=1", "seed=1.zarr"),
                              ("10-05-00/2/captures.zarr", "10-05-00/2", "10-05-00/2")]:
        assert _job_of(root, root.child(rel)) == (job, str(tmp_path / run_dir))
