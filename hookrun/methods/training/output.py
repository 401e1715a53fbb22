"""A trained dictionary written as a SAELens folder, and the marker that says hookrun wrote it.

    write_folder(trainer, "runs/sae6", hook_name="blocks.6", meta={...})   # cfg.json + sae_weights.safetensors
    folder_problems("train.out", "runs/sae6")     # [] unless it exists and hookrun did not write it

An SAE (relu, topk, jumprelu; batchtopk saved as the JumpReLU SAELens saves it as) goes through
hookrun.methods.saes.save_saelens, so `dictionaries:` and `sae_lens.SAE.load_from_disk` read it; a
transcoder is written as SAELens's transcoder / skip_transcoder / jumprelu_transcoder cfg (d_out, metadata.hook_name
the input site, metadata.hook_name_out the output site), which SAELens and `dictionaries:` read.
The input normalisation and topk's decoder norm are folded into the weights (normalize_activations "none").
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import torch

from hookrun.methods.saes import CFG_FILE, DTYPE_NAMES, SAELENS_FORMAT, WEIGHTS_FILE, SparseAutoencoder, save_saelens
from hookrun.methods.training.kinds import saelens_architecture

MARKER = "hookrun-train.json"   # in every folder the train block writes: its config hash, sites, steps


def owned(path: Path) -> bool:
    """Whether `path` is a folder the train block wrote (it holds the marker), or does not exist."""
    return not path.exists() or (path.is_dir() and not path.is_symlink() and (path / MARKER).is_file())


def folder_problems(key: str, path) -> List[str]:
    """A problem for an output folder hookrun did not write (it is never overwritten)."""
    p = Path(str(path)).expanduser()
    if p.is_symlink():
        return [f"{key}: {str(path)!r} is a symlink; give a folder path (hookrun never writes through a link)"]
    if p.exists() and not p.is_dir():
        return [f"{key}: {str(path)!r} is a file; give a folder path for the SAELens folder"]
    if p.exists() and any(p.iterdir()) and not owned(p):
        return [f"{key}: {str(path)!r} exists and was not written by hookrun's train block (no {MARKER}); it is "
                "never overwritten: give another folder, or remove it yourself"]
    return []


def marker(path: Path) -> Optional[dict]:
    """The marker of a folder the train block wrote (None where there is none)."""
    try:
        return json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_marker(path: Path, info: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path / MARKER)


def write_folder(trainer, path, hook_name: str, hook_name_out: Optional[str] = None,
                 meta: Optional[dict] = None) -> Path:
    """The trained dictionary of `trainer` (hookrun.methods.training.trainer.Trainer) as a SAELens folder at `path`."""
    d = trainer.d
    path = Path(str(path)).expanduser()
    state = d.inference_state(trainer.scale_in, trainer.scale_out)
    architecture = saelens_architecture(d.kind, d.transcoder, d.skip)
    metadata = {**(meta or {}), "hookrun_kind": d.kind}
    if not d.transcoder:
        sae = SparseAutoencoder(d.d_in, d.d_sae, architecture, k=int(d.k) if architecture == "topk" else None,
                                dtype=d.W_dec.dtype, hook_name=hook_name)
        with torch.no_grad():
            for name, value in state.items():
                getattr(sae, name).copy_(value)
        return save_saelens(sae, path, hook_name=hook_name, metadata=metadata)
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.to("cpu").contiguous() for n, t in state.items()}, str(path / WEIGHTS_FILE))
    cfg = {"d_in": d.d_in, "d_sae": d.d_sae, "d_out": d.d_out, "dtype": DTYPE_NAMES[d.W_dec.dtype], "device": "cpu",
           "apply_b_dec_to_input": False, "normalize_activations": "none", "reshape_activations": "none",
           "metadata": {"sae_lens_version": SAELENS_FORMAT, "sae_lens_training_version": SAELENS_FORMAT,
                        "hook_name": hook_name, "hook_name_out": hook_name_out, **metadata},
           "architecture": architecture}
    (path / CFG_FILE).write_text(json.dumps(cfg), encoding="utf-8")
    return path
