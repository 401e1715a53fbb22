"""Whether a run may write at a location: never into what hookrun did not write; an existing run needs
overwrite or resume (with the same config and encoding); overwrite removes only hookrun's own keys."""
from __future__ import annotations

import json
import logging
from typing import List, Optional

from hookrun.lock import LOCK_NAME
from hookrun.storage import Location, is_partial_write
from hookrun.store.spec import ENCODING_KEYS, config_diff
from hookrun.verify import INDEX_DIR

log = logging.getLogger("hookrun")


def read_attrs(location: Location) -> Optional[dict]:
    """The root attributes of a hookrun store at `location`, or None if it is not one (read as JSON)."""
    try:
        meta = json.loads(location.get("zarr.json") or b"null")
    except (OSError, ValueError):
        return None
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    return attrs if isinstance(attrs, dict) and "config_hash" in attrs and "status" in attrs else None


def is_complete(location: Location) -> bool:
    """Whether `location` holds a finished run."""
    return (read_attrs(location) or {}).get("status") == "complete"


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


def check_path(location: Location, mode: str, config_hash: str, config: dict) -> List[str]:
    """Problems with writing a run to `location` in `mode` (see the module docstring)."""
    try:
        foreign = _foreign_entries(location)
    except Exception as err:  # noqa: BLE001 - a remote store that cannot be reached: credentials, endpoint, bucket
        if location.local is not None:
            raise
        return [f"store.path: {location} cannot be read ({type(err).__name__}: {err}); check the credentials "
                "(AWS_* variables or store.storage_options), the endpoint and the bucket"]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return [f"store.path: {location} exists and is not a hookrun store (it holds {shown}); hookrun never "
                "writes into or deletes what it did not create: choose another store.path"]
    attrs = read_attrs(location)
    if attrs is None:
        return []
    if mode == "create":
        return [f"store.path: {location} already holds a hookrun run (status {attrs.get('status')}); set "
                "store.mode=resume to continue it, store.mode=overwrite to replace it, or choose another store.path"]
    if mode == "resume":
        if attrs.get("config_hash") != config_hash:
            return [f"store.mode: resume refused, {location} was written with another config: "
                    f"{config_diff(attrs.get('config', {}), config) or 'config hash differs'}"]
        old, new = attrs.get("config", {}).get("store", {}), config.get("store", {})
        changed = [f"store.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in ENCODING_KEYS if old.get(k) != new.get(k)]
        if changed:
            return [f"store.mode: resume refused, the arrays of {location} are encoded and chunked otherwise "
                    f"({'; '.join(changed)}); one array keeps one encoding: resume with the old settings"]
    return []


def clear_store(location: Location) -> None:
    """Remove what a previous hookrun run wrote at `location` (root metadata, index, array groups), nothing else."""
    for name in location.children():
        if name == LOCK_NAME:
            continue
        if name == INDEX_DIR or location.exists(f"{name}/zarr.json"):
            location.delete_dir(name)
        elif name == "zarr.json":
            location.delete(name)
        else:
            log.warning("overwrite: left %s/%s in place (hookrun did not write it)", location, name)
