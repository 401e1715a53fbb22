"""The bundled steer experiment (conf/experiment/steer*.yaml, experiments/steer.py) against the model's own generate():
coef 0 is plain greedy generation, a nonzero coef is generate() with a plain hook adding coef * (mean(A) - mean(B))."""
import numpy as np
import torch

import hookrun
from hookrun.experiments import steer
from hookrun.experiments.lm import causal_lm, tokenizer
from hookrun.data.text import resolve_file
from tests.helpers import run_here

DATA = "pkg://hookrun.experiments/data/"
NEW = 12


def completions(hook=None):
    """generate() of each bundled prompt alone, greedy, without hookrun; `hook(model)` registers a plain hook."""
    torch.manual_seed(0)  # the runner seeds torch with cfg.seed before building the model
    model = causal_lm(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256).eval()
    handle = hook(model) if hook else None
    tok, out = tokenizer(), []
    for text in resolve_file(DATA + "steer_prompts.txt").read_text().splitlines():
        ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            new = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                 use_cache=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out.append(new[0, len(ids):].tolist())
    if handle:
        handle.remove()
    return out


def adding(vector):
    """A plain forward hook on block 0 adding `vector` at the decoding steps (one token a pass), not the prompt."""
    def hook(model):
        def add(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output  # a tuple in older transformers
            if hidden.shape[1] > 1:
                return None
            return (hidden + vector,) + tuple(output[1:]) if isinstance(output, tuple) else hidden + vector
        return model.transformer.h[0].register_forward_hook(add)
    return hook


def test_the_steer_sweep_equals_generate_with_a_plain_hook_adding_the_direction(tmp_path):
    for run, name in steer.SETS.items():  # the source runs in process (the script skips complete ones)
        run_here(tmp_path / "runs" / run, "+experiment=steer_source", f"data.text.files=[{DATA}{name}]")
    sweep = steer.sweep(tmp_path, "0,8")  # the sweep through the CLI, from the work dir
    gens = hookrun.collect(sweep, generations=True)
    mean = {run: hookrun.open(tmp_path / "runs" / run).load(layer="transformer.h.0", role="output").mean(0)
            for run in steer.SETS}
    direction = torch.from_numpy((mean["steer_happy"] - mean["steer_sad"]).astype(np.float32))
    plain, steered = completions(), completions(adding(8.0 * direction))
    assert sorted(gens["hooks.steer.edit.0.coef"].unique()) == [0, 8] and len(gens) == 2 * len(plain)
    got = {c: gens[gens["hooks.steer.edit.0.coef"] == c].sort_values("sample")["completion_ids"].tolist()
           for c in (0, 8)}
    assert got[0] == plain
    assert got[8] == steered
    assert steered != plain
