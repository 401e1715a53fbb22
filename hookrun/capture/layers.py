"""Layer patterns -> named modules or parameters, with near-miss suggestions.

A pattern is an exact dotted name from `named_modules()` / `named_parameters()`, a glob
("layer*.conv?": `*` within one dotted segment, `**` across segments; see match), or "re:<regex>" (full match).
The root module is called `_model`. Given the model, a pattern in the standard vocabulary (`blocks.*`,
`blocks.0-3.attn.heads`, `unembed`: hookrun.capture.anatomy) selects standard site names, found by the model's
anatomy (a model without one keeps the pattern as a module name).

    >>> resolve(["conv1", "layer*.conv?"], module_names(model), "module", "hooks.acts.layers")
    (['conv1', 'layer1.conv1', 'layer1.conv2'], [])      # (names in model order, problems)
    >>> resolve(["conv9"], module_names(model), "module", "hooks.acts.layers")[1]
    ["hooks.acts.layers: 'conv9' matches no module (did you mean: conv1?)"]
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from hookrun.capture.anatomy import AnatomyError, anatomy, is_standard
from hookrun.config.checks import as_list, suggest

ROOT = "_model"  # the store/index name of the model itself (its named_modules() name is "")


def module_names(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """Every module by its dotted name; the root as `_model`."""
    return {(name or ROOT): module for name, module in model.named_modules()}


def parameter_names(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Every parameter by its dotted name."""
    return dict(model.named_parameters())


def match(pattern: str, names: Iterable[str]) -> List[str]:
    """The names a single pattern selects, in the order given.

    A glob is segment-aware: `*` matches within one dotted segment (`transformer.h.*` is the blocks, not their
    submodules), `?` one character of a segment, `[...]` a class, and `**` any number of whole segments, none
    included (`transformer.**.mlp` is every block's MLP; `**.weight` every weight). `re:<regex>` is a full match
    of the whole dotted name; a plain name matches itself.

        match("model.layers.*", names)   # model.layers.0, model.layers.1 (not model.layers.0.mlp)"""
    names = list(names)
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        return [n for n in names if regex.fullmatch(n)]
    if any(c in pattern for c in "*?["):
        regex = re.compile(_glob_regex(pattern))
        return [n for n in names if regex.fullmatch(n)]
    return [n for n in names if n == pattern]


def _glob_regex(pattern: str) -> str:
    """A segment-aware glob (match's) as a regex: `**` segments span segments, the rest stay in one."""
    parts = pattern.split(".")
    out = []
    for i, seg in enumerate(parts):
        if seg == "**":
            out.append(".*" if len(parts) == 1 else r"(?:.+\.)?" if i == 0 else r"(?:\..+)?")
            continue
        if i > 0 and not (i == 1 and parts[0] == "**"):
            out.append(r"\.")
        out.append(_segment_regex(seg))
    return "".join(out)


def _segment_regex(seg: str) -> str:
    """One segment of a glob: `*` and `?` stay inside it (`**` inside a segment spans dots), `[...]` as fnmatch."""
    out, i = [], 0
    while i < len(seg):
        c = seg[i]
        if seg.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append(r"[^.]*")
        elif c == "?":
            out.append(r"[^.]")
        elif c == "[" and "]" in seg[i + 2:]:  # a class (a "]" right after "[" is in it, as fnmatch)
            end = seg.index("]", i + 2)
            body = seg[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def resolve(patterns, available: Dict[str, object], what: str, key: str,
            model: Optional[torch.nn.Module] = None) -> Tuple[List[str], List[str]]:
    """(selected names in model order without repeats, problems for patterns that match nothing). With `model`,
    standard patterns select standard names (after the module names, in the anatomy's order); one the model lacks
    is a problem naming the name, the architecture and the nearest names (or model.anatomy to declare).

        resolve(["blocks.*.attn"], module_names(gpt2), "module", "hooks.a.layers", gpt2)[0]  # ['blocks.0.attn', ...]
    """
    selected: List[str] = []
    standard: List[str] = []
    problems: List[str] = []
    pats = as_list(patterns)
    if not pats:
        problems.append(f"{key}: no {what} named; give a name, a glob or re:<regex>, e.g. layers=conv1")
    for pat in pats:
        pat = str(pat)
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as err:
                problems.append(f"{key}: {pat!r} is not a valid regex ({err})")
                continue
        if model is not None and what == "module" and is_standard(pat):
            try:
                standard += [n for n in anatomy(model).names(pat, key) if n not in standard]
                continue
            except AnatomyError as err:  # a model whose own modules are named blocks.N... keeps them
                if not match(pat, available):
                    if str(err) not in problems:  # an unknown architecture: said once, not once a pattern
                        problems.append(str(err))
                    continue
        found = match(pat, available)
        if not found:
            hint = suggest(pat, available) or f" (there are {len(available)} {what}s; list them with inspect=true)"
            problems.append(f"{key}: {pat!r} matches no {what}{hint}")
        selected += [n for n in found if n not in selected]
    order = {n: i for i, n in enumerate(available)}
    if len(standard) > 1:
        rank = {n: i for i, n in enumerate(anatomy(model).standard_names())}
        standard.sort(key=rank.__getitem__)
    return sorted(selected, key=order.__getitem__) + standard, problems
