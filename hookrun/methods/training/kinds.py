"""The dictionaries a `train:` block trains, each kind's activation and loss as its reference code defines it.

    d = TrainingDictionary(d_in=64, d_sae=256, kind="topk", k=8)          # an SAE; d_out=...: a transcoder
    out = d.losses(x, dead=mask, coefficient=1.0)   # {"loss", "mse_loss", "aux_loss", "features", "hidden_pre", ...}
    sae = d.inference()                              # a hookrun SparseAutoencoder (or a transcoder's weights)

The maths, from SAELens 6.54 (sae_lens/saes/*.py; docs/training.md cites each):
    sae_in = x - b_dec (an SAE; a transcoder subtracts nothing);  pre = sae_in @ W_enc + b_enc
    relu       f = relu(pre);  loss = mse + coef * mean |f * |W_dec rows||_1        (standard_sae.py)
    topk       pre *= |W_dec rows| (rescale_acts_by_decoder_norm); f = the k largest of pre, relu'd;
               loss = mse + aux_coefficient * AuxK                                       (topk_sae.py)
    batchtopk  as topk, but the k * batch largest over the whole batch; a running threshold (the minimum
               positive feature, EMA topk_threshold_lr) makes it a JumpReLU after training   (batchtopk_sae.py)
    jumprelu   f = pre * (pre > threshold), straight-through gradients for the threshold (rectangle kernel of
               `bandwidth`); loss = mse + coef * mean sum Step(pre, threshold)           (jumprelu_sae.py)
    mse = sum over d_out of (x_hat - target)^2, mean over tokens;  x_hat = f @ W_dec + b_dec (+ x @ W_skip^T)
    AuxK: the k_aux = d_in // 2 largest pre-activations of dead features reconstruct the residual
    (x - x_hat).detach() without b_dec; scaled by min(dead / k_aux, 1) (topk_sae.py, after sparsify's sae.py).

topk and batchtopk train on a sparse path (sparse=True, the default; the same values as the dense one within float
rounding, tests/test_train_kinds.py): the pre-activations once without a graph, top-k, then only the chosen
(row, feature) pairs carry gradients: SparseEncoder's backward writes W_enc's and b_enc's chosen columns by one
sparse product, the decoder is an embedding_bag of the chosen rows of W_dec (sparsify 1.3's fused_encoder.py and
utils.py eager_decode); no dense [tokens, d_sae] gradient is formed.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import nn

KINDS = ("relu", "topk", "batchtopk", "jumprelu")


def rectangle(x: torch.Tensor) -> torch.Tensor:
    """SAELens's rectangle kernel: 1 on (-0.5, 0.5), else 0."""
    return ((x > -0.5) & (x < 0.5)).to(x)


class Step(torch.autograd.Function):
    """Heaviside step (pre > threshold) with SAELens's straight-through gradient to the threshold."""

    @staticmethod
    def forward(ctx, x, threshold, bandwidth: float):
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x)

    @staticmethod
    def backward(ctx, grad):
        x, threshold = ctx.saved_tensors
        ste = (1.0 / ctx.bandwidth) * rectangle((x - threshold) / ctx.bandwidth) * grad
        return None, torch.sum(-ste, dim=0), None


class JumpReLU(torch.autograd.Function):
    """pre * (pre > threshold) with SAELens's straight-through gradient to the threshold."""

    @staticmethod
    def forward(ctx, x, threshold, bandwidth: float):
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x * (x > threshold)).to(x)

    @staticmethod
    def backward(ctx, grad):
        x, threshold = ctx.saved_tensors
        ste = (threshold / ctx.bandwidth) * rectangle((x - threshold) / ctx.bandwidth) * grad
        return (x > threshold) * grad, torch.sum(-ste, dim=0), None


class SparseEncoder(torch.autograd.Function):
    """The encoder's pre-activations at chosen (row, feature) pairs, given their values (computed without a graph),
    with a backward into the chosen columns of W_enc and b_enc only (after sparsify's FusedEncoder).

        pre = SparseEncoder.apply(sae_in, W_enc, b_enc, b_dec, rows, cols, values)   # [E], differentiable

    sae_in [n, d_in]: the encoder's input (x - b_dec for an SAE: b_dec then gets its gradient through it; None for a
    transcoder); rows, cols [E]: the pairs; values [E]: (sae_in @ W_enc + b_enc)[rows, cols]. Gradients: W_enc
    = (G^T @ sae_in)^T and the input's G @ W_enc^T as products of the sparse G [n, d_sae] (torch.sparse.mm), b_enc and
    b_dec from G's column sums."""

    @staticmethod
    def forward(ctx, sae_in, W_enc, b_enc, b_dec, rows, cols, values):
        ctx.save_for_backward(sae_in, W_enc, rows, cols)
        ctx.b_dec = b_dec is not None
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        sae_in, W_enc, rows, cols = ctx.saved_tensors
        grad = grad.contiguous()
        n, d_sae = sae_in.shape[0], W_enc.shape[1]
        g_in = g_w = g_b = g_dec = None
        if ctx.needs_input_grad[1]:
            by_feature = torch.sparse_coo_tensor(torch.stack([cols, rows]), grad, (d_sae, n), check_invariants=False)
            g_w = torch.sparse.mm(by_feature, sae_in).T
        if ctx.needs_input_grad[2] or (ctx.b_dec and ctx.needs_input_grad[3]):
            column = torch.zeros(d_sae, dtype=grad.dtype, device=grad.device).index_add_(0, cols, grad)
            g_b = column if ctx.needs_input_grad[2] else None
            if ctx.b_dec and ctx.needs_input_grad[3]:
                g_dec = -(W_enc @ column)
        if ctx.needs_input_grad[0]:
            by_row = torch.sparse_coo_tensor(torch.stack([rows, cols]), grad, (n, d_sae), check_invariants=False)
            g_in = torch.sparse.mm(by_row, W_enc.T.contiguous())
        return g_in, g_w, g_b, g_dec, None, None, None


class Losses(dict):
    """A training forward's outputs (TrainingDictionary.losses); on the sparse path "features", the dense
    [n, d_sae] matrix, is made from rows, cols and values only when it is asked for."""

    def __missing__(self, key):
        if key != "features" or "cols" not in self:
            raise KeyError(key)
        values = self["values"]
        dense = values.new_zeros(self["shape"])
        dense[self["rows"], self["cols"]] = values
        self[key] = dense
        return dense


def batch_topk(pre: torch.Tensor, k: float) -> torch.Tensor:
    """SAELens's BatchTopK: relu, then the int(k * rows) largest entries of the whole batch kept."""
    acts = pre.relu()
    flat = acts.flatten()
    top = torch.topk(flat, int(k * acts.shape[:-1].numel()), dim=-1)
    return torch.zeros_like(flat).scatter_(-1, top.indices, top.values).reshape(acts.shape)


def topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """SAELens's TopK: the k largest of each row, relu'd; zeros elsewhere."""
    values, indices = torch.topk(pre, k=k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter_(-1, indices, values.relu())   # in place: no copy of the zeros


def aux_budget(target: torch.Tensor, out: torch.Tensor, dead: Optional[torch.Tensor]):
    """AuxK's inputs, as SAELens's calculate_topk_aux_loss takes them: (the residual to reconstruct, k_aux = half
    the input width capped at the dead count, the loss's scale min(dead / k_aux, 1)), or None with no dead feature.
    Usage: residual, k_aux, scale = aux_budget(x, x_hat, dead)."""
    if dead is None or (n_dead := int(dead.sum())) == 0:
        return None
    k_aux = target.shape[-1] // 2
    return (target - out).detach(), min(k_aux, n_dead), min(n_dead / k_aux, 1.0)


class TrainingDictionary(nn.Module):
    """A sparse autoencoder (d_out = d_in, same site) or a transcoder (d_out, another site; skip: W_skip) being trained.

        d = TrainingDictionary(64, 256, "relu")
        out = d.losses(x); out["loss"].backward()

    Parameters as SAELens names them: W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_out], b_dec [d_out],
    threshold [d_sae] (jumprelu), W_skip [d_out, d_in] (a skip transcoder); buffer topk_threshold (batchtopk).
    Initialised as SAELens's TrainingSAE: W_dec kaiming uniform, rows scaled to decoder_init_norm, W_enc = W_dec^T.
    sparse (topk, batchtopk): train on the sparse path (the module docstring); False: the dense one."""

    def __init__(self, d_in: int, d_sae: int, kind: str = "relu", k: Optional[float] = None,
                 d_out: Optional[int] = None, skip: bool = False, transcoder: bool = False,
                 rescale_acts_by_decoder_norm: bool = True, decoder_init_norm: Optional[float] = 0.1,
                 jumprelu_init_threshold: float = 0.01, jumprelu_bandwidth: float = 0.05,
                 aux_coefficient: float = 1.0, topk_threshold_lr: float = 0.01, sparse: bool = True,
                 dtype=torch.float32, device=None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        self.d_in, self.d_sae, self.kind = int(d_in), int(d_sae), kind
        self.transcoder = bool(transcoder or d_out is not None or skip)
        self.d_out = int(d_out) if d_out is not None else self.d_in
        self.k = k
        self.rescale = bool(rescale_acts_by_decoder_norm) and kind in ("topk", "batchtopk")
        self.bandwidth = float(jumprelu_bandwidth)
        self.aux_coefficient = float(aux_coefficient)
        self.topk_threshold_lr = float(topk_threshold_lr)
        self.sparse = bool(sparse) and kind in ("topk", "batchtopk")
        kw = {"dtype": dtype, "device": device}
        w_dec = torch.empty(self.d_sae, self.d_out, **kw)
        nn.init.kaiming_uniform_(w_dec)
        if decoder_init_norm is not None:
            w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True) * decoder_init_norm
        self.W_dec = nn.Parameter(w_dec)
        w_enc = w_dec.T.clone().contiguous() if self.d_out == self.d_in else torch.empty(self.d_in, self.d_sae, **kw)
        if self.d_out != self.d_in:  # a transcoder of another width: the encoder as the decoder's init would be
            nn.init.kaiming_uniform_(w_enc.T)
            if decoder_init_norm is not None:
                w_enc = w_enc / w_enc.norm(dim=0, keepdim=True) * decoder_init_norm
        self.W_enc = nn.Parameter(w_enc)
        self.b_enc = nn.Parameter(torch.zeros(self.d_sae, **kw))
        self.b_dec = nn.Parameter(torch.zeros(self.d_out, **kw))
        if kind == "jumprelu":
            self.threshold = nn.Parameter(torch.full((self.d_sae,), float(jumprelu_init_threshold), **kw))
        if kind == "batchtopk":
            self.register_buffer("topk_threshold", torch.tensor(0.0, dtype=torch.float64, device=device))
        if skip:
            self.W_skip = nn.Parameter(torch.zeros(self.d_out, self.d_in, **kw))

    @property
    def skip(self) -> bool:
        return hasattr(self, "W_skip")

    def decoder_norm(self) -> torch.Tensor:
        return self.W_dec.norm(dim=-1)

    def encode_with_hidden_pre(self, x: torch.Tensor, training: bool = True):
        """(features, pre-activations) of x [n, d_in]; training=False: batchtopk as the JumpReLU it is saved as."""
        sae_in = x if self.transcoder else x - self.b_dec
        pre = sae_in @ self.W_enc + self.b_enc
        if self.kind == "relu":
            return torch.relu(pre), pre
        if self.kind == "jumprelu":
            return JumpReLU.apply(pre, self.threshold, self.bandwidth), pre
        if self.rescale:
            pre = pre * self.decoder_norm()
        if self.kind == "topk":
            return topk(pre, int(self.k)), pre
        if not training:
            return pre * (pre > self.topk_threshold.to(pre.dtype)), pre
        return batch_topk(pre, float(self.k)), pre

    def decode(self, f: torch.Tensor, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The reconstruction [n, d_out] from features (x: the input, for a skip transcoder)."""
        if self.rescale:   # times the reciprocal, as SAELens's act_times_W_dec: its backward stays [d_sae]-sized
            f = f * (1 / self.decoder_norm())
        out = f @ self.W_dec + self.b_dec
        if self.skip:
            out = out + x @ self.W_skip.T
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f, _ = self.encode_with_hidden_pre(x, training=False)
        return self.decode(f, x)

    def losses(self, x: torch.Tensor, target: Optional[torch.Tensor] = None, dead: Optional[torch.Tensor] = None,
               coefficient: float = 1.0) -> Dict[str, torch.Tensor]:
        """One training forward (SAELens's training_forward_pass): loss, mse_loss, aux_loss, sae_out, features,
        hidden_pre (the sparse path: rows, cols, values instead, "features" made when asked for). target: the output
        site's value (a transcoder; default x); dead: bool [d_sae] (AuxK); coefficient: the sparsity coefficient now
        (l1 / l0, after warm-up). batchtopk's threshold is updated."""
        target = x if target is None else target
        if self.sparse:
            return self.sparse_losses(x, target, dead)
        if self.kind == "jumprelu":
            with torch.no_grad():
                self.threshold.data.clamp_(min=0.0)
        f, pre = self.encode_with_hidden_pre(x)
        out = self.decode(f, x)
        mse = (out - target).pow(2).sum(-1).mean()
        if self.kind == "relu":
            # SAELens's mean |f * |W_dec rows||_1; f >= 0 (relu'd) and the norms too, so a plain sum: no abs, and
            # no sign in the backward
            aux = (coefficient * (f * self.decoder_norm()).sum(-1)).mean()
        elif self.kind == "jumprelu":
            aux = (coefficient * Step.apply(pre, self.threshold, self.bandwidth).sum(-1)).mean()
        else:
            aux = self.auxk(target, out, pre, dead)
        if self.kind == "batchtopk":
            self.update_threshold(f)
        return Losses({"loss": mse + aux, "mse_loss": mse, "aux_loss": aux, "sae_out": out, "features": f,
                       "hidden_pre": pre})

    def sparse_losses(self, x: torch.Tensor, target: torch.Tensor, dead: Optional[torch.Tensor]) -> Losses:
        """topk / batchtopk's training forward on the sparse path: losses() without the dense features; rows, cols
        and values [E] the chosen pairs and their (relu'd) features, sorted by row ("features" made on demand)."""
        n = len(x)
        with torch.no_grad():   # the scores the top-k choose by: pre-activations, times the decoder norm (folded in)
            sae_in = x if self.transcoder else x - self.b_dec
            norm = self.decoder_norm() if self.rescale else None
            w_enc, b_enc = (self.W_enc, self.b_enc) if norm is None else (self.W_enc * norm, self.b_enc * norm)
            scores = torch.addmm(b_enc, sae_in, w_enc)
            if self.kind == "topk":
                chosen, cols = scores.topk(int(self.k), dim=-1, sorted=False)
                rows = torch.arange(n, device=x.device).repeat_interleave(chosen.shape[-1])
                chosen, cols = chosen.flatten(), cols.flatten()
            else:
                chosen, flat = scores.flatten().topk(int(float(self.k) * n), sorted=False)
                flat, order = flat.sort()
                chosen, rows, cols = chosen[order], flat // self.d_sae, flat % self.d_sae
        f = self.chosen_features(sae_in, rows, cols, chosen, norm)
        out = self.sparse_decode(rows, cols, f.relu(), n) + self.b_dec
        if self.skip:
            out = out + x @ self.W_skip.T
        mse = (out - target).pow(2).sum(-1).mean()
        aux = self.sparse_auxk(target, out, sae_in, scores, norm, dead)
        values = f.detach().relu()
        if self.kind == "batchtopk":
            self.update_threshold(values)
        return Losses({"loss": mse + aux, "mse_loss": mse, "aux_loss": aux, "sae_out": out, "rows": rows,
                       "cols": cols, "values": values, "shape": (n, self.d_sae)})

    def chosen_features(self, sae_in, rows, cols, chosen, norm) -> torch.Tensor:
        """The differentiable pre-activations (times the decoder norm where rescaled) at the chosen pairs, from their
        scores (no relu)."""
        pre = SparseEncoder.apply(sae_in, self.W_enc, self.b_enc, None if self.transcoder else self.b_dec, rows, cols,
                                  chosen if norm is None else chosen / norm[cols])
        return pre if norm is None else pre * self.decoder_norm()[cols]

    def sparse_decode(self, rows, cols, values, n: int) -> torch.Tensor:
        """sum over a row's pairs of value * W_dec[col] (divided by the decoder norm where rescaled): [n, d_out], by
        embedding_bag over the chosen rows of W_dec (rows sorted)."""
        if self.rescale:
            values = values * (1 / self.decoder_norm())[cols]
        offsets = torch.searchsorted(rows, torch.arange(n, device=rows.device))
        return nn.functional.embedding_bag(cols, self.W_dec, offsets, mode="sum", per_sample_weights=values)

    def sparse_auxk(self, target, out, sae_in, scores, norm, dead: Optional[torch.Tensor]) -> torch.Tensor:
        """AuxK (auxk) on the sparse path: the dead features' top k_aux scores of each row, their decode."""
        if (budget := aux_budget(target, out, dead)) is None:
            return out.new_tensor(0.0)
        residual, k_aux, scale = budget
        with torch.no_grad():
            which = torch.nonzero(dead).flatten()
            chosen, local = scores.index_select(1, which).topk(k_aux, dim=-1, sorted=False)
            cols = which[local.flatten()]
            rows = torch.arange(len(out), device=out.device).repeat_interleave(k_aux)
        acts = self.chosen_features(sae_in, rows, cols, chosen.flatten(), norm)
        e_hat = self.sparse_decode(rows, cols, acts, len(out))
        return self.aux_coefficient * scale * (e_hat - residual).pow(2).sum(-1).mean()

    def firing_counts(self, out: Losses) -> torch.Tensor:
        """float64 [d_sae]: on how many rows of the step each feature fired (was not 0)."""
        if "cols" in out:
            return torch.bincount(out["cols"][out["values"] != 0], minlength=self.d_sae).double()
        f = out["features"]   # (f != 0) summed in f's dtype (exact below 2^24 rows): 1.5x faster than as int64
        return (f != 0).to(f.dtype if len(f) < 2 ** 24 else torch.float64).sum(0).double()

    def auxk(self, target, out, pre, dead: Optional[torch.Tensor]) -> torch.Tensor:
        """SAELens's calculate_topk_aux_loss (after sparsify): the dead features' reconstruction of the residual."""
        if (budget := aux_budget(target, out, dead)) is None:
            return out.new_tensor(0.0)
        residual, k_aux, scale = budget
        top = torch.where(dead[None], pre, -torch.inf).topk(k_aux, sorted=False)
        acts = torch.zeros_like(pre).scatter_(-1, top.indices, top.values)
        if self.rescale:
            acts = acts * (1 / self.decoder_norm())
        return self.aux_coefficient * scale * (acts @ self.W_dec - residual).pow(2).sum(-1).mean()

    @torch.no_grad()
    def update_threshold(self, f: torch.Tensor) -> None:
        """batchtopk: topk_threshold <- (1 - lr) * it + lr * the batch's smallest positive feature (f: the features,
        dense, or the sparse path's values)."""
        positive = f > 0
        if positive.any():
            lr = self.topk_threshold_lr
            self.topk_threshold.copy_((1 - lr) * self.topk_threshold + lr * f[positive].min().double())

    @torch.no_grad()
    def unit_norm_decoder(self) -> None:
        """Decoder rows set to unit norm (sparsify's set_decoder_norm_to_unit_norm)."""
        self.W_dec.data /= self.W_dec.data.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(self.W_dec.dtype).eps)

    @torch.no_grad()
    def remove_parallel_gradient(self) -> None:
        """The decoder's gradient less its component along each row (sparsify's
        remove_gradient_parallel_to_decoder_directions), so a step keeps unit rows unit."""
        if self.W_dec.grad is None:
            return
        rows = self.W_dec.data / self.W_dec.data.norm(dim=-1, keepdim=True)
        self.W_dec.grad -= (self.W_dec.grad * rows).sum(-1, keepdim=True) * rows

    @torch.no_grad()
    def inference_state(self, scale_in: float = 1.0, scale_out: float = 1.0) -> Dict[str, torch.Tensor]:
        """The weights as SAELens's inference SAE takes them: the input normalisation folded in (SAELens's
        fold_activation_norm_scaling_factor: W_enc * s, W_dec / s, b_dec / s), topk's decoder norm folded in
        (_fold_norm_topk), batchtopk's running threshold as a JumpReLU threshold."""
        state = {"W_enc": self.W_enc.detach().clone(), "b_enc": self.b_enc.detach().clone(),
                 "W_dec": self.W_dec.detach().clone(), "b_dec": self.b_dec.detach().clone()}
        threshold = None
        if self.kind == "jumprelu":
            threshold = self.threshold.detach().clone()
        if self.rescale:
            norm = self.decoder_norm().detach()
            state["b_enc"] = state["b_enc"] * norm
            state["W_dec"] = state["W_dec"] / norm[:, None]
            state["W_enc"] = state["W_enc"] * norm[None, :]
        if self.kind == "batchtopk":
            threshold = torch.full_like(self.b_enc, float(self.topk_threshold))
        state["W_enc"] = state["W_enc"] * scale_in
        state["W_dec"] = state["W_dec"] / scale_out
        state["b_dec"] = state["b_dec"] / scale_out
        if self.skip:
            state["W_skip"] = self.W_skip.detach().clone() * (scale_in / scale_out)
        if threshold is not None:
            state["threshold"] = threshold
        return state


def geometric_median(x: torch.Tensor, iterations: int = 100, tolerance: float = 1e-5) -> torch.Tensor:
    """The geometric median of rows x [n, d] by Weiszfeld's iteration (sparsify's utils.geometric_median; SAELens
    < 6 had b_dec_init_method="geometric_median"): b_dec's start that one far outlier does not move."""
    x = x.double()
    guess = x.mean(0)
    for _ in range(iterations):
        weights = 1.0 / (x - guess).norm(dim=-1).clamp_min(1e-8)
        new = (weights[:, None] * x).sum(0) / weights.sum()
        moved = float((new - guess).norm())
        guess = new
        if moved < tolerance * max(float(guess.norm()), 1.0):
            break
    return guess


def saelens_architecture(kind: str, transcoder: bool, skip: bool) -> str:
    """The inference architecture SAELens loads the trained weights as (batchtopk is saved as a JumpReLU)."""
    base = {"relu": "standard", "topk": "topk", "batchtopk": "jumprelu", "jumprelu": "jumprelu"}[kind]
    if not transcoder:
        return base
    prefix = "jumprelu_" if base == "jumprelu" else ""
    return f"{prefix}{'skip_' if skip else ''}transcoder"


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
