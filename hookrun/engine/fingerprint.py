"""What a store was made from: fingerprints of the model's weights, each dictionary's files, the data files and the
tokenizer, recorded in the root attrs at creation so a resume from other inputs is refused (hookrun.store.place).

    inputs = fingerprints(config, model, tokenizer_digest)   # {"model": {...}, "dictionaries.sae1": {...}, "data": ...}

The record is {section: {item: digest}}: each item a parameter, a file or the tokenizer, its digest 16 hex digits of
BLAKE2b. The rule (RULE, written in docs/concepts/resume.md) is bounded for large models and files:
- a parameter: its name, shape and dtype, and the bytes of at most SAMPLE elements of it, evenly spaced over the
  flattened tensor (index floor(i * (n - 1) / (SAMPLE - 1)), i = 0..SAMPLE-1; every element when n <= SAMPLE). A
  parameter offloaded to the "meta" device (a device map's disk offload) counts by its shape and dtype; its values
  are in the checkpoint files, which are fingerprinted too.
- a file: its size and its bytes, all of them up to FULL_BYTES, else BLOCKS blocks of BLOCK bytes evenly spaced
  over it (the first and the last included). A folder: each file under it, by its path inside the folder.
- the tokenizer: its class and its full definition (a fast tokenizer's JSON, else its vocabulary and special
  tokens).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Dict, Iterable, Optional

import numpy as np
import torch

from hookrun.config.checks import resolve_file

RULE = "hookrun-fingerprint-1"
SAMPLE = 65536  # elements hashed a parameter, at most
FULL_BYTES = 64 * 2**20  # files up to this size hashed whole
BLOCK = 64 * 2**10
BLOCKS = 256  # blocks of a larger file hashed (16 MiB read a file)
PATH_KEYS = ("path", "pretrained_model_name_or_path", "file", "files", "checkpoint", "weights")


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """A parameter's digest: shape, dtype and a strided sample of its values (the module docstring's rule)."""
    head = f"{tuple(t.shape)}|{t.dtype}".encode()
    if t.device.type == "meta":
        return _digest(head, b"|meta")
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n > SAMPLE:
        index = torch.from_numpy(np.arange(SAMPLE, dtype=np.int64) * (n - 1) // (SAMPLE - 1)).to(flat.device)
        flat = flat.index_select(0, index)
    data = flat.contiguous().cpu()
    return _digest(head, data.view(torch.uint8).numpy().tobytes() if n else b"")


def model_digests(model: torch.nn.Module) -> Dict[str, str]:
    """Every parameter's digest, by name (parameters shared by two names counted under the first)."""
    return {name: tensor_digest(p) for name, p in model.named_parameters()}


def file_digest(path: Path) -> str:
    """A file's digest: its size and its bytes (all up to FULL_BYTES, else BLOCKS evenly spaced blocks)."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=8)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= FULL_BYTES:
            for block in iter(lambda: f.read(2**20), b""):
                h.update(block)
        else:
            for i in range(BLOCKS):
                f.seek((size - BLOCK) * i // (BLOCKS - 1))
                h.update(f.read(BLOCK))
    return h.hexdigest()


def path_files(path: Path, label: str) -> Dict[str, Path]:
    """A file (under `label`) or every file under a folder (under `label`/its path inside; hidden ones left out)."""
    if path.is_file():
        return {label: path}
    found = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                full = Path(root, name)
                found[f"{label}/{full.relative_to(path).as_posix()}"] = full
    return found


def path_digests(path: Path, label: str) -> Dict[str, str]:
    """The digests of a file (under `label`) or of every file under a folder (path_files' labels)."""
    return {k: file_digest(f) for k, f in path_files(path, label).items()}


def _named(node, keys: Iterable[str] = PATH_KEYS) -> Iterable[str]:
    """The strings under `keys` anywhere in a config node that name a local file or folder."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in keys:
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, str) and "://" not in item.replace("pkg://", "") and resolve_file(item).exists():
                        yield item
            elif key != "_target_":
                yield from _named(value, keys)
    elif isinstance(node, list):
        for item in node:
            yield from _named(item, keys)


def _listed(node) -> Dict[str, Path]:
    return {k: f for item in _named(node) for k, f in path_files(resolve_file(item), item).items()}


def named_files(config: dict) -> Dict[str, Dict[str, Path]]:
    """{section: {label: file}} of the local files a run's config names, each section's node walked once: `model`
    (checkpoint files), `dictionaries.NAME` (each dictionary's files) and `data` (the data files; a tokenizer's
    folder is the tokenizer's, fingerprinted by its definition: files whose label begins with its name left out)."""
    found = {"model": _listed(config.get("model") or {})}
    for name, spec in (config.get("dictionaries") or {}).items():
        if isinstance(spec, dict):
            found[f"dictionaries.{name}"] = _listed(spec)
    data = {k: v for k, v in (config.get("data") or {}).items() if k != "tokenizer"}
    text = data.get("text") or {}
    tokenizer = list(_named(text["tokenizer"])) if isinstance(text, dict) and text.get("tokenizer") else []
    found["data"] = {k: f for k, f in _listed(data).items() if not any(k.startswith(p) for p in tokenizer)}
    return found


def fingerprints(config: dict, model: torch.nn.Module, tokenizer: Optional[str] = None
                 ) -> Dict[str, Dict[str, str]]:
    """{section: {item: digest}} of a run's inputs: `model` (its parameters, and the checkpoint files its config
    names), `dictionaries.NAME` (the files at each dictionary's path), `data` (the data files) and `tokenizer`
    (`tokenizer`: its digest, which the inputs made: their tokenizer_digest). `config`: the resolved config as the
    store keeps it; the files it names are listed first (named_files), then each read once.

        found = fingerprints(job.stored_config(), job.model, job.inputs.tokenizer_digest)
    """
    found = {"model": {f"parameter {k}": v for k, v in model_digests(model).items()}}
    for section, files in named_files(config).items():
        found.setdefault(section, {}).update({f"file {k}": file_digest(f) for k, f in files.items()})
    if tokenizer is not None:
        found["tokenizer"] = {"definition": tokenizer}
    return {section: items for section, items in found.items() if items}
