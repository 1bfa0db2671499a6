"""Ranks, reductions, ports and the process group: the one copy every part uses."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host` ("" = every interface); the caller binds it soon after."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def restart_count() -> int:
    """How many times this run's trainer was started again after a rank died (torchrun --max-restarts sets
    TORCHELASTIC_RESTART_COUNT; polyrl's Ray driver sets POLYRL_RESTART_COUNT for its actors)."""
    return int(os.environ.get("POLYRL_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


_group_timeout: timedelta | None = None  # the default group's, as init_distributed made it (None: it made none)


def group_timeout_minutes(default: float = 30.0) -> float:
    """--distributed-timeout-minutes as the default process group got it, for groups made later by libraries that take
    their own (megatron's parallel state); `default` where polyrl did not make the default group."""
    return _group_timeout.total_seconds() / 60 if _group_timeout is not None else default


def init_distributed(device: str, backend: str = "auto", timeout_minutes: float = 10.0) -> None:
    """Join the process group torchrun set up, or make a one-rank group for a plain launch
    (FSDP2 and DCP always run inside a process group, even alone). timeout_minutes (--distributed-timeout-minutes): how
    long a collective waits for the other ranks before it raises (gloo) or the NCCL watchdog ends the process."""
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":  # small CPU-side reductions (metrics, counts) ride on gloo beside NCCL
        backend = "cpu:gloo,cuda:nccl"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    global _group_timeout
    timeout = _group_timeout = timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout, **_attempt_store(timeout))
    else:  # a plain launch: a one-rank group over an in-process store (a TCP port found free could be taken by another
        # process before the store bound it); the environment (inherited by children) stays as it was
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _attempt_store(timeout: timedelta) -> dict:
    """init_process_group's store under torchrun: the agent's TCPStore seen through a prefix of its own per restart.
    torchrun's agent makes that store once and hands every restart of the workers the same one, and the keys a process
    group writes there (each rank's gloo or NCCL address) have the same names in every attempt: a restarted rank that
    reads a peer's key before the peer rewrote it gets the dead address of the previous attempt, and its connect is
    refused (another restart spent) or both ranks wait for each other to dial in until the timeout."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}  # env:// then makes a store on rank 0 that lives and dies with this attempt
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # the agent's count: the same on every rank of a restart
    return {"store": dist.PrefixStore(f"polyrl/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


@dataclass
class Dist:
    """This rank's place in the job and the reductions the step parts run over it."""

    rank: int
    world: int
    group: Any = None  # the process group of the reductions (None: the default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: list) -> list:
        """This rank's contiguous share (groups of one prompt stay on one rank)."""
        if len(items) % self.world:
            raise ValueError(f"{len(items)} items do not split evenly over {self.world} ranks; make --rollout-batch-size "
                             f"(and --global-batch-size for sft) a multiple of the number of ranks")
        per = len(items) // self.world
        return items[self.rank * per:(self.rank + 1) * per]

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def own_group(self) -> "Dist":
        """The same ranks on a gloo group of their own: for reductions on a thread other than the one that runs the
        default group's collectives (their order must be the same on every rank)."""
        if self.world == 1:
            return self
        # the default group's timeout (--distributed-timeout-minutes), not torch's 30 minutes
        return Dist(self.rank, self.world,
                    group=dist.new_group(backend="gloo", timeout=timedelta(minutes=group_timeout_minutes())))

    def _reduce(self, values: list[float], op) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()


def resolve_device(device: str) -> str:
    """--device: auto means CUDA when one is visible."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (taskset, a container's cpuset), not the machine's count,
    which would put more threads than cores on a process restricted to a few."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(world_size: int) -> int:
    """Intra-op threads of a CPU rank: POLYRL_CPU_THREADS when set (make test sets 1: its workers share two cores),
    else the cores split over the ranks. Not OMP_NUM_THREADS: torchrun sets it to 1 for every multi-process job."""
    raw = os.environ.get("POLYRL_CPU_THREADS", "")
    if not raw:
        return max(1, usable_cores() // world_size)
    if not raw.isdigit() or int(raw) < 1:
        from polyrl.config import ConfigError  # a one-line error at the command line, as a bad flag gets
        raise ConfigError(f"POLYRL_CPU_THREADS={raw!r}: give a whole number of threads, 1 or more")
    return int(raw)


def host_threads(device: str, world_size: int, cpu_optimizer: bool = False) -> int:
    """Intra-op threads of a process. A CPU rank computes on them: cpu_threads. A GPU process's host work is small
    tensors (a micro-batch's packing, the engine's inputs, rewards): one thread, as torchrun and Ray give each process,
    unless its optimizer steps on the CPU (--fsdp-cpu-offload, --optimizer-cpu-offload): then the cores split over this
    host's ranks. Why: at torch's default of a thread per core, OpenMP's barriers wait on threads the OS has parked
    beside the process's own busy ones, and the train step becomes host-bound (bench/RESULTS.md#host-threads-2026-11-28).
    POLYRL_CPU_THREADS overrides either."""
    if device == "cpu" or os.environ.get("POLYRL_CPU_THREADS"):
        return cpu_threads(world_size)
    if cpu_optimizer:
        return cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return 1


def set_host_threads(device: str, world_size: int, cpu_optimizer: bool = False) -> int:
    """torch's intra-op threads set to host_threads (what every polyrl command, server and GPU bench uses); returns it."""
    n = host_threads(device, world_size, cpu_optimizer)
    torch.set_num_threads(n)
    return n


def setup(device: str, backend: str, seed: int, timeout_minutes: float,
          cpu_optimizer: bool = False, threads_of_work: int = 1) -> tuple[str, Dist]:
    """The process group, seeds and CPU threads (host_threads) of a command; returns (device, this rank's Dist).
    threads_of_work: threads of this process that compute at once (--async: the trainer's and the rollout's). A
    process that loaded OpenMP spinning (polyrl.cpu_env.GOVERNED) and computes on the CPU on one thread of work gets a
    thread count that follows the machine's load (polyrl.cpu_governor); with two, each takes half the cores, so that
    their spinning threads never outnumber them."""
    from polyrl import cpu_env
    device = resolve_device(device)
    init_distributed(device, backend, timeout_minutes)
    seed_everything(seed)
    n = set_host_threads(device, dist.get_world_size(), cpu_optimizer)
    if cpu_env.GOVERNED and device == "cpu" and dist.get_world_size() == 1:
        if threads_of_work > 1:
            torch.set_num_threads(max(1, n // threads_of_work))
        else:
            from polyrl import cpu_governor
            cpu_governor.start(n)
    return device, Dist(dist.get_rank(), dist.get_world_size())
