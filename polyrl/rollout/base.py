"""RolloutEngine protocol and the lazy engine table."""

from __future__ import annotations

import importlib
from typing import Iterable, Protocol

import torch

from polyrl.types import Sample, SamplingParams

ENGINES = {  # --rollout-engine (and "external" for --rollout-external) -> class with from_config(cfg, device)
    "embedded": "polyrl.rollout.embedded:EmbeddedEngine",
    "server": "polyrl.rollout.http_engine:HTTPEngine",
    "sglang": "polyrl.rollout.http_engine:HTTPEngine",
    "external": "polyrl.rollout.http_engine:HTTPEngine",
}


class RolloutEngine(Protocol):
    version: int  # the weight version (trainer step) it holds
    concurrent_update: bool  # update_weights may run while a generate is in flight (the async loop relies on it)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        """params.n samples per prompt, grouped: samples[i * n + j] answers prompts[i]
        (group_index i); each carries response ids, per-token logprobs and finish reason."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load an HF-named stream in place; `version` is the trainer step it came from."""

    def sleep(self) -> None:
        """Give the GPU to the trainer (colocated placement); a no-op where nothing is shared."""

    def wake(self) -> None: ...

    def stats(self) -> dict[str, float]:
        """Counters since the last call (e.g. retries, restarts of engine servers), logged with the step."""

    def close(self) -> None:
        """Stop what the engine started (launched servers, router); idempotent."""


class InProcessEngine:
    """What an engine in the trainer's process has nothing to say about."""

    concurrent_update = False  # one model in this process: a weight update must wait for the running generate

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def load_engine_class(name: str):
    try:
        module, cls = ENGINES[name].split(":")
    except KeyError:
        raise ValueError(f"--rollout-engine {name!r} is unknown; choose one of {', '.join(ENGINES)}") from None
    return getattr(importlib.import_module(module), cls)
