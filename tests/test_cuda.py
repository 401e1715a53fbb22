"""The CUDA path (pinned non-blocking copies, events in the writer): captures equal the CPU run's. Needs a GPU."""
import numpy as np
import pytest
import torch

from hookrun.format.layout import parse_key
from tests.helpers import REPO, run_here

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_captures_equal_cpu(run_cfg, npy, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # compare full float32 maths
    x = np.random.default_rng(7).standard_normal((37, 3, 6, 6)).astype("float32")
    y = np.random.default_rng(8).integers(0, 5, 37)
    base = ["+model._target_=tests.models.CNN", f"+data.inputs.x={{file: '{npy('x', x)}'}}",
            f"+data.inputs.label={{file: '{npy('y', y)}'}}", "data.targets=[label]", "data.batch_size=8",
            "loss=cross_entropy", "+hooks.a={kind:forward,layers:[conv1,conv2],capture:[input,output]}",
            "+hooks.g={kind:output_grad,layers:[conv1,conv2]}", "+hooks.p={kind:param_grad,layers:['*.weight']}",
            "+hooks.h={kind:forward,layers:conv2,dtype:bfloat16}"]
    cpu = run_cfg([*base, "device=cpu"], name="cpu")
    gpu = run_cfg([*base, "device=cuda"], name="gpu")
    assert gpu.attrs["device"].startswith("cuda")
    for key in cpu.index.array.unique():
        hook, layer, role = parse_key(key)
        np.testing.assert_allclose(gpu.load(hook=hook, layer=layer, role=role),
                                   cpu.load(hook=hook, layer=layer, role=role), rtol=1e-3, atol=1e-4, err_msg=key)
    # statistics computed on the GPU (stats.device_sums) against numpy's in the CPU run
    columns = ["mean", "std", "min", "max"]
    np.testing.assert_allclose(gpu.index[columns].to_numpy(float), cpu.index[columns].to_numpy(float),
                               rtol=1e-3, atol=1e-4)
    assert gpu.index[["nan_count", "inf_count", "numel"]].equals(cpu.index[["nan_count", "inf_count", "numel"]])


def test_cuda_captures_before_in_place_ops_and_with_a_busy_model_stream(run_cfg, npy, monkeypatch):
    """Side-stream copies read a snapshot taken in the hook: ReLU(inplace=True) right after the captured
    conv does not reach the stored values, in both writer modes."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x = np.random.default_rng(9).standard_normal((64, 3, 6, 6)).astype("float32")
    base = ["+model._target_=tests.models.CNN", "+model.inplace=true", f"+data.inputs.x={{file: '{npy('x', x)}'}}",
            "data.batch_size=4", "+hooks.a={kind:forward,layers:[conv1,conv2]}", "store.chunk_rows=3"]
    cpu = run_cfg([*base, "device=cpu"], name="cpu")
    conv1 = cpu.load(layer="conv1", role="output")
    assert (conv1 < 0).any()  # stored before the in-place ReLU
    for writer in ("thread", "sync"):
        gpu = run_cfg([*base, "device=cuda", f"store.writer={writer}"], name=f"gpu-{writer}")
        for layer in ("conv1", "conv2"):
            np.testing.assert_allclose(gpu.load(layer=layer, role="output"), cpu.load(layer=layer, role="output"),
                                       rtol=1e-4, atol=1e-5, err_msg=f"{writer} {layer}")


# Every bundled experiment but steer (it needs two source runs: tested below), on the GPU against the CPU
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml") if p.stem != "steer")


def same_run(gpu, cpu, what):
    """The two stores hold the same arrays with the same rows, floats close (full float32 maths on both), whole
    numbers (token ids, ranks, counts) equal but where a near tie of two logits may order them otherwise
    (at most 1 in 100); infinite and NaN values in the same places, except in arrays whose values pass 1e30
    (blowup's gradients, at float32's limit: the order of a sum decides which overflow), where the values finite
    in both are compared."""
    assert gpu.status == cpu.status == "complete", what
    assert gpu.attrs["device"].startswith("cuda") and cpu.attrs["device"] == "cpu", what
    keys = sorted(cpu.index.array.unique())
    assert keys and sorted(gpu.index.array.unique()) == keys, what
    for key in keys:
        mine, theirs = gpu.array(key)[:], cpu.array(key)[:]
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype, f"{what} {key}"
        if np.issubdtype(theirs.dtype, np.floating):
            finite = np.isfinite(mine) & np.isfinite(theirs)
            scale = max(float(np.abs(theirs[finite]).max(initial=0)), 1.0)
            if scale < 1e30:
                np.testing.assert_array_equal(np.isnan(mine), np.isnan(theirs), err_msg=f"{what} {key}: NaNs")
                np.testing.assert_array_equal(mine[~finite], theirs[~finite], err_msg=f"{what} {key}: infinities")
            np.testing.assert_allclose(mine[finite], theirs[finite], rtol=1e-3, atol=1e-4 * scale,
                                       err_msg=f"{what} {key}")
        else:
            assert (mine != theirs).mean() <= 0.01, f"{what} {key}: {(mine != theirs).sum()} of {mine.size} differ"
    assert gpu.index[["array", "sample_start", "sample_stop"]].equals(cpu.index[["array", "sample_start",
                                                                                  "sample_stop"]]), what


@pytest.fixture
def full_float32(monkeypatch):
    """No TF32 on the GPU (convolutions and matrix products): its values then compare with the CPU's."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_bundled_experiment_on_cuda_equals_cpu(name, run_cfg, full_float32):
    """Each method (captures, gradients, edits, patching, attribution, lens, DLA, dictionaries, circuits) run on
    the GPU stores what it stores on the CPU."""
    cpu = run_cfg([f"+experiment={name}", "device=cpu"], name="cpu")
    gpu = run_cfg([f"+experiment={name}", "device=cuda"], name="gpu")
    same_run(gpu, cpu, name)


def test_steering_while_generating_on_cuda_equals_cpu(tmp_path, run_cfg, full_float32):
    """steer: the direction from two source runs, added while HF generate() writes; the generated tokens and
    the captured residual stream on the GPU equal the CPU's."""
    for mood in ("happy", "sad"):
        run_here(tmp_path / "runs" / f"steer_{mood}", "+experiment=steer_source",
                 f"data.text.files=[pkg://hookrun.experiments/data/{mood}.txt]")
    diff = (f"[{{store: {tmp_path}/runs/steer_happy, hook: resid}}, "
            f"{{store: {tmp_path}/runs/steer_sad, hook: resid}}]")
    runs = {device: run_cfg(["+experiment=steer", f"device={device}", f"hooks.steer.edit.0.value.diff={diff}"],
                            name=device) for device in ("cpu", "cuda")}
    same_run(runs["cuda"], runs["cpu"], "steer")
    assert runs["cuda"].tokens().equals(runs["cpu"].tokens())
