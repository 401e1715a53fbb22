"""The smaller everyday items of issue 32: the eager-attention hint, interrupt and resume naming the same batches,
botocore quiet in the run log, a missing S3 bucket as a config error, hookrun's own --help, the torch backward-hook
warning filtered, the site's wide code blocks and the API page's public names."""
import logging
import re
import warnings

import pytest
import torch

import hookrun
from hookrun.engine.runner import Interrupted, run
from tests.helpers import RANDOM, REPO, make_cfg, run_cli


# -- interrupt and resume name the same batch ---------------------------------------------------------------
class StopAfterEndBatch:
    """HeapTrimmer's stand-in: raises Interrupted(SIGTERM) right after batch `at` was handed to the store and
    before the loop counted it (the window a signal hit on S3, where end_batch blocks longest)."""

    at = 2

    def __init__(self):
        self.seen = 0

    def between_batches(self):
        self.seen += 1
        if self.seen == self.at + 1:
            raise Interrupted(15)


def test_interrupt_and_resume_name_consecutive_batches(tmp_path, monkeypatch, caplog):
    """Stopped right after batch 2 reached the store: the message says `after batch 2` (batch 2 is committed), and
    the resume says `starting at batch 3` and stores the same 24 samples as an uninterrupted run."""
    import hookrun.engine.runner as runner

    path = tmp_path / "run.zarr"
    monkeypatch.setattr(runner, "HeapTrimmer", StopAfterEndBatch)
    with caplog.at_level(logging.INFO, logger="hookrun"), pytest.raises(Interrupted):
        run(make_cfg([*RANDOM, f"store.path={path}"]))
    stopped = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("interrupted by"))
    assert stopped.startswith("interrupted by SIGTERM after batch 2: finished batches are committed"), stopped
    assert sorted(hookrun.open(path).index.batch.unique()) == [0, 1, 2]
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hookrun"):
        run(make_cfg([*RANDOM, f"store.path={path}", "store.mode=resume"]))
    resumed = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming"))
    assert resumed.endswith("after its last committed batch: starting at batch 3"), resumed
    cap = hookrun.open(path)
    assert cap.status == "complete" and sorted(cap.index.batch.unique()) == [0, 1, 2, 3, 4, 5]
    assert len(cap.samples) == 24


# -- attention patterns need eager attention ----------------------------------------------------------------
def test_attention_pattern_on_sdpa_names_eager(tmp_path):
    """An attention pattern (output.1) asked of an SDPA GPT-2 block: refused before any batch is stored (exit 2),
    with the fix `attn_implementation: eager`."""
    common = ["+experiment=lm_tokens", "model.n_layer=1", "data.max_samples=4", "data.text.max_length=16",
              "+hooks.attn={kind: forward, layers: [transformer.h.0.attn], capture: [output.1]}"]
    proc = run_cli(*common, "+model.attn_implementation=sdpa", f"hydra.run.dir={tmp_path / 'sdpa'}", check=False)
    out = proc.stdout + proc.stderr  # the log goes to stdout
    assert proc.returncode == 2, out
    assert "hooks.attn.capture: 'output.1' is not a role transformer.h.0.attn produced in the first batch" in out
    assert "give the model `attn_implementation: eager`" in out
    assert not (tmp_path / "sdpa" / "captures.zarr").exists()


def test_eager_hint_only_for_attention_modules():
    """The hint is for attention modules' extra outputs, not a plain layer's missing role."""
    from hookrun.engine.preflight import _attention_pattern

    assert _attention_pattern("output.1", ["model.layers.0.self_attn"])
    assert _attention_pattern("output.1", ["transformer.h.3.attn"])
    assert not _attention_pattern("output.1", ["fc1"])
    assert not _attention_pattern("output.0", ["transformer.h.3.attn"])
