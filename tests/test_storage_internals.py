"""hookrun.storage.internals, the one module that uses zarr's and fsspec's insides: each name it uses exists with the
parameters it passes (a zarr or fsspec upgrade that moves one fails here, by name, not somewhere in a run), the
installed zarr is one pyproject.toml allows, what it builds equals what zarr builds, and no other module of hookrun
reaches into zarr or fsspec."""
import ast
import re
from pathlib import Path

import numpy as np
import pytest
import zarr
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hookrun.storage import internals
from hookrun.storage.internals import (array_metadata, codec_specs, decode, group_json, metadata_json,
                                       resize_in_place, with_attributes)

ROOT = Path(__file__).resolve().parent.parent
# names of zarr's and fsspec's that are theirs alone (hookrun names none of its own so)
PRIVATE = {"_async_array", "_decode_sync", "_encode_sync", "_check_writable", "_ensure_open_sync", "_is_open",
           "_pipe_file", "_put_file", "_find", "_info", "_cat_file", "_wrap_all_sync_methods", "_set_many",
           "_get_many", "_with_store", "_store", "sync_fs", "pseudo_dirs", "codec_pipeline", "_async_group",
           "_getitem_consolidated"}
INTERNAL_MODULES = re.compile(r"zarr\.core(\.|$)|zarr\.storage\._|zarr\.codecs\._|fsspec\.(implementations|asyn)")
STORE_CLASSES = {"LocalStore", "FsspecStore", "MemoryStore", "WrapperStore", "ZipStore", "ObjectStore",
                 "AsyncFileSystemWrapper", "AsyncFileSystem", "MemoryFileSystem"}


@pytest.mark.parametrize("what", sorted(internals.used()))
def test_each_inside_of_zarr_and_fsspec_used_is_there_with_the_parameters_passed(what):
    obj, names = internals.used()[what]
    assert obj is not None, what
    if names is None:
        return
    have = internals.parameters(obj)
    at = 0
    for name in names:  # in the order passed (a positional argument moved is a break too)
        assert name in have[at:], (f"{what}: zarr {zarr.__version__} takes {have}; hookrun.storage.internals "
                                   f"passes {names}: update the adapter (and pyproject.toml's zarr bound)")
        at = have.index(name) + 1


def test_the_installed_zarr_is_one_the_project_allows():
    text = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'"zarr([^"]*)"', text).group(1)
    assert SpecifierSet(spec).contains(Version(zarr.__version__)), \
        f"zarr {zarr.__version__} is outside pyproject.toml's {spec}, the versions hookrun.storage.internals is tested on"
    assert "<" in spec, "zarr needs an upper bound: hookrun.storage.internals uses its insides"


def test_no_module_but_the_adapter_reaches_into_zarr_or_fsspec():
    found = []
    for path in sorted((ROOT / "hookrun").rglob("*.py")):
        if path == ROOT / "hookrun" / "storage" / "internals.py":
            continue
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and INTERNAL_MODULES.match(node.module):
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                          if INTERNAL_MODULES.match(a.name)]
            elif isinstance(node, ast.Attribute) and node.attr in PRIVATE:
                found.append(f"{where}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                found += [f"{where}:{node.lineno}: class {node.name}({b})" for b in bases & STORE_CLASSES]
    assert found == [], "zarr's or fsspec's insides used outside hookrun/storage/internals.py:\n" + "\n".join(found)


@pytest.mark.parametrize("compressors", [None, "blosc"])
def test_a_chunk_decoded_by_the_adapter_is_what_zarr_reads(compressors):
    store = zarr.storage.MemoryStore()
    codecs = [zarr.codecs.BloscCodec(cname="lz4"), zarr.codecs.Crc32cCodec()] if compressors else \
        [zarr.codecs.Crc32cCodec()]
    arr = zarr.create_array(store, name="a", shape=(8, 3), chunks=(4, 3), dtype="float32", compressors=codecs)
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    arr[:] = data
    raw = zarr.core.sync.sync(store.get("a/c/1/0", zarr.core.buffer.default_buffer_prototype())).to_bytes()
    np.testing.assert_array_equal(decode(codec_specs(arr), raw), data[4:])


def test_metadata_built_by_the_adapter_is_what_zarr_writes():
    store = zarr.storage.MemoryStore()
    group = zarr.create_group(store, attributes={"a": 1})
    prototype = zarr.core.buffer.default_buffer_prototype()
    assert group_json({"a": 1}) == zarr.core.sync.sync(store.get("zarr.json", prototype)).to_bytes()
    arr = group.create_array("x", shape=(4, 2), chunks=(2, 2), dtype="float32", dimension_names=("r", "c"),
                             compressors=[zarr.codecs.Crc32cCodec()], attributes={"k": "v"}, fill_value=0,
                             chunk_key_encoding={"name": "default", "separator": "."})
    ours = with_attributes(array_metadata((4, 2), arr.metadata.data_type, (2, 2), list(arr.metadata.codecs),
                                          ("r", "c"), "."), {"k": "v"})
    assert metadata_json(ours) == metadata_json(arr.metadata)
    grown = resize_in_place(arr, (6, 2))
    assert arr.shape == (6, 2) and grown.shape == (6, 2)


def test_zarr_writes_a_local_store_through_the_adapters_write(tmp_path):
    """LocalWrites: every key zarr writes (group and array metadata, chunks) reaches `write`, once the store opened
    itself; a read-only one refuses before writing anything."""
    written = []

    class Recording(internals.LocalWrites):
        def write(self, key, data, exclusive):
            written.append(key)
            path = self.root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes(data))

    group = zarr.create_group(Recording(tmp_path / "s.zarr"))
    group.create_array("a", shape=(2,), chunks=(2,), dtype="int8")[:] = [1, 2]
    assert set(written) == {"a/c/0", "a/zarr.json", "zarr.json"}
    assert zarr.open_array(tmp_path / "s.zarr" / "a", mode="r")[:].tolist() == [1, 2]
    count = len(written)
    with pytest.raises(ValueError, match="read-only"):
        zarr.core.sync.sync(Recording(tmp_path / "s.zarr", read_only=True).set("b", internals.buffer(b"x")))
    assert len(written) == count
