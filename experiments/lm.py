"""The language model and tokenizer of the lm_tokens experiment, built offline: nothing is downloaded.

    tok = tokenizer("pkg://hookrun.experiments/data/corpus.txt")   # byte-level BPE trained on the corpus
    model = causal_lm(n_layer=2, n_embd=64, n_head=4, vocab_size=512)   # GPT-2 config, random init
    weights = trained_weights(task_loss, 2, 64, 4, steps=80, lr=1e-2, seed=0)   # Adam, one CPU thread

The corpus (experiments/data/corpus.txt) is the project's own documentation, one paragraph a line. The models
trained on synthetic tasks (recall.py, moods.py, which brings its own corpus) are trained with `trained_weights`.
"""
from __future__ import annotations

import functools
import random

CORPUS = "pkg://hookrun.experiments/data/corpus.txt"
SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<pad>"}


@functools.lru_cache(maxsize=8)
def _trained(corpus: str, vocab_size: int):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained on the corpus lines; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hookrun.config.checks import resolve_file

    lines = [line for line in resolve_file(corpus).read_text(encoding="utf-8").splitlines() if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=sorted(set(SPECIAL.values())),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    return tok.to_str()


def tokenizer(corpus: str = CORPUS, vocab_size: int = 512, padding_side: str = "right"):
    """A transformers.PreTrainedTokenizerFast trained on `corpus` (a path or pkg://...), GPT-2 style:
    byte-level BPE, <|endoftext|> as BOS and EOS, <pad> as padding."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained(str(corpus), vocab_size)),
                                   padding_side=padding_side, **SPECIAL)


def trained_weights(task_loss, n_layer: int, n_embd: int, n_head: int, steps: int, lr: float, seed: int) -> dict:
    """A copy of the weights of causal_lm(n_layer, n_embd, n_head), initialised under torch seed `seed`, after
    `steps` Adam steps on one thread (tiny matrices: more threads only spin), each on `task_loss(model, rng)`: the
    loss of a fresh batch drawn from rng (random.Random(seed + 1), the same draws every time)."""
    import torch

    torch.manual_seed(seed)
    model = causal_lm(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    rng = random.Random(seed + 1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            value = task_loss(model, rng)
            opt.zero_grad()
            value.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def with_weights(weights: dict, n_layer: int, n_embd: int, n_head: int):
    """causal_lm(n_layer, n_embd, n_head) holding `weights` (trained_weights'), in eval mode."""
    model = causal_lm(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    model.load_state_dict(weights)
    return model.eval()


def causal_lm(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = 512, n_positions: int = 256,
              attn_implementation: str = "eager"):
    """A GPT2LMHeadModel from a GPT2Config, randomly initialised (seeded by the run's seed), no dropout.

    Eager attention makes each block's attention module return its pattern [batch, heads, q, k] as
    role output.1 (SDPA returns none)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                        n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=1, eos_token_id=1, use_cache=False, attn_implementation=attn_implementation)
    return GPT2LMHeadModel(config)
