"""The run folder's name: `outputs/<date>/<H-M-S>`, as the README shows it, and `<H-M-S>-2`, `-3`, ... for a
second launch in the same second (conf/config.yaml's `hydra.run.dir` and `hydra.sweep.dir` call it).

The folder is claimed with one `mkdir` (atomic: two processes cannot both get it), so two runs launched in one
second never share a store; OmegaConf caches the answer in the config (Hydra copies that cache to a sweep's jobs),
so one run resolves it once. `kept_if_used` takes back the folders claimed inside it that were left empty (hookrun.run
with a store.path elsewhere, or a config refused).

    hydra:
      run:
        dir: ${hookrun.fresh:outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}}    # outputs/2026-11-22/10-00-00
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Dict, Iterator, List

from omegaconf import OmegaConf

_claimed: Dict[str, List[str]] = {}  # a folder this process claimed -> the parents it made for it (innermost first)


def fresh(base: str) -> str:
    """`base` if no folder of that name exists (claiming it), else the first free `base-2`, `base-3`, ...

        fresh("outputs/2026-11-22/10-00-00")   # 'outputs/2026-11-22/10-00-00', then '...-2'
    """
    made, parent = [], os.path.dirname(os.path.abspath(base))
    while not os.path.isdir(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    if made:
        os.makedirs(made[0], exist_ok=True)
    name, n = base, 1
    while True:
        try:
            os.mkdir(name)
            break
        except FileExistsError:
            n += 1
            name = f"{base}-{n}"
    _claimed[os.path.abspath(name)] = made
    return name


@contextmanager
def kept_if_used() -> Iterator[None]:
    """Remove, on the way out, each folder `fresh` claimed inside the block that is still empty, and the parents it
    made for it that are empty too: a refused config or a store written elsewhere leaves no folder behind.

        with kept_if_used():
            parsed, context = _parsed(names)      # resolves hydra.run.dir
    """
    before = set(_claimed)
    try:
        yield
    finally:
        for path in set(_claimed) - before:
            for folder in (path, *_claimed.pop(path)):
                try:
                    os.rmdir(folder)  # only an empty folder: never what a run or a user put there
                except OSError:
                    break


def register() -> None:
    """Make `${hookrun.fresh:...}` known to OmegaConf (before Hydra composes the config)."""
    OmegaConf.register_new_resolver("hookrun.fresh", fresh, use_cache=True, replace=True)
