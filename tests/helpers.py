"""Helpers the test modules share (no test module imports another): run the CLI or a config, standard runs, and
store comparisons."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from hookrun.config.schema import register_configs

REPO = Path(__file__).resolve().parents[1]
register_configs()  # the schemas make_cfg composes against (in a test's subprocess too)

MLP = ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1,fc2],capture:[input,output]}"]
RANDOM = [*MLP, "+data.dataset._target_=tests.models.RandomItems", "data.batch_size=4",
          "store.chunk_rows=5", "store.commit_s=0"]  # 24 items drawn at load time: 6 batches of 4
SLOW = ["+model._target_=tests.models.Slow", "+data.inputs.x={random:normal,shape:[120,3,6,6]}",
        "data.batch_size=2", "+hooks.acts={kind:forward,layers:[conv,fc],capture:[input,output]}",
        "+hooks.g={kind:output_grad,layers:conv}", "loss=sum", "store.chunk_rows=3", "store.commit_s=0"]


def run_cli(*args, cwd=None, check=True, env=None):
    """`python -m hookrun ARGS` as a user types it; returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "hookrun", *args], cwd=cwd or REPO, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"hookrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def make_cfg(overrides):
    """The config `python -m hookrun OVERRIDES` would run."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_here(run_dir, *overrides):
    """The run `python -m hookrun OVERRIDES hydra.run.dir=RUN_DIR` makes, in this process (no interpreter to
    start): for reference runs and resumes where the CLI itself is not what a test is about."""
    from hookrun.engine.runner import run

    return run(make_cfg([*overrides, f"store.path={run_dir}/captures.zarr"]))


def run_in(path: Path, overrides, stop_at=None):
    """Run in process into `path`; with stop_at, the dataset sends SIGTERM while loading that item."""
    from hookrun.engine.runner import run

    if stop_at is not None:
        os.environ["HOOKRUN_TEST_STOP_AT"] = str(stop_at)
    try:
        return run(make_cfg([*overrides, f"store.path={path}"]))
    finally:
        os.environ.pop("HOOKRUN_TEST_STOP_AT", None)


def interrupted_store(path: Path, overrides=RANDOM, stop_at=13):
    """A store of `overrides` stopped by SIGTERM while loading item `stop_at` (interrupted, resumable)."""
    import hookrun
    from hookrun.engine.runner import Interrupted

    with pytest.raises(Interrupted):
        run_in(path, overrides, stop_at=stop_at)
    cap = hookrun.open(path)
    assert cap.status == "interrupted"
    return cap


def launch(run_dir, *extra):
    """`python -m hookrun SLOW EXTRA` started into run_dir, output discarded; returns the Popen."""
    return subprocess.Popen([sys.executable, "-m", "hookrun", *SLOW, *extra, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def same_store(a, b):
    """Arrays bitwise equal (chunk files too) and the index equal; batch timings excepted."""
    assert a.index.equals(b.index)
    cols = ["batch", "sample_start", "sample_stop", "loss"]
    assert a.batches[cols].equals(b.batches[cols])
    for key in a.index.array.unique():
        np.testing.assert_array_equal(a.array(key)[:], b.array(key)[:])
        files = sorted(p.relative_to(a.path) for p in (a.path / key).glob("c.*"))
        assert files == sorted(p.relative_to(b.path) for p in (b.path / key).glob("c.*"))
        assert all((a.path / f).read_bytes() == (b.path / f).read_bytes() for f in files)


def without_run_ids(node):
    """A parsed zarr.json without its run ids (each run makes its own: hookrun.format.layout.RUN_ID)."""
    if isinstance(node, dict):
        return {k: without_run_ids(v) for k, v in node.items() if k != "run_id"}
    if isinstance(node, list):
        return [without_run_ids(v) for v in node]
    return node


def same_bytes(a: Path, b: Path) -> bool:
    """Two store files bitwise equal; metadata (zarr.json) equal but for the run ids."""
    if a.name == "zarr.json":
        import json

        return without_run_ids(json.loads(a.read_bytes())) == without_run_ids(json.loads(b.read_bytes()))
    return a.read_bytes() == b.read_bytes()


def same_arrays(local, remote, fs):
    """Index equal; every chunk and array metadata object bitwise equal to the local file."""
    from hookrun.store.lock import LOCK_NAME

    assert local.index.equals(remote.index)
    cols = ["batch", "sample_start", "sample_stop", "loss"]
    assert local.batches[cols].equals(remote.batches[cols])
    files = sorted(p.relative_to(local.path).as_posix() for p in local.path.rglob("*") if p.is_file()
                   and p.relative_to(local.path).parts[0] not in ("_index", LOCK_NAME, "zarr.json"))
    assert len(files) > 10
    for name in files:
        theirs, mine = fs.cat(f"{remote.path.split('://', 1)[1]}/{name}"), (local.path / name).read_bytes()
        if name.endswith("zarr.json"):  # metadata: equal but for the run ids
            import json

            theirs, mine = (without_run_ids(json.loads(m)) for m in (theirs, mine))
        assert theirs == mine, name


# Paired prompts of one token length in the bundled tokenizer: (clean, corrupt, answer), the tests' patching and
# attribution data
PAIRS = [("the hooks run on a model", "the hooks run on a store", " model"),
         ("a store of captures", "a store of hooks", " captures"),
         ("every layer writes an array", "every layer writes a model", " array"),
         ("tokens of the model", "tokens of the store", " model"),
         ("the model writes", "the store writes", " the")]


def write_pairs(path, pairs=PAIRS):
    """`pairs` as a .jsonl of {clean, corrupt, answer} records; its path."""
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x, "answer": a}) + "\n" for c, x, a in pairs))
    return path


def paired_data(path, *extra):
    """The overrides reading the paired prompts of `path` (write_pairs'), two a batch."""
    return [f"data.text.files=[{path}]", "data.text.fields={clean:clean,corrupt:corrupt}", "data.batch_size=2",
            *extra]


def block0(model, ids, metric, eps=None, replace=None):
    """(metric(logits, None), block 0's output) of one forward of a GPT-2 with plain hooks: a zero `eps` added to
    block 0's output (for its gradient), or the output replaced."""
    kept = {}

    def hook(m, a, out):
        t = out[0] if isinstance(out, tuple) else out
        kept["x"] = t.detach()
        x = replace if replace is not None else t + (eps if eps is not None else 0)
        return (x, *out[1:]) if isinstance(out, tuple) else x
    h = model.transformer.h[0].register_forward_hook(hook)
    try:
        return metric(model(input_ids=ids).logits, None), kept["x"]
    finally:
        h.remove()
