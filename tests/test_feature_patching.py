"""A dictionary's features as patching sites (patch_grid(dictionary=, features=), patching.sites.dictionary/features)
against plain PyTorch written here: one feature patched a forward by an own hook adding (f_source - f_target) times
the decoder row at every position, each pair alone; the grid stored and read back; the refusals before the store."""
import numpy as np
import pytest
import torch

import hookrun
from hookrun.capture.tokens import TokenInfo
from hookrun.config.checks import ConfigError
from hookrun.engine.runner import run
from hookrun.methods.saes import SparseAutoencoder, save_saelens
from hookrun.methods.patching import PatchError, patch_grid
from tests.helpers import PAIRS, make_cfg, write_pairs
from tests.test_patching_run import GPT2, grid_run, ids_of, plain_ld, reference

LAYER, D_SAE, FEATURES = "transformer.h.1", 48, [0, 5, 17, 47]


def make_sae(dtype=torch.float32):
    torch.manual_seed(3)
    sae = SparseAutoencoder(GPT2["n_embd"], D_SAE, dtype=dtype)
    with torch.no_grad():
        sae.b_enc.normal_(std=0.5)
    return sae.eval()


def plain_features(model, sae, clean, corrupt, answer, features, layer=LAYER):
    """[features]: the metric of `corrupt` with feature f of the layer's output moved to its value on `clean` at
    every position (x + (f_clean - f_corrupt) * W_dec[f]), one forward a feature."""
    mod = model.get_submodule(layer)
    kept = {}
    h = mod.register_forward_hook(lambda m, a, o: kept.__setitem__("x", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model(input_ids=ids_of(clean))
    h.remove()
    with torch.no_grad():
        f_src = sae.encode(kept["x"])
    out = []
    for f in features:
        def post(m, a, o):
            x = o[0] if isinstance(o, tuple) else o
            f_tgt = sae.encode(x)[..., f]
            x = x + ((f_src[..., f] - f_tgt)[..., None] * sae.W_dec[f]).to(x.dtype)
            return (x, *o[1:]) if isinstance(o, tuple) else x
        h = mod.register_forward_hook(post)
        with torch.no_grad():
            out.append(plain_ld(model(input_ids=ids_of(corrupt)).logits, answer))
        h.remove()
    return np.array(out)


@pytest.mark.slow
def test_patch_grid_of_features_equals_one_feature_a_forward_by_hand_in_float64():
    model, sae = reference("gpt2").double(), make_sae(torch.float64)
    store = ids_of(" store")[0, 1]
    moved = False
    for clean, corrupt, answer in PAIRS:   # each pair a batch of one (the pairs differ in length)
        src, tgt = ids_of(clean), ids_of(corrupt)
        info_src, info_tgt = (TokenInfo.of_batch(torch.ones_like(t, dtype=torch.bool),
                                                 torch.ones_like(t, dtype=torch.bool), t.shape[1]) for t in (src, tgt))
        a = ids_of(answer)[0, 1]
        ld = lambda logits, rows: logits[:, -1, a] - logits[:, -1, store]  # noqa: E731
        grid = patch_grid(model, {"input_ids": src}, {"input_ids": tgt}, info_src, info_tgt, [LAYER], metric=ld,
                          dictionary=sae, features=FEATURES, sites_per_forward=3, source_positions="all")
        assert grid.axis == "feature" and grid.labels == FEATURES and grid.scores.shape == (1, 1, 4)
        want = plain_features(model, sae, clean, corrupt, answer, FEATURES)
        np.testing.assert_allclose(grid.scores[0, 0].double().numpy(), want, atol=1e-5, rtol=0)
        moved |= bool((grid.scores[0, 0] != grid.corrupt[0]).any())
    assert moved  # some feature moves the metric
    clean, info = ids_of(PAIRS[0][0]), info_src
    with pytest.raises(PatchError, match=r"features: \[3, 48\] is not a list of feature ids in 0\.\.47"):
        patch_grid(model, {"input_ids": clean}, {"input_ids": corrupt}, info, info, [LAYER], metric=ld,
                   dictionary=sae, features=[3, 48])


@pytest.fixture
def sae_dir(tmp_path):
    return save_saelens(make_sae(), tmp_path / "sae", hook_name=LAYER)


def feature_run(pairs, sae_dir, features="[0,5,17,47]", dictionary="sae1"):
    return grid_run(pairs, "gpt2", f"{{layers:[{LAYER}],dictionary:{dictionary},features:{features}}}",
                    f"+dictionaries={{sae1:{{path:{sae_dir}}}}}")


@pytest.mark.slow
def test_a_run_stores_the_features_grid_and_cap_grid_reads_it_back(tmp_path, sae_dir):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    path = tmp_path / "feats.zarr"
    run(make_cfg([*feature_run(pairs, sae_dir), f"store.path={path}"]))
    grid, model, sae = hookrun.open(path).grid(), reference("gpt2"), make_sae()
    assert grid.axis == "feature" and grid.labels == FEATURES and grid.layers == [LAYER]
    assert grid.scores.shape == (len(PAIRS), 1, 4)
    for i, (clean, corrupt, answer) in enumerate(PAIRS):
        np.testing.assert_allclose(grid.scores[i, 0], plain_features(model, sae, clean, corrupt, answer, FEATURES),
                                   atol=2e-4, rtol=1e-4)   # float32, batched with padding against each pair alone
    assert list(grid.to_frame().columns)[:3] == ["sample", "layer", "feature"]


def refused(tmp_path, overrides) -> str:
    path = tmp_path / "refused.zarr"
    with pytest.raises(ConfigError) as err:
        run(make_cfg([*overrides, f"store.path={path}"]))
    assert not path.exists()
    return str(err.value)


def test_refusals_before_the_store(tmp_path, sae_dir):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    assert ("patching.sites.features: 48 is out of range: dictionary sae1 has 48 features (0..47); pick features "
            "it has") in refused(tmp_path, feature_run(pairs, sae_dir, "[3,48]"))
    assert ("patching.sites.dictionary: 'sae2' is not in the dictionaries: block ({sae1}) (did you mean: sae1?); add "
            "dictionaries: {sae2: {path: DIR}}") in refused(tmp_path, feature_run(pairs, sae_dir, dictionary="sae2"))
    assert "patching.sites.features: 'x' is not a list of feature ids (e.g. [12, 40])" in \
        refused(tmp_path, feature_run(pairs, sae_dir, "x"))
