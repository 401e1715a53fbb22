"""Rows of a stored array read straight from its chunk files, chunks read and decoded in parallel threads.

    reader = ChunkReader(location, array)     # array: a zarr array of a hookrun store (open_array)
    reader.read(slice(0, 1000))               # rows 0..999 into one preallocated array
    reader.read(np.array([5, 3, 900]))         # any rows, in the order given: only their chunks are read
    reader.read(slice(a, b), out=mm[:b - a])   # into an array of yours (a memmap: export)

A chunk is read whole (its crc32c covers all of it), checked and decoded with the array's own zarr codecs
(their synchronous decode, without zarr's event loop), then its rows are put in place. A chunk stored raw
(bytes + crc32c, what dense float captures are) on a local disk is read straight into the output in one
preadv call, the rows a read leaves out (at its two ends) into a scratch buffer, and its crc32c summed over
all of it. A shard is read whole like a chunk: its index checked against its crc32c, each inner chunk decoded.
Codecs with no synchronous decode are read through zarr. A chunk (or shard) that is missing, fails its
crc32c, does not decode or is not the one committed there (`reader(cap, key)`: its size and crc32c against
the committed index, compared with the 4 bytes read with it anyway) raises DamagedError naming it: no data
is returned from a damaged chunk. bfloat16 arrays come back as float32 (exact): numpy has no bfloat16;
`as_dtype(rows, "bfloat16")` makes them the torch bfloat16 tensor captured, bit for bit.

    reader(cap, "acts/fc1/output").read(rows)   # a ChunkReader that checks each chunk against the index
"""
from __future__ import annotations

import collections
import errno
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.codecs import ShardingCodec
from zarr.codecs.sharding import ShardingCodecIndexLocation

from hookrun.format.files import (SHARD_EMPTY, DamagedError, chunk_path, crc32c, shard_count,
                                  shard_index, shard_sum)
from hookrun.format.layout import CHUNK_COLUMNS, DTYPE_ATTR, INDEX_DIR, bf16_bits_to_float32
from hookrun.storage import Location
from hookrun.storage.internals import codec_specs, decode, decodes_in_thread

READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC  # a chunk file is opened as itself, never through a link
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
THREADS = max(2, min(8, 2 * CORES))  # chunk reads in flight (page-cache copies and crc32c release the GIL)
_POOL: dict = {}  # pid -> the thread pool (a forked DataLoader worker makes its own)


def pool() -> ThreadPoolExecutor:
    """The chunk readers' thread pool of this process."""
    pid = os.getpid()
    if pid not in _POOL:
        _POOL.clear()
        _POOL[pid] = ThreadPoolExecutor(THREADS, thread_name_prefix="hookrun-read")
    return _POOL[pid]


PAGE = 4096
PAGE_OFFSET = 2048  # where in a page a new output starts: see empty()


def empty(shape, dtype) -> np.ndarray:
    """A new array whose data starts half a page past a page boundary, for reads that copy whole pages into it.

        out = empty((rows, 512), np.float32)

    The kernel copies a chunk from the page cache (page-aligned) into the output; where the output starts a few
    bytes past a page boundary, as numpy's large arrays do (16 bytes: malloc's header), every load of the copy
    seems to depend on the store just before it (4K aliasing) and the copy runs at a third of its speed
    (benchmarks/read.py: 40 ms against 125 ms for 200 MB on this machine's CPU)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 2 * PAGE, dtype=np.uint8)
    start = (PAGE_OFFSET - raw.ctypes.data) % PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def read_all(jobs) -> None:
    """Every (reader, rows, out) of `jobs` read, their chunks taken one at a time from one queue by the calling
    thread and up to THREADS - 1 of the pool's (a thread the machine's load holds back delays one chunk, not a
    share of them fixed in advance); the kernel asked for every file first when the first is not in the page
    cache (a cold read is then one deep queue; a warm one skips the calls). DamagedError names the chunks that
    are missing, fail their crc32c or do not decode."""
    tasks = [t for reader, rows, out in jobs for t in reader.tasks(rows, out)]
    if not tasks:
        return
    if not tasks[0][0].cached(tasks[0][1]):
        for reader, k, _, _ in tasks:
            reader.advise(k)
    queue = collections.deque(enumerate(tasks))
    helpers = [pool().submit(_take, queue) for _ in range(min(THREADS, len(tasks)) - 1)]
    problems = _take(queue)
    for helper in helpers:
        problems += helper.result()
    if problems:
        raise damaged([p for _, p in sorted(problems)])


def _take(queue) -> List[Tuple[int, str]]:
    """Read chunk tasks from `queue` until it is empty (popleft is atomic: each task is read once); the
    problems met, by task number."""
    problems = []
    while True:
        try:
            i, (reader, *task) = queue.popleft()
        except IndexError:
            return problems
        problem = reader.task(*task)
        if problem:
            problems.append((i, problem))


def damaged(problems: List[str]) -> DamagedError:
    """The error of a read that met damaged chunks (three named, the rest counted)."""
    more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
    return DamagedError(f"{'; '.join(problems[:3])}{more}: no data is returned from a damaged chunk "
                        "(cap.verify() lists every damaged file)")


def subset(records, rows=None):
    """Rows `rows` (None: all; a slice; numbers in any order, negative from the end; a boolean mask) of an array's
    records (a slice of its rows, or row numbers): the array rows to read, a slice where they are contiguous."""
    n = records.stop - records.start if isinstance(records, slice) else len(records)
    if rows is None:
        return records
    if isinstance(rows, slice):
        start, stop, step = rows.indices(n)
        if step == 1 and isinstance(records, slice):
            return slice(records.start + start, records.start + max(start, stop))
        rows = np.arange(start, stop, step)
    idx = np.asarray(rows)
    if idx.dtype == bool:
        if idx.shape != (n,):
            raise IndexError(f"a boolean row mask needs {n} values, got shape {idx.shape}")
        idx = np.flatnonzero(idx)
    if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
        raise IndexError(f"rows must be a slice or 1-D integers, got {idx.dtype} of shape {idx.shape}")
    idx = idx.astype(np.int64, copy=False)
    bad = (idx < -n) | (idx >= n)
    if bad.any():
        raise IndexError(f"row {int(idx[bad][0])} is out of range: there are {n} records")
    idx = np.where(idx < 0, idx + n, idx)
    return records.start + idx if isinstance(records, slice) else records[idx]


def _plain_shards(array) -> bool:
    """Whether an array's shards are what hookrun writes (split along axis 0 only; their index at the end, raw
    uint64 with its crc32c): then they are read straight from their files, like chunks."""
    codec = array.metadata.codecs[0] if len(array.metadata.codecs) == 1 else None
    index_codecs = getattr(codec, "index_codecs", ())
    return (isinstance(codec, ShardingCodec) and tuple(array.shards[1:]) == tuple(array.shape[1:])
            and codec.index_location == ShardingCodecIndexLocation.end and len(index_codecs) == 2
            and isinstance(index_codecs[0], BytesCodec) and isinstance(index_codecs[1], Crc32cCodec)
            and (index_codecs[0].endian is None or index_codecs[0].endian.value == "little"))


class _Damaged(Exception):
    """A chunk's problem, raised in a reader thread and gathered by `read`."""


_LOCAL = threading.local()


def _scratch(size: int) -> memoryview:
    """This thread's scratch buffer of at least `size` bytes (what a read skips lands there)."""
    buf = getattr(_LOCAL, "scratch", None)
    if buf is None or len(buf) < size:
        buf = _LOCAL.scratch = memoryview(bytearray(max(size, 64 * 1024)))
    return buf


def as_dtype(data: np.ndarray, dtype=None):
    """Rows read (float32 for a bfloat16 array) in the dtype asked for: None: as read (numpy); "bfloat16" or any torch
    dtype: a torch tensor of it (exact for the captured bfloat16 and float16 values); another name or numpy dtype
    ("float16", np.float64): numpy cast to it.

        as_dtype(rows, "bfloat16")      # torch.bfloat16: what the hook captured, bit for bit
        as_dtype(rows, torch.float16)   # torch.float16
        as_dtype(rows, "float64")       # numpy float64
    """
    if dtype is None:
        return data
    if str(dtype) in ("bfloat16", "torch.bfloat16") or type(dtype).__module__ == "torch":
        import torch  # only asked for a torch dtype: the read side needs no torch otherwise

        torch_dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""))
        return torch.from_numpy(np.ascontiguousarray(data)).to(torch_dtype)
    try:
        return data.astype(np.dtype(dtype), copy=False)
    except TypeError as err:
        raise TypeError(f"dtype={dtype!r} is not a dtype; use None (as stored), 'bfloat16' or a torch dtype (a torch "
                        "tensor), or a numpy dtype name such as 'float32'") from err


@dataclass
class Committed:
    """What an array's chunks must be, from the committed index: {chunk: (encoded bytes, crc32c or -1)} (`sums`);
    `boundary` (a running store's chunk holding its last committed row, rewritten as it fills: only its own crc32c
    is checked); `required`: a chunk with no record is damage (a complete store: every chunk has one)."""

    sums: Dict[int, tuple]
    boundary: Optional[int] = None
    required: bool = True


def committed(cap, key: str, array) -> Optional[Committed]:
    """What the chunks of `cap`'s array `key` must be, as its index committed them (None where that cannot be
    said chunk by chunk: a data-parallel run still running, whose ranks share chunks written at its close)."""
    files = cap._files()
    if not files.has_chunk_sums:
        frame = cap._table("chunks", CHUNK_COLUMNS)  # (the store is read again if a run committed or closed since)
        files = cap._files()
        files.chunk_sums(frame)
    sums = files.chunk_sums()
    if files.merged:
        return Committed(sums.get(key, {}))
    if len(files.sources) > 1:
        return None
    rows = cap.index.loc[cap.index["array"] == key, "row_stop"]
    last = int(rows.max()) if len(rows) else 0
    per = (array.shards or array.chunks)[0]
    return Committed(sums.get(key, {}), last // per if last % per else None, required=False)


def reader(cap, key: str, array=None) -> "ChunkReader":
    """A ChunkReader of `cap`'s array `key` that checks every chunk it reads against the committed index."""
    array = cap.array(key) if array is None else array
    return ChunkReader(cap.location, array, committed(cap, key, array))


class ChunkReader:
    """Reads rows of one zarr array (chunked, and sharded, along axis 0 only) from its chunk (or shard) files;
    with `committed`, each one's size and crc32c must be the committed ones (a chunk swapped with another, each
    whole, is damage)."""

    def __init__(self, location: Location, array, committed: Optional[Committed] = None):
        self.location, self.array, self.committed = location, array, committed
        self._root = f"{location.local}/" if location.local is not None else None  # a chunk's file: _root + key
        self._paths: Dict[int, str] = {}  # chunk -> its key
        self.n = array.shape[0]
        self.rows = (array.shards or array.chunks)[0]  # rows per stored object: a chunk, or a shard
        self.inner = array.chunks[0]
        self.bf16 = array.attrs.get(DTYPE_ATTR) == "bfloat16"
        self.stored = np.dtype(array.dtype)
        self.dtype = np.dtype(np.float32) if self.bf16 else self.stored
        self.row_shape = tuple(array.shape[1:])
        serializer, compressors = array.serializer, tuple(array.compressors)
        native = isinstance(serializer, BytesCodec) and (serializer.endian is None
                                                         or serializer.endian.value == sys.byteorder)
        self.crc = any(isinstance(c, Crc32cCodec) for c in compressors)
        self.sharded = array.shards is not None
        self.count = shard_count(array) if self.sharded else 1
        self.direct = (not array.filters and tuple(array.chunks[1:]) == self.row_shape
                       and all(decodes_in_thread(c) for c in (serializer, *compressors))
                       and (not self.sharded or _plain_shards(array)))
        self.raw = self.direct and native and all(isinstance(c, Crc32cCodec) for c in compressors)
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.stored.itemsize
        self.chunk_bytes = self.inner * self.row_bytes
        self.fast = self.raw and not self.bf16 and not self.sharded and location.local is not None
        if self.direct and not self.raw:  # (codec, spec) of the serializer, then each compressor, as written
            self._specs = codec_specs(array, array.chunks if self.sharded else None)
            self._own_crc = isinstance(self._specs[-1][0], Crc32cCodec)  # the last written: the first undone

    # -- what to read -------------------------------------------------------------------------------------
    def read(self, rows=None, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Rows `rows` (a slice, or integers in any order; None: all) as one array, written into `out` when
        given (its length is the number of rows)."""
        out = self.output(rows, out)
        read_all([(self, rows, out)])
        return out

    def block_rows(self, block_mb: float) -> int:
        """Rows in about `block_mb` MB of whole chunks (one chunk at the least): a streamed read's step."""
        row_bytes = max(1, int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize)
        return max(self.rows, int(block_mb * 2**20 / row_bytes) // self.rows * self.rows)

    def output(self, rows, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The array that `rows` are read into: `out` checked, or a new one."""
        start, stop, idx = self.request(rows)
        count = stop - start if idx is None else len(idx)
        if out is None:
            return empty((count, *self.row_shape), self.dtype)
        if out.shape != (count, *self.row_shape) or out.dtype != self.dtype:
            raise ValueError(f"out has shape {out.shape} and dtype {out.dtype}; the rows read have shape "
                             f"{(count, *self.row_shape)} and dtype {self.dtype}")
        return out

    def tasks(self, rows, out: np.ndarray) -> list:
        """The chunk reads that put `rows` into `out`: (reader, chunk, its rows, where they go) each."""
        start, stop, idx = self.request(rows)
        if idx is None and stop == start or idx is not None and not len(idx):
            return []
        if not self.direct:
            return [(self, None, (start, stop, idx), out)]
        return self._slice_tasks(start, stop, out) if idx is None else self._gather_tasks(idx, out)

    def request(self, rows) -> Tuple[int, int, Optional[np.ndarray]]:
        """(start, stop, None) of a contiguous request, else (0, 0, the row numbers)."""
        rows = subset(slice(0, self.n), rows)
        return (rows.start, rows.stop, None) if isinstance(rows, slice) else (0, 0, rows)

    def _slice_tasks(self, start: int, stop: int, out: np.ndarray) -> list:
        """(chunk, rows of it, where they go) for a contiguous request."""
        tasks = []
        for k in range(start // self.rows, -(-stop // self.rows)):
            lo, hi = max(start, k * self.rows), min(stop, (k + 1) * self.rows)
            tasks.append((self, k, slice(lo - k * self.rows, hi - k * self.rows), out[lo - start:hi - start]))
        return tasks

    def _gather_tasks(self, idx: np.ndarray, out: np.ndarray) -> list:
        """(chunk, its rows wanted, (out, where each goes)) for rows in any order."""
        order = np.argsort(idx, kind="stable")
        chunk = idx[order] // self.rows
        cuts = np.flatnonzero(np.diff(chunk)) + 1
        tasks = []
        for part in np.split(order, cuts):
            k = int(idx[part[0]] // self.rows)
            tasks.append((self, k, idx[part] - k * self.rows, (out, part)))
        return tasks

    # -- one chunk ------------------------------------------------------------------------------------------
    def task(self, k: Optional[int], rows, dest) -> Optional[str]:
        """Read chunk k and put `rows` of it in `dest`; its problem, or None."""
        if k is None:
            self._through_zarr(*rows, dest)
            return None
        if self.fast and isinstance(rows, slice) and dest.flags.c_contiguous:
            try:
                if self._read_into(k, rows, dest):
                    return None
            except _Damaged as err:  # missing, a link
                return str(err)
        return self.careful(k, rows, dest)

    def careful(self, k: int, rows, dest) -> Optional[str]:
        """Chunk k read whole, checked and decoded, `rows` of it put in `dest`; its problem, or None."""
        try:
            data = self._decode(k, self._get(k))
            if isinstance(dest, tuple):
                target, where = dest
                if self.bf16:  # a fancy-indexed target is a copy: convert, then assign
                    target[where] = bf16_bits_to_float32(data[rows])
                else:
                    target[where] = data[rows]
            elif self.bf16:
                bf16_bits_to_float32(data[rows], out=dest)
            else:
                dest[...] = data[rows]
            return None
        except _Damaged as err:
            return str(err)

    def cached(self, k: Optional[int]) -> bool:
        """Whether chunk k's first page is in the page cache (a read that must not wait; True where that
        cannot be asked: then nothing is advised)."""
        if k is None or self.location.local is None or not hasattr(os, "RWF_NOWAIT"):
            return True
        try:
            fd = os.open(self._root + self._path(k), READ)
        except OSError:
            return True
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
            return True
        except OSError:  # EAGAIN: it would wait for the disk
            return False
        finally:
            os.close(fd)

    def advise(self, k: Optional[int]) -> None:
        """Tell the kernel that chunk k's file will be read soon (local stores; it reads ahead, async)."""
        if k is None or self.location.local is None or not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = os.open(self._root + self._path(k), READ)
        except OSError:
            return  # a missing chunk: its read says so
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def _path(self, k: int) -> str:
        path = self._paths.get(k)
        if path is None:
            path = self._paths[k] = chunk_path(self.array, k)
        return path

    def _open(self, path: str) -> int:
        """A descriptor of a local chunk file, opened without following a symbolic link (a store holding one is
        damaged: hookrun never reads out of a store through a link); _Damaged if it is missing or a link."""
        try:
            return os.open(self._root + path, READ)
        except FileNotFoundError:
            raise _Damaged(f"{path}: chunk missing") from None
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise _Damaged(f"{path}: chunk is a symbolic link (to {os.readlink(self.location.local / path)}); "
                           "hookrun never reads through one") from None

    def _get(self, k: int) -> bytes:
        """The bytes of chunk k's file."""
        path = self._path(k)
        if self.location.local is not None:
            with os.fdopen(self._open(path), "rb") as f:
                return f.read()
        data = self.location.get(path)
        if data is None:
            raise _Damaged(f"{path}: chunk missing")
        return data

    def _read_into(self, k: int, rows: slice, dest: np.ndarray) -> bool:
        """Rows `rows` of raw local chunk k read straight into `dest` (contiguous) in one preadv call, the rows
        before and after them and the crc32c into this thread's scratch buffer, the crc32c summed over the three in
        file order: True if the chunk is sound and the one committed, False for the careful path (`careful`: the
        file read again whole) to name what is wrong: short, long, failing its crc32c, not the one committed."""
        path = self._paths.get(k) or self._path(k)
        body = memoryview(dest).cast("B")
        head, after = rows.start * self.row_bytes, (self.inner - rows.stop) * self.row_bytes
        scratch = _scratch(head + after + 8)
        tail = scratch[head + after:head + after + 8]  # 8 bytes: the crc32c, and a longer file shows
        parts = [scratch[:head], body, scratch[head:head + after], tail] if head or after else [body, tail]
        fd = self._open(path)
        try:
            got = os.preadv(fd, parts, 0)
        finally:
            os.close(fd)
        if got != self.chunk_bytes + 4 * self.crc:  # (a short read of a whole local file is rare: read again then)
            return False
        stored = -1
        if self.crc:
            stored = int.from_bytes(tail[:4], "little")
            crc = crc32c(body) if len(parts) == 2 else crc32c(parts[2], crc32c(body, crc32c(parts[0])))
            if crc != stored:
                return False
        try:
            self._check(k, path, got, stored)
        except _Damaged:
            return False
        return True

    def _check(self, k: int, path: str, size: int, crc: int) -> None:
        """_Damaged if stored object k (`size` bytes, its crc32c `crc`) is not the one the index committed."""
        known = self.committed
        if known is None or k == known.boundary:
            return
        want = known.sums.get(k)
        if want is None:
            if known.required:
                raise _Damaged(f"{path}: chunk has no committed size in {INDEX_DIR}/chunks (written after its commit?)")
            return
        if size != want[0]:
            raise _Damaged(f"{path}: chunk is {size} bytes but {want[0]} were committed (truncated or rewritten)")
        if want[1] != -1 and crc != want[1]:
            raise _Damaged(f"{path}: chunk is not the one committed here (crc32c {crc:08x}, committed "
                           f"{want[1]:08x}): moved or rewritten")

    def _decode(self, k: int, data: bytes) -> np.ndarray:
        """Chunk (or shard) k's stored bytes, checked against the committed ones and decoded with the array's
        codecs: [rows, ...] as stored."""
        path = self._path(k)
        if self.sharded:
            return self._decode_shard(k, path, data)
        rows = self._decode_chunk(path, data)  # its own crc32c first: damage in place is named as such
        self._check(k, path, len(data), int.from_bytes(data[-4:], "little") if self.crc else -1)
        return rows

    def _decode_chunk(self, path: str, data) -> np.ndarray:
        """One chunk's bytes (a whole chunk, or a shard's inner chunk) decoded: [inner rows, ...]."""
        if self.raw:
            body = memoryview(data)[:-4] if self.crc else memoryview(data)
            if len(body) != self.chunk_bytes:
                raise _Damaged(f"{path}: chunk is {len(data)} bytes, not {self.chunk_bytes + 4 * self.crc} (damaged)")
            if self.crc and crc32c(np.frombuffer(body, dtype=np.uint8)) != int.from_bytes(data[-4:], "little"):
                raise _Damaged(f"{path}: chunk fails its crc32c checksum (damaged)")
            return np.frombuffer(body, dtype=self.stored).reshape(self.inner, *self.row_shape)
        specs = self._specs
        if self._own_crc:  # checked here with the GIL released (zarr's codec holds it), then decoded without it
            if len(data) < 4 or crc32c(memoryview(data)[:-4]) != int.from_bytes(data[-4:], "little"):
                raise _Damaged(f"{path}: chunk fails its crc32c checksum (damaged)")
            specs, data = specs[:-1], memoryview(data)[:-4]
        try:
            return decode(specs, data)
        except Exception as err:  # noqa: BLE001 - the crc32c codec's mismatch, a codec that cannot decode
            if "checksum" in str(err).lower():
                raise _Damaged(f"{path}: chunk fails its crc32c checksum (damaged)") from None
            raise _Damaged(f"{path}: chunk does not decode ({type(err).__name__}: {err})") from None

    def _decode_shard(self, k: int, path: str, data: bytes) -> np.ndarray:
        """A shard's bytes, checked (its index's crc32c; its checksum, shard_sum, against the committed one) and
        each inner chunk decoded (and checked against its own crc32c): [shard rows, ...]; an inner chunk the
        shard does not hold is the fill value."""
        try:
            index = shard_index(path, data, self.count)
            self._check(k, path, len(data), shard_sum(path, data, self.count) if self.crc else -1)
        except ValueError as err:
            raise _Damaged(str(err)) from None
        out = np.empty((self.rows, *self.row_shape), dtype=self.stored)
        view = memoryview(data)
        for j, (offset, size) in enumerate(index.tolist()):
            part = out[j * self.inner:(j + 1) * self.inner]
            if offset == SHARD_EMPTY:
                part[...] = self.array.fill_value
            else:
                part[...] = self._decode_chunk(f"{path} (inner chunk {j})", view[offset:offset + size])
        return out

    def _through_zarr(self, start: int, stop: int, idx: Optional[np.ndarray], out: np.ndarray) -> np.ndarray:
        """Shards and unusual codecs: zarr reads them (its errors are the caller's to explain)."""
        data = self.array[start:stop] if idx is None else self.array.get_orthogonal_selection((idx,))
        if self.bf16:
            bf16_bits_to_float32(data, out=out)
        else:
            out[...] = data
        return out
