"""Store round trips: index vs arrays, statistics vs numpy, threaded vs sync writes, dtype/reduce/select, failures."""
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from omegaconf import OmegaConf

from hookrun.config.checks import ConfigError
from hookrun.config.schema import StoreConfig
from hookrun.capture.hooks import Piece
from hookrun.capture.site import Site
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


@pytest.mark.parametrize("case", ["normal", "offset", "nonfinite", "all_nan", "constant", "bfloat16", "int64", "one"])
def test_statistics_on_the_device_equal_the_writers(case):
    """CUDA captures get their index statistics from torch on the device (stats.device_sums); the same function on
    a CPU tensor gives numpy's values and float64 ones, NaN and inf left out and counted."""
    from hookrun.store.stats import device_sums, stats, stats_from_sums

    rng = np.random.default_rng(12)
    a = {"normal": rng.standard_normal((64, 16, 8, 8)).astype("float32"),
         "offset": (rng.standard_normal(100_000) * 1e-3 + 1e3).astype("float32"),  # E[x^2] - mean^2 cancels
         "nonfinite": np.array([1.0, np.nan, np.inf, -np.inf, 2.0, np.nan], dtype="float32"),
         "all_nan": np.full(7, np.nan, dtype="float32"),
         "constant": np.full(1000, 7.5, dtype="float32"),
         "bfloat16": rng.standard_normal(4096).astype("float32"),
         "int64": np.arange(-50, 51),
         "one": np.array([3.25], dtype="float32")}[case]
    t = torch.from_numpy(a).bfloat16() if case == "bfloat16" else torch.from_numpy(a)
    ref = stats(t.float().numpy() if case == "bfloat16" else a)
    got = stats_from_sums(device_sums(t).tolist(), t.numel())
    finite = t.double().numpy()[np.isfinite(t.double().numpy())]
    assert got.keys() == ref.keys() and (got["nan_count"], got["inf_count"], got["numel"]) == (
        ref["nan_count"], ref["inf_count"], ref["numel"])
    for key in ("mean", "std", "min", "max"):
        truth = {"mean": np.mean, "std": np.std, "min": np.min, "max": np.max}[key](finite) if finite.size else np.nan
        np.testing.assert_allclose(got[key], truth, rtol=1e-6, atol=1e-9, err_msg=key)
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert device_sums(torch.empty(0, 3)) is None


def test_writer_auto_writes_in_the_hooks_only_on_a_cpu_with_no_core_to_spare(run_cfg, cnn, monkeypatch):
    """store.writer=auto (the default): sync when torch's threads take every core of a CPU run on a local disk;
    a thread when a core is left (by torch's threads and the machine's load), on a GPU and on an object store
    (requests wait on the network)."""
    from hookrun.engine.cores import cores
    from hookrun.store import writer_mode

    assert writer_mode("auto", "cpu", True, False) == "sync"
    assert writer_mode("auto", "cpu", True, True) == writer_mode("auto", "cuda", True, False) == "thread"
    assert writer_mode("auto", "cpu", False, False) == "thread"
    assert writer_mode("thread", "cpu", True, False) == "thread" and writer_mode("sync", "cuda", True, True) == "sync"
    _, base = cnn
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cores())
        assert run_cfg(base, name="full").attrs["summary"]["writer"] == "sync"
        assert run_cfg([*base, "store.writer=thread"], name="asked").attrs["summary"]["writer"] == "thread"
        if cores() > 1:
            torch.set_num_threads(cores() - 1)
            monkeypatch.setattr("hookrun.engine.cores.load", lambda: 0.0)  # a quiet machine: a core left
            assert run_cfg(base, name="spare").attrs["summary"]["writer"] == "thread"
            monkeypatch.setattr("hookrun.engine.cores.load", lambda: float(cores()))  # its load takes every core
            assert run_cfg(base, name="busy").attrs["summary"]["writer"] == "sync"
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores()))  # one thread per rank, a rank per core
        torch.set_num_threads(1)
        assert run_cfg(base, name="ranks").attrs["summary"]["writer"] == "sync"
    finally:
        torch.set_num_threads(threads)


def test_threaded_writer_is_bitwise_identical_to_sync(run_cfg, cnn):
    _, base = cnn
    a = run_cfg([*base, "store.writer=thread", "store.chunk_rows=3"], name="thread")
    b = run_cfg([*base, "store.writer=sync", "store.chunk_rows=3"], name="sync")
    assert a.index.equals(b.index)
    for key in a.index.array.unique():
        np.testing.assert_array_equal(a.array(key)[:], b.array(key)[:])
        chunks = sorted(p.relative_to(a.path / key) for p in (a.path / key).glob("c.*"))
        assert chunks and all((a.path / key / c).read_bytes() == (b.path / key / c).read_bytes() for c in chunks)


@pytest.mark.parametrize("writer", ["sync", "thread"])
def test_captures_are_what_the_layer_output_before_an_in_place_op(run_cfg, npy, writer):
    """A sync writer reads the model's own tensor in the hook (no copy): whole chunks are written from it and the
    rows left for the next chunk are copied, before ReLU(inplace=True) overwrites the tensor."""
    x = np.random.default_rng(10).standard_normal((N, 3, 6, 6)).astype("float32")
    cap = run_cfg(["+model._target_=tests.models.CNN", "+model.inplace=true", f"+data.inputs.x={{file: '{npy('x', x)}'}}",
                   "data.batch_size=5", "+hooks.a={kind:forward,layers:[conv1,relu1,conv2]}", f"store.writer={writer}",
                   "store.chunk_rows=3", "store.commit_s=0"])  # 5-row captures in 3-row chunks: rows wait for the next
    from tests.models import CNN
    torch.manual_seed(0)
    model = CNN(inplace=True)
    with torch.no_grad():
        conv1 = model.conv1(torch.from_numpy(x))
        conv2 = model.conv2(torch.relu(conv1))
    assert (conv1 < 0).any()
    np.testing.assert_array_equal(cap.load(layer="conv1", role="output"), conv1.numpy())
    np.testing.assert_array_equal(cap.load(layer="relu1", role="output"), torch.relu(conv1).numpy())
    np.testing.assert_array_equal(cap.load(layer="conv2", role="output"), conv2.numpy())
    assert cap.verify(decode=True) == []


def test_arrays_are_compressed_where_it_saves_min_saving(run_cfg, npy):
    """Mostly-zero inputs are compressed; a conv's dense float output, which lz4 shrinks by ~10%, is stored raw under
    the default min_saving 0.2; min_saving=0 compresses both. Both read back exactly either way."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((64, 3, 6, 6)) * (rng.random((64, 3, 6, 6)) < 0.1)).astype("float32")  # 90% zeros
    base = ["+model._target_=tests.models.CNN", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=16",
            "+hooks.a={kind:forward,layers:conv1,capture:[input,output]}"]
    auto = run_cfg(base, name="auto")
    always = run_cfg([*base, "store.min_saving=0"], name="always")
    blosc = [[type(c).__name__ for c in cap.array(f"a/conv1/{r}").compressors] for cap in (auto, always)
             for r in ("input.0", "output")]  # every chunk ends in its crc32c, compressed or not
    lz4 = ["BloscCodec", "Crc32cCodec"]
    assert blosc == [lz4, ["Crc32cCodec"], lz4, lz4]
    ratio = {(a["role"], name): a["stored_bytes"] / a["raw_bytes"]
             for name, cap in (("auto", auto), ("always", always)) for a in cap.attrs["summary"]["arrays"]}
    assert ratio["input.0", "auto"] < 0.8 and 0.8 < ratio["output", "always"] < 1 < ratio["output", "auto"] < 1.05  # raw + metadata
    for role in ("input.0", "output"):
        np.testing.assert_array_equal(auto.load(layer="conv1", role=role), always.load(layer="conv1", role=role))
    np.testing.assert_array_equal(auto.load(layer="conv1", role="input.0"), x)
    assert auto.verify(decode=True) == [] and always.verify(decode=True) == []


@pytest.mark.parametrize("codec,shuffle", [("lz4", "bitshuffle"), ("zstd", "shuffle"), ("none", "shuffle")])
def test_chunk_files_are_what_zarr_itself_writes(run_cfg, cnn, tmp_path, codec, shuffle):
    _, base = cnn
    cap = run_cfg([*base, "store.chunk_rows=4", f"store.codec={codec}", f"store.shuffle={shuffle}", "store.min_saving=0"])
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
    cap = run_cfg([*base, "store.chunk_mb=0.001", "store.codec=zstd", "store.level=3", "store.min_saving=0"])
    arr = cap.array("acts/conv1/output")  # 4*6*6 float32 = 576 bytes a row -> 1 row per ~1 KB chunk
    assert arr.chunks[0] == 1048 // 576
    assert arr.metadata.codecs[-2].cname.value == "zstd" and type(arr.metadata.codecs[-1]).__name__ == "Crc32cCodec"
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
    return Piece(Site("h", "l", "output", 0, i, i * rows, (i + 1) * rows), "forward",
                   torch.full((rows, width), float(i + 1)), per_sample=True)  # no all-zero chunk: zarr skips those


def test_queue_is_bounded_by_its_byte_budget(tmp_path, monkeypatch):
    store = Store.open(tmp_path / "s.zarr", store_cfg(queue_mb=0.02, chunk_rows=8), {}, "thread")
    slow, append, pending = store._add, store.streams.append, [0]

    def slow_add(item):  # a slow disk: the hooks must wait instead of queueing without bound
        time.sleep(0.002)
        slow(item)

    def append_counted(stream, data, **kw):  # the writer's buffered rows: every array's, with the rows arriving
        held = sum(s.pending_bytes for s in store.streams.by_key.values()) + data.nbytes
        pending[0] = max(pending[0], held)
        append(stream, data, **kw)
    monkeypatch.setattr(store, "_add", slow_add)
    monkeypatch.setattr(store.streams, "append", append_counted)
    item_bytes = 4 * 256 * 4
    for i in range(60):
        store.submit(capture(i))
    store.close("complete")
    assert store.queue.peak_queued_bytes <= store.queue.budget + item_bytes
    assert store.queue.peak_queued_bytes >= store.queue.budget - item_bytes  # the budget was actually reached
    assert pending[0] <= 8 * 256 * 4 + item_bytes  # at most one chunk per array buffered
    arr = zarr.open_array(str(tmp_path / "s.zarr/h/l/output"))
    np.testing.assert_array_equal(arr[:, 0], np.repeat(np.arange(1.0, 61.0), 4))


def test_writer_failure_stops_the_run_with_that_error(tmp_path):
    path = tmp_path / "s.zarr"
    # a small queue: the feeder must meet the error
    store = Store.open(path, store_cfg(chunk_rows=4, queue_mb=0.1), {}, "thread")
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


@pytest.mark.parametrize("url", ["local", "memory"])
def test_arrays_hookrun_makes_are_the_arrays_zarr_makes(tmp_path, url):
    """Streams make an array's zarr.json in one put: the same metadata and bytes as root.create_array, the same
    parent groups, and chunks that read back through zarr (dtypes, codecs, shards)."""
    import uuid

    from zarr.codecs import BloscCodec

    from hookrun.format.layout import CHUNK_KEY_ENCODING
    from hookrun.storage import Location
    from hookrun.store.streams import Streams

    loc = Location(tmp_path / "s.zarr" if url == "local" else f"memory://hookrun-test/{uuid.uuid4().hex}/s.zarr")
    root = zarr.open_group(loc.zarr_store, mode="w")
    streams = Streams(loc, root, StoreConfig(), 10, 2)
    cases = [("float32", None, []), ("float16", None, [BloscCodec(cname="lz4")]), ("int64", None, []),
             ("bool", None, [BloscCodec(cname="zstd")]), ("uint16", None, []), ("float32", 8, [BloscCodec(cname="lz4")]),
             ("uint8", 4, []), ("int32", None, [])]
    for i, (dtype, shard, compressors) in enumerate(cases):
        codecs = [*compressors, zarr.codecs.Crc32cCodec()]
        ours = streams._new_array(f"h{i}/layer.0/output", (10, 3, 5), (4, 3, 5), np.dtype(dtype), shard, codecs,
                                  {"unit": "sample"}, ("sample", "d0", "d1"))
        assert not loc.exists(f"h{i}/layer.0/output/zarr.json")  # until the next commit writes them together
        streams.write_metadata()
        theirs = root.create_array(f"z{i}/layer.0/output", overwrite=True, shape=(10, 3, 5), chunks=(4, 3, 5),
                                   dtype=dtype, shards=(shard, 3, 5) if shard else None, compressors=codecs,
                                   fill_value=0, attributes={"unit": "sample"}, chunk_key_encoding=CHUNK_KEY_ENCODING,
                                   dimension_names=("sample", "d0", "d1"), config={"write_empty_chunks": True})
        assert ours.metadata == theirs.metadata and ours.config == theirs.config
        for mine, zarrs in [(f"h{i}/layer.0/output", f"z{i}/layer.0/output"), (f"h{i}/layer.0", f"z{i}/layer.0"),
                            (f"h{i}", f"z{i}")]:
            assert loc.get(f"{mine}/zarr.json") == loc.get(f"{zarrs}/zarr.json")
        x = (np.arange(150).reshape(10, 3, 5) % 7).astype(dtype)
        ours[:] = x
        np.testing.assert_array_equal(zarr.open_array(loc.zarr_store, path=f"h{i}/layer.0/output", mode="r")[:], x)
    leftover = f"h0/layer.0/output/c.{9}.0.0"  # what a killed run left at a key goes with the new array
    loc.put(leftover, b"x")
    streams._new_array("h0/layer.0/output", (2,), (2,), np.dtype("float32"), None, [], {}, ("sample",))
    streams.write_metadata()
    assert not loc.exists(leftover) and loc.keys("h0/") == ["h0/layer.0/output/zarr.json", "h0/layer.0/zarr.json",
                                                            "h0/zarr.json"]


def test_index_parts_read_back_as_pandas_writes_them():
    """An index part written from its rows without pandas reads back as pd.DataFrame(rows, columns).to_parquet
    does: ints with gaps as floats, text with gaps, lists, bools, a column no row has."""
    import io

    import pandas as pd

    from hookrun.format.files import parquet_bytes
    from hookrun.store.index import _rows_parquet

    rows = [{"a": 1, "b": "x", "c": None, "d": 1.5, "e": [8, 64], "f": True, "g": np.int64(3), "h": None,
             "i": float("nan")},
            {"a": 2, "b": None, "c": None, "d": 2, "e": [1], "f": False, "g": np.int64(4), "h": 5, "i": 1.0}]
    columns = [*"abcdefghi", "absent"]
    for part in (rows, rows[:1], []):
        frame = pd.DataFrame(part, columns=columns)
        buf = io.BytesIO()
        frame.to_parquet(buf, index=False)
        assert bytes(parquet_bytes(frame)) == buf.getvalue()
        pd.testing.assert_frame_equal(pd.read_parquet(io.BytesIO(_rows_parquet(part, columns))),
                                      pd.read_parquet(io.BytesIO(buf.getvalue())))
