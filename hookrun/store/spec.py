"""The `store` settings: their names, their checks, and the errors a store raises."""
from __future__ import annotations

from typing import List

import numpy as np
import pandas as pd
import torch
import zarr


from hookrun.config.checks import Number, check_choice, check_numbers
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


SECONDS = 10 ** 6  # about 12 days: more between commits or retries is a typo, not a plan
NUMBERS = {
    "level": Number(whole=True, low=0, high=9, fix="blosc's compression level"),
    "min_saving": Number(low=0, high=1, open_high=True, fix="the fraction of its bytes an array's first chunk must "
                                                           "save to be compressed; 0 = compress every array"),
    "chunk_mb": Number(low=0, high=MAX_CHUNK_MB, open_low=True, fix="chunks of 1-64 MB read and write best"),
    "chunk_rows": Number(whole=True, low=1, null="chunk_mb decides"),
    "shard_mb": Number(low=0, high=MAX_SHARD_MB, open_low=True, null="no shards", fix="256 makes few large files"),
    "queue_mb": Number(low=0, high=10 ** 6, open_low=True),
    "commit_s": Number(low=0, high=SECONDS, fix="0 = commit after every batch"),
    "retry_s": Number(low=0, high=SECONDS, fix="seconds an object store may stay unreachable; 0 = fail at the "
                                               "first error"),
}


def check_spec(store_cfg) -> List[str]:
    """Problems with the `store` entry."""
    problems = check_numbers("store", store_cfg, NUMBERS)
    problems += check_choice("store.mode", store_cfg.mode, STORE_MODES)
    problems += check_choice("store.codec", store_cfg.codec, CODECS)
    problems += check_choice("store.shuffle", store_cfg.shuffle, SHUFFLES, hint=False)
    problems += check_choice("store.writer", store_cfg.writer, WRITERS)
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
