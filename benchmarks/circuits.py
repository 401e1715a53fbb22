"""Circuits benchmark: hookrun's EAP against a hand-written EAP on the same graph, and a GPT-2-small-size graph on
a CPU.

Part 1, side by side in one process, interleaved --rounds times (min and median), torch on --threads threads
(default 1), a GPT-2-shaped model of random weights (--layers blocks, d 256, 8 heads) on --pairs pairs of --tokens
tokens (the corrupt prompt has other tokens at positions 2-3), metric the logit difference of two tokens at the last
position:

    hand_eap      plain PyTorch written here, TransformerLens's split-input way: one target forward in which each
                  head's q, k and v read their own copy of the stream (x + a zero tensor [B, T, heads, D], the layer
                  norm applied per copy, each head projected by its own columns), each MLP and the logits a zero
                  added to their norm's input; one torch.autograd.grad for every zero; the senders' activations by
                  forward hooks; the scores by one einsum per layer
    hookrun_eap   hookrun.methods.circuits.edge_scores, method eap (one backward, then one batched
                  vector-Jacobian product per projection)

It prints both ways' min and median seconds, the ratio (target <= 1.2) and the largest difference of the scores.
Then, on the same model and pairs, interleaved --ig-rounds times: EAP-IG's two variants at --ig-steps steps,
eap_ig ("inputs": steps passes a batch) and eap_ig_activations ((2 x layers + 1) x steps passes), their times and
ratio beside the ratio of their passes.

Part 2: GPT-2 small's shape (12 blocks, d 768, 12 heads, vocab 50257; random weights from its config): the graph's
edge count, the time to build it, EAP on 4 pairs of 32 tokens (time, and the process's peak resident memory before
and after, ru_maxrss), and the verify-style exact patching of 16 edges.

Part 3 (--run-rounds R, default 0: skipped): a declared EAP run against its core call: `python -m hookrun`'s run in
this process (the bundled tiny-LM experiment, GPT-2 --layers blocks, d 256, 8 heads, --run-pairs copies of one pair
in batches of 8) with `circuit: {method: eap}` and no circuits asked, the same run without the block (the
forward, the metric, the store), and edge_scores on the same batches; wall and CPU time (time.process_time), min
over R alternated rounds; the block's cost is (with - without) against the core call's.

Part 3 with --run-shape small: the same on GPT-2 small's shape (12 blocks, d 768, 12 heads, 32,491 edges); --rounds 0
runs part 3 alone.

Part 4 (--targets R, default 0: skipped): issue 55 item 7's targets on GPT-2 small's shape (random weights), --t-pairs
pairs of --t-tokens tokens, each measurement in a subprocess of its own (`--measure KIND`: its peak resident memory,
ru_maxrss, is that call's; its CPU time, time.process_time, and wall are the call's, after a one-pair warm-up), R
alternated rounds, the min: hand_eap and hookrun's eap (EAP <= 1.2x the hand EAP), eap_ig at --t-steps steps
(<= 1.2x steps x EAP), eap_ig_activations at --t-act-steps steps (<= 1.2x its passes x EAP, peak < 2 GB), and a
circuit evaluation (`circuit_metric`) of the benchmark's 10 circuit sizes, of 32 and of 64 circuits (these two in
the first round only: their memory is the point): its forwards counted by a hook on the model (the rows it runs
over the batch's; <= 1.2x the circuits + full / empty) and its peak memory (flat beyond a chunk).

    python benchmarks/circuits.py                  # ~1-3 minutes on a shared 2-core machine
    python benchmarks/circuits.py --skip-small --rounds 2 --ig-rounds 1 --run-rounds 3
    python benchmarks/circuits.py --skip-small --rounds 1 --ig-rounds 1 --run-rounds 2 --run-shape small --targets 2
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import transformers as tf

from hookrun.methods.circuits.attribute import sender_activations
from hookrun.methods.circuits.scores import edge_scores
from hookrun.methods.circuits.evaluate import patch_edges
from hookrun.methods.circuits.graph import circuit_graph


def gpt2(layers: int, d: int, heads: int, vocab: int = 512, positions: int = 64):
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=vocab, n_layer=layers, n_embd=d, n_head=heads, n_positions=positions,
                           attn_implementation="eager")
    return tf.GPT2LMHeadModel(config).eval()


def pairs(n: int, t: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(1, vocab, (n, t), generator=g)
    tgt = src.clone()
    tgt[:, 2:4] = torch.randint(1, vocab, (n, 2), generator=g)
    return {"input_ids": src}, {"input_ids": tgt}


def metric(logits, rows):
    return logits[:, -1, 5] - logits[:, -1, 7]


def hand_eap(model, graph, src, tgt) -> torch.Tensor:
    """[B, E] EAP scores with split inputs (see the module's docstring): written here for GPT-2, no hookrun."""
    cfg = model.config
    H, D = cfg.n_head, cfg.n_embd
    dh = D // H

    def senders(ids):
        acts, hs = {}, []
        hs.append(model.transformer.h[0].register_forward_pre_hook(
            lambda m, a, kw: acts.__setitem__("input", a[0] if a else kw["hidden_states"]), with_kwargs=True))
        for i, b in enumerate(model.transformer.h):
            wo = b.attn.c_proj.weight.view(H, dh, D)
            hs.append(b.attn.c_proj.register_forward_pre_hook(lambda m, a, i=i, wo=wo: acts.__setitem__(
                f"a{i}", torch.einsum("bthd,hde->hbte", a[0].view(*a[0].shape[:2], H, dh), wo))))
            hs.append(b.mlp.register_forward_hook(lambda m, a, o, i=i: acts.__setitem__(f"m{i}", o)))
        with torch.no_grad():
            model(**ids)
        for h in hs:
            h.remove()
        out = [acts["input"]]
        for i in range(cfg.n_layer):
            out += list(acts[f"a{i}"]) + [acts[f"m{i}"]]
        return torch.stack(out)

    a_s = senders(src)
    b, t = tgt["input_ids"].shape
    zeros, hs, stream = [], [], {}
    for i, blk in enumerate(model.transformer.h):
        eps_qkv = torch.zeros(3, b, t, H, D, requires_grad=True)
        eps_m = torch.zeros(b, t, D, requires_grad=True)
        zeros += [eps_qkv, eps_m]
        hs.append(blk.ln_1.register_forward_pre_hook(lambda m, a, i=i: stream.__setitem__(i, a[0])))

        def split(m, a, out, i=i, eps=eps_qkv, ln=blk.ln_1):
            w, bias = m.weight.view(D, 3, H, dh), m.bias.view(3, H, dh)
            x = ln.forward(stream[i][None, :, :, None, :] + eps)  # [3, B, T, H, D]: a copy per receiver
            return (torch.einsum("kbthd,dkhe->bkthe", x, w) + bias[:, None, :, :]).permute(0, 2, 1, 3, 4) \
                .reshape(b, t, 3 * D)
        hs.append(blk.attn.c_attn.register_forward_hook(split))
        hs.append(blk.ln_2.register_forward_pre_hook(lambda m, a, e=eps_m: (a[0] + e,)))
    eps_f = torch.zeros(b, t, D, requires_grad=True)
    zeros.append(eps_f)
    hs.append(model.transformer.ln_f.register_forward_pre_hook(lambda m, a: (a[0] + eps_f,)))
    acts_t = {}
    hs.append(model.transformer.h[0].register_forward_pre_hook(
        lambda m, a, kw: acts_t.__setitem__("x", (a[0] if a else kw["hidden_states"])), with_kwargs=True))
    try:
        value = metric(model(**tgt).logits, None).sum()
        grads = torch.autograd.grad(value, zeros)
    finally:
        for h in hs:
            h.remove()
    delta = a_s - senders(tgt)
    # receivers in the graph's order: per layer q heads, k heads, v heads, the MLP; then the logits
    g_all = []
    for i in range(cfg.n_layer):
        g_qkv, g_m = grads[2 * i], grads[2 * i + 1]
        g_all += [g_qkv[k, :, :, h] for k in range(3) for h in range(H)] + [g_m]
    g_all.append(grads[-1])
    full = torch.einsum("sbtd,rbtd->bsr", delta, torch.stack(g_all))
    return full[:, graph.edge_s, graph.edge_r]


def timed(fn, rounds):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def declared_run(args) -> None:
    """Part 3 (see the module's docstring)."""
    import json
    import tempfile
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from hookrun.config.schema import register_configs
    from hookrun.engine.runner import run
    from hookrun.experiments.lm import causal_lm, tokenizer

    register_configs()
    conf = Path(__file__).resolve().parents[1] / "conf"
    tmp = Path(tempfile.mkdtemp(prefix="circuits-bench-"))
    clean, corrupt = "the hooks run on a model", "the hooks run on a store"
    (tmp / "pairs.jsonl").write_text((json.dumps({"clean": clean, "corrupt": corrupt}) + "\n") * args.run_pairs)
    layers, d, heads = (12, 768, 12) if args.run_shape == "small" else (args.layers, 256, 8)
    base = ["+experiment=lm_tokens", f"model.n_layer={layers}", f"model.n_embd={d}", f"model.n_head={heads}",
            f"data.text.files=[{tmp / 'pairs.jsonl'}]", "data.text.fields={clean:clean,corrupt:corrupt}",
            "data.batch_size=8", "hooks.resid=null", "device=cpu",
            "+metrics.ld={metric:logit_diff,a:' model',b:' store'}"]
    tok = tokenizer()
    a, b = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (" model", " store"))
    ids = lambda text: torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]] * 8)  # noqa
    torch.manual_seed(0)
    model = causal_lm(n_layer=layers, n_embd=d, n_head=heads).eval()
    graph = circuit_graph(model)
    ld = lambda logits, rows: logits[:, -1, a] - logits[:, -1, b]  # noqa: E731
    times = {"with": [], "without": [], "core": []}
    for r in range(args.run_rounds):  # alternated
        for name, extra in (("with", ["+circuit={source:clean,target:corrupt,metric:ld,method:eap}"]),
                            ("without", [])):
            with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
                cfg = compose(config_name="config", overrides=[*base, *extra, f"store.path={tmp}/{name}{r}.zarr"])
            w0, c0 = time.perf_counter(), time.process_time()
            run(cfg)
            times[name].append((time.perf_counter() - w0, time.process_time() - c0))
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.run_pairs // 8):
            edge_scores(model, graph, {"input_ids": ids(clean)}, {"input_ids": ids(corrupt)}, ld)
        times["core"].append((time.perf_counter() - w0, time.process_time() - c0))
    best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in times.items()}
    block = [best["with"][i] - best["without"][i] for i in range(2)]
    print(f"part 3: a declared EAP run, GPT-2 {layers} blocks, d {d}, {heads} heads ({len(graph)} edges), "
          f"{args.run_pairs} pairs in batches of 8, min of {args.run_rounds} alternated rounds (wall / CPU s):")
    for k, (w, c) in best.items():
        print(f"  {k:8s} {w:.3f} / {c:.3f}")
    print(f"  the block's cost (with - without) / the core call: wall {block[0] / best['core'][0]:.2f}x, CPU "
          f"{block[1] / best['core'][1]:.2f}x (target <= 1.5)")


KINDS = ("hand_eap", "eap", "eap_ig", "eap_ig_activations", "eval_10", "eval_32", "eval_64")


def measure(kind: str, args) -> dict:
    """One measurement of part 4 in this (fresh) process: GPT-2 small, the pairs, a one-pair warm-up, then the call;
    its wall and CPU seconds, the peak resident memory before and after it (MiB), and for the evaluations the
    forwards a hook on the model counted (rows run / the batch's rows)."""
    import json

    from hookrun.capture.scope import HookScope
    from hookrun.methods.circuits.evaluate import circuit_metric, donor_activations
    from hookrun.methods.circuits.select import top_n
    from hookrun.read.results.benchmark import PERCENT, size

    small = tf.GPT2LMHeadModel(tf.GPT2Config(attn_implementation="eager")).eval()
    g = circuit_graph(small)
    s, c = pairs(args.t_pairs, args.t_tokens, small.config.vocab_size)
    w_s, w_c = pairs(1, 8, small.config.vocab_size, seed=1)
    edge_scores(small, g, w_s, w_c, metric)  # warm-up
    b = args.t_pairs
    if kind.startswith("eval"):
        gen = torch.Generator().manual_seed(0)
        scores = torch.rand(len(g), generator=gen).numpy()
        n = int(kind.split("_")[1])
        sizes = [size(p, len(g)) for p in PERCENT] if n == 10 else [int(len(g) * (k + 1) / (n + 1)) for k in range(n)]
        masks = torch.stack([top_n(g, scores, k, "top") for k in sizes])
        rows = []

        def call():
            with HookScope() as scope:
                scope.pre(small, lambda m, a, kw: rows.append(int((a[0] if a else kw["input_ids"]).shape[0])),
                          with_kwargs=True)
                a_t, _ = sender_activations(small, g, c)
                return circuit_metric(small, g, s, donor_activations("same", a_t), masks, metric)
    elif kind == "hand_eap":
        def call():
            return hand_eap(small, g, s, c).detach()
    else:
        steps = {"eap": None, "eap_ig": args.t_steps, "eap_ig_activations": args.t_act_steps}[kind]

        def call():
            return edge_scores(small, g, s, c, metric, method=kind, steps=steps).scores
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    w0, c0 = time.perf_counter(), time.process_time()
    call()
    out = {"kind": kind, "wall": time.perf_counter() - w0, "cpu": time.process_time() - c0, "rss_before": before,
           "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if kind.startswith("eval"):
        out.update(forwards=sum(rows) / b, circuits=len(masks))
    print("MEASURED " + json.dumps(out))
    return out


def targets(args) -> None:
    """Part 4 (see the module's docstring): each KIND in a subprocess, alternated over --targets rounds."""
    import json
    import subprocess
    import sys

    got = {k: [] for k in KINDS}
    for r in range(args.targets):
        for kind in KINDS:
            if r and kind in ("eval_32", "eval_64"):  # their memory, not their time: the first round's
                continue
            cmd = [sys.executable, __file__, "--measure", kind, "--threads", str(args.threads),
                   "--t-pairs", str(args.t_pairs), "--t-tokens", str(args.t_tokens), "--t-steps", str(args.t_steps),
                   "--t-act-steps", str(args.t_act_steps)]
            text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got[kind].append(json.loads(text.split("MEASURED ", 1)[1].splitlines()[0]))
            print(f"  {kind}: {got[kind][-1]}", flush=True)
    # times: the min over the rounds; memory: the max (each round a fresh process)
    best = {k: {"wall": min(r["wall"] for r in v), "cpu": min(r["cpu"] for r in v),
                "rss_before": max(r["rss_before"] for r in v), "rss_peak": max(r["rss_peak"] for r in v),
                "grew": max(r["rss_peak"] - r["rss_before"] for r in v),
                **{f: v[-1][f] for f in ("forwards", "circuits") if f in v[-1]}} for k, v in got.items()}
    eap = best["eap"]
    passes = (2 * 12 + 1) * args.t_act_steps
    print(f"part 4: GPT-2 small's shape (32,491 edges), {args.t_pairs} pairs x {args.t_tokens} tokens, torch threads "
          f"{args.threads}, min of {args.targets} alternated rounds, a subprocess each (wall / CPU s, peak MiB):")
    for k, v in best.items():
        extra = f", {v['forwards']:.2f} forwards for {v['circuits']} circuits" if "forwards" in v else ""
        print(f"  {k:18s} {v['wall']:.2f} / {v['cpu']:.2f} s, peak {v['rss_peak']:.0f} MiB (before the call "
              f"{v['rss_before']:.0f}, +{v['grew']:.0f}){extra}")
    for name, num, den, target in (
            ("eap / hand_eap", eap["cpu"], best["hand_eap"]["cpu"], 1.2),
            (f"eap_ig / ({args.t_steps} x eap)", best["eap_ig"]["cpu"], args.t_steps * eap["cpu"], 1.2),
            (f"eap_ig_activations / ({passes} x eap)", best["eap_ig_activations"]["cpu"], passes * eap["cpu"], 1.2)):
        print(f"  {name}: CPU {num / den:.2f}x (target <= {target})")
    ten = best["eval_10"]
    print(f"  eval of the 10 sizes + full / empty: {ten['forwards']:.2f} forwards for 12 circuits = "
          f"{ten['forwards'] / 12:.2f}x (target <= 1.2); peak memory grown over the call: "
          + ", ".join(f"{best[k]['circuits']} circuits +{best[k]['grew']:.0f} MiB" for k in KINDS if k[:4] == "eval"))
    print(f"  eap_ig_activations peak {best['eap_ig_activations']['rss_peak']:.0f} MiB (target < 2048)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ig-steps", type=int, default=4)
    parser.add_argument("--ig-rounds", type=int, default=3)
    parser.add_argument("--skip-small", action="store_true", help="skip part 2 (GPT-2 small)")
    parser.add_argument("--run-rounds", type=int, default=0, help="part 3's alternated rounds (0: skip it)")
    parser.add_argument("--run-pairs", type=int, default=32)
    parser.add_argument("--run-shape", choices=("tiny", "small"), default="tiny",
                        help="part 3's model: GPT-2 --layers blocks, d 256, 8 heads, or GPT-2 small's shape")
    parser.add_argument("--targets", type=int, default=0, help="part 4's alternated rounds (0: skip it)")
    parser.add_argument("--t-pairs", type=int, default=4)
    parser.add_argument("--t-tokens", type=int, default=32)
    parser.add_argument("--t-steps", type=int, default=4)
    parser.add_argument("--t-act-steps", type=int, default=1)
    parser.add_argument("--measure", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure:
        measure(args.measure, args)
        return
    if args.run_rounds:
        declared_run(args)
    if args.targets:
        targets(args)
        return
    if not args.rounds:  # --rounds 0: parts 3 / 4 alone
        return

    model = gpt2(args.layers, 256, 8)
    graph = circuit_graph(model)
    src, tgt = pairs(args.pairs, args.tokens, 512)
    ours, hand = [], []
    for _ in range(args.rounds):  # interleaved
        t, s_ours = timed(lambda: edge_scores(model, graph, src, tgt, metric).scores, 1)
        ours += t
        t, s_hand = timed(lambda: hand_eap(model, graph, src, tgt).detach(), 1)
        hand += t
    diff = float((s_ours - s_hand).abs().max())
    scale = float(s_hand.abs().max())
    print(f"part 1: GPT-2 {args.layers} blocks, d 256, 8 heads; {len(graph)} edges; {args.pairs} pairs x "
          f"{args.tokens} tokens; torch threads {args.threads}; {args.rounds} interleaved rounds")
    for name, ts in (("hand_eap", hand), ("hookrun_eap", ours)):
        print(f"  {name:12s} min {min(ts):.3f} s  median {statistics.median(ts):.3f} s")
    print(f"  ratio hookrun / hand: min {min(ours) / min(hand):.2f}x  median "
          f"{statistics.median(ours) / statistics.median(hand):.2f}x (target <= 1.2)")
    print(f"  largest |difference| of the scores: {diff:.2e} (largest |score| {scale:.2e})")
    ig = {"eap_ig": [], "eap_ig_activations": []}
    for _ in range(args.ig_rounds):  # interleaved
        for name in ig:
            ig[name] += timed(lambda: edge_scores(model, graph, src, tgt, metric, method=name, steps=args.ig_steps),
                              1)[0]
    print(f"  EAP-IG, {args.ig_steps} steps, {args.ig_rounds} interleaved rounds:")
    for name, ts in ig.items():
        print(f"  {name:18s} min {min(ts):.3f} s  median {statistics.median(ts):.3f} s")
    print(f"  ratio activations / inputs: min {min(ig['eap_ig_activations']) / min(ig['eap_ig']):.1f}x  median "
          f"{statistics.median(ig['eap_ig_activations']) / statistics.median(ig['eap_ig']):.1f}x; passes "
          f"{(2 * args.layers + 1) * args.ig_steps} / {args.ig_steps} = {2 * args.layers + 1}x")
    if args.skip_small:
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    small = tf.GPT2LMHeadModel(tf.GPT2Config(attn_implementation="eager")).eval()  # GPT-2 small, random weights
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = circuit_graph(small)
    t_graph = time.perf_counter() - t0
    s, c = pairs(4, 32, small.config.vocab_size)
    mid = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    est = edge_scores(small, g, s, c, metric)
    t_eap = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    a_s, _ = sender_activations(small, g, s)
    a_t, _ = sender_activations(small, g, c)
    top = torch.argsort(-est.scores.abs().mean(0))[:16].tolist()
    t0 = time.perf_counter()
    exact = patch_edges(small, g, c, a_s - a_t, top, metric)
    t_exact = time.perf_counter() - t0
    err = (exact - est.target[:, None] - est.scores[:, top]).abs().mean() / est.scores[:, top].abs().mean()
    print(f"part 2: GPT-2 small (random weights, model built in {built:.1f} s): {len(g.senders)} senders, "
          f"{len(g.receivers)} receivers, {len(g)} edges; graph built in {t_graph:.2f} s")
    print(f"  EAP on 4 pairs x 32 tokens: {t_eap:.2f} s; peak resident memory {mid:.0f} MiB before, {peak:.0f} MiB "
          f"after (+{peak - mid:.0f} MiB; before the model: {before:.0f} MiB); scores [4, {est.scores.shape[1]}]")
    print(f"  exact patching of the 16 largest edges (one forward per chunk of copies): {t_exact:.2f} s; mean "
          f"|EAP - exact| / mean |EAP| there: {float(err):.3f}")


if __name__ == "__main__":
    main()
