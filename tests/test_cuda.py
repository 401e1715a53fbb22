"""The CUDA path (pinned non-blocking copies, events in the writer): captures equal the CPU run's. Needs a GPU."""
import numpy as np
import pytest
import torch

from hookrun.format.layout import parse_key

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
