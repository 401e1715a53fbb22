"""Every call hookrun makes into zarr's and fsspec's insides, in one place: what a zarr or fsspec upgrade may break.

    sync(store.get(key, prototype=default_buffer_prototype()))   # zarr's event loop, from a plain thread
    buffer(b"...")                                               # bytes as zarr's CPU Buffer
    decode(codec_specs(array), data)                             # a chunk decoded by its codecs, without the loop
    class MyStore(Wrapper): ...                                  # a zarr store over another, public methods only

zarr 3.1 (`zarr>=3.1.3,<3.2` in pyproject.toml, the versions tested) keeps these outside its public API:
`zarr.core.sync.sync`, `zarr.core.buffer` (`default_buffer_prototype`, the CPU `Buffer`),
`zarr.core.group.GroupMetadata`, `zarr.core.metadata.v3.ArrayV3Metadata`, `zarr.core.array_spec.ArraySpec`, an
array's `_async_array.config` and its `metadata.get_chunk_spec`, a group's `_async_group._getitem_consolidated`,
a codec's `_decode_sync`, LocalStore's `_set`, `_open`, `_is_open`, `_ensure_open_sync` and `_check_writable`,
WrapperStore's `_store`, `_with_store`, `_set_many` and `_get_many`, and an array's frozen metadata replaced in
place (`AsyncArray.metadata`, as zarr's resize does). From fsspec: an async filesystem's `_pipe_file(mode=
"create")`, `_put_file`, `_find`, `_info`, `AsyncFileSystemWrapper._wrap_all_sync_methods` and `sync_fs`, the
memory filesystem's `store` and `pseudo_dirs` and `MemoryFile`. No other module of hookrun touches any of them
(tests/test_storage_internals.py checks both: each name here exists with the parameters passed, and no module
outside this one names them).
"""
from __future__ import annotations

import asyncio
import copy
import inspect
from typing import Any, Dict, List, Sequence

import zarr
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from fsspec.implementations.memory import MemoryFile
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer
from zarr.core.group import GroupMetadata
from zarr.core.metadata.v3 import ArrayV3Metadata
from zarr.core.sync import sync
from zarr.storage import LocalStore, WrapperStore

__all__ = ["ArrayV3Metadata", "Buffer", "GroupMetadata", "InlineFileSystem", "LocalWrites", "Wrapper",
           "array_metadata", "array_of", "buffer", "codec_specs", "decode", "decodes_in_thread",
           "default_buffer_prototype", "fs_create", "fs_find", "fs_info", "fs_put_file", "group_json", "memory_dirs",
           "memory_file", "memory_files", "metadata_json", "node_of", "resize_in_place", "sync", "sync_filesystem",
           "with_attributes"]


# -- zarr: buffers, metadata, arrays ---------------------------------------------------------------------------
def buffer(data) -> Buffer:
    """Bytes (or any buffer) as zarr's CPU Buffer, what its stores take."""
    return Buffer.from_bytes(data)


def metadata_json(meta) -> bytes:
    """A group's or an array's zarr.json, as zarr writes it from its metadata object."""
    return meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


def group_json(attributes: dict = None) -> bytes:
    """A zarr v3 group's zarr.json holding `attributes`, as zarr writes it."""
    return metadata_json(GroupMetadata(attributes=attributes, zarr_format=3))


def array_metadata(shape: tuple, data_type, chunk_shape: tuple, codecs: list, dimension_names: tuple,
                   separator: str) -> ArrayV3Metadata:
    """The metadata of a zarr v3 array with a regular chunk grid, the default chunk key encoding with `separator`,
    fill value 0 and no attributes, as `create_array` makes it."""
    return ArrayV3Metadata(
        shape=shape, data_type=data_type, fill_value=0, codecs=codecs, attributes={},
        chunk_grid={"name": "regular", "configuration": {"chunk_shape": chunk_shape}}, dimension_names=dimension_names,
        chunk_key_encoding={"name": "default", "configuration": {"separator": separator}})


def with_attributes(meta: ArrayV3Metadata, attributes: dict) -> ArrayV3Metadata:
    """A copy of an array's metadata (a frozen dataclass) holding `attributes` instead of its own."""
    meta = copy.copy(meta)
    object.__setattr__(meta, "attributes", attributes)
    return meta


def resize_in_place(array: zarr.Array, shape: tuple) -> ArrayV3Metadata:
    """An array's metadata changed to `shape` in place, as zarr's resize does (no chunk is touched, its zarr.json
    not written: the caller puts it); the new metadata."""
    inner = array.async_array
    meta = inner.metadata.update_shape(shape)
    object.__setattr__(inner, "metadata", meta)
    return meta


def array_of(meta: ArrayV3Metadata, group: zarr.Group, key: str, config: dict) -> zarr.Array:
    """The zarr Array at `key` below `group` described by `meta`, without reading or writing its zarr.json."""
    return zarr.Array(zarr.AsyncArray(meta, group.store_path / key, config=config))


def node_of(group: zarr.Group, key: str):
    """`group[key]` (an array or a group; KeyError if absent), without a trip through zarr's event loop where the
    group holds consolidated metadata: zarr's own getitem then does no I/O, yet runs in its loop thread, a thread hop
    a call (a wait for that thread to be scheduled, on a busy machine)."""
    inner = group._async_group
    if inner.metadata.consolidated_metadata is None:
        return group[key]
    node = inner._getitem_consolidated(inner.store_path / key, key, prefix=inner.name)
    return zarr.Array(node) if isinstance(node, zarr.AsyncArray) else zarr.Group(node)


def codec_specs(array: zarr.Array, inner_shape: Sequence[int] = None) -> List[tuple]:
    """(codec, the spec it decodes with) of an array's serializer, then of each of its compressors in the order
    written (`inner_shape`: the chunks' shape inside a shard): what `decode` takes."""
    spec = array.metadata.get_chunk_spec((0,) * array.ndim, array._async_array.config, default_buffer_prototype())
    if inner_shape is not None:
        spec = ArraySpec(shape=tuple(inner_shape), dtype=spec.dtype, fill_value=spec.fill_value, config=spec.config,
                         prototype=spec.prototype)
    out = [(array.serializer, spec)]
    spec = array.serializer.resolve_metadata(spec)
    for codec in array.compressors:
        out.append((codec, spec))
        spec = codec.resolve_metadata(spec)
    return out


def decodes_in_thread(codec) -> bool:
    """Whether a codec decodes without zarr's event loop (its synchronous decode)."""
    return hasattr(codec, "_decode_sync")


def decode(specs: List[tuple], data):
    """One chunk's stored bytes decoded by the codecs of `codec_specs` (the last written first), without zarr's
    event loop: a numpy array of the chunk's shape. Raises what the codecs raise (a crc32c mismatch, bad bytes)."""
    buf = default_buffer_prototype().buffer.from_bytes(data)
    for codec, spec in reversed(specs[1:]):
        buf = codec._decode_sync(buf, spec)
    serializer, spec = specs[0]
    return serializer._decode_sync(buf, spec).as_numpy_array()


class LocalWrites(LocalStore):
    """zarr's LocalStore whose writes of a key (`set` and `set_if_not_exists`, and zarr's `_set` below them) are a
    subclass's `write(key, data, exclusive)`, in a worker thread as LocalStore's own; `check_writable` for its
    other writes (ValueError on a read-only store).

        class MyStore(LocalWrites):
            def write(self, key, data, exclusive): ...
    """

    def write(self, key: str, data, exclusive: bool) -> None:
        """Write `key` whole with `data` (a bytes-like object); FileExistsError if `exclusive` and it exists."""
        raise NotImplementedError

    def check_writable(self) -> None:
        self._check_writable()

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"{type(self).__name__}.set(): value must be a Buffer, got {type(value)}")
        await asyncio.to_thread(self.write, key, value.as_buffer_like(), exclusive)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._ensure_open_sync()
        self._check_writable()
        self.write(key, value.as_buffer_like(), False)


class Wrapper(WrapperStore):
    """zarr's WrapperStore (a store over another: `inner`) whose every write and read, batched ones too, goes
    through this wrapper's public methods: a subclass overrides `set`, `get`, ... and `rewrap` (when it takes more
    than the store), nothing private of zarr's.

        class Counting(Wrapper):
            async def get(self, key, prototype, byte_range=None): ...
    """

    @property
    def inner(self):
        """The store this one wraps."""
        return self._store

    def rewrap(self, store) -> "Wrapper":
        """This wrapper over another store (zarr's with_read_only and __enter__ make one); override it where
        the wrapper holds more than its store."""
        return type(self)(store)

    def _with_store(self, store):
        return self.rewrap(store)

    async def _set_many(self, values) -> None:
        for key, value in values:
            await self.set(key, value)

    async def _get_many(self, requests):
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)

    async def getsize(self, key: str) -> int:
        return await self.inner.getsize(key)


# -- fsspec: async filesystems, the memory filesystem --------------------------------------------------------------
async def fs_create(fs, path: str, data) -> None:
    """Write `path` only if it is absent (S3: a conditional PUT, If-None-Match: *): FileExistsError (or the
    filesystem's own refusal) if it is there."""
    await fs._pipe_file(path, data, mode="create")


async def fs_put_file(fs, local_path: str, path: str) -> None:
    """Upload a local file to `path` (multipart where large)."""
    await fs._put_file(local_path, path)


async def fs_find(fs, path: str) -> Dict[str, dict]:
    """{path: info} of every file below `path`, from one listing."""
    return await fs._find(path, detail=True)


async def fs_info(fs, path: str) -> dict:
    """What the filesystem knows of `path` (FileNotFoundError if it is absent)."""
    return await fs._info(path)


def sync_filesystem(fs):
    """The synchronous filesystem an AsyncFileSystemWrapper wraps."""
    return fs.sync_fs


class InlineFileSystem(AsyncFileSystemWrapper):
    """A synchronous fsspec filesystem awaited in zarr's event loop itself, not in a worker thread per call as
    fsspec's wrapper does (for the memory filesystem: its calls are dict operations, and the thread hops were half
    of a small run's store time).

        InlineFileSystem(fsspec.filesystem("memory"), asynchronous=True)"""

    def _wrap_all_sync_methods(self):
        super()._wrap_all_sync_methods()
        for name in [n for n in vars(self) if n.startswith("_") and hasattr(self.sync_fs, n[1:])]:
            setattr(self, name, _inline(getattr(self.sync_fs, name[1:])))


def _inline(method):
    async def call(*args, **kwargs):
        return method(*args, **kwargs)
    return call


def memory_files(mem) -> Dict[str, Any]:
    """{path: MemoryFile} of fsspec's memory filesystem (one dict for the whole process)."""
    return mem.store


def memory_dirs(mem) -> List[str]:
    """The directories made on fsspec's memory filesystem (a list for the whole process)."""
    return mem.pseudo_dirs


def memory_file(mem, path: str, data: bytes):
    """A file of fsspec's memory filesystem holding `data`, not yet in it (put it in `memory_files(mem)`)."""
    return MemoryFile(mem, path, data)


# -- what the test checks ------------------------------------------------------------------------------------------
def used() -> Dict[str, tuple]:
    """{what: (the object, the parameter names used, in order)} of every private or internal name above: the
    test asserts each exists and takes those parameters (a zarr or fsspec upgrade that moves one fails there)."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.implementations.memory import MemoryFileSystem
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec

    return {
        "zarr.core.sync.sync": (sync, ("coro",)),
        "zarr.core.buffer.default_buffer_prototype": (default_buffer_prototype, ()),
        "Buffer.from_bytes": (Buffer.from_bytes, ("bytes_like",)),
        "Buffer.as_buffer_like": (Buffer.as_buffer_like, ("self",)),
        "GroupMetadata": (GroupMetadata, ("attributes", "zarr_format")),
        "GroupMetadata.to_buffer_dict": (GroupMetadata.to_buffer_dict, ("self", "prototype")),
        "ArrayV3Metadata": (ArrayV3Metadata, ("shape", "data_type", "chunk_grid", "chunk_key_encoding",
                                              "fill_value", "codecs", "attributes", "dimension_names")),
        "ArrayV3Metadata.get_chunk_spec": (ArrayV3Metadata.get_chunk_spec, ("self", "_chunk_coords", "array_config",
                                                                            "prototype")),
        "ArraySpec": (ArraySpec, ("shape", "dtype", "fill_value", "config", "prototype")),
        "AsyncArray": (zarr.AsyncArray, ("metadata", "store_path", "config")),
        "Array._async_array": (zarr.Array.__dataclass_fields__["_async_array"], None),
        "AsyncArray.config": (zarr.AsyncArray.__dataclass_fields__["config"], None),
        "Group._async_group": (zarr.Group.__dataclass_fields__["_async_group"], None),
        "AsyncGroup._getitem_consolidated": (zarr.AsyncGroup._getitem_consolidated, ("self", "store_path", "key",
                                                                                    "prefix")),
        "AsyncArray.metadata (replaced in place)": (zarr.AsyncArray.__dataclass_fields__["metadata"], None),
        "ArrayV3Metadata.attributes (replaced in a copy)": (ArrayV3Metadata.__dataclass_fields__["attributes"], None),
        "ArrayV3Metadata.update_shape": (ArrayV3Metadata.update_shape, ("self", "shape")),
        "BytesCodec._decode_sync": (BytesCodec._decode_sync, ("self", "chunk_bytes", "chunk_spec")),
        "BloscCodec._decode_sync": (BloscCodec._decode_sync, ("self", "chunk_bytes", "chunk_spec")),
        "Crc32cCodec._decode_sync": (Crc32cCodec._decode_sync, ("self", "chunk_bytes", "chunk_spec")),
        "LocalStore._set": (LocalStore._set, ("self", "key", "value", "exclusive")),
        "LocalStore._open": (LocalStore._open, ("self", "mode")),
        "LocalStore._ensure_open_sync": (LocalStore._ensure_open_sync, ("self",)),
        "Store._check_writable": (LocalStore._check_writable, ("self",)),
        "WrapperStore._with_store": (WrapperStore._with_store, ("self", "store")),
        "WrapperStore._set_many": (WrapperStore._set_many, ("self", "values")),
        "WrapperStore._get_many": (WrapperStore._get_many, ("self", "requests")),
        "AsyncFileSystem._pipe_file": (AsyncFileSystem._pipe_file, ("self", "path", "value", "mode")),
        "AsyncFileSystem._put_file": (AsyncFileSystem._put_file, ("self", "lpath", "rpath")),
        "AsyncFileSystem._find": (AsyncFileSystem._find, ("self", "path")),
        "AsyncFileSystem._info": (AsyncFileSystem._info, ("self", "path")),
        "AsyncFileSystemWrapper._wrap_all_sync_methods": (AsyncFileSystemWrapper._wrap_all_sync_methods, ("self",)),
        "MemoryFile": (MemoryFile, ("fs", "path", "data")),
        "MemoryFileSystem.store": (MemoryFileSystem.store, None),
        "MemoryFileSystem.pseudo_dirs": (MemoryFileSystem.pseudo_dirs, None),
    }


def parameters(obj) -> tuple:
    """The parameter names of a function or a class's constructor, in order."""
    return tuple(inspect.signature(obj).parameters)
