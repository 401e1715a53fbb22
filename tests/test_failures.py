"""Bad input and failures through the real CLI: one clear message, non-zero exit, no complete store, no hook left."""
import logging
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pytest
import torch
import zarr

import hookrun
from hookrun.format.layout import BATCH_COLUMNS, INDEX_COLUMNS
from tests.helpers import SLOW, launch, make_cfg, run_cli, run_here, same_store

CONV = "+experiment=conv_fmaps"
BAD = [  # (id, overrides, exit code, what the message must say)
    ("layer-no-match", [CONV, "layers=conv9"], 2,
     ["hooks.fmaps.layers: 'conv9' matches no module", "did you mean: conv1"]),
    ("layer-bad-regex", [CONV, "layers='re:(('"], 2, ["hooks.fmaps.layers: 're:((' is not a valid regex"]),
    ("kind-typo", [CONV, "hooks.fmaps.kind=fowrard"], 2,
     ["hooks.fmaps.kind: 'fowrard' is unknown", "did you mean: forward"]),
    ("capture-not-a-role", [CONV, "hooks.fmaps.capture=[grad]"], 2,
     ["hooks.fmaps.capture: 'grad' is not a role of forward", "output"]),
    ("output-grad-without-loss", [CONV, "+hooks.g={kind:output_grad,layers:conv1}"], 2,
     ["hooks.g.kind: output_grad needs a backward pass but loss is null", "loss=sum"]),
    ("param-grad-without-loss", [CONV, "+hooks.g={kind:param_grad,layers:conv1.weight,edit:[{op:scale,value:2}]}"], 2,
     ["hooks.g.kind: param_grad needs a backward pass"]),
    ("hook-unknown-key", [CONV, "+hooks.x={kind:forward,layers:conv1,bogus:1}"], 2,
     ["hooks.x.bogus: unknown key", "a hook takes kind, layers"]),
    ("edit-op-typo", [CONV, "+hooks.fmaps.edit=[{op:sclae,value:2}]"], 2,
     ["hooks.fmaps.edit[0].op: 'sclae' is unknown", "did you mean: scale"]),
    ("edit-missing-value", [CONV, "+hooks.fmaps.edit=[{op:scale}]"], 2,
     ["hooks.fmaps.edit[0]: op scale needs 'value'"]),
    ("edit-extra-key", [CONV, "+hooks.fmaps.edit=[{op:scale,value:2,factor:3}]"], 2,
     ["hooks.fmaps.edit[0].factor: op scale takes no 'factor'"]),
    ("edit-target-not-callable", [CONV, "+hooks.fmaps.edit=[{_target_:tests.models.double,power:2}]"], 2,
     ["hooks.fmaps.edit[0]: tests.models.double cannot be called"]),
    ("model-target-not-importable", [CONV, "model._target_=hookrun.experiments.models.Nope"], 2,
     ["model._target_: 'hookrun.experiments.models.Nope' does not import"]),
    ("model-bad-signature", [CONV, "+model.width=3"], 2,
     ["model: hookrun.experiments.models.ConvFmapsNet(width) does not match its signature"]),
    ("dtype-unknown", [CONV, "+hooks.fmaps.dtype=float8"], 2, ["hooks.fmaps.dtype: 'float8' is unknown", "float16"]),
    ("reduce-dim-unknown", [CONV, "+hooks.fmaps.reduce={op:mean,dims:[depth]}"], 2,
     ["hooks.fmaps.reduce.dims: 'depth' is not a dim", "spatial"]),
    ("select-sample-axis", [CONV, "+hooks.fmaps.select={dim:0,index:1}"], 2,
     ["hooks.fmaps.select.dim: 0 is the sample axis"]),
    ("codec-typo", [CONV, "store.codec=lz5"], 2, ["store.codec: 'lz5' is unknown", "did you mean: lz4"]),
    ("chunk-rows-zero", [CONV, "store.chunk_rows=0"], 2, ["store.chunk_rows: 0 is too small; give an integer in [1, 1_000_000_000] or null"]),
    ("store-mode-unknown", [CONV, "store.mode=append"], 2, ["store.mode: 'append' is unknown", "resume"]),
    ("batch-size-zero", [CONV, "data.batch_size=0"], 2, ["data.batch_size: 0 is too small; give an integer in [1, 1_000_000_000]"]),
    ("max-samples-negative", [CONV, "data.max_samples=-1"], 2, ["data.max_samples: -1 is too small; give an integer in [1, 1_000_000_000] or null"]),
    ("cuda-missing", [CONV, "device=cuda:99"], 2,  # a device this machine lacks, with or without a GPU
     ["device: 'cuda:99' but " + ("there are" if torch.cuda.is_available() else "CUDA is not available here")]),
    ("device-unknown", [CONV, "device=gpu"], 2, ["device: 'gpu' is not a device"]),
    ("mode-unknown", [CONV, "mode=training"], 2, ["mode: 'training' is unknown", "eval or train"]),
    ("on-nonfinite-unknown", [CONV, "on_nonfinite=explode"], 2, ["on_nonfinite: 'explode' is unknown"]),
    ("random-kind-unknown", [CONV, "+data.inputs.bad={random:gaussian,shape:[1]}"], 2,
     ["data.inputs.bad.random: 'gaussian' is unknown"]),
    ("input-not-a-number", ["+experiment=add_one", "data.inputs.x=[1.0,'one']"], 2,
     ["data.inputs.x: 'one' is not a number"]),
    ("loss-target-unlisted", ["+experiment=linear_backward", "loss.target=label"], 2,
     ["loss.target: 'label' is not listed in data.targets"]),
    ("loss-unknown-key", ["+experiment=linear_backward", "loss=mean", "+loss.bogus=1"], 2, ["loss.bogus: unknown key"]),
    ("input-grad-on-a-layer", ["+experiment=add_one", "+hooks.ig={kind:input_grad,layers:conv1}"], 2,
     ["hooks.ig.layers: input_grad hooks the model's inputs"]),
    ("layer-name-not-a-store-key",
     ["+experiment=add_one", "model._target_=tests.models.Slashed", "layers=a/b",
      "data.inputs.x=[[1.0,2.0,3.0,4.0]]"], 2,
     ["hooks.for_hook.layers: 'a/b' cannot be a store key"]),
    ("ragged-batch",
     ["model=add_one", "+hooks.for_hook={kind:forward,layers:_model}", "+data.dataset._target_=tests.models.Ragged"], 1,
     ["data: input 'input' has per-sample shape [4] in the batch at sample 1 but [3] in the first batch"]),
    ("loss-not-scalar", ["+experiment=add_one", "+loss._target_=tests.models.no_reduce", "data.inputs.x=[1.0,2.0]"], 2,
     ["loss: tests.models.no_reduce returned [2], not a scalar; reduce it"]),
    ("hook-output-not-a-tensor",
     ["+experiment=add_one", "model._target_=tests.models.NotTensor", "layers=meta", "data.inputs.x=[[1.0]]"], 1,
     ["run failed: HookError", "layer 'meta' returned str, not a tensor"]),
    ("model-raises",
     ["+experiment=add_one", "model._target_=tests.models.Broken", "layers=fc", "data.inputs.x=[[1.0,2.0,3.0,4.0]]"], 1,
     ["run failed: RuntimeError: model exploded"]),
    ("nan-with-error", ["+experiment=add_one", "data.inputs.x=[nan]", "on_nonfinite=error"], 1,
     ["hooks.for_hook: _model input.0 in batch 0 (samples 0..1) has 1 NaN and 0 inf values", "on_nonfinite=error"]),
]


def run_in_process(args, store):
    """(exit code, message) of `python -m hookrun ARGS` as __main__ would end it, without a new process."""
    from hookrun.__main__ import failure
    from hookrun.engine.runner import run

    try:
        run(make_cfg([*args, f"store.path={store}"]))
    except Exception as err:  # noqa: BLE001 - mapped as the CLI maps it
        return failure(err)
    return 0, ""


@pytest.mark.parametrize("args,code,expected", [pytest.param(*case[1:], id=case[0]) for case in BAD])
def test_bad_input_fails_with_one_clear_message(tmp_path, args, code, expected):
    """Each case in process (the message and exit code __main__ gives); the CLI itself is tested below."""
    store = tmp_path / "s.zarr"
    got, out = run_in_process(args, store)
    assert got == code and all(text in out for text in expected), f"exit {got}, wanted {code}, {expected}:\n{out}"
    assert not (store.exists() and hookrun.open(store).status == "complete"), "store marked complete"


CLI_CASES = ["layer-no-match", "codec-typo", "hook-output-not-a-tensor", "nan-with-error"]  # exits 2, 2, 1, 1


@pytest.mark.slow
def test_bad_inputs_through_the_real_cli(tmp_path):
    """Through `python -m hookrun`: exit code 2 for config problems, 1 for run failures, no traceback."""
    assert len(BAD) >= 25 and len({case[0] for case in BAD}) == len(BAD)
    cases = [case for case in BAD if case[0] in CLI_CASES]
    assert [case[0] for case in cases] == CLI_CASES

    def one(case):
        return run_cli(*case[1], f"hydra.run.dir={tmp_path / case[0]}", check=False)
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(one, cases))
    for (_, args, code, expected), proc in zip(cases, procs):
        out = proc.stdout + proc.stderr
        assert proc.returncode == code, out
        assert "Traceback" not in out and all(text in out for text in expected), out


@pytest.mark.slow
def test_every_problem_is_reported_at_once(tmp_path):
    """Every problem that needs no model at once, before the model is built (seconds, whatever its size); those
    against the model (an unknown layer) once they are fixed."""
    proc = run_cli(CONV, "layers=conv9", "store.codec=lz5", "+hooks.fmaps.edit=[{op:scale}]", "data.batch_size=0",
                   f"hydra.run.dir={tmp_path}", check=False)
    assert proc.returncode == 2
    err = proc.stderr + proc.stdout
    assert "3 problem(s) in the config" in err
    for key in ("store.codec", "hooks.fmaps.edit[0]", "data.batch_size"):
        assert f"  - {key}" in err
    proc = run_cli(CONV, "layers=conv9", f"hydra.run.dir={tmp_path}", check=False)
    assert proc.returncode == 2 and "  - hooks.fmaps.layers" in proc.stderr + proc.stdout
    assert not (tmp_path / "captures.zarr").exists()  # nothing written before the config is right


@pytest.mark.slow
def test_existing_run_refused_and_full_traceback_on_request(tmp_path):
    run_cli(CONV, f"hydra.run.dir={tmp_path}")
    proc = run_cli(CONV, f"hydra.run.dir={tmp_path}", check=False)
    assert proc.returncode == 2 and "already holds a hookrun run (status complete); set store.mode=resume" in proc.stderr + proc.stdout
    assert hookrun.open(tmp_path).status == "complete"  # the first run is untouched
    proc = run_cli(CONV, "layers=conv9", f"hydra.run.dir={tmp_path}/x", check=False, env={"HYDRA_FULL_ERROR": "1"})
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_inspect_lists_layers_and_parameters_without_a_store(tmp_path):
    proc = run_cli(CONV, "inspect=true", f"hydra.run.dir={tmp_path}")
    out = proc.stdout
    assert "conv1       Conv2d      20      1 [1, 2, 2, 2]" in out
    assert "pool1    MaxPool2d       0      1 [1, 2, 1, 1]" in out
    assert "conv1.weight [2, 1, 3, 3]     18" in out
    assert not (tmp_path / "captures.zarr").exists()


def kill_once_written(run_dir, part: str, then_s: float = 0.0, *extra):
    """Launch SLOW into run_dir, SIGKILL it `then_s` seconds after `_index/batches-<part>.parquet` appears."""
    proc = launch(run_dir, *extra)
    while not (run_dir / "captures.zarr" / "_index" / f"batches-{part}.parquet").exists() and proc.poll() is None:
        time.sleep(0.005)
    time.sleep(then_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_kill_at_random_points_then_resume_is_bitwise_identical(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hookrun")
    run_here(tmp_path / "ref", *SLOW)
    ref = hookrun.open(tmp_path / "ref")
    assert len(ref.batches) == 60
    rng = random.Random(1234)
    # 3 random points in the ~1.8 s of batches, then once the last batch is committed (the close: merge, checks)
    for n, first_part in enumerate(["000000", "000000", "000000", "000059"]):
        run_dir = tmp_path / f"killed{n}"
        writer = f"store.writer={'thread' if n % 2 else 'sync'}"  # a kill inside the hooks, and beside them
        kill_once_written(run_dir, first_part, rng.uniform(0.0, 1.2) if first_part == "000000" else 0.0, writer)
        killed = hookrun.open(run_dir)
        if killed.status == "complete":  # the close outran the kill: nothing to resume here
            assert first_part == "000059"
            continue
        assert killed.status == "running"  # honest: not complete
        committed = killed.batches.batch.tolist()
        # 0 committed batches is a real kill point too: killed before the first commit
        assert committed == list(range(len(committed))) and len(committed) <= 60, committed
        for row in killed.index.itertuples():  # every indexed capture is on disk and readable
            assert row.batch in committed
            data = killed.read_row(row._asdict())
            assert np.isclose(float(np.mean(data)), row.mean, rtol=1e-4, atol=1e-6)
        caplog.clear()
        run_here(run_dir, *SLOW, "store.mode=resume", writer)
        assert f"starting at batch {len(committed)}\n" in caplog.text
        resumed = hookrun.open(run_dir)
        assert resumed.status == "complete"
        same_store(resumed, ref)
    caplog.clear()
    run_here(run_dir, *SLOW, "store.mode=resume")  # a complete run: nothing to do
    assert "is complete: nothing to resume" in caplog.text
    same_store(hookrun.open(run_dir), ref)


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_a_part_written_but_not_yet_committed_is_neither_read_nor_resumed_from(tmp_path, caplog):
    """A kill between a commit's files and its `committed_parts` attr: readers and resume agree on the parts."""
    caplog.set_level(logging.INFO, logger="hookrun")
    run_here(tmp_path / "ref", *SLOW)
    run_dir = tmp_path / "killed"
    kill_once_written(run_dir, "000004")
    root = zarr.open_group(str(run_dir / "captures.zarr"), mode="r+")
    parts = root.attrs["committed_parts"]
    assert parts >= 4
    root.attrs["committed_parts"] = 0  # as if killed before the first commit: empty tables, with their columns
    nothing = hookrun.open(run_dir)
    assert nothing.batches.empty and nothing.batches.columns.tolist() == BATCH_COLUMNS
    assert nothing.index.empty and nothing.index.columns.tolist() == INDEX_COLUMNS
    root.attrs["committed_parts"] = parts - 1  # the files of part parts-1 are there; its commit is not
    index_dir = run_dir / "captures.zarr" / "_index"
    committed = sorted(b for n in range(parts - 1) for b in pd.read_parquet(index_dir / f"batches-{n:06d}.parquet").batch)
    killed = hookrun.open(run_dir)
    assert killed.batches.batch.tolist() == committed == list(range(len(committed))) and killed.verify() == []
    assert set(killed.index.batch) == set(committed)
    caplog.clear()
    run_here(run_dir, *SLOW, "store.mode=resume")
    assert f"starting at batch {len(committed)}\n" in caplog.text
    same_store(hookrun.open(run_dir), hookrun.open(tmp_path / "ref"))


@pytest.mark.slow
def test_resume_with_another_config_is_refused_with_the_difference(tmp_path):
    run_dir = tmp_path / "run"
    kill_once_written(run_dir, "000000")
    proc = run_cli(*SLOW, "store.mode=resume", "seed=5", "data.batch_size=4", f"hydra.run.dir={run_dir}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "resume refused" in out
    assert "seed: 0 -> 5" in out and "data.batch_size: 2 -> 4" in out


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MB tmpfs: a real file system that fills up."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.slow
def test_disk_full_ends_the_run_cleanly(tiny_disk, tmp_path):
    big = ["+model._target_=tests.models.Slow", "+model.seconds=0", "+data.inputs.x={random:normal,shape:[4000,3,6,6]}",
           "data.batch_size=100", "+hooks.acts={kind:forward,layers:[conv],capture:[input,output]}",
           "store.codec=none", "store.chunk_rows=100", "store.commit_s=0", f"store.path={tiny_disk}/c.zarr"]
    proc = run_cli(*big, f"hydra.run.dir={tmp_path / 'run'}", check=False)  # ~8 MB of captures on 3 MB
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "No space left on device" in out and "Traceback" not in out
    cap = hookrun.open(tiny_disk / "c.zarr")
    assert cap.status in ("failed", "running")  # "running" only if even the status could not be written
    assert len(cap.batches) > 0
    x = cap.load(layer="conv", role="input.0")  # every committed capture is readable
    rows = cap.rows(layer="conv", role="input.0")
    assert len(x) >= rows.row_stop.max()
    for row in rows.itertuples():
        assert np.isclose(float(cap.read_row(row._asdict()).mean()), row.mean, rtol=1e-4, atol=1e-6)


def test_warn_on_nonfinite_keeps_going_and_counts(run_cfg, caplog):
    cap = run_cfg(["+experiment=add_one", "data.inputs.x=[[nan],[inf],[1.0]]", "data.batched=true",
                   "on_nonfinite=warn"])
    assert cap.status == "complete"
    assert cap.rows(role="input.0").nan_count.tolist() == [1, 0, 0]
    assert cap.rows(role="input.0").inf_count.tolist() == [0, 1, 0]
    assert "has 1 NaN and 0 inf values" in caplog.text


ONE_ROW = "+data.inputs.x={value:[[1.0,2,3,4,5,6]]}"


@pytest.mark.parametrize("overrides,error", [
    ([ONE_ROW, "+hooks.e={kind:forward,layers:fc1,edit:[{_target_:tests.models.explode}]}"], "edit exploded"),
    (["+data.inputs.x={value:[[nan,0,0,0,0,0]]}", "+hooks.e={kind:forward,layers:fc1}", "on_nonfinite=error"],
     "on_nonfinite=error"),
    ([ONE_ROW, "loss=sum", "+hooks.e={kind:output_grad,layers:fc2,edit:[{_target_:tests.models.explode}]}"],
     "edit exploded"),
    (["+data.inputs.x={random:normal,shape:[20000,6]}", "data.batch_size=1000", "store.chunk_rows=1000",
      "store.codec=none", "store.commit_s=0", "+hooks.e={kind:forward,layers:[fc1,fc2,act1,act2]}",
      "+hooks.f={kind:forward_pre,layers:_model}"], "No space left on device"),
])
def test_no_hook_left_after_failures(tmp_path, tiny_disk, overrides, error):
    from hookrun.capture.hooks import hook_count
    from hookrun.engine.runner import run
    from tests.models import BUILT

    BUILT.pop("f", None)
    cfg = make_cfg(["+model._target_=tests.models.tracked", "+model.name=f", "+model.cls=MLP",
                    f"store.path={tiny_disk}/s.zarr", *overrides])  # 3 MB: the last case fills it
    with pytest.raises(Exception, match=error):
        run(cfg)
    assert hook_count(BUILT["f"]) == 0
