"""Pictures of a run or a sweep: the public name of hookrun.read.plots.

    python -m hookrun.plot RUN_DIR [--layer L] [--sample 0] [--out DIR]
    from hookrun import plot; plot.feature_maps(cap, layer="conv1")
"""
import sys

from hookrun.read import plots as _plot

if __name__ == "__main__":
    sys.exit(_plot.main())
sys.modules[__name__] = _plot  # `hookrun.plot` is the read side's plot module itself
