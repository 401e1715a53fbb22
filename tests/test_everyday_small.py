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
@pytest.mark.slow
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


# -- torch's backward-hook warning, filtered where hookrun triggers it -------------------------------------------
WARNING_START = "Full backward hook is firing when gradients are computed with respect to module outputs"


def test_torch_warns_for_a_backward_hook_on_a_first_layer():
    """The control: plain PyTorch warns for a full backward hook on a layer whose input needs no gradient."""
    layer = torch.nn.Linear(3, 2)
    layer.register_full_backward_hook(lambda m, gi, go: None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        layer(torch.ones(1, 3)).sum().backward()
    assert any(str(w.message).startswith(WARNING_START) for w in seen)


def test_a_backward_hook_on_the_first_layer_runs_without_the_warning(run_cfg, npy):
    """kind: backward on fc1 (its input x needs no gradient): no torch warning, and grad_output.0 equals
    d sum(model(x)) / d fc1(x) from torch.autograd.grad on the same model; other warnings still show."""
    import numpy as np

    from tests.models import BUILT

    x = np.random.default_rng(0).standard_normal((8, 6)).astype("float32")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cap = run_cfg(["+model._target_=tests.models.tracked", "+model.name=first", "+model.cls=MLP",
                       f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=4", "loss=sum",
                       "+hooks.bw={kind: backward, layers: [fc1], capture: [grad_output]}"])
        warnings.warn("a warning of the user's own")
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if m.startswith(WARNING_START)]
    assert "a warning of the user's own" in messages  # the filter ended with the backward pass
    net, got = BUILT["first"], cap.load(layer="fc1", role="grad_output.0")
    for s in (0, 4):
        xb = torch.from_numpy(x[s:s + 4])
        out = net.fc1(xb)
        want = torch.autograd.grad(net.head(net.act2(net.fc2(net.act1(out)))).sum(), out)[0]
        np.testing.assert_allclose(got[s:s + 4], want.numpy(), rtol=1e-5, atol=1e-6)


# -- python -m hookrun --help ----------------------------------------------------------------------------------
def test_help_shows_hookrun_usage_first():
    """--help: hookrun's usage (experiments, --config-dir, the docs) above Hydra's groups and config, exit 0."""
    proc = run_cli("--help")
    out = proc.stdout
    assert out.startswith("hookrun: declarative PyTorch hook experiments."), out[:200]
    usage, groups, config = (out.index(s) for s in ("Usage:", "== Experiments (+experiment=NAME)", "== Config"))
    assert usage < groups < config
    assert "python -m hookrun --config-dir my_conf +experiment=mine" in out[:groups]
    experiments = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
    assert f"experiment: {', '.join(experiments)}" in out
    assert "python -m hookrun.config.table" in out and "mkdocs serve" in out
    assert "is powered by Hydra" not in out


# -- S3: a quiet log, a missing bucket named ----------------------------------------------------------------------
MLP = ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1],capture:[output]}",
       "+data.inputs.x={random:normal,shape:[8,6]}", "data.batch_size=4"]


@pytest.mark.slow
def test_s3_run_log_has_no_botocore_info_and_a_missing_bucket_is_a_config_error(s3, tmp_path):
    """A run on S3 logs no botocore/aiobotocore INFO line (console and run log); a store.path in a bucket that does
    not exist exits 2 before the model is built, naming the bucket."""
    proc = run_cli(*MLP, f"store.path={s3.url('quiet/captures.zarr')}", f"hydra.run.dir={tmp_path / 'a'}", env=s3.env)
    assert "botocore" not in proc.stdout + proc.stderr
    assert "hookrun][INFO] - captures: s3://" in (tmp_path / "a" / "__main__.log").read_text()
    assert "botocore" not in (tmp_path / "a" / "__main__.log").read_text()
    proc = run_cli(*MLP, "store.path=s3://no-such-bucket/runs/captures.zarr", f"hydra.run.dir={tmp_path / 'b'}",
                   env=s3.env, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("store.path: the bucket 'no-such-bucket' of s3://no-such-bucket/runs/captures.zarr does not exist; "
            "create it") in proc.stdout
    assert "The specified bucket does not exist" not in proc.stdout + proc.stderr


# -- the site: wide code blocks, the API page's public names ---------------------------------------------------
CODE_CHAR_REM = 0.8 * 0.85 * 0.6  # Material: text 0.8rem, code 0.85em of it, a monospace glyph ~0.6em wide
SIDEBARS_REM = 2 * 12.1 + 4  # navigation and table of contents, and the content's padding


def test_no_comment_in_a_docs_code_block_runs_past_110_characters():
    """A YAML, shell or Python line of the docs with a comment stays within 110 characters (a longer comment goes
    on its own line above the code): on a laptop's screen a longer line scrolls, and the comment is what is cut."""
    long = []
    for page in sorted((REPO / "docs").rglob("*.md")):
        inside, lang = False, ""
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith(("```", "~~~")):
                inside = not inside
                lang = line.lstrip().strip("`~ ") if inside else ""
            elif inside and lang in ("yaml", "bash", "sh", "python") and len(line) > 110 and "# " in line:
                long.append(f"{page.relative_to(REPO)}:{n} ({len(line)})")
    assert long == []


def test_the_longest_docs_code_line_fits_the_site_grid():
    """docs/stylesheets/extra.css (in mkdocs.yml's extra_css) widens Material's grid so that the longest line of any
    code block in docs/ fits beside the two sidebars (61rem, Material's own, left ~680 px and cut the comments)."""
    import yaml

    site = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert "stylesheets/extra.css" in site["extra_css"]
    css = (REPO / "docs" / "stylesheets" / "extra.css").read_text()
    width = float(re.search(r"\.md-grid\s*\{[^}]*max-width:\s*([\d.]+)rem", css)[1])
    longest, inside = 0, False
    for page in (REPO / "docs").rglob("*.md"):
        for line in page.read_text().splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                inside = not inside
            elif inside:
                longest = max(longest, len(line))
    assert longest > 100  # the docs do have long commented lines
    assert longest * CODE_CHAR_REM + SIDEBARS_REM <= width, f"{longest} characters need a wider .md-grid"
    assert 61 < width


@pytest.mark.slow
def test_api_page_shows_documented_public_names_only(tmp_path):
    """The built API page lists the documented names (Captures.status, .path, .load; Loader.set_epoch) and none of
    the internals without a docstring (Captures.location, .root; Loader.stores, .cuts) or private ones."""
    import subprocess
    import sys

    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr
    ids = set(re.findall(r'id="hookrun\.[\w.]+\.(\w+\.\w+)"', (tmp_path / "site/reference/api/index.html").read_text()))
    assert {"Captures.status", "Captures.path", "Captures.config", "Captures.load", "Loader.set_epoch"} <= ids
    assert not ids & {"Captures.location", "Captures.root", "Loader.stores", "Loader.cuts", "Loader.records"}
    assert not [i for i in ids if i.split(".")[1].startswith("_")]
