"""The bundled SAE (python -m hookrun.experiments.train_sae, on captures of conf/experiment/steer_source.yaml): its
captures run, its folder loads, and what it explains and finds, recomputed here from the captures with plain torch."""
import os

import pytest
import torch

import hookrun
from hookrun.experiments import moods, train_sae
from hookrun.methods.saes import load_saelens


@pytest.mark.slow
def test_train_sae_explains_the_residual_stream_and_finds_mood_features(tmp_path, capsys):
    run, out = tmp_path / "runs" / "sae_source", tmp_path / "runs" / "sae"
    result = train_sae.main(["--out", str(out), "--run", str(run)])
    printed = capsys.readouterr().out
    assert "fraction of variance explained" in printed and f"saved (SAELens format): {out}" in printed
    assert result["shipped"] and "3328 tokens of blocks.1: the shipped weights\n  (sae-moods-blocks.1-256-" in printed

    sae = load_saelens(out)
    assert (sae.architecture, sae.d_in, sae.d_sae, sae.hook_name) == ("standard", 64, 256, "blocks.1")
    for name, p in sae.named_parameters():
        assert torch.equal(p, dict(result["sae"].named_parameters())[name]), name

    cap = hookrun.open(run)
    x = torch.from_numpy(cap.load(layer="transformer.h.1", hook="resid")).double()
    assert x.shape == (3328, 64)   # 256 sentences of 13 tokens
    w = {n: p.detach().double() for n, p in sae.named_parameters()}
    f = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    x_hat = f @ w["W_dec"] + w["b_dec"]
    mse = (x - x_hat).pow(2).sum(1).mean()
    explained = 1 - mse / (x - x.mean(0)).pow(2).sum(1).mean()
    l0 = (f > 0).sum(1).double().mean()
    dead = int(((f > 0).sum(0) == 0).sum())
    ev = result["evaluation"]
    assert abs(ev["explained_variance"] - float(explained)) < 1e-5 and abs(ev["l0"] - float(l0)) < 1e-6
    assert abs(ev["mse"] - float(mse)) < 1e-4 and ev["dead_features"] == dead
    assert explained > 0.98 and l0 < 6   # the shipped SAE: 0.991 and 3.98 (seed 0, 50 epochs)

    # mood features: fire on 20+ tokens, (almost) all of them in sentences of one mood
    tokens = cap.tokens()
    happy_sample = tokens.groupby("sample")["token"].agg(lambda t: bool(set(t.str.strip()) & moods.HAPPY))
    happy = torch.tensor(happy_sample.loc[tokens["sample"]].to_numpy())
    on = f > 0
    count = on.sum(0)
    purity = (on & happy[:, None]).sum(0) / count.clamp(min=1)
    busy = count >= 20
    assert int((busy & (purity >= 0.95)).sum()) >= 2 and int((busy & (purity <= 0.05)).sum()) >= 2   # measured 3+ each

    # a complete capture run is reused, not run again
    stamp = os.stat(run / "captures.zarr" / "zarr.json").st_mtime_ns
    again = train_sae.main(["--out", str(tmp_path / "sae2"), "--run", str(run), "--epochs", "1"])
    assert os.stat(run / "captures.zarr" / "zarr.json").st_mtime_ns == stamp
    assert again["evaluation"]["tokens"] == 3328 and not again["shipped"]   # other settings train
    assert "trained in" in capsys.readouterr().out


def test_the_shipped_sae_is_what_sae_features_reads_checked_against_its_sha256(tmp_path, monkeypatch):
    from hookrun.experiments import sae_features, weights

    sae = sae_features.saved_sae()
    assert (sae.architecture, sae.d_in, sae.d_sae, sae.hook_name, sae.training) == ("standard", 64, 256, "blocks.1",
                                                                                    False)
    name = train_sae._name(*weights.defaults(train_sae.train)[1:])
    state = weights.load(name)
    for n, p in sae.named_parameters():
        assert torch.equal(p, state[n]), n
    assert sae_features.saved_sae(dtype="float64").W_dec.dtype == torch.float64
    damaged = tmp_path / "weights"
    damaged.mkdir()
    data = bytearray((weights.DIR / f"{name}.safetensors").read_bytes())
    data[-1] ^= 1
    (damaged / f"{name}.safetensors").write_bytes(bytes(data))
    (damaged / "SHA256SUMS").write_text(weights.SUMS.read_text())
    monkeypatch.setattr(weights, "DIR", damaged)
    monkeypatch.setattr(weights, "SUMS", damaged / "SHA256SUMS")
    with pytest.raises(weights.WeightsError, match="the file is damaged"):
        sae_features.saved_sae()
