"""Data safety, round 2 (issue 17, items 7-8): silent corruption is found, and never read as data; every kill
point of a run ends, after a resume, in the store an uninterrupted run writes.

Kill points are storage writes and deletes, numbered in the order a run makes them: a run is stopped just
before write N, in process (the writes from N on are dropped, as a killed process makes none) or in a
subprocess that exits there with os._exit."""
import contextlib
import copy
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.engine.runner import Interrupted, run
from hookrun.storage import Location
from hookrun.format.files import DamagedError
from tests.helpers import RANDOM, REPO, make_cfg, run_in, same_bytes, without_run_ids

@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A complete store (raw arrays), one with every array lz4-compressed, and one stopped after batch 2."""
    base = tmp_path_factory.mktemp("stores")
    run_in(base / "raw.zarr", RANDOM)
    run_in(base / "lz4.zarr", [*RANDOM, "store.min_saving=0"])
    with pytest.raises(Interrupted):
        run_in(base / "killed.zarr", RANDOM, stop_at=13)
    return base


def flip(name, at=10, n=1):
    def damage(path):
        data = bytearray((path / name).read_bytes())
        for i in range(n):
            data[at + i] ^= 0xFF
        (path / name).write_bytes(bytes(data))
    return damage


def swap(a, b):
    def damage(path):
        x, y = (path / a).read_bytes(), (path / b).read_bytes()
        assert len(x) == len(y)
        (path / a).write_bytes(y), (path / b).write_bytes(x)
    return damage


def truncate(name, keep=20):
    return lambda path: (path / name).write_bytes((path / name).read_bytes()[:keep])


def extend(name, more=b"\0" * 4):
    return lambda path: (path / name).write_bytes((path / name).read_bytes() + more)


def delete(name):
    return lambda path: (path / name).unlink()


def edit_json(name, change):
    def damage(path):
        meta = json.loads((path / name).read_text())
        change(meta)
        (path / name).write_text(json.dumps(meta))
    return damage


OUT = "acts/fc1/output"
CHUNK_DAMAGE = [  # (store, damage, what verify says; load(fc1 output) refuses with it too)
    ("raw", flip(f"{OUT}/c.1.0"), f"{OUT}/c.1.0: chunk fails its crc32c checksum"),
    ("raw", flip(f"{OUT}/c.1.0", at=40, n=8), f"{OUT}/c.1.0: chunk fails its crc32c checksum"),
    ("raw", flip(f"{OUT}/c.2.0", at=-1), f"{OUT}/c.2.0: chunk fails its crc32c checksum"),  # in the checksum
    ("lz4", flip(f"{OUT}/c.1.0", at=30), f"{OUT}/c.1.0: chunk fails its crc32c checksum"),
    ("lz4", flip(f"{OUT}/c.3.0", at=30, n=8), f"{OUT}/c.3.0: chunk fails its crc32c checksum"),
    ("raw", truncate(f"{OUT}/c.3.0"), f"{OUT}/c.3.0: chunk is 20 bytes but"),
    ("raw", extend(f"{OUT}/c.3.0"), f"{OUT}/c.3.0: chunk is 168 bytes but 164"),  # 164 sound bytes, then more
    ("raw", delete(f"{OUT}/c.0.0"), f"{OUT}/c.0.0: chunk missing"),
]
OTHER_DAMAGE = [  # (store, damage, what verify says, what reading the store says: None = reads the right data)
    ("raw", swap(f"{OUT}/c.1.0", f"{OUT}/c.2.0"), f"{OUT}/c.1.0: chunk is not the one committed here", None),
    ("raw", swap(f"{OUT}/c.4.0", "acts/fc2/input.0/c.4.0"), f"{OUT}/c.4.0: chunk is not the one committed here", None),
    ("raw", flip("_index/index.parquet", at=200), "_index/index.parquet: 32859 bytes with crc32c", "index"),
    ("raw", flip("_index/batches.parquet", at=100), "_index/batches.parquet:", "batches"),
    ("raw", flip("_index/chunks.parquet", at=100), "_index/chunks.parquet:", "load"),  # what reads check chunks by
    ("raw", flip("_index/samples.parquet", at=100), "_index/samples.parquet:", "samples"),
    ("raw", delete("_index/samples.parquet"), "_index/samples.parquet: missing", "samples"),
    ("raw", delete("_index/index.parquet"), "_index/index.parquet: missing", "index"),
    ("raw", truncate(f"{OUT}/zarr.json", 50), f"{OUT}/zarr.json: does not parse", None),
    ("raw", delete(f"{OUT}/zarr.json"), f"{OUT}/zarr.json: missing (the consolidated copy", None),
    ("raw", edit_json(f"{OUT}/zarr.json", lambda m: m["attributes"].update(unit="token")),
     f"{OUT}/zarr.json: differs from its consolidated copy", None),
    ("raw", edit_json(f"{OUT}/zarr.json", lambda m: m.update(codecs=m["codecs"][:1])),
     f"{OUT}/zarr.json: differs from its consolidated copy", None),
    ("raw", delete("acts/fc1/zarr.json"), "acts/fc1/zarr.json: missing", None),
    ("raw", truncate("_index/zarr.json", 10), "_index/zarr.json: does not parse", None),
]


def damaged_copy(stores, tmp_path, name, damage) -> Path:
    path = tmp_path / f"{name}.zarr"
    shutil.copytree(stores / f"{name}.zarr", path)
    damage(path)
    return path


@pytest.mark.slow
def test_the_stores_are_whole_and_every_chunk_ends_in_its_crc32c(stores):
    for name in ("raw", "lz4"):
        cap = hookrun.open(stores / f"{name}.zarr")
        assert cap.verify() == [] and cap.verify(decode=True) == [] and cap.status == "complete"
        codecs = [type(c).__name__ for c in cap.array(OUT).compressors]
        assert codecs == (["Crc32cCodec"] if name == "raw" else ["BloscCodec", "Crc32cCodec"])
        assert sorted(cap.attrs["index_files"]) == ["batches.parquet", "chunks.parquet", "index.parquet",
                                                    "samples.parquet"]
        assert sorted(p.name for p in (stores / f"{name}.zarr/_index").iterdir()) == [
            "batches.parquet", "chunks.parquet", "index.parquet", "samples.parquet", "zarr.json"]


@pytest.mark.parametrize("store,damage,expected", CHUNK_DAMAGE)
def test_a_damaged_chunk_is_found_and_never_loaded(stores, tmp_path, store, damage, expected):
    path = damaged_copy(stores, tmp_path, store, damage)
    cap = hookrun.open(path)
    assert any(p.startswith(expected) for p in cap.verify()), cap.verify()
    assert any(p.startswith(expected) for p in cap.verify(decode=True)), cap.verify(decode=True)
    chunk = expected.split(":")[0]
    with pytest.raises(DamagedError) as err:
        cap.load(layer="fc1", role="output")
    assert str(err.value).startswith(f"{chunk}: chunk ") and "cap.verify() lists every damaged file" in str(err.value)
    k = int(chunk.split(".")[-2])  # rows 5k..5k+5
    with pytest.raises(DamagedError, match=chunk):
        cap.read_rows(OUT, [5 * k + 2])
    with pytest.raises(DamagedError, match=chunk):  # a chunk's middle row: its crc32c covers the rows left out
        cap.read_rows(OUT, slice(5 * k + 2, 5 * k + 3))
    ref = hookrun.open(stores / f"{store}.zarr")
    other = 5 * ((k + 1) % 4)
    np.testing.assert_array_equal(cap.read_rows(OUT, [other]), ref.read_rows(OUT, [other]))  # other chunks read
    np.testing.assert_array_equal(cap.read_rows(OUT, slice(other + 1, other + 3)),
                                  zarr.open_array(stores / f"{store}.zarr" / OUT, mode="r")[other + 1:other + 3])
    np.testing.assert_array_equal(cap.load(layer="fc2", role="output"), ref.load(layer="fc2", role="output"))


@pytest.mark.parametrize("store,damage,expected,refused", OTHER_DAMAGE)
def test_damaged_index_files_and_metadata_are_found(stores, tmp_path, store, damage, expected, refused):
    path = damaged_copy(stores, tmp_path, store, damage)
    cap = hookrun.open(path)
    assert any(p.startswith(expected) for p in cap.verify()), cap.verify()
    assert any(p.startswith(expected) for p in cap.verify(decode=True))
    ref = hookrun.open(stores / f"{store}.zarr")
    if refused:  # a table that is damaged or missing is never read as another (nor as no rows)
        with pytest.raises(DamagedError) as err:
            cap.load(layer="fc1", role="output") if refused == "load" else getattr(cap, refused)
        assert str(err.value).startswith(f"_index/{'chunks' if refused == 'load' else refused}.parquet:")
    else:  # readers use the consolidated copy of the metadata, which is whole: the data read is right
        assert cap.index.equals(ref.index) and cap.samples.equals(ref.samples)
        if "swap" not in damage.__qualname__:
            np.testing.assert_array_equal(cap.load(layer="fc1", role="output"), ref.load(layer="fc1", role="output"))


def test_a_store_whose_root_metadata_does_not_parse_is_named_damaged(stores, tmp_path):
    path = damaged_copy(stores, tmp_path, "raw", truncate("zarr.json", 50))
    with pytest.raises(DamagedError) as err:
        hookrun.open(path)
    assert str(err.value).startswith(f"{path}/zarr.json: the store's root metadata does not parse")
    with pytest.raises(DamagedError):
        hookrun.open(path.parent)  # the run dir


KILLED_DAMAGE = [  # a stopped run's store: (damage, what verify and the refused resume say)
    (flip(f"{OUT}/c.0.0"), f"{OUT}/c.0.0: chunk fails its crc32c checksum"),
    (flip(f"{OUT}/c.2.0", at=-3), f"{OUT}/c.2.0: chunk fails its crc32c checksum"),  # the partial last chunk
    (swap(f"{OUT}/c.0.0", "acts/fc2/output/c.0.0"), f"{OUT}/c.0.0: chunk is not the one committed here"),
    (flip("_index/part-000001.parquet", at=100), "_index/part-000001.parquet: "),
    (delete("_index/samples-000001.parquet"), "_index/samples-000001.parquet: missing"),
    (flip("_index/chunks-000000.parquet", at=100), "_index/chunks-000000.parquet: "),
    (delete("_index/sums-000002.json"), "_index/sums-000002.json: missing"),
    (truncate("_index/sums-000000.json", 5), "_index/sums-000000.json: does not parse"),
    (truncate(f"{OUT}/zarr.json", 50), f"{OUT}/zarr.json: the array's metadata does not read (JSONDecodeError"),
    (delete("acts/fc2/zarr.json"), "acts/fc2/zarr.json: missing"),
]


@pytest.mark.parametrize("damage,expected", KILLED_DAMAGE)
def test_a_damaged_stopped_store_is_found_and_its_resume_refused(stores, tmp_path, damage, expected):
    path = damaged_copy(stores, tmp_path, "killed", damage)
    assert hookrun.open(stores / "killed.zarr").verify() == []
    cap = hookrun.open(path)
    assert cap.status == "interrupted"
    assert any(p.startswith(expected) for p in cap.verify()), cap.verify()
    with pytest.raises(ConfigError) as err:
        run_in(path, [*RANDOM, "store.mode=resume"])
    assert f"is damaged: {expected}" in str(err.value) and "store.mode=overwrite" in str(err.value)
    assert hookrun.open(path).status == "interrupted"


@pytest.mark.slow
def test_a_store_written_before_checksums_opens_reads_verifies_and_resumes(tmp_path, monkeypatch):
    """No crc32c in the arrays, no sums of index files: as hookrun wrote stores before them."""
    from hookrun.store.streams import Streams

    codecs = Streams.codecs
    with monkeypatch.context() as old:
        old.setattr(Streams, "codecs", lambda self, compressed: codecs(self, compressed)[:-1])
        run_in(tmp_path / "old.zarr", RANDOM)
        with pytest.raises(Interrupted):
            run_in(tmp_path / "stopped.zarr", RANDOM, stop_at=13)
    for name in ("old", "stopped"):
        path = tmp_path / f"{name}.zarr"
        for sums in path.glob("_index/sums-*.json"):
            sums.unlink()
        root = zarr.open_group(str(path), mode="r+", use_consolidated=False)
        attrs = {k: v for k, v in root.attrs.items() if k not in ("index_files", "index_sums_from", "root_crc32c")}
        attrs["format_version"] = 2  # (version 3 stores record root_crc32c)
        root.attrs.put(attrs)
        if name == "old":
            zarr.consolidate_metadata(str(path))
    run_in(tmp_path / "new.zarr", RANDOM)
    new, old = hookrun.open(tmp_path / "new.zarr"), hookrun.open(tmp_path / "old.zarr")
    assert old.array(OUT).compressors == () and "index_files" not in old.attrs
    assert old.verify() == [] and old.verify(decode=True) == [] and old.samples.equals(new.samples)
    np.testing.assert_array_equal(old.load(layer="fc1", role="output"), new.load(layer="fc1", role="output"))
    run_in(tmp_path / "stopped.zarr", [*RANDOM, "store.mode=resume"])
    resumed = hookrun.open(tmp_path / "stopped.zarr")
    assert resumed.status == "complete" and resumed.verify(decode=True) == []
    assert resumed.array(OUT).compressors == ()  # one array keeps one encoding
    assert resumed.attrs["index_sums_from"] == 3 and resumed.index.equals(new.index)
    np.testing.assert_array_equal(resumed.load(layer="fc1", role="output"), new.load(layer="fc1", role="output"))


def test_a_reader_of_a_store_whose_run_closes_meanwhile_reads_it_whole(stores, tmp_path, monkeypatch):
    """Opened while the run was stopped (its parts committed); the resumed run completes and removes them just
    before the reader reads its first part: the reader reads the store as it is now, not `ArrowInvalid: Parquet
    file size is 0 bytes`."""
    path = tmp_path / "s.zarr"
    shutil.copytree(stores / "killed.zarr", path)
    reader = hookrun.open(path)
    assert reader.status == "interrupted"
    get, closed = Location.get, []

    def get_once_the_run_closed(self, key):
        if key.endswith("_index/part-000000.parquet") and not closed:
            closed.append(key)
            run_in(path, [*RANDOM, "store.mode=resume"])
            assert not (path / "_index/part-000000.parquet").exists()
        return get(self, key)
    monkeypatch.setattr(Location, "get", get_once_the_run_closed)
    ref = hookrun.open(stores / "raw.zarr")
    assert reader.index.equals(ref.index) and reader.samples.equals(ref.samples) and reader.status == "complete"
    np.testing.assert_array_equal(reader.load(layer="fc1", role="output"), ref.load(layer="fc1", role="output"))


# -- item 8: kill points -----------------------------------------------------------------------------------
KILL_RUNS = {  # 2 arrays; every batch committed (3 commits), or a dataset without len() committed at the close
    "commits": ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1,fc2]}",
                "+data.dataset._target_=tests.models.RandomItems", "+data.dataset.n=12", "data.batch_size=4",
                "store.chunk_rows=5", "store.commit_s=0", "store.writer=sync"],
    "at close": ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1,fc2]}",
                 "+data.dataset._target_=tests.models.RandomStream", "+data.dataset.n=12", "data.batch_size=4",
                 "store.chunk_rows=2", "store.commit_s=3600", "store.writer=sync"],  # arrays grow, then are trimmed
}


@functools.lru_cache(maxsize=None)
def _composed(name: str, mode: str):
    return make_cfg([*KILL_RUNS[name], f"store.mode={mode}", "store.path=unset"])


def kill_cfg(path: Path, name: str, mode: str = "create"):
    """A run of KILL_RUNS into `path` (composed once: a run at every kill point)."""
    cfg = copy.deepcopy(_composed(name, mode))
    cfg.store.path = str(path)
    return cfg


class Killed(BaseException):
    """Where the in-process kill stops the run (nothing catches a BaseException but the writer's clean-up)."""


@contextlib.contextmanager
def storage_writes(before_write):
    """Every write and delete of a store, local or zarr's own, calls `before_write(description)` first: a false
    return drops it."""
    orig = dict(put=Location.put, put_many=Location.put_many, local_file=Location.local_file,
                delete_dir=Location.delete_dir, set=LocalStore.set, set_if=LocalStore.set_if_not_exists,
                delete=LocalStore.delete)

    def put(self, key, data):
        if before_write(f"put {key}"):
            orig["put"](self, key, data)

    def put_many(self, items):  # each key a write of its own (a kill between two of them leaves the first)
        for key, data in items:
            put(self, key, data)

    @contextlib.contextmanager
    def local_file(self, key):
        with orig["local_file"](self, key) as path:
            yield path
            before_write(f"file {key}")

    def delete_dir(self, prefix):
        if before_write(f"delete {prefix}/"):
            orig["delete_dir"](self, prefix)

    async def zarr_set(self, key, value):
        if before_write(f"set {key}"):
            await orig["set"](self, key, value)

    async def zarr_set_if(self, key, value):
        if before_write(f"set {key}"):
            await orig["set_if"](self, key, value)

    async def zarr_delete(self, key):
        if before_write(f"delete {key}"):
            await orig["delete"](self, key)
    Location.put, Location.put_many, Location.local_file, Location.delete_dir = put, put_many, local_file, delete_dir
    LocalStore.set, LocalStore.set_if_not_exists, LocalStore.delete = zarr_set, zarr_set_if, zarr_delete
    try:
        yield
    finally:
        Location.put, Location.put_many = orig["put"], orig["put_many"]
        Location.local_file, Location.delete_dir = orig["local_file"], orig["delete_dir"]
        LocalStore.set, LocalStore.set_if_not_exists, LocalStore.delete = orig["set"], orig["set_if"], orig["delete"]


def writes_until(path: Path, name: str, kill_at=None, exit=None) -> list:
    """Run KILL_RUNS[name] into `path`, stopped just before write `kill_at` (1-based): in process (later writes
    are dropped), or with `exit` (os._exit) in a subprocess. Returns the writes made, described."""
    made, dead = [], []

    def before_write(what):
        if dead:
            return False
        if len(made) + 1 == kill_at:
            dead.append(what)
            if exit:
                exit(9)
            raise Killed(what)
        made.append(what)
        return True
    with storage_writes(before_write):
        try:
            run(kill_cfg(path, name))
        except BaseException:  # noqa: BLE001 - the kill, or what the run raised after it
            if not dead:
                raise
    return made


def kill_in_subprocess(n: int, path: str) -> None:
    """The subprocess of a real kill: exits with os._exit just before write n (`python -c`)."""
    logging.disable(logging.WARNING)
    writes_until(Path(path), "commits", n, exit=os._exit)


def files(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.is_file() and p.name != ".hookrun.lock"}


def same_as_uninterrupted(path: Path, ref: Path) -> None:
    """Every file of `path` is one of `ref` and bytes-equal (arrays, chunks, metadata), but for what holds times:
    the root attrs (equal but for times and the resume) and the merged tables (equal but for batch timings)."""
    mine, theirs = files(path), files(ref)
    assert sorted(mine) == sorted(theirs)
    timed = {"zarr.json", "_index/batches.parquet", "_index/index.parquet", "_index/chunks.parquet",
             "_index/samples.parquet"}
    assert all(same_bytes(mine[k], theirs[k]) for k in mine if k not in timed)
    a, b = hookrun.open(path), hookrun.open(ref)
    meta = [json.loads(p.read_text()) for p in (path / "zarr.json", ref / "zarr.json")]
    assert without_run_ids(meta[0]["consolidated_metadata"]) == without_run_ids(meta[1]["consolidated_metadata"])
    assert a.status == "complete" and a.verify(decode=True) == []
    assert a.index.equals(b.index) and a.samples.equals(b.samples) and a.table("chunks").equals(b.table("chunks"))
    cols = ["batch", "sample_start", "sample_stop", "loss"]
    assert a.batches[cols].equals(b.batches[cols])
    times = {"started", "finished", "summary", "index_files", "resumed_at_batch", "config", "overrides", "root_crc32c",
             "run_id"}
    assert {k: v for k, v in a.attrs.items() if k not in times} == {k: v for k, v in b.attrs.items() if k not in times}
    a.config["store"].update(path=None, mode=None)
    b.config["store"].update(path=None, mode=None)
    assert a.config == b.config
    for name in ("index", "samples", "chunks"):  # the same bytes: only batches.parquet holds timings
        file = f"{name}.parquet"
        assert a.attrs.get("index_files", {}).get(file) == b.attrs.get("index_files", {}).get(file)


def phase(writes: list, n: int) -> str:
    """Where write n (1-based) of a run is: the close (after its last commit), creation (the metadata of the store,
    its index and each group and array, up to the first commit, which writes the arrays' with it) or the run
    (chunks, array resizes, commits)."""
    sums = [i for i, w in enumerate(writes) if w.startswith("put _index/sums-")]
    if n > max(sums) + 2:
        return "close"
    return "create" if writes[n - 1].endswith("zarr.json") and n <= sums[0] else "run"


@pytest.mark.parametrize("name", KILL_RUNS)
@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_every_kill_point_leaves_a_readable_store_that_resumes_bitwise(tmp_path, name):
    ref = tmp_path / "ref.zarr"
    writes = writes_until(ref, name)
    assert writes[:2] == ["set zarr.json", "set _index/zarr.json"] and writes[-1].startswith("delete _index/")
    logging.disable(logging.WARNING)  # 2 runs a kill point
    tried = {"create": 0, "run": 0, "close": 0}
    try:
        for n in range(1, len(writes) + 1):
            path = tmp_path / f"killed-{n}.zarr"
            assert writes_until(path, name, n) == writes[:n - 1]
            if n > 1:  # the store as the kill left it opens, reads and verifies whole
                killed = hookrun.open(path)
                assert killed.verify() == [], (n, writes[n - 1], killed.verify())
                assert set(killed.index.batch) <= set(killed.batches.batch), (n, writes[n - 1])
                assert len(killed.samples) == 4 * len(killed.batches)
            run(kill_cfg(path, name, "resume"))
            try:
                same_as_uninterrupted(path, ref)
            except AssertionError as err:
                raise AssertionError(f"killed before write {n} ({writes[n - 1]}): {err}") from err
            tried[phase(writes, n)] += 1
            shutil.rmtree(path)
    finally:
        logging.disable(logging.NOTSET)
    assert min(tried.values()) >= 7, tried  # each phase at several writes (the creation: the root's, the index dir's,
    # each group's and array's zarr.json, a resize)
    print(f"{name}: kill points resumed bitwise: {tried} of {len(writes)}")


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_real_kills_in_creation_commits_and_close_resume_bitwise(tmp_path, caplog):
    ref = tmp_path / "ref.zarr"
    writes = writes_until(ref, "commits")
    points = {  # kill just before: the _index group (the root exists), a commit's committed_parts, the first
        "after the root": writes.index("set _index/zarr.json") + 1,  # removal of a part (complete, with its parts)
        "before a commit": writes.index("set zarr.json", writes.index("put _index/batches-000001.parquet")) + 1,
        "after complete": writes.index("delete _index/part-000000.parquet") + 1,
    }
    for what, n in points.items():
        path = tmp_path / f"{n}.zarr"
        proc = subprocess.run([sys.executable, "-c", "import sys; from tests.test_safety_corrupt import "
                               "kill_in_subprocess as k; k(int(sys.argv[1]), sys.argv[2])", str(n), str(path)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 9, proc.stderr
        killed = hookrun.open(path)
        assert killed.verify() == []
        if what == "after complete":
            assert killed.status == "complete" and (path / "_index/part-000000.parquet").exists()
        else:
            assert killed.status == "running"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hookrun"):
            run(kill_cfg(path, "commits", "resume"))
        if what == "after complete":
            assert "finishing the close of its run (removing 15 index file(s) it left)" in caplog.text
        same_as_uninterrupted(path, ref)
