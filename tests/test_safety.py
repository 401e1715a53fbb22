"""Data safety: overwrite never deletes a user's files, one writer per store, resume refuses damage and
encoding changes, commits keep what they promise, dataset randomness replays, signals end runs cleanly."""
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zarr

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.store.lock import store_lock
from hookrun.format.layout import COMMITTED
from hookrun.storage import Location
from hookrun.engine.runner import run
from tests.helpers import (MLP, RANDOM, REPO, SLOW, interrupted_store, launch, make_cfg, on_cpu, run_cli, run_here,
                           run_in, same_store)

# -- 1. overwrite only ever replaces a hookrun store --------------------------------------------------------
def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work")
    (mine / "data").mkdir()
    for mode in ("overwrite", "create", "resume"):
        with pytest.raises(ConfigError) as err:
            run_in(mine, [*RANDOM, f"store.mode={mode}"])
        msg = str(err.value)
        assert f"store.path: {mine} exists and is not a hookrun store (it holds chapter1.tex, data/)" in msg
        assert "store.mode=overwrite" not in msg and "choose another store.path" in msg
    assert sorted(p.name for p in mine.iterdir()) == ["chapter1.tex", "data"]
    assert (mine / "chapter1.tex").read_text() == "years of work"


def test_overwrite_of_the_working_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("keep")
    proc = run_cli("+experiment=conv_fmaps", "store.mode=overwrite", "store.path=.", cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "store.path: . exists and is not a hookrun store (it holds" in out
    assert "notes.txt" in out and "outputs/" in out  # Hydra's output dir is the user's too
    assert (tmp_path / "notes.txt").read_text() == "keep"


def test_overwrite_replaces_a_store_and_leaves_foreign_files(tmp_path):
    path = tmp_path / "s.zarr"
    run_in(path, RANDOM)
    (path / "README.txt").write_text("my notes about this run")
    run_in(path, [*RANDOM, "store.mode=overwrite", "data.batch_size=3"])
    cap = hookrun.open(path)
    assert cap.status == "complete" and cap.config["data"]["batch_size"] == 3 and len(cap.batches) == 8
    assert (path / "README.txt").read_text() == "my notes about this run"
    assert cap.verify() == []


# -- 2. resume keeps the encoding --------------------------------------------------------------------------
def test_resume_with_other_store_encoding_is_refused(tmp_path):
    path = tmp_path / "s.zarr"
    interrupted_store(path)
    with pytest.raises(ConfigError) as err:
        run_in(path, [*RANDOM, "store.mode=resume", "store.codec=none", "store.chunk_rows=7"])
    msg = str(err.value)
    assert "resume refused" in msg and "store.codec: 'lz4' -> 'none'" in msg and "store.chunk_rows: 5 -> 7" in msg
    assert hookrun.open(path).status == "interrupted"  # untouched
    run_in(path, [*RANDOM, "store.mode=resume", "store.commit_s=1", "store.queue_mb=8"])  # these may change
    assert hookrun.open(path).status == "complete"


# -- 3. one writer per store -----------------------------------------------------------------------------
def test_a_held_lock_refuses_a_second_writer_before_it_writes(tmp_path):
    path = tmp_path / "s.zarr"
    interrupted_store(path)
    before = {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.name != ".hookrun.lock"}
    with store_lock(Location(path)):
        with pytest.raises(ConfigError, match=rf"store.path: {path} is being written by another run "
                                              rf"\(pid {os.getpid()} on .*, started 20"):
            run_in(path, [*RANDOM, "store.mode=resume"])
    assert before == {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.name != ".hookrun.lock"}
    run_in(path, [*RANDOM, "store.mode=resume"])  # the lock is free again
    assert hookrun.open(path).status == "complete"


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_two_resumes_of_one_killed_store_one_wins(tmp_path):
    run_here(tmp_path / "ref", *SLOW)
    run_dir = tmp_path / "killed"
    proc = launch(run_dir)
    while not (run_dir / "captures.zarr/_index/batches-000003.parquet").exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with ThreadPoolExecutor(2) as pool:  # the killed run's lock file is there: it must not block them
        procs = list(pool.map(lambda _: run_cli(*SLOW, "store.mode=resume", f"hydra.run.dir={run_dir}", check=False),
                              range(2)))
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [p.stdout + p.stderr for p in procs]
    loser = next(p for p in procs if p.returncode == 2)
    assert "is being written by another run (pid" in loser.stdout + loser.stderr
    same_store(hookrun.open(run_dir), hookrun.open(tmp_path / "ref"))


@pytest.mark.slow
def test_two_creates_at_once_one_is_refused_and_launches_get_their_own_dirs(tmp_path):
    store = tmp_path / "one.zarr"
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda _: run_cli("+experiment=conv_fmaps", f"store.path={store}", cwd=tmp_path,
                                                check=False), range(2)))
    assert sorted(p.returncode for p in procs) == [0, 2]
    loser = next(p for p in procs if p.returncode == 2).stdout
    assert "is being written by another run" in loser or "already holds a hookrun run" in loser
    assert "Traceback" not in loser and hookrun.open(store).verify() == []
    run_dirs = sorted(p.name for p in (tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 2  # launched in the same second, each kept its own .hydra/


def test_a_store_created_while_the_path_is_checked_reads_as_a_store(tmp_path, monkeypatch):
    """The check before the lock races a run creating the store: what it lists, it must read as a store."""
    from hookrun.store.place import check_path
    path = tmp_path / "s.zarr"
    run_in(tmp_path / "made.zarr", RANDOM)
    path.mkdir()
    (path / f"zarr.{'ab' * 16}.partial").write_bytes(b"{")  # zarr's temp file of a metadata write in flight
    assert check_path(Location(str(path)), "create", "h", {}) == []
    listing = Location.children

    def children_then_the_other_run_writes(self, *args):
        names = listing(self, *args)
        (path / "zarr.json").write_bytes((tmp_path / "made.zarr/zarr.json").read_bytes())
        return names + ["zarr.json"]
    monkeypatch.setattr(Location, "children", children_then_the_other_run_writes)
    problems = check_path(Location(str(path)), "create", "h", {})
    assert len(problems) == 1 and "already holds a hookrun run" in problems[0], problems


# -- 4. damaged stores are found, not resumed to complete --------------------------------------------------
@pytest.mark.parametrize("damage,expected", [
    (lambda p: (p / "acts/fc1/output/c.1.0").unlink(), "acts/fc1/output/c.1.0: chunk missing"),
    (lambda p: (p / "acts/fc2/output/c.0.0").write_bytes((p / "acts/fc2/output/c.0.0").read_bytes()[:20]),
     "acts/fc2/output/c.0.0: chunk is 20 bytes but"),
    (lambda p: (p / "_index/part-000001.parquet").unlink(), "_index/part-000001.parquet: missing"),
    (lambda p: __import__("shutil").rmtree(p / "acts/fc1/output"), "acts/fc1/output: array missing"),
])
def test_damaged_store_is_refused_by_resume_and_named_by_verify(tmp_path, damage, expected):
    path = tmp_path / "s.zarr"
    cap = interrupted_store(path)
    assert cap.verify() == [] and len(cap.batches) == 3  # items 0..11 loaded; 13 stopped batch 3
    damage(path)
    assert any(expected in p for p in hookrun.open(path).verify()), hookrun.open(path).verify()
    with pytest.raises(ConfigError) as err:
        run_in(path, [*RANDOM, "store.mode=resume"])
    assert "is damaged" in str(err.value) and expected in str(err.value)
    assert hookrun.open(path).status == "interrupted"


def test_a_write_cut_by_a_signal_leaves_no_temp_file_and_resume_drops_a_killed_runs(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"
    cap = interrupted_store(path)
    chunk = path / "acts/fc1/output/c.0.0"
    before = chunk.read_bytes()

    def signal_mid_write(*args, **kwargs):
        raise KeyboardInterrupt  # what the SIGINT handler raises, here between the temp file and the rename
    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", signal_mid_write)
        with pytest.raises(KeyboardInterrupt):
            Location(str(path)).put("acts/fc1/output/c.0.0", b"new")
    assert chunk.read_bytes() == before and not list(path.rglob("*.partial"))
    killed = [path / "acts/fc1/output/c.9.0.4242.partial", path / "_index/part-000009.parquet.4242.partial",
              path / f"zarr.{'0f' * 16}.partial"]  # left by writers killed with SIGKILL mid-write
    mine = [path / "acts/notes.partial", path / "acts/fc1/output/c.0.0.draft.partial"]  # not hookrun's names
    for f in killed + mine:
        f.write_bytes(b"x")
    assert len(cap.batches) == 3
    run_in(path, [*RANDOM, "store.mode=resume"])
    assert hookrun.open(path).status == "complete" and hookrun.open(path).verify(decode=True) == []
    assert not any(f.exists() for f in killed) and all(f.read_bytes() == b"x" for f in mine)


def test_a_run_stopped_before_its_first_commit_resumes_from_batch_0_and_says_so(tmp_path, caplog):
    path = tmp_path / "s.zarr"
    interrupted_store(path)
    zarr.open_group(str(path), mode="r+").attrs["committed_parts"] = 0  # as a kill before the first commit leaves it
    cap = hookrun.open(path)
    assert cap.batches.empty and cap.batches.columns.tolist()[:3] == ["batch", "sample_start", "sample_stop"]
    with caplog.at_level(logging.INFO, logger="hookrun"):
        run_in(path, [*RANDOM, "store.mode=resume"])
    assert f"resuming {path} after its last committed batch: starting at batch 0\n" in caplog.text
    run_in(tmp_path / "ref.zarr", RANDOM)
    same_store(hookrun.open(path), hookrun.open(tmp_path / "ref.zarr"))


def test_verify_of_a_complete_store_checks_every_chunk(tmp_path):
    path = tmp_path / "s.zarr"
    run_in(path, RANDOM)
    cap = hookrun.open(path)
    assert cap.verify() == [] and cap.verify(decode=True) == []
    chunk = path / "acts/fc2/output/c.2.0"
    chunk.write_bytes(chunk.read_bytes()[:-1])
    assert hookrun.open(path).verify() == [f"acts/fc2/output/c.2.0: chunk is {chunk.stat().st_size} bytes but "
                                           f"{chunk.stat().st_size + 1} were committed (truncated or rewritten)"]


# -- 5. commits keep what they promise -----------------------------------------------------------------------
@pytest.mark.slow
def test_small_captures_commit_without_filling_a_chunk(tmp_path):
    """Reduced captures of 1 MB chunks never fill one: the batches still commit every commit_s."""
    small = ["+model._target_=tests.models.Slow", "+data.inputs.x={random:normal,shape:[400,3,6,6]}",
             "data.batch_size=2", "+hooks.acts={kind:forward,layers:[conv],reduce:{op:mean,dims:spatial}}",
             "store.commit_s=0.2"]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu(small), f"hydra.run.dir={run_dir}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    index = run_dir / "captures.zarr/_index"
    while not (index / "batches-000002.parquet").exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cap = hookrun.open(run_dir)
    assert cap.status == "running" and cap.verify() == []
    committed = len(cap.batches)
    assert 3 <= committed < 200
    assert cap.array("acts/conv/output").chunks[0] == 400  # one chunk for the whole run, still partial
    data = cap.load(layer="conv", role="output")[:2 * committed]
    rows = cap.rows(layer="conv", role="output")
    assert rows.row_stop.max() == 2 * committed
    for row in rows.itertuples():
        assert np.isclose(float(data[row.row_start:row.row_stop].mean()), row.mean, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_uncommitted_index_rows_stay_bounded(tmp_path):
    from hookrun.store import Store

    seen = []
    original = Store._commit

    def spy(self):
        seen.append(len(self.index.rows))
        original(self)
    Store._commit = spy
    try:
        run_in(tmp_path / "s.zarr", [*MLP, "+data.inputs.x={random:normal,shape:[150,6]}", "data.batch_size=1",
                                     "store.commit_s=0", "store.writer=sync"])
    finally:
        Store._commit = original
    assert max(seen) == 4  # one batch's rows (fc1, fc2: input, output) wait at most, never the run's 600


# -- 6. dataset randomness replays on resume -----------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_replays_a_random_dataset(tmp_path, workers):
    """Items drawn from torch's RNG in __getitem__: a run stopped at batch 3 and resumed (with items loaded
    in DataLoader workers or not) holds the same samples as one uninterrupted run."""
    run_in(tmp_path / "ref.zarr", [*RANDOM, f"data.num_workers={workers}"])
    ref = hookrun.open(tmp_path / "ref.zarr")
    cap = interrupted_store(tmp_path / "s.zarr", [*RANDOM, "data.num_workers=0"])  # SIGTERM from the main process
    assert len(cap.batches) == 3
    with pytest.raises(ConfigError, match="data.num_workers: 0 -> 2") if workers else contextlib.nullcontext():
        run_in(tmp_path / "s.zarr", [*RANDOM, f"data.num_workers={workers}", "store.mode=resume"])
    if workers:  # num_workers is part of the config: resume with the same, then compare across worker counts
        run_in(tmp_path / "s.zarr", [*RANDOM, "data.num_workers=0", "store.mode=resume"])
    same_store(hookrun.open(tmp_path / "s.zarr"), ref)
    x = ref.load(layer="fc1", role="input.0")
    assert x.shape == (24, 6) and not np.allclose(x[0], x[4] - 4)  # really random items


# -- 7. signals end a run like any other failure -------------------------------------------------------------
def _committed(store) -> int:
    """The committed parts the store's root says (0 while it is not there or being rewritten)."""
    try:
        return int(json.loads((store / "zarr.json").read_text())["attributes"].get(COMMITTED, 0))
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_signal_commits_finished_batches_and_says_how_to_resume(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu(SLOW), f"hydra.run.dir={run_dir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while _committed(run_dir / "captures.zarr") < 3 and proc.poll() is None:  # batches 0..2 committed
        time.sleep(0.02)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if "interrupted by" in line]
    assert len(lines) == 1 and f"interrupted by {sig.name} after batch" in lines[0]
    assert "continue with the same command plus store.mode=resume" in lines[0]
    cap = hookrun.open(run_dir)
    assert cap.status == "interrupted" and cap.verify() == []
    done = len(cap.batches)
    assert done >= 3 and cap.batches.batch.tolist() == list(range(done))
    run_here(run_dir, *SLOW, "store.mode=resume")
    resumed = hookrun.open(run_dir)
    assert resumed.status == "complete" and len(resumed.batches) == 60 and resumed.verify(decode=True) == []


# -- 8, 9. unknown keys and checks that come before any work ------------------------------------------------
EARLY = [  # (overrides, what the message says)
    ([*RANDOM, "+foo=1"], "foo: unknown key"),
    ([*RANDOM, "+store.compresion=zstd"], "store.compresion: unknown key; store takes path, storage_options, mode, codec"),
    ([*RANDOM, "+data.shuffle=true"], "data.shuffle: unknown key; data takes inputs, dataset"),
    ([*RANDOM, "store.chunk_mb=nan"], "store.chunk_mb: nan is not a finite number"),
    ([*RANDOM, "store.chunk_mb=inf"], "store.chunk_mb: inf is not a finite number"),
    ([*RANDOM, "store.chunk_mb=1e9"], "store.chunk_mb: 1000000000.0 is too large; give a number in (0, 2048]"),
    ([*RANDOM, "store.commit_s=nan"], "store.commit_s: nan is not a finite number"),
    ([*RANDOM, "store.min_saving=1.5"], "store.min_saving: 1.5 is too large; give a number in [0, 1)"),
    ([*RANDOM, "store.min_saving=nan"], "store.min_saving: nan is not a finite number"),
    ([*RANDOM, "store.writer=threads"], "store.writer: 'threads' is unknown; use one of auto, thread, sync (did you mean: thread"),
    ([*RANDOM, "data.num_workers=-1"], "data.num_workers: -1 is too small; give an integer in [0, 1024]"),
    ([*RANDOM, "seed=-3"], "seed: -3 is too small"),
    ([*RANDOM, "seed=9223372036854775807"], "seed: 9223372036854775807 is too large"),
    ([*RANDOM, "+hooks.acts.edit=[{op:scale,value:abc}]"], "hooks.acts.edit[0].value: 'abc' is not a number"),
    ([*RANDOM, "+hooks.acts.edit=[{op:zero,dim:x}]"], "hooks.acts.edit[0].dim: 'x' is not an integer dim"),
    ([*RANDOM, "+hooks.acts.edit=[{op:replace,store:/nowhere/run}]"],
     "hooks.acts.edit[0].store: '/nowhere/run' is not a hookrun store or run dir"),
    ([*RANDOM, "+hooks={zarr.json:{kind:forward,layers:fc1}}"], "hooks.zarr.json: 'zarr.json' cannot name a store group"),
    ([*MLP, "+data.dataset._target_=tests.models.EmptyItems"], "data.dataset: EmptyItems has no items (len 0)"),
    ([*MLP, "+data.dataset._target_=tests.models.TupleItems", "data.batch_size=2"],
     "data: MLP.forward(x) cannot take the first batch (input.0 [2, 6] float32, input.1 [2] int64)"),
    ([*MLP, "+data.dataset._target_=tests.models.NoneItems", "data.batch_size=2"],
     "data: the first batch does not load (TypeError: default_collate: batch must contain tensors"),
    ([*MLP, "+data.dataset._target_=tests.models.Ragged", "data.batch_size=2"],
     "data: the first batch does not load (RuntimeError: stack expects each tensor to be equal size"),
    ([*MLP, "+data.inputs.x={random:randint,high:5,shape:[4,6]}"],
     "data: the first batch (input.0 [1, 6] int64) does not fit MLP: RuntimeError: mat1 and mat2 must have the same dtype"),
]


@pytest.mark.parametrize("overrides,expected", EARLY, ids=[e[1][:40] for e in EARLY])
def test_bad_input_is_refused_before_any_work(tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as err:
        run_in(tmp_path / "s.zarr", overrides)
    assert expected in str(err.value)
    assert not (tmp_path / "s.zarr").exists()


def test_a_model_that_needs_the_whole_batch_passes_the_first_batch_check(tmp_path):
    """The check runs the first sample alone, and the whole first batch only when that fails."""
    x = np.random.default_rng(13).standard_normal((8, 6)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    run_in(tmp_path / "s.zarr", ["+model._target_=tests.models.BatchStandardized",
                                 f"+data.inputs.x={{file: '{tmp_path / 'x.npy'}'}}", "data.batch_size=4",
                                 "+hooks.a={kind:forward,layers:fc1}"])
    from tests.models import BatchStandardized
    torch.manual_seed(0)
    model = BatchStandardized()
    with torch.no_grad():  # batch by batch, as the run computed them
        expected = torch.cat([model.fc1(torch.from_numpy(x[i:i + 4])) for i in (0, 4)]).numpy()
    np.testing.assert_array_equal(hookrun.open(tmp_path / "s.zarr").load(layer="fc1", role="output"), expected)


def test_a_hook_name_with_a_backslash_is_refused(tmp_path):
    from omegaconf import open_dict

    cfg = make_cfg([*RANDOM, f"store.path={tmp_path / 's.zarr'}"])
    with open_dict(cfg):
        cfg.hooks["a\\b"] = {"kind": "forward", "layers": "fc1"}  # as a YAML file can spell it
    with pytest.raises(ConfigError) as err:
        run(cfg)
    assert "hooks.a\\b: 'a\\\\b' cannot name a store group" in str(err.value)
    assert not (tmp_path / "s.zarr").exists()


def test_tuple_items_fix_names_the_keys(tmp_path):
    with pytest.raises(ConfigError) as err:
        run_in(tmp_path / "s.zarr", [*MLP, "+data.dataset._target_=tests.models.TupleItems"])
    assert "data.targets=[...]" in str(err.value) and "data.fields=[...]" in str(err.value)
    run_in(tmp_path / "s.zarr", [*MLP, "+data.dataset._target_=tests.models.TupleItems", "data.fields=[x,label]",
                                 "data.targets=[label]"])
    assert hookrun.open(tmp_path / "s.zarr").load(layer="fc1", role="output").shape == (8, 8)


def test_edit_along_a_missing_dim_names_hook_layer_and_dim(tmp_path):
    """Found by the first-batch check: refused before the store exists (it failed after, before issue 17)."""
    with pytest.raises(ConfigError, match=r"hooks.acts.edit\[0\].dim: zero along dim 3 of fc1 output \(shape \[4, 8\] "
                                          r"float32\) in batch 0 \(samples 0..4\), which it lacks; use a dim in 1..1"):
        run_in(tmp_path / "s.zarr", [*RANDOM, "+hooks.acts.edit=[{op:zero,dim:3,index:0}]"])
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("args,expected", [
    (["+experiment=nope"], "Could not find 'experiment/nope'"),
    (["+experiment=conv_fmaps", "layers=[conv1"], "no viable alternative at input '[conv1'"),
])
def test_hydra_errors_exit_2(tmp_path, args, expected):
    proc = run_cli(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and expected in proc.stderr + proc.stdout


def test_a_dataset_without_len_gives_the_same_batches_as_one_with_len(tmp_path):
    """Stride and max_samples cut the same samples, and each batch is seeded the same way, read in order or not."""
    over = [*RANDOM, "data.stride=2", "data.max_samples=7", "data.batch_size=3"]
    run_in(tmp_path / "map.zarr", over)
    run_in(tmp_path / "iter.zarr", [*over, "data.dataset._target_=tests.models.RandomStream"])
    a, b = hookrun.open(tmp_path / "map.zarr"), hookrun.open(tmp_path / "iter.zarr")
    assert a.batches[["sample_start", "sample_stop"]].values.tolist() == [[0, 3], [6, 9], [12, 13]]
    assert b.batches[["sample_start", "sample_stop"]].values.tolist() == [[0, 3], [6, 9], [12, 13]]
    np.testing.assert_array_equal(a.load(layer="fc1", role="input.0"), b.load(layer="fc1", role="input.0"))
