"""The opening the benchmarks share: their command line and torch's thread count, said once.

    args = parse(__doc__, argv, rounds=5, batch=8)   # --rounds 5 --batch 8 --threads 1, threads set, printed
"""
import argparse

import torch


def parse(doc: str, argv=None, threads: bool = True, **defaults) -> argparse.Namespace:
    """The arguments of a benchmark: one `--name` option a keyword (its type the default's; `max_length` is
    `--max-length`) and `--threads` (default 1), described by the module docstring's first line; torch set to
    that many threads and `torch VERSION, N thread(s)` printed (threads=False: no --threads, nothing set)."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    if threads:
        parser.add_argument("--threads", type=int, default=1, help="torch's threads (default 1)")
    args = parser.parse_args(argv)
    if threads:
        torch.set_num_threads(args.threads)
        print(f"torch {torch.__version__}, {args.threads} thread(s)")
    return args
