"""Every edit op changes the downstream result exactly as the same hand-written hook does."""
import numpy as np
import pytest
import torch

from hookrun.config.checks import ConfigError
from hookrun.capture.edits import noise_seed
from hookrun.capture.site import Site
from tests.models import BUILT

N, BS = 6, 3


@pytest.fixture
def mlp(npy):
    x = np.random.default_rng(3).standard_normal((N, 6)).astype("float32")
    base = ["+model._target_=tests.models.tracked", "+model.name=mlp", "+model.cls=MLP",
            f"+data.inputs.x={{file: '{npy('x', x)}'}}", f"data.batch_size={BS}",
            "+hooks.out.kind=forward", "+hooks.out.layers=_model"]
    return x, base


def hand_forward(model, x, fn):
    """The model output with a hand-written forward hook on fc1 returning fn(output)."""
    h = model.fc1.register_forward_hook(lambda m, i, o: fn(o))
    with torch.no_grad():
        out = torch.cat([model(torch.from_numpy(x[s:s + BS])) for s in range(0, N, BS)])
    h.remove()
    return out.numpy()


def gen(seed):
    return torch.Generator().manual_seed(seed)


BATCH = {"i": 0}  # the batch hand_forward is on


def noise_fn(o):
    site = Site("acts", "fc1", "output", 0, BATCH["i"], BATCH["i"] * BS, (BATCH["i"] + 1) * BS)
    BATCH["i"] += 1
    return o + 0.5 * torch.randn(o.shape, generator=gen(noise_seed(7, site)))


CASES = {
    "{op:scale,value:3}": lambda o: o * 3,
    "{op:add,value:-1.5}": lambda o: o - 1.5,
    "{op:zero}": lambda o: torch.zeros_like(o),
    "{op:zero,dim:1,index:[0,2,5]}": lambda o: o * torch.tensor([0, 1, 0, 1, 1, 0, 1, 1.0]),
    "{op:zero,dim:1,index:{start:4}}": lambda o: o * torch.tensor([1, 1, 1, 1, 0, 0, 0, 0.0]),
    "{op:clamp,min:-0.1,max:0.2}": lambda o: o.clamp(-0.1, 0.2),
    "{op:noise,std:0.5,seed:7}": noise_fn,
    "{op:replace,value:0.25}": lambda o: torch.full_like(o, 0.25),
    "{_target_:tests.models.double,factor:-2}": lambda o: o * -2,
}


@pytest.mark.parametrize("edit", list(CASES))
def test_forward_edit_matches_hand_written_hook(run_cfg, mlp, edit):
    x, base = mlp
    cap = run_cfg([*base, "+hooks.acts.kind=forward", "+hooks.acts.layers=fc1", f"+hooks.acts.edit=[{edit}]"])
    BATCH["i"] = 0
    want = hand_forward(BUILT["mlp"], x, CASES[edit])
    np.testing.assert_allclose(cap.load(hook="out", role="output"), want, rtol=1e-6, atol=1e-7)
    # the capture records the value after the edit
    BATCH["i"] = 0
    with torch.no_grad():
        fc1 = torch.cat([CASES[edit](BUILT["mlp"].fc1(torch.from_numpy(x[s:s + BS]))) for s in range(0, N, BS)])
    np.testing.assert_allclose(cap.load(hook="acts", role="output"), fc1.numpy(), rtol=1e-6, atol=1e-7)


def test_noise_is_seeded_per_batch(run_cfg, mlp):
    x, base = mlp
    runs = [run_cfg([*base, "+hooks.acts.kind=forward", "+hooks.acts.layers=fc1",
                     f"+hooks.acts.edit=[{{op:noise,std:1,seed:{seed}}}]"], name=f"n{i}")
            for i, seed in enumerate((3, 3, 4))]
    a, b, c = (r.load(hook="acts", role="output") for r in runs)
    np.testing.assert_array_equal(a, b)  # same seed, same noise
    assert not np.allclose(a, c)  # another seed, other noise
    with torch.no_grad():
        clean = BUILT["mlp"].fc1(torch.from_numpy(x)).numpy()
    assert not np.allclose(a[:BS] - clean[:BS], a[BS:] - clean[BS:])  # each batch draws its own


def test_replace_from_file_and_edits_in_order(run_cfg, mlp, npy):
    x, base = mlp
    value = np.linspace(-1, 1, 8, dtype="float32")
    f = npy("v", value)
    cap = run_cfg([*base, "+hooks.acts.kind=forward", "+hooks.acts.layers=fc1",
                   f"+hooks.acts.edit=[{{op:replace,file:'{f}'}},{{op:scale,value:2}}]"])
    want = hand_forward(BUILT["mlp"], x, lambda o: torch.from_numpy(value).expand_as(o) * 2)
    np.testing.assert_allclose(cap.load(hook="out", role="output"), want, rtol=1e-6)


def test_forward_pre_edit_changes_the_input(run_cfg, mlp):
    x, base = mlp
    cap = run_cfg([*base, "+hooks.pre.kind=forward_pre", "+hooks.pre.layers=fc2", "+hooks.pre.edit=[{op:scale,value:0}]"])
    model = BUILT["mlp"]
    with torch.no_grad():
        want = model.head(torch.tanh(model.fc2.bias)).expand(N, -1)
    np.testing.assert_allclose(cap.load(hook="out", role="output"), want.numpy(), rtol=1e-6)
    assert (cap.load(hook="pre", role="input.0") == 0).all()


def grad_run(run_cfg, base, hook):
    return run_cfg([*[b for b in base if "hooks.out" not in b], "loss=sum", *hook])


def hand_grads(model, x, register):
    """Parameter grads of the summed output over the first batch, with a hand-written hook."""
    model.zero_grad()
    handle = register(model)
    model(torch.from_numpy(x[N - BS:])).sum().backward()
    handle.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_output_grad_edit_matches_tensor_hook(run_cfg, mlp):
    x, base = mlp
    cap = grad_run(run_cfg, base, ["+hooks.g.kind=output_grad", "+hooks.g.layers=fc2", "+hooks.g.edit=[{op:scale,value:3}]",
                                   "+hooks.p.kind=param_grad", "+hooks.p.layers=fc1.weight"])
    model = BUILT["mlp"]
    hs = []

    def register(m):
        return m.fc2.register_forward_hook(lambda mod, i, o: hs.append(o.register_hook(lambda g: g * 3)))

    want = hand_grads(model, x, register)
    np.testing.assert_allclose(cap.load(hook="p", role="grad")[-1], want["fc1.weight"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(model.fc1.weight.grad.numpy(), want["fc1.weight"].numpy(), rtol=1e-5)


def test_backward_edit_changes_grad_input(run_cfg, mlp):
    x, base = mlp
    cap = grad_run(run_cfg, base, ["+hooks.b.kind=backward", "+hooks.b.layers=fc2", "+hooks.b.edit=[{op:clamp,max:0}]",
                                   "+hooks.p.kind=param_grad", "+hooks.p.layers=fc1.weight"])
    want = hand_grads(BUILT["mlp"], x, lambda m: m.fc2.register_full_backward_hook(
        lambda mod, gi, go: (gi[0].clamp(max=0),)))
    np.testing.assert_allclose(cap.load(hook="p", role="grad")[-1], want["fc1.weight"].numpy(), rtol=1e-5)
    assert (cap.load(hook="b", role="grad_input.0") <= 0).all()


def test_backward_pre_edit_changes_grad_output(run_cfg, mlp):
    x, base = mlp
    cap = grad_run(run_cfg, base, ["+hooks.b.kind=backward_pre", "+hooks.b.layers=fc2", "+hooks.b.edit=[{op:add,value:1}]",
                                   "+hooks.p.kind=param_grad", "+hooks.p.layers=fc2.bias"])
    want = hand_grads(BUILT["mlp"], x, lambda m: m.fc2.register_full_backward_pre_hook(lambda mod, go: (go[0] + 1,)))
    np.testing.assert_allclose(cap.load(hook="p", role="grad")[-1], want["fc2.bias"].numpy(), rtol=1e-5)


def test_param_grad_edit_sets_param_grad(run_cfg, mlp):
    x, base = mlp
    cap = grad_run(run_cfg, base, ["+hooks.p.kind=param_grad", "+hooks.p.layers='fc*.weight'",
                                   "+hooks.p.edit=[{op:zero}]", "+hooks.q.kind=param_grad", "+hooks.q.layers=head.weight"])
    model = BUILT["mlp"]
    assert (model.fc1.weight.grad == 0).all() and (model.fc2.weight.grad == 0).all()
    assert (cap.load(hook="p", layer="fc1.weight", role="grad") == 0).all()
    want = hand_grads(model, x, lambda m: m.fc1.weight.register_hook(lambda g: g))
    np.testing.assert_allclose(cap.load(hook="q", role="grad")[-1], want["head.weight"].numpy(), rtol=1e-5)


def test_activation_patching_from_another_run(run_cfg, npy):
    xa = np.random.default_rng(4).standard_normal((N, 6)).astype("float32")
    xb = np.random.default_rng(5).standard_normal((N, 6)).astype("float32")
    common = ["+model._target_=tests.models.MLP", f"data.batch_size={BS}", "seed=11",
              "+hooks.out.kind=forward", "+hooks.out.layers=_model"]
    a = run_cfg([*common, f"+data.inputs.x={{file: '{npy('xa', xa)}'}}", "+hooks.acts.kind=forward",
                 "+hooks.acts.layers=fc1"], name="a")
    b = run_cfg([*common, f"+data.inputs.x={{file: '{npy('xb', xb)}'}}", "+hooks.patch.kind=forward",
                 "+hooks.patch.layers=fc1", f"+hooks.patch.edit=[{{op:replace,store:'{a.path}',hook:acts}}]"], name="b")
    np.testing.assert_array_equal(b.load(hook="out", role="output"), a.load(hook="out", role="output"))
    c = run_cfg([*common, f"+data.inputs.x={{file: '{npy('xb', xb)}'}}"], name="c")
    assert not np.allclose(c.load(hook="out", role="output"), a.load(hook="out", role="output"))


def test_bad_edits_are_reported_together(run_cfg, mlp):
    _, base = mlp
    with pytest.raises(ConfigError) as err:
        run_cfg([*base, "+hooks.a.kind=forward", "+hooks.a.layers=fc1",
                 "+hooks.a.edit=[{op:scal,value:2},{op:clamp},{op:add},{_target_:nowhere.fn}]"])
    text = str(err.value)
    assert "hooks.a.edit[0].op: 'scal' is unknown" in text and "did you mean: scale" in text
    assert "hooks.a.edit[1]: op clamp needs min, max or both" in text
    assert "hooks.a.edit[2]: op add needs 'value'" in text
    assert "hooks.a.edit[3]._target_: 'nowhere.fn' does not import" in text
