"""hookrun: declarative PyTorch hook experiments that stream captures into Zarr with a pandas index.

    import hookrun
    cap = hookrun.open("outputs/2026-11-22/10-00-00")
    cap.index                                  # one row per captured tensor per batch
    cap.load(layer="conv1", role="output")     # numpy, all samples
    hookrun.collect("multirun/2026-11-22/10-05-00")
    hookrun.loader(cap, layer="blocks.3", batch_size=4096)   # shuffled minibatches for training (torch)
    cap = hookrun.run("conv_fmaps", layers=["conv1"])         # run an experiment from Python (hookrun.api)
    hookrun.compose("conv_fmaps"); hookrun.sweep("conv_fmaps", {"layers": [["conv1"], ["conv2"]]})
    hookrun.anatomy(model).table()             # a model's standard site names -> its modules (docs/anatomy.md)
    hookrun.lens(model, ids); hookrun.dla(model, ids, [7]); hookrun.features(model, ids, sae, site="blocks.1")
"""
import os as _os

# conf/ and experiments/ stand beside this package in a clone (the wheel holds them inside it as hookrun.conf and
# hookrun.experiments): a clone run as it is, or installed editable, finds them there
_beside = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "conf")) and \
        _os.path.isfile(_os.path.join(_beside, "conf", "__init__.py")):
    __path__.append(_beside)

from hookrun._version import __version__  # noqa: E402,F401
from hookrun.read.captures import Captures, collect, open  # noqa: E402,F401  (open shadows the builtin on purpose)

__all__ = ["Captures", "anatomy", "collect", "compose", "dla", "features", "lens", "loader", "open", "run", "sweep",
           "__version__"]


def __getattr__(name):
    if name == "loader":  # imported on first use: the rest of the read side does not need torch
        from hookrun.read.loader import loader

        return loader
    if name == "anatomy":  # imported on first use: torch
        from hookrun.capture.anatomy import anatomy

        return anatomy
    if name in ("lens", "dla", "features"):  # the one-call analyses in memory (hookrun.analyses): torch
        from hookrun import analyses

        return getattr(analyses, name)
    if name in ("run", "compose", "sweep"):  # the Python entry (hookrun.api): Hydra and, to run, the engine
        from hookrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'hookrun' has no attribute {name!r}")
