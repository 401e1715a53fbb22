"""Stores on S3: a real SeaweedFS server on loopback (tests/s3.py). A run through the CLI reads back
like a local one (index, arrays, chunk bytes, collect, xarray); a kill -9 resumes; the lock holds."""
import json
import logging
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import s3fs

import hookrun
from hookrun.store.lock import LOCK_NAME, LeaseLock
from hookrun.engine.runner import run
from hookrun.storage import Location
from tests.helpers import REPO, make_cfg, on_cpu, run_cli, run_here, same_arrays

MLP = ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1,fc2],capture:[input,output]}",
       "+hooks.g={kind:output_grad,layers:fc1}", "loss=sum", "+data.inputs.x={random:normal,shape:[50,6]}",
       "data.batch_size=4", "store.chunk_rows=3", "store.commit_s=0"]
SLOW = ["+model._target_=tests.models.Slow", "+data.inputs.x={random:normal,shape:[120,3,6,6]}", "data.batch_size=2",
        "+hooks.acts={kind:forward,layers:[conv,fc],capture:[input,output]}", "store.chunk_rows=3", "store.commit_s=0"]


@pytest.mark.slow
def test_a_run_on_s3_reads_back_like_the_same_run_on_disk(s3, tmp_path):
    run_here(tmp_path / "local", *MLP)
    for job in ("a", "b"):  # a sweep-like prefix of two runs, for collect
        run_cli(*MLP, f"store.path={s3.url(f'sweep/{job}/captures.zarr')}", f"hydra.run.dir={tmp_path / job}", env=s3.env)
    local = hookrun.open(tmp_path / "local")
    remote = hookrun.open(s3.url("sweep/a"), storage_options=s3.storage_options)  # the run dir, like a local one
    assert remote.status == "complete" and remote.verify(decode=True) == []
    assert not (tmp_path / "a" / "captures.zarr").exists()  # nothing of the store written locally
    fs = s3fs.S3FileSystem(**s3.storage_options)
    same_arrays(local, remote, fs)
    assert np.array_equal(local.load(layer="fc1", role="grad"), remote.load(layer="fc1", role="grad"))
    assert local.samples.equals(remote.samples)
    sweep = hookrun.collect(s3.url("sweep"), storage_options=s3.storage_options)
    assert sorted(sweep.job.unique()) == ["a", "b"] and len(sweep) == 2 * len(local.index)
    ds = remote.to_xarray(hook="acts", layer="fc2")
    assert type(ds["output"].data).__module__.startswith("dask")  # lazy
    assert np.array_equal(ds["output"].values, local.load(layer="fc2", role="output"))


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_kill_9_on_s3_then_resume_equals_an_uninterrupted_run(s3, tmp_path, monkeypatch, caplog):
    run_here(tmp_path / "ref", *SLOW)
    url = s3.url("killed.zarr")
    fs = s3fs.S3FileSystem(**s3.storage_options, skip_instance_cache=True)
    proc = subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu(SLOW), f"store.path={url}",
                             f"hydra.run.dir={tmp_path / 'killed'}"], cwd=REPO, env={**__import__("os").environ, **s3.env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not fs.exists(f"{s3.bucket}/killed.zarr/_index/batches-000005.parquet") and proc.poll() is None:
        time.sleep(0.05)
        fs.invalidate_cache()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = hookrun.open(url, storage_options=s3.storage_options)
    committed = killed.batches.batch.tolist()
    assert killed.status == "running" and killed.verify() == [] and committed == list(range(len(committed)))
    assert 5 <= len(committed) < 60  # part 5 written; its commit (the root attr, written last) may not be
    for name, value in s3.env.items():  # resumed in this process, with the credentials a shell would give
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.INFO, logger="hookrun")
    run(make_cfg([*SLOW, "store.mode=resume", f"store.path={url}"]))
    assert f"starting at batch {len(committed)}\n" in caplog.text  # the dead writer's lease did not block
    resumed = hookrun.open(url, storage_options=s3.storage_options)
    assert resumed.status == "complete" and resumed.verify(decode=True) == []
    same_arrays(hookrun.open(tmp_path / "ref"), resumed, fs)


@pytest.mark.slow
def test_the_lease_refuses_a_second_writer_and_a_stale_one_is_taken_over(s3, tmp_path):
    url = s3.url("leased.zarr")
    location = Location(url, s3.storage_options)
    with LeaseLock(location):  # a live writer (this process)
        proc = run_cli(*MLP, f"store.path={url}", f"hydra.run.dir={tmp_path / 'r1'}", env=s3.env, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and f"store.path: {url} is being written by another run (pid " in out
        assert f"on {socket.gethostname()}" in out and "Traceback" not in out
    assert not location.exists("zarr.json")  # refused before anything was written
    stale = {"host": "elsewhere", "pid": 1, "started": "2026-01-01T00:00:00", "ttl_s": 60, "released": False}
    location.put(f"{LOCK_NAME}/lease-000005", json.dumps({**stale, "renewed": time.time() - 3600}).encode())
    run_cli(*MLP, f"store.path={url}", f"hydra.run.dir={tmp_path / 'r2'}", env=s3.env)  # an hour old: taken over
    assert location.keys(f"{LOCK_NAME}/") == [f"{LOCK_NAME}/lease-000006"]  # released by the run that took it
    location.put(f"{LOCK_NAME}/lease-000007", json.dumps({**stale, "renewed": time.time()}).encode())
    proc = run_cli(*MLP, "store.mode=overwrite", f"store.path={url}", f"hydra.run.dir={tmp_path / 'r3'}",
                   env=s3.env, check=False)
    assert proc.returncode == 2 and "being written by another run (pid 1 on elsewhere" in proc.stdout + proc.stderr


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_two_writers_racing_for_one_s3_store_one_wins(s3, tmp_path):
    url = s3.url("raced.zarr")
    procs = [subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu(SLOW), f"store.path={url}",
                               f"hydra.run.dir={tmp_path / str(i)}"], cwd=REPO, env={**__import__("os").environ, **s3.env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    results = [(p.wait(300), p.stdout.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(out for code, out in results if code == 2)
    assert "is being written by another run" in loser or "already holds a hookrun run" in loser
    cap = hookrun.open(url, storage_options=s3.storage_options)
    assert cap.status == "complete" and cap.verify(decode=True) == [] and cap.batches.batch.tolist() == list(range(60))


@pytest.mark.slow
def test_a_store_url_that_cannot_be_used_is_refused_before_any_work(s3, tmp_path):
    proc = run_cli("+experiment=conv_fmaps", "store.path=foo://x/y.zarr", f"hydra.run.dir={tmp_path / 'a'}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "store.path: 'foo://x/y.zarr' cannot be opened (ValueError: Protocol not known: foo)" in out
    wrong = {**s3.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    proc = run_cli("+experiment=conv_fmaps", f"store.path={s3.url('denied.zarr')}", f"hydra.run.dir={tmp_path / 'b'}",
                   env=wrong, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and f"store.path: {s3.url('denied.zarr')} cannot be read (" in out
    assert "check the credentials" in out and "Traceback" not in out
    assert not Location(s3.url("denied.zarr"), s3.storage_options).keys()  # nothing written
