"""Circuit metrics that read the other run's output: functions for the metrics block (`_target_`) whose inputs carry
the source run's logits as `inputs.reference` in a circuit's run (circuit.eval_metrics), as the EAP-IG code's
metrics read `clean_logits`.

    metrics:
      kl:  {metric: kl}                                                     # KL(clean || circuit run), last token
      acc: {_target_: hookrun.methods.circuits.compare.clean_top1}         # 1 where the top token is the clean run's
      ref: {_target_: hookrun.methods.circuits.compare.eap_ig_signature, fn: pkg.metric, label: [answer, wrong]}
    circuit: {..., metric: ld, eval_metrics: [kl, acc]}
"""
from __future__ import annotations

from typing import Sequence

import torch

from hookrun.config.checks import target_of


def _last(logits: torch.Tensor, info) -> torch.Tensor:
    """[B, V] the logits at each sequence's last real token."""
    cols = (info.first + info.lengths - 1).to(logits.device)
    return logits[torch.arange(len(cols), device=logits.device), cols]


def clean_top1(logits: torch.Tensor, inputs) -> torch.Tensor:
    """[B] 1.0 where this run's most likely next token at the last real token is the reference (clean) run's."""
    ref_info = inputs.reference_info or inputs.info
    return (_last(logits, inputs.info).argmax(-1) == _last(inputs.reference, ref_info).argmax(-1)).float()


def eap_ig_signature(logits: torch.Tensor, inputs, fn: str, label: Sequence[str] = ()) -> torch.Tensor:
    """The EAP-IG code's metric signature, fn(logits, clean_logits, input_lengths, label) -> [B] (its metrics with
    mean=False), on right-padded batches: `label` the fields holding each sample's token ids, stacked [B, len]."""
    if inputs.info is not None and bool((inputs.info.first != 0).any()):
        raise ValueError("eap_ig_signature reads input_lengths as the EAP-IG code does: give right-padded batches")
    ids = torch.tensor([[int(inputs.fields[f][i]) for f in label] for i in range(len(logits))],
                       device=logits.device) if label else None
    lengths = inputs.info.lengths if inputs.info is not None else torch.full((len(logits),), logits.shape[1])
    return target_of(fn)(logits, inputs.reference, lengths.to(logits.device), ids)
