"""Targets: the layer names a method reads or patches (standard, `blocks.3.attn.heads`, or native module names with
a role) resolved to where their tensor is met, and hooks that read or replace that tensor there (in a HookScope),
for patching, attribution, circuits, the lens and dictionaries.

    targets, problems = resolve_sites(model, ["blocks.0-3.attn.heads"], None, "patching.sites.layers")
    with HookScope() as scope:
        attach(scope, model, targets, [fn, ...])   # fn(value) -> value (kept) or a new value (written back)

A standard name resolves through the model's anatomy (hookrun.capture.anatomy) to a Point: its module, side (output
| input), the element of a tuple and the view (heads split to [..., heads, d_head], a slice of a fused q/k/v, OPT's
flattened MLP rows as [B, T, ...]); a standard site has one value, so it takes no role. A native name is a module
whose `role` tensor is the site (output: what it returns, a tuple's first element; input: its first argument), as
it was before the anatomy.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hookrun.capture.anatomy import AnatomyError, Point, anatomy, is_standard
from hookrun.capture.layers import match, module_names, resolve
from hookrun.capture.scope import HookScope
from hookrun.config.checks import as_list

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Target:
    """One site: `name` (the standard name, or the module's), the module and the Point its tensor is met at."""

    name: str
    module: nn.Module
    point: Point
    standard: bool

    @property
    def heads(self) -> int:
        """The heads a standard site is split into (0: not split; a native site: unknown until its tensor)."""
        return self.point.heads if self.standard else 0


def resolve_sites(model: nn.Module, patterns, role: Optional[str], key: str,
                  role_key: str = "role") -> Tuple[List[Target], List[str]]:
    """(targets, problems): standard patterns through the anatomy (in the order given, each pattern's names in
    model order), then native ones as module names (model order) with `role` (output when None). A standard-looking
    pattern the anatomy refuses but the model's own module names match is native (as hooks take it). A role given
    with a standard name is a problem naming role_key."""
    patterns = [str(p) for p in as_list(patterns)]
    named = module_names(model)
    anat, why = _anatomy(model)
    standard = [p for p in patterns if is_standard(p)]
    problems: List[str] = []
    targets: List[Target] = []
    names: List[str] = []
    for pattern in list(standard):  # in the order given (blocks.0.resid_pre before blocks.*), each in model order
        try:
            if anat is None:
                raise why
            names += [n for n in anat.names(pattern, key) if n not in names]
        except AnatomyError as err:  # a model whose own modules are named blocks.N... keeps them (as hooks do)
            if match(pattern, named):
                standard.remove(pattern)
            else:
                problems.append(str(err))
    native = [p for p in patterns if p not in standard]
    if standard and role is not None:
        problems.append(f"{role_key}: {role!r} with the standard name {standard[0]!r} in {key}; a standard site "
                        "has one value (blocks.N.resid_pre is a block's input, blocks.N.attn.heads the output "
                        f"projection's input...): drop {role_key}, or name a native module for a role")
    if not problems:
        targets += [Target(n, named[p.module], p, True) for n in names for p in [anat.point(n, key)]]
    if native or not patterns:
        names, found = resolve(native, named, "module", key)
        problems += found
        side = role or "output"
        targets += [Target(n, named[n], Point(n, n, side), False) for n in names]
    return targets, problems


def _anatomy(model: nn.Module):
    """(the model's anatomy, None) or (None, the AnatomyError saying why it has none)."""
    try:
        return anatomy(model), None
    except AnatomyError as err:
        return None, err


def patterns_standard(patterns) -> bool:
    """Whether any of the layer patterns is a standard name."""
    return any(is_standard(str(p)) for p in as_list(patterns))


class Batch:
    """The (batch, sequence) shape of the forward running now, kept by a pre-hook on the model: the rows a
    standard site of flattened tokens (OPT's MLP, [B*T, d]) is unflattened by."""

    def __init__(self):
        self.shape: Optional[Tuple[int, int]] = None

    def __call__(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args and isinstance(args[0], torch.Tensor):
            x = args[0]
        self.shape = tuple(x.shape[:2]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else None


def attach(scope: HookScope, model: nn.Module, targets: Sequence[Target], fns: Sequence[Fn], error=ValueError,
           batch: Optional["Batch"] = None) -> None:
    """Hooks in `scope` applying fns[i] to targets[i]'s value on every forward (what fn returns replaces the value
    unless it is the value itself). `error`: the exception class of a module that gives no tensor there; `batch`: a
    Batch the caller keeps up to date (else a pre-hook on the model keeps one)."""
    if batch is None:
        batch = Batch()
        scope.pre(model, batch, with_kwargs=True)
    shape = lambda: batch.shape  # noqa: E731 - a standard site of flattened tokens is unflattened by it
    for target, fn in zip(targets, fns):
        scope.value(target.module, target.point, fn, shape if target.standard else None, error, target.name)


def heads_problems(model: nn.Module, targets: Sequence[Target], key: str) -> List[str]:
    """Sites of a heads grid that are not split by head. A standard site is when the anatomy splits it
    (blocks.N.attn.heads, .attn.q/k/v); a native one when it is the same tensor as such a site (the attention output
    projection's input, a q/k/v projection's output); a native site of a model without an anatomy is checked at its
    first tensor. The attention pattern is no per-token site. A grid's heads are one count (q and k of GQA differ)."""
    problems = []
    anat = _anatomy(model)[0]
    by_native = _native_head_sites(anat) if anat is not None and any(
        not t.heads and not t.standard for t in targets) else {}
    for t in targets:
        if t.standard and t.name.endswith(".attn.pattern"):
            problems.append(f"{key}: {t.name} is the attention pattern [batch, heads, query, key], not a per-token "
                            f"site; patch heads at blocks.{t.point.layer}.attn.heads (or .attn.q / .k / .v)")
            continue
        if t.heads or (not t.standard and (anat is None or (t.point.module, t.point.role) in by_native)):
            continue
        block = t.point.layer if t.standard else _block_of(anat, t.point.module)
        if block is None:
            block = 0
        heads = f"blocks.{block}.attn.heads"
        native = ""
        if anat is not None and anat.block_modules(block)["attn_out"]:
            native = f", or natively layers: [{anat.block_modules(block)['attn_out']}], role: input"
        what = f"{t.name} {t.point.role}" if not t.standard else t.name
        problems.append(f"{key}: {what} is not split into heads ({'the standard site ' if t.standard else ''}"
                        f"{'is one value of d_model features' if t.standard else 'its features are no heads side by side'}"
                        f"); patch heads at the input of the attention output projection (layers: [{heads}]{native}), "
                        "or drop heads for a layers x positions grid")
    counts = {t.heads for t in targets if t.heads}
    if len(counts) > 1:
        problems.append(f"{key}: the sites have {sorted(counts)} heads (queries and grouped keys/values differ); give "
                        "sites of one head count in a grid")
    return problems


_NATIVE_HEADS: dict = {}  # id(anatomy) -> (a weak reference to it, its native head sites)


def _native_head_sites(anat) -> dict:
    """(module, role) -> the standard site split by head that is the same tensor, once an anatomy object (asking
    the anatomy for every standard site's point costs ~10 ms on a 4-block GPT-2: a grid a call)."""
    key = id(anat)
    held = _NATIVE_HEADS.get(key)
    if held is not None and held[0]() is anat:
        return held[1]
    found = {}
    for name in anat.standard_names():
        p = anat.point(name)
        if p.heads and p.view is not None:
            found[(p.module, p.role)] = p
    _NATIVE_HEADS[key] = (weakref.ref(anat, lambda _, key=key: _NATIVE_HEADS.pop(key, None)), found)
    return found


def _block_of(anat, module: str) -> Optional[int]:
    """The block a native module name is in (None outside the blocks)."""
    prefix = anat.family.blocks + "."
    if not module.startswith(prefix):
        return None
    head = module[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def n_heads(model: nn.Module, targets: Sequence[Target]) -> Optional[int]:
    """The heads of a heads grid: the standard sites' count, else the anatomy's (or the config's num_attention_heads
    for a model without one)."""
    counts = [t.heads for t in targets if t.heads]
    if counts:
        return counts[0]
    anat = _anatomy(model)[0]
    return anat.n_heads or None if anat is not None else \
        getattr(getattr(model, "config", None), "num_attention_heads", None)
