"""The model's inputs: tensors, datasets, text corpora (tokenized, batched), per-sample records.

    from hookrun.data import make_inputs
    inputs = make_inputs(cfg.data, cfg.seed)     # Inputs or TextInputs: ranges(), batches(first), check(model)

    inputs.py    literals, constants, random tensors, files, any torch Dataset; seeded batches
    text.py      text corpora: read, tokenize, pad or pack; the per-batch token table
    batching.py  the batching rule (batch_size, stride, max_samples), shared by both
    samples.py   data.record -> per-sample rows
"""
import dataclasses

from hookrun.config.schema import TextConfig
from hookrun.data.inputs import Inputs, token_sequences
from hookrun.data.text import TextInputs


def make_inputs(data_cfg, seed: int, tokenizer=None):
    """The batches of a run: a tokenized text corpus (data.text, or a dataset of 1-D token tensors), else Inputs.
    `tokenizer`: one already loaded, used where data.text.tokenizer is not given."""
    if data_cfg.text:
        return TextInputs(data_cfg, seed, tokenizer=tokenizer)
    inputs = Inputs(data_cfg, seed)
    tokens = token_sequences(inputs.dataset)
    if tokens is None:
        return inputs
    cfg = dataclasses.replace(data_cfg, text=TextConfig(max_length=max(map(len, tokens), default=2),
                                                       padding_side="right"))
    return TextInputs(cfg, seed, docs=tokens)
