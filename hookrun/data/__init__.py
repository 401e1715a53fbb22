"""The model's inputs: tensors, datasets, text corpora (tokenized, batched), per-sample records.

    from hookrun.data.text import make_inputs
"""
