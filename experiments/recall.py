"""The synthetic task of the patching_grid and ablate_heads experiments, its pairs and a model trained on it.

A prompt names one key among KEYS in a fixed template; the answer (the next token) is the key's value:

    "A hook with each row into its"  ->  " output"        (KEYS[i] -> VALUES[i]; fillers drawn at random)

Every word is one token of the bundled tokenizer, so every prompt is BOS + 7 tokens, the key at position 2.
A pair's corrupt prompt is its clean prompt with another key: `answer` is the clean key's value, `wrong` the
corrupt key's. `trained_lm` trains the bundled GPT-2 (hookrun.experiments.lm) on fresh prompts of the task
for a few seconds on CPU, so the grid has structure to show: the key's position in the early blocks, the last
position in the late ones. Its default weights ship as a file (hookrun.experiments.weights): the same on every CPU.

    python -m hookrun.experiments.recall      # (re)writes experiments/data/pairs.jsonl (64 pairs, seed 0)
"""
from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from hookrun.experiments import weights
from hookrun.experiments.lm import tokenizer, trained_weights, with_weights

KEYS = ["hook", "cap", "run", "store", "batch", "token", "model", "layer"]
VALUES = ["output", "tensor", "index", "config", "array", "loss", "torch", "forward"]
FILLERS = ["with", "per", "one", "every", "over", "each", "that", "back", "real"]
KEY_POSITION = 2  # BOS, "A", key, ...
PAIRS = Path(__file__).parent / "data" / "pairs.jsonl"


def prompt(key: str, rng: random.Random) -> str:
    """One prompt of the task: the key, three fillers, then the question "into its" (all one-token words)."""
    return f"A {key} {' '.join(rng.choice(FILLERS) for _ in range(3))} into its"


def pairs(n: int = 64, seed: int = 0) -> list:
    """n clean/corrupt pairs differing in the key only, with the answer fields (a leading space: one token)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(range(len(KEYS)), 2)
        clean = prompt(KEYS[a], rng)
        out.append({"clean": clean, "corrupt": clean.replace(f" {KEYS[a]} ", f" {KEYS[b]} ", 1),
                    "answer": f" {VALUES[a]}", "wrong": f" {VALUES[b]}", "key": KEYS[a], "pair": i})
    return out


def _name(n_layer: int, n_embd: int, n_head: int, steps: int, batch: int, lr: float, seed: int) -> str:
    return f"recall-{n_layer}x{n_embd}x{n_head}-steps{steps}-batch{batch}-lr{lr:g}-seed{seed}"


@functools.lru_cache(maxsize=4)
def _trained_state(*settings):
    """The shipped weights of these settings (weights.shipped), else _train's."""
    return weights.shipped(_name(*settings), lambda: _train(*settings), weights.vocab_digest(tokenizer()))


def _train(n_layer: int, n_embd: int, n_head: int, steps: int, batch: int, lr: float, seed: int):
    """The weights after `steps` Adam steps on batches of fresh prompts (loss: the answer at the last token)."""
    import torch

    tok = tokenizer()
    values = torch.tensor([tok.convert_tokens_to_ids(f"\u0120{v}") for v in VALUES])

    def loss(model, rng):
        keys = torch.tensor([rng.randrange(len(KEYS)) for _ in range(batch)])
        ids = torch.tensor([[tok.bos_token_id] + tok(prompt(KEYS[k], rng))["input_ids"] for k in keys])
        hidden = model.transformer(input_ids=ids).last_hidden_state[:, -1]
        return torch.nn.functional.cross_entropy(model.lm_head(hidden), values[keys])

    return trained_weights(loss, n_layer, n_embd, n_head, steps, lr, seed)


def trained_lm(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, steps: int = 80, batch: int = 32,
               lr: float = 1e-2, seed: int = 0):
    """The bundled GPT-2 (hookrun.experiments.lm.causal_lm) trained on the task: `steps` Adam steps of `batch`
    fresh prompts; the same weights every call (the shipped file at the defaults, else trained under its own seed;
    cached in the process), eval mode. steps=0: the random init."""
    return with_weights(_trained_state(n_layer, n_embd, n_head, steps, batch, lr, seed), n_layer, n_embd, n_head)


def write_weights():
    """Train at trained_lm's defaults and write the shipped file (python -m hookrun.experiments.weights)."""
    settings = weights.defaults(trained_lm)
    return weights.save(_name(*settings), _train(*settings), weights.vocab_digest(tokenizer()))


def main(n: int = 64, seed: int = 0):
    """Write the bundled pairs file."""
    PAIRS.write_text("".join(json.dumps(p) + "\n" for p in pairs(n, seed)), encoding="utf-8")
    print(f"{n} pairs -> {PAIRS}")


if __name__ == "__main__":
    main()
