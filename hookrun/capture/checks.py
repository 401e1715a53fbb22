"""The checks on keys that several methods share, written once: source vs target, heads only where a site splits
into heads, finite numbers, a value given twice, a count past what there is.

    problems += same_role_problems("attribution", spec.get("source"), spec.get("target"), spec.get("donor", "same"))
    problems += finite_problems("hooks.steer.edit[0].add", spec["add"])

Each function takes the config key its messages name and the value(s), and returns a list of problems (each naming
the key, the value and the fix; [] when fine). Patching, attribution, the lens, dictionaries, edits (and circuits)
call them, so one key and one value get one refusal whichever method takes it.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hookrun.capture.layers import module_names
from hookrun.config.schema import is_int, is_number

ATTENTION = ("attn", "attention", "self_attn", "self_attention", "crossattention", "cross_attn", "mixer")
OUT_PROJECTIONS = ("c_proj", "o_proj", "out_proj", "dense", "out", "wo", "proj")  # an attention's output projection


def same_role_problems(key: str, source, target, donor: str = "same") -> List[str]:
    """`key`.source equal to `key`.target with donor same: every site patched with its own value, every score the
    unpatched metric (an ablation, donor zero, mean or resample, may name one role)."""
    if source is None or source != target or donor != "same":
        return []
    return [f"{key}.target: {target!r} is also {key}.source, and with donor same each site is patched with its own "
            f"value: every score would be the unpatched metric; patch another role in (e.g. {key}.source=clean "
            f"{key}.target=corrupt), or ablate the sites: {key}.donor=zero (or mean, resample)"]


def finite_problems(key: str, value) -> List[str]:
    """NaN or inf in a number, a (nested) list of numbers, or a tensor or array (an edit's file, another run's mean):
    what it touches becomes NaN or inf (every later value, every log-prob)."""
    if hasattr(value, "shape") and hasattr(value, "tolist"):  # a tensor or an array: described, not printed
        shown, bad = _tensor_nonfinite(value)
    else:
        shown, bad = repr(value), _nonfinite(value)
    if bad is None:
        return []
    what = f"holds NaN or inf (at {bad})" if bad else "is not a finite number"
    return [f"{key}: {shown} {what}; a NaN or inf makes everything it touches NaN or inf (every later value, "
            "every log-prob): give a finite number"]


def _tensor_nonfinite(value) -> Tuple[str, Optional[str]]:
    """(how a message names a tensor or array, where its first NaN or inf is: "[i][j]", "" for one number, None)."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):  # an array of objects: no numbers to check
        return repr(value), None
    if t.dim() == 0:
        return repr(t.item()), None if not t.is_floating_point() or bool(torch.isfinite(t)) else ""
    shown = f"a tensor of shape {list(t.shape)}"
    if not t.is_floating_point():
        return shown, None
    bad = torch.nonzero(~torch.isfinite(t))[:1]
    if not len(bad):
        return shown, None
    return shown, "".join(f"[{int(i)}]" for i in bad[0])


def _nonfinite(value, at: str = "") -> Optional[str]:
    """Where the first NaN or inf of `value` is ("" for a number, "[i][j]" in a list), None if there is none."""
    if is_number(value):
        return None if math.isfinite(value) else at
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _nonfinite(item, f"{at}[{i}]")
            if found is not None:
                return found
    return None


def repeat_problems(key: str, values: Sequence) -> List[str]:
    """A value given twice in a list where each names something different (tokens: [" Paris", " Paris"] makes
    logit(A) - logit(B) zero everywhere)."""
    seen: Dict[str, int] = {}
    for i, value in enumerate(values or []):
        label = repr(value)
        if label in seen:
            return [f"{key}: {value!r} is given twice (at {seen[label]} and {i}); each entry must differ (a difference "
                    "of a token with itself is 0 everywhere): name another"]
        seen[label] = i
    return []


def k_problems(key: str, k, limit: Optional[int], what: str) -> List[str]:
    """A count `k` that must be an int in 1..limit (`what` there are `limit` of, e.g. "tokens in the vocabulary")."""
    if not is_int(k) or k < 1:
        return [f"{key}: {k!r} must be an integer >= 1"]
    if limit is not None and k > limit:
        return [f"{key}: {k} is more than the {limit} {what}; give at most {limit}"]
    return []


def attention_of(name: str, named: dict) -> Optional[str]:
    """The name of the attention module `name` is (or is inside): the nearest whose class name holds Attention or
    whose own name is attn, self_attn, attention, ...; None outside attention."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        module = named.get(prefix)
        if module is not None and ("attention" in type(module).__name__.lower() or parts[n - 1].lower() in ATTENTION):
            return prefix
    return None


def _projection(name: str, named: dict) -> str:
    """An attention output projection to suggest for `name` (inside it, else the model's first)."""
    found = [n for n in named if n.rsplit(".", 1)[-1] in OUT_PROJECTIONS and attention_of(n, named) not in (None, n)]
    return next((n for n in found if n.startswith(name + ".")), found[0] if found else "attn.c_proj / self_attn.o_proj")


def heads_problems(key: str, model, layers: List[str], role: str) -> List[str]:
    """Layers whose `role` tensor is not the attention heads side by side: a module outside attention (a block's
    output is the residual stream: its features are no heads), or an attention module's or its output
    projection's output (the heads are summed there). Heads are the input of the output projection (role input),
    or a per-head tensor inside attention (queries, keys, values, [batch, seq, heads, d_head])."""
    named = module_names(model)
    problems = []
    for name in layers:
        attention = attention_of(name, named)
        last = name.rsplit(".", 1)[-1]
        if attention is None:
            why = "it is outside every attention module (a block's output is the residual stream)"
        elif role == "output" and (name == attention or last in OUT_PROJECTIONS):
            why = "it is the attention's output, after its output projection summed the heads"
        else:
            continue
        problems.append(f"{key}: {name} {role} is not split into heads: {why}, so its features are no heads side by "
                        f"side; patch heads at the input of the attention output projection (e.g. layers: "
                        f"[{_projection(name, named)}], role: input), or drop heads for a layers x positions grid")
    return problems
