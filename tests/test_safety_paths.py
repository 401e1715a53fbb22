"""Data safety, round 2: hookrun never writes or deletes outside what it owns. A lock, an index dir, a group, an
array or a chunk that is a symbolic link is refused, never followed; overwrite removes only the old run's keys and
finishes the job when it was stopped half-way; `~` is expanded once; store.path on /proc or below a file, and every
form of store.storage_options, are refused before any work or work; no value from the environment is stored; an
object store outage is ridden out for store.retry_s."""
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import zarr

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.store.lock import LOCK_NAME, FileLock
from hookrun.engine.runner import Interrupted, run, store_location
from hookrun.storage import Location
from tests.helpers import (RANDOM, REPO, interrupted_store, make_cfg, on_cpu, run_cli, run_here, run_in,
                           same_arrays, same_store)


def files(root: Path) -> dict:
    """{relative path: bytes} of every file below `root`, links not followed (what must stay as it was)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath, name)
            out[path.relative_to(root).as_posix()] = os.readlink(path) if path.is_symlink() else path.read_bytes()
    return out


def users_dir(tmp_path: Path) -> Path:
    """A directory of the user's: a text file, a .parquet, a .tmp and their own zarr group with an array."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    pd.DataFrame({"a": [1, 2]}).to_parquet(mine / "results.parquet")
    (mine / "draft.tmp").write_text("unsaved")
    zarr.create_array(store=str(mine / "own.zarr"), name="x", shape=(3,), dtype="f4")[:] = [1, 2, 3]
    return mine


# -- 1. a lock that is not a file hookrun made is refused, never truncated ---------------------------------------------
@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "hard link", "other content", "directory", "fifo"])
def test_a_lock_file_hookrun_did_not_make_is_refused_and_left_alone(tmp_path, kind):
    store, theirs = tmp_path / "s.zarr", tmp_path / "theirs.txt"
    store.mkdir()
    theirs.write_text("precious")
    lock = store / LOCK_NAME
    if kind == "symlink":
        lock.symlink_to(theirs)
    elif kind == "dangling symlink":
        lock.symlink_to(tmp_path / "not-yet.txt")
    elif kind == "hard link":
        os.link(theirs, lock)
    elif kind == "other content":
        lock.write_text("precious")
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(ConfigError, match=rf"store.path: {lock} is .*hookrun never follows, truncates or writes a "
                                          "lock it did not make"):
        FileLock(store).acquire()
    assert theirs.read_text() == "precious" and not (tmp_path / "not-yet.txt").exists()
    assert kind != "other content" or lock.read_text() == "precious"


def test_a_lock_hookrun_made_is_taken_again(tmp_path):
    (tmp_path / "s.zarr").mkdir()
    (tmp_path / "s.zarr" / LOCK_NAME).write_text("")  # made, then its process was killed before writing
    FileLock(tmp_path / "s.zarr").acquire().release()
    record = json.loads((tmp_path / "s.zarr" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid()
    FileLock(tmp_path / "s.zarr").acquire().release()  # a record of an earlier run


@pytest.mark.parametrize("mode", ["create", "overwrite", "resume"])
def test_a_store_whose_lock_links_to_your_file_is_refused_before_any_work(tmp_path, mode):
    path, theirs = tmp_path / "s.zarr", tmp_path / "theirs.txt"
    theirs.write_text("precious")
    if mode == "create":
        path.mkdir()
    else:
        interrupted_store(path)
        (path / LOCK_NAME).unlink()
    (path / LOCK_NAME).symlink_to(theirs)
    before = files(path)
    with pytest.raises(ConfigError) as err:
        run_in(path, [*RANDOM, f"store.mode={mode}"])
    assert f"store.path: {path} is damaged, {LOCK_NAME}: a symbolic link to {theirs}" in str(err.value)
    assert theirs.read_text() == "precious" and files(path) == before


# -- 2, 3. a store holding a symbolic link (index dir, group, array, chunk) is damaged: refused, nothing followed ------
@pytest.mark.parametrize("mode", ["overwrite", "resume"])
@pytest.mark.parametrize("where", ["_index", "acts", "acts/fc1/output", "acts/fc1/output/c.0.0"])
def test_a_store_holding_a_symlink_is_refused_and_nothing_outside_changes(tmp_path, where, mode):
    path = tmp_path / "s.zarr"
    interrupted_store(path)
    mine = users_dir(tmp_path)
    target = mine / "moved"
    os.rename(path / where, target)  # the store's own files now live in the user's dir, beside theirs
    (path / where).symlink_to(target, target_is_directory=target.is_dir())
    before, inside = files(mine), files(path)
    with pytest.raises(ConfigError) as err:
        run_in(path, [*RANDOM, f"store.mode={mode}"])
    assert f"store.path: {path} is damaged, {where}: a symbolic link to {target}; hookrun never writes or deletes " \
           "through a link inside a store: remove the link" in str(err.value)
    assert files(mine) == before and files(path) == inside


@pytest.mark.parametrize("mode", ["overwrite", "resume"])
def test_a_group_linked_to_your_own_zarr_group_is_refused(tmp_path, mode):
    """The link points to a directory that already holds the user's own zarr group (zarr.json and an array)."""
    path = tmp_path / "s.zarr"
    interrupted_store(path)
    mine = users_dir(tmp_path)
    own = mine / "own.zarr"
    zarr.open_group(str(own), mode="r+").attrs["mine"] = True
    os.rename(path / "acts", tmp_path / "old-acts")
    (path / "acts").symlink_to(own, target_is_directory=True)
    before = files(mine)
    with pytest.raises(ConfigError, match=r"is damaged, acts: a symbolic link to .*own.zarr"):
        run_in(path, [*RANDOM, f"store.mode={mode}"])
    assert files(mine) == before


def test_resume_leaves_your_files_in_the_index_dir(tmp_path):
    """The clean-up of uncommitted parts and the merge at completion touch only hookrun's own index files."""
    path = tmp_path / "s.zarr"
    interrupted_store(path)
    pd.DataFrame({"note": ["mine"]}).to_parquet(path / "_index/notes.parquet")
    (path / "_index/draft.tmp").write_text("unsaved")
    (path / "_index/README.txt").write_text("read me")
    before = {n: (path / "_index" / n).read_bytes() for n in ("notes.parquet", "draft.tmp", "README.txt")}
    (path / "_index/part-000009.parquet").write_bytes(b"uncommitted")  # hookrun's: dropped
    run_in(path, [*RANDOM, "store.mode=resume"])
    cap = hookrun.open(path)
    assert cap.status == "complete" and cap.verify(decode=True) == []
    assert {n: (path / "_index" / n).read_bytes() for n in before} == before
    assert not (path / "_index/part-000009.parquet").exists()
    run_in(tmp_path / "ref.zarr", RANDOM)
    same_store(cap, hookrun.open(tmp_path / "ref.zarr"))


# -- 4. overwrite removes only what the old run wrote ------------------------------------------------------------------
@pytest.mark.slow
def test_overwrite_keeps_your_group_beside_the_hooks_and_your_notes_in_the_index(tmp_path, caplog):
    path = tmp_path / "s.zarr"
    run_in(path, [*RANDOM, "+hooks.old={kind:forward,layers:fc2}"])
    own = zarr.create_array(store=str(path / "mine"), name="x", shape=(3,), dtype="f4")
    own[:] = [1, 2, 3]
    zarr.open_group(str(path / "mine"), mode="r+").attrs["what"] = "my own analysis"
    (path / "_index/notes.txt").write_text("notes")
    pd.DataFrame({"a": [1]}).to_parquet(path / "_index/results.parquet")
    (path / "README.txt").write_text("about this run")
    kept = {k: v for k, v in files(path).items() if k.startswith(("mine/", "_index/notes", "_index/results", "README"))}
    assert len(kept) == 6
    with caplog.at_level(logging.WARNING, logger="hookrun"):
        run_in(path, [*RANDOM, "store.mode=overwrite", "data.batch_size=3"])
    assert f"overwrite: left in {path} what hookrun did not write: README.txt, mine/, _index/notes.txt, " \
           "_index/results.parquet" in caplog.text
    assert {k: v for k, v in files(path).items() if k in kept} == kept
    cap = hookrun.open(path)
    assert cap.status == "complete" and cap.verify(decode=True) == [] and not (path / "old").exists()
    assert np.array_equal(zarr.open_array(str(path / "mine/x"))[:], [1, 2, 3])
    run_in(tmp_path / "ref.zarr", [*RANDOM, "data.batch_size=3"])
    same_store(cap, hookrun.open(tmp_path / "ref.zarr"))


# -- 5. `~` is the home directory, once --------------------------------------------------------------------------------
def test_a_store_path_with_a_tilde_is_in_the_home_directory_and_resumes(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    with pytest.raises(Interrupted):
        run_in("'~/x.zarr'", RANDOM, stop_at=13)  # quoted, as Hydra needs it
    assert hookrun.open("~/x.zarr").status == "interrupted"
    run_in("'~/x.zarr'", [*RANDOM, "store.mode=resume"])
    assert list(cwd.iterdir()) == [] and sorted(p.name for p in home.iterdir()) == ["x.zarr"]
    cap = hookrun.open("~/x.zarr")
    assert cap.path == home / "x.zarr" and cap.status == "complete" and cap.verify(decode=True) == []
    run_in(tmp_path / "ref.zarr", RANDOM)
    same_store(cap, hookrun.open(tmp_path / "ref.zarr"))


# -- 6. an overwrite killed while clearing leaves a store that says so; the next overwrite finishes the job ------------
KILL_DURING_CLEARING = """
import os, signal, sys
from hookrun.storage import Location
calls = [0]
def dying(real):
    def call(self, key):
        real(self, key)
        calls[0] += 1
        if calls[0] == int(sys.argv[1]):  # right after the Nth delete of the overwrite
            os.kill(os.getpid(), signal.SIGKILL)
    return call
Location.delete, Location.delete_dir = dying(Location.delete), dying(Location.delete_dir)
from hookrun.engine.runner import run
from tests.helpers import make_cfg
run(make_cfg(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [1, 5])  # the first delete (a merged index file), the last (the hook group)
def test_an_overwrite_killed_while_clearing_is_finished_by_the_next(tmp_path, kill_after):
    path = tmp_path / "s.zarr"
    run_in(path, RANDOM)
    (path / "_index/notes.txt").write_text("notes")
    (path / "README.txt").write_text("about this run")
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_CLEARING, str(kill_after), *RANDOM,
                           "store.mode=overwrite", "data.batch_size=3", f"store.path={path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    cap = hookrun.open(path)  # it says what it is: an old run being replaced, nothing committed
    assert cap.status == "replacing" and cap.attrs["replacing_since"].startswith("20") and cap.index.empty
    for mode in ("resume", "create"):
        with pytest.raises(ConfigError) as err:
            run_in(path, [*RANDOM, f"store.mode={mode}", "data.batch_size=3"])
        assert f"store.path: {path} is being replaced (status replacing, since 20" in str(err.value)
        assert "rerun with store.mode=overwrite to finish it" in str(err.value)
    run_in(path, [*RANDOM, "store.mode=overwrite", "data.batch_size=3"])
    cap = hookrun.open(path)
    assert cap.status == "complete" and cap.verify(decode=True) == [] and "replacing_since" not in cap.attrs
    assert (path / "_index/notes.txt").read_text() == "notes" and (path / "README.txt").read_text() == "about this run"
    run_in(tmp_path / "ref.zarr", [*RANDOM, "data.batch_size=3"])
    same_store(cap, hookrun.open(tmp_path / "ref.zarr"))


# -- store.path where no store can be ----------------------------------------------------------------------------------
@pytest.mark.parametrize("where,reason", [
    ("/proc/hookrun-test.zarr", "/proc is on proc, a kernel filesystem that holds no files"),
    ("/proc/self/hookrun-test.zarr", "/proc/self is on proc, a kernel filesystem that holds no files"),
    ("/sys/hookrun-test.zarr", "/sys is on sysfs, a kernel filesystem that holds no files"),
    ("{tmp}/a-file/x.zarr", "{tmp}/a-file is not a directory"),
    ("{tmp}/a-file/deeper/x.zarr", "{tmp}/a-file is not a directory"),
])
def test_a_store_path_on_proc_or_below_a_file_is_refused_before_any_work(tmp_path, where, reason):
    if where.startswith(("/proc", "/sys")) and not Path("/proc/self/mounts").exists():
        pytest.skip("no /proc here")
    (tmp_path / "a-file").write_text("mine")
    where, reason = where.format(tmp=tmp_path), reason.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as err:
        run(make_cfg([*RANDOM, f"store.path={where}"]))
    assert f"store.path: {where} cannot be made there: {reason}; give a path in a directory you can write" \
        in str(err.value)
    assert (tmp_path / "a-file").read_text() == "mine" and not os.path.lexists(where)


# -- store.storage_options: every form, resolved, never stored ---------------------------------------------------------
@pytest.mark.parametrize("override,expected", [
    ("+store.storage_options.key=x", {"key": "x"}),
    ("++store.storage_options.key=x", {"key": "x"}),
    ("store.storage_options={key:x}", {"key": "x"}),
    ("+store.storage_options={key:x,secret:y}", {"key": "x", "secret": "y"}),
    ("+store.storage_options.client_kwargs.region_name=r", {"client_kwargs": {"region_name": "r"}}),
    ("store.storage_options=null", {}),
    ("+store.storage_options.key=${oc.env:HOOKRUN_TEST_KEY}", {"key": "from-the-environment"}),
    ("store.storage_options=x", "store.storage_options: 'x' is not a mapping of fsspec options"),
    ("store.storage_options='{key: x}'", "store.storage_options: '{key: x}' is not a mapping of fsspec options"),
    ("store.storage_options=[a]", "store.storage_options: ['a'] is not a mapping of fsspec options"),
    ("store.storage_options=1", "store.storage_options: 1 is not a mapping of fsspec options"),
    ("+store.storage_options.key=${oc.env:HOOKRUN_TEST_UNSET}",
     "store.storage_options.key: '${oc.env:HOOKRUN_TEST_UNSET}' does not resolve"),
])
def test_every_form_of_storage_options_works_or_is_refused_naming_the_key(monkeypatch, override, expected):
    monkeypatch.setenv("HOOKRUN_TEST_KEY", "from-the-environment")
    monkeypatch.delenv("HOOKRUN_TEST_UNSET", raising=False)
    cfg = make_cfg([*RANDOM, "store.path=s3://bucket/x.zarr", override])
    if isinstance(expected, dict):
        location = store_location(cfg, {})
        assert location.storage_options == expected
        assert location.fs.key == expected.get("key")  # what reached fsspec
    else:
        with pytest.raises(ConfigError) as err:
            run(cfg)
        assert str(err.value).startswith(f"1 problem(s) in the config:\n  - {expected}"), str(err.value)


def test_storage_options_without_a_plus_get_hydras_hint():
    with pytest.raises(Exception, match=r"Could not override 'store.storage_options.key'.\n"
                                        r"To append to your config use \+store.storage_options.key=x"):
        make_cfg([*RANDOM, "store.storage_options.key=x"])


def test_no_value_from_the_environment_is_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKRUN_TEST_TOKEN", "t0ken-from-env")
    path = tmp_path / "s.zarr"
    run_in(path, [*RANDOM, "+vars.token=${oc.env:HOOKRUN_TEST_TOKEN}", "+vars.url=https://x/${vars.token}",
                  "+vars.plain=${data.batch_size}"])
    assert b"t0ken-from-env" not in (path / "zarr.json").read_bytes()
    cap = hookrun.open(path)
    assert cap.config["vars"] == {"token": "${oc.env:HOOKRUN_TEST_TOKEN}", "url": "https://x/${vars.token}", "plain": 4}


@pytest.mark.slow
def test_storage_options_from_the_environment_reach_s3_and_stay_out_of_the_store(s3, tmp_path):
    url = s3.url("from-env.zarr")
    env = {"AWS_ACCESS_KEY_ID": "wrong", "AWS_SECRET_ACCESS_KEY": "wrong", "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
           "HOOKRUN_TEST_SECRET": s3.storage_options["secret"]}
    endpoint = s3.storage_options["client_kwargs"]["endpoint_url"]
    run_cli(*RANDOM, f"store.path={url}", f"hydra.run.dir={tmp_path / 'run'}",
            f"+store.storage_options.key={s3.storage_options['key']}",  # literal, on the command line
            "+store.storage_options.secret=${oc.env:HOOKRUN_TEST_SECRET}",
            f"+store.storage_options.client_kwargs={{endpoint_url:'{endpoint}',region_name:us-east-1}}",
            "+vars.token=${oc.env:HOOKRUN_TEST_SECRET}", env=env)
    location = Location(url, s3.storage_options)
    root = location.get("zarr.json")
    assert s3.storage_options["secret"].encode() not in root
    cap = hookrun.open(url, storage_options=s3.storage_options)
    assert cap.status == "complete" and cap.verify() == []
    assert cap.config["store"]["storage_options"] == dict.fromkeys(["key", "secret", "client_kwargs"], "<not stored>")
    assert cap.config["vars"]["token"] == "${oc.env:HOOKRUN_TEST_SECRET}"
    assert "+store.storage_options.key=<not stored>" in cap.attrs["overrides"]


# -- an object store outage is ridden out for store.retry_s ------------------------------------------------------------
SLOW = ["+model._target_=tests.models.Slow", "+data.inputs.x={random:normal,shape:[120,3,6,6]}", "data.batch_size=2",
        "+hooks.acts={kind:forward,layers:[conv,fc],capture:[input,output]}", "store.chunk_rows=3", "store.commit_s=0"]


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_an_object_store_outage_is_retried_for_retry_s_then_fails_as_before(s3, tmp_path):
    """SeaweedFS killed mid-run and started again ~17 s later: longer than botocore's own retries (~10-15 s)."""
    import s3fs

    run_here(tmp_path / "ref", *SLOW)
    url = s3.url("outage.zarr")
    fs = s3fs.S3FileSystem(**s3.storage_options, skip_instance_cache=True)
    probe = Location(s3.url("probe.zarr"), s3.storage_options, retry_s=2)
    probe.put("answered", b"1")
    proc = subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu(SLOW), "store.retry_s=60", f"store.path={url}",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env={**os.environ, **s3.env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not fs.exists(f"{s3.bucket}/outage.zarr/_index/batches-000005.parquet") and proc.poll() is None:
        time.sleep(0.05)
        fs.invalidate_cache()
    args = s3.proc.args
    os.killpg(s3.proc.pid, signal.SIGKILL)
    s3.proc.wait()
    down = time.monotonic()
    try:
        with pytest.raises(Exception, match="Could not connect to the endpoint URL") as err:
            probe.put("during", b"2")  # retry_s=2: fails as before, after 2 s and botocore's own retries
        assert 2 <= time.monotonic() - down < 25 and type(err.value).__name__ == "EndpointConnectionError"
        time.sleep(max(0.0, 17 - (time.monotonic() - down)))
    finally:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        s3.proc = subprocess.Popen(args, stdout=s3.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        s3._wait()
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    assert "the object store did not answer" in out and "retrying for up to 60 s (store.retry_s)" in out
    assert "the object store answers again" in out
    cap = hookrun.open(url, storage_options=s3.storage_options)
    assert cap.status == "complete" and cap.verify(decode=True) == []
    same_arrays(hookrun.open(tmp_path / "ref"), cap, fs)
