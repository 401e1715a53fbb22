"""How many CPU threads a run's torch may use, so parallel sweep jobs on one machine share its cores,
and whether a core is left over for the store's writer thread.

    threads = job_threads(HydraConfig.get())   # None: not a local parallel sweep, leave torch as it is
    spare_core(jobs)                           # False: torch's threads of every job and rank, or the load, fill the cores

joblib (`hydra/launcher=joblib`, `n_jobs`; -1 = one job per core) and submitit_local (every job
at once) run several jobs on one machine; each job then takes cores // jobs-at-once threads (at
least 1; jobs-at-once counted as at most one per core) instead of every core, which would
oversubscribe them. Launchers that send jobs to other machines (SLURM) leave torch as it is.
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parallel_jobs(launcher, available: int) -> int:
    """How many jobs the launcher runs at once on this machine (1 for launchers that use other machines)."""
    target = str(launcher.get("_target_", ""))
    if "joblib" in target.lower():
        n = launcher.get("n_jobs") or -1
        return available + 1 + n if n < 0 else n  # joblib: -1 = every core, -2 = every core but one
    if "LocalLauncher" in target and "submitit" in target.lower():
        return available  # submitit's local executor starts every job of the sweep at once
    return 1


def job_threads(hydra_cfg) -> Optional[int]:
    """torch threads for this job of a multirun (None when it runs alone or on a machine of its own)."""
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    available = cores()
    jobs = min(max(1, parallel_jobs(hydra_cfg.launcher, available)), available)
    return None if jobs <= 1 else max(1, available // jobs)


def spare_core(jobs: int = 1) -> bool:
    """Whether a core is left beside torch's intra-op threads of this machine's `jobs` sweep jobs and of the
    local ranks of a data-parallel run (LOCAL_WORLD_SIZE), each taking torch.get_num_threads(), and beside the
    machine's load: its 1-minute load average (which counts those threads too, once they have run a while) below
    the cores. On a machine that other processes keep busy a writer thread gets no core of its own.

        spare_core()   # False on 2 cores with torch's 2 threads, or with 1 thread at a load average of 2 or more
    """
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(torch.get_num_threads() * max(1, jobs) * max(1, ranks), load()) < cores()


def load() -> float:
    """The machine's 1-minute load average (0 where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not Unix
        return 0.0
