"""hookrun.run / compose / sweep (hookrun/api.py): the same store as the CLI, a model already loaded used in place,
config errors as one ConfigError, overrides given as Python values."""
import signal
import textwrap

import numpy as np
import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from torch import nn

import hookrun
from hookrun.api import value_text
from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import causal_lm, tokenizer
from tests.helpers import REPO, make_cfg, run_cli, same_store

SMALL = ["data.max_samples=12", "data.batch_size=4"]  # lm_tokens on 12 documents: 3 batches


def hooks_left(model):
    """Every hook registered on the model's modules and parameters (empty: none left)."""
    found = [(name, kind) for name, m in model.named_modules() for kind in
             ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks") if getattr(m, kind)]
    found += [(name, "post_accumulate_grad") for name, p in model.named_parameters()
              if getattr(p, "_post_accumulate_grad_hooks", None)]
    return found


@pytest.mark.slow
def test_run_writes_the_clis_store_for_a_bundled_experiment(tmp_path, monkeypatch):
    run_cli("+experiment=lm_tokens", *SMALL, "layers=[transformer.h.1]", f"hydra.run.dir={tmp_path / 'cli'}")
    monkeypatch.chdir(tmp_path)
    cap = hookrun.run("lm_tokens", SMALL, layers=["transformer.h.1"], device="cpu")  # as run_cli's
    run_dirs = list((tmp_path / "outputs").glob("*/*"))  # a fresh outputs/<date>/<time> run dir, as the CLI's
    assert [p.name for p in run_dirs[0].iterdir()] == ["captures.zarr"] and cap.path == run_dirs[0] / "captures.zarr"
    cli = hookrun.open(tmp_path / "cli")
    same_store(cap, cli)
    assert cap.status == "complete" and len(cap.samples) == 12
    assert cap.config == cli.config and cap.attrs["overrides"] == cli.attrs["overrides"]
    assert cap.attrs["choices"] == cli.attrs["choices"]


USER_EXPERIMENT = '''
# @package _global_
defaults:
  - conv_fmaps              # a bundled experiment inherited
model:
  _target_: mymodels.Tiny   # mymodels.py in the working directory
  width: 3
data:
  inputs:
    fake_img: {fill: 2.0, shape: [2, 1, 4, 4]}
layers: [fc]
hooks:
  model_output: null
'''
USER_MODEL = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, width=2):
        super().__init__()
        self.fc = nn.Linear(16, width)
        with torch.no_grad():
            self.fc.weight.fill_(1.0)
            self.fc.bias.zero_()

    def forward(self, x):
        return self.fc(x.flatten(1))
'''


def test_run_with_a_users_config_dir_writes_the_clis_store(tmp_path, monkeypatch):
    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    (tmp_path / "my_conf" / "experiment" / "mine.yaml").write_text(textwrap.dedent(USER_EXPERIMENT).lstrip())
    (tmp_path / "mymodels.py").write_text(USER_MODEL)
    run_cli("--config-dir", "my_conf", "+experiment=mine", "hydra.run.dir=cli", cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cap = hookrun.run("mine", config_dir="my_conf", store={"path": "api.zarr"}, device="cpu")
    same_store(cap, hookrun.open(tmp_path / "cli"))
    np.testing.assert_array_equal(cap.load(layer="fc", role="output"), np.full((2, 3), 32.0))  # 16 x 2.0 summed
    assert cap.path.resolve() == tmp_path / "api.zarr"


def block_outputs(model, ids_per_sample, block):
    """Plain PyTorch: each sample's own forward (no padding), block `block`'s output per token, stacked."""
    rows = []
    handle = model.transformer.h[block].register_forward_hook(
        lambda m, a, out: rows.append((out[0] if isinstance(out, tuple) else out)[0].detach()))
    try:
        with torch.no_grad():
            for ids in ids_per_sample:
                model(torch.tensor([ids]))
    finally:
        handle.remove()
    return torch.cat(rows).numpy()


def test_a_model_in_memory_is_used_in_place(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(3)
    model = causal_lm(n_layer=2, n_embd=64, n_head=4).eval()
    model.transformer.h[1].train()  # mixed modes: each module's mode comes back as it was
    modes = {name: m.training for name, m in model.named_modules()}
    weight = model.transformer.wte.weight
    ptr = weight.data_ptr()
    cap = hookrun.run("lm_tokens", SMALL, model=model, tokenizer=tokenizer(), layers=["transformer.h.0"],
                      data={"text": {"tokenizer": None}})  # the tokenizer given, not the config's
    assert model.transformer.wte.weight is weight and weight.data_ptr() == ptr and weight.device.type == "cpu"
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert hooks_left(model) == [] and all(p.grad is None for p in model.parameters())
    assert cap.config["model"] is None and cap.config["data"]["text"]["tokenizer"] is None
    assert cap.attrs["model_given"] == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
    tokens = cap.tokens()
    ids = [g["token_id"].tolist() for _, g in tokens.groupby("sample", sort=True)]
    model.eval()  # the run was in eval mode (mode=eval), so the plain forward is too
    expected = block_outputs(model, ids, 0)
    got = cap.load(layer="transformer.h.0", role="output")
    assert got.shape == expected.shape == (len(tokens), 64)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


class Boom(nn.Module):
    """Linear(4, 3) whose forward fails on its call `at` (`error` raised, or SIGINT sent to this process)."""

    def __init__(self, at, error=None):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.calls, self.at, self.error = 0, at, error

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            if self.error is None:
                signal.raise_signal(signal.SIGINT)
            raise self.error
        return self.fc(x)


BOOM = ["+data.inputs.x={random:normal,shape:[12,4]}", "data.batch_size=4", "loss=sum",
        "+hooks.h={kind:forward,layers:[fc],capture:[output]}", "+hooks.g={kind:output_grad,layers:[fc]}"]


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt(), None], ids=["error", "keyboard", "sigint"])
def test_no_hook_left_and_modes_kept_after_a_failing_run(tmp_path, error):
    model = Boom(at=3, error=error).train()  # batch 1 (the first batch is checked first: call 1), then batch 2 fails
    model.fc.eval()
    with pytest.raises(RuntimeError if isinstance(error, RuntimeError) else KeyboardInterrupt):
        hookrun.run(None, BOOM, model=model, store={"path": str(tmp_path / "s.zarr")}, mode="train")
    assert model.calls == 3 and hooks_left(model) == []
    assert model.training and not model.fc.training and model.fc.weight.grad is None
    assert hookrun.open(tmp_path / "s.zarr").status == ("failed" if isinstance(error, RuntimeError) else
                                                         "interrupted" if error is None else "failed")


def test_gradients_of_a_training_run_match_autograd_and_are_not_left_on_the_model(tmp_path):
    model = Boom(at=0).train()
    cap = hookrun.run(None, BOOM, model=model, store={"path": str(tmp_path / "s.zarr")}, mode="train")
    x = torch.as_tensor(cap.load(layer="fc", role="output"))  # forward outputs; loss=sum: d loss/d output = 1
    np.testing.assert_array_equal(cap.load(hook="g", layer="fc"), np.ones_like(x.numpy()))
    assert hooks_left(model) == [] and model.fc.weight.grad is None


def test_config_errors_are_one_configerror_with_the_clis_messages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = ["data.batch_size=0", "seed=-1", "device=gpu"]
    with pytest.raises(ConfigError) as err:
        hookrun.run("lm_tokens", bad)
    problems = err.value.problems
    assert any(p.startswith("seed: -1 is too small") for p in problems)
    assert any(p.startswith("device: 'gpu' is not a device") for p in problems)
    assert any(p.startswith("data.batch_size: 0") for p in problems)
    (tmp_path / "cli").mkdir()  # (Hydra makes the CLI's run dir before the checks)
    proc = run_cli("+experiment=lm_tokens", *bad, cwd=tmp_path / "cli", check=False)
    assert proc.returncode == 2 and str(err.value) in proc.stdout  # the CLI logs the same message (stdout)
    with pytest.raises(ConfigError) as err:  # Hydra's own errors and unknown keys too
        hookrun.run("no_such_experiment")
    assert "Could not find 'experiment/no_such_experiment'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        hookrun.run("lm_tokens", ["store.codex=zstd", "data.batch_sise=2"])
    assert [p.split(":")[0] for p in err.value.problems] == ["store.codex", "data.batch_sise"]
    with pytest.raises(ConfigError) as err:  # a dict merged into a typed block: Hydra names the key
        hookrun.run("lm_tokens", data={"batch_sise": 2})
    assert "batch_sise" in str(err.value)
    assert not (tmp_path / "outputs").exists()  # nothing written


def test_model_and_a_model_override_refused_before_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = causal_lm()
    for overrides in (["model._target_=mymodels.Other"], ["+model._target_=x.Y"], ["model.n_layer=3"]):
        with pytest.raises(ConfigError) as err:
            hookrun.run("lm_tokens", overrides, model=model)
        key = overrides[0].lstrip("+").split("=")[0]
        assert err.value.problems[0].startswith(f"{key}: given as an override, but model= passes a model")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("value", [["conv1"], "re:transformer\\.h\\.\\d+", "a'b", "back\\", "x\\'y", "true", "1",
                                   "a b", "${layers}", "", 2.5, -3, None, False, {"x": [1, 2.5, None, True, "a,b"]},
                                   ["transformer.h.0", "re:x\\d"], "/abs/path.txt", "pkg://hookrun.experiments/d.txt"])
def test_python_values_read_back_as_overrides(value):
    assert OverridesParser.create().parse_override(f"k={value_text(value)}").value() == value
    assert value_text(["conv1"]) == "[conv1]"


def test_compose_returns_the_typed_config():
    cfg = hookrun.compose("lm_tokens", ["data.batch_size=3"], layers=["transformer.h.1"])
    assert cfg.data.batch_size == 3 and cfg.hooks["resid"].layers == ["transformer.h.1"]
    assert cfg.data.text.max_length == 64 and cfg.model["n_layer"] == 2
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        assert hookrun.compose("conv_fmaps", layers=["conv1"]).layers == ["conv1"]  # inside a Hydra app's own
        assert hydra_compose("config", ["+experiment=lm_tokens"]).data.batch_size == 8  # the app's Hydra intact
    assert make_cfg(["+experiment=lm_tokens"]).data.batch_size == 8


@pytest.mark.slow
def test_sweep_runs_one_job_per_value_with_the_model_reused(tmp_path):
    torch.manual_seed(0)
    model = causal_lm().eval()
    layers = [["transformer.h.0"], ["transformer.h.1"]]
    df = hookrun.sweep("lm_tokens", {"layers": layers}, SMALL, model=model, sweep_dir=tmp_path / "sw",
                       with_index=False)
    assert df["layers"].tolist() == layers and df["job"].tolist() == ["0", "1"]
    assert (df["status"] == "complete").all() and df.attrs["sweep_dir"] == str(tmp_path / "sw")
    assert hooks_left(model) == []
    for job, layer in ((0, 0), (1, 1)):
        cap = hookrun.open(tmp_path / "sw" / str(job))
        ids = [g["token_id"].tolist() for _, g in cap.tokens().groupby("sample", sort=True)]
        np.testing.assert_allclose(cap.load(layer=f"transformer.h.{layer}", role="output"),
                                   block_outputs(model, ids, layer), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_notebook_page_runs_on_a_fresh_kernel(tmp_path):
    """docs/notebook.md (jupytext markdown) made a notebook and executed by nbclient in a fresh kernel."""
    import jupytext
    import nbclient

    nb = jupytext.read(REPO / "docs" / "notebook.md")
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    pictures = [c.source for c in code if any("image/png" in o.get("data", {}) for o in c.outputs)]
    assert [s.split("(")[0] for s in pictures] == ["plot.text", "plot.patching_grid", "plot.steering"]
    html = [o["data"]["text/html"] for c in code for o in c.outputs if "text/html" in o.get("data", {})]
    assert "resid/blocks.1/output" in html[0] and html[1].startswith("<div><b>PatchGrid ld")
    streams = {name: "".join(o.get("text", "") for o in code[1].outputs if o.get("name") == name)
               for name in ("stdout", "stderr")}  # the first capture's cell: the CLI's summary, and the bar
    assert "[hookrun][INFO] - captures: " in streams["stdout"] and "resid blocks.1 output" in streams["stdout"]
    assert "hookrun: 100%" in streams["stderr"] and "1/1" in streams["stderr"]
    happy = hookrun.open(tmp_path / "runs" / "steer_happy")
    assert happy.status == "complete" and len(happy.samples) == 8
    grid = hookrun.open(tmp_path / "runs" / "grid").grid()  # patching the subject's embedding restores the clean
    subject = grid.labels.index(2)  # run exactly: <|endoftext|> The <subject> was
    np.testing.assert_allclose(grid.normalised()[:, grid.layers.index("blocks.0.resid_pre"), subject], 1.0, atol=1e-5)
    jobs = hookrun.collect(tmp_path / "runs" / "steer_sweep", with_index=False)
    assert jobs["hooks.steer.edit.0.coef"].tolist() == [-8, -4, 0, 4, 8] and (jobs["status"] == "complete").all()
