"""The only writer of a store: captures into Zarr arrays, their index into parquet parts.

    captures.zarr/<hook>/<layer>/<role>     one array per stream, axis 0 = record, chunked (or sharded) along it
    captures.zarr/_index/...                the index parts, merged at completion (hookrun.store.index)
    captures.zarr/.hookrun.lock             the writer's lock (hookrun.store.lock)

A store lives at a local path or a URL (hookrun.storage.Location: every key goes through one Zarr
store object). Every `commit_s` seconds every finished batch is committed: the partly filled last
chunk of each array is written (and rewritten when it fills), then the index part. A killed run
leaves a readable store whose index describes only committed batches; `store.mode=resume` checks
it (hookrun.format.verify) and continues after the last of them. Only an absent path, an empty directory
or a hookrun store is ever written; overwrite removes only what hookrun wrote.

Modules, each one responsibility:
    spec     the store settings, their checks, the errors
    place    may a run write here (foreign files, existing runs, resume compatibility), overwrite
    queue    the byte-budgeted queue and the writer thread
    streams  one Zarr array per captured site, written chunk by chunk (or shard by shard)
    stats    the index statistics of a capture (numpy in the writer, torch on a CUDA device)
    host     CUDA captures to pinned host memory on a side stream
    index    index parts, commits, what a resume reads back, the merge at completion
    parallel a data-parallel run: each rank's rows, and the chunks two ranks share
    writer   the Store, tying them together
"""
from hookrun.store.place import check_path, is_complete, read_attrs
from hookrun.store.spec import NonFiniteError, StoreError, check_spec, versions, writer_mode
from hookrun.store.writer import Store, finish_close

__all__ = ["NonFiniteError", "Store", "StoreError", "check_path", "check_spec", "finish_close",
           "is_complete", "read_attrs", "versions", "writer_mode"]
