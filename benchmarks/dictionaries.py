"""Dictionary features benchmark: hookrun storing a layer's SAE features (a `dictionary:` hook, top_k) against encode
by hand (an own forward hook, sae.encode, topk, kept in memory), side by side in one run, and the bytes stored
against a dense capture of the same layer.

Both read the bundled corpus (BOS + up to --max-length tokens, right-padded batches of --batch) through a
GPT-2-shaped model built from its config (hookrun.experiments.lm.causal_lm, random init, seed 0): the bundled LM's
shape (2 x 64) and 8 blocks x 256. The SAE (hookrun.methods.dictionaries.SparseAutoencoder, d_sae = 8 x d_model,
ReLU, seeded, encoder bias -0.05) is saved as a SAELens folder and read at block
n_layer // 2's output.

    hookrun     hookrun.engine.runner.run in this process: its batch loop (summary loop_s: forwards, encode, top_k,
                the store's writes of features.indices / features.values / error_norm)
    hand_loop   plain PyTorch: a forward hook, sae.encode, torch.topk, the error norm; numpy arrays kept in memory

Rounds are interleaved (hookrun, hand, ...), --rounds of them; min and median, the ratio hookrun / hand (target
within 1.2x); the stored features are checked equal to the hand ones (values within 1e-5), and the bytes on disk
of the features against a dense capture (`capture: [output]`) of the same layer.

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
from hookrun.methods.dictionaries import SparseAutoencoder, save_saelens

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
    return cap.attrs["summary"]["timing"]["loop_s"], cap


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


def hand_loop(model, sae, layer: str, data, k: int):
    """Each batch's real tokens' top-k features (indices, values) and error norm, plain PyTorch, in memory."""
    kept = {}
    h = model.get_submodule(layer).register_forward_hook(lambda m, a, o: kept.__setitem__("x", o[0] if isinstance(o, tuple) else o))
    idx, val, err = [], [], []
    try:
        for ids, mask in data:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
                x = kept["x"][mask.bool()]
                f = sae.encode(x)
                top = f.topk(k, -1)
                err.append((x - sae.decode(f)).norm(dim=-1).numpy())
                idx.append(torch.where(top.values > 0, top.indices, -1).int().numpy())
                val.append(top.values.clamp(min=0).numpy())
    finally:
        h.remove()
    return np.concatenate(idx), np.concatenate(val), np.concatenate(err)


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
            feats = f"{{kind: forward, layers: [{layer}], dictionary: sae1, top_k: {args.k}}}"
            dense = f"{{kind: forward, layers: [{layer}], capture: [output]}}"
            path = Path(tmp) / "feats.zarr"
            _, cap = run_hookrun(shape, args, layer, path, feats)  # warm
            data = batches(cap, args.batch)
            torch.manual_seed(0)
            model = causal_lm(**shape).eval()
            ours, hand = [], []
            for _ in range(args.rounds):
                loop_s, cap = run_hookrun(shape, args, layer, path, feats)
                ours.append(loop_s)
                t0 = time.perf_counter()
                mine = hand_loop(model, sae, layer, data, args.k)
                hand.append(time.perf_counter() - t0)
            got = cap.read("dictionaries", "features", features=list(range(sae.d_sae)))
            want = np.zeros_like(got)
            rows_ = np.arange(len(mine[0]))[:, None].repeat(args.k, 1)
            on = mine[0] >= 0
            want[rows_[on], mine[0][on]] = mine[1][on]
            diff = float(np.abs(got - want).max())
            assert diff < 1e-5, diff
            feat_bytes = size(path, "x")
            dense_path = Path(tmp) / "dense.zarr"
            run_hookrun(shape, args, layer, dense_path, dense)
            rows.append((label, len(mine[0]), float((mine[0] >= 0).sum(1).mean()), ours, hand, diff, feat_bytes,
                         size(dense_path, "x")))
    med = statistics.median
    print(f"\n{'model':22} {'tokens':>6} {'L0@k':>5} | {'hookrun loop':>17} | {'hand loop':>17} | {'ratio':>13} | "
          f"{'stored / dense bytes':>22}")
    for label, tokens, l0, ours, hand, diff, fb, db in rows:
        print(f"{label:22} {tokens:6d} {l0:5.1f} | {min(ours):7.3f} / {med(ours):7.3f} | {min(hand):7.3f} / "
              f"{med(hand):7.3f} | {min(ours) / min(hand):5.2f}x / {med(ours) / med(hand):5.2f}x | "
              f"{fb:>9,} / {db:>9,} ({fb / db:.2f}x)   (features equal, max |diff| {diff:.1e})")


if __name__ == "__main__":
    main()
