"""The `store` settings: their names, their checks, and the errors a store raises."""
from __future__ import annotations

import math
from typing import List

import numpy as np
import pandas as pd
import torch
import zarr


from hookrun.config.checks import check_choice
from hookrun.config.schema import CODECS, SHUFFLES, STORE_MODES, WRITERS
from hookrun.storage import MEMORY_URL

WRITER_MODES = tuple(w for w in WRITERS if w != "auto")  # a writer thread beside the run, or writing in the hooks
ENCODING_KEYS = ("codec", "level", "shuffle", "chunk_mb", "chunk_rows", "shard_mb")  # fixed for the life of a store
MEMORY = "memory"  # store.path of a store in this process's memory (fsspec memory://, a fresh name each run) ...
MEMORY_ROOT = f"{MEMORY_URL}hookrun/"  # ... at MEMORY_ROOT<uuid>/captures.zarr
MAX_SHARD_MB = 16384  # a shard is buffered whole in memory before it is written
MAX_CHUNK_MB = 2048  # one chunk is encoded in memory at once: larger is a typo, not a plan


class NonFiniteError(RuntimeError):
    """A capture held NaN or inf values and on_nonfinite is error."""


class StoreError(RuntimeError):
    """The store could not be written (exists, disk full, permission denied, writer failure)."""


def check_spec(store_cfg) -> List[str]:
    """Problems with the `store` entry."""
    problems = []
    for key in ("chunk_mb", "commit_s", "queue_mb", "min_saving", "retry_s"):
        value = getattr(store_cfg, key)
        if not math.isfinite(value):
            problems.append(f"store.{key}: {value} is not a finite number; give a positive number")
    if problems:
        return problems
    problems += _range_problems(store_cfg)
    problems += check_choice("store.mode", store_cfg.mode, STORE_MODES)
    problems += check_choice("store.codec", store_cfg.codec, CODECS)
    problems += check_choice("store.shuffle", store_cfg.shuffle, SHUFFLES, hint=False)
    problems += check_choice("store.writer", store_cfg.writer, WRITERS)
    return problems


def _range_problems(store_cfg) -> List[str]:
    """The `store` numbers out of their ranges."""
    problems = []
    if store_cfg.chunk_mb > MAX_CHUNK_MB:
        problems.append(f"store.chunk_mb: {store_cfg.chunk_mb} MB per chunk is more than {MAX_CHUNK_MB}; "
                        "chunks of 1-64 MB read and write best")
    if store_cfg.commit_s < 0:
        problems.append(f"store.commit_s: {store_cfg.commit_s} must be >= 0 (0 = commit after every batch)")
    if not 0 <= store_cfg.min_saving < 1:
        problems.append(f"store.min_saving: {store_cfg.min_saving} must be in [0, 1): the fraction of its bytes an "
                        "array's first chunk must save to be compressed (0 = compress every array)")
    if not 0 <= store_cfg.level <= 9:
        problems.append(f"store.level: {store_cfg.level} must be 0..9")
    if store_cfg.chunk_mb <= 0:
        problems.append(f"store.chunk_mb: {store_cfg.chunk_mb} must be > 0")
    shard = store_cfg.shard_mb
    if shard is not None and not (math.isfinite(shard) and 0 < shard <= MAX_SHARD_MB):
        problems.append(f"store.shard_mb: {shard} must be a number in (0, {MAX_SHARD_MB}] or null (no shards); "
                        "256 makes few large files")
    if store_cfg.chunk_rows is not None and store_cfg.chunk_rows <= 0:
        problems.append(f"store.chunk_rows: {store_cfg.chunk_rows} must be a positive integer or null")
    if store_cfg.queue_mb <= 0:
        problems.append(f"store.queue_mb: {store_cfg.queue_mb} must be > 0")
    if store_cfg.retry_s < 0:
        problems.append(f"store.retry_s: {store_cfg.retry_s} must be >= 0 (seconds an object store may stay "
                        "unreachable; 0 = fail at the first error)")
    return problems


def storage_options(store_cfg) -> dict:
    """`store.storage_options` as plain options for fsspec (parse() checked them: a mapping whose values resolve)."""
    return dict(store_cfg.storage_options or {})


def writer_mode(setting: str, device_type: str, local: bool, spare_core: bool) -> str:
    """thread or sync for store.writer=`setting`. auto: sync for a CPU run writing to a local disk with no core
    to spare, where a writer thread preempts one of torch's intra-op threads and every parallel region then
    waits for it (benchmarks/capture.py on 2 cores: sync as fast or faster on every workload); else thread
    (a GPU run leaves the CPU to the writer; an object store's requests wait on the network)."""
    if setting != "auto":
        return setting
    return "sync" if device_type == "cpu" and local and not spare_core else "thread"


def config_diff(old: dict, new: dict, prefix: str = "") -> str:
    """The keys whose values differ between two resolved configs, as 'key: old -> new; ...'."""
    out = []
    for key in sorted(set(old) | set(new)):
        if key == "store" and not prefix:
            continue
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            sub = config_diff(a, b, f"{prefix}{key}.")
            if sub:
                out.append(sub)
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return "; ".join(out)


def versions() -> dict:
    """Versions of the packages a run depends on, for the store attrs."""
    from importlib.metadata import version

    from hookrun._version import __version__

    return {"hookrun": __version__, "torch": torch.__version__, "zarr": zarr.__version__,
            "numpy": np.__version__, "pandas": pd.__version__, "hydra": version("hydra-core"),
            "omegaconf": version("omegaconf")}
