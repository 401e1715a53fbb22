"""Circuits in the EAP-IG code's graph files (hannamw/EAP-IG `Graph.to_json` / `to_pt`, read by `Graph.from_json` /
`from_pt`: the MIB circuit track's submission format), written from a circuit run and read back as circuits of
hookrun's graph. No torch, but for the .pt files.

    write_graph("c.json", graph, scores, mask, d_model=64)   # res.to_json("c.json", "top_20") calls it; .pt: to_pt
    ref = read_graph("c.json")             # a ReferenceGraph: cfg, and each reference edge's score and in_graph
    mask, problems = ref.circuit(graph)    # [E] bool: hookrun's edges in the file's circuit (pruned by the caller)

The names: the reference's nodes are `input`, `a{L}.h{H}`, `m{L}` and `logits`, its edges `sender->receiver`,
`a{L}.h{H}<q|k|v>` for a head's inputs: hookrun's own. Its graph always has an MLP a layer (an attention-only
model's MLP edges are written with score 0, not in the graph) and a k and v receiver a head: under grouped-query
attention hookrun's `a{L}.kv{G}<k>` edge is written on each head of its group (its score split evenly, so the
group's scores add up to it), and read back in the circuit where any head's copy is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

SUFFIXES = (".json", ".pt")


def reference_nodes(n_layers: int, n_heads: int) -> Tuple[List[str], List[str]]:
    """The reference graph's source nodes (its forward index order: input, then a layer's heads and its MLP) and
    destination nodes (its backward index order: a layer's q, k and v inputs head by head, its MLP, then logits)."""
    src, dst = ["input"], []
    for layer in range(n_layers):
        src += [f"a{layer}.h{h}" for h in range(n_heads)] + [f"m{layer}"]
        dst += [f"a{layer}.h{h}<{x}>" for x in "qkv" for h in range(n_heads)] + [f"m{layer}"]
    return src, dst + ["logits"]


def reference_edges(n_layers: int, n_heads: int, parallel: bool) -> List[Tuple[str, int, int]]:
    """(name, forward index, backward index) of each edge of the reference's Graph.from_model, in its order: a
    layer's heads read every node before the layer, its MLP those and (sequential blocks) the layer's heads, the
    logits every node."""
    src, dst = reference_nodes(n_layers, n_heads)
    fwd = {n: i for i, n in enumerate(src)}
    bwd = {n: i for i, n in enumerate(dst)}
    out, stream = [], ["input"]

    def add(parent, child):
        out.append((f"{parent}->{child}", fwd[parent], bwd[child]))

    for layer in range(n_layers):
        heads = [f"a{layer}.h{h}" for h in range(n_heads)]
        for node in stream:
            for head in heads:
                for x in "qkv":
                    add(node, f"{head}<{x}>")
            if parallel:
                add(node, f"m{layer}")
        if not parallel:
            for node in stream + heads:
                add(node, f"m{layer}")
        stream += heads + [f"m{layer}"]
    for node in stream:
        add(node, "logits")
    return out


def hookrun_names(graph) -> List[List[str]]:
    """For each edge of hookrun's graph (a CircuitGraph or a Graph), the reference edge names it is: one, or under
    grouped-query attention a key-value edge's copy on each head of its group."""
    out = []
    for s, r in zip(np.asarray(graph.edge_s).tolist(), np.asarray(graph.edge_r).tolist()):
        snd, rcv = graph.senders[s], graph.receivers[r]
        if rcv.kind in ("q", "k", "v"):
            out.append([f"{snd.name}->{head}<{rcv.kind}>" for head in rcv.heads])
        else:
            out.append([f"{snd.name}->{rcv.name}"])
    return out


def _shape(graph) -> Tuple[int, int, bool]:
    heads = sorted({s.head for s in graph.senders if s.kind == "head"})
    layers = graph.n_layers
    parallel = not any(graph.senders[s].kind == "head" and graph.receivers[r].kind == "mlp" and
                       graph.senders[s].layer == graph.receivers[r].layer
                       for s, r in zip(np.asarray(graph.edge_s).tolist(), np.asarray(graph.edge_r).tolist()))
    has_mlp = any(r.kind == "mlp" for r in graph.receivers)
    return layers, len(heads), parallel if has_mlp else False


def reference_dict(graph, scores: Sequence[float], mask: Optional[Sequence[bool]], d_model: int) -> dict:
    """The reference's JSON graph (cfg, nodes, edges) of hookrun's `graph` with these mean edge `scores` [E] and the
    circuit `mask` [E] (None: every edge in the graph, a submission MIB selects from by score)."""
    layers, heads, parallel = _shape(graph)
    scores = np.asarray(scores, np.float64)
    keep = np.ones(len(scores), bool) if mask is None else np.asarray(mask, bool)
    score, inside = {}, {}
    for e, names in enumerate(hookrun_names(graph)):
        for name in names:
            score[name] = float(scores[e]) / len(names)
            inside[name] = bool(keep[e])
    edges = reference_edges(layers, heads, parallel)
    src, _ = reference_nodes(layers, heads)
    has_out = {n: False for n in src}
    has_in = {n: n == "input" for n in src}
    for name, _, _ in edges:
        if inside.get(name, False):
            parent, child = name.split("->")
            has_out[parent] = True
            if child != "logits":
                has_in[child.split("<")[0]] = True
    nodes = {n: {"in_graph": bool(has_out[n] and has_in[n])} for n in src}
    nodes["logits"] = {"in_graph": True}
    return {"cfg": {"n_layers": layers, "n_heads": heads, "parallel_attn_mlp": parallel, "d_model": int(d_model)},
            "nodes": nodes,
            "edges": {name: {"score": score.get(name, 0.0), "in_graph": inside.get(name, False)}
                      for name, _, _ in edges}}


def write_graph(path, graph, scores, mask=None, d_model: int = 0) -> Path:
    """Write the circuit as the reference's graph file: `.json` (Graph.to_json's layout) or `.pt` (Graph.to_pt's:
    cfg, src_nodes, dst_nodes, edges_scores and edges_in_graph [forward, backward], nodes_in_graph [forward])."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: give a .json or .pt path (the reference's two graph files)")
    d = reference_dict(graph, scores, mask, d_model)
    if path.suffix == ".json":
        path.write_text(json.dumps(d))
        return path
    import torch

    cfg = d["cfg"]
    src, dst = reference_nodes(cfg["n_layers"], cfg["n_heads"])
    s = torch.zeros((len(src), len(dst)))
    g = torch.zeros((len(src), len(dst)), dtype=torch.bool)
    for name, f, b in reference_edges(cfg["n_layers"], cfg["n_heads"], cfg["parallel_attn_mlp"]):
        s[f, b] = d["edges"][name]["score"]
        g[f, b] = d["edges"][name]["in_graph"]
    torch.save({"cfg": cfg, "src_nodes": src, "dst_nodes": dst, "edges_scores": s, "edges_in_graph": g,
                "nodes_in_graph": torch.tensor([d["nodes"][n]["in_graph"] for n in src])}, path)
    return path


@dataclass
class ReferenceGraph:
    """A reference graph file read back: its `cfg` (n_layers, n_heads, parallel_attn_mlp, d_model) and each of its
    edges' `score` and `in_graph`, by the reference's edge name."""

    path: str
    cfg: dict
    scores: Dict[str, float]
    in_graph: Dict[str, bool]

    def circuit(self, graph, key: str = "circuit.circuits") -> Tuple[np.ndarray, List[str]]:
        """([E] bool: hookrun's edges in the file's circuit, problems): a problem for a file of another shape, or
        an edge in its circuit that hookrun's graph lacks (an attention-only model's MLP edges)."""
        layers, heads, parallel = _shape(graph)
        cfg = self.cfg
        want = (int(cfg.get("n_layers", -1)), int(cfg.get("n_heads", -1)))
        if want != (layers, heads):
            return np.zeros(len(graph), bool), [
                f"{key}: {self.path} is a graph of {want[0]} layers of {want[1]} heads, the model's has {layers} of "
                f"{heads}; give a graph file written for this model"]
        has_mlp = any(r.kind == "mlp" for r in graph.receivers)
        if has_mlp and bool(cfg.get("parallel_attn_mlp", False)) != parallel:
            said = {True: "parallel attention and MLP", False: "sequential blocks"}
            return np.zeros(len(graph), bool), [
                f"{key}: {self.path} is a graph of {said[bool(cfg.get('parallel_attn_mlp'))]}, the model has "
                f"{said[parallel]}; give a graph file written for this model"]
        where = {name: e for e, names in enumerate(hookrun_names(graph)) for name in names}
        mask = np.zeros(len(graph), bool)
        missing = []
        for name, inside in self.in_graph.items():
            if not inside:
                continue
            if name in where:
                mask[where[name]] = True
            else:
                missing.append(name)
        problems = [] if not missing else [
            f"{key}: {self.path} has {len(missing)} edge(s) in its circuit that the model's graph lacks "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): written for another architecture "
            "(an MLP edge on an attention-only model, parallel against sequential blocks)"]
        return mask, problems

    def edge_scores(self, graph) -> np.ndarray:
        """[E] the file's scores on hookrun's edges (a grouped-query key-value edge: the sum over its heads')."""
        return np.array([sum(self.scores.get(n, 0.0) for n in names) for names in hookrun_names(graph)])


def read_graph(path) -> ReferenceGraph:
    """A reference graph file (.json from Graph.to_json, .pt from Graph.to_pt) read back; ValueError naming the
    file and what is wrong with it."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: not a .json or .pt graph file (the EAP-IG code's Graph.to_json / to_pt)")
    if path.suffix == ".json":
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or not all(k in d for k in ("cfg", "nodes", "edges")):
            raise ValueError(f"{path}: not a reference graph (a JSON object with cfg, nodes and edges)")
        return ReferenceGraph(str(path), dict(d["cfg"]), {k: float(v.get("score", 0.0)) for k, v in d["edges"].items()},
                              {k: bool(v.get("in_graph", False)) for k, v in d["edges"].items()})
    import torch

    d = torch.load(path, map_location="cpu", weights_only=True)
    need = ("cfg", "src_nodes", "dst_nodes", "edges_scores", "edges_in_graph", "nodes_in_graph")
    if not isinstance(d, dict) or not all(k in d for k in need):
        raise ValueError(f"{path}: not a reference graph (a torch file with {', '.join(need)})")
    cfg = dict(d["cfg"])
    scores, inside = {}, {}
    s, g = d["edges_scores"], d["edges_in_graph"]
    for name, f, b in reference_edges(int(cfg["n_layers"]), int(cfg["n_heads"]), bool(cfg["parallel_attn_mlp"])):
        scores[name] = float(s[f, b])
        inside[name] = bool(g[f, b])
    return ReferenceGraph(str(path), cfg, scores, inside)
