"""Dictionaries (sparse autoencoders): the module, the SAELens folder format, sparse features and evaluations.

    sae = load_saelens("runs/sae")                     # a SAELens 6.x folder: cfg.json + sae_weights.safetensors
    f = sae.encode(x)                                  # [..., d_sae], as SAELens's encode gives them
    x_hat = sae.decode(f)                              # [..., d_in]
    idx, val = sparse_topk(f.flatten(0, -2), k=16)     # int32 / float32 [n, 16], index -1 where fewer fired
    ev = Evaluation(sae.d_sae); ev.add(x, x_hat, f); ev.result()   # l0, mse, explained_variance, dead_features...
    save_saelens(sae, "runs/sae2", hook_name="transformer.h.1")

The encode/decode maths are SAELens 6.54's (sae_lens/saes/standard_sae.py, topk_sae.py, jumprelu_sae.py):
    sae_in = x.to(dtype) - b_dec * apply_b_dec_to_input;  pre = sae_in @ W_enc + b_enc
    standard: relu(pre);  jumprelu: relu(pre) * (pre > threshold)
    topk: pre *= |W_dec rows| if rescale_acts_by_decoder_norm; keep the k largest of pre, relu'd, zero the rest
    decode: f @ W_dec + b_dec  (topk with rescale_acts_by_decoder_norm: f / |W_dec rows| first)
Only normalize_activations "none" is supported: the others keep per-call state between encode and decode in
SAELens (or need a scaling factor from its registry); fold them into the weights first (SAELens:
sae.fold_activation_norm_scaling_factor(...), then save_model). The maths above are pure torch.

In a run (the method `Dictionaries`, docs/dictionaries.md):

    dictionaries: {sae1: {path: runs/sae}}                       # loaded once; checked before the model is built
    hooks:
      feats: {kind: forward, layers: [transformer.h.1], dictionary: sae1, top_k: 16, evaluate: true}
      steer: {kind: forward, layers: [transformer.h.1], capture: [], edit: [{op: feature, dictionary: sae1,
                                                                              feature: 12, add: 4.0}]}
    cap.top(feature=12, hook="feats")                            # its top contexts
    cap.read("dictionaries", "features", hook="feats", features=[12])   # dense [tokens, 1]
    cap.read("dictionaries")                                     # the evaluations: l0, mse, ..., ce_loss_recovered
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from hookrun.capture import tokens as tok
from hookrun.capture.checks import any_layer, dictionary_problems, trained_layer_problems
from hookrun.capture.hooks import HookError, Piece, replacing
from hookrun.capture.scope import HookScope
from hookrun.capture.site import Site
from hookrun.config.registry import methods
from hookrun.config.checks import ConfigError, check_choice, check_target, is_int, suggest, unknown_keys
from hookrun.methods import Method
from hookrun.methods.metrics import logits_of, unhooked
from hookrun.methods.paired import decoder_direction, dims, linear_decoder
from hookrun.read.results.dictionaries import read as read_dictionaries

ARCHITECTURES = ("standard", "topk", "jumprelu")
CFG_FILE = "cfg.json"                      # SAELens's SAE_CFG_FILENAME
WEIGHTS_FILE = "sae_weights.safetensors"   # SAELens's SAE_WEIGHTS_FILENAME
SAELENS_FORMAT = "6.54.0"   # written as metadata.sae_lens_version: SAELens reads older (< 6.0) configs another way
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SAELENS_FIX = "save it with hookrun.methods.dictionaries.save_saelens or SAELens's sae.save_model(path)"


class DictionaryError(ValueError):
    """A dictionary that cannot be loaded or used: the message names the path (or key), what is wrong and the fix."""


class SparseAutoencoder(nn.Module):
    """A sparse autoencoder with SAELens's weights and maths (architectures standard, topk, jumprelu).

        sae = SparseAutoencoder(d_in=64, d_sae=256, architecture="topk", k=8)
        x_hat = sae(x)                     # decode(encode(x))

    Parameters W_enc [d_in, d_sae], W_dec [d_sae, d_in], b_enc [d_sae], b_dec [d_in] and, for jumprelu,
    threshold [d_sae]; all zero except W_dec (kaiming uniform, as SAELens) and W_enc = W_dec.T."""

    def __init__(self, d_in: int, d_sae: int, architecture: str = "standard", k: Optional[int] = None,
                 apply_b_dec_to_input: bool = True, rescale_acts_by_decoder_norm: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, hook_name: Optional[str] = None):
        super().__init__()
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in (d_in, d_sae)):
            raise DictionaryError(f"d_in and d_sae must be positive ints; got d_in={d_in!r}, d_sae={d_sae!r}")
        if architecture not in ARCHITECTURES:
            raise DictionaryError(f"architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
        if architecture == "topk" and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= d_sae):
            raise DictionaryError(f"architecture topk needs k, an int in 1..d_sae ({d_sae}); got k={k!r}")
        if rescale_acts_by_decoder_norm and architecture != "topk":
            raise DictionaryError("rescale_acts_by_decoder_norm is a topk setting (SAELens's TopKSAEConfig); "
                                  f"architecture is {architecture!r}")
        self.d_in, self.d_sae, self.architecture = int(d_in), int(d_sae), architecture
        self.k = int(k) if architecture == "topk" else None
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)
        self.hook_name = hook_name
        kw = {"dtype": dtype, "device": device}
        w_dec = torch.empty(self.d_sae, self.d_in, **kw)
        nn.init.kaiming_uniform_(w_dec)
        self.W_dec = nn.Parameter(w_dec)
        self.W_enc = nn.Parameter(w_dec.T.clone().contiguous())
        self.b_enc = nn.Parameter(torch.zeros(self.d_sae, **kw))
        self.b_dec = nn.Parameter(torch.zeros(self.d_in, **kw))
        if architecture == "jumprelu":
            self.threshold = nn.Parameter(torch.zeros(self.d_sae, **kw))

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's pre-activations [..., d_sae] (SAELens's hook_sae_acts_pre; topk: before any rescale)."""
        sae_in = x.to(self.dtype)
        if self.apply_b_dec_to_input:
            sae_in = sae_in - self.b_dec
        return sae_in @ self.W_enc + self.b_enc

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """The features [..., d_sae] from pre-activations: the architecture's activation."""
        if self.architecture == "standard":
            return torch.relu(pre)
        if self.architecture == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        if self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        values, indices = torch.topk(pre, k=self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter(-1, indices, values.relu())

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Features [..., d_sae] of activations x [..., d_in] (in the SAE's dtype)."""
        return self.activate(self.pre_activations(x))

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """The reconstruction [..., d_in] of features [..., d_sae]."""
        if self.rescale_acts_by_decoder_norm:
            features = features * (1 / self.W_dec.norm(dim=-1))
        return features @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reconstruction decode(encode(x))."""
        return self.decode(self.encode(x))

    def extra_repr(self) -> str:
        k = f", k={self.k}" if self.k is not None else ""
        return f"d_in={self.d_in}, d_sae={self.d_sae}, architecture={self.architecture}{k}"


def _fail(path, what: str, fix: str):
    raise DictionaryError(f"dictionary {path}: {what}; {fix}")


def _cfg_value(cfg: dict, key: str, kind, path, default=None, required=False):
    """cfg[key] checked against `kind` (a type or a tuple of allowed values)."""
    if key not in cfg:
        if required:
            _fail(path / CFG_FILE, f"has no key {key!r}", f"add it (SAELens 6 writes it), or {SAELENS_FIX}")
        return default
    value = cfg[key]
    if isinstance(kind, tuple):
        ok = value in kind
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    else:
        ok = isinstance(value, kind)
    if not ok:
        want = (f"one of {', '.join(map(repr, kind))}" if isinstance(kind, tuple)
                else "a positive int" if kind is int else f"a {kind.__name__}")
        _fail(path / CFG_FILE, f"{key}={value!r} is not {want}", f"set {key} to {want}")
    return value


def _read_cfg(path: Path) -> dict:
    if not path.exists():
        _fail(path, "does not exist", f"give the folder holding {CFG_FILE} and {WEIGHTS_FILE}")
    if not path.is_dir():
        _fail(path, f"is not a folder (a SAELens SAE is a folder of {CFG_FILE} and {WEIGHTS_FILE})",
              "give the folder, not a file in it")
    for name in (CFG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            _fail(path, f"has no {name} (a SAELens SAE folder holds {CFG_FILE} and {WEIGHTS_FILE})", SAELENS_FIX)
    try:
        cfg = json.loads((path / CFG_FILE).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        _fail(path / CFG_FILE, f"is not JSON ({e})", SAELENS_FIX)
    if not isinstance(cfg, dict):
        _fail(path / CFG_FILE, f"holds a {type(cfg).__name__}, not a JSON object", SAELENS_FIX)
    return cfg


def _hook_name(cfg: dict) -> Optional[str]:
    """metadata.hook_name (SAELens 6); hook_name or hook_point at the top (older configs)."""
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    return meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")


def load_saelens(path: Union[str, Path], device=None, dtype: Union[str, torch.dtype, None] = None
                 ) -> SparseAutoencoder:
    """A SparseAutoencoder from a SAELens-format folder (cfg.json + sae_weights.safetensors), in eval mode, as
    SAELens's SAE.load_from_disk(path) reads it; DictionaryError (naming the path, the problem, the fix) else.

        sae = load_saelens("runs/sae")                 # dtype: cfg.json's, or `dtype` ("float32", torch.float64)
    """
    path = Path(path).expanduser()
    cfg = _read_cfg(path)
    arch = _cfg_value(cfg, "architecture", ARCHITECTURES, path, default="standard")
    d_in = _cfg_value(cfg, "d_in", int, path, required=True)
    d_sae = _cfg_value(cfg, "d_sae", int, path, required=True)
    norm = _cfg_value(cfg, "normalize_activations", str, path, default="none")
    if norm != "none":
        _fail(path / CFG_FILE, f"normalize_activations={norm!r}: only 'none' is supported (the others keep state "
              "between encode and decode, or need SAELens's registry scaling factor)",
              "fold the normalisation into the weights in SAELens (sae.fold_activation_norm_scaling_factor(s) or "
              "sae.fold_activation_whitening(...)), then sae.save_model(path)")
    reshape = _cfg_value(cfg, "reshape_activations", str, path, default="none")
    if reshape != "none":
        _fail(path / CFG_FILE, f"reshape_activations={reshape!r} is not supported",
              "give the dictionary activations flattened to [..., d_in] and set reshape_activations to 'none'")
    k = _cfg_value(cfg, "k", int, path, required=arch == "topk") if arch == "topk" else None
    name = dtype if dtype is not None else _cfg_value(cfg, "dtype", str, path, default="float32")
    torch_dtype = name if isinstance(name, torch.dtype) else DTYPES.get(str(name).removeprefix("torch."))
    if torch_dtype is None:
        _fail(path / CFG_FILE, f"dtype={name!r} is not one of {', '.join(DTYPES)}", "set dtype to one of them")
    try:
        sae = SparseAutoencoder(d_in, d_sae, arch, k=k,
                                apply_b_dec_to_input=_cfg_value(cfg, "apply_b_dec_to_input", bool, path, True),
                                rescale_acts_by_decoder_norm=_cfg_value(cfg, "rescale_acts_by_decoder_norm", bool,
                                                                        path, False),
                                dtype=torch_dtype, device="meta", hook_name=_hook_name(cfg))
    except DictionaryError as e:
        _fail(path / CFG_FILE, str(e), "correct cfg.json")
    sae.load_state_dict(_read_weights(path, sae, device), assign=True)
    return sae.eval()


def _safetensors():
    """safetensors (SAELens's weights format; it comes with transformers), or an ImportError saying what to install."""
    try:
        import safetensors.torch
    except ImportError as e:
        raise ImportError("SAELens folders are read and written with safetensors: pip install safetensors "
                          "(or hookrun[lm], whose transformers brings it)") from e
    return safetensors


def _read_weights(path: Path, sae: SparseAutoencoder, device) -> Dict[str, torch.Tensor]:
    """The weights file's tensors in the SAE's dtype, checked against its parameters' names and shapes."""
    st = _safetensors()

    file = path / WEIGHTS_FILE
    try:
        state = st.torch.load_file(file, device=str(device or "cpu"))
    except (st.SafetensorError, OSError, ValueError) as e:
        _fail(file, f"is not a readable safetensors file ({e})", SAELENS_FIX)
    if "log_threshold" in state and sae.architecture == "jumprelu":   # SAELens: older jumprelu checkpoints
        state["threshold"] = torch.exp(state.pop("log_threshold"))
    scale = state.pop("scaling_factor", None)
    if scale is not None and not torch.all(scale == 1):
        _fail(file, "holds a scaling_factor that is not all ones (a SAELens finetuning scale)",
              "fold it into W_dec and b_dec in SAELens, then sae.save_model(path)")
    want = {name: tuple(p.shape) for name, p in sae.named_parameters()}
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        _fail(file, f"tensors {'missing ' + ', '.join(missing) if missing else ''}"
              f"{'; ' if missing and extra else ''}{'unexpected ' + ', '.join(extra) if extra else ''} "
              f"for architecture {sae.architecture!r} (it needs {', '.join(want)})",
              "check cfg.json's architecture, or save the SAE again")
    wrong = [f"{n} {tuple(state[n].shape)} (want {want[n]})" for n in want if tuple(state[n].shape) != want[n]]
    if wrong:
        _fail(file, f"shapes do not match cfg.json's d_in={sae.d_in}, d_sae={sae.d_sae}: {', '.join(wrong)}",
              "correct d_in / d_sae in cfg.json, or save the SAE again")
    bad = [(n, t) for n, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        name, t = bad[0]
        first = tuple(int(i) for i in torch.nonzero(~torch.isfinite(t))[0])
        _fail(file, f"tensor {name} holds {int((~torch.isfinite(t)).sum())} NaN or inf value(s) (the first at "
              f"{list(first)}: {float(t[first])}){' and so does ' + ', '.join(n for n, _ in bad[1:]) if bad[1:] else ''}"
              ": every feature, error norm and evaluation would be NaN", "retrain the SAE, or save it again from a "
              "checkpoint with finite weights")
    return {n: t.to(sae.dtype) for n, t in state.items()}


def saelens_config(sae: SparseAutoencoder, hook_name: Optional[str] = None,
                   metadata: Optional[Mapping[str, Any]] = None) -> dict:
    """The cfg.json SAELens 6.54 writes for `sae` (keys in its order; hook_name: metadata.hook_name)."""
    meta = {"sae_lens_version": SAELENS_FORMAT, "sae_lens_training_version": SAELENS_FORMAT}
    hook = hook_name if hook_name is not None else sae.hook_name
    if hook is not None:
        meta["hook_name"] = hook
    meta.update(metadata or {})
    cfg = {"d_in": sae.d_in, "d_sae": sae.d_sae, "dtype": DTYPE_NAMES[sae.dtype], "device": "cpu",
           "apply_b_dec_to_input": sae.apply_b_dec_to_input, "normalize_activations": "none",
           "reshape_activations": "none", "metadata": meta}
    if sae.architecture == "topk":
        cfg.update(k=sae.k, rescale_acts_by_decoder_norm=sae.rescale_acts_by_decoder_norm)
    cfg["architecture"] = sae.architecture
    return cfg


def save_saelens(sae: SparseAutoencoder, path: Union[str, Path], hook_name: Optional[str] = None,
                 metadata: Optional[Mapping[str, Any]] = None) -> Path:
    """Write `sae` as a SAELens 6.54 folder (cfg.json, sae_weights.safetensors) that SAE.load_from_disk and
    load_saelens read; the folder. `metadata`: more keys for cfg.json's metadata (model_name, ...).

        save_saelens(sae, "runs/sae", hook_name="transformer.h.1")
    """
    save_file = _safetensors().torch.save_file
    if sae.dtype not in DTYPE_NAMES:
        raise DictionaryError(f"save_saelens: dtype {sae.dtype} is not one SAELens reads ({', '.join(DTYPES)})")
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().to("cpu").contiguous() for n, p in sae.named_parameters()}
    save_file(state, str(path / WEIGHTS_FILE))
    (path / CFG_FILE).write_text(json.dumps(saelens_config(sae, hook_name, metadata)), encoding="utf-8")
    return path


def load_dictionary(spec: Union[Mapping, str, Path], device=None) -> nn.Module:
    """The dictionary a spec names: `{path: DIR}` (a SAELens folder, optional `dtype`), or `{_target_: ...,
    **kwargs}` (`path` among them is the target's argument; any module with callable encode(x) and decode(f),
    built by Hydra's instantiate); a str or
    Path is a folder. DictionaryError when it cannot be built or lacks encode/decode.

        sae = load_dictionary({"path": "runs/sae"})
        sae = load_dictionary({"_target_": "mypkg.Transcoder", "width": 4096})
    """
    if isinstance(spec, (str, Path)):
        spec = {"path": spec}
    if not isinstance(spec, Mapping) or not ("_target_" in spec or "path" in spec):
        raise DictionaryError(f"dictionary: {spec!r} names neither a path nor a _target_; give "
                              "{path: DIR} (a SAELens folder) or {_target_: pkg.Class, **kwargs}")
    if "_target_" not in spec:
        extra = sorted(set(spec) - set(FOLDER_KEYS))
        if extra:
            raise DictionaryError(f"dictionary {spec['path']}: unknown key(s) {', '.join(extra)} beside path; "
                                  "a folder takes only `dtype` and `any_layer`")
        module = load_saelens(spec["path"], device=device, dtype=spec.get("dtype"))
        where = spec["path"]
    else:
        from hydra.utils import instantiate

        where = spec["_target_"]
        try:
            module = instantiate({k: v for k, v in spec.items() if k != "any_layer"})
        except Exception as e:  # noqa: BLE001 - any failure of the user's constructor is reported with its target
            raise DictionaryError(f"dictionary {where}: building it failed ({type(e).__name__}: {e}); check the "
                                  "dotted path, its package and its arguments") from e
        if device is not None and isinstance(module, nn.Module):
            module = module.to(device)
    for name in ("encode", "decode"):
        if not callable(getattr(module, name, None)):
            raise DictionaryError(f"dictionary {where}: a {type(module).__name__} has no callable {name}(); a "
                                  "dictionary is a module with encode(x) -> features and decode(features) -> x")
    return module.eval() if isinstance(module, nn.Module) else module


def fires_only_positive(module) -> bool:
    """Whether a dictionary's features are never below 0, so their top k by magnitude is their top k by value
    (sparse_topk's `nonnegative`): hookrun's SparseAutoencoder (ReLU, JumpReLU and TopK all end in a ReLU; every
    SAELens folder it reads); never assumed of a user's own module.

        sparse_topk(f, 16, nonnegative=fires_only_positive(sae))
    """
    return type(module) is SparseAutoencoder


def sparse_topk(features: torch.Tensor, k: int, nonnegative: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest-magnitude nonzero features of each row of `features` [n, d_sae]: (indices int32 [n, k],
    values float32 [n, k]), largest first; where a row has fewer than k nonzero, index -1 and value 0 fill it.
    `nonnegative`: the features are never below 0 (a ReLU, JumpReLU or TopK SAE), so their magnitude is their value.

        idx, val = sparse_topk(sae.encode(x), k=32)
    """
    if features.ndim != 2:
        raise ValueError(f"sparse_topk: features must be [n, d_sae]; got shape {tuple(features.shape)}")
    if k < 1:
        raise ValueError(f"sparse_topk: k must be >= 1; got {k}")
    n, d = features.shape
    take = min(k, d)
    if nonnegative:
        values, idx = torch.topk(features.detach(), take, dim=-1, sorted=True)
        mag = values = values.float()
    else:
        mag, idx = torch.topk(features.detach().abs(), take, dim=-1, sorted=True)
        values = torch.gather(features.detach(), -1, idx).float().masked_fill(mag == 0, 0.0)
    idx = idx.to(torch.int32).masked_fill(mag == 0, -1)
    if take < k:
        idx = torch.cat([idx, idx.new_full((n, k - take), -1)], dim=1)
        values = torch.cat([values, values.new_zeros(n, k - take)], dim=1)
    return idx, values


def sparse_nonzero(features: torch.Tensor, width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every nonzero feature of each row: sparse_topk with k = the most nonzero in a row (at least 1), or
    `width` (a fixed width; ValueError when a row has more nonzero features than that, none dropped)."""
    most = int((features != 0).sum(dim=-1).max()) if features.numel() else 0
    if width is not None and most > width:
        raise ValueError(f"sparse_nonzero: a row has {most} nonzero features, more than width {width}; "
                         "raise the width or keep the top k (sparse_topk)")
    return sparse_topk(features, width if width is not None else max(most, 1))


def densify(indices: torch.Tensor, values: torch.Tensor, d_sae: int,
            features: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Dense features [n, d_sae] from sparse (indices, values) [n, k] (index -1: nothing); with `features`, only
    those columns [n, len(features)], in that order.

        acts = densify(idx, val, sae.d_sae, features=[17, 3])   # feature 17's and 3's activation per row
    """
    idx = torch.as_tensor(indices).long()
    val = torch.as_tensor(values)
    if idx.shape != val.shape or idx.ndim != 2:
        raise ValueError(f"densify: indices {tuple(idx.shape)} and values {tuple(val.shape)} must be one [n, k]")
    bad = (idx < -1) | (idx >= d_sae)
    if bad.any():
        raise ValueError(f"densify: index {int(idx[bad][0])} is out of range for d_sae={d_sae}")
    real = idx >= 0
    dense = val.new_zeros(idx.shape[0], d_sae + 1)   # column d_sae takes the fills, then is dropped
    dense.scatter_add_(1, torch.where(real, idx, d_sae), torch.where(real, val, torch.zeros_like(val)))
    dense = dense[:, :d_sae]
    if features is None:
        return dense
    cols = torch.as_tensor(list(features), dtype=torch.long)
    if cols.numel() and (cols.min() < 0 or cols.max() >= d_sae):
        raise ValueError(f"densify: features {list(features)} must be in 0..{d_sae - 1}")
    return dense[:, cols]


class Evaluation:
    """SAELens's evaluation numbers (sae_lens/evals.py), accumulated over batches of tokens.

        ev = Evaluation(d_sae=256)
        for x in batches: ev.add(x, sae(x), sae.encode(x))      # x, reconstruction [n, d_in]; features [n, d_sae]
        ev.result()   # {"tokens", "l0", "l1", "mse", "explained_variance", "cossim", "dead_features", ...}

    Per token (rows of x), then the mean over all tokens: l0 (nonzero features), l1 (sum of |features|), mse
    (sum over d_in of (x - x_hat)^2, SAELens's convention), cossim(x, x_hat). explained_variance: 1 - mse / Var(x),
    Var(x) = E|x|^2 - |E x|^2 over all tokens (SAELens's ExplainedVarianceCalculator, sums in float64).
    feature_density: the fraction of tokens on which each feature fired; dead_features: how many never did."""

    def __init__(self, d_sae: int):
        self.d_sae = int(d_sae)
        self.tokens = 0
        self.sums = {"l0": 0.0, "l1": 0.0, "mse": 0.0, "cossim": 0.0}
        self.sum_x: Optional[torch.Tensor] = None
        self.sum_sq = 0.0
        self.fired = torch.zeros(self.d_sae, dtype=torch.float64)

    def add(self, x: torch.Tensor, reconstruction: torch.Tensor,
            features: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One batch: activations x and reconstructions [n, d_in] (leading dims flattened), and the features,
        dense [n, d_sae] or sparse (indices, values) [n, k] (index -1: none)."""
        x = x.detach().reshape(-1, x.shape[-1]).double()
        x_hat = reconstruction.detach().reshape(-1, reconstruction.shape[-1]).double()
        if x.shape != x_hat.shape:
            raise ValueError(f"Evaluation.add: x {tuple(x.shape)} and reconstruction {tuple(x_hat.shape)} differ")
        if isinstance(features, (tuple, list)):
            idx, val = (torch.as_tensor(t).detach() for t in features)
            active = (idx >= 0) & (val != 0)
            l0, l1 = active.sum(-1).double(), (val.double().abs() * active).sum(-1)
            hits = idx[active].long()
        else:
            f = features.detach().reshape(-1, features.shape[-1])
            active = f != 0
            l0, l1 = active.sum(-1).double(), f.double().abs().sum(-1)
            hits = active.nonzero()[:, 1]
        if len(l0) != len(x):
            raise ValueError(f"Evaluation.add: {len(l0)} rows of features for {len(x)} rows of x")
        resid = (x - x_hat).pow(2).sum(-1)
        cos = torch.nn.functional.cosine_similarity(x, x_hat, dim=-1, eps=0.0)
        for key, per_token in (("l0", l0), ("l1", l1), ("mse", resid), ("cossim", cos)):
            self.sums[key] += float(per_token.sum())
        batch_sum = x.sum(0).cpu()
        self.sum_x = batch_sum if self.sum_x is None else self.sum_x + batch_sum
        self.sum_sq += float(x.pow(2).sum())
        self.fired += torch.bincount(hits.cpu(), minlength=self.d_sae)[:self.d_sae].double()
        self.tokens += len(x)

    def result(self) -> Dict[str, Any]:
        """The numbers over every token added (NaN before any): tokens, l0, l1, mse, explained_variance, cossim,
        dead_features (int), feature_density (a float64 tensor [d_sae])."""
        n = self.tokens
        out: Dict[str, Any] = {"tokens": n}
        out.update({k: v / n if n else math.nan for k, v in self.sums.items()})
        if n:
            variance = self.sum_sq / n - float((self.sum_x / n).pow(2).sum())
            mse = out["mse"]
            out["explained_variance"] = (1.0 if mse < 1e-10 else 0.0) if variance < 1e-10 else 1.0 - mse / variance
        else:
            out["explained_variance"] = math.nan
        out["feature_density"] = self.fired / n if n else torch.full((self.d_sae,), math.nan, dtype=torch.float64)
        out["dead_features"] = int((self.fired == 0).sum())
        return out


def evaluate(x: torch.Tensor, reconstruction: torch.Tensor, features, d_sae: Optional[int] = None) -> Dict[str, Any]:
    """Evaluation's numbers for one batch (d_sae: features' last dim when dense)."""
    ev = Evaluation(d_sae if d_sae is not None else features.shape[-1])
    ev.add(x, reconstruction, features)
    return ev.result()


# -- in a run: the `dictionaries:` block, `dictionary:` on a hook, `op: feature` edits, and the readers ------------

DEFAULT_WIDTH = 64   # features stored a token when top_k is null and the dictionary is no TopK SAE
SPLICES = ("replace", "replace_with_error")


def spec_problems(name, spec) -> List[str]:
    """Problems with one entry of the `dictionaries:` block found without loading it: a folder that does not exist
    or is not a SAELens folder (its cfg.json read), a `_target_` that does not import or take its arguments."""
    key = f"dictionaries.{name}"
    if isinstance(spec, str):
        spec = {"path": spec}
    if not isinstance(spec, dict) or not ("_target_" in spec or "path" in spec):
        return [f"{key}: {spec!r} names neither a path nor a _target_; give {{path: DIR}} (a SAELens folder) or "
                "{_target_: pkg.Class, **kwargs} (a module with encode and decode; a `path` beside it is its "
                "argument)"]
    problems = [] if spec.get("any_layer") in (None, True, False) else [
        f"{key}.any_layer: {spec['any_layer']!r} must be true (read layers other than the one cfg.json says it was "
        "trained on) or false"]
    if spec.get("dtype") is not None and spec["dtype"] not in DTYPES:
        problems.append(f"{key}.dtype: {spec['dtype']!r} is not one of {', '.join(DTYPES)}")
    if "_target_" in spec:
        problems += check_target(key, {k: v for k, v in spec.items() if k != "any_layer"},
                                 "give an importable class or function returning a module with encode(x) and decode(f)")
        folder = Path(str(spec.get("path"))).expanduser()
        if spec.get("path") is not None and (folder / CFG_FILE).is_file():  # a loader of a SAELens folder
            problems += folder_problems(key, spec["path"], spec.get("dtype"))
        return problems
    problems += unknown_keys(key, sorted(spec), FOLDER_KEYS, "a folder takes")
    return problems + folder_problems(key, spec["path"], spec.get("dtype") if spec.get("dtype") in DTYPES else None)


FOLDER_KEYS = ("path", "dtype", "any_layer")


def folder_problems(key: str, path, dtype=None) -> List[str]:
    """A SAELens folder read as a run would read it, on the CPU, before the model is built: missing or damaged
    files, shapes against cfg.json, NaN or inf weights (naming the tensor)."""
    try:
        load_saelens(path, device="cpu", dtype=dtype)
    except DictionaryError as err:
        return [f"{key}.path: {err}"]
    return []


def hook_problems(cfg, names) -> List[str]:
    """Problems with the hooks that use a dictionary (`dictionary`, `top_k`, `splice`, `evaluate`, `op: feature`
    edits), against the block's `names`."""
    problems = []
    for hook_name, hook in (cfg.hooks or {}).items():
        key = f"hooks.{hook_name}"
        for i, spec in enumerate(hook.edit or []):
            if isinstance(spec, dict) and spec.get("op") == "feature" and isinstance(spec.get("dictionary"), str) \
                    and spec["dictionary"] not in names:
                problems += dictionary_problems(f"{key}.edit[{i}].dictionary", spec["dictionary"], names)
        if hook.dictionary is None:
            problems += [f"{key}.{k}: set without {key}.dictionary; name a dictionary, or drop it"
                         for k in ("top_k", "splice") if getattr(hook, k) is not None]
            problems += [f"{key}.evaluate: set without {key}.dictionary; name a dictionary, or drop it"] * \
                bool(hook.evaluate)
            continue
        problems += dictionary_problems(f"{key}.dictionary", hook.dictionary, names)
        if hook.kind != "forward":
            problems.append(f"{key}.kind: {hook.kind} with a dictionary; a dictionary reads a layer's output: use "
                            "kind: forward")
        if hook.capture == []:
            problems.append(f"{key}.capture: [] with a dictionary stores no features; leave capture unset (the "
                            "output), or name the role the dictionary reads (capture: [output.0])")
        for setting_ in ("reduce", "dtype"):
            if getattr(hook, setting_) is not None:
                problems.append(f"{key}.{setting_}: a dictionary hook stores features (int32 indices, float32 "
                                f"values), not the activation; drop {setting_}")
        select = hook.select
        if select is not None and not (isinstance(select, dict) and set(select) <= {"positions"}):
            problems.append(f"{key}.select: {select!r}; a dictionary hook takes select: {{positions: ...}} only")
        if hook.top_k is not None and not (is_int(hook.top_k) and hook.top_k >= 1):
            problems.append(f"{key}.top_k: {hook.top_k!r} must be a positive int (features kept a token), or null")
        if hook.splice is not None:
            problems += check_choice(f"{key}.splice", hook.splice, SPLICES)
        if hook.evaluate and cfg.data.text is None:
            problems.append(f"{key}.evaluate: CE loss recovered is the next-token loss of a text run; give data.text, "
                            "or drop evaluate")
    return problems


class DictionaryUse:
    """`hooks.<name>.dictionary` in a run, bound to the hook's plan (HookPlan.dictionary): on the first role the
    hook's capture names (per layer), it stores the features sparse (`features.indices` int32 and `features.values`
    float32 [rows, width], index -1 where fewer fired), the reconstruction error's L2 norm (`error_norm`) and, with
    `evaluate`, a row a batch of SAELens's sums (`eval.sums`); then returns what flows on (the splice)."""

    def __init__(self, hook: str, name: str, module, top_k: Optional[int], splice: Optional[str], evaluate: bool):
        self.hook, self.name, self.module = hook, name, module
        self.d_in, self.d_sae = dims(module)
        self.top_k, self.splice, self.evaluate = top_k, splice, bool(evaluate)
        self.roles: Dict[str, str] = {}   # layer -> the role it reads

    @property
    def width(self) -> Optional[int]:
        """Features stored a token: top_k, else a TopK SAE's k, else min(d_sae, DEFAULT_WIDTH)."""
        if self.top_k is not None:
            return self.top_k
        k = getattr(self.module, "k", None)
        if is_int(k) and getattr(self.module, "architecture", "topk") == "topk":
            return k
        return min(self.d_sae, DEFAULT_WIDTH) if self.d_sae is not None else None

    def reads(self, layer: str, role: str) -> bool:
        """Whether the dictionary reads `role` of `layer`: the first role the hook's capture names there."""
        return self.roles.setdefault(layer, role) == role

    def reconstruct(self, t: torch.Tensor) -> torch.Tensor:
        """decode(encode(t)) in t's dtype (the splice of `replace`)."""
        return self.module.decode(self.module.encode(t)).to(t.dtype)

    def __call__(self, hookset, plan, layer: str, role: str, call: int, t: torch.Tensor, info) -> torch.Tensor:
        key = f"hooks.{plan.name}.dictionary"
        if not t.is_floating_point() or (self.d_in is not None and (not t.dim() or t.shape[-1] != self.d_in)):
            raise HookError(f"{key}: dictionary {self.name} reads {self.d_in}-wide activations, but {layer} {role} is "
                            f"{list(t.shape)} {str(t.dtype).replace('torch.', '')} (last axis "
                            f"{t.shape[-1] if t.dim() else 'none'}); hook the layer the dictionary was trained on "
                            "(its cfg.json's metadata.hook_name), or name its role (capture: [output.0])", key)
        rows = self._stored_rows(plan, t, info)
        if rows is not None:  # only the stored tokens encoded (no pads); the other rows filled, never stored
            return self._encode_rows(hookset, plan, layer, call, t, info, rows)
        grad = self.splice is not None and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            f = self.module.encode(t if grad else t.detach())
            x_hat = self.module.decode(f)
        fd, xh, x = f.detach(), x_hat.detach(), t.detach()
        if self.d_sae is None:
            self.d_sae = int(fd.shape[-1])
        idx, val = self._sparse(fd.reshape(-1, fd.shape[-1]), plan, layer)
        lead = fd.shape[:-1]
        hookset._emit(plan, layer, "features.indices", call, idx.reshape(*lead, -1), info)
        hookset._emit(plan, layer, "features.values", call, val.reshape(*lead, -1), info)
        error = x.to(xh.dtype) - xh
        hookset._emit(plan, layer, "error_norm", call, error.norm(dim=-1).float(), info)
        if self.evaluate:
            self._sums(hookset, plan, layer, call, info, *(self._rows(a, info) for a in (x.to(xh.dtype), xh, fd)))
        if self.splice == "replace":
            return x_hat.to(t.dtype)
        if self.splice == "replace_with_error":   # SAELens's use_error_term: the error added back, no gradient
            return (x_hat + (t.to(x_hat.dtype) - x_hat).detach()).to(t.dtype)
        return t

    def sparse(self, f: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) [rows, k] of features f [rows, d_sae] as the hook stores them: the top_k largest, or every
        nonzero one up to the width (ValueError where a row has more); hookrun.features keeps the same.

            idx, val = use.sparse(sae.encode(x))"""
        if self.top_k is not None:
            return sparse_topk(f, self.top_k, nonnegative=fires_only_positive(self.module))
        return sparse_nonzero(f, self.width)

    def _sparse(self, f: torch.Tensor, plan, layer: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """`sparse` in a hook: HookError naming top_k where a row has more nonzero features than the width."""
        try:
            return self.sparse(f)
        except ValueError:
            most = int((f != 0).sum(-1).max())
            raise HookError(f"hooks.{plan.name}.top_k: null stores every nonzero feature, up to {self.width} a "
                            f"token, but a token of {layer} has {most} nonzero features of dictionary {self.name}; "
                            f"set hooks.{plan.name}.top_k: K to keep the K largest", f"hooks.{plan.name}.top_k") from None

    def _stored_rows(self, plan, t: torch.Tensor, info) -> Optional[torch.Tensor]:
        """The flat [B * T] indices of the tokens the store keeps of a [B, T, d] text capture with pads (or excluded
        tokens), where nothing flows on (no splice) and the hook stores every kept token as it is (no select,
        reduce or dtype); else None: every row is encoded."""
        tokens = getattr(info, "tokens", None)
        shrink = plan.shrink
        if (self.splice is not None or tokens is None or tokens.all_kept or t.dim() != 3 or not tok.is_tokens(t, tokens)
                or shrink.positions is not None or shrink.heads is not None or shrink.select or shrink.reduce
                or shrink.dtype is not None):
            return None
        return tokens.kept_rows.to(t.device)

    def _encode_rows(self, hookset, plan, layer: str, call: int, t: torch.Tensor, info, rows: torch.Tensor):
        """The features, error norm (and evaluation sums) of the stored rows of t only, handed to the store as they
        are: a row per stored token (pads are never encoded)."""
        b, n, d = t.shape
        x = t.detach().reshape(b * n, d).index_select(0, rows)
        with torch.no_grad():
            f = self.module.encode(x)
            x_hat = self.module.decode(f)
        if self.d_sae is None:
            self.d_sae = int(f.shape[-1])
        idx, val = self._sparse(f, plan, layer)
        x = x.to(x_hat.dtype)
        norm = (x - x_hat).norm(dim=-1).float()
        for role, part in (("features.indices", idx), ("features.values", val), ("error_norm", norm)):
            hookset.emit_token_rows(plan, layer, role, call, part, info)
        if self.evaluate:
            self._sums(hookset, plan, layer, call, info, x, x_hat, f)
        return t

    @staticmethod
    def _rows(a: torch.Tensor, info) -> torch.Tensor:
        """[stored tokens (or samples), last axis] of a [B, T, ...] capture."""
        tokens = getattr(info, "tokens", None)
        if tokens is not None and tok.is_tokens(a, tokens):
            return tok.per_token(a, tokens)[0].reshape(-1, a.shape[-1])
        return a.reshape(-1, a.shape[-1])

    def _sums(self, hookset, plan, layer, call, info, x, x_hat, f) -> None:
        """One batch's SUMS (hookrun.read.results.dictionaries), x summed, and each feature's firing count, as a row of
        `<hook>/<layer>/eval.sums`:
        x, x_hat [stored tokens, d_in] and f [stored tokens, d_sae] (counted and summed as it is, no float64 copy)."""
        x, x_hat = x.double(), x_hat.double()
        active = f != 0
        cos = torch.nn.functional.cosine_similarity(x, x_hat, dim=-1, eps=0.0)
        head = torch.stack([torch.tensor(float(len(x)), dtype=torch.float64, device=x.device), active.sum(),
                            f.abs().sum(dtype=torch.float64), (x - x_hat).pow(2).sum(), x.pow(2).sum(),
                            cos.sum()]).to(torch.float64)
        row = torch.cat([head, x.sum(0), active.sum(0).double()])
        site = Site(plan.name, layer, "eval.sums", call, info.index, info.start, info.stop)
        hookset.sink(Piece(site, plan.kind, row, False, "batch"))


class FeatureEdit:
    """An `op: feature` edit bound to its dictionary: `edit(t)` sets, scales or clamps feature `feature` of t's
    encoding and adds the change through the decoder (the reconstruction error kept), or adds `add` times the
    feature's decoder direction. A SAELens SAE (W_dec, no decoder-norm rescale) uses W_dec's row, exactly."""

    def __init__(self, module, name: str, feature: int, op: str, arg):
        self.module, self.name, self.feature, self.op, self.arg = module, name, int(feature), op, arg
        self.d_in, self.d_sae = dims(module)
        self.linear = linear_decoder(module)

    def direction(self) -> torch.Tensor:
        """The feature's decoder direction [d_in]: W_dec's row, or decode(one-hot) - decode(0)."""
        return decoder_direction(self.module, self.feature)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.d_in is not None and (not t.dim() or t.shape[-1] != self.d_in):
            raise ValueError(f"dictionary {self.name} reads {self.d_in}-wide activations, this tensor is "
                             f"{list(t.shape)}; edit the layer the dictionary was trained on (or name its role: "
                             "roles: [output.0])")
        if self.op == "add":
            return t + (self.arg * self.direction()).to(t.dtype)
        with torch.no_grad():
            f = self.module.encode(t.detach())
        old = f[..., self.feature]
        if self.op == "set":
            new = torch.full_like(old, float(self.arg))
        elif self.op == "scale":
            new = old * self.arg
        else:
            new = old.clamp(min=self.arg[0], max=self.arg[1])
        if self.linear:
            return t + ((new - old)[..., None] * self.direction()).to(t.dtype)
        g = f.clone()
        g[..., self.feature] = new
        return t + (self.module.decode(g) - self.module.decode(f)).to(t.dtype)


def nll(out, ids: torch.Tensor, info) -> Tuple[int, float]:
    """(predicted tokens, summed next-token loss) of a text batch's output over its real token pairs."""
    logits = logits_of(out)
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None].to(logits.device)).squeeze(-1)
    pairs = info.mask[:, :-1] & info.mask[:, 1:]
    return int(pairs.sum()), float(torch.where(pairs, nll, torch.zeros_like(nll)).double().sum())


class Dictionaries(Method):
    """The `dictionaries:` block (name -> `{path: DIR}` or `{_target_: ...}`), loaded once a run; hooks read a layer
    through one (`dictionary: NAME`), and `op: feature` edits change its features (docs/dictionaries.md)."""

    key = "dictionaries"
    annotation = Dict[str, Any]
    factory = dict
    help = ("name → `{path: DIR}` (a SAELens folder) or `{_target_: ..., **kwargs}` (a module with encode/decode): "
            "the dictionaries that hooks' `dictionary:` and `op: feature` edits name (docs/dictionaries.md)")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.loaded: Dict[str, Any] = {}
        self.uses: Dict[str, Tuple[Any, DictionaryUse]] = {}   # hook -> (its plan, its use)

    @classmethod
    def check(cls, cfg) -> List[str]:
        block = getattr(cfg, "dictionaries", None) or {}
        if not isinstance(block, dict):
            return [f"dictionaries: {block!r} is not a mapping; write dictionaries: {{sae1: {{path: runs/sae}}}}"]
        problems = [p for name, spec in block.items() for p in spec_problems(name, spec)]
        problems += [p for method in methods().values() for key, name in method.dictionary_uses(cfg)
                     for p in dictionary_problems(key, name, list(block))]
        return problems + hook_problems(cfg, list(block))

    def load(self, job, name: str):
        """The dictionary `name` of the block, loaded once a run (whichever method asks first: a patching grid of
        features, circuit.features, this method's compile); ConfigError naming dictionaries.<name> if it does not
        load."""
        if name not in self.loaded:
            try:
                self.loaded[name] = load_dictionary(self.spec[name], device=job.device)
            except DictionaryError as err:
                raise ConfigError([f"dictionaries.{name}: {err}"]) from None
        return self.loaded[name]

    @classmethod
    def generation_problems(cls, cfg) -> List[str]:
        return [f"hooks.{name}.evaluate: runs extra forwards a batch, and a generate run has none; set "
                "generate.max_new_tokens=0 (or drop evaluate)" for name, hook in (cfg.hooks or {}).items()
                if hook.dictionary is not None and hook.evaluate]

    def layer_problems(self, key: str, name: str, layers: List[str], reader: str = "this hook") -> List[str]:
        """Dictionary `name` (loaded) read at `layers` other than the one it was trained on, unless its entry sets
        any_layer (hookrun.capture.checks.trained_layer_problems); `reader` names who reads it."""
        return trained_layer_problems(key, name, self.loaded[name], layers, any_layer(self.spec.get(name)), reader)

    def compile(self, job) -> None:
        """Load every dictionary (once), bind each hook's use and each feature edit; ConfigError for a dictionary
        that does not load or a feature beyond its width."""
        problems = []
        for name in self.spec or {}:
            try:
                self.load(job, name)
            except ConfigError as err:
                problems += err.problems
        if problems:
            raise ConfigError(problems)
        for plan in job.plans:
            hook = job.specs.get(plan.name)
            if hook is not None and getattr(hook, "dictionary", None):
                problems += self.layer_problems(f"hooks.{plan.name}.layers", hook.dictionary, list(plan.targets))
                plan.dictionary = DictionaryUse(plan.name, hook.dictionary, self.loaded[hook.dictionary], hook.top_k,
                                                hook.splice, hook.evaluate)
                self.uses[plan.name] = (plan, plan.dictionary)
            for edit in plan.edits:
                if edit.op != "feature":
                    continue
                name, feature = edit.args["dictionary"], edit.args["feature"]
                module = self.loaded[name]
                d_sae = dims(module)[1]
                if d_sae is not None and feature >= d_sae:
                    problems.append(f"{edit.key}.feature: {feature} is out of range: dictionary {name} has {d_sae} "
                                    f"features (0..{d_sae - 1}); pick one of them")
                    continue
                op = next(k for k in ("set", "scale", "clamp", "add") if k in edit.args)
                edit.bound = FeatureEdit(module, name, feature, op, edit.args[op])
        if problems:
            raise ConfigError(problems)

    def measure(self, job, i: int, batch, output, hookset) -> Dict[str, np.ndarray]:
        """CE loss recovered's three losses (clean, the layer spliced, the layer zeroed) for each layer of each hook
        with `evaluate`: the run's hooks off, 2 x layers forwards, and the clean loss from the batch's own output
        where nothing changed it (no edit, no splice, the model in eval mode), else from one more forward; a row
        of `<hook>/<layer>/eval.ce`."""
        todo = [(plan, layer, module, use) for plan, use in self.uses.values() if use.evaluate
                for layer, module in plan.targets.items() if layer in use.roles]
        if not todo:
            return {}
        ids, info = batch.kwargs["input_ids"], batch.tokens
        clean_output = not job.model.training and not any(
            plan.edits or (plan.dictionary is not None and plan.dictionary.splice) for plan in job.plans)
        with unhooked(hookset), torch.inference_mode():
            pairs, clean = nll(output if clean_output else job.model(*batch.args, **batch.kwargs), ids, info)
            for plan, layer, module, use in todo:
                losses = []
                for fn in (use.reconstruct, torch.zeros_like):
                    with HookScope() as scope:
                        replacing(scope, plan, layer, use.roles[layer], fn)
                        losses.append(nll(job.model(*batch.args, **batch.kwargs), ids, info)[1])
                row = torch.tensor([pairs, clean, *losses], dtype=torch.float64)
                site = Site(plan.name, layer, "eval.ce", 0, i, batch.start, batch.stop)
                hookset.sink(Piece(site, "metric", row, False, "batch"))
        return {}

    def attrs(self) -> dict:
        """Per dictionary hook: its dictionary, d_in, d_sae, width, layers and the role each read, splice, evaluate."""
        return {"dictionaries": {hook: {"dictionary": use.name, "d_in": use.d_in, "d_sae": use.d_sae,
                                        "width": use.width, "layers": list(plan.targets), "roles": dict(use.roles),
                                        "splice": use.splice, "evaluate": use.evaluate}
                                 for hook, (plan, use) in self.uses.items()}}

    @staticmethod
    def read(cap, what: str = "evaluations", **kwargs):
        return read_dictionaries(cap, what, **kwargs)
