"""The bundled SAE (python -m hookrun.experiments.train_sae, on captures of conf/experiment/steer_source.yaml): its
captures run, its folder loads, and what it explains and finds, recomputed here from the captures with plain torch."""
import os

import torch

import hookrun
from hookrun.experiments import moods, train_sae
from hookrun.methods.dictionaries import load_saelens


def test_train_sae_explains_the_residual_stream_and_finds_mood_features(tmp_path, capsys):
    run, out = tmp_path / "runs" / "sae_source", tmp_path / "runs" / "sae"
    result = train_sae.main(["--out", str(out), "--run", str(run)])
    printed = capsys.readouterr().out
    assert "fraction of variance explained" in printed and f"saved (SAELens format): {out}" in printed

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
    assert explained > 0.98 and l0 < 6   # measured: 0.991 and 3.84 (seed 0, 50 epochs)

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
    assert again["evaluation"]["tokens"] == 3328
