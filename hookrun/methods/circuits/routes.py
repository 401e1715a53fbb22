"""Information-flow routes (Ferrando & Voita 2024), the EAP-IG code's `information-flow-routes`: every edge scored
from one forward of the source run, no metric and no gradient (the block's `method: information_flow_routes`).

    s = route_scores(model, g, clean)                            # [B, E]: each sample's mean over its tokens
    s = edge_scores(model, g, clean, corrupt, metric, method="information_flow_routes")   # the same, as EdgeScores

At each position, receiver v reads the residual stream x_v (a head's q / k / v: the stream into its layer's norm;
an MLP: into its norm; logits: into the final norm), the sum of the senders upstream (plus the biases that are no
sender). Sender u's proximity to it is max(0, |x_v|_1 - |x_v - a_u|_1) (a_u the sender's activation, L1 norms over
the model's width), its importance the proximity over the sum of the proximities of every sender of an edge into v
(0 where they are all 0, where the reference divides 0 by 0), and the edge's score the importance's mean over the
sample's real tokens: the reference's loop (its per-sample mean over positions, summed over the batch and divided
by the items there: the mean over samples here). The input sender is the stream into block 0 (`input: stream`) or
its token embedding alone (`input: token_embedding`, the reference's hook_embed): on a model with absolute
position embeddings the two differ, since the proximity reads the activation itself, not a difference.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from hookrun.capture.scope import HookScope
from hookrun.methods.circuits.ablation import INPUTS, kept_positions
from hookrun.methods.circuits.attribute import SenderHooks, input_point
from hookrun.methods.circuits.graph import Graph
from hookrun.methods.metrics import logits_of

METHOD = "information_flow_routes"
CHUNK_BYTES = 64 << 20  # the sender differences [senders, B, T, D] formed a slice of senders at a time


def route_scores(model: nn.Module, graph: Graph, inputs: dict, valid: Optional[torch.Tensor] = None,
                 per_position: bool = False, input: str = "stream", metric=None, rows=None):
    """[B, E] each edge's importance in the run of `inputs`, averaged over the sample's real tokens (`valid` [B, T],
    default the attention mask, else every position); `per_position`: [B, T, E], each position's importance over
    the sample's token count (its positions add up to the sample's score). With `metric` (logits, rows) -> [B]: (the
    scores, the metric of the same forward)."""
    if input not in INPUTS:
        raise ValueError(f"circuit.input: {input!r} is not one of {', '.join(INPUTS)}")
    if graph.post_norms():
        raise ValueError(f"circuit.method: {METHOD} on a post-norm model ({graph.model_class}: a norm after "
                         "attention, so the heads' outputs are not what the stream adds); eap and exact are built "
                         "there")
    b, t = inputs["input_ids"].shape[:2]
    streams = _receiver_streams(graph)
    read: Dict[tuple, torch.Tensor] = {}
    mods = dict(model.named_modules())
    with HookScope() as scope, torch.no_grad():
        senders = SenderHooks(model, graph, (b, t), scope)
        for key in dict.fromkeys(streams.values()):
            scope.value(mods[key[1]], input_point(key[1]), lambda x, k=key: read.__setitem__(k, x.detach()))
        logits = logits_of(model(**inputs))
        value = None if metric is None else metric(
            logits, torch.arange(b, device=logits.device) if rows is None else rows).detach().float()
    acts = senders.stacked()
    if input == "token_embedding":
        acts[0] = acts[0] - kept_positions(model, graph, inputs).to(acts.dtype)
    if valid is None:
        mask = inputs.get("attention_mask")
        valid = torch.ones((b, t), dtype=torch.bool, device=acts.device) if mask is None else mask.bool()
    w = valid.to(torch.float32) / valid.sum(1, keepdim=True).clamp(min=1).to(torch.float32)  # [B, T]
    n_r = len(graph.receivers)
    out = torch.zeros((b, t, len(graph.senders), n_r) if per_position else (b, len(graph.senders), n_r),
                      dtype=torch.float32, device=acts.device)
    done: Dict[tuple, int] = {}
    for r in range(n_r):
        col = graph.mask[:, r]
        key = (streams[r], bytes(col.numpy()))
        if key in done:  # the same stream and senders as an earlier receiver (a layer's q, k and v of every head)
            out[..., r] = out[..., done[key]]
            continue
        done[key] = r
        us = col.nonzero().flatten().tolist()
        if not us:
            continue
        x = read[streams[r]].float()
        prox = _proximity(acts, us, x)  # [U, B, T]
        total = prox.sum(0, keepdim=True)
        share = torch.where(total > 0, prox / torch.where(total > 0, total, torch.ones_like(total)),
                            torch.zeros_like(prox))
        share = share * w[None]
        if per_position:
            out[:, :, us, r] = share.permute(1, 2, 0)
        else:
            out[:, us, r] = share.sum(2).t()
    scores = out[..., graph.edge_s, graph.edge_r].cpu()
    return scores if metric is None else (scores, value)


def _proximity(acts: torch.Tensor, us, x: torch.Tensor) -> torch.Tensor:
    """[U, B, T]: max(0, |x|_1 - |x - a_u|_1) for the senders us, a slice of senders at a time."""
    norm = x.abs().sum(-1)
    per = max(1, CHUNK_BYTES // max(1, x.numel() * 4))
    out = []
    for i in range(0, len(us), per):
        a = acts[us[i:i + per]].float()
        out.append((norm[None] - (a - x[None]).abs().sum(-1)).clamp(min=0))
    return torch.cat(out)


def _receiver_streams(graph: Graph) -> Dict[int, tuple]:
    """{receiver: (kind, the module whose input is the stream it reads)}: a head's q / k / v its layer's first norm,
    an MLP its norm (the first norm in parallel blocks), the logits the final norm (the unembedding without one)."""
    anat, out = graph.anat, {}
    fin = anat.part(anat.family.final_norm) or anat.unembed_name()
    for r, rec in enumerate(graph.receivers):
        if rec.kind == "logits":
            out[r] = ("final", fin)
        else:
            b = anat.block_modules(rec.layer)
            out[r] = ("mlp", b["ln2"] or b["ln1"]) if rec.kind == "mlp" else ("attn", graph.stream_module(rec.layer))
    return out
