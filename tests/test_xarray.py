"""Reading at scale: consolidated metadata at completion, lazy dask-backed xarray datasets, named dims."""
import warnings

import numpy as np
import pytest
import xarray as xr

import hookrun
from tests.helpers import RANDOM, interrupted_store, run_in


@pytest.fixture
def cnn(npy):
    x = np.random.default_rng(6).standard_normal((23, 3, 6, 6)).astype("float32")
    return x, ["+model._target_=tests.models.CNN", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=5",
               "+hooks.acts={kind:forward,layers:[conv1,relu1,fc],capture:[input,output]}"]


def test_to_xarray_is_lazy_and_equals_load(run_cfg, cnn):
    x, base = cnn
    cap = run_cfg([*base, "store.chunk_rows=4"])
    ds = cap.to_xarray(layer="conv1")
    out, inp = ds["output"], ds["input.0"]
    assert out.dims == ("sample", "output_channel", "output_height", "output_width")
    assert inp.dims == ("sample", "input.0_channel", "input.0_height", "input.0_width")
    assert out.shape == (23, 4, 6, 6) and out.chunks[0] == (4, 4, 4, 4, 4, 3)
    assert type(out.data).__module__.startswith("dask")  # lazy: nothing read yet
    np.testing.assert_array_equal(out.values, cap.load(layer="conv1", role="output"))
    np.testing.assert_array_equal(inp.values, x)
    assert cap.to_xarray(layer="fc")["output"].dims == ("sample", "output_feature")
    with pytest.raises(KeyError, match="to_xarray.hook=None, layer='nope'. matches nothing; groups: acts/conv1"):
        cap.to_xarray(layer="nope")


def test_complete_store_is_consolidated_and_opens_without_warnings(run_cfg, cnn):
    _, base = cnn
    cap = run_cfg(base)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = xr.open_zarr(str(cap.path), group="acts/relu1")
    assert set(ds.data_vars) == {"input.0", "output"} and ds["output"].shape == (23, 4, 6, 6)
    meta = (cap.path / "zarr.json").read_text()
    assert '"consolidated_metadata"' in meta and '"status": "complete"' in meta


def test_a_stopped_store_is_not_consolidated_and_resumes(tmp_path):
    cap = interrupted_store(tmp_path / "s.zarr")
    assert '"consolidated_metadata"' not in (cap.path / "zarr.json").read_text()
    run_in(tmp_path / "s.zarr", [*RANDOM, "store.mode=resume"])
    done = hookrun.open(tmp_path / "s.zarr")
    assert done.status == "complete" and done.to_xarray(layer="fc2")["output"].shape == (24, 8)
