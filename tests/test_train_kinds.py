"""The train block's kinds, losses and update against plain PyTorch written here and against SAELens's own
training SAEs (sae_lens 6.54: StandardTrainingSAE, TopKTrainingSAE, BatchTopKTrainingSAE, JumpReLUTrainingSAE),
and its folders read back by sae_lens.SAE.load_from_disk."""
from __future__ import annotations

import math

import pytest
import torch

from hookrun.methods.training.kinds import TrainingDictionary, geometric_median
from hookrun.methods.training.output import write_folder
from hookrun.methods.training.trainer import Schedule, Trainer

sae_lens = pytest.importorskip("sae_lens")


def _dictionary(kind, d_in=12, d_sae=40, k=4, **kw):
    torch.manual_seed(0)
    d = TrainingDictionary(d_in, d_sae, kind, k=k, **kw)
    with torch.no_grad():  # weights away from the init so every term is non-trivial
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
        if kind == "jumprelu":
            d.threshold.copy_(torch.rand(d_sae) * 0.2)
    return d


def _x(n=64, d=12, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


# -- plain-PyTorch losses, written out here ---------------------------------------------------------------------------

def plain_relu(W_enc, b_enc, W_dec, b_dec, x, coef):
    f = torch.relu((x - b_dec) @ W_enc + b_enc)
    out = f @ W_dec + b_dec
    mse = ((out - x) ** 2).sum(-1).mean()
    l1 = (coef * (f * W_dec.norm(dim=1)).abs().sum(-1)).mean()
    return mse + l1, mse, l1


def plain_topk(W_enc, b_enc, W_dec, b_dec, x, k, dead, batch=False, rescale=True):
    """TopK's (batch=True: BatchTopK's) loss, dense: every [tokens, d_sae] matrix formed."""
    norm = W_dec.norm(dim=1) if rescale else torch.ones(W_dec.shape[0], dtype=W_dec.dtype)
    pre = ((x - b_dec) @ W_enc + b_enc) * norm
    f = torch.zeros_like(pre)
    if batch:
        flat = pre.relu().flatten()
        keep = flat.topk(int(k * len(x))).indices
        f = torch.zeros_like(flat).scatter(0, keep, flat[keep]).reshape(pre.shape)
    else:
        v, i = pre.topk(k, dim=-1)
        f.scatter_(-1, i, v.relu())
    out = (f / norm) @ W_dec + b_dec
    mse = ((out - x) ** 2).sum(-1).mean()
    n_dead = int(dead.sum())
    if n_dead == 0:
        return mse, mse, mse.new_tensor(0.0)
    k_aux = min(x.shape[1] // 2, n_dead)
    scale = min(n_dead / (x.shape[1] // 2), 1.0)
    masked = pre.masked_fill(~dead, -float("inf"))
    v, i = masked.topk(k_aux, dim=-1)
    a = torch.zeros_like(pre).scatter(-1, i, v)
    e_hat = (a / norm) @ W_dec
    aux = scale * ((e_hat - (x - out).detach()) ** 2).sum(-1).mean()
    return mse + aux, mse, aux


@pytest.mark.parametrize("coef", [0.0, 0.7])
def test_relu_loss_is_saelens_standard_l1(coef):
    d, x = _dictionary("relu"), _x()
    out = d.losses(x, coefficient=coef)
    loss, mse, l1 = plain_relu(d.W_enc, d.b_enc, d.W_dec, d.b_dec, x, coef)
    torch.testing.assert_close(out["loss"], loss)
    torch.testing.assert_close(out["aux_loss"], l1)
    from sae_lens.saes.sae import TrainStepInput
    from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig
    ref = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=12, d_sae=40, l1_coefficient=coef))
    ref.load_state_dict(d.state_dict())
    got = ref.training_forward_pass(TrainStepInput(x, {"l1": coef}, None, 0, False))
    torch.testing.assert_close(out["loss"], got.loss)
    torch.testing.assert_close(out["mse_loss"], got.losses["mse_loss"])
    out["loss"].backward()
    got.loss.backward()
    for name, p in d.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, msg=name)


@pytest.mark.parametrize("n_dead", [0, 3, 30])
def test_topk_loss_and_auxk_match_plain_and_saelens(n_dead):
    d, x = _dictionary("topk"), _x()
    dead = torch.zeros(40, dtype=torch.bool)
    dead[torch.randperm(40, generator=torch.Generator().manual_seed(2))[:n_dead]] = True
    out = d.losses(x, dead=dead)
    loss, mse, aux = plain_topk(d.W_enc, d.b_enc, d.W_dec, d.b_dec, x, 4, dead)
    torch.testing.assert_close(out["loss"], loss)
    torch.testing.assert_close(out["aux_loss"], aux)
    assert (out["features"] != 0).sum(-1).le(4).all()
    from sae_lens.saes.sae import TrainStepInput
    from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig
    ref = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=12, d_sae=40, k=4))
    ref.load_state_dict(d.state_dict())
    got = ref.training_forward_pass(TrainStepInput(x, {}, dead, 0, False))
    torch.testing.assert_close(out["loss"], got.loss)
    out["loss"].backward()
    got.loss.backward()
    for name, p in d.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, msg=name)


@pytest.mark.parametrize("kind,n_dead,rescale", [("topk", 0, True), ("topk", 5, True), ("topk", 30, False),
                                                 ("batchtopk", 0, True), ("batchtopk", 7, True),
                                                 ("batchtopk", 7, False)])
def test_sparse_path_equals_the_dense_plain_pytorch_loss_gradients_and_steps(kind, n_dead, rescale):
    """The sparse top-k path (the default) against plain_topk, every matrix dense: the losses, the reconstruction,
    every parameter's gradient (AuxK's dead features included); then four Trainer steps (clipping, Adam, the
    counters, batchtopk's threshold) equal to the same dictionary on the dense path (sparse=False)."""
    d = _dictionary(kind, k=3, rescale_acts_by_decoder_norm=rescale, dtype=torch.float64)
    assert d.sparse
    x = _x().double()
    dead = torch.zeros(40, dtype=torch.bool)
    dead[torch.randperm(40, generator=torch.Generator().manual_seed(3))[:n_dead]] = True
    out = d.losses(x, dead=dead)
    assert "features" not in out and len(out["cols"]) == 3 * len(x)
    plain = {n: p.detach().clone().requires_grad_(True) for n, p in d.named_parameters()}
    loss, mse, aux = plain_topk(plain["W_enc"], plain["b_enc"], plain["W_dec"], plain["b_dec"], x, 3, dead,
                                batch=kind == "batchtopk", rescale=rescale)
    torch.testing.assert_close(out["loss"], loss)
    torch.testing.assert_close(out["mse_loss"], mse)
    torch.testing.assert_close(out["aux_loss"], aux)
    assert (float(aux.detach()) > 0) == (n_dead > 0)
    out["loss"].backward()
    loss.backward()
    for name, p in d.named_parameters():
        torch.testing.assert_close(p.grad, plain[name].grad, msg=name)
    dense = TrainingDictionary(12, 40, kind, k=3, rescale_acts_by_decoder_norm=rescale, sparse=False,
                               dtype=torch.float64)
    dense.load_state_dict(d.state_dict())
    d.zero_grad()
    trainers = [Trainer(m, Schedule(steps=4, lr=1e-2, dead_feature_window=1, clip_grad=0.5)) for m in (d, dense)]
    for step in range(4):   # 4 rows a step: features go dead, AuxK joins from step 3
        rows = [t.step(_x(n=4, seed=10 + step).double()) for t in trainers]
        assert rows[0].keys() == rows[1].keys()
        for key in rows[0]:
            assert rows[0][key] == pytest.approx(rows[1][key], rel=1e-9, abs=1e-12), key
    for name, p in dense.state_dict().items():
        torch.testing.assert_close(d.state_dict()[name], p, msg=name)
    for counter in ("since_fired", "fired"):
        assert torch.equal(getattr(trainers[0], counter), getattr(trainers[1], counter)), counter
    assert rows[0]["aux"] > 0   # dead features: AuxK took part


def test_batchtopk_keeps_k_per_row_on_average_and_its_threshold_as_saelens():
    d, x = _dictionary("batchtopk", k=3), _x()
    from sae_lens.saes.batchtopk_sae import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig
    from sae_lens.saes.sae import TrainStepInput
    ref = BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(d_in=12, d_sae=40, k=3))
    ref.load_state_dict(d.state_dict())
    out = d.losses(x, dead=torch.zeros(40, dtype=torch.bool))
    got = ref.training_forward_pass(TrainStepInput(x, {}, torch.zeros(40, dtype=torch.bool), 0, False))
    torch.testing.assert_close(out["loss"], got.loss)
    assert int((out["features"] != 0).sum()) == 3 * len(x)
    # plain: the 3 * 64 largest relu'd pre-activations of the batch (pre rescaled by the decoder norm)
    pre = ((x - d.b_dec) @ d.W_enc + d.b_enc) * d.W_dec.norm(dim=1)
    flat = pre.relu().flatten()
    keep = flat.topk(3 * len(x)).indices
    f = torch.zeros_like(flat).scatter(0, keep, flat[keep]).reshape(pre.shape)
    torch.testing.assert_close(out["features"], f)
    torch.testing.assert_close(d.topk_threshold, ref.topk_threshold)
    assert float(d.topk_threshold.detach()) == pytest.approx(0.01 * float(f[f > 0].min().detach()))


def test_jumprelu_loss_and_straight_through_threshold_gradient():
    d, x = _dictionary("jumprelu"), _x()
    out = d.losses(x, coefficient=0.5)
    pre = (x - d.b_dec) @ d.W_enc + d.b_enc
    th, bw = d.threshold, 0.05
    f = pre * (pre > th)
    recon = f @ d.W_dec + d.b_dec
    mse = ((recon - x) ** 2).sum(-1).mean()
    l0 = 0.5 * (pre > th).float().sum(-1).mean()
    torch.testing.assert_close(out["loss"], mse + l0)
    out["loss"].backward()
    # the threshold's gradient by hand: d/dth of mse through f (the rectangle kernel's -th/bw), and of the L0 term
    g_f = (2 * (recon - x) @ d.W_dec.T / len(x)).detach()
    window = ((pre - th).abs() < bw / 2).float().detach()
    g_th = (-(th / bw) * window * g_f).sum(0) + (-(1 / bw) * window * 0.5 / len(x)).sum(0)
    torch.testing.assert_close(d.threshold.grad, g_th.detach())
    from sae_lens.saes.jumprelu_sae import JumpReLUTrainingSAE, JumpReLUTrainingSAEConfig
    from sae_lens.saes.sae import TrainStepInput
    ref = JumpReLUTrainingSAE(JumpReLUTrainingSAEConfig(d_in=12, d_sae=40, l0_coefficient=0.5))
    ref.load_state_dict(d.state_dict())
    got = ref.training_forward_pass(TrainStepInput(x, {"l0": 0.5}, None, 0, False))
    torch.testing.assert_close(out["loss"], got.loss)
    got.loss.backward()
    for name, p in d.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, msg=name)


def test_transcoder_skip_reconstructs_the_output_site():
    d = _dictionary("relu", transcoder=True, skip=True)
    with torch.no_grad():
        d.W_skip.copy_(0.1 * torch.randn_like(d.W_skip))
    x, y = _x(), _x(seed=5)
    out = d.losses(x, y, coefficient=0.3)
    f = torch.relu(x @ d.W_enc + d.b_enc)   # a transcoder subtracts no b_dec from its input
    recon = f @ d.W_dec + d.b_dec + x @ d.W_skip.T
    mse = ((recon - y) ** 2).sum(-1).mean()
    torch.testing.assert_close(out["loss"], mse + (0.3 * (f * d.W_dec.norm(dim=1)).sum(-1)).mean())


def test_one_step_is_adam_with_clipping_and_schedules():
    sched = Schedule(steps=10, lr=1e-2, lr_warm_up_steps=4, coefficient=2.0, coefficient_warm_up_steps=5, clip_grad=0.5)
    d, x = _dictionary("relu"), _x()
    plain = {n: p.detach().clone().requires_grad_(True) for n, p in d.named_parameters()}
    opt = torch.optim.Adam(plain.values(), lr=1e-2 * 2 / 4)
    t = Trainer(d, sched)
    t.n = 1  # step 1: lr 1e-2 * 2 / 4, coefficient 2 * 1 / 5
    t.step(x)
    loss, _, _ = plain_relu(plain["W_enc"], plain["b_enc"], plain["W_dec"], plain["b_dec"], x, 2.0 * 1 / 5)
    loss.backward()
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in plain.values()))
    for p in plain.values():
        p.grad *= min(1.0, 0.5 / (float(total) + 1e-6))
    opt.step()
    for n, p in d.named_parameters():
        torch.testing.assert_close(p.detach(), plain[n].detach(), msg=n)


def test_schedules_are_saelens():
    from sae_lens.training.optim import CoefficientScheduler, get_lr_scheduler
    for name, w, dec, end in [("constant", 3, 0, None), ("constant", 0, 4, None), ("cosineannealing", 2, 3, 1e-4)]:
        sched = Schedule(steps=20, lr=1e-3, lr_warm_up_steps=w, lr_decay_steps=dec, lr_end=end, lr_scheduler=name)
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.Adam([p], lr=1e-3)
        ref = get_lr_scheduler(name, opt, 20, 1e-3, w, dec, sched.end(), 1)
        for s in range(20):
            assert sched.lr_at(s) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-15), (name, s)
            opt.step()
            ref.step()
    coef = CoefficientScheduler(5, 2.0)
    sched = Schedule(steps=9, coefficient=2.0, coefficient_warm_up_steps=5)
    for s in range(9):
        assert sched.coefficient_at(s) == pytest.approx(coef.value)
        coef.step()


def test_dead_features_counted_as_saelens():
    d = _dictionary("topk", k=2)
    t = Trainer(d, Schedule(steps=10, dead_feature_window=2, lr=0.0))
    x = _x(8)
    fired = set()
    for _ in range(4):
        out = t.step(x)
        fired |= set(torch.nonzero((d.losses(x)["features"] != 0).any(0)).flatten().tolist())
    never = torch.ones(40, dtype=torch.bool)
    never[list(fired)] = False
    assert torch.equal(t.dead(), never)  # lr 0: the same features fire each step; the others are 4 > 2 steps dead
    assert out["dead_fraction"] == pytest.approx(float(never.double().mean()))


def test_unit_decoder_stays_unit():
    d = _dictionary("topk")
    t = Trainer(d, Schedule(steps=5, lr=1e-2, decoder_norm="unit"))
    for _ in range(3):
        t.step(_x())
    torch.testing.assert_close(d.W_dec.norm(dim=1), torch.ones(40))


def test_geometric_median_against_weiszfeld_by_hand():
    x = torch.cat([torch.randn(50, 3), torch.full((5, 3), 100.0)])
    m = geometric_median(x, iterations=500, tolerance=1e-12)
    grad = ((m - x.double()) / (m - x.double()).norm(dim=-1, keepdim=True)).sum(0)
    assert float(grad.norm()) < 1e-4          # the sum of unit vectors to the points is zero at the median
    assert float(m.norm()) < 5 < float(x.mean(0).norm())


@pytest.mark.parametrize("kind,transcoder,skip", [("relu", False, False), ("topk", False, False),
                                                  ("batchtopk", False, False), ("jumprelu", False, False),
                                                  ("relu", True, True), ("jumprelu", True, False)])
def test_folder_read_by_saelens_gives_the_trained_map(tmp_path, kind, transcoder, skip):
    d = _dictionary(kind, transcoder=transcoder, skip=skip)
    t = Trainer(d, Schedule(steps=4, lr=1e-2), scale_in=2.5, scale_out=1.5 if transcoder else 2.5)
    x, y = _x(), _x(seed=3)
    for _ in range(3):
        t.step(x, y if transcoder else None)
    write_folder(t, tmp_path / "sae", hook_name="blocks.0", hook_name_out="blocks.0.mlp" if transcoder else None)
    sae = sae_lens.SAE.load_from_disk(str(tmp_path / "sae"))
    d.eval()
    with torch.no_grad():
        torch.testing.assert_close(sae(x), d(x * 2.5) / t.scale_out, atol=1e-5, rtol=1e-5)
    assert sae.cfg.metadata.hook_name == "blocks.0"
    if not transcoder:
        from hookrun.methods.saes import load_saelens
        mine = load_saelens(tmp_path / "sae")
        torch.testing.assert_close(mine(x), sae(x).detach(), atol=1e-5, rtol=1e-5)
