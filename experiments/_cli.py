"""Shared argument handling of the analysis scripts: `python -m hookrun.experiments.NAME RUN_DIR`, and their
child `python -m hookrun` processes (hookrun_cli)."""
import shlex
import subprocess
import sys

import numpy as np
import pandas as pd

import hookrun
from hookrun.read.plots import grid_ticks


def open_run(argv=None):
    """The captures of the run dir (or .zarr) given on the command line."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit(f"usage: python -m {sys.modules['__main__'].__spec__.name} RUN_DIR  (a run dir or its captures.zarr)")
    np.set_printoptions(precision=4, suppress=True)
    return hookrun.open(argv[0])


def grid_table(cap, grid, values):
    """The mean over samples as a DataFrame: a row a layer, a column a position (or head) with its token."""
    table = pd.DataFrame(np.nanmean(values, axis=0).astype(float), index=pd.Index(grid.layers, name="layer"),
                         columns=pd.Index(grid.labels, name=grid.axis))
    table.columns = pd.Index(grid_ticks(cap, grid), name=grid.axis)  # positions with the first sample's token
    return table


def hookrun_cli(*args, cwd=None) -> None:
    """Run `python -m hookrun ARGS` in a child process, in `cwd` (default: the caller's directory, so that paths in
    ARGS resolve as the caller gave them); on failure exit naming the command, with the child's stdout and stderr
    (hookrun writes config errors to stdout)."""
    done = subprocess.run([sys.executable, "-m", "hookrun", *args], capture_output=True, text=True, cwd=cwd)
    if done.returncode:
        sys.exit(f"python -m hookrun {shlex.join(args)} failed (exit {done.returncode}):\n"
                 f"--- its stdout:\n{done.stdout.rstrip()}\n--- its stderr:\n{done.stderr.rstrip()}")
