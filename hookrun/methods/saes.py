"""A dictionary's own floor (sparse autoencoders): the module, the SAELens folder format, sparse features and
evaluations; the dictionaries method reads with them, the training method writes with them.

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
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

ARCHITECTURES = ("standard", "topk", "jumprelu")
TRANSCODERS = ("transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder")   # SAELens's
CFG_FILE = "cfg.json"                      # SAELens's SAE_CFG_FILENAME
WEIGHTS_FILE = "sae_weights.safetensors"   # SAELens's SAE_WEIGHTS_FILENAME
SAELENS_FORMAT = "6.54.0"   # written as metadata.sae_lens_version: SAELens reads older (< 6.0) configs another way
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FOLDER_KEYS = ("path", "dtype", "any_layer")   # what a dictionary folder's spec takes beside its path
SAELENS_FIX = "save it with hookrun.methods.saes.save_saelens or SAELens's sae.save_model(path)"


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


class Transcoder(nn.Module):
    """A transcoder with SAELens's weights and maths (sae_lens/saes/transcoder.py): it reads one site (hook_name) and
    writes another (hook_name_out).

        tc = load_saelens("runs/tc")       # architecture transcoder | skip_transcoder | jumprelu_(skip_)transcoder
        y_hat = tc.decode(tc.encode(x), x)  # the output site's value from the input site's (x: the skip's input)

    encode: relu(x @ W_enc + b_enc) (jumprelu: times pre > threshold; no b_dec subtracted: it is the output's);
    decode: f @ W_dec + b_dec, plus x @ W_skip^T for a skip transcoder."""

    def __init__(self, d_in: int, d_sae: int, d_out: int, architecture: str = "transcoder",
                 dtype: torch.dtype = torch.float32, device=None, hook_name: Optional[str] = None,
                 hook_name_out: Optional[str] = None):
        super().__init__()
        if architecture not in TRANSCODERS:
            raise DictionaryError(f"architecture {architecture!r} is not one of {', '.join(TRANSCODERS)}")
        self.d_in, self.d_sae, self.d_out, self.architecture = int(d_in), int(d_sae), int(d_out), architecture
        self.hook_name, self.hook_name_out = hook_name, hook_name_out
        kw = {"dtype": dtype, "device": device}
        self.W_enc = nn.Parameter(torch.zeros(self.d_in, self.d_sae, **kw))
        self.b_enc = nn.Parameter(torch.zeros(self.d_sae, **kw))
        self.W_dec = nn.Parameter(torch.zeros(self.d_sae, self.d_out, **kw))
        self.b_dec = nn.Parameter(torch.zeros(self.d_out, **kw))
        if architecture.startswith("jumprelu"):
            self.threshold = nn.Parameter(torch.zeros(self.d_sae, **kw))
        if "skip" in architecture:
            self.W_skip = nn.Parameter(torch.zeros(self.d_out, self.d_in, **kw))

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def skip(self) -> bool:
        return hasattr(self, "W_skip")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Features [..., d_sae] of the input site's activations x [..., d_in]."""
        pre = x.to(self.dtype) @ self.W_enc + self.b_enc
        f = torch.relu(pre)
        return f * (pre > self.threshold).to(pre.dtype) if hasattr(self, "threshold") else f

    def decode(self, features: torch.Tensor, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The output site's value [..., d_out] from features (x: the input, which a skip transcoder needs)."""
        out = features @ self.W_dec + self.b_dec
        if self.skip:
            if x is None:
                raise DictionaryError("a skip transcoder decodes with its input: decode(features, x)")
            out = out + x.to(self.dtype) @ self.W_skip.T
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output site's value decode(encode(x), x)."""
        return self.decode(self.encode(x), x)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_sae={self.d_sae}, d_out={self.d_out}, architecture={self.architecture}"


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
                 ) -> Union[SparseAutoencoder, Transcoder]:
    """A SparseAutoencoder (or a Transcoder) from a SAELens-format folder (cfg.json + sae_weights.safetensors), in
    eval mode, as SAELens's SAE.load_from_disk(path) reads it; DictionaryError (naming the path, the problem, the
    fix) else.

        sae = load_saelens("runs/sae")                 # dtype: cfg.json's, or `dtype` ("float32", torch.float64)
    """
    path = Path(path).expanduser()
    cfg = _read_cfg(path)
    arch = _cfg_value(cfg, "architecture", ARCHITECTURES + TRANSCODERS, path, default="standard")
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
    if arch in TRANSCODERS:
        meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
        tc = Transcoder(d_in, d_sae, _cfg_value(cfg, "d_out", int, path, required=True), arch, dtype=torch_dtype,
                        device="meta", hook_name=_hook_name(cfg), hook_name_out=meta.get("hook_name_out"))
        tc.load_state_dict(_read_weights(path, tc, device), assign=True)
        return tc.eval()
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


def _read_weights(path: Path, sae: nn.Module, device) -> Dict[str, torch.Tensor]:
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
