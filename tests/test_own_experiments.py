"""A user's own experiments: a config dir of their own, models from the working directory, vars, null hooks."""
import textwrap

import numpy as np
import pytest
from hydra.errors import ConfigCompositionException

import hookrun
from tests.helpers import make_cfg, run_cli

MODEL = '''
"""A user's own model, importable from the working directory."""
import torch
from torch import nn


class Tiny(nn.Module):
    """Flatten, then Linear(16, width) with every weight 1 and bias 0: each output is the input's sum."""

    def __init__(self, width=2):
        super().__init__()
        self.fc = nn.Linear(16, width)
        with torch.no_grad():
            self.fc.weight.fill_(1.0)
            self.fc.bias.zero_()

    def forward(self, x):
        return self.fc(x.flatten(1))
'''

EXPERIMENT = '''
# @package _global_
# My experiment: conv_fmaps' inputs and hooks, on my own model.
defaults:
  - conv_fmaps              # inherit a bundled experiment (hookrun/conf/experiment/conv_fmaps.yaml)

vars:
  width: 3                  # my own variable, used below
  fill: 2.0                 # another one

model:
  _target_: mymodels.Tiny   # mymodels.py in the working directory
  width: ${vars.width}

data:
  inputs:
    fake_img: {fill: "${vars.fill}", shape: [1, 1, 4, 4]}

layers: [fc]                # what the inherited `fmaps` hook targets

hooks:
  model_output: null        # drop a hook conv_fmaps declares
'''


@pytest.fixture
def user_dir(tmp_path):
    """A working directory as a user has it: mymodels.py and my_conf/experiment/mine.yaml."""
    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODEL))
    (tmp_path / "my_conf" / "experiment" / "mine.yaml").write_text(textwrap.dedent(EXPERIMENT).lstrip())
    return tmp_path


def test_own_config_dir_model_vars_and_null_hook_from_the_cli(user_dir):
    run_cli("--config-dir", "my_conf", "+experiment=mine", "hydra.run.dir=run", cwd=user_dir)
    cap = hookrun.open(user_dir / "run")
    assert sorted(set(cap.index.hook)) == ["fmaps"]  # model_output: null removed the inherited hook
    np.testing.assert_array_equal(cap.load(layer="fc", role="output"), [[32.0, 32.0, 32.0]])  # 16 x 2.0, width 3
    assert cap.config["vars"] == {"width": 3, "fill": 2.0}
    assert cap.config["model"] == {"_target_": "mymodels.Tiny", "width": 3}


def test_searchpath_and_unknown_keys_in_a_users_yaml(user_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(user_dir))
    cfg = make_cfg(["+experiment=mine", f"hydra.searchpath=[file://{user_dir / 'my_conf'}]"])
    assert cfg.model.width == 3 and cfg.hooks.model_output is None and list(cfg.layers) == ["fc"]
    bad = user_dir / "my_conf" / "experiment" / "bad.yaml"
    bad.write_text("# @package _global_\nclean_run: true\n")
    with pytest.raises(ConfigCompositionException) as err:
        make_cfg(["+experiment=bad", f"hydra.searchpath=[file://{user_dir / 'my_conf'}]"])
    assert "Key 'clean_run' not in 'RunConfig'" in str(err.value.__cause__ or err.value)


def test_vars_interpolate_and_null_removes_a_hook(run_cfg):
    cap = run_cfg(["+experiment=conv_fmaps", "+vars.ones=3.0", "data.inputs.fake_img.fill=${vars.ones}",
                   "hooks.model_output=null"])
    assert sorted(set(cap.index.hook)) == ["fmaps"]
    fmap = cap.load(layer="conv1", role="output")
    assert fmap[0, 0].ravel().tolist() == [27.0] * 4 and fmap[0, 1].ravel().tolist() == [54.0] * 4


def test_every_hook_null_is_an_empty_hooks_error(run_cfg):
    from hookrun.config.checks import ConfigError

    with pytest.raises(ConfigError, match=r"hooks: empty \(or every entry null\)"):
        run_cfg(["+experiment=conv_fmaps", "hooks.model_output=null", "hooks.fmaps=null"])
