"""The family tables: where each architecture keeps its parts, one entry a family with its quirks beside it, and
`model.anatomy` (the same fields declared in YAML) for any other model.

    FAMILIES["llama"].attn_out           # 'self_attn.o_proj' (block parts are relative to a block)
    declared({"blocks": "layers", "embed": "tok", "attn": "attn", "mlp": "ff"})   # a Family from model.anatomy

A family with no entry here is inferred from its module tree (hookrun.capture.inference) and proved on one tiny
forward (hookrun.capture.proof); an entry is proved the same way in tests/test_anatomy_walk.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from hookrun.config.checks import suggest


class AnatomyError(ValueError):
    """A part the model lacks, an unknown architecture, or a declared anatomy that does not fit the model; the
    message names the key to set and what the model has."""


@dataclass(frozen=True)
class Family:
    """Where one architecture keeps its parts: module names, block parts relative to the block (`attn.c_proj`).

    A part set to None is absent (GPT-J's ln2, Llama's pos_embed), and so is a block part a block lacks (a hybrid's
    attention on its state-space layers); `model.anatomy` in YAML gives these fields."""

    blocks: str  # the ModuleList of blocks
    embed: Tuple[str, ...]  # the token embedding's write: the first of these the model has
    attn: Optional[str]  # the attention module: its output (output.0) is what attention computes (None: a
    # state-space or recurrent stack with no attention, whose `mixer` mixes the tokens)
    mlp: Optional[str]  # the MLP: its output is what the MLP computes (OPT: fc2); None: attention-only blocks
    pos_embed: Tuple[str, ...] = ()  # learned position embeddings
    embed_scale: Optional[float] = None  # the stream is the token embedding's output times this (XGLM, CTRL)
    embed_times: Optional[str] = None  # a config attribute that is embed_scale (Granite's embedding_multiplier)
    pos_fixed: bool = False  # positions added from a buffer, not a module (CTRL's sinusoids): the check asks that
    # blocks.0.resid_pre - embed * embed_scale be the same on every row (a function of the position alone)
    ln1: Optional[str] = None  # the norm before attention
    ln2: Optional[str] = None  # the norm before the MLP (in parallel blocks: on the block's input too)
    attn_out: Optional[str] = None  # attention's output projection: its input holds the heads side by side
    q: Optional[str] = None  # the query / key / value projections
    k: Optional[str] = None
    v: Optional[str] = None
    qkv: Optional[str] = None  # a fused projection instead of q, k, v
    q_parts: int = 1  # q's projection holds, per head, q and then q_parts - 1 more (Qwen3-Next's output gate:
    # [q | gate] per head); attn.q is the first, proved by what the attention reads (its q_norm)
    qkv_layout: str = "concat"  # concat: [q | k | v] (GPT-2, Phi-3); per_head: [heads, 3, d_head] (GPT-NeoX);
    # groups:G: [G, (q | v | k)] (CodeGen's model-parallel groups, its attention's mp_num)
    pattern: Optional[str] = None  # a module whose output is the attention pattern (else attention's output.1)
    attn_write: Optional[str] = None  # a module after attention whose output is what reaches the stream (Gemma 2/3's
    # post-norm; BLOOM's output projection, its attention adding the residual itself)
    mlp_write: Optional[str] = None  # the same after the MLP (Gemma 2/3, OLMo 2)
    mlp_out: Optional[str] = None  # the MLP's output projection: its input is mlp.hidden
    attn_scale: Optional[str] = None  # an attribute of the block that attention's write is multiplied by before
    # the residual add (MiniCPM3's residual_scale, Granite's residual_multiplier): blocks.N.attn is the scaled write
    mlp_scale: Optional[str] = None  # the same for the MLP's write
    mlp_plus: Optional[str] = None  # a second module the block adds to the MLP's output before the residual add, on
    # the same input (Granite 4's shared_mlp beside its experts): blocks.N.mlp is their sum, read at the MLP's output
    router: Optional[str] = None  # a mixture of experts' router: its output.0 is the router logits (mlp.router)
    mixer: Optional[str] = None  # a hybrid's token mixer on the blocks without attention (state-space, linear)
    start: Optional[str] = None  # a norm in block 0 whose output starts the residual stream (RWKV's pre_ln):
    # blocks.0.resid_pre is its output, and the embeddings add up to its input
    final_norm: Optional[str] = None  # the final norm
    post: Tuple[str, ...] = ()  # modules between the final norm and the unembedding (OPT's project_out)
    final_times: Optional[str] = None  # a config attribute the final norm's output is multiplied by before the
    # unembedding reads it
    final_over: Optional[str] = None  # one it is divided by (Inkling's logits_mup_width_multiplier)
    unembed: Optional[str] = None  # None: model.get_output_embeddings()
    prefix: Optional[str] = None  # a config attribute: positions the model prepends to the tokens inside (CPM-Ant's
    # prompt_length): every site before the unembedding is read on the token positions after them
    parallel: object = False  # attention and MLP both read the block's input: True, or a config attribute's name
    logits_times: Optional[str] = None  # a config attribute the unembedding's output is multiplied by (Cohere)
    logits_over: Optional[str] = None  # a config attribute it is divided by (Granite's logits_scaling)
    router_index: int = 0  # the element of the router's output that holds its logits (Llama 4's: 1, after scores)
    layers: Tuple[Tuple[int, Tuple[Tuple[str, Optional[str]], ...]], ...] = ()  # a hybrid's blocks that differ:
    # (block, ((part, module or None), ...)) beside the fields above (OLMo-Hybrid's post_attention_layernorm is a
    # post-norm on its attention blocks and the MLP's pre-norm on the others; Nemotron-H's `mixer` is attention,
    # Mamba or an MLP by block); inferred, not declared

    def block_part(self, part: str, i: int) -> Optional[str]:
        """Block i's part (relative to the block): its own where the block differs, else the field's."""
        for block, parts in self.layers:
            if block == i:
                own = dict(parts)
                if part in own:
                    return own[part]
        return getattr(self, part)


_LLAMA = Family(blocks="model.layers", embed=("model.embed_tokens",), ln1="input_layernorm", attn="self_attn",
                attn_out="self_attn.o_proj", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                ln2="post_attention_layernorm", mlp="mlp", mlp_out="mlp.down_proj", final_norm="model.norm")
_GEMMA2 = dataclasses.replace(_LLAMA, ln2="pre_feedforward_layernorm", attn_write="post_attention_layernorm",
                              mlp_write="post_feedforward_layernorm")
FAMILIES: Dict[str, Family] = {
    "gpt2": Family(blocks="transformer.h", embed=("transformer.wte",), pos_embed=("transformer.wpe",), ln1="ln_1",
                   attn="attn", attn_out="attn.c_proj", qkv="attn.c_attn", ln2="ln_2", mlp="mlp",
                   mlp_out="mlp.c_proj", final_norm="transformer.ln_f"),
    "gpt_neo": Family(blocks="transformer.h", embed=("transformer.wte",), pos_embed=("transformer.wpe",), ln1="ln_1",
                      attn="attn", attn_out="attn.attention.out_proj", q="attn.attention.q_proj",
                      k="attn.attention.k_proj", v="attn.attention.v_proj", ln2="ln_2", mlp="mlp",
                      mlp_out="mlp.c_proj", final_norm="transformer.ln_f"),
    "gptj": Family(blocks="transformer.h", embed=("transformer.wte",), ln1="ln_1", attn="attn",
                   attn_out="attn.out_proj", q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", mlp="mlp",
                   mlp_out="mlp.fc_out", final_norm="transformer.ln_f", parallel=True),
    "gpt_neox": Family(blocks="gpt_neox.layers", embed=("gpt_neox.embed_in",), ln1="input_layernorm",
                       attn="attention", attn_out="attention.dense", qkv="attention.query_key_value",
                       qkv_layout="per_head", ln2="post_attention_layernorm", mlp="mlp", mlp_out="mlp.dense_4h_to_h",
                       final_norm="gpt_neox.final_layer_norm", parallel="use_parallel_residual"),
    # OPT: token embeddings go through project_in when word_embed_proj_dim != hidden_size; the MLP is inline
    # (fc1 -> act -> fc2) on tokens flattened to [B*T, d]
    "opt": Family(blocks="model.decoder.layers", embed=("model.decoder.project_in", "model.decoder.embed_tokens"),
                  pos_embed=("model.decoder.embed_positions",), ln1="self_attn_layer_norm", attn="self_attn",
                  attn_out="self_attn.out_proj", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                  ln2="final_layer_norm", mlp="fc2", mlp_out="fc2", final_norm="model.decoder.final_layer_norm",
                  post=("model.decoder.project_out",)),
    "phi": Family(blocks="model.layers", embed=("model.embed_tokens",), ln1="input_layernorm", attn="self_attn",
                  attn_out="self_attn.dense", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                  mlp="mlp", mlp_out="mlp.fc2", final_norm="model.final_layernorm", parallel=True),
    "phi3": dataclasses.replace(_LLAMA, q=None, k=None, v=None, qkv="self_attn.qkv_proj"),
    "cohere": dataclasses.replace(_LLAMA, ln2=None, parallel=True, logits_times="logit_scale"),
    "stablelm": dataclasses.replace(_LLAMA, parallel="use_parallel_residual"),
    # experts' weights are fused (one tensor for all experts): no mlp.hidden; the router's logits are gate's output.0
    "mixtral": dataclasses.replace(_LLAMA, mlp_out=None, router="mlp.gate"),
    "olmo2": dataclasses.replace(_LLAMA, ln1=None, ln2=None, attn_write="post_attention_layernorm",
                                 mlp_write="post_feedforward_layernorm"),
    # Gemma 3 (ForConditionalGeneration too: its text stack is model.language_model.*, found by the same table)
    **{t: _GEMMA2 for t in ("gemma2", "gemma3_text")},
    # Granite scales each write by residual_multiplier before the add (0.22 in Granite 3): blocks.N.attn / .mlp are
    # the scaled writes; its embedding by embedding_multiplier (12), outside the module
    "granite": dataclasses.replace(_LLAMA, logits_over="logits_scaling", attn_scale="residual_multiplier",
                                   mlp_scale="residual_multiplier", embed_times="embedding_multiplier"),
    **{t: _LLAMA for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo")},
}
BLOCK_PARTS = ("ln1", "attn", "attn_out", "q", "k", "v", "qkv", "pattern", "attn_write", "ln2", "mlp", "mlp_out",
               "mlp_write", "mlp_plus", "router", "mixer")  # a block's parts, relative to the block
FIELDS = tuple(f.name for f in dataclasses.fields(Family) if f.name != "layers")  # model.anatomy's keys
TUPLES = ("embed", "pos_embed", "post")  # the fields that take a list of module names (the first the model has)


def declared(spec: Mapping, key: str = "model.anatomy") -> Family:
    """A Family from `model.anatomy` in YAML (str or list for the tuple fields); AnatomyError naming unknown or
    missing keys.

        declared({"blocks": "layers", "embed": "tok", "attn": "attn", "mlp": "ff", "final_norm": "norm"})
    """
    spec = dict(spec)
    unknown = [k for k in spec if k not in FIELDS]
    problems = [f"{key}.{k}: unknown part{suggest(k, FIELDS)}; the parts are {', '.join(FIELDS)}" for k in unknown]
    missing = [k for k in ("blocks", "embed", "attn", "mlp") if k not in spec]
    problems += [f"{key}.{k}: missing; {key} needs blocks, embed, attn and mlp (dotted module names; block parts "
                 f"relative to a block, e.g. attn: self_attn)" for k in missing]
    if problems:
        raise AnatomyError("; ".join(problems))
    tuples = {k: tuple([spec[k]] if isinstance(spec[k], str) else spec[k]) for k in TUPLES if k in spec}
    return Family(**{**spec, **tuples})
