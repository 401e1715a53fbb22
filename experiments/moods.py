"""The synthetic mood language of the steer experiment, its data files and a model trained on it.

Every sentence has one mood, happy or sad, that picks all three of its mood words:

    "The party was great . we laughed . it felt nice ."      "The exam was grim . we cried . it felt bad ."

The subject leans one way (a party is happy LEAN of the time, an exam sad), so a prompt "The party" continues
happily under greedy decoding and "The exam" sadly; the mood words come from disjoint sets (HAPPY, SAD). With
its own tokenizer (hookrun.experiments.lm.tokenizer trained on CORPUS) every word is one token. `trained_lm`
trains the bundled GPT-2 on fresh sentences for a few seconds on CPU, deterministically: a model whose residual
stream carries the mood, for steering to move.

    python -m hookrun.experiments.moods     # (re)writes data/moods.txt, happy.txt, sad.txt, mood_pairs.jsonl
"""
from __future__ import annotations

import functools
import random
import re
from pathlib import Path

from hookrun.experiments import lm, weights

LEANS = {"party": "happy", "holiday": "happy", "song": "happy", "trip": "happy",
         "exam": "sad", "storm": "sad", "news": "sad", "funeral": "sad"}   # subject -> the mood it leans to
LEAN = 0.75   # how often a subject's sentence has the mood it leans to
ADJECTIVES = {"happy": ["bright", "fun", "good", "great", "nice", "lovely"],
              "sad": ["dark", "dull", "bad", "awful", "sad", "grim"]}
VERBS = {"happy": ["smiled", "laughed", "sang", "cheered"], "sad": ["cried", "sighed", "wept", "frowned"]}
HAPPY = frozenset(ADJECTIVES["happy"] + VERBS["happy"])   # the words only happy sentences use
SAD = frozenset(ADJECTIVES["sad"] + VERBS["sad"])
DATA = Path(__file__).parent / "data"
CORPUS = "pkg://hookrun.experiments/data/moods.txt"   # the tokenizer's corpus (python -m hookrun.experiments.moods)


def sentence(subject: str, mood: str, rng: random.Random) -> str:
    """One sentence: the subject, then an adjective, a verb and an adjective of `mood` drawn from rng."""
    adj, verbs = ADJECTIVES[mood], VERBS[mood]
    return f"The {subject} was {rng.choice(adj)} . we {rng.choice(verbs)} . it felt {rng.choice(adj)} ."


def draw(rng: random.Random) -> str:
    """A sentence of the training text: a random subject, its leaning mood LEAN of the time."""
    subject = rng.choice(sorted(LEANS))
    other = "sad" if LEANS[subject] == "happy" else "happy"
    return sentence(subject, LEANS[subject] if rng.random() < LEAN else other, rng)


def words(text: str) -> list:
    """The words of a text (its punctuation left out)."""
    return re.findall(r"[a-z]+", text.lower())


def grammatical(completion: str) -> bool:
    """Whether a completion of a prompt "The <subject>" finishes a sentence of the language (either mood's words
    in the right places, mixed or not)."""
    adj, verb = (f"({'|'.join(sorted(ws['happy'] + ws['sad']))})" for ws in (ADJECTIVES, VERBS))
    return re.fullmatch(rf"\s*was {adj} \. we {verb} \. it felt {adj} \.\s*", completion) is not None


def tokenizer():
    """The mood language's tokenizer: the bundled byte-level BPE trained on CORPUS (one token a word)."""
    return lm.tokenizer(CORPUS)


def _name(n_layer: int, n_embd: int, n_head: int, steps: int, batch: int, lr: float, seed: int) -> str:
    return f"moods-{n_layer}x{n_embd}x{n_head}-steps{steps}-batch{batch}-lr{lr:g}-seed{seed}"


@functools.lru_cache(maxsize=4)
def _trained_state(*settings):
    """The shipped weights of these settings (weights.shipped), else _train's."""
    return weights.shipped(_name(*settings), lambda: _train(*settings), weights.vocab_digest(tokenizer()))


def _train(n_layer: int, n_embd: int, n_head: int, steps: int, batch: int, lr: float, seed: int):
    """The weights after `steps` Adam steps on batches of fresh sentences (loss: every next token)."""
    import torch

    tok = tokenizer()

    def loss(model, rng):
        ids = torch.tensor([[tok.bos_token_id, *tok(draw(rng))["input_ids"], tok.eos_token_id] for _ in range(batch)])
        logits = model(input_ids=ids[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    return lm.trained_weights(loss, n_layer, n_embd, n_head, steps, lr, seed)


def trained_lm(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, steps: int = 400, batch: int = 32,
               lr: float = 3e-3, seed: int = 0):
    """The bundled GPT-2 (hookrun.experiments.lm.causal_lm) trained on the mood language: `steps` Adam steps of
    `batch` fresh sentences; the same weights every call (the shipped file at the defaults, else trained under its
    own seed; cached in the process), eval mode."""
    return lm.with_weights(_trained_state(n_layer, n_embd, n_head, steps, batch, lr, seed), n_layer, n_embd, n_head)


def write_weights():
    """Train at trained_lm's defaults and write the shipped file (python -m hookrun.experiments.weights)."""
    settings = weights.defaults(trained_lm)
    return weights.save(_name(*settings), _train(*settings), weights.vocab_digest(tokenizer()))


def pairs(per_subject: int = 4, seed: int = 0) -> list:
    """Clean / corrupt prompt pairs for the feature circuit (mood_pairs.jsonl): a happy sentence and the sad one of
    the same subject and word draws, each cut before its last adjective ("... it felt"), `per_subject` a subject."""
    out = []
    for subject in LEANS:
        for k in range(per_subject):
            happy, sad = (sentence(subject, mood, random.Random(f"{seed}{subject}{k}")) for mood in ("happy", "sad"))
            out.append({"clean": happy.rsplit(" ", 2)[0], "corrupt": sad.rsplit(" ", 2)[0], "subject": subject})
    return out


def write_pairs(per_subject: int = 4, seed: int = 0) -> Path:
    """Write pairs() to experiments/data/mood_pairs.jsonl."""
    import json

    path = DATA / "mood_pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs(per_subject, seed)), encoding="utf-8")
    return path


def main(lines: int = 256, seed: int = 0):
    """Write the tokenizer's corpus (`lines` sentences drawn with `seed`) and the two contrastive sets: one
    sentence a subject in each mood, word for word the same draws (happy.txt, sad.txt)."""
    rng = random.Random(seed)
    (DATA / "moods.txt").write_text("".join(draw(rng) + "\n" for _ in range(lines)), encoding="utf-8")
    for mood in ("happy", "sad"):
        text = "".join(sentence(s, mood, random.Random(f"{seed}{s}")) + "\n" for s in LEANS)
        (DATA / f"{mood}.txt").write_text(text, encoding="utf-8")
    write_pairs(seed=seed)
    print(f"{lines} sentences -> {DATA / 'moods.txt'}; {len(LEANS)} a mood -> happy.txt, sad.txt; "
          f"{4 * len(LEANS)} pairs -> mood_pairs.jsonl")


if __name__ == "__main__":
    main()
