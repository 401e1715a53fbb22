"""Dictionaries (sparse autoencoders) in a run: features captured at a site, feature edits, splices and
evaluations, with the dictionaries a run loads once (the module, its SAELens folders and the evaluation's sums are
the floor's: hookrun.methods.saes).

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

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from hookrun.capture import tokens as tok
from hookrun.capture.checks import any_layer, dictionary_problems, trained_layer_problems
from hookrun.capture.hooks import HookError, Piece, replacing
from hookrun.capture.scope import HookScope
from hookrun.capture.site import Site
from hookrun.capture.targets import attach, patterns_standard, resolve_sites
from hookrun.config.registry import methods
from hookrun.config.checks import ConfigError, check_choice, check_number, check_target, is_int, unknown_keys
from hookrun.methods import Method
from hookrun.methods.metrics import logits_of, unhooked
from hookrun.methods.paired import decoder_direction, dims, linear_decoder
from hookrun.methods.saes import (CFG_FILE, DTYPES, FOLDER_KEYS, DictionaryError, Transcoder, fires_only_positive,
                                  load_dictionary, load_saelens, sparse_nonzero, sparse_topk)
from hookrun.read.results.dictionaries import read as read_dictionaries

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
        problems += check_number(f"{key}.top_k", hook.top_k, whole=True, low=1, null="every nonzero feature",
                                 fix="features kept a token")
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
    `evaluate`, a row a batch of SAELens's sums (`eval.sums`); then returns what flows on (the splice).
    A transcoder (hookrun.methods.saes.Transcoder) reads the hook's layer (its input site) and is compared with and
    spliced into its output site (hook_name_out): the features are stored at the input, then `at_output` (a hook
    on the output site) stores the error norm and the sums against the output's value, and splices there."""

    def __init__(self, hook: str, name: str, module, top_k: Optional[int], splice: Optional[str], evaluate: bool):
        self.hook, self.name, self.module = hook, name, module
        self.d_in, self.d_sae = dims(module)
        self.top_k, self.splice, self.evaluate = top_k, splice, bool(evaluate)
        self.roles: Dict[str, str] = {}   # layer -> the role it reads
        self.transcoder = isinstance(module, Transcoder)
        self.d_out = module.d_out if self.transcoder else None
        self.outputs: Dict[str, list] = {}   # a transcoder's layer -> its output site's targets
        self.pending: Dict[str, tuple] = {}  # a transcoder's layer -> what its input site gave, for the output
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
        """decode(encode(t)) in t's dtype (the splice of `replace`; a transcoder's: its output site's value)."""
        if self.transcoder:
            return self.module.decode(self.module.encode(t), t).to(t.dtype)
        return self.module.decode(self.module.encode(t)).to(t.dtype)

    def at_output(self, layer: str):
        """A transcoder's hook function on the output site of `layer`: the error norm and the evaluation's sums
        against the output's value, and the splice (None: what flows on is unchanged)."""
        def fn(y: torch.Tensor):
            got = self.pending.pop(layer, None)
            if got is None:   # a forward the input hook did not see (the evaluation's own, the run's hooks off)
                return None
            hookset, plan, call, info, fd, x_hat = got
            if y.shape[:-1] != x_hat.shape[:-1] or y.shape[-1] != self.d_out:
                raise HookError(f"hooks.{plan.name}.dictionary: transcoder {self.name} writes {self.d_out}-wide "
                                f"values at {self.module.hook_name_out}, which is {list(y.shape)}; hook the sites it "
                                "was trained on (its cfg.json's metadata.hook_name and hook_name_out)",
                                f"hooks.{plan.name}.dictionary")
            xh, target = x_hat.detach(), y.detach().to(x_hat.dtype)
            hookset._emit(plan, layer, "error_norm", call, (target - xh).norm(dim=-1).float(), info)
            if self.evaluate:
                self._sums(hookset, plan, layer, call, info, *(self._rows(a, info) for a in (target, xh, fd)))
            if self.splice == "replace":
                return x_hat.to(y.dtype)
            if self.splice == "replace_with_error":
                return (x_hat + (y.to(x_hat.dtype) - x_hat).detach()).to(y.dtype)
            return None
        return fn

    def _store_features(self, hookset, plan, layer: str, call: int, fd: torch.Tensor, info) -> None:
        """The features of one call stored sparse (features.indices, features.values), as an SAE's and a
        transcoder's: d_sae learnt from the first call."""
        if self.d_sae is None:
            self.d_sae = int(fd.shape[-1])
        idx, val = self._sparse(fd.reshape(-1, fd.shape[-1]), plan, layer)
        lead = fd.shape[:-1]
        hookset._emit(plan, layer, "features.indices", call, idx.reshape(*lead, -1), info)
        hookset._emit(plan, layer, "features.values", call, val.reshape(*lead, -1), info)

    def _transcode(self, hookset, plan, layer: str, call: int, t: torch.Tensor, info) -> torch.Tensor:
        """A transcoder at its input site: the features stored, the output site's reconstruction kept for at_output."""
        grad = self.splice is not None and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            f = self.module.encode(t if grad else t.detach())
            x_hat = self.module.decode(f, t if grad else t.detach())
        fd = f.detach()
        self._store_features(hookset, plan, layer, call, fd, info)
        self.pending[layer] = (hookset, plan, call, info, fd, x_hat)
        return t

    def __call__(self, hookset, plan, layer: str, role: str, call: int, t: torch.Tensor, info) -> torch.Tensor:
        key = f"hooks.{plan.name}.dictionary"
        if not t.is_floating_point() or (self.d_in is not None and (not t.dim() or t.shape[-1] != self.d_in)):
            raise HookError(f"{key}: dictionary {self.name} reads {self.d_in}-wide activations, but {layer} {role} is "
                            f"{list(t.shape)} {str(t.dtype).replace('torch.', '')} (last axis "
                            f"{t.shape[-1] if t.dim() else 'none'}); hook the layer the dictionary was trained on "
                            "(its cfg.json's metadata.hook_name), or name its role (capture: [output.0])", key)
        if self.transcoder:
            return self._transcode(hookset, plan, layer, call, t, info)
        rows = self._stored_rows(plan, t, info)
        if rows is not None:  # only the stored tokens encoded (no pads); the other rows filled, never stored
            return self._encode_rows(hookset, plan, layer, call, t, info, rows)
        grad = self.splice is not None and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            f = self.module.encode(t if grad else t.detach())
            x_hat = self.module.decode(f)
        fd, xh, x = f.detach(), x_hat.detach(), t.detach()
        self._store_features(hookset, plan, layer, call, fd, info)
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
        self.scope = HookScope()   # transcoders' hooks on their output sites, for the whole run (removed in close)

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
                if plan.dictionary.transcoder:
                    problems += self._output_sites(job, plan, hook.dictionary)
            for edit in plan.edits:
                if edit.op != "feature":
                    continue
                name, feature = edit.args["dictionary"], edit.args["feature"]
                module = self.loaded[name]
                if isinstance(module, Transcoder):
                    problems.append(f"{edit.key}.dictionary: {name} is a transcoder (its features write another "
                                    "site than they read); op: feature edits take a sparse autoencoder")
                    continue
                d_sae = dims(module)[1]
                if d_sae is not None and feature >= d_sae:
                    problems.append(f"{edit.key}.feature: {feature} is out of range: dictionary {name} has {d_sae} "
                                    f"features (0..{d_sae - 1}); pick one of them")
                    continue
                op = next(k for k in ("set", "scale", "clamp", "add") if k in edit.args)
                edit.bound = FeatureEdit(module, name, feature, op, edit.args[op])
        if problems:
            raise ConfigError(problems)

    def _output_sites(self, job, plan, name: str) -> List[str]:
        """A transcoder's output site (its cfg.json's metadata.hook_name_out) found in the model and hooked
        (DictionaryUse.at_output); problems where it has none, it is not in the model, or the hook has several
        layers."""
        use, key = plan.dictionary, f"hooks.{plan.name}"
        out = use.module.hook_name_out
        if not out:
            return [f"{key}.dictionary: transcoder {name} names no output site (cfg.json's metadata.hook_name_out); "
                    "set it to the site it writes"]
        if len(plan.targets) != 1:
            return [f"{key}.layers: transcoder {name} reads one site and writes {out}; give one layer, not "
                    f"{len(plan.targets)}"]
        targets, problems = resolve_sites(job.model, [out], None if patterns_standard([out]) else "output",
                                          f"dictionaries.{name} (hook_name_out)")
        if problems or len(targets) != 1:
            return problems or [f"{key}.dictionary: transcoder {name}'s output site {out!r} names {len(targets)} "
                                "sites of the model; it must name one"]
        layer = next(iter(plan.targets))
        use.outputs[layer] = targets
        attach(self.scope, job.model, targets, [use.at_output(layer)], HookError)
        return []

    def close(self, job) -> None:
        self.scope.remove()

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
                        if use.transcoder:   # the input site's value read, the output site's replaced
                            seen = {}
                            replacing(scope, plan, layer, use.roles[layer], lambda t, seen=seen: seen.update(x=t) or t)
                            zero = fn is torch.zeros_like
                            attach(scope, job.model, use.outputs[layer],
                                   [lambda y, zero=zero, seen=seen: torch.zeros_like(y) if zero else
                                    use.reconstruct(seen["x"]).to(y.dtype)])
                        else:
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
                                        "splice": use.splice, "evaluate": use.evaluate,
                                        **({"d_out": use.d_out, "out": use.module.hook_name_out}
                                           if use.transcoder else {})}
                                 for hook, (plan, use) in self.uses.items()}}

    @staticmethod
    def read(cap, what: str = "evaluations", **kwargs):
        return read_dictionaries(cap, what, **kwargs)
