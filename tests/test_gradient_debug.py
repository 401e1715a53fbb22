"""For the people who debug gradients: each capture's L2 norm in the index (numpy and device paths), and
cap.first_nonfinite() naming the first batch, capture (forward order, then backward order) and sample with NaN/inf,
checked against plain PyTorch hooks on the bundled blowup experiment."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import hookrun
from hookrun.store.stats import device_sums, stats, stats_from_sums

V1 = Path(__file__).parent / "data" / "format_v1" / "v1_conv_fmaps.zarr"


def finite_norm(a: np.ndarray) -> float:
    """The L2 norm of the finite values, in float64 (NaN when there is none)."""
    x = np.asarray(a, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    return float(np.sqrt(np.sum(x * x))) if x.size else math.nan


@pytest.mark.parametrize("case", ["normal", "offset", "huge", "nonfinite", "all_nan", "int64", "bfloat16"])
def test_norm_in_numpy_and_on_the_device(case):
    rng = np.random.default_rng(5)
    a = {"normal": rng.standard_normal((64, 300)).astype("float32"),
         "offset": (rng.standard_normal(100_000) * 1e-3 + 1e3).astype("float32"),
         "huge": (rng.standard_normal(200_000) * 1e17).astype("float32"),  # squares overflow float32 sums
         "nonfinite": np.array([3.0, np.nan, np.inf, -4.0, -np.inf], dtype="float32"),
         "all_nan": np.full(9, np.nan, dtype="float32"),
         "int64": np.arange(-20, 21),
         "bfloat16": rng.standard_normal(5000).astype("float32")}[case]
    t = torch.from_numpy(a).bfloat16() if case == "bfloat16" else torch.from_numpy(a)
    values = t.float().numpy() if case == "bfloat16" else a
    truth = finite_norm(values)
    if case == "nonfinite":
        assert truth == 5.0
    got_numpy = stats(values)["norm"]
    got_device = stats_from_sums(device_sums(t).tolist(), t.numel())["norm"]
    if math.isnan(truth):
        assert math.isnan(got_numpy) and math.isnan(got_device)
    else:
        np.testing.assert_allclose([got_numpy, got_device], [truth, truth], rtol=1e-5)


def test_a_store_written_before_the_norm_reads_it_as_nan():
    cap = hookrun.open(V1)
    assert "norm" in cap.index.columns and cap.index["norm"].isna().all() and len(cap.index) == 3


def plain_blowup():
    """The blowup experiment run with plain torch: every batch's forward outputs and output gradients in the order
    the hooks fire, as (batch, backward, layer, tensor)."""
    from hookrun.experiments.blowup import DeepLinear, Unnormalised, energy

    model, data = DeepLinear(), Unnormalised()
    events = []
    for batch in range(4):
        x = data.items[4 * batch:4 * batch + 4].clone()

        def forward(module, args, out, name=None):
            events.append((batch, False, name, out.detach().clone()))
            out.register_hook(lambda g: events.append((batch, True, name, g.detach().clone())))

        handles = [m.register_forward_hook(lambda m, a, o, n=n: forward(m, a, o, n)) for n, m in model.named_children()]
        energy(model(x), None).backward()
        for h in handles:
            h.remove()
    return events


@pytest.fixture(scope="module")
def blowup(tmp_path_factory):
    from tests.helpers import make_cfg
    from hookrun.engine.runner import run

    path = tmp_path_factory.mktemp("blowup") / "captures.zarr"
    run(make_cfg(["+experiment=blowup", f"store.path={path}"]))
    return hookrun.open(path)


def test_blowup_norms_and_counts_are_plain_torch_ones(blowup):
    events = plain_blowup()
    index = blowup.index
    assert blowup.status == "complete" and len(index) == len(events) == 64  # the run kept going (on_nonfinite)
    for batch, backward, layer, tensor in events:
        row = index[(index.batch == batch) & (index.layer == layer)
                    & (index.role == ("grad" if backward else "output"))].iloc[0]
        a = tensor.numpy()
        assert (row.nan_count, row.inf_count) == (int(np.isnan(a).sum()), int(np.isinf(a).sum())), (batch, layer)
        truth = finite_norm(a)
        assert math.isnan(row.norm) if math.isnan(truth) else row.norm == pytest.approx(truth, rel=1e-5)
    grads = index[index.hook == "grads"].set_index(["batch", "layer"])["norm"]
    assert grads[(0, "fc1")] / grads[(0, "fc2")] == pytest.approx(30.0, rel=1e-4)  # gain 30 a layer going back
    assert index[(index.nan_count + index.inf_count) > 0].batch.unique().tolist() == [3]


def test_first_nonfinite_is_the_first_plain_torch_hook_to_see_one(blowup):
    events = plain_blowup()
    batch, backward, layer, tensor = next(e for e in events if not torch.isfinite(e[3]).all())
    assert (batch, backward, layer) == (3, True, "fc4")  # in backward order: fc8's gradient first, fc4 overflows
    row = int(np.flatnonzero(~torch.isfinite(tensor).all(1).numpy())[0])
    element = int(np.flatnonzero(~np.isfinite(tensor[row].numpy()))[0])
    hit = blowup.first_nonfinite()
    assert (hit.batch, hit.backward, hit.hook, hit.layer, hit.role) == (3, True, "grads", "fc4", "grad")
    assert (hit.sample, hit.element, hit.value) == (4 * batch + row, (element,), float(tensor[row, element]))
    assert (hit.nan_count, hit.inf_count) == (int(tensor.isnan().sum()), int(tensor.isinf().sum()))
    assert str(hit).startswith(f"batch 3, backward: grads fc4 grad, sample {4 * batch + row}, element [{element}]")
    from hookrun.read.captures import _execution_order  # a store written before the index's `fired`: the guess

    rows = blowup.index[blowup.index.batch == 3]
    guessed = [rows.loc[i, "layer"] + ("'" if rows.loc[i, "role"] == "grad" else "") for i in _execution_order(rows)]
    assert guessed == [f"fc{k}" for k in range(1, 9)] + [f"fc{k}'" for k in range(8, 0, -1)]


def test_first_nonfinite_in_forward_order_across_hooks(run_cfg):
    """Hooks named against the forward order (a_late on head, z_early on fc1): NaN in sample 1's input shows first
    at fc1's output, whatever the hooks' names; a finite run has none."""
    overrides = ["+model._target_=tests.models.MLP", "+data.inputs.x=[[1,2,3,4,5,6],[1,nan,3,4,5,6],[0,0,0,0,0,0]]",
                 "+hooks.a_late={kind: forward, layers: head}", "+hooks.z_early={kind: forward, layers: fc1}",
                 "data.batch_size=3"]
    cap = run_cfg(overrides)
    hit = cap.first_nonfinite()
    assert (hit.hook, hit.layer, hit.role, hit.batch, hit.sample, hit.backward) == ("z_early", "fc1", "output", 0, 1,
                                                                                     False)
    assert hit.nan_count == 8 and math.isnan(hit.value)  # fc1's 8 outputs of sample 1
    finite = run_cfg([*overrides[:1], "+data.inputs.x=[[1.0,2,3,4,5,6]]", *overrides[2:4]], name="finite")
    assert finite.first_nonfinite() is None
