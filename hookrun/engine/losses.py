"""Backward objectives: the scalar whose backward pass the gradient hooks observe.

    loss: {name: sum}                              # sum of the model output
    loss: {name: mse, target: y}                   # against the data field y
    loss: {name: cross_entropy, target: label}
    loss: {name: index, index: 3}                  # logit 3, summed over the batch (saliency)
    loss: {name: index, index: [0, 1]}             # one element of the output
    loss: {_target_: mypkg.losses.fn}              # fn(output, batch) -> scalar
    loss: {name: mean, output: logits}             # pick one part of a tuple/dict output first
"""
from __future__ import annotations

from typing import Callable, List

import torch
import torch.nn.functional as F

from hookrun.config.checks import ConfigError, check_choice, check_target, target_of, unknown_keys

NAMES = ("sum", "mean", "mse", "cross_entropy", "index")
KEYS = {"name", "output", "target", "index", "reduction", "_target_"}


def check_spec(loss, data=None) -> List[str]:
    """Problems with the `loss` entry (and its target field in `data`, if given)."""
    spec = loss
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict):
        return [f"loss: {spec!r} is not a loss; write {{name: sum}} or pick one with loss=sum"]
    problems = unknown_keys("loss", spec, sorted(KEYS), "loss takes")
    if "_target_" in spec:
        return problems + check_target("loss", spec, "give fn(output, batch)", {"output": None, "batch": None}, KEYS)
    name = spec.get("name")
    problems += check_choice("loss.name", name, NAMES, f"one of {', '.join(NAMES)} or _target_")
    if name in ("mse", "cross_entropy") and not spec.get("target"):
        problems.append(f"loss.target: {name} needs the data field that holds targets, e.g. loss.target=y")
    elif name in ("mse", "cross_entropy") and data is not None and spec["target"] not in data.targets:
        problems.append(f"loss.target: {spec['target']!r} is not listed in data.targets ({list(data.targets)}); "
                        f"add it there (data.targets=[{spec['target']}]) so it goes to the loss, not the model")
    if name == "index" and spec.get("index") is None:
        problems.append("loss.index: name index needs index: <logit> or [i, j, ...]")
    return problems


def pick_output(output, key):
    """The part of a model output a loss is computed on."""
    if key is None:
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, (tuple, list)):
            return output[0]
        if hasattr(output, "keys"):
            return output[next(iter(output.keys()))]
        raise TypeError(f"model returned {type(output).__name__}; set loss.output to pick a tensor")
    if isinstance(output, (tuple, list)):
        return output[int(key)]
    return output[key] if hasattr(output, "keys") else getattr(output, key)


def build(loss) -> Callable:
    """`fn(output, batch) -> scalar tensor` for the `loss` entry (not null)."""
    spec = loss
    if isinstance(spec, str):
        spec = {"name": spec}
    if "_target_" in spec:
        fn = target_of(spec["_target_"])
        return _scalar(lambda out, batch: fn(out, batch), spec["_target_"])
    name, key = spec["name"], spec.get("output")
    reduction = spec.get("reduction", "mean")

    def target(batch):
        return batch.targets[spec["target"]]

    def compute(output, batch):
        out = pick_output(output, key)
        if name == "sum":
            return out.sum()
        if name == "mean":
            return out.mean()
        if name == "mse":
            y = target(batch)
            if y.shape != out.shape:  # mse_loss would broadcast them into a wrong loss (with a warning)
                raise ConfigError([f"loss.target: {spec['target']!r} has shape {list(y.shape)} but the output "
                                   f"{list(out.shape)}; mse compares them element by element: give targets of the "
                                   "output's shape (or pick the output with loss.output)"])
            return F.mse_loss(out, y.to(out.dtype), reduction=reduction)
        if name == "cross_entropy":
            return F.cross_entropy(out, target(batch).long(), reduction=reduction)
        index = spec["index"]
        if isinstance(index, list):
            return out[tuple(index)]
        return out[..., index].sum()

    return _scalar(compute, name)


def _scalar(fn, name):
    def checked(output, batch):
        value = fn(output, batch)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError([f"loss: {name} returned {shape}, not a scalar; reduce it "
                               "(loss.reduction=mean|sum, or name: sum / mean)"])
        return value.reshape(())
    return checked
