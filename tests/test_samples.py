"""Per-sample metadata (data.record -> cap.samples) and reused modules (load() never mixes calls)."""
import numpy as np
import pytest
import torch

from hookrun.config.checks import ConfigError


class Labelled(torch.utils.data.Dataset):
    """n items (x, label, name): x = [i, i, i, i] / 10, label = i % 3, name = 'item<i>'."""

    def __init__(self, n=10):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((4,), i / 10), i % 3, f"item{i}"


DATA = ["model=add_one", "+data.dataset._target_=tests.test_samples.Labelled", "data.fields=[x,label,name]",
        "data.batch_size=4", "+hooks.acts.kind=forward", "+hooks.acts.layers=_model", "+hooks.acts.capture=[input,output]"]


def test_recorded_fields_are_one_row_per_sample_and_join_arrays_and_index(run_cfg):
    cap = run_cfg([*DATA, "data.targets=[label,name]", "data.record=[label,name]", "data.stride=2"])
    s = cap.samples
    assert list(s.columns) == ["sample", "batch", "row", "label", "name"]
    # stride 2 over batches of 4 out of 10 samples: samples 0..3 and 8..9
    assert s["sample"].tolist() == [0, 1, 2, 3, 8, 9]
    assert s.batch.tolist() == [0, 0, 0, 0, 1, 1] and s.row.tolist() == [0, 1, 2, 3, 4, 5]
    assert s.label.tolist() == [0, 1, 2, 0, 2, 0] and s.name.tolist() == ["item0", "item1", "item2", "item3", "item8", "item9"]
    x = cap.load(role="input.0")  # row i of every per-sample array is samples.row == i
    np.testing.assert_allclose(x[s.row, 0], s["sample"] / 10, rtol=1e-6)
    # class 0's rows of the model output (x + 1), and the index rows of their batches
    out = cap.load(role="output")[s.row[s.label == 0]]
    np.testing.assert_allclose(out[:, 0], [1.0, 1.3, 1.9], rtol=1e-6)
    joined = s.merge(cap.rows(role="output")[["batch", "mean"]], on="batch")
    assert len(joined) == 6
    np.testing.assert_allclose(joined.groupby("batch")["mean"].first(), [1.15, 1.85], rtol=1e-6)


def test_default_record_is_the_targets_and_non_scalars_are_refused(run_cfg):
    cap = run_cfg([*DATA, "data.targets=[label,name]"], name="default")
    assert list(cap.samples.columns) == ["sample", "batch", "row", "label", "name"]
    assert cap.samples["sample"].tolist() == list(range(10)) and cap.samples.label.tolist()[:4] == [0, 1, 2, 0]
    cap = run_cfg([*DATA, "data.targets=[label,name]", "data.record=[]"], name="none")
    assert list(cap.samples.columns) == ["sample", "batch", "row"] and len(cap.samples) == 10
    with pytest.raises(ConfigError, match=r"data.record: 'x' has per-sample shape \[4\], not one scalar per sample"):
        run_cfg([*DATA, "data.targets=[label,name]", "data.record=[x]"], name="bad")
    with pytest.raises(ConfigError, match=r"data.record: 'lable' is not one of the inputs/fields \(x, label, name\) \(did you mean: label"):
        run_cfg([*DATA, "data.targets=[label,name]", "data.record=[lable]"], name="typo")


def test_record_names_are_checked_against_inputs_before_running(run_cfg):
    with pytest.raises(ConfigError, match=r"data.record: 'y' is not one of the inputs/fields \(x\)"):
        run_cfg(["+experiment=add_one", "+data.record=[y]"])


REUSE = ["+model._target_=tests.models.Reuse", "data.batch_size=4", "+hooks.acts.kind=forward",
         "+hooks.acts.layers=shared"]


def test_load_of_a_reused_module_needs_call_and_the_summary_counts_per_call(run_cfg, npy):
    x = np.random.default_rng(0).standard_normal((10, 4)).astype("float32")
    cap = run_cfg([*REUSE, f"+data.inputs.x={{file: '{npy('x', x)}'}}"])
    with pytest.raises(KeyError, match=r"acts/shared/output holds 2 calls .* \(calls \[0, 1\]\); pick one with call="):
        cap.load(layer="shared", role="output")
    assert cap.calls(layer="shared", role="output") == [0, 1]
    assert cap.load(layer="shared", role="output", call=1).shape == (10, 4)
    with pytest.raises(KeyError, match=r"no capture with call=2; calls are \[0, 1\]"):
        cap.load(layer="shared", role="output", call=2)
    summary = {a["role"]: a for a in cap.attrs["summary"]["arrays"]}
    assert summary["output"]["calls"] == 2 and summary["output"]["shape"] == [10, 4]  # what load(call=c) returns
