"""One dictionary's optimiser loop: Adam, lr warm-up and decay, sparsity warm-up, dead features, clipping.

    t = Trainer(dictionary, Schedule(steps=1000, lr=3e-4), scale_in=s)
    row = t.step(x)                 # one update on rows x [n, d_in] (target: a transcoder's output rows)
    state = t.state_dict(); t2.load_state_dict(state)   # resume: weights, Adam, counters, step

As SAELens 6.54's SAETrainer (sae_lens/training/sae_trainer.py, optim.py): the lr at step s is lr * (s + 1) / w
during the w warm-up steps, then constant (or cosine annealing to lr_end), then a linear decay from lr_end to 0 over
the last decay steps; the sparsity coefficient is coef * min(1, s / warm_up); a feature is dead after
dead_feature_window steps without firing; gradients are clipped to clip_grad (SAELens: 1.0). decoder_norm=unit
keeps decoder rows at unit norm as sparsify does (the parallel gradient removed, rows renormalised after each step).
Under torch.distributed every rank's gradients (and the firing counts) are averaged before the update.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from hookrun.methods.training.kinds import TrainingDictionary


@dataclass
class Schedule:
    """The optimiser's settings (the train block's keys of the same names)."""

    steps: int
    lr: float = 3e-4
    lr_warm_up_steps: int = 0
    lr_decay_steps: int = 0
    lr_end: Optional[float] = None   # cosine annealing's end (None: lr / 10); constant ignores it, as SAELens
    lr_scheduler: str = "constant"   # constant | cosineannealing
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    coefficient: float = 1.0         # l1_coefficient (relu) or l0_coefficient (jumprelu)
    coefficient_warm_up_steps: int = 0
    dead_feature_window: int = 1000
    clip_grad: Optional[float] = 1.0
    decoder_norm: str = "free"       # free | unit

    def end(self) -> float:
        """Where the main schedule ends and the decay starts (SAELens: lr for constant, whatever lr_end says)."""
        if self.lr_scheduler == "constant":
            return self.lr
        if self.lr_end is not None:
            return float(self.lr_end)
        return self.lr / 10 if self.lr_scheduler == "cosineannealing" else self.lr

    def lr_at(self, s: int) -> float:
        """The learning rate of step s (0-based), as SAELens's get_lr_scheduler gives it."""
        w, d, total = self.lr_warm_up_steps, self.lr_decay_steps, self.steps
        if s < w:
            return self.lr * (s + 1) / w
        if d and s >= total - d:
            return self.end() * (1 - (s - (total - d)) / d)
        if self.lr_scheduler == "cosineannealing":
            span = max(total - w - d, 1)
            j = s - w
            return self.end() + (self.lr - self.end()) * (1 + math.cos(math.pi * j / span)) / 2
        return self.lr

    def coefficient_at(self, s: int) -> float:
        """The sparsity coefficient of step s (SAELens's CoefficientScheduler)."""
        w = self.coefficient_warm_up_steps
        return self.coefficient * min(1.0, s / w) if w else self.coefficient


SMALL = 2 ** 24   # multiply-adds of a step's encoder below which more CPU threads only spin (measured: 10x slower
                  # with 2 threads than 1 for 256 x 16 x 64 on a loaded 2-core machine)


def small(trainer: "Trainer", batch_size: int) -> bool:
    """Whether a step of `trainer` on `batch_size` rows is a CPU step too small to split over torch's threads
    (with hookrun.threads.one_thread(small(...)): on one thread)."""
    d = trainer.d
    return d.W_dec.device.type == "cpu" and batch_size * d.d_in * d.d_sae < SMALL


def _world():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


class Trainer:
    """A dictionary, its optimiser and its counters (see the module docstring)."""

    def __init__(self, dictionary: TrainingDictionary, schedule: Schedule, scale_in: float = 1.0,
                 scale_out: float = 1.0):
        self.d, self.schedule = dictionary, schedule
        self.scale_in, self.scale_out = float(scale_in), float(scale_out)
        self.optimizer = torch.optim.Adam(dictionary.parameters(), lr=schedule.lr,
                                          betas=(schedule.adam_beta1, schedule.adam_beta2))
        self.n = 0  # steps done
        device = dictionary.W_dec.device
        self.since_fired = torch.zeros(dictionary.d_sae, device=device)
        self.fired = torch.zeros(dictionary.d_sae, dtype=torch.float64, device=device)  # tokens each fired on
        self.tokens = 0
        if schedule.decoder_norm == "unit":
            dictionary.unit_norm_decoder()

    def dead(self) -> torch.Tensor:
        """bool [d_sae]: features that fired on no step of the last dead_feature_window."""
        return self.since_fired > self.schedule.dead_feature_window

    def step(self, x: torch.Tensor, target: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """One update on rows x (and target); the step's numbers: loss, mse, aux, l0, dead_fraction, lr, coefficient."""
        d, sched, s = self.d, self.schedule, self.n
        x = x * self.scale_in if self.scale_in != 1.0 else x
        if target is not None and self.scale_out != 1.0:
            target = target * self.scale_out
        lr, coefficient = sched.lr_at(s), sched.coefficient_at(s)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        d.train()
        dead = self.dead() if d.kind in ("topk", "batchtopk") else None
        with torch.enable_grad():  # (a run without a loss runs with gradients off)
            out = d.losses(x, target, dead=dead, coefficient=coefficient)
        with torch.no_grad():   # one pass over the features: every count below comes from the per-feature sums
            counts = d.firing_counts(out)
            l0 = counts.sum() / len(x)
            world = _world()
            if world is not None:
                world.all_reduce(counts)
            did_fire = counts > 0
            self.since_fired += 1
            self.since_fired[did_fire] = 0
            self.fired += counts
            self.tokens += len(x) * (world.get_world_size() if world is not None else 1)
        with torch.enable_grad():
            out["loss"].backward()
        if world is not None:
            for p in d.parameters():
                if p.grad is not None:
                    world.all_reduce(p.grad)
                    p.grad /= world.get_world_size()
            if d.kind == "batchtopk":
                world.all_reduce(d.topk_threshold)
                d.topk_threshold /= world.get_world_size()
        if sched.decoder_norm == "unit":
            d.remove_parallel_gradient()
        if sched.clip_grad:
            torch.nn.utils.clip_grad_norm_(d.parameters(), sched.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if sched.decoder_norm == "unit":
            d.unit_norm_decoder()
        self.n += 1
        numbers = torch.stack([out["loss"].detach().double(), out["mse_loss"].detach().double(),
                               out["aux_loss"].detach().double(), l0, self.dead().double().mean()]).tolist()
        return {"step": s, **dict(zip(("loss", "mse", "aux", "l0", "dead_fraction"), numbers)),
                "lr": lr, "coefficient": coefficient}   # one copy to the host a step (on a GPU, one sync)

    def state_dict(self) -> dict:
        """Everything a resume needs to go on bitwise: weights, Adam's moments, counters, step, scales."""
        return {"dictionary": {k: v.clone() for k, v in self.d.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "n": self.n, "since_fired": self.since_fired.clone(),
                "fired": self.fired.clone(), "tokens": self.tokens, "scale_in": self.scale_in,
                "scale_out": self.scale_out}

    def load_state_dict(self, state: dict) -> None:
        self.d.load_state_dict(state["dictionary"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.n, self.tokens = int(state["n"]), int(state["tokens"])
        self.since_fired.copy_(state["since_fired"])
        self.fired.copy_(state["fired"])
        self.scale_in, self.scale_out = float(state["scale_in"]), float(state["scale_out"])
