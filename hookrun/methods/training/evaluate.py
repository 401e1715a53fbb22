"""The dictionaries evaluated on held-out batches: SAELens's numbers (hookrun.methods.saes.Evaluation) and
CE loss recovered (its ce_loss_recovered) with each dictionary spliced into the model, against zero ablation.

    held = HeldOut(job, spec, targets, n_batches)     # the first n data batches, never trained on
    held.evaluate(job, trainers)   # per site: l0, mse, explained_variance, fvu, dead/dense features, ce_*

Per held-out batch: one clean forward records every site's value (and gives the clean loss), then per site one
forward with its value replaced by the reconstruction and one with it zeroed (text batches with input_ids and
logits; other models get the reconstruction numbers only).
"""
from __future__ import annotations

import itertools
import math
from typing import Dict, List, Optional

import torch

from hookrun.capture.scope import HookScope
from hookrun.capture.targets import attach
from hookrun.methods.saes import Evaluation
from hookrun.read.results.dictionaries import ce_loss_recovered
from hookrun.methods.metrics import logits_of


def rows_of(value: torch.Tensor, tokens) -> torch.Tensor:
    """A site's value as rows [n, d]: a text batch's real tokens (tokens.mask), else every leading position."""
    mask = getattr(tokens, "mask", None)
    if mask is not None and value.dim() >= 3 and tuple(value.shape[:2]) == tuple(mask.shape):
        return value[mask.to(value.device)].reshape(int(mask.sum()), -1)
    return value.reshape(-1, value.shape[-1]) if value.dim() > 1 else value.reshape(1, -1)


def _put(value: torch.Tensor, tokens, rows: torch.Tensor) -> torch.Tensor:
    """`value` with its rows (as rows_of takes them) replaced by `rows`."""
    mask = getattr(tokens, "mask", None)
    new = value.clone()
    if mask is not None and value.dim() >= 3 and tuple(value.shape[:2]) == tuple(mask.shape):
        new[mask.to(value.device)] = rows.to(value.dtype).reshape(new[mask.to(value.device)].shape)
        return new
    return rows.to(value.dtype).reshape(value.shape)


def _nll(output, batch) -> Optional[tuple]:
    """(pairs, summed next-token loss) of a text batch, None where there is no next-token loss to take."""
    ids = batch.kwargs.get("input_ids") if isinstance(batch.kwargs, dict) else None
    tokens = batch.tokens
    if ids is None or tokens is None:
        return None
    try:
        logits = logits_of(output)
    except Exception:  # noqa: BLE001
        return None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != ids.shape:
        return None
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None].to(logits.device)).squeeze(-1)
    mask = tokens.mask.to(logits.device)
    pairs = mask[:, :-1] & mask[:, 1:]
    return int(pairs.sum()), float(torch.where(pairs, nll, torch.zeros_like(nll)).double().sum())


class HeldOut:
    """The held-out batches and the forwards that evaluate the dictionaries on them."""

    def __init__(self, job, spec, targets, n: int):
        self.spec, self.targets = spec, targets
        self.batches = list(itertools.islice(job.inputs.batches(0), n)) if n else []

    def _forward(self, job, batch, fns: Dict[int, object]):
        """The model on `batch` with fns[slot] on the sites (slot 2s: site s's input, 2s + 1: its output)."""
        targets, chosen = [], []
        for s, (a, b) in enumerate(self.targets):
            for slot, target in ((2 * s, a), (2 * s + 1, b)):
                if target is not None and slot in fns:
                    targets.append(target)
                    chosen.append(fns[slot])
        with HookScope() as scope, torch.no_grad():
            attach(scope, job.model, targets, chosen)
            return job.model(*batch.args, **batch.kwargs)

    def site_values(self, job, batch) -> List[tuple]:
        """Each site's (x rows, y rows or None) on one batch."""
        batch = batch.to(job.device)
        seen: Dict[int, torch.Tensor] = {}

        keep = _keeper(seen)
        self._forward(job, batch, {slot: keep(slot) for s in range(len(self.targets)) for slot in (2 * s, 2 * s + 1)})
        return [(rows_of(seen[2 * s], batch.tokens), rows_of(seen[2 * s + 1], batch.tokens) if b is not None else None)
                for s, (a, b) in enumerate(self.targets)]

    def evaluate(self, job, trainers) -> List[dict]:
        """Per site the evaluation's numbers over every held-out batch."""
        evals = [Evaluation(t.d.d_sae) for t in trainers]
        ce = [[0, 0.0, 0.0, 0.0] for _ in trainers]  # pairs, clean, spliced, zero
        has_ce = True
        for t in trainers:
            t.d.eval()
        for batch in self.batches:
            batch = batch.to(job.device)
            seen: Dict[int, torch.Tensor] = {}

            keep = _keeper(seen)
            clean = _nll(self._forward(job, batch, {slot: keep(slot) for s in range(len(self.targets))
                                                    for slot in (2 * s, 2 * s + 1)}), batch)
            has_ce = has_ce and clean is not None
            for s, (trainer, (a, b)) in enumerate(zip(trainers, self.targets)):
                x = rows_of(seen[2 * s], batch.tokens)
                y = rows_of(seen[2 * s + 1], batch.tokens) if b is not None else x
                d = trainer.d
                with torch.no_grad():
                    xs = x.to(d.W_dec.dtype) * trainer.scale_in
                    f, _ = d.encode_with_hidden_pre(xs, training=False)
                    recon = d.decode(f, xs) / trainer.scale_out
                evals[s].add(y, recon, f)
                if clean is None:
                    continue
                out_slot = 2 * s + (1 if b is not None else 0)

                def splice(value, recon=recon):
                    return _put(value, batch.tokens, recon)
                spliced = _nll(self._forward(job, batch, {out_slot: splice}), batch)
                zero = _nll(self._forward(job, batch, {out_slot: torch.zeros_like}), batch)
                ce[s][0] += clean[0]
                ce[s][1] += clean[1]
                ce[s][2] += spliced[1]
                ce[s][3] += zero[1]
        results = []
        for s, ev in enumerate(evals):
            r = ev.result()
            density = r.pop("feature_density")
            row = {k: r[k] for k in ("tokens", "l0", "l1", "mse", "explained_variance", "cossim", "dead_features")}
            row["fvu"] = 1.0 - r["explained_variance"] if not math.isnan(r["explained_variance"]) else math.nan
            row["dense_features"] = int((density > self.spec.dense_density).sum())
            pairs, clean, spliced, zero = ce[s]
            if has_ce and pairs:
                row.update(ce_clean=clean / pairs, ce_spliced=spliced / pairs, ce_zero=zero / pairs,
                           ce_loss_recovered=ce_loss_recovered(clean / pairs, spliced / pairs, zero / pairs))
            else:
                row.update(ce_clean=math.nan, ce_spliced=math.nan, ce_zero=math.nan, ce_loss_recovered=math.nan)
            results.append(row)
        for t in trainers:
            t.d.train()
        return results


def _keeper(seen: Dict[int, torch.Tensor]):
    """keep(slot): a site function that puts the value it sees (detached) in seen[slot] and leaves it as it is."""
    def keep(slot):
        def fn(value):
            seen[slot] = value.detach()
            return value
        return fn
    return keep
