"""Read benchmark: how fast do a per-token capture's rows come back, for training and for analysis?

One capture made by hookrun itself (the bundled lm_tokens experiment scaled up: a 2-block GPT-2 with
d_model 512 on random documents of 16..256 tokens, both blocks' outputs stored per token, ~4 KB a token),
then each reader run in its own subprocess (its own peak RSS) over one layer's array, warm (page cache
filled by a first pass; best of --reps passes) and cold (the files' pages dropped with
posix_fadvise(DONTNEED) before one pass: no root needed; a VM's host cache may still hold them):

    memmap_random    raw float32 .npy memmap (written by cap.export_npy), minibatches of random rows
    memmap_chunks    the same memmap read as a hand-written training loader: chunk order shuffled, a buffer
                     of --buffer-chunks chunks shuffled and served in minibatches (the reference loader)
    raw_files        hookrun's own chunk files read with readinto into one array (no check): the raw ceiling
    zarr_load        zarr's arr[:] (sequential)         zarr_chunks   zarr, shuffled chunks + buffer (as memmap_chunks)
    load             cap.load() (sequential)            load_random   cap.load(rows=random minibatch)
    loader_w0 / loader_w2   cap.loader() through a DataLoader with 0 / 2 workers
    loader_8mb       cap.loader() on the same capture made with store.chunk_mb=8
    hf_iter / hf_random     a Hugging Face datasets Arrow dataset (cap.export_hf), iterated / random rows
    xarray_random    cap.to_xarray() random rows (a few minibatches: it is slow)
    sae / sae_memory the loader / minibatches already in memory feeding a small sparse autoencoder's
                     training step (d -> 4d, 12 steps): rows/s of training, the loader's overhead

Then three pairs alternated in one process (the same minutes of a noisy machine), the target ratios:
load / raw_files, loader_w0 / memmap_chunks, and loader on 8 MB chunks / on 1 MB chunks.

Rows/s are of 4096-row minibatches (torch float32 tensors); GB/s of float32 rows. Run from the repository root:

    python benchmarks/read.py                   # 100k tokens: 2 x 200 MB arrays (a few minutes on 2 cores)
    python benchmarks/read.py --tokens 500000   # 2 x 1 GB
    python benchmarks/read.py --runs 10 [--busy 4]   # load / raw_files in 10 processes, every pass printed
                                                     # (--busy: spinning processes, a load average of 2x 2 cores)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # hookrun imports from the checkout

import hookrun  # noqa: E402
from hookrun.config.schema import conf_dir, register_configs  # noqa: E402
from hookrun.engine.runner import run as hookrun_run  # noqa: E402
from hookrun.read.chunks import empty  # noqa: E402

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
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):  # conf/ in a clone, or the wheel's
        cfg = compose(config_name="config", overrides=[
            "+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in DIMS.items()), "+model.attn_implementation=sdpa",
            "data.text.files=null", "data.text.tokenizer=null", "data.text.bos=false", "data.text.max_length=256",
            f"data.text.dataset={{_target_: {Docs.__module__}.Docs, n: {docs}}}", "data.batch_size=16",
            f"layers=[{','.join(layers)}]", f"store.path={path}", "store.mode=overwrite", f"store.chunk_mb={chunk_mb}"])
    hookrun_run(cfg)
    return hookrun.open(path)


BATCH = 4096
LAYER = LAYERS[0]


def evict(paths) -> None:
    """Drop the page-cache pages of every file under `paths` (clean pages: written back first)."""
    os.sync()
    for root in paths:
        files = [Path(root)] if Path(root).is_file() else [p for p in Path(root).rglob("*") if p.is_file()]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def shuffled_chunks(read_chunk, n: int, rows: int, buffer_chunks: int, rng):
    """The reference training loader: chunks in a random order, `buffer_chunks` at a time shuffled together
    (with the rows left from the last buffer), served in BATCH-row float32 tensors."""
    order = rng.permutation(-(-n // rows))
    left = None
    for g in range(0, len(order), buffer_chunks):
        parts = [read_chunk(k * rows, min(n, (k + 1) * rows)) for k in order[g:g + buffer_chunks]]
        buf = np.concatenate(parts if left is None else [left, *parts])
        perm = rng.permutation(len(buf))
        full = len(buf) // BATCH
        for i in range(full):
            yield torch.from_numpy(buf[np.sort(perm[i * BATCH:(i + 1) * BATCH])])
        left = buf[perm[full * BATCH:]]
    if left is not None and len(left):
        yield torch.from_numpy(left)


def random_rows(take, n: int, rng, batches=None):
    """Minibatches of BATCH random rows (sorted within the batch), `batches` of them or one epoch's."""
    perm = rng.permutation(n)
    count = -(-n // BATCH) if batches is None else batches
    for i in range(count):
        yield torch.from_numpy(np.asarray(take(np.sort(perm[i * BATCH:(i + 1) * BATCH]))))


def method(name: str, a) -> tuple:
    """(one pass: a function returning rows read, the files it reads) of a reader."""
    cap = hookrun.open(a.store)
    key = f"resid/{LAYER}/output"
    arr = cap.array(key)
    n, rows = arr.shape[0], arr.chunks[0]
    rng = np.random.default_rng(0)
    npy = Path(a.dir) / "layer.npy"

    def count(batches):
        return sum(len(b) for b in batches)

    if name.startswith("memmap"):
        mm = np.load(npy, mmap_mode="r")
        if name == "memmap_random":
            return lambda: count(random_rows(lambda i: mm[i], n, rng)), [npy]
        return lambda: count(shuffled_chunks(lambda x, y: np.array(mm[x:y]), n, rows, a.buffer_chunks, rng)), [npy]
    if name == "raw_files":
        files = [cap.path / key / f"c.{k}.0" for k in range(-(-n // rows))]
        out = np.empty(arr.nbytes + 4 * len(files), dtype=np.uint8)

        def raw():
            at = 0
            for f in files:
                with open(f, "rb", buffering=0) as fh:
                    at += fh.readinto(memoryview(out[at:]))
            return n
        return raw, [cap.path / key]
    if name == "zarr_load":
        return lambda: len(arr[:]), [cap.path / key]
    if name == "zarr_chunks":
        return lambda: count(shuffled_chunks(lambda x, y: arr[x:y], n, rows, a.buffer_chunks, rng)), [cap.path / key]
    if name == "load":  # into the array cap.load makes (hookrun.read.chunks.empty), made once, as raw's buffer is
        out = empty(arr.shape, np.float32)
        return lambda: len(cap._read(key, slice(0, n), out)), [cap.path / key]
    if name == "load_random":
        return lambda: count(random_rows(lambda i: cap.load(layer=LAYER, role="output", rows=i), n, rng)), \
            [cap.path / key]
    if name.startswith("loader") or name == "sae":
        store = hookrun.open(a.store8) if name == "loader_8mb" else cap
        ds = store.loader(layer=LAYER, role="output", batch_size=BATCH, buffer_chunks=a.buffer_chunks)
        if name == "loader_8mb":
            ds.buffer_chunks = max(1, a.buffer_chunks // 8)  # the same buffer in MB
        workers = 2 if name == "loader_w2" else 0  # persistent: a training loop starts its workers once
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
        if name == "sae":
            return sae_pass(dl), [store.path / key]
        return lambda: count(dl), [store.path / key]
    if name == "sae_memory":  # the same training on minibatches already in memory: the loader's overhead
        mem = torch.from_numpy(np.load(npy))
        return sae_pass([mem[i:i + BATCH] for i in range(0, n, BATCH)]), []
    if name.startswith("hf"):
        import datasets

        ds = datasets.load_from_disk(str(Path(a.dir) / "hf")).with_format("torch")
        if name == "hf_iter":
            return lambda: count(b["acts"] for b in ds.iter(batch_size=BATCH)), [Path(a.dir) / "hf"]
        return lambda: count(random_rows(lambda i: ds[i]["acts"], n, rng, batches=8)), [Path(a.dir) / "hf"]
    if name == "xarray_random":
        xa = cap.to_xarray(layer=LAYER)["output"]
        return lambda: count(random_rows(lambda i: xa.isel(token=i).values, n, rng, batches=2)), [cap.path / key]
    raise ValueError(name)


def sae_pass(dl):
    """One epoch of a sparse autoencoder (d -> 4d, ReLU, L1) trained on the loader's batches (at most 12)."""
    d = DIMS["n_embd"]
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-3)

    def run():
        done = 0
        for i, x in enumerate(dl):
            if i == 12:
                break
            z = torch.relu(enc(x))
            loss = (dec(z) - x).pow(2).mean() + 1e-3 * z.abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += len(x)
        return done
    return run


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would keep the parent's across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pair(names, a) -> None:
    """Two readers alternated --reps times in one process (the same minutes of a noisy machine): the best
    rows/s of each and their ratio."""
    passes = [method(name, a)[0] for name in names]
    best, best_cpu, ratios, cpu_ratios = [0.0, 0.0], [0.0, 0.0], [], []
    for _ in range(2 * a.reps + 1):  # this machine's noise comes and goes: more passes than for the table
        got, cpu = [], []
        for i, one_pass in enumerate(passes):
            t, c = time.perf_counter(), time.process_time()  # CPU time: every thread of this process
            rows = one_pass()
            got.append(rows / (time.perf_counter() - t))
            cpu.append(rows / max(time.process_time() - c, 1e-9))
            best[i], best_cpu[i] = max(best[i], got[-1]), max(best_cpu[i], cpu[-1])
        ratios.append(got[1] / got[0])
        cpu_ratios.append(cpu[1] / cpu[0])
    print(json.dumps({"rows_s": best, "ratio": best[1] / best[0], "ratios": ratios,
                      "cpu_ratio": best_cpu[1] / best_cpu[0], "cpu_ratios": cpu_ratios}))


def child(name: str, a) -> None:
    """Run one reader (warm: a first pass, then the best of --reps; cold: one pass after dropping its files'
    pages) and print its result as JSON."""
    one_pass, files = method(name, a)
    result = {}
    if a.mode == "cold":
        evict(files)
    else:
        one_pass()
    best, rows = None, 0
    for _ in range(1 if a.mode == "cold" else a.reps):
        t = time.perf_counter()
        rows = one_pass()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    row_bytes = DIMS["n_embd"] * 4
    result.update(rows=rows, seconds=best, rows_s=rows / best, gb_s=rows * row_bytes / best / 1e9,
                  rss_mb=peak_rss_mb())
    print(json.dumps(result))


METHODS = ["memmap_random", "memmap_chunks", "raw_files", "zarr_load", "zarr_chunks", "load", "load_random",
           "loader_w0", "loader_w2", "loader_8mb", "hf_iter", "hf_random", "xarray_random", "sae", "sae_memory"]
NO_COLD = {"hf_random", "xarray_random", "sae", "sae_memory"}
PAIRS = [("raw_files", "load"), ("memmap_chunks", "loader_w0"), ("loader_w0", "loader_8mb")]  # (reference, tried)


def run_child(name: str, mode: str, a, d: Path):
    proc = subprocess.run([sys.executable, __file__, "--child", name, "--mode", mode, "--dir", a.dir,
                           "--store", str(d / "c1.zarr"), "--store8", str(d / "c8.zarr"),
                           "--reps", str(a.reps), "--buffer-chunks", str(a.buffer_chunks)],
                          capture_output=True, text=True)
    if proc.returncode:
        print(f"{name} {mode} failed:\n{proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spin() -> None:
    """A busy loop (a process of --busy): load on the machine."""
    while True:
        pass


def load_runs(a, d: Path) -> None:
    """cap.load against the raw chunk reads, alternated in each of a.runs processes: every pass's ratio, each
    process's best and worst, the least of the bests (the target: >= 0.8 in every run)."""
    import multiprocessing

    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(a.busy)]
    for proc in spinners:
        proc.start()
    try:
        time.sleep(3 if spinners else 0)  # the load average rises
        print(f"load / raw_files in {a.runs} processes, {2 * a.reps + 1} alternated passes each, {a.busy} spinning "
              f"processes, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
        bests = []
        for run in range(a.runs):
            got = run_child("raw_files+load", "warm", a, d)
            if got is None:
                continue
            bests.append(got["ratio"])
            print(f"run {run + 1}: best {got['ratio']:.2f} ({got['rows_s'][1]:,.0f} / {got['rows_s'][0]:,.0f} rows/s); "
                  f"every pass {' '.join(f'{r:.2f}' for r in got['ratios'])}; rows per CPU second: best "
                  f"{got['cpu_ratio']:.2f}, every pass {' '.join(f'{r:.2f}' for r in got['cpu_ratios'])}; "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
        print(f"least best of {len(bests)} runs: {min(bests):.2f}; median {np.median(bests):.2f}")
    finally:
        for proc in spinners:
            proc.terminate()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=100_000, help="tokens captured (default 100k: 2 x 200 MB)")
    p.add_argument("--dir", default="/tmp/hookrun-read-bench", help="where the captures go (kept for the next run)")
    p.add_argument("--reps", type=int, default=3, help="warm passes per reader; the best is reported")
    p.add_argument("--buffer-chunks", type=int, default=16, help="chunks of 1 MB per shuffle buffer")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="warm", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--store8", help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=0, help="only the load / raw_files pair, in this many processes: "
                                                           "each process's ratio printed (a slow mode shows)")
    p.add_argument("--busy", type=int, default=0, help="with --runs: this many spinning processes beside the runs "
                                                       "(a load average above the cores)")
    a = p.parse_args()
    if a.child and "+" in a.child:
        return pair(a.child.split("+"), a)
    if a.child:
        return child(a.child, a)
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    cap = capture(d / "c1.zarr", a.tokens, 1.0)
    capture(d / "c8.zarr", a.tokens, 8.0, layers=LAYERS[:1])  # loader_8mb's
    print(f"captures: {cap.index.row_stop.max()} tokens, {time.perf_counter() - t:.0f} s")
    exports = {}
    if not (d / "layer.npy").exists():
        t = time.perf_counter()
        cap.export_npy(d / "layer.npy", layer=LAYER, role="output")
        exports["export_npy"] = time.perf_counter() - t
    if importlib.util.find_spec("datasets") is None:
        print("datasets is not installed: no Hugging Face readers")
        a.methods = ",".join(m for m in a.methods.split(",") if not m.startswith("hf"))
    elif not (d / "hf" / "state.json").exists():
        t = time.perf_counter()
        cap.export_hf(d / "hf", layer=LAYER, role="output")
        exports["export_hf"] = time.perf_counter() - t
    if a.runs:
        return load_runs(a, d)
    nbytes = np.load(d / "layer.npy", mmap_mode="r").nbytes
    for k, v in exports.items():
        print(f"{k}: {v:.2f} s ({nbytes / v / 1e9:.2f} GB/s)")
    print(f"one layer: {nbytes / 1e6:.0f} MB, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| reader | warm rows/s | warm GB/s | warm peak RSS MB | cold rows/s | cold GB/s |")
    print("|---|---|---|---|---|---|")
    for name in a.methods.split(","):
        got = {}
        for mode in ("warm", "cold"):
            if mode == "cold" and name in NO_COLD:
                continue
            result = run_child(name, mode, a, d)
            if result is not None:
                got[mode] = result
        w, c = got.get("warm", {}), got.get("cold", {})
        fmt = lambda r, k, f: f.format(r[k]) if k in r else ""  # noqa: E731
        print(f"| {name} | {fmt(w, 'rows_s', '{:,.0f}')} | {fmt(w, 'gb_s', '{:.2f}')} | {fmt(w, 'rss_mb', '{:.0f}')} "
              f"| {fmt(c, 'rows_s', '{:,.0f}')} | {fmt(c, 'gb_s', '{:.2f}')} |", flush=True)
    print("\nalternated in one process, warm (best rows/s of each; targets: load >= 0.8x raw_files, "
          "loader_w0 >= 0.8x memmap_chunks):")
    for ref, tried in PAIRS:
        got = run_child(f"{ref}+{tried}", "warm", a, d)
        if got:
            print(f"{tried} / {ref}: {got['rows_s'][1]:,.0f} / {got['rows_s'][0]:,.0f} rows/s = {got['ratio']:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
