"""Layer patterns -> named modules or parameters, with near-miss suggestions.

A pattern is an exact dotted name from `named_modules()` / `named_parameters()`, a glob
("layer*.conv?"), or "re:<regex>" (full match). The root module is called `_model`. Given the model, a pattern in
the standard vocabulary (`blocks.*`, `blocks.0-3.attn.heads`, `unembed`: hookrun.capture.anatomy) selects standard
site names, found by the model's anatomy (a model without one keeps the pattern as a module name).

    >>> resolve(["conv1", "layer*.conv?"], module_names(model), "module", "hooks.acts.layers")
    (['conv1', 'layer1.conv1', 'layer1.conv2'], [])      # (names in model order, problems)
    >>> resolve(["conv9"], module_names(model), "module", "hooks.acts.layers")[1]
    ["hooks.acts.layers: 'conv9' matches no module (did you mean: conv1?)"]
"""
from __future__ import annotations

import fnmatch
import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from hookrun.capture.anatomy import AnatomyError, anatomy, is_standard
from hookrun.config.schema import as_list, suggest

ROOT = "_model"  # the store/index name of the model itself (its named_modules() name is "")


def module_names(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """Every module by its dotted name; the root as `_model`."""
    return {(name or ROOT): module for name, module in model.named_modules()}


def parameter_names(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Every parameter by its dotted name."""
    return dict(model.named_parameters())


def match(pattern: str, names: Iterable[str]) -> List[str]:
    """The names a single pattern selects, in the order given."""
    names = list(names)
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        return [n for n in names if regex.fullmatch(n)]
    if any(c in pattern for c in "*?["):
        return [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    return [n for n in names if n == pattern]


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
