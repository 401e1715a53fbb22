"""Data safety round 5 (issue 52, items 3 and 4) for the methods beside the circuit: a result holding NaN or inf at
the first batch of a model whose weights hold one (patching grids, attribution scores, lens and DLA values, a
dictionary's features) is refused before the store exists, naming the array and the weight; and a run whose
estimated memory (Method.memory_need: copies stacked along the batch axis, IG's copies, the lens's logits,
generation's logits and KV cache) cannot fit the device's free memory is refused before the first batch, with the
figure and the key to lower."""
import numpy as np
import pytest
import torch

import hookrun
import hookrun.methods
from hookrun.methods.saes import SparseAutoencoder, save_saelens
from tests.test_safety_round5 import PATCH, circuit, outcome, replace

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread

BASE = circuit()[:-1]  # the tiny GPT-2 over the pairs, the metric ld, no circuit block
ATTRIBUTION = PATCH.replace("+patching", "+attribution")
LENS = "+lens={sites:{layers:[transformer.h.0],positions:last},tokens:[' model',' store']}"
DLA = "+lens={dla:{tokens:[' model',' store']}}"
SAE = ["+dictionaries.sae1={path:SAE_DIR}", "+hooks.f={kind:forward,layers:[transformer.h.0],dictionary:sae1}"]
WEIGHT = "the model's weights hold NaN or inf (transformer.h.0.attn.c_attn.weight): fix the model's files"
INF_CASES = [  # (id, overrides, the array named)
    ("patching", [*BASE, PATCH], "patching: _patching/ld/scores holds"),
    ("attribution", [*BASE, ATTRIBUTION], "attribution: _attribution/ld/scores holds"),
    ("attribution-ig", [*BASE, ATTRIBUTION.replace("metric:ld", "metric:ld,method:integrated_gradients")],
     "attribution: _attribution/ld/scores holds"),
    ("lens", [*BASE, LENS], "lens: _lens/top/probs holds"),
    ("dla", [*BASE, DLA], "lens: _dla/answer/parts holds"),
    ("dictionary-features", [*BASE, *SAE], "hooks.f.dictionary: f/transformer.h.0/features.values holds"),
]


def with_sae(tmp_path, overrides):
    """`overrides` with SAE_DIR a ReLU SAE of the tiny GPT-2's width saved as a SAELens folder."""
    if not any("SAE_DIR" in o for o in overrides):
        return overrides
    torch.manual_seed(3)
    sae = SparseAutoencoder(32, 48, hook_name="transformer.h.0")
    folder = save_saelens(sae, tmp_path / "sae", hook_name="transformer.h.0")
    return [o.replace("SAE_DIR", str(folder)) for o in overrides]


def inf_model(overrides):
    return replace(overrides, "tests.test_safety_round5.lm", "tests.test_safety_round5.lm_inf")


@pytest.mark.parametrize("overrides,array", [pytest.param(*c[1:], id=c[0]) for c in INF_CASES])
def test_a_nonfinite_result_of_an_inf_weight_is_refused_at_the_first_batch_naming_the_array(tmp_path, overrides,
                                                                                            array):
    """One inf weight: the method's first-batch result holds NaN; the run is refused before the store exists
    (exit 2), naming the array and the weight. The same config on the healthy model runs to `complete` (the NaN
    a grid holds by design, past a sample's end, refuses nothing)."""
    overrides = with_sae(tmp_path, overrides)
    code, message, built, stored = outcome(tmp_path, inf_model(overrides))
    assert code == 2 and built and not stored, message
    assert array in message and "NaN or inf value(s) in the first batch" in message and WEIGHT in message, message
    assert "Traceback" not in message
    code, message, _, _ = outcome(tmp_path, overrides)
    assert code == 0 and hookrun.open(tmp_path / "s.zarr").status == "complete", message


GEN = ["+experiment=lm_tokens", "model._target_=tests.test_safety_round5.lm", "model.n_layer=2", "model.n_embd=32",
       "model.n_head=4", "model.n_positions=64", "data.text.files=[PAIRS_FILE]", "data.text.fields={clean:clean}",
       "data.batch_size=2"]


def test_generation_that_cannot_fit_is_refused_before_the_first_batch_with_the_figure_and_the_key(tmp_path):
    """max_new_tokens 10**6 over a 50k vocabulary: every step's float32 logits alone are 10**6 x 2 prompts x 50257
    x 4 bytes = 402 GB, more than this machine has; refused after the model, before the store, naming the key."""
    code, message, built, stored = outcome(tmp_path, [*GEN, "model.vocab_size=50257",
                                                      "generate.max_new_tokens=1000000"])
    assert code == 2 and built and not stored, message
    assert "generate: the run would hold about" in message and "lower generate.max_new_tokens" in message, message
    assert f"1000000 steps' logits x 2 prompts x 50257 tokens: {1e6 * 2 * 50257 * 4 / 1e9:.3g} GB" in message, message


SMALL = 20_000  # bytes: a device smaller than what the tiny runs below need
MEMORY_CASES = [  # (id, overrides, the figure's part, the key to lower)
    ("patching-sites-per-forward", [*BASE, PATCH.replace("metric:ld", "metric:ld,sites_per_forward:4")],
     "4 copies of 2 prompts x 8 tokens stacked along the batch axis", "patching.sites_per_forward"),
    ("attribution-ig", [*BASE, ATTRIBUTION.replace("metric:ld", "metric:ld,method:integrated_gradients")],
     "1 copy of 2 prompts x 8 tokens, forward and backward", "data.batch_size"),
    ("lens", [*BASE, LENS.replace("positions:last", "positions:all")], "the final logits of 2 prompts x 8 positions",
     "lens.sites.positions"),
    ("generation", [*GEN, "model.vocab_size=512", "generate.max_new_tokens=64"],
     "64 steps' logits x 2 prompts x 512 tokens", "generate.max_new_tokens"),
]


@pytest.mark.parametrize("overrides,part,key", [pytest.param(*c[1:], id=c[0]) for c in MEMORY_CASES])
def test_a_run_that_cannot_fit_a_small_device_is_refused_naming_the_part_and_the_key(tmp_path, monkeypatch,
                                                                                     overrides, part, key):
    """A device with 20 kB free (hookrun.methods.free_memory: what mem_get_info or MemAvailable would say there):
    each method's estimate is refused before the store, with its largest part and the key to lower; the figure
    of that part is its bytes computed here from the model's shape (float32 logits over the vocabulary)."""
    seen = {}
    real = hookrun.methods.run_shape

    def shape(job):
        seen["shape"] = real(job)
        return seen["shape"]
    for module in ("patching", "attribution", "lens", "generation"):
        monkeypatch.setattr(f"hookrun.methods.{module}.run_shape", shape)
    monkeypatch.setattr(hookrun.methods, "free_memory", lambda device: SMALL)
    code, message, built, stored = outcome(tmp_path, overrides)
    assert code == 2 and built and not stored, message
    s = seen["shape"]
    assert (s.batch, s.tokens, s.d_model, s.layers) == (2, 8, 32, 2)
    figures = {"patching.sites_per_forward": 4 * 4 * 2 * 8 * (s.vocab + 4 * 32),
               "data.batch_size": 4 * 2 * 8 * (2 * s.vocab + 24 * 32 * 2),
               "lens.sites.positions": 3 * 4 * 2 * 8 * s.vocab, "generate.max_new_tokens": 4 * 64 * 2 * 512}
    figure = hookrun.methods.gigabytes(figures[key])
    assert f"{part}" in message and f": {figure}), more than the 20 kB free on cpu; lower {key}" in message, message


@pytest.mark.parametrize("block,reader", [(PATCH, "grid"), (ATTRIBUTION, "attribution")])
def test_nan_past_the_check_is_stored_and_read_back_as_nan_with_a_warning(tmp_path, monkeypatch, block, reader):
    """Were a NaN to reach the store (the weights' check blinded here: a NaN the weights do not explain, as a
    metric's), the run ends `complete` and its reader reads it: the grid NaN, a RuntimeWarning naming the metric,
    never an error."""
    monkeypatch.setattr("hookrun.engine.preflight.nonfinite_weights", lambda model: [])
    code, message, _, _ = outcome(tmp_path, inf_model([*BASE, block]))
    assert code == 0, message
    cap = hookrun.open(tmp_path / "s.zarr")
    assert cap.status == "complete"
    with pytest.warns(RuntimeWarning, match=r"ld \(source run\) holds 4 NaN or inf value\(s\) of 4"):
        grid = cap.grid() if reader == "grid" else cap.read("attribution")
    assert np.isnan(grid.source).all() and np.isnan(grid.scores).all()
    assert grid.to_frame()["score"].isna().all()


@pytest.mark.parametrize("overrides,read,array", [
    pytest.param([*BASE, LENS], lambda cap: cap.read("lens"), "_lens/top/probs", id="lens"),
    pytest.param([*BASE, DLA], lambda cap: cap.read("lens"), "_dla/answer/parts", id="dla"),
    pytest.param([*BASE, *SAE], lambda cap: cap.read("dictionaries", "features", hook="f", features=[0, 1]),
                 "f/transformer.h.0 features.values", id="dictionary-features")])
def test_nan_past_the_check_in_lens_and_dictionaries_reads_back_with_a_warning(tmp_path, monkeypatch, overrides, read,
                                                                               array):
    """The same for the lens's, DLA's and a dictionary's arrays: stored, `complete`, read back as stored with a
    RuntimeWarning naming the array."""
    monkeypatch.setattr("hookrun.engine.preflight.nonfinite_weights", lambda model: [])
    code, message, _, _ = outcome(tmp_path, inf_model(with_sae(tmp_path, overrides)))
    assert code == 0, message
    cap = hookrun.open(tmp_path / "s.zarr")
    assert cap.status == "complete"
    with pytest.warns(RuntimeWarning, match=f"{array} holds \\d+ NaN or inf value"):
        read(cap)
