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
from tests.helpers import cli_outcome

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


PATCH = "+patching={source:clean,target:corrupt,sites:{layers:[blocks.0],positions:all},metric:ld}"
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
       [f"circuit.select.threshold: {v} is not a finite number", "give a number in [0, 1_000_000_000]"]) for v in ("nan", "inf")),
    ("threshold-negative", circuit("select:{threshold:-1}"), None, NO_MODEL,
     ["circuit.select.threshold: -1 is too small; give a number in [0, 1_000_000_000]"]),
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
    # the other config-only refusals that were made after the model
    ("reversed-block-range", [*MODEL, "layers=[blocks.1-0]"], None, NO_MODEL,
     ["hooks.resid.layers: 'blocks.1-0' is a reversed range (it selects no block); give low-high, both included: "
      "blocks.0-1"]),
    ("negative-block", [*MODEL, "layers=[blocks.-1]"], None, NO_MODEL,
     ["hooks.resid.layers: 'blocks.-1' has a negative block number; blocks count from 0"]),
    ("features-layer-reversed", circuit("features:{dictionary:sae1,layer:blocks.1-0}",
                                        "+dictionaries.sae1={path:EMPTY_DIR}"), None, NO_MODEL,
     ["circuit.features.layer: 'blocks.1-0' is a reversed range"]),
    ("dictionary-folder-without-cfg", [*MODEL, "+dictionaries.sae1={path:EMPTY_DIR}",
                                       "+hooks.f={kind:forward,layers:[blocks.0],dictionary:sae1}"], None, NO_MODEL,
     ["dictionaries.sae1.path: dictionary", "has no cfg.json"]),
    ("patching-role-typo", [*circuit()[:-1], PATCH.replace("target:corrupt", "target:corupt")], None, NO_MODEL, ["patching.target: 'corupt' is not a role of the data (clean, corrupt)"]),
    ("patching-unequal-lengths", [*circuit()[:-1], PATCH], UNEQUAL, NO_MODEL,
     ["patching.sites.positions: sample 4 has", "patching.source_positions"]),
    ("attribution-unequal-lengths", [*circuit()[:-1], PATCH.replace("+patching", "+attribution")], UNEQUAL,
     NO_MODEL, ["attribution.sites.positions: sample 4 has", "attribution.source_positions"]),
    # legitimate choices that must still run
    ("a-good-block", circuit("select:{top_n:[2],random:2,threshold:0.0}"), None, RUNS, []),
]


def outcome(tmp_path, overrides, rows=None):
    """(exit code, message, built the model, the store exists) of `python -m hookrun OVERRIDES`, in this process."""
    pairs = tmp_path / "pairs.jsonl"
    rows = rows if rows is SAME else [*PAIRS, *(rows or [])]  # a bad row is sample 4, in batch 2
    pairs.write_text("".join(json.dumps({"clean": c, "corrupt": x}) + "\n" for c, x in rows))
    (tmp_path / "nocfg").mkdir(exist_ok=True)  # a dictionary folder without cfg.json
    overrides = [o.replace("PAIRS_FILE", str(pairs)).replace("EMPTY_DIR", str(tmp_path / "nocfg")) for o in overrides]
    return cli_outcome(overrides, tmp_path / "s.zarr", BUILT)


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


def test_an_edited_graph_in_the_root_attrs_is_a_damaged_error_naming_the_key(tmp_path):
    """cap.read("circuit") checks the root attrs' checksum before it rebuilds the graph from them: an edited shape
    is DamagedError naming the attr, not an IndexError or "written by another hookrun"."""
    from hookrun.format.files import DamagedError
    from hookrun.format.layout import CIRCUIT_ATTR

    code, message, _, _ = outcome(tmp_path, circuit("select:{top_n:[2]}"))
    assert code == 0, message
    cap = hookrun.open(tmp_path / "s.zarr")
    whole = cap.read("circuit")
    assert len(whole.edges) == whole.attrs["graph"]["edges"]
    meta_file = tmp_path / "s.zarr" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"][CIRCUIT_ATTR]["graph"]["n_layers"] = 7
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(DamagedError, match=f"builds its graph from the root attr '{CIRCUIT_ATTR}'"):
        hookrun.open(tmp_path / "s.zarr").read("circuit")


def test_a_typo_in_a_method_block_on_the_command_line_gets_the_did_you_mean(tmp_path, cli):
    """`circuit.methd=eap` (no `+`): hookrun's unknown key with the nearest ones, exit 2, not Hydra's advice to
    append it with `+`; an integer key given nan is named in check_number's words."""
    proc = cli("+experiment=lm_tokens", "+circuit={source:clean,target:corrupt,metric:ld}", "circuit.methd=eap",
               "circuit.select.hw=top", "data.batch_size=nan", f"hydra.run.dir={tmp_path}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "circuit.methd: unknown key (did you mean: method, metric?); circuit takes source, target" in out
    assert "circuit.select.hw: unknown key (did you mean: how?); select takes top_n" in out
    assert "data.batch_size: nan is not a finite number" in out
    assert "+circuit.methd" not in out and "Traceback" not in out


NEEDS_THE_MODEL = {"gap-0-on-the-first-batch": "the metric's values on the first batch",
                   "inf-weight": "the model's weights, through the first batch's scores",
                   "copies-1e8": "the model's width and the graph's senders"}


def test_the_tally_every_config_only_mistake_is_refused_before_the_model():
    """Of the mistakes of this round (and test_safety_late's), each one the config or the data alone shows is
    refused before the model (NO_MODEL, checked by the parametrized test: the factory never ran); only those that
    need the model are refused after it, before the store."""
    from tests.test_safety_late import CASES as LATE

    ours = [(c[0], c[3]) for c in CASES]
    late = [(c[0], c[3]) for c in LATE]
    after = sorted(name for name, when in ours if when == NO_STORE)
    assert after == sorted(NEEDS_THE_MODEL)
    refused = [when for _, when in ours + late if when != RUNS]
    before = refused.count(NO_MODEL)
    assert (len(ours), sum(w == NO_MODEL for _, w in ours), len(after)) == (33, 29, 3)
    assert (len(refused), before) == (50, 41)  # late's NO_STORE: token ids and heads, against the model's vocab


def no_model(**config):
    """A model factory that fails if called: a refusal with exit 2 through it came before the model."""
    raise AssertionError("the model was built")


def test_a_dictionary_folder_without_cfg_json_on_the_command_line_is_refused_before_the_model(tmp_path, cli):
    """`dictionaries.NAME={path: DIR}` as the issue gives it (no `+`): exit 2 naming the folder, the factory never
    called (it would fail with exit 1)."""
    (tmp_path / "nocfg").mkdir()
    proc = cli("+experiment=lm_tokens", "model._target_=tests.test_safety_round5.no_model",
               f"dictionaries.sae1={{path: {tmp_path / 'nocfg'}}}",
               "+hooks.f={kind:forward,layers:[blocks.0],dictionary:sae1}", f"hydra.run.dir={tmp_path}/run",
               check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "dictionaries.sae1.path: dictionary" in out and "has no cfg.json" in out
    assert "the model was built" not in out and "InstantiationException" not in out


def test_nan_scores_stored_past_the_check_read_back_as_nan_with_a_warning(tmp_path, monkeypatch):
    """Were a NaN to reach the store (the first-batch check switched off here), cap.read("circuit") reads it back:
    its scores NaN, its edges ranked, a warning; never pandas' IntCastingNaNError."""
    from hookrun.methods.circuits import Circuit

    monkeypatch.setattr(Circuit, "first_batch_problems", lambda self, job: [])
    code, message, _, _ = outcome(tmp_path, replace(circuit(), "tests.test_safety_round5.lm",
                                                    "tests.test_safety_round5.lm_inf"))
    assert code == 0, message
    with pytest.warns(RuntimeWarning, match="edges' mean scores are NaN or inf"):
        res = hookrun.open(tmp_path / "s.zarr").read("circuit")
    assert res.edges["score"].isna().any() and sorted(res.edges["rank"]) == list(range(1, len(res.edges) + 1))
