"""The store format (hookrun.format.layout): stores written by the previous version still read, keys round trip,
a newer format is refused, the documented index columns (docs/concepts/store.md) are the format's."""
import json
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

import hookrun
from hookrun.format.layout import FORMAT_VERSION, INDEX_COLUMNS, VERSION, array_key, parse_key, version
from hookrun.storage import Location
from hookrun.read.captures import NewerFormatError
from hookrun.store.place import check_path

V1 = Path(__file__).parent / "data" / "format_v1"  # written by commit bbbeb60, before checksums (format version 1)
STORE_DOC = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "store.md"


def test_v1_conv_fmaps_reads():
    cap = hookrun.open(V1 / "v1_conv_fmaps.zarr")
    assert cap.status == "complete" and version(cap.attrs) == 1 and VERSION not in cap.attrs
    assert list(cap.index.columns) == INDEX_COLUMNS and set(cap.index.unit) == {"sample"}
    assert sorted(cap.index.array) == ["fmaps/conv1/input.0", "fmaps/conv1/output", "model_output/_model/output"]
    out = cap.load(layer="conv1", role="output")
    assert out.shape == (1, 2, 2, 2) and out.dtype == np.float32
    assert (out[:, 0] == 9).all() and (out[:, 1] == 18).all()
    assert cap.verify() == [] and cap.verify(decode=True) == []


def test_v1_lm_tokens_reads():
    path = V1 / "v1_lm_tokens.zarr"
    cap = hookrun.open(path)
    assert version(cap.attrs) == 1 and list(cap.index.columns) == INDEX_COLUMNS
    assert set(cap.index.unit) == {"token"} and len(cap.batches) == 3
    assert len(cap.tokens()) == 712 and list(cap.tokens().columns) == ["sample", "position", "token_id", "token"]
    assert len(cap.samples) == 12 and cap.samples["sample"].tolist() == list(range(12))
    for layer in ("transformer.h.0", "transformer.h.1"):
        data = cap.load(layer=layer, role="output")
        # the chunk files read without zarr: raw little-endian float32, 256 rows each, the last one padded
        meta = json.loads((path / "resid" / layer / "output" / "zarr.json").read_text())
        assert meta["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
        raw = np.concatenate([np.frombuffer((path / "resid" / layer / "output" / f"c.{k}.0").read_bytes(), "<f4")
                              for k in range(3)]).reshape(-1, 64)[:712]
        assert data.shape == (712, 64) and np.array_equal(data, raw) and np.abs(raw).sum() > 0
    assert cap.verify() == [] and cap.verify(decode=True) == []


def test_v1_store_resume_refused_overwrite_accepted(tmp_path, run_cfg):
    """As before: create refuses an existing store, resume checks the config (the experiment's module moved since
    version 1, so it differs), overwrite replaces it with a version-3 store."""
    from hookrun.config.checks import ConfigError

    path = tmp_path / "old.zarr"  # where run_cfg(..., name="old") writes
    shutil.copytree(V1 / "v1_conv_fmaps.zarr", path)
    for mode, said in [("create", "already holds a hookrun run (status complete)"),
                       ("resume", f"resume refused, {path} was written with another config: model._target_")]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            run_cfg(["+experiment=conv_fmaps", f"store.mode={mode}", "device=auto"], name="old")  # as it was run
    assert version(hookrun.open(path).attrs) == 1  # untouched
    cap = run_cfg(["+experiment=conv_fmaps", "store.mode=overwrite"], name="old")
    assert cap.attrs[VERSION] == FORMAT_VERSION == 3 and cap.status == "complete" and cap.verify(decode=True) == []
    old = hookrun.open(V1 / "v1_conv_fmaps.zarr").load(layer="conv1", role="output")
    assert np.array_equal(cap.load(layer="conv1", role="output"), old)


@pytest.mark.parametrize("hook,layer,role", [("fmaps", "conv1", "output"), ("resid", "transformer.h.0", "input.0"),
                                             ("model_output", "_model", "output"), ("g", "a.b.c", "grad_input.1")])
def test_array_key_round_trips(hook, layer, role):
    assert parse_key(array_key(hook, layer, role)) == (hook, layer, role)
    assert array_key(hook, layer, role) == f"{hook}/{layer}/{role}"


def test_written_keys_parse_back():
    """The writer's keys (in the index) are the layout's: each parses back to its row's hook, layer and role."""
    cap = hookrun.open(V1 / "v1_conv_fmaps.zarr")
    for row in cap.index.itertuples():
        assert parse_key(row.array) == (row.hook, row.layer, row.role)
        assert array_key(row.hook, row.layer, row.role) == row.array


def test_newer_format_refused(tmp_path):
    path = tmp_path / "new.zarr"
    shutil.copytree(V1 / "v1_conv_fmaps.zarr", path)
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"][VERSION] = FORMAT_VERSION + 1
    (path / "zarr.json").write_text(json.dumps(meta))
    said = f"written in hookrun store format version {FORMAT_VERSION + 1}, but this hookrun reads versions 1 to " \
           f"{FORMAT_VERSION}; upgrade hookrun"
    with pytest.raises(NewerFormatError, match=re.escape(said)):
        hookrun.open(path)
    attrs = meta["attributes"]
    problems = check_path(Location(path), "resume", attrs["config_hash"], attrs["config"])
    assert len(problems) == 1 and problems[0].startswith("store.mode: resume refused, ") and said in problems[0]


def test_documented_index_columns_are_the_format():
    text = STORE_DOC.read_text()
    listed = re.search(r"Index columns: (`[^`]*`)", text.replace("\n", " ")).group(1).strip("`")
    assert [c.strip() for c in listed.split(",")] == INDEX_COLUMNS
    assert "format_version" in text


def test_a_memory_location_answers_as_a_local_one(tmp_path):
    """Location(memory://...) does its own reads and writes on fsspec's memory filesystem: every call answers as
    a store on a local disk does, for the same keys."""
    local, memory = Location(tmp_path / "s.zarr"), Location(f"memory://hookrun-test/{uuid.uuid4().hex}/s.zarr")
    assert type(memory).__name__ == "MemoryLocation" and memory.in_memory and not local.in_memory
    assert type(memory.child("sub")).__name__ == "MemoryLocation"
    for loc in (local, memory):
        loc.put("a/b", b"1")
        loc.put("a/c/d", [b"2", b"34"])  # pieces, joined
        loc.put_many([("x", memoryview(b"zz")), ("a/e", b"")])
        assert loc.put_if_absent("n", b"9") and not loc.put_if_absent("n", b"8")
    for call in [lambda l: l.get("a/c/d"), lambda l: l.get("absent"), lambda l: l.get("n"),
                 lambda l: [l.exists(k) for k in ("a/b", "a", "absent", "a/e")], lambda l: l.size("a/c/d"),
                 lambda l: l.keys(), lambda l: l.keys("a/"), lambda l: l.children(), lambda l: l.children("a/"),
                 lambda l: l.children("absent/"), lambda l: l.sizes("a/"), lambda l: l.sizes(""),
                 lambda l: [l.is_dir(k) for k in ("a", "x", "q")], lambda l: l.keys("a"),
                 lambda l: l.sizes_by_dir(["a", "a/c", "absent", "x"]),
                 lambda l: [l.lister()(p) for p in ("", "a", "a/", "a/c", "absent")]]:
        assert call(memory) == call(local)
    neighbour = Location(f"{memory}X")  # a store whose name starts with this one's: none of its keys are ours
    neighbour.put("a/b", b"not ours")
    neighbour.put("a/zz", b"not ours either")
    assert memory.keys() == local.keys() and memory.sizes("a/") == local.sizes("a/")
    fs, root = memory._mem, memory.fs_root.rstrip("/")
    for prefix in ("", "a/", "a/c/", "absent/"):  # one pass over the keys, as fsspec's own find answers
        found = fs.find(f"{root}/{prefix}".rstrip("/"), detail=True) if fs.exists(f"{root}/{prefix}") else {}
        want = {k[len(root) + 1:]: int(i["size"]) for k, i in found.items()
                if k.startswith(f"{root}/{prefix}") and i["type"] == "file"}
        assert memory.sizes(prefix) == want, prefix
    with pytest.raises(FileNotFoundError):
        memory.size("a/absent")
    for loc in (local, memory):
        loc.delete("a/b")
        loc.delete_dir("a/c")
    assert memory.keys() == local.keys() == ["a/e", "n", "x"]
