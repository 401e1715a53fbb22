"""Interventions a hook applies to what flows on: scale, add, zero, clamp, noise, replace, or a callable.

Every op returns a new tensor and never writes into one autograd may still need.

    edit: [{op: scale, value: 2}, {op: zero, dim: 1, index: [0, 3]}, {op: clamp, min: 0}]
    edit: [{op: add, value: [0.1, 0.2, ...], coef: 4, positions: last}]    # a vector over the last axis
    edit: [{op: add, value: {store: runs/a, hook: resid, reduce: mean}, coef: 4}]    # (hookrun.capture.sources)
    edit: [{op: zero, heads: [1]}]                                         # one attention head's columns
    edit: [{op: replace, store: runs/a, hook: acts, positions: last, source: {position: last}}]  # patching
    edit: [{_target_: mypkg.edits.flip, axis: 1}]                          # fn(tensor, **args) -> tensor
    edit: [{op: feature, dictionary: sae1, feature: 12, add: 4.0}]         # a dictionary feature: set | scale |
                                                                           # clamp: [min, max] | add (its direction)

`positions: last | first | [ints]` limits any edit to those real-token positions of each sequence, and
`heads: [ints]` to those attention heads (hookrun.capture.tokens: [B, H, T, T], [B, T, H, Dh], or [B, T, H*Dh]
split into the model's heads; the op then sees the per-head view, so a vector is Dh wide). `replace` from a
store takes the source run's rows of the sample and position its `source:` names (hookrun.capture.sources).
"""
from __future__ import annotations

import zlib
from typing import Callable, List, Optional

import torch

from hookrun.capture import sources, tokens
from hookrun.capture.checks import finite_problems
from hookrun.capture.site import Site, where
from hookrun.config.checks import ConfigError, as_list, check_choice, check_target, is_int, is_number, target_of


ARGS = {  # op -> (required args, optional args)
    "scale": (set(), {"value", "file", "coef"}),
    "add": (set(), {"value", "file", "coef"}),
    "zero": (set(), {"dim", "index"}),
    "clamp": (set(), {"min", "max"}),
    "noise": ({"std"}, {"seed", "mean"}),
    "replace": (set(), {"value", "file", "coef", "store", "hook", "layer", "role", "call", "source"}),
    "feature": ({"dictionary", "feature"}, {"set", "scale", "clamp", "add"}),   # hookrun.methods.dictionaries binds it
}
FEATURE_OPS = ("set", "scale", "clamp", "add")
COMMON = {"op", "roles", "positions", "heads", "n_heads"}
VALUES = {"scale": ("value", "file"), "add": ("value", "file"), "replace": ("value", "file", "store")}


def check_spec(key: str, spec) -> List[str]:
    """Problems with one edit spec, each naming the key and the fix."""
    if not isinstance(spec, dict):
        return [f"{key}: {spec!r} is not an edit; write {{op: scale, value: 2}} or {{_target_: pkg.fn}}"]
    problems = _selection_problems(key, spec)
    if "_target_" in spec:
        return problems + check_target(key, spec, "give an importable function", {"tensor": None},
                                       skip=tuple(COMMON - {"op"}))
    if problems:
        return problems
    op = spec.get("op")
    if op not in ARGS:
        return check_choice(f"{key}.op", op, ARGS, f"one of {', '.join(ARGS)} or _target_")
    required, optional = ARGS[op]
    problems = [f"{key}: op {op} needs {r!r}, e.g. {{op: {op}, {r}: 2}}" for r in sorted(required - set(spec))]
    for extra in sorted(set(spec) - required - optional - COMMON):
        problems.append(f"{key}.{extra}: op {op} takes no {extra!r}; it takes {sorted(required | optional)}")
    problems += _value_problems(key, op, spec) + _type_problems(key, spec)
    if op == "clamp" and "min" not in spec and "max" not in spec:
        problems.append(f"{key}: op clamp needs min, max or both")
    elif op == "clamp" and is_number(spec.get("min")) and is_number(spec.get("max")) and spec["min"] > spec["max"]:
        problems.append(f"{key}: op clamp with min {spec['min']} > max {spec['max']} sets every value to max; "
                        "swap them (min <= max)")
    if op == "feature":
        problems += _feature_problems(key, spec)
    if op == "noise" and "std" in spec and not (isinstance(spec["std"], (int, float)) and spec["std"] >= 0):
        problems.append(f"{key}.std: {spec['std']!r} must be a number >= 0")
    return problems


def _feature_problems(key: str, spec: dict) -> List[str]:
    """An edit of a dictionary feature: one of set, scale, clamp, add; the dictionary's name (checked against the
    `dictionaries:` block, and the feature against its width, by hookrun.methods.dictionaries)."""
    given = [k for k in FEATURE_OPS if k in spec]
    problems = []
    if len(given) != 1:
        problems.append(f"{key}: op feature takes exactly one of {', '.join(FEATURE_OPS)}; got "
                        f"{', '.join(given) or 'none'}, e.g. {{op: feature, dictionary: sae1, feature: 12, add: 4.0}}")
    if "dictionary" in spec and not isinstance(spec["dictionary"], str):
        problems.append(f"{key}.dictionary: {spec['dictionary']!r} must name an entry of the dictionaries: block")
    clamp = spec.get("clamp")
    pair = isinstance(clamp, list) and len(clamp) == 2 and all(v is None or is_number(v) for v in clamp)
    if "clamp" in spec and not (pair and clamp != [None, None]):
        problems.append(f"{key}.clamp: {clamp!r} must be [min, max] (numbers; null for no bound)")
    elif "clamp" in spec and None not in clamp and clamp[0] > clamp[1]:
        problems.append(f"{key}.clamp: min {clamp[0]} > max {clamp[1]}; swap them (min <= max)")
    return problems


def _selection_problems(key: str, spec: dict) -> List[str]:
    """Problems with where an edit applies: positions, heads, n_heads."""
    problems = tokens.check_positions(f"{key}.positions", spec["positions"], sets=True) if "positions" in spec else []
    if "heads" in spec and not (as_list(spec["heads"]) and all(is_int(h) and h >= 0 for h in as_list(spec["heads"]))):
        problems.append(f"{key}.heads: {spec['heads']!r} must be a head index or a list of them, e.g. [0, 3]")
    if "n_heads" in spec and not (is_int(spec["n_heads"]) and spec["n_heads"] > 0):
        problems.append(f"{key}.n_heads: {spec['n_heads']!r} must be a positive integer (the model's attention heads)")
    return problems


def _value_problems(key: str, op: str, spec: dict) -> List[str]:
    """Where an op's values come from: exactly one of value, file (or store for replace), each usable."""
    if op not in VALUES:
        return []
    given = [s for s in VALUES[op] if s in spec]
    if not given:
        return [f"{key}: op {op} needs 'value' (or {' or '.join(VALUES[op][1:])}), e.g. {{op: {op}, value: 2}}"]
    if len(given) > 1:
        return [f"{key}: op {op} takes one of {', '.join(VALUES[op])}, not {' and '.join(given)}; keep one"]
    if "file" in spec:
        return sources.file_problems(f"{key}.file", spec["file"])
    if "value" in spec:
        return sources.value_problems(f"{key}.value", spec["value"])
    problems = sources.store_problems(f"{key}.store", spec["store"]) if "store" in spec else []
    if "source" in spec and "store" not in spec:
        problems.append(f"{key}.source: names where a patch takes its rows; it needs store: RUN")
    elif "source" in spec:
        problems += sources.source_problems(f"{key}.source", spec["source"], spec.get("positions"))
    return problems


def _is_index(v) -> bool:
    return is_int(v) or (isinstance(v, list) and all(is_int(i) for i in v)) or \
        (isinstance(v, dict) and set(v) <= {"start", "stop", "step"})


ARG_TYPES = {  # arg -> (test, what it must be)
    "min": (is_number, "a number"), "max": (is_number, "a number"), "mean": (is_number, "a number"),
    "coef": (is_number, "a number"),
    "dim": (is_int, "an integer dim"),
    "index": (_is_index, "an int, a list of ints or {start, stop, step}"),
    "seed": (is_int, "an integer"),
    "call": (is_int, "an integer"),
    "feature": (lambda v: is_int(v) and v >= 0, "a feature index (an int >= 0)"),
    "set": (is_number, "a number"), "scale": (is_number, "a number"), "add": (is_number, "a number"),
}


def _type_problems(key: str, spec: dict) -> List[str]:
    """Arguments of the wrong type ({op: clamp, min: abc}), and numbers that are not finite (a NaN coef makes every
    value it touches NaN: never a choice)."""
    problems = [f"{key}.{arg}: {spec[arg]!r} is not {what}" for arg, (ok, what) in ARG_TYPES.items()
                if arg in spec and not ok(spec[arg])]
    for arg in ("coef", "min", "max", "mean", "std", "set", "scale", "add"):
        if arg in spec and is_number(spec[arg]):
            problems += finite_problems(f"{key}.{arg}", spec[arg])
    if spec.get("op") == "feature" and isinstance(spec.get("clamp"), list):
        problems += finite_problems(f"{key}.clamp", [v for v in spec["clamp"] if v is not None])
    return problems


def noise_seed(seed: int, site: Site) -> int:
    """The seed of a noise edit at one site: fixed by (seed, hook, layer, role, call, batch), so a
    resumed run draws the same noise as an uninterrupted one."""
    return zlib.crc32(f"{seed}/{site.hook}/{site.layer}/{site.role}/{site.call}/{site.batch}".encode())


def _index(spec):
    """A YAML index (int, list, {start, stop, step}) as something torch indexing takes."""
    if isinstance(spec, dict):
        return slice(spec.get("start"), spec.get("stop"), spec.get("step"))
    if isinstance(spec, list):
        return torch.as_tensor(spec, dtype=torch.long)
    return spec


class Edit:
    """One compiled edit: `edit(tensor, site) -> tensor`, restricted to `roles` if given; `key` is its config key
    (hooks.<name>.edit[<i>]). `n_heads` splits a [B, T, H*Dh] tensor for `heads:`; `decode` names token ids in
    a patch's messages."""

    def __init__(self, spec: dict, key: str, n_heads: Optional[int] = None,
                 decode: Optional[Callable[[int], str]] = None):
        spec = dict(spec)
        self.key = key
        self.roles = [str(r) for r in as_list(spec.pop("roles", None))]
        self.positions = spec.pop("positions", None)
        self.heads = spec.pop("heads", None)
        self.n_heads = spec.pop("n_heads", None) or n_heads
        self.patch: Optional[sources.Patch] = None
        self.value: Optional[torch.Tensor] = None
        self.bound: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # op feature: bound by its dictionary
        if "_target_" in spec:
            self.fn: Callable = target_of(spec.pop("_target_"))
            self.op = "_target_"
        else:
            self.op = spec.pop("op")
        if self.op == "replace" and "store" in spec:
            self.patch = sources.Patch(spec, key, decode)
        elif self.op in VALUES:
            self.value_key = f"{key}.{'file' if 'file' in spec else 'value'}"
            self.value = sources.load_value(key, spec)
        self.args = spec

    def applies_to(self, role: str) -> bool:
        return not self.roles or any(role == r or role.startswith(r + ".") for r in self.roles)

    def __call__(self, t: torch.Tensor, site: Site) -> torch.Tensor:
        if self.patch is not None:
            new = self._patched(t, site)
        elif self.positions is None and self.heads is None:
            return self._op(t, site)
        elif self.heads is not None:
            new = self._on_heads(t, site)
        else:
            new = self._op(t, site)
        mask = None
        if self.positions is not None and self.patch is None:
            key = f"{self.key}.positions"
            mask = tokens.position_mask(t, tokens.require(site.tokens, key), self.positions, key)
        if self.heads is not None:
            heads = self._head_mask(t, site)
            mask = heads if mask is None else mask & heads
        return new if mask is None else torch.where(mask, new, t)

    def _head_view(self, t: torch.Tensor, site: Site):
        """(t with a head axis, that axis): [B, H, T, T] and [B, T, H, Dh] as they are, [B, T, H*Dh] split."""
        key = f"{self.key}.heads"
        info = tokens.require(site.tokens, key)
        axis = tokens.head_axis(t, info)
        if axis is not None:
            return t, axis
        if t.dim() == 3 and tokens.is_tokens(t, info):
            if not self.n_heads or t.shape[2] % self.n_heads:
                raise tokens.TokenError(f"{key}: cannot split the last axis of a tensor of shape {list(t.shape)} into "
                                        f"{self.n_heads} heads; give the edit n_heads: (the model's attention heads)")
            return t.reshape(*t.shape[:2], self.n_heads, -1), 2
        raise tokens.TokenError(f"{key}: a tensor of shape {list(t.shape)} has no head axis; heads apply to attention "
                                "patterns [batch, heads, seq, seq], per-head tensors [batch, seq, heads, d_head] and "
                                "[batch, seq, heads * d_head] (e.g. the input of attn.c_proj / self_attn.o_proj)")

    def _head_mask(self, t: torch.Tensor, site: Site) -> torch.Tensor:
        """A bool mask of `t`'s shape, true on the entries of the edit's heads."""
        view, axis = self._head_view(t, site)
        n = view.shape[axis]
        bad = [h for h in as_list(self.heads) if h >= n]
        if bad:
            raise tokens.TokenError(f"{self.key}.heads: {bad} beyond the {n} heads of a tensor of shape "
                                    f"{list(t.shape)}")
        picked = torch.zeros(n, dtype=torch.bool, device=t.device)
        picked[torch.as_tensor(as_list(self.heads), device=t.device)] = True
        shape = [1] * view.dim()
        shape[axis] = n
        return picked.reshape(shape).expand(view.shape).reshape(t.shape)

    def _on_heads(self, t: torch.Tensor, site: Site) -> torch.Tensor:
        """The op on the per-head view of `t` (a vector value is one head wide), back in `t`'s shape."""
        view, _ = self._head_view(t, site)
        return self._op(view, site).reshape(t.shape)

    def _patched(self, t: torch.Tensor, site: Site) -> torch.Tensor:
        """`t` with the source run's rows: at the edit's positions (or every real token) of a per-token capture, else
        the whole capture of the same samples."""
        info = site.tokens
        if info is None or not tokens.is_tokens(t, info) or not self.patch.per_token(site):
            whole = self.patch.whole(t, site)
            if self.positions is None:
                return whole
            key = f"{self.key}.positions"
            return torch.where(tokens.position_mask(t, tokens.require(info, key), self.positions, key), whole, t)
        if self.positions is None:
            b, cols = info.mask.nonzero(as_tuple=True)
            slot = torch.zeros_like(b)
        else:
            grid = tokens.columns(info, tokens.positions_spec(self.positions)[0], f"{self.key}.positions")
            b = torch.arange(grid.shape[0], device=grid.device).repeat_interleave(grid.shape[1])
            cols, slot = grid.reshape(-1), torch.arange(grid.shape[1], device=grid.device).repeat(grid.shape[0])
        return self.patch.at_tokens(t, site, info, b, cols, slot)

    def _op(self, t: torch.Tensor, site: Site) -> torch.Tensor:
        a = self.args
        if self.op == "_target_":
            return self.fn(t, **a)
        if self.op in VALUES:
            v = sources.fit(self.value, t, self.value_key)
            return t * v if self.op == "scale" else t + v if self.op == "add" else v.to(t.dtype).expand_as(t).clone()
        if self.op == "feature":
            if self.bound is None:
                raise RuntimeError(f"{self.key}: op feature has no dictionary bound (the run's dictionaries: block "
                                   "binds it when the run is prepared)")
            return self.bound(t)
        if self.op == "clamp":
            return t.clamp(min=a.get("min"), max=a.get("max"))
        if self.op == "zero":
            if "index" not in a:
                return torch.zeros_like(t)
            mask = torch.ones_like(t)
            idx = [slice(None)] * t.dim()
            idx[a.get("dim", 1)] = _index(a["index"])
            mask[tuple(idx)] = 0
            return t * mask
        if self.op == "noise":
            generator = torch.Generator(device=t.device).manual_seed(noise_seed(a.get("seed", 0), site))
            noise = torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype)
            return t + a.get("mean", 0.0) + a["std"] * noise
        raise AssertionError(self.op)


def compile_edits(specs, hook: str, n_heads: Optional[int] = None,
                  decode: Optional[Callable[[int], str]] = None) -> List[Edit]:
    """The edit list of hook `hook`, compiled in order (values loaded); ConfigError naming every edit that cannot."""
    edits, problems = [], []
    for i, s in enumerate(as_list(specs)):
        try:
            edits.append(Edit(s, f"hooks.{hook}.edit[{i}]", n_heads, decode))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    return edits


def source_problems(edits: List[Edit], layers: List[str], inputs=None) -> List[str]:
    """What the source runs of the patches among `edits` lack for this run (its hooked `layers`, its `inputs`)."""
    return [p for e in edits if e.patch is not None for p in e.patch.problems(layers, inputs)]


class EditError(RuntimeError):
    """An edit could not apply to the tensor it met (a dim it lacks, a shape it cannot take); `key` names the
    edit (hooks.<name>.edit[<i>])."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


def apply(edits: List[Edit], t: torch.Tensor, site: Site) -> torch.Tensor:
    """`t` after every edit that applies to its role, in order; an edit that fails, or returns another shape or
    dtype (what flows on must still fit the model), raises EditError naming the edit, the site and the batch."""
    for e in edits:
        if not e.applies_to(site.role):
            continue
        if e.op == "zero" and "dim" in e.args and not -t.dim() <= e.args["dim"] < t.dim():
            raise EditError(f"{e.key}.dim", f"{e.key}.dim: zero along dim {e.args['dim']} of {where(site, t)}, which "
                            f"it lacks; use a dim in 1..{t.dim() - 1}")
        try:
            out = e(t, site)
        except tokens.TokenError as err:
            setting = "heads" if ".heads:" in str(err) else "positions"
            raise EditError(f"{e.key}.{setting}", f"{err} (at {where(site, t)})") from err
        except sources.SourceError as err:
            raise EditError(err.key, f"{err} (at {where(site, t)})") from err
        except Exception as err:  # noqa: BLE001 - any failure of an edit names the edit and where it met the tensor
            raise EditError(e.key, f"{e.key}: {e.op} on {where(site, t)} failed: {type(err).__name__}: {err}") from err
        if not isinstance(out, torch.Tensor) or out.shape != t.shape or out.dtype != t.dtype:
            got = f"{list(out.shape)} {str(out.dtype).replace('torch.', '')}" if isinstance(out, torch.Tensor) else \
                type(out).__name__
            raise EditError(e.key, f"{e.key}: {e.op} on {where(site, t)} returned {got}; an edit must keep the "
                            "shape and dtype of what it edits (the model goes on with it)")
        t = out
    return t
