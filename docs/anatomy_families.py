"""The family list of docs/anatomy.md, made by walking the installed transformers' causal-LM registry: every model type
of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES built tiny from its config class (2 layers, width 32, random weights), its
anatomy found (table or inferred) and proved on one tiny forward. tests/test_anatomy_walk.py checks the page.

    python docs/anatomy_families.py            # rewrite the list in docs/anatomy.md
"""
from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "anatomy.md"
BEGIN, END = "<!-- families: begin (python docs/anatomy_families.py) -->", "<!-- families: end -->"
SHRINK = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, head_dim=8, max_position_embeddings=64, n_layer=2, n_embd=32, n_head=4, n_layers=2,
              d_model=32, num_layers=2, num_heads=4, n_positions=64, ffn_dim=64, moe_intermediate_size=32,
              num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
              shared_expert_intermediate_size=32, rotary_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
              first_k_dense_replace=1, n_shared_experts=1, topk_group=1, n_group=1, sliding_window=16,
              image_size=28, patch_size=14, mm_tokens_per_image=4, vision_output_dim=32, projection_dim=32,
              mamba_n_heads=4, mamba_d_head=16)
MAMBA = ("mamba_n_heads", "mamba_d_head")  # Bamba's and Granite-hybrid's Mamba heads (dropped where refused)
CAUSES = {  # why a refused family's stream does not add up, where it is known (the check says which identity)
    "openai-gpt": "post-norm blocks: the norm comes after the residual add",
    "trocr": "post-norm blocks (the decoder of an OCR encoder-decoder)",
    "deepseek_v4": "hyper-connections: several residual streams mixed by learned weights, not one",
    "minimax": "the residual is the norm's output (each sublayer adds to its normalised input, BERT-style), not the "
               "block's input",
    "ctrl": "sinusoidal positions from a buffer (no module) and a scaled embedding are added before block 0",
    "beam": "depth-scaled residual adds: the stream and each sublayer's output are scaled before the add",
    "dory": "unit-sphere updates (nGPT-style): the stream moves towards the normalised update by learned rates",
    "hy_v4": "hyper-connections: several residual streams mixed by learned weights, not one",
    "qwen4_exp_text": "hyper-connections: several residual streams mixed by learned weights, not one",
    **{t: "a short convolution sits between attention (and the MLP) and the residual add, over the positions"
       for t in ("inkling_text", "inkling2_text", "inkling2_loop_text")},
    "granitemoehybrid": "the MLP's write is the sum of two modules (the experts and a shared MLP), no one module",
    "zamba2": "a shared transformer block is applied beside the Mamba layers and projected back into them",
    "bert-generation": "BERT-style post-norm layers (the norm after each add, inside the attention's output)",
    "git": "BERT-style post-norm layers (the norm after each add, inside the attention's output)",
    "xlnet": "two-stream permutation attention over a memory: no one ModuleList on the token stream",
    "hrm_text": "a hierarchical recurrent model: two stacks run in loops, not one stack of blocks",
}
LIMIT = 20_000_000  # parameters: a family whose shrunk config still builds bigger is counted as not tiny
STATUS = {"verified": "resolves every standard site it has and passes the check",
          "refused": "built, but its anatomy was refused or a site did not add up",
          "not_built": "its config class does not build a tiny model here (or it needs external weights)",
          "encoder_decoder": "an encoder-decoder (its causal-LM class is the decoder of one)",
          "encoder": "an encoder used as a decoder (also a masked-LM family: post-norm BERT-style blocks)"}


LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
NONE_OK = ("head_dim", "num_key_value_heads")  # set even where the default is None (derived later, or unset)


def _kwargs(config) -> dict:
    d = config.to_dict()
    out = {k: v for k, v in SHRINK.items() if k in d and (isinstance(d[k], int) and not isinstance(d[k], bool)
                                                          or d[k] is None and (k.endswith("token_id")
                                                                               or k in NONE_OK))}
    if all(isinstance(d.get(k), int) for k in ("expand", "num_heads", "head_dim")):  # Mamba-2: heads * d_head is
        out["head_dim"] = out.get("hidden_size", d.get("hidden_size")) * d["expand"] // out["num_heads"]  # expand * d
    if "qk_rope_head_dim" in out:  # multi-head latent attention: head_dim is its rope's width, a key-value head a head
        out.update({k: out[v] for k, v in (("head_dim", "qk_rope_head_dim"), ("num_key_value_heads",
                                                                          "num_attention_heads")) if k in out})
    layers = next((d[k] for k in LAYER_COUNTS if isinstance(d.get(k), int)), None)
    new = next((out[k] for k in LAYER_COUNTS if k in out), None)
    for k, v in d.items():  # per-layer lists (layer_types, attention_layers) cut to the new depth, every kind kept
        if layers and new and isinstance(v, list) and len(v) == layers and new < layers:
            out[k] = _fewer(v, new)
    return out


def _fewer(items: list, n: int) -> list:
    """n of a per-layer list's items, the first of each kind first (a hybrid keeps its attention layer)."""
    firsts = [i for i, x in enumerate(items) if repr(x) not in {repr(y) for y in items[:i]}]
    keep = sorted((firsts + [i for i in range(len(items)) if i not in firsts])[:n])
    return [items[i] for i in keep]


def config_of(model_type: str):
    """The model type's config class, shrunk (its text and vision sub-configs too), eager attention, no cache."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    base = cls()
    subs = {}
    for sub in ("text_config", "vision_config"):
        c = getattr(base, sub, None)
        if c is not None and hasattr(c, "to_dict"):
            subs[sub] = {**c.to_dict(), **_kwargs(c), **({"num_hidden_layers": 1} if sub == "vision_config" else {})}
    kwargs = _kwargs(base)
    plain = {k: v for k, v in kwargs.items() if k not in MAMBA}
    config = None
    for args in ({**kwargs, **subs}, kwargs, {**plain, **subs}, plain):  # sub-configs and Mamba heads where taken
        try:
            config = cls(**args, use_cache=False)
            break
        except Exception as err:  # noqa: BLE001 - a config class that takes no sub-config dicts, or these heads
            failed = err
    if config is None:
        raise failed
    config._attn_implementation = "eager"
    return config


def tiny(model_type: str):
    """(status, a tiny random model of the model type or None, why): status is one of STATUS's keys."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, \
        MODEL_FOR_MASKED_LM_MAPPING_NAMES

    try:
        config = config_of(model_type)
    except Exception as err:  # noqa: BLE001 - any config class's own refusal
        return "not_built", None, f"config: {type(err).__name__}"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder_decoder", None, ""
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder", None, ""
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    if cls is None:
        return "not_built", None, "no class"
    text = getattr(config, "text_config", None)
    if text is not None and not isinstance(config, cls.config_class) and isinstance(text, cls.config_class):
        config = text  # a multimodal type whose causal-LM class is its text model (Qwen 3.5, Llama 4)
        config._attn_implementation = "eager"
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(config).parameters())
        if size > LIMIT:
            return "not_built", None, f"{size / 1e6:.0f}M parameters at the smallest config"
        torch.manual_seed(0)
        model = cls(config).eval()
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]), use_cache=False)
    except Exception as err:  # noqa: BLE001 - any model's own failure to build or run tiny
        return "not_built", None, f"{type(err).__name__}"
    return "built", model, ""


def walk(types=None) -> list:
    """One row a model type: model_type, class, status, source (table | inferred), sites, worst (the check's worst
    relative error), why (refused: the first refusal)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hookrun.capture.anatomy import AnatomyError, anatomy

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    rows = []
    for mtype, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if types is not None and mtype not in types:
            continue
        status, model, why = tiny(mtype)
        row = dict(model_type=mtype, cls=cls, status=status, source=None, sites=0, worst=None, why=why, model=None)
        if model is not None:
            try:
                anat = anatomy(model)
                failed = anat.proof.failed if anat.proof is not None else {}
                row.update(source=anat.source, sites=len(anat.standard_names()), worst=anat.proof.worst(),
                           status="refused" if failed else "verified", model=model,
                           why=next(iter(failed.items()), ("", ""))[0] + (": " + _short(failed)) if failed else "")
            except AnatomyError as err:
                row.update(status="refused", why=_short_text(str(err)))
        rows.append(row)
    logging.disable(logging.NOTSET)
    return rows


def _short(failed: dict) -> str:
    return _short_text(next(iter(failed.values())))


def _short_text(text: str) -> str:
    text = re.sub(r"\(relative error [^)]*\)", "", text).split("; declare")[0]
    return re.sub(r"\s+", " ", text)[:160].strip()


def counts(rows: list) -> dict:
    """The walk's numbers: in the mapping, decoder-only, built, verified, refused, not built, skipped."""
    c = {k: sum(r["status"] == k for r in rows) for k in STATUS}
    built = c["verified"] + c["refused"]
    return dict(mapping=len(rows), decoder_only=built + c["not_built"], built=built, **c,
                share=c["verified"] / built if built else 0.0)


def render(rows: list) -> str:
    """The page's list: the numbers, then each family by status (inferred or table), refusals with why."""
    import transformers

    n = counts(rows)
    out = [BEGIN, "", f"transformers {transformers.__version__}: {n['mapping']} causal-LM model types; "
           f"{n['decoder_only']} decoder-only, {n['built']} of them build tiny here, **{n['verified']} "
           f"({n['share']:.0%}) resolve every standard site they have and pass the check**; {n['refused']} refused; "
           f"{n['not_built']} do not build tiny; skipped: {n['encoder_decoder']} encoder-decoder, {n['encoder']} "
           "encoder.", ""]
    for source in ("table", "inferred"):
        names = [r["model_type"] for r in rows if r["status"] == "verified" and r["source"] == source]
        out += [f"Verified, from {'a table' if source == 'table' else 'inference'} ({len(names)}): "
                + ", ".join(f"`{x}`" for x in names) + ".", ""]
    refused = [r for r in rows if r["status"] == "refused"]
    if refused:
        out += [f"Refused ({len(refused)}):", ""] + [
            f"- `{r['model_type']}` ({r['cls']}): {r['why']}" + (f" ({CAUSES[r['model_type']]})"
                                                                 if r["model_type"] in CAUSES else "")
            for r in refused] + [""]
    not_built = [r for r in rows if r["status"] == "not_built"]
    out += [f"Not built tiny ({len(not_built)}): " + ", ".join(f"`{r['model_type']}`" for r in not_built) + ".",
            "", f"Skipped: encoder-decoder " + ", ".join(f"`{r['model_type']}`" for r in rows
                                                         if r["status"] == "encoder_decoder")
            + "; encoders " + ", ".join(f"`{r['model_type']}`" for r in rows if r["status"] == "encoder") + ".",
            "", END]
    return "\n".join(out)


def update(text: str, rows: list) -> str:
    """The page's text with its family list replaced by the walk's."""
    a, b = text.index(BEGIN), text.index(END) + len(END)
    return text[:a] + render(rows) + text[b:]


if __name__ == "__main__":
    found = walk()
    PAGE.write_text(update(PAGE.read_text(), found))
    print(counts(found))
