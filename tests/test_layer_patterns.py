"""Layer patterns (hookrun.capture.layers.match, docs/concepts/hooks.md#layer-patterns): `*` within one dotted
segment, `**` across segments, `re:` a full match, on a real model's names, and through a run."""
import re

import numpy as np
import torch

import hookrun

from hookrun.capture.layers import match, module_names, parameter_names, resolve
from hookrun.experiments.lm import causal_lm
from tests.helpers import run_here


def model():
    torch.manual_seed(0)
    return causal_lm(n_layer=2)


def test_star_stays_in_one_segment():
    names = module_names(model())
    assert match("transformer.h.*", names) == ["transformer.h.0", "transformer.h.1"]  # not their 26 submodules
    assert match("transformer.h.*.mlp", names) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert match("transformer.h.?.ln_?", names) == [f"transformer.h.{i}.ln_{j}" for i in (0, 1) for j in (1, 2)]
    assert match("transformer.h.[!0].attn", names) == ["transformer.h.1.attn"]
    assert match("transformer.*", names) == ["transformer.wte", "transformer.wpe", "transformer.drop",
                                             "transformer.h", "transformer.ln_f"]


def test_double_star_spans_segments():
    m = model()
    names = module_names(m)
    below = [n for n in names if re.fullmatch(r"transformer\..*\.c_fc", n)]
    assert match("transformer.**.c_fc", names) == below == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert match("**.mlp", names) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert match("transformer.h.**", names) == [n for n in names if n == "transformer.h" or
                                                n.startswith("transformer.h.")]  # none included: h itself
    weights = parameter_names(m)
    assert match("**.weight", weights) == [n for n in weights if n.endswith(".weight")]
    assert match("*.weight", weights) == []  # every weight is two segments deep or more


def test_regex_is_a_full_match_of_the_whole_name():
    names = module_names(model())
    assert match(r"re:transformer\.h\.\d+", names) == ["transformer.h.0", "transformer.h.1"]
    assert match(r"re:h\.\d+", names) == []  # full match, not search
    assert match(r"re:.*\.attn\..*", names) == [n for n in names if ".attn." in n]
    assert resolve(["transformer.h.0"], names, "module", "k") == (["transformer.h.0"], [])


def test_a_run_hooks_exactly_the_blocks(tmp_path):
    cap = hookrun.open(run_here(tmp_path / "run", "+experiment=lm_tokens", "model.n_layer=2", "data.max_samples=2",
                   "layers=[transformer.h.*]"))
    assert sorted(set(cap.index["layer"])) == ["transformer.h.0", "transformer.h.1"]
    assert np.isfinite(cap.load(layer="transformer.h.1", role="output")).all()
