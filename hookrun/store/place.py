"""Whether a run may write at a location, and an overwrite of what is there.

Never into what hookrun did not write, never through a symbolic link; an existing run needs overwrite or resume
(with the same config and encoding); overwrite removes only hookrun's own keys, after marking the store `replacing`
(so an overwrite stopped half-way is finished by the next one)."""
from __future__ import annotations

import json
import logging
import time
from typing import List, Optional

from hookrun.config.parsing import without_later_defaults
from hookrun.format.layout import (COMMITTED, COMMITTED_FILE, COMPLETE, CONFIG_HASH, INDEX_DIR, INPUTS, INPUTS_RULE,
                                   REPLACING, STATUS,
                                   TABLES, is_part, is_run_attrs, is_writer_dir, merged_name, newer_version,
                                   parse_key, parse_part)
from hookrun.format.files import read_table
from hookrun.storage import Location, is_partial_write, local_problem
from hookrun.storage.internals import group_json
from hookrun.store.lock import LOCK_NAME
from hookrun.store.spec import ENCODING_KEYS, config_diff

log = logging.getLogger("hookrun")


def read_attrs(location: Location) -> Optional[dict]:
    """The root attributes of a hookrun store at `location`, or None if it is not one (read as JSON)."""
    try:
        meta = json.loads(location.get("zarr.json") or b"null")
    except (OSError, ValueError):
        return None
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    return attrs if is_run_attrs(attrs) else None


def write_root(location: Location, attrs: dict) -> None:
    """Replace the root group's metadata with a plain group holding `attrs` (one atomic write; no consolidated
    metadata: it would list arrays that are no longer there)."""
    location.put("zarr.json", group_json(attrs))


def is_complete(location: Location) -> bool:
    """Whether `location` holds a finished run."""
    return (read_attrs(location) or {}).get(STATUS) == COMPLETE


def _foreign_entries(location: Location) -> List[str]:
    """What is at `location` that hookrun did not write (empty for an absent path, an empty dir or a store)."""
    if location.local is not None and location.local.exists() and not location.local.is_dir():
        return [location.local.name]
    # listed before the attrs are read: a run creating the store meanwhile (zarr.json appears, whole, after
    # the listing, from zarr's temp file zarr.<uuid>.partial) then reads as the store it is
    names = [name for name in location.children() if name != LOCK_NAME and not is_partial_write(name)]
    if not names or read_attrs(location) is not None:
        return []
    return [name + ("/" if location.is_dir(name) else "") for name in names]


def _shown(names: List[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def link_problems(location: Location) -> List[str]:
    """One line per symbolic link inside the store at `location` (a store holding one is damaged)."""
    return [f"{key}: a symbolic link to {target}; hookrun never writes or deletes through a link inside a store"
            for key, target in location.links().items()]


def check_path(location: Location, mode: str, config_hash: str, config: dict, inputs: Optional[dict] = None,
               rule: Optional[str] = None) -> List[str]:
    """Problems with writing a run to `location` in `mode` (see the module docstring). `inputs`, `rule`: the
    fingerprints of what this run is made from (hookrun.engine.fingerprint), which a resume must match."""
    if location.local is not None:
        reason = local_problem(location.local)
        if reason:
            return [f"store.path: {location} cannot be made there: {reason}; give a path in a directory you can write"]
    missing = location.missing_bucket()
    if missing:
        return [f"store.path: the bucket {missing!r} of {location} does not exist; create it (`aws s3 mb s3://{missing}`"
                " with your endpoint) or give a store.path in a bucket that exists"]
    try:
        foreign = _foreign_entries(location)
    except Exception as err:  # noqa: BLE001 - a remote store that cannot be reached: credentials, endpoint, bucket
        if location.local is not None:
            raise
        return [f"store.path: {location} cannot be read ({type(err).__name__}: {err}); check the credentials "
                "(AWS_* variables or store.storage_options), the endpoint and the bucket"]
    if foreign:
        return [f"store.path: {location} exists and is not a hookrun store (it holds {_shown(foreign)}); hookrun never "
                "writes into or deletes what it did not create: choose another store.path"]
    links = link_problems(location)
    if links:
        return [f"store.path: {location} is damaged, {line}: remove the link (copy what it points to into the store "
                "if it is yours), or choose another store.path" for line in links]
    attrs = read_attrs(location)
    if attrs is None:
        return []
    if attrs.get(STATUS) == REPLACING and mode != "overwrite":
        return [f"store.path: {location} is being replaced (status replacing, since {attrs.get('replacing_since')}): "
                "an overwrite is removing its old run, or was stopped doing so"
                f"{' and left nothing to resume' if mode == 'resume' else ''}; rerun with store.mode=overwrite to "
                "finish it, or choose another store.path"]
    if mode == "create":
        return [f"store.path: {location} already holds a hookrun run (status {attrs.get(STATUS)}); set "
                "store.mode=resume to continue it, store.mode=overwrite to replace it, or choose another store.path"]
    if mode == "resume":
        newer = newer_version(attrs, location)
        if newer:
            return [f"store.mode: resume refused, {newer}"]
        if attrs.get(CONFIG_HASH) != config_hash:
            diff = config_diff(*map(without_later_defaults, (attrs.get("config", {}), config)))
            return [f"store.mode: resume refused, {location} was written with another config: "
                    f"{diff or 'config hash differs'}"]
        old, new = attrs.get("config", {}).get("store", {}), config.get("store", {})
        changed = [f"store.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in ENCODING_KEYS if old.get(k) != new.get(k)]
        if changed:
            return [f"store.mode: resume refused, {location} was written with other encoding and chunking "
                    f"({'; '.join(changed)}); one array keeps one encoding: resume with the old settings"]
        if inputs is not None:
            return inputs_problems(location, attrs, inputs, rule)
    return []


def inputs_problems(location: Location, attrs: dict, inputs: dict, rule: Optional[str]) -> List[str]:
    """A resume from inputs other than those the store was made from: one problem naming each input that changed
    (the model's weights, a dictionary's files, a data file, the tokenizer) and how to start over. A store from
    before fingerprints (or of another rule) is resumed with a warning: nothing to compare."""
    old = attrs.get(INPUTS)
    if old is None or attrs.get(INPUTS_RULE) != rule:
        log.warning("resume: %s records no fingerprints of its inputs (%s); hookrun cannot check that this run uses "
                    "the same model, dictionaries, data files and tokenizer", location,
                    "written before they were recorded" if old is None else f"rule {attrs.get(INPUTS_RULE)}")
        return []
    changed = []
    for section in sorted(set(old) | set(inputs)):
        before, now = old.get(section) or {}, inputs.get(section) or {}
        if before == now:
            continue
        differ = sorted((k for k in before if k in now and before[k] != now[k]), key=lambda k: not k.startswith("file"))
        gone = [k for k in before if k not in now]
        added = [k for k in now if k not in before]
        parts = [f"{len(items)} {what}: {_shown(items)}" for items, what in
                 ((differ, "changed"), (gone, "gone"), (added, "new")) if items]
        changed.append(f"{_section_name(section)} ({'; '.join(parts)})")
    if not changed:
        return []
    return [f"store.mode: resume refused, {location} was made from other inputs: {line}; a resume would mix two "
            "runs in one store" for line in changed] + [
        "store.mode: resume with the inputs the store was made from, or start over: store.mode=overwrite (or another "
        "store.path)"]


def _section_name(section: str) -> str:
    return {"model": "the model's weights", "data": "the data files", "tokenizer": "the tokenizer"}.get(
        section, section)


def _hook_groups(location: Location, attrs: dict) -> List[str]:
    """The top-level groups the old run wrote: one per hook of its committed config (and any its index names)."""
    hooks = {name for name, spec in (attrs.get("config", {}).get("hooks") or {}).items() if spec is not None}
    merged = f"{INDEX_DIR}/{merged_name('index')}"  # a complete run's (else the config names every group)
    try:
        if location.exists(merged):
            hooks |= {parse_key(key)[0] for key in read_table(location, merged, columns=["array"]).array.unique()}
    except Exception:  # noqa: BLE001 - a damaged index: the config names the groups
        pass
    return sorted(h for h in hooks if h and "/" not in h and h not in (INDEX_DIR, LOCK_NAME, "zarr.json"))


def _own_index_files(names: List[str]) -> List[str]:
    """The names in an index dir that hookrun wrote (merged tables first, so a reader meanwhile sees no index)."""
    tables = [*TABLES, *sorted({p[0] for p in map(parse_part, names) if p} - {"part", *TABLES})]
    merged = [f"{merged_name(t)}{tmp}" for t in tables for tmp in ("", ".tmp") if f"{merged_name(t)}{tmp}" in names]
    return merged + [n for n in names if n not in merged and (is_part(n) or is_partial_write(n)
                                                               or n == COMMITTED_FILE)]


def clear_store(location: Location) -> List[str]:
    """Remove what the previous hookrun run at `location` wrote, nothing else: the groups of its hooks and its index
    files. First the root is marked `replacing` (one write): an overwrite stopped while clearing leaves a store
    that says so, and the next overwrite finishes the job. The root metadata, `_index/zarr.json` and the lock stay
    (the new run rewrites the root). What stays besides is listed in one line, and returned (none: the new run
    makes its arrays as in a new store, without looking for what was at their keys)."""
    attrs = read_attrs(location)
    if attrs.get(STATUS) != REPLACING:
        attrs = {**attrs, STATUS: REPLACING, "replacing_since": time.strftime("%Y-%m-%dT%H:%M:%S"), COMMITTED: 0}
    write_root(location, attrs)
    groups = _hook_groups(location, attrs)
    names = location.children(INDEX_DIR)
    for name in _own_index_files(names):
        location.delete(f"{INDEX_DIR}/{name}")
    for name in names:
        if is_writer_dir(name):
            location.delete_dir(f"{INDEX_DIR}/{name}")
    for name in groups:
        location.delete_dir(name)
    kept = []
    for name in location.children():
        if is_partial_write(name):
            location.delete(name)
        elif name not in (LOCK_NAME, "zarr.json", INDEX_DIR):
            kept.append(name + ("/" if location.is_dir(name) else ""))
    kept += [f"{INDEX_DIR}/{n}" for n in location.children(INDEX_DIR) if n != "zarr.json"]
    if kept:
        log.warning("overwrite: left in %s what hookrun did not write: %s", location, _shown(kept))
    return kept
