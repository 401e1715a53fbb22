"""Attribution patching benchmark: hookrun's AtP grid against a hand-written AtP and against hookrun's exact grid.

Two models built from config (random weights, seeded): the bundled LM shape (hookrun.experiments.lm.causal_lm,
4 blocks, d 64, 4 heads) on 12-token prompts (4 x 12 = 48 residual sites) and a GPT-2-shaped model of 8 blocks (d
128, 4 heads) on 24-token prompts (8 x 24 = 192 residual sites); --pairs clean/corrupt pairs (default 32, one batch;
the corrupt prompt has another token at position 3), metric: the logit difference of the two tokens at position 3
read at the last position. Per model and grid (residual: every block's output x every position; heads: every
block's attn.c_proj input split into heads, all positions patched together), timed side by side in one process,
interleaved --rounds times (min and median), torch on --threads threads (default 1):

    hand_atp        plain PyTorch written here: forward hooks keep the clean run's tensors, the corrupt run's are kept
                    in the graph, one torch.autograd.grad, grad . (clean - corrupt) summed per site
    hookrun_atp     hookrun.methods.attribution.attribution_grid, method gradient
    hookrun_ig      the same, method integrated_gradients, --steps steps (residual grids only)
    exact           hookrun.methods.patching.patch_grid, sites_per_forward auto

It prints each way's min and median seconds, the ratios (hookrun_atp / hand_atp: target <= 1.2, in wall seconds
and in CPU seconds, time.process_time, steadier on a loaded machine; atp / exact),
the largest difference between hookrun's and the hand AtP, and Pearson(AtP, exact) and Pearson(IG, exact) per
cell (sample x layer x site).

    python benchmarks/attribution.py                 # ~1-2 minutes on a shared 2-core machine
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from _args import parse
from hookrun.capture.tokens import TokenInfo
from hookrun.experiments.lm import causal_lm
from hookrun.methods.attribution import attribution_grid
from hookrun.methods.patching import patch_grid

CHANGE = 3  # the corrupted position
MODELS = {"bundled LM (4 blocks)": ({"n_layer": 4, "n_embd": 64, "n_head": 4}, 12),
          "GPT-2 8 blocks": ({"n_layer": 8, "n_embd": 128, "n_head": 4}, 24)}


def make_batch(n: int, length: int, vocab: int = 512, seed: int = 0):
    """(clean kwargs, corrupt kwargs, TokenInfo, metric): n unpadded pairs of `length` tokens."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, vocab, (n, length), generator=g)
    corrupt = clean.clone()
    corrupt[:, CHANGE] = (clean[:, CHANGE] + 11) % (vocab - 1) + 1
    mask = torch.ones(n, length, dtype=torch.bool)
    good, bad = clean[:, CHANGE], corrupt[:, CHANGE]

    def metric(logits, rows):
        r = torch.arange(len(rows))
        return logits[r, -1, good[rows]] - logits[r, -1, bad[rows]]
    return {"input_ids": clean}, {"input_ids": corrupt}, TokenInfo.of_batch(mask, mask, length), metric


def hand_atp(model, names, src, tgt, metric, role="output", heads=None):
    """[B, layers, positions | heads]: grad . (clean - corrupt), written with plain hooks and autograd."""
    mods = [model.get_submodule(n) for n in names]
    kept = {}

    def hook(i):
        if role == "output":
            return mods[i].register_forward_hook(lambda m, a, o: kept.__setitem__(i, o[0] if isinstance(o, tuple)
                                                                                   else o))
        return mods[i].register_forward_pre_hook(lambda m, a: kept.__setitem__(i, a[0]))
    handles = [hook(i) for i in range(len(mods))]
    with torch.no_grad():
        model(**src)
    clean = dict(kept)
    logits = model(**tgt).logits
    values = metric(logits, torch.arange(logits.shape[0]))
    grads = torch.autograd.grad(values.sum(), [kept[i] for i in range(len(mods))])
    for h in handles:
        h.remove()
    with torch.no_grad():
        out = []
        for i, g in enumerate(grads):
            prod = g * (clean[i] - kept[i])  # [B, T, D]
            out.append(prod.sum(-1) if heads is None else prod.reshape(*prod.shape[:2], heads, -1).sum((1, 3)))
        return torch.stack(out, 1)


def pearson(a, b) -> float:
    a, b = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    keep = np.isfinite(a) & np.isfinite(b)
    return float(np.corrcoef(a[keep], b[keep])[0, 1])


def bench(name, config, length, args):
    torch.manual_seed(0)
    model = causal_lm(**config).eval()
    src, tgt, info, metric = make_batch(args.pairs, length)
    n = config["n_layer"]
    blocks = [f"transformer.h.{i}" for i in range(n)]
    projs = [f"transformer.h.{i}.attn.c_proj" for i in range(n)]
    heads = config["n_head"]
    grids = {
        f"residual {n}x{length}={n * length} sites": {
            "hand_atp": lambda: hand_atp(model, blocks, src, tgt, metric),
            "hookrun_atp": lambda: attribution_grid(model, src, tgt, info, info, blocks, metric=metric).estimate,
            "hookrun_ig": lambda: attribution_grid(model, src, tgt, info, info, blocks, metric=metric,
                                                   method="integrated_gradients", steps=args.steps).estimate,
            "exact": lambda: patch_grid(model, src, tgt, info, info, blocks, metric=metric).scores},
        f"heads {n}x{heads}={n * heads} sites": {
            "hand_atp": lambda: hand_atp(model, projs, src, tgt, metric, role="input", heads=heads),
            "hookrun_atp": lambda: attribution_grid(model, src, tgt, info, info, projs, metric=metric, role="input",
                                                    heads="all").estimate,
            "exact": lambda: patch_grid(model, src, tgt, info, info, projs, metric=metric, role="input",
                                        heads="all").scores}}
    for grid, ways in grids.items():
        times, cpu = {w: [] for w in ways}, {w: [] for w in ways}
        results = {}
        for _ in range(args.rounds):
            for way, fn in ways.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                results[way] = fn()
                times[way].append(time.perf_counter() - start)
                cpu[way].append(time.process_time() - start_cpu)
        with torch.no_grad():
            corrupt = metric(model(**tgt).logits, torch.arange(args.pairs))
        exact = results["exact"] - corrupt[:, None, None]
        print(f"\n{name}, {grid}, {args.pairs} pairs, {args.rounds} rounds:")
        for way, t in times.items():
            print(f"  {way:12s} min {min(t):.4f} s  median {statistics.median(t):.4f} s")
        atp, hand, best = min(times["hookrun_atp"]), min(times["hand_atp"]), min(times["exact"])
        median = statistics.median(times["hookrun_atp"]) / statistics.median(times["hand_atp"])
        med_cpu = statistics.median(cpu["hookrun_atp"]) / statistics.median(cpu["hand_atp"])
        print(f"  hookrun_atp / hand_atp {atp / hand:.2f}x (median {median:.2f}x; CPU seconds "
              f"{min(cpu['hookrun_atp']) / min(cpu['hand_atp']):.2f}x, median {med_cpu:.2f}x); hand_atp / exact "
              f"{hand / best:.3f}x; hookrun_atp / exact {atp / best:.3f}x")
        diff = float((results["hookrun_atp"] - results["hand_atp"]).abs().max())
        r = pearson(results["hookrun_atp"], exact)
        print(f"  max |hookrun_atp - hand_atp| {diff:.2e}; Pearson(AtP, exact) {r:.3f}"
              + (f", Pearson(IG {args.steps} steps, exact) {pearson(results['hookrun_ig'], exact):.3f}; "
                 f"hookrun_ig / hookrun_atp {min(times['hookrun_ig']) / atp:.2f}x" if "hookrun_ig" in results else ""))


def main(argv=None):
    args = parse(__doc__, argv, pairs=32, rounds=3, steps=4)  # steps: integrated gradients'
    for name, (config, length) in MODELS.items():
        bench(name, config, length, args)


if __name__ == "__main__":
    main()
