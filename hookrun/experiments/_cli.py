"""Shared argument handling of the analysis scripts: `python -m hookrun.experiments.NAME RUN_DIR`."""
import sys

import numpy as np

import hookrun


def open_run(argv=None):
    """The captures of the run dir (or .zarr) given on the command line."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit(f"usage: python -m {sys.modules['__main__'].__spec__.name} RUN_DIR  (a run dir or its captures.zarr)")
    np.set_printoptions(precision=4, suppress=True)
    return hookrun.open(argv[0])
