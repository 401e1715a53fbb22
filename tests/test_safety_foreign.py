"""A store whose index (or root and index) belongs to another run is refused on open, not only by verify(): the run
id made at creation is in the root, the index group and every array's metadata, and compared on open."""
import json
import shutil

import pytest
import zarr

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.format.files import DamagedError
from tests.helpers import RANDOM, interrupted_store, run_in


def two_runs(tmp_path):
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    run_in(a, RANDOM)
    run_in(b, [*RANDOM, "seed=1"])
    return a, b


@pytest.mark.slow
def test_every_part_of_a_store_holds_its_run_id_and_an_overwrite_takes_a_new_one(tmp_path):
    a, b = two_runs(tmp_path)
    cap = hookrun.open(a)
    run_id = cap.attrs["run_id"]
    assert len(run_id) == 32 and run_id != hookrun.open(b).attrs["run_id"]
    assert zarr.open_group(str(a / "_index"), mode="r").attrs["run_id"] == run_id
    keys = cap.index.array.unique()
    assert len(keys) == 4 and all(zarr.open_array(str(a / k), mode="r").attrs["run_id"] == run_id for k in keys)
    run_in(a, [*RANDOM, "store.mode=overwrite"])
    new = hookrun.open(a)
    assert new.attrs["run_id"] != run_id and new.verify() == []
    assert zarr.open_group(str(a / "_index"), mode="r").attrs["run_id"] == new.attrs["run_id"]


def test_an_index_of_another_run_is_refused_on_open(tmp_path):
    a, b = two_runs(tmp_path)
    shutil.rmtree(a / "_index")
    shutil.copytree(b / "_index", a / "_index")
    with pytest.raises(DamagedError, match=r"_index: the index belongs to another run \(run id [0-9a-f]{32}; the "
                                           r"root's is [0-9a-f]{32}\)"):
        hookrun.open(a)


@pytest.mark.slow
def test_a_root_and_index_of_another_run_are_refused_on_first_read(tmp_path):
    """Both the root metadata and _index/ replaced by another run's: the arrays say whose they are."""
    a, b = two_runs(tmp_path)
    shutil.rmtree(a / "_index")
    shutil.copytree(b / "_index", a / "_index")
    shutil.copy(b / "zarr.json", a / "zarr.json")
    cap = hookrun.open(a)
    for read in (lambda: cap.index, lambda: cap.samples, lambda: cap.load(layer="fc1", role="output")):
        with pytest.raises(DamagedError, match=r"acts/fc1/input.0: array acts/fc1/input.0 belongs to another run"):
            read()
    assert any("belongs to another run" in p for p in cap.verify())


def test_a_resume_of_a_store_with_another_runs_index_is_refused(tmp_path):
    a = tmp_path / "a.zarr"
    interrupted_store(a)
    b = tmp_path / "b.zarr"
    interrupted_store(b)
    meta = json.loads((b / "_index" / "zarr.json").read_text())
    (a / "_index" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="resume refused, .* is damaged: .*the index belongs to another run"):
        run_in(a, [*RANDOM, "store.mode=resume"])
