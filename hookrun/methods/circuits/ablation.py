"""Ablations of a circuit graph's senders: what an edge carries in place of the other run's sender, in a circuit's
run (`donor`) and at a score's other end (`score_donor`): zero, the mean over a declared set of prompts (`means`)
or its mean at each position, with the input sender ablated as the stream into block 0 or as its token embedding
alone (the positions kept, the EAP-IG code's and TransformerLens's `hook_embed`).

    kept = kept_positions(model, graph, inputs)                   # [B, T, D]: the stream into block 0 without tokens
    acc = Means(len(graph.senders)); acc.add(a, valid, kept)      # over a dataset's batches (token_embedding: kept)
    d = ablated(acc.mean(), kept_of_this_run, valid)              # [S, B, T, D]: each sender's donor in this run

`mean`: each sender's mean over every real token of the prompts (the reference's `mean`, one vector a sender);
`mean_positional`: its mean at each real-token position over the prompts that have it (the reference's
`mean-positional`; position p is a sequence's p-th real token, whatever the padding side); `zero`: 0. With
`input: token_embedding` the input sender's donor is this run's stream without its token embedding plus the
ablated token part (zero: the position embeddings alone), so a zero-ablated input keeps its positions; with
`input: stream` (the default) the whole stream into block 0 is ablated, which is what the graph's input sender is
(the senders add up to the residual stream).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hookrun.capture.scope import HookScope
from hookrun.methods.circuits.attribute import input_point, output_point
from hookrun.methods.circuits.graph import Graph

ABLATIONS = ("zero", "mean", "mean_positional")  # donors that are no run's senders
INPUTS = ("stream", "token_embedding")  # what the input sender's ablation removes


def kept_positions(model: nn.Module, graph: Graph, inputs: dict) -> torch.Tensor:
    """[B, T, D]: the stream into block 0 of `inputs` with the token embedding's output zeroed: what the input
    sender holds besides its tokens (absolute position embeddings; zero for a model without them)."""
    emb = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is emb)
    block = graph.anat.block_modules(0)["block"]
    mods = dict(model.named_modules())
    kept = []
    with HookScope() as scope, torch.no_grad():
        scope.value(emb, output_point(name), torch.zeros_like)
        scope.value(mods[block], input_point(block), lambda x: kept.append(x.detach()))
        model(**inputs)
    return kept[0]


class Means:
    """Each sender's sum over real tokens, overall and at each real-token position, over batches (add), and their
    means (mean, positional)."""

    def __init__(self, n_senders: int):
        self.n, self.total, self.count, self.by_pos, self.pos_count = n_senders, None, 0, None, None

    def add(self, acts: torch.Tensor, valid: torch.Tensor, kept: Optional[torch.Tensor] = None) -> None:
        """acts [S, B, T, D] one batch's senders, valid [B, T] its real tokens; `kept` [B, T, D]: the input's
        positions, taken out of the input sender first (input: token_embedding)."""
        acts = acts.double().clone()
        if kept is not None:
            acts[0] -= kept.double()
        w = valid.to(acts.dtype)
        self.total = (acts * w[None, :, :, None]).sum((1, 2)) + (0 if self.total is None else self.total)
        self.count += int(valid.sum())
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)  # each token's real-token position
        width = int(pos.max()) + 1 if valid.any() else 1
        by = torch.zeros((self.n, width, acts.shape[-1]), dtype=acts.dtype, device=acts.device)
        cnt = torch.zeros(width, dtype=acts.dtype, device=acts.device)
        flat = pos[valid.bool()]
        by.index_add_(1, flat, acts[:, valid.bool()])
        cnt.index_add_(0, flat, torch.ones_like(flat, dtype=acts.dtype))
        if self.by_pos is None:
            self.by_pos, self.pos_count = by, cnt
        else:
            grow = max(width, self.by_pos.shape[1])
            self.by_pos = _pad(self.by_pos, grow, 1) + _pad(by, grow, 1)
            self.pos_count = _pad(self.pos_count, grow, 0) + _pad(cnt, grow, 0)

    def mean(self) -> torch.Tensor:
        """[S, D]: each sender's mean over every real token added."""
        return (self.total / max(1, self.count)).float()

    def positional(self) -> torch.Tensor:
        """[S, P, D]: each sender's mean at each real-token position (over the prompts that have it)."""
        return (self.by_pos / self.pos_count.clamp(min=1)[None, :, None]).float()


def _pad(t: torch.Tensor, n: int, axis: int) -> torch.Tensor:
    missing = n - t.shape[axis]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], axis)


def ablated(kind: str, n_senders: int, valid: torch.Tensor, kept: Optional[torch.Tensor] = None,
            means: Optional[Means] = None, dim: Optional[int] = None) -> torch.Tensor:
    """[S, B, T, D]: every sender's donor in a run of real tokens `valid` [B, T]: zero, the mean or the positional
    mean of `means` (a position past the means' longest prompt: the overall mean), plus `kept` [B, T, D] on the
    input sender (input: token_embedding: the run's positions kept)."""
    b, t = valid.shape
    if kind == "zero":
        d = dim if dim is not None else kept.shape[-1]
        out = torch.zeros((n_senders, b, t, d), device=valid.device)
    elif kind == "mean":
        out = means.mean().to(valid.device)[:, None, None, :].expand(-1, b, t, -1).clone()
    elif kind == "mean_positional":
        by, overall = means.positional().to(valid.device), means.mean().to(valid.device)
        pos = (valid.long().cumsum(1) - 1).clamp(min=0, max=by.shape[1])  # past the longest prompt: the overall mean
        out = torch.cat([by, overall[:, None]], 1)[:, pos]
    else:
        raise ValueError(f"circuit.donor: {kind!r} is not one of {', '.join(ABLATIONS)}")
    if kept is not None:
        out[0] = out[0] + kept.to(out.dtype)
    return out


def through_post_norms(model: nn.Module, graph: Graph, post: dict, pre_norm: dict, have, w: torch.Tensor,
                       diff: torch.Tensor, k: int) -> torch.Tensor:
    """A circuit run's change of receivers' inputs [R', K * B, T, D] on a post-norm model (the EAP-IG code's
    evaluate_graph with use_normalization_before_and_after): the linear senders' ablated differences summed, and for
    each post-norm layer norm(R + the ablated heads' differences into that receiver) - norm(R), R the layer's norm
    input in this run. w [K, S, R']: the ablated edges of each circuit; diff [S', K, B, T, D] the senders `have`'s
    donor - current differences."""
    mods = dict(model.named_modules())
    layer_of = {s: graph.senders[s].layer for s in have if graph.senders[s].kind == "head"}
    linear = [i for i, s in enumerate(have) if graph.senders[s].kind != "head" or layer_of[s] not in post]
    wh = w[:, list(have)].to(diff.dtype)  # [K, S', R']
    d = torch.einsum("ksr,skbtd->rkbtd", wh[:, linear], diff[linear]) if linear else \
        torch.zeros((w.shape[-1], *diff.shape[1:]), dtype=diff.dtype, device=diff.device)
    for layer, name in post.items():
        mine = [i for i, s in enumerate(have) if layer_of.get(s) == layer]
        if not mine:
            continue
        x = pre_norm[layer].reshape(k, -1, *diff.shape[3:]).to(diff.dtype)  # [K, B, T, D]
        moved = torch.einsum("ksr,skbtd->rkbtd", wh[:, mine], diff[mine])  # [R', K, B, T, D]
        norm = mods[name].forward  # not through its hooks: a run's own record of the norm's input stays the run's
        d = d + (norm(x[None] + moved) - norm(x)[None]).to(d.dtype)
    return d.reshape(w.shape[-1], -1, *d.shape[3:])
