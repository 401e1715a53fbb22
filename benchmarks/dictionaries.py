"""Dictionary features benchmark: hookrun storing a layer's SAE features (a `dictionary:` hook, top_k) against encode
by hand (an own forward hook, sae.encode, topk, kept in memory), side by side in one run, and the bytes stored
against a dense capture of the same layer.

Both read the bundled corpus (BOS + up to --max-length tokens, right-padded batches of --batch) through a
GPT-2-shaped model built from its config (hookrun.experiments.lm.causal_lm, random init, seed 0): the bundled LM's
shape (2 x 64) and 8 blocks x 256. The SAE (hookrun.methods.saes.SparseAutoencoder, d_sae = 8 x d_model,
ReLU, seeded, encoder bias -0.05) is saved as a SAELens folder and read at block
n_layer // 2's output.

    hookrun     hookrun.engine.runner.run in this process: its batch loop (summary loop_s: forwards, encode, top_k,
                the store's writes of features.indices / features.values / error_norm)
    one-call    hookrun.features(model, ids, sae, site=layer, k=..., evaluate=...) (hookrun/analyses.py) on the
                same ids: no config, no store
    hand_loop   plain PyTorch: a forward hook, sae.encode, torch.topk, the error norm; numpy arrays kept in memory

Each shape runs twice: the features alone, and with `evaluate: true` (SAELens's evaluation sums a batch, and CE
loss recovered: the layer spliced, then zeroed, two more forwards a batch; by hand the same, the clean loss from
the batch's own forward), the evaluations table checked equal to the hand ones.

Rounds are interleaved (hookrun, one-call, hand, ...), --rounds of them; min and median, the ratios hookrun / hand
and one-call / hand (target within 1.2x) in wall seconds and in CPU seconds (the loop's `loop_cpu_s`, time.process_time around the hand loop:
steadier on a loaded machine); the stored features are checked equal to the hand ones (values within 1e-5), and
the bytes on disk of the features against a dense capture (`capture: [output]`) of the same layer.

    python benchmarks/dictionaries.py          # about a minute on 2 cores
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import hookrun
from _args import parse
from hookrun.experiments.lm import causal_lm
from hookrun.methods.saes import SparseAutoencoder, save_saelens

SHAPES = {"bundled LM (2 x 64)": dict(n_layer=2, n_embd=64, n_head=4),
          "GPT-2 shape (8 x 256)": dict(n_layer=8, n_embd=256, n_head=8)}


def make_sae(d: int, path: Path) -> SparseAutoencoder:
    torch.manual_seed(1)
    sae = SparseAutoencoder(d, 8 * d)
    with torch.no_grad():
        sae.b_enc.fill_(-0.05)
    save_saelens(sae, path)
    return sae.eval()


def overrides(shape, args, layer, path, hook) -> list:
    return ["+experiment=lm_tokens", "hooks.resid=null", *(f"model.{k}={v}" for k, v in shape.items()),
            f"data.batch_size={args.batch}", f"data.text.max_length={args.max_length}", f"+hooks.x={hook}",
            f"store.path={path}", "store.mode=overwrite", "store.writer=sync", "progress_s=0", *(
                [f"+dictionaries={{sae1: {{path: {path.parent / 'sae'}}}}}"] if "dictionary" in hook else [])]


def run_hookrun(shape, args, layer, path, hook):
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg

    run(make_cfg(overrides(shape, args, layer, path, hook)))
    cap = hookrun.open(path)
    timing = cap.attrs["summary"]["timing"]
    return (timing["loop_s"], timing["loop_cpu_s"]), cap


def batches(cap, size: int):
    tokens = cap.tokens()
    seqs = [g.sort_values("position")["token_id"].tolist() for _, g in tokens.groupby("sample")]
    out = []
    for start in range(0, len(seqs), size):
        part = seqs[start:start + size]
        longest = max(map(len, part))
        out.append((torch.tensor([s + [0] * (longest - len(s)) for s in part]),
                    torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in part])))
    return out


def hand_loop(model, sae, layer: str, data, k: int, evaluate: bool = False):
    """Each batch's real tokens' top-k features (indices, values) and error norm, plain PyTorch, in memory; with
    `evaluate`, SAELens's evaluation sums and CE loss recovered (the layer spliced, then zeroed: two more forwards)."""
    kept, swap = {}, {}

    def hook(m, a, o):
        x = o[0] if isinstance(o, tuple) else o
        kept["x"] = x
        if "fn" in swap:
            new = swap["fn"](x)
            return (new, *o[1:]) if isinstance(o, tuple) else new
    h = model.get_submodule(layer).register_forward_hook(hook)
    idx, val, err = [], [], []
    sums = np.zeros(6)  # tokens, l0, l1, mse, sum_sq, cossim
    x_sum, fired, ce = 0.0, 0.0, np.zeros(4)  # ce: pairs, clean, spliced, zero (summed losses)

    def nll(logits, ids, pairs):
        lp = torch.log_softmax(logits[:, :-1].float(), -1)
        return float(torch.where(pairs, -lp.gather(-1, ids[:, 1:, None])[..., 0], 0.0).double().sum())
    try:
        for ids, mask in data:
            with torch.no_grad():
                kw = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
                logits = model(**kw).logits
                x = kept["x"][mask.bool()]
                f = sae.encode(x)
                top = f.topk(k, -1)
                x_hat = sae.decode(f)
                err.append((x - x_hat).norm(dim=-1).numpy())
                idx.append(torch.where(top.values > 0, top.indices, -1).int().numpy())
                val.append(top.values.clamp(min=0).numpy())
                if evaluate:
                    xd, xh = x.double(), x_hat.double()
                    sums += [len(x), float((f != 0).sum()), float(f.abs().sum()), float((xd - xh).pow(2).sum()),
                             float(xd.pow(2).sum()),
                             float(torch.nn.functional.cosine_similarity(xd, xh, dim=-1, eps=0.0).sum())]
                    x_sum = x_sum + xd.sum(0).numpy()
                    fired = fired + (f != 0).sum(0).numpy()
                    pairs = mask[:, :-1].bool() & mask[:, 1:].bool()
                    row = [float(pairs.sum()), nll(logits, ids, pairs)]
                    for fn in (lambda t: sae.decode(sae.encode(t)), torch.zeros_like):
                        swap["fn"] = fn
                        row.append(nll(model(**kw).logits, ids, pairs))
                        del swap["fn"]
                    ce += row
    finally:
        h.remove()
    out = [np.concatenate(idx), np.concatenate(val), np.concatenate(err)]
    if evaluate:
        n = sums[0]
        mse = sums[3] / n
        clean, spliced, zero = ce[1:] / ce[0]
        variance = sums[4] / n - ((x_sum / n) ** 2).sum()
        out.append({"l0": sums[1] / n, "mse": mse, "explained_variance": 1 - mse / variance,
                    "cossim": sums[5] / n, "dead_features": int((fired == 0).sum()),
                    "ce_loss_recovered": (zero - spliced) / (zero - clean)})
    return out


def size(path: Path, hook: str) -> int:
    return sum(p.stat().st_size for p in (path / hook).rglob("*") if p.is_file())


def main(argv=None):
    args = parse(__doc__, argv, rounds=5, batch=8, max_length=64, k=16)
    print(f"{args.rounds} interleaved rounds; batches of {args.batch}, max_length {args.max_length}, top_k {args.k}, "
          "d_sae = 8 x d_model")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape in SHAPES.items():
            layer = f"transformer.h.{shape['n_layer'] // 2}"
            sae = make_sae(shape["n_embd"], Path(tmp) / "sae")
            for evaluate in (False, True):
                feats = (f"{{kind: forward, layers: [{layer}], dictionary: sae1, top_k: {args.k}"
                         + (", evaluate: true}" if evaluate else "}"))
                dense = f"{{kind: forward, layers: [{layer}], capture: [output]}}"
                path = Path(tmp) / "feats.zarr"
                _, cap = run_hookrun(shape, args, layer, path, feats)  # warm
                data = batches(cap, args.batch)
                torch.manual_seed(0)
                model = causal_lm(**shape).eval()
                seqs = [ids[m.bool()].tolist() for batch_ids, batch_mask in data for ids, m in zip(batch_ids, batch_mask)]
                ours, hand, ours_cpu, hand_cpu, calls = [], [], [], [], []
                for _ in range(args.rounds):
                    (loop_s, loop_cpu), cap = run_hookrun(shape, args, layer, path, feats)
                    ours.append(loop_s)
                    ours_cpu.append(loop_cpu)
                    t0 = time.perf_counter()
                    one = hookrun.features(model, seqs, sae, site=layer, k=args.k, evaluate=evaluate,
                                           batch_size=args.batch)
                    calls.append(time.perf_counter() - t0)
                    t0, c0 = time.perf_counter(), time.process_time()
                    mine = hand_loop(model, sae, layer, data, args.k, evaluate)
                    hand.append(time.perf_counter() - t0)
                    hand_cpu.append(time.process_time() - c0)
                got = cap.read("dictionaries", "features", features=list(range(sae.d_sae)))
                want = np.zeros_like(got)
                rows_ = np.arange(len(mine[0]))[:, None].repeat(args.k, 1)
                on = mine[0] >= 0
                want[rows_[on], mine[0][on]] = mine[1][on]
                diff = float(np.abs(got - want).max())
                assert diff < 1e-5, diff
                assert float(np.abs(one.dense() - want).max()) < 1e-5, "one-call features differ"
                if evaluate:
                    table = cap.read("dictionaries").iloc[0]
                    for key, value in mine[3].items():
                        assert np.isclose(table[key], value, rtol=1e-6, atol=1e-9), (key, table[key], value)
                feat_bytes = size(path, "x")
                dense_path = Path(tmp) / "dense.zarr"
                run_hookrun(shape, args, layer, dense_path, dense)
                rows.append((label + (" + evaluate" if evaluate else ""), len(mine[0]),
                             float((mine[0] >= 0).sum(1).mean()), ours, hand, diff, feat_bytes, size(dense_path, "x"),
                             ours_cpu, hand_cpu, calls))
    med = statistics.median
    print(f"\n{'model':33} {'tokens':>6} {'L0@k':>5} | {'hookrun loop':>17} | {'hand loop':>17} | {'ratio':>13} | "
          f"{'CPU s: hookrun':>17} | {'CPU s: hand':>17} | {'CPU ratio':>13} | {'stored / dense bytes':>22}")
    for label, tokens, l0, ours, hand, diff, fb, db, oc, hc, _ in rows:
        print(f"{label:33} {tokens:6d} {l0:5.1f} | {min(ours):7.3f} / {med(ours):7.3f} | {min(hand):7.3f} / "
              f"{med(hand):7.3f} | {min(ours) / min(hand):5.2f}x / {med(ours) / med(hand):5.2f}x | "
              f"{min(oc):7.3f} / {med(oc):7.3f} | {min(hc):7.3f} / {med(hc):7.3f} | "
              f"{min(oc) / min(hc):5.2f}x / {med(oc) / med(hc):5.2f}x | "
              f"{fb:>9,} / {db:>9,} ({fb / db:.2f}x)   (features equal, max |diff| {diff:.1e})")
    print("\none-call hookrun.features against the hand loop, wall seconds (min / median):")
    for label, tokens, l0, ours, hand, diff, fb, db, oc, hc, calls in rows:
        print(f"{label:33} one-call {min(calls):7.3f} / {med(calls):7.3f} | hand loop {min(hand):7.3f} / "
              f"{med(hand):7.3f} | one-call/hand {min(calls) / min(hand):5.2f}x / {med(calls) / med(hand):5.2f}x")


if __name__ == "__main__":
    main()
