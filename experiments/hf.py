"""A Hugging Face folder as a run's model and tokenizer (conf/model/hf.yaml: `model=hf model.path=DIR`), offline.

    model = causal_lm("runs/my-llama", dtype="bfloat16", attn_implementation="eager")   # AutoModelForCausalLM
    tok = tokenizer("runs/my-llama")                                                      # AutoTokenizer
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional, Union

log = logging.getLogger(__name__)


def _folder(path, needs: str = "config.json") -> str:
    """The folder `path` names, holding `needs`; else the ConfigError naming model.path (exit 2, before any work)."""
    from hookrun.config.checks import ConfigError

    folder = Path(str(path)).expanduser() if path is not None else None
    if folder is None or not folder.is_dir():
        raise ConfigError([f"model.path: {path!r} is not a folder; give the folder save_pretrained wrote "
                           "(model=hf model.path=DIR)"])
    if needs and not (folder / needs).is_file():
        raise ConfigError([f"model.path: {str(folder)!r} holds no {needs}; give the folder save_pretrained wrote "
                           "(model=hf model.path=DIR: config.json, the weights and the tokenizer's files)"])
    return str(folder)


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
    """The folder's own tokenizer, offline: AutoTokenizer.from_pretrained(path), unless the folder holds a
    tokenizer.json that the class AutoTokenizer picked does not load as written (transformers 5 picks the class from
    the model's type and rebuilds a custom tokenizer as that type's own: a WordLevel tokenizer.json beside a Qwen2
    config came back as Qwen2Tokenizer, every word one id); then the file itself (PreTrainedTokenizerFast), said in
    the log. A pad token (its EOS) where it has none.

        tok = tokenizer("runs/my-llama")   # the class it built: type(tok).__name__, logged by the run
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    has_files = path is not None and any((Path(str(path)).expanduser() / f).is_file() for f in tokenizer_files)
    folder = _folder(path, needs="" if has_files else "config.json")  # built before the model: its words
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, padding_side=padding_side)
    written = Path(folder) / "tokenizer.json"
    if written.is_file() and not _loads_as_written(tok, written):
        picked = type(tok).__name__
        tok = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True, padding_side=padding_side)
        log.warning("data.text.tokenizer: AutoTokenizer built %s for %s, whose tokenizer.json it does not load as "
                    "written (another vocabulary or model); using the file itself (%s)", picked, folder,
                    type(tok).__name__)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def _loads_as_written(tok, written: Path) -> bool:
    """Whether a tokenizer's backend is the one tokenizer.json defines: the same model type and vocabulary."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: it reads its own files, not tokenizer.json
        return True
    try:
        model = json.loads(written.read_text(encoding="utf-8"))["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return True  # not a tokenizers file hookrun can read: AutoTokenizer's word stands
    ours = json.loads(backend.to_str())["model"]
    return ours.get("type") == model.get("type") and _vocab(ours) == _vocab(model)


def _vocab(model: dict):
    vocab = model.get("vocab")
    return {tuple(v) if isinstance(v, list) else v for v in vocab} if isinstance(vocab, list) else vocab
