"""Exact edge patching and the faithfulness of circuits: forwards in which each receiver reads the residual stream
along its own path, changed by what the edges into it carry.

    exact = patch_edges(model, g, clean, corrupt, [e1, e2], metric)         # [B, 2]: the target run, edge e patched
    m = circuit_metric(model, g, clean, corrupt, masks, metric)              # [B, C]: each circuit run on the source
    f = faithfulness(m.mean(0), m_source.mean(), m_target.mean())            # (m - m_target) / (m_source - m_target)

Exact patching of u -> v: the target run in which receiver v's input along its path gets a_source[u] -
a_target[u] added, nothing else changed (a head's q/k/v: its projection recomputed from the layer's norm of the
changed stream and spliced into that head's slice, OLMo 2's q/k: the full projection and its norm over all heads,
then the slice; an MLP: its norm's input; logits: the final norm's input).
A circuit: the source run in which every receiver v reads x_v - sum over senders u of edges u -> v outside the
circuit of (a_u - a_donor[u]), a_u the sender's activation in this run, the donor the target run's (`same`), its
mean over the batch (`mean`) or zero (`zero`). The full circuit is the source run, the empty one (donor same) the
target run. Copies (edges, circuits) are stacked along the batch axis: one forward per chunk of copies.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from hookrun.capture.scope import HookScope
from hookrun.methods.circuits.attribute import (SenderHooks, embedding_sizes, input_point, output_point,
                                                repeat_inputs, sender_activations, weight_io)
from hookrun.methods.circuits.ablation import through_post_norms
from hookrun.methods.circuits.graph import Graph
from hookrun.methods.metrics import logits_of

DONORS = ("same", "mean", "zero")
SUB_TOKENS = 512  # a circuit run's sender differences formed for this many tokens' circuits at a time  # what an ablated edge carries: the target run's sender, its batch mean, zero


def path_run(model: nn.Module, graph: Graph, inputs: dict, delta: Callable, metric: Callable,
             rows: torch.Tensor) -> torch.Tensor:
    """One forward of `inputs` [N, T] in which receivers `rs` of a layer read their input plus
    delta(rs, senders) ([len(rs), N, T, D], or None: unchanged; senders: SenderHooks of this forward so far);
    returns the metric [N]."""
    anat, mods = graph.anat, dict(model.named_modules())
    shape = tuple(inputs["input_ids"].shape[:2])
    stream: Dict[int, torch.Tensor] = {}

    def splice(layer, rs, module, ln, y, proj):
        d = delta(rs, senders)
        if d is None:
            return None
        live = d.flatten(1).any(1).nonzero().flatten().tolist()
        if not live:
            return None
        xs = ln(stream[layer][None] + d[live].to(stream[layer].dtype))
        w = weight_io(module)
        # a plain projection: each receiver's own head columns only (1 / (3 x heads) of the projection each), the
        # tokens its delta leaves alone kept as they are (bitwise: a full circuit stacked beside others)
        heads = _head_columns(graph, [rs[i] for i in live], module, w, xs) if w is not None else None
        if module is not proj:  # a norm over the whole projection (OLMo 2's q_norm): the full projection per copy
            full = module.forward(proj.forward(xs))
            heads = torch.stack([graph.point(graph.receivers[rs[i]]).get(full[k])[..., graph.receivers[rs[i]].head, :]
                                 for k, i in enumerate(live)])
        moved = d[live].ne(0).any(-1)[..., None] if heads is not None else None  # [R, N, T, 1]
        ys = module.forward(xs) if heads is None else None
        by_kind: Dict[str, list] = {}
        for k, i in enumerate(live):
            by_kind.setdefault(graph.receivers[rs[i]].kind, []).append((graph.receivers[rs[i]], k))
        for items in by_kind.values():  # one splice per q / k / v view of the projection
            p = graph.point(items[0][0])
            part = p.get(y).clone()
            for rec, k in items:
                part[..., rec.head, :] = p.get(ys[k])[..., rec.head, :] if heads is None else torch.where(
                    moved[k], heads[k].to(part.dtype), part[..., rec.head, :])
            y = p.put(y, part)
        return y

    def add(rs, x):
        d = delta(rs, senders)
        return None if d is None or not bool(d.any()) else x + d[0].to(x.dtype)

    with HookScope() as scope:
        senders = SenderHooks(model, graph, shape, scope)
        for layer in range(anat.n_layers):
            b = anat.block_modules(layer)
            reads = graph.stream_module(layer)  # its norm before attention, or (OLMo 2) attention: the raw stream
            ln1 = mods[b["ln1"]].forward if b["ln1"] else (lambda x: x)
            scope.value(mods[reads], input_point(reads), lambda x, l=layer: stream.__setitem__(l, x))
            by_module: Dict[str, List[int]] = {}
            for r in graph.receivers_of(layer):
                if graph.receivers[r].kind in "qkv":
                    by_module.setdefault(graph.point(graph.receivers[r]).module, []).append(r)
            for name, rs in by_module.items():
                rec = graph.receivers[rs[0]]
                proj = mods[graph.proj_norms[(layer, rec.kind)][1]] if (layer, rec.kind) in graph.proj_norms else \
                    mods[name]
                scope.value(mods[name], output_point(name),
                            lambda y, l=layer, rs=rs, m=mods[name], ln=ln1, pr=proj: splice(l, rs, m, ln, y, pr))
            mlp = [r for r in graph.receivers_of(layer) if graph.receivers[r].kind == "mlp"]
            if mlp and (b["ln2"] or not anat.parallel):  # its norm's input, or (OLMo 2) the MLP's: the raw stream
                scope.value(mods[b["ln2"] or b["mlp"]], input_point(b["ln2"] or b["mlp"]), lambda x, rs=mlp: add(rs, x))
            elif mlp:  # parallel without its own norm: the MLP reads ln1's output
                def through_ln1(x, rs=mlp, l=layer, ln=ln1):
                    d = delta(rs, senders)
                    return None if d is None or not bool(d.any()) else ln(stream[l] + d[0].to(x.dtype))
                scope.value(mods[b["mlp"]], input_point(b["mlp"]), through_ln1)
        fin = anat.part(anat.family.final_norm) or anat.unembed_name()
        scope.value(mods[fin], input_point(fin), lambda x: add([len(graph.receivers) - 1], x))
        with torch.no_grad():
            logits = logits_of(model(**inputs))
            return metric(logits, rows).detach().float()


def _head_columns(graph: Graph, rs: List[int], module: nn.Module, w: torch.Tensor, xs: torch.Tensor):
    """[R, N, T, dh]: receiver rs[k]'s head slice of the projection (weight w [in, out], its bias) of xs[k], or None
    where the module's input is not xs' width."""
    if xs.shape[-1] != w.shape[0]:
        return None
    bias = getattr(module, "bias", None)
    cols, shift = [], []
    for r in rs:
        rec = graph.receivers[r]
        p = graph.point(rec)
        cols.append(p.get(w)[:, rec.head, :])
        shift.append(p.get(bias)[rec.head, :] if bias is not None else None)
    out = torch.matmul(xs.flatten(1, -2), torch.stack(cols).to(xs.dtype))  # [R, N x T, dh]
    if bias is not None:
        out = out + torch.stack(shift).to(out.dtype)[:, None]
    return out.reshape(*xs.shape[:-1], out.shape[-1])


def _chunks(n: int, per: int):
    for first in range(0, n, per):
        yield list(range(first, min(first + per, n)))


EVAL_BYTES = 512 << 20  # what one forward of stacked copies may hold: every sender's activation and the logits


def copies_per_forward(copies: int, b: int, t: int, model: nn.Module, graph: Graph) -> int:
    """Edges or circuits a forward (circuit.copies; 0: ~4k tokens, fewer where the copies' senders and logits would
    pass EVAL_BYTES: GPT-2 small 6 copies of 4 x 32 tokens, so that memory stays flat in the count)."""
    if copies:
        return copies
    d, vocab = embedding_sizes(model)
    per_token = 4 * (len(graph.senders) * d + vocab)
    return max(1, min(4096, EVAL_BYTES // per_token) // max(1, b * t))


def patch_edges(model: nn.Module, graph: Graph, target: dict, delta: torch.Tensor, edges: Sequence[int],
                metric: Callable, copies: int = 0) -> torch.Tensor:
    """[B, K] the metric of the target run with edge edges[k] patched exactly (delta [S, B, T, D]: a_source -
    a_target, see the module's docstring); copies: edges a forward (0: ~4k tokens)."""
    b, t = target["input_ids"].shape[:2]
    out = torch.empty((b, len(edges)))
    rows = torch.arange(b, device=target["input_ids"].device)
    for chunk in _chunks(len(edges), copies_per_forward(copies, b, t, model, graph)):
        es = [int(edges[c]) for c in chunk]
        want = [(int(graph.edge_s[e]), int(graph.edge_r[e])) for e in es]

        def fn(rs, senders, want=want):
            if not any(r in rs for _, r in want):
                return None
            d = torch.zeros((len(rs), len(want), *delta.shape[1:]), dtype=delta.dtype, device=delta.device)
            for k, (s, r) in enumerate(want):
                if r in rs:
                    d[rs.index(r), k] = delta[s]
            return d.reshape(len(rs), -1, *delta.shape[2:])
        m = path_run(model, graph, repeat_inputs(target, len(es)), fn, metric, rows.repeat(len(es)))
        out[:, chunk] = m.reshape(len(es), b).t().cpu()
    return out


def donor_activations(donor: str, a_target: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What ablated edges carry [S, B | 1, T, D]: the target run's senders (same), their mean over the batch's real
    tokens (mean), zero."""
    if donor == "same":
        return a_target
    if donor == "zero":
        return torch.zeros_like(a_target[:, :1])
    if donor == "mean":
        w = torch.ones(a_target.shape[1:3], device=a_target.device) if valid is None else valid.to(a_target.dtype)
        return ((a_target * w[None, :, :, None]).sum(1, keepdim=True) /
                w.sum(0).clamp(min=1)[None, None, :, None])
    raise ValueError(f"circuit.donor: {donor!r} is not one of {', '.join(DONORS)}")


def circuit_metric(model: nn.Module, graph: Graph, source: dict, donor: torch.Tensor, circuits: torch.Tensor,
                   metric: Callable, copies: int = 0, neurons: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, C]: the metric of the source run with every edge outside circuit c ablated (circuits [C, E] bool; [C, T,
    E]: an edge's mask at each position, the ablated pairs (edge, position) carrying the donor at that position
    alone; donor [S, B | 1, T, D] from donor_activations). `neurons` [C, S, D] bool: neuron circuits, every edge of
    the graph carrying the donor on the dimensions outside circuit c (a sender out of it: all of them), `circuits`
    unused (hookrun.methods.circuits.levels)."""
    b, t = source["input_ids"].shape[:2]
    rows = torch.arange(b, device=source["input_ids"].device)
    n_c = len(circuits) if neurons is None else len(neurons)
    out = torch.empty((b, n_c))
    n_s, n_r = len(graph.senders), len(graph.receivers)
    post = graph.post_norms()
    per_position = neurons is None and circuits.dim() == 3
    if (per_position or neurons is not None) and post:
        raise ValueError(f"circuit.level: per-position and neuron circuits on {graph.model_class}, a post-norm model, "
                         "are not built; use level edge or node")
    for chunk in _chunks(n_c, copies_per_forward(copies, b, t, model, graph)):
        k = len(chunk)
        if neurons is not None:
            off = graph.mask.to(donor.dtype)[None].expand(k, -1, -1)
            cut = (~neurons[chunk].to(torch.bool)).to(donor.device)  # [K, S, D]: the dimensions ablated
        else:
            off = torch.zeros((k, n_s, n_r, t) if per_position else (k, n_s, n_r), dtype=donor.dtype,
                              device=donor.device)
            for c, i in enumerate(chunk):
                gone = ~circuits[i].to(torch.bool)
                if per_position:  # gone [T, E]
                    pos, e = gone.nonzero(as_tuple=True)
                    off[c, graph.edge_s[e], graph.edge_r[e], pos] = 1
                else:
                    off[c, graph.edge_s[gone], graph.edge_r[gone]] = 1
            cut = None

        def fn(rs, senders, off=off, k=k, cut=cut):
            w = off[:, :, rs]
            if not bool(w.any()):
                return None
            have = [s for s, a in enumerate(senders.acts) if a is not None and bool(w[:, s].any())]
            if not have:
                return None
            first = senders.acts[have[0]]
            n, rest = first.shape[0] // k, first.shape[1:]  # a copy's prompts; [T, D]
            given = donor[have][:, None].to(first.dtype)  # [S', 1, B | 1, T, D]
            d = torch.empty((len(rs), k, n, *rest), dtype=first.dtype, device=first.device)
            step = max(1, SUB_TOKENS // max(1, n * rest[0]))  # circuits whose differences are formed at once
            for c0 in range(0, k, step):
                c1 = min(c0 + step, k)
                cur = torch.stack([senders.acts[s][c0 * n:c1 * n] for s in have]).reshape(len(have), c1 - c0, n, *rest)
                diff = given - cur  # [S', circuits c0..c1, B, T, D]
                if cut is not None:  # only the dimensions outside the circuit carry the donor
                    diff = diff * cut[c0:c1, have].transpose(0, 1)[:, :, None, None, :].to(diff.dtype)
                if post:  # a post-norm layer's heads pass its norm together, per receiver (ablation.through_post_norms)
                    pre = {layer: x[c0 * n:c1 * n] for layer, x in senders.pre_norm.items()}
                    part = through_post_norms(model, graph, post, pre, have, w[c0:c1], diff, c1 - c0)
                    d[:, c0:c1] = part.reshape(len(rs), c1 - c0, n, *rest)
                elif per_position:
                    d[:, c0:c1] = torch.einsum("ksrt,skbtd->rkbtd", w[c0:c1, have].to(cur.dtype), diff)
                else:
                    d[:, c0:c1] = torch.einsum("ksr,skbtd->rkbtd", w[c0:c1, have].to(cur.dtype), diff)
            return d.reshape(len(rs), -1, *rest)
        m = path_run(model, graph, repeat_inputs(source, k), fn, metric, rows.repeat(k))
        out[:, chunk] = m.reshape(k, b).t().cpu()
    return out


def faithfulness(m_circuit, m_source, m_target):
    """(m_circuit - m_target) / (m_source - m_target): 1 the source's metric, 0 the target's."""
    return (m_circuit - m_target) / (m_source - m_target)


def evaluate_circuits(model: nn.Module, graph: Graph, source: dict, target: dict, circuits: torch.Tensor,
                      metric: Callable, donor: str = "same", valid: Optional[torch.Tensor] = None,
                      copies: int = 0, source_metric: Optional[Callable] = None,
                      neurons: Optional[torch.Tensor] = None):
    """(m [B, C] each circuit's metric, m_source [B], m_target [B]) for one batch of paired inputs (circuits [C, E],
    or [C, T, E] per position; `neurons` [C, S, D]: neuron circuits, see circuit_metric)."""
    b = source["input_ids"].shape[0]
    rows = torch.arange(b, device=source["input_ids"].device)
    _, m_s = sender_activations(model, graph, source, source_metric or metric, rows)
    a_t, m_t = sender_activations(model, graph, target, metric, rows)
    m = circuit_metric(model, graph, source, donor_activations(donor, a_t, valid), circuits, source_metric or metric,
                       copies, neurons)
    return m, m_s.cpu(), m_t.cpu()
