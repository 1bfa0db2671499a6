"""Where everything runs: one pure function from (config, visible devices) to a plan.

The plan says which devices hold the trainer ranks and the engines, whether they share devices (then the trainer and
the engines take turns: offload / sleep / wake), and which transport moves the weights. It is computed during
validation, before any model is built, so an impossible layout exits 2 at once; torchrun ranks, the HTTP launcher and
Ray all read the same plan. "Shared" is the one meaning of colocation: engines use the trainer's devices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from polyrl.config import Config, ConfigError

# engine kinds that serve with one GPU per process: a larger --rollout-num-gpus-per-engine would leave GPUs idle
ONE_GPU_ENGINES = ("embedded", "server")


@dataclass(frozen=True)
class Plan:
    device: str  # "cpu" | "cuda": what the trainer computes on
    orchestrator: str  # "process" (one process or torchrun) | "ray"
    trainer_ranks: int  # train ranks on this node (torchrun's LOCAL_WORLD_SIZE, Ray's actors per node)
    trainer_devices: tuple[int, ...]  # GPU ids of the trainer ranks on this node (empty on CPU)
    engine: str  # "embedded" | "server" | "sglang" | "external" | "none" (--debug-train-only reads saved rollouts)
    engine_devices: tuple[tuple[int, ...], ...]  # per launched engine: its GPU ids (empty on CPU, for external engines)
    shared: bool  # engines run on the trainer's devices: trainer and engines take turns (sleep / wake / offload)
    transport: str  # how weights move: "tensor" | "distributed" | "disk" | "none"

    @property
    def in_process(self) -> bool:
        return self.engine == "embedded"

    def summary(self) -> str:
        where = "shared devices" if self.shared else "own devices" if self.engine_devices and any(self.engine_devices) else ""
        eng = self.engine + (f" x{len(self.engine_devices)}" if self.engine in ("server", "sglang") else "")
        gpus = f" GPUs {list(self.trainer_devices)}" if self.trainer_devices else ""
        engine_gpus = f" on GPUs {[list(d) for d in self.engine_devices]}" if any(self.engine_devices) else ""
        return (f"{self.device}, {self.trainer_ranks} train rank(s){gpus} via {self.orchestrator}; engine {eng}{engine_gpus}"
                f"{' (' + where + ')' if where else ''}; weights by {self.transport}")


def engine_kind(cfg: Config) -> str:
    if cfg.debug.train_only:
        return "none"
    return "external" if cfg.engines.rollout_external else cfg.rollout.rollout_engine


def num_engines(cfg: Config) -> int:
    """Engine servers to launch: --rollout-num-engines, else --rollout-num-gpus / --rollout-num-gpus-per-engine, else 1."""
    e = cfg.engines
    if e.rollout_num_engines:
        return e.rollout_num_engines
    if e.rollout_num_gpus:
        return max(1, e.rollout_num_gpus // e.rollout_num_gpus_per_engine)
    return 1


def transport_kind(cfg: Config) -> str:
    kind = engine_kind(cfg)
    if kind == "none":
        return "none"
    mode = cfg.engines.weight_sync
    if mode == "auto":
        return "tensor" if kind == "embedded" else "distributed"
    return mode


def engine_gpus(n_engines: int, per_engine: int, trainer_gpus: int, visible: int) -> tuple[list[list[int]], bool]:
    """GPU ids of each engine and whether they share the trainer's GPUs. Disaggregated when the GPUs past the trainer's
    hold every engine; shared (engine k on trainer GPU k, wrapping) otherwise."""
    if visible >= trainer_gpus + n_engines * per_engine:
        return [list(range(trainer_gpus + k * per_engine, trainer_gpus + (k + 1) * per_engine))
                for k in range(n_engines)], False
    if per_engine > trainer_gpus:
        raise ConfigError(f"--rollout-num-gpus-per-engine {per_engine} needs {per_engine} GPUs of the trainer's "
                          f"{trainer_gpus} (or {trainer_gpus + n_engines * per_engine} in all to run the engines apart), but "
                          f"{visible} are visible")
    return [[(k * per_engine + i) % trainer_gpus for i in range(per_engine)] for k in range(n_engines)], True


def plan(cfg: Config, visible_gpus: int, trainer_ranks: int = 1) -> Plan:
    """The layout of a run of `cfg` on a node with `visible_gpus` GPUs and `trainer_ranks` local train ranks (torchrun's
    LOCAL_WORLD_SIZE; ignored under --use-ray, whose actors per node come from the config). Raises ConfigError naming
    the flags when the layout cannot exist."""
    c, e, r, y = cfg.cluster, cfg.engines, cfg.rollout, cfg.ray
    if c.device == "cuda" and visible_gpus == 0 and not y.use_ray:  # Ray's actors may see GPUs the driver does not
        raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu or auto")
    device = "cuda" if c.device == "cuda" or (c.device == "auto" and visible_gpus > 0) else "cpu"
    kind, transport = engine_kind(cfg), transport_kind(cfg)
    n, per = num_engines(cfg), e.rollout_num_gpus_per_engine
    if kind in ONE_GPU_ENGINES and per > 1:
        what = "the embedded engine runs in each train rank" if kind == "embedded" else "`polyrl serve` runs on one GPU"
        raise ConfigError(f"--rollout-num-gpus-per-engine {per} with --rollout-engine {kind}: {what}; use "
                          "--rollout-engine sglang for tensor-parallel engines, or --rollout-num-engines for more engines")
    if y.use_ray:
        ranks = y.actor_num_gpus_per_node
        if y.colocate:  # the embedded engine inside each train actor, or a server actor beside each on its GPU
            devices = tuple(range(ranks)) if device == "cuda" else ()
            engines = tuple((d,) for d in devices) if device == "cuda" or kind == "embedded" else \
                tuple(() for _ in range(ranks))
            return Plan(device, "ray", ranks, devices, kind, engines, device == "cuda", transport)
        # engine actors get GPUs of their own; Ray's placement group decides which, so no ids here
        return Plan(device, "ray", ranks, (), kind, tuple(() for _ in range(n)), False, transport)
    trainer_devices = tuple(range(trainer_ranks)) if device == "cuda" else ()
    if device == "cuda" and trainer_ranks > visible_gpus:
        raise ConfigError(f"{trainer_ranks} train ranks need {trainer_ranks} GPUs but {visible_gpus} are visible "
                          "(torchrun --nproc-per-node, or CUDA_VISIBLE_DEVICES)")
    if kind == "none":
        return Plan(device, "process", trainer_ranks, trainer_devices, kind, (), False, transport)
    if kind == "embedded":
        return Plan(device, "process", trainer_ranks, trainer_devices, kind, tuple((d,) for d in trainer_devices),
                    device == "cuda", transport)
    if kind == "external":  # --rollout-external-colocated: servers started on these GPUs (a Ray engine actor beside each)
        return Plan(device, "process", trainer_ranks, trainer_devices, kind,
                    tuple(() for _ in e.rollout_external_engine_addrs), e.rollout_external_colocated, transport)
    if device != "cuda":  # CPU servers: processes of their own, no devices to share
        return Plan(device, "process", trainer_ranks, (), kind, tuple(() for _ in range(n)), False, transport)
    gpus, shared = engine_gpus(n, per, trainer_ranks, visible_gpus)
    if shared and r.async_training:
        raise ConfigError(f"--async needs the engines on GPUs of their own, but {n} engine(s) x "
                          f"--rollout-num-gpus-per-engine {per} do not fit beside the {trainer_ranks} trainer GPU(s) of "
                          f"{visible_gpus} visible: lower --rollout-num-engines / --rollout-num-gpus, or drop --async")
    return Plan(device, "process", trainer_ranks, trainer_devices, kind, tuple(tuple(g) for g in gpus), shared, transport)


def local_trainer_ranks() -> int:
    """Train ranks on this node as torchrun (or a single process) starts them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_here(cfg: Config) -> Plan:
    """The plan of `cfg` on this node."""
    return plan(cfg, visible_gpus(), local_trainer_ranks())
