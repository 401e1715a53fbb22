"""Induction heads (Olsson et al. 2022) reproduced with hookrun: a 2-layer attention-only transformer, its
training, the repeated sequences it is measured on, and the analysis of the induction experiments.

    net = model()                   # the shipped weights (hookrun.experiments.weights), the same on every CPU
    seqs = repeated(n=128, half=16) # [{"clean": [BOS, A, A], "corrupt": [BOS, B, A], ...}] as token ids
    python -m hookrun.experiments.induction --out runs/induction   # the runs, the table, the pictures

The model (AttnOnly) is token + learned position embeddings, 2 blocks of pre-LayerNorm multi-head attention (no
MLP), a final LayerNorm and the unembedding. Its modules are named for hookrun: `blocks.N.attn.pattern` (a Softmax)
outputs the attention pattern [batch, heads, query, key]; `blocks.N.attn.out` (the output projection) takes the
heads side by side [batch, seq, heads * d_head], head h in columns h*d_head:(h+1)*d_head. Its experiment declares its
anatomy (`model.anatomy` in conf/experiment/induction.yaml; in Python it is inferred from the modules and proved on
one tiny forward, hookrun.capture.anatomy), so experiments name its sites in the standard vocabulary:
`blocks.N.attn.heads` is that input split [batch, seq, heads, d_head], which `heads:` edits and head patching grids
use; `blocks.N` outputs the residual stream.

It is trained on sequences of random tokens in which a random segment comes back later at a random offset, so no
fixed-offset (positional) head can predict the repeat: only matching content can. It is measured on the paper's
repeated random tokens, BOS + A + A with A `half` random tokens: the loss on the repeated half drops far below
log(vocab), layer 1 holds heads attending from each repeated token to the token after its previous occurrence
(key position i - half + 1), and layer 0 a previous-token head they compose with.
"""
from __future__ import annotations

import argparse
import functools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import pandas as pd
import torch
from torch import nn

import hookrun
from hookrun.experiments import weights
from hookrun.experiments._cli import hookrun_cli

FORMAT = 1  # raise when fit or the model changes: shipped weights of an older version are then not read
BOS = 0  # token id 0 opens every sequence; the random tokens are 1 .. vocab_size - 1
POST_NORM_STEPS = 4000  # the post-norm variant's shipped training (at 1000 steps it attends a fixed distance back)


@dataclass
class AttnOnlyConfig:
    """The shape of an AttnOnly model; hookrun reads num_attention_heads (heads: edits and grids), vocab_size and
    n_positions (the check of token ids and lengths before a run)."""

    model_type = "hookrun_attn_only"  # a name for its architecture (hookrun.capture.anatomy); not a field
    vocab_size: int = 64
    d_model: int = 64
    num_attention_heads: int = 4
    n_layer: int = 2
    n_positions: int = 33
    post_norm: bool = False  # a norm after attention too, before the residual add (Gemma 2/3's post-norm blocks)

    @property
    def n_head(self) -> int:
        return self.num_attention_heads

    @property
    def num_hidden_layers(self) -> int:  # the block count hookrun's anatomy inference reads
        return self.n_layer


class Attention(nn.Module):
    """Causal multi-head self-attention whose pattern is the output of `pattern` and whose heads' outputs are
    concatenated into the input of `out`."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not a multiple of n_head {n_head}")
        self.n_head, self.d_head = n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.pattern = nn.Softmax(dim=-1)  # [B, H, Q, K]: a forward hook captures it
        self.out = nn.Linear(d_model, d_model)  # input [B, T, H * Dh]: the heads side by side

    def forward(self, x: torch.Tensor, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, self.d_head).permute(2, 0, 3, 1, 4)  # each [B, H, T, Dh]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head)
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
        if keys is not None:  # padding: no query attends to a pad key
            allowed = allowed & keys[:, None, None, :].bool()
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        z = self.pattern(scores) @ v  # [B, H, T, Dh]
        return self.out(z.transpose(1, 2).reshape(b, t, self.n_head * self.d_head))


class Block(nn.Module):
    """x + attn(ln(x)): one attention-only residual block; post_norm: x + post(attn(ln(x))), a norm on attention's
    output before the add (Gemma 2/3's post_attention_layernorm)."""

    def __init__(self, d_model: int, n_head: int, post_norm: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.post = nn.LayerNorm(d_model) if post_norm else None

    def forward(self, x: torch.Tensor, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.attn(self.ln(x), keys)
        return x + (self.post(out) if self.post is not None else out)


class AttnOnly(nn.Module):
    """A transformer with attention and no MLP: embed + pos_embed -> blocks -> ln_f -> unembed; logits [B, T, V].

        logits = AttnOnly(AttnOnlyConfig())(input_ids=ids)   # attention_mask, position_ids taken as hookrun passes them
    """

    def __init__(self, config: AttnOnlyConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.pos_embed = nn.Embedding(config.n_positions, d)
        self.embeddings = nn.Identity()  # token + position embedding: the residual stream before block 0
        self.blocks = nn.ModuleList(Block(d, config.num_attention_heads, config.post_norm)
                                    for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.unembed = nn.Linear(d, config.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.unembed

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.embeddings(self.embed(input_ids) + self.pos_embed(position_ids))
        for block in self.blocks:
            x = block(x, attention_mask)
        return self.unembed(self.ln_f(x))


# -- data --------------------------------------------------------------------------------------------------------
def repeated(n: int = 128, half: int = 16, vocab_size: int = 64, seed: int = 1) -> List[dict]:
    """`n` examples of the paper's repeated random tokens, as hookrun's data.text.dataset takes them: `clean` is
    BOS + A + A (A: `half` tokens drawn uniformly from 1 .. vocab_size - 1), `corrupt` is BOS + B + A (B another
    draw), so its second half repeats nothing; both 1-D LongTensors of 2 * half + 1 ids. `half` is kept as a field."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        a, b = (torch.randint(1, vocab_size, (half,), generator=gen) for _ in range(2))
        bos = torch.tensor([BOS])
        out.append({"clean": torch.cat([bos, a, a]), "corrupt": torch.cat([bos, b, a]), "half": half, "example": i})
    return out


def training_batch(rng: random.Random, batch: int, length: int, vocab_size: int) -> torch.Tensor:
    """[batch, length] training sequences: BOS then random tokens, in which a segment of 4 .. (length - 1) // 2
    tokens comes back once at a random later offset (the second copy ends the sequence half the time, as in the
    measured BOS + A + A)."""
    rows = []
    body = length - 1
    for _ in range(batch):
        seq = [rng.randrange(1, vocab_size) for _ in range(body)]
        m = rng.randint(4, body // 2)
        start = rng.randint(0, body - 2 * m)
        second = body - m if rng.random() < 0.5 else rng.randint(start + m, body - m)
        seq[second:second + m] = seq[start:start + m]
        rows.append([BOS] + seq)
    return torch.tensor(rows)


def halves(length: int) -> dict:
    """The predicting positions of each half of a BOS + A + A sequence of `length` tokens: the logits at position p
    predict token p + 1. `first`: p = 1 .. half - 1 (tokens 2 .. half of A's first copy), `repeat`: p = half + 1 ..
    2 * half - 1 (the same tokens of the second copy). Left out: BOS predicting A's first token and the last token
    of the first copy predicting the repeat's first (no sequence says that a repeat starts there)."""
    if length < 5 or length % 2 == 0:
        raise ValueError(f"a BOS + A + A sequence has 2 * half + 1 tokens (half >= 2); this one has {length}")
    half = (length - 1) // 2
    return {"first": np.arange(1, half), "repeat": np.arange(half + 1, 2 * half)}


def token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, T - 1] float32 next-token losses: column p is -log p(ids[:, p + 1]) from the logits at position p."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -logp.gather(-1, ids[:, 1:, None].to(logits.device)).squeeze(-1)


def half_loss(logits: torch.Tensor, inputs, part: str = "repeat") -> torch.Tensor:
    """A metric (metrics: {_target_: hookrun.experiments.induction.half_loss, part: repeat}): [B] the mean
    next-token loss over one half (`first` | `repeat`, see halves) of unpadded BOS + A + A sequences."""
    if inputs.info is not None and not bool(inputs.info.mask.all()):
        raise ValueError("half_loss reads unpadded sequences of one length (BOS + A + A); these are padded")
    cols = halves(logits.shape[1])
    if part not in cols:
        raise ValueError(f"part: {part!r} is not a half; use first or repeat")
    return token_losses(logits, inputs.input_ids)[:, torch.as_tensor(cols[part])].mean(1)


# -- training ----------------------------------------------------------------------------------------------------
def fit(config: AttnOnlyConfig, steps: int, batch: int, lr: float, seed: int) -> dict:
    """The weights of AttnOnly(config), initialised under torch seed `seed`, after `steps` Adam steps (one CPU
    thread: tiny matrices, more threads only spin) of next-token cross-entropy on fresh training_batch draws from
    random.Random(seed + 1). The same weights every call."""
    torch.manual_seed(seed)
    net = AttnOnly(config)
    rng = random.Random(seed + 1)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            ids = training_batch(rng, batch, config.n_positions, config.vocab_size)
            logits = net(input_ids=ids)
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _weights_name(vocab_size, d_model, n_head, n_layer, n_positions, steps, batch, lr, seed, post_norm=False) -> str:
    return (f"induction-v{FORMAT}-{n_layer}x{d_model}x{n_head}-vocab{vocab_size}-len{n_positions}-steps{steps}"
            f"-batch{batch}-lr{lr:g}-seed{seed}" + ("-postnorm" if post_norm else ""))


@functools.lru_cache(maxsize=4)
def _weights(vocab_size, d_model, n_head, n_layer, n_positions, steps, batch, lr, seed, post_norm=False) -> dict:
    """The shipped weights of these settings (hookrun.experiments.weights: the same on every CPU), else fit's."""
    config = AttnOnlyConfig(vocab_size, d_model, n_head, n_layer, n_positions, post_norm)
    name = _weights_name(vocab_size, d_model, n_head, n_layer, n_positions, steps, batch, lr, seed, post_norm)
    return weights.shipped(name, lambda: fit(config, steps, batch, lr, seed))


def write_weights():
    """Train at model()'s defaults, and its post-norm variant's, and write the shipped files (python -m
    hookrun.experiments.weights)."""
    settings = weights.defaults(model)[:-1]
    vocab_size, d_model, n_head, n_layer, n_positions, steps, batch, lr, seed = settings
    paths = []
    for post_norm, n in ((False, steps), (True, POST_NORM_STEPS)):
        config = AttnOnlyConfig(vocab_size, d_model, n_head, n_layer, n_positions, post_norm)
        named = _weights_name(vocab_size, d_model, n_head, n_layer, n_positions, n, batch, lr, seed, post_norm)
        paths.append(weights.save(named, fit(config, n, batch, lr, seed)))
    return paths


def model(vocab_size: int = 64, d_model: int = 64, n_head: int = 4, n_layer: int = 2, n_positions: int = 33,
          steps: int = 1000, batch: int = 64, lr: float = 3e-3, seed: int = 0, post_norm: bool = False) -> AttnOnly:
    """The experiments' model (`model._target_`): AttnOnly trained `steps` Adam steps on repeats (fit), in eval
    mode; the same weights every call: the shipped file at the defaults, else trained (cached in the process).
    steps=0: the random init (no induction). post_norm: the post-norm variant (a norm on attention's output
    before the add, as Gemma 2/3), shipped too."""
    config = AttnOnlyConfig(vocab_size, d_model, n_head, n_layer, n_positions, post_norm)
    net = AttnOnly(config)
    net.load_state_dict(_weights(vocab_size, d_model, n_head, n_layer, n_positions, steps, batch, lr, seed,
                                 post_norm))
    return net.eval()


# -- analysis: hookrun's reader alone --------------------------------------------------------------------------
EXPERIMENTS = ("induction", "induction_ablate", "induction_heads_grid", "induction_attribution")
ABLATE_LAYER = "hooks.ablate.layers"
ABLATE_HEADS = "hooks.ablate.edit.0.heads"


def _grid_of(cap, layer: str, role: str = "output") -> np.ndarray:
    """A per-token array as [samples, positions, ...] (every sequence has the same length), row (s, p) = sample s's
    token at real position p, through cap.token_rows."""
    rows = cap.token_rows(layer=layer, role=role).sort_index()
    samples = rows.index.get_level_values("sample").unique()
    values = cap.load(layer=layer, role=role)
    return values[rows["row"].to_numpy()].reshape(len(samples), -1, *values.shape[1:])


def token_ids(cap) -> np.ndarray:
    """[samples, positions] the token ids the run read, from its token table."""
    tokens = cap.tokens().set_index(["sample", "position"]).sort_index()
    return tokens["token_id"].to_numpy().reshape(tokens.index.get_level_values("sample").nunique(), -1)


def position_losses(cap, layer: str = "unembed") -> np.ndarray:
    """[samples, positions - 1] next-token losses from the stored logits: column p is -log p(token p + 1) (float64)."""
    logits = _grid_of(cap, layer).astype(np.float64)  # [S, T, V]
    ids = token_ids(cap)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]


def loss_table(cap) -> pd.DataFrame:
    """Mean loss per half (rows first, repeat): from the per-sample metrics and recomputed from the stored logits."""
    losses = position_losses(cap)
    cols = halves(losses.shape[1] + 1)
    return pd.DataFrame({"metric (cap.samples)": [cap.samples[f"loss_{k}"].mean() for k in cols],
                         "from the stored logits": [losses[:, c].mean() for c in cols.values()]},
                        index=pd.Index(list(cols), name="half"))


def attention_patterns(cap) -> dict:
    """layer number -> [samples, query, heads, key] attention patterns from the run's `pattern` captures."""
    layers = cap.index.loc[cap.index["hook"] == "pattern", "layer"].unique()
    return {int(name.split(".")[1]): _grid_of(cap, name) for name in sorted(layers)}


def scores(patterns: dict) -> pd.DataFrame:
    """Per (layer, head), the mean attention from each token q of the repeated half (q = half + 1 .. 2 * half) of
    BOS + A + A to: `induction` the token after the previous occurrence of q's token (key q - half + 1; Olsson et al.
    call this attention prefix matching) and `duplicate` the previous occurrence itself (q - half); and from every
    token after BOS (q = 1 .. 2 * half), `prev_token` the mean attention to the token before (q - 1): the layer-0
    heads an induction head composes with, which its keys in the first copy read."""
    rows = []
    for layer, p in sorted(patterns.items()):  # p: [S, Q, H, K]
        half = (p.shape[1] - 1) // 2
        q, every = np.arange(half + 1, 2 * half + 1), np.arange(1, 2 * half + 1)
        for h in range(p.shape[2]):
            rows.append({"layer": layer, "head": h, "induction": float(p[:, q, h, q - half + 1].mean()),
                         "duplicate": float(p[:, q, h, q - half].mean()),
                         "prev_token": float(p[:, every, h, every - 1].mean())})
    return pd.DataFrame(rows).set_index(["layer", "head"])


def grid_heads(cap) -> pd.DataFrame:
    """The exact head grid per (layer, head): the mean repeated-half loss with that head patched clean -> corrupt,
    and the fraction of the loss gap it restores, (corrupt - patched) / (corrupt - clean) of the means."""
    grid = cap.grid()
    patched = np.nanmean(grid.scores, 0)  # [layers, heads]
    clean, corrupt = float(grid.source.mean()), float(grid.target.mean())
    rows = [{"layer": int(name.split(".")[1]), "head": h, "patched_loss": float(patched[i, j]),
             "restored": (corrupt - float(patched[i, j])) / (corrupt - clean)}
            for i, name in enumerate(grid.layers) for j, h in enumerate(grid.labels)]
    return pd.DataFrame(rows).set_index(["layer", "head"])


def compare_attribution(attribution_cap, exact_cap, estimates_effects: bool = False) -> pd.DataFrame:
    """Whether attribution patching and the exact grid agree on which heads matter. `attribution_cap` is the store
    of an attribution run over the same sites (clean -> corrupt, metric loss_repeat: induction_attribution), read
    with the grid reader (a PatchGrid, the exact grid's axes; any grid run compares). Per (layer, head), the mean
    effect of patching the head on the repeated-half loss, exact (patched - corrupt) and estimated (its change():
    scores - target, AtP's grad . (a_clean - a_corrupt); `estimates_effects`: grids whose scores are the effects
    themselves); .attrs holds their Pearson correlation over the heads' means and whether both put the same head
    first (the most negative effect)."""
    exact = exact_cap.grid()
    estimate = attribution_cap.read("attribution") if attribution_cap.attrs.get("attribution") else \
        attribution_cap.grid()
    if (exact.layers, exact.labels) != (estimate.layers, estimate.labels):
        raise ValueError(f"the attribution grid's sites ({estimate.layers} x {estimate.labels}) are not the exact "
                         f"grid's ({exact.layers} x {exact.labels}); run both over the same layers and heads")
    a = np.nanmean(exact.scores - exact.target[:, None, None], 0)
    b = np.nanmean(estimate.scores if estimates_effects else estimate.change(), 0)
    index = pd.MultiIndex.from_product([[int(n.split(".")[1]) for n in exact.layers], exact.labels],
                                       names=["layer", "head"])
    table = pd.DataFrame({"exact": a.ravel(), "attribution": b.ravel()}, index=index)
    table.attrs["pearson"] = float(np.corrcoef(a.ravel(), b.ravel())[0, 1])
    table.attrs["same_top"] = bool(np.argmin(a) == np.argmin(b))
    return table


# -- pictures --------------------------------------------------------------------------------------------------
def attention_picture(patterns: dict, heads: list, sample: int = 0):
    """The attention pattern (query x key) of each (layer, head, score name, score) in `heads` on one sequence,
    the halves of BOS + A + A marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * len(heads), 5.0), layout="constrained")
    axes = fig.subplots(1, len(heads), squeeze=False)[0]
    for ax, (layer, head, name, value) in zip(axes, heads):
        p = patterns[layer][sample, :, head, :]  # [Q, K]
        half = (len(p) - 1) // 2
        image = ax.imshow(p, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
        for edge in (0.5, half + 0.5):
            ax.axhline(edge, color="grey", lw=0.6, ls="--")
            ax.axvline(edge, color="grey", lw=0.6, ls="--")
        ax.set(xlabel="key position (attended to)", ylabel="query position (attending)",
               xticks=range(0, len(p), 4), yticks=range(0, len(p), 4))
        ax.set_title(f"layer {layer} head {head} ({name} score {value:.3f})\nsequence {sample}: BOS | A (1-{half}) | "
                     f"A again ({half + 1}-{2 * half})", fontsize=10)
    fig.colorbar(image, ax=list(axes), label="attention weight", shrink=0.8)
    return fig


def scores_picture(table: pd.DataFrame, columns: dict):
    """A layers x heads heatmap per column of `table` (name -> title), each cell annotated with its value."""
    from matplotlib.figure import Figure

    layers, heads = table.index.levels[0], table.index.levels[1]
    fig = Figure(figsize=(3.6 * len(columns) + 0.6, 2.6), layout="constrained")
    for ax, (column, (title, cmap, bounds)) in zip(fig.subplots(1, len(columns), squeeze=False)[0], columns.items()):
        values = table[column].unstack("head").reindex(index=layers, columns=heads).to_numpy()
        image = ax.imshow(values, cmap=cmap, vmin=bounds[0], vmax=bounds[1], aspect="auto")
        for (i, j), v in np.ndenumerate(values):
            r, g, b, _ = image.cmap(image.norm(v))
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=8,
                    color="white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black")
        ax.set(xticks=range(len(heads)), xticklabels=[f"head {h}" for h in heads], xlabel="head",
               yticks=range(len(layers)), yticklabels=[f"layer {l}" for l in layers])
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.9)
    return fig


def loss_picture(curves: dict, vocab: int):
    """Mean next-token loss by the position of the predicted token, one line per run (name -> [samples, T - 1])."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 3.6), layout="constrained")
    ax = fig.subplots()
    for name, losses in curves.items():
        ax.plot(np.arange(1, losses.shape[1] + 1), losses.mean(0), marker="o", ms=3, label=name)
    half = losses.shape[1] // 2
    ax.axvspan(half + 0.5, 2 * half + 0.5, color="tab:green", alpha=0.08, label="repeated half (A again)")
    ax.axhline(math.log(vocab - 1), color="grey", ls="--", lw=0.8, label=f"log {vocab - 1} (a uniform guess)")
    ax.set(xlabel="position of the predicted token", ylabel="loss (nats), mean over sequences", ylim=(0, None))
    ax.set_title("next-token loss on BOS + A + A", fontsize=10)
    ax.legend(fontsize=8)
    return fig


SCORE_PANELS = {  # column of the head table -> (title, colour map, range) of its heatmap
    "induction": ("induction score: attention to the token\nafter the previous occurrence", "Blues", (0, 1)),
    "prev_token": ("previous-token score: attention\nto the token before", "Blues", (0, 1)),
    "restored": ("exact patching clean -> corrupt: fraction\nof the repeated-half loss gap restored", "RdBu", (-1, 1)),
}


# -- the script ------------------------------------------------------------------------------------------------
def _name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def run_all(out: Path) -> dict:
    """The four experiments through the CLI into out/runs/NAME (stores replaced); the ablation zeroes the top
    induction head the first run shows. name -> the run's captures."""
    runs = {name: out / "runs" / name for name in EXPERIMENTS}
    hookrun_cli("+experiment=induction", f"hydra.run.dir={runs['induction']}", "store.mode=overwrite")
    caps = {"induction": hookrun.open(runs["induction"])}
    layer, head = scores(attention_patterns(caps["induction"]))["induction"].idxmax()
    hookrun_cli("+experiment=induction_ablate", f"hydra.run.dir={runs['induction_ablate']}", "store.mode=overwrite",
         f"{ABLATE_LAYER}=[blocks.{layer}.attn.heads]", f"{ABLATE_HEADS}=[{head}]")
    hookrun_cli("+experiment=induction_heads_grid", f"hydra.run.dir={runs['induction_heads_grid']}", "store.mode=overwrite")
    hookrun_cli("+experiment=induction_attribution", f"hydra.run.dir={runs['induction_attribution']}",
         "store.mode=overwrite")
    return {**caps, **{name: hookrun.open(runs[name]) for name in EXPERIMENTS[1:]}}


def report(caps: dict, out: Path, attribution=None) -> pd.DataFrame:
    """Print the tables and write out/{loss,attention,scores}.png from the runs' captures; the head table."""
    clean, ablated = caps["induction"], caps["induction_ablate"]
    vocab = int(clean.config["model"]["vocab_size"])
    losses = loss_table(clean)
    print(f"next-token loss, mean over {len(clean.samples)} sequences BOS + A + A (A: {token_ids(clean).shape[1] // 2} "
          f"random tokens of {vocab - 1}; log {vocab - 1} = {math.log(vocab - 1):.3f}):")
    print(losses.round(3).to_string())
    patterns = attention_patterns(clean)
    table = scores(patterns).join(grid_heads(caps["induction_heads_grid"]))
    print("\nper head: mean attention from the repeated half to the token after the previous occurrence (induction)")
    print("and to the previous occurrence (duplicate); from every token to the one before (prev_token); exact")
    print("patching of the head clean -> corrupt: repeated-half loss (patched_loss), fraction of the gap restored:")
    print(table.round(3).to_string())
    top = table["induction"].sort_values(ascending=False)
    print("\ntop induction heads: " + ", ".join(f"{_name(*i)} {v:.3f}" for i, v in top.head(3).items()))
    hooks = ablated.config["hooks"]["ablate"]
    name = f"layer {hooks['layers'][0].split('.')[1]} head {', '.join(map(str, hooks['edit'][0]['heads']))}"
    before, after = clean.samples["loss_repeat"].mean(), ablated.samples["loss_repeat"].mean()
    print(f"ablating {name} (zeroed): repeated-half loss {before:.3f} -> {after:.3f} ({after - before:+.3f}); first "
          f"half {clean.samples['loss_first'].mean():.3f} -> {ablated.samples['loss_first'].mean():.3f}")
    grid = caps["induction_heads_grid"].grid()
    restored = table["restored"].sort_values(ascending=False)
    print(f"exact head grid (repeated-half loss: clean {grid.source.mean():.3f}, corrupt {grid.target.mean():.3f}); "
          "restoring most: " + ", ".join(f"{_name(*i)} {v:.3f}" for i, v in restored.head(3).items()))
    attribution = attribution if attribution is not None else caps.get("induction_attribution")
    if attribution is not None:
        both = compare_attribution(attribution, caps["induction_heads_grid"])
        print(f"\nattribution vs exact (effect on the repeated-half loss), Pearson {both.attrs['pearson']:.3f}, "
              f"same top head: {both.attrs['same_top']}:")
        print(both.round(3).to_string())
    out.mkdir(parents=True, exist_ok=True)
    prev = table.loc[0, "prev_token"].idxmax()
    (layer, head), value = top.index[0], top.iloc[0]
    pictures = {
        "loss.png": loss_picture({"trained model": position_losses(clean),
                                  f"{name} zeroed": position_losses(ablated)}, vocab),
        "attention.png": attention_picture(patterns, [(0, prev, "previous-token", table.loc[(0, prev), "prev_token"]),
                                                      (layer, head, "induction", value)]),
        "scores.png": scores_picture(table, SCORE_PANELS),
    }
    for file, fig in pictures.items():
        fig.savefig(out / file, dpi=110)
        print(out / file)
    return table


def one_run(cap) -> None:
    """What one run of the induction experiments holds, printed: the losses per half, the head scores (pattern
    captures), the
    ablated head (an ablate hook), the exact head grid (a patching grid); pictures into RUN_DIR/plots."""
    losses = loss_table(cap) if "logits" in set(cap.index["hook"]) else \
        pd.DataFrame({"metric (cap.samples)": [cap.samples[f"loss_{k}"].mean() for k in ("first", "repeat")]},
                     index=pd.Index(["first", "repeat"], name="half"))
    print(f"next-token loss per half, mean over {len(cap.samples)} sequences BOS + A + A:")
    print(losses.round(3).to_string())
    ablate = (cap.config.get("hooks") or {}).get("ablate")
    if ablate:
        print(f"with {ablate['layers'][0]} heads {ablate['edit'][0]['heads']} zeroed")
    tables = []
    if "pattern" in set(cap.index["hook"]):
        patterns = attention_patterns(cap)
        tables.append(scores(patterns))
    if cap.attrs.get("patching"):
        tables.append(grid_heads(cap))
    if cap.attrs.get("attribution"):
        estimate = cap.read("attribution")
        change = np.nanmean(estimate.change(), 0)
        tables.append(pd.DataFrame({"atp_change": change.ravel()}, index=pd.MultiIndex.from_product(
            [[int(n.split(".")[1]) for n in estimate.layers], estimate.labels], names=["layer", "head"])))
    if tables:
        table = pd.concat(tables, axis=1)
        print("\nper head:")
        print(table.round(3).to_string())
    if "pattern" in set(cap.index["hook"]):
        plots = cap.path.parent / "plots"
        plots.mkdir(exist_ok=True)
        (layer, head), value = table["induction"].idxmax(), table["induction"].max()
        attention_picture(patterns, [(layer, head, "induction", value)]).savefig(plots / "attention.png", dpi=110)
        scores_picture(table, {k: v for k, v in SCORE_PANELS.items() if k in table}).savefig(plots / "scores.png",
                                                                                            dpi=110)
        print(f"\n{plots / 'attention.png'}\n{plots / 'scores.png'}")


def main(argv=None):
    """python -m hookrun.experiments.induction [--out DIR] [--attribution RUN] runs the four experiments into DIR
    and prints the tables, pictures into DIR; python -m hookrun.experiments.induction RUN_DIR reads one run."""
    parser = argparse.ArgumentParser(prog="python -m hookrun.experiments.induction", description=main.__doc__)
    parser.add_argument("run_dir", nargs="?", help="one run of the induction experiments to read (nothing is run)")
    parser.add_argument("--out", default="induction", help="the runs go to OUT/runs/NAME, the pictures to OUT")
    parser.add_argument("--attribution", help="another attribution run over the heads (clean -> corrupt, "
                                              "loss_repeat) to compare with the exact grid in place of "
                                              "induction_attribution's")
    args = parser.parse_args(argv)
    if args.run_dir:
        return one_run(hookrun.open(args.run_dir))
    out = Path(args.out).resolve()
    caps = run_all(out)
    return report(caps, out, hookrun.open(args.attribution) if args.attribution else None)


if __name__ == "__main__":
    main()
