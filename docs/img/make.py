"""The pictures of the docs site: runs the bundled experiments into a work dir and draws them into docs/img/.

    python docs/img/make.py [WORK_DIR]   # default: a temporary dir; runs already complete in WORK_DIR are kept

Each picture is what `python -m hookrun.plot` (or hookrun.plot's functions) draws for a user's run of the same
experiment; the pages that explain them (docs/patching.md, docs/generation.md, docs/tutorials/vision.md) show them.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

import hookrun
from hookrun import plot
from hookrun.experiments import moods, steer

IMG = Path(__file__).resolve().parent


def run(work: Path, name: str, *args: str) -> Path:
    """`python -m hookrun ARGS` into WORK/name (skipped when a complete store is there); the run (or sweep) dir."""
    out = work / name
    multirun = args and args[0] == "-m"
    done = list(out.rglob("captures.zarr")) if multirun else [out / "captures.zarr"]
    if not done or not all(p.exists() and hookrun.open(p).status == "complete" for p in done):
        where = f"hydra.sweep.dir={out}" if multirun else f"hydra.run.dir={out}"
        subprocess.run([sys.executable, "-m", "hookrun", *args, where], cwd=work, check=True)
    return out


def save(fig, name: str) -> None:
    fig.savefig(IMG / name, dpi=90)
    print(IMG / name)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    work = Path(argv[0] if argv else tempfile.mkdtemp(prefix="hookrun-docs-img-")).resolve()
    work.mkdir(parents=True, exist_ok=True)

    heads = hookrun.open(run(work, "ablate_heads", "+experiment=ablate_heads"))
    save(plot.patching_grid(heads), "ablate_heads.png")
    grid = hookrun.open(run(work, "patching_grid", "+experiment=patching_grid"))
    save(plot.patching_grid(grid), "patching_grid.png")
    save(plot.patching_grid(grid, value="normalised"), "patching_grid_normalised.png")

    conv = hookrun.open(run(work, "conv_fmaps", "+experiment=conv_fmaps"))
    save(plot.feature_maps(conv, layer="conv1"), "conv_fmaps_conv1.png")
    save(plot.batch_stats(conv), "conv_fmaps_stats.png")
    layers = run(work, "conv_layers", "-m", "+experiment=conv_fmaps", "layers=conv1,pool1")
    save(plot.compare(layers, layer="conv1", role="output"), "conv_fmaps_compare.png")

    existing = sorted((work / "multirun").glob("steer*"))
    sweep = existing[-1] if existing and len(list(existing[-1].rglob("captures.zarr"))) == 5 else steer.sweep(work)
    frame = hookrun.collect(sweep, generations=True)
    save(plot.steering(frame, words={"happy": moods.HAPPY, "sad": moods.SAD}), "steer_sweep.png")
    coef4 = frame[frame[steer.COEF] == 4]["run_dir"].iloc[0]
    save(plot.completions(hookrun.open(coef4)), "steer_completions.png")
    print(f"runs: {work}")


if __name__ == "__main__":
    main()
