"""Interventions a hook applies to what flows on: scale, add, zero, clamp, noise, replace, or a callable.

Every op returns a new tensor and never writes into one autograd may still need.

    edit: [{op: scale, value: 2}, {op: zero, dim: 1, index: [0, 3]}, {op: clamp, min: 0}]
    edit: [{op: replace, store: outputs/run_a, hook: acts}]     # activation patching
    edit: [{_target_: mypkg.edits.flip, axis: 1}]               # fn(tensor, **args) -> tensor
    edit: [{op: replace, store: outputs/run_a, positions: last}] # patch each sequence's last real token

`positions: last | first | [ints]` limits any edit to those real-token positions of each sequence
(hookrun.capture.tokens); `replace` from a per-token store then takes the source's row of the same sample
and position.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from hookrun.capture.site import Site, where
from hookrun.config.schema import as_list, check_choice, check_target, target_of, to_plain


ARGS = {  # op -> (required args, optional args)
    "scale": ({"value"}, set()),
    "add": ({"value"}, set()),
    "zero": (set(), {"dim", "index"}),
    "clamp": (set(), {"min", "max"}),
    "noise": ({"std"}, {"seed", "mean"}),
    "replace": (set(), {"value", "file", "store", "hook", "layer", "role", "call"}),
}
COMMON = {"op", "roles", "positions"}


def check_spec(key: str, spec) -> List[str]:
    """Problems with one edit spec, each naming the key and the fix."""
    spec = to_plain(spec)
    if not isinstance(spec, dict):
        return [f"{key}: {spec!r} is not an edit; write {{op: scale, value: 2}} or {{_target_: pkg.fn}}"]
    if "_target_" in spec:
        return check_target(key, spec, "give an importable function", {"tensor": None}, skip=("roles", "positions"))
    if "positions" in spec:
        from hookrun.capture.tokens import check_positions

        problems = check_positions(f"{key}.positions", spec["positions"])
        if problems:
            return problems
    op = spec.get("op")
    if op not in ARGS:
        return check_choice(f"{key}.op", op, ARGS, f"one of {', '.join(ARGS)} or _target_")
    required, optional = ARGS[op]
    problems = [f"{key}: op {op} needs {r!r}, e.g. {{op: {op}, {r}: 2}}" for r in sorted(required - set(spec))]
    for extra in sorted(set(spec) - required - optional - COMMON):
        problems.append(f"{key}.{extra}: op {op} takes no {extra!r}; it takes {sorted(required | optional)}")
    if op == "replace":
        sources = [s for s in ("value", "file", "store") if s in spec]
        if len(sources) != 1:
            problems.append(f"{key}: op replace needs exactly one of value, file or store (got {sources or 'none'})")
        if "file" in spec and not Path(spec["file"]).exists():
            problems.append(f"{key}.file: {spec['file']!r} does not exist; give a .npy or .pt file")
    problems += _type_problems(key, op, spec)
    if op == "clamp" and "min" not in spec and "max" not in spec:
        problems.append(f"{key}: op clamp needs min, max or both")
    elif op == "clamp" and _is_number(spec.get("min")) and _is_number(spec.get("max")) and spec["min"] > spec["max"]:
        problems.append(f"{key}: op clamp with min {spec['min']} > max {spec['max']} sets every value to max; "
                        "swap them (min <= max)")
    if op == "noise" and "std" in spec and not (isinstance(spec["std"], (int, float)) and spec["std"] >= 0):
        problems.append(f"{key}.std: {spec['std']!r} must be a number >= 0")
    return problems


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_index(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or \
        (isinstance(v, list) and all(isinstance(i, int) for i in v)) or \
        (isinstance(v, dict) and set(v) <= {"start", "stop", "step"})


def _numbers(v) -> bool:
    return _is_number(v) or (isinstance(v, list) and all(_numbers(x) for x in v))


ARG_TYPES = {  # arg -> (test, what it must be)
    "value": (_numbers, "a number (or, for replace, a nested list of numbers)"),
    "min": (_is_number, "a number"), "max": (_is_number, "a number"), "mean": (_is_number, "a number"),
    "dim": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer dim"),
    "index": (_is_index, "an int, a list of ints or {start, stop, step}"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "call": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
}


def _type_problems(key: str, op: str, spec: dict) -> List[str]:
    """Arguments of the wrong type ({op: scale, value: abc}) and replace sources that are not stores."""
    problems = [f"{key}.{arg}: {spec[arg]!r} is not {what}" for arg, (ok, what) in ARG_TYPES.items()
                if arg in spec and not ok(spec[arg])]
    if op in ("scale", "add") and "value" in spec and not _is_number(spec["value"]):
        problems = [p for p in problems if not p.startswith(f"{key}.value")]
        problems.append(f"{key}.value: {spec['value']!r} is not a number; op {op} takes value: 2.0")
    if op == "replace" and "store" in spec:
        from hookrun.read.captures import find_store

        try:
            find_store(spec["store"])
        except FileNotFoundError:
            problems.append(f"{key}.store: {spec['store']!r} is not a hookrun store or run dir; give the run dir "
                            "(or its captures.zarr) of a finished run to patch from")
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
    (hooks.<name>.edit[<i>])."""

    def __init__(self, spec: dict, key: str):
        spec = dict(to_plain(spec))
        self.key = key
        self.roles = [str(r) for r in as_list(spec.pop("roles", None))]
        self.positions = spec.pop("positions", None)
        if "_target_" in spec:
            self.fn: Callable = target_of(spec.pop("_target_"))
            self.args = spec
            self.op = "_target_"
            return
        self.op = spec.pop("op")
        self.args = spec
        if self.op == "replace":
            self.source = _ReplaceSource(spec)

    def applies_to(self, role: str) -> bool:
        return not self.roles or any(role == r or role.startswith(r + ".") for r in self.roles)

    def __call__(self, t: torch.Tensor, site: Site) -> torch.Tensor:
        if self.positions is None:
            return self._op(t, site)
        from hookrun.capture import tokens

        key = f"{self.key}.positions"
        info = tokens.require(site.tokens, key)
        mask = tokens.position_mask(t, info, self.positions, key)  # raises unless t is [batch, sequence, ...]
        if self.op == "replace" and self.source.cap is not None:  # the source's rows of the same tokens
            cols = tokens.columns(info, tokens.positions_spec(self.positions)[0], key)
            return self.source.at_positions(t, site, info, cols)
        return torch.where(mask, self._op(t, site), t)

    def _op(self, t: torch.Tensor, site: Site) -> torch.Tensor:
        a = self.args
        if self.op == "_target_":
            return self.fn(t, **a)
        if self.op == "scale":
            return t * a["value"]
        if self.op == "add":
            return t + a["value"]
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
        if self.op == "replace":
            return self.source.value_for(t, site)
        raise AssertionError(self.op)


class _ReplaceSource:
    """The replacement values of a `replace` edit: a constant, a file, or another run's captures."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.constant: Optional[torch.Tensor] = None
        self.cap = None
        if "value" in spec:
            self.constant = torch.as_tensor(spec["value"])
        elif "file" in spec:
            path = Path(spec["file"])
            self.constant = torch.load(path) if path.suffix == ".pt" else torch.from_numpy(np.load(path))
        else:
            from hookrun.read.captures import open as open_captures

            self.cap = open_captures(spec["store"])
            self._cache: Dict[tuple, torch.Tensor] = {}

    def value_for(self, t: torch.Tensor, site: Site) -> torch.Tensor:
        if self.constant is not None:
            return self.constant.to(device=t.device, dtype=t.dtype).expand_as(t).clone()
        layer, role = self.spec.get("layer", site.layer), self.spec.get("role", site.role)
        call = self.spec.get("call", site.call)
        rows = self.cap.rows(hook=self.spec.get("hook"), layer=layer, role=role, call=call,
                             sample_start=site.sample_start)
        if len(rows) != 1:
            raise LookupError(
                f"replace: the source store {self.spec['store']} has {len(rows)} captures for "
                f"layer={layer} role={role} call={call} samples {site.sample_start}..{site.sample_stop}; "
                "it needs exactly one (same data, batch size and hook as this run)"
            )
        value = torch.from_numpy(self.cap.read_row(rows.iloc[0]))
        if value.shape != t.shape:
            raise ValueError(f"replace: source capture has shape {list(value.shape)}, this tensor {list(t.shape)}")
        return value.to(device=t.device, dtype=t.dtype)


    def at_positions(self, t: torch.Tensor, site: Site, info, cols: torch.Tensor) -> torch.Tensor:
        """`t` with the source run's per-token rows of the same (sample, position) at `cols` [B, P]."""
        layer, role = self.spec.get("layer", site.layer), self.spec.get("role", site.role)
        hook, call = self.spec.get("hook"), self.spec.get("call", site.call)
        key = (hook, layer, role, call)
        if key not in self._cache:
            self._cache[key] = self.cap.token_rows(hook=hook, layer=layer, role=role, call=call)
        lookup = self._cache[key]
        samples = torch.arange(site.sample_start, site.sample_stop)[:, None].expand_as(cols.cpu())
        positions = (cols - info.first[:, None]).cpu()
        wanted = list(zip(samples.reshape(-1).tolist(), positions.reshape(-1).tolist()))
        missing = [w for w in wanted if w not in lookup.index]
        if missing:
            raise LookupError(f"replace: the source store {self.spec['store']} has no token row of {layer} {role} for "
                              f"(sample, position) {missing[:3]}; it needs a per-token capture of the same corpus "
                              "(no exclude_special there, or the same positions stored)")
        rows = lookup.loc[wanted, "row"].to_numpy()
        value = torch.from_numpy(self.cap.read_rows(lookup.attrs["array"], rows))
        if value.shape[1:] != t.shape[2:]:
            raise ValueError(f"replace: source rows have shape {list(value.shape[1:])}, this tensor's tokens "
                             f"{list(t.shape[2:])}")
        value = value.to(device=t.device, dtype=t.dtype).reshape(*cols.shape, *t.shape[2:])
        out = t.clone()
        out[torch.arange(len(cols), device=t.device)[:, None], cols] = value
        return out


def compile_edits(specs, hook: str) -> List[Edit]:
    """The edit list of hook `hook`, compiled in order."""
    return [Edit(s, f"hooks.{hook}.edit[{i}]") for i, s in enumerate(as_list(specs))]


class EditError(RuntimeError):
    """An edit could not apply to the tensor it met (a dim it lacks, a shape it cannot take); `key` names the
    edit (hooks.<name>.edit[<i>])."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


def apply(edits: List[Edit], t: torch.Tensor, site: Site) -> torch.Tensor:
    """`t` after every edit that applies to its role, in order; an edit that fails, or returns another shape or
    dtype (what flows on must still fit the model), raises EditError naming the edit, the site and the batch."""
    from hookrun.capture.tokens import TokenError

    for e in edits:
        if not e.applies_to(site.role):
            continue
        if e.op == "zero" and "dim" in e.args and not -t.dim() <= e.args["dim"] < t.dim():
            raise EditError(f"{e.key}.dim", f"{e.key}.dim: zero along dim {e.args['dim']} of {where(site, t)}, which "
                            f"it lacks; use a dim in 1..{t.dim() - 1}")
        try:
            out = e(t, site)
        except TokenError as err:
            raise EditError(f"{e.key}.positions", f"{err} (at {where(site, t)})") from err
        except Exception as err:  # noqa: BLE001 - any failure of an edit names the edit and where it met the tensor
            raise EditError(e.key, f"{e.key}: {e.op} on {where(site, t)} failed: {type(err).__name__}: {err}") from err
        if not isinstance(out, torch.Tensor) or out.shape != t.shape or out.dtype != t.dtype:
            got = f"{list(out.shape)} {str(out.dtype).replace('torch.', '')}" if isinstance(out, torch.Tensor) else \
                type(out).__name__
            raise EditError(e.key, f"{e.key}: {e.op} on {where(site, t)} returned {got}; an edit must keep the "
                            "shape and dtype of what it edits (the model goes on with it)")
        t = out
    return t
