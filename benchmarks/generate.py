"""Generation benchmark: tokens/s of the model's own generate() alone vs hookrun generating with every block's output
captured per step (hookrun.engine.runner.run(cfg) in process), on the bundled LM (hookrun.experiments.lm, random init).

    python benchmarks/generate.py [--reps 3] [--prompts 16] [--new 32] [--layers 4]

The two are alternated in one process, each --reps times, median reported. generate() gets the same left-padded
batches, greedy, KV cache on. hookrun's breakdown (forward, hooks, store) is the run's summary timing. Target:
hookrun / generate() <= 1.3."""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from hookrun.config.schema import conf_dir

import hookrun
from hookrun.config.checks import resolve_file
from hookrun.experiments.lm import CORPUS, causal_lm, tokenizer
from hookrun.config.schema import register_configs
from hookrun.engine.runner import run

CONF = conf_dir()  # conf/ in a clone, hookrun/conf in the wheel
register_configs()  # the schemas the experiment composes against


def overrides(args, prompts: Path, store: Path):
    return ["+experiment=lm_tokens", f"model.n_layer={args.layers}", "model.n_embd=128", f"data.text.files=[{prompts}]",
            "data.text.max_length=32", "data.batch_size=8", f"generate.max_new_tokens={args.new}",
            "generate.stop=[]", f"store.path={store}"]


def plain(args, texts):
    """generate() alone on the same batches; (seconds, new tokens)."""
    torch.manual_seed(0)
    model = causal_lm(n_layer=args.layers, n_embd=128, n_head=4).eval()
    tok, new = tokenizer(padding_side="left"), 0
    start = time.perf_counter()
    for i in range(0, len(texts), 8):
        enc = tok([tok.bos_token + t for t in texts[i:i + 8]], return_tensors="pt", padding=True, truncation=True,
                  max_length=32, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                 use_cache=True, pad_token_id=tok.pad_token_id)
        new += (out.shape[1] - enc["input_ids"].shape[1]) * len(out)
    return time.perf_counter() - start, new


def hooked(args, prompts: Path, work: Path, rep: int):
    """hookrun generating with every block's output stored; (seconds, new tokens, summary timing)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides(args, prompts, work / f"r{rep}.zarr"))
    start = time.perf_counter()
    path = run(cfg)
    seconds = time.perf_counter() - start
    cap = hookrun.open(path)
    return seconds, int(cap.generations()["new_tokens"].sum()), cap.attrs["summary"]["timing"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    lines = [x for x in resolve_file(CORPUS).read_text().splitlines() if x.strip()][:args.prompts]
    texts = [" ".join(x.split()[:20]) for x in lines]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = work / "prompts.txt"
        prompts.write_text("\n".join(texts) + "\n")
        a, b, timings = [], [], []
        for rep in range(args.reps):
            a.append(plain(args, texts))
            seconds, new, timing = hooked(args, prompts, work, rep)
            b.append((seconds, new))
            timings.append(timing)
    rate_a = statistics.median(n / s for s, n in a)
    rate_b = statistics.median(n / s for s, n in b)
    print(f"{args.prompts} prompts x {args.new} new tokens, GPT-2 {args.layers} blocks d_model 128, batch 8, "
          f"median of {args.reps}")
    print(f"| way | new tokens | tokens/s |\n|---|---|---|\n| generate() alone | {a[0][1]} | {rate_a:.0f} |")
    print(f"| hookrun, every block's output per step | {b[0][1]} | {rate_b:.0f} |")
    print(f"ratio hookrun / generate(): {rate_a / rate_b:.2f}x (target <= 1.3x)")
    med = {k: statistics.median(t[k] for t in timings) for k in ("loop_s", "forward_s", "capture_s")}
    print(f"hookrun breakdown (median, s): loop {med['loop_s']:.3f} = forward {med['forward_s']:.3f} + hooks/store "
          f"{med['capture_s']:.3f} + rest; whole run() {statistics.median(s for s, _ in b):.3f}")


if __name__ == "__main__":
    main()
