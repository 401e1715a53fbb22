"""Did-you-mean and hints that apply (issue 39): an unknown key inside a named hook on the command line gets the
hook's nearest keys, not Hydra's advice to add it with `+`; an unknown top-level key of an experiment file gets the
run's nearest keys; the `${...}` quoting hint only for an unquoted interpolation inside a flow mapping or list; a
device map asked to offload that offloads nothing says so."""
from hookrun.config.commandline import override_problems
from hookrun.config.yamlcheck import QUOTE_HINT, syntax_problem, yaml_problems
from tests.helpers import run_cli

EXPERIMENT = "# @package _global_\ndefaults:\n  - lm_tokens\n  - _self_\n"


def test_a_nested_typo_gets_the_nearest_keys_not_a_plus(tmp_path):
    [problem] = override_problems(["hooks.resid.layr=x"])
    assert problem.startswith("hooks.resid.layr: unknown key (did you mean: layers?); hooks.resid takes kind, layers")
    assert override_problems(["hooks.resid.layers=[a]", "hooks.new.kind=forward", "+hooks.new.kind=forward"]) == []
    done = run_cli("+experiment=lm_tokens", "hooks.resid.captur=[output]", cwd=tmp_path, check=False)
    assert done.returncode == 2 and "did you mean: capture?" in done.stderr and "+hooks" not in done.stderr + done.stdout


def test_an_unknown_top_level_key_of_an_experiment_gets_the_nearest(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text(EXPERIMENT + "hook:\n  resid: {kind: forward}\n")
    [problem] = yaml_problems(["+experiment=typo"], [tmp_path])
    assert problem.startswith(f"{tmp_path / 'experiment' / 'typo.yaml'}: hook: unknown key (did you mean: hooks?)")
    (tmp_path / "experiment" / "fine.yaml").write_text(EXPERIMENT + "hooks:\n  resid: {kind: forward}\n")
    assert yaml_problems(["+experiment=fine"], [tmp_path]) == []


def test_the_quoting_hint_only_for_an_interpolation_in_a_flow_mapping(tmp_path):
    flow = tmp_path / "flow.yaml"
    flow.write_text("sites: {layers: ${layers}, positions: all}\n")
    assert QUOTE_HINT in syntax_problem(flow)
    indent = tmp_path / "indent.yaml"
    indent.write_text("hooks:\n  resid:\n    kind: forward\n   layers: ${layers}\n")
    problem = syntax_problem(indent)
    assert problem.startswith(f"{indent}:4:4: YAML syntax error") and QUOTE_HINT not in problem


def test_an_offload_that_offloads_nothing_says_so():
    import torch

    from hookrun.engine.placement import offload_note

    model = torch.nn.Linear(2, 2)
    asked = {"_target_": "x", "device_map": "auto", "max_memory": {"cpu": "1GB", "disk": "10GB"}}
    model.hf_device_map = {"": "cpu"}
    accelerator = torch.cuda.is_available()
    note = offload_note(asked, model)
    assert (note is None) if accelerator else note.startswith(
        "model.device_map: offload asked for (cpu, disk), but every module was placed on cpu: nothing is offloaded")
    model.hf_device_map = {"weight": "cpu", "bias": "disk"}
    assert offload_note(asked, model) is None  # something went to disk
    assert offload_note({"_target_": "x", "device_map": "auto"}, model) is None  # no offload asked for
