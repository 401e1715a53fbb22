"""hookrun.methods.dictionaries: SAE maths against loops written here, the SAELens folder round trip and its
refusals, sparse features, and the evaluation numbers against hand computation (and against sae_lens itself
where it is installed)."""
import json
import math

import numpy as np
import pytest
import torch

from hookrun.methods.dictionaries import dims

from hookrun.methods.saes import DictionaryError, Evaluation, SparseAutoencoder, densify, evaluate, load_dictionary, load_saelens, save_saelens, sparse_nonzero, sparse_topk
from hookrun.read.results import dictionaries as stored

D_IN, D_SAE = 5, 12


def random_sae(arch, dtype=torch.float64, seed=0, **kw):
    """An SAE whose every parameter is random (biases and threshold too), so each term of the maths counts."""
    if arch == "topk":
        kw.setdefault("k", 4)
    sae = SparseAutoencoder(D_IN, D_SAE, arch, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        if arch == "jumprelu":
            sae.threshold.abs_()   # thresholds >= 0 as trained ones are: some features above zero stay off
    return sae


def by_hand_encode(sae, x):
    """Features of each row of x from loops over the weights (SAELens's maths, spelled out)."""
    W_enc, b_enc, b_dec = sae.W_enc.detach(), sae.b_enc.detach(), sae.b_dec.detach()
    norms = [math.sqrt(sum(float(v) ** 2 for v in row)) for row in sae.W_dec.detach()]
    out = torch.zeros(x.shape[0], sae.d_sae, dtype=torch.float64)
    for r in range(x.shape[0]):
        sae_in = [float(x[r, i]) - (float(b_dec[i]) if sae.apply_b_dec_to_input else 0.0) for i in range(sae.d_in)]
        pre = [sum(sae_in[i] * float(W_enc[i, j]) for i in range(sae.d_in)) + float(b_enc[j])
               for j in range(sae.d_sae)]
        for j in range(sae.d_sae):
            if sae.architecture == "standard":
                out[r, j] = max(pre[j], 0.0)
            elif sae.architecture == "jumprelu":
                out[r, j] = pre[j] if pre[j] > float(sae.threshold.detach()[j]) and pre[j] > 0 else 0.0
        if sae.architecture == "topk":
            scaled = [pre[j] * norms[j] if sae.rescale_acts_by_decoder_norm else pre[j] for j in range(sae.d_sae)]
            for j in sorted(range(sae.d_sae), key=lambda j: -scaled[j])[:sae.k]:
                out[r, j] = max(scaled[j], 0.0)
    return out


def by_hand_decode(sae, f):
    W_dec, b_dec = sae.W_dec.detach(), sae.b_dec.detach()
    norms = [math.sqrt(sum(float(v) ** 2 for v in row)) for row in W_dec]
    out = torch.zeros(f.shape[0], sae.d_in, dtype=torch.float64)
    for r in range(f.shape[0]):
        for i in range(sae.d_in):
            acc = float(b_dec[i])
            for j in range(sae.d_sae):
                fj = float(f[r, j]) / norms[j] if sae.rescale_acts_by_decoder_norm else float(f[r, j])
                acc += fj * float(W_dec[j, i])
            out[r, i] = acc
    return out


CASES = [("standard", {}), ("standard", {"apply_b_dec_to_input": False}), ("topk", {}), ("topk", {"k": 1}),
         ("topk", {"k": D_SAE}),   # every feature kept: the relu of negative pre-activations counts
         ("topk", {"rescale_acts_by_decoder_norm": True}), ("jumprelu", {})]


@pytest.mark.parametrize("arch,kw", CASES)
def test_encode_decode_equal_the_maths_by_hand(arch, kw):
    sae = random_sae(arch, **kw)
    x = torch.randn(7, D_IN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    f = sae.encode(x)
    want = by_hand_encode(sae, x)
    torch.testing.assert_close(f, want, rtol=1e-12, atol=1e-12)
    assert 0 < int((f != 0).sum()) < f.numel()   # some on, some off: the activation was exercised
    if arch == "topk":
        assert ((f != 0).sum(-1) <= sae.k).all()
    torch.testing.assert_close(sae.decode(f), by_hand_decode(sae, want), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sae(x), by_hand_decode(sae, want), rtol=1e-12, atol=1e-12)
    assert sae.encode(x.reshape(7, 1, D_IN)).shape == (7, 1, D_SAE)   # leading dims kept


def test_jumprelu_threshold_is_strict():
    """A pre-activation equal to its threshold is off (SAELens: pre > threshold), just above it is on."""
    sae = random_sae("jumprelu")
    x = sae.b_dec.detach().clone()[None]   # sae_in = 0, so pre = b_enc
    with torch.no_grad():
        sae.b_enc.copy_(torch.linspace(0.5, 2.0, D_SAE, dtype=torch.float64))
        sae.threshold.copy_(sae.b_enc)
        sae.threshold[::2] -= 1e-9
    f = sae.encode(x)[0]
    assert f[::2].tolist() == sae.b_enc[::2].tolist() and f[1::2].eq(0).all()


@pytest.mark.parametrize("arch,kw", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_bitwise(tmp_path, arch, kw, dtype):
    sae = random_sae(arch, dtype=dtype, **kw)
    save_saelens(sae, tmp_path / "sae", hook_name="transformer.h.1", metadata={"model_name": "moods"})
    back = load_saelens(tmp_path / "sae")
    assert (back.architecture, back.k, back.d_in, back.d_sae, back.hook_name) == \
           (arch, sae.k, D_IN, D_SAE, "transformer.h.1")
    assert back.apply_b_dec_to_input == sae.apply_b_dec_to_input
    assert back.rescale_acts_by_decoder_norm == sae.rescale_acts_by_decoder_norm
    mine, theirs = dict(sae.named_parameters()), dict(back.named_parameters())
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert theirs[name].dtype == dtype and torch.equal(mine[name], theirs[name]), name
    x = torch.randn(6, D_IN).to(dtype)
    assert torch.equal(sae.encode(x), back.encode(x)) and torch.equal(sae(x), back(x))
    assert not back.training


def test_cfg_json_is_saelens_6_54s(tmp_path):
    save_saelens(random_sae("topk", dtype=torch.float32, k=3), tmp_path, hook_name="blocks.0.hook_resid_post")
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert list(cfg) == ["d_in", "d_sae", "dtype", "device", "apply_b_dec_to_input", "normalize_activations",
                         "reshape_activations", "metadata", "k", "rescale_acts_by_decoder_norm", "architecture"]
    assert cfg == {"d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
                   "normalize_activations": "none", "reshape_activations": "none",
                   "metadata": {"sae_lens_version": "6.54.0", "sae_lens_training_version": "6.54.0",
                                "hook_name": "blocks.0.hook_resid_post"},
                   "k": 3, "rescale_acts_by_decoder_norm": False, "architecture": "topk"}
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "sae_weights.safetensors")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        "W_enc": (D_IN, D_SAE), "W_dec": (D_SAE, D_IN), "b_enc": (D_SAE,), "b_dec": (D_IN,)}


def edit_cfg(path, **changes):
    cfg = json.loads((path / "cfg.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    (path / "cfg.json").write_text(json.dumps(cfg))


def refused(path, *parts):
    with pytest.raises(DictionaryError) as err:
        load_saelens(path)
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    for part in parts:
        assert part in message, message
    return message


def test_refusals_name_the_path_the_problem_and_the_fix(tmp_path):
    refused(tmp_path / "nowhere", str(tmp_path / "nowhere"), "does not exist", "cfg.json")
    (tmp_path / "file.txt").write_text("x")
    refused(tmp_path / "file.txt", "file.txt", "is not a folder", "give the folder")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "empty", "has no cfg.json", "save_saelens")

    sae = tmp_path / "sae"
    save_saelens(random_sae("standard", dtype=torch.float32), sae)
    (sae / "sae_weights.safetensors").rename(tmp_path / "w")
    refused(sae, "has no sae_weights.safetensors", "save_model")
    (tmp_path / "w").rename(sae / "sae_weights.safetensors")
    assert load_saelens(sae).d_sae == D_SAE

    edit_cfg(sae, d_in=D_IN + 1)
    refused(sae, "sae_weights.safetensors", "do not match", "W_enc (5, 12) (want (6, 12))", "correct d_in / d_sae")
    edit_cfg(sae, d_in=None)
    refused(sae, "cfg.json", "has no key 'd_in'", "add it")
    edit_cfg(sae, d_in="5")
    refused(sae, "d_in='5' is not a positive int")
    edit_cfg(sae, d_in=D_IN, architecture="gated")
    refused(sae, "cfg.json", "architecture='gated' is not one of 'standard', 'topk', 'jumprelu'")
    edit_cfg(sae, architecture="topk")
    refused(sae, "cfg.json", "has no key 'k'")
    edit_cfg(sae, architecture="topk", k=D_SAE + 1)
    refused(sae, "cfg.json", "needs k, an int in 1..d_sae (12)")
    edit_cfg(sae, architecture="jumprelu", k=None)
    refused(sae, "tensors missing threshold", "for architecture 'jumprelu'")
    edit_cfg(sae, architecture="standard", normalize_activations="layer_norm")
    refused(sae, "normalize_activations='layer_norm'", "only 'none'", "fold")
    edit_cfg(sae, normalize_activations="none", dtype="int8")
    refused(sae, "dtype='int8'")
    (sae / "cfg.json").write_text("{not json")
    refused(sae, "cfg.json", "is not JSON")
    (sae / "cfg.json").write_text("[]")
    refused(sae, "holds a list")
    edit_ok = tmp_path / "ok"
    save_saelens(random_sae("standard", dtype=torch.float32), edit_ok)
    (edit_ok / "sae_weights.safetensors").write_bytes(b"garbage")
    refused(edit_ok, "is not a readable safetensors file")


def test_load_dictionary_specs(tmp_path):
    save_saelens(random_sae("jumprelu", dtype=torch.float32), tmp_path / "sae")
    for spec in ({"path": str(tmp_path / "sae")}, str(tmp_path / "sae"), tmp_path / "sae"):
        assert isinstance(load_dictionary(spec), SparseAutoencoder)
    assert load_dictionary({"path": str(tmp_path / "sae"), "dtype": "float64"}).W_enc.dtype == torch.float64
    from omegaconf import OmegaConf
    built = load_dictionary(OmegaConf.create({"_target_": "hookrun.methods.saes.SparseAutoencoder",
                                              "d_in": 3, "d_sae": 7, "architecture": "topk", "k": 2}))
    assert dims(built) == (3, 7) and built.k == 2 and not built.training
    with pytest.raises(DictionaryError, match=r"torch.nn.Linear: a Linear has no callable encode\(\)"):
        load_dictionary({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2})
    with pytest.raises(DictionaryError, match=r"nowhere.Thing: building it failed .*check the dotted path"):
        load_dictionary({"_target_": "nowhere.Thing"})
    with pytest.raises(DictionaryError, match="names neither a path nor a _target_"):
        load_dictionary({"dtype": "float32"})
    with pytest.raises(DictionaryError, match=r"b: building it failed"):   # beside _target_, path is its argument
        load_dictionary({"path": "a", "_target_": "b"})
    with pytest.raises(DictionaryError, match="unknown key"):
        load_dictionary({"path": str(tmp_path / "sae"), "k": 3})

    class Wrapped:   # a SAELens-like object: sizes on its cfg
        cfg = type("Cfg", (), {"d_in": 4, "d_sae": 9})()
    assert dims(Wrapped()) == (4, 9)
    assert dims(object()) == (None, None)


def test_sparse_topk_and_densify_against_loops():
    f = torch.tensor([[0.0, 3.0, 0.0, 1.0, 2.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0],
                      [5.0, 0.0, 0.0, 0.0, 0.0],
                      [-4.0, 1.0, 0.5, 0.25, 2.0]])
    idx, val = sparse_topk(f, 3)
    assert idx.dtype == torch.int32 and val.dtype == torch.float32
    assert idx.tolist() == [[1, 4, 3], [-1, -1, -1], [0, -1, -1], [0, 4, 1]]
    assert val.tolist() == [[3.0, 2.0, 1.0], [0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [-4.0, 2.0, 1.0]]
    idx7, val7 = sparse_topk(f, 7)   # wider than d_sae: padded
    assert idx7.shape == (4, 7) and idx7[:, 5:].eq(-1).all()
    assert torch.equal(densify(idx7, val7, 5), f)
    nz_idx, nz_val = sparse_nonzero(f)
    assert nz_idx.shape == (4, 5) and torch.equal(densify(nz_idx, nz_val, 5), f)
    with pytest.raises(ValueError, match="more than width 2"):
        sparse_nonzero(f, width=2)
    assert sparse_nonzero(torch.zeros(3, 5))[0].tolist() == [[-1], [-1], [-1]]
    assert densify(idx, val, 5, features=[4, 0]).tolist() == [[2.0, 0.0], [0.0, 0.0], [0.0, 5.0], [2.0, -4.0]]
    with pytest.raises(ValueError, match="out of range for d_sae=3"):
        densify(idx, val, 3)
    with pytest.raises(ValueError, match=r"features \[9\] must be in 0..4"):
        densify(idx, val, 5, features=[9])
    # the readers' numpy densify (no torch) gives the same numbers, all features or some, with the same refusals
    assert np.array_equal(stored.densify(idx7.numpy(), val7.numpy(), 5), f.numpy())
    assert stored.densify(idx.numpy(), val.numpy(), 5, features=[4, 0]).tolist() == \
        [[2.0, 0.0], [0.0, 0.0], [0.0, 5.0], [2.0, -4.0]]
    assert stored.densify(idx.numpy(), val.numpy(), 5).dtype == np.float32
    with pytest.raises(ValueError, match="out of range for d_sae=3"):
        stored.densify(idx.numpy(), val.numpy(), 3)
    with pytest.raises(ValueError, match=r"features \[9\] must be in 0..4"):
        stored.densify(idx.numpy(), val.numpy(), 5, features=[9])


def test_sparse_topk_of_nonnegative_features_equals_the_magnitude_order():
    """A ReLU SAE's features are never negative: their top k by value (no abs, no gather) equals the top k by
    magnitude, ids -1 and values 0 where fewer than k fire, padded past d_sae."""
    g = torch.Generator().manual_seed(5)
    f = torch.relu(torch.randn(40, 24, generator=g) - 0.8)
    f[3] = 0.0  # nothing fires
    f[4, :] = 0.0
    f[4, 7] = 2.0  # one fires
    for k in (1, 5, 30):
        want_idx, want_val = sparse_topk(f, k)
        idx, val = sparse_topk(f, k, nonnegative=True)
        assert idx.dtype == torch.int32 and val.dtype == torch.float32
        assert torch.equal(idx, want_idx) and torch.equal(val, want_val)
        assert torch.equal(densify(idx, val, 24), torch.where(f >= f.topk(min(k, 24), 1).values[:, -1:], f, 0.0))
    assert sparse_topk(f, 3, nonnegative=True)[0][3].tolist() == [-1, -1, -1]
    assert sparse_topk(f, 3, nonnegative=True)[0][4].tolist() == [7, -1, -1]


def test_evaluation_numbers_against_hand_computation():
    g = torch.Generator().manual_seed(3)
    sae = random_sae("standard", dtype=torch.float32)
    batches = [torch.randn(n, D_IN, generator=g) + 2.0 for n in (9, 4)]   # a mean offset: Var(x) is not E|x|^2
    ev, ev_sparse = Evaluation(D_SAE), Evaluation(D_SAE)
    for x in batches:
        ev.add(x, sae(x), sae.encode(x))
        ev_sparse.add(x, sae(x), sparse_nonzero(sae.encode(x)))
    got, got_sparse = ev.result(), ev_sparse.result()

    rows = [r for x in batches for r in x.double().tolist()]
    recon = [r for x in batches for r in sae(x).double().tolist()]
    feats = [r for x in batches for r in sae.encode(x).double().tolist()]
    n = len(rows)
    l0 = sum(sum(v != 0 for v in f) for f in feats) / n
    l1 = sum(sum(abs(v) for v in f) for f in feats) / n
    mse = sum(sum((a - b) ** 2 for a, b in zip(x, y)) for x, y in zip(rows, recon)) / n
    mean = [sum(r[i] for r in rows) / n for i in range(D_IN)]
    variance = sum(sum((r[i] - mean[i]) ** 2 for i in range(D_IN)) for r in rows) / n
    cos = sum(sum(a * b for a, b in zip(x, y)) / math.sqrt(sum(a * a for a in x) * sum(b * b for b in y))
              for x, y in zip(rows, recon)) / n
    fired = [sum(f[j] != 0 for f in feats) for j in range(D_SAE)]
    assert got["tokens"] == n == 13
    for key, want in (("l0", l0), ("l1", l1), ("mse", mse), ("explained_variance", 1 - mse / variance),
                      ("cossim", cos)):
        assert got[key] == pytest.approx(want, rel=1e-9), key
        assert got_sparse[key] == pytest.approx(want, rel=1e-6), key
    assert got["feature_density"].tolist() == pytest.approx([c / n for c in fired])
    assert got["dead_features"] == got_sparse["dead_features"] == sum(c == 0 for c in fired)
    assert torch.equal(got["feature_density"], got_sparse["feature_density"])
    assert 0 < got["dead_features"] < D_SAE   # some fired, some never did: the count was exercised

    # a dictionary that reconstructs perfectly explains everything; all-zero features are all dead
    x = batches[0]
    perfect = evaluate(x, x.clone(), torch.zeros(len(x), D_SAE))
    assert perfect["explained_variance"] == 1.0 and perfect["mse"] == 0.0 and perfect["dead_features"] == D_SAE
    mean_only = evaluate(x, x.mean(0).expand_as(x), torch.zeros(len(x), D_SAE))
    assert mean_only["explained_variance"] == pytest.approx(0.0, abs=1e-6)   # the mean explains no variance
    assert math.isnan(Evaluation(3).result()["l0"])


def test_ce_loss_recovered():
    assert stored.ce_loss_recovered(2.0, 2.5, 6.0) == pytest.approx(3.5 / 4.0)
    assert stored.ce_loss_recovered(torch.tensor(2.0), torch.tensor(2.0), torch.tensor(6.0)) == 1.0
    assert stored.ce_loss_recovered(2.0, 6.0, 6.0) == 0.0
    assert math.isnan(stored.ce_loss_recovered(2.0, 3.0, 2.0))


@pytest.mark.parametrize("arch,kw", CASES)
def test_sae_lens_reads_our_folder_and_we_read_its(tmp_path, arch, kw):
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is not installed: pip install -e '.[saelens]' "
                                   "(its own extra: it pins transformer-lens < 4)")
    import warnings

    ours = random_sae(arch, dtype=torch.float32, **kw)
    save_saelens(ours, tmp_path / "ours", hook_name="blocks.0.hook_resid_post")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = sae_lens.SAE.load_from_disk(str(tmp_path / "ours"))
    assert type(theirs).__name__ == {"standard": "StandardSAE", "topk": "TopKSAE", "jumprelu": "JumpReLUSAE"}[arch]
    assert theirs.cfg.metadata.hook_name == "blocks.0.hook_resid_post"
    x = torch.randn(16, D_IN, generator=torch.Generator().manual_seed(2)) * 2
    with torch.no_grad():
        f = ours.encode(x)
        torch.testing.assert_close(theirs.encode(x), f, rtol=0, atol=1e-6)
        torch.testing.assert_close(theirs.decode(f), ours.decode(f), rtol=0, atol=1e-6)
        torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=1e-6)
    theirs.save_model(str(tmp_path / "theirs"))   # and their folder loads here, bitwise the same weights
    back = load_saelens(tmp_path / "theirs")
    for name, p in ours.named_parameters():
        assert torch.equal(dict(back.named_parameters())[name], p), name
