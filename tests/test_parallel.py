"""Data-parallel capture through the real `torchrun` (gloo on CPU): one store, bitwise the one a single
process writes (arrays and their metadata; the index minus timings); a killed rank resumes."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import hookrun
from tests.helpers import REPO, on_cpu, run_cli, run_here, same_bytes

MLP = ["+model._target_=tests.models.KilledOnRank", "+hooks.acts={kind:forward,layers:[fc1,fc2],capture:[input,output]}",
       "+hooks.g={kind:output_grad,layers:fc1}", "loss=sum", "+data.inputs.x={random:normal,shape:[50,6]}",
       "data.batch_size=4", "store.chunk_rows=3", "store.commit_s=0"]  # 13 batches: ranks start mid-chunk
LM = ["+experiment=lm_tokens", "store.chunk_rows=50", "store.commit_s=0", "data.text.max_length=24"]


def torchrun(ranks, *args, env=None, check=True):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",  # a free port
                           "-m", "hookrun", *on_cpu(args)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def same_store(one, many):
    """Every file of every array (chunks and metadata) bitwise equal; index, samples and tokens equal."""
    assert one.status == many.status == "complete" and many.verify(decode=True) == []
    assert one.index.equals(many.index)
    cols = ["batch", "sample_start", "sample_stop", "loss"]
    assert one.batches[cols].equals(many.batches[cols])
    assert one.samples.equals(many.samples)
    files = sorted(p.relative_to(one.path) for p in one.path.rglob("*")
                   if p.is_file() and p.parts[len(one.path.parts)] not in ("_index", ".hookrun.lock", "zarr.json"))
    assert files == sorted(p.relative_to(many.path) for p in many.path.rglob("*")
                           if p.is_file() and p.parts[len(many.path.parts)] not in ("_index", ".hookrun.lock", "zarr.json"))
    assert len(files) > 20 and all(same_bytes(one.path / f, many.path / f) for f in files)
    assert many.attrs["world_size"] > 1 and not (many.path / "_index" / "rank-001").exists()


@pytest.mark.slow
def test_two_ranks_write_the_store_one_process_writes(tmp_path):
    run_here(tmp_path / "one", *MLP)
    proc = torchrun(2, *MLP, f"hydra.run.dir={tmp_path / 'two'}")
    assert "rank 1 of 2: batches 6..12, 26 samples" in proc.stderr + proc.stdout
    one, two = hookrun.open(tmp_path / "one"), hookrun.open(tmp_path / "two")
    same_store(one, two)
    x = one.load(layer="fc1", role="input.0")
    assert x.shape == (50, 6) and np.array_equal(x, two.load(layer="fc1", role="input.0"))


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_three_ranks_of_a_language_model_store_every_token_once(tmp_path):
    run_here(tmp_path / "one", *LM)
    torchrun(3, *LM, f"hydra.run.dir={tmp_path / 'three'}")
    one, three = hookrun.open(tmp_path / "one"), hookrun.open(tmp_path / "three")
    same_store(one, three)
    assert one.tokens().equals(three.tokens()) and len(three.tokens()) == len(three.load(layer="transformer.h.1",
                                                                                          role="output"))


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_a_killed_rank_resumes_where_each_rank_stopped(tmp_path):
    run_here(tmp_path / "one", *MLP)
    run_dir = tmp_path / "two"
    proc = torchrun(2, *MLP, "store.writer=sync", f"hydra.run.dir={run_dir}",  # sync: committed as each batch ends
                    env={"HOOKRUN_TEST_KILL_RANK": "1", "HOOKRUN_TEST_KILL_AT": "6"}, check=False)
    assert proc.returncode != 0
    killed = hookrun.open(run_dir)
    assert killed.status != "complete"
    batches = killed.batches.batch.tolist()  # rank 1 (batches 6..12) died in batch 9 (forward 6: the first-batch
    # check runs 1 and 2 samples)
    assert {6, 7, 8} <= set(batches) and 9 not in batches and killed.verify() == []
    refused = run_cli(*MLP, "store.mode=resume", f"hydra.run.dir={run_dir}", check=False)
    assert refused.returncode == 2 and "written by 2 process(es), this run has 1" in refused.stdout + refused.stderr
    proc = torchrun(2, *MLP, "store.mode=resume", f"hydra.run.dir={run_dir}")
    assert "starting at batch 9" in proc.stdout + proc.stderr
    same_store(hookrun.open(tmp_path / "one"), hookrun.open(run_dir))


def test_ranks_come_from_torchrun_or_slurm_and_split_batches_without_padding(monkeypatch):
    from hookrun.engine.ranks import Ranks

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    assert Ranks.from_env() == Ranks(0, 1, 0)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert Ranks.from_env() == Ranks(5, 8, 1)  # one SLURM task a rank (srun python -m hookrun ...)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert Ranks.from_env() == Ranks(1, 2, 0)  # torchrun inside a SLURM job wins
    shares = [Ranks(r, 3).share(13) for r in range(3)]
    assert shares == [(0, 4), (4, 8), (8, 13)]  # contiguous, every batch once, sizes within one
    assert [Ranks(r, 4).share(2) for r in range(4)] == [(0, 0), (0, 1), (1, 1), (1, 2)]  # more ranks than batches


def test_a_rank_device_is_numbered(monkeypatch):
    """device=cuda becomes a numbered device (torch.cuda.set_device refuses a bare "cuda"): the local rank's with
    several ranks, torch's current device with one; the current device is faked here, the GPU run is test_cuda's."""
    from hookrun.config.checks import ConfigError
    from hookrun.engine.ranks import Ranks

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert Ranks(0, 1, 0).device("cuda") == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert Ranks(1, 2, 1).device("cuda") == torch.device("cuda", 1)
    assert Ranks(1, 2, 1).device("cuda:2") == torch.device("cuda", 2)  # a number given is kept
    assert Ranks(0, 1, 0).device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a second rank on a machine of one GPU: refused
    with pytest.raises(ConfigError, match=r"rank 1 is local rank 1 of its machine, which has 1 CUDA device\(s\); "
                                          r"start at most 1 process\(es\) a machine \(torchrun --nproc-per-node=1\)"):
        Ranks(1, 2, 1).device("cuda")


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_two_ranks_of_a_patching_grid_with_metrics_write_the_store_one_process_writes(tmp_path):
    """metrics: and patching: under torchrun: each rank computes its batches' metrics and grids into one store,
    bitwise the one a single process writes (captures of the fed role too)."""
    from tests.helpers import write_pairs
    from tests.test_patching_run import grid_run

    pairs = write_pairs(tmp_path / "pairs.jsonl")
    args = [*grid_run(pairs, "gpt2", "{layers:[transformer.h.0,transformer.h.1],positions:all}",
                      "+patching.sites_per_forward=4", "+hooks.resid={kind:forward,layers:[transformer.h.1]}",
                      "+metrics.ce={metric:loss}"), "store.chunk_rows=2", "store.commit_s=0", "data.batch_size=1"]
    torchrun(1, *args, f"hydra.run.dir={tmp_path / 'one'}")  # one process on one thread, as each rank runs
    torchrun(2, *args, f"hydra.run.dir={tmp_path / 'two'}")
    one, two = hookrun.open(tmp_path / "one"), hookrun.open(tmp_path / "two")
    same_store(one, two)
    assert one.grid().scores.shape[:2] == (len(one.samples), 2) and np.isfinite(one.samples["ce"]).all()
