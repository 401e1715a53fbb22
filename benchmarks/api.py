"""Start-up saved by reusing a loaded model: N runs of the bundled LM experiment (lm_tokens) as N CLI commands, as N
hookrun.run calls that each build the model from the config, and as N hookrun.run(model=...) calls on one model;
with --methods, the fixed cost of a declared run per method (a notebook's rerun).

    python benchmarks/api.py [--runs 10] [--shape tiny|small] [--no-cli]
    python benchmarks/api.py --methods [--store memory|disk] [--runs 7] [--other-keys 50000]

--methods: one bundled experiment per method, its model built once and passed as model=, run N times; each run's
fixed cost is its wall time in hookrun.run less its batches (the loop's seconds the store records, loop_s): the
config, the checks, opening and closing the store, opening the result. Printed per method, with one torch thread:
the median and the range over the reruns (the same config, inputs and model: the first-batch check is not run
again), and the median over as many runs whose first-batch check runs (a new config's first run). --other-keys N: N files of someone else in the process's memory filesystem first (other
memory stores a notebook keeps: each listing of a memory store reads every key of the process).

tiny: the experiment's GPT-2 as bundled (2 layers, d_model 64); small: GPT-2-small-shaped (12 layers, d_model 768,
12 heads, ~86M parameters with the bundled 512-token vocabulary), random init, where building the model costs what
loading a real one does. Each run stores every block's output for 16 documents of 64 tokens. Printed: the seconds
of each way in all and per run, and the store of the last model= run checked equal to the config-built one's."""
import argparse
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import hookrun
from hookrun.experiments.lm import causal_lm

SHAPES = {"tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4}, "small": {"n_layer": 12, "n_embd": 768, "n_head": 12}}
DATA = ["data.max_samples=16", "data.batch_size=8"]


def overrides(shape: dict) -> list:
    return ["+experiment=lm_tokens", *DATA, *(f"model.{k}={v}" for k, v in shape.items())]


def timed(label: str, runs: int, one) -> float:
    """Seconds of `runs` calls of one(i), printed in all and per run."""
    start = time.perf_counter()
    for i in range(runs):
        one(i)
    seconds = time.perf_counter() - start
    print(f"{label:<44} {seconds:8.2f} s  ({seconds / runs:.2f} s a run)", flush=True)
    return seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--no-cli", action="store_true", help="skip the N CLI commands")
    parser.add_argument("--methods", action="store_true", help="the fixed cost of a declared run, per method")
    parser.add_argument("--store", choices=["memory", "disk"], default="memory", help="--methods: where the stores go")
    parser.add_argument("--other-keys", type=int, default=0, help="--methods: other files in the memory filesystem")
    args = parser.parse_args(argv)
    if args.methods:
        return fixed_costs(args.runs, args.store, args.other_keys)
    logging.basicConfig(level=logging.WARNING)  # the runs' summaries not printed: only the timings below
    shape = SHAPES[args.shape]
    work = Path(tempfile.mkdtemp(prefix="hookrun-api-bench-"))
    print(f"{args.runs} runs of lm_tokens ({args.shape}: {shape}), {torch.get_num_threads()} torch threads")
    found = {}
    if not args.no_cli:
        found["cli"] = timed(f"{args.runs} x python -m hookrun", args.runs, lambda i: subprocess.run(
            [sys.executable, "-m", "hookrun", *overrides(shape), f"hydra.run.dir={work / 'cli' / str(i)}"],
            check=True, capture_output=True))
    found["run"] = timed(f"{args.runs} x hookrun.run (model built each run)", args.runs, lambda i: hookrun.run(
        None, overrides(shape), store={"path": str(work / "run" / f"{i}.zarr")}))
    start = time.perf_counter()
    torch.manual_seed(0)  # the run's seed: the weights the config builds
    model = causal_lm(**shape).eval()
    found["load"] = time.perf_counter() - start
    print(f"{'the model built once':<44} {found['load']:8.2f} s")
    found["model"] = timed(f"{args.runs} x hookrun.run(model=...)", args.runs, lambda i: hookrun.run(
        None, ["+experiment=lm_tokens", *DATA], model=model, store={"path": str(work / "model" / f"{i}.zarr")}))
    a, b = hookrun.open(work / "run" / "0.zarr"), hookrun.open(work / "model" / f"{args.runs - 1}.zarr")
    same = all(np.array_equal(a.array(k)[:], b.array(k)[:]) for k in a.index.array.unique())
    print(f"saved by model= : {found['run'] - found['model'] - found['load']:.2f} s against hookrun.run"
          + (f", {found['cli'] - found['model'] - found['load']:.2f} s against the CLI" if "cli" in found else "")
          + f" (the one build counted); captures equal to the config-built run's: {same}")
    return found


METHODS = {"hooks (capture)": ("lm_tokens", []), "lens + dla": ("lens", []),
           "patching + metrics": ("patching_grid", []), "attribution": ("attribution", []),
           "dictionaries": ("sae_features", []), "generate": ("lm_tokens", ["generate.max_new_tokens=4"])}


def fixed_costs(runs: int, store: str, other_keys: int = 0) -> dict:
    """Per method: the seconds of hookrun.run(model=...) beyond its batches (median, min, max over `runs` reruns),
    and the median over `runs` runs whose first-batch check runs (a new config's first run: the check a rerun of the
    same config, inputs and model skips, hookrun.engine.preflight, forgotten before each); `other_keys` files of
    someone else in the memory filesystem meanwhile."""
    import fsspec
    from hydra.utils import instantiate

    from hookrun.engine import preflight

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="hookrun-api-bench-"))
    memory = fsspec.filesystem("memory")
    for i in range(other_keys):  # as other stores' chunks: a thousand a directory
        memory.pipe_file(f"/hookrun-api-bench-others/{i // 1000}/c/{i}", b"x")
    print(f"fixed cost of a declared run (wall - loop_s), {runs} runs each, store {store}, 1 torch thread"
          + (f", {other_keys} other files in memory" if other_keys else ""))
    print(f"{'method':<22} {'experiment':<14} {'rerun':>8} {'min':>8} {'max':>8} {'checked':>8} {'batches':>8}")
    found = {}
    for label, (experiment, more) in METHODS.items():
        torch.manual_seed(0)
        model = instantiate(hookrun.compose(experiment).model).eval()
        costs, checked, loops = [], [], []
        for i in range(2 * runs + 1):  # the first run composes the config and warms the caches: not counted
            path = "memory" if store == "memory" else str(work / label.split()[0] / f"{i}.zarr")
            if i > runs:
                preflight._PASSED.clear()
            start = time.perf_counter()
            cap = hookrun.run(experiment, more, model=model, store={"path": path})
            wall = time.perf_counter() - start
            loop = cap.attrs["summary"]["timing"]["loop_s"]
            if i:
                (costs if i <= runs else checked).append(wall - loop)
                loops.append(loop)
        found[label] = costs
        print(f"{label:<22} {experiment:<14} {np.median(costs) * 1e3:6.0f}ms {min(costs) * 1e3:6.0f}ms "
              f"{max(costs) * 1e3:6.0f}ms {np.median(checked) * 1e3:6.0f}ms {np.median(loops) * 1e3:6.0f}ms",
              flush=True)
    if other_keys:
        memory.rm("/hookrun-api-bench-others", recursive=True)
    return found


if __name__ == "__main__":
    main()
