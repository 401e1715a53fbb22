"""Configs that ran to exit 0 with nonsense, or were refused late or unclearly (issue 29, items 6 and 7), and readers
beside a running generate run (item 8): each bad config is refused with exit 2 naming its full key, those that need
no model before the model factory runs (a factory here records each call), those that need the data or the model
before the store exists; a generate run read in a loop while it is written gives a prefix of its final table or
says it is still being written."""
import json
import subprocess
import sys
import time

import numpy as np
import pytest

import hookrun
from hookrun.experiments.lm import causal_lm
from tests.helpers import REPO, cli_outcome, on_cpu

BUILT = []  # one entry per call of the model factories below (the runs are in this process)
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 512, "n_positions": 64}


def lm(**config):
    """The bundled tiny GPT-2 (random init), its building recorded in BUILT."""
    BUILT.append(config)
    return causal_lm(**config)


def slow_lm(**config):
    """lm() sleeping 0.03 s a forward: a generate run slow enough to be read while it is written."""
    model = causal_lm(**config)
    model.register_forward_pre_hook(lambda m, a: time.sleep(0.03))
    return model


PAIRS = [("the hooks run on a model", "the hooks run on a store", " model"),
         ("a store of captures", "a store of hooks", " captures"),
         ("tokens of the model", "tokens of the store", " model"),
         ("the model writes", "the store writes", " the")]
PROMPTS = ["the hooks run on a model", "a store", "every layer writes an array of captures", "tokens"]
MODEL = ["+experiment=lm_tokens", "model._target_=tests.test_safety_late.lm",
         *(f"model.{k}={v}" for k, v in GPT2.items())]
LD = "+metrics.ld={metric:logit_diff,a:{field:answer},b:' store'}"


def grid(*extra, sites="{layers:[transformer.h.0,transformer.h.1],positions:last}"):
    """A patching run over PAIRS (written to PAIRS_FILE) with `extra` overrides."""
    return [*MODEL, "data.text.files=[PAIRS_FILE]", "data.text.fields={clean:clean,corrupt:corrupt}",
            "data.batch_size=2", "hooks.resid=null", LD,
            f"+patching={{source:clean,target:corrupt,sites:{sites},metric:ld}}", *extra]


def gen(*extra, new=4):
    """A generate run over PROMPTS (PROMPTS_FILE), block 0's output captured."""
    return [*MODEL, "data.text.files=[PROMPTS_FILE]", "data.batch_size=2", "layers=[transformer.h.0]",
            f"generate.max_new_tokens={new}", *extra]


STEER = "+hooks.steer={kind:forward,layers:[transformer.h.0],capture:[],edit:[EDIT]}"


def steer(edit):
    return STEER.replace("EDIT", edit)


NO_MODEL = "no model"  # refused before the model factory runs
NO_STORE = "no store"  # refused after the model is built (the check needs it or the data), before the store exists
RUNS = "runs"  # a legitimate choice: the run completes
CASES = [  # (id, overrides, pairs file rows, expected, what the message must say)
    # item 6: ran to exit 0 with nonsense
    ("edit-coef-nan", gen(steer("{op:add,value:1.0,coef:nan,positions:generated}")), None, NO_MODEL,
     ["hooks.steer.edit[0].coef: nan is not a finite number"]),
    ("edit-value-inf", gen(steer("{op:add,value:inf}")), None, NO_MODEL,
     ["hooks.steer.edit[0].value: inf is not a finite number"]),
    ("edit-scale-value-nan", [*MODEL, steer("{op:scale,value:nan}")], None, NO_MODEL,
     ["hooks.steer.edit[0].value: nan is not a finite number"]),
    ("patching-source-is-target", grid("patching.target=clean"), None, NO_MODEL,
     ["patching.target: 'clean' is also patching.source", "donor same", "patching.donor=zero"]),
    ("generated-positions-without-generation",
     gen(steer("{op:add,value:1.0,positions:generated}"), new=0), None, NO_MODEL,
     ["hooks.steer.edit[0].positions: 'generated' names tokens of a generate run",
      "generate.max_new_tokens=N"]),
    ("stop-id-past-the-vocabulary", gen("generate.stop=[eos,99999]"), None, NO_STORE,
     ["generate.stop: 99999 is not a token id of the model's 512-token vocabulary"]),
    ("heads-of-a-block-output",
     grid(sites="{layers:[transformer.h.0,transformer.h.1],heads:all}"), None, NO_STORE,
     ["patching.sites.heads: transformer.h.0 output is not split into heads",
      "transformer.h.0.attn.c_proj", "role: input"]),
    # item 7: refused late or unclearly
    ("answer-of-several-tokens", grid(), [("a store of captures", "a store of hooks", " captures of hooks")],
     NO_STORE, ["metrics.ld.a: field 'answer' of sample 4", "is 3 tokens"]),
    ("answer-id-out-of-vocabulary", grid(), [("a store of captures", "a store of hooks", 9999)], NO_STORE,
     ["metrics.ld.a: field 'answer' of sample 4 is token id 9999", "512"]),
    ("answer-null", grid("data.record=[answer]"), [("a store of captures", "a store of hooks", None)], NO_STORE,
     ["metrics.ld.a: field 'answer' of sample 4 is None"]),
    ("patching-seed-abc", grid("+patching.seed=abc"), None, NO_MODEL,
     ["patching.seed: 'abc' is not a number; give an integer in"]),
    ("patching-noise-field-nope", grid("+patching.noise={positions:{field:nope},std:0.1}"), None, NO_STORE,
     ["patching.noise.positions: {field: nope} but the data has no such field"]),
    ("patching-noise-unknown-key", grid("+patching.noise={positions:all,sd:0.1}"), None, NO_MODEL,
     ["patching.noise.sd: unknown key"]),
    ("patching-heads-abc", grid(sites="{layers:[transformer.h.0.attn.c_proj],role:input,heads:abc}"), None,
     NO_MODEL, ["patching.sites.heads: 'abc' is not all or a list of head indices"]),
    ("steering-file-of-text", gen(steer("{op:add,file:TEXT_FILE}")), None, NO_MODEL,
     ["hooks.steer.edit[0].file:", "direction.txt' is not a .npy or .pt file", "numpy.save"]),
    ("steering-npy-of-objects", gen(steer("{op:add,file:OBJECT_FILE}")), None, NO_MODEL,
     ["hooks.steer.edit[0].file:", "objects.npy' does not load as a tensor", "Object arrays"]),
    ("text-role-with-a-path", [o.replace("{clean:clean,", "{../../x:clean,") for o in grid()] +
     ["patching.source=../../x"], None, NO_MODEL,
     ["data.text.fields: role '../../x'"]),
    ("store-level-10", [*MODEL, "store.level=10"], None, NO_MODEL, ["store.level: 10 is too large; give an integer in [0, 9]"]),
    # legitimate choices that must still run
    ("ablation-source-is-target-donor-zero", grid("patching.target=clean", "+patching.donor=zero"), None, RUNS,
     []),
    ("ablation-source-is-target-donor-mean", grid("patching.target=clean", "+patching.donor=mean"), None, RUNS,
     []),
    ("heads-of-c_proj-input", grid(sites="{layers:[transformer.h.0.attn.c_proj],role:input,heads:all}"), None,
     RUNS, []),
]


def outcome(tmp_path, overrides, rows=None):
    """(exit code, message, built the model, the store exists) of `python -m hookrun OVERRIDES`, in this process."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"clean": c, "corrupt": x, "answer": a}) + "\n"
                             for c, x, a in [*PAIRS, *(rows or [])]))  # a bad row is sample 4, in batch 2
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    (tmp_path / "direction.txt").write_text("0.1 0.2 0.3\n")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    fill = {"PAIRS_FILE": str(pairs), "PROMPTS_FILE": str(tmp_path / "prompts.txt"),
            "TEXT_FILE": str(tmp_path / "direction.txt"), "OBJECT_FILE": str(tmp_path / "objects.npy")}
    overrides = [o if not any(k in o for k in fill) else _fill(o, fill) for o in overrides]
    return cli_outcome(overrides, tmp_path / "s.zarr", BUILT)


def _fill(text, fill):
    for k, v in fill.items():
        text = text.replace(k, v)
    return text


@pytest.mark.parametrize("overrides,rows,when,expected", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_a_bad_config_is_refused_naming_its_key_before_the_model_or_the_store(tmp_path, overrides, rows, when,
                                                                             expected):
    code, message, built, stored = outcome(tmp_path, overrides, rows)
    if when == RUNS:
        assert code == 0 and hookrun.open(tmp_path / "s.zarr").status == "complete", message
        return
    assert code == 2 and not stored, message
    for text in expected:
        assert text in message, message
    assert built == (when == NO_STORE), f"model built: {built}\n{message}"


def test_the_tally_of_late_and_silent_configs():
    """The figures of the closing note: cases tried, refused before the model, before the store, legitimate."""
    counts = [sum(c[3] == w for c in CASES) for w in (NO_MODEL, NO_STORE, RUNS)]
    assert (len(CASES), *counts) == (21, 12, 6, 3)


# -- item 8: readers beside a running generate run --------------------------------------------------------------------
WRITING = "still being written"


@pytest.mark.slow
def test_generations_read_beside_a_running_generate_run_are_a_prefix_or_say_still_being_written(tmp_path):
    """A generate run (0.03 s a forward, a commit a batch) written by another process while this one opens the store,
    reads cap.generations() and cap.verify() in a loop: each round's rows equal the first rows of the final table,
    or the error says the store is still being written; verify() finds nothing missing, or says so too."""
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS * 3) + "\n")
    path = tmp_path / "s.zarr"
    args = [*gen("data.batch_size=1", "store.commit_s=0", new=6), f"store.path={path}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    args = [a.replace("PROMPTS_FILE", str(tmp_path / "prompts.txt")).replace(".lm", ".slow_lm") for a in args]
    writer = subprocess.Popen([sys.executable, "-m", "hookrun", *on_cpu(args)], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    rounds, checks = [], []
    while writer.poll() is None:
        if not (path / "zarr.json").exists():
            time.sleep(0.01)
            continue
        try:
            cap = hookrun.open(path)
            rounds.append(cap.generations())
        except Exception as err:  # noqa: BLE001 - what a reader meets is the point
            rounds.append(err)
        try:
            checks.append(hookrun.open(path).verify())
        except Exception as err:  # noqa: BLE001
            checks.append([f"raised {type(err).__name__}: {err}"])
    assert writer.wait() == 0, writer.stderr.read()
    final = hookrun.open(path).generations()
    assert len(final) == 12 and hookrun.open(path).verify() == []
    errors = [r for r in rounds if isinstance(r, Exception)]
    tables = [r for r in rounds if not isinstance(r, Exception)]
    assert len(rounds) > 10 and len(tables) > 3, (len(rounds), errors[:3])
    for err in errors:
        assert WRITING in str(err), repr(err)
    for table in tables:
        assert list(table.columns) == list(final.columns)
        head = final.iloc[:len(table)].reset_index(drop=True)
        assert table.reset_index(drop=True).astype(str).equals(head.astype(str)), (table, head)
    assert {len(t) for t in tables} > {0, 12} or len({len(t) for t in tables}) > 2  # read mid-run, not only at ends
    for problems in checks:
        assert problems == [] or all(WRITING in p for p in problems), problems


def test_verify_with_the_attrs_of_a_running_store_that_closed_since_reads_it_again(tmp_path):
    """cap opened while the run was running (its committed parts listed), verified after the close merged and
    removed those parts: verify() reads the store again and finds it whole (it reported the parts missing)."""
    from hookrun.format.verify import verify_store

    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    path = tmp_path / "s.zarr"
    outcome(tmp_path, gen(new=3), None)
    cap = hookrun.open(path)
    assert cap.status == "complete" and cap.verify() == []
    stale = dict(cap.root.attrs)
    stale.update(status="running", committed_parts=2)
    stale.pop("index_files", None)

    class Stale:  # the root as a reader opened it mid-run (its attrs), over the store as it is now
        attrs = stale

    problems = verify_store(Stale(), cap.location)
    assert problems == [], problems
