"""Data-parallel runs: which rank this process is, the process group, and each rank's share of the batches.

    ranks = Ranks.from_env()          # torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or SLURM (SLURM_PROCID, ...)
    ranks.start("cpu")                # gloo on CPU, nccl on CUDA; a no-op for one process
    first, stop = ranks.share(n_batches)   # a contiguous range of batches (no padding, no duplicates)
    ranks.gather(obj)                 # every rank's obj, in rank order

Every rank takes a contiguous range of whole batches, so batch numbers, sample positions and rows
are those of a one-process run.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, List, Tuple

import torch
import torch.distributed as dist


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return default


@dataclass
class Ranks:
    """This process's place among the processes of one run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Ranks":
        """torchrun's variables first, then SLURM's (one task per rank); one process otherwise."""
        if "WORLD_SIZE" in os.environ:
            return cls(_env_int("RANK", default=0), _env_int("WORLD_SIZE", default=1), _env_int("LOCAL_RANK", default=0))
        if _env_int("SLURM_NTASKS", default=1) > 1:
            return cls(_env_int("SLURM_PROCID", default=0), _env_int("SLURM_NTASKS", default=1),
                       _env_int("SLURM_LOCALID", default=0))
        return cls()

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def start(self, device_type: str) -> None:
        """Join the process group (gloo on CPU, nccl on CUDA). Under SLURM without torchrun, the first
        node of the job is the rendezvous (MASTER_ADDR, MASTER_PORT override it)."""
        if not self.parallel or dist.is_initialized():
            return
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or socket.gethostname()
        os.environ.setdefault("MASTER_PORT", str(29500 + _env_int("SLURM_JOB_ID", default=0) % 1000))
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world))
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world)

    def stop(self) -> None:
        if self.parallel and dist.is_initialized():
            dist.destroy_process_group()

    def device(self, name: str) -> torch.device:
        """This rank's device: cuda:<LOCAL_RANK> for device=cuda with several ranks."""
        device = torch.device(name)
        if self.parallel and device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.local_rank)
        return device

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
