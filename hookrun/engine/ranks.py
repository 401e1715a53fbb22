"""Data-parallel runs: which rank this process is, the process group, and each rank's share of the batches.

    ranks = Ranks.from_env()          # torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or SLURM (SLURM_PROCID, ...)
    ranks.start("cpu")                # gloo on CPU, nccl on CUDA; a no-op for one process
    first, stop = ranks.share(n_batches)   # a contiguous range of batches (no padding, no duplicates)
    ranks.gather(obj)                 # every rank's obj, in rank order

Every rank takes a contiguous range of whole batches, so batch numbers, sample positions and rows
are those of a one-process run.

Rank variables that cannot describe a launch (a rank outside the world, a torchrun world without its
rendezvous: a stale `export RANK=0 WORLD_SIZE=2`) are refused before any work (`env_problems`), and
joining the process group gives up after START_TIMEOUT_S with a message instead of waiting for ranks
that never come.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from hookrun.config.checks import ConfigError

START_TIMEOUT_S = 300.0  # every rank gets here after building the model and checking the first batch, alike
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
log = logging.getLogger("hookrun")


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return default


def _launcher_vars() -> Tuple[str, ...]:
    """The rank variables this process was given: torchrun's, else SLURM's for a multi-task job, else none."""
    if "WORLD_SIZE" in os.environ:
        return TORCHRUN
    if os.environ.get("SLURM_NTASKS", "").strip() not in ("", "0", "1"):
        return SLURM
    return ()


def _fix(names: Tuple[str, ...]) -> str:
    return (f"launch every rank with torchrun --nproc-per-node=N -m hookrun ... (or srun under SLURM), or unset "
            f"{', '.join(names or TORCHRUN)} to run one process")


def _is_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


def _value_problems(names: Tuple[str, ...]) -> List[str]:
    """The rank variables `names` (rank, world, local rank) as integers that place this rank in its world."""
    given = {n: os.environ[n].strip() for n in names if os.environ.get(n, "").strip()}
    bad = [f"{n}={v!r}" for n, v in given.items() if not _is_int(v)]
    if bad:
        return [f"{', '.join(bad)}: not an integer; {_fix(names)}"]
    if not names:
        return []
    fix = _fix(names)
    rank_var, world_var, local_var = names
    shown = " ".join(f"{n}={v}" for n, v in given.items())
    world, rank, local = (int(given.get(n, d)) for n, d in ((world_var, 1), (rank_var, 0), (local_var, 0)))
    if world < 1:
        return [f"{shown}: {world_var} must be at least 1; {fix}"]
    if world > 1 and rank_var not in given:
        return [f"{shown}: {world_var}={world} but {rank_var} is not set, so this process's rank is unknown; {fix}"]
    if not 0 <= rank < world:
        return [f"{shown}: {rank_var} must be 0..{world - 1} in a world of {world}; {fix}"]
    if local < 0:
        return [f"{shown}: {local_var} must be >= 0; {fix}"]
    return []


def env_problems() -> List[str]:
    """Rank variables that cannot describe a launch, one line each naming them and the fix: not integers, a
    world below 1, a rank outside it, or a torchrun world of several ranks without MASTER_ADDR / MASTER_PORT
    (torchrun sets both: such variables are left over, and the run would wait for ranks that never come)."""
    names = _launcher_vars()
    problems = _value_problems(names)
    if problems or names != TORCHRUN or _env_int("WORLD_SIZE", default=1) < 2:
        return problems
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n, "").strip()]
    if missing:
        shown = " ".join(f"{n}={os.environ[n]}" for n in TORCHRUN if os.environ.get(n, "").strip())
        verb = "is" if len(missing) == 1 else "are"
        problems.append(f"{shown}: several ranks but {' and '.join(missing)} {verb} not set, as torchrun would set "
                        f"them: these variables look left over from another launch; {_fix(TORCHRUN)}")
    return problems


@dataclass
class Ranks:
    """This process's place among the processes of one run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Ranks":
        """torchrun's variables first, then SLURM's (one task per rank); one process otherwise. Variables that
        are not integers or put the rank outside the world raise ConfigError."""
        names = _launcher_vars()
        problems = _value_problems(names)
        if problems:
            raise ConfigError(problems)
        if not names:
            return cls()
        rank, world, local = names
        return cls(_env_int(rank, default=0), _env_int(world, default=1), _env_int(local, default=0))

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def start(self, device_type: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Join the process group (gloo on CPU, nccl on CUDA). Under SLURM without torchrun, the first
        node of the job is the rendezvous (MASTER_ADDR, MASTER_PORT override it). Raises ConfigError when
        the other ranks have not all joined within `timeout_s`."""
        if not self.parallel or dist.is_initialized():
            return
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or socket.gethostname()
        os.environ.setdefault("MASTER_PORT", str(29500 + _env_int("SLURM_JOB_ID", default=0) % 1000))
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world))
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        log.info("rank %d of %d: waiting for every rank at %s (up to %.0f s)", self.rank, self.world, where, timeout_s)
        try:  # the rendezvous alone is bounded by timeout_s; the group's operations keep torch's default timeout
            store, _, _ = next(dist.rendezvous("env://", self.rank, self.world, timeout=timedelta(seconds=timeout_s)))
        except RuntimeError as err:  # torch's DistStoreError / DistNetworkError
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            shown = " ".join(f"{n}={os.environ[n]}" for n in TORCHRUN if n in os.environ)
            raise ConfigError([f"{shown}: the ranks did not all meet at {where} within {timeout_s:.0f} s ({reason}); "
                               f"check that all {self.world} ranks were started and reach {where}, or "
                               f"{_fix(TORCHRUN)}"]) from None
        store.set_timeout(default_pg_timeout)
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=self.rank,
                                world_size=self.world)

    def stop(self) -> None:
        if self.parallel and dist.is_initialized():
            dist.destroy_process_group()

    def device(self, name: str) -> torch.device:
        """This rank's device, with its index: cuda:<LOCAL_RANK> for device=cuda with several ranks, else torch's
        current CUDA device (torch.cuda.set_device and the side streams need a numbered device). More ranks on a
        machine than it has GPUs is a ConfigError naming the fix."""
        device = torch.device(name)
        if device.type != "cuda" or device.index is not None:
            return device
        if not self.parallel:
            return torch.device("cuda", torch.cuda.current_device())
        count = torch.cuda.device_count()
        if self.local_rank >= count:
            raise ConfigError([f"device: {name!r}: rank {self.rank} is local rank {self.local_rank} of its machine, "
                               f"which has {count} CUDA device(s); start at most {count} process(es) a machine "
                               f"(torchrun --nproc-per-node={count}) or use device=cpu"])
        return torch.device("cuda", self.local_rank)

    def share(self, n_batches: int) -> Tuple[int, int]:
        """This rank's batches [first, stop): contiguous, sizes differing by at most one."""
        return self.rank * n_batches // self.world, (self.rank + 1) * n_batches // self.world

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in rank order (just [obj] for one process)."""
        if not self.parallel:
            return [obj]
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out
