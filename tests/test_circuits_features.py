"""Feature attribution through a dictionary (hookrun.methods.circuits.features) against plain hooks and autograd:
AtP over a sparse autoencoder's features and its error term equals the gradient by hand times the change, IG's
features and error sum to the exact effect of patching the whole site, and one feature's exact patch equals a
plain hook adding its decoder direction."""
import torch
import transformers as tf

from hookrun.methods.circuits.features import feature_scores, patch_features
from hookrun.methods.saes import SparseAutoencoder
from tests.helpers import block0

V, D = 64, 32


def setup():
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_layer=2, n_embd=D, n_head=4, n_positions=64,
                                             attn_implementation="eager")).eval()
    sae = SparseAutoencoder(D, 48)
    with torch.no_grad():
        sae.b_enc.normal_(std=0.5)
        sae.W_enc.normal_(std=1.0)
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(1, V, (3, 6), generator=gen)
    tgt = src.clone()
    tgt[:, 1:3] = torch.randint(1, V, (3, 2), generator=gen)
    return model, sae.eval(), {"input_ids": src}, {"input_ids": tgt}


def metric(logits, rows):
    return logits[:, -1, 5] - logits[:, -1, 7]


def test_atp_over_features_and_the_error_term_by_hand():
    model, sae, src, tgt = setup()
    got = feature_scores(model, "blocks.0", sae, src, tgt, metric)
    _, x_s = block0(model, src["input_ids"], metric)
    eps = torch.zeros(3, 6, D, requires_grad=True)
    value, x_t = block0(model, tgt["input_ids"], metric, eps=eps)
    g, = torch.autograd.grad(value.sum(), eps)
    with torch.no_grad():
        f_s, f_t = sae.encode(x_s), sae.encode(x_t)
        e_s, e_t = x_s - sae.decode(f_s), x_t - sae.decode(f_t)
        want = ((f_s - f_t) * (g @ sae.W_dec.t())).sum(1)
        torch.testing.assert_close(got.scores, want, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.error, ((e_s - e_t) * g).sum((1, 2)), rtol=1e-4, atol=1e-6)
    assert (f_s != f_t).any() and got.scores.abs().max() > 1e-4
    ids, vals = got.top(4)
    assert ids.shape == (3, 4) and torch.equal(vals.abs(), got.scores.abs().topk(4, dim=1).values)


def test_ig_over_features_is_complete_and_one_feature_patch_equals_a_plain_hook():
    model, sae, src, tgt = setup()
    ig = feature_scores(model, "blocks.0", sae, src, tgt, metric, method="ig", steps=48)
    with torch.no_grad():
        m_t, x_t = block0(model, tgt["input_ids"], metric)
        _, x_s = block0(model, src["input_ids"], metric)
        whole, _ = block0(model, tgt["input_ids"], metric, replace=x_s)  # the site patched whole
    torch.testing.assert_close(ig.scores.sum(1) + ig.error, whole - m_t, rtol=2e-3, atol=1e-5)
    top = ig.top(2)[0][0].tolist()
    exact = patch_features(model, "blocks.0", sae, src, tgt, top, metric)
    with torch.no_grad():
        change = sae.encode(x_s) - sae.encode(x_t)
        for k, i in enumerate(top):
            want, _ = block0(model, tgt["input_ids"], metric, replace=x_t + change[..., i, None] * sae.W_dec[i])
            torch.testing.assert_close(exact[:, k], want)
