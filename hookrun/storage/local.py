"""A store in a local directory, and every write into one: none follows a symbolic link.

    loc = Location("outputs/run/captures.zarr")     # its backend a LocalBackend (`~` expanded; `file://` local)
    write_file(root, "a/b/c.0", data, tmp_name)     # a key written whole (temp file, rename), no link followed
    os.close(open_dir(root, ["a", "b"]))            # a directory opened from the root, LinkError at a link
    NoLinkStore(root)                               # zarr's own writes (metadata, shards) as safe as hookrun's

hookrun never follows a symbolic link inside a store: `links()` lists them (without following any) so that a store
holding one is refused, and every write (`put`, `local_file`, zarr's own through NoLinkStore) opens its directories
from the store's root with O_NOFOLLOW (open_dir): a directory replaced by a link mid-run raises LinkError naming it.
Reads of hookrun's own keys are done in the calling thread (zarr's LocalStore hops two threads a call, more than a
small file's read costs).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from zarr.storage import LocalStore

from hookrun.storage.internals import LocalWrites, sync
from hookrun.storage.location import BACKENDS, Backend, Kind, is_url

# put's temp file `<chunk, index file or metadata>.<pid>.partial`, zarr's `<stem>.<uuid>.partial`
_PARTIAL_WRITE = re.compile(r"(c(\.\d+)+|[\w.-]+\.(parquet|json|npy))\.\d+\.partial|[\w.-]+\.[0-9a-f]{32}\.partial")


def is_partial_write(name: str) -> bool:
    """Whether a file name is the temp file of a write in flight, or of one a killed process cut short."""
    return _PARTIAL_WRITE.fullmatch(name) is not None


# kernel filesystems that hold no files of their own: a store there cannot be made
PSEUDO_FILESYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf",
                      "pstore", "efivarfs", "devpts", "mqueue", "binfmt_misc", "fusectl", "nsfs", "rpc_pipefs"}


def _filesystem_type(path: str) -> Optional[str]:
    """The type of the filesystem holding `path` (Linux: /proc/self/mounts), or None where that cannot be told."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    best, kind = "", None
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def local_problem(path) -> Optional[str]:
    """Why a local store cannot be made at `path`, found without writing anything (None if nothing is seen): a parent
    that is a file, a kernel filesystem (/proc, /sys), a directory this user cannot write."""
    path = Path(os.path.abspath(path))
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory" if existing != path else None  # a file at `path`: not a store
    kind = _filesystem_type(os.path.realpath(existing))
    if kind in PSEUDO_FILESYSTEMS:
        return f"{existing} is on {kind}, a kernel filesystem that holds no files"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable (permissions, or a read-only filesystem)"
    return None


# -- writes that never follow a link ------------------------------------------------------------------------------
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkError(OSError):
    """A directory of a store is a symbolic link (or not a directory): hookrun writes nothing through it."""


def _link_error(root: Path, parts: List[str], fd: int) -> LinkError:
    name, where = parts[-1], "/".join(parts)
    try:
        what = f"a symbolic link to {os.readlink(name, dir_fd=fd)}"
    except OSError:
        what = "not a directory"
    return LinkError(errno.ELOOP, f"{root}/{where}: is {what}, not the store's directory (replaced while the run "
                                  "wrote?); hookrun writes nothing through a link, so the write stopped here")


def open_dir(root: Path, parts: List[str], create: bool = True) -> int:
    """A descriptor of the directory root/parts[0]/parts[1]/..., each opened from the one above without following
    a link (O_NOFOLLOW; created where missing if `create`); LinkError names a directory that is a link."""
    try:
        fd = os.open(root, _DIR)  # the store's own path may be a link the user chose; nothing below it may be
    except FileNotFoundError:
        if not create:
            raise
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, _DIR)
    made = False  # a directory this call made: what is below it is made too, without looking first
    try:
        for i, name in enumerate(parts):
            if made:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
            for attempt in (0, 1):
                try:
                    below = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=fd)
                    break
                except FileNotFoundError:
                    if not create or attempt:
                        raise
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)
                        made = True
                    except FileExistsError:
                        pass
                except OSError as err:
                    if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise _link_error(root, parts[:i + 1], fd) from None
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(root: Path, key: str, data, tmp_name: str, exclusive: bool = False) -> None:
    """`key` below `root` written whole (a temp file `tmp_name` beside it, then a rename), through directory
    descriptors opened without following links (open_dir): nothing is written outside the store, whatever
    became of its directories. `exclusive`: FileExistsError if `key` exists."""
    *dirs, name = key.split("/")
    dfd = open_dir(root, dirs)
    try:
        _write_in(dfd, name, data, tmp_name, exclusive)
    finally:
        os.close(dfd)


def write_files(root: Path, items: List[tuple], tag) -> None:
    """Each (key, data) of `items` written as write_file writes it; consecutive keys of one directory through one
    open_dir of it (a batch's chunks of an array: one walk down from the root instead of one a file)."""
    i = 0
    while i < len(items):
        where = items[i][0].rpartition("/")[0]
        dfd = open_dir(root, where.split("/") if where else [])
        try:
            while i < len(items) and items[i][0].rpartition("/")[0] == where:
                key, data = items[i]
                name = key.rpartition("/")[2]
                _write_in(dfd, name, data, _tmp_name(key, tag))
                i += 1
        finally:
            os.close(dfd)


def _write_in(dfd: int, name: str, data, tmp_name: str, exclusive: bool = False) -> None:
    """`name` in the directory `dfd` written whole: a temp file `tmp_name` beside it, then a rename."""
    fd = os.open(tmp_name, _NEW, 0o644, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.writelines(data if isinstance(data, list) else [data])
        if exclusive:
            os.link(tmp_name, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            os.unlink(tmp_name, dir_fd=dfd)
        else:
            os.replace(tmp_name, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:  # a full disk (this frees room for the final status), a signal mid-write
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name, dir_fd=dfd)
        raise


def _tmp_name(key: str, tag) -> str:
    return f"{key.rsplit('/', 1)[-1]}.{tag}.partial"


def check_dirs(root: Path, key: str) -> None:
    """LinkError if a directory above `key` (below `root`) is a link (FileNotFoundError-free: a missing one is
    fine); what zarr's own deletes check first."""
    dirs = key.strip("/").split("/")[:-1]
    try:
        os.close(open_dir(root, dirs, create=False))
    except FileNotFoundError:
        pass


def remove_tree(root: Path, prefix: str) -> None:
    """Remove root/prefix and everything below it without following any link (shutil.rmtree with a dir_fd);
    a link in its place is left, and nothing it points to is touched."""
    *dirs, name = prefix.strip("/").split("/")
    try:
        dfd = open_dir(root, dirs, create=False)
    except FileNotFoundError:
        return
    try:
        shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
    finally:
        os.close(dfd)


class NoLinkStore(LocalWrites):
    """zarr's LocalStore whose writes open their directories from the store's root without following a link
    (write_file), and whose deletes refuse a directory that became one: zarr's own writes (array metadata,
    shards, root attrs) are as safe as hookrun's.

        zarr.open_group(store=NoLinkStore(root), mode="r+")"""

    def write(self, key: str, data, exclusive: bool) -> None:
        write_file(self.root, key, data, _tmp_name(key, uuid.uuid4().hex), exclusive)

    async def delete(self, key: str) -> None:
        self.check_writable()
        check_dirs(self.root, key)
        await super().delete(key)

    def delete_sync(self, key: str) -> None:
        check_dirs(self.root, key)
        super().delete_sync(key)

    async def delete_dir(self, prefix: str) -> None:
        self.check_writable()
        check_dirs(self.root, prefix.rstrip("/") + "/x")
        await super().delete_dir(prefix)


class LocalBackend(Backend):
    """A store in a local directory (`local`): hookrun's reads and writes of its own keys are file operations in the
    calling thread; zarr's go through NoLinkStore (writes) and a read-only LocalStore (reads)."""

    def __init__(self, path: str, storage_options=None, retry_s=None, retry=None):
        self.local = Path(path).expanduser()  # once, here: every key below is a plain path
        self.url = str(self.local)
        self.zarr_store = NoLinkStore(self.local)  # the writer's (opening it creates the directory)
        self.reader = LocalStore(self.local, read_only=True)  # reads never create anything

    def _read(self, call, absent):
        """Run a read on the reader; `absent` if the directory does not exist (yet)."""
        try:
            return sync(call(self.reader))
        except FileNotFoundError:
            if not self.local.is_dir():
                return absent
            raise

    def get(self, key: str) -> Optional[bytes]:
        """Read in the calling thread (what zarr's LocalStore does in a worker thread: the two thread hops cost
        more than a small file's read)."""
        try:
            return (self.local / key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def put(self, key: str, data) -> None:
        """A temp file and a rename in the calling thread, through directories opened without following a link
        (through zarr's event loop each put hops two threads, which cost ~12% of a run's wall time on
        uncompressed captures: benchmarked)."""
        write_file(self.local, key, data, _tmp_name(key, os.getpid()))

    def put_many(self, items: List[tuple]) -> None:
        """Each put as `put` does it, the keys of one directory through one walk down to it (write_files)."""
        write_files(self.local, items, os.getpid())

    def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            write_file(self.local, key, [data], _tmp_name(key, os.getpid()), exclusive=True)
        except FileExistsError:
            return False
        return True

    def exists(self, key: str) -> bool:
        return (self.local / key).is_file()  # (in the calling thread, as zarr's LocalStore checks it)

    def sizes(self, prefix: str) -> Dict[str, int]:
        """{key: bytes} of every file below `prefix`, walked with os.scandir (a directory's entries typed without a
        call each: a run's close lists every chunk twice); a link to a directory is not walked into, a link to a
        file counts its target's size (as Path.rglob and is_file did)."""
        base = self.local / prefix
        if not base.is_dir():
            return {}
        found: Dict[str, int] = {}
        stack = [(str(base), base.relative_to(self.local).as_posix())]
        while stack:
            path, key = stack.pop()
            with os.scandir(path) as entries:
                for entry in entries:
                    name = f"{key}/{entry.name}" if key != "." else entry.name
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((entry.path, name))
                    elif entry.is_file():
                        found[name] = entry.stat().st_size
        return dict(sorted(found.items()))

    def sizes_by_dir(self, dirs) -> Dict[str, int]:
        """Each directory walked (no link followed out of it)."""
        return {d: sum(self.sizes(f"{d}/").values()) for d in dirs}

    def is_dir(self, prefix: str) -> bool:
        return (self.local / prefix).is_dir()

    def delete_tree(self, prefix: str) -> None:
        remove_tree(self.local, prefix)

    def links(self, prefix: str) -> Dict[str, str]:
        found: Dict[str, str] = {}
        start = self.local / prefix
        if prefix and start.is_symlink():
            return {prefix.rstrip("/"): os.readlink(start)}
        stack = [start]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                if entry.is_symlink():
                    found[Path(entry.path).relative_to(self.local).as_posix()] = os.readlink(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
        return dict(sorted(found.items()))

    def drop_partial_writes(self) -> List[str]:
        """`put`'s `<key>.<pid>.partial` and zarr's `<stem>.<uuid>.partial` that a killed process left."""
        if not self.local.is_dir():
            return []
        dropped = []
        for path in self.local.rglob("*.partial"):
            if is_partial_write(path.name) and path.is_file():
                path.unlink(missing_ok=True)
                dropped.append(path.relative_to(self.local).as_posix())
        return dropped

    @contextlib.contextmanager
    def local_file(self, key: str) -> Iterator[Path]:
        """A path in `key`'s directory, held open (never written through a link made since): renamed into place
        on success."""
        *dirs, name = key.split("/")
        dfd = open_dir(self.local, dirs)
        here = Path(f"/proc/self/fd/{dfd}")  # that directory itself (Linux); else its real path, checked
        base = here if here.is_dir() else Path(os.path.realpath(self.local.joinpath(*dirs)))
        try:
            yield base / f"{name}.tmp"
            os.replace(f"{name}.tmp", name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{name}.tmp", dir_fd=dfd)
            os.close(dfd)


BACKENDS.append(Kind(lambda path: not is_url(path), LocalBackend))  # the last: any path that is not a URL
