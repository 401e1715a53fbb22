"""Logit lens + DLA benchmark: hookrun's `lens:` block in a real run against a hand-written loop with the same outputs.

Both read the same prompts (the bundled corpus, BOS + up to --max-length tokens, right-padded batches of --batch)
through the same GPT-2 (hookrun.experiments.lm.causal_lm: random init, seed 0), twice: the bundled LM's shape
(2 blocks, d_model 64) and a GPT-2-shaped model of 8 blocks (d_model 256, 8 heads). Per batch both compute:
the logit lens at every block's output x every real position (top --k ids and probabilities, log-probability and
rank of two tokens, each site's KL to the model's output distribution and its entropy), and the DLA of logit(" the") - logit(" a") at the last real token (embeddings, every block's
attention and MLP, every head, the biases), with ln_f's scale frozen from the run.

    hookrun     hookrun.engine.runner.run in this process: the run's batch loop (summary loop_s: forwards, the
                lens and DLA, the store's writes), and the whole call (model, tokenizer, store open and close)
    one-call    hookrun.lens(..., dla=...) (hookrun/analyses.py) on the same ids: the lens and the DLA from one
                forward a batch, as the run; no config, no store
    hand_loop   plain PyTorch written here: forward hooks keep the blocks' outputs, the components' outputs, c_proj's
                inputs and ln_f's input; the same arithmetic by hand; results kept as numpy arrays (no store)

Rounds are interleaved (hookrun, hand, hookrun, hand, ...), --rounds of them; min and median are printed, and the
ratios hookrun loop / hand loop and one-call / hand loop (target <= 1.2x), in wall seconds and in CPU seconds
(the loop's `loop_cpu_s`, time.process_time around the hand loop: steadier on a loaded machine). The outputs are
checked equal (top-k ids, and DLA within 1e-4).
torch runs on --threads threads (default 1). --store disk (default: a temporary directory) or memory (`store.path:
memory`, a notebook's store, read back in the same process); --writer sync (default: the writes inside the loop) or
thread (store.writer=thread: a writer thread beside it, as `auto` picks where a core is spare).

    python benchmarks/lens.py                  # about a minute on 2 cores
    python benchmarks/lens.py --store memory [--writer thread]
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
from hookrun.experiments.lm import causal_lm, tokenizer

SHAPES = {"bundled LM (2 x 64)": dict(n_layer=2, n_embd=64, n_head=4),
          "GPT-2 shape (8 x 256)": dict(n_layer=8, n_embd=256, n_head=8)}


def overrides(shape: dict, args, path: Path) -> list:
    return ["+experiment=lm_tokens", "hooks.resid=null", *(f"model.{k}={v}" for k, v in shape.items()),
            f"data.batch_size={args.batch}", f"data.text.max_length={args.max_length}", "lens.sites.layers=blocks",
            "lens.sites.positions=all", f"lens.top_k={args.k}", "lens.tokens=[' the',' a']",
            "lens.dla.tokens=[' the',' a']", f"store.path={path if args.store == 'disk' else 'memory'}",
            "store.mode=overwrite", f"store.writer={args.writer}", "progress_s=0"]


def run_hookrun(shape, args, path):
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg

    cfg = make_cfg(overrides(shape, args, path))
    t0 = time.perf_counter()
    where = run(cfg)
    whole = time.perf_counter() - t0
    cap = hookrun.open(where)
    timing = cap.attrs["summary"]["timing"]
    return (timing["loop_s"], timing["loop_cpu_s"]), whole, cap


def batches(cap, size: int):
    """The run's own prompts (from its token table), right-padded in batches of `size`: (ids, mask) each."""
    tokens = cap.tokens()
    seqs = [g.sort_values("position")["token_id"].tolist() for _, g in tokens.groupby("sample")]
    out = []
    for start in range(0, len(seqs), size):
        part = seqs[start:start + size]
        longest = max(map(len, part))
        ids = torch.tensor([s + [0] * (longest - len(s)) for s in part])
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in part])
        out.append((ids, mask))
    return out


def hand_loop(model, data, k: int, lens_ids, a: int, b: int):
    """The lens and the DLA of every batch, plain PyTorch; returns the numpy arrays."""
    tr = model.transformer
    blocks, n_heads = list(tr.h), model.config.n_head
    kept = {}
    hooks = [blk.register_forward_hook(lambda m, x, o, i=i: kept.__setitem__(("h", i), o[0] if isinstance(o, tuple) else o))
             for i, blk in enumerate(blocks)]
    for name in ("wte", "wpe"):
        hooks.append(getattr(tr, name).register_forward_hook(lambda m, x, o, n=name: kept.__setitem__(n, o)))
    for i, blk in enumerate(blocks):
        hooks.append(blk.attn.register_forward_hook(lambda m, x, o, i=i: kept.__setitem__(("attn", i), o[0])))
        hooks.append(blk.mlp.register_forward_hook(lambda m, x, o, i=i: kept.__setitem__(("mlp", i), o)))
        hooks.append(blk.attn.c_proj.register_forward_pre_hook(lambda m, x, i=i: kept.__setitem__(("z", i), x[0])))
    hooks.append(tr.ln_f.register_forward_pre_hook(lambda m, x: kept.__setitem__("final", x[0])))
    ln, unembed = tr.ln_f, model.lm_head.weight
    out = {"ids": [], "probs": [], "logprob": [], "rank": [], "parts": [], "heads": []}
    tokens = torch.tensor(lens_ids)
    try:
        for ids, mask in data:
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
                n, t = ids.shape
                final_full = kept["final"]  # (ln_f's pre-hook fires again in the lens below)
                resid = torch.stack([kept["h", i] for i in range(len(blocks))])  # [L, B, T, d]
                lp = torch.log_softmax((ln(resid) @ unembed.T).float(), -1)  # [L, B, T, V]
                top = lp.topk(k, -1)
                chosen = lp[..., tokens]  # [L, B, T, 2]
                rank = (lp.unsqueeze(-2) > chosen.unsqueeze(-1)).sum(-1)
                ref = torch.log_softmax(logits.float(), -1)  # [B, T, V]: the model's own distribution
                kl = (ref.exp() * (ref - lp)).sum(-1)  # [L, B, T]
                entropy = -(lp.exp() * lp).sum(-1)
                valid = mask.bool()[None, :, :, None]
                out["ids"].append(torch.where(valid, top.indices, -1).permute(1, 0, 2, 3).numpy())
                out["probs"].append(torch.where(valid, top.values.exp(), np.nan).permute(1, 0, 2, 3).numpy())
                out["logprob"].append(torch.where(valid, chosen, np.nan).permute(1, 0, 2, 3).numpy())
                out["rank"].append(torch.where(valid, rank, -1).permute(1, 0, 2, 3).numpy())
                out.setdefault("kl", []).append(torch.where(valid[..., 0], kl, np.nan).permute(1, 0, 2).numpy())
                out.setdefault("entropy", []).append(torch.where(valid[..., 0], entropy, np.nan).permute(1, 0, 2)
                                                     .numpy())
                # DLA at the last real token: parts through ln_f with its sigma frozen
                last, rows = mask.sum(1) - 1, torch.arange(n)
                at = lambda x: x.expand(n, t, x.shape[-1])[rows, last]  # noqa: E731
                final = at(final_full)
                sigma = torch.sqrt(final.var(-1, unbiased=False, keepdim=True) + ln.eps)
                w = (unembed[a] - unembed[b]) * ln.weight
                parts = [at(kept["wte"]), at(kept["wpe"])]
                for i in range(len(blocks)):
                    parts += [at(kept["attn", i]), at(kept["mlp", i])]
                stack = torch.stack(parts)
                contrib = ((stack - stack.mean(-1, keepdim=True)) / sigma) @ w  # [C, B]
                bias = (ln.bias @ (unembed[a] - unembed[b])).expand(n)
                out["parts"].append(torch.cat([contrib.T, bias[:, None]], 1).numpy())
                heads = []
                for i, blk in enumerate(blocks):
                    z = at(kept["z", i]).reshape(n, n_heads, -1)  # [B, H, dh]
                    w_o = blk.attn.c_proj.weight.reshape(n_heads, -1, w.shape[0])  # [H, dh, d]
                    h = torch.einsum("bhk,hkd->hbd", z, w_o)
                    heads.append(((h - h.mean(-1, keepdim=True)) / sigma) @ w)  # [H, B]
                out["heads"].append(torch.stack(heads).permute(2, 0, 1).numpy())
                out.setdefault("logit", []).append((logits[rows, last, a] - logits[rows, last, b]).numpy())
    finally:
        for h in hooks:
            h.remove()
    width = max(x.shape[2] for x in out["ids"])
    pad = lambda x, v: np.concatenate([x, np.full((*x.shape[:2], width - x.shape[2], x.shape[3]), v, x.dtype)], 2)  # noqa: E731
    pad2 = lambda x: np.concatenate([x, np.full((*x.shape[:2], width - x.shape[2]), np.nan, x.dtype)], 2)  # noqa: E731
    return {"ids": np.concatenate([pad(x, -1) for x in out["ids"]]), "kl": np.concatenate([pad2(x) for x in out["kl"]]),
            "parts": np.concatenate(out["parts"]),
            "heads": np.concatenate(out["heads"]), "logit": np.concatenate(out["logit"])}


def main(argv=None):
    args = parse(__doc__, argv, rounds=5, batch=8, max_length=64, k=5, store="disk", writer="sync")
    if args.store not in ("disk", "memory") or args.writer not in ("sync", "thread"):
        raise SystemExit(f"--store {args.store!r} --writer {args.writer!r}: give disk or memory, sync or thread")
    tok = tokenizer()
    the, a_ = (tok(s, add_special_tokens=False)["input_ids"][0] for s in (" the", " a"))
    print(f"{args.rounds} interleaved rounds; batches of {args.batch}, max_length {args.max_length}, top {args.k}, "
          f"positions all, DLA + heads at the last token; store on {args.store}, {args.writer} writer")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape in SHAPES.items():
            path = Path(tmp) / "lens.zarr"
            _, _, cap = run_hookrun(shape, args, path)  # warm: tokenizer, imports
            data = batches(cap, args.batch)
            torch.manual_seed(0)
            model = causal_lm(**shape).eval()
            ours, whole, hand, calls, ours_cpu, hand_cpu = [], [], [], [], [], []
            seqs = [ids[m.bool()].tolist() for batch_ids, batch_mask in data for ids, m in zip(batch_ids, batch_mask)]
            for _ in range(args.rounds):
                (loop_s, loop_cpu), whole_s, cap = run_hookrun(shape, args, path)
                ours.append(loop_s)
                ours_cpu.append(loop_cpu)
                whole.append(whole_s)
                t0 = time.perf_counter()
                one = hookrun.lens(model, seqs, layers="blocks", positions="all", k=args.k, tokens=[the, a_],
                                   dla=[the, a_], batch_size=args.batch)
                calls.append(time.perf_counter() - t0)
                t0, c0 = time.perf_counter(), time.process_time()
                mine = hand_loop(model, data, args.k, [the, a_], the, a_)
                hand.append(time.perf_counter() - t0)
                hand_cpu.append(time.process_time() - c0)
            lens = cap.read("lens")
            assert np.array_equal(lens.top_ids, mine["ids"][:, :, :lens.top_ids.shape[2]]), "top-k ids differ"
            diff = max(np.abs(lens.dla.parts - mine["parts"]).max(), np.abs(lens.dla.heads - mine["heads"]).max(),
                       np.abs(lens.dla.logit - mine["logit"]).max())
            assert diff < 1e-4, diff
            kl = mine["kl"][:, :, :lens.kl.shape[2]]
            assert np.allclose(lens.kl, kl, atol=1e-4, equal_nan=True), "KL differs"
            assert np.array_equal(one.top_ids, lens.top_ids) and np.allclose(one.dla.parts, lens.dla.parts, atol=1e-4)
            samples, tokens = len(cap.samples), len(cap.tokens())
            rows.append((label, samples, tokens, ours, whole, hand, calls, diff, ours_cpu, hand_cpu))
    print(f"\n{'model':24} {'samples':>7} {'tokens':>6} | {'hookrun loop':>17} | {'hookrun run()':>17} | "
          f"{'one-call':>17} | {'hand loop':>17} | {'loop/hand':>13} | {'one-call/hand':>13}")
    print(f"{'':24} {'':>7} {'':>6} | {'min / median s':>17} | {'min / median s':>17} | {'min / median s':>17} | "
          f"{'min / median s':>17} | {'min / median':>13} | {'min / median':>13}")
    med = statistics.median
    for label, samples, tokens, ours, whole, hand, calls, diff, _, _ in rows:
        print(f"{label:24} {samples:7d} {tokens:6d} | {min(ours):7.3f} / {med(ours):7.3f} | {min(whole):7.3f} / "
              f"{med(whole):7.3f} | {min(calls):7.3f} / {med(calls):7.3f} | {min(hand):7.3f} / {med(hand):7.3f} | "
              f"{min(ours) / min(hand):5.2f}x / {med(ours) / med(hand):5.2f}x | {min(calls) / min(hand):5.2f}x / "
              f"{med(calls) / med(hand):5.2f}x   (outputs equal; DLA max |diff| {diff:.1e})")
    print("\nCPU seconds (time.process_time; other processes' load barely moves them), loop / hand loop:")
    for label, samples, tokens, ours, whole, hand, calls, diff, ours_cpu, hand_cpu in rows:
        print(f"{label:24} hookrun loop {min(ours_cpu):7.3f} / {med(ours_cpu):7.3f} s | hand loop "
              f"{min(hand_cpu):7.3f} / {med(hand_cpu):7.3f} s | loop/hand {min(ours_cpu) / min(hand_cpu):5.2f}x / "
              f"{med(ours_cpu) / med(hand_cpu):5.2f}x (min / median)")


if __name__ == "__main__":
    main()
