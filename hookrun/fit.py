"""Does the data fit the model? The first batch, checked before any store is created.

    problems = first_batch_problems(model, inputs, device)   # inputs: data.Inputs or text.TextInputs

Three steps, each a clear message instead of a traceback from deep inside a run: the first batch must
load (collate), bind to `forward`'s signature, and go through one forward pass without hooks (eval
mode, no autograd, so nothing in the model changes) of its first sample, or of the whole batch if
that fails (a model that needs more than one sample). A failure there that is about the inputs (their
number, dtype or shape) is a config problem; any other error is the model's own and is raised as is.
"""
from __future__ import annotations

import inspect
from typing import List

import torch


FIX = ("set data.targets=[...] for fields that go to the loss, not the model; data.fields=[...] to name a "
       "dataset's tuple items; data.keyword=true to pass inputs by name")
INPUT_ERRORS = ("dtype", "scalar type", "type (", "shapes cannot be multiplied", "size mismatch", "must match the size",
                "Expected", "expected input", "positional argument", "unexpected keyword")


def _describe(batch) -> str:
    def one(v):
        return f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else type(v).__name__
    parts = [f"input.{i} {one(a)}" for i, a in enumerate(batch.args)]
    parts += [f"{k} {one(v)}" for k, v in batch.kwargs.items()]
    return ", ".join(parts) or "no inputs"


def first_batch_problems(model: torch.nn.Module, inputs, device: torch.device) -> List[str]:
    """Problems with feeding the run's first batch to the model, found before anything is written."""
    try:
        batch = next(iter(inputs.batches()))
    except StopIteration:
        return ["data: the run has no batches (no samples after max_samples and stride); give data that holds samples"]
    except Exception as err:  # noqa: BLE001 - a dataset that cannot be batched is the config's problem
        if hasattr(err, "problems"):
            return list(err.problems)
        return [f"data: the first batch does not load ({type(err).__name__}: {str(err).strip().splitlines()[0]}); "
                "every item must be a tensor, a tuple or a dict of tensors of one shape (no None, no ragged "
                "lengths: pad or crop them in the dataset)"]
    try:
        inspect.signature(model.forward).bind(*batch.args, **batch.kwargs)
    except TypeError as err:
        params = ", ".join(inspect.signature(model.forward).parameters)
        return [f"data: {type(model).__name__}.forward({params}) cannot take the first batch ({_describe(batch)}): "
                f"{err}; {FIX}"]
    except ValueError:
        pass  # no signature to check
    batch = batch.to(device)
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            try:  # the first sample alone is a fraction of the cost; the whole batch only if that fails
                one = batch.head(1)
                model(*one.args, **one.kwargs)
            except Exception:  # noqa: BLE001 - the whole batch says what is wrong (or that nothing is)
                model(*batch.args, **batch.kwargs)
    except (TypeError, ValueError, RuntimeError, IndexError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not any(hint in message for hint in INPUT_ERRORS):
            raise
        return [f"data: the first batch ({_describe(batch)}) does not fit {type(model).__name__}: "
                f"{type(err).__name__}: {message}; check the inputs' dtype and shape (data.inputs.<x>.dtype, the "
                f"dataset's transform) or {FIX}"]
    finally:
        model.train(was_training)
    return []
