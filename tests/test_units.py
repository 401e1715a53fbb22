"""Unit tests of the core objects, built directly (no Hydra, no run): HookSet, Streams, Index, WriteQueue.
One behaviour per test."""
import io
import threading
import time

import numpy as np
import pytest
import torch

from hookrun.capture.hooks import BatchInfo, HookPlan, HookSet, Piece, hook_count
from hookrun.capture.shrink import Shrink
from hookrun.capture.site import Site
from hookrun.config.schema import StoreConfig
from hookrun.storage import Location
from hookrun.store.index import TABLES_KEY, Index
from hookrun.store.queue import WriteQueue
from hookrun.store.streams import Streams
from tests.models import MLP


# -- HookSet -----------------------------------------------------------------------------------------------
def plan(model, kind="forward", layers=("fc1",), capture=("output",)):
    """A HookPlan on `model`'s modules, nothing edited or shrunk."""
    modules = dict(model.named_modules())
    return HookPlan("h", kind, {name: modules[name] for name in layers}, list(capture), [], Shrink())


def batch(n=3):
    return BatchInfo(index=0, start=0, stop=n, batched=True)


def test_hookset_registers_one_handle_per_layer_and_removes_them_on_exit():
    model = MLP()
    with HookSet(model, [plan(model, layers=("fc1", "fc2"))], sink=lambda cap: None) as hs:
        assert hook_count(model) == 2 and len(hs.handles) == 2
    assert hook_count(model) == 0 and hs.handles == []


def test_hookset_removes_every_handle_when_the_body_raises():
    model = MLP()
    with pytest.raises(RuntimeError, match="boom"):
        with HookSet(model, [plan(model, layers=("fc1", "fc2"))], sink=lambda cap: None):
            assert hook_count(model) == 2
            raise RuntimeError("boom")
    assert hook_count(model) == 0


def test_hookset_removes_the_hooks_it_registered_when_a_later_registration_fails():
    model = MLP()
    broken = HookPlan("b", "forward", {"nowhere": object()}, ["output"], [], Shrink())  # cannot take a hook
    with pytest.raises(AttributeError):
        with HookSet(model, [plan(model, layers=("fc1", "fc2")), broken], sink=lambda cap: None):
            pass
    assert hook_count(model) == 0


def test_hookset_removes_every_handle_when_the_sink_raises():
    model = MLP()

    def sink(cap):
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        with HookSet(model, [plan(model)], sink=sink) as hs:
            args, kwargs = hs.begin_batch(batch(), [torch.randn(3, 6)], {})
            model(*args, **kwargs)
    assert hook_count(model) == 0


def test_a_forward_hook_captures_what_a_plain_pytorch_hook_sees():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 6)
    plain = {}
    handle = model.fc2.register_forward_hook(lambda m, args, out: plain.update(input=args[0].clone(),
                                                                              output=out.clone()))
    caps = []
    with HookSet(model, [plan(model, layers=("fc2",), capture=("input", "output"))], sink=caps.append) as hs:
        args, kwargs = hs.begin_batch(batch(), [x], {})
        model(*args, **kwargs)
        hs.end_batch()
    handle.remove()
    assert [(c.site.layer, c.site.role, c.kind, c.per_sample, c.unit) for c in caps] == [
        ("fc2", "input.0", "forward", True, "sample"), ("fc2", "output", "forward", True, "sample")]
    torch.testing.assert_close(caps[0].tensor, plain["input"], rtol=0, atol=0)
    torch.testing.assert_close(caps[1].tensor, plain["output"], rtol=0, atol=0)
    assert not caps[1].tensor.requires_grad  # detached


def test_a_hookset_outside_a_batch_captures_nothing():
    model, caps = MLP(), []
    with HookSet(model, [plan(model)], sink=caps.append):
        model(torch.randn(2, 6))  # no begin_batch: e.g. the model's own calls before the run
    assert caps == []


# -- Streams ------------------------------------------------------------------------------------------------
def streams(tmp_path, chunk_rows=4):
    """Streams of a fresh local store, uncompressed, `chunk_rows` rows per chunk."""
    location = Location(tmp_path / "s.zarr")
    cfg = StoreConfig(codec="none", chunk_rows=chunk_rows)
    return Streams(location, location.open_group("w"), cfg, expected_samples=None, expected_batches=None)


def chunks(st, key="h/fc1/output"):
    """The chunk files of an array."""
    return sorted(k.rsplit("/", 1)[1] for k in st.location.sizes(f"{key}/") if "/c." in k)


def first_capture(rows):
    return Piece(Site("h", "fc1", "output", 0, 0, 0, len(rows)), "forward", torch.from_numpy(rows), True)


def test_rows_appended_across_chunk_boundaries_read_back_exactly(tmp_path):
    st = streams(tmp_path)
    data = np.arange(11 * 3, dtype=np.float32).reshape(11, 3)
    blocks = [data[0:3], data[3:9], data[9:10], data[10:11]]  # 3 + 6 + 1 + 1 rows over chunks of 4
    stream = st.create("h/fc1/output", first_capture(blocks[0]), blocks[0], torch.float32)
    for block in blocks:
        st.append(stream, block)
    assert (stream.rows_assigned, stream.rows_flushed, stream.rows_durable) == (11, 8, 8)
    st.write_partial()
    st.trim()
    np.testing.assert_array_equal(stream.array[:], data)


def test_only_whole_chunks_are_written_until_write_partial(tmp_path):
    st = streams(tmp_path)
    data = np.arange(6 * 2, dtype=np.int64).reshape(6, 2)
    stream = st.create("h/fc1/output", first_capture(data), data, torch.int64)
    st.append(stream, data)
    assert chunks(st) == ["c.0.0"]
    assert stream.block().tolist() == data[4:].tolist()  # the partial chunk, pending
    st.write_partial()
    assert chunks(st) == ["c.0.0", "c.1.0"]
    assert stream.rows_durable == 6 and stream.rows_flushed == 4


def test_the_partial_chunk_is_written_padded_and_rewritten_whole_when_it_fills(tmp_path):
    st = streams(tmp_path)
    data = np.arange(8, dtype=np.float64).reshape(8, 1) + 1
    stream = st.create("h/fc1/output", first_capture(data[:2]), data[:2], torch.float64)
    st.append(stream, data[:2])
    st.write_partial()
    raw = st.location.get("h/fc1/output/c.0.0")  # 4 rows, uncompressed, then the crc32c
    np.testing.assert_array_equal(np.frombuffer(raw[:-4], "<f8"), [1, 2, 0, 0])  # padded with the fill value
    np.testing.assert_array_equal(stream.array[:], [[1], [2]])
    st.append(stream, data[2:8])
    np.testing.assert_array_equal(stream.array[:8], data)
    assert stream.pending == [] and stream.rows_flushed == 8


def test_set_rows_writes_the_metadata_zarrs_own_resize_writes(tmp_path):
    """An array grown by Streams.set_rows (put with the next write_metadata, from the calling thread) has the zarr.json
    zarr's resize writes, and its rows read back through zarr, from this object and from a fresh open."""
    import zarr

    st = streams(tmp_path)
    data = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)
    stream = st.create("h/fc1/output", first_capture(data[:2]), data[:2], torch.float32)
    st.write_metadata()
    twin = zarr.open_array(st.location.local / "h" / "fc1" / "output", mode="r+")
    twin.resize((6, 2))
    want = (st.location.local / "h" / "fc1" / "output" / "zarr.json").read_bytes()
    st.set_rows(stream, 2)
    st.set_rows(stream, 6)
    st.write_metadata()
    assert st.location.get("h/fc1/output/zarr.json") == want
    st.append(stream, data)
    st.write_partial()
    np.testing.assert_array_equal(stream.array[:], data)
    np.testing.assert_array_equal(zarr.open_array(st.location.local / "h" / "fc1" / "output", mode="r")[:], data)



def test_an_array_in_a_store_made_fresh_is_made_without_listing_and_elsewhere_over_what_was_left(tmp_path,
                                                                                                 monkeypatch):
    """A store this run made where there was none holds nothing at any array's key: making an array there lists
    nothing (a memory store's listing reads every key of the process). Any other store (a resume, an overwrite)
    still clears what a killed run left at the key before the array is made."""
    listed = []
    is_dir = Location.is_dir
    monkeypatch.setattr(Location, "is_dir", lambda self, prefix: listed.append(prefix) or is_dir(self, prefix))
    data = np.arange(4, dtype=np.float32).reshape(2, 2)
    st = streams(tmp_path)
    st.location.put("h/fc1/output/c/9/0", b"a killed run's chunk")
    stream = st.create("h/fc1/output", first_capture(data), data, torch.float32)
    assert listed == ["h/fc1/output"] and st.location.get("h/fc1/output/c/9/0") is None
    st.append(stream, data)
    st.write_partial()
    np.testing.assert_array_equal(stream.array[:2], data)
    listed.clear()
    fresh = Streams(Location(tmp_path / "new.zarr"), Location(tmp_path / "new.zarr").open_group("w"),
                    StoreConfig(codec="none", chunk_rows=4), None, None, fresh=True)
    fresh.create("h/fc1/output", first_capture(data), data, torch.float32)
    assert listed == []



def test_an_overwrite_that_leaves_nothing_makes_its_arrays_as_a_new_store_does(tmp_path, monkeypatch):
    """An overwrite that removed every key of the previous run makes its arrays without looking at their keys (as a
    new store); one that left a file hookrun did not write clears each array's key first, and keeps the file. Both
    read back as a fresh run's store."""
    import hookrun
    from tests.helpers import RANDOM, run_in, same_store

    path, ref = tmp_path / "s.zarr", tmp_path / "ref.zarr"
    run_in(ref, RANDOM)
    run_in(path, [*RANDOM, "data.batch_size=3"])
    listed = []
    is_dir = Location.is_dir
    monkeypatch.setattr(Location, "is_dir", lambda self, prefix: listed.append(prefix) or is_dir(self, prefix))
    run_in(path, [*RANDOM, "store.mode=overwrite"])
    arrays = set(hookrun.open(path).index.array)
    assert arrays and not arrays & set(listed)
    same_store(hookrun.open(path), hookrun.open(ref))
    (path / "notes.txt").write_text("mine")
    listed.clear()
    run_in(path, [*RANDOM, "store.mode=overwrite"])
    assert arrays <= set(listed) and (path / "notes.txt").read_text() == "mine"
    same_store(hookrun.open(path), hookrun.open(ref))

# -- Index --------------------------------------------------------------------------------------------------
def index(tmp_path, parts=0):
    location = Location(tmp_path / "s.zarr")
    return Index(location, location.open_group("a"), parts=parts)


def finish(idx, batch_no, rows):
    """Index rows of one batch, and its record (so the next commit takes them)."""
    idx.rows += [{"hook": "h", "layer": "fc1", "role": "output", "batch": batch_no, "array": "h/fc1/output",
                  "row_start": r, "row_stop": r + 1} for r in rows]
    idx.batch_rows.append({"batch": batch_no, "sample_start": rows[0], "sample_stop": rows[-1] + 1, "loss": None,
                           "forward_s": 0.1, "backward_s": 0.0, TABLES_KEY: {}})


def test_a_commits_rows_and_batch_records_read_back(tmp_path):
    idx = index(tmp_path)
    finish(idx, 0, [0, 1])
    idx.commit({("h/fc1/output", 0): (16, 7)})
    finish(idx, 1, [2])
    idx.commit({})
    assert idx.parts == 2 and idx.root.attrs["committed_parts"] == 2
    rows, batches = idx.committed()
    assert rows.batch.tolist() == [0, 0, 1] and rows.row_start.tolist() == [0, 1, 2]
    assert batches[["batch", "sample_start", "sample_stop"]].values.tolist() == [[0, 0, 2], [1, 2, 3]]


def test_side_tables_kept_as_columns_are_the_table_their_frames_make(tmp_path):
    """A batch's side table kept as columns (Columns, one DataFrame a commit) reads back as the frames pd.concat
    makes of one DataFrame a batch: values, dtypes (ints, floats, strings inferred once) and order."""
    import pandas as pd
    from hookrun.store.index import Columns, joined

    batches = [{"sample": np.arange(0, 3), "token": np.array(["a", "bc", "a"], dtype=object),
                "score": np.array([0.5, np.nan, 2.0], dtype=np.float32), "label": ["x", "y", "z"], "n": [1, 2, 3]},
               {"sample": np.arange(3, 4), "token": np.array(["d"], dtype=object),
                "score": np.array([1.5], dtype=np.float32), "label": ["w"], "n": [4]}]
    want = pd.concat([pd.DataFrame(b) for b in batches], ignore_index=True)
    got = joined([Columns(b) for b in batches])
    pd.testing.assert_frame_equal(got, want)
    assert [len(Columns(b)) for b in batches] == [3, 1] and len(Columns({})) == 0
    mixed = joined([Columns(batches[0]), pd.DataFrame(batches[1])])  # a method's frame beside columns
    pd.testing.assert_frame_equal(mixed, want)
    idx = index(tmp_path)
    finish(idx, 0, [0, 1, 2])
    idx.batch_rows[-1][TABLES_KEY] = {"tokens": Columns(batches[0])}
    finish(idx, 1, [3])
    idx.batch_rows[-1][TABLES_KEY] = {"tokens": Columns(batches[1])}
    idx.commit({})
    stored = pd.read_parquet(io.BytesIO(idx.location.get("_index/tokens-000000.parquet")))
    pd.testing.assert_frame_equal(stored, pd.read_parquet(io.BytesIO(want.to_parquet(index=False))))


def test_rows_of_an_unfinished_batch_wait_for_its_record(tmp_path):
    idx = index(tmp_path)
    finish(idx, 0, [0, 1])
    idx.rows.append({"hook": "h", "batch": 1, "row_start": 2, "row_stop": 3})  # batch 1 still running
    idx.commit({})
    assert idx.committed()[0].batch.tolist() == [0, 0]
    assert [r["batch"] for r in idx.rows] == [1]


def test_parts_written_after_the_last_commit_are_not_read_and_are_dropped(tmp_path):
    idx = index(tmp_path)
    finish(idx, 0, [0])
    idx.commit({})
    finish(idx, 1, [1])
    idx.commit({})
    idx.root.attrs["committed_parts"] = 1  # killed before its second commit raised the count
    again = Index(idx.location, idx.root, parts=1)
    assert again.committed()[1].batch.tolist() == [0]
    assert idx.location.exists("_index/part-000001.parquet")
    again.drop_uncommitted()
    assert sorted(idx.location.children("_index")) == [
        "batches-000000.parquet", "chunks-000000.parquet", "part-000000.parquet", "sums-000000.json"]


# -- WriteQueue ---------------------------------------------------------------------------------------------
def test_put_waits_while_the_queue_is_over_its_byte_budget():
    gate, handled = threading.Event(), []
    queue = WriteQueue(lambda item: (gate.wait(5), handled.append(item)), budget_bytes=100)
    queue.put("a", 60)  # the writer holds it (its bytes count until it is handled) at the gate
    done = threading.Event()
    threading.Thread(target=lambda: (queue.put("b", 60), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # 60 + 60 > 100: the hook waits for the writer
    assert queue.queued_bytes == 60
    gate.set()
    assert done.wait(5)
    queue.close()
    assert handled == ["a", "b"] and queue.queued_bytes == 0 and queue.peak_queued_bytes == 60


def test_an_item_larger_than_the_budget_is_taken_when_the_queue_is_empty():
    handled = []
    queue = WriteQueue(handled.append, budget_bytes=10)
    queue.put("big", 1000)
    queue.close()
    assert handled == ["big"]


def test_an_error_in_the_writer_is_kept_and_later_items_are_skipped():
    handled = []

    def handle(item):
        if item == "bad":
            raise OSError("no space left")
        handled.append(item)
    queue = WriteQueue(handle, budget_bytes=1 << 20)
    queue.put("ok", 1)
    queue.put("bad", 1)
    deadline = time.monotonic() + 5
    while queue.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    queue.put("after", 1)  # returns at once, not queued: the caller checks `error` after each put
    queue.close()
    assert isinstance(queue.error, OSError) and str(queue.error) == "no space left"
    assert handled == ["ok"] and queue.queued_bytes == 0


def test_a_put_waiting_on_the_budget_returns_when_the_writer_fails():
    gate = threading.Event()

    def handle(item):
        gate.wait(5)
        raise RuntimeError("writer died")
    queue = WriteQueue(handle, budget_bytes=10)
    queue.put("a", 10)
    done = threading.Event()
    threading.Thread(target=lambda: (queue.put("b", 10), done.set()), daemon=True).start()
    assert not done.wait(0.2)
    gate.set()
    assert done.wait(5) and isinstance(queue.error, RuntimeError)
    queue.close()


def test_without_a_thread_put_handles_the_item_itself():
    seen = []
    queue = WriteQueue(lambda item: seen.append((item, threading.current_thread())), budget_bytes=1, thread=False)
    queue.put("x", 100)
    assert seen == [("x", threading.current_thread())]
    queue.close()
