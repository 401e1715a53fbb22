"""The read side for training and analysis: load(rows=), the token spans of cap.samples, the shuffled loader
(every row once per epoch, per rank and per worker), per-sample pooling, xarray token coordinates, exports.

Tiny stores made by running hookrun in process: a 2-block GPT-2 on six documents, per-token chunks of 7 rows."""
import numpy as np
import pandas as pd
import pytest
import torch
import zarr

import hookrun
from hookrun.format.files import DamagedError
from tests.helpers import RANDOM, make_cfg

MODEL = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=512, n_positions=64)
DOCS = ["Hookrun stores every capture one row per real token.", "Pads never reach the store.", "A short one",
        "Language models read text token by token, and interpretability work collects their activations.", "x",
        "The index statistics cover real tokens only, so the means are honest."]
LAYERS = ["transformer.h.0", "transformer.h.1"]
REUSE = ["+model._target_=tests.models.tracked", "+model.name=reuse", "+model.cls=Reuse"]


def _run(path, overrides):
    from hookrun.engine.runner import run

    run(make_cfg([*overrides, f"store.path={path}"]))
    return hookrun.open(path)


def text_run(path, corpus, *extra):
    return _run(path, ["+experiment=lm_tokens", *(f"model.{k}={v}" for k, v in MODEL.items()),
                       f"data.text.files=[{corpus}]", "data.batch_size=4", f"layers=[{','.join(LAYERS)}]",
                       "store.chunk_rows=7", *extra])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A text run storing per-token arrays only: 6 documents, 2 blocks, chunks of 7 rows."""
    tmp = tmp_path_factory.mktemp("tok")
    corpus = tmp / "docs.txt"
    corpus.write_text("\n".join(DOCS) + "\n")
    return text_run(tmp / "tok.zarr", corpus)


def test_token_spans_agree_with_the_token_table_and_row_is_refused_on_per_token_runs(tok):
    s, tokens = tok.samples, tok.tokens()
    assert list(s.columns) == ["sample", "batch", "token_start", "token_stop"] and len(s) == 6
    for r in s.itertuples():
        assert (tokens["sample"].iloc[r.token_start:r.token_stop] == r.sample).all()
        assert tokens["position"].iloc[r.token_start:r.token_stop].tolist() == list(range(r.token_stop - r.token_start))
    assert s.token_start.tolist() == [0, *s.token_stop.tolist()[:-1]] and s.token_stop.iloc[-1] == len(tokens)
    acts = tok.load(layer=LAYERS[1], role="output")
    assert len(acts) == len(tokens) and s.token_start.iloc[1] > 1  # document 1's rows start past row 1
    with pytest.raises(AttributeError, match="no 'row' on this run.*token_start:token_stop"):
        s.row
    with pytest.raises(KeyError, match="no 'row' on this run"):
        s[s["sample"] > 2]["row"]


def test_row_stays_where_per_sample_arrays_are_stored(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(DOCS) + "\n")
    cap = text_run(tmp_path / "mixed.zarr", corpus,
                   "+hooks.last={kind:forward,layers:[transformer.h.1],capture:[output],select:{positions:last}}")
    s = cap.samples
    assert list(s.columns) == ["sample", "batch", "row", "token_start", "token_stop"]
    last = cap.load(hook="last", layer=LAYERS[1], role="output")
    per_token = cap.load(hook="resid", layer=LAYERS[1], role="output")
    np.testing.assert_array_equal(last[s.row], per_token[s.token_stop - 1])


@pytest.mark.parametrize("extra", [[], ["store.min_saving=0"], ["+hooks.acts.dtype=bfloat16"]],
                         ids=["raw", "blosc", "bfloat16"])
def test_load_rows_equals_load_indexed_and_zarr(tmp_path, extra):
    cap = _run(tmp_path / "r.zarr", [*RANDOM, *extra])
    arr = cap.array("acts/fc1/output")
    assert arr.shape == (24, 8) and arr.chunks == (5, 8)
    full = cap.load(layer="fc1", role="output")
    stored = arr[:]
    expect = (stored.astype(np.uint32) << 16).view(np.float32) if "bfloat16" in str(extra) else stored
    np.testing.assert_array_equal(full, expect)
    assert full.dtype == np.float32
    for rows in [slice(3, 17), slice(None, None, 3), slice(20, 5), [23, 0, 7, 7, -1], np.arange(24) % 2 == 0, []]:
        np.testing.assert_array_equal(cap.load(layer="fc1", role="output", rows=rows), full[rows])
    with pytest.raises(IndexError, match="row 24 is out of range: there are 24 records"):
        cap.load(layer="fc1", role="output", rows=[24])


def test_load_of_one_call_takes_rows_of_that_call(tmp_path):
    x = np.random.default_rng(0).standard_normal((10, 4)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    cap = _run(tmp_path / "reuse.zarr", [*REUSE, f"+data.inputs.x={{file: '{tmp_path / 'x.npy'}'}}",
                                         "data.batch_size=4", "+hooks.acts={kind:forward,layers:[shared]}",
                                         "store.chunk_rows=3"])
    raw = cap.array("acts/shared/output")[:]  # batches of 4, 4, 2 rows: call 0 then call 1 of each
    call1 = np.concatenate([raw[4:8], raw[12:16], raw[18:20]])
    np.testing.assert_array_equal(cap.load(layer="shared", role="output", call=1), call1)
    np.testing.assert_array_equal(cap.load(layer="shared", role="output", call=1, rows=[9, 0, 5]), call1[[9, 0, 5]])
    with pytest.raises(KeyError, match="pick one with call="):
        cap.load(layer="shared", role="output", rows=[0])


@pytest.mark.parametrize("extra", [[], ["store.min_saving=0"]], ids=["raw", "blosc"])
def test_damaged_and_missing_chunks_raise_and_other_rows_still_read(tmp_path, extra):
    cap = _run(tmp_path / "d.zarr", [*RANDOM, *extra])
    full = cap.load(layer="fc2", role="output")
    chunk = cap.path / "acts/fc2/output/c.2.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    for rows in [None, slice(8, 12), [0, 11]]:
        with pytest.raises(DamagedError, match="acts/fc2/output/c.2.0: chunk fails its crc32c checksum"):
            cap.load(layer="fc2", role="output", rows=rows)
    np.testing.assert_array_equal(cap.load(layer="fc2", role="output", rows=slice(0, 10)), full[:10])
    size = len(data)
    for wrong in (data[:-9], data + b"\0" * 3):  # cut short; grown (its crc32c no longer at the end)
        chunk.write_bytes(bytes(wrong))
        with pytest.raises(DamagedError, match=f"c.2.0: chunk (is {len(wrong)} bytes, not {size}|fails its crc32c)"):
            cap.load(layer="fc2", role="output")
    chunk.unlink()
    with pytest.raises(DamagedError, match="acts/fc2/output/c.2.0: chunk missing"):
        cap.load(layer="fc2", role="output")
    with pytest.raises(DamagedError, match="c.2.0: chunk missing"):
        next(iter(cap.loader(layer="fc2", role="output", batch_size=24, shuffle=False)))


def _epoch(ds, workers=0):
    """Every batch of one epoch as (records, acts) numpy pairs."""
    batches = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers) if workers else ds
    return [(b["record"].numpy(), b["acts"].numpy()) for b in batches]


def test_loader_yields_every_row_once_per_epoch_per_rank_and_worker_in_a_seeded_order(tok):
    acts = tok.load(layer=LAYERS[0], role="output")
    n = len(acts)
    kw = dict(layer=LAYERS[0], role="output", batch_size=10, buffer_chunks=3, seed=7, fields=["record"])
    one = _epoch(tok.loader(**kw))
    records = np.concatenate([r for r, _ in one])
    assert sorted(records.tolist()) == list(range(n)) and records.tolist() != list(range(n))
    assert [len(r) for r, _ in one] == [10] * (n // 10) + ([n % 10] if n % 10 else [])
    for r, x in one:
        np.testing.assert_array_equal(x, acts[r])
    again = np.concatenate([r for r, _ in _epoch(tok.loader(**kw))])
    np.testing.assert_array_equal(again, records)  # the same seed and epoch: the same order
    ds = tok.loader(**kw)
    ds.set_epoch(1)
    other = np.concatenate([r for r, _ in _epoch(ds)])
    assert sorted(other.tolist()) == list(range(n)) and other.tolist() != records.tolist()
    ranks = [np.concatenate([r for r, _ in _epoch(tok.loader(**kw, rank=k, world_size=2), workers=2)])
             for k in range(2)]
    assert not set(ranks[0]) & set(ranks[1]) and sorted(np.concatenate(ranks).tolist()) == list(range(n))
    workers = [np.concatenate([r for r, _ in _epoch(tok.loader(**kw, rank=1, world_size=2))])]
    assert sorted(workers[0].tolist()) == sorted(ranks[1].tolist())


@pytest.mark.slow
def test_loader_in_spawned_workers_yields_every_row_once_with_the_values_of_load(tok):
    acts = tok.load(layer=LAYERS[1], role="output")
    ds = tok.loader(layer=LAYERS[1], role="output", batch_size=9, buffer_chunks=2, seed=3, fields=["record"])
    batches = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = [(b["record"].numpy(), b["acts"].numpy()) for b in batches]
    records = np.concatenate([r for r, _ in got])
    assert sorted(records.tolist()) == list(range(len(acts)))
    for r, x in got:
        np.testing.assert_array_equal(x, acts[r])
    forked = np.concatenate([r for r, _ in _epoch(ds, workers=2)])
    assert sorted(forked.tolist()) == sorted(records.tolist())


def test_loader_pin_memory_and_device_where_they_can_and_cannot_act(tok):
    acts = tok.load(layer=LAYERS[0], role="output")
    kw = dict(layer=LAYERS[0], role="output", batch_size=len(acts), shuffle=False)
    if not torch.accelerator.is_available():
        with pytest.warns(UserWarning, match="pin_memory=True but no accelerator is here"):
            ds = tok.loader(**kw, pin_memory=True)
        np.testing.assert_array_equal(next(iter(ds)).numpy(), acts)
    worker = torch.utils.data.DataLoader(tok.loader(**kw, device="meta"), batch_size=None, num_workers=1)
    with pytest.raises(ValueError, match="in a DataLoader worker process; .* the DataLoader pin_memory=True"):
        next(iter(worker))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loader_on_cuda_yields_pinned_copies_equal_to_load(tok):
    acts = tok.load(layer=LAYERS[0], role="output")
    ds = tok.loader(layer=LAYERS[0], role="output", batch_size=len(acts), shuffle=False, device="cuda",
                    pin_memory=True, fields=["record"])
    batch = next(iter(ds))
    assert batch["acts"].device.type == "cuda"
    np.testing.assert_array_equal(batch["acts"].cpu().numpy(), acts)


@pytest.mark.slow
def test_loader_rank_from_the_environment_and_drop_last_gives_every_rank_the_same_full_batches(tok, monkeypatch):
    kw = dict(layer=LAYERS[0], role="output", batch_size=8, buffer_chunks=2, fields=["record"], drop_last=True)
    monkeypatch.setenv("WORLD_SIZE", "3")
    counts = []
    for k in range(3):
        monkeypatch.setenv("RANK", str(k))
        batches = _epoch(tok.loader(**kw))
        assert all(len(r) == 8 for r, _ in batches)
        counts.append(len(batches))
    assert len(set(counts)) == 1 and counts[0] > 0
    with pytest.raises(ValueError, match="rank 3 is not in 0..2"):
        tok.loader(**kw, rank=3)


def test_loader_layers_side_by_side_with_token_ids_and_sample_fields(tok):
    tokens, samples = tok.tokens(), tok.samples
    a, b = (tok.load(layer=layer, role="output") for layer in LAYERS)
    ds = hookrun.loader(tok, layer=LAYERS, role="output", batch_size=16, seed=3,
                        fields=["record", "token_id", "position", "sample", "batch"], rows=slice(10, 60))
    seen = []
    for batch in ds:
        r = batch["record"].numpy()
        assert batch["acts"].shape == (len(r), 2, MODEL["n_embd"]) and batch["acts"].dtype == torch.float32
        np.testing.assert_array_equal(batch["acts"][:, 0].numpy(), a[r])
        np.testing.assert_array_equal(batch["acts"][:, 1].numpy(), b[r])
        np.testing.assert_array_equal(batch["token_id"].numpy(), tokens["token_id"].to_numpy()[r])
        np.testing.assert_array_equal(batch["position"].numpy(), tokens["position"].to_numpy()[r])
        np.testing.assert_array_equal(batch["sample"].numpy(), tokens["sample"].to_numpy()[r])
        by_sample = samples.set_index("sample")["batch"]
        np.testing.assert_array_equal(batch["batch"].numpy(), by_sample.loc[batch["sample"].numpy()].to_numpy())
        seen.append(r)
    assert sorted(np.concatenate(seen).tolist()) == list(range(10, 60))
    with pytest.raises(ValueError, match="field 'nope' is none of record, token_id, position"):
        tok.loader(layer=LAYERS[0], role="output", fields=["nope"])


def test_pool_equals_numpy_on_load_with_samples_aligned(tok):
    acts = tok.load(layer=LAYERS[1], role="output")
    s = tok.samples
    out = tok.pool(layer=LAYERS[1], role="output", how=["mean", "sum", "max", "min", "first", "last"],
                   block_mb=1e-4)  # one chunk (7 rows) a block: documents span blocks
    spans = [acts[a:b] for a, b in zip(s.token_start, s.token_stop)]
    np.testing.assert_allclose(out["mean"], np.stack([x.mean(0) for x in spans]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out["sum"], np.stack([x.sum(0) for x in spans]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["max"], np.stack([x.max(0) for x in spans]))
    np.testing.assert_array_equal(out["min"], np.stack([x.min(0) for x in spans]))
    np.testing.assert_array_equal(out["first"], acts[s.token_start])
    np.testing.assert_array_equal(out["last"], acts[s.token_stop - 1])
    np.testing.assert_array_equal(tok.pool(layer=LAYERS[1], role="output"), out["mean"].astype(np.float32))
    with pytest.raises(ValueError, match="how='median'"):
        tok.pool(layer=LAYERS[1], role="output", how="median")


def test_xarray_per_token_arrays_carry_sample_and_position_with_zarr_chunks(tok):
    ds = tok.to_xarray(layer=LAYERS[0])
    out = ds["output"]
    tokens = tok.tokens()
    np.testing.assert_array_equal(out["sample"].values, tokens["sample"].to_numpy())
    np.testing.assert_array_equal(out["position"].values, tokens["position"].to_numpy())
    n = len(tokens)
    assert out.chunks[0] == (7,) * (n // 7) + ((n % 7,) if n % 7 else ())
    np.testing.assert_array_equal(out.values, tok.load(layer=LAYERS[0], role="output"))
    mean = out.groupby("sample").mean().values
    np.testing.assert_allclose(mean, tok.pool(layer=LAYERS[0], role="output"), rtol=1e-5, atol=1e-7)


def test_export_npy_and_hugging_face_round_trip(tok, tmp_path):
    acts = tok.load(layer=LAYERS[1], role="output")
    path = tok.export_npy(tmp_path / "a.npy", layer=LAYERS[1], role="output")
    np.testing.assert_array_equal(np.load(path, mmap_mode="r"), acts)
    rows = np.arange(5, 40, 3)
    tok.export_npy(tmp_path / "b.npy", layer=LAYERS[1], role="output", rows=rows)
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), acts[rows])
    datasets = pytest.importorskip("datasets")
    tok.export_hf(tmp_path / "hf", layer=LAYERS[1], role="output", fields=["sample", "token_id"])
    ds = datasets.load_from_disk(str(tmp_path / "hf")).with_format("numpy")
    np.testing.assert_array_equal(ds["acts"][:], acts)
    table = pd.DataFrame({"sample": ds["sample"][:], "token_id": ds["token_id"][:]})
    pd.testing.assert_frame_equal(table, tok.tokens()[["sample", "token_id"]], check_dtype=False)


def test_reads_check_every_chunk_they_use_without_zarr(tok, monkeypatch):
    """load() reads chunk files itself (no zarr chunk reads), and still equals what zarr decodes."""
    expect = tok.array(f"resid/{LAYERS[0]}/output")[:]
    monkeypatch.setattr(zarr.Array, "__getitem__", lambda *a: pytest.fail("zarr read a chunk"))
    np.testing.assert_array_equal(tok.load(layer=LAYERS[0], role="output"), expect)


def test_a_cold_load_asks_for_its_files_ahead_and_reads_the_same(tok, monkeypatch):
    import os

    from hookrun.read import chunks

    key = f"resid/{LAYERS[0]}/output"
    expect = tok.load(layer=LAYERS[0], role="output")
    os.sync()
    for f in (tok.path / key).glob("c.*"):  # drop the chunk files from the page cache
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    advised = []
    advise = chunks.ChunkReader.advise
    monkeypatch.setattr(chunks.ChunkReader, "advise", lambda self, k: advised.append(k) or advise(self, k))
    np.testing.assert_array_equal(tok.load(layer=LAYERS[0], role="output"), expect)
    if advised:  # where the page cache let the files go: every run of chunks was asked for whole
        assert sorted(set(advised)) == list(range(-(-len(expect) // 7)))


@pytest.mark.parametrize("extra", [[], ["store.min_saving=0"]], ids=["raw", "blosc"])
def test_a_chunk_that_is_a_symbolic_link_out_of_the_store_is_not_read(tmp_path, extra):
    cap = _run(tmp_path / "d.zarr", [*RANDOM, *extra])
    chunk = cap.path / "acts/fc2/output/c.2.0"
    outside = tmp_path / "elsewhere"
    outside.write_bytes(chunk.read_bytes())  # the same bytes: its crc32c would pass
    chunk.unlink()
    chunk.symlink_to(outside)
    for rows in [None, slice(8, 12)]:
        with pytest.raises(DamagedError, match=f"c.2.0: chunk is a symbolic link \\(to {outside}\\)"):
            cap.load(layer="fc2", role="output", rows=rows)
    assert len(cap.load(layer="fc2", role="output", rows=slice(0, 4))) == 4  # the other chunks still read


def test_load_returns_an_array_half_a_page_past_a_boundary_with_the_stored_values(tmp_path):
    """The kernel copies page-cache pages into cap.load's output at full speed only where the output does not start
    just past a page boundary (4K aliasing); the array is an ordinary writable one, equal to zarr's read."""
    from hookrun.read.chunks import PAGE, PAGE_OFFSET, empty

    for shape, dtype in [((3, 5), np.float32), ((1000, 7), np.int64), ((0, 4), np.float16)]:
        out = empty(shape, dtype)
        assert out.shape == shape and out.dtype == dtype and out.flags.writeable and out.flags.c_contiguous
        assert out.ctypes.data % PAGE == PAGE_OFFSET or out.size == 0  # an empty array has no data to place
    run = tmp_path / "r.zarr"
    from hookrun.engine.runner import run as run_engine

    run_engine(make_cfg([*RANDOM, f"store.path={run}"]))
    cap = hookrun.open(run)
    got = cap.load(layer="fc1", role="output")
    assert got.ctypes.data % PAGE == PAGE_OFFSET
    assert np.array_equal(got, zarr.open_array(run / cap.source(layer="fc1", role="output")[0], mode="r")[:])
