"""The checks on keys that several methods share, written once: source vs target, heads only where a site splits
into heads (hookrun.capture.targets.heads_problems, which asks the anatomy), finite numbers, a value given twice, a
count past what there is, a dictionary the dictionaries block lacks or read at a layer it was not trained on.

    problems += same_role_problems("attribution", spec.get("source"), spec.get("target"), spec.get("donor", "same"))
    problems += finite_problems("hooks.steer.edit[0].add", spec["add"])

Each function takes the config key its messages name and the value(s), and returns a list of problems (each naming
the key, the value and the fix; [] when fine). Patching, attribution, the lens, dictionaries, edits (and circuits)
call them, so one key and one value get one refusal whichever method takes it.
"""
from __future__ import annotations

import math
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from hookrun.capture.anatomy import BLOCK_SITES, ROOTS
from hookrun.config.checks import HUGE, check_differ, check_number, is_int, is_number, suggest



def same_role_problems(key: str, source, target, donor: str = "same") -> List[str]:
    """`key`.source equal to `key`.target with donor same: every site patched with its own value, every score the
    unpatched metric (an ablation, donor zero, mean or resample, may name one role)."""
    if donor != "same":
        return []
    return check_differ(f"{key}.source", source, f"{key}.target", target,
                        "with donor same each site is patched with its own value: every score would be the unpatched "
                        "metric", f"patch another role in (e.g. {key}.source=clean {key}.target=corrupt), or ablate "
                        f"the sites: {key}.donor=zero (or mean, resample)")


def block_number_problems(key: str, patterns) -> List[str]:
    """Block numbers of standard layer patterns that no model has, said without the model: a negative one
    (`blocks.-1`: block numbers count from 0, not from the end) and a reversed range (`blocks.3-1`).

        problems += block_number_problems("hooks.resid.layers", ["blocks.3-1"])   # ["... give blocks.1-3 ..."]
    """
    problems = []
    for pattern in patterns if isinstance(patterns, (list, tuple)) else [patterns]:
        if not isinstance(pattern, str) or pattern.startswith("re:") or pattern.split(".", 1)[0] != "blocks":
            continue
        seg = pattern.split(".")[1] if "." in pattern else ""
        reversed_range = re.fullmatch(r"(\d+)-(\d+)", seg)
        if re.fullmatch(r"-\d+(-\d+)?", seg):
            problems.append(f"{key}: {pattern!r} has a negative block number; blocks count from 0 (blocks.0 is the "
                            "first), not from the end: give blocks.N with N the block's number, e.g. "
                            f"{pattern.replace(seg, '0', 1)}")
        elif reversed_range and int(reversed_range.group(1)) > int(reversed_range.group(2)):
            lo, hi = reversed_range.group(2), reversed_range.group(1)
            problems.append(f"{key}: {pattern!r} is a reversed range (it selects no block); give low-high, both "
                            f"included: {pattern.replace(seg, f'{lo}-{hi}', 1)}")
    return problems


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
    if limit is not None and is_int(k) and k > limit:
        return [f"{key}: {k} is more than the {limit} {what}; give at most {limit}"]
    return check_number(key, k, whole=True, low=1, high=HUGE)


def dictionary_problems(key: str, name, names) -> List[str]:
    """[the problem] when `name` (at config key `key`) is not a dictionary of the block's `names`, else []: what
    every user of a dictionary (hooks, edits, circuit.features) says."""
    if isinstance(name, str) and name in names:
        return []
    block = f"{{{', '.join(names)}}}" if names else "empty"
    return [f"{key}: {name!r} is not in the dictionaries: block ({block}){suggest(str(name), names)}; add "
            f"dictionaries: {{{name}: {{path: DIR}}}}"]


def trained_layer_problems(key: str, name: str, module, layers: List[str], allowed: bool,
                           reader: str = "this hook") -> List[str]:
    """A dictionary read at a layer other than the one its cfg.json says it was trained on (hook_name): its
    features mean nothing there, even where the widths agree. Two standard names (docs/anatomy.md) compare
    exactly (blocks.3 is not blocks.3.mlp); other names by their block number (blocks.3.hook_resid_post and
    transformer.h.3 are one layer); a name without one is not compared. `reader`: who reads it, as the message
    says it."""
    trained = getattr(module, "hook_name", None)
    if allowed or not trained:
        return []
    at = _block_number(trained)

    def elsewhere(layer: str) -> bool:
        if standard_site(trained) and standard_site(layer):
            return layer != trained
        return layer != trained and at is not None and _block_number(layer) not in (None, at)
    other = [layer for layer in layers if elsewhere(layer)]
    if not other:
        return []
    return [f"{key}: dictionary {name} was trained on {trained} (cfg.json's hook_name), but {reader} reads it at "
            f"{', '.join(other)}; read it at {trained if standard_site(trained) else f'layer {at}'}, or set "
            f"dictionaries.{name}.any_layer=true to read it "
            "elsewhere on purpose"]


def standard_site(name: str) -> bool:
    """Whether `name` is one standard site (blocks.3, blocks.3.mlp, embed; not TransformerLens's
    blocks.3.hook_resid_post)."""
    parts = str(name).split(".")
    if parts[0] != "blocks":
        return len(parts) == 1 and parts[0] in ROOTS
    return len(parts) >= 2 and parts[1].isdigit() and (len(parts) == 2 or ".".join(parts[2:]) in BLOCK_SITES)


def any_layer(spec) -> bool:
    """Whether a dictionaries block entry lets its dictionary read layers other than the one it was trained on."""
    return isinstance(spec, Mapping) and bool(spec.get("any_layer"))


def _block_number(name: str) -> Optional[int]:
    """The first integer part of a dotted layer name (blocks.3.hook_resid_post -> 3, model.layers.12 -> 12)."""
    return next((int(part) for part in str(name).split(".") if part.isdigit()), None)

