"""Capture benchmark: what does writing every capture to disk with hookrun cost, and how does it compare?

For each workload the same model and the same batches are run several ways, each repeated
(--reps, default 3) with the median reported:

    forward_only   the model alone, no hooks (torch.no_grad for forward workloads;
                   forward + backward of the loss for the gradient workload)
    raw_write      as many bytes as hookrun captures, written with ndarray.tofile, one file per
                   1 MiB chunk (hookrun's store.chunk_mb), no fsync: the disk's share of the work
    hookrun        hookrun.engine.runner.run(cfg) with the shipped defaults: hooks, store.writer=auto (sync on a CPU
                   with no core to spare, else a thread), blosc-lz4 Zarr where it saves 20% (min_saving), parquet
    hookrun_thread / hookrun_sync   the same with the writer that auto did not pick
    hookrun_lz4    the same with store.min_saving=0: every array compressed (what lz4 costs on this machine)
    hookrun_nocrc  the same without the crc32c each chunk ends in (patched out here; not a setting): what
                   the checksum costs
    handwritten    register_forward_hook (or Tensor.register_hook) + torch.save of each batch
    handwritten_npy  the careful loop: forward hooks, a copy of each output, one np.save per layer and batch
    nnsight        trace + .save(), then torch.save of each batch          (if installed)
    transformer_lens HookedTransformer built from config (no weights), run_with_cache,
                   then torch.save of each batch (transformer workload only; if installed)
    torchlens      tl.trace(save=tl.module(...)), then torch.save of each batch (forward
                   workloads; if installed)

Workloads (captures are float32; --gb sets their size, --scale multiplies the sample count):

    cnn          four conv blocks on 3x64x64 random images; every conv output (480 KiB a sample)
    transformer  6 blocks, d_model 128, 4 heads, d_mlp 512, vocab 1000, 64-token random
                 sequences; every block's output, i.e. the residual stream (192 KiB a sequence)
    cnn_grad     the cnn with loss = sum of the logits; output_grad on every conv
    lm_tokens    a 6-block GPT-2 (transformers, random init, d_model 128, 4 heads, vocab 1000, SDPA) on
                 seeded documents of 16..256 tokens (batches padded to their longest): every block's
                 output stored per real token, pads never stored. Sized by --tokens (default 1M), not
                 --gb; reports tokens/s of forward_only and hookrun. SAELens' activation cache is not
                 run: CacheActivationsRunner loads its model with HookedTransformer.from_pretrained
                 (a hub download; no override for the model), so it cannot run offline

It also runs hookrun on the cnn in fresh subprocesses at 1x and 4x the sample count and
reports their peak RSS, and prints the project's targets next to the numbers: hookrun /
forward_only <= 1.25 (the goal beyond: 1.10), peak RSS at 4x within 10 % of 1x, faster than every
peer. Beside the ratio it prints the floor of a machine with no core to spare, forward_only +
raw_write (the bytes have to reach the page cache on a core the forward pass also uses).

Defaults are sized to finish in about 10 minutes on 2 CPU cores: --gb 0.5 (the targets are
stated for 1 GB: run with --gb 1 for that). Run from the repository root:

    python benchmarks/capture.py --quick              # ~50 MB per workload, about a minute
    python benchmarks/capture.py                      # 0.5 GB per workload
    python benchmarks/capture.py --gb 1 --device cuda # 1 GB per workload on a GPU

Everything is written under --dir (default: the system temp dir) and removed afterwards.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # hookrun and experiments import from the checkout

import zarr  # noqa: E402
from zarr.codecs import Crc32cCodec  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from hookrun.config.schema import conf_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import hookrun  # noqa: E402
from hookrun.config.schema import register_configs  # noqa: E402
from hookrun.engine.cores import spare_core  # noqa: E402
from hookrun.engine.runner import run as hookrun_run  # noqa: E402
from hookrun.store import writer_mode  # noqa: E402
from hookrun.store.streams import Streams  # noqa: E402

CHUNK_BYTES = 2**20  # raw_write file size: hookrun's default store.chunk_mb
TARGET_RATIO = 1.25  # hookrun / forward_only
GOAL_RATIO = 1.10  # beyond the target
TARGET_RSS = 1.10  # peak RSS at 4x samples / at 1x
TL_DIMS = dict(n_layers=6, d_model=128, n_heads=4, d_head=32, d_mlp=512, d_vocab=1000, n_ctx=64)


# -- models and data (hookrun instantiates them by their import path) ----------------------------
class ConvNet(nn.Module):
    """Four conv -> relu -> maxpool blocks on 3x64x64 images, then a linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv4 = nn.Conv2d(64, 128, 3, padding=1)
        self.head = nn.Linear(128 * 4 * 4, 10)

    def forward(self, x):
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            x = torch.max_pool2d(torch.relu(conv(x)), 2)
        return self.head(x.flatten(1))


class TinyTransformer(nn.Module):
    """A causal pre-LayerNorm GPT with the dims of TL_DIMS, built from nn.TransformerEncoderLayer."""

    def __init__(self):
        super().__init__()
        d = TL_DIMS["d_model"]
        self.embed = nn.Embedding(TL_DIMS["d_vocab"], d)
        self.pos = nn.Parameter(torch.randn(TL_DIMS["n_ctx"], d) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, TL_DIMS["n_heads"], TL_DIMS["d_mlp"], dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(TL_DIMS["n_layers"]))
        self.ln_final = nn.LayerNorm(d)
        self.unembed = nn.Linear(d, TL_DIMS["d_vocab"])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        """hookrun passes a dataset of token sequences as input_ids (+ mask and positions: every sequence here is
        full length, so they change nothing); the peers pass the ids alone."""
        tokens = input_ids
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.unembed(self.ln_final(x))


class RandomImages(torch.utils.data.Dataset):
    """`n` seeded 3x64x64 normal images, made on demand so memory does not grow with n."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + i))


class RandomTokens(RandomImages):
    """`n` seeded sequences of n_ctx token ids in [0, d_vocab)."""

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, TL_DIMS["d_vocab"], (TL_DIMS["n_ctx"],), generator=g)


LM_DIMS = dict(n_layer=6, n_embd=128, n_head=4, vocab_size=1000, n_positions=256, attn_implementation="sdpa")
LM_LENGTHS = (16, 256)  # document lengths, uniform


def gpt2_6():
    """The lm_tokens model: a GPT-2 of LM_DIMS from a transformers config, random init, no download."""
    from hookrun.experiments.lm import causal_lm

    return causal_lm(**LM_DIMS)


class RandomDocs(RandomImages):
    """`n` seeded documents of token ids in [2, vocab), each LM_LENGTHS[0]..LM_LENGTHS[1] tokens long."""

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = int(torch.randint(LM_LENGTHS[0], LM_LENGTHS[1] + 1, (), generator=g))
        return torch.randint(2, LM_DIMS["vocab_size"], (n,), generator=g)


def pad_docs(items):
    """A padded batch as the model's keywords, as hookrun passes it (right padding, pad id 0)."""
    from hookrun.data.text import pad

    ids, mask = pad([t.tolist() for t in items], 0, "right")
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}


def import_path(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


@dataclass
class Workload:
    """A model, its data, the layers whose outputs (or output gradients) are captured."""

    name: str
    model: type
    dataset: type
    layers: List[str]
    batch_size: int
    gradient: bool = False  # capture output gradients of loss = output.sum()
    samples: int = 0  # set by size_workloads
    collate: Optional[Callable] = None  # batches as keyword dicts (lm_tokens)

    def loader(self):
        return torch.utils.data.DataLoader(self.dataset(self.samples), batch_size=self.batch_size,
                                           collate_fn=self.collate)

    def tokens(self) -> int:
        """Real tokens in the workload (lm_tokens), else 0."""
        if self.collate is None:
            return 0
        ds = self.dataset(self.samples)
        return sum(len(ds[i]) for i in range(len(ds)))

    def build(self, device) -> nn.Module:
        torch.manual_seed(0)
        return self.model().to(device).eval()


WORKLOADS = [
    Workload("cnn", ConvNet, RandomImages, ["conv1", "conv2", "conv3", "conv4"], batch_size=64),
    Workload("transformer", TinyTransformer, RandomTokens, [f"blocks.{i}" for i in range(6)], batch_size=32),
    Workload("cnn_grad", ConvNet, RandomImages, ["conv1", "conv2", "conv3", "conv4"], batch_size=64, gradient=True),
    Workload("lm_tokens", gpt2_6, RandomDocs, [f"transformer.h.{i}" for i in range(6)], batch_size=16,
             collate=pad_docs),
]


def bytes_per_sample(w: Workload) -> int:
    """Bytes captured for one sample: a forward pass of one sample with hooks that only measure."""
    model, sizes = w.build("cpu"), []
    handles = [model.get_submodule(n).register_forward_hook(lambda m, a, out: sizes.append(out.nbytes))
               for n in w.layers]
    with torch.no_grad():
        x = w.dataset(1)[0][None]
        model(**w.collate(x)) if w.collate else model(x)
    for h in handles:
        h.remove()
    if w.collate:  # per stored token: the outputs of a one-document batch over its tokens
        return sum(sizes) // len(w.dataset(1)[0])
    return sum(sizes)


def size_workloads(gb: float, scale: float, tokens: int = 1_000_000) -> None:
    for w in WORKLOADS:
        if w.collate:  # lm_tokens is sized in tokens: mean document length is the middle of LM_LENGTHS
            w.samples = max(w.batch_size, round(tokens / (sum(LM_LENGTHS) / 2) * scale))
        else:
            w.samples = max(w.batch_size, round(gb * 2**30 / bytes_per_sample(w) * scale))


# -- timing --------------------------------------------------------------------------------------
def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def loss_of(output):
    return output.sum()


def batches(w: Workload, device):
    for x in w.loader():
        if isinstance(x, dict):
            yield {k: v.to(device, non_blocking=True) for k, v in x.items()}
        else:
            yield x.to(device, non_blocking=True)


def call(model, x):
    return model(**x) if isinstance(x, dict) else model(x)


def run_model(model, x, w: Workload):
    """One batch: forward (no_grad) or forward + backward of the sum."""
    if not w.gradient:
        with torch.no_grad():
            return call(model, x)
    out = call(model, x)
    model.zero_grad(set_to_none=True)
    loss_of(out).backward()
    return out


# -- methods: each runs the whole workload once, writing under `out`; the caller times it ----------
def forward_only(w: Workload, device, out: Path) -> None:
    model = w.build(device)
    for x in batches(w, device):
        run_model(model, x, w)


def raw_write(w: Workload, device, out: Path, nbytes: int) -> None:
    chunk = np.random.default_rng(0).standard_normal(CHUNK_BYTES // 4, dtype=np.float32)
    for i in range(-(-nbytes // CHUNK_BYTES)):
        chunk[: (nbytes - i * CHUNK_BYTES) // 4].tofile(out / f"chunk-{i:06d}.bin")


_COMPOSED = None


def hookrun_config(w: Workload, device, store: Path):
    """The shipped conf/config.yaml (store: zarr defaults) plus this workload's model, data and hooks."""
    global _COMPOSED
    if _COMPOSED is None:
        register_configs()
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):  # conf/ in a clone
            _COMPOSED = compose(config_name="config")
        OmegaConf.set_struct(_COMPOSED, False)  # hooks.<name> is a new key
    return OmegaConf.merge(_COMPOSED, {
        "device": str(device), "layers": w.layers,
        "model": {"_target_": import_path(w.model)},
        "data": {"dataset": {"_target_": import_path(w.dataset), "n": w.samples}, "batch_size": w.batch_size},
        "hooks": {"acts": {"kind": "output_grad" if w.gradient else "forward", "layers": "${layers}"}},
        "loss": {"name": "sum"} if w.gradient else None,
        "store": {"path": str(store), "mode": "overwrite"},
    })


def hookrun_method(w: Workload, device, out: Path, **store) -> dict:
    """Runs hookrun; returns its own timing summary from the store attrs: the loop's wall seconds (forward,
    backward, inside the hooks), the writer's busy wall and CPU seconds, and its CPU and wall seconds by
    stage (statistics, assemble, encode, write, index commits, close) as "cpu:<stage>" / "wall:<stage>"."""
    path = hookrun_run(OmegaConf.merge(hookrun_config(w, device, out / "captures.zarr"), {"store": store}))
    sync(device)
    summary = zarr.open_group(str(path), mode="r").attrs.get("summary", {})
    stages = summary.get("writer_stages_s", {})
    by_stage = {f"{clock}:{k}": v for clock in ("cpu", "wall") for k, v in stages.get(clock, {}).items()}
    busy = {k: summary.get(k, 0.0) for k in ("write_s", "write_cpu_s")}  # the writer's wall and CPU seconds
    return {**summary.get("timing", {}), **busy, **by_stage, "writer": summary.get("writer")}


@contextlib.contextmanager
def without_checksum():
    """hookrun's arrays made without the crc32c codec (the benchmark's patch: the checksum is not optional)."""
    codecs = Streams.codecs
    Streams.codecs = lambda self, compressed: [c for c in codecs(self, compressed) if not isinstance(c, Crc32cCodec)]
    try:
        yield
    finally:
        Streams.codecs = codecs


def hookrun_nocrc(w: Workload, device, out: Path) -> dict:
    with without_checksum():
        return hookrun_method(w, device, out)


def handwritten(w: Workload, device, out: Path) -> None:
    model, captured = w.build(device), {}

    def grab(name):
        def store_grad(g):
            captured[name] = g.detach().cpu()

        def hook(module, args, output):
            if w.gradient:
                output.register_hook(store_grad)
            else:
                captured[name] = (output[0] if isinstance(output, tuple) else output).detach().cpu()
        return hook

    handles = [model.get_submodule(n).register_forward_hook(grab(n)) for n in w.layers]
    try:
        for i, x in enumerate(batches(w, device)):
            run_model(model, x, w)
            torch.save(captured, out / f"batch-{i:06d}.pt")
            captured.clear()
    finally:
        for h in handles:
            h.remove()


def handwritten_npy(w: Workload, device, out: Path) -> None:
    """A careful hand-written loop: forward hooks, a copy of each output, one np.save per layer and batch."""
    model, captured = w.build(device), {}

    def grab(name):
        def store_grad(g):
            captured[name] = g.detach().to("cpu", copy=True).numpy()

        def hook(module, args, output):
            if w.gradient:
                output.register_hook(store_grad)
            else:
                captured[name] = (output[0] if isinstance(output, tuple) else output).detach().to("cpu", copy=True).numpy()
        return hook

    handles = [model.get_submodule(n).register_forward_hook(grab(n)) for n in w.layers]
    try:
        for i, x in enumerate(batches(w, device)):
            run_model(model, x, w)
            for name, array in captured.items():
                np.save(out / f"{name}-{i:06d}.npy", array)
            captured.clear()
    finally:
        for h in handles:
            h.remove()


def envoy(model, name: str):
    """nnsight's proxy of the submodule at a dotted name ("blocks.0")."""
    for part in name.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def nnsight_method(w: Workload, device, out: Path) -> None:
    from nnsight import NNsight

    model = NNsight(w.build(device))
    for i, x in enumerate(batches(w, device)):
        saved = []  # filled inside the trace: nnsight cannot rebind a function's locals
        if w.gradient:
            with model.trace(x):
                outputs = [envoy(model, n).output for n in w.layers]
                loss = model.output.sum()
                with loss.backward():  # gradients arrive last layer first; ask for them in that order
                    saved.extend(o.grad.save() for o in reversed(outputs))
            saved.reverse()
        else:
            with torch.no_grad(), model.trace(x):
                saved.extend(envoy(model, n).output.save() for n in w.layers)
        torch.save({n: t.detach().cpu() for n, t in zip(w.layers, saved)}, out / f"batch-{i:06d}.pt")


def transformer_lens_method(w: Workload, device, out: Path) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    torch.manual_seed(0)
    model = HookedTransformer(HookedTransformerConfig(**TL_DIMS, act_fn="gelu", normalization_type="LN",
                                                      device=str(device))).eval()
    wanted = lambda name: name.endswith("hook_resid_post")  # noqa: E731
    for i, x in enumerate(batches(w, device)):
        with torch.no_grad():
            _, cache = model.run_with_cache(x, names_filter=wanted)
        torch.save({k: v.cpu() for k, v in cache.items()}, out / f"batch-{i:06d}.pt")


def torchlens_method(w: Workload, device, out: Path) -> None:
    import torchlens as tl
    from torchlens.backends.torch.wrappers import unwrap_torch

    model = w.build(device)
    selector = tl.module(w.layers[0])
    for name in w.layers[1:]:
        selector = selector | tl.module(name)
    try:
        for i, x in enumerate(batches(w, device)):
            with torch.no_grad():
                trace = tl.trace(model, x, save=selector)
            torch.save({n: trace[n].out.cpu() for n in w.layers}, out / f"batch-{i:06d}.pt")
    finally:
        unwrap_torch()  # torchlens leaves torch's functions wrapped, slowing every later method


PEERS: Dict[str, tuple] = {  # name -> (function, importable module, applies to workload)
    "handwritten": (handwritten, None, lambda w: True),  # lm_tokens: stores [batch, seq, d] with the pads
    "handwritten_npy": (handwritten_npy, None, lambda w: True),
    "nnsight": (nnsight_method, "nnsight", lambda w: w.collate is None),
    "transformer_lens": (transformer_lens_method, "transformer_lens", lambda w: w.name == "transformer"),
    "torchlens": (torchlens_method, "torchlens", lambda w: not w.gradient and w.collate is None),
}


METHODS = ["forward_only", "raw_write", "hookrun", "hookrun_thread", "hookrun_sync", "hookrun_lz4", "hookrun_nocrc",
           *PEERS]


def peer_status(module: Optional[str]) -> Optional[str]:
    """None if the peer can run, else why not."""
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as err:  # noqa: BLE001 - any import failure means the peer is skipped
        return "not installed" if isinstance(err, ImportError) else f"import failed: {err}"
    if module == "transformer_lens":
        try:
            from transformer_lens import HookedTransformer  # noqa: F401  (removed in TransformerLens 4)
        except Exception:  # noqa: BLE001
            return "no HookedTransformer (needs transformer_lens<4)"
    return None


CPU_S: Dict[str, float] = {}  # the last timed call's CPU seconds (every thread of this process), by "cpu"


def timed(fn: Callable, w: Workload, device, scratch: Path, **kwargs):
    """Seconds for fn on a fresh directory (removed afterwards), and fn's return value; its CPU seconds (every
    thread of this process: torch's, hookrun's writer) in CPU_S["cpu"]."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    try:
        sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        result = fn(w, device, out, **kwargs)
        sync(device)
        CPU_S["cpu"] = time.process_time() - cpu
        return time.perf_counter() - start, result
    finally:
        shutil.rmtree(out, ignore_errors=True)


def bench_workload(w: Workload, device, scratch: Path, reps: int, only: Optional[set] = None) -> Dict[str, object]:
    """Median seconds of every method (or those in `only`) on one workload (or why it did not run), in METHODS
    order."""
    nbytes = (w.tokens() or w.samples) * bytes_per_sample(w)
    methods: Dict[str, Callable] = {"forward_only": forward_only,
                                    "raw_write": lambda w_, d, o: raw_write(w_, d, o, w_.samples * nbytes // w.samples),
                                    "hookrun": hookrun_method}
    auto = writer_mode("auto", torch.device(device).type, True, spare_core())  # what the default run will pick
    other = "sync" if auto == "thread" else "thread"
    methods[f"hookrun_{other}"] = lambda w_, d, o: hookrun_method(w_, d, o, writer=other)
    # every array compressed (min_saving 0): what lz4 costs on this machine
    methods["hookrun_lz4"] = lambda w_, d, o: hookrun_method(w_, d, o, min_saving=0.0)
    methods["hookrun_nocrc"] = hookrun_nocrc  # what the chunks' crc32c costs
    skipped: Dict[str, str] = {}
    for name, (fn, module, applies) in PEERS.items():
        if applies(w):
            why = peer_status(module)
            if why is None:
                methods[name] = fn
            else:
                skipped[name] = why
    if only:
        methods = {k: v for k, v in methods.items() if k in only}
        skipped = {k: v for k, v in skipped.items() if k in only}
    warmup = dataclasses.replace(w, samples=w.batch_size)  # one batch: imports, allocator, first-call costs
    for name, fn in list(methods.items()):
        try:
            timed(fn, warmup, device, scratch)
        except Exception as err:  # noqa: BLE001 - a broken peer is reported, not fatal
            skipped[name] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}"
            del methods[name]
    times: Dict[str, List[float]] = {name: [] for name in methods}
    cpus: Dict[str, List[float]] = {name: [] for name in methods}
    internals: List[dict] = []
    nocrc_encode: List[float] = []  # the writer's CPU seconds encoding chunks without the crc32c
    for rep in range(reps):  # interleaved, so drift in the machine hits every method alike
        for name, fn in methods.items():
            seconds, extra = timed(fn, w, device, scratch)
            times[name].append(seconds)
            cpus[name].append(CPU_S["cpu"])
            if name == "hookrun":
                internals.append(extra)
            if name == "hookrun_nocrc":
                nocrc_encode.append(extra.get("cpu:encode", 0.0))
            print(f"  {w.name:12s} rep {rep + 1}/{reps} {name:17s} {seconds:8.2f} s, CPU {cpus[name][-1]:8.2f} s; load "
                  f"average {os.getloadavg()[0]:.1f}", flush=True)
    results: Dict[str, object] = {name: statistics.median(ts) for name, ts in times.items()}
    results.update(skipped)
    results = {name: results[name] for name in METHODS if name in results}
    results["_bytes"] = nbytes
    results["_cpu"] = {name: statistics.median(c) for name, c in cpus.items()}
    # each round's hookrun / handwritten_npy (alternated rounds: the same minutes of a noisy machine)
    if "hookrun" in times and "handwritten_npy" in times:
        results["_vs_npy"] = [(a / b, c / d) for a, b, c, d in zip(times["hookrun"], times["handwritten_npy"],
                                                                    cpus["hookrun"], cpus["handwritten_npy"])]
    results["_tokens"] = w.tokens()
    results["_internals"] = {k: statistics.median(d[k] for d in internals) if k != "writer" else internals[0][k]
                             for k in internals[0]} if internals else {}
    results["_nocrc_encode"] = statistics.median(nocrc_encode) if nocrc_encode else None
    return results


# -- peak RSS in fresh processes -----------------------------------------------------------------
def peak_rss_self() -> int:
    """This process's peak RSS in bytes. VmHWM, because ru_maxrss survives exec on Linux and would
    report the parent's RSS at fork time."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:
        scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def rss_child(method: str, samples: int, device, scratch: Path) -> None:
    """Hidden entry (--rss-child): run one method of the cnn workload, print this process's peak RSS."""
    w = WORKLOADS[0]
    w.samples = samples
    timed({"hookrun": hookrun_method, "forward_only": forward_only}[method], w, device, scratch)
    print(f"RSS {peak_rss_self()}")


def peak_rss(method: str, samples: int, device, scratch: Path) -> int:
    cmd = [sys.executable, __file__, "--rss-child", method, str(samples), "--device", str(device),
           "--dir", str(scratch)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1].split()[1])


# -- report --------------------------------------------------------------------------------------
def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_machine(device, scratch: Path) -> None:
    gpu = f" ({torch.cuda.get_device_name()})" if torch.device(device).type == "cuda" else ""
    print(f"machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"device {device}{gpu}")
    print(f"hookrun {hookrun.__version__}, zarr {zarr.__version__}, numpy {np.__version__}; peers: "
          + ", ".join(f"{d} {version(d)}" for d in ("nnsight", "transformer_lens", "torchlens")))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = "  (other processes are running: timings will be noisy)" if load > 0.5 else ""
    print(f"scratch dir: {scratch}; load average {load:.2f}{busy}")


def print_table(all_results: Dict[str, dict]) -> None:
    print(f"\n{'workload':12s} {'method':17s} {'median s':>9s} {'MB/s':>8s}  {'hookrun/this':>12s}  target")
    for wname, res in all_results.items():
        mb = res["_bytes"] / 2**20
        hook = res.get("hookrun")
        for name, value in res.items():
            if name.startswith("_"):
                continue
            if not isinstance(value, float):
                print(f"{wname:12s} {name:17s} {value}")
                continue
            ratio = f"{hook / value:12.2f}" if isinstance(hook, float) and name != "hookrun" else " " * 12
            target = "< 1" if name in PEERS else ""
            print(f"{wname:12s} {name:17s} {value:9.2f} {mb / value:8.1f}  {ratio}  {target}")
        fwd, disk = res.get("forward_only"), res.get("raw_write")
        if isinstance(hook, float) and isinstance(fwd, float):
            r = hook / fwd
            verdict = "meets the goal" if r <= GOAL_RATIO else "meets" if r <= TARGET_RATIO else "MISSES"
            floor = f"; no-spare-core floor forward_only + raw_write = {(fwd + disk) / fwd:.2f}" if isinstance(
                disk, float) else ""
            print(f"{wname:12s} hookrun / forward_only = {r:.2f} (target <= {TARGET_RATIO}, goal {GOAL_RATIO}: "
                  f"{verdict}){floor}; {mb:.0f} MB captured")
        if res.get("_vs_npy"):
            cpu = res["_cpu"]
            print(f"{wname:12s} hookrun / handwritten_npy (target <= 1.0): wall {hook / res['handwritten_npy']:.2f}, "
                  f"CPU {cpu['hookrun'] / cpu['handwritten_npy']:.2f} (medians); each round: wall "
                  f"{' '.join(f'{a:.2f}' for a, _ in res['_vs_npy'])}, CPU {' '.join(f'{c:.2f}' for _, c in res['_vs_npy'])}")
        if isinstance(hook, float) and isinstance(res.get("hookrun_nocrc"), float):
            encode = res["_internals"].get("cpu:encode")
            cpu = f"; the writer's CPU encoding chunks {encode:.3f} s, {res['_nocrc_encode']:.3f} s without it" \
                if encode is not None and res.get("_nocrc_encode") is not None else ""
            print(f"{wname:12s} the chunks' crc32c: hookrun / hookrun_nocrc = {hook / res['hookrun_nocrc']:.3f}{cpu}")
        if res.get("_tokens") and isinstance(hook, float) and isinstance(res.get("forward_only"), float):
            n = res["_tokens"]
            print(f"{wname:12s} tokens/s: forward_only {n / res['forward_only']:,.0f}, hookrun {n / hook:,.0f}; "
                  f"hookrun / forward_only = {hook / res['forward_only']:.2f} ({n:,} real tokens)")
        if res["_internals"]:
            print_breakdown(wname, res)
        print()


def print_breakdown(wname: str, res: dict) -> None:
    """Where hookrun's time went (medians of its own timing summary): the loop on the main thread, how much
    slower its forward ran than the bare forward pass beside it (the writer taking cores from torch's
    threads), and the writer's CPU seconds by stage against its busy wall time (the rest: waiting)."""
    t = res["_internals"]
    bare = res.get("forward_only")
    slower = f" (bare forward_only {bare:.2f} s: {t['forward_s'] - bare:+.2f} s)" if isinstance(bare, float) else ""
    print(f"{wname:12s} main thread: loop {t['loop_s']:.2f} s = forward {t['forward_s']:.2f} s{slower}, backward "
          f"{t['backward_s']:.2f} s; inside the hooks (detach, copy, queue; a sync writer's work too) "
          f"{t['capture_s']:.2f} s")
    stages = [k[len("cpu:"):] for k in t if k.startswith("cpu:")]
    cpu = ", ".join(f"{k} {t['cpu:' + k]:.2f}/{t['wall:' + k]:.2f}" for k in stages)
    print(f"{wname:12s} {t.get('writer', '?')} writer: busy {t['write_s']:.2f} s wall, {t['write_cpu_s']:.2f} s CPU "
          f"({max(0.0, t['write_s'] - t['write_cpu_s']):.2f} s waiting for a core or the disk); "
          f"CPU/wall s by stage: {cpu}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=0.5, help="GiB of captures per workload (default 0.5)")
    p.add_argument("--tokens", type=int, default=1_000_000, help="real tokens of the lm_tokens workload (default 1M)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's sample count")
    p.add_argument("--reps", type=int, default=3, help="repetitions per method; medians are reported")
    p.add_argument("--quick", action="store_true", help="smoke run: 50 MB per workload")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dir", default=None, help="where captures are written (default: the system temp dir)")
    p.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS), help="comma-separated subset")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {', '.join(METHODS)} (default: all)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak RSS subprocesses")
    p.add_argument("--rss-child", nargs=2, metavar=("METHOD", "SAMPLES"), help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]), device, Path(args.dir))
        return
    gb = 50 / 1024 if args.quick else args.gb
    size_workloads(gb, args.scale, args.tokens // 20 if args.quick else args.tokens)
    scratch = Path(tempfile.mkdtemp(prefix="hookrun-bench-", dir=args.dir))
    try:
        print_machine(device, scratch)
        chosen = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
        print("workloads: " + ", ".join(f"{w.name} ({w.samples} samples)" for w in chosen) + "\n")
        only = set(args.methods.split(",")) if args.methods else None
        results = {w.name: bench_workload(w, device, scratch, args.reps, only) for w in chosen}
        print_table(results)
        if not args.no_rss:
            n = WORKLOADS[0].samples
            base = peak_rss("forward_only", n, device, scratch)
            one, four = (peak_rss("hookrun", k * n, device, scratch) for k in (1, 4))
            verdict = "meets" if four / one <= TARGET_RSS else "MISSES"
            print(f"peak RSS, cnn: forward_only 1x {base / 2**20:.0f} MB; hookrun 1x ({n} samples) "
                  f"{one / 2**20:.0f} MB, 4x ({4 * n} samples) {four / 2**20:.0f} MB; 4x/1x = {four / one:.2f} "
                  f"(target <= {TARGET_RSS}: {verdict})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
