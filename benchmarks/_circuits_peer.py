"""The peer side of benchmarks/circuits_peers.py, run by it in the peer's own venv (no hookrun there): loads the
saved GPT-2, then answers one line of JSON a command read from stdin.

    PEER_PYTHON benchmarks/_circuits_peer.py tl|ac JOB.json     # JOB: model dir, clean, corrupt, a, b, threads
    stdin "run" -> {"seconds": s} (one EAP pass over every pair)   "scores" -> {"scores": {hookrun edge name: s}}

tl: TransformerLens 4.x, TransformerBridge.boot_transformers(hf_model=..) and
    transformer_lens.tools.analysis.attribution_patch(granularity="edge"): gradient on the corrupt run, score
    (a_clean - a_corrupt) . grad, mean over pairs; its edges are per position (summed here to hookrun's).
ac: auto-circuit on a HookedTransformer (TransformerLens 2.x) built from the same config and weights
    (convert_gpt2_weights, no folding), mask_gradient_prune_scores(grad_function="logit", answer_function=
    "avg_diff", mask_val=0): gradient of -(mean logit difference) on the clean run with respect to each edge's
    mask (0: clean, 1: corrupt); its edges are summed over positions (seq_len=None).
"""
import json
import sys
import time

import torch


def tl_peer(job):
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, attribution_patch

    hf = GPT2LMHeadModel.from_pretrained(job["model"]).eval()
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=hf, device="cpu",
                                                 tokenizer=PreTrainedTokenizerFast.from_pretrained(job["model"]))
    bridge.eval()
    clean, corrupt = torch.tensor(job["clean"]), torch.tensor(job["corrupt"])
    a, b = job["a"], job["b"]
    config = EdgeAttributionConfig(granularity="edge")

    def run():
        return attribution_patch(bridge, clean, corrupt, lambda logits: logits[0, -1, a] - logits[0, -1, b], config)

    def node(n):
        if n.kind == "embed":
            return "input"
        if n.kind == "attn_head_out":
            return f"a{n.layer}.h{n.head}"
        if n.kind in ("mlp_out", "mlp_in"):
            return f"m{n.layer}"
        if n.kind == "logits":
            return "logits"
        return f"a{n.layer}.h{n.head}<{n.kind[0]}>"  # q_input, k_input, v_input

    def scores(result):
        out = {}
        for (writer, reader), s in result.edge_scores.items():  # per position: summed
            name = f"{node(writer)}->{node(reader)}"
            out[name] = out.get(name, 0.0) + s
        return out

    import importlib.metadata as md
    return run, scores, f"transformer-lens {md.version('transformer-lens')}"


def ac_peer(job):
    from transformers import GPT2LMHeadModel
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from auto_circuit.data import PromptDataLoader, PromptDataset
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.utils.graph_utils import patchable_model

    hf = GPT2LMHeadModel.from_pretrained(job["model"]).eval()
    c = hf.config
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, n_heads=c.n_head, d_head=c.n_embd // c.n_head,
                                  d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, n_ctx=c.n_positions, act_fn="gelu_new",
                                  normalization_type="LN", eps=c.layer_norm_epsilon, device="cpu")
    model = HookedTransformer(cfg)
    model.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
    model.cfg.use_attn_result = True
    model.cfg.use_split_qkv_input = True
    model.cfg.use_hook_mlp_in = True
    model.eval()
    for p in model.parameters():
        p.requires_grad = False
    model = patchable_model(model, factorized=True, slice_output="last_seq", separate_qkv=True, device="cpu")
    clean, corrupt = torch.tensor(job["clean"]), torch.tensor(job["corrupt"])
    n = len(clean)
    data = PromptDataset(clean, corrupt, [torch.tensor([job["a"]])] * n, [torch.tensor([job["b"]])] * n)
    loader = PromptDataLoader(data, seq_len=None, diverge_idx=0, batch_size=n, shuffle=False)

    def run():
        return mask_gradient_prune_scores(model, loader, None, grad_function="logit", answer_function="avg_diff",
                                          mask_val=0.0)

    def name(n):
        if n.name == "Resid Start":
            return "input"
        if n.name == "Resid End":
            return "logits"
        if n.name.startswith("MLP "):
            return f"m{n.name.split()[1]}"
        parts = n.name[1:].split(".")  # A{L}.{H} or A{L}.{H}.{Q|K|V}
        return f"a{parts[0]}.h{parts[1]}" + (f"<{parts[2].lower()}>" if len(parts) == 3 else "")

    def scores(result):
        return {f"{name(e.src)}->{name(e.dest)}": float(result[e.dest.module_name][e.patch_idx]) for e in model.edges}

    import importlib.metadata as md
    return run, scores, f"auto-circuit {md.version('auto-circuit')}, transformer-lens {md.version('transformer-lens')}"


def main():
    tool, path = sys.argv[1], sys.argv[2]
    job = json.loads(open(path).read())
    torch.set_num_threads(job["threads"])
    run, scores, version = {"tl": tl_peer, "ac": ac_peer}[tool](job)
    last = run()  # warm-up (the first pass builds caches)
    print(json.dumps({"ready": version}), flush=True)
    for line in sys.stdin:
        what = line.strip()
        if what == "run":
            t0 = time.perf_counter()
            last = run()
            print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
        elif what == "scores":
            print(json.dumps({"scores": scores(last)}), flush=True)
        else:
            break


if __name__ == "__main__":
    main()
