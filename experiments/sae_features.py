"""sae_features: the bundled SAE's features in a run: mood features and their top contexts, SAELens's evaluations,
and one happy and one sad feature steered while generating.

    python -m hookrun.experiments.sae_features RUN_DIR [--no-steer]   # RUN_DIR: a run of +experiment=sae_features

From the run's stored features (cap.read("dictionaries", "features", ...)): per feature, how many tokens it fires on
and the fraction of them in happy sentences (moods.HAPPY words); the strongest happy-only and sad-only features with
their top contexts (cap.top(feature=F)); the evaluations table (cap.read("dictionaries")). Then a sweep of the mood
model continuing the 8 steer prompts ("The party", "The exam", ...) greedily with `op: feature, add: C` on each of
the two features at every decoding step (`python -m hookrun -m +experiment=sae_features ...`, one process): the
completions, and the fraction of their words that are happy / sad, per feature and coefficient.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

import hookrun
from hookrun.experiments import moods, weights
from hookrun.experiments._cli import hookrun_cli

HOOK, DICTIONARY, LAYER = "feats", "mood", "blocks.1"
BOS = "<|endoftext|>"
COEFS, SHOWN = (0, 4, 8, 16), 8   # the steering coefficients swept, and the one whose completions are printed


SHIPPED = "sae-moods-blocks.1-256-standard-l1coef1-epochs50-batch256-lr0.003-seed0"   # +experiment=train_sae's SAE


def saved_sae(path: Optional[str] = None, dtype: Optional[str] = None):
    """The SAE in a SAELens folder (`+experiment=train_sae` writes one), loaded by hookrun's own loader (in `dtype`,
    else cfg.json's); `path` None: the shipped SAE (bundled()), no training."""
    from hookrun.methods.saes import load_saelens

    return bundled(dtype) if path is None else load_saelens(path, dtype=dtype)


def bundled(dtype: Optional[str] = None):
    """The shipped SAE (experiments/weights/SHIPPED.safetensors, sha256 checked: `+experiment=train_sae`'s at its
    settings), in `dtype` (a name of hookrun.methods.saes.DTYPES) if given: what +experiment=sae_features reads as
    `mood`, no captures needed."""
    from hookrun.methods.saes import DTYPES, DictionaryError, SparseAutoencoder

    state = weights.load(SHIPPED, weights.vocab_digest(moods.tokenizer()))
    if state is None:
        raise weights.WeightsError(f"{weights.DIR / SHIPPED}.safetensors is missing: reinstall hookrun, or write it "
                                   "with `python -m hookrun.experiments.weights`")
    if dtype is not None and dtype not in DTYPES:
        raise DictionaryError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    sae = SparseAutoencoder(state["W_enc"].shape[0], state["W_enc"].shape[1], "standard", hook_name=LAYER)
    sae.load_state_dict(state)
    sae.eval()
    return sae if dtype is None else sae.to(DTYPES[dtype])


def write_weights() -> Path:
    """Run `+experiment=sae_source` then `+experiment=train_sae` in a temporary folder and write the shipped file
    from the SAELens folder it trained (python -m hookrun.experiments.weights, after the mood model's)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        paths = [f"++vars.sae_source={tmp}/sae_source", f"++vars.sae={tmp}/sae"]
        hookrun.run("sae_source", paths, quiet=True)
        hookrun.run("train_sae", [*paths, f"store.path={tmp}/train/captures.zarr"], quiet=True)
        state = load_file(f"{tmp}/sae/sae_weights.safetensors")
    return weights.save(SHIPPED, state, weights.vocab_digest(moods.tokenizer()))


def mood_table(cap, min_tokens: int = 20) -> pd.DataFrame:
    """Per feature firing on `min_tokens`+ tokens: tokens, happy (the fraction of them in happy sentences), mean."""
    d_sae = cap.attrs["dictionaries"][HOOK]["d_sae"]
    acts = cap.read("dictionaries", "features", hook=HOOK, features=range(d_sae))
    tokens = cap.tokens()
    happy_sample = tokens.groupby("sample")["token"].agg(lambda t: bool(set(t.str.strip()) & moods.HAPPY))
    happy = happy_sample.loc[tokens["sample"]].to_numpy()
    on = acts > 0
    count = on.sum(0)
    keep = np.flatnonzero(count >= min_tokens)
    table = pd.DataFrame({"feature": keep, "tokens": count[keep], "happy": (on[:, keep] & happy[:, None]).sum(0) /
                          count[keep], "mean": acts[:, keep].sum(0) / count[keep], "max": acts[:, keep].max(0)})
    return table.sort_values(["tokens", "feature"], ascending=[False, True]).reset_index(drop=True)


def steer(cap, features: dict, coefs, work: Path) -> pd.DataFrame:
    """The sweep: the steer prompts generated with `add: C` on each feature (features: label -> feature), in one
    `python -m hookrun -m` process, into work/steer; its generations with columns feature and coef. The run's
    dictionary path, relative as the command line gave it, resolves against the current directory."""
    spec = dict(cap.config["dictionaries"][DICTIONARY])
    if spec.get("path") and "://" not in str(spec["path"]):
        spec["path"] = str(Path(spec["path"]).resolve())
    edit = "{op: feature, dictionary: mood, feature: 0, add: 0.0, positions: generated}"
    out = work / "steer"
    given = ", ".join(f"{k}: {'null' if v is None else repr(v) if isinstance(v, str) else v}" for k, v in spec.items())
    args = ["-m", "+experiment=sae_features", f"dictionaries.{DICTIONARY}={{{given}}}",
            "data.text.files=[pkg://hookrun.experiments/data/steer_prompts.txt]", "data.batch_size=8",
            "generate.max_new_tokens=12", f"hooks.{HOOK}=null",
            f"+hooks.steer={{kind: forward, layers: [{LAYER}], capture: [], edit: [{edit}]}}",
            f"hooks.steer.edit.0.feature={','.join(str(f) for f in features.values())}",
            f"hooks.steer.edit.0.add={','.join(f'{c:g}' for c in coefs)}", f"hydra.sweep.dir={out}"]
    hookrun_cli(*args)
    return steered(out, features)


def steered(sweep: Path, features: dict) -> pd.DataFrame:
    """The sweep's generations (steer's, in `sweep`) with columns feature (its label) and coef."""
    df = hookrun.collect(sweep, generations=True)
    label = {f: name for name, f in features.items()}
    return df.assign(feature=df["hooks.steer.edit.0.feature"].map(label), coef=df["hooks.steer.edit.0.add"])


def strongest(table: pd.DataFrame) -> dict:
    """{"happy": row, "sad": row} of mood_table: the happy-only (>= 0.95) and sad-only (<= 0.05) features with the
    largest mean activation where on."""
    ranked = table.sort_values("mean", ascending=False, kind="stable")
    return {"happy": ranked[ranked["happy"] >= 0.95].iloc[0], "sad": ranked[ranked["happy"] <= 0.05].iloc[0]}


def mood_words(df: pd.DataFrame) -> pd.DataFrame:
    """Per feature and coef: the fractions of completion words that are happy and sad words."""
    def measure(group):
        words = [w for text in group["completion"] for w in moods.words(text)]
        return pd.Series({"happy": sum(w in moods.HAPPY for w in words) / max(len(words), 1),
                          "sad": sum(w in moods.SAD for w in words) / max(len(words), 1)})
    return df.groupby(["feature", "coef"])[["completion"]].apply(measure)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    paths = [a for a in argv if not a.startswith("--")]
    if len(paths) != 1:
        sys.exit("usage: python -m hookrun.experiments.sae_features RUN_DIR [--no-steer]")
    cap = hookrun.open(paths[0])
    meta = cap.attrs["dictionaries"][HOOK]
    print(f"dictionary {meta['dictionary']}: {meta['d_in']} -> {meta['d_sae']} features on {LAYER}, "
          f"{len(cap.tokens())} tokens stored sparse ({meta['width']} a token)")
    ev = cap.read("dictionaries").iloc[0]
    print(f"evaluations: L0 {ev['l0']:.2f}  variance explained {ev['explained_variance']:.4f}  MSE {ev['mse']:.4f}  "
          f"dead {ev['dead_features']}  CE clean {ev['ce_clean']:.4f} spliced {ev['ce_spliced']:.4f} zero "
          f"{ev['ce_zero']:.4f}  CE loss recovered {ev['ce_loss_recovered']:.4f}")
    table = mood_table(cap)
    picked = strongest(table)
    print(f"\n{len(table)} features fire on 20+ tokens; the strongest happy-only and sad-only ones (largest mean "
          "activation where on), top contexts:")
    for name, row in picked.items():
        print(f"  {name} feature {int(row['feature'])}: {int(row['tokens'])} tokens, happy {row['happy']:.2f}")
        for ctx in cap.top(feature=int(row["feature"]), hook=HOOK, k=3, context=4).itertuples():
            print(f"      {ctx.value:.2f} {ctx.context.replace(BOS, '')}")
    result = {"evaluations": ev, "features": table, "picked": picked}
    if "--no-steer" not in argv:
        features = {name: int(row["feature"]) for name, row in picked.items()}
        df = steer(cap, features, COEFS, Path(paths[0]).resolve())
        print("\nsteered while generating: C x the feature's decoder row added at every decoding step")
        for (name, coef), group in df.sort_values("sample").groupby(["feature", "coef"], sort=True):
            if coef == SHOWN:
                print(f"  {name} feature, C = {coef:g}:")
                for prompt, completion in zip(group["prompt"], group["completion"]):
                    print(f"    {prompt.replace(BOS, ''):<14} ->{completion}")
        words = mood_words(df)
        print("\nthe fraction of completion words that are happy / sad, per feature and C")
        print(words.round(2).to_string())
        result.update(steered=df, words=words)
    return result


if __name__ == "__main__":
    main()
