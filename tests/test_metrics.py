"""Declared metrics (hookrun.methods.metrics) against plain PyTorch: on a GPT-2 and a Llama built from configs, each
sample run alone, log-softmax by hand; right and left padding; per-sample tokens; every bad spec's message."""
import numpy as np
import pytest
import torch

from hookrun.methods.metrics import MetricError, MetricInputs, check_spec, compile_metrics, fields_needed, \
    needing_reference
from hookrun.capture.tokens import TokenInfo
from hookrun.config.checks import ConfigError
from hookrun.experiments.lm import tokenizer

DOCS = ["hooks capture the model", "the layer", "a store of captures for every layer of the model and its hooks",
        "run it"]
ANSWERS = [" the", 425, " hooks", 7]  # per-sample tokens: strings of one token and ids
THE, HOOKS, LAYER, MODEL = 270, 432, 436, 425  # the bundled tokenizer's ids of " the", " hooks", " layer", " model"
SPECS = {
    "ld": {"metric": "logit_diff", "a": " hooks", "b": MODEL},
    "lp": {"metric": "logprob", "target": {"field": "answer"}, "position": -2},
    "p": {"metric": "prob", "target": " the", "position": [0, "last"]},
    "r": {"metric": "rank", "target": " layer", "position": "first"},
    "ce": {"metric": "loss"},
    "kl": {"metric": "kl"},
    "kl_all": {"metric": "kl", "position": "all"},
    "user": {"_target_": "tests.test_metrics.mean_logit", "scale": 2.0},
}


def mean_logit(logits, inputs, scale=1.0):
    """A user metric: `scale` x the mean logit over each sequence's real tokens."""
    mask = inputs.info.mask[..., None]
    return scale * (logits.float() * mask).sum((1, 2)) / (mask.sum((1, 2)) * logits.shape[-1])


def one_arg(logits):
    return logits[:, -1, 0]


def wrong_shape(logits, inputs):
    return logits[:, -1]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def build(kind: str, seed: int):
    """A GPT-2 or Llama with random weights from a small config (vocabulary of the bundled tokenizer)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                           eos_token_id=1, attn_implementation="eager"))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             attn_implementation="eager"))
    return model.eval()


def padded(model, seqs, side):
    """(logits [B, T, V], input_ids, TokenInfo) of the sequences run as one batch padded on `side`."""
    longest = max(map(len, seqs))
    ids = torch.zeros((len(seqs), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(longest - len(s), longest)
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    return logits, ids, TokenInfo.of_batch(mask.bool(), mask.bool(), 64)


def alone(model, seq):
    """[L, V] logits of one sequence run by itself, without padding."""
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


def log_softmax(x):
    top = x.max(-1, keepdim=True).values
    return x - top - (x - top).exp().sum(-1, keepdim=True).log()


def by_hand(x, ref, seq, answer):
    """Every metric of SPECS for one sequence from its own logits x [L, V] (and the reference's), in plain PyTorch."""
    logp, ref_logp = log_softmax(x), log_softmax(ref)
    kl = [torch.nn.functional.kl_div(logp[t], ref_logp[t], log_target=True, reduction="sum") for t in range(len(seq))]
    return {
        "ld": x[-1, HOOKS] - x[-1, MODEL],
        "lp": logp[-2, answer],
        "p": torch.stack([logp[0, THE].exp(), logp[-1, THE].exp()]),
        "r": (x[0] > x[0, LAYER]).sum().float(),
        "ce": torch.stack([-logp[t, seq[t + 1]] for t in range(len(seq) - 1)]).mean(),
        "kl": (ref_logp[-1].exp() * (ref_logp[-1] - logp[-1])).sum(),
        "kl_all": torch.stack(kl).mean(),
        "user": 2.0 * x.mean(),
    }


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_every_metric_equals_each_sample_run_alone_under_right_and_left_padding(kind, tok):
    model, ref_model = build(kind, 0), build(kind, 1)
    seqs = [tok.encode(d) for d in DOCS]
    answers = [tok.encode(a)[0] if isinstance(a, str) else a for a in ANSWERS]
    metrics = compile_metrics(SPECS, tok)
    expected = [by_hand(alone(model, s), alone(ref_model, s), s, a) for s, a in zip(seqs, answers)]
    values = {}
    for side in ("right", "left"):
        logits, ids, info = padded(model, seqs, side)
        reference = padded(ref_model, seqs, side)[0]
        inputs = MetricInputs(info, ids, {"answer": ANSWERS}, reference)
        values[side] = {name: m(logits, inputs) for name, m in metrics.items()}
        for name, got in values[side].items():
            assert got.dtype == torch.float32 and got.shape == ((4, 2) if name == "p" else (4,)), name
            want = torch.stack([e[name].float() for e in expected])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{kind} {side} {name}")
    for name in metrics:
        torch.testing.assert_close(values["right"][name], values["left"][name], rtol=1e-4, atol=1e-5)
    assert values["right"]["r"].tolist() == [e["r"].item() for e in expected]  # ranks are exact


def test_kl_to_a_reference_of_other_prompts_takes_each_ones_last_token(tok):
    """The clean pass of a patching experiment: other prompts, other lengths, their own TokenInfo."""
    model = build("gpt2", 0)
    corrupt, clean = [tok.encode(d) for d in DOCS[:2]], [tok.encode(d) for d in DOCS[2:]]
    logits, ids, info = padded(model, corrupt, "right")
    reference, _, ref_info = padded(model, clean, "left")
    metrics = compile_metrics({"kl": {"metric": "kl", "position": "last"}, "all": {"metric": "kl", "position": "all"}})
    got = metrics["kl"](logits, MetricInputs(info, ids, reference=reference, reference_info=ref_info))
    want = [torch.nn.functional.kl_div(torch.log_softmax(alone(model, c)[-1], -1),
                                       torch.log_softmax(alone(model, r)[-1], -1), log_target=True, reduction="sum")
            for c, r in zip(corrupt, clean)]
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-4, atol=1e-6)
    with pytest.raises(MetricError, match="metrics.all: kl over all positions compares token by token, but the "
                                          "reference's sequences have other lengths; use position: last"):
        metrics["all"](logits, MetricInputs(info, ids, reference=reference, reference_info=ref_info))


def test_bf16_logits_give_float32_values_computed_in_float32():
    logits = (torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0)) * 8).bfloat16()
    metrics = compile_metrics({"lp": {"metric": "logprob", "target": 3}, "ld": {"metric": "logit_diff", "a": 3, "b": 9},
                               "kl": {"metric": "kl", "position": "all"}})
    inputs = MetricInputs(None, reference=logits.roll(1, dims=0))
    x = logits.float()
    torch.testing.assert_close(metrics["lp"](logits, inputs), log_softmax(x[:, -1])[:, 3], rtol=0, atol=1e-6)
    torch.testing.assert_close(metrics["ld"](logits, inputs), x[:, -1, 3] - x[:, -1, 9], rtol=0, atol=0)
    kl = torch.nn.functional.kl_div(log_softmax(x), log_softmax(x.roll(1, dims=0)), log_target=True,
                                    reduction="none").sum(-1).mean(1)
    torch.testing.assert_close(metrics["kl"](logits, inputs), kl, rtol=1e-5, atol=1e-6)
    assert {m(logits, inputs).dtype for m in metrics.values()} == {torch.float32}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_values_equal_cpu(tok):
    model = build("llama", 0)
    seqs = [tok.encode(d) for d in DOCS]
    logits, ids, info = padded(model, seqs, "left")
    reference = padded(build("llama", 1), seqs, "left")[0]
    metrics = compile_metrics(SPECS, tok)
    cpu = MetricInputs(info, ids, {"answer": ANSWERS}, reference)
    gpu = MetricInputs(info.to("cuda"), ids.cuda(), {"answer": ANSWERS}, reference.cuda())
    for name, m in metrics.items():
        got = m(logits.cuda(), gpu)
        assert got.is_cuda and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), m(logits, cpu), rtol=1e-5, atol=1e-5, msg=name)


def test_field_tokens_take_strings_ids_arrays_and_columns_per_sample(tok):
    logits = torch.randn(3, 4, 512, generator=torch.Generator().manual_seed(1))
    metric = compile_metrics({"lp": {"metric": "logprob", "target": {"field": "y"}}}, tok)["lp"]
    want = log_softmax(logits[:, -1])[[0, 1, 2], [THE, MODEL, HOOKS]]
    for values in ([" the", MODEL, " hooks"], np.array([THE, MODEL, HOOKS]), torch.tensor([[THE], [MODEL], [HOOKS]]),
                   np.array([" the", " model", " hooks"])):
        torch.testing.assert_close(metric(logits, MetricInputs(None, fields={"y": values})), want)
    assert not metric(logits.requires_grad_(), MetricInputs(None, fields={"y": [1, 2, 3]})).requires_grad  # no graph


def test_what_the_runner_reads_off_the_metrics(tok):
    metrics = compile_metrics(SPECS, tok)
    assert needing_reference(metrics) == ["kl", "kl_all"]
    assert fields_needed(metrics) == ["answer"]
    assert {n: m.width for n, m in metrics.items() if m.width} == {"p": 2}  # [B, 2]; every other metric [B]
    assert metrics["ld"].tokens == {"a": HOOKS, "b": MODEL}


BAD_SPECS = [  # (spec, the problem line)
    pytest.param(3, "metrics.m: 3 is not a metric; write {metric: logprob, target: \" hooks\"} or {_target_: pkg.fn}",
                 id="not-a-mapping"),
    pytest.param({"metric": "logit_dif", "a": 1, "b": 2}, "metrics.m.metric: 'logit_dif' is unknown (did you mean: "
                 "logit_diff?); use one of logit_diff, logprob, prob, rank, loss, kl, or {_target_: pkg.fn} for your "
                 "own", id="unknown-metric"),
    pytest.param({"target": 1}, "metrics.m.metric: missing; use one of logit_diff", id="no-metric"),
    pytest.param({"metric": "logprob", "target": " Paris"}, "metrics.m.target: ' Paris' is 4 tokens [' ', 'P', 'ar', "
                 "'is'] (ids [222, 49, 276, 288]), not one; give a single token (e.g. ' ') or its id",
                 id="multi-token-string"),
    pytest.param({"metric": "logit_diff", "a": " the", "b": ""}, "metrics.m.b: '' is no token at all",
                 id="empty-string"),
    pytest.param({"metric": "logprob"}, "metrics.m: metric logprob needs 'target' (a string of one token, an int id "
                 "or {field: NAME} (one string or id per sample)), e.g. {metric: logprob, target: \" hooks\"}",
                 id="missing-target"),
    pytest.param({"metric": "logit_diff", "a": 3}, "metrics.m: metric logit_diff needs 'b'", id="missing-b"),
    pytest.param({"metric": "rank", "target": [1, 2]}, "metrics.m.target: [1, 2] is not a token; give a string of "
                 "one token, an int id or {field: NAME}", id="target-a-list"),
    pytest.param({"metric": "rank", "target": -1}, "metrics.m.target: -1 is not a token id; ids are >= 0",
                 id="negative-id"),
    pytest.param({"metric": "prob", "target": {"fields": "y"}}, "metrics.m.target: {'fields': 'y'} is not a token; "
                 "a per-sample token is {field: NAME}", id="bad-field-token"),
    pytest.param({"metric": "prob", "target": 3, "position": "lst"}, "metrics.m.position: 'lst' is not a position; "
                 "use last, first, an int (0 = first real token, -1 = last) or a list of them, e.g. [0, -1] (did you "
                 "mean: last, first?)", id="position-typo"),
    pytest.param({"metric": "prob", "target": 3, "position": 1.5}, "metrics.m.position: 1.5 is not a position",
                 id="position-a-float"),
    pytest.param({"metric": "prob", "target": 3, "position": "all"}, "metrics.m.position: 'all' is not a position",
                 id="all-positions-outside-kl"),
    pytest.param({"metric": "kl", "position": "every"}, "metrics.m.position: 'every' is not a position; use last, "
                 "first, an int (0 = first real token, -1 = last) or a list of them, e.g. [0, -1]; kl also takes all",
                 id="kl-position"),
    pytest.param({"metric": "loss", "position": "last"}, "metrics.m.position: metric loss takes no 'position'; it "
                 "takes nothing else", id="loss-with-position"),
    pytest.param({"metric": "logprob", "target": 3, "a": 4}, "metrics.m.a: metric logprob takes no 'a'; it takes "
                 "position, target", id="extra-argument"),
    pytest.param({"_target_": "tests.nowhere.fn"}, "metrics.m._target_: 'tests.nowhere.fn' does not import (",
                 id="target-not-importable"),
    pytest.param({"_target_": "tests.test_metrics.one_arg", "k": 3}, "metrics.m: tests.test_metrics.one_arg cannot be "
                 "called as fn(logits, inputs, k) (too many positional arguments); a metric function takes (logits, "
                 "inputs, **args)", id="target-wrong-signature"),
    pytest.param({"_target_": "tests.test_metrics.mean_logit", "metric": "loss"}, "metrics.m: has both metric "
                 "('loss') and _target_; give one of them", id="metric-and-target"),
]


@pytest.mark.parametrize("spec,problem", BAD_SPECS)
def test_a_bad_spec_is_refused_before_any_work_naming_key_value_and_fix(spec, problem, tok):
    with pytest.raises(ConfigError) as err:
        compile_metrics({"m": spec}, tok)
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(problem), err.value.problems
    assert check_spec("metrics.m", spec, tok) == err.value.problems


def test_a_string_token_without_a_tokenizer_is_refused_and_a_good_block_passes(tok):
    assert check_spec("metrics.m", {"metric": "logprob", "target": " Paris"}) == []  # no tokenizer yet: not read
    with pytest.raises(ConfigError, match=r"metrics.m.a: ' hooks' is a string but this run has no tokenizer to read "
                                          "it; give its token id"):
        compile_metrics({"m": {"metric": "logit_diff", "a": " hooks", "b": 3}})
    with pytest.raises(ConfigError, match="metrics: 3 is not a mapping"):
        compile_metrics(3)
    assert compile_metrics(None) == {}
    assert all(check_spec(f"metrics.{n}", s, tok) == [] for n, s in SPECS.items())


BAD_BATCHES = [  # (spec, inputs, the error's key, its message)
    pytest.param({"metric": "logprob", "target": {"field": "answr"}}, dict(fields={"answer": [1, 2]}), "metrics.m",
                 "metrics.m: {field: answr} but the batch has no field 'answr' (it has answer) (did you mean: answer?)",
                 id="field-missing"),
    pytest.param({"metric": "logprob", "target": {"field": "y"}},
                 dict(fields={"y": [" the", "hookrun"]}, sample_start=8), "metrics.m",
                 "metrics.m.target: field 'y' of sample 9: 'hookrun' is 2 tokens ['hook', 'run'] (ids [297, 326]), not one",
                 id="field-string-of-two-tokens"),
    pytest.param({"metric": "logprob", "target": {"field": "y"}}, dict(fields={"y": [1, 2, 3]}), "metrics.m",
                 "metrics.m: field 'y' has 3 values for a batch of 2 samples", id="field-length"),
    pytest.param({"metric": "logprob", "target": {"field": "y"}}, dict(fields={"y": [1.5, 2]}), "metrics.m",
                 "metrics.m.target: field 'y' of sample 0 is 1.5, not a token", id="field-float"),
    pytest.param({"metric": "rank", "target": 600}, {}, "metrics.m.target", "metrics.m.target: token id 600 is outside "
                 "the model's 512 logits; give an id below 512", id="id-beyond-vocab"),
    pytest.param({"metric": "logit_diff", "a": 1, "b": {"field": "y"}}, dict(fields={"y": [2, 512]}, sample_start=4),
                 "metrics.m.b", "metrics.m.b: token id 512 (sample 5) is outside the model's 512 logits",
                 id="field-id-beyond-vocab"),
    pytest.param({"metric": "prob", "target": 1, "position": 3}, {}, "metrics.m.position", "metrics.m.position: [3] "
                 "reaches beyond a sequence of 2 real tokens in this batch", id="position-beyond-sequence"),
    pytest.param({"metric": "kl"}, {}, "metrics.m", "metrics.m: metric kl needs reference logits",
                 id="kl-no-reference"),
    pytest.param({"metric": "kl"}, dict(reference=torch.zeros(2, 4, 100)), "metrics.m", "metrics.m: reference logits "
                 "[2, 4, 100] do not fit these [2, 4, 512]", id="kl-reference-vocab"),
    pytest.param({"metric": "loss"}, dict(input_ids=None), "metrics.m", "metrics.m: metric loss needs the batch's "
                 "input_ids", id="loss-no-ids"),
    pytest.param({"_target_": "tests.test_metrics.wrong_shape"}, {}, "metrics.m", "metrics.m: "
                 "tests.test_metrics.wrong_shape returned [2, 512]; a metric function returns a tensor of one value "
                 "per sample, shape [2]", id="user-metric-shape"),
    pytest.param({"_target_": "tests.test_metrics.mean_logit", "scale": "x"}, {}, "metrics.m", "metrics.m: "
                 "tests.test_metrics.mean_logit failed: TypeError:", id="user-metric-fails"),
]


@pytest.mark.parametrize("spec,given,key,message", BAD_BATCHES)
def test_a_batch_a_metric_cannot_take_raises_naming_the_metric(spec, given, key, message, tok):
    mask = torch.tensor([[True, True, True, False], [False, False, True, True]])  # lengths 3 and 2
    inputs = dict(info=TokenInfo.of_batch(mask, mask, 8), input_ids=torch.ones(2, 4, dtype=torch.long))
    metric = compile_metrics({"m": spec}, tok)["m"]
    with pytest.raises(MetricError) as err:
        metric(torch.zeros(2, 4, 512), MetricInputs(**{**inputs, **given}))
    assert err.value.key == key and str(err.value).startswith(message), str(err.value)
