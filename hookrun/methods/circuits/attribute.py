"""Edge attribution: the gradient methods' scores (EAP, EAP-IG inputs and activations, clean-corrupted) of every edge
of a circuit graph, plain torch functions usable without a run; the entry point, edge_scores, is
hookrun.methods.circuits.scores (it also patches every edge for `exact`).

    g = circuit_graph(model)
    s = edge_scores(model, g, clean, corrupt, metric)                       # EAP: s.scores [B, E]
    s = edge_scores(model, g, clean, corrupt, metric, method="eap_ig", steps=16)
    s = edge_scores(model, g, clean, corrupt, metric, method="eap_ig_activations", steps=4)

score(u -> v) = (a_source[u] - a_target[u]) . dM/d input_v, summed over positions (`per_position`: kept), where
input_v is the residual stream as receiver v reads it along its own path (a head's q/k/v: through the layer's
norm and that head's slice of the projection, or OLMo 2's q/k: the whole projection and its norm, then the slice;
an MLP: through its norm; logits: the final norm's input). EAP
takes the gradient on the target run: a source forward, a target forward and one backward a batch for every edge
(plus one small vector-Jacobian product a layer for the heads' paths). EAP-IG ("inputs", Hanna et al. 2024)
averages the gradients over `steps` runs whose input (the residual stream into block 0) is interpolated
target + alpha (source - target), alpha = (k + 0.5) / steps (the midpoint rule), the steps stacked along the batch
axis. EAP-IG "activations" (EAP-IG's get_scores_ig_activations) runs (2 layers + 1) x steps passes instead: for each
layer node in turn (the input, each layer's attention output with all its heads, its MLP's output) and each alpha,
the target run with that node's output replaced by target + alpha (source - target) (a constant: nothing flows back
through it), every other node flowing; every pass's receiver gradients go to every edge, averaged over all the
passes. `metric(logits, rows) -> [rows]` must be differentiable (row r is a copy of sample rows[r]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hookrun.capture.anatomy import Point
from hookrun.capture.scope import HookScope
from hookrun.methods.circuits.graph import Graph
from hookrun.methods.metrics import logits_of

METHODS = ("eap", "eap_ig", "eap_ig_activations", "clean_corrupted", "exact", "information_flow_routes")
IG_METHODS = ("eap_ig", "eap_ig_activations")  # the methods that take IG points (steps, points)
GRADIENTS = ("target", "source")  # the run whose gradient is taken and whose edges a score patches
POINTS = ("midpoint", "left", "right")  # the IG points of `steps`: (k + 0.5) / steps, k / steps from 0, from 1


@dataclass
class EdgeScores:
    """One batch's edge scores: `scores` [B, E] (per_position: [B, T, E]) the estimated change of the metric when
    the edge is patched from target to source; `source`, `target` [B] the two runs' metric; `passes` forwards;
    `neurons` [B, S, D] (neurons=True) each sender's output dimension's score, `nodes` [B, S] each sender's
    (hookrun.methods.circuits.levels)."""

    scores: torch.Tensor
    source: torch.Tensor
    target: torch.Tensor
    passes: int
    neurons: Optional[torch.Tensor] = None
    nodes: Optional[torch.Tensor] = None


def _modules(model: nn.Module) -> Dict[str, nn.Module]:
    return dict(model.named_modules())


def input_point(module: str) -> Point:
    """A module's input as a Point: its first argument, else the hidden_states keyword, else its first tensor
    keyword (Point.read / Point.write)."""
    return Point(module, module, "input")


def output_point(module: str) -> Point:
    """A module's output as a Point: what it returns, a tuple's first element."""
    return Point(module, module, "output")


def w_out(module: nn.Module, heads: int) -> torch.Tensor:
    """The output projection's weight as [heads, d_head, d_model] (Conv1D stores [in, out], Linear [out, in])."""
    w = weight_io(module)
    w = module.weight.t() if w is None else w
    return w.reshape(heads, -1, w.shape[-1])


def weight_io(module: nn.Module) -> Optional[torch.Tensor]:
    """A plain projection's weight as [in, out] (Conv1D stores it so, Linear as [out, in]); None for another
    module (its cotangents then go through the module's own backward)."""
    if type(module).__name__ == "Conv1D":
        return module.weight
    if type(module) is nn.Linear:
        return module.weight.t()
    return None


class SenderHooks:
    """Hooks (in `scope`) that record every sender's activation [N, T, D] of one forward as `acts[s]` (heads through
    W_O)."""

    def __init__(self, model: nn.Module, graph: Graph, shape, scope: HookScope, detach: bool = True,
                 on_record: Callable = None):
        self.graph, self.acts = graph, [None] * len(graph.senders)
        self.pre_norm: Dict[int, torch.Tensor] = {}  # post-norm blocks: {layer: the norm's input} of this forward
        self.shape, self.detach, self.on_record = shape, detach, on_record
        anat, mods = graph.anat, _modules(model)
        index = {s.name: i for i, s in enumerate(graph.senders)}
        block = anat.block_modules(0)["block"]
        scope.value(mods[block], input_point(block), lambda x: self._put(0, x))
        at = lambda: self.shape  # noqa: E731
        for layer in range(anat.n_layers):
            b = anat.block_modules(layer)
            heads = anat.point(f"blocks.{layer}.attn.heads")
            first = index[f"a{layer}.h0"]
            wo = mods[b["attn_out"]]
            k = 1.0 if b["attn_write"] else anat.write_scale(layer, "attn")  # a write scaled before the add
            scope.value(wo, heads, lambda zh, f=first, wo=wo, k=k: self._heads(f, zh, wo, k), at)
            if b["attn_write"]:
                scope.value(mods[b["attn_write"]], input_point(b["attn_write"]),
                            lambda x, l=layer: self.pre_norm.__setitem__(l, x.detach() if self.detach else x))
            if f"m{layer}" in index:
                mp = anat.point(f"blocks.{layer}.mlp")
                scope.value(mods[mp.module], mp, lambda y, i=index[f"m{layer}"]: self._put(i, y), at)

    def _put(self, i: int, x: torch.Tensor):
        self.acts[i] = x.detach() if self.detach else x
        if self.on_record:
            self.on_record(i)

    def _heads(self, first: int, zh: torch.Tensor, wo: nn.Module, k: float = 1.0):
        """zh [N, T, H, dh]: the output projection's input split by head; k: the block's scale of the write."""
        out = torch.einsum("nthd,hdo->hnto", zh, w_out(wo, zh.shape[-2]).to(zh.dtype))
        out = out * k if k != 1.0 else out
        for h in range(out.shape[0]):
            self.acts[first + h] = out[h].detach() if self.detach else out[h]
        if self.on_record:
            self.on_record(first + out.shape[0] - 1)

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.acts)


def sender_activations(model: nn.Module, graph: Graph, inputs: dict, metric: Optional[Callable] = None,
                       rows: Optional[torch.Tensor] = None):
    """([S, B, T, D] every sender's activation, the metric [B] or None) from one forward without a graph."""
    shape = tuple(inputs["input_ids"].shape[:2])
    with HookScope() as scope, torch.no_grad():
        hooks = SenderHooks(model, graph, shape, scope)
        logits = logits_of(model(**inputs))
        value = None if metric is None else metric(logits, _rows(rows, shape[0], logits)).detach().float()
    return hooks.stacked(), value


def _rows(rows, b: int, logits: torch.Tensor) -> torch.Tensor:
    return torch.arange(b, device=logits.device) if rows is None else rows


def repeat_inputs(inputs: dict, k: int) -> dict:
    """The inputs with every tensor repeated k times along the batch axis (k copies of the batch)."""
    return {n: v.repeat(k, *([1] * (v.dim() - 1))) if isinstance(v, torch.Tensor) and v.dim() else v
            for n, v in inputs.items()}


def _vjp_many(y: torch.Tensor, x: torch.Tensor, cots: torch.Tensor) -> torch.Tensor:
    """[R, *x.shape]: the vector-Jacobian products of y wrt x for R cotangents (batched where autograd can)."""
    try:
        g, = torch.autograd.grad(y, x, cots, retain_graph=True, is_grads_batched=True, allow_unused=True)
    except RuntimeError:
        parts = [torch.autograd.grad(y, x, c, retain_graph=True, allow_unused=True)[0] for c in cots]
        g = None if any(p is None for p in parts) else torch.stack(parts)
    return torch.zeros((len(cots), *x.shape), dtype=x.dtype, device=x.device) if g is None else g


def receiver_gradients(model: nn.Module, graph: Graph, inputs: dict, metric: Callable, rows: torch.Tensor,
                       consume: Callable, input_value: Optional[torch.Tensor] = None,
                       senders: Optional[SenderHooks] = None) -> torch.Tensor:
    """One forward + backward of `inputs`: consume(receiver ids, G [R', N, T, D]) for every layer's receivers, G
    the metric's gradient along each receiver's own path; `input_value` replaces the residual stream into block 0
    (EAP-IG). Returns the metric [N]."""
    anat, mods = graph.anat, _modules(model)
    ln1_in: Dict[int, torch.Tensor] = {}
    proj_out: Dict[tuple, torch.Tensor] = {}
    proj_in: Dict[tuple, torch.Tensor] = {}
    mlp_in: Dict[int, torch.Tensor] = {}
    final: List[torch.Tensor] = []
    alias = lambda store, key: (lambda x: store.__setitem__(key, x + 0) or store[key])  # noqa: E731
    # the stream into block 0 as a leaf that requires grad: the graph exists whatever the parameters require
    with HookScope() as scope:
        block = anat.block_modules(0)["block"]
        scope.value(mods[block], input_point(block), lambda x: (x if input_value is None else input_value.to(x.dtype)).detach()
                    .requires_grad_(True))
        layers = []
        for layer in range(anat.n_layers):
            b = anat.block_modules(layer)
            reads = graph.stream_module(layer)  # its norm before attention, or (OLMo 2) attention itself
            scope.value(mods[reads], input_point(reads), alias(ln1_in, layer))
            heads = [r for r in graph.receivers_of(layer) if graph.receivers[r].kind in "qkv"]
            by_module: Dict[str, List[int]] = {}
            for r in heads:
                by_module.setdefault(graph.point(graph.receivers[r]).module, []).append(r)
            for name in by_module:
                scope.value(mods[name], output_point(name), lambda y, k=(layer, name): proj_out.__setitem__(k, y))
                scope.pre(mods[name], lambda m, a, k=(layer, name): proj_in.__setitem__(k, a[0]) if a else None)
            mlp = [r for r in graph.receivers_of(layer) if graph.receivers[r].kind == "mlp"]
            if mlp:
                scope.value(mods[b["ln2"] or b["mlp"]], input_point(b["ln2"] or b["mlp"]), alias(mlp_in, layer))
            layers.append((layer, by_module, mlp))
        fin = anat.part(anat.family.final_norm) or anat.unembed_name()
        scope.value(mods[fin], input_point(fin), lambda x: final.append(x + 0) or final[-1])
        with torch.inference_mode(False), torch.enable_grad():
            logits = logits_of(model(**inputs))
            value = metric(logits, rows)
            if not value.requires_grad:
                raise ValueError("circuit.metric: the metric has no gradient with respect to the logits; use "
                                 "logit_diff, logprob, prob or loss")
            keys = list(proj_out) + [("mlp", m) for m in mlp_in] + [("final", 0)]
            tensors = list(proj_out.values()) + list(mlp_in.values()) + final[-1:]
            grads = dict(zip(keys, torch.autograd.grad(value.float().sum(), tensors, retain_graph=True,
                                                       allow_unused=True)))
            for layer, by_module, mlp in layers:
                x = ln1_in[layer]
                for name, rs in by_module.items():
                    y, g = proj_out[(layer, name)], grads[(layer, name)]
                    if g is None:
                        g = torch.zeros_like(y)
                    w, xin = weight_io(mods[name]), proj_in.get((layer, name))
                    if w is not None and xin is not None and xin.shape[:-1] == y.shape[:-1]:
                        # a linear projection: each head's cotangent through its own columns (the cost of one
                        # projection for all heads), then through the norm, batched over the heads
                        cots = []
                        for r in rs:
                            rec = graph.receivers[r]
                            p = graph.point(rec)
                            cots.append(p.get(g)[..., rec.head, :] @ p.get(w)[:, rec.head, :].t().to(g.dtype))
                        consume(rs, _vjp_many(xin, x, torch.stack(cots)).detach())
                        continue
                    cots = []
                    for r in rs:
                        rec = graph.receivers[r]
                        p = graph.point(rec)
                        part = p.get(g)
                        only = torch.zeros_like(part)
                        only[..., rec.head, :] = part[..., rec.head, :]
                        cots.append(p.put(torch.zeros_like(g), only))
                    consume(rs, _vjp_many(y, x, torch.stack(cots)).detach())
                if mlp:
                    g = grads[("mlp", layer)]
                    if g is None:
                        g = torch.zeros_like(mlp_in[layer])
                    if anat.block_modules(layer)["ln2"] is None and anat.parallel:  # the MLP reads ln1's output
                        g = _vjp_many(mlp_in[layer], x, g[None])[0]
                    consume(mlp, g.detach()[None])
            g = grads[("final", 0)]
            consume([len(graph.receivers) - 1], (torch.zeros_like(final[-1]) if g is None else g).detach()[None])
    return value.detach().float()


def gradient_scores(model: nn.Module, graph: Graph, source: dict, target: dict, metric: Callable, method: str,
                    alphas: Optional[List[float]], per_position: bool, valid: Optional[torch.Tensor], copies: int,
                    source_metric: Optional[Callable], donor: Optional[torch.Tensor] = None,
                    neurons: bool = False) -> EdgeScores:
    """Edge scores with the gradient on the target run, the IG points resolved (hookrun.methods.circuits.scores.
    edge_scores is the entry point; method exact: the masked source - target differences [S, B, T, D] as `scores`,
    for the caller to patch); `neurons`: each sender's per-dimension scores too, delta . the sum of its receivers'
    gradients (EdgeScores.neurons)."""
    b, t = target["input_ids"].shape[:2]
    device = target["input_ids"].device
    rows = torch.arange(b, device=device)
    nodes = LayerNodes(model, graph, (b, t)) if method == "eap_ig_activations" else None
    with HookScope() as scope:
        if nodes:
            nodes.record(scope)
        a_s, m_s = sender_activations(model, graph, source, source_metric or metric, rows)
        node_s = nodes.take() if nodes else None
        if method != "eap":
            a_t, m_t = sender_activations(model, graph, target, metric, rows)
            node_t = nodes.take() if nodes else None
    if donor is not None:  # an ablation in place of the source's senders
        a_s = donor.to(a_s.dtype).expand(len(graph.senders), b, t, -1)
    n_s, n_r = len(graph.senders), len(graph.receivers)
    out = torch.zeros((b, t, n_s, n_r) if per_position else (b, n_s, n_r), dtype=torch.float32, device=device)
    state = {"neurons": torch.zeros((b, n_s, a_s.shape[-1]), device=device) if neurons else None}
    feeds = graph.mask.to(device, torch.float32) if neurons else None

    def consume(rs, g):  # g [R', N, T, D] (N = copies x B)
        delta = state["delta"]
        g = g.reshape(len(rs), -1, b, t, g.shape[-1]).sum(1).float()  # IG passes summed
        if neurons:  # a sender's output dimension: delta times the gradients of every receiver it feeds
            state["neurons"] += (delta * torch.einsum("sr,rbtd->sbtd", feeds[:, rs], g)).sum(2).transpose(0, 1)
        if per_position:
            out[:, :, :, rs] += torch.einsum("sbtd,rbtd->btsr", delta, g)
        else:
            out[:, :, rs] += torch.einsum("sbtd,rbtd->bsr", delta, g)

    post = graph.post_norms()
    if post and method not in ("eap", "exact", "eap_ig"):
        raise ValueError(f"circuit.method: {method} on a post-norm model ({graph.model_class}: a norm after "
                         "attention); eap, eap_ig and exact are built there (the heads' edges pass the norm)")
    if method == "eap":
        with HookScope() as scope:
            hooks = SenderHooks(model, graph, (b, t), scope)
            state["delta"] = None

            def first(rs, g):
                if state["delta"] is None:
                    state["delta"] = _delta(a_s, hooks.stacked(), valid)
                consume(rs, g)
                if post:  # a post-norm layer's heads: their differences through the norm's Jacobian at this run
                    through_norms(model, graph, post, hooks.pre_norm, rs, g, state["delta"], out, per_position, b, t)
            m_t = receiver_gradients(model, graph, target, metric, rows, first)
        scores = out[..., graph.edge_s, graph.edge_r].cpu()
        return EdgeScores(scores, m_s.cpu(), m_t.cpu(), 2, _cpu(state["neurons"]))
    state["delta"] = _delta(a_s, a_t, valid)
    if method == "exact" and post:  # a head's exact patch is its change of the norm's output in the target run
        state["delta"] = normed_delta(model, graph, post, post_norm_inputs(model, graph, target), state["delta"])
    if method == "exact":  # the two runs' senders and metric: the patching is hookrun.methods.circuits.scores'
        return EdgeScores(state["delta"], m_s.cpu(), m_t.cpu(), 2)
    if method == "clean_corrupted":  # the mean of the two ends' gradients: the target's and the source's own run
        receiver_gradients(model, graph, target, metric, rows, consume)
        receiver_gradients(model, graph, source, source_metric or metric, rows, consume)
        out /= 2
        return EdgeScores(out[..., graph.edge_s, graph.edge_r].cpu(), m_s.cpu(), m_t.cpu(), 4,
                          _cpu(state["neurons"], 2))
    points = alphas
    x_s, x_t = a_s[0], a_t[0]  # the input sender: the stream into block 0
    # a pass: (node, alpha); eap_ig interpolates the input only, eap_ig_activations each layer node in turn
    passes = [(node, a) for node in (["input"] if nodes is None else ["input", *nodes.names]) for a in points]
    per = copies or max(1, min(len(passes), pass_tokens(model, graph) // max(1, b * t)))
    forwards = 2
    for first in range(0, len(passes), per):
        chunk = passes[first:first + per]

        def share(node):  # [copies, 1, 1, 1]: alpha in the copies interpolating node, 0 elsewhere
            return torch.tensor([a if n == node else 0.0 for n, a in chunk], device=device,
                                dtype=x_s.dtype)[:, None, None, None]
        x = (x_t[None] + share("input") * (x_s - x_t)[None]).reshape(-1, t, x_s.shape[-1])
        with HookScope() as scope:
            if nodes is not None:
                nodes.interpolate(scope, {n: (torch.tensor([m == n for m, _ in chunk], device=device), share(n))
                                          for n in {n for n, _ in chunk} - {"input"}}, node_t, node_s, len(chunk))
            take = consume
            if post:  # post-norm heads: each pass's gradient through the norm's Jacobian at that pass's own input
                norms = SenderHooks(model, graph, (len(chunk) * b, t), scope)

                def through(rs, g, norms=norms):
                    consume(rs, g)
                    through_norms(model, graph, post, norms.pre_norm, rs, g, state["delta"], out, per_position, b,
                                  t)
                take = through
            receiver_gradients(model, graph, repeat_inputs(target, len(chunk)), metric, rows.repeat(len(chunk)),
                               take, input_value=x)
        forwards += 1
    out /= len(passes)
    scores = out[..., graph.edge_s, graph.edge_r].cpu()
    return EdgeScores(scores, m_s.cpu(), m_t.cpu(), forwards, _cpu(state["neurons"], len(passes)))


def _cpu(t: Optional[torch.Tensor], over: int = 1) -> Optional[torch.Tensor]:
    return None if t is None else (t / over).cpu()


PASS_BYTES = 512 << 20  # what the IG passes stacked in one forward + backward may hold (auto copies)


def pass_tokens(model: nn.Module, graph: Graph) -> int:
    """The tokens of IG passes stacked in one forward + backward (circuit.copies 0): ~4k, fewer where a token's
    activations, their gradients and its logits (~32 floats a layer and width, 4 a vocabulary entry) would pass
    PASS_BYTES (GPT-2 small: 2 copies of 4 x 32 tokens), so that the passes stream through a bounded memory."""
    d, vocab = embedding_sizes(model)
    per_token = 4 * (32 * graph.anat.n_layers * d + 4 * vocab)
    return max(1, min(4096, PASS_BYTES // per_token))


def embedding_sizes(model: nn.Module) -> Tuple[int, int]:
    """(width, vocabulary) of the model's token embedding and unembedding (1024 and 0 where it has none): what one
    token's activations and logits take, for the copies stacked in a forward.

        d, vocab = embedding_sizes(model)
    """
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    d = int(emb.weight.shape[-1]) if emb is not None else 1024
    return d, int(out.weight.shape[0]) if out is not None else 0


def heads_of(graph: Graph, layer: int) -> List[int]:
    """The sender indices of layer `layer`'s heads."""
    return [i for i, snd in enumerate(graph.senders) if snd.kind == "head" and snd.layer == layer]


def through_norms(model, graph, post: dict, pre_norm: dict, rs: List[int], g: torch.Tensor, delta: torch.Tensor,
                  out: torch.Tensor, per_position: bool, b: int, t: int) -> None:
    """Post-norm layers' heads into receivers rs: replace their delta . g in `out` by delta . J_norm(R)^T g (R the
    norm's input in this run), the first-order change of the norm's output that reaches the stream. g [R', N, T, D]
    holds N = copies x B rows (EAP-IG's passes stacked), each through the Jacobian at its own pass's R, then summed."""
    mods = _modules(model)
    for layer, name in post.items():
        heads = heads_of(graph, layer)
        if not bool(graph.mask[heads][:, rs].any()):
            continue
        with torch.inference_mode(False), torch.enable_grad():
            x = pre_norm[layer].detach().clone().requires_grad_(True)
            gl = _vjp_many(mods[name].forward(x), x, g.to(x.dtype)).float()  # not through the run's hooks
        gl = gl.reshape(len(rs), -1, b, t, g.shape[-1]).sum(1)
        g_sum = g.reshape(len(rs), -1, b, t, g.shape[-1]).sum(1).float()
        d = delta[heads]
        if per_position:
            out[:, :, heads[0]:heads[-1] + 1, rs] += torch.einsum("sbtd,rbtd->btsr", d, gl - g_sum)
        else:
            out[:, heads[0]:heads[-1] + 1, rs] += torch.einsum("sbtd,rbtd->bsr", d, gl - g_sum)


def post_norm_inputs(model: nn.Module, graph: Graph, inputs: dict) -> Dict[int, torch.Tensor]:
    """{layer: the input of the norm after its attention} in one forward of `inputs` (post-norm blocks)."""
    with HookScope() as scope, torch.no_grad():
        hooks = SenderHooks(model, graph, tuple(inputs["input_ids"].shape[:2]), scope)
        model(**inputs)
    return hooks.pre_norm


def normed_delta(model: nn.Module, graph: Graph, post: dict, pre_norm: dict, delta: torch.Tensor) -> torch.Tensor:
    """delta [S, B, T, D] with each post-norm layer's heads' rows replaced by norm(R + delta_h) - norm(R) (R the
    norm's input in the run they are patched into): what patching that head's edge alone adds to a receiver."""
    mods, delta = _modules(model), delta.clone()
    with torch.no_grad():
        for layer, name in post.items():
            x = pre_norm[layer].to(delta.dtype)
            for h in heads_of(graph, layer):
                delta[h] = (mods[name](x + delta[h]) - mods[name](x)).to(delta.dtype)
    return delta


def ig_points(steps: int, points: Union[str, Sequence[float], None] = None) -> List[float]:
    """The IG points, each the share of the source in target + alpha (source - target): a list as given, else of
    `steps`: midpoint (k + 0.5) / steps (default), left k / steps (k = 0 .. steps - 1: the target end in, the EAP-IG
    code's "inputs" loop with the gradient on its clean run), right k / steps (k = 1 .. steps: the source end in,
    its "activations" loop).

        ig_points(4)  # [0.125, 0.375, 0.625, 0.875];  ig_points(4, "left")  # [0.0, 0.25, 0.5, 0.75]
    """
    if points is not None and not isinstance(points, str):
        if not len(points):
            raise ValueError("circuit.points: empty; give the interpolation points, e.g. [0.25, 0.75]")
        return [float(a) for a in points]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"circuit.steps: {steps!r}; eap_ig and eap_ig_activations take steps >= 1")
    points = points or "midpoint"
    if points not in POINTS:
        raise ValueError(f"circuit.points: {points!r} is not one of {', '.join(POINTS)} or a list of numbers")
    first = {"midpoint": 0.5, "left": 0.0, "right": 1.0}[points]
    return [(k + first) / steps for k in range(steps)]


class LayerNodes:
    """EAP-IG "activations": the layer nodes past the input (each layer's attention, all heads at once, and its
    MLP: `a{L}` and `m{L}`, their modules' outputs), recording their outputs in a forward (record(), take()) and
    replacing them in a pass's copies with target + alpha (source - target) (interpolate())."""

    def __init__(self, model: nn.Module, graph: Graph, shape):
        anat, mods = graph.anat, _modules(model)
        has_mlp = {s.layer for s in graph.senders if s.kind == "mlp"}
        self.shape, self.mods, self.points, self.names, self.acts = tuple(shape), mods, {}, [], {}
        for layer in range(anat.n_layers):
            self.points[f"a{layer}"] = anat.point(f"blocks.{layer}.attn")
            if layer in has_mlp:
                self.points[f"m{layer}"] = anat.point(f"blocks.{layer}.mlp")
        self.names = list(self.points)

    def record(self, scope: HookScope) -> None:
        """Hooks in `scope` keeping each node's output of every forward, until take()."""
        at = lambda: self.shape  # noqa: E731
        for n, p in self.points.items():
            scope.value(self.mods[p.module], p, lambda y, n=n: self.acts.__setitem__(n, y.detach()), at)

    def take(self) -> Dict[str, torch.Tensor]:
        """The outputs the last forward recorded, {node: [B, T, D]}."""
        acts, self.acts = self.acts, {}
        return acts

    def interpolate(self, scope: HookScope, shares: Dict[str, tuple], lo: dict, hi: dict, copies: int) -> None:
        """Hooks in `scope` replacing node n's output in the copies `on` of shares[n] = (on [copies] bool, alpha
        [copies, 1, 1, 1]) by lo[n] + alpha (hi[n] - lo[n]), a constant (nothing flows back through it); the other
        copies flow."""
        batch = (copies * self.shape[0], self.shape[1])
        for n, (on, alpha) in shares.items():
            p = self.points[n]

            def fn(now, n=n, on=on, alpha=alpha):
                new = now.reshape(copies, *self.shape, now.shape[-1]).clone()
                new[on] = (lo[n][None] + alpha[on] * (hi[n] - lo[n])[None]).to(now.dtype)
                return new.reshape(now.shape)
            scope.value(self.mods[p.module], p, fn, lambda: batch)


def _delta(a_s: torch.Tensor, a_t: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    d = (a_s - a_t).float()
    return d if valid is None else d * valid[None, :, :, None].to(d.dtype)
