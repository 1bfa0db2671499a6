"""The GPU hand-off: the colocated choreography between the trainer and the engine in one place.

Where the engine shares the trainer's devices (placement plan `shared`) they take turns: the trainer offloads before
the rollout, the engine sleeps before training, and after training the engine's weights come back first, take the
update straight from the trainer's copy, the trainer leaves, and the KV cache returns into the memory it freed.
Where nothing is shared these calls are no-ops on both sides. --debug-rollout-only and --debug-train-only substitute
FrozenHandoff (the weights never change, or there is no engine to send them to)."""

from __future__ import annotations

from typing import ContextManager

from polyrl.backends.base import TrainBackend
from polyrl.dist import barrier
from polyrl.metrics import notice
from polyrl.rollout.base import RolloutEngine
from polyrl.weight_sync import WeightTransport


class Handoff:
    def __init__(self, backend: TrainBackend, engine: RolloutEngine, transport: WeightTransport, engine_lock: ContextManager,
                 *, push_at_start: bool):
        self.backend, self.engine, self.transport, self.engine_lock = backend, engine, transport, engine_lock
        self.push_at_start = push_at_start

    def start(self, version: int, resumed: bool) -> None:
        """Before the first step: the engine must sample from the trainer's policy. An engine that loaded the same
        --hf-checkpoint holds it already; a resumed run, or an engine that was running before this run (external
        servers, which another run may have updated), gets the trainer's weights now."""
        if resumed or self.push_at_start:
            if self.push_at_start and not resumed:
                notice("sending the trainer's weights to the engines before the first rollout")
            self.push(version)

    def to_engine(self) -> None:
        """Before a rollout: the trainer leaves the devices it shares with the engine."""
        self.backend.offload()

    def to_trainer(self) -> None:
        """After a rollout: the engine gives the shared devices to the trainer, once every rank's rollout is over (the
        ranks share the servers: one rank's sleep would hold another's requests still out until the next wake)."""
        barrier()
        self.engine.sleep()

    def sync(self, version: int) -> None:
        """After training: the engine gets weights `version` (the number of train steps in them)."""
        self.push(version)

    def push(self, version: int) -> None:
        self.engine.wake(("weights",))
        with self.engine_lock:
            self.transport.push(self.backend.export_weights(), self.engine, version=version)
        self.backend.offload()
        self.engine.wake(("kv_cache",))


class FrozenHandoff(Handoff):
    """--debug-rollout-only (nothing trains: the engine keeps its memory and its weights) and --debug-train-only (no
    engine: samples come from files). A resumed rollout-only run still sends the resumed weights once."""

    def start(self, version: int, resumed: bool) -> None:
        if resumed:
            self.push(version)

    def to_trainer(self) -> None:
        pass

    def sync(self, version: int) -> None:
        pass
