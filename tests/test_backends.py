"""One suite for every storage backend (as zarr's StoreTests): each test runs on a `Location` of a local
directory and of the SeaweedFS S3 server (the `s3` fixture; skipped where it is not installed)."""
import itertools
import os

import numpy as np
import pandas as pd
import pytest

from hookrun.format.files import parquet_bytes, read_table
from hookrun.storage import Location

_fresh = itertools.count()


@pytest.fixture(params=["local", "memory", "s3"])
def loc(request, tmp_path):
    """An empty Location on each backend."""
    if request.param == "local":
        yield Location(tmp_path / "store.zarr")
        return
    if request.param == "memory":
        loc = Location(f"memory://hookrun-test/{os.getpid()}-{next(_fresh)}.zarr")
        yield loc
        loc.delete_all()
        return
    s3 = request.getfixturevalue("s3")
    yield Location(s3.url(f"backends/{os.getpid()}-{next(_fresh)}.zarr"), s3.storage_options)


def test_get_of_an_absent_key_is_none(loc):
    assert loc.get("nothing/here") is None
    assert not loc.exists("nothing/here")


def test_put_then_get_returns_the_bytes(loc):
    loc.put("a/b/c.0", b"\x00\x01hello")
    assert loc.get("a/b/c.0") == b"\x00\x01hello"
    assert loc.exists("a/b/c.0") and loc.size("a/b/c.0") == 7


def test_put_of_a_list_of_buffers_writes_them_joined(loc):
    loc.put("k", [b"abc", memoryview(b"def"), bytearray(b"gh")])
    assert loc.get("k") == b"abcdefgh"


def test_put_replaces_a_key_whole(loc):
    loc.put("k", b"a much longer first value")
    loc.put("k", b"short")
    assert loc.get("k") == b"short"


def test_put_many_writes_every_key(loc):
    loc.put_many([(f"arr/c.{i}", [bytes([i]) * 3, b"!"]) for i in range(5)])
    assert [loc.get(f"arr/c.{i}") for i in range(5)] == [bytes([i]) * 3 + b"!" for i in range(5)]
    # keys of several directories, a directory coming back, the root, a new nested one
    mixed = [("arr/c.0", b"a"), ("arr/c.9", b"b"), ("other/x", b"c"), ("arr/c.1", b"d"), ("top", b"e"),
             ("new/deep/er/k", b"f"), ("new/deep/k", b"g")]
    loc.put_many(mixed)
    assert [loc.get(k) for k, _ in mixed] == [v for _, v in mixed]
    assert loc.get("arr/c.2") == bytes([2]) * 3 + b"!"


def test_put_if_absent_creates_once_and_keeps_the_first_value(loc):
    assert loc.put_if_absent("lock", b"first") is True
    assert loc.put_if_absent("lock", b"second") is False
    assert loc.get("lock") == b"first"


def test_keys_lists_every_key_below_a_prefix_sorted(loc):
    for key in ["g/b", "g/a", "g/sub/c", "other/d"]:
        loc.put(key, b"x")
    assert loc.keys("g/") == ["g/a", "g/b", "g/sub/c"]
    assert loc.keys() == ["g/a", "g/b", "g/sub/c", "other/d"]
    assert loc.keys("none/") == []


def test_children_lists_the_names_directly_below(loc):
    for key in ["g/b", "g/a", "g/sub/c", "top"]:
        loc.put(key, b"x")
    assert loc.children("g") == ["a", "b", "sub"]
    assert loc.children() == ["g", "top"]
    assert loc.children("none") == []


def test_is_dir_is_true_for_a_prefix_holding_keys(loc):
    loc.put("g/sub/c", b"x")
    assert loc.is_dir("g") and loc.is_dir("g/sub")
    assert not loc.is_dir("none")


def test_sizes_gives_every_key_below_a_prefix_its_bytes(loc):
    loc.put("g/a", b"1234")
    loc.put("g/sub/b", b"12")
    loc.put("h/c", b"1")
    assert loc.sizes("g/") == {"g/a": 4, "g/sub/b": 2}
    assert loc.sizes("none/") == {}


def test_delete_removes_one_key(loc):
    loc.put("g/a", b"1")
    loc.put("g/b", b"2")
    loc.delete("g/a")
    assert not loc.exists("g/a") and loc.get("g/b") == b"2"


def test_delete_dir_removes_every_key_below_a_prefix(loc):
    for key in ["g/a", "g/sub/b", "gg/c"]:
        loc.put(key, b"x")
    loc.delete_dir("g/")
    assert loc.keys() == ["gg/c"]


def test_a_store_without_links_lists_none(loc):
    loc.put("g/a", b"x")
    assert loc.links() == {} and loc.links("g/") == {}


def test_parquet_written_reads_back_equal(loc):
    df = pd.DataFrame({"batch": [0, 1, 2], "layer": ["fc1", "fc2", "fc1"], "loss": [0.5, None, 1.5]})
    loc.put("_index/part-000000.parquet", parquet_bytes(df))
    pd.testing.assert_frame_equal(read_table(loc, "_index/part-000000.parquet"), df)
    assert read_table(loc, "_index/part-000000.parquet", columns=["layer"]).layer.tolist() == ["fc1", "fc2", "fc1"]


def test_a_local_file_becomes_the_key_whole_on_success(loc):
    with loc.local_file("_index/index.parquet") as path:
        with open(path, "wb") as f:
            f.write(b"part one, ")
            f.write(b"part two")
        assert not loc.exists("_index/index.parquet")
    assert loc.get("_index/index.parquet") == b"part one, part two"


def test_a_local_file_is_not_written_when_the_body_raises(loc):
    with pytest.raises(RuntimeError):
        with loc.local_file("_index/index.parquet") as path:
            path.write_bytes(b"half")
            raise RuntimeError("stopped")
    assert not loc.exists("_index/index.parquet")


def test_a_child_location_reads_the_keys_below_its_name(loc):
    loc.put("run/captures.zarr/k", b"v")
    child = loc.child("run/captures.zarr")
    assert child.get("k") == b"v" and child.keys() == ["k"]


def test_a_zarr_array_written_through_the_group_reads_back(loc):
    root = loc.open_group("w")
    root.create_array("acts/fc1", shape=(5, 2), chunks=(2, 2), dtype="float32")[:] = np.arange(10).reshape(5, 2)
    again = loc.open_group("r")
    np.testing.assert_array_equal(again["acts/fc1"][:], np.arange(10, dtype=np.float32).reshape(5, 2))
    assert loc.exists("acts/fc1/zarr.json") and loc.exists("acts/fc1/c/0/0")


# -- what only a local directory has --------------------------------------------------------------------------
def test_links_lists_a_symbolic_link_without_following_it(tmp_path):
    loc = Location(tmp_path / "store.zarr")
    loc.put("g/a", b"x")
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "store.zarr" / "g" / "linked")
    assert loc.links() == {"g/linked": str(tmp_path / "elsewhere")}
    assert loc.links("g/linked") == {"g/linked": str(tmp_path / "elsewhere")}


def test_drop_partial_writes_removes_only_temp_files_of_writes(tmp_path):
    loc = Location(tmp_path / "store.zarr")
    loc.put("acts/c.0.0", b"whole")
    for name in ["acts/c.1.0.4242.partial", "_index/part-000001.parquet.77.partial", "notes.partial"]:
        (tmp_path / "store.zarr" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "store.zarr" / name).write_bytes(b"half")
    assert sorted(loc.drop_partial_writes()) == ["_index/part-000001.parquet.77.partial", "acts/c.1.0.4242.partial"]
    assert loc.keys() == ["acts/c.0.0", "notes.partial"]


def test_a_local_path_has_tilde_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Location("~/runs/a.zarr").local == tmp_path / "runs" / "a.zarr"
