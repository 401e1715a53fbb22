"""Small truths: the summary's numbers, gradient rows in forward order, parsed sweep values, inspect leaves nothing."""
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from hookrun.engine import summary
from hookrun.read.captures import override_columns
from hookrun.engine.inspect import describe, discard_run_dir
from tests.helpers import run_cli, run_here
from tests.models import MLP


def test_compression_is_said_in_words_that_cannot_be_misread():
    assert summary.compression(1900, 1000) == "stored/raw: 1.9x smaller"
    assert summary.compression(100, 2500).startswith("stored is 25.0x larger than raw")
    assert summary.compression(0, 0) == "nothing stored"
    assert summary.compression(1105408, 1106113) == "stored within 5% of raw (+0.1%: not compressed; checksums and metadata)"
    assert summary.compression(1000, 988).startswith("stored within 5% of raw (-1.2%")
    timing = dict(wall_s=2.0, loop_s=1.5, forward_s=1.0, backward_s=0.25, capture_s=0.125, write_s=2.5)
    arrays = [dict(hook="a", layer="l", role="output", calls=2, shape=[10, 4], dtype="float32", raw_bytes=320,
                   stored_bytes=100)]
    text = summary.text("x.zarr", arrays, timing, 10, "thread")
    assert "10 samples; 0.00 MB raw, 0.00 MB stored: stored/raw: 3.2x smaller" in text
    assert ("wall 2.000 s: loop 1.500 s (forward 1.000 s, backward 0.250 s, hooks 0.125 s) + closing the store "
            "0.500 s; writer thread busy 2.500 s in the background") in text
    assert "writing 2.500 s inside the hooks (sync writer)" in summary.text("x.zarr", arrays, timing, 10, "sync")


def test_summary_of_a_run(run_cfg, npy, caplog):
    x = np.zeros((64, 6), dtype="float32")  # zeros compress well
    with caplog.at_level(logging.INFO, logger="hookrun"):
        run_cfg(["+model._target_=tests.models.MLP", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=16",
                 "+hooks.a.kind=forward", "+hooks.a.layers=fc1", "store.writer=thread"])
    text = caplog.text
    assert "ratio" not in text
    assert "64 samples; " in text and "stored/raw: " in text and "x smaller" in text
    assert "writer thread busy" in text and "in the background" in text
    wall = float(text.split("wall ")[1].split(" s")[0])
    loop = float(text.split("loop ")[1].split(" s")[0])
    closing = float(text.split("closing the store ")[1].split(" s")[0])
    assert abs(wall - loop - closing) < 2e-3 and loop <= wall


def test_writer_seconds_by_stage_are_cpu_and_wall(run_cfg, npy):
    x = np.random.default_rng(0).standard_normal((256, 6)).astype("float32")
    cap = run_cfg(["+model._target_=tests.models.MLP", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=16",
                   "+hooks.a.kind=forward", "+hooks.a.layers=[fc1,fc2]", "store.chunk_rows=32"])
    summary = cap.attrs["summary"]
    stages = summary["writer_stages_s"]
    assert {"statistics", "encode", "write", "index commits", "close: verify"} <= set(stages["cpu"])
    assert set(stages["cpu"]) == set(stages["wall"])
    # one thread's CPU time never exceeds the clock (1 ms of slack for the two clocks' granularity)
    assert all(0 <= stages["cpu"][k] <= stages["wall"][k] + 1e-3 for k in stages["cpu"])
    assert 0 < summary["write_cpu_s"] <= summary["write_s"] + 1e-3


def test_gradient_rows_are_in_forward_order_in_the_merged_index(run_cfg, npy):
    x = np.random.default_rng(3).standard_normal((8, 6)).astype("float32")
    layers = "[fc1,act1,fc2,head]"  # forward order; not alphabetical
    cap = run_cfg(["+model._target_=tests.models.MLP", f"+data.inputs.x={{file: '{npy('x', x)}'}}", "data.batch_size=4",
                   "loss=sum", "+hooks.og.kind=output_grad", f"+hooks.og.layers={layers}",
                   "+hooks.bw.kind=backward", "+hooks.bw.layers=[fc1,fc2]", "+hooks.pg.kind=param_grad",
                   "+hooks.pg.layers=[fc1.weight,fc2.weight,head.weight]",
                   "+hooks.fw.kind=forward", f"+hooks.fw.layers={layers}"])
    idx = cap.index
    for b in (0, 1):
        assert idx[(idx.hook == "og") & (idx.batch == b)].layer.tolist() == ["fc1", "act1", "fc2", "head"]
        assert idx[(idx.hook == "fw") & (idx.batch == b)].layer.tolist() == ["fc1", "act1", "fc2", "head"]
        assert idx[(idx.hook == "pg") & (idx.batch == b)].layer.tolist() == ["fc1.weight", "fc2.weight", "head.weight"]
        bw = idx[(idx.hook == "bw") & (idx.batch == b)]
        assert list(zip(bw.layer, bw.role)) == [("fc1", "grad_input.0"), ("fc1", "grad_output.0"),
                                                ("fc2", "grad_input.0"), ("fc2", "grad_output.0")]
    assert idx.batch.is_monotonic_increasing


def test_collect_parses_swept_values_as_hydra_does():
    cols = override_columns(["layers=conv1", "+experiment=conv_fmaps", "data.batch_size=64", "x=[1,2]",
                              "lr=0.5", "name='64'", "z=null", "~hooks.model_output"])
    assert cols == {"layers": "conv1", "experiment": "conv_fmaps", "data.batch_size": 64, "x": [1, 2], "lr": 0.5,
                    "name": "64", "z": None}
    assert type(cols["data.batch_size"]) is int


def test_inspect_says_params_are_a_modules_own_and_gives_the_total():
    text = describe(MLP(), [torch.zeros(2, 6)], {})
    lines = text.splitlines()
    assert "params: the module's own parameter values, not its submodules'; the model's total is below" in lines[0]
    assert lines[2].split()[:3] == ["_model", "MLP", "0"] and lines[3].split()[:3] == ["fc1", "Linear", str(6 * 8 + 8)]
    assert f"6 parameters, {6 * 8 + 8 + 8 * 8 + 8 + 8 * 3 + 3} values in all" in text


def test_inspect_run_dir_is_removed_only_when_hydra_alone_wrote_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "2026-11-22" / "10-00-00"
    (run / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text("{}")
    (run / "__main__.log").write_text("")
    assert discard_run_dir(run) and not (tmp_path / "outputs").exists()  # empty parents below cwd go too
    named = tmp_path / "named"  # hydra.run.dir=named: may hold an earlier run's files, left as it is
    (named / ".hydra").mkdir(parents=True)
    (named / ".hydra" / "config.yaml").write_text("{}")
    (named / "__main__.log").write_text("")
    assert not discard_run_dir(named, keep_dir=True)
    assert sorted(p.name for p in named.rglob("*")) == [".hydra", "__main__.log", "config.yaml"]
    old = tmp_path / "old"  # an earlier run's log in the dir: not this launch's to delete
    (old / ".hydra").mkdir(parents=True)
    (old / "__main__.log").write_text("yesterday")
    import time
    assert not discard_run_dir(old, since=time.time() + 1) and (old / "__main__.log").read_text() == "yesterday"
    kept = tmp_path / "kept"
    (kept / ".hydra").mkdir(parents=True)
    (kept / "captures.zarr").mkdir()
    assert not discard_run_dir(kept) and (kept / "captures.zarr").exists()


def test_inspect_from_the_cli_leaves_no_output_dir(tmp_path):
    proc = run_cli("+experiment=conv_fmaps", "inspect=true", cwd=tmp_path)
    assert "params: the module's own parameter values" in proc.stdout and "20 values in all" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no outputs/<date>/<time>


def test_the_heap_trimmer_lifts_glibcs_thresholds_so_freed_blocks_are_reused_without_page_faults():
    """A batch's few-MB tensors, freed and made again, fault their pages in again while glibc's thresholds are at
    their start (each is mapped and unmapped, or the heap's top given back); after the trimmer lifted them (as
    the runner makes one), they reuse the heap's pages. A fresh process, with page faults counted by the kernel."""
    code = """
import resource, sys
import numpy as np
from hookrun.engine import heap
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        blocks = [np.ones(3 * 2**18, dtype=np.float32) for _ in range(4)]  # 3 MB each, written
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
if heap.HeapTrimmer().trim is None:
    sys.exit(3)
print(faults())
"""
    first = subprocess.run([sys.executable, "-c", code.replace("if heap", "print(faults())\nif heap")],
                           capture_output=True, text=True, timeout=120)
    if first.returncode == 3:
        pytest.skip("no glibc here")
    assert first.returncode == 0, first.stderr
    before, after = map(int, first.stdout.split())
    pages = 10 * 4 * 3 * 2**20 // 4096  # every page of every block, made 10 times
    assert before > pages // 2, (before, after)  # faulted in nearly every time at glibc's start
    assert after < pages // 5, (before, after)  # reused: the first round's pages (a quarter of them all)


def test_heap_trimmer_gives_memory_back_at_most_every_interval(monkeypatch):
    """Between batches the runner returns freed C heap to the OS (glibc malloc_trim), at most every every_s, and
    after a costly call only once the main thread has run 100 x its CPU seconds."""
    from hookrun.engine import heap

    calls = []
    trimmer = heap.HeapTrimmer(every_s=0.05)
    if trimmer.trim is None:
        pytest.skip("no glibc malloc_trim here")
    assert trimmer.trim(0) in (0, 1)  # the real function answers whether it released memory
    cpu = [0.0]  # the main thread's CPU seconds, each trim taking 10 ms of them
    monkeypatch.setattr(heap.time, "thread_time", lambda: cpu[0])
    trimmer = heap.HeapTrimmer(every_s=0.05)
    trimmer.trim = lambda pad: calls.append(pad) or cpu.__setitem__(0, cpu[0] + 0.01)
    trimmer.between_batches()  # too soon after the start
    assert calls == []
    time.sleep(0.06)
    trimmer.between_batches()
    trimmer.between_batches()  # too soon after the last call
    assert calls == [0] and trimmer.calls == 1 and trimmer.wait == pytest.approx(1.0)
    time.sleep(0.06)
    cpu[0] += 0.5
    trimmer.between_batches()  # past every_s, but only half the CPU seconds the last call's cost set
    assert trimmer.calls == 1
    cpu[0] += 0.5
    trimmer.between_batches()
    assert calls == [0, 0] and trimmer.calls == 2
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda *a, **k: (_ for _ in ()).throw(OSError("no libc")))
    assert heap.HeapTrimmer().trim is None
    heap.HeapTrimmer().between_batches()  # a no-op without glibc


@pytest.mark.slow
def test_progress_is_logged_when_stderr_is_not_a_terminal(tmp_path):
    """| tee, nohup and SLURM logs see where a run is: a progress line (batch, samples, rates, ETA) every progress_s."""
    from tests.helpers import run_cli

    out = run_cli("+experiment=lm_tokens", "progress_s=0.000001", "data.batch_size=20",
                  f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert out.returncode == 0, out.stderr
    logged = out.stdout + out.stderr  # Hydra's log handler writes to stdout
    lines = [line.split("progress: ")[1] for line in logged.splitlines() if "progress: " in line]
    assert len(lines) == 4  # 78 documents in batches of 20
    assert lines[0].startswith("batch 1/4 (25%), 20 samples, ") and "tokens/s, " in lines[0] and "ETA 0:00:0" in lines[0]
    assert lines[-1].startswith("batch 4/4 (100%), 78 samples, ") and lines[-1].endswith("ETA 0:00:00")
    assert "store.writer=auto" not in logged  # the writer's choice is no news on every run


def test_negative_progress_interval_is_refused(tmp_path):
    from tests.helpers import run_cli

    out = run_cli("+experiment=lm_tokens", "progress_s=-1", f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert out.returncode == 2
    assert "progress_s: -1.0 is too small; give a number in [0, 1_000_000] (seconds between progress lines" in out.stdout + out.stderr


@pytest.mark.slow
def test_inspect_into_a_closed_pipe_exits_cleanly_and_leaves_nothing(tmp_path):
    """`python -m hookrun ... inspect=true | head`: the reader closing the pipe is not a failure, and inspect
    leaves no run dir behind."""
    from tests.helpers import REPO

    proc = subprocess.Popen([sys.executable, "-m", "hookrun", "+experiment=lm_tokens", "inspect=true"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "documents truncated" in proc.stdout.readline().decode()  # head -1: the log line before the listing
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, stderr
    assert "Traceback" not in stderr and "run failed" not in stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_missing_pretrained_folder_is_said_at_once(tmp_path):
    """A wrong local model or tokenizer path is a config error naming it, before Hugging Face tries the hub for it."""
    from tests.helpers import run_cli

    started = time.perf_counter()
    out = run_cli("+experiment=lm_tokens", "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
                  "+model.pretrained_model_name_or_path=./my-llama", "~model.n_layer", "~model.n_embd",
                  "~model.n_head", "~model.vocab_size", "~model.n_positions",
                  "data.text.tokenizer._target_=transformers.AutoTokenizer.from_pretrained",
                  "~data.text.tokenizer.vocab_size", "+data.text.tokenizer._args_=[/no/such/tok]",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False, env={"HF_HUB_OFFLINE": "0"})
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert f"model.pretrained_model_name_or_path: './my-llama' is not a folder; give the folder save_pretrained " \
           f"wrote (absolute, or relative to the directory you run from: {tmp_path})" in text
    assert "data.text.tokenizer._args_[0]: '/no/such/tok' is not a folder" in text
    assert time.perf_counter() - started < 60 and not (tmp_path / "run" / "captures.zarr").exists()


def test_a_model_needing_a_missing_package_says_what_to_install(tmp_path):
    """A model factory importing a package that is not installed: exit 2 with the pip line, not a traceback."""
    from tests.helpers import run_cli

    out = run_cli("+model._target_=tests.test_truths.needs_missing_package", "+data.inputs.x={random:normal,shape:[2,6]}",
                  "+hooks.acts={kind:forward,layers:[_model]}",  # a config without model-free problems: the model is built
                  f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert ("model: building tests.test_truths.needs_missing_package needs the module 'transformers', which is not "
            "installed; pip install \"hookrun[lm]\"") in out.stdout + out.stderr


def needs_missing_package():
    raise ModuleNotFoundError("No module named 'transformers'", name="transformers")


def test_a_batch_seed_on_the_cpu_draws_what_torch_manual_seed_draws():
    """seed_everything seeds torch's CPU generator alone where torch has no accelerator (no lazy seeds queued):
    the draws equal torch.manual_seed's, and numpy's and random's are seeded too."""
    import random

    from hookrun.data.inputs import seed_everything

    seed_everything(7)
    ours = (torch.rand(4), np.random.rand(2), random.random())
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    theirs = (torch.rand(4), np.random.rand(2), random.random())
    assert torch.equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1]) and ours[2] == theirs[2]


def test_token_texts_are_decoded_once_a_tokenizer_definition_across_runs(monkeypatch, tmp_path):
    """The runs of one process share the decoded token texts of tokenizers built alike (a config's tokenizer is a new
    object each run: the second run decodes no token), keyed by the tokenizer's digest, which is also the store's
    fingerprint of it; the anchor token is looked up in a tokenizer's vocabulary once, not once a batch."""
    import collections

    import hookrun
    from hookrun.capture import tokens
    from hookrun.capture.tokens import decoded_texts, tokenizer_digest
    from hookrun.format.tokens import token_texts
    from hookrun.data import text
    from hookrun.experiments.lm import tokenizer

    tok, same, other = tokenizer(), tokenizer(), tokenizer()
    other.add_tokens(["zzqx"])
    assert tokenizer_digest(tok) == tokenizer_digest(same) != tokenizer_digest(other)
    assert decoded_texts(tok, tokenizer_digest(tok)) is decoded_texts(same, tokenizer_digest(same))
    assert decoded_texts(other, tokenizer_digest(other)) is not decoded_texts(tok, tokenizer_digest(tok))
    assert decoded_texts(None, None) == {} and decoded_texts(None, None) is not decoded_texts(None, None)

    class Bare:  # a tokenizer without a vocabulary to digest: its own texts, by object
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)
    bare, twin = Bare(), Bare()
    assert tokenizer_digest(bare) == tokenizer_digest(twin)
    assert decoded_texts(bare, tokenizer_digest(bare)) is decoded_texts(bare, tokenizer_digest(bare))
    assert decoded_texts(twin, tokenizer_digest(twin)) is not decoded_texts(bare, tokenizer_digest(bare))
    calls = []
    vocab = tok.get_vocab
    monkeypatch.setattr(tok, "get_vocab", lambda: calls.append(1) or vocab())
    first = token_texts(tok, [5, 100, 200])
    assert token_texts(tok, [5, 100, 200]) == first == [tok.decode([i]) for i in (5, 100, 200)] and len(calls) == 1

    monkeypatch.setattr(tokens, "_DECODED", collections.OrderedDict())
    decoded = []
    monkeypatch.setattr(text, "token_texts", lambda t, ids: decoded.append(len(ids)) or token_texts(t, ids))
    overrides = ["+experiment=lm_tokens", "data.max_samples=8", "progress_s=0"]
    runs = [run_here(tmp_path / str(i), *overrides) for i in range(2)]
    table = hookrun.open(runs[1]).tokens()
    assert sum(decoded) == table.token_id.nunique() and len(decoded) >= 1  # the first run only
    assert table.token.tolist() == token_texts(tok, table.token_id.tolist())
    assert hookrun.open(runs[1]).attrs["inputs"]["tokenizer"] == {"definition": tokenizer_digest(tok)}
