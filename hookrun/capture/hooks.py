"""Hook kinds -> PyTorch registrations, the roles each records, and HookSet, the owner of every handle.

    plans = build_plans(model, cfg.hooks)                 # resolve layers, compile edits
    with HookSet(model, plans, sink=store.submit) as hs:  # registers; removes in __exit__
        for batch in batches:
            args, kwargs = hs.begin_batch(info, args, kwargs)
            out = model(*args, **kwargs); loss.backward()
            hs.end_batch()

Every capture goes to `sink(Piece)` detached. The store's sink copies it to the host and queues it for its
writer thread, or (store.writer=sync) writes it before the hook returns.

A standard site (`blocks.3.attn.heads`, hookrun.capture.anatomy) is hooked on the module and side its Point names (a
pre-hook for input sides: resid_pre, resid_mid, mlp.hidden, heads); the hook reads the site's value from the call
(`point.read`, `point.get`), edits it, records it as role `output` (`grad` for output_grad), and writes an edited
value back into the call (`point.put`, `point.write`).
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

import torch

from hookrun.capture import edits as edit_ops
from hookrun.capture import tokens as tok
from hookrun.capture.anatomy import AnatomyError, Point, anatomy
from hookrun.capture.checks import block_number_problems
from hookrun.config.checks import ConfigError, as_list, check_choice, suggest
from hookrun.capture.layers import ROOT, module_names, parameter_names, resolve
from hookrun.capture.shrink import Shrink, ShrinkError, check_spec as check_shrink
from hookrun.capture.site import Site, where


@dataclass(frozen=True)
class Kind:
    """A hook kind: the role families it records, its default capture, whether it needs a backward pass, what
    it attaches to, and the role families its edits change (what flows on)."""

    roles: Tuple[str, ...]
    default: Tuple[str, ...]
    gradient: bool
    target: str  # module | parameter | input
    edits: Tuple[str, ...]


KINDS: Dict[str, Kind] = {  # the PyTorch registration of each: HookSet._register
    "forward_pre": Kind(("input", "kwarg"), ("input", "kwarg"), False, "module", ("input", "kwarg")),
    "forward": Kind(("input", "kwarg", "output"), ("output",), False, "module", ("output",)),
    "backward": Kind(("grad_input", "grad_output"), ("grad_input", "grad_output"), True, "module", ("grad_input",)),
    "backward_pre": Kind(("grad_output",), ("grad_output",), True, "module", ("grad_output",)),
    "output_grad": Kind(("grad",), ("grad",), True, "module", ("grad",)),  # Tensor.register_hook on the output
    "param_grad": Kind(("grad",), ("grad",), True, "parameter", ("grad",)),
    "input_grad": Kind(("grad",), ("grad",), True, "input", ("grad",)),  # Tensor.register_hook on the model inputs
}
OTHER_KIND = {"input": "forward_pre", "kwarg": "forward_pre", "grad_output": "backward_pre"}  # edits them instead


class HookError(RuntimeError):
    """A hook could not do its work (bad module output, a setting that does not fit a capture, a failed edit);
    `key` is the config key to fix when it is the config's (hooks.<name>.select.dim, hooks.<name>.edit[0])."""

    def __init__(self, message: str, key: Optional[str] = None):
        self.key = key
        super().__init__(message)


class BatchError(RuntimeError):
    """A batch failed: names the batch, its samples, what was being done (`what`) and the original error."""

    def __init__(self, message: str, what: str = ""):
        self.what = what
        super().__init__(message)


@dataclass
class Piece:
    """What a hook hands to the store's sink: the tensor it captured at one site in one batch, and how to store it
    (one piece of the site's array)."""

    site: Site
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
    fields: Optional[dict] = None  # the batch's fields by name (source: {sample: FIELD} of a patch)

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
        return check_choice(f"{key}.kind", hook.kind, KINDS)
    problems = []
    if kind.gradient and not has_loss:
        problems.append(f"{key}.kind: {hook.kind} needs a backward pass but loss is null; "
                        "set loss (e.g. loss=sum) or use a forward kind")
    if kind.target == "input" and [str(x) for x in as_list(hook.layers)] not in ([], [ROOT]):
        problems.append(f"{key}.layers: input_grad hooks the model's inputs; leave layers unset (or {ROOT}) "
                        "and pick inputs with capture: [grad.0] / [grad.<name>]")
    if kind.target != "input" and not as_list(hook.layers):
        problems.append(f"{key}.layers: empty; name the {kind.target}s to hook, e.g. layers=conv1 or ['layer*.conv?']")
    problems += block_number_problems(f"{key}.layers", [str(x) for x in as_list(hook.layers)])
    if hook.capture == [] and not as_list(hook.edit):
        problems.append(f"{key}.capture: [] stores nothing and the hook has no edit, so it does nothing; name roles "
                        "to capture, or give it an edit (capture: [] makes an edit-only hook)")
    for role in as_list(hook.capture):
        if str(role).split(".")[0] not in kind.roles:
            problems.append(f"{key}.capture: {role!r} is not a role of {hook.kind}; it records "
                            f"{', '.join(r + '[.<i>]' for r in kind.roles)}{suggest(role, kind.roles)}")
    for i, spec in enumerate(as_list(hook.edit)):
        for role in as_list(spec.get("roles")) if isinstance(spec, dict) else []:
            family = str(role).split(".")[0]
            if family not in kind.edits:
                fix = (f"; kind {OTHER_KIND[family]} edits {family}" if family in OTHER_KIND else
                       suggest(role, kind.edits))
                problems.append(f"{key}.edit[{i}].roles: {role!r} is never edited by a {hook.kind} hook, which edits "
                                f"{', '.join(r + '[.<i>]' for r in kind.edits)}{fix}")
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
    per_batch: Set[Tuple[str, str]] = field(default_factory=set)  # (layer, role) whose axis 0 is not the samples
    dictionary: Optional[object] = None  # hooks.<name>.dictionary in a run: hookrun.methods.dictionaries.DictionaryUse
    points: Dict[str, Point] = field(default_factory=dict)  # standard layer name -> where its value is met

    @property
    def site_role(self) -> str:
        """The role a standard site's one value is stored under: grad for gradient kinds, else output."""
        return "grad" if KINDS[self.kind].gradient else "output"

    def wants(self, role: str) -> bool:
        return matches(role, self.capture)

    @functools.cached_property
    def wants_inputs(self) -> bool:
        """Whether a forward hook of this plan may record an input role (input.<i>, kwarg.<name>): else its
        hook need not list them (a per-call cost, at every decoding step of a generate run)."""
        return any(p.split(".")[0] in ("input", "kwarg") or any(ch in p for ch in "*?[") for p in self.capture)


def matches(role: str, patterns) -> bool:
    """Whether a role is named by one of `patterns` (the role, a prefix of it before a '.', or a glob)."""
    return any(role == p or role.startswith(p + ".") or fnmatch.fnmatchcase(role, p) for p in patterns)


def layer_problems(model: torch.nn.Module, hooks_cfg) -> List[str]:
    """Problems with every valid hook's layers on this model (patterns that match nothing, bad names)."""
    modules, params = module_names(model), parameter_names(model)
    problems = []
    for name, h in hooks_cfg.items():
        kind = KINDS.get(h.kind)
        if kind is None or kind.target == "input":
            continue
        pool = modules if kind.target == "module" else params
        names, found = resolve(h.layers, pool, kind.target, f"hooks.{name}.layers", model)
        standard = [n for n in names if n not in pool]
        problems += found + site_problems(name, h, standard) + [f"hooks.{name}.layers: {n!r} cannot be a store key (it holds '/' or is '.' / '..' "
                             "or starts with '__'); rename the module" for n in names
                             if "/" in n or "\\" in n or n in (".", "..", "zarr.json") or n.startswith("__")]
        frozen = [n for n in names if kind.target == "parameter" and not pool[n].requires_grad]
        if frozen:
            problems.append(f"hooks.{name}.layers: {', '.join(frozen)} {'does' if len(frozen) == 1 else 'do'} not "
                            "require grad (frozen), so no gradient ever reaches it; hook trainable parameters, or "
                            "unfreeze them in the model")
    return problems


SITE_KINDS = ("forward", "forward_pre", "output_grad")  # the kinds a standard site takes


def site_problems(name: str, hook, standard: List[str]) -> List[str]:
    """A hook's kind or capture that does not fit the standard sites it names (`standard`)."""
    if not standard:
        return []
    key, shown = f"hooks.{name}", ", ".join(standard[:3]) + (" ..." if len(standard) > 3 else "")
    if hook.kind not in SITE_KINDS:
        use = ("kind: output_grad (the gradient of the site's value, role grad)" if hook.kind != "param_grad" else
               "the native parameter names (inspect=true lists them), e.g. transformer.h.0.attn.c_attn.weight")
        return [f"{key}.kind: {hook.kind} cannot hook the standard site(s) {shown}: a standard site is a value in "
                f"the forward pass, not a module's backward call; use {use}, or native module names for {hook.kind}"]
    role = "grad" if KINDS[hook.kind].gradient else "output"
    capture = [str(r) for r in as_list(hook.capture)]
    if hook.capture is not None and capture and not _wants_site(hook.kind, capture):
        return [f"{key}.capture: {capture} names no value of the standard site(s) {shown}: a standard site holds one "
                f"value, stored as role {role}; write capture: [{role}] (or leave capture unset)"]
    return []


def _wants_site(kind: str, capture: List[str]) -> bool:
    """Whether a capture list records a standard site's value (role output, grad; forward_pre's input)."""
    role = "grad" if KINDS[kind].gradient else "output"
    return matches(role, capture) or (kind == "forward_pre" and matches("input", capture))


def build_plans(model: torch.nn.Module, hooks_cfg, inputs=None) -> List[HookPlan]:
    """Every hook resolved on the model, edits compiled (after check() and layer_problems() found nothing); a
    ConfigError names what an edit's values or source run lack for this run (its `inputs`: tokenizer, corpus)."""
    modules, params = module_names(model), parameter_names(model)
    config = getattr(model, "config", None)
    n_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    plans, problems = [], []
    for name, h in hooks_cfg.items():
        kind = KINDS[h.kind]
        points: Dict[str, Point] = {}
        if kind.target == "input":
            targets = {ROOT: None}
        else:
            pool = modules if kind.target == "module" else params
            names = resolve(h.layers, pool, kind.target, name, model)[0]
            points = {n: anatomy(model).point(n) for n in names if n not in pool}
            targets = {n: pool[points[n].module] if n in points else pool[n] for n in names}
        roles = h.capture
        capture = list(kind.default) if roles is None else [str(r) for r in as_list(roles)]  # []: an edit-only hook
        site_role = "grad" if kind.gradient else "output"
        if points and roles is None and len(points) == len(targets):  # standard sites only: their one value
            capture = [site_role]
        elif points and _wants_site(h.kind, capture) and site_role not in capture:
            capture.append(site_role)
        try:
            edits = edit_ops.compile_edits(h.edit, name, n_heads, getattr(inputs, "token", None))
        except ConfigError as err:
            problems += err.problems
            continue
        problems += edit_ops.source_problems(edits, list(targets), inputs)
        plans.append(HookPlan(name, h.kind, targets, capture, edits, Shrink(h.dtype, h.reduce, h.select),
                              points=points))
    if problems:
        raise ConfigError(problems)
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


def generation_rows_error(hook: str, layer: str, role: str, shape: list) -> HookError:
    """The error of a generate run's capture whose rows cannot keep one shape from pass to pass (attention)."""
    return HookError(f"hooks.{hook}: {layer} {role} (shape {shape}) is an attention pattern or another tensor whose "
                     "rows change shape between passes of generation (the key axis grows each step); a generate run "
                     "stores per-token tensors [batch, seq, ...]: capture attention in a run without generation over "
                     "the prompts and completions (generate.max_new_tokens=0; cap.generations() has the texts)",
                     f"hooks.{hook}")


class HookSet:
    """Registers the hooks of every plan on the model and owns every handle until remove().

    Each array's unit (a row per sample, per token or per batch) is decided at its first capture and kept:
    a per-batch tensor ([1, T] position ids) stays per batch in a last batch of one sample. `observe=True`
    (the first-batch check) also records every role each hooked layer produced (`seen`), the roles its
    edits met (`edited`) and each capture's axis 0 (`axis0`)."""

    def __init__(self, model: torch.nn.Module, plans: List[HookPlan], sink: Callable[[Piece], None],
                 has_loss: bool = False, observe: bool = False):
        self.plans, self.sink = plans, sink
        # a model without trainable parameters (the seeds' y = x + 2) needs its inputs to require grad
        self.inputs_require_grad = has_loss and not any(p.requires_grad for p in model.parameters())
        self.units: Dict[tuple, str] = {}  # (hook, layer, role) -> sample | token | batch
        self.seen: Optional[Dict[tuple, Set[str]]] = defaultdict(set) if observe else None  # (hook, layer) -> roles
        self.edited: Dict[tuple, Set[str]] = defaultdict(set)  # (hook, layer) -> roles its edits met (observe)
        self.axis0: Dict[tuple, Optional[int]] = {}  # (hook, layer, role) -> axis 0 of what it kept (observe)
        self.handles: list = []
        self.tensor_handles: list = []
        self.batch: Optional[BatchInfo] = None
        self.calls: Dict[tuple, int] = defaultdict(int)  # (hook, layer) -> forward calls this batch
        self.backward_calls: Dict[tuple, int] = defaultdict(int)  # (hook, layer) -> backward calls this batch
        self.forward_counts: Dict[str, int] = defaultdict(int)  # layer -> forward calls this batch
        self.moved: Dict[torch.device, tuple] = {}  # device -> (the batch's info, it on that device)

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
        point = plan.points.get(layer)
        if point is not None:  # a standard site: a pre-hook where its value is the module's input
            factory = self._site_grad if plan.kind == "output_grad" else self._site_value
            if point.side == "input":
                return target.register_forward_pre_hook(factory(plan, layer, point), with_kwargs=True)
            return target.register_forward_hook(factory(plan, layer, point), with_kwargs=True)
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
    def _on(self, info: BatchInfo, t: torch.Tensor) -> BatchInfo:
        """The batch's info with its tokens and fields on `t`'s device (a layer a device map put on another device
        than the inputs), made once a batch and device; `info` itself where they already are."""
        tokens = info.tokens
        if tokens is None or tokens.mask.device == t.device:
            return info
        moved = self.moved.get(t.device)
        if moved is None or moved[0] is not info:
            fields = {k: v.to(t.device) if isinstance(v, torch.Tensor) else v for k, v in (info.fields or {}).items()}
            moved = self.moved[t.device] = (info, dataclasses.replace(info, tokens=tokens.to(t.device),
                                                                      fields=fields if info.fields is not None else None))
        return moved[1]

    def _saw(self, plan: HookPlan, layer: str, roles) -> None:
        if self.seen is not None:
            self.seen[plan.name, layer].update(roles)

    def _emit(self, plan: HookPlan, layer: str, role: str, call: int, t: torch.Tensor, info: BatchInfo,
              site: Optional[Site] = None) -> None:
        """Hand what the plan keeps of `t` to the sink, with where it was captured.

        On text batches a [batch, sequence, ...] capture (or an attention pattern) keeps one row per
        stored token, gathered here on the device: pads never leave it (see hookrun.capture.tokens). A setting
        that does not fit the tensor raises HookError naming its key, the site and the batch."""
        t, shrink = t.detach(), plan.shrink
        info = self._on(info, t)
        site = site or self._site(plan, layer, role, call, info)
        met, setting = t, None  # for messages: the tensor as the hook met it
        try:
            if t.layout != torch.strided:  # sparse: stored as the dense tensor it stands for
                t = t.to_dense()
            if plan.kind != "param_grad" and shrink.heads is not None:
                setting = "select.heads"
                key = f"hooks.{plan.name}.{setting}"
                t = tok.heads(t, tok.require(info.tokens, key), shrink.heads, key)
            if plan.kind != "param_grad" and shrink.positions is not None:
                setting = "select.positions"
                key = f"hooks.{plan.name}.{setting}"
                t = tok.at_positions(t, tok.require(info.tokens, key), shrink.positions, key)
            kept = shrink(t)
        except ShrinkError as err:
            key = f"hooks.{plan.name}.{err.setting}"
            raise HookError(f"{key}: {err} (at {where(site, met)})", key) from err
        except tok.TokenError as err:
            raise HookError(f"{err} (at {where(site, met)})", f"hooks.{plan.name}.{setting}") from err
        except Exception as err:  # noqa: BLE001 - named with the site; the sink's own errors are not caught here
            key = f"hooks.{plan.name}" + (f".{setting}" if setting else "")
            raise HookError(f"{key}: storing {where(site, met)} failed: {type(err).__name__}: {err}",
                            key) from err
        rows, unit = self._rows(plan, layer, role, kept, info)
        self.sink(Piece(site, plan.kind, rows, unit != "batch", unit))

    def emit_token_rows(self, plan: HookPlan, layer: str, role: str, call: int, rows: torch.Tensor,
                        info: BatchInfo) -> None:
        """Hand the sink rows already gathered one per stored token ([kept tokens, ...]): what `_emit` keeps of a
        [batch, sequence, ...] capture with no select, reduce or dtype, for a hook that computed them on those
        tokens alone (a dictionary's features).

            hookset.emit_token_rows(plan, layer, "error_norm", call, norms, info)   # norms [kept tokens]
        """
        info = self._on(info, rows)
        key = (plan.name, layer, role)
        if self.seen is not None:
            self.axis0[key] = info.size  # the [batch, sequence, ...] capture they come from follows the batch
        self.units.setdefault(key, "token")
        self.sink(Piece(self._site(plan, layer, role, call, info), plan.kind, rows.detach(), True, "token"))

    def _rows(self, plan: HookPlan, layer: str, role: str, kept: torch.Tensor, info: BatchInfo):
        """(rows to store, unit): the unit of the array (sample | token | batch) is decided at its first capture,
        and a later capture that does not have it raises HookError."""
        key = (plan.name, layer, role)
        if self.seen is not None:
            self.axis0[key] = kept.shape[0] if kept.dim() else None
        unit = self.units.get(key)
        if info.tokens is not None and info.tokens.step is not None and tok.is_attention(kept, info.tokens):
            raise generation_rows_error(plan.name, layer, role, list(kept.shape))
        if unit is None:
            unit = self.units[key] = self._unit(plan, layer, role, kept, info)
        if unit == "batch":
            return kept, unit
        if unit == "token" and info.tokens is not None:
            rows, is_token = tok.per_token(kept, info.tokens)
            if is_token:
                return rows, unit
        elif unit == "sample" and kept.dim() and kept.shape[0] == info.size:
            return kept, unit
        if unit == "token" and info.tokens is not None and info.tokens.step is not None:
            raise generation_rows_error(plan.name, layer, role, list(kept.shape))
        raise HookError(f"hooks.{plan.name}: {layer} {role} had a row per {unit} in the first batch this run "
                        f"captured it, but shape {list(kept.shape)} in batch {info.index} (samples {info.start}.."
                        f"{info.stop}, {info.size} samples); one array holds one kind of row: capture a tensor whose "
                        "axis 0 follows the batch's samples (or tokens) in every batch, or one that never does")

    @staticmethod
    def _unit(plan: HookPlan, layer: str, role: str, kept: torch.Tensor, info: BatchInfo) -> str:
        """What a row of this array is: its first capture's axis 0 against the batch, unless the first-batch
        check saw that axis 0 does not follow the batch's size (plan.per_batch)."""
        if plan.kind == "param_grad" or not kept.dim() or (layer, role) in plan.per_batch:
            return "batch"
        if info.tokens is not None and plan.shrink.positions is None and \
                (tok.is_attention(kept, info.tokens) or tok.is_tokens(kept, info.tokens)):
            return "token"
        return "sample" if info.batched and kept.shape[0] == info.size else "batch"

    @staticmethod
    def _site(plan, layer, role, call, info: BatchInfo, module_role: Optional[str] = None) -> Site:
        if module_role is not None:  # a standard site: the native module and role it stands for
            return Site(plan.name, layer, role, call, info.index, info.start, info.stop, info.tokens, info.fields,
                        plan.points[layer].module, module_role)
        return Site(plan.name, layer, role, call, info.index, info.start, info.stop, info.tokens, info.fields)

    def _edit_and_emit(self, plan, layer, role, call, t, info, module_role: Optional[str] = None) -> torch.Tensor:
        """Apply the plan's edits to `t`, record it if wanted, return what flows on (`module_role`: a standard
        site's native role)."""
        info = self._on(info, t)
        site = self._site(plan, layer, role, call, info, module_role)
        if self.seen is not None:
            self.seen[plan.name, layer].add(role)
            self.edited[plan.name, layer].add(role)
        if plan.edits:
            try:
                t = edit_ops.apply(plan.edits, t, site)
            except edit_ops.EditError as err:
                raise HookError(str(err), err.key) from err
        if plan.dictionary is not None and plan.wants(role):  # features stored instead of the activation
            return plan.dictionary(self, plan, layer, role, call, t, info) if plan.dictionary.reads(layer, role) else t
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

    # -- standard sites ---------------------------------------------------------------------------
    @staticmethod
    def _native_role(point: Point, output) -> str:
        """The native role a point reads in this call: output.<i> of a tuple output, else point.role."""
        return f"output.{point.index}" if point.side == "output" and isinstance(output, (tuple, list)) else point.role

    def _site_value(self, plan: HookPlan, layer: str, point: Point):
        """forward / forward_pre on a standard site: its value read, edited, recorded (role output), written back."""
        def hook(module, args, kwargs, output=None):
            info = self.batch
            if info is None:
                return None
            t = point.read(args, kwargs, output)
            shape = tuple(info.tokens.mask.shape) if info.tokens is not None else None
            value = point.get(t, shape)
            new = self._edit_and_emit(plan, layer, "output", self._next_call(plan, layer), value, info,
                                      self._native_role(point, output))
            if new is value:
                return None
            written = point.write(args, kwargs, output, point.put(t, new, shape))
            return written
        return hook

    def _site_grad(self, plan: HookPlan, layer: str, point: Point):
        """output_grad on a standard site: the gradient of its value (role grad), edits on it flowing back."""
        def hook(module, args, kwargs, output=None):
            info = self.batch
            if info is None or not torch.is_grad_enabled():
                return None
            t = point.read_grad(args, kwargs, output)
            if not t.requires_grad:
                return None
            call = self._next_call(plan, layer)
            shape = tuple(info.tokens.mask.shape) if info.tokens is not None else None
            native = self._native_role(point, output)
            native = "grad" + native[len("output"):] if native.startswith("output") else f"grad.{native}"

            def grad_hook(grad):
                value = point.get_grad(grad, shape)  # a scaled write's site: the gradient over the scale
                new = self._edit_and_emit(plan, layer, "grad", call, value, info, native)
                return None if new is value else point.put_grad(grad, new, shape)
            self.tensor_handles.append(t.register_hook(grad_hook))
            return None
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
            for role, t in input_roles(args, kwargs) if plan.wants_inputs or self.seen is not None else ():
                self._saw(plan, layer, [role])
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
            self._saw(plan, layer, [f"grad_output.{i}" for i, g in enumerate(grad_output) if g is not None])
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
                self._saw(plan, ROOT, [grad_role])
                if plan.wants(grad_role):
                    self.tensor_handles.append(t.register_hook(self._grad_hook(plan, ROOT, grad_role, 0, self.batch)))
            return t

        args = [leaf(f"input.{i}", a) for i, a in enumerate(args)]
        kwargs = {k: leaf(f"kwarg.{k}", v) for k, v in kwargs.items()}
        return args, kwargs


def replacing(scope, plan: HookPlan, layer: str, role: str, fn: Callable[[torch.Tensor], torch.Tensor]):
    """A forward hook in `scope` (a hookrun.capture.scope.HookScope) putting fn(t) in place of `role` of one of the
    plan's layers (a standard site: its value, on its module and side); returns the handle.

        with HookScope() as scope:
            replacing(scope, plan, "blocks.1", "output", torch.zeros_like)
    """
    module, point = plan.targets[layer], plan.points.get(layer)
    if point is None:
        def hook(mod, args, kwargs, output):
            return rebuild(output, "output", {r: fn(t) for r, t in flatten(output, "output") if r == role})
        return scope.forward(module, hook, with_kwargs=True)

    def site(mod, args, kwargs, output=None):
        t = point.read(args, kwargs, output)
        return point.write(args, kwargs, output, point.put(t, fn(point.get(t))))
    if point.side == "input":
        return scope.pre(module, site, with_kwargs=True)
    return scope.forward(module, site, with_kwargs=True)


def forward(model: torch.nn.Module, args, kwargs, plans: List[HookPlan]):
    """model(*args, **kwargs), with a clear message when a full backward hook broke it."""
    try:
        return model(*args, **kwargs)
    except RuntimeError as err:
        if "BackwardHookFunction" in str(err):
            hooked = sorted({f"hooks.{p.name} ({', '.join(p.targets)})" for p in plans
                             if p.kind in ("backward", "backward_pre")})
            raise HookError(
                f"a full backward hook broke the forward pass on {'; '.join(hooked)}: PyTorch wraps the output of a "
                "module with a full backward hook in a view, and an in-place op after it (ReLU(inplace=True), "
                "x += shortcut) modified that view. Use kind: output_grad on the same layers instead: it records "
                f"the same gradient (role grad = grad_output.0) with Tensor.register_hook. PyTorch said: {err}"
            ) from err
        raise


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
