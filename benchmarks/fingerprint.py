"""Fingerprint benchmark: what recording a run's inputs costs (hookrun.engine.fingerprint), for a model in memory
and for a checkpoint folder on disk, against hashing every byte of the same weights.

    python benchmarks/fingerprint.py [--params 100e6]
"""
import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import torch

from hookrun.engine.fingerprint import model_digests, path_digests


def model(params: float) -> torch.nn.Module:
    """Linear layers of 2048 x 2048 (4.2M parameters each) up to about `params` parameters."""
    layers = max(1, round(params / (2048 * 2049)))
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    net = model(args.params).eval()
    n = sum(p.numel() for p in net.parameters())
    size = sum(p.numel() * p.element_size() for p in net.parameters())

    def full_hash():
        h = hashlib.blake2b(digest_size=8)
        for p in net.parameters():
            h.update(p.detach().numpy().tobytes())

    sample = timed(lambda: model_digests(net))
    full = timed(full_hash)
    print(f"model in memory: {n / 1e6:.0f}M parameters ({size / 2**20:.0f} MiB, {len(list(net.parameters()))} "
          f"tensors): fingerprint {sample:.3f} s, every byte hashed {full:.3f} s ({full / sample:.0f}x)")
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_file

        folder = Path(tmp) / "ckpt"
        folder.mkdir()
        state = {k: v.contiguous() for k, v in net.state_dict().items()}
        half = len(state) // 2
        keys = list(state)
        save_file({k: state[k] for k in keys[:half]}, folder / "model-00001-of-00002.safetensors")
        save_file({k: state[k] for k in keys[half:]}, folder / "model-00002-of-00002.safetensors")
        (folder / "config.json").write_text("{}")
        files = timed(lambda: path_digests(folder, "ckpt"))

        def every_byte():
            for f in sorted(folder.iterdir()):
                h = hashlib.blake2b(digest_size=8)
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(2**20), b""):
                        h.update(block)
        whole = timed(every_byte)
        print(f"checkpoint folder: 3 files, {sum(f.stat().st_size for f in folder.iterdir()) / 2**20:.0f} MiB (warm "
              f"page cache): fingerprint {files:.3f} s, every byte hashed {whole:.3f} s ({whole / files:.0f}x)")


if __name__ == "__main__":
    main()
