"""Dictionary training against EleutherAI's sparsify (eai-sparsify 1.3): hookrun's TopK trainer and sparsify's own
SparseCoder step on the same activations, the same initial weights and the same hyperparameters, in alternated
rounds; sparsify runs in its own venv (its pins: benchmarks/venvs.sh makes .venv-sparsify), one process a round.

    hookrun     Trainer.step (hookrun.methods.training): TopK's sparse path (MSE + AuxK), firing counters,
                backward, the gradient parallel to decoder rows removed, Adam, rows renormalised (decoder_norm unit)
    sparsify    sparsify/trainer.py's local step, its own code: SparseCoder.forward(x, dead_mask=...) -> fvu +
                auxk_alpha * auxk_loss, backward, remove_gradient_parallel_to_decoder_directions, Adam,
                set_decoder_norm_to_unit_norm, the tokens-since-fired counters

Matched: the minibatches and their order; the initial weights (hookrun's init, W_enc = W_dec^T, decoder rows then set
to unit norm as sparsify's SparseCoder sets them, b_enc = b_dec = 0); width, k; Adam (betas 0.9, 0.999) at one lr,
--lr, by default sparsify's own 2e-4 / sqrt(width / 2^14); no gradient clipping (sparsify has none: hookrun's
clip_grad null here, where its SAELens default is 1.0); decoder rows unit (hookrun's decoder_norm unit; its default,
SAELens's, keeps them free); no feature dead within the run on either side (hookrun: 1000 steps, sparsify: 10M
tokens), so AuxK is 0 on both. Not matched: the loss's scale (hookrun's MSE is sum over d_in, mean over tokens,
sparsify's FVU divides the sum by the batch's variance): a near-constant factor that Adam's updates do not see.

    .venv-sparsify/bin/python -c 'import sparsify'      # made by benchmarks/venvs.sh
    python benchmarks/train_sparsify.py --rounds 3 --steps 20 --sparsify-python .venv-sparsify/bin/python

Wall and CPU seconds (the peer's measured inside its process, its imports excluded), tokens per second, and the final
MSE / L0 / variance explained of each on the same held-out rows (equal within the seeds' noise: the losses differ
by a constant factor, fvu = MSE / variance, which Adam's updates do not see).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _args import parse
from train import data, quality, report

PEER = r'''
import json, sys, time
import numpy as np, torch
from sparsify import SparseCoder, SparseCoderConfig
torch.set_num_threads(int(sys.argv[3]))
folder, steps = sys.argv[1], int(sys.argv[2])
x = torch.from_numpy(np.load(f"{folder}/x.npy")); order = torch.from_numpy(np.load(f"{folder}/order.npy"))
init = torch.load(f"{folder}/init.pt"); meta = json.load(open(f"{folder}/meta.json"))
sae = SparseCoder(x.shape[1], SparseCoderConfig(num_latents=meta["width"], k=meta["k"]))
with torch.no_grad():
    sae.encoder.weight.copy_(init["W_enc"].T); sae.encoder.bias.copy_(init["b_enc"])
    sae.W_dec.copy_(init["W_dec"]); sae.b_dec.copy_(init["b_dec"])
opt = torch.optim.Adam(sae.parameters(), lr=meta["lr"])
since = torch.zeros(meta["width"], dtype=torch.long)
w, c = time.perf_counter(), time.process_time()
for i in range(steps):
    batch = x[order[i * meta["batch"]:(i + 1) * meta["batch"]]]
    out = sae(batch, dead_mask=since > 10_000_000)          # the trainer's default dead_feature_threshold
    (out.fvu + 1 / 32 * out.auxk_loss).backward()           # auxk_alpha 1/32, the trainer's default
    sae.remove_gradient_parallel_to_decoder_directions()
    opt.step(); opt.zero_grad()
    sae.set_decoder_norm_to_unit_norm()
    with torch.no_grad():
        fired = torch.zeros(meta["width"], dtype=torch.bool); fired[out.latent_indices.flatten()] = True
        since += batch.shape[0]; since[fired] = 0
wall, cpu = time.perf_counter() - w, time.process_time() - c
held = x[:8192]
with torch.no_grad():
    enc = sae.encode(held); x_hat = sae.decode(enc.top_acts, enc.top_indices)
mse = float((x_hat - held).pow(2).sum(1).mean()); var = float((held - held.mean(0)).pow(2).sum(1).mean())
l0 = float((enc.top_acts != 0).sum(1).float().mean())
print(json.dumps({"wall": wall, "cpu": cpu, "mse": mse, "l0": l0, "ev": 1 - mse / var}))
'''


def hookrun_loop(x, batches, width, k, lr, init):
    """hookrun's trainer as sparsify trains: unit decoder rows, no clipping, from the weights `init`."""
    from hookrun.methods.training.kinds import TrainingDictionary
    from hookrun.methods.training.trainer import Schedule, Trainer
    d = TrainingDictionary(x.shape[1], width, "topk", k=k)
    d.load_state_dict(init)
    t = Trainer(d, Schedule(steps=len(batches), lr=lr, clip_grad=None, decoder_norm="unit"))
    for idx in batches:
        t.step(x[idx])
    return d


def main(argv=None):
    args = parse(__doc__, argv, rounds=3, steps=20, d_in=256, width=2048, k=32, batch=4096, lr=0.0,
                 sparsify_python=".venv-sparsify/bin/python")
    lr = args.lr or 2e-4 / (args.width / 2 ** 14) ** 0.5
    n = args.batch * args.steps
    x = data(n, args.d_in)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    batches = [order[i * args.batch:(i + 1) * args.batch] for i in range(args.steps)]
    print(f"{n} rows of {args.d_in}, {args.steps} steps of {args.batch}, width {args.width}, k {args.k}, lr {lr:.3g}")
    from hookrun.methods.training.kinds import TrainingDictionary
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/x.npy", x.numpy())
        np.save(f"{tmp}/order.npy", order.numpy())
        torch.manual_seed(0)  # the initial weights of both: hookrun's init, the decoder rows unit
        start = TrainingDictionary(args.d_in, args.width, "topk", k=args.k)
        start.unit_norm_decoder()
        init = {name: value.clone() for name, value in start.state_dict().items()}
        torch.save(init, f"{tmp}/init.pt")
        Path(f"{tmp}/meta.json").write_text(json.dumps(dict(width=args.width, k=args.k, lr=lr, batch=args.batch)))
        Path(f"{tmp}/peer.py").write_text(PEER)
        times = {"hookrun": [], "sparsify": []}
        result = {}
        for _ in range(args.rounds):
            w, c = time.perf_counter(), time.process_time()
            module = hookrun_loop(x, batches, args.width, args.k, lr, init)
            times["hookrun"].append((time.perf_counter() - w, time.process_time() - c))
            result["hookrun"] = quality(module, x[:8192], True)
            out = subprocess.run([args.sparsify_python, f"{tmp}/peer.py", tmp, str(args.steps), str(args.threads)],
                                 capture_output=True, text=True, check=True)
            peer = json.loads(out.stdout.strip().splitlines()[-1])
            times["sparsify"].append((peer["wall"], peer["cpu"]))
            result["sparsify"] = (peer["mse"], peer["l0"], peer["ev"])
    report(times, result, n, "sparsify")


if __name__ == "__main__":
    sys.exit(main())
