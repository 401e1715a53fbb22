"""Store round trips: index vs arrays, statistics vs numpy, threaded vs sync writes, dtype/reduce/select, failures."""
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from omegaconf import OmegaConf

from hookrun.config import ConfigError, StoreConfig
from hookrun.edits import Site
from hookrun.hooks import Capture
from hookrun.store import Store, StoreError

N = 23


@pytest.fixture
def cnn(npy):
    x = np.random.default_rng(6).standard_normal((N, 3, 6, 6)).astype("float32")
    return x, ["+model._target_=tests.models.CNN", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=5",
               "+hooks.acts.kind=forward", "+hooks.acts.layers=[conv1,relu1,conv2,fc]", "+hooks.acts.capture=[input,output]"]


def test_index_rows_match_arrays_and_stats_match_numpy(run_cfg, cnn):
    x, base = cnn
    cap = run_cfg([*base, "store.chunk_rows=4"])
    idx = cap.index
    assert len(idx) == 5 * 8  # 5 batches x 4 layers x (input.0, output)
    for key, rows in idx.groupby("array"):
        arr = cap.array(key)
        assert arr.shape[0] == rows.row_stop.max() == N  # rows in the index == samples in the array
        assert arr.chunks[0] == 4 and arr.metadata.dimension_names[0] == "sample"
        assert sorted(zip(rows.row_start, rows.row_stop)) == [(s, min(s + 5, N)) for s in range(0, N, 5)]
        for r in rows.itertuples():
            part = cap.read_row(r._asdict()).astype(np.float64)
            assert r.shape == str([len(part), *part.shape[1:]])
            np.testing.assert_allclose([r.mean, r.std, r.min, r.max], [part.mean(), part.std(), part.min(), part.max()],
                                       rtol=1e-5, atol=1e-6)
            assert r.nan_count == 0 and r.inf_count == 0 and r.numel == part.size
    np.testing.assert_array_equal(cap.load(layer="conv1", role="input.0"), x)
    assert cap.attrs["config"]["hooks"]["acts"]["kind"] == "forward"
    assert {"torch", "zarr", "hydra"} <= set(cap.attrs["versions"])
    assert cap.attrs["summary"]["samples"] == N


def test_threaded_writer_is_bitwise_identical_to_sync(run_cfg, cnn):
    _, base = cnn
    a = run_cfg([*base, "store.writer=thread", "store.chunk_rows=3"], name="thread")
    b = run_cfg([*base, "store.writer=sync", "store.chunk_rows=3"], name="sync")
    assert a.index.equals(b.index)
    for key in a.index.array.unique():
        np.testing.assert_array_equal(a.array(key)[:], b.array(key)[:])
        chunks = sorted(p.relative_to(a.path / key) for p in (a.path / key).glob("c.*"))
        assert chunks and all((a.path / key / c).read_bytes() == (b.path / key / c).read_bytes() for c in chunks)


@pytest.mark.parametrize("codec,shuffle", [("lz4", "bitshuffle"), ("zstd", "shuffle"), ("none", "shuffle")])
def test_chunk_files_are_what_zarr_itself_writes(run_cfg, cnn, tmp_path, codec, shuffle):
    _, base = cnn
    cap = run_cfg([*base, "store.chunk_rows=4", f"store.codec={codec}", f"store.shuffle={shuffle}"])
    for key in ("acts/conv1/output", "acts/fc/input.0"):
        ours = cap.array(key)
        theirs = zarr.create_array(str(tmp_path / "ref.zarr" / key), shape=ours.shape, chunks=ours.chunks,
                                   dtype=ours.dtype, compressors=ours.compressors, fill_value=0,
                                   chunk_key_encoding=ours.metadata.chunk_key_encoding)
        theirs[:] = ours[:]
        files = sorted(p.relative_to(cap.path / key) for p in (cap.path / key).glob("c.*"))
        assert len(files) == 6  # ceil(23 / 4) chunks
        for f in files:
            assert (cap.path / key / f).read_bytes() == (tmp_path / "ref.zarr" / key / f).read_bytes(), f


def test_chunks_sized_from_bytes_and_codecs(run_cfg, cnn):
    _, base = cnn
    cap = run_cfg([*base, "store.chunk_mb=0.001", "store.codec=zstd", "store.level=3"])
    arr = cap.array("acts/conv1/output")  # 4*6*6 float32 = 576 bytes a row -> 1 row per ~1 KB chunk
    assert arr.chunks[0] == 1048 // 576
    assert arr.metadata.codecs[-1].cname.value == "zstd"
    raw = run_cfg([*base, "store.codec=none"], name="raw")
    np.testing.assert_array_equal(raw.load(layer="conv1", role="output"), cap.load(layer="conv1", role="output"))


def test_dtype_reduce_select_round_trip(run_cfg, cnn):
    x, base = cnn
    cap = run_cfg([*base[:3], "+hooks.h.kind=forward", "+hooks.h.layers=conv1", "+hooks.h.dtype=float16",
                   "+hooks.b.kind=forward", "+hooks.b.layers=conv1", "+hooks.b.dtype=bfloat16",
                   "+hooks.r.kind=forward", "+hooks.r.layers=conv1", "+hooks.r.reduce={op:mean,dims:spatial}",
                   "+hooks.m.kind=forward", "+hooks.m.layers=conv1", "+hooks.m.reduce={op:max,dims:[1]}",
                   "+hooks.s.kind=forward", "+hooks.s.layers=conv1", "+hooks.s.select={dim:1,index:[3,0]}",
                   "+hooks.t.kind=forward", "+hooks.t.layers=conv1", "+hooks.t.select={dim:2,index:{start:1,stop:5,step:2}}",
                   "+hooks.full.kind=forward", "+hooks.full.layers=conv1"])
    full = cap.load(hook="full", layer="conv1", role="output")
    assert cap.load(hook="h", role="output").dtype == np.float16
    np.testing.assert_array_equal(cap.load(hook="h", role="output"), full.astype(np.float16))
    bf = cap.load(hook="b", role="output")
    assert bf.dtype == np.float32 and cap.array("b/conv1/output").dtype == np.uint16
    np.testing.assert_array_equal(bf, torch.from_numpy(full).bfloat16().float().numpy())
    assert cap.rows(hook="b").dtype.iloc[0] == "bfloat16"
    np.testing.assert_allclose(cap.load(hook="r", role="output"), full.mean(axis=(2, 3)), rtol=1e-5)
    np.testing.assert_array_equal(cap.load(hook="m", role="output"), full.max(axis=1))
    np.testing.assert_array_equal(cap.load(hook="s", role="output"), full[:, [3, 0]])
    np.testing.assert_array_equal(cap.load(hook="t", role="output"), full[:, :, 1:5:2])


def test_max_samples_and_stride(run_cfg, cnn):
    x, base = cnn
    cap = run_cfg([*base, "data.max_samples=12", "data.stride=2"])
    rows = cap.rows(layer="conv1", role="input.0")
    # every 2nd batch of 5, until 12 samples were run
    assert rows.sample_start.tolist() == [0, 10, 20] and rows.sample_stop.tolist() == [5, 15, 22]
    np.testing.assert_array_equal(cap.load(layer="conv1", role="input.0"), np.concatenate([x[0:5], x[10:15], x[20:22]]))
    assert cap.array("acts/conv1/input.0").shape[0] == 12


def test_existing_store_is_refused_unless_overwrite(run_cfg, cnn):
    _, base = cnn
    run_cfg(base)
    with pytest.raises(ConfigError, match="already holds a hookrun run .status complete.; set store.mode=resume to continue it, store.mode=overwrite"):
        run_cfg(base)
    assert run_cfg([*base, "store.mode=overwrite"]).status == "complete"


def store_cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(StoreConfig), kw)


def capture(i, rows=4, width=256):
    return Capture(Site("h", "l", "output", 0, i, i * rows, (i + 1) * rows), "forward",
                   torch.full((rows, width), float(i + 1)), per_sample=True)  # no all-zero chunk: zarr skips those


def test_queue_is_bounded_by_its_byte_budget(tmp_path, monkeypatch):
    store = Store(tmp_path / "s.zarr", store_cfg(queue_mb=0.02, chunk_rows=8), {})
    slow = store._add

    def slow_add(item):  # a slow disk: the hooks must wait instead of queueing without bound
        time.sleep(0.002)
        slow(item)
    monkeypatch.setattr(store, "_add", slow_add)
    item_bytes = 4 * 256 * 4
    for i in range(60):
        store.submit(capture(i))
    store.close("complete")
    assert store.peak_queued_bytes <= store.budget + item_bytes
    assert store.peak_queued_bytes >= store.budget - item_bytes  # the budget was actually reached
    assert store.peak_pending_bytes <= 8 * 256 * 4 + item_bytes  # at most one chunk per array buffered
    arr = zarr.open_array(str(tmp_path / "s.zarr/h/l/output"))
    np.testing.assert_array_equal(arr[:, 0], np.repeat(np.arange(1.0, 61.0), 4))


def test_writer_failure_stops_the_run_with_that_error(tmp_path):
    path = tmp_path / "s.zarr"
    store = Store(path, store_cfg(chunk_rows=4, queue_mb=0.1), {})  # a small queue: the feeder must meet the error
    store.submit(capture(0))
    deadline = time.time() + 10
    while not (path / "h/l/output/c.0.0").exists() and time.time() < deadline:
        time.sleep(0.01)
    (path / "h/l/output/c.1.0").mkdir()  # the next chunk cannot be written, as on a broken disk
    done = threading.Event()

    def feed():
        with pytest.raises(StoreError, match="writing .* failed"):
            for i in range(1, 1000):
                store.submit(capture(i))
        done.set()
    t = threading.Thread(target=feed)
    t.start()
    t.join(20)
    assert done.is_set(), "submit hung after the writer failed"
    with pytest.raises(StoreError):
        store.close("complete")
    assert zarr.open_group(str(path)).attrs["status"] == "failed"
    assert Path(path / "_index").exists()
