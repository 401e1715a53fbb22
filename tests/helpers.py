"""Helpers the test modules share (no test module imports another): run the CLI or a config, standard runs, and
store comparisons."""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
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


def on_cpu(args) -> list:
    """Overrides (or a command line's arguments) with device=cpu unless one names the device: the tests compare runs
    with plain PyTorch on the CPU, and device=auto takes the GPU where there is one (tests/test_cuda.py names
    device=cuda). It goes right after the last override, so that the overrides stay together (--cfg job after) and
    keep their places (a sweep's job lists them)."""
    args = list(args)
    if any(a.lstrip("+~").startswith("device=") for a in args):
        return args
    last = max((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), default=len(args) - 1)
    return [*args[:last + 1], "device=cpu", *args[last + 1:]]


def run_cli(*args, cwd=None, check=True, env=None):
    """`python -m hookrun ARGS` as a user types it, in `cwd` with `env` added; returns the CompletedProcess.

    It runs in a child forked from a process that already imported what the CLI imports (tests/cli_zygote.py):
    the same code from `__main__` on, without the interpreter's 4-5 s start-up each call. A real interpreter runs it
    where `env` sets what is read at import time (IMPORT_TIME_ENV), for Hydra's joblib launcher, and every call with
    HOOKRUN_TEST_REAL_CLI=1."""
    full = {**os.environ, **(env or {})}
    args = tuple(on_cpu(args))
    if os.environ.get("HOOKRUN_TEST_REAL_CLI") == "1" or any(k.startswith(IMPORT_TIME_ENV) for k in env or {}) \
            or "hydra/launcher=joblib" in args:  # loky's workers hang in a forked child: a fresh interpreter
        proc = subprocess.run([sys.executable, "-m", "hookrun", *args], cwd=cwd or REPO, capture_output=True,
                              text=True, env=full, timeout=300)
    else:
        proc = _forked(list(args), str(cwd or REPO), full)
    if check and proc.returncode != 0:
        raise AssertionError(f"hookrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "OPENBLAS", "TORCH", "CUDA", "HF_", "TRANSFORMERS", "TOKENIZERS", "LD_",
                   "MALLOC", "ARROW", "NUMEXPR")  # settings a library reads as it is imported: a fresh interpreter
_IDLE: list = []  # forking processes not serving a call (one more starts for each call made at the same time)
_IDLE_LOCK = threading.Lock()


def _forked(args: list, cwd: str, env: dict) -> subprocess.CompletedProcess:
    """run_cli's call through a forking process (tests/cli_zygote.py), killed after 300 s as subprocess.run's is."""
    with _IDLE_LOCK:
        zygote = _IDLE.pop() if _IDLE else None
    if zygote is None or zygote.poll() is not None:
        zygote = subprocess.Popen([sys.executable, str(REPO / "tests" / "cli_zygote.py")], cwd=REPO, 
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    command = ["python", "-m", "hookrun", *args]
    with tempfile.TemporaryDirectory(prefix="hookrun-cli-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        request = {"args": args, "cwd": cwd, "env": env, "out": str(out), "err": str(err)}
        zygote.stdin.write((json.dumps(request) + "\n").encode())
        pid = _answer(zygote, 60)["pid"]
        try:
            rc = _answer(zygote, 300)["rc"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            _answer(zygote, 60)
            raise subprocess.TimeoutExpired(command, 300) from None
        proc = subprocess.CompletedProcess(command, rc, out.read_text(errors="replace"), err.read_text(errors="replace"))
    with _IDLE_LOCK:
        _IDLE.append(zygote)
    return proc


def _answer(zygote: subprocess.Popen, timeout: float) -> dict:
    """The forking process's next answer line (unbuffered reads: select sees every byte not yet read)."""
    line = b""
    while not line.endswith(b"\n"):
        if not select.select([zygote.stdout], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("tests/cli_zygote.py", timeout)
        byte = zygote.stdout.read(1)
        if not byte:
            raise RuntimeError(f"tests/cli_zygote.py ended (exit code {zygote.wait()})")
        line += byte
    return json.loads(line)


def make_cfg(overrides):
    """The config `python -m hookrun OVERRIDES` would run."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=on_cpu(overrides))


def cli_outcome(overrides, path: Path, built: list):
    """(exit code, message, the model was built, the store exists) of `python -m hookrun OVERRIDES
    store.path=PATH`, run in this process and its error mapped as the CLI maps it; `built` is the list the test's
    model factory appends to (cleared here)."""
    from hookrun.__main__ import failure
    from hookrun.engine.runner import run

    built.clear()
    try:
        run(make_cfg([*overrides, f"store.path={path}"]))
        code, message = 0, ""
    except Exception as err:  # noqa: BLE001 - mapped as the CLI maps it
        code, message = failure(err)
    return code, message, bool(built), path.exists()


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
    return subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu([*SLOW, *extra]), f"hydra.run.dir={run_dir}"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
