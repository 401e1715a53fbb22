"""Circuits beside their peers: hookrun's EAP against TransformerLens 4.x's edge attribution and auto-circuit's, on
the same GPT-2 (random weights, seeded, saved to a temporary dir and loaded by each), the same clean/corrupt token
pairs and the same metric (logit difference of two tokens at the last position): scores compared edge by edge,
times side by side.

Each peer runs in its own venv (their pins clash with each other and with hookrun's: auto-circuit needs a
TransformerLens with HookedTransformer, < 4), as a subprocess (benchmarks/_circuits_peer.py) that loads the model
once and then runs one EAP pass a time when told: hookrun's pass (in this process) and the peer's alternate,
--rounds times (min and median, torch on --threads threads each). A peer's python: --tl-python / --ac-python, else
$HOOKRUN_TL_PYTHON / $HOOKRUN_AC_PYTHON, else .venv-bench / .venv-autocircuit (benchmarks/venvs.sh makes them);
a peer without one is skipped with a line saying so.

    python benchmarks/circuits_peers.py                       # ~1 minute on a shared 2-core machine
    python benchmarks/circuits_peers.py --tl-python VENV/bin/python --ac-python VENV2/bin/python --layers 6

The conventions, and how the scores are matched:
    TransformerLens   gradient on the corrupt run, (a_clean - a_corrupt) . grad, mean over pairs, as hookrun's
                      (source clean, target corrupt); its edges are per position: summed over positions here. Its
                      `embed` writer is the token embedding alone (hookrun's `input` adds the position embedding;
                      equal deltas, as clean and corrupt share positions). q/k/v separate receivers, as hookrun's.
    auto-circuit      gradient on the clean run of -(mean logit difference) with respect to each edge's mask (0:
                      clean, 1: corrupt): that is -1 x hookrun's score with source and target swapped (source
                      corrupt, target clean), which hookrun computes here for the comparison. `Resid Start` is the
                      token + position embedding, `Resid End` the logits.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf

from hookrun.experiments.lm import tokenizer
from hookrun.methods.circuits.scores import edge_scores
from hookrun.methods.circuits.graph import circuit_graph

sys.path.insert(0, str(Path(__file__).parent))
from _args import parse  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEERS = {"tl": ("TransformerLens", "HOOKRUN_TL_PYTHON", ".venv-bench", 1.0, False),  # name, env, venv, sign, swapped
         "ac": ("auto-circuit", "HOOKRUN_AC_PYTHON", ".venv-autocircuit", -1.0, True)}
A, B = 5, 7  # the logit difference's two tokens


def metric(logits, rows):
    return logits[:, -1, A] - logits[:, -1, B]


def build(layers: int, d: int, heads: int, where: Path):
    """The seeded GPT-2 (vocab 512, hookrun's bundled tokenizer's), saved with that tokenizer to `where`."""
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=512, n_layer=layers, n_embd=d, n_head=heads, n_positions=64,
                           attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=1, eos_token_id=1)
    model = tf.GPT2LMHeadModel(config).eval()
    model.save_pretrained(where)
    tokenizer().save_pretrained(where)
    return model


def token_pairs(n: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, 512, (n, t), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2:4] = torch.randint(1, 512, (n, 2), generator=g)
    return clean, corrupt


class Peer:
    """A peer's subprocess: started, loaded (and warmed up) once; run() -> seconds of one pass; scores()."""

    def __init__(self, python: str, tool: str, job: Path):
        self.proc = subprocess.Popen([python, str(Path(__file__).parent / "_circuits_peer.py"), tool, str(job)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": ""})
        self.version = self._ask(None)["ready"]

    def _ask(self, what):
        if what is not None:
            self.proc.stdin.write(what + "\n")
            self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the peer stopped: {self.proc.stderr.read()[-3000:]}")
            if line.startswith("{"):
                return json.loads(line)

    def run(self) -> float:
        return self._ask("run")["seconds"]

    def scores(self) -> dict:
        return self._ask("scores")["scores"]

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def compare(name, ours: dict, theirs: dict, sign: float) -> None:
    """Print the edges matched by name and the largest difference of their scores."""
    matched = [e for e in ours if e in theirs]
    only_ours, only_theirs = set(ours) - set(theirs), set(theirs) - set(ours)
    a = np.array([ours[e] for e in matched])
    b = sign * np.array([theirs[e] for e in matched])
    diff = np.abs(a - b)
    worst = matched[int(diff.argmax())] if len(matched) else "-"
    print(f"  edges: hookrun {len(ours)}, {name} {len(theirs)}, matched by name {len(matched)}"
          + (f"; only hookrun's: {sorted(only_ours)[:4]}" if only_ours else "")
          + (f"; only {name}'s: {sorted(only_theirs)[:4]}" if only_theirs else ""))
    if len(matched):
        print(f"  scores: largest |hookrun - {name}| {diff.max():.2e} (at {worst}), largest |score| "
              f"{np.abs(a).max():.2e}, relative {diff.max() / np.abs(a).max():.1e}; Pearson r "
              f"{np.corrcoef(a, b)[0, 1]:.6f}; top-20 by |score| shared: "
              f"{len(set(np.argsort(-np.abs(a))[:20]) & set(np.argsort(-np.abs(b))[:20]))} of 20")


def main(argv=None):
    args = parse(__doc__, argv, layers=4, d=128, heads=4, pairs=8, tokens=16, rounds=5, tl_python="", ac_python="")
    with tempfile.TemporaryDirectory() as tmp:
        model = build(args.layers, args.d, args.heads, Path(tmp) / "model")
        graph = circuit_graph(model)
        clean, corrupt = token_pairs(args.pairs, args.tokens)
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"model": str(Path(tmp) / "model"), "clean": clean.tolist(),
                                   "corrupt": corrupt.tolist(), "a": A, "b": B, "threads": args.threads}))
        print(f"GPT-2 {args.layers} blocks, d {args.d}, {args.heads} heads, random weights (seed 0); {len(graph)} "
              f"edges; {args.pairs} pairs x {args.tokens} tokens (the corrupt one differs at positions 2-3); metric "
              f"logit[{A}] - logit[{B}] at the last position; {args.rounds} alternating rounds")
        for tool, (name, env, venv, sign, swapped) in PEERS.items():
            python = getattr(args, f"{tool}_python") or os.environ.get(env) or str(ROOT / venv / "bin" / "python")
            if not Path(python).exists():
                print(f"{name}: skipped: no venv ({python} is absent; give --{tool}-python PATH or {env}, or run "
                      "benchmarks/venvs.sh)")
                continue
            src, tgt = ({"input_ids": corrupt}, {"input_ids": clean}) if swapped else \
                ({"input_ids": clean}, {"input_ids": corrupt})
            ours_pass = lambda: edge_scores(model, graph, src, tgt, metric).scores  # noqa: E731
            scores = ours_pass()  # warm-up, as the peer's
            try:
                peer = Peer(python, tool, job)
            except RuntimeError as err:
                print(f"{name}: failed to start: {err}")
                continue
            ours, theirs = [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                scores = ours_pass()
                ours.append(time.perf_counter() - t0)
                theirs.append(peer.run())
            their_scores = peer.scores()
            peer.close()
            print(f"{name} ({peer.version})" + (": hookrun with source corrupt, target clean; theirs x -1"
                                                if swapped else ""))
            for who, ts in (("hookrun", ours), (name, theirs)):
                print(f"  {who:16s} min {min(ts):.3f} s  median {statistics.median(ts):.3f} s")
            print(f"  ratio {name} / hookrun: min {min(theirs) / min(ours):.1f}x  median "
                  f"{statistics.median(theirs) / statistics.median(ours):.1f}x")
            mean = scores.double().mean(0).tolist()
            compare(name, dict(zip(graph.names, mean)), their_scores, sign)


if __name__ == "__main__":
    main()
