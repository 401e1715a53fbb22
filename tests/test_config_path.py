"""The config's way through a run kept short: parsed once at the edge, hashed once (the hash a store keeps and a
resume compares, the same value for the same config as before), its methods made once; benchmarks/config_path.py
counts the whole way."""
import sys

import pytest

import hookrun
from hookrun.config import parsing
from hookrun.config.parsing import parse
from hookrun.engine.runner import run
from tests.helpers import make_cfg

# config_hash of each bundled experiment (device=cpu) as the release before the config's split computed it: a
# store written then resumes now only if these stay
HASHES = {"add_one": "47fd61bff062c3ab", "conv_fmaps": "3632cc99d66c6d99", "attribution": "1bb68a4e9d2ffa89",
          "ablate_heads": "1313322fd0f5657a"}


@pytest.mark.parametrize("experiment", sorted(HASHES))
def test_the_config_hash_is_the_value_stores_were_written_with(experiment):
    parsed = parse(make_cfg([f"+experiment={experiment}"]))
    assert parsed.config_hash == HASHES[experiment] == parsing.config_hash(parsed.resolved)
    moved = parsed.with_store_path("elsewhere.zarr")  # where a run is stored is not what it computes
    assert moved.config_hash == parsing.config_hash(moved.resolved) == HASHES[experiment]


def calls_during(fn, *names):
    """How many times each function named (module, name) is called while fn() runs (counted with sys.setprofile;
    module "*": any method's, called from the engine), and fn's result."""
    counts = {name: 0 for name in names}

    def profile(frame, event, arg):
        if event != "call":
            return
        key = (frame.f_globals.get("__name__"), frame.f_code.co_name)
        if key in counts:
            counts[key] += 1
        elif ("*", key[1]) in counts and frame.f_back is not None and \
                str(frame.f_back.f_globals.get("__name__")).startswith("hookrun.engine"):
            counts[("*", key[1])] += 1
    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return [counts[n] for n in names], result


def test_a_run_parses_and_hashes_its_config_once_and_the_store_keeps_that_hash(tmp_path):
    from hookrun.config.registry import methods

    cfg = make_cfg(["+experiment=add_one", f"store.path={tmp_path / 's.zarr'}"])
    (parses, hashes, asked), where = calls_during(lambda: run(cfg), ("hookrun.config.parsing", "parse"),
                                                  ("hookrun.config.parsing", "config_hash"), ("*", "active"))
    assert (parses, hashes) == (1, 1)
    assert asked == len(methods())  # each method asked once whether the run uses it
    attrs = hookrun.open(where).attrs
    assert attrs["config_hash"] == HASHES["add_one"] == parsing.config_hash(attrs["config"])
