"""The one place that starts torch.distributed and validates parallel degrees."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str, backend: str = "auto") -> None:
    """Join the process group torchrun set up, or make a one-rank group for a plain launch
    (FSDP2 and DCP always run inside a process group, even alone)."""
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":  # small CPU-side reductions (metrics, counts) ride on gloo beside NCCL
        backend = "cpu:gloo,cuda:nccl"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        dist.init_process_group(backend=backend)
    else:  # a plain launch: a one-rank group on a port of its own; the environment (inherited by children) stays as it was
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


@dataclass
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    world_size: int = 1
    etp: int | None = None  # expert tensor parallel; None = tp (megatron's default)

    def __post_init__(self) -> None:
        if self.etp is None:
            self.etp = self.tp
        for name, v in (("tensor-model-parallel-size", self.tp), ("pipeline-model-parallel-size", self.pp),
                        ("context-parallel-size", self.cp), ("expert-model-parallel-size", self.ep),
                        ("expert-tensor-parallel-size", self.etp)):
            if v < 1:
                raise ValueError(f"--{name} must be >= 1 (got {v})")
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            raise ValueError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size ({self.tp}) x "
                f"--pipeline-model-parallel-size ({self.pp}) x --context-parallel-size ({self.cp}) = {model}")
        self.dp = self.world_size // model
        if (self.dp * self.cp * self.tp) % self.ep:
            raise ValueError(f"--expert-model-parallel-size ({self.ep}) must divide data x context x tensor parallel "
                             f"({self.dp * self.cp * self.tp})")
        if (self.dp * self.cp * self.tp) % (self.ep * self.etp):
            # megatron lays experts out as etp x ep x expert-dp over the same ranks as tp x cp x dp
            raise ValueError(f"--expert-model-parallel-size ({self.ep}) x --expert-tensor-parallel-size ({self.etp}) "
                             f"must divide data x context x tensor parallel ({self.dp * self.cp * self.tp})")

    @classmethod
    def from_world(cls, **degrees) -> "ParallelDims":
        ws = dist.get_world_size() if dist.is_initialized() else 1
        return cls(world_size=ws, **degrees)

    def build_dp_mesh(self, device: str):
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device, (self.dp,), mesh_dim_names=("dp",))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
