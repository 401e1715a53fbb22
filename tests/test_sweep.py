"""Hydra multiruns over layers (basic and joblib launchers), collected into one DataFrame."""
import numpy as np
import pytest

import hookrun
from tests.conftest import run_cli


@pytest.mark.parametrize("launcher", ["basic", "joblib"])
def test_layer_sweep_collects_into_one_dataframe(tmp_path, launcher):
    run_cli("-m", "+experiment=conv_fmaps", "layers=conv1,pool1", "seed=3", f"hydra/launcher={launcher}",
            f"hydra.sweep.dir={tmp_path}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1"]  # one store per job
    df = hookrun.collect(tmp_path)
    fmaps = df[(df.hook == "fmaps") & (df.role == "output")]
    assert sorted(zip(fmaps.layers, fmaps.layer)) == [("conv1", "conv1"), ("pool1", "pool1")]
    assert set(df.status) == {"complete"} and set(df.experiment) == {"conv_fmaps"}
    assert set(df.seed) == {3} and df.seed.dtype.kind == "i"  # parsed as Hydra does, not '3'
    by_layer = fmaps.set_index("layer")
    assert by_layer.loc["conv1", "shape"] == "[1, 2, 2, 2]" and by_layer.loc["pool1", "shape"] == "[1, 2, 1, 1]"
    assert by_layer.loc["pool1", "max"] == 18.0
    pool = hookrun.open(tmp_path / fmaps.set_index("layer").loc["pool1", "job"])
    assert pool.load(layer="pool1", role="output").ravel().tolist() == [9.0, 18.0]
    np.testing.assert_array_equal(pool.load(layer="pool1", role="input.0")[0, 1], np.full((2, 2), 18.0))
