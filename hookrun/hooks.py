"""Hook kinds -> PyTorch registrations, the roles each records, and HookSet, the owner of every handle.

    plans = build_plans(model, cfg.hooks, device)         # resolve layers, compile edits
    with HookSet(model, plans, sink=store.submit) as hs:  # registers; removes in __exit__
        for batch in batches:
            args, kwargs = hs.begin_batch(info, args, kwargs)
            out = model(*args, **kwargs); loss.backward()
            hs.end_batch()

Every capture goes to `sink(Capture)` detached; the sink copies it off the hot path.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from hookrun import edits as edit_ops
from hookrun import tokens as tok
from hookrun.config import as_list, suggest, to_plain
from hookrun.select import ROOT, module_names, parameter_names, resolve
from hookrun.shrink import Shrink, check_spec as check_shrink


@dataclass(frozen=True)
class Kind:
    """A hook kind: the role families it records, its default capture, and what it attaches to."""

    api: str
    roles: Tuple[str, ...]
    default: Tuple[str, ...]
    gradient: bool
    target: str  # module | parameter | input


KINDS: Dict[str, Kind] = {
    "forward_pre": Kind("Module.register_forward_pre_hook(with_kwargs=True)", ("input", "kwarg"), ("input", "kwarg"), False, "module"),
    "forward": Kind("Module.register_forward_hook(with_kwargs=True)", ("input", "kwarg", "output"), ("output",), False, "module"),
    "backward": Kind("Module.register_full_backward_hook", ("grad_input", "grad_output"), ("grad_input", "grad_output"), True, "module"),
    "backward_pre": Kind("Module.register_full_backward_pre_hook", ("grad_output",), ("grad_output",), True, "module"),
    "output_grad": Kind("Tensor.register_hook on the module output", ("grad",), ("grad",), True, "module"),
    "param_grad": Kind("Tensor.register_post_accumulate_grad_hook", ("grad",), ("grad",), True, "parameter"),
    "input_grad": Kind("Tensor.register_hook on the model inputs", ("grad",), ("grad",), True, "input"),
}


class HookError(RuntimeError):
    """A hook could not do its work (bad module output, broken backward hook, ...)."""


@dataclass
class Capture:
    """One captured tensor, handed by a hook to the store, with where it was captured."""

    site: edit_ops.Site
    kind: str
    tensor: torch.Tensor
    per_sample: bool  # axis 0 of the tensor is the batch's samples (or tokens); else one record per batch
    unit: str = "sample"  # what a row of axis 0 is: sample | token (a real token of a text batch) | batch


@dataclass(frozen=True)
class BatchInfo:
    """The batch being run: its number and sample range."""

    index: int
    start: int
    stop: int
    batched: bool
    tokens: Optional[tok.TokenInfo] = None  # text batches: real and stored tokens, on the device

    @property
    def size(self) -> int:
        return self.stop - self.start


def check_spec(name: str, hook, has_loss: bool) -> List[str]:
    """Problems with one `hooks.<name>` entry that need no model."""
    key = f"hooks.{name}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name or ""):
        return [f"{key}: {name!r} cannot name a store group; use letters, digits, '-' or '_' (starting with a "
                "letter or digit)"]
    kind = KINDS.get(hook.kind)
    if kind is None:
        return [f"{key}.kind: {hook.kind!r} is unknown; use one of {', '.join(KINDS)}{suggest(hook.kind, KINDS)}"]
    problems = []
    if kind.gradient and not has_loss:
        problems.append(f"{key}.kind: {hook.kind} needs a backward pass but loss is null; "
                        "set loss (e.g. loss=sum) or use a forward kind")
    if kind.target == "input" and [str(x) for x in as_list(hook.layers)] not in ([], [ROOT]):
        problems.append(f"{key}.layers: input_grad hooks the model's inputs; leave layers unset (or {ROOT}) "
                        "and pick inputs with capture: [grad.0] / [grad.<name>]")
    if kind.target != "input" and not as_list(hook.layers):
        problems.append(f"{key}.layers: empty; name the {kind.target}s to hook, e.g. layers=conv1 or ['layer*.conv?']")
    for role in as_list(to_plain(hook.capture)):
        if str(role).split(".")[0] not in kind.roles:
            problems.append(f"{key}.capture: {role!r} is not a role of {hook.kind}; it records "
                            f"{', '.join(r + '[.<i>]' for r in kind.roles)}{suggest(role, kind.roles)}")
    problems += check_shrink(key, hook)
    return problems


@dataclass
class HookPlan:
    """One `hooks` entry resolved against a model: targets, roles to record, compiled edits."""

    name: str
    kind: str
    targets: Dict[str, object]  # layer name -> module | parameter | None (inputs)
    capture: List[str]
    edits: List[edit_ops.Edit]
    shrink: Shrink

    def wants(self, role: str) -> bool:
        return any(role == p or role.startswith(p + ".") or fnmatch.fnmatchcase(role, p) for p in self.capture)


def layer_problems(model: torch.nn.Module, hooks_cfg) -> List[str]:
    """Problems with every valid hook's layers on this model (patterns that match nothing, bad names)."""
    modules, params = module_names(model), parameter_names(model)
    problems = []
    for name, h in hooks_cfg.items():
        kind = KINDS.get(h.kind)
        if kind is None or kind.target == "input":
            continue
        pool = modules if kind.target == "module" else params
        names, found = resolve(to_plain(h.layers), pool, kind.target, f"hooks.{name}.layers")
        problems += found + [f"hooks.{name}.layers: {n!r} cannot be a store key (it holds '/' or is '.' / '..' "
                             "or starts with '__'); rename the module" for n in names
                             if "/" in n or "\\" in n or n in (".", "..", "zarr.json") or n.startswith("__")]
    return problems


def build_plans(model: torch.nn.Module, hooks_cfg, device: torch.device) -> List[HookPlan]:
    """Every hook resolved on the model, edits compiled (after check() and layer_problems() found nothing)."""
    modules, params = module_names(model), parameter_names(model)
    plans = []
    for name, h in hooks_cfg.items():
        kind = KINDS[h.kind]
        if kind.target == "input":
            targets = {ROOT: None}
        else:
            pool = modules if kind.target == "module" else params
            targets = {n: pool[n] for n in resolve(to_plain(h.layers), pool, kind.target, name)[0]}
        capture = [str(r) for r in as_list(to_plain(h.capture))] or list(kind.default)
        plans.append(HookPlan(name, h.kind, targets, capture, edit_ops.compile_edits(h.edit, device),
                              Shrink(h.dtype, h.reduce, h.select)))
    return plans


def flatten(obj, prefix: str) -> List[Tuple[str, torch.Tensor]]:
    """(role, tensor) for every tensor in a tensor / tuple / list / dict / dataclass (ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, Mapping):
        items = list(obj.items())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (tuple, list)):
        items = list(enumerate(obj))
    else:
        return []
    return [pair for k, v in items for pair in flatten(v, f"{prefix}.{k}")]


def rebuild(obj, prefix: str, new: Dict[str, torch.Tensor]):
    """`obj` with the tensors at the roles in `new` replaced, same container types."""
    if isinstance(obj, torch.Tensor):
        return new.get(prefix, obj)
    if isinstance(obj, Mapping):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = rebuild(v, f"{prefix}.{k}", new)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: rebuild(getattr(obj, f.name), f"{prefix}.{f.name}", new)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (tuple, list)):
        items = [rebuild(v, f"{prefix}.{i}", new) for i, v in enumerate(obj)]
        if hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def input_roles(args, kwargs) -> List[Tuple[str, torch.Tensor]]:
    """Roles of a call's arguments: input.<i> for positional, kwarg.<name> for keyword."""
    return flatten(tuple(args), "input") + [p for k, v in (kwargs or {}).items() for p in flatten(v, f"kwarg.{k}")]


class HookSet:
    """Registers the hooks of every plan on the model and owns every handle until remove()."""

    def __init__(self, model: torch.nn.Module, plans: List[HookPlan], sink: Callable[[Capture], None],
                 inputs_require_grad: bool = False):
        self.model, self.plans, self.sink = model, plans, sink
        self.inputs_require_grad = inputs_require_grad  # make inputs autograd leaves even without input_grad
        self.handles: list = []
        self.tensor_handles: list = []
        self.batch: Optional[BatchInfo] = None
        self.calls: Dict[tuple, int] = defaultdict(int)  # (hook, layer) -> forward calls this batch
        self.backward_calls: Dict[tuple, int] = defaultdict(int)  # (hook, layer) -> backward calls this batch
        self.forward_counts: Dict[str, int] = defaultdict(int)  # layer -> forward calls this batch

    # -- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> "HookSet":
        try:
            self.attach()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def attach(self) -> None:
        counted = set()
        for plan in self.plans:
            for layer, target in plan.targets.items():
                if plan.kind in ("backward", "backward_pre") and layer not in counted:
                    counted.add(layer)  # backward hooks map their firings back to forward calls
                    self.handles.append(target.register_forward_pre_hook(self._counter(layer)))
                if plan.kind != "input_grad":  # input_grad hooks are put on each batch's inputs
                    self.handles.append(self._register(plan, layer, target))

    def _register(self, plan: HookPlan, layer: str, target):
        """The one PyTorch registration of a plan's kind on one module or parameter."""
        if plan.kind == "forward_pre":
            return target.register_forward_pre_hook(self._forward_pre(plan, layer), with_kwargs=True)
        if plan.kind == "forward":
            return target.register_forward_hook(self._forward(plan, layer), with_kwargs=True)
        if plan.kind == "output_grad":
            return target.register_forward_hook(self._output_grad(plan, layer), with_kwargs=True)
        if plan.kind == "backward":
            return target.register_full_backward_hook(self._backward(plan, layer))
        if plan.kind == "backward_pre":
            return target.register_full_backward_pre_hook(self._backward_pre(plan, layer))
        return target.register_post_accumulate_grad_hook(self._param_grad(plan, layer))

    def remove(self) -> None:
        for h in self.handles + self.tensor_handles:
            h.remove()
        self.handles, self.tensor_handles = [], []
        self.batch = None

    def begin_batch(self, info: BatchInfo, args: list, kwargs: dict) -> Tuple[list, dict]:
        """Start a batch; returns the inputs, made to require grad where input_grad hooks need it."""
        self.batch = info
        self.calls.clear()
        self.backward_calls.clear()
        self.forward_counts.clear()
        grad_plans = [p for p in self.plans if p.kind == "input_grad"]
        if (grad_plans or self.inputs_require_grad
                or any(p.kind == "backward" and p.wants("grad_input") for p in self.plans)):
            args, kwargs = self._inputs_requiring_grad(args, kwargs, grad_plans)
        return args, kwargs

    def end_batch(self) -> None:
        for h in self.tensor_handles:
            h.remove()
        self.tensor_handles = []

    # -- shared -------------------------------------------------------------------------------
    def _emit(self, plan: HookPlan, layer: str, role: str, call: int, t: torch.Tensor, info: BatchInfo,
              site: Optional[edit_ops.Site] = None) -> None:
        """Hand what the plan keeps of `t` to the sink, with where it was captured.

        On text batches a [batch, sequence, ...] capture (or an attention pattern) keeps one row per
        stored token, gathered here on the device: pads never leave it (see hookrun.tokens)."""
        t, shrink = t.detach(), plan.shrink
        tokens = info.tokens
        if plan.kind != "param_grad" and (shrink.heads is not None or shrink.positions is not None):
            tokens = tokens if tokens is not None else tok.TokenInfo.dense(t.shape, t.device)
            if shrink.heads is not None:
                t = tok.heads(t, tokens, shrink.heads, f"hooks.{plan.name}.select.heads")
            if shrink.positions is not None:
                t = tok.at_positions(t, tokens, shrink.positions, f"hooks.{plan.name}.select.positions")
        kept = shrink(t)
        per_token = False
        if info.tokens is not None and shrink.positions is None and plan.kind != "param_grad":
            kept, per_token = tok.per_token(kept, info.tokens)
        per_sample = per_token or (info.batched and plan.kind != "param_grad" and kept.dim() >= 1
                                   and t.dim() >= 1 and t.shape[0] == info.size)
        site = site or self._site(plan, layer, role, call, info)
        self.sink(Capture(site, plan.kind, kept, per_sample, "token" if per_token else "sample" if per_sample else "batch"))

    @staticmethod
    def _site(plan, layer, role, call, info: BatchInfo) -> edit_ops.Site:
        return edit_ops.Site(plan.name, layer, role, call, info.index, info.start, info.stop, info.tokens)

    def _edit_and_emit(self, plan, layer, role, call, t, info) -> torch.Tensor:
        """Apply the plan's edits to `t`, record it if wanted, return what flows on."""
        site = self._site(plan, layer, role, call, info)
        if plan.edits:
            t = edit_ops.apply(plan.edits, t, site)
        if plan.wants(role):
            self._emit(plan, layer, role, call, t, info, site)
        return t

    def _edit_all(self, plan, layer, call, items, info) -> Dict[str, torch.Tensor]:
        """Edit and record each (role, tensor); returns {role: new tensor} for those an edit replaced."""
        new = {}
        for role, t in items:
            out = self._edit_and_emit(plan, layer, role, call, t, info)
            if out is not t:
                new[role] = out
        return new

    def _edit_grads(self, plan, layer, prefix, call, grads, info) -> Optional[tuple]:
        """Edit and record a tuple of gradients; the new tuple if an edit replaced one, else None."""
        new = self._edit_all(plan, layer, call, [(f"{prefix}.{i}", g) for i, g in enumerate(grads) if g is not None], info)
        return tuple(new.get(f"{prefix}.{i}", g) for i, g in enumerate(grads)) if new else None

    @staticmethod
    def _output_items(plan: HookPlan, layer: str, output) -> List[Tuple[str, torch.Tensor]]:
        items = flatten(output, "output")
        if not items:
            raise HookError(f"hooks.{plan.name}: layer {layer!r} returned {type(output).__name__}, "
                            "not a tensor or a container of tensors; hook a submodule that returns tensors")
        return items

    def _next_call(self, plan: HookPlan, layer: str) -> int:
        call = self.calls[plan.name, layer]
        self.calls[plan.name, layer] += 1
        return call

    def _counter(self, layer: str):
        def count(module, args):
            self.forward_counts[layer] += 1
        return count

    def _backward_call(self, plan: HookPlan, layer: str) -> int:
        """Backward hooks fire in reverse call order: map the k-th firing to its forward call."""
        k = self.backward_calls[plan.name, layer]
        self.backward_calls[plan.name, layer] += 1
        return max(self.forward_counts[layer] - 1 - k, 0)

    def _grad_hook(self, plan: HookPlan, layer: str, role: str, call: int, info: BatchInfo):
        def hook(grad):
            if grad is None:
                return None
            new = self._edit_and_emit(plan, layer, role, call, grad, info)
            return new if new is not grad else None
        return hook

    # -- one factory per kind -------------------------------------------------------------------
    def _forward_pre(self, plan: HookPlan, layer: str):
        def hook(module, args, kwargs):
            info = self.batch
            if info is None:
                return None
            new = self._edit_all(plan, layer, self._next_call(plan, layer), input_roles(args, kwargs), info)
            if not new:
                return None
            return rebuild(tuple(args), "input", new), {k: rebuild(v, f"kwarg.{k}", new) for k, v in kwargs.items()}
        return hook

    def _forward(self, plan: HookPlan, layer: str):
        def hook(module, args, kwargs, output):
            info = self.batch
            if info is None:
                return None
            call = self._next_call(plan, layer)
            for role, t in input_roles(args, kwargs):
                if plan.wants(role):
                    self._emit(plan, layer, role, call, t, info)
            new = self._edit_all(plan, layer, call, self._output_items(plan, layer, output), info)
            return rebuild(output, "output", new) if new else None
        return hook

    def _output_grad(self, plan: HookPlan, layer: str):
        def hook(module, args, kwargs, output):
            info = self.batch
            if info is None or not torch.is_grad_enabled():
                return None
            call = self._next_call(plan, layer)
            for role, t in self._output_items(plan, layer, output):
                if t.requires_grad:
                    grad_role = "grad" + role[len("output"):]
                    self.tensor_handles.append(t.register_hook(self._grad_hook(plan, layer, grad_role, call, info)))
            return None
        return hook

    def _backward(self, plan: HookPlan, layer: str):
        def hook(module, grad_input, grad_output):
            info = self.batch
            if info is None:
                return None
            call = self._backward_call(plan, layer)
            for i, g in enumerate(grad_output):
                if g is not None and plan.wants(f"grad_output.{i}"):
                    self._emit(plan, layer, f"grad_output.{i}", call, g, info)
            return self._edit_grads(plan, layer, "grad_input", call, grad_input, info)
        return hook

    def _backward_pre(self, plan: HookPlan, layer: str):
        def hook(module, grad_output):
            info = self.batch
            if info is None:
                return None
            return self._edit_grads(plan, layer, "grad_output", self._backward_call(plan, layer), grad_output, info)
        return hook

    def _param_grad(self, plan: HookPlan, layer: str):
        def hook(param):
            info = self.batch
            if info is None or param.grad is None:
                return
            new = self._edit_and_emit(plan, layer, "grad", 0, param.grad, info)
            if new is not param.grad:
                param.grad = new
        return hook

    def _inputs_requiring_grad(self, args, kwargs, grad_plans):
        """Floating inputs as fresh leaves that require grad, with each input_grad plan's hook on them."""
        def leaf(role, t):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                return t
            t = t.detach().requires_grad_(True)
            for plan in grad_plans:
                grad_role = "grad." + role.split(".", 1)[1]
                if plan.wants(grad_role):
                    self.tensor_handles.append(t.register_hook(self._grad_hook(plan, ROOT, grad_role, 0, self.batch)))
            return t

        args = [leaf(f"input.{i}", a) for i, a in enumerate(args)]
        kwargs = {k: leaf(f"kwarg.{k}", v) for k, v in kwargs.items()}
        return args, kwargs


def hook_count(model: torch.nn.Module) -> int:
    """How many module hooks are registered anywhere in the model (0 after a clean run)."""
    n = 0
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            n += len(getattr(m, attr))
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        n += len(p._backward_hooks or {})
    return n
