"""Configs that ran to exit 0 with a wrong or empty result, or crashed after the store was created without
naming the batch or the key (issue 17, items 9-11 and the late crashes): each is now refused before the store
exists (exit 2, the key named) or fails naming the batch, the samples, the hook/layer/role and the error."""
import numpy as np
import pytest
import torch
from torch import nn

import hookrun


# -- tiny models and datasets of this file ----------------------------------------------------------------------
class SparseOut(nn.Module):
    """fc -> a sparse COO output (`sparse`), then back to dense."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.sparse = ToSparse()

    def forward(self, x):
        return self.sparse(torch.relu(self.fc(x))).to_dense()


class ToSparse(nn.Module):
    def forward(self, x):
        return x.to_sparse()


class ComplexOut(nn.Module):
    """fc -> a complex spectrum (`spectrum`: real part h, imaginary part -2h)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.spectrum = Spectrum()

    def forward(self, x):
        return self.spectrum(self.fc(x)).real


class Spectrum(nn.Module):
    def forward(self, h):
        return torch.complex(h, -2 * h)


class Float8Out(nn.Module):
    """fc -> a float8 copy (`narrow`, a dtype numpy has not) -> back to float32."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.narrow = Narrow()

    def forward(self, x):
        return self.narrow(self.fc(x)).float()


class Narrow(nn.Module):
    def forward(self, x):
        return x.to(torch.float8_e4m3fn)


class BatchNormed(nn.Module):
    """fc -> BatchNorm1d -> head: in train mode, a batch of one sample is an error."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.bn(self.fc(x)))


class FailsAt(torch.utils.data.Dataset):
    """Items of 6 values; item `bad` raises (a corrupt file)."""

    def __init__(self, n=48, bad=37):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"cannot decode image file {i:05d}.png")
        return torch.full((6,), float(i))


class Labelled(torch.utils.data.Dataset):
    """Dict items {x, label}."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.full((6,), float(i)), "label": i % 3}


def tiny_llama():
    """A 2-layer Llama (hidden 16) from a transformers LlamaConfig, random init; eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def halve(t):
    """A user edit that returns the wrong shape."""
    return t[:, : t.shape[1] // 2]


class TokenItems(torch.utils.data.Dataset):
    """Rows of 5 token ids; from item `wild` on, ids beyond a 64-token vocabulary."""

    def __init__(self, n=9, wild=None):
        self.n, self.wild = n, wild

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import os
        import signal

        if os.environ.get("HOOKRUN_TEST_STOP_AT") == str(i):  # SIGTERM while loading item i (once)
            del os.environ["HOOKRUN_TEST_STOP_AT"]
            os.kill(os.getpid(), signal.SIGTERM)
        ids = (torch.arange(5) * 7 + i) % 64
        return {"input_ids": ids + (100 if self.wild is not None and i >= self.wild else 0)}


class Frozen(nn.Module):
    """fc1 frozen, fc2 trained."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8).requires_grad_(False)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def float_loss(output, batch):
    """A user loss that returns a Python float."""
    return float(output.detach().sum())


class TokenRows(torch.utils.data.Dataset):
    """`n` documents of 1-D token ids, `lengths` cycling (a text corpus already tokenized)."""

    def __init__(self, n=9, lengths=(6, 4, 5)):
        self.n, self.lengths = n, list(lengths)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        return (torch.arange(self.lengths[i % len(self.lengths)]) * 5 + i) % 60 + 2


class Table(nn.Module):
    """A module that returns a learned table of 4 rows whatever the batch: axis 0 is not the samples."""

    def __init__(self):
        super().__init__()
        self.rows = nn.Parameter(torch.arange(12.0).reshape(4, 3))

    def forward(self, x):
        return self.rows * 1.0


class WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.table = Table()

    def forward(self, x):
        return self.fc(x) + self.table(x).sum()


# -- the bad configs tried, each with what it must do now ----------------------------------------------------------
M = "+model._target_=tests.models.MLP"
HERE = "tests.test_safety_configs"
X = "+data.inputs.x={random:normal,shape:[8,6]}"
X9 = "+data.inputs.x={random:normal,shape:[9,6]}"
BS = "data.batch_size=4"
LLAMA = [f"+model._target_={HERE}.tiny_llama", "data.keyword=true", BS]
IDS = "+data.inputs.input_ids={random:randint,high:64,shape:[8,5]}"
TOKENS = [f"+model._target_={HERE}.tiny_llama", f"+data.dataset._target_={HERE}.TokenRows", BS]  # a text run


def hook(spec, name="h"):
    return f"+hooks.{name}={{{spec}}}"


BEFORE = "before"  # refused before the store exists: exit 2, the key named, no store written
LATER = "later"  # fails on a later batch: exit 1, the batch, its samples, what failed and the error named
REFUSED = [  # (id, overrides, when, what the message must say)
    # item 9: configs that ran to exit 0 with a wrong or empty result
    ("reduce-dim-2-on-2d", [M, X, BS, hook("kind:forward,layers:fc1,reduce:{op:mean,dims:[2]}")], BEFORE,
     ["hooks.h.reduce.dims: 2 is not a dim of a 2-D capture of shape [4, 8]", "its dims are 1 (or -1)"]),
    ("reduce-dim-minus2-on-2d", [M, X, BS, hook("kind:forward,layers:fc1,reduce:{op:mean,dims:[-2]}")], BEFORE,
     ["hooks.h.reduce.dims: -2 is not a dim of a 2-D capture of shape [4, 8]", "axis 0 (the samples)"]),
    ("reduce-spatial-on-2d", [M, X, BS, hook("kind:forward,layers:fc1,reduce:{op:mean,dims:spatial}")], BEFORE,
     ["hooks.h.reduce.dims: spatial means dims 2..", "shape [4, 8] has none; give its dims: 1 (or -1)"]),
    ("reduce-on-1d", [M, X, BS, "loss=sum", hook("kind:param_grad,layers:fc1.bias,reduce:{op:mean,dims:[1]}")],
     BEFORE, ["hooks.h.reduce: a capture of shape [8] has no dim besides axis 0", "fc1.bias grad"]),
    ("capture-output.0-of-a-tensor", [M, X, BS, hook("kind:forward,layers:fc1,capture:[output.0]")], BEFORE,
     ["hooks.h.capture: 'output.0' is not a role fc1 produced", "they produce fc1: input.0, output"]),
    ("capture-input.3", [M, X, BS, hook("kind:forward,layers:fc1,capture:[input.3]")], BEFORE,
     ["hooks.h.capture: 'input.3' is not a role fc1 produced", "input.0, output"]),
    ("capture-kwarg.x", [M, X, BS, hook("kind:forward_pre,layers:fc1,capture:[kwarg.x]")], BEFORE,
     ["hooks.h.capture: 'kwarg.x' is not a role fc1 produced", "they produce fc1: input.0"]),
    ("capture-glob-of-nothing", [M, X, BS, hook("kind:forward,layers:fc1,capture:['output.*']")], BEFORE,
     ["hooks.h.capture: 'output.*' is not a role fc1 produced"]),
    ("capture-grad_input.3", [M, X, BS, "loss=sum", hook("kind:backward,layers:fc2,capture:[grad_input.3]")], BEFORE,
     ["hooks.h.capture: 'grad_input.3' is not a role fc2 produced", "grad_input.0, grad_output.0"]),
    ("edit-roles-of-no-role", [M, X, BS, hook("kind:forward,layers:fc1,edit:[{op:scale,value:2,roles:[output.1]}]")],
     BEFORE, ["hooks.h.edit[0].roles: ['output.1'] is not a role this hook edits on fc1", "it edits output"]),
    ("edit-roles-a-forward-hook-never-edits",
     [M, X, BS, hook("kind:forward,layers:fc1,capture:[input,output],edit:[{op:scale,value:2,roles:[input.0]}]")],
     BEFORE, ["hooks.h.edit[0].roles: 'input.0' is never edited by a forward hook", "kind forward_pre edits input"]),
    ("select-positions-without-text", [M, X, BS, hook("kind:forward,layers:fc1,select:{positions:last}")], BEFORE,
     ["hooks.h.select.positions: this run has no text", "select: {dim: 1, index: -1}"]),
    ("edit-positions-without-text",
     [M, X, BS, hook("kind:forward,layers:fc1,edit:[{op:scale,value:2,positions:last}]")],
     BEFORE, ["hooks.h.edit[0].positions: this run has no text"]),
    ("select-heads-without-text", [M, X, BS, hook("kind:forward,layers:fc1,select:{heads:[0]}")], BEFORE,
     ["hooks.h.select.heads: this run has no text"]),
    ("select-heads-of-a-non-attention-tensor", [*TOKENS, hook("kind:forward,layers:model.layers.0,select:{heads:[0]}")],
     BEFORE, ["hooks.h.select.heads: a capture of shape [4, 6, 16] has no head axis", "model.layers.0 output"]),
    ("select-positions-beyond-every-sequence",
     [*TOKENS, hook("kind:forward,layers:model.layers.0,select:{positions:9}")],
     BEFORE, ["hooks.h.select.positions: [9] reaches beyond a sequence of 4 real tokens"]),
    ("clamp-min-above-max", [M, X, BS, hook("kind:forward,layers:fc1,edit:[{op:clamp,min:1,max:-1}]")], BEFORE,
     ["hooks.h.edit[0]: op clamp with min 1 > max -1 sets every value to max"]),
    ("select-empty-slice", [M, X, BS, hook("kind:forward,layers:fc1,select:{dim:1,index:{start:5,stop:5}}")], BEFORE,
     ["hooks.h.select.index: {'start': 5, 'stop': 5} keeps nothing of dim 1 (size 8)"]),
    ("select-slice-past-the-end", [M, X, BS, hook("kind:forward,layers:fc1,select:{dim:1,index:{start:9}}")], BEFORE,
     ["hooks.h.select.index: {'start': 9} keeps nothing of dim 1 (size 8)"]),
    ("select-empty-list", [M, X, BS, hook("kind:forward,layers:fc1,select:{dim:1,index:[]}")], BEFORE,
     ["hooks.h.select.index: [] is not an index"]),
    ("dtype-of-complex",
     [f"+model._target_={HERE}.ComplexOut", X, BS, hook("kind:forward,layers:spectrum,dtype:float16")],
     BEFORE, ["hooks.h.dtype: float16 of a complex capture (complex64) would keep its real part only"]),
    ("max-of-complex", [f"+model._target_={HERE}.ComplexOut", X, BS,
                        hook("kind:forward,layers:spectrum,reduce:{op:max,dims:[1]}")], BEFORE,
     ["hooks.h.reduce.op: max of a complex capture has no order"]),
    ("a-dtype-the-store-cannot-hold", [f"+model._target_={HERE}.Float8Out", X, BS, hook("kind:forward,layers:narrow")],
     BEFORE, ["hooks.h.dtype: narrow output is float8_e4m3fn, which the store cannot hold", "hooks.h.dtype=float32"]),
    # select errors, edits and losses that crashed after the store was created
    ("select-dim-out-of-range", [M, X, BS, hook("kind:forward,layers:fc1,select:{dim:3,index:0}")], BEFORE,
     ["hooks.h.select.dim: 3 is not a dim of a 2-D capture of shape [4, 8]", "fc1 output"]),
    ("select-dim-minus2-is-the-samples", [M, X, BS, hook("kind:forward,layers:fc1,select:{dim:-2,index:0}")], BEFORE,
     ["hooks.h.select.dim: -2 is not a dim of a 2-D capture", "axis 0 (the samples)"]),
    ("select-index-out-of-range", [M, X, BS, hook("kind:forward,layers:fc1,select:{dim:1,index:99}")], BEFORE,
     ["hooks.h.select.index: 99 is outside dim 1 (size 8)", "use indices in 0..7"]),
    ("select-list-out-of-range", [M, X, BS, hook("kind:forward,layers:fc1,select:{dim:1,index:[0,99]}")], BEFORE,
     ["hooks.h.select.index: [99] is outside dim 1 (size 8)"]),
    ("select-negative-step", [M, X, BS, hook("kind:forward,layers:fc1,select:{dim:1,index:{start:0,step:-1}}")],
     BEFORE, ["hooks.h.select.index: step -1 must be >= 1"]),
    ("select-on-a-gradient", [M, X, BS, "loss=sum", hook("kind:output_grad,layers:fc1,select:{dim:1,index:99}")],
     BEFORE, ["hooks.h.select.index: 99 is outside dim 1", "fc1 grad"]),
    ("edit-zero-index-out-of-range", [M, X, BS, hook("kind:forward,layers:fc1,edit:[{op:zero,dim:1,index:[99]}]")],
     BEFORE, ["hooks.h.edit[0]: zero on fc1 output (shape [4, 8] float32) in batch 0 (samples 0..4) failed: "
              "IndexError"]),
    ("edit-in-backward-fails",
     [M, X, BS, "loss=sum", hook("kind:backward,layers:fc2,edit:[{op:zero,dim:1,index:[99]}]")],
     BEFORE, ["hooks.h.edit[0]: zero on fc2 grad_input.0"]),
    ("replace-value-of-another-shape",
     [M, X, BS, hook("kind:forward,layers:fc1,edit:[{op:replace,value:[1.0,2.0,3.0]}]")],
     BEFORE, ["hooks.h.edit[0].value: a vector of width 3 does not fit", "last axis 8 wide",
              "at fc1 output (shape [4, 8] float32)"]),
    ("replace-file-of-another-shape", [M, X, BS, hook("kind:forward,layers:fc1,edit:[{op:replace,file:V3}]")], BEFORE,
     ["hooks.h.edit[0].file: a vector of width 3 does not fit", "at fc1 output"]),
    ("user-edit-of-another-shape",
     [M, X, BS, hook(f"kind:forward,layers:fc1,edit:[{{_target_:{HERE}.halve}}]")], BEFORE,
     ["hooks.h.edit[0]: _target_ on fc1 output", "returned [4, 4] float32; an edit must keep the shape and dtype"]),
    ("edit-turns-token-ids-to-floats",
     [*LLAMA, IDS, hook("kind:forward_pre,layers:model.embed_tokens,edit:[{op:add,value:0.5}]")],
     BEFORE, ["hooks.h.edit[0]: add on model.embed_tokens input.0 (shape [4, 5] int64)", "returned [4, 5] float32"]),
    ("noise-on-token-ids", [*LLAMA, IDS, hook("kind:forward_pre,layers:model.embed_tokens,edit:[{op:noise,std:1}]")],
     BEFORE, ["hooks.h.edit[0]: noise on model.embed_tokens input.0", "not implemented for 'Long'"]),
    ("loss-index-out-of-range", [M, X, BS, "+loss.name=index", "+loss.index=99", hook("kind:output_grad,layers:fc1")],
     BEFORE, ["loss: computing it on the first batch's output failed: IndexError: index 99 is out of bounds"]),
    ("loss-index-not-a-scalar", [M, X, BS, "+loss.name=index", "+loss.index=[0]", hook("kind:output_grad,layers:fc1")],
     BEFORE, ["loss: index returned [3], not a scalar"]),
    ("loss-output-key-of-a-tensor",
     [M, X, BS, "+loss.name=sum", "+loss.output=logits", hook("kind:output_grad,layers:fc1")],
     BEFORE, ["loss: computing it", "AttributeError: 'Tensor' object has no attribute 'logits'"]),
    ("loss-output-index-of-a-pair", ["+model._target_=tests.models.Pair", "+model.d=6", X, BS, "+loss.name=sum",
                                     "+loss.output=5", hook("kind:output_grad,layers:lin")], BEFORE,
     ["loss: computing it", "IndexError: tuple index out of range"]),
    ("user-loss-returns-a-float", [M, X, BS, f"+loss._target_={HERE}.float_loss", hook("kind:output_grad,layers:fc1")],
     BEFORE, ["loss: tests.test_safety_configs.float_loss returned float, not a scalar"]),
    ("mse-target-of-another-shape", [M, X, "+data.inputs.y={random:normal,shape:[8,1]}", "data.targets=[y]", BS,
                                     "+loss.name=mse", "+loss.target=y", hook("kind:output_grad,layers:fc1")], BEFORE,
     ["loss.target: 'y' has shape [4, 1] but the output [4, 3]"]),
    ("param-grad-of-a-frozen-weight", [f"+model._target_={HERE}.Frozen", X, BS, "loss=sum",
                                       hook("kind:param_grad,layers:fc1.weight")], BEFORE,
     ["hooks.h.layers: fc1.weight does not require grad (frozen)"]),
    ("output-grad-of-a-frozen-layer", [f"+model._target_={HERE}.Frozen", X, BS, "loss=sum",
                                       hook("kind:output_grad,layers:fc1")], BEFORE,
     ["hooks.h.layers: fc1 never ran (or got no gradient) in the first batch"]),
    ("input-grad-of-token-ids", [*LLAMA, IDS, "loss=sum", "+hooks.h={kind:input_grad}"], BEFORE,
     ["hooks.h: the model has no floating-point input to take the gradient of", "kind: output_grad on the embedding"]),
    ("a-module-list-never-called", [*LLAMA, IDS, hook("kind:forward,layers:model.layers")], BEFORE,
     ["hooks.h.layers: model.layers never ran"]),
    ("batchnorm-train-last-batch-of-one", [f"+model._target_={HERE}.BatchNormed", X9, BS, "mode=train",
                                           hook("kind:forward,layers:fc")], BEFORE,
     ["data.batch_size: the last batch (batch 2, samples 8..9) has 1 sample(s)",
      "Expected more than 1 value per channel",
      "data.max_samples=8"]),
    # item 11: a config error found only after the store existed
    ("record-a-field-the-batch-lacks", [M, f"+data.dataset._target_={HERE}.Labelled", BS, "data.keyword=true",
                                        "data.targets=[label]", "data.record=[lable]", hook("kind:forward,layers:fc1")],
     BEFORE, ["data.record: 'lable' is not a field of the batch; it has x, label (did you mean: label?)"]),
    # what only a later batch shows: named with the batch, its samples, what failed and the original error
    ("dataset-raises-on-item-37", [M, f"+data.dataset._target_={HERE}.FailsAt", BS, hook("kind:forward,layers:fc1")],
     LATER, ["batch 9 (samples 36..40): loading its data failed: item 37 raises ValueError: cannot decode image file "
             "00037.png"]),
    ("dataset-raises-in-a-worker", [M, f"+data.dataset._target_={HERE}.FailsAt", "+data.dataset.bad=9", BS,
                                    "data.num_workers=1", hook("kind:forward,layers:fc1")], LATER,
     ["batch 2 (samples 8..12): loading its data failed: item 9 raises ValueError"]),
    ("an-input-changes-shape-on-batch-1", ["model=add_one", "+hooks.h={kind:forward,layers:_model}",
                                           "+data.dataset._target_=tests.models.Ragged"], LATER,
     ["batch 1 (samples 1..2): loading its data failed: data: input 'input' has per-sample shape [4]"]),
    ("model-fails-on-batch-2", [*LLAMA, f"+data.dataset._target_={HERE}.TokenItems", "+data.dataset.wild=8",
                                hook("kind:forward,layers:model.layers.0")], LATER,
     ["batch 2 (samples 8..9): the forward pass failed: IndexError: index out of range in self"]),
    ("cross-entropy-target-out-of-range", [M, X, "+data.inputs.y={value:[0,1,2,0,0,1,7,0]}", "data.targets=[y]", BS,
                                           "+loss.name=cross_entropy", "+loss.target=y",
                                           hook("kind:output_grad,layers:fc1")], LATER,
     ["batch 1 (samples 4..8): the loss failed: IndexError: Target 7 is out of bounds"]),
    ("positions-beyond-a-later-sequence", [*TOKENS, "+data.dataset.lengths=[6,6,6,6,2]",
                                           hook("kind:forward,layers:model.layers.0,select:{positions:4}")], LATER,
     ["hooks.h.select.positions: [4] reaches beyond a sequence of 2 real tokens", "model.layers.0 output",
      "in batch 1 (samples 4..8)"]),
]


def run_case(overrides, path):
    """(exit code, message) as `python -m hookrun OVERRIDES` ends (hookrun.__main__.failure), in this process."""
    from hookrun.__main__ import failure
    from hookrun.engine.runner import run
    from tests.helpers import make_cfg

    try:
        run(make_cfg([*overrides, f"store.path={path}"]))
    except Exception as err:  # noqa: BLE001 - mapped as the CLI maps it
        return failure(err)
    return 0, ""


@pytest.mark.slow
@pytest.mark.parametrize("overrides,when,expected", [pytest.param(*case[1:], id=case[0]) for case in REFUSED])
def test_bad_config_is_refused_before_the_store_or_names_the_batch(tmp_path, overrides, when, expected):
    np.save(tmp_path / "v3.npy", np.ones(3, dtype="float32"))
    overrides = [o.replace("V3", str(tmp_path / "v3.npy")) for o in overrides]
    path = tmp_path / "s.zarr"
    code, message = run_case(overrides, path)
    for text in expected:
        assert text in message, message
    if when == BEFORE:
        assert code == 2 and not path.exists(), message
    else:
        assert code == 1 and ("run failed: BatchError: batch " in message or "run failed: HookError: " in message)
        assert hookrun.open(path).status == "failed"


def test_the_tally_of_bad_configs():
    """The figures of the closing note: bad configs tried here, refused before the store, failing later named."""
    before = [c for c in REFUSED if c[2] == BEFORE]
    assert (len(REFUSED), len(before), len(REFUSED) - len(before)) == (54, 48, 6)


# -- item 10: the sample axis is decided once per array, from how it follows the batch size ----------------------
ROTARY = [hook("kind:forward,layers:model.rotary_emb", "rot"), hook("kind:forward_pre,layers:model.layers.0.self_attn",
                                                                   "attn")]


def llama_reference(batches):
    """The tiny Llama as a run with seed 0 builds it, and its rotary cos/sin and layer-0 attention inputs per batch."""
    torch.manual_seed(0)
    model = tiny_llama().eval()
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    handle.remove()
    return seen


def test_per_batch_tensors_stay_per_batch_in_a_last_batch_of_one(tmp_path):
    """Llama's position ids [1, T] and rotary cos/sin [1, T, D] are per-batch tensors; a last batch of one sample
    made them look per-sample and the run died at it. 9 samples in batches of 4: 3 batch rows each."""
    ids = torch.randint(0, 64, (9, 5), generator=torch.Generator().manual_seed(3))
    np.save(tmp_path / "ids.npy", ids.numpy())
    path = tmp_path / "s.zarr"
    code, message = run_case([*LLAMA, f"+data.inputs.input_ids={{file: '{tmp_path / 'ids.npy'}'}}", *ROTARY], path)
    assert code == 0, message
    cap = hookrun.open(path)
    index = cap.index
    per_batch = ["output.0", "output.1", "kwarg.position_ids", "kwarg.position_embeddings.0",
                 "kwarg.position_embeddings.1"]
    for role in per_batch:
        rows = index[index.role == role]
        assert rows.per_sample.tolist() == [False] * 3 and rows.row_start.tolist() == [0, 1, 2], role
    seen = llama_reference([ids[0:4], ids[4:8], ids[8:9]])
    cos, sin = seen[-1]["position_embeddings"]
    assert cap.load(layer="model.rotary_emb", role="output.0").shape == (3, 1, 5, 8)
    np.testing.assert_allclose(cap.load(layer="model.rotary_emb", role="output.0")[2], cos.numpy(), rtol=1e-6)
    np.testing.assert_allclose(cap.load(layer="model.rotary_emb", role="output.1")[2], sin.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(cap.load(layer="model.layers.0.self_attn", role="kwarg.position_ids"),
                                  np.tile(np.arange(5), (3, 1, 1)))
    hidden = cap.load(layer="model.layers.0.self_attn", role="kwarg.hidden_states")
    assert hidden.shape == (9, 5, 16)  # per sample, the last batch's one sample included
    np.testing.assert_allclose(hidden, torch.cat([s["hidden_states"] for s in seen]).numpy(), rtol=1e-5, atol=1e-6)


def test_per_batch_tensors_of_a_text_run_stay_per_batch_in_a_last_batch_of_one(tmp_path):
    """On a text run a [1, T, D] tensor in a batch of one sample looks per token; it stays one row per batch."""
    path = tmp_path / "s.zarr"
    code, message = run_case(["+experiment=lm_tokens", f"model._target_={HERE}.tiny_llama", "~model.n_layer",
                              "~model.n_embd", "~model.n_head", "~model.vocab_size", "~model.n_positions",
                              "~hooks.resid", "data.text.files=null", "data.text.tokenizer=null", "data.text.bos=false",
                              f"+data.text.dataset._target_={HERE}.TokenRows", "+data.text.dataset.lengths=[5]",
                              "data.text.max_length=8", "data.text.position_ids=false", BS, *ROTARY], path)
    assert code == 0, message
    cap = hookrun.open(path)
    rot = cap.index[cap.index.layer == "model.rotary_emb"]
    assert set(rot.unit) == {"batch"} and len(rot) == 6
    assert cap.load(layer="model.rotary_emb", role="output.0").shape == (3, 1, 5, 8)
    hidden = cap.index[cap.index.role == "kwarg.hidden_states"]
    assert set(hidden.unit) == {"token"} and int(hidden.row_stop.max()) == 45  # 9 documents of 5 tokens
    ids = torch.stack([TokenRows(lengths=[5])[i] for i in range(9)])
    seen = llama_reference([ids[0:4], ids[4:8], ids[8:9]])
    np.testing.assert_allclose(cap.load(layer="model.layers.0.self_attn", role="kwarg.hidden_states"),
                               torch.cat([s["hidden_states"] for s in seen]).reshape(45, 16).numpy(), rtol=1e-5,
                               atol=1e-6)


def test_a_resume_at_the_last_batch_of_one_keeps_per_batch_arrays_per_batch(tmp_path):
    """Killed while loading the last batch (one sample), then resumed: its first batch is that one sample."""
    import os

    from hookrun.engine.runner import Interrupted, run
    from tests.helpers import make_cfg

    overrides = [*LLAMA, f"+data.dataset._target_={HERE}.TokenItems", "store.commit_s=0", *ROTARY]
    whole = tmp_path / "whole.zarr"
    assert run_case(overrides, whole)[0] == 0
    path = tmp_path / "s.zarr"
    os.environ["HOOKRUN_TEST_STOP_AT"] = "8"
    try:
        with pytest.raises(Interrupted):
            run(make_cfg([*overrides, f"store.path={path}"]))
    finally:
        os.environ.pop("HOOKRUN_TEST_STOP_AT", None)
    assert len(hookrun.open(path).batches) == 2
    assert run_case([*overrides, "store.mode=resume"], path)[0] == 0
    a, b = hookrun.open(whole), hookrun.open(path)
    assert b.status == "complete" and len(b.batches) == 3
    for role in ("output.0", "kwarg.position_ids", "kwarg.hidden_states"):
        layer = "model.rotary_emb" if role.startswith("output") else "model.layers.0.self_attn"
        np.testing.assert_array_equal(a.load(layer=layer, role=role), b.load(layer=layer, role=role))


def test_a_tensor_whose_rows_match_the_batch_size_by_chance_is_per_batch(tmp_path):
    """A learned table of 4 rows in batches of 4: its axis 0 does not follow the batch size (the first-batch check
    tries 1 and 2 samples), so it is stored once a batch, not as 4 samples (and the last batch of 1 does not
    break the run)."""
    path = tmp_path / "s.zarr"
    code, message = run_case([f"+model._target_={HERE}.WithTable", X9, BS, hook("kind:forward,layers:[table,fc]")],
                             path)
    assert code == 0, message
    cap = hookrun.open(path)
    table = cap.index[cap.index.layer == "table"]
    assert table.per_sample.tolist() == [False] * 3
    np.testing.assert_array_equal(cap.load(layer="table", role="output"),
                                  np.tile(np.arange(12.0).reshape(4, 3), (3, 1, 1)))
    assert cap.load(layer="fc", role="output").shape == (9, 3)


# -- captures the store took wrongly, or not at all -----------------------------------------------------------------
def test_a_sparse_output_is_stored_dense(tmp_path, npy):
    x = np.random.default_rng(5).standard_normal((8, 6)).astype("float32")
    path = tmp_path / "s.zarr"
    code, message = run_case([f"+model._target_={HERE}.SparseOut", f"+data.inputs.x={{file: '{npy('x', x)}'}}", BS,
                              hook("kind:forward,layers:sparse")], path)
    assert code == 0, message
    torch.manual_seed(0)
    model = SparseOut()
    with torch.no_grad():
        want = torch.relu(model.fc(torch.from_numpy(x))).numpy()
    np.testing.assert_allclose(hookrun.open(path).load(layer="sparse", role="output"), want, rtol=1e-6)


def test_complex_captures_are_stored_whole_and_their_statistics_cover_both_parts(tmp_path, npy):
    x = np.random.default_rng(6).standard_normal((8, 6)).astype("float32")
    path = tmp_path / "s.zarr"
    for writer in ("sync", "thread"):
        code, message = run_case([f"+model._target_={HERE}.ComplexOut", f"+data.inputs.x={{file: '{npy('x', x)}'}}",
                                  BS, f"store.writer={writer}", "store.mode=overwrite",
                                  hook("kind:forward,layers:spectrum")], path)
        assert code == 0, message
        torch.manual_seed(0)
        model = ComplexOut()
        with torch.no_grad():
            h = model.fc(torch.from_numpy(x)).numpy()
        cap = hookrun.open(path)
        got = cap.load(layer="spectrum", role="output")
        assert got.dtype == np.complex64
        np.testing.assert_allclose(got, h - 2j * h, rtol=1e-6)
        for row, part in zip(cap.rows(layer="spectrum").itertuples(), (h[:4], h[4:])):
            both = np.concatenate([part.ravel(), -2 * part.ravel()]).astype(np.float64)  # real, imaginary
            assert row.numel == 16
            np.testing.assert_allclose([row.mean, row.std, row.min, row.max],
                                       [both.mean(), both.std(), both.min(), both.max()], rtol=1e-5, atol=1e-7)


def test_statistics_of_values_near_the_float32_limit_do_not_overflow(tmp_path):
    """A causal mask of -3.4e38 summed in float32 gave mean -inf and std inf (with overflow warnings)."""
    path = tmp_path / "s.zarr"
    code, message = run_case(["model=add_one", "+data.inputs.x=[[-3.4e38,1.0],[2.0,-3.4e38]]", "data.batch_size=2",
                              "+hooks.h={kind:forward_pre,layers:_model}"], path)
    assert code == 0, message
    row = hookrun.open(path).index.iloc[0]
    values = np.array([-3.4e38, 1.0, 2.0, -3.4e38], dtype=np.float32).astype(np.float64)
    np.testing.assert_allclose([row["mean"], row["std"]], [values.mean(), values.std()], rtol=1e-6)


@pytest.mark.parametrize("t", [
    pytest.param(torch.complex(torch.arange(6.0).reshape(2, 3), -2 * torch.arange(6.0).reshape(2, 3)), id="complex"),
    pytest.param(torch.tensor([[-3.4e38, 1.0], [2.0, -3.4e38]]), id="near-float32-max"),
])
def test_device_statistics_match_the_writers(t):
    """The CUDA path's statistics (computed with torch where the tensor is; here on the CPU) equal numpy's, and both
    cover a complex tensor's two parts."""
    from hookrun.store.stats import device_sums, stats, stats_from_sums

    values = (torch.view_as_real(t) if t.is_complex() else t).double().reshape(-1).numpy()
    want = [values.mean(), values.std(), values.min(), values.max()]
    for got in (stats(t.numpy()), stats_from_sums(device_sums(t).tolist(), t.numel())):
        np.testing.assert_allclose([got[k] for k in ("mean", "std", "min", "max")], want, rtol=1e-6)
