"""Sharded stores (store.shard_mb): whole shards written at once, read back bitwise, few files, resumable."""
import numpy as np
import pytest

import hookrun
from hookrun.config.checks import ConfigError
from tests.helpers import RANDOM, interrupted_store, run_in, same_store

SHARD = "store.shard_mb=0.0016"  # 1,677 bytes: 5 chunks of 10 fc1 outputs (32 B rows), 6 of fc1 inputs (24 B)


@pytest.mark.slow
def test_sharded_store_reads_back_bitwise_like_one_file_per_chunk(tmp_path):
    over = [*RANDOM, "store.chunk_rows=10", "+data.dataset.n=130"]
    run_in(tmp_path / "plain.zarr", over)
    run_in(tmp_path / "sharded.zarr", [*over, SHARD])
    plain, sharded = hookrun.open(tmp_path / "plain.zarr"), hookrun.open(tmp_path / "sharded.zarr")
    assert plain.index.equals(sharded.index)
    out = sharded.array("acts/fc1/output")
    assert out.chunks == (10, 8) and out.shards == (50, 8)
    assert sharded.array("acts/fc1/input.0").shards == (60, 6)
    for key in plain.index.array.unique():
        np.testing.assert_array_equal(plain.array(key)[:], sharded.array(key)[:])
    files = sorted(p.name for p in (sharded.path / "acts/fc1/output").glob("c.*"))
    assert files == ["c.0.0", "c.1.0", "c.2.0"]  # 130 rows: shards of 50, 50 and 30
    assert sharded.verify(decode=True) == []


def test_a_hundred_thousand_samples_are_not_a_hundred_thousand_files(tmp_path):
    over = ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1]}",
            "+data.inputs.x={random:normal,shape:[100000,6]}", "data.batch_size=5000", "store.chunk_rows=100"]
    run_in(tmp_path / "plain.zarr", over)
    run_in(tmp_path / "sharded.zarr", [*over, "store.shard_mb=1"])
    count = {name: sum(1 for _ in (tmp_path / name / "acts/fc1/output").glob("c.*"))
             for name in ("plain.zarr", "sharded.zarr")}
    assert count == {"plain.zarr": 1000, "sharded.zarr": 4}  # 1 MB shards of 32 B rows: 32,700 rows each
    a, b = hookrun.open(tmp_path / "plain.zarr"), hookrun.open(tmp_path / "sharded.zarr")
    np.testing.assert_array_equal(a.load(layer="fc1", role="output"), b.load(layer="fc1", role="output"))


@pytest.mark.slow
def test_sharded_run_stopped_and_resumed_is_bitwise_identical(tmp_path):
    over = [*RANDOM, "store.chunk_rows=2", "store.shard_mb=0.0002"]  # 209 bytes: shards of 3 chunks of fc1 outputs
    run_in(tmp_path / "ref.zarr", over)
    cap = interrupted_store(tmp_path / "s.zarr", over)
    assert len(cap.batches) == 3 and cap.verify() == []  # 12 rows committed: a partial shard on disk
    run_in(tmp_path / "s.zarr", [*over, "store.mode=resume"])
    resumed = hookrun.open(tmp_path / "s.zarr")
    same_store(resumed, hookrun.open(tmp_path / "ref.zarr"))
    assert resumed.verify(decode=True) == []
    shard = resumed.path / "acts/fc2/output/c.1.0"
    shard.write_bytes(shard.read_bytes()[:-4])
    assert any("acts/fc2/output/c.1.0: chunk is" in p for p in hookrun.open(tmp_path / "s.zarr").verify())


def test_shard_settings_are_checked_and_kept_on_resume(tmp_path):
    with pytest.raises(ConfigError, match=r"store.shard_mb: -1.0 is too small; give a number in \(0, 16384\] or null"):
        run_in(tmp_path / "bad.zarr", [*RANDOM, "store.shard_mb=-1"])
    interrupted_store(tmp_path / "s.zarr")
    with pytest.raises(ConfigError, match=r"store.shard_mb: None -> 1.0"):
        run_in(tmp_path / "s.zarr", [*RANDOM, "store.mode=resume", "store.shard_mb=1"])
