"""Dictionary training benchmark: hookrun's trainer (hookrun.methods.training) against SAELens 6.54's training step on
the same activations, the same initial weights and the same hyperparameters; and hookrun reading a store against
reading the same rows from memory.

    hookrun     Trainer.step: the kind's loss, dead-feature counters, backward, clip_grad 1.0, Adam
    sae_lens    what SAELens's SAETrainer._train_step does: sae.training_forward_pass(TrainStepInput(... dead mask)),
                the firing counters, backward, clip_grad_norm_(1.0), Adam, zero_grad (its training SAE classes)
    store       hookrun's Trainer fed by StoreRows (cap.loader through the shuffle buffer) from a store holding the
                rows, against the same trainer fed from a tensor in memory

The activations are a toy of superposition at a realistic width (d_in features mixed from 4 x d_in sparse ones).
Rounds alternate (hookrun, sae_lens, ...), --rounds of them; min and median wall seconds, CPU seconds
(time.process_time) beside them, tokens per second, and the final MSE / L0 / variance explained of each (the same
minibatches: equal within float noise).

    python benchmarks/train.py --rounds 3 --steps 40          # a few minutes on 2 loaded cores

Then the store: peak memory (tracemalloc: numpy's buffers) while StoreRows serves the minibatches, from a store of
the rows and from one 4 times larger, the shuffle buffer the same: bounded by the buffer, not by the store.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _args import parse


def data(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(4 * d, d, generator=g)
    dirs /= dirs.norm(dim=1, keepdim=True)
    on = torch.rand(n, 4 * d, generator=g) < 8 / (4 * d)
    return (torch.rand(n, 4 * d, generator=g) * on) @ dirs


def hookrun_loop(x, batches, kind, width, k, seed=0):
    from hookrun.methods.training.kinds import TrainingDictionary
    from hookrun.methods.training.trainer import Schedule, Trainer
    torch.manual_seed(seed)
    d = TrainingDictionary(x.shape[1], width, kind, k=k)
    t = Trainer(d, Schedule(steps=len(batches), lr=3e-4))
    for idx in batches:
        t.step(x[idx])
    return d


def saelens_loop(x, batches, kind, width, k, seed=0):
    from sae_lens.saes.sae import TrainStepInput
    from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig
    from hookrun.methods.training.kinds import TrainingDictionary
    torch.manual_seed(seed)
    init = TrainingDictionary(x.shape[1], width, kind, k=k).state_dict()
    if kind == "topk":
        sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=x.shape[1], d_sae=width, k=k))
    else:
        sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=x.shape[1], d_sae=width))
    sae.load_state_dict(init)
    opt = torch.optim.Adam(sae.parameters(), lr=3e-4)
    since = torch.zeros(width)
    for idx in batches:
        out = sae.training_forward_pass(TrainStepInput(x[idx], {"l1": 1.0}, since > 1000, 0, False))
        with torch.no_grad():
            fired = out.feature_acts.bool().float().sum(-2).bool()
            since += 1
            since[fired] = 0
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(sae.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return sae


def quality(module, x, hookrun_side: bool):
    with torch.no_grad():
        if hookrun_side:
            f, _ = module.encode_with_hidden_pre(x, training=False)
            x_hat = module.decode(f, x)
        else:
            f = module.encode(x)
            x_hat = module.decode(f)
    mse = float((x_hat - x).pow(2).sum(1).mean())
    var = float((x - x.mean(0)).pow(2).sum(1).mean())
    return mse, float((f != 0).sum(1).float().mean()), 1 - mse / var


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def store_rows(x: torch.Tensor, folder: Path):
    """A store holding x's rows at one site (an identity model's output), as a hookrun run writes it."""
    import hookrun
    from hydra import compose, initialize_config_dir
    from hookrun.config.schema import register_configs
    from hookrun.engine.runner import run
    repo = Path(__file__).resolve().parents[1]
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "x.npy", x.numpy())
    register_configs()
    with initialize_config_dir(config_dir=str(repo / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+model._target_=torch.nn.Identity", f"+data.inputs.x={{file: {folder / 'x.npy'}}}",
            "data.batch_size=4096", "+hooks.m={kind: forward, layers: [_model]}", "device=cpu",
            f"store.path={folder / 'acts.zarr'}", "progress_s=0"])
        run(cfg)
    return hookrun.open(folder / "acts.zarr")


def report(times: dict, result: dict, n: int, peer: str) -> None:
    """Print each trainer's wall / CPU figures and quality (times: name -> [(wall, cpu)], result: name -> (mse,
    l0, ev)) and hookrun's throughput over the peer's. Usage: report(times, result, n, "sae_lens")."""
    for name, rows in times.items():
        walls, cpus = [w for w, _ in rows], [c for _, c in rows]
        mse, l0, ev = result[name]
        print(f"  {name:9s} wall min {min(walls):.2f} s median {statistics.median(walls):.2f} s, cpu min "
              f"{min(cpus):.2f} s; {n / min(walls):,.0f} tokens/s; MSE {mse:.4f} L0 {l0:.2f} EV {ev:.4f}")
    ratio = min(w for w, _ in times[peer]) / min(w for w, _ in times["hookrun"])
    cpu = min(c for _, c in times[peer]) / min(c for _, c in times["hookrun"])
    print(f"  hookrun throughput / {peer}: {ratio:.2f}x (wall), {cpu:.2f}x (CPU)")


def main(argv=None):
    args = parse(__doc__, argv, rounds=3, steps=40, d_in=256, width=2048, k=32, batch=4096)
    n = args.batch * args.steps
    x = data(n, args.d_in)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    batches = [order[i * args.batch:(i + 1) * args.batch] for i in range(args.steps)]
    print(f"{n} rows of {args.d_in}, {args.steps} steps of {args.batch}, width {args.width}")
    for kind in ("topk", "relu"):
        k = args.k if kind == "topk" else None
        times = {"hookrun": [], "sae_lens": []}
        result = {}
        for _ in range(args.rounds):
            for name, loop in (("hookrun", hookrun_loop), ("sae_lens", saelens_loop)):
                module, wall, cpu = timed(lambda: loop(x, batches, kind, args.width, k))
                times[name].append((wall, cpu))
                result[name] = quality(module, x[:8192], name == "hookrun")
        print(f"\n{kind}:")
        report(times, result, n, "sae_lens")
    from hookrun.methods.training.kinds import TrainingDictionary
    from hookrun.methods.training.sources import StoreRows
    from hookrun.methods.training.trainer import Schedule, Trainer
    with tempfile.TemporaryDirectory() as tmp:
        cap = store_rows(x, Path(tmp) / "a")

        def from_store():
            src = StoreRows(cap, ["_model"], "m", None, args.batch, 8 * args.batch, 0)
            torch.manual_seed(0)
            t = Trainer(TrainingDictionary(args.d_in, args.width, "topk", k=args.k), Schedule(steps=args.steps))
            for _ in range(args.steps):
                t.step(src.next()[0])
            src.close()

        def from_memory():
            hookrun_loop(x, batches, "topk", args.width, args.k)
        times = {"store": [], "memory": []}
        for _ in range(args.rounds):
            for name, fn in (("store", from_store), ("memory", from_memory)):
                times[name].append(timed(fn)[1:])
        (sw, sc), (mw, mc) = (min(times[n]) for n in ("store", "memory"))
        print(f"\nfrom a store {sw:.2f} s wall ({min(c for _, c in times['store']):.2f} s CPU), from memory {mw:.2f} s "
              f"({min(c for _, c in times['memory']):.2f} s CPU): {mw / sw:.2f}x the in-memory throughput (wall)")
        print(f"peak memory of the store's reads (tracemalloc, {args.steps} minibatches of {args.batch}, shuffle buffer "
              f"{8 * args.batch} rows = {8 * args.batch * args.d_in * 4 / 2 ** 20:.0f} MiB):")
        for scale in (1, 4):
            big = cap if scale == 1 else store_rows(data(scale * n, args.d_in, seed=2), Path(tmp) / f"x{scale}")
            print(f"  a store of {scale * n} rows ({scale * n * args.d_in * 4 / 2 ** 20:.0f} MiB): "
                  f"{read_peak(big, args) / 2 ** 20:.1f} MiB")


def read_peak(cap, args) -> int:
    """The peak of Python-tracked memory (numpy's buffers included) while StoreRows serves args.steps minibatches."""
    import tracemalloc
    from hookrun.methods.training.sources import StoreRows
    tracemalloc.start()
    try:
        src = StoreRows(cap, ["_model"], "m", None, args.batch, 8 * args.batch, 0)
        for _ in range(args.steps):
            src.next()
        src.close()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

if __name__ == "__main__":
    main()
