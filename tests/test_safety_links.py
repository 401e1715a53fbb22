"""Data safety, round 3 (issue 29, item 4): a directory of a store replaced by a symbolic link while the run writes
(`python -m hookrun`, the real CLI) stops the run at its next write, with an error naming the directory; not a byte
lands in the link's target, and a user's file there named like a chunk survives."""
import os
import subprocess
import sys
import time

import pytest
import torch

from hookrun.storage import LinkError, Location
from tests.helpers import MLP, REPO


class GatedItems(torch.utils.data.Dataset):
    """RandomItems that, loading item `at`, write `<gate>/ready` and wait for `<gate>/go` (the test changes the
    store's directories meanwhile)."""

    def __init__(self, gate: str, n: int = 24, dim: int = 6, at: int = 12):
        self.gate, self.n, self.dim, self.at = gate, n, dim, at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at:
            open(os.path.join(self.gate, "ready"), "w").close()
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(self.gate, "go")) and time.time() < deadline:
                time.sleep(0.02)
        return torch.randn(self.dim) + i


def user_dir(path):
    """A user's directory: files named like chunks and index parts, and notes."""
    path.mkdir()
    for name in ["c.0.0", "c.1.0", "c.2.0", "c.3.0", "c.30.0", "part-000003.parquet", "sums-000003.json", "notes.txt"]:
        (path / name).write_bytes(f"the user's {name}".encode())
    return {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("swapped", ["acts/fc1/output", "_index"])
def test_a_store_dir_replaced_by_a_link_mid_run_stops_the_run_and_writes_nothing_through_it(tmp_path, swapped):
    gate, store = tmp_path / "gate", tmp_path / "run" / "captures.zarr"
    gate.mkdir()
    theirs = tmp_path / "users_dir"
    before = user_dir(theirs)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hookrun", *MLP, "+data.dataset._target_=tests.test_safety_links.GatedItems",
         f"+data.dataset.gate={gate}", "data.batch_size=4", "store.chunk_rows=5", "store.commit_s=0",
         f"store.path={store}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (gate / "ready").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.3)  # the writer's work on batches 0..2 is done (commits every batch)
        (store / swapped).rename(tmp_path / "moved")  # the store's own dir, kept aside
        (store / swapped).symlink_to(theirs, target_is_directory=True)
        (gate / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0, out + err
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before  # nothing added, replaced or removed
    assert f"{store}/{swapped}: is a symbolic link to {theirs}" in out + err, (out + err)[-3000:]


def test_every_kind_of_write_refuses_a_linked_dir(tmp_path):
    """Location.put, put_many, put_if_absent, local_file, delete_dir and zarr's own set and delete (the store object
    zarr writes array metadata and shards through) each refuse a directory that is a link; the target is untouched."""
    loc = Location(tmp_path / "s.zarr")
    loc.put("acts/fc1/output/c.0.0", b"mine")
    theirs = tmp_path / "theirs"
    before = user_dir(theirs)
    (tmp_path / "s.zarr/acts/fc1/output").rename(tmp_path / "aside")
    (tmp_path / "s.zarr/acts/fc1/output").symlink_to(theirs)
    said = f"{tmp_path}/s.zarr/acts/fc1/output: is a symbolic link to {theirs}"
    from zarr.core.buffer.cpu import Buffer
    from zarr.core.sync import sync

    writes = [lambda: loc.put("acts/fc1/output/c.0.0", b"x"), lambda: loc.put("acts/fc1/output/new/c.0.0", b"x"),
              lambda: loc.put_many([("acts/fc1/ok", b"x"), ("acts/fc1/output/c.0.0", b"x"),
                                    ("acts/fc1/output/c.1.0", b"x")]),
              lambda: loc.put_if_absent("acts/fc1/output/lock", b"x"),
              lambda: loc.local_file("acts/fc1/output/index.parquet").__enter__(),
              lambda: sync(loc.zarr_store.set("acts/fc1/output/zarr.json", Buffer.from_bytes(b"{}"))),
              lambda: sync(loc.zarr_store.delete("acts/fc1/output/c.1.0")),
              lambda: sync(loc.zarr_store.delete_dir("acts/fc1/output/sub"))]
    for write in writes:
        with pytest.raises(LinkError, match=said):
            write()
    loc.delete_dir("acts/fc1/output")  # removes the link at most, never what it points to
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before
