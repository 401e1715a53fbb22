"""The transport of a store: bytes by key, wherever the store lives, laid out as zarr's own `zarr.storage` is: one
module per backend, behaviours as zarr store wrappers, zarr's and fsspec's insides behind one module.

    location   Location(path): the interface every read and write of hookrun goes through (is_url, BACKENDS)
    local      a local directory: writes that never follow a link (open_dir, write_file, NoLinkStore, LinkError)
    remote     an fsspec URL (s3://, gs://, ...): every request retried
    memory     fsspec's memory filesystem in this process (memory://, store.path=memory)
    retry      which errors pass by themselves (is_transient), the backoff (Retry), RetryingStore over any zarr store
    internals  every zarr and fsspec call outside their public API (the one module a zarr upgrade may break)

    from hookrun.storage import Location
    Location("outputs/run/captures.zarr").put("_index/part-000000.parquet", data)
"""
from hookrun.storage.location import Location, is_url
from hookrun.storage.local import LinkError, NoLinkStore, is_partial_write, local_problem
from hookrun.storage.remote import RemoteBackend
from hookrun.storage.memory import MEMORY_URL, MemoryLocation
from hookrun.storage.retry import RETRY_S, Retry, RetryingStore, is_transient

__all__ = ["Location", "MemoryLocation", "MEMORY_URL", "is_url", "LinkError", "NoLinkStore", "RemoteBackend",
           "is_partial_write", "local_problem", "RETRY_S", "Retry", "RetryingStore", "is_transient"]
