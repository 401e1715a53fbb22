"""An anatomy inferred from a model's module tree, its config and one traced forward, for a family with no table.

The ModuleList of `num_hidden_layers` blocks; in a block the attention (or a hybrid's token mixer), the MLP or
mixture of experts, the norms (by what they feed and what feeds them), the projections (q/k/v or a fused one, the
output projections, a router); the embeddings, the final norm and the unembedding, with a logit scale or soft-cap.
What is inferred is then proved (hookrun.capture.proof) before any site of it is used.

    seen = trace(model); family = infer(model, config, seen)   # a Family, or AnatomyError naming what was not found
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from hookrun.capture.families import BLOCK_PARTS, AnatomyError, Family
from hookrun.capture.proof import Trace, rel, same, tolerance

LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
NOT_TEXT = re.compile(r"(^|\.)(vision|visual|vit|audio|speech|image|encoder|vision_tower|vision_model|"
                      r"multi_modal_projector|mm_projector)(\.|_|$)")
ATTENTION = re.compile(r"attention|attn", re.I)
NOT_ATTENTION = re.compile(r"linear|deltanet|mamba|recurrent|norm|retention|lightning|gated|conv|rwkv|lstm|ssm", re.I)
MIXER = re.compile(r"mamba|mixer|deltanet|linear_?attn|linearattention|recurrent|ssm|conv|rwkv|lstm|retention|"
                   r"time_?mix", re.I)
MLP = re.compile(r"mlp|moe|feed_?forward|ffn|experts|sparse|channel_?mix", re.I)
NORM = re.compile(r"norm", re.I)
MLP_NAMES = {"mlp", "feed_forward", "ffn", "moe", "block_sparse_moe", "mlp_block", "channel_mix"}
TEXT_ENCODER = re.compile(r"(^|\.)encoder\.")  # a stack named an encoder, in no vision or audio tower
PREFIX_NAME = re.compile(r"prompt|prefix", re.I)  # a config attribute counting positions prepended inside
SCALE_NAME = re.compile(r"scal|mult|factor", re.I)  # a config attribute named as a scale
SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap", "logit_softcapping")
Q_NAMES, K_NAMES, V_NAMES = ({"q_proj", "query", "q", "wq", "q_lin", "query_proj", "project_q"},
                             {"k_proj", "key", "k", "wk", "k_lin", "key_proj", "project_k"},
                             {"v_proj", "value", "v", "wv", "v_lin", "value_proj", "project_v"})
QKV_NAMES = {"qkv_proj", "query_key_value", "c_attn", "wqkv", "qkv", "w_pack", "in_proj_qkv", "qkv_lin"}
ROUTER_NAMES = {"gate", "router", "gating", "switch", "gate_proj_router"}


def setting(config, name: str, default=None):
    """A config's attribute, `default` where it has none or refuses it (a per-layer attribute of a heterogeneous
    config raises on the global read)."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return default


def count(config, *names) -> Optional[int]:
    """The first of the config's integer attributes `names` it has (None when it has none)."""
    return next((int(setting(config, n)) for n in names if isinstance(setting(config, n), int)
                 and not isinstance(setting(config, n), bool)), None)


def layer_count(config) -> Optional[int]:
    """The number of blocks a config names (num_hidden_layers, n_layer, ...), None when it names none."""
    return count(config, *LAYER_COUNTS)


def _norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or bool(NORM.search(type(module).__name__)) and \
        not ATTENTION.search(type(module).__name__)


def _linear(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and not isinstance(module, nn.Embedding) and not _norm(module)


def width_in(module: Optional[nn.Module]) -> Optional[int]:
    """A projection's input width (Linear, GPT-2's Conv1D), None for other modules."""
    if isinstance(module, nn.Linear):
        return module.in_features
    w = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D":
        return w.shape[0]
    return w.shape[1] if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def width_out(module: Optional[nn.Module]) -> Optional[int]:
    """A projection's output width (Linear, GPT-2's Conv1D), None for other modules."""
    if isinstance(module, nn.Linear):
        return module.out_features
    w = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D":
        return w.shape[1]
    return w.shape[0] if isinstance(w, torch.Tensor) else None


def find_blocks(model: nn.Module, config, seen: Optional[Trace] = None) -> Optional[str]:
    """The name of the ModuleList of the text stack's blocks: `num_hidden_layers` long (any length where the config
    names none), outside vision and audio towers, its first block called on the token stream when traced; a text
    stack named an encoder (CPM-Ant's cpmant.encoder.layers) where no other is."""
    n = layer_count(config)
    found, encoders = [], []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or not len(m):
            continue
        if NOT_TEXT.search(name) and (NOT_TEXT.search(name.replace("encoder", "")) or not TEXT_ENCODER.search(name)):
            continue
        if n is not None and len(m) != n:
            continue
        if seen is not None and seen.calls:
            call = seen.calls.get(f"{name}.0")
            x = call.input() if call is not None else None
            if x is None or x.dim() < 2 or tuple(x.shape[:2]) != seen.batch_shape and not (
                    x.shape[0] == seen.batch_shape[0] and prefix_of(config, x.shape[1] - seen.batch_shape[1])):
                continue
        (encoders if NOT_TEXT.search(name) else found).append(name)
    found = found or encoders
    return min(found, key=lambda s: (s.count("."), len(s))) if found else None


def prefix_of(config, extra: int) -> Optional[str]:
    """The config attribute that is `extra` positions the model prepends to the tokens inside (CPM-Ant's
    prompt_length), None where none is."""
    if extra <= 0:
        return None
    names = sorted(vars(config)) if hasattr(config, "__dict__") else []
    return next((n for n in names if PREFIX_NAME.search(n) and count(config, n) == extra), None)


def _children(model_modules: Dict[str, nn.Module], prefix: str) -> List[Tuple[str, nn.Module]]:
    return [(n[len(prefix) + 1:], m) for n, m in model_modules.items()
            if n.startswith(prefix + ".") and "." not in n[len(prefix) + 1:]]


def _under(modules: Dict[str, nn.Module], prefix: str) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in modules.items() if n.startswith(prefix + ".")]


def _roles(modules, seen: Trace, block: str) -> Dict[str, str]:
    """One block's direct children by role: attn, mixer, mlp and its norms (by class and name, then by data flow)."""
    kids = [(n, m) for n, m in _children(modules, block) if f"{block}.{n}" in seen.calls]
    kids.sort(key=lambda nm: seen.calls[f"{block}.{nm[0]}"].order)
    roles: Dict[str, str] = {}
    for n, m in kids:
        cls = type(m).__name__
        if _norm(m):
            continue
        if "attn" not in roles and (ATTENTION.search(cls) or n in ("self_attn", "attn", "attention",
                                                                     "self_attention")) \
                and not NOT_ATTENTION.search(cls) and not NOT_ATTENTION.search(n):
            roles["attn"] = n
        elif "mixer" not in roles and (MIXER.search(cls) or MIXER.search(n) and not MLP.search(cls)) \
                and n not in MLP_NAMES:  # Nemotron-H names every block's one part `mixer`: its class says which
            roles["mixer"] = n
        elif "mlp" not in roles and (MLP.search(cls) or MLP.search(n)) and not ATTENTION.search(cls):
            roles["mlp"] = n
    reads = lambda n: seen.calls[f"{block}.{n}"].input()  # noqa: E731
    made = [seen.calls[f"{block}.{roles[r]}"].out() for r in ("attn", "mlp") if r in roles]
    if "mixer" in roles and any(same(reads(roles["mixer"]), t) for t in made):
        del roles["mixer"]  # it reads attention's (or the MLP's) output: a write after it, not a mixer beside it
    return roles


def _norm_roles(modules, seen: Trace, block: str, roles: Dict[str, str]) -> Dict[str, str]:
    """The block's norms by what they feed (ln1: attention's input, ln2: the MLP's) and what feeds them (attn_write,
    mlp_write: a norm of the part's output before the residual add)."""
    call = lambda n: seen.calls.get(f"{block}.{n}")  # noqa: E731
    out: Dict[str, str] = {}
    mixer = roles.get("attn") or roles.get("mixer")
    for n, m in _children(modules, block):
        c = call(n)
        if not _norm(m) or c is None:
            continue
        if mixer and "ln1" not in out and same(c.out(), call(mixer).input()):
            out["ln1"] = n
        elif roles.get("mlp") and "ln2" not in out and same(c.out(), call(roles["mlp"]).input()):
            out["ln2"] = n
        elif mixer and "attn_write" not in out and same(c.input(), call(mixer).out()):
            out["attn_write"] = n
        elif roles.get("mlp") and "mlp_write" not in out and same(c.input(), call(roles["mlp"]).out()):
            out["mlp_write"] = n
    for norm, part in (("ln1", mixer), ("ln2", roles.get("mlp"))):  # a sublayer block's own norm (CPM-Ant's
        # self_att.layernorm_before_attention): inside the part, reading the part's input, read by its sibling
        if norm in out or not part or call(part) is None:
            continue
        inner = sorted([(f"{part}.{n}", m) for n, m in _children(modules, f"{block}.{part}") if call(f"{part}.{n}")],
                       key=lambda nm: call(nm[0]).order)
        out.update({norm: n for n, m in inner[:1] if _norm(m) and same(call(n).input(), call(part).input())
                    and any(same(call(o).input(), call(n).out()) for o, _ in inner[1:])})
    taken = set(roles.values()) | set(out.values())
    for n, m in _children(modules, block):  # another module between a part and the add (Inkling's short convs)
        c = call(n)
        if c is None or n in taken or _norm(m) or not any(True for _ in m.parameters()) or same(c.out(), c.input()):
            continue  # a dropout (or any identity) is no write
        if mixer and "attn_write" not in out and same(c.input(), call(mixer).out()):
            out["attn_write"] = n
        elif roles.get("mlp") and "mlp_write" not in out and same(c.input(), call(roles["mlp"]).out()):
            out["mlp_write"] = n
    return out


def _last_linear(modules, seen: Trace, prefix: str, width: int, direct: bool = False) -> Optional[str]:
    """The last-called projection under `prefix` (its direct children only: `direct`) whose output is `width` wide
    (an output projection)."""
    best = None
    for n, m in _under(modules, prefix):
        if direct and "." in n[len(prefix) + 1:]:
            continue
        c = seen.calls.get(n)
        if c is not None and _linear(m) and width_out(m) == width and (best is None or c.order > best[0]):
            best = (c.order, n)
    return best[1] if best else None


def _named(modules, prefix: str, names) -> Optional[str]:
    return next((n for n, _ in _under(modules, prefix) if n.rsplit(".", 1)[-1].lower() in names
                 and _linear(modules[n])), None)


def infer(model: nn.Module, config, seen: Trace) -> Family:
    """A Family of the model's parts from its module tree, config and traced forward; AnatomyError naming the part
    not found (and model.anatomy, the key that declares it)."""
    if seen.error is not None:
        raise AnatomyError(f"model.anatomy: {type(model).__name__} has no table, and its anatomy cannot be inferred "
                           f"without one tiny forward: {seen.error}; declare its parts in model.anatomy")
    modules = {n: m for n, m in model.named_modules() if n}
    blocks = find_blocks(model, config, seen)
    n = layer_count(config)
    if blocks is None:
        raise AnatomyError(f"model.anatomy.blocks: {type(model).__name__} has no ModuleList of "
                           f"{n if n is not None else 'its'} blocks called on the token stream; name it "
                           "(model.anatomy.blocks)")
    prefix = blocks
    x0 = seen.calls[f"{blocks}.0"].input()
    skip = prefix_of(config, x0.shape[1] - seen.batch_shape[1]) if x0.dim() >= 2 else None  # CPM-Ant's prompt
    roles = [_roles(modules, seen, f"{prefix}.{i}") for i in range(len(modules[blocks]))]
    if not any("attn" in r or "mixer" in r for r in roles):
        raise AnatomyError(f"model.anatomy.attn: no attention module (nor a token mixer) was found in the blocks of "
                           f"{type(model).__name__} ({prefix}.0: {', '.join(n for n, _ in _children(modules, prefix + '.0'))}); "
                           "name it (model.anatomy.attn)")
    parts = [_block(modules, seen, config, f"{prefix}.{i}", r) for i, r in enumerate(roles)]
    keys = [tuple(sorted(p.items())) for p in parts]
    ranked = Counter(k for k, r in zip(keys, roles) if "attn" in r or "mixer" in r).most_common()
    main = dict(ranked[0][0])
    family = Family(blocks=prefix, embed=(), **main, layers=tuple(
        (i, tuple((k, v) for k, v in p.items() if main[k] != v)) for i, p in enumerate(parts) if p != main))
    family = dataclasses.replace(family, start=_start(modules, seen, f"{prefix}.0", parts[0]), prefix=skip)
    ab = f"{prefix}.{keys.index(ranked[0][0])}"
    mb = next((f"{prefix}.{i}" for i, p in enumerate(parts) if p == main and p["mlp"]), ab)
    return _outside(model, config, seen, modules, family, ab, mlp_block=mb)


def _block(modules, seen: Trace, config, ab: str, roles: Dict[str, str]) -> Dict[str, Optional[str]]:
    """One block's parts (relative to it): attention or a token mixer, the MLP (an inline one: its last projection),
    the norms by what they feed, the projections, a router, where the writes are read."""
    attn, mixer, mlp = roles.get("attn"), roles.get("mixer"), roles.get("mlp")
    inline = None
    if mlp is None and (attn or mixer):  # an inline MLP (fc1 -> act -> fc2 in the block, BioGPT's): its last
        # projection is its output
        inline = _last_linear(modules, seen, ab, seen.calls[ab].input().shape[-1], direct=True)
        mlp = inline[len(ab) + 1:] if inline else None
    norms = _norm_roles(modules, seen, ab, {"attn": attn, "mixer": mixer, "mlp": None if inline else mlp})
    if inline and "ln2" not in norms:  # the norm called after attention and before the inline MLP
        mixer_order = seen.calls[f"{ab}.{attn or mixer}"].order
        later = [n for n, m in _children(modules, ab) if _norm(m) and f"{ab}.{n}" in seen.calls
                 and seen.calls[f"{ab}.{n}"].order > mixer_order and n not in norms.values()]
        norms["ln2"] = min(later, key=lambda n: seen.calls[f"{ab}.{n}"].order) if later else None
    d = seen.calls[f"{ab}"].input().shape[-1]
    rel_name = lambda full: full[len(ab) + 1:] if full else None  # noqa: E731
    attn_out = q = k = v = qkv = pattern = None
    if attn:
        attn_out = _last_linear(modules, seen, f"{ab}.{attn}", d)
        q, k, v = (_named(modules, f"{ab}.{attn}", names) for names in (Q_NAMES, K_NAMES, V_NAMES))
        if not (q and k and v):
            q = k = v = None
            qkv = _named(modules, f"{ab}.{attn}", QKV_NAMES)
        p = seen.calls[f"{ab}.{attn}"].out(1)
        if p is None or p.dim() != 4:
            pattern = next((rel_name(nm) for nm, _ in _under(modules, f"{ab}.{attn}")
                            if (c := seen.calls.get(nm)) is not None and (t := c.out()) is not None and t.dim() == 4
                            and t.shape[-1] == t.shape[-2] == seen.batch_shape[1]), None)
    mlp_out = router = None
    index = 0
    if mlp and inline:
        mlp_out = mlp
    elif mlp:
        mcall = seen.calls[f"{ab}.{mlp}"]
        router = next((nm for nm, m in _under(modules, f"{ab}.{mlp}") if nm.count(".") == ab.count(".") + 2
                       and (nm.rsplit(".", 1)[-1].lower() in ROUTER_NAMES or "router" in type(m).__name__.lower())
                       and seen.calls.get(nm) is not None and _router(m, config, d)), None)
        last = _last_linear(modules, seen, f"{ab}.{mlp}", d)
        if last is not None and router is None and (same(seen.calls[last].out(), mcall.out()) or
                                                    rel(seen.calls[last].out(), mcall.out()) < tolerance(mcall.out())):
            mlp_out = last
        mlp_out = mlp_out[len(ab) + 1:] if mlp_out else None
        if router is not None:
            index = _router_index(modules[router], seen.calls[router])
        router = router[len(ab) + 1:] if router else None
    family = Family(blocks=ab.rsplit(".", 1)[0], embed=(), attn=attn, mlp=mlp, ln1=norms.get("ln1"),
                    ln2=norms.get("ln2"), attn_out=rel_name(attn_out), q=rel_name(q), k=rel_name(k), v=rel_name(v),
                    qkv=rel_name(qkv), pattern=pattern, attn_write=norms.get("attn_write"),
                    mlp_write=norms.get("mlp_write"), mlp_out=mlp_out, router=router, mixer=mixer)
    family = _writes(seen, family, ab, ab, attn_out, _last_linear(modules, seen, f"{ab}.{mlp}", d) if mlp else None)
    family = dataclasses.replace(family, mlp_plus=_plus(modules, seen, family, ab))
    return {**{p: getattr(family, p) for p in BLOCK_PARTS}, **_scales(modules, seen, family, ab),
            "router_index": index,
            "qkv_layout": _layout(modules, ab, family), "q_parts": _q_parts(modules, config, ab, family)}


def _numbers(block: nn.Module) -> Dict[str, float]:
    """A block's number attributes other than 0 and 1 (a residual multiplier among them)."""
    return {k: float(v) for k, v in sorted(vars(block).items()) if isinstance(v, (int, float))
            and not isinstance(v, bool) and v not in (0, 1)}


def _plus(modules, seen: Trace, family: Family, ab: str) -> Optional[str]:
    """A child of the block called after the MLP on the MLP's input whose output the block adds to the MLP's
    (Granite 4's shared_mlp beside its experts: resid_mid + (experts + shared) * k == the block's output, k 1 or a
    number of the block's), None where the MLP's write adds up alone or no such child is."""
    block, mcall = seen.calls.get(ab), seen.calls.get(f"{ab}.{family.mlp}") if family.mlp else None
    norm = seen.calls.get(f"{ab}.{family.ln2}") if family.ln2 else None
    if block is None or mcall is None or family.mlp_write or family.parallel or mcall.out() is None:
        return None
    mid, goal, mine = norm.input() if norm else mcall.input(), block.out(), mcall.out()
    if mid is None or goal is None or mine.shape != goal.shape or mid.shape != goal.shape:
        return None
    ks = [1.0, *_numbers(modules[ab]).values()]
    if any(rel(lambda: mid + mine * k, goal) <= tolerance(goal) for k in ks):  # noqa: B023
        return None
    taken = {getattr(family, p) for p in BLOCK_PARTS}
    for n, m in _children(modules, ab):
        c = seen.calls.get(f"{ab}.{n}")
        if n in taken or c is None or c.order < mcall.order or _norm(m) or not same(c.input(), mcall.input()) \
                or c.out() is None or c.out().shape != goal.shape:
            continue
        if any(rel(lambda: mid + (mine + c.out()) * k, goal) <= tolerance(goal) for k in ks):  # noqa: B023
            return n
    return None


def _scales(modules, seen: Trace, family: Family, ab: str) -> Dict[str, Optional[str]]:
    """{attn_scale, mlp_scale}: the block's number attribute a write is multiplied by before the residual add, where
    the stream adds up only with it (MiniCPM3's residual_scale: resid_pre + attn * s == resid_mid); None elsewhere."""
    out: Dict[str, Optional[str]] = {"attn_scale": None, "mlp_scale": None}
    block = seen.calls.get(ab)
    call = lambda n: seen.calls.get(f"{ab}.{n}") if n else None  # noqa: E731
    numbers = _numbers(modules[ab])
    if block is None or not numbers or family.parallel:
        return out
    norm = call(family.ln2)
    mid = norm.input() if norm else call(family.mlp).input() if call(family.mlp) else None
    first = family.attn_write or family.attn or (family.mixer if not family.attn else None)
    for key, write, base, goal in (("attn_scale", first, block.input(), mid if mid is not None else block.out()),
                                   ("mlp_scale", family.mlp_write or family.mlp, mid, block.out())):
        c = call(write)
        mine = c.out() if c is not None else None
        plus = call(family.mlp_plus) if key == "mlp_scale" else None
        mine = mine + plus.out() if mine is not None and plus is not None else mine  # the MLP's write: the sum
        if mine is None or base is None or goal is None or mine.shape != goal.shape or base.shape != goal.shape:
            continue
        plain = rel(lambda: base + mine, goal)  # noqa: B023
        m = mine.float()
        k = float((m * (goal.float() - base.float())).sum() / (m * m).sum().clamp_min(1e-12))
        # the attribute the least-squares ratio is, where it makes the add exact (MiniCPM3's 0.99 at two layers: the
        # plain add is off by only a little, the scaled one by rounding)
        out[key] = next((n for n, v in numbers.items() if abs(v - k) <= 1e-3 * abs(k)
                         and (e := rel(lambda: base + mine * v, goal)) <= tolerance(goal)  # noqa: B023
                         and e < plain / 10), None)
    return out


def _q_parts(modules, config, ab: str, family: Family) -> int:
    """2 where the query projection is twice the heads' width ([q | gate] per head: Qwen3-Next's gated attention),
    by its attention's head_dim; else 1."""
    q = modules.get(f"{ab}.{family.q}") if family.q else None
    d = getattr(modules.get(f"{ab}.{family.attn}"), "head_dim", None) if family.attn else None
    n = count(config, "num_attention_heads", "n_head", "num_heads")
    return 2 if q is not None and isinstance(d, int) and n and width_out(q) == 2 * n * d else 1


def _start(modules, seen: Trace, block: str, parts: Dict[str, Optional[str]]) -> Optional[str]:
    """A norm of block 0 that none of its parts is, reading the block's input and feeding its first norm: where the
    residual stream starts (RWKV's pre_ln), None for a block with none."""
    call = lambda n: seen.calls.get(f"{block}.{n}") if n else None  # noqa: E731
    first = call(parts.get("ln1")) or call(parts.get("attn") or parts.get("mixer"))
    if first is None or seen.calls.get(block) is None:
        return None
    return next((n for n, m in _children(modules, block) if _norm(m) and n not in parts.values()
                 and call(n) is not None and same(call(n).input(), seen.calls[block].input())
                 and same(call(n).out(), first.input())), None)


def _router_index(module: nn.Module, call) -> int:
    """The element of a router's output that is its linear map of its input (Llama 4's router returns its scores,
    then its logits), 0 when none is."""
    w, b, x = getattr(module, "weight", None), getattr(module, "bias", None), call.input()
    if not isinstance(w, torch.Tensor) or x is None or x.shape[-1] != w.shape[-1]:
        return 0
    want = nn.functional.linear(x.float(), w.float(), b.float() if isinstance(b, torch.Tensor) else None)
    for i in range(4):
        got = call.out(i)
        if got is not None and got.numel() == want.numel() and rel(got, want.reshape(got.shape)) <= tolerance(got):
            return i
    return 0


def _layout(modules, ab: str, family: Family) -> str:
    """A fused q/k/v projection's layout as far as the module tree says: CodeGen's model-parallel groups (its
    attention's mp_num: [groups, (q | v | k)]), else [q | k | v] (the check tries [heads, 3, d_head] after)."""
    groups = getattr(modules.get(f"{ab}.{family.attn}"), "mp_num", None) if family.qkv else None
    return f"groups:{groups}" if isinstance(groups, int) and groups > 1 else "concat"


def _writes(seen: Trace, family: Family, ab: str, mb: str, attn_out: Optional[str],
            mlp_last: Optional[str]) -> Family:
    """Where attention's and the MLP's writes are read: the module's output, unless the block's residual adds up
    only with its output projection's (BLOOM and MPT add the residual inside attention or the MLP). `ab`, `mb`: a
    block with attention, one with the MLP."""
    changes = {}
    for block, part, proj, write in ((ab, family.attn, attn_out, "attn_write"), (mb, family.mlp, mlp_last,
                                                                                 "mlp_write")):
        call = lambda n: seen.calls.get(f"{block}.{n}") if n else None  # noqa: E731,B023
        norm = call(family.ln2)
        mid = norm.input() if norm else call(family.mlp).input() if call(family.mlp) else None
        if not part or getattr(family, write) or mid is None or proj is None or call(part) is None \
                or seen.calls.get(proj) is None or (write == "mlp_write" and family.router is not None):
            continue
        base, goal = (seen.calls[block].input(), mid) if write == "attn_write" else (mid, seen.calls[block].out())
        mine, theirs = call(part).out(), seen.calls[proj].out()
        if goal is not None and rel(lambda: base + mine, goal) > tolerance(goal) and \
                rel(lambda: base + theirs, goal) <= tolerance(goal):
            changes[write] = proj[len(block) + 1:]
            if write == "mlp_write":
                changes["mlp_out"] = proj[len(block) + 1:]
    return dataclasses.replace(family, **changes) if changes else family


def _router(module: nn.Module, config, d: int) -> bool:
    experts = count(config, *EXPERT_COUNTS)
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == d and (experts is None or
                                                                                  w.shape[0] == experts)


def _outside(model, config, seen: Trace, modules, family: Family, ab: str, mlp_block: str) -> Family:
    """The parts outside the blocks: embeddings (and a module between them and block 0), the final norm (and a
    module between it and the unembedding), the unembedding, whether blocks are parallel, a logit scale."""
    blocks = family.blocks
    first, last = seen.calls[f"{blocks}.0"], seen.calls.get(f"{blocks}.{len(modules[blocks]) - 1}")
    get_in = getattr(model, "get_input_embeddings", None)
    emb = get_in() if get_in is not None else None
    token = next((n for n, m in modules.items() if m is emb), None)
    if token is None:
        token = next((n for n, m in modules.items() if isinstance(m, nn.Embedding) and n in seen.calls
                      and not n.startswith(blocks + ".")), None)
    if token is None:
        raise AnatomyError(f"model.anatomy.embed: {type(model).__name__} has no token embedding "
                           "(get_input_embeddings()); name it (model.anatomy.embed)")
    x0 = first.input()
    pos = next((n for n, m in modules.items() if n != token and n in seen.calls and not n.startswith(blocks + ".")
                and "rotary" not in type(m).__name__.lower()
                and (isinstance(m, nn.Embedding) or "position" in type(m).__name__.lower())
                and (t := seen.calls[n].out()) is not None and t.shape[-1] == x0.shape[-1]), None)
    embed, scale, fixed = (token,), None, False
    te = seen.calls[token].out()
    pe = seen.calls[pos].out() if pos else None
    added = lambda k=1.0: te.float() * k + (pe.float() if pe is not None else 0)  # noqa: E731
    if te is not None and rel(added, x0) > tolerance(x0):
        between = None if pos else next((n for n, c in seen.calls.items() if not n.startswith(blocks)
                                         and same(c.input(), te) and same(c.out(), x0)), None)
        if between is not None:  # a module between the embedding and block 0 (BLOOM's norm, OPT's project_in)
            embed = (between, token)
        elif te.shape == x0.shape and (pe is None or pe.shape[-1] == x0.shape[-1]):  # a scale outside the
            # embedding (XGLM's embed_scale, CTRL's sqrt(d))
            try:
                rest = x0.float() - (pe.float() if pe is not None else 0)
                ratio = float((te.float() * rest).sum() / (te.float() ** 2).sum().clamp_min(1e-12))
            except RuntimeError:  # a position embedding that does not broadcast over the batch
                ratio = None
            scale = ratio if ratio is not None and rel(lambda: added(ratio), x0) <= tolerance(x0) else None
            if scale is None and pe is None and te.shape[0] > 1:  # positions from a buffer (CTRL's sinusoids):
                dt, dx = (te[1:] - te[:1]).float(), (x0[1:] - x0[:1]).float()  # rows differ by their tokens alone
                k = float((dt * dx).sum() / (dt * dt).sum().clamp_min(1e-12))
                rest = x0.float() - te.float() * k
                if rel(rest[:1].expand_as(rest), rest) <= tolerance(x0):
                    scale, fixed = k, True
    out_last = last.out() if last is not None else None
    final = next((n for n, m in modules.items() if not n.startswith(blocks + ".") and n in seen.calls
                  and _norm(m) and same(seen.calls[n].input(), out_last)), None)
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if get_out is not None else None
    unembed = next((n for n, m in modules.items() if m is head), None)
    if unembed is None and seen.logits is not None:
        unembed = next((n for n, c in seen.calls.items() if _linear(modules[n]) and same(c.out(), seen.logits)), None)
    if unembed is None:
        raise AnatomyError(f"model.anatomy.unembed: {type(model).__name__} has no output embedding "
                           "(get_output_embeddings()); name it (model.anatomy.unembed)")
    post: Tuple[str, ...] = ()
    ucall = seen.calls.get(unembed)
    if final and ucall is not None and not same(seen.calls[final].out(), ucall.input()):
        step = next((n for n, c in seen.calls.items() if n not in (final, unembed) and not n.startswith(blocks + ".")
                     and same(c.input(), seen.calls[final].out()) and same(c.out(), ucall.input())), None)
        post = (step,) if step else ()
    final_times = final_over = None
    if final and not post and ucall is not None and not same(seen.calls[final].out(), ucall.input()):
        final_times, final_over = _scaled_by(config, seen.calls[final].out(), ucall.input())  # Inkling's mup width
    parallel = _parallel(seen, family, ab, mlp_block)
    times, over = _logit_scale(config, seen, ucall)
    return dataclasses.replace(family, embed=embed, embed_scale=scale, pos_fixed=fixed, pos_embed=(pos,) if pos else (),
                               final_norm=final, post=post, final_times=final_times, final_over=final_over,
                               unembed=unembed, parallel=parallel, logits_times=times, logits_over=over)


def _parallel(seen: Trace, family: Family, ab: str, mb: str) -> bool:
    """Whether the MLP reads the block's input (through its own norm or attention's): a parallel block."""
    if not family.mlp:
        return False
    block = seen.calls[mb]
    reads = seen.calls[f"{mb}.{family.ln2}"].input() if family.ln2 else seen.calls[f"{mb}.{family.mlp}"].input()
    shared = family.ln1 and family.ln2 is None and same(seen.calls[f"{mb}.{family.mlp}"].input(),
                                                        seen.calls.get(f"{mb}.{family.ln1}").out()
                                                        if seen.calls.get(f"{mb}.{family.ln1}") else None)
    return bool(same(reads, block.input()) or shared)


def _logit_scale(config, seen: Trace, ucall) -> Tuple[Optional[str], Optional[str]]:
    """(a config attribute the logits are the unembedding's output times, one they are it divided by), found by
    comparing the two on the trace (a soft-cap, final_logit_softcapping, undone first)."""
    if ucall is None or seen.logits is None or ucall.out() is None:
        return None, None
    u, logits = ucall.out().float(), seen.logits.float()
    cap = next((setting(config, n) for n in SOFTCAPS if setting(config, n)), None)
    if cap:
        logits = torch.atanh((logits / cap).clamp(-1 + 1e-6, 1 - 1e-6)) * cap
    if u.shape != logits.shape or rel(u, logits) <= tolerance(seen.logits):
        return None, None
    return _scaled_by(config, u, logits)


def _scaled_by(config, u: torch.Tensor, want: torch.Tensor) -> Tuple[Optional[str], Optional[str]]:
    """(a config attribute `want` is u times, one it is u divided by), None, None where neither is."""
    u, want = u.float(), want.float()
    if u.shape != want.shape:
        return None, None
    ratio = float((want * u).sum() / (u * u).sum().clamp_min(1e-12))
    names = set(vars(config)) if hasattr(config, "__dict__") else set()
    names |= {n for n in dir(type(config)) if isinstance(getattr(type(config), n, None), property)}  # MiniCPM3's
    # logits_scaling is a property; a name that says it scales first (a layer count or a rank may equal the ratio)
    for name in sorted(names, key=lambda n: (not SCALE_NAME.search(n), n)):
        value = setting(config, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            if abs(value - ratio) <= 1e-3 * abs(ratio):
                return name, None
            if abs(1 / value - ratio) <= 1e-3 * abs(ratio):
                return None, name
    return None, None
