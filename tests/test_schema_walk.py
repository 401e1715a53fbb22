"""Every block's numbers and names walked (issue 52, item 1): each numeric key of the typed schema (run_schema(),
every dataclass below it) and of the free-form blocks (circuit, patching, attribution, train) is fed NaN, inf, 0, a
negative and a huge value, each name key a name hookrun makes; a bad value is refused by the checks that need no
model (hookrun.engine.checks.check, or the command line's for an integer OmegaConf cannot hold), in one line that
names the key and the value and says what to give."""
import dataclasses
import math
import typing

import pytest

from hookrun.config.commandline import override_problems
from hookrun.config.schema import run_schema
from hookrun.engine.checks import check
from tests.helpers import make_cfg

BASE = ["+experiment=lm_tokens", "model.n_layer=2", "model.n_embd=32", "model.n_head=4"]
BAD = {"nan": math.nan, "inf": math.inf, "negative": -1, "huge": 10 ** 15}
ZERO_OK = {  # 0 is a value these keys mean something by (what is said where they take it)
    "seed", "progress_s", "data.num_workers", "store.level", "store.min_saving", "store.commit_s", "store.retry_s",
    "generate.max_new_tokens", "generate.top_k"}
HUGE_OF = {"seed": 2 ** 64}  # torch takes 64-bit seeds: 10**15 is one
SKIP = {"data.text.max_length"}  # walked below with its own base (a text corpus), not the lm experiment's default


def numeric_fields(schema, prefix=""):
    """(key, is an int) of every int or float field below `schema`, through Optional and nested dataclasses."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        kinds = set(typing.get_args(hint)) or {hint}
        inner = next((k for k in kinds if dataclasses.is_dataclass(k)), None)
        if inner is not None:
            yield from numeric_fields(inner, f"{prefix}{f.name}.")
        elif kinds & {int, float} and bool not in kinds:
            yield f"{prefix}{f.name}", int in kinds


TYPED = [k for k in numeric_fields(run_schema()) if k[0] not in SKIP]


def problems_of(overrides):
    return check(make_cfg([*BASE, *overrides])).problems


def said(problems, key, shown):
    return [p for p in problems if p.startswith(f"{key}: {shown}") and "; give " in p]


def test_the_walk_finds_every_typed_block():
    keys = {k for k, _ in TYPED}
    assert {"data.batch_size", "store.level", "store.chunk_mb", "generate.temperature", "lens.top_k",
            "lens.dla.tolerance", "progress_s", "seed"} <= keys
    assert len(keys) >= 20


@pytest.mark.parametrize("key,whole", TYPED, ids=[k for k, _ in TYPED])
def test_every_typed_number_refuses_nan_inf_negative_and_huge(key, whole):
    extra = ["generate.do_sample=true", "generate.max_new_tokens=2"] if key.startswith("generate.") else []
    extra += ["+lens.sites.layers=[blocks.0]", "+lens.dla.tokens=[' model']"] if key.startswith("lens.") else []
    for name, value in BAD.items():
        shown = {"nan": "nan", "inf": "inf", "negative": "-1", "huge": str(HUGE_OF.get(key, 10 ** 15))}[name]
        if whole and name in ("nan", "inf"):  # OmegaConf cannot hold it: the command line's check names it
            found = override_problems([f"{key}={shown}"])
        else:
            found = problems_of([*extra, f"{key}={shown}"])
        assert said(found, key, shown), (name, found)  # a float field shows -1 as -1.0: the line starts alike
    zero = problems_of([*extra, f"{key}=0"])
    if key not in ZERO_OK:
        assert said(zero, key, "0"), zero
    else:
        assert not [p for p in zero if p.startswith(f"{key}:")], zero


TEXT = ["data.text.files=[pkg://hookrun.experiments/data/corpus.txt]"]


def test_text_max_length_is_walked_too():
    for shown in ("0", "-1", "1000000000000000"):
        assert said(check(make_cfg([*BASE, *TEXT, f"data.text.max_length={shown}"])).problems,
                    "data.text.max_length", shown)


PAIRED = ["data.text.fields={clean:clean,corrupt:corrupt}", "+metrics.ld={metric:logit_diff,a:' model',b:' store'}"]
FREE = {  # the free-form blocks: (a good block, its numeric keys: dotted path -> 0 refused)
    "circuit": ("{source:clean,target:corrupt,metric:ld,method:eap_ig,select:{top_n:[2],threshold:0.1,random:1,"
                "seed:0},verify:1,copies:0,features:{dictionary:d,method:ig,steps:2,top_k:2,verify:1}}",
                {"steps": True, "verify": False, "copies": False, "select.threshold": False, "select.random": False,
                 "select.seed": False, "features.steps": True, "features.top_k": True, "features.verify": False}),
    "patching": ("{source:clean,target:corrupt,sites:{layers:[blocks.0]},metric:ld,seed:0,noise:{std:0.1,seed:0}}",
                 {"seed": False, "noise.std": False, "noise.seed": False}),
    "attribution": ("{source:clean,target:corrupt,sites:{layers:[blocks.0]},metric:ld,method:integrated_gradients,"
                    "steps:4,verify:0,seed:0}", {"steps": True, "verify": False, "seed": False}),
}
TRAIN_NUMBERS = ["width", "k", "steps", "batch_size", "lr", "lr_warm_up_steps", "lr_decay_steps", "lr_end",
                 "adam_beta1", "adam_beta2", "l1_coefficient", "aux_coefficient", "topk_threshold_lr",
                 "jumprelu_bandwidth", "dead_feature_window", "dense_density", "clip_grad", "buffer_tokens",
                 "evaluate_every", "checkpoint_every", "seed"]


def free_cases():
    for block, (good, keys) in FREE.items():
        for key, zero_bad in keys.items():
            yield block, good, key, zero_bad


@pytest.mark.parametrize("block,good,key,zero_bad", list(free_cases()),
                         ids=[f"{b}.{k}" for b, _, k, _ in free_cases()])
def test_every_free_form_number_refuses_nan_inf_negative_and_huge(block, good, key, zero_bad):
    from omegaconf import OmegaConf

    cfg = make_cfg([*BASE, *PAIRED, f"+{block}={good}", "+dictionaries.d={path: /nonexistent}"])
    assert not [p for p in check(cfg).problems if p.startswith(f"{block}.")], check(cfg).problems
    for shown, value in (("nan", math.nan), ("inf", math.inf), ("-1", -1), ("1000000000000000", 10 ** 15),
                         *((("0", 0),) if zero_bad else ())):
        bad = make_cfg([*BASE, *PAIRED, f"+{block}={good}", "+dictionaries.d={path: /nonexistent}"])
        OmegaConf.update(bad, f"{block}.{key}", value, force_add=True)
        found = check(bad).problems
        assert said(found, f"{block}.{key}", shown), (shown, found)


@pytest.mark.parametrize("key", TRAIN_NUMBERS)
def test_every_train_number_refuses_nan_inf_negative_and_huge(key):
    from hookrun.methods.training.spec import parse_block

    good = {"sites": ["blocks.0"], "width": 64, "steps": 100, "kind": "batchtopk", "k": 4}
    assert parse_block(good)[1] == []
    for shown, value in (("nan", math.nan), ("inf", math.inf), ("-1", -1), ("1000000000000000", 10 ** 15),
                         ("0", 0)):
        problems = parse_block({**good, key: value})[1]
        assert said(problems, f"train.{key}", shown), (shown, problems)


@pytest.mark.parametrize("name", ["full", "empty", "top_3", "random_3", "random_3_0", "threshold_0.1"])
def test_every_name_hookrun_makes_is_refused_as_a_circuit_name(name):
    cfg = make_cfg([*BASE, *PAIRED, f"+circuit={{source:clean,target:corrupt,metric:ld,circuits:{{{name}:"
                                     "{but_from:[a0.h0]}}}"])
    found = check(cfg).problems
    assert [p for p in found if p.startswith(f"circuit.circuits.{name}: '{name}' is a name hookrun gives")], found
