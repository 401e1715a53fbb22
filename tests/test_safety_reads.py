"""Data safety, round 3 (issue 29, items 1-3, 5, 9): a store never returns data that differs from what its run
committed. Chunks or shards swapped (each whole, each matching its own crc32c), a shard deleted, the consolidated
metadata or the root attrs edited: verify() names each, and load() / grid() / the loader refuse with DamagedError
naming the file, instead of returning other rows, zeros or reinterpreted bytes. Exports never replace a file."""
import json
import shutil

import numpy as np
import pytest

import hookrun
from hookrun.format.files import DamagedError
from tests.helpers import RANDOM, run_in

OUT = "acts/fc1/output"
SHARD = ["store.chunk_rows=10", "+data.dataset.n=160", "store.shard_mb=0.0016"]  # fc1 output: shards of 50 rows
GPT2 = ["+experiment=lm_tokens", "model.n_layer=2", "model.n_embd=32", "model.n_head=4"]
PAIRS = [("the hooks run on a model", "the hooks run on a store", " model"),
         ("a store of captures", "a store of hooks", " captures"),
         ("every layer writes an array", "every layer writes a model", " array")]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """raw: one file a chunk; sharded: 50-row shards of 10-row chunks; grid: a patching run (a sample a chunk)."""
    base = tmp_path_factory.mktemp("reads")
    run_in(base / "raw.zarr", RANDOM)
    run_in(base / "sharded.zarr", [*RANDOM, *SHARD])
    pairs = base / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"clean": c, "corrupt": x, "answer": a}) + "\n" for c, x, a in PAIRS))
    run_in(base / "grid.zarr", [*GPT2, f"data.text.files=[{pairs}]", "data.text.fields={clean:clean,corrupt:corrupt}",
                                "data.batch_size=1", "hooks.resid=null", "store.chunk_rows=1",
                                "+metrics.ld={metric:logit_diff,a:{field:answer},b:' store'}",
                                "+patching={source:clean,target:corrupt,sites:{layers:[transformer.h.0,"
                                "transformer.h.1],positions:all},metric:ld}"])
    return base


def copy(stores, tmp_path, name):
    path = tmp_path / f"{name}.zarr"
    shutil.copytree(stores / f"{name}.zarr", path)
    return path


def swap(path, a, b):
    x, y = (path / a).read_bytes(), (path / b).read_bytes()
    assert len(x) == len(y) and x != y
    (path / a).write_bytes(y), (path / b).write_bytes(x)


def edit_root(path, change):
    meta = json.loads((path / "zarr.json").read_text())
    change(meta)
    (path / "zarr.json").write_text(json.dumps(meta))


def refused(cap, read, names, verify_names=None):
    """`read()` raises DamagedError naming `names` first (what verify names too, or `verify_names`)."""
    with pytest.raises(DamagedError) as err:
        read()
    assert str(err.value).startswith(names), str(err.value)
    assert any(p.startswith(verify_names or names) for p in cap.verify()), cap.verify()
    return str(err.value)


@pytest.mark.slow
def test_the_stores_are_whole_and_shards_record_a_checksum(stores):
    sharded = hookrun.open(stores / "sharded.zarr")
    assert sharded.array(OUT).shards == (50, 8) and sharded.verify(decode=True) == []
    chunks = sharded.table("chunks")
    assert chunks[chunks.array == OUT].chunk.nunique() == 4 and (chunks.crc32c != -1).all()  # was -1 for every shard
    assert sharded.attrs["format_version"] == 3 and isinstance(sharded.attrs["root_crc32c"], int)
    ref = hookrun.open(stores / "raw.zarr")
    assert ref.verify() == [] and hookrun.open(stores / "grid.zarr").verify() == []
    assert len(sharded.load(layer="fc1", role="output")) == 160


def test_swapped_shards_are_refused_by_load_loader_and_verify(stores, tmp_path):
    path = copy(stores, tmp_path, "sharded")
    want = hookrun.open(stores / "sharded.zarr").load(layer="fc1", role="output")
    swap(path, f"{OUT}/c.0.0", f"{OUT}/c.1.0")  # rows 0..49 and 50..99 exchanged: before, load returned them so
    cap = hookrun.open(path)
    said = refused(cap, lambda: cap.load(layer="fc1", role="output"), f"{OUT}/c.0.0: chunk is not the one committed")
    assert "cap.verify() lists every damaged file" in said
    refused(cap, lambda: cap.load(layer="fc1", role="output", rows=[55]), f"{OUT}/c.1.0: chunk is not the one")
    with pytest.raises(DamagedError, match=f"{OUT}/c.[01].0: chunk is not the one committed"):
        list(cap.loader(layer="fc1", role="output", batch_size=16))
    assert any(p.startswith(f"{OUT}/c.1.0: chunk is not") for p in cap.verify(decode=True))
    np.testing.assert_array_equal(cap.load(layer="fc1", role="output", rows=slice(100, 160)), want[100:])  # the rest


def test_a_deleted_shard_is_refused_not_read_as_zeros(stores, tmp_path):
    path = copy(stores, tmp_path, "sharded")
    (path / f"{OUT}/c.2.0").unlink()
    cap = hookrun.open(path)
    refused(cap, lambda: cap.load(layer="fc1", role="output"), f"{OUT}/c.2.0: chunk missing")
    refused(cap, lambda: cap.load(layer="fc1", role="output", rows=[105, 3]), f"{OUT}/c.2.0: chunk missing")
    assert len(cap.load(layer="fc1", role="output", rows=slice(0, 100))) == 100


def test_an_inner_chunk_of_a_shard_changed_in_place_is_refused(stores, tmp_path):
    path = copy(stores, tmp_path, "sharded")
    data = bytearray((path / f"{OUT}/c.1.0").read_bytes())
    data[5] ^= 0xFF  # inner chunk 0 of shard 1: fails its own crc32c
    (path / f"{OUT}/c.1.0").write_bytes(bytes(data))
    cap = hookrun.open(path)
    refused(cap, lambda: cap.load(layer="fc1", role="output"), f"{OUT}/c.1.0 (inner chunk 0): chunk fails its crc32c",
            f"{OUT}/c.1.0: chunk does not decode (ValueError: Stored and computed checksum do not match")


@pytest.mark.parametrize("a,b", [(f"{OUT}/c.1.0", f"{OUT}/c.2.0"),  # two chunks of one array
                                 (f"{OUT}/c.4.0", "acts/fc2/input.0/c.4.0")])  # the same chunk of two layers
def test_swapped_chunks_are_refused_by_every_reader(stores, tmp_path, a, b):
    path = copy(stores, tmp_path, "raw")
    swap(path, a, b)
    cap = hookrun.open(path)
    refused(cap, lambda: cap.load(layer="fc1", role="output"), f"{a}: chunk is not the one committed here")
    k = int(a.split(".")[-2])
    refused(cap, lambda: cap.read_rows(OUT, [5 * k + 1]), f"{a}: chunk is not the one committed here")
    with pytest.raises(DamagedError, match=f"{a}: chunk is not the one committed"):
        list(cap.loader(layer="fc1", role="output", batch_size=4))
    with pytest.raises(DamagedError, match=f"{a}: chunk is not the one committed"):
        cap.export_npy(tmp_path / "out.npy", layer="fc1", role="output")
    ref = hookrun.open(stores / "raw.zarr")
    np.testing.assert_array_equal(cap.read_rows(OUT, [0, 1]), ref.read_rows(OUT, [0, 1]))  # chunk 0 reads


def test_swapped_patching_scores_are_refused_by_grid(stores, tmp_path):
    path = copy(stores, tmp_path, "grid")
    scores = "_patching/ld/scores"
    names = sorted(p.name for p in (path / scores).glob("c.*"))
    assert len(names) == 3  # a sample a chunk
    ref = hookrun.open(stores / "grid.zarr").grid()
    assert not np.array_equal(ref.scores[0], ref.scores[1], equal_nan=True)
    swap(path, f"{scores}/{names[0]}", f"{scores}/{names[1]}")
    cap = hookrun.open(path)
    refused(cap, cap.grid, f"{scores}/{names[0]}: chunk is not the one committed here")


@pytest.mark.parametrize("what,change", [
    ("dtype", lambda m: m["consolidated_metadata"]["metadata"][OUT].update(data_type="int32")),
    ("shape", lambda m: m["consolidated_metadata"]["metadata"][OUT].update(shape=[20, 8])),
    ("chunks", lambda m: m["consolidated_metadata"]["metadata"][OUT]["chunk_grid"]["configuration"].update(
        chunk_shape=[4, 8]))])
def test_edited_consolidated_metadata_is_refused(stores, tmp_path, what, change):
    path = copy(stores, tmp_path, "raw")
    edit_root(path, change)
    cap = hookrun.open(path)
    said = refused(cap, lambda: cap.load(layer="fc1", role="output"), "zarr.json: the root attrs or the consolidated")
    assert "edited or damaged" in said
    assert any(p.startswith(f"{OUT}/zarr.json: differs from its consolidated copy") for p in cap.verify())


def test_reversed_patching_layers_are_refused(stores, tmp_path):
    path = copy(stores, tmp_path, "grid")
    edit_root(path, lambda m: m["attributes"]["patching"].update(layers=m["attributes"]["patching"]["layers"][::-1]))
    cap = hookrun.open(path)
    assert cap.attrs["patching"]["layers"] == ["transformer.h.1", "transformer.h.0"]
    refused(cap, cap.grid, "zarr.json: the root attrs or the consolidated metadata differ")


def test_a_removed_index_files_entry_is_refused(stores, tmp_path):
    path = copy(stores, tmp_path, "raw")
    edit_root(path, lambda m: m["attributes"]["index_files"].pop("index.parquet"))
    cap = hookrun.open(path)
    refused(cap, lambda: cap.index, "zarr.json: the root attrs or the consolidated metadata differ")
    path = tmp_path / "second.zarr"
    shutil.copytree(stores / "raw.zarr", path)
    edit_root(path, lambda m: m["attributes"].pop("root_crc32c"))  # the sum itself removed
    cap = hookrun.open(path)
    refused(cap, lambda: cap.index, "zarr.json: the root attrs have no root_crc32c")


def test_export_never_replaces_a_file_it_did_not_write(stores, tmp_path):
    cap = hookrun.open(stores / "raw.zarr")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(FileExistsError, match="notes.txt.*overwrite=True"):
        cap.export_npy(notes, layer="fc1", role="output")
    assert notes.read_text() == "my notes"
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    pytest.importorskip("datasets")
    with pytest.raises(FileExistsError, match="mine.*overwrite=True"):
        cap.export_hf(folder, layer="fc1", role="output")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    want = cap.load(layer="fc1", role="output")
    out = cap.export_npy(tmp_path / "acts.npy", layer="fc1", role="output")
    with pytest.raises(FileExistsError):
        cap.export_npy(out, layer="fc1", role="output")
    cap.export_npy(out, layer="fc1", role="output", rows=slice(0, 3), overwrite=True)
    np.testing.assert_array_equal(np.load(out), want[:3])
    cap.export_npy(notes, layer="fc1", role="output", overwrite=True)
    np.testing.assert_array_equal(np.load(notes), want)
