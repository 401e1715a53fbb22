"""A Hugging Face folder as a run's model and tokenizer (conf/model/hf.yaml: `model=hf model.path=DIR`), offline.

    model = causal_lm("runs/my-llama", dtype="bfloat16", attn_implementation="eager")   # AutoModelForCausalLM
    tok = tokenizer("runs/my-llama")                                                      # AutoTokenizer
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union


def _folder(path) -> str:
    if path is None or not Path(str(path)).expanduser().is_dir():
        raise ValueError(f"model.path: {path!r} is not a folder; give the folder save_pretrained wrote "
                         "(model=hf model.path=DIR)")
    return str(Path(str(path)).expanduser())


def causal_lm(path: str, dtype: Optional[str] = "auto", device_map: Optional[Union[str, dict]] = None,
              attn_implementation: Optional[str] = None):
    """AutoModelForCausalLM.from_pretrained(path) from the local folder only (nothing downloaded), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype if dtype == "auto" else getattr(torch, dtype)
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(_folder(path), **kwargs).eval()


def tokenizer(path: str, padding_side: str = "right"):
    """AutoTokenizer.from_pretrained(path) from the local folder only; a pad token (its EOS) where it has none."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_folder(path), local_files_only=True, padding_side=padding_side)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok
