"""One set of checks for every method (hookrun.capture.checks): each bad value of a key several methods share is run
against every method that takes it, and each refuses it before the store exists, with one message for one key and
value (only the method's prefix differs)."""
import json

import pytest

from hookrun.capture.checks import finite_problems, k_problems, repeat_problems, same_role_problems
from hookrun.config.checks import ConfigError
from hookrun.engine.runner import run
from tests.helpers import make_cfg

PAIRS = [("the hooks run on a model", "the hooks run on a store", " model"),
         ("a store of captures", "a store of hooks", " captures")]
LD = "+metrics.ld={metric:logit_diff,a:{field:answer},b:' store'}"
BLOCK0 = "[transformer.h.0]"


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"clean": c, "corrupt": x, "answer": a}) + "\n" for c, x, a in PAIRS))
    return path


def base(pairs):
    return ["+experiment=lm_tokens", "model.n_layer=2", "model.n_embd=32", "model.n_head=4",
            f"data.text.files=[{pairs}]", "data.text.fields={clean:clean,corrupt:corrupt}", "data.batch_size=2",
            "hooks.resid=null", LD]


def grid(method, sites, *more):
    return f"+{method}={{source:clean,target:clean,sites:{sites},metric:ld{''.join(',' + m for m in more)}}}"


# each shared key: (bad block per method, the message each must give with {m} the method's key)
CASES = {
    "source equal to target": (
        {m: [grid(m, f"{{layers:{BLOCK0},positions:all}}")] for m in ("patching", "attribution")},
        "{m}.target: 'clean' is also {m}.source: with donor same each site is patched with its own value"),
    "source equal to target, whatever the donor": (  # an edge's score is (a_source - a_target) x gradient
        {"circuit": ["+circuit={source:clean,target:clean,metric:ld,donor:zero}"]},
        "{m}.target: 'clean' is also {m}.source: every edge's score is (a_source - a_target) x gradient = 0 whatever "
        "the donor"),
    "heads on the residual stream": (
        {m: [grid(m, f"{{layers:{BLOCK0},heads:all}}").replace("target:clean", "target:corrupt")]
         for m in ("patching", "attribution")},
        "{m}.sites.heads: transformer.h.0 output is not split into heads (its features are no heads side by side)"),
    "a token given twice": (
        {"lens.tokens": ["+lens={sites:{layers:[transformer.h.0],positions:last},tokens:[' model',' model']}"],
         "lens.dla.tokens": ["+lens={dla:{tokens:[' model',' model']}}"]},
        "{m}: ' model' is given twice (at 0 and 1); each entry must differ"),
    "k past the vocabulary": (
        {"lens.top_k": ["+lens={sites:{layers:[transformer.h.0],positions:last},top_k:100000}"]},
        "{m}: 100000 is more than the 512 tokens in the model's vocabulary; give at most 512"),
}
EDITS = {  # a NaN in every edit that takes a number
    "add": "{op:add,value:nan}", "scale": "{op:scale,value:nan}", "coef": "{op:add,value:1,coef:nan}",
    "clamp": "{op:clamp,min:nan}", "noise": "{op:noise,std:inf}",
    "feature add": "{op:feature,dictionary:sae1,feature:0,add:nan}",
    "feature set": "{op:feature,dictionary:sae1,feature:0,set:inf}",
    "feature clamp": "{op:feature,dictionary:sae1,feature:0,clamp:[0,nan]}",
    "add a list": "{op:add,value:[0.1,nan]}",
    "add a file": "{op:add,file:NAN_FILE}",  # a .npy of 32 numbers, the sixth inf (capture/sources.py's own check)
}
SAID = {"add": "hooks.steer.edit[0].value: nan is not a finite number",
        "add a list": "hooks.steer.edit[0].value: [0.1, nan] holds NaN or inf (at [1])",
        "add a file": "hooks.steer.edit[0].file: a tensor of shape [32] holds NaN or inf (at [5])"}
SHARED = "a NaN or inf makes everything it touches NaN or inf (every later value, every log-prob): give a finite number"


def refusal(overrides) -> str:
    with pytest.raises(ConfigError) as err:
        run(make_cfg(overrides))
    return str(err.value)


@pytest.mark.parametrize("case", list(CASES))
def test_a_shared_key_is_refused_alike_by_every_method_that_takes_it(case, pairs, tmp_path):
    blocks, message = CASES[case]
    for method, extra in blocks.items():
        msg = refusal([*base(pairs), *extra, f"store.path={tmp_path / 'x.zarr'}"])
        assert message.format(m=method) in msg, (method, msg)
    assert not (tmp_path / "x.zarr").exists()


@pytest.mark.parametrize("op", list(EDITS))
def test_a_nan_or_inf_in_any_edit_is_refused(op, pairs, tmp_path, sae_folder):
    """Each with the one message of hookrun.capture.checks.finite_problems (a number, a list or a file's tensor)."""
    import numpy as np

    direction = np.full(32, 0.1, np.float32)
    direction[5] = np.inf
    np.save(tmp_path / "direction.npy", direction)
    edit = EDITS[op].replace("NAN_FILE", str(tmp_path / "direction.npy"))
    msg = refusal([*base(pairs), f"+dictionaries={{sae1:{{path:{sae_folder}}}}}",
                   f"+hooks.steer={{kind:forward,layers:[transformer.h.0],capture:[],edit:[{edit}]}}",
                   f"store.path={tmp_path / 'x.zarr'}"])
    assert "hooks.steer.edit[0]." in msg and SHARED in msg and SAID.get(op, "") in msg, msg
    assert not (tmp_path / "x.zarr").exists()


@pytest.fixture
def sae_folder(tmp_path):
    import torch

    from hookrun.methods.saes import SparseAutoencoder, save_saelens

    torch.manual_seed(0)
    return save_saelens(SparseAutoencoder(32, 16, hook_name="transformer.h.0"), tmp_path / "sae",
                        hook_name="transformer.h.0")


def test_the_functions_return_plain_problem_lists():
    assert same_role_problems("circuit", "clean", "corrupt") == []
    assert same_role_problems("circuit", "clean", "clean", "zero") == []
    assert same_role_problems("circuit", "clean", "clean")[0].startswith("circuit.target: 'clean' is also circuit.source")
    assert finite_problems("x", [1.0, [2.0, float("nan")]]) == [
        "x: [1.0, [2.0, nan]] holds NaN or inf (at [1][1]); a NaN or inf makes everything it touches NaN or inf (every "
        "later value, every log-prob): give a finite number"]
    assert finite_problems("x", 3) == [] and repeat_problems("t", ["a", "b"]) == []
    import numpy as np
    import torch

    assert finite_problems("x", torch.tensor([[1.0, 2.0], [3.0, float("-inf")]])) == [
        f"x: a tensor of shape [2, 2] holds NaN or inf (at [1][1]); {SHARED}"]
    assert finite_problems("x", np.float64("nan")) == [f"x: nan is not a finite number; {SHARED}"]
    assert finite_problems("x", torch.tensor(float("inf"))) == [f"x: inf is not a finite number; {SHARED}"]
    assert finite_problems("x", torch.ones(3, dtype=torch.bfloat16)) == [] == finite_problems("x", np.arange(3))
    assert k_problems("k", 0, 10, "tokens") == ["k: 0 is too small; give an integer in [1, 1_000_000_000]"]
    assert k_problems("k", 11, 10, "tokens") == ["k: 11 is more than the 10 tokens; give at most 10"]


# -- reader calls name the argument and its range ----------------------------------------------------------
def test_reader_calls_out_of_range_name_the_argument_and_the_valid_range(tmp_path):
    corpus = tmp_path / "p.txt"
    corpus.write_text("".join(f"document {i} of the hooks and the store\n" for i in range(8)))
    run(make_cfg(["+experiment=lm_tokens", "model.n_layer=2", "model.n_embd=32", "model.n_head=4",
                  f"data.text.files=[{corpus}]", "data.batch_size=4",
                  "+lens={sites:{layers:[transformer.h.0],positions:last},top_k:3}",
                  f"store.path={tmp_path / 's.zarr'}"]))
    import hookrun

    cap = hookrun.open(tmp_path / "s.zarr")
    table = cap.read("lens")
    calls = {
        "top(unit=1000000)": (lambda: cap.top(layer="transformer.h.0", unit=10**6), IndexError,
                              "top(unit=1000000): out of range: resid/blocks.0/output has 32 units a token; "
                              "give unit in 0..31 (or -32..-1 from the end)"),
        "top(k=0)": (lambda: cap.top(layer="transformer.h.0", k=0), ValueError,
                     "top(k=0): k must be an integer >= 1"),
        "lens top(sample=99)": (lambda: table.top(sample=99), IndexError,
                                "top(sample=99): out of range: the lens holds 8 samples; give sample in 0..7"),
        "lens top(k=4)": (lambda: table.top(k=4), ValueError,
                          "top(k=4): the run stored the top 3 tokens a site (lens.top_k); give k in 1..3"),
        "load(rows=[10**6])": (lambda: cap.load(layer="transformer.h.0", rows=[10**6]), IndexError,
                               "row 1000000 is out of range: there are"),
    }
    for name, (call, error, message) in calls.items():
        with pytest.raises(error) as err:
            call()
        assert message in str(err.value), (name, str(err.value))
