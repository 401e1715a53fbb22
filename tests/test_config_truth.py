"""Each config fact written once: defaults and choices in the schema (the YAML sets only what differs), one
choice check, one `_target_` check, the hook kinds from hookrun.capture.hooks.KINDS."""
import dataclasses
import subprocess

import pytest
import yaml
from omegaconf import MISSING, OmegaConf

from hookrun.capture import edits, hooks
from hookrun.config import schema
from hookrun.config.checks import check_choice, check_target, either
from hookrun.config.schema import run_schema, schema_field
from hookrun.engine import losses
from hookrun.engine.checks import check
from hookrun.store import spec as store_spec
from tests.helpers import REPO, make_cfg, run_cli

CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def defaults(schema_type=None, prefix="") -> dict:
    """key path -> the schema's default, for every key of a typed block (free-form keys are leaves)."""
    schema_type = schema_type or run_schema()
    out = {}
    for f in dataclasses.fields(schema_type):
        typed = schema_field(schema_type, f.name)
        if typed:
            out.update(defaults(typed, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def flat(node, prefix="") -> dict:
    """key path -> value of a plain YAML mapping, down to the schema's leaves."""
    out = {}
    for key, value in (node or {}).items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in DEFAULTS and path != "defaults":
            out.update(flat(value, path + "."))
        else:
            out[path] = value
    return out


DEFAULTS = defaults()


def yaml_settings():
    """(file, key path, value) of every setting in the bundled YAML files that the schema types."""
    files = [(CONF / "config.yaml", ""), *((p, "data.") for p in (CONF / "data").glob("*.yaml")),
             *((p, "store.") for p in (CONF / "store").glob("*.yaml")),
             *((p, "") for p in (CONF / "experiment").glob("*.yaml")),
             *((p, "") for p in (CONF / "model").glob("*.yaml") if p.read_text().startswith("# @package _global_"))]
    for path, prefix in files:
        for key, value in flat(yaml.safe_load(path.read_text()), prefix).items():
            if key in DEFAULTS:
                yield path.relative_to(CONF), key, value


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_key_an_experiment_leaves_is_the_schema_default(experiment):
    def bases(name):  # experiments it builds on, theirs too (feature_circuit: sae_features, steer_source)
        found = [d for d in yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text()).get("defaults", [])
                 if isinstance(d, str) and d != "_self_"]
        return [b for d in found for b in (d, *bases(d))]
    parents = bases(experiment)
    presets = [v for file in (experiment, *parents)  # model presets they pick (override /model: recall_lm)
               for d in yaml.safe_load((CONF / "experiment" / f"{file}.yaml").read_text()).get("defaults", [])
               if isinstance(d, dict) for k, v in d.items() if k == "override /model"]
    set_here = {key: value for file, key, value in yaml_settings()
                if file.stem in (experiment, *parents) and file.parent.name == "experiment"
                or file.parent.name == "model" and file.stem in presets}
    resolved = OmegaConf.to_container(make_cfg([f"+experiment={experiment}"]))
    got = flat(resolved)
    for key, default in DEFAULTS.items():
        if key in set_here or key in ("model", "hooks", "loss", "device") or default is MISSING:  # make_cfg: cpu
            continue
        assert got[key] == default, f"{experiment}: {key} resolves to {got[key]!r}, the schema says {default!r}"
    assert set_here, experiment  # every bundled experiment sets something


def test_the_bundled_yaml_sets_only_what_differs_from_the_schema():
    same = [f"{file}: {key}: {value!r}" for file, key, value in yaml_settings() if value == DEFAULTS[key]
            and type(value) is type(DEFAULTS[key])]
    assert same == []


def test_cfg_job_of_a_bundled_experiment_shows_every_store_default():
    out = run_cli("+experiment=conv_fmaps", "--cfg", "job").stdout
    store = yaml.safe_load(out)["store"]
    assert store == {key[6:]: value for key, value in DEFAULTS.items() if key.startswith("store.")}
    assert store["codec"] == "lz4" and store["queue_mb"] == 64.0


def test_each_choice_default_is_among_its_choices_and_the_store_check_takes_every_one():
    for schema_type in (run_schema(), schema.DataConfig, schema.StoreConfig, schema.TextConfig, schema.HookConfig):
        for f in dataclasses.fields(schema_type):
            if f.metadata["choices"] and f.default is not None:
                assert f.default in f.metadata["choices"], f"{schema_type.__name__}.{f.name}"
    for codec in schema.CODECS:  # lz4hc too, which the old StoreConfig comment left out
        cfg = OmegaConf.merge(OmegaConf.structured(schema.StoreConfig), {"codec": codec})
        assert store_spec.check_spec(cfg) == []


def test_one_choice_check_writes_the_message():
    assert check_choice("store.writer", "thread", schema.WRITERS) == []
    assert check_choice("store.writer", "threads", schema.WRITERS) == [
        "store.writer: 'threads' is unknown; use one of auto, thread, sync (did you mean: thread?)"]
    assert check_choice("mode", "training", schema.RUN_MODES, either(schema.RUN_MODES)) == [
        "mode: 'training' is unknown; use eval or train (did you mean: train?)"]
    assert check_choice("store.shuffle", "bitshufle", schema.SHUFFLES, hint=False) == [
        "store.shuffle: 'bitshufle' is unknown; use one of noshuffle, shuffle, bitshuffle"]


def test_no_module_writes_the_choice_message_itself():
    grep = subprocess.run(["grep", "-rln", "is unknown; use", "hookrun"], cwd=REPO, capture_output=True, text=True)
    assert grep.stdout.split() == ["hookrun/config/checks.py"]


def one_argument(output):
    """A loss that cannot take (output, batch)."""
    return output.sum()


def test_model_edit_and_loss_targets_go_through_one_check():
    problems = check(make_cfg(["+experiment=conv_fmaps", "model._target_=math",
                               "+hooks.fmaps.edit=[{_target_:math.pi}]", "+loss._target_=math"])).problems
    assert problems[-3:] == [
        "model._target_: 'math' is a module, not a function or class; check the dotted path and that its package "
        "is installed",
        "hooks.fmaps.edit[0]._target_: 'math.pi' is a float, not a function or class; give an importable function",
        "loss._target_: 'math' is a module, not a function or class; give fn(output, batch)"]
    nowhere = {"_target_": "nowhere.fn"}
    reason = "(Are you sure that module 'nowhere' is installed?)"
    assert check_target("model", nowhere) == [f"model._target_: 'nowhere.fn' does not import {reason}; check the "
                                              "dotted path and that its package is installed"]
    assert edits.check_spec("e", nowhere) == [f"e._target_: 'nowhere.fn' does not import {reason}; give an "
                                              "importable function"]
    assert losses.check_spec(nowhere) == [f"loss._target_: 'nowhere.fn' does not import {reason}; give "
                                          "fn(output, batch)"]
    assert losses.check_spec({"_target_": f"{__name__}.one_argument"})[0].startswith(
        f"loss: {__name__}.one_argument cannot be called as fn(output, batch) (too many positional arguments)")
    assert edits.check_spec("e", {"_target_": "tests.models.double", "roles": ["output"], "scale": 2}) == [
        "e: tests.models.double cannot be called as fn(tensor, scale) (got an unexpected keyword argument 'scale')"]


def test_a_missing_hook_kind_lists_the_kinds_of_the_capture_layer():
    problems = check(make_cfg(["+experiment=conv_fmaps", "+hooks.extra.layers=conv1"])).problems
    assert f"hooks.extra.kind: missing; set one of {', '.join(hooks.KINDS)}" in problems
    assert "forward_pre" not in (REPO / "hookrun" / "config" / "schema.py").read_text()
