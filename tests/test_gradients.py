"""Every gradient kind against torch.autograd.grad on the same model, loss and batches."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hookrun.capture.hooks import HookError, hook_count
from tests.models import BUILT

N, BS = 10, 4


def data(npy, shape, classes):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, *shape)).astype("float32")
    y = rng.integers(0, classes, N)
    return x, y, [f"+data.inputs.x={{file: '{npy('x', x)}'}}", f"+data.inputs.label={{file: '{npy('y', y)}'}}",
                  "data.targets=[label]", f"data.batch_size={BS}", "loss=cross_entropy"]


def reference(model, x, y, layers, params):
    """Per batch: dL/d(layer outputs), dL/d(layer inputs), dL/d(params), dL/dx, computed by autograd."""
    modules = dict(model.named_modules())
    per_batch = []
    for s in range(0, N, BS):
        xb = torch.from_numpy(x[s:s + BS]).requires_grad_(True)
        seen = {}
        handles = [modules[n].register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, (i[0], o)))
                   for n in layers]
        loss = F.cross_entropy(model(xb), torch.from_numpy(y[s:s + BS]).long())
        for h in handles:
            h.remove()
        outs = [seen[n][1] for n in layers]
        ins = [seen[n][0] for n in layers]
        wanted = outs + ins + [dict(model.named_parameters())[p] for p in params] + [xb]
        grads = torch.autograd.grad(loss, wanted)
        k = len(layers)
        per_batch.append(dict(out=grads[:k], inp=grads[k:2 * k], param=grads[2 * k:-1], x=grads[-1]))
    return per_batch


@pytest.mark.parametrize("model,shape,classes,layers,params", [
    ("MLP", (6,), 3, ["fc1", "fc2"], ["fc1.weight", "fc2.weight", "head.bias"]),
    ("CNN", (3, 6, 6), 5, ["conv1", "conv2"], ["conv1.weight", "conv2.bias", "fc.weight"]),
])
def test_gradient_kinds_equal_autograd(run_cfg, npy, model, shape, classes, layers, params):
    x, y, d = data(npy, shape, classes)
    lay = f"[{','.join(layers)}]"
    cap = run_cfg(["+model._target_=tests.models.tracked", f"+model.name={model}", f"+model.cls={model}", *d,
                   "+hooks.og.kind=output_grad", f"+hooks.og.layers={lay}",
                   "+hooks.bw.kind=backward", f"+hooks.bw.layers={lay}",
                   "+hooks.bp.kind=backward_pre", f"+hooks.bp.layers={lay}",
                   "+hooks.pg.kind=param_grad", f"+hooks.pg.layers=[{','.join(params)}]",
                   "+hooks.ig.kind=input_grad"])
    net = BUILT[model]
    assert hook_count(net) == 0
    ref = reference(net, x, y, layers, params)
    for b, r in enumerate(ref):
        rows = slice(b * BS, min((b + 1) * BS, N))
        for i, layer in enumerate(layers):
            for hook, role, want in (("og", "grad", r["out"][i]), ("bw", "grad_output.0", r["out"][i]),
                                     ("bp", "grad_output.0", r["out"][i]), ("bw", "grad_input.0", r["inp"][i])):
                got = cap.load(hook=hook, layer=layer, role=role)[rows]
                np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-7, err_msg=f"{hook} {layer} {role}")
        for i, p in enumerate(params):
            got = cap.load(hook="pg", layer=p, role="grad")[b]  # one record per batch
            np.testing.assert_allclose(got, r["param"][i].numpy(), rtol=1e-5, atol=1e-7, err_msg=p)
        np.testing.assert_allclose(cap.load(hook="ig", role="grad.0")[rows], r["x"].numpy(), rtol=1e-5, atol=1e-7)
    # gradient rows line up with their batch: same batch, sample_start as forward rows would have
    pg = cap.rows(hook="pg", layer=params[0])
    assert pg.batch.tolist() == [0, 1, 2] and pg.sample_start.tolist() == [0, 4, 8]
    assert pg.per_sample.tolist() == [False] * 3
    with torch.no_grad():
        np.testing.assert_allclose(
            cap.batches.loss, [float(F.cross_entropy(net(torch.from_numpy(x[s:s + BS])), torch.from_numpy(y[s:s + BS])))
                               for s in range(0, N, BS)], rtol=1e-5)


def test_reused_module_backward_calls_match_forward_calls(run_cfg, npy):
    x = np.random.default_rng(2).standard_normal((4, 4)).astype("float32")
    cap = run_cfg(["+model._target_=tests.models.tracked", "+model.name=reuse", "+model.cls=Reuse",
                   f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=4",
                   "loss=sum", "loss.output=h",
                   "+hooks.og.kind=output_grad", "+hooks.og.layers=shared",
                   "+hooks.bw.kind=backward", "+hooks.bw.layers=shared", "+hooks.bw.capture=[grad_output]"])
    net = BUILT["reuse"]
    xb = torch.from_numpy(x)
    outs = []
    h = net.shared.register_forward_hook(lambda m, i, o: outs.append(o))
    loss = net(xb)["h"].sum()
    h.remove()
    g0, g1 = torch.autograd.grad(loss, outs)
    for hook, role in (("og", "grad"), ("bw", "grad_output.0")):
        np.testing.assert_allclose(cap.load(hook=hook, role=role, call=0), g0.numpy(), rtol=1e-5)
        np.testing.assert_allclose(cap.load(hook=hook, role=role, call=1), g1.numpy(), rtol=1e-5)


def test_inplace_relu_breaks_backward_hook_with_a_clear_error_and_output_grad_works(run_cfg, npy):
    x, y, d = data(npy, (3, 6, 6), 5)
    model = ["+model._target_=tests.models.tracked", "+model.name=inplace", "+model.cls=CNN", "+model.inplace=true"]
    with pytest.raises(HookError) as err:
        run_cfg([*model, *d, "+hooks.bw.kind=backward", "+hooks.bw.layers=conv1"], name="bad")
    assert "hooks.bw (conv1)" in str(err.value) and "kind: output_grad" in str(err.value)
    assert hook_count(BUILT["inplace"]) == 0
    cap = run_cfg([*model, *d, "+hooks.og.kind=output_grad", "+hooks.og.layers=conv1"], name="good")
    net = BUILT["inplace"]
    net.relu1.inplace = net.relu2.inplace = False  # the reference needs conv1's output before the ReLU
    outs = []
    h = net.conv1.register_forward_hook(lambda m, i, o: outs.append(o))
    loss = F.cross_entropy(net(torch.from_numpy(x[:BS])), torch.from_numpy(y[:BS]))
    h.remove()
    (want,) = torch.autograd.grad(loss, outs)
    np.testing.assert_allclose(cap.load(role="grad")[:BS], want.numpy(), rtol=1e-5, atol=1e-7)


def test_hooks_removed_after_failing_backward(run_cfg, npy):
    x, y, d = data(npy, (6,), 3)
    with pytest.raises(RuntimeError, match="backward exploded"):
        run_cfg(["+model._target_=tests.models.tracked", "+model.name=boom", "+model.cls=MLP",
                 *[o for o in d if not o.startswith("loss")], "+loss._target_=tests.models.boom_loss",
                 "+hooks.og.kind=output_grad", "+hooks.og.layers=fc1", "+hooks.pg.kind=param_grad",
                 "+hooks.pg.layers='*.weight'", "+hooks.bw.kind=backward", "+hooks.bw.layers=fc2"])
    assert hook_count(BUILT["boom"]) == 0


@pytest.mark.parametrize("loss,fn", [
    (["loss=mean"], lambda out: out.mean()),
    (["+loss.name=index", "+loss.index=2"], lambda out: out[:, 2].sum()),
    (["+loss.name=index", "+loss.index=[1,0]"], lambda out: out[1, 0]),
    (["+loss._target_=tests.models.first_logit_sum"], lambda out: out[:, 0].sum() * 3),
])
def test_losses_and_saliency_equal_autograd(run_cfg, npy, loss, fn):
    x = np.random.default_rng(9).standard_normal((N, 6)).astype("float32")
    cap = run_cfg(["+model._target_=tests.models.tracked", "+model.name=mlp", "+model.cls=MLP",
                   f"+data.inputs.x={{file: '{npy('x', x)}'}}", f"data.batch_size={BS}", *loss,
                   "+hooks.sal.kind=input_grad"])
    net = BUILT["mlp"]
    for b, s in enumerate(range(0, N, BS)):
        xb = torch.from_numpy(x[s:s + BS]).requires_grad_(True)
        value = fn(net(xb))
        (grad,) = torch.autograd.grad(value, [xb])
        assert cap.batches.loss[b] == pytest.approx(float(value.detach()), rel=1e-5)
        np.testing.assert_allclose(cap.load(role="grad.0")[s:s + BS], grad.numpy(), rtol=1e-5, atol=1e-7)
