"""Parallel degrees: validated once, the one owner of mesh construction (polyrl/dist.py starts the process group)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist



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
