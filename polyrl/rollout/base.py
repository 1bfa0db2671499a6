"""RolloutEngine protocol and the lazy engine table."""

from __future__ import annotations

import importlib
from typing import Iterable, Protocol

import torch

from polyrl.types import Sample, SamplingParams

ENGINES = {
    "embedded": "polyrl.rollout.embedded:EmbeddedEngine",
}


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        """params.n samples per prompt, grouped: samples[i * n + j] answers prompts[i]
        (group_index i); each carries response ids, per-token logprobs and finish reason."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load an HF-named stream in place; `version` is the trainer step it came from."""

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


def load_engine_class(name: str):
    try:
        module, cls = ENGINES[name].split(":")
    except KeyError:
        raise ValueError(f"--rollout-engine {name!r} is unknown; choose one of {', '.join(ENGINES)}") from None
    return getattr(importlib.import_module(module), cls)
