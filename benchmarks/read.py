"""Read benchmark: how fast do hookrun's captures come back, for analysis and for training?

WIP: the capture step (the rest follows).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # hookrun imports from the checkout

import hookrun  # noqa: E402
from hookrun.config.schema import register_configs  # noqa: E402
from hookrun.run.runner import run as hookrun_run  # noqa: E402

LAYERS = ["transformer.h.0", "transformer.h.1"]
DIMS = dict(n_layer=2, n_embd=512, n_head=8, vocab_size=1000, n_positions=256)
LENGTHS = (16, 256)  # document lengths, uniform


class Docs(torch.utils.data.Dataset):
    """`n` seeded documents of token ids in [2, vocab), LENGTHS[0]..LENGTHS[1] tokens long."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)  # the end of iteration (read_documents iterates the dataset)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = int(torch.randint(LENGTHS[0], LENGTHS[1] + 1, (), generator=g))
        return torch.randint(2, DIMS["vocab_size"], (n,), generator=g)


def capture(path: Path, tokens: int, chunk_mb: float, layers=LAYERS) -> hookrun.Captures:
    """The bundled lm_tokens experiment scaled up (d_model 512, documents of 16..256 random tokens), every
    listed block's output stored per token, into `path` (reused when it is complete)."""
    from hydra import compose, initialize_config_dir

    if path.exists():
        cap = hookrun.open(path)
        if cap.status == "complete":
            return cap
    register_configs()
    docs = max(16, round(tokens / (sum(LENGTHS) / 2)))
    with initialize_config_dir(config_dir=str(REPO / "hookrun" / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in DIMS.items()), "+model.attn_implementation=sdpa",
            "data.text.files=null", "data.text.tokenizer=null", "data.text.bos=false", "data.text.max_length=256",
            f"data.text.dataset={{_target_: {Docs.__module__}.Docs, n: {docs}}}", "data.batch_size=16",
            f"layers=[{','.join(layers)}]", f"store.path={path}", "store.mode=overwrite", f"store.chunk_mb={chunk_mb}"])
    hookrun_run(cfg)
    return hookrun.open(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--dir", default="/tmp/hookrun-read-bench")
    args = p.parse_args()
    t = time.perf_counter()
    cap = capture(Path(args.dir) / "c1.zarr", args.tokens, 1.0)
    print(cap, time.perf_counter() - t)


if __name__ == "__main__":
    main()
