"""steer: the two source runs, the coefficient sweep, the completions per coefficient and how happy they are.

    python -m hookrun.experiments.steer [WORK_DIR]   # runs/steer_happy, runs/steer_sad, multirun/steer under it

Each step is the CLI command docs/generation.md#try-it shows, run in WORK_DIR (default: the current directory);
the source runs are skipped when their stores are complete. The sweep goes to multirun/steer, or on a later run to
the first of multirun/steer-2, -3, ... that does not exist (nothing already there is replaced). Per coefficient it
prints the fraction of completion words that are happy words (moods.HAPPY), sad words (moods.SAD), and the fraction
of completions that are still sentences of the language (moods.grammatical)."""
import itertools
import sys
from pathlib import Path

import pandas as pd

import hookrun
from hookrun.experiments import moods
from hookrun.experiments._cli import hookrun_cli

SETS = {"steer_happy": "happy.txt", "steer_sad": "sad.txt"}
COEFS = "-8,-4,0,4,8"
COEF = "hooks.steer.edit.0.coef"
BOS = "<|endoftext|>"  # the prompt column's first token


def sweep(work: Path, coefs: str = COEFS) -> Path:
    """The source runs (when not complete yet), then the multirun over hooks.steer.edit.0.coef into a sweep dir that
    did not exist (free_dir); that dir."""
    for run, name in SETS.items():
        done = work / "runs" / run / "captures.zarr"
        if not done.exists() or hookrun.open(done).status != "complete":
            hookrun_cli("+experiment=steer_source", f"data.text.files=[pkg://hookrun.experiments/data/{name}]",
                        f"hydra.run.dir=runs/{run}", cwd=work)
    out = free_dir(work / "multirun" / "steer")
    hookrun_cli("-m", "+experiment=steer", f"{COEF}={coefs}", f"hydra.sweep.dir={out}", cwd=work)
    return out


def free_dir(path: Path) -> Path:
    """`path`, else the first of path-2, path-3, ... that does not exist: a new sweep never mixes with an earlier
    one's jobs, and nothing there (a sweep of yours) is deleted."""
    tries = itertools.chain([path], (path.with_name(f"{path.name}-{n}") for n in itertools.count(2)))
    return next(p for p in tries if not p.exists())


def moods_per_coef(df: pd.DataFrame) -> pd.DataFrame:
    """Per coefficient (the index): `happy` and `sad`, the fractions of all completion words in moods.HAPPY and
    moods.SAD; `grammatical`, the fraction of completions that finish a sentence of the language."""
    def measure(group):
        words = [w for text in group["completion"] for w in moods.words(text)]
        return pd.Series({"happy": sum(w in moods.HAPPY for w in words) / len(words),
                          "sad": sum(w in moods.SAD for w in words) / len(words),
                          "grammatical": group["completion"].map(moods.grammatical).mean()})
    return df.groupby(COEF)[["completion"]].apply(measure)


def main(argv=None) -> pd.DataFrame:
    argv = sys.argv[1:] if argv is None else argv
    work = Path(argv[0] if argv else ".").resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = sweep(work)
    df = hookrun.collect(out, generations=True)
    for coef, group in df.sort_values([COEF, "sample"]).groupby(COEF, sort=True):
        print(f"coef {coef:g}:")
        for prompt, completion in zip(group["prompt"], group["completion"]):
            print(f"  {prompt.replace(BOS, ''):<14} ->{completion}")
    print("\nper coef: the fraction of completion words that are happy / sad, of completions still grammatical")
    print(moods_per_coef(df).round(2).to_string())
    print(f"\nthe sweep: {out}")
    return df


if __name__ == "__main__":
    main()
