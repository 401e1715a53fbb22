"""Data safety round 5 (issue 52): every mistake of a circuit config that the config alone shows is refused before
the model factory runs (a factory here records each call), naming the key, the value and the fix; those that need
the model (an inf weight, a metric that cannot tell the two roles apart) at the first batch, before the store
exists; the circuit reader checks the root attrs' checksum before it builds the graph from them; nothing is
accepted that gives a silently wrong, meaningless or unreadable result."""
import json
import math

import pytest
import torch

import hookrun
from hookrun.experiments.lm import causal_lm
from tests.helpers import make_cfg

BUILT = []  # one entry per call of the model factories below (the runs are in this process)
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 512, "n_positions": 64}
PAIRS = [("the hooks run on a model", "the hooks run on a store"),
         ("a store of captures", "a store of hooks"),
         ("tokens of the model", "tokens of the store"),
         ("the model writes", "the store writes")]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


def lm(**config):
    """The bundled tiny GPT-2 (random init), its building recorded in BUILT."""
    BUILT.append(config)
    return causal_lm(**config)


def lm_inf(**config):
    """lm() with one weight inf: what a damaged model folder loads as."""
    model = lm(**config)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[0, 0] = math.inf
    return model


MODEL = ["+experiment=lm_tokens", "model._target_=tests.test_safety_round5.lm",
         *(f"model.{k}={v}" for k, v in GPT2.items())]
LD = "+metrics.ld={metric:logit_diff,a:' model',b:' store'}"


def circuit(block="", *extra, model=MODEL):
    """A circuit run over PAIRS (PAIRS_FILE) with `block`'s keys added to a good block, and `extra` overrides."""
    keys = "source:clean,target:corrupt,metric:ld,method:eap" + ("," + block if block else "")
    return [*model, "data.text.files=[PAIRS_FILE]", "data.text.fields={clean:clean,corrupt:corrupt}",
            "data.batch_size=2", "hooks.resid=null", LD, f"+circuit={{{keys}}}", *extra]


def replace(overrides, old, new):
    return [o.replace(old, new) for o in overrides]


NO_MODEL = "no model"  # refused before the model factory runs
NO_STORE = "no store"  # refused after the model is built (the check needs it), before the store exists
RUNS = "runs"  # a legitimate choice: the run completes
UNEQUAL = [("the hooks run on a model", "the hooks run on a store of captures")]  # sample 4: 6 vs 8 tokens
SAME = [(c, c) for c, _ in PAIRS]  # the two roles the same prompts: a gap of 0 on every sample
CASES = [  # (id, overrides, pairs file rows (None: PAIRS), expected, what the message must say)
    # a circuit named like a built-in one would replace it silently
    *((f"circuit-named-{name}", circuit(f"circuits:{{{name}:{{but_from:[a0.h0]}}}}"), None, NO_MODEL,
       [f"circuit.circuits.{name}: '{name}' is a name hookrun gives its own circuits", "rename it (e.g. my_"])
      for name in ("full", "empty", "top_2", "random_2", "random_2_1", "threshold_0.5")),
    ("top_n-twice", circuit("select:{top_n:[2,2]}"), None, NO_MODEL,
     ["circuit.select.top_n: [2, 2] lists 2 twice; give each size once"]),
    # source = target, whatever the donor
    *((f"source-is-target-donor-{d}", circuit(f"donor:{d}", "circuit.target=clean"), None, NO_MODEL,
       ["circuit.target: 'clean' is also circuit.source", "whatever the donor", "circuit.target=corrupt"])
      for d in ("same", "mean", "zero")),
    # a metric 0 by construction
    ("logit-diff-same-token", replace(circuit(), "b:' store'", "b:' model'"), None, NO_MODEL,
     ["metrics.ld.b: ' model' is the same token as metrics.ld.a", "give two different tokens"]),
    ("logit-diff-same-id", replace(circuit(), "b:' store'", "b:425"), None, NO_MODEL,
     ["metrics.ld.b: 425 is the same token as metrics.ld.a (both token id 425)"]),
    ("gap-0-on-the-first-batch", circuit(), SAME, NO_STORE,
     ["circuit.metric: ld is the same on 'clean' and 'corrupt' for every sample of the first batch",
      "gap 0", "faithfulness 0 / 0"]),
    # non-finite values: refused at the first batch, naming the array and the cause
    ("inf-weight", replace(circuit(), "tests.test_safety_round5.lm", "tests.test_safety_round5.lm_inf"), None,
     NO_STORE, ["circuit: _circuit/ld/", "NaN or inf value(s) in the first batch",
                "the model's weights hold NaN or inf (transformer.h.0.attn.c_attn.weight)"]),
    # numbers: NaN passes every `<`
    *((f"threshold-{v}", circuit(f"select:{{threshold:{v}}}"), None, NO_MODEL,
       [f"circuit.select.threshold: {v} is not a finite number", "give a number >= 0"]) for v in ("nan", "inf")),
    ("threshold-negative", circuit("select:{threshold:-1}"), None, NO_MODEL,
     ["circuit.select.threshold: -1 is too small; give a number >= 0"]),
    ("steps-1e8", circuit("method:eap_ig,steps:100000000"), None, NO_MODEL,
     ["circuit.steps: 100000000 is too large; give an integer in [1, 100_000]"]),
    ("random-1e6", circuit("select:{top_n:[2],random:1000000}"), None, NO_MODEL,
     ["circuit.select.random: 1000000 is too large; give an integer in [0, 10000]"]),
    ("verify-nan", circuit("verify:nan"), None, NO_MODEL, ["circuit.verify: nan is not a finite number"]),
    # bounds from an estimate: refused before the first batch with the figure and the key to lower
    ("copies-1e8", circuit("copies:100000000"), None, NO_STORE,
     ["circuit: the run would hold about", "100000000 copies x 2 prompts", "free on cpu; lower circuit.copies"]),
    # the data before the model: the tokenizer is cheap, the model is not
    ("role-typo", circuit("", "circuit.target=corupt"), None, NO_MODEL,
     ["circuit.target: 'corupt' is not a role of the data (clean, corrupt) (did you mean: corrupt?)"]),
    *((f"unequal-lengths-donor-{d}", circuit(f"donor:{d}"), UNEQUAL, NO_MODEL,
       ["circuit.source: sample 4 has", "give pairs of the same token length (circuit takes no source_positions)",
        "whatever circuit.donor"]) for d in ("same", "zero", "mean")),
    # legitimate choices that must still run
    ("a-good-block", circuit("select:{top_n:[2],random:2,threshold:0.0}"), None, RUNS, []),
]


def outcome(tmp_path, overrides, rows=None):
    """(exit code, message, built the model, the store exists) of `python -m hookrun OVERRIDES`, in this process."""
    from hookrun.__main__ import failure
    from hookrun.engine.runner import run

    pairs = tmp_path / "pairs.jsonl"
    rows = rows if rows is SAME else [*PAIRS, *(rows or [])]  # a bad row is sample 4, in batch 2
    pairs.write_text("".join(json.dumps({"clean": c, "corrupt": x}) + "\n" for c, x in rows))
    overrides = [o.replace("PAIRS_FILE", str(pairs)) for o in overrides]
    path = tmp_path / "s.zarr"
    BUILT.clear()
    try:
        run(make_cfg([*overrides, f"store.path={path}"]))
        code, message = 0, ""
    except Exception as err:  # noqa: BLE001 - mapped as the CLI maps it
        code, message = failure(err)
    return code, message, bool(BUILT), path.exists()


@pytest.mark.parametrize("overrides,rows,when,expected", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_a_bad_circuit_config_is_refused_naming_its_key_before_the_model_or_the_store(tmp_path, overrides, rows,
                                                                                     when, expected):
    code, message, built, stored = outcome(tmp_path, overrides, rows)
    if when == RUNS:
        assert code == 0 and hookrun.open(tmp_path / "s.zarr").status == "complete", message
        return
    assert code == 2 and not stored, message
    assert "Traceback" not in message
    for text in expected:
        assert text in message, message
    assert built == (when == NO_STORE), f"model built: {built}\n{message}"
