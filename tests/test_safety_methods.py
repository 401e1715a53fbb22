"""Every method under the concurrency and kill checks (issue 36, item 7): patching, attribution (integrated
gradients), the lens with DLA, dictionaries, generation and plain hooks, each on a tiny GPT-2 over 12 samples in 6
batches. A second run on a running store is refused and the first's store ends equal to an uninterrupted run;
readers beside a running store see a prefix of its final result or are told it is still being written; a sweep
with a failing job records it, says so in its tally and collect's status; a run killed with SIGKILL at a sampled
forward resumes to a store bitwise equal to an uninterrupted run."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import hookrun
from hookrun.experiments.lm import causal_lm
from hookrun.methods.saes import SparseAutoencoder, save_saelens
from tests.helpers import REPO, on_cpu, run_cli, run_in, same_store

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 512, "n_positions": 64}
UNSET = [f"~model.{k}" for k in GPT2]
PAIRS = [("the hooks run on a model", "the hooks run on a store", " model"),
         ("a store of captures", "a store of hooks", " captures"),
         ("tokens of the model", "tokens of the store", " model"),
         ("the model writes", "the store writes", " the")] * 3
PROMPTS = ["the hooks run on a model", "a store", "every layer writes an array of captures", "tokens", "x",
           "generation is a loop", "one more line", "and the last", "a store of hooks", "the model writes",
           "tokens of the store", "every block"]
FORWARDS = {"n": 0, "store": None}  # forwards of the last model lm() built; the first made once the store existed


def lm():
    """The tiny GPT-2 of these runs. Each forward is counted (FORWARDS); with HOOKRUN_TEST_SLOW_S it sleeps that long
    first (a run slow enough to be read while it is written); with HOOKRUN_TEST_KILL_AT=N this process gets SIGKILL
    at forward N (a real kill, mid-batch); with HOOKRUN_TEST_STORE=PATH the first forward after PATH/zarr.json
    exists is noted."""
    model = causal_lm(**GPT2)
    slow = float(os.environ.get("HOOKRUN_TEST_SLOW_S", 0))
    kill = int(os.environ.get("HOOKRUN_TEST_KILL_AT", 0))
    store = os.environ.get("HOOKRUN_TEST_STORE")
    FORWARDS.update(n=0, store=None)

    def count(module, args):
        FORWARDS["n"] += 1
        if FORWARDS["store"] is None and store and os.path.exists(os.path.join(store, "zarr.json")):
            FORWARDS["store"] = FORWARDS["n"]
        if FORWARDS["n"] == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if slow:
            time.sleep(slow)
    model.register_forward_pre_hook(count)
    return model


LD = "+metrics.ld={metric:logit_diff,a:{field:answer},b:' store'}"
SITES = "{layers:[transformer.h.0,transformer.h.1],positions:last}"
METHODS = {  # name -> the overrides of its run (PAIRS_FILE, PROMPTS_FILE, SAE_DIR filled in by `method_run`)
    "patching": ["data.text.files=[PAIRS_FILE]", "data.text.fields={clean:clean,corrupt:corrupt}", "hooks.resid=null",
                 LD, f"+patching={{source:clean,target:corrupt,sites:{SITES},metric:ld}}"],
    "attribution": ["data.text.files=[PAIRS_FILE]", "data.text.fields={clean:clean,corrupt:corrupt}",
                    "hooks.resid=null", LD,
                    "+attribution={source:clean,target:corrupt,sites:{layers:[transformer.h.0,transformer.h.1],"
                    "positions:all},metric:ld,method:integrated_gradients,steps:3,verify:2}"],
    "lens": ["data.text.files=[PROMPTS_FILE]", "hooks.resid=null", "lens.sites.layers=blocks",
             "lens.sites.positions=all", "lens.top_k=4", "lens.tokens=[' the']",
             "lens.dla.tokens=[' model',' the']"],
    "dictionaries": ["data.text.files=[PROMPTS_FILE]", "hooks.resid=null", "+dictionaries={sae1:{path:SAE_DIR}}",
                     "+hooks.feats={kind:forward,layers:[transformer.h.0],dictionary:sae1,top_k:8,evaluate:true}"],
    "generation": ["data.text.files=[PROMPTS_FILE]", "layers=[transformer.h.0]", "generate.max_new_tokens=4"],
    "hooks": ["data.text.files=[PROMPTS_FILE]"],
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The pairs file, the prompts file and a SAELens folder (a ReLU SAE on block 0, about half its features fire)."""
    base = tmp_path_factory.mktemp("inputs")
    pairs, prompts = base / "pairs.jsonl", base / "prompts.txt"
    pairs.write_text("".join(json.dumps({"clean": c, "corrupt": x, "answer": a}) + "\n" for c, x, a in PAIRS))
    prompts.write_text("\n".join(PROMPTS) + "\n")
    torch.manual_seed(3)
    sae = SparseAutoencoder(GPT2["n_embd"], 48, hook_name="transformer.h.0")
    with torch.no_grad():
        sae.b_enc.normal_(std=0.5)
    save_saelens(sae, base / "sae", hook_name="transformer.h.0")
    return {"PAIRS_FILE": str(pairs), "PROMPTS_FILE": str(prompts), "SAE_DIR": str(base / "sae")}


def method_run(name, inputs, *extra):
    """The overrides of method `name`'s run: the tiny GPT-2, 6 batches of 2, a commit a batch."""
    overrides = ["+experiment=lm_tokens", "model._target_=tests.test_safety_methods.lm", *UNSET, "data.batch_size=2",
                 "store.commit_s=0", *METHODS[name], *extra]
    for key, value in inputs.items():
        overrides = [o.replace(key, value) for o in overrides]
    return overrides


def result(name, cap) -> dict:
    """What a reader of method `name` reads of a store: arrays whose first axis grows as batches commit."""
    if name == "patching":
        return {"scores": cap.grid().scores}
    if name == "attribution":
        grid = cap.read("attribution")
        return {"scores": grid.scores, "exact": grid.exact}
    if name == "lens":
        lens = cap.read("lens")
        return {"top_ids": lens.top_ids, "top_probs": lens.top_probs, "logprob": lens.logprob,
                "dla": lens.dla.parts}
    if name == "dictionaries":
        return {role: cap.load(hook="feats", role=role) for role in ("features.indices", "features.values",
                                                                      "error_norm")}
    if name == "generation":
        table = cap.generations()
        return {column: table[column].astype(str).to_numpy() for column in table.columns}
    return {"resid": cap.load(layer="transformer.h.1", role="output")}


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # tiny matrices gain nothing from more threads, and on a shared machine they spin


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


@pytest.fixture(scope="module")
def references(inputs, tmp_path_factory):
    """Each method's uninterrupted run, made on first use: {name: (its store, its forwards, the first forward made
    once the store existed)}."""
    base, made = tmp_path_factory.mktemp("references"), {}

    def reference(name):
        if name not in made:
            path = base / f"{name}.zarr"
            os.environ["HOOKRUN_TEST_STORE"] = str(path)
            try:
                torch.set_num_threads(1)
                run_in(path, method_run(name, inputs))
            finally:
                del os.environ["HOOKRUN_TEST_STORE"]
            made[name] = (path, FORWARDS["n"], FORWARDS["store"])
        return made[name]
    return reference


def same_result(name, a, b):
    """Two stores of method `name` equal bitwise (same_store) and to its reader."""
    same_store(a, b)
    mine, theirs = result(name, a), result(name, b)
    assert list(mine) == list(theirs)
    for key in mine:
        np.testing.assert_array_equal(mine[key], theirs[key], err_msg=f"{name}: {key}")


# -- kill points of every method, resumed bitwise ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_a_run_killed_at_a_sampled_forward_resumes_to_a_store_bitwise_equal_to_an_uninterrupted_run(
        name, inputs, references, tmp_path):
    """`python -m hookrun` of each method gets SIGKILL at a forward drawn (seeded) among those made once its store
    exists: at a random batch, at a random point inside it (a patched forward, an IG step, a generated token), with
    the writer thread or the writes in the loop (drawn too). Each forward takes 0.02 s more (as a real model's, so
    the writer thread keeps up with the commits). The store it leaves reads whole and is not complete; the resume
    completes it bitwise equal to the uninterrupted run."""
    ref, forwards, first = references(name)
    draw = random.Random(f"issue 36 {name}")  # seeded: the same kill point each run, whichever tests are selected
    at, writer = draw.randint(first, forwards), draw.choice(["thread", "sync"])
    path = tmp_path / "killed.zarr"
    proc = run_cli(*method_run(name, inputs, f"store.writer={writer}"), f"store.path={path}",
                   f"hydra.run.dir={tmp_path / 'run'}", check=False,
                   env={**ONE_THREAD, "HOOKRUN_TEST_KILL_AT": str(at), "HOOKRUN_TEST_SLOW_S": "0.02"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    killed = hookrun.open(path)
    assert killed.status == "running" and killed.verify() == [], (at, killed.verify())
    done = len(killed.batches)
    assert done < 6 and set(killed.index.batch) <= set(range(done))
    run_in(path, method_run(name, inputs, f"store.writer={writer}", "store.mode=resume"))
    resumed = hookrun.open(path)
    assert resumed.status == "complete" and resumed.verify(decode=True) == []
    same_result(name, resumed, hookrun.open(ref))
    print(f"{name}: killed at forward {at} of {forwards} (writer {writer}, {done} batches committed), resumed bitwise")


# -- a running store of each method: a second run refused, readers beside it ----------------------------------------
WRITING = "still being written"


def second_run(path, overrides):
    """(exit code, message) of a run into `path` in this process, mapped as the CLI maps it."""
    from hookrun.__main__ import failure

    try:
        run_in(path, overrides)
    except Exception as err:  # noqa: BLE001 - mapped as the CLI maps it
        return failure(err)
    return 0, ""


def is_prefix(name, seen: dict, final: dict) -> int:
    """Asserts each array a reader got is the first rows of the final one; returns its rows."""
    assert list(seen) == list(final), (name, list(seen))
    for key, value in seen.items():
        assert len(value) <= len(final[key]), (name, key, len(value))
        np.testing.assert_array_equal(value, final[key][:len(value)], err_msg=f"{name}: {key}")
    return max(len(v) for v in seen.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["patching", "attribution", "lens", "dictionaries"])
def test_beside_a_running_run_a_second_run_is_refused_and_readers_see_a_prefix_of_the_result(
        name, inputs, references, tmp_path):
    """`python -m hookrun` of each method, slowed to about 4 s of forwards, a commit a batch. While it runs: a second
    run into its store (overwrite, resume, create) is refused with exit 2 naming the running one; its reader and
    verify() in a loop give the first rows of the final result, or say the store is still being written. The first
    run completes, its store bitwise equal to an uninterrupted run."""
    ref, forwards, _ = references(name)
    path = tmp_path / "s.zarr"
    writer = subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu(method_run(name, inputs)), f"store.path={path}",
                               f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **ONE_THREAD, "HOOKRUN_TEST_SLOW_S": str(4.0 / forwards)})
    while not (path / "zarr.json").exists() and writer.poll() is None:
        time.sleep(0.01)
    for mode in ("overwrite", "resume", "create"):
        code, message = second_run(path, method_run(name, inputs, f"store.mode={mode}"))
        assert code == 2 and f"store.path: {path} " in message, (mode, message)
        assert "is being written by another run (pid" in message or "already holds a hookrun run" in message, message
        assert writer.poll() is None, "the first run ended before the second was refused: slow it down"
    rounds, checks = [], []
    while writer.poll() is None:
        time.sleep(0.02)  # a reader's pace, leaving the writer a core
        try:
            rounds.append(result(name, hookrun.open(path)))
        except Exception as err:  # noqa: BLE001 - what a reader meets is the point
            rounds.append(err)
        try:
            checks.append(hookrun.open(path).verify())
        except Exception as err:  # noqa: BLE001
            checks.append([f"raised {type(err).__name__}: {err}"])
    assert writer.wait() == 0, writer.stderr.read()
    cap = hookrun.open(path)
    assert cap.status == "complete" and cap.verify(decode=True) == []
    same_result(name, cap, hookrun.open(ref))
    final = result(name, cap)
    errors = [r for r in rounds if isinstance(r, Exception)]
    for err in errors:
        assert WRITING in str(err), repr(err)
    rows = [is_prefix(name, r, final) for r in rounds if not isinstance(r, Exception)]
    total = is_prefix(name, final, final)
    assert len(rows) > 3 and any(0 < n < total for n in rows), (rows, errors[:3])  # read mid-run, not only at ends
    for problems in checks:
        assert problems == [] or all(WRITING in p for p in problems), problems
    print(f"{name}: {len(rounds)} reads ({len(errors)} still being written), rows seen {sorted(set(rows))} of {total}")


@pytest.mark.parametrize("name", list(METHODS))
def test_a_running_store_before_its_first_commit_reads_as_no_rows_or_says_still_being_written(
        name, references, tmp_path):
    """Each method's store as a run leaves it before its first commit (the root says running, no part committed):
    its reader gives no rows, or says the store is still being written and to read it again (it said: matches
    nothing; arrays: none)."""
    import shutil

    import zarr

    ref = references(name)[0]
    path = tmp_path / "s.zarr"
    shutil.copytree(ref, path)
    root = zarr.open_group(str(path), mode="r+")
    attrs = {k: v for k, v in root.attrs.items() if k != "index_files"}
    root.attrs.put({**attrs, "status": "running", "committed_parts": 0})
    try:
        seen = result(name, hookrun.open(path))
    except KeyError as err:
        assert f"{path} is still being written (status running, 0 batch(es) committed)" in str(err) and \
            "read it again later" in str(err), err
    else:
        assert is_prefix(name, seen, result(name, hookrun.open(ref))) == 0


# -- a sweep of each method with a failing job ------------------------------------------------------------------------
SWEEPS = {  # name -> (the swept override: job 0 as the reference run, job 1 refused; what job 1's reason starts with)
    "attribution": ("attribution.target=corrupt,clean", "attribution.target: 'clean' is also attribution.source"),
    "lens": ("lens.top_k=4,100000", "lens.top_k: 100000 is more than the 512"),
    "dictionaries": ("hooks.feats.layers=[transformer.h.0],[transformer.h.1]",
                     "hooks.feats.layers: dictionary sae1 was trained on transformer.h.0 (cfg.json's hook_name), but "
                     "this hook reads it at transformer.h.1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SWEEPS))
def test_a_sweep_of_each_method_with_a_failing_job_records_it_and_runs_the_others(name, inputs, references, tmp_path):
    """`python -m hookrun -m` of a method over a key whose second value is refused: the sweep goes on, ends with
    exit 2 and a tally naming the failed job and why; the job's hookrun-job.json records it; collect has a status
    for each job and warns; the good job's store equals the uninterrupted run."""
    swept, reason = SWEEPS[name]
    proc = run_cli("-m", *method_run(name, inputs), swept, f"hydra.sweep.dir={tmp_path}", check=False, env=ONE_THREAD)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert f"2 jobs: 1 complete, 1 failed (job 1: {reason}" in said and "Traceback" not in said
    record = json.loads((tmp_path / "1" / "hookrun-job.json").read_text())
    assert (record["status"], record["exit_code"]) == ("failed", 2) and record["reason"].startswith(reason), record
    assert json.loads((tmp_path / "0" / "hookrun-job.json").read_text())["status"] == "complete"
    assert not (tmp_path / "1" / "captures.zarr").exists()
    with pytest.warns(UserWarning, match=r"1 of 2 jobs in .* did not complete: job 1 failed \("):
        jobs = hookrun.collect(tmp_path, with_index=False)
    assert jobs.status.tolist() == ["complete", "failed"] and jobs.reason.tolist()[1].startswith(reason)
    same_result(name, hookrun.open(tmp_path / "0"), hookrun.open(references(name)[0]))
