"""Patching grid benchmark: a layers x positions grid of activation patching over clean/corrupt pairs.

The bundled LM (hookrun.experiments.lm.causal_lm: GPT-2 config, random init) and tokenizer; --pairs prompts
(default 64) from the bundled corpus, BOS + 9..16 tokens, right-padded in batches of --batch; the corrupt
prompt has another token at real position 3. The grid: every block's output x every real position; the
metric: the logit difference, at the last real token, between the clean and the corrupt token. Each way runs
the same patches and is timed side by side in one process, interleaved, --reps times (median):

    hand_loop         plain PyTorch written here: the clean run's block outputs kept by forward hooks, then one
                      forward of the corrupt batch per (layer, position) with one hook replacing that column
    patch_grid_k1     hookrun.methods.patching.patch_grid, sites_per_forward=1 (one site a forward, as the loop)
    patch_grid_auto   the same with sites_per_forward=auto: sites stacked along the batch axis
    nnsight           NNsight(model).trace per (layer, position), the column assigned in the trace (if installed)

It checks that every way gives the same grid (max |difference| against hand_loop) and prints the ratios to
hand_loop, of wall time and of this process's CPU time (on a shared machine the steadier of the two; target:
patch_grid_k1 <= 1.2x). torch runs on --threads threads (default 1: tiny matrices gain nothing from more,
and on a shared machine they spin).

--heads: a layers x heads x positions grid instead (patch_grid heads="all", per_position=True, the standard site
blocks.N.attn.heads; one (layer, head, position) a site) against a hand loop, one forward per (layer, head,
position) with a plain forward_pre hook on the block's attn.c_proj replacing that head's columns at that column:

    python benchmarks/patching.py --heads --pairs 16     # hand_loop, patch_grid_k1, patch_grid_auto

--cli: the same kind of grid through the real runner, on the bundled patching_grid experiment (its 64 pairs,
its trained 4-block LM, 4 blocks x 8 positions, batches of 16, sites_per_forward auto):

    run(cfg)          hookrun.engine.runner.run in this process: the whole run, and its grid loop (summary loop_s)
    command           `python -m hookrun +experiment=patching_grid ...`: the whole command, start-up included
    hand_loop         the hand loop above on the same model, pairs and batches
    nnsight           the nnsight loop above, likewise
    jobs per cond.    one Hydra job per condition, as before the patching block: a clean run storing every
                      block's output, then a real multirun (-m) of --jobs layers, each a last-position `replace`
                      edit from the clean store; the time a job, times the grid's conditions (extrapolated)

    python benchmarks/patching.py --cli                  # a few minutes on 2 cores
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hookrun.capture.tokens import TokenInfo
from hookrun.config.checks import resolve_file
from hookrun.data.text import pad
from hookrun.experiments.lm import CORPUS, causal_lm, tokenizer
from hookrun.methods.patching import patch_grid

CHANGE = 3  # the real position of the corrupted token


def pairs(n: int, batch: int, device=torch.device("cpu")):
    """[(clean kwargs, corrupt kwargs, TokenInfo, metric)] a batch; both prompts of a pair have one length."""
    tok = tokenizer()
    docs = [line for line in resolve_file(CORPUS).read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [d for d in tok(docs, add_special_tokens=False)["input_ids"] if len(d) >= 16]
    clean = [[tok.bos_token_id] + ids[i % len(ids)][:9 + i % 8] for i in range(n)]
    corrupt = [s[:CHANGE] + [(s[CHANGE] + 11) % 500] + s[CHANGE + 1:] for s in clean]
    out = []
    for start in range(0, n, batch):
        (ci, mask), (ki, _) = [[t.to(device) for t in pad(s[start:start + batch], tok.pad_token_id, "right")]
                               for s in (clean, corrupt)]
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        info = TokenInfo.of_batch(mask.bool(), mask.bool(), 64)

        def metric(logits, rows, good=ci[:, CHANGE], bad=ki[:, CHANGE], last=mask.sum(1) - 1):
            r = torch.arange(len(rows), device=rows.device)
            return logits[r, last[rows], good[rows]] - logits[r, last[rows], bad[rows]]
        out.append(({"input_ids": ci, "attention_mask": mask, "position_ids": pos},
                    {"input_ids": ki, "attention_mask": mask, "position_ids": pos}, info, metric))
    return out


def hand_loop(model, blocks, src, tgt, info, metric):
    """([B, layers, P], forwards): one forward per (layer, position), written with plain hooks."""
    mods = [model.get_submodule(b) for b in blocks]
    kept = {}
    handles = [m.register_forward_hook(lambda m, a, o, i=i: kept.__setitem__(i, o)) for i, m in enumerate(mods)]
    model(**src)
    for h in handles:
        h.remove()
    lengths = info.mask.sum(1)
    out = torch.full((len(lengths), len(blocks), int(lengths.max())), float("nan"))
    for i, m in enumerate(mods):
        for p in range(out.shape[2]):
            rows = (lengths > p).nonzero().squeeze(1)

            def put(mod, args, o, rows=rows, p=p, i=i):
                o = o.clone()
                o[rows, p] = kept[i][rows, p]  # right padding: real position p is column p
                return o
            h = m.register_forward_hook(put)
            values = metric(model(**tgt).logits, torch.arange(len(lengths), device=lengths.device))
            h.remove()
            out[rows.cpu(), i, p] = values[rows].cpu()
    return out, 1 + out.shape[1] * out.shape[2]


def nnsight_loop(model, blocks, src, tgt, info, metric):
    """The same grid with nnsight: one trace per (layer, position)."""
    from nnsight import NNsight

    nm = NNsight(model)
    layers = [nm.transformer.h[int(b.rsplit(".", 1)[1])] for b in blocks]
    kept, got = [], {}  # filled inside the traces: nnsight runs their bodies apart from this frame
    with nm.trace(**src):
        kept.extend(layer.output.save() for layer in layers)
    lengths, device = info.mask.sum(1), info.mask.device
    out = torch.full((len(lengths), len(blocks), int(lengths.max())), float("nan"))
    for i, layer in enumerate(layers):
        for p in range(out.shape[2]):
            rows = (lengths > p).nonzero().squeeze(1)
            with nm.trace(**tgt):
                layer.output[rows, p] = kept[i][rows, p]
                got["logits"] = nm.output.logits.save()
            out[rows.cpu(), i, p] = metric(got["logits"], torch.arange(len(lengths), device=device))[rows].cpu()
    return out, 1 + out.shape[1] * out.shape[2]


def hand_heads_loop(model, projs, src, tgt, info, metric, heads=4):
    """([B, layers, heads, P], forwards): one forward per (layer, head, position), written with plain hooks."""
    mods = [model.get_submodule(p) for p in projs]
    kept = {}
    handles = [m.register_forward_pre_hook(lambda m, a, i=i: kept.__setitem__(i, a[0])) for i, m in enumerate(mods)]
    model(**src)
    for h in handles:
        h.remove()
    lengths = info.mask.sum(1)
    d_head = kept[0].shape[-1] // heads
    out = torch.full((len(lengths), len(projs), heads, int(lengths.max())), float("nan"))
    for i, m in enumerate(mods):
        for head in range(heads):
            cols = slice(head * d_head, (head + 1) * d_head)
            for p in range(out.shape[3]):
                rows = (lengths > p).nonzero().squeeze(1)

                def put(mod, args, rows=rows, p=p, i=i, cols=cols):
                    x = args[0].clone()
                    x[rows, p, cols] = kept[i][rows, p, cols]  # right padding: real position p is column p
                    return (x,)
                h = m.register_forward_pre_hook(put)
                values = metric(model(**tgt).logits, torch.arange(len(lengths), device=lengths.device))
                h.remove()
                out[rows.cpu(), i, head, p] = values[rows].cpu()
    return out, 1 + out[0].numel()


def heads_grid(k):
    """patch_grid over blocks.N.attn.heads, per_position, sites_per_forward=k ([B, layers, heads, P], forwards)."""
    def run(model, projs, src, tgt, info, metric):
        g = patch_grid(model, src, tgt, info, info, ["blocks.*.attn.heads"], heads="all", per_position=True,
                       metric=metric, sites_per_forward=k)
        return g.scores, 2 + g.forwards
    return run


def grid(k):
    """patch_grid with sites_per_forward=k: ([B, layers, P], forwards, with the source and unpatched runs)."""
    def run(model, blocks, src, tgt, info, metric):
        g = patch_grid(model, src, tgt, info, info, blocks, metric=metric, sites_per_forward=k)
        return g.scores, 2 + g.forwards
    return run


EXPERIMENT = ["+experiment=patching_grid", r"layers=[re:transformer\.h\.\d+]"]  # the blocks only: 4 x 8 sites
CLEAN = ["~patching", "data.text.fields={clean:clean}", "+hooks.resid={kind:forward,layers:${layers},capture:[output]}"]
# the jobs feed the corrupt prompts under the role name clean: data.text.fields={corrupt:corrupt} on the command line
# merges with the experiment's {clean: clean, corrupt: corrupt} and would still feed clean
PATCH = ("+hooks.patch={kind:forward,capture:[],edit:[{op:replace,store:%s,hook:resid,positions:last,"
         "source:{position:last}}]}")


def hookrun_cli(*args, threads=1):
    """Seconds of `python -m hookrun ARGS` (the whole command)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hookrun", *args], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return time.perf_counter() - start


def experiment_batches(batch: int = 16):
    """The patching_grid experiment's pairs as pairs() makes them: [(clean, corrupt, TokenInfo, metric)] a batch."""
    from hookrun.experiments.recall import PAIRS

    tok = tokenizer()
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    ids = {k: [[tok.bos_token_id, *tok(r[k])["input_ids"]] for r in rows] for k in ("clean", "corrupt")}
    good, bad = [torch.tensor([tok(r[k])["input_ids"][0] for r in rows]) for k in ("answer", "wrong")]
    out = []
    for start in range(0, len(rows), batch):
        (ci, mask), (ki, _) = [pad(ids[k][start:start + batch], tok.pad_token_id, "right") for k in ("clean", "corrupt")]
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        info = TokenInfo.of_batch(mask.bool(), mask.bool(), 64)

        def metric(logits, rows, g=good[start:start + batch], b=bad[start:start + batch], last=mask.sum(1) - 1):
            r = torch.arange(len(rows))
            return logits[r, last[rows], g[rows]] - logits[r, last[rows], b[rows]]
        out.append(({"input_ids": ci, "attention_mask": mask, "position_ids": pos},
                    {"input_ids": ki, "attention_mask": mask, "position_ids": pos}, info, metric))
    return out


def cli(args):
    """The patching_grid experiment's grid: run(cfg), the command, the hand loop, nnsight, one job per condition."""
    from hydra import compose, initialize_config_dir

    import hookrun
    from hookrun.config.schema import register_configs
    from hookrun.experiments.recall import trained_lm
    from hookrun.engine.runner import run

    register_configs()
    from hookrun.config.schema import conf_dir

    conf = conf_dir()  # conf/ in a clone, hookrun/conf in the wheel
    tmp = Path(tempfile.mkdtemp(prefix="hookrun-patching-"))
    model, data = trained_lm(), experiment_batches()
    blocks = [f"transformer.h.{i}" for i in range(4)]
    times = {w: [] for w in ("run(cfg)", "grid loop", "hand_loop", "nnsight")}
    for rep in range(args.reps):
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*EXPERIMENT, f"store.path={tmp}/inproc{rep}/captures.zarr"])
        start = time.perf_counter()
        run(cfg)
        times["run(cfg)"].append(time.perf_counter() - start)
        grid = hookrun.open(tmp / f"inproc{rep}").grid()
        times["grid loop"].append(hookrun.open(tmp / f"inproc{rep}").attrs["summary"]["timing"]["loop_s"])
        for name, fn in (("hand_loop", hand_loop), ("nnsight", nnsight_loop)):
            start = time.perf_counter()
            with torch.inference_mode():
                got = torch.cat([fn(model, blocks, *b)[0] for b in data])
            times[name].append(time.perf_counter() - start)
            print(f"rep {rep} {name}: max |diff| to the run's grid {float((got - torch.from_numpy(grid.scores)).nan_to_num().abs().max()):.2e}")
    command = hookrun_cli(*EXPERIMENT, f"hydra.run.dir={tmp}/cmd", threads=args.threads)
    clean = hookrun_cli(*EXPERIMENT, *CLEAN, f"hydra.run.dir={tmp}/clean", threads=args.threads)
    layers = ",".join(f"[{b}]" for b in blocks[:args.jobs])
    sweep = hookrun_cli("-m", *EXPERIMENT, "~patching", "data.text.fields={clean:corrupt}", PATCH % f"{tmp}/clean",
                        f"+hooks.patch.layers={layers}", f"hydra.sweep.dir={tmp}/sweep", threads=args.threads)
    jobs = hookrun.collect(tmp / "sweep", with_index=False)
    per_job, conditions = sweep / args.jobs, grid.scores.shape[1] * grid.scores.shape[2]
    med = {w: statistics.median(t) for w, t in times.items()}
    print(f"\npatching_grid experiment: 64 pairs, batches of 16, 4 blocks x 8 positions ({conditions} conditions), "
          f"trained 4-block LM, torch {torch.__version__}, {args.threads} thread(s), median of {args.reps}")
    print(f"{'way':<52}{'wall s':>9}{'x hand':>8}")
    rows = [("hookrun run(cfg), whole run", med["run(cfg)"]), ("hookrun run(cfg), grid loop", med["grid loop"]),
            ("python -m hookrun (whole command)", command), ("hand-written PyTorch loop", med["hand_loop"]),
            ("nnsight", med["nnsight"]), ("clean run (stores every block)", clean),
            (f"multirun, {args.jobs} jobs (per job {per_job:.1f} s)", sweep),
            (f"one job a condition: clean + {conditions} x job (extrapolated)", clean + conditions * per_job)]
    for name, t in rows:
        print(f"{name:<52}{t:>9.2f}{t / med['hand_loop']:>8.2f}")
    print(f"one job a condition / the whole command: {(clean + conditions * per_job) / command:.1f}x; "
          f"jobs' mean ld (last position patched): {jobs['ld'].round(3).tolist()}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="blocks of the bundled LM (causal_lm n_layer)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="16 pairs, 1 rep")
    parser.add_argument("--cli", action="store_true", help="the patching_grid experiment through the runner")
    parser.add_argument("--jobs", type=int, default=2, help="--cli: jobs of the one-job-a-condition multirun")
    parser.add_argument("--heads", action="store_true", help="a layers x heads x positions grid (per_position)")
    args = parser.parse_args(argv)
    if args.cli:
        torch.set_num_threads(args.threads)
        return cli(args)
    if args.quick:
        args.pairs, args.reps = 16, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = causal_lm(n_layer=args.layers).eval().to(args.device)
    blocks = [f"transformer.h.{i}" for i in range(args.layers)]
    data = pairs(args.pairs, args.batch, torch.device(args.device))
    ways = {"hand_loop": hand_loop, "patch_grid_k1": grid(1), "patch_grid_auto": grid("auto")}
    if args.heads:
        blocks = [f"transformer.h.{i}.attn.c_proj" for i in range(args.layers)]
        ways = {"hand_loop": hand_heads_loop, "patch_grid_k1": heads_grid(1), "patch_grid_auto": heads_grid("auto")}
    try:
        version = f"nnsight {importlib.metadata.version('nnsight')}"
        if not args.heads:
            ways["nnsight"] = nnsight_loop
    except importlib.metadata.PackageNotFoundError:
        version = "nnsight not installed"
    times = {w: [] for w in ways}
    cpu = {w: [] for w in ways}
    results = {}
    for _ in range(args.reps):
        for name, fn in ways.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                results[name] = [fn(model, blocks, src, tgt, info, metric) for src, tgt, info, metric in data]
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    what = "blocks x 4 heads x every real position" if args.heads else "blocks x every real position"
    print(f"patching grid: {args.pairs} pairs in batches of {args.batch}, {args.layers} {what}, "
          f"torch {torch.__version__}, {args.threads} thread(s), {version}, median of {args.reps} interleaved runs")
    wall, busy = {w: statistics.median(t) for w, t in times.items()}, {w: statistics.median(t) for w, t in cpu.items()}
    print(f"{'way':<18}{'forwards':>9}{'wall s':>9}{'x hand':>8}{'CPU s':>8}{'x hand':>8}{'max |diff|':>12}")
    for name in ways:
        forwards = sum(f for _, f in results[name])
        same = zip(results[name], results["hand_loop"])
        diff = max(float((g - h).nan_to_num().abs().max()) for (g, _), (h, _) in same)
        print(f"{name:<18}{forwards:>9}{wall[name]:>9.3f}{wall[name] / wall['hand_loop']:>8.2f}{busy[name]:>8.3f}"
              f"{busy[name] / busy['hand_loop']:>8.2f}{diff:>12.2e}")


if __name__ == "__main__":
    main()
