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


@pytest.fixture(scope="module")
def twelve(tmp_path_factory):
    """A 12-block tiny GPT-2's residual stream after each block (hook resid, standard names blocks.0..11: blocks.10
    sorts before blocks.2 by name) and two MLP sites of other widths (hook mlp), chunks of 4 token rows."""
    import torch

    from hookrun.experiments.lm import causal_lm, tokenizer

    torch.manual_seed(0)
    model = causal_lm(n_layer=12, n_embd=8, n_head=2).eval()
    hooks = {"resid": {"kind": "forward", "layers": ["blocks.*"]},
             "mlp": {"kind": "forward", "layers": ["blocks.0.mlp.hidden", "blocks.1"]}}
    return hookrun.run(model=model, tokenizer=tokenizer(), hooks=hooks,
                       inputs=["the hooks run on a model", "a store of captures"],
                       **{"store.path": str(tmp_path_factory.mktemp("x") / "a.zarr"), "store.chunk_rows": 4})


def test_a_hooks_layers_stack_along_layer_in_model_order_with_the_token_coordinates(twelve):
    cap = twelve
    ds = cap.to_xarray(hook="resid")
    names = [f"blocks.{i}" for i in range(12)]
    out = ds["output"]
    assert out.dims[:2] == ("layer", "token") and ds["layer"].values.tolist() == names  # model order, not by name
    assert type(out.data).__module__.startswith("dask") and out.chunks[1] == (4, 4, 3)
    for name in names:
        np.testing.assert_array_equal(out.sel(layer=name).values, cap.load(hook="resid", layer=name))
    tokens = cap.tokens()
    for coord, column in dict(sample="sample", position="position", token_id="token_id", token_text="token").items():
        assert ds[coord].dims == ("token",) and ds[coord].values.tolist() == tokens[column].tolist()
    picked = cap.to_xarray(hook="resid", layer=["blocks.7", "transformer.h.2"])  # given order; native name too
    assert picked["layer"].values.tolist() == ["blocks.7", "blocks.2"]
    np.testing.assert_array_equal(picked["output"].values[1], cap.load(hook="resid", layer="blocks.2"))
    one = cap.to_xarray(hook="resid", layer=["blocks.3"])  # a list: the layer dim even for one
    assert one["output"].dims[0] == "layer" and "layer" not in cap.to_xarray(hook="resid", layer="blocks.3").dims


def test_stacked_layers_read_nothing_until_computed(twelve, tmp_path):
    import shutil

    shutil.copytree(twelve.path, tmp_path / "a.zarr")
    ds = hookrun.open(tmp_path / "a.zarr").to_xarray(hook="resid")
    four, five = (tmp_path / "a.zarr" / "resid" / f"blocks.{i}" / "output" for i in (4, 5))
    chunks = sorted(p.name for p in five.glob("c*"))
    assert len(chunks) == 3
    for name in chunks:  # block 5's chunk files replaced by block 4's after opening: what is read is block 4's
        shutil.copyfile(four / name, five / name)
    np.testing.assert_array_equal(ds["output"].sel(layer="blocks.5").values,
                                  twelve.load(hook="resid", layer="blocks.4"))


def test_layers_of_other_shapes_merge_with_stack_false_and_are_refused_stacked(twelve, run_cfg, cnn):
    merged = twelve.to_xarray(hook="mlp", stack=False)
    assert set(merged.data_vars) == {"blocks.0.mlp.hidden/output", "blocks.1/output"}
    assert merged["blocks.0.mlp.hidden/output"].dims == ("token", "blocks.0.mlp.hidden/output_feature")
    assert merged["blocks.0.mlp.hidden/output"].shape == (len(twelve.tokens()), 32)
    assert type(merged["blocks.1/output"].data).__module__.startswith("dask")
    np.testing.assert_array_equal(merged["blocks.1/output"].values, twelve.load(hook="mlp", layer="blocks.1"))
    assert merged["token_text"].values.tolist() == twelve.tokens()["token"].tolist()
    with pytest.raises(KeyError, match=r"to_xarray.hook='mlp', layer=None.: the layers' arrays differ in roles, "
                                       r"shape or dtype, so they do not stack along `layer` \(blocks.0.mlp.hidden: "
                                       r"output \[11, 32\] float32; blocks.1: output \[11, 8\] float32\); .*stack=False"):
        twelve.to_xarray(hook="mlp")
    with pytest.raises(KeyError, match=r"is ambiguous: the store has hooks mlp, resid; name one .hook=...., or a "
                                       r"layer; groups: mlp/blocks.0.mlp.hidden, mlp/blocks.1, resid/blocks.0, "):
        twelve.to_xarray()
    with pytest.raises(KeyError, match=r"layer=\['blocks.1', 'blocks.99'\]. matches nothing at 'blocks.99'; groups"):
        twelve.to_xarray(hook="resid", layer=["blocks.1", "blocks.99"])
    with pytest.raises(KeyError, match="a layer is named twice"):
        twelve.to_xarray(hook="resid", layer=["blocks.1", "transformer.h.1"])
    with pytest.raises(TypeError, match="layer is a layer's name, a list of names, or None"):
        twelve.to_xarray(hook="resid", layer=3)

    x, base = cnn
    cap = run_cfg(base)
    acts = cap.to_xarray(hook="acts", stack=False)  # conv1, relu1, fc: dims of other sizes, each its own
    assert list(acts.data_vars)[:2] == ["conv1/input.0", "conv1/output"]
    assert acts["conv1/input.0"].dims == ("sample", "conv1/input.0_channel", "conv1/input.0_height",
                                          "conv1/input.0_width")
    np.testing.assert_array_equal(acts["conv1/input.0"].values, x)
    np.testing.assert_array_equal(acts["fc/output"].values, cap.load(layer="fc", role="output"))
    with pytest.raises(KeyError, match=r"conv1: input.0 \[23, 3, 6, 6\] float32, output \[23, 4, 6, 6\] float32; "
                                       r"relu1: input.0 \[23, 4, 6, 6\] float32"):
        cap.to_xarray(hook="acts")
    relu = cap.to_xarray(hook="acts", layer=["relu1", "conv1"], stack=False)
    np.testing.assert_array_equal(relu["relu1/output"].values, cap.load(layer="relu1", role="output"))
