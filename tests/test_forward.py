"""Forward kinds against hand-written PyTorch hooks; roles of tuple, dict and dataclass outputs; layer selection."""
import numpy as np
import pytest
import torch

from hookrun.config.checks import ConfigError
from hookrun.capture.hooks import hook_count
from tests.models import BUILT

REUSE = ["+model._target_=tests.models.tracked", "+model.name=reuse", "+model.cls=Reuse"]


def reuse_inputs(npy, n=10):
    x = np.random.default_rng(0).standard_normal((n, 4)).astype("float32")
    return x, [f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=4"]


def hand_captures(model, x, batch_size, names, scale=None):
    """What register_forward_hook(with_kwargs=True) sees per batch: {(layer, role): [tensors in call order]}."""
    got = {}

    def make(name):
        def hook(module, args, kwargs, output):
            outs = output if isinstance(output, (tuple, dict)) else {"": output}
            items = outs.items() if isinstance(outs, dict) else enumerate(outs)
            for i, a in enumerate(args):
                got.setdefault((name, f"input.{i}"), []).append(a.detach().clone())
            for k, v in items:
                got.setdefault((name, f"output.{k}" if k != "" else "output"), []).append(v.detach().clone())
        return hook

    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(make(n), with_kwargs=True) for n in names]
    with torch.no_grad():
        for s in range(0, len(x), batch_size):
            kwargs = {} if scale is None else {"scale": scale}
            model(torch.from_numpy(x[s:s + batch_size]), **kwargs)
    for h in handles:
        h.remove()
    return got


def test_forward_matches_hand_written_hooks_with_reuse_and_tuples(run_cfg, npy):
    x, data = reuse_inputs(npy)
    cap = run_cfg([*REUSE, *data, "+hooks.acts.kind=forward", "+hooks.acts.layers=[shared,pair]",
                   "+hooks.acts.capture=[input,output]"])
    model = BUILT["reuse"]
    assert hook_count(model) == 0
    ref = hand_captures(model, x, 4, ["shared", "pair"])
    # shared runs twice per forward: calls 0 and 1, each a full batch of rows
    idx = cap.rows(layer="shared", role="output")
    assert idx.call.tolist() == [0, 1, 0, 1, 0, 1]
    assert idx.batch.tolist() == [0, 0, 1, 1, 2, 2]
    assert idx.sample_start.tolist() == [0, 0, 4, 4, 8, 8]
    for call in (0, 1):
        want = torch.cat(ref["shared", "output"][call::2]).numpy()
        np.testing.assert_array_equal(cap.load(layer="shared", role="output", call=call), want)
    for role in ("output.0", "output.1", "input.0"):
        np.testing.assert_array_equal(cap.load(layer="pair", role=role), torch.cat(ref["pair", role]).numpy())
    assert set(cap.index.role) == {"input.0", "output", "output.0", "output.1"}


def test_dict_and_dataclass_outputs_become_roles(run_cfg, npy):
    x, data = reuse_inputs(npy, n=4)
    cap = run_cfg([*REUSE, *data, "+hooks.out.kind=forward", "+hooks.out.layers=_model"])
    assert sorted(cap.index.role) == ["output.h", "output.t"]
    np.testing.assert_allclose(np.tanh(cap.load(role="output.h")), cap.load(role="output.t"), rtol=1e-6)
    cap = run_cfg(["+model._target_=tests.models.DataclassOut", *data, "+hooks.out.kind=forward",
                   "+hooks.out.layers=_model"], name="dc")
    np.testing.assert_allclose(cap.load(role="output.logits"), 2 * cap.load(role="output.hidden"), rtol=1e-6)


def test_forward_pre_records_args_and_kwargs(run_cfg, npy):
    x, data = reuse_inputs(npy, n=4)
    s = npy("s", np.float32(0.5))
    cap = run_cfg([*REUSE, *data, f"+data.inputs.scale={{file: '{s}'}}", "data.keyword=true",
                   "data.batched=false", "+hooks.pre.kind=forward_pre", "+hooks.pre.layers=_model"])
    np.testing.assert_array_equal(cap.load(role="kwarg.x")[0], x)
    assert cap.load(role="kwarg.scale").tolist() == [0.5]
    assert cap.index.per_sample.tolist() == [False, False]


def test_layer_patterns_glob_regex_and_near_miss(run_cfg, npy):
    _, data = reuse_inputs(npy, n=4)
    mlp = ["+model._target_=tests.models.MLP", "+model.d_in=4", *data[:1], "data.batch_size=2"]
    cap = run_cfg([*mlp, "+hooks.a.kind=forward", "+hooks.a.layers=fc?"], name="glob")
    assert sorted(set(cap.index.layer)) == ["fc1", "fc2"]
    cap = run_cfg([*mlp, "+hooks.a.kind=forward", "+hooks.a.layers='re:(fc|act)1'"], name="re")
    assert sorted(set(cap.index.layer)) == ["act1", "fc1"]
    with pytest.raises(ConfigError) as err:
        run_cfg([*mlp, "+hooks.a.kind=forward", "+hooks.a.layers=[fc3,hed]"], name="bad")
    text = str(err.value)
    assert "hooks.a.layers: 'fc3' matches no module (did you mean: fc2, fc1?)" in text
    assert "'hed' matches no module (did you mean: head" in text


def test_no_autograd_without_loss(run_cfg, npy):
    _, data = reuse_inputs(npy, n=4)
    seen = []
    cap = run_cfg(["+model._target_=tests.models.MLP", "+model.d_in=4", *data[:1], "+hooks.a.kind=forward", "+hooks.a.layers=fc1"])
    assert cap.status == "complete"
    # a forward-only run records activations computed without a graph
    model = __import__("tests.models", fromlist=["MLP"]).MLP()
    h = model.fc1.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    with torch.set_grad_enabled(False):
        model(torch.zeros(1, 6))
    h.remove()
    assert seen == [False]


def test_hooks_removed_when_model_raises(run_cfg, npy):
    _, data = reuse_inputs(npy, n=4)
    with pytest.raises(RuntimeError, match="model exploded"):
        run_cfg(["+model._target_=tests.models.tracked", "+model.name=broken", "+model.cls=Broken",
                 *data[:1], "+hooks.a.kind=forward", "+hooks.a.layers=fc", "+hooks.b.kind=forward_pre",
                 "+hooks.b.layers=_model"])
    assert hook_count(BUILT["broken"]) == 0
