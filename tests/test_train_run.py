"""The train block in runs: streamed from a model and read from a store, its tables, columns and SAELens folders
(read by sae_lens and by the dictionaries block), its refusals, and resumes bitwise equal to a run not stopped."""
from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch

import hookrun
from hookrun.experiments.superposition import SparseFeatures, Superposition
from tests.helpers import run_cli, run_here

TOY = ["+model._target_=hookrun.experiments.superposition.Superposition",
       "+data.dataset._target_=hookrun.experiments.superposition.SparseFeatures", "+data.dataset.n=4096",
       "data.batch_size=512"]


def _block(out, **kw):
    spec = {"sites": "[mix]", "kind": "topk", "k": 2, "width": 32, "steps": 24, "batch_size": 128,
            "buffer_tokens": 512, "out": str(out), "evaluate_every": 12, "b_dec_init": "mean", **kw}
    return "+train={" + ", ".join(f"{k}: {v}" for k, v in spec.items()) + "}"


def _weights(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "sae_weights.safetensors"))


def _toy_rows(batches):
    ds = SparseFeatures(4096)
    with torch.no_grad():
        return Superposition()(ds.items[:512 * batches]).double()


def test_streamed_run_writes_a_saelens_folder_its_curves_and_final_columns(tmp_path):
    out = tmp_path / "sae"
    store = run_here(tmp_path / "run", *TOY, _block(out))
    cap = hookrun.open(store)
    curves = cap.read("train")
    assert list(curves["step"]) == list(range(24)) and set(curves["site"]) == {"mix"}
    assert {"loss", "mse", "aux", "l0", "dead_fraction", "lr"} <= set(curves.columns)
    assert (curves["l0"] == 2).all() and (curves["lr"] == 3e-4).all()
    evals = cap.read("train", "evaluations")
    assert list(evals["step"]) == [12, 24]
    # the final evaluation recomputed here: the saved SAE on the held-out batch 0 (the first 512 samples)
    sae_lens = pytest.importorskip("sae_lens")
    sae = sae_lens.SAE.load_from_disk(str(out))
    assert sae.cfg.metadata.hook_name == "mix" and sae.cfg.d_sae == 32
    x = _toy_rows(1).float()
    with torch.no_grad():
        f = sae.encode(x)
        x_hat = sae.decode(f)
    mse = (x_hat - x).double().pow(2).sum(1).mean()
    var = (x.double() - x.double().mean(0)).pow(2).sum(1).mean()
    final = evals.iloc[-1]
    assert final["mse"] == pytest.approx(float(mse), rel=1e-4)
    assert final["explained_variance"] == pytest.approx(float(1 - mse / var), rel=1e-4)
    assert final["l0"] == pytest.approx(float((f != 0).sum(1).double().mean()))
    assert final["dead_features"] == int(((f != 0).sum(0) == 0).sum())
    samples = cap.samples
    last = samples[samples["batch"] == samples["batch"].max()]
    assert last["train.mse"].eq(final["mse"]).all() and samples["train.mse"].isna().sum() == len(samples) - len(last)
    assert json.loads((out / "hookrun-train.json").read_text())["written_by"] == "hookrun"
    assert not (out / "checkpoint.pt").exists()
    # the same run again: the same weights, bit for bit
    run_here(tmp_path / "run2", *TOY, _block(tmp_path / "sae2"))
    for name, value in _weights(out).items():
        assert torch.equal(value, _weights(tmp_path / "sae2")[name]), name


def test_training_from_a_store_equals_plain_torch_on_the_same_minibatches(tmp_path):
    """From a store: the rows the loader serves, the trainer's updates as plain Adam on SAELens's loss."""
    acts = run_here(tmp_path / "acts", *TOY, "+hooks.m={kind: forward, layers: [mix]}", "store.chunk_rows=256")
    out = tmp_path / "sae"
    store = run_here(tmp_path / "run", *TOY, _block(out, **{"from": str(acts), "hook": "m", "kind": "relu",
                                                           "l1_coefficient": 0.5, "evaluate_every": "null"}).replace(
        "k: 2, ", ""))
    cap = hookrun.open(store)
    assert len(cap.read("train")) == 24
    # the same training by hand: the loader's minibatches (seed 0, epoch 0), the first 4 of them for b_dec's mean
    src = hookrun.open(acts)
    batches = [x for x in src.loader(layer="mix", hook="m", batch_size=128, seed=0, buffer_chunks=2, drop_last=True)]
    from hookrun.methods.training.kinds import TrainingDictionary
    torch.manual_seed(0)
    d = TrainingDictionary(16, 32, "relu")
    w = {n: p.detach().clone().requires_grad_(True) for n, p in d.named_parameters()}
    with torch.no_grad():
        w["b_dec"].copy_(torch.cat(batches[:4]).double().mean(0).float())
    opt = torch.optim.Adam(w.values(), lr=3e-4)
    for x in batches[:24]:
        f = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
        loss = ((f @ w["W_dec"] + w["b_dec"] - x) ** 2).sum(-1).mean() + \
            (0.5 * (f * w["W_dec"].norm(dim=1)).sum(-1)).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(w.values(), 1.0)
        opt.step()
    got = _weights(out)
    for name in w:
        torch.testing.assert_close(got[name], w[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_dictionary_trained_here_is_what_the_dictionaries_block_reads(tmp_path):
    out = tmp_path / "sae"
    run_here(tmp_path / "run", *TOY, _block(out))
    used = run_here(tmp_path / "use", *TOY, f"+dictionaries.toy={{path: {out}}}",
                    "+hooks.f={kind: forward, layers: [mix], dictionary: toy, top_k: 2}")
    cap = hookrun.open(used)
    from hookrun.methods.saes import load_saelens
    sae = load_saelens(out)
    x = _toy_rows(8).float()
    idx = cap.load(hook="f", layer="mix", role="features.indices")
    val = cap.load(hook="f", layer="mix", role="features.values")
    dense = np.zeros((len(x), 32), dtype=np.float32)
    for r in range(len(x)):
        for i, v in zip(idx[r], val[r]):
            if i >= 0:
                dense[r, i] = v
    np.testing.assert_allclose(dense, sae.encode(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def _interrupt_after(monkeypatch, where, calls):
    """Raise the runner's Interrupted (as SIGTERM does) on the `calls`-th call of `where` (a method of Train)."""
    from hookrun.engine.runner import Interrupted
    from hookrun.methods import training

    original = getattr(training.Train, where)
    seen = {"n": 0}

    def stopping(self, *a, **kw):
        seen["n"] += 1
        if seen["n"] == calls:
            raise Interrupted(signal.SIGTERM)
        return original(self, *a, **kw)
    monkeypatch.setattr(training.Train, where, stopping)


@pytest.mark.parametrize("source", ["stream", "store"])
def test_a_killed_run_resumes_bitwise_equal_to_one_not_stopped(tmp_path, monkeypatch, source):
    from hookrun.engine.runner import Interrupted
    extra = {}
    if source == "store":
        acts = run_here(tmp_path / "acts", *TOY, "+hooks.m={kind: forward, layers: [mix]}", "store.chunk_rows=256")
        extra = {"from": str(acts), "hook": "m", "checkpoint_every": 10}
    block = lambda out: _block(out, steps=24, evaluate_every=7, **extra)  # noqa: E731
    run_here(tmp_path / "whole", *TOY, block(tmp_path / "sae_whole"))
    if source == "stream":
        _interrupt_after(monkeypatch, "_feed", 3)  # batches 1, 2 trained; killed in batch 3's
    else:
        _interrupt_after(monkeypatch, "_step", 15)  # checkpoint after step 10; killed at step 15
    with pytest.raises(Interrupted):
        run_here(tmp_path / "cut", *TOY, block(tmp_path / "sae_cut"))
    monkeypatch.undo()
    assert hookrun.open(tmp_path / "cut" / "captures.zarr").status == "interrupted"
    run_here(tmp_path / "cut", *TOY, block(tmp_path / "sae_cut"), "store.mode=resume")
    for name, value in _weights(tmp_path / "sae_whole").items():
        assert torch.equal(value, _weights(tmp_path / "sae_cut")[name]), name
    a = hookrun.open(tmp_path / "whole" / "captures.zarr")
    b = hookrun.open(tmp_path / "cut" / "captures.zarr")
    assert a.read("train").equals(b.read("train"))
    assert a.read("train", "evaluations").equals(b.read("train", "evaluations"))


@pytest.mark.parametrize("edit,expect", [
    ({"kind": "topc"}, "train.kind: 'topc' is unknown; use one of relu, topk, batchtopk, jumprelu (did you mean: topk?)"),
    ({"wdth": 3}, "train.wdth: unknown key (did you mean: width?)"),
    ({"k": 32}, "train.k: 32 must be < width (32)"),
    ({"width": 0}, "train.width: 0 is too small; give an integer in [1, 16_777_216]"),
    ({"lr": "nan"}, "train.lr: nan is not a finite number"),
    ({"lr": "inf"}, "train.lr: inf is not a finite number"),
    ({"steps": -3}, "train.steps: -3 is too small"),
    ({"batch_size": 10 ** 12}, "train.batch_size: 1000000000000 is too large"),
    ({"lr_warm_up_steps": 0}, "train.lr_warm_up_steps: 0 is too small; give an integer in [1, 1_000_000_000] or null "
                              "(null switches it off)"),
    ({"from": "/nonexistent/store", "hook": "m"}, "train.from: '/nonexistent/store' is not a hookrun store"),
    ({"sites": "[{in: mix, out: mix}]", "kind": "topk"}, "train.kind: topk for a transcoder"),
])
def test_refusals_exit_2_before_any_work(tmp_path, edit, expect):
    proc = run_cli(*TOY, _block(tmp_path / "sae", **edit), f"hydra.run.dir={tmp_path / 'run'}", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert expect in said
    assert not (tmp_path / "run" / "captures.zarr").exists() and not (tmp_path / "sae").exists()


def test_a_shuffle_buffer_too_big_for_memory_is_refused_before_the_first_batch(tmp_path):
    """train.buffer_tokens 2**34 rows of the toy's 16-wide site (float32, twice while shuffled): 2.2 TB, refused
    with the figure and the key to lower, before the store or the output folder exists."""
    proc = run_cli(*TOY, _block(tmp_path / "sae", buffer_tokens=2 ** 34), f"hydra.run.dir={tmp_path / 'run'}",
                   check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    buffer = 2 * 2 ** 34 * 16 * 4
    assert buffer == 2_199_023_255_552
    assert "train: the run would hold about 2.2 TB at once (the shuffle buffer's 17179869184 rows of 16 values: " \
           "2.2 TB)" in said and "lower train.buffer_tokens" in said
    assert not (tmp_path / "run" / "captures.zarr").exists() and not (tmp_path / "sae").exists()


def test_a_width_too_big_for_memory_is_refused_with_its_figure(tmp_path, monkeypatch):
    """A dictionary of width 2**20 on the 16-wide site: its encoder, decoder and biases with their gradients and
    Adam's two moments (float32) are 554 MB, more than 0.8 of a device with 500 MB free (the free memory set here;
    the estimate is the code's): refused naming train.width."""
    import hookrun.methods
    from hookrun.config.checks import ConfigError
    monkeypatch.setattr(hookrun.methods, "free_memory", lambda device: 500_000_000)
    width = 2 ** 20
    params = 2 * width * 16 + width + 16   # W_enc, W_dec, b_enc, b_dec
    assert 4 * params * 4 == 553_648_384
    with pytest.raises(ConfigError) as err:
        run_here(tmp_path / "run", *TOY, _block(tmp_path / "sae", width=width, batch_size=8, k=2))
    said = str(err.value)
    assert "(1 dictionary of width 1048576: parameters, gradients and Adam's moments: 554 MB), more than the " \
           "500 MB free on cpu; lower train.width" in said, said
    assert not (tmp_path / "sae").exists()


def test_an_output_folder_hookrun_did_not_write_is_never_overwritten(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    proc = run_cli(*TOY, _block(out), f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2 and "train.out:" in proc.stdout + proc.stderr and \
        "never overwritten" in proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_refusals_against_the_store(tmp_path):
    acts = run_here(tmp_path / "acts", *TOY, "+hooks.m={kind: forward, layers: [mix]}")
    proc = run_cli(*TOY, _block(tmp_path / "sae", **{"from": str(acts), "hook": "m", "sites": "[nope]"}),
                   f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2 and "train.sites[0]: 'nope' (hook 'm') is not in" in proc.stdout + proc.stderr
    proc = run_cli(*TOY, "+model.d=8", _block(tmp_path / "sae", **{"from": str(acts), "hook": "m"}),
                   f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2 and "mix is 8 wide in the model but its array" in proc.stdout + proc.stderr


def test_resume_with_other_hyperparameters_is_refused(tmp_path, monkeypatch):
    from hookrun.engine.runner import Interrupted
    _interrupt_after(monkeypatch, "_feed", 2)
    with pytest.raises(Interrupted):
        run_here(tmp_path / "cut", *TOY, _block(tmp_path / "sae", steps=24))
    monkeypatch.undo()
    proc = run_cli(*TOY, _block(tmp_path / "sae", steps=24, lr=1e-3), "store.mode=resume",
                   f"store.path={tmp_path / 'cut' / 'captures.zarr'}", check=False)
    assert proc.returncode == 2 and "holds a training started with other inputs or hyperparameters" in proc.stdout + proc.stderr


def test_a_sweep_collects_one_row_a_job_and_plots_its_frontier(tmp_path):
    sweep = tmp_path / "sweep"
    run_cli("-m", *TOY, _block("null", steps=16), "train.k=1,3", f"hydra.sweep.dir={sweep}")
    jobs = hookrun.collect(sweep, with_index=False)
    assert len(jobs) == 2 and sorted(jobs["train.k"]) == [1, 3]
    assert sorted(jobs["train.l0"]) == [1.0, 3.0] and jobs["train.explained_variance"].notna().all()
    assert (jobs["train.steps"] == 16).all()
    for job in ("0", "1"):   # out: null: each job's sae/ beside its store
        assert (sweep / job / "sae" / "cfg.json").is_file()
    from hookrun.read.plots import write_run, write_sweep
    written = write_sweep(sweep, tmp_path / "plots")
    assert [p.name for p in written] == ["frontier.png"]
    assert "train.png" in [p.name for p in write_run(hookrun.open(sweep / "0"), tmp_path / "plots0")]


def _torchrun(ranks, *args):
    import os
    import subprocess
    import sys
    from tests.helpers import REPO, on_cpu
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "-m", "hookrun", *on_cpu(args)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow  # several processes: CI's full run
def test_torchrun_ranks_train_one_dictionary_equal_to_one_process(tmp_path):
    """Two ranks (gloo) each take half of every minibatch, gradients all-reduced: the weights one process trains,
    within float tolerance, written once (rank 0)."""
    acts = run_here(tmp_path / "acts", *TOY, "+hooks.m={kind: forward, layers: [mix]}", "store.chunk_rows=256")
    block = lambda out: _block(out, **{"from": str(acts), "hook": "m", "kind": "relu", "steps": 20})  # noqa: E731
    one = tmp_path / "sae1"
    run_here(tmp_path / "one", *TOY, block(one).replace("k: 2, ", ""))
    two = tmp_path / "sae2"
    _torchrun(2, *TOY, block(two).replace("k: 2, ", ""), f"hydra.run.dir={tmp_path / 'two'}")
    a, b = _weights(one), _weights(two)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)
    cap = hookrun.open(tmp_path / "two")
    assert len(cap.read("train")) == 20   # rank 0's rows only: one writer
    jobs = cap.samples["train.mse"].dropna()
    assert jobs.nunique() == 1


def _streamed_on_two_ranks_in_one_process(steps: int, batch: int = 128, buffer: int = 512, seed: int = 0):
    """The global minibatches two streamed ranks train on, in one process: rank r runs data batches share(r) of 8
    (rank 0: 0..3, its batch 0 held out; rank 1: 4..7), its rows through its own ShuffleBuffer (buffer / 2 rows,
    batch / 2 a minibatch, seed + r), drained at its last batch; step t's minibatch is rank 0's t-th served
    minibatch then rank 1's. b_dec: the mean of both ranks' rows when each buffer first filled. One Trainer (no
    process group: one process's update) on those minibatches; its inference weights."""
    from hookrun.methods.training.kinds import TrainingDictionary
    from hookrun.methods.training.sources import ShuffleBuffer
    from hookrun.methods.training.trainer import Schedule, Trainer

    rows = _toy_rows(8).float()
    queues, firsts = [], []
    for r, batches in enumerate([range(1, 4), range(4, 8)]):
        buf, queue, first = ShuffleBuffer(buffer // 2, batch // 2, seed + r), [], None
        for i in batches:
            buf.add(rows[512 * i:512 * (i + 1)])
            if first is None and len(buf) >= buf.capacity:
                first = buf.rows.clone()
            queue.extend(buf.batches())
        queue.extend(buf.batches(drain=True))
        queues.append(queue)
        firsts.append(first)
    start = torch.cat(firsts).double()
    torch.manual_seed(seed)
    d = TrainingDictionary(16, 32, "topk", k=2)
    with torch.no_grad():
        d.b_dec.copy_(start.mean(0))
    trainer = Trainer(d, Schedule(steps=steps))
    taken = min(steps, *map(len, queues))
    for t in range(taken):
        trainer.step(torch.cat([queues[0][t], queues[1][t]]))
    return d.inference_state(), taken


@pytest.mark.slow  # several processes: CI's full run
def test_torchrun_ranks_train_one_dictionary_streamed_from_the_model(tmp_path):
    """Streamed under torchrun (2 ranks, gloo): each rank forwards its own batches into its own buffer, the ranks
    step in lockstep on the global minibatch (rank 0's share then rank 1's), gradients all-reduced: the weights
    one process trains on those minibatches, within float tolerance; written once (rank 0); no checkpoint left."""
    out = tmp_path / "sae"
    _torchrun(2, *TOY, _block(out, steps=20), f"hydra.run.dir={tmp_path / 'two'}")
    expected, taken = _streamed_on_two_ranks_in_one_process(steps=20)
    assert taken == 20
    got = _weights(out)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        torch.testing.assert_close(got[name], expected[name].float(), rtol=1e-4, atol=1e-6, msg=name)
    cap = hookrun.open(tmp_path / "two")
    curves = cap.read("train")
    assert list(curves["step"]) == list(range(20)) and (curves["l0"] == 2).all()   # rank 0's rows only
    assert list(cap.read("train", "evaluations")["step"]) == [12, 20]
    assert cap.samples["train.mse"].dropna().nunique() == 1   # both ranks' last batches: the same final numbers
    assert sorted(p.name for p in out.iterdir()) == ["cfg.json", "hookrun-train.json", "sae_weights.safetensors"]


MLP_KILLED = ["+model._target_=tests.models.KilledOnRank", "+data.inputs.x={random:normal,shape:[512,6]}",
              "data.batch_size=32", "store.writer=sync", "store.commit_s=0"]   # 16 batches: rank 1 runs 8..15


@pytest.mark.slow  # a kill and several processes: CI's full run
@pytest.mark.parametrize("kill_at", [7, 11])
def test_a_streamed_torchrun_run_with_a_killed_rank_resumes_bitwise(tmp_path, kill_at):
    """Streamed under torchrun, rank 1 SIGKILLed at its forward `kill_at` (7: both ranks' last checkpoints at
    their 3rd call; 11: rank 0 has checkpointed its 6th call, rank 1 only its 5th, so rank 0 goes back to its
    previous checkpoint): resumed with store.mode=resume, every rank at the last call all ranks checkpointed, the
    weights, curves and evaluations bitwise those of an uninterrupted two-rank run; no checkpoint left."""
    block = ("+train={sites: [fc1], kind: topk, k: 2, width: 16, steps: 24, batch_size: 16, buffer_tokens: 64, "
             "evaluate_every: 9, b_dec_init: mean, out: %s}")
    _torchrun(2, *MLP_KILLED, block % (tmp_path / "sae_whole"), f"hydra.run.dir={tmp_path / 'whole'}")
    import os
    import subprocess
    import sys
    from tests.helpers import REPO, on_cpu
    killed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
                             "--rdzv-endpoint=localhost:0", "-m", "hookrun",
                             *on_cpu([*MLP_KILLED, block % (tmp_path / "sae_cut"), f"hydra.run.dir={tmp_path / 'cut'}"])],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HOOKRUN_TEST_KILL_RANK": "1",
                                 "HOOKRUN_TEST_KILL_AT": str(kill_at)})
    assert killed.returncode != 0
    cut = hookrun.open(tmp_path / "cut")
    assert cut.status != "complete" and (tmp_path / "sae_cut" / "checkpoint.rank-1.pt").is_file()
    assert not (tmp_path / "sae_cut" / "sae_weights.safetensors").exists()
    _torchrun(2, *MLP_KILLED, block % (tmp_path / "sae_cut"), "store.mode=resume", f"hydra.run.dir={tmp_path / 'cut'}")
    assert_resumed_as_whole(tmp_path)


def assert_resumed_as_whole(tmp_path):
    """The killed-and-resumed run (tmp_path/cut, its dictionary sae_cut) is bitwise the one not stopped (whole,
    sae_whole): weights, the 24 steps' curves, the evaluations, and the output folder without its checkpoints."""
    for name, value in _weights(tmp_path / "sae_whole").items():
        assert torch.equal(value, _weights(tmp_path / "sae_cut")[name]), name
    a, b = hookrun.open(tmp_path / "whole"), hookrun.open(tmp_path / "cut")
    assert len(a.read("train")) == 24 and a.read("train").equals(b.read("train"))
    assert a.read("train", "evaluations").equals(b.read("train", "evaluations"))
    assert sorted(p.name for p in (tmp_path / "sae_cut").iterdir()) == ["cfg.json", "hookrun-train.json",
                                                                      "sae_weights.safetensors"]


def _killed_after_checkpoint(ranks: int, args, save: int = 0, rank: int = 0, finish: str = "", timeout: int = 600):
    """`python -m hookrun ARGS` (ranks > 1: under torchrun, gloo) through tests/killed_after_checkpoint.py: with
    save, the process of `rank` SIGKILLed right after writing its checkpoint number `save` (with finish, STORE:BATCH:
    as its training finishes, once STORE holds batch BATCH); its CompletedProcess (TimeoutExpired after `timeout` s:
    a rank waiting on one that never comes)."""
    import os
    import subprocess
    import sys
    from tests.helpers import REPO, on_cpu
    launch = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=localhost:0"] if ranks > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOOKRUN_TEST_KILL_SAVE": str(save),
           "HOOKRUN_TEST_KILL_RANK": str(rank), "HOOKRUN_TEST_KILL_FINISH": finish}
    return subprocess.run([*launch, "-m", "tests.killed_after_checkpoint", *on_cpu(args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow  # kills and several processes: CI's full run
@pytest.mark.parametrize("ranks,rank,save,store", [(1, 0, 3, "sync"), (2, 0, 3, "sync"), (2, 1, 4, "sync"),
                                                    (2, 1, 8, "sync"), (2, 0, 9, "sync"), (1, 0, 6, "thread"),
                                                    (2, 1, 5, "thread")])
def test_a_run_killed_between_its_checkpoint_and_its_batch_commit_resumes_bitwise(tmp_path, ranks, rank, save, store):
    """Issue 54 item 6's last case: a process (one run's, or one torchrun rank's) SIGKILLed right after it wrote a
    checkpoint and before the runner committed that batch, so the store is one batch behind the checkpoint; resumed
    with store.mode=resume, the weights, curves and evaluations are bitwise those of a run not stopped (rank 0 killed:
    its committed curves lack the killed call's rows, which come back from the checkpoint). Under torchrun, save 8
    is a rank's checkpoint of its last batch (the ranks resume together from it) and rank 0's save 9 its final
    checkpoint (written before any rank's last commit: every rank finishes from it, none waits). `store`: thread is
    the writer thread and the default store.commit_s (5 s: many batches a commit elsewhere), whose batch is committed
    all the same before the next batch runs (the training's BatchResult.commit)."""
    block = ("+train={sites: [fc1], kind: topk, k: 2, width: 16, steps: 24, batch_size: 16, buffer_tokens: 64, "
             "evaluate_every: 9, b_dec_init: mean, out: %s}")
    data = MLP_KILLED if store == "sync" else [*MLP_KILLED[:3], "store.writer=thread"]
    runs = {name: [*data, block % (tmp_path / f"sae_{name}"), f"hydra.run.dir={tmp_path / name}"]
            for name in ("whole", "cut")}
    whole = _killed_after_checkpoint(ranks, runs["whole"])
    assert whole.returncode == 0, whole.stdout + whole.stderr
    killed = _killed_after_checkpoint(ranks, runs["cut"], save=save, rank=rank)
    assert killed.returncode != 0
    cut = hookrun.open(tmp_path / "cut")
    assert cut.status != "complete" and not (tmp_path / "sae_cut" / "sae_weights.safetensors").exists()
    share = range(0, 16) if ranks == 1 else range(8 * rank, 8 * rank + 8)   # the killed rank's batches
    committed = sum(b in share for b in cut.samples["batch"].unique())
    state = torch.load(tmp_path / "sae_cut" / ("checkpoint.pt" if rank == 0 else f"checkpoint.rank-{rank}.pt"),
                       weights_only=False)
    assert state["batch"] == share[0] + committed   # checkpointed its next batch, which the store does not hold
    assert (tmp_path / "sae_cut" / "checkpoint.final.pt").is_file() == (save == 9)
    resumed = _killed_after_checkpoint(ranks, [*runs["cut"], "store.mode=resume"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_resumed_as_whole(tmp_path)


@pytest.mark.slow  # a kill and several processes: CI's full run
@pytest.mark.parametrize("killed,rows", [(1, 480), (0, 512)])
def test_a_streamed_torchrun_rank_killed_as_it_finishes_after_the_other_finished_resumes_bitwise(tmp_path, killed,
                                                                                                  rows):
    """Streamed under torchrun, one rank SIGKILLed in its last batch, after its checkpoints and before it commits,
    once the other rank has committed its whole share (480 rows: 15 batches, rank 1 the slower with 8 to rank 0's 7;
    512: 8 each, rank 0, the writer, killed). Resumed, the finished rank runs no batch and the other finishes from
    the final checkpoint without waiting for it (a rank waiting on the finished one would hang: the timeout fails
    the test); the weights, curves and evaluations are bitwise an uninterrupted run's; no checkpoint left."""
    data = [a.replace("[512,6]", f"[{rows},6]") for a in MLP_KILLED]
    block = ("+train={sites: [fc1], kind: topk, k: 2, width: 16, steps: 24, batch_size: 16, buffer_tokens: 64, "
             "evaluate_every: 9, b_dec_init: mean, out: %s}")
    runs = {name: [*data, block % (tmp_path / f"sae_{name}"), f"hydra.run.dir={tmp_path / name}"]
            for name in ("whole", "cut")}
    whole = _killed_after_checkpoint(2, runs["whole"], timeout=300)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    batches = rows // 32
    shares = [range(0, batches // 2), range(batches // 2, batches)]
    other = shares[1 - killed]
    killed_run = _killed_after_checkpoint(2, runs["cut"], rank=killed, finish=f"{tmp_path / 'cut'}:{other[-1]}",
                                          timeout=300)
    assert killed_run.returncode != 0
    done = set(hookrun.open(tmp_path / "cut").samples["batch"])
    assert set(other) <= done and shares[killed][-1] not in done   # the other's share committed, not the killed's
    resumed = _killed_after_checkpoint(2, [*runs["cut"], "store.mode=resume"], timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert hookrun.open(tmp_path / "cut").status == "complete"
    assert_resumed_as_whole(tmp_path)


@pytest.mark.slow  # a kill and three processes: CI's full run
def test_training_from_a_store_killed_after_a_checkpoint_resumes_bitwise(tmp_path):
    """From a store (the training runs in the last batch): SIGKILLed right after the checkpoint of step 10, the last
    batch not committed; resumed, it goes on from step 10 (its curves from the checkpoint), bitwise a run not
    stopped."""
    acts = run_here(tmp_path / "acts", *TOY, "+hooks.m={kind: forward, layers: [mix]}", "store.chunk_rows=256")
    runs = {name: [*TOY, _block(tmp_path / f"sae_{name}", evaluate_every=7, checkpoint_every=10,
                                **{"from": str(acts), "hook": "m"}), f"hydra.run.dir={tmp_path / name}"]
            for name in ("whole", "cut")}
    assert _killed_after_checkpoint(1, runs["whole"]).returncode == 0
    assert _killed_after_checkpoint(1, runs["cut"], save=1).returncode != 0
    state = torch.load(tmp_path / "sae_cut" / "checkpoint.pt", weights_only=False)
    assert state["mode"] == "store" and state["trainers"][0]["n"] == 10
    resumed = _killed_after_checkpoint(1, [*runs["cut"], "store.mode=resume"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for name, value in _weights(tmp_path / "sae_whole").items():
        assert torch.equal(value, _weights(tmp_path / "sae_cut")[name]), name
    a, b = hookrun.open(tmp_path / "whole"), hookrun.open(tmp_path / "cut")
    assert len(a.read("train")) == 24 and a.read("train").equals(b.read("train"))
    assert a.read("train", "evaluations").equals(b.read("train", "evaluations"))


def test_a_streamed_transcoder_with_skip_is_read_by_saelens(tmp_path):
    """A transcoder from fc1's output to fc2's (tests.models.MLP): SAELens's SkipTranscoder with the site names;
    its final evaluation is the reconstruction of fc2's output from fc1's on the held-out batch."""
    sae_lens = pytest.importorskip("sae_lens")
    mlp = ["+model._target_=tests.models.MLP", "+data.inputs.x={random: normal, shape: [2048, 6]}",
           "data.batch_size=256"]
    out = tmp_path / "tc"
    run_here(tmp_path / "run", *mlp, "+train={sites: [{in: fc1, out: fc2}], kind: relu, skip: true, width: 32, "
             f"steps: 12, batch_size: 128, buffer_tokens: 256, out: {out}, b_dec_init: mean}}")
    tc = sae_lens.SAE.load_from_disk(str(out))
    assert type(tc).__name__ == "SkipTranscoder"
    assert (tc.cfg.metadata.hook_name, tc.cfg.metadata.hook_name_out) == ("fc1", "fc2")
    cap = hookrun.open(tmp_path / "run")
    final = cap.read("train", "final").iloc[0]
    assert final["site"] == "fc1->fc2" and final["step"] == 12
    # the same model and inputs captured: the held-out batch (the first 256 samples) through SAELens's transcoder
    acts = hookrun.open(run_here(tmp_path / "acts", *mlp, "+hooks.a={kind: forward, layers: [fc1, fc2]}"))
    x = torch.from_numpy(acts.load(layer="fc1", role="output")[:256])
    y = torch.from_numpy(acts.load(layer="fc2", role="output")[:256]).double()
    with torch.no_grad():
        y_hat = tc(x).double()
    mse = (y_hat - y).pow(2).sum(1).mean()
    assert final["mse"] == pytest.approx(float(mse), rel=1e-4)
    assert final["explained_variance"] == pytest.approx(float(1 - mse / (y - y.mean(0)).pow(2).sum(1).mean()),
                                                        rel=1e-4)


def test_reading_train_from_a_run_without_it_is_a_key_error(tmp_path):
    store = run_here(tmp_path / "acts", *TOY, "+hooks.m={kind: forward, layers: [mix]}")
    with pytest.raises(KeyError, match="its run had no train block"):
        hookrun.open(store).read("train")


def test_several_sites_train_from_one_forward_each_into_its_folder(tmp_path):
    sae_lens = pytest.importorskip("sae_lens")
    mlp = ["+model._target_=tests.models.MLP", "+data.inputs.x={random: normal, shape: [1536, 6]}",
           "data.batch_size=256"]
    out = tmp_path / "saes"
    store = run_here(tmp_path / "run", *mlp, "+train={sites: [fc1, fc2], kind: topk, k: 2, width: 16, steps: 8, "
                     f"batch_size: 128, buffer_tokens: 256, out: {out}}}")
    cap = hookrun.open(store)
    curves = cap.read("train")
    assert sorted(curves.groupby("site").size().items()) == [("fc1", 8), ("fc2", 8)]
    for site in ("fc1", "fc2"):
        sae = sae_lens.SAE.load_from_disk(str(out / site))
        assert sae.cfg.metadata.hook_name == site and sae.cfg.d_in == 8
    assert {"train.l0@fc1", "train.l0@fc2"} <= set(cap.samples.columns)
    assert cap.samples["train.l0@fc2"].dropna().eq(2).all()


def test_a_transcoder_trained_here_is_read_by_the_dictionaries_block_input_site_to_output_site(tmp_path):
    """A skip transcoder blocks.1.ln2 -> blocks.1.mlp of the mood model, trained streamed, then read by
    `dictionaries:` on its held-out batch: features from the input site and the error norm against the output site
    as plain torch computes them from the captured sites; its evaluation (L0, MSE, variance explained, CE loss
    recovered with the output site spliced) the train block's own on the same tokens."""
    from safetensors.torch import load_file

    out = tmp_path / "tc"
    moods = ["+experiment=steer_source", "hooks.resid=null", "data.text.files=[pkg://hookrun.experiments/data/moods.txt]",
             "data.batch_size=64"]
    trained = hookrun.open(run_here(tmp_path / "train", *moods, "+train={sites: [{in: blocks.1.ln2, out: blocks.1.mlp}], "
                                    f"kind: relu, skip: true, width: 64, steps: 15, batch_size: 128, buffer_tokens: 832, "
                                    f"out: {out}, b_dec_init: mean, lr: 0.003}}"))
    cfg = json.loads((out / "cfg.json").read_text())
    assert cfg["architecture"] == "skip_transcoder" and cfg["metadata"]["hook_name_out"] == "blocks.1.mlp"
    cap = hookrun.open(run_here(tmp_path / "read", *moods, "data.max_samples=64", f"+dictionaries.tc={{path: {out}}}",
                                "+hooks.feats={kind: forward, layers: [blocks.1.ln2], dictionary: tc, top_k: 64, "
                                "evaluate: true}", "+hooks.acts={kind: forward, layers: [blocks.1.ln2, blocks.1.mlp]}"))
    w = {k: v.double() for k, v in load_file(str(out / "sae_weights.safetensors")).items()}
    x = torch.from_numpy(cap.load(hook="acts", layer="blocks.1.ln2")).double()
    y = torch.from_numpy(cap.load(hook="acts", layer="blocks.1.mlp")).double()
    f = torch.relu(x @ w["W_enc"] + w["b_enc"])
    y_hat = f @ w["W_dec"] + w["b_dec"] + x @ w["W_skip"].T
    dense = cap.read("dictionaries", "features", hook="feats", features=range(64))
    np.testing.assert_allclose(dense, f.numpy(), atol=1e-4)
    np.testing.assert_allclose(cap.load(hook="feats", layer="blocks.1.ln2", role="error_norm"),
                               (y - y_hat).norm(dim=-1).numpy(), rtol=1e-4, atol=1e-5)
    ev, final = cap.read("dictionaries").iloc[0], trained.read("train", "final").iloc[0]
    assert ev["tokens"] == final["tokens"] == len(x) == 832
    mse = float((y - y_hat).pow(2).sum(1).mean())
    assert ev["mse"] == pytest.approx(mse, rel=1e-4) and final["mse"] == pytest.approx(mse, rel=1e-4)
    for name in ("l0", "explained_variance", "ce_clean", "ce_spliced", "ce_zero", "ce_loss_recovered"):
        assert ev[name] == pytest.approx(final[name], rel=1e-4, abs=1e-6), name
    assert ev["ce_spliced"] != ev["ce_clean"] and ev["ce_zero"] > ev["ce_spliced"]


@pytest.mark.slow
def test_training_from_a_store_on_s3_equals_training_from_the_same_store_on_disk(s3, tmp_path, monkeypatch):
    """train.from an s3:// store (the AWS_* variables, as a shell gives them) reads it as it reads a local one: the
    same minibatches, bitwise the same weights and curves."""
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    capture = [*TOY, "+hooks.m={kind: forward, layers: [mix]}", "store.chunk_rows=256"]
    local = run_here(tmp_path / "acts", *capture)
    url = s3.url("train/acts/captures.zarr")
    run(make_cfg([*capture, f"store.path={url}"]))
    block = lambda src, out: _block(out, **{"from": src, "hook": "m", "kind": "relu",  # noqa: E731
                                            "steps": 20}).replace("k: 2, ", "")
    a = hookrun.open(run_here(tmp_path / "a", *TOY, block(str(local), tmp_path / "sae_local")))
    b = hookrun.open(run_here(tmp_path / "b", *TOY, block(f"'{url}'", tmp_path / "sae_s3")))
    wa, wb = _weights(tmp_path / "sae_local"), _weights(tmp_path / "sae_s3")
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    ca, cb = a.read("train"), b.read("train")
    assert len(ca) == 20 and ca[["loss", "mse", "l0"]].equals(cb[["loss", "mse", "l0"]])
    assert b.attrs["train"]["source"] == url


def _two_ranks_in_one_process(cap, steps: int, width: int = 32, k: float = 2.0, batch: int = 128):
    """Two data-parallel batchtopk ranks simulated in one process: each rank's share (every 2nd row of the minibatch)
    through its own copy, its own batch-wide top-k and threshold update; gradients and thresholds averaged, clipped
    to 1.0, one Adam step, the copies kept equal."""
    import copy

    from hookrun.methods.training.kinds import TrainingDictionary
    from hookrun.methods.training.sources import StoreRows

    sample = StoreRows(cap, ["mix"], "m", None, batch, 512, 0)
    start = torch.cat([sample.next()[0] for _ in range(4)]).double()   # b_dec: the mean of the first 4 minibatches
    torch.manual_seed(0)
    d = TrainingDictionary(start.shape[-1], width, "batchtopk", k=k)
    with torch.no_grad():
        d.b_dec.copy_(start.mean(0))
    opt = torch.optim.Adam(d.parameters(), lr=3e-4)
    rows = StoreRows(cap, ["mix"], "m", None, batch, 512, 0)
    for _ in range(steps):
        x = rows.next()[0]
        ranks = [copy.deepcopy(d) for _ in range(2)]
        for r, copy_ in enumerate(ranks):
            copy_.losses(x[r::2], dead=torch.zeros(width, dtype=torch.bool))["loss"].backward()
        for name, p in d.named_parameters():
            p.grad = (dict(ranks[0].named_parameters())[name].grad + dict(ranks[1].named_parameters())[name].grad) / 2
        d.topk_threshold.copy_((ranks[0].topk_threshold + ranks[1].topk_threshold) / 2)
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return d.inference_state()


@pytest.mark.slow  # several processes: CI's full run
def test_torchrun_batchtopk_takes_its_batch_wide_topk_over_each_ranks_share(tmp_path):
    """batchtopk under torchrun (2 ranks, gloo): each rank keeps the k x rows largest of its own half of the
    minibatch (as the docs say), its running threshold averaged: the weights of that loop simulated in one process;
    not those of one process's batch-wide top-k over the whole minibatch."""
    acts = run_here(tmp_path / "acts", *TOY, "+hooks.m={kind: forward, layers: [mix]}", "store.chunk_rows=256")
    block = lambda out: _block(out, **{"from": str(acts), "hook": "m", "kind": "batchtopk", "steps": 12})  # noqa: E731
    _torchrun(2, *TOY, block(tmp_path / "two"), f"hydra.run.dir={tmp_path / 'two_run'}")
    run_here(tmp_path / "one_run", *TOY, block(tmp_path / "one"))
    two, one = _weights(tmp_path / "two"), _weights(tmp_path / "one")
    expected = _two_ranks_in_one_process(hookrun.open(acts), steps=12)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
        torch.testing.assert_close(two[name], expected[name].float(), rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.allclose(two["threshold"], one["threshold"], rtol=1e-3)   # one process: another threshold
