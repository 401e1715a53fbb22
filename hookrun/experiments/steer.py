"""steer: the two source runs, the coefficient sweep, and the completions per coefficient.

    python -m hookrun.experiments.steer [WORK_DIR]   # runs/steer_happy, runs/steer_sad, multirun/steer under it

Each step is the CLI command docs/generation.md#try-it shows, run in WORK_DIR (default: the current directory);
the source runs are skipped when their stores are complete."""
import subprocess
import sys
from pathlib import Path

import pandas as pd

import hookrun

SETS = {"steer_happy": "happy.txt", "steer_sad": "sad.txt"}
COEFS = "0,2,4,8"


def _cli(work: Path, *args) -> None:
    subprocess.run([sys.executable, "-m", "hookrun", *args], cwd=work, check=True)


def sweep(work: Path, coefs: str = COEFS) -> Path:
    """The source runs (when not complete yet), then the multirun over hooks.steer.edit.0.coef; its sweep dir."""
    for run, name in SETS.items():
        done = work / "runs" / run / "captures.zarr"
        if not done.exists() or hookrun.open(done).status != "complete":
            _cli(work, "+experiment=steer_source", f"data.text.files=[pkg://hookrun.experiments/data/{name}]",
                 f"hydra.run.dir=runs/{run}")
    out = work / "multirun" / "steer"
    _cli(work, "-m", "+experiment=steer", f"hooks.steer.edit.0.coef={coefs}", f"hydra.sweep.dir={out}")
    return out


def main(argv=None) -> pd.DataFrame:
    argv = sys.argv[1:] if argv is None else argv
    work = Path(argv[0] if argv else ".").resolve()
    work.mkdir(parents=True, exist_ok=True)
    df = hookrun.collect(sweep(work), generations=True)
    table = df.pivot(index="prompt", columns="hooks.steer.edit.0.coef", values="completion")
    with pd.option_context("display.max_colwidth", 40, "display.width", 200):
        print(table.to_string())
    return df


if __name__ == "__main__":
    main()
