"""train_sae: the bundled sparse autoencoder, trained on the mood model's residual stream, saved for SAELens.

    python -m hookrun.experiments.train_sae [--out runs/sae] [--run runs/sae_source] [--epochs 50] ...

1. The captures: the steer experiment's source run on the 256 sentences of the mood language (its tokenizer's
   corpus) instead of 8, `python -m hookrun +experiment=steer_source data.text.files=[...moods.txt]
   data.batch_size=64 hydra.run.dir=RUN`: the mood model's block 1 output per token, 3,328 rows of 64;
   skipped when RUN's store is complete.
2. The SAE: at the default settings the shipped weights (experiments/weights/sae-moods-...safetensors, sha256
   checked: hookrun.experiments.weights; `python -m hookrun.experiments.weights` retrains and rewrites them), so
   every CPU evaluates the same SAE. Other settings train on CPU (one thread, a few seconds): minibatches from `hookrun.open(RUN).loader(...)`, a fresh shuffle an
   epoch; a ReLU SAE with SAELens's standard loss (squared error summed over d_in plus l1 * sum |f| |W_dec row|)
   or a TopK one (--architecture topk --k 4), 4 x d_model features, b_dec started at the mean activation.
3. Its evaluation as SAELens reports it (L0, fraction of variance explained, MSE, dead features), printed;
   the SAE saved in the SAELens format (hookrun.methods.saes.save_saelens: cfg.json, sae_weights.safetensors;
   metadata.hook_name = the layer), which `sae_lens.SAE.load_from_disk(OUT)` reads too.
4. Its most mood-selective features (firing on tokens of happy sentences only, or of sad ones only), each with
   its top contexts: the SAE finds the mood the steer experiment adds as a direction.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import pandas as pd
import torch

import hookrun
from hookrun.experiments import moods, weights
from hookrun.experiments._cli import hookrun_cli
from hookrun.methods.saes import Evaluation, SparseAutoencoder, save_saelens

LAYER, HOOK = "blocks.1", "resid"   # steer_source's block (its standard site name) and hook
CAPTURE = ["+experiment=steer_source", "data.text.files=[pkg://hookrun.experiments/data/moods.txt]",
           "data.batch_size=64"]   # the 256 sentences, 64 a forward pass


def capture(run: Path) -> "hookrun.Captures":
    """The CAPTURE run's captures in `run` (a run dir), run first unless its store is complete."""
    store = run / "captures.zarr"
    if not store.exists() or hookrun.open(store).status != "complete":
        run.parent.mkdir(parents=True, exist_ok=True)
        hookrun_cli(*CAPTURE, f"hydra.run.dir={run}")
    return hookrun.open(run)


def train(cap, architecture: str = "standard", d_sae: int = 256, l1: float = 1.0, k: int = 4, epochs: int = 50,
          batch_size: int = 256, lr: float = 3e-3, seed: int = 0) -> SparseAutoencoder:
    """An SAE trained on the captures' LAYER rows: `epochs` passes of shuffled minibatches (cap.loader, a new
    order an epoch), Adam, on one thread (tiny matrices: more threads only spin); the same weights every call."""
    total, n = 0.0, 0
    for rows in cap.loader(layer=LAYER, hook=HOOK, batch_size=4096, shuffle=False):
        total, n = total + rows.double().sum(0), n + len(rows)
    torch.manual_seed(seed)
    sae = SparseAutoencoder(len(total), d_sae, architecture, k=k if architecture == "topk" else None,
                            hook_name=LAYER)
    with torch.no_grad():
        sae.b_dec.copy_(total / n)   # SAELens's b_dec_init_method="mean"
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for epoch in range(epochs):
            for x in cap.loader(layer=LAYER, hook=HOOK, batch_size=batch_size, seed=seed, epoch=epoch):
                features = sae.encode(x)
                loss = (sae.decode(features) - x).pow(2).sum(-1).mean()
                if architecture != "topk":
                    loss = loss + l1 * (features * sae.W_dec.norm(dim=-1)).sum(-1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return sae.eval()


def _name(architecture: str, d_sae: int, l1: float, k: int, epochs: int, batch_size: int, lr: float,
          seed: int) -> str:
    shape = f"topk-k{k}" if architecture == "topk" else f"{architecture}-l1coef{l1:g}"
    return f"sae-moods-{LAYER}-{d_sae}-{shape}-epochs{epochs}-batch{batch_size}-lr{lr:g}-seed{seed}"


def _with_state(state: dict, architecture: str, d_sae: int, k: int) -> SparseAutoencoder:
    sae = SparseAutoencoder(state["W_enc"].shape[0], d_sae, architecture, k=k if architecture == "topk" else None,
                            hook_name=LAYER)
    sae.load_state_dict(state)
    return sae.eval()


def trained(cap, *settings) -> Tuple[SparseAutoencoder, bool]:
    """(the SAE at these settings (train's, after cap), whether it is the shipped file's): the shipped weights
    (checked against SHA256SUMS and the mood tokenizer they were trained with) where hookrun ships them, else
    train(cap, *settings)."""
    architecture, d_sae, _, k = settings[:4]
    state = weights.load(_name(*settings), weights.vocab_digest(moods.tokenizer()))
    return (train(cap, *settings), False) if state is None else (_with_state(state, architecture, d_sae, k), True)


def bundled(dtype: Optional[str] = None) -> SparseAutoencoder:
    """The shipped SAE (train's defaults), in `dtype` (a name of hookrun.methods.dictionaries.DTYPES) if given: what
    +experiment=sae_features reads as `mood`, no captures needed."""
    from hookrun.methods.saes import DTYPES, DictionaryError

    settings = weights.defaults(train)[1:]
    state = weights.load(_name(*settings), weights.vocab_digest(moods.tokenizer()))
    if state is None:
        raise weights.WeightsError(f"{weights.DIR / _name(*settings)}.safetensors is missing: reinstall hookrun, or "
                                   "write it with `python -m hookrun.experiments.weights`")
    if dtype is not None and dtype not in DTYPES:
        raise DictionaryError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    sae = _with_state(state, settings[0], settings[1], settings[3])
    return sae if dtype is None else sae.to(DTYPES[dtype])


def write_weights() -> Path:
    """Train at the default settings on a fresh capture (in a temporary folder) and write the shipped file
    (python -m hookrun.experiments.weights, after the mood model's)."""
    import tempfile

    settings = weights.defaults(train)[1:]
    with tempfile.TemporaryDirectory() as tmp:
        sae = train(capture(Path(tmp) / "run"), *settings)
    state = {n: p.detach() for n, p in sae.named_parameters()}
    return weights.save(_name(*settings), state, weights.vocab_digest(moods.tokenizer()))


def evaluate(cap, sae) -> dict:
    """Evaluation's numbers (SAELens's) over every stored row, in order."""
    ev = Evaluation(sae.d_sae)
    with torch.no_grad():
        for x in cap.loader(layer=LAYER, hook=HOOK, batch_size=4096, shuffle=False):
            features = sae.encode(x)
            ev.add(x, sae.decode(features), features)
    return ev.result()


def mood_features(cap, sae, min_tokens: int = 20) -> pd.DataFrame:
    """Per feature that fires on at least `min_tokens` tokens: `tokens` (how many), `happy` (the fraction of them
    in happy sentences: those with a moods.HAPPY word), `mean` (its mean activation where on); by tokens."""
    tokens = cap.tokens()
    happy_sample = tokens.groupby("sample")["token"].agg(lambda t: bool(set(t.str.strip()) & moods.HAPPY))
    happy = happy_sample.loc[tokens["sample"]].to_numpy()
    with torch.no_grad():
        f = sae.encode(torch.from_numpy(cap.load(layer=LAYER, hook=HOOK))).numpy()
    on = f > 0
    count = on.sum(0)
    keep = np.flatnonzero(count >= min_tokens)
    table = pd.DataFrame({"feature": keep, "tokens": count[keep],
                          "happy": (on[:, keep] & happy[:, None]).sum(0) / count[keep],
                          "mean": f[:, keep].sum(0) / count[keep]})
    return table.sort_values(["tokens", "feature"], ascending=[False, True]).reset_index(drop=True)


def contexts(cap, sae, feature: int, k: int = 3) -> list:
    """The k distinct contexts where `feature` is largest, each as its sentence up to the token, which is in
    [brackets], after the activation."""
    tokens = cap.tokens()
    with torch.no_grad():
        acts = sae.encode(torch.from_numpy(cap.load(layer=LAYER, hook=HOOK)))[:, feature].numpy()
    out = {}
    for row in np.argsort(-acts, kind="stable"):
        sample, pos = tokens.at[row, "sample"], tokens.at[row, "position"]
        words = tokens[(tokens["sample"] == sample) & (tokens["position"] <= pos)]["token"].str.strip().tolist()
        words = [w for w in words if w != "<|endoftext|>"]
        out.setdefault(f"{' '.join(words[:-1])} [{words[-1]}]", acts[row])   # the same sentence again: skipped
        if len(out) == k:
            break
    return [f"{act:.2f} {text}" for text, act in out.items()]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hookrun.experiments.train_sae", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/sae", help="the SAE's folder (SAELens format; default runs/sae)")
    p.add_argument("--run", default="runs/sae_source",
                   help="the captures' run dir, run there first unless complete (default runs/sae_source)")
    p.add_argument("--architecture", choices=["standard", "topk"], default="standard",
                   help="standard: ReLU with an L1 penalty; topk: the k largest (default standard)")
    p.add_argument("--d-sae", type=int, default=256, help="features (default 256: 4 x d_model)")
    p.add_argument("--l1", type=float, default=1.0, help="standard's L1 coefficient (default 1.0)")
    p.add_argument("--k", type=int, default=4, help="topk's k (default 4)")
    p.add_argument("--epochs", type=int, default=50, help="passes over the captures (default 50)")
    p.add_argument("--seed", type=int, default=0, help="the SAE's initialisation and shuffle (default 0)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Captures, training, evaluation, the saved folder and the mood features, printed; a dict of them."""
    args = parse(argv)
    cap = capture(Path(args.run).resolve())
    start = time.perf_counter()
    settings = (args.architecture, args.d_sae, args.l1, args.k, args.epochs, *weights.defaults(train)[6:8], args.seed)
    sae, shipped = trained(cap, *settings)
    seconds = time.perf_counter() - start
    numbers = evaluate(cap, sae)
    out = save_saelens(sae, args.out, hook_name=LAYER,
                       metadata={"model_name": "hookrun.experiments.moods.trained_lm", "hookrun_run": str(args.run)})
    how = (f"the shipped weights\n  ({_name(*settings)}; other settings train)" if shipped else
           f"trained in {seconds:.1f} s ({args.epochs} epochs)")
    print(f"SAE {args.architecture} {sae.d_in} -> {sae.d_sae} on {numbers['tokens']} tokens of {LAYER}: {how}")
    print(f"L0 {numbers['l0']:.2f}  fraction of variance explained {numbers['explained_variance']:.4f}  "
          f"MSE {numbers['mse']:.4f}  dead features {numbers['dead_features']} of {sae.d_sae}")
    table = mood_features(cap, sae)
    picked = pd.concat([table[table["happy"] >= 0.95].head(3), table[table["happy"] <= 0.05].head(3)])
    print(f"\nmood features: {len(picked)} of the {len(table)} that fire on 20+ tokens (happy: the fraction of their "
          "tokens in happy sentences); top contexts")
    for f in picked.itertuples():
        print(f"  feature {f.feature}: {f.tokens} tokens, happy {f.happy:.2f}")
        for line in contexts(cap, sae, int(f.feature)):
            print(f"      {line}")
    print(f"\nsaved (SAELens format): {out}")
    return {"sae": sae, "shipped": shipped, "evaluation": numbers, "features": table, "path": out, "seconds": seconds}


if __name__ == "__main__":
    main()
