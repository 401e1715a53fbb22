"""A run as one object: what build() makes (Run), what the loop counts (RunStats), the store's opening (Store.open,
with no I/O in the constructor), the writer mode decided once, and check()'s problems by config section."""
import threading

import pytest
import torch
from omegaconf import OmegaConf

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.config.schema import StoreConfig
from hookrun.storage import Location
from hookrun.engine.build import Run, build
from hookrun.engine.checks import check
from hookrun.engine.cores import spare_core
from hookrun.engine.runner import RunStats, capture
from hookrun.store import Store, writer_mode
from hookrun.store.lock import LOCK_NAME, NoLock, store_lock
from tests.helpers import MLP, make_cfg

X = "+data.inputs.x={random:normal,shape:[10,6]}"  # 10 samples in batches of 4: 4, 4, 2


def built(path, *overrides) -> Run:
    """The Run of MLP on X into `path`, built and prepared as run() builds it (outside Hydra: no context)."""
    cfg = make_cfg([*MLP, X, "data.batch_size=4", *overrides, f"store.path={path}"])
    job = build(cfg, Location(path), {})
    job.prepare()
    return job


def test_run_stats_count_what_the_index_holds(tmp_path):
    job = built(tmp_path / "s.zarr", "store.writer=sync")
    store, stats = capture(job, job.attrs(), "sync")
    cap = hookrun.open(tmp_path / "s.zarr")
    assert cap.status == "complete" and store.next_batch == 0
    assert stats.captures == len(cap.index) == 3 * 4  # 3 batches, fc1 and fc2, input and output
    assert stats.samples == int((cap.batches.sample_stop - cap.batches.sample_start).sum()) == 10
    assert stats.batches == len(cap.batches) == 3
    sizes = {"fc1": (6, 8), "fc2": (8, 8)}  # (input, output) features
    captured = sum(n * width * 4 for n in (4, 4, 2) for a, b in sizes.values() for width in (a, b))
    assert stats.captured_bytes == captured  # float32 inputs and outputs of both layers
    timing = cap.attrs["summary"]["timing"]
    assert list(timing) == ["forward_s", "backward_s", "capture_s", "loop_s", "loop_cpu_s"] == list(stats.timing())
    assert timing["loop_s"] == stats.loop_s > 0 and timing["forward_s"] == stats.forward_s > 0
    assert timing["loop_cpu_s"] == stats.loop_cpu_s > 0
    assert list(stats.timing(closed=True)) == [*timing, "wall_s", "write_s"]


def test_run_stats_start_at_the_batch_they_resume_from():
    stats = RunStats(batches=3)
    assert (stats.batches, stats.samples, stats.captures, stats.captured_bytes) == (3, 0, 0, 0)
    assert stats.samples_before == 0 and stats.tokens == 0 and stats.startup_s is None


def test_progress_line_says_batch_rates_and_eta():
    from hookrun.engine.progress import Progress

    progress = Progress(iter(()), total=40, initial=10, every_s=0, show=False)
    line = progress.line(done=20, samples=80, tokens=2000, captured_bytes=3 * 2**20, elapsed=10.0)
    assert line == "batch 20/40 (50%), 80 samples, 200 tokens/s, 0.3 MB/s, ETA 0:00:20"  # 10 batches in 10 s, 20 left
    assert progress.line(5, 20, 0, 0, 1.0).startswith("batch 5/40 (12%), 20 samples, 0.0 MB/s")


def test_a_run_holds_what_was_built_for_it(tmp_path):
    job = built(tmp_path / "s.zarr")
    assert isinstance(job.model, torch.nn.Module) and not job.model.training  # mode=eval
    assert job.device == torch.device("cpu") and next(job.model.parameters()).device == job.device
    assert [p.name for p in job.plans] == ["acts"] and job.loss_fn is None and job.share is None
    assert job.inputs.batch_count() == 3 and job.where == tmp_path / "s.zarr"
    assert job.attrs()["config"]["seed"] == job.cfg.seed and job.attrs()["device"] == "cpu"
    assert not (tmp_path / "s.zarr").exists()  # building and the first-batch check write nothing


def test_hooked_turns_gradients_on_only_with_a_loss(tmp_path):
    seen = []
    for loss in ([], ["loss=sum"]):
        job = built(tmp_path / f"{len(loss)}.zarr", *loss)
        with job.hooked(lambda capture: None):
            seen.append(torch.is_grad_enabled())
    assert seen == [False, True]


def store_cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(StoreConfig), kw)


def test_constructing_a_store_touches_nothing_and_open_opens_it(tmp_path):
    path = tmp_path / "s.zarr"
    threads = threading.active_count()
    store = Store(Location(path), store_cfg(), "thread")
    assert not path.exists() and not tmp_path.joinpath(LOCK_NAME).exists()  # no directory, no lock file
    assert isinstance(store.lock, NoLock) and store.root is None and store.queue is None
    assert threading.active_count() == threads  # no writer thread either
    store = Store.open(path, store_cfg(), {"config_hash": "h"}, "thread")
    assert (path / "zarr.json").exists() and (path / LOCK_NAME).exists() and (path / "_index").is_dir()
    assert store.queue.thread is not None and store.root.attrs["status"] == "running"
    store.close("complete")
    assert hookrun.open(path).status == "complete"


def test_a_store_that_cannot_be_opened_releases_its_lock(tmp_path):
    path = tmp_path / "s.zarr"
    path.mkdir()
    (path / "notes.txt").write_text("mine")  # not a hookrun store: refused, and the lock is let go
    with pytest.raises(ConfigError, match="store.path"):
        Store.open(path, store_cfg(), {"config_hash": "h"}, "sync")
    store_lock(Location(path)).acquire().release()  # free: this process's own lock would refuse it
    assert (path / "notes.txt").read_text() == "mine"


def test_the_writer_mode_is_decided_once(tmp_path, monkeypatch):
    monkeypatch.setattr("hookrun.engine.cores.load", lambda: 0.0)  # the machine's load held still between the calls
    with pytest.raises(ValueError, match="auto"):  # the store takes a decided mode, never decides one itself
        Store(Location(tmp_path / "s.zarr"), store_cfg(writer="auto"), "auto")
    job = built(tmp_path / "s.zarr", "store.writer=auto")
    decided = job.writer_mode()
    assert decided == writer_mode("auto", "cpu", True, spare_core(1))
    store, _ = capture(job, job.attrs(), decided)
    assert store.writer == decided == hookrun.open(tmp_path / "s.zarr").attrs["summary"]["writer"]
    assert built(tmp_path / "t.zarr", "store.writer=thread").writer_mode() == "thread"


def test_check_files_each_problem_under_its_config_section():
    cfg = make_cfg(["+hooks.acts={kind:forward,layers:[fc1]}", "seed=-1", "data.batch_size=0", "+store.bogus=1"])
    checked = check(cfg)
    sections = {section for section, _ in checked.found}
    assert {"model", "seed", "data", "store"} <= sections and "hooks" not in sections
    assert checked.problems == [p for _, p in checked.found]
    assert any(p.startswith("store.bogus") for p in checked.problems)
    assert not checked.clean("model") and not checked.clean("data", "loss") and checked.clean("loss", "hooks")
    with pytest.raises(ConfigError) as err:  # build() reports them all, building neither model nor inputs
        build(cfg, None, {})
    assert err.value.problems == checked.problems
