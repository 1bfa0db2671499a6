"""`polyrl train --use-ray`: Ray places and supervises the processes; the RL loop is unchanged.

One placement group holds a bundle per train actor (one GPU each; on CPU one `polyrl_slot`, a
custom resource the local instance declares) and, disaggregated, a bundle per engine actor
(`--rollout-num-gpus-per-engine` GPUs each). Then:
  engine actors (EngineRayActor)  each starts a `polyrl serve` (or SGLang) on its bundle's GPUs and
                                  reports its URL; the server dies with its actor
  train actors (TrainRayActor)    rank k of a torch.distributed group formed among them (rank 0's
                                  node and a free port as master), each running the same loop as a
                                  torchrun rank (`loop.train` / `loop_async.train`, any backend), with
                                  the engine actors' servers as external engines (weights from
                                  distributed). `--colocate`: no engine actors; the embedded engine
                                  runs inside each train actor on its GPU and the two take turns
                                  (offload/onload, sleep/wake), weights from tensor. `--colocate
                                  --rollout-engine server`: one engine actor in each train actor's
                                  bundle (a fraction of its GPU each), taking turns the same way
                                  through the server's memory routes, weights over gloo.
The reference model is part of each train actor's backend (slime's `with_ref`), as under torchrun.
The driver waits on the actors; a train actor that dies (or raises) ends the run with a message
naming it, every actor is killed, the placement group removed, and a local Ray instance stopped:
nothing is left behind. A local instance keeps its temp dir and logs under RUN_DIR/ray.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
import time

from polyrl.checkpoint import resume_latest
from polyrl.config import Config, ConfigError
from polyrl.metrics import notice

log = logging.getLogger(__name__)

RAY_HINT = "--use-ray needs Ray: pip install 'polyrl[ray]' (or pip install ray)"
# --colocate with servers: the engine actor's share of its train actor's bundle, for Ray's bookkeeping only (the two
# take turns on the whole GPU: the engine releases its memory while the trainer trains)
ENGINE_SHARE = 0.5
CPU_SLOT = "polyrl_slot"  # what a "GPU" is on CPU: declared by the local instance, or by `ray start --resources`


class TrainActorDied(RuntimeError):
    """A train actor died or failed; the message names it."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(RAY_HINT) from None
    return ray


def _unit(cfg: Config) -> str:
    return "GPU" if cfg.cluster.device == "cuda" else CPU_SLOT


def _needs(unit: str, amount: float) -> dict:
    """An actor's resource options: Ray takes GPUs as num_gpus only (a "GPU" key in resources is refused)."""
    return {"num_gpus": amount} if unit == "GPU" else {"resources": {unit: amount}}


def _absolute(cfg: Config) -> Config:
    """Actors may start in another directory: the paths they read (when they exist here) and write are made absolute."""
    cfg = copy.deepcopy(cfg)
    reads = (("model", "hf_checkpoint"), ("model", "ref_load"), ("data", "prompt_data"), ("data", "eval_prompt_data"),
             ("checkpoint", "load"))
    writes = (("checkpoint", "save"), ("checkpoint", "save_hf"), ("log", "run_dir"))
    for sec, key in reads + writes:
        v = getattr(getattr(cfg, sec), key)
        if v and ((sec, key) in writes or os.path.exists(v)):
            setattr(getattr(cfg, sec), key, os.path.abspath(v))
    rm = cfg.reward.custom_rm_path
    if rm and ":" in rm and rm.rpartition(":")[0].endswith(".py"):
        path, _, fn = rm.rpartition(":")
        cfg.reward.custom_rm_path = f"{os.path.abspath(path)}:{fn}"
    return cfg


def _ray_temp_dir(run_dir: str) -> str:
    """RUN_DIR/ray, or a short directory linked from there: Ray's unix sockets live under it and a
    socket path may not exceed 107 bytes."""
    want = os.path.join(os.path.abspath(run_dir), "ray")
    if len(want) <= 40:
        os.makedirs(want, exist_ok=True)
        return want
    short = tempfile.mkdtemp(prefix="polyrl_ray_")
    os.makedirs(run_dir, exist_ok=True)
    if not os.path.lexists(want):
        os.symlink(short, want)
    return short


def _init(cfg: Config, slots: int) -> bool:
    """Join a cluster or start a local instance; True when we started it (and must stop it)."""
    ray = _import_ray()
    address = cfg.ray.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        if cfg.ray.ray_num_cpus:  # a running cluster's CPUs are its nodes' own: the flag would be silently ignored
            raise ConfigError(f"--ray-num-cpus sizes the local Ray instance; this run joins the cluster at {address} "
                              "(--ray-address or RAY_ADDRESS), whose nodes declare their own CPUs: drop --ray-num-cpus")
        from polyrl.cpu_env import wait_env
        # the cluster's workers were started outside this process's environment: its OpenMP wait policy goes along
        env_vars = wait_env()
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": env_vars} if env_vars else None)
        return False
    resources = {} if cfg.cluster.device == "cuda" else {CPU_SLOT: slots}
    ray.init(num_cpus=cfg.ray.ray_num_cpus or os.cpu_count(), resources=resources, include_dashboard=False,
             _temp_dir=_ray_temp_dir(cfg.log.run_dir), log_to_driver=True)  # its workers inherit this environment
    return True


def _node_ip() -> str:
    import ray
    return ray.util.get_node_ip_address()


class TrainRayActor:
    """One train rank (slime's FSDPTrainRayActor / MegatronTrainRayActor): the same backend and loop as
    a torchrun rank; the reference model comes with the backend when the config needs one."""

    def master(self) -> tuple[str, int]:
        from polyrl.rollout.http_engine import free_port
        return _node_ip(), free_port("")  # every interface: ranks on other nodes connect to it

    def pid(self) -> int:
        return os.getpid()

    def train(self, cfg: Config, rank: int, world: int, master: tuple[str, int], restart: int = 0) -> dict:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),  # Ray sets CUDA_VISIBLE_DEVICES to its GPU
                          POLYRL_RESTART_COUNT=str(restart))
        logging.basicConfig(level=os.environ.get("POLYRL_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
        if cfg.rollout.async_training:
            from polyrl.loop_async import train
        else:
            from polyrl.loop import train
        try:
            return train(cfg)
        finally:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


class EngineRayActor:
    """One engine server on its bundle's GPUs; the server is tied to this actor's process (it dies with it)."""

    def __init__(self):
        self.server = None

    def start(self, cfg: Config, index: int, log_dir: str, host: str, api_key: str) -> str:
        from polyrl.rollout.http_client import HTTPClient
        from polyrl.rollout.http_engine import Server, free_port, launch_secret, server_command, wait_healthy
        bind = _node_ip() if host == "node" else "127.0.0.1"
        port = free_port(bind)
        kind = "sglang" if cfg.rollout.rollout_engine == "sglang" else "server"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        key_file, key_env = launch_secret(cfg, kind, api_key, os.path.join(log_dir, f"engine{index}.sglang.yaml"))
        self.server = Server(index=index, url=f"http://{bind}:{port}", env={**env, **key_env},
                             cmd=server_command(cfg, kind, port, cfg.cluster.device, host=bind, sglang_config=key_file),
                             log_path=os.path.join(log_dir, f"engine{index}.log"))
        self.server.start()
        http = HTTPClient(api_key)
        try:
            wait_healthy(self.server, http, cfg.engines.rollout_engine_startup_timeout)
            return self.server.url
        finally:
            http.close()

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def plan(cfg: Config) -> tuple[int, int, int]:
    """(train actors, engine actors, units per engine) from the placement plan; engines 0 when they share the train
    actors' devices (the embedded engine inside each actor)."""
    from polyrl.placement import plan as placement_plan
    p = placement_plan(cfg, visible_gpus=0, trainer_ranks=cfg.ray.actor_num_gpus_per_node)
    world = cfg.ray.actor_num_nodes * p.trainer_ranks
    if p.in_process:
        return world, 0, 0
    if cfg.ray.colocate:  # a server actor in each train actor's bundle
        return world, world, 0
    return world, len(p.engine_devices), cfg.engines.rollout_num_gpus_per_engine


def train_on_ray(cfg: Config) -> dict:
    ray = _import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cfg = _absolute(cfg)
    world, n_eng, per_eng = plan(cfg)
    unit = _unit(cfg)
    started = _init(cfg, world + n_eng * per_eng)
    actors: list = []
    engines: list = []
    pg = None
    try:
        shared = cfg.ray.colocate and n_eng > 0  # engine actor k shares train actor k's bundle (and GPU)
        bundles = [{unit: 1} for _ in range(world)] + ([] if shared else [{unit: per_eng} for _ in range(n_eng)])
        pg = placement_group(bundles, strategy="PACK")
        timeout = cfg.engines.rollout_engine_startup_timeout
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            raise TimeoutError(f"Ray could not place {len(bundles)} bundles ({bundles}) within {timeout:.0f} s "
                               f"(--rollout-engine-startup-timeout): the cluster has {ray.cluster_resources()}")

        def at(i: int):
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

        multi_node = len({n["NodeID"] for n in ray.nodes() if n.get("Alive")}) > 1
        run_cfg = copy.deepcopy(cfg)
        run_cfg.ray.use_ray = False
        if n_eng:
            # every engine server gets a key (a random one unless given), also on loopback; the train actors send it
            from polyrl.rollout.http_engine import engines_api_key
            run_cfg.engines.api_key = key = engines_api_key(cfg, launched=True)
            run_cfg.engines.api_key_file = None
            eng_cls = ray.remote(num_cpus=0)(EngineRayActor)
            engines = [eng_cls.options(scheduling_strategy=at(k if shared else world + k),
                                       **_needs(unit, ENGINE_SHARE if shared else per_eng)).remote()
                       for k in range(n_eng)]
            log_dir = os.path.join(cfg.log.run_dir, "engines")
            urls = _get(ray, [e.start.remote(cfg, k, log_dir, "node" if multi_node else "loopback", key)
                              for k, e in enumerate(engines)], timeout + 30, "engine actors starting their servers")
            run_cfg.engines.rollout_external, run_cfg.engines.rollout_external_engine_addrs = True, urls
            run_cfg.engines.rollout_external_colocated = shared
        train_cls = ray.remote(num_cpus=0)(TrainRayActor)
        for restart in range(cfg.ray.max_restarts + 1):
            actors = [train_cls.options(scheduling_strategy=at(i), **_needs(unit, 1 - ENGINE_SHARE if shared else 1)).remote()
                      for i in range(world)]
            master = _get(ray, [actors[0].master.remote()], 120, "train actor 0 (its address)")[0]
            pids = _get(ray, [a.pid.remote() for a in actors + engines], 120, "actors (their pids)")
            os.makedirs(cfg.log.run_dir, exist_ok=True)
            with open(os.path.join(cfg.log.run_dir, "ray_actors.json"), "w") as f:
                json.dump({"train": pids[:world], "engines": pids[world:], "restart": restart}, f)
            refs = [a.train.remote(run_cfg, rank, world, master, restart) for rank, a in enumerate(actors)]
            try:
                return _supervise(ray, refs)
            except TrainActorDied as e:
                if restart == cfg.ray.max_restarts:
                    raise
                notice(f"{e}")
                for a in actors:  # the survivors wait in collectives with the dead one: the whole trainer starts again
                    ray.kill(a, no_restart=True)
                resume_latest(run_cfg, restart + 1, cfg.ray.max_restarts)  # the engine actors keep running
    finally:
        for a in engines:
            try:
                ray.get(a.stop.remote(), timeout=15)
            except Exception:  # a dead actor: its server died with it
                pass
        for a in actors + engines:
            ray.kill(a, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
        if started:
            ray.shutdown()


def _get(ray, refs: list, timeout: float, what: str) -> list:
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if len(ready) < len(refs):
        raise TimeoutError(f"Ray: no answer from {what} within {timeout:.0f} s")
    return ray.get(refs)


def _supervise(ray, refs: list) -> dict:
    """Wait for every train actor; the first that dies or raises ends the run (the rest are killed by the caller)."""
    from ray.exceptions import RayActorError, RayTaskError
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=5.0)
        for ref in done:
            rank = refs.index(ref)
            try:
                ray.get(ref)
            except RayActorError as e:
                raise TrainActorDied(f"train actor {rank} (rank {rank}) died: {e.__class__.__name__}; its log is under "
                                     "the Ray session's logs (RUN_DIR/ray for a local instance)") from None
            except RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                if isinstance(cause, (ConfigError, ValueError, ImportError, TimeoutError, RuntimeError)):
                    raise cause
                raise TrainActorDied(f"train actor {rank} failed: {cause}") from None
    return ray.get(refs[0])
