"""One RolloutEngine over N SGLang-compatible HTTP servers: `polyrl serve` or SGLang processes
that polyrl launches (`--rollout-engine server|sglang`), or running servers it attaches to
(`--rollout-external --rollout-external-engine-addrs ...`), optionally behind the real
sglang-router (`--use-sglang-router`).

To the loop this is one engine (`generate`, `sleep`, `wake`, `stats`); balancing, health
checks, retries and restarts live here. Weights reach the servers through a transport
(polyrl.weight_sync.distributed), which asks this object where to send them
(`weight_sync_urls`, `membership`) and tells it what they now hold (`weights_pushed`).

Fault tolerance (`--use-fault-tolerance`): a server that dies, or stops answering (its /health
or a request times out: --rollout-health-check-interval, --rollout-request-timeout), is marked
down; its in-flight requests are cancelled and re-sent to the others (or to it once it is back),
and a launched one is killed (SIGKILL when it does not answer) and restarted. A restarted server
holds --hf-checkpoint's weights: the transport's last pushed weights (`set_weight_source`) are
re-sent to it alone (`transport.push_to`) before it serves again. A server lost during a push is
reported by `lost_during_sync`; the push finishes on the others. Without the flag each of these
stops the run with an EngineDeadError naming the engine and its log.

Sampling is reproducible across servers: every prompt carries its own `sampling_seed`
(polyrl.rollout.sampling), so a sample does not depend on which server ran it.
"""

from __future__ import annotations

import asyncio
import base64
import atexit
import collections
import contextlib
import concurrent.futures
import importlib.util
import logging
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from polyrl.config import Config
from polyrl.dist import free_port, group_timeout_minutes, rank as trainer_rank
from polyrl.placement import num_engines, plan_here
from polyrl.rollout.base import GenerateWatch, wake_tags
from polyrl.rollout.http_client import EngineHTTPError, HTTPClient, normalize_url
from polyrl.rollout.lengths import mark_forced
from polyrl.rollout.router import spawn
from polyrl.rollout.sampling import prompt_seed, sample_seed
from polyrl.types import Sample, SamplingParams

log = logging.getLogger(__name__)

SGLANG_HINT = ("--rollout-engine sglang needs SGLang in this Python environment: pip install 'sglang[all]' "
               "(it pins its own torch and CUDA kernels); or use --rollout-engine server (polyrl serve), or attach to "
               "running SGLang servers with --rollout-external --rollout-external-engine-addrs URL ...")


class EngineDeadError(RuntimeError):
    """An engine server died or stopped answering and fault tolerance is off (or nothing is left to retry on)."""


class RouterDeadError(EngineDeadError):
    """The sglang-router in front of the engines died or failed (and fault tolerance is off, or could not restart it)."""


def wait_healthy(s: Server, http, timeout: float) -> None:
    """Until a starting server answers /health; an exit or the timeout is an EngineDeadError with its log's tail."""
    deadline = time.monotonic() + timeout
    while True:
        if s.exited():
            raise EngineDeadError(f"{s.name} exited with code {s.proc.returncode} while starting; last log lines:\n{s.tail()}")
        try:
            http.call(s.url, "/health", timeout=5)
            return
        except EngineHTTPError as err:
            if time.monotonic() > deadline:
                raise EngineDeadError(f"{s.name} did not answer /health within {timeout:.0f} s "
                                      f"(--rollout-engine-startup-timeout): {err}\n{s.tail()}") from None
        time.sleep(0.2)


@dataclass
class Server:
    index: int
    url: str
    cmd: list[str] | None = None  # None: external, never started or stopped by us
    env: dict | None = None
    log_path: str | None = None
    proc: subprocess.Popen | None = None
    alive: bool = True
    version: int | None = 0  # weight version it holds; None: unknown (restarted, waits for the next sync)
    outstanding: int = 0
    failures: int = 0
    restarting: bool = False
    log_tail: list[str] = field(default_factory=list)
    born: int = 0  # the engine's membership when this process started: restarted after a push began if larger
    inflight: set = field(default_factory=set)  # asyncio tasks of its /generate requests (cancelled when it goes down)
    log_start: int = 0  # the log's size when this process started (the log is appended to across restarts)

    @property
    def name(self) -> str:
        where = f", log {self.log_path}" if self.log_path else ""
        return f"engine {self.index} ({self.url}{where})"

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.log_start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        # 0600: a server may print its settings (SGLang prints its ServerArgs, key included) into its log
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as logf:
            # spawn: tied to the trainer (killed with it, also by kill -9), even when a restart thread starts it
            self.proc = spawn(self.cmd, env=self.env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def kill(self) -> None:
        """SIGKILL: a stopped or wedged process ignores SIGTERM until it runs again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def said(self) -> str:
        """What this process wrote to its log."""
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def tail(self, n: int = 15) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def _dtype_flags(cfg: Config) -> list[str]:
    m = cfg.model
    return ["--fp16"] if m.fp16 else ["--bf16"] if m.bf16 else ["--fp32"] if m.fp32 else []


def wants_routes(cfg: Config) -> bool:
    return cfg.model.return_routed_experts or cfg.model.use_rollout_routing_replay


def decode_routed_experts(b64: str, tokens: int, layers: int, top_k: int) -> torch.Tensor:
    """SGLang's meta_info.routed_experts (base64 of int32 [tokens - 1, layers, k]) as the small-int tensor a Sample
    keeps ([tokens - 1, layers, k]; int16 holds any expert id below 2**15, at half the host memory)."""
    raw = base64.b64decode(b64.encode("ascii"))
    want = max(tokens - 1, 0) * layers * top_k * 4
    if len(raw) != want:
        raise ValueError(f"routed_experts holds {len(raw)} bytes; a sample of {tokens} tokens over {layers} layers with "
                         f"top-{top_k} needs {want} (int32 [tokens - 1, layers, k]): does the engine serve this model?")
    routes = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(tokens - 1, layers, top_k)
    return routes.to(torch.int16) if routes.numel() == 0 or int(routes.max()) < 2**15 else routes


API_KEY_ENV = "POLYRL_API_KEY"  # polyrl serve reads its key from here when --api-key is absent (polyrl.rollout.server)


def engines_api_key(cfg: Config, launched: bool) -> str | None:
    """The engines' key: --api-key, else --api-key-file; servers polyrl launches get a random one when neither is set
    (also on loopback: any local user can reach 127.0.0.1). Held by the engine object only, never written to the config."""
    e = cfg.engines
    if e.api_key and e.api_key_file:
        from polyrl.config import ConfigError
        raise ConfigError("--api-key and --api-key-file are alternatives; give one")
    if e.api_key_file:
        from polyrl.rollout.server import read_key_file
        return read_key_file(e.api_key_file, "--api-key-file")
    return e.api_key or (secrets.token_urlsafe(32) if launched else None)


def _sglang_user_config(args: Sequence[str]) -> str | None:
    return args[args.index("--config") + 1] if "--config" in args[:-1] else None


def launch_secret(cfg: Config, kind: str, key: str | None, path: str) -> tuple[str | None, dict[str, str]]:
    """(SGLang --config file, environment) that give a launched server its key without putting it on its command line
    (/proc/PID/cmdline is readable by every local user; /proc/PID/environ and a 0600 file only by this user).
    polyrl serve reads POLYRL_API_KEY; sglang.launch_server reads flags from a YAML --config file, so its key goes in
    one (merged with a --sglang-config file the user gave: SGLang takes a single --config)."""
    if key is None:
        return None, {}
    if kind != "sglang":
        return None, {API_KEY_ENV: key}
    import yaml
    data = {}
    user = _sglang_user_config(cfg.engines.sglang_args)
    if user is not None:
        with open(user) as f:
            data = yaml.safe_load(f) or {}
    data["api-key"] = key
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f)
    return path, {}


def engine_model_path(cfg: Config) -> str:
    """The checkpoint a launched SGLang starts from: --hf-checkpoint, or (--rollout-quantization fp8) its block-FP8
    copy under the run's engine directory, written once, so that SGLang builds FP8 layers for the quantized stream."""
    if cfg.rollout.rollout_quantization != "fp8":
        return cfg.model.hf_checkpoint
    from polyrl.weight_sync.fp8_checkpoint import write_fp8_checkpoint
    log_dir = cfg.engines.rollout_engine_log_dir or os.path.join(cfg.log.run_dir, "engines")
    return write_fp8_checkpoint(cfg.model.hf_checkpoint, os.path.join(log_dir, "fp8-checkpoint"))


def server_command(cfg: Config, kind: str, port: int, device: str, host: str = "127.0.0.1",
                   sglang_config: str | None = None) -> list[str]:
    """argv of one launched engine server (host: where it listens). It holds no key: launch_secret hands that over
    (sglang_config: the file it wrote for SGLang)."""
    e = cfg.engines
    if kind == "sglang":
        if importlib.util.find_spec("sglang") is None:
            raise ImportError(SGLANG_HINT)
        extra = list(e.sglang_args)
        if sglang_config is not None and _sglang_user_config(extra) is not None:  # merged into ours by launch_secret
            i = extra.index("--config")
            del extra[i:i + 2]
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", engine_model_path(cfg),
                "--host", host, "--port", str(port), "--tp-size", str(e.rollout_num_gpus_per_engine),
                "--mem-fraction-static", str(cfg.rollout.rollout_mem_fraction),
                *(["--config", sglang_config] if sglang_config else []),
                *(["--enable-return-routed-experts"] if wants_routes(cfg) else []),
                *(["--kv-cache-dtype", cfg.rollout.kv_cache_dtype] if cfg.rollout.kv_cache_dtype != "auto" else []),
                *extra]
    r = cfg.rollout
    from polyrl.placement import transport_kind
    # --weight-sync disk: the servers may load from the directory DiskTransport writes in, and nothing else
    allowed = []
    if transport_kind(cfg) == "disk":
        from polyrl.weight_sync.distributed import private_weight_dir
        allowed = ["--allowed-weight-dirs", private_weight_dir()]
    max_n = max(64, r.n_samples_per_prompt)  # a request carries one prompt's n samples
    return [sys.executable, "-m", "polyrl", "serve", "--hf-checkpoint", cfg.model.hf_checkpoint, "--host", host,
            "--port", str(port), "--device", device, "--seed", str(cfg.cluster.seed),
            "--rollout-mem-fraction", str(r.rollout_mem_fraction), "--rollout-batch-generate", str(r.rollout_batch_generate),
            "--attn-implementation", cfg.model.attn_implementation,
            "--max-n", str(max_n), "--max-running-requests", str(max(1024, max_n)),
            # the server stops generating for a request its client has given up on
            "--request-timeout-s", str(e.rollout_request_timeout), *allowed,
            *([] if r.rollout_gpu_engine else ["--no-rollout-gpu-engine"]),
            *([] if r.rollout_cuda_graph else ["--no-rollout-cuda-graph"]), *_dtype_flags(cfg),
            *(["--true-on-policy"] if cfg.model.true_on_policy else []),
            *(["--rollout-quantization", r.rollout_quantization] if r.rollout_quantization != "none" else []),
            *(["--kv-cache-dtype", r.kv_cache_dtype] if r.kv_cache_dtype != "auto" else [])]


class HTTPEngine:
    """`--rollout-engine server|sglang` (launched) or `--rollout-external` (attached)."""

    concurrent_update = True  # servers load weights between engine calls, each response reports its version
    reports_top_logprobs = True  # SGLang's top_logprobs_num (a polyrl serve on the GPU engine refuses it by name)

    @classmethod
    def from_config(cls, cfg: Config, device: str) -> "HTTPEngine":
        return cls(cfg, device)

    def __init__(self, cfg: Config, device: str):
        e = cfg.engines
        self.cfg, self.device = cfg, device
        self.kind = "external" if e.rollout_external else cfg.rollout.rollout_engine
        self.fault_tolerant = e.use_fault_tolerance
        self.request_timeout = e.rollout_request_timeout
        # SGLang gives the n copies of one request the same seed: ask it for single samples, each with its own seed
        self.split_samples = self.kind != "server"
        self.api_key = engines_api_key(cfg, launched=not e.rollout_external)
        self.http = HTTPClient(self.api_key)
        self.rank = trainer_rank()
        self.version = 0
        self.membership = 0  # changes when a server is restarted: the weight transport rebuilds its group
        self.shares_devices = False
        self.router = None
        self._stats: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._closed = False
        self.servers: list[Server] = []
        self._secret_files: list[str] = []  # 0600 files holding the key for launched SGLang servers, removed at close
        self._weight_source = None  # (source, transport): how a restarted server gets the current weights
        self._resync_lock = threading.Lock()
        self._processor = None  # image prompts: the model's VisionProcessor, loaded at the first one
        self._router_restart: concurrent.futures.Future | None = None  # rank 0: the router's restart under way
        self._router_lost = False  # another rank: a request through the router failed; rank 0 restarts it
        self._router_gave_up: str | None = None  # why the router's restart failed
        atexit.register(self.close)
        try:
            self._start_servers(cfg, device)
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        except BaseException:
            self.close()
            raise
        self._stop_health = threading.Event()
        self._health = threading.Thread(target=self._health_loop, name="polyrl-engine-health", daemon=True)
        self._health.start()

    # ---- start-up ------------------------------------------------------------------------------
    def _start_servers(self, cfg: Config, device: str) -> None:
        e = cfg.engines
        log_dir = e.rollout_engine_log_dir or os.path.join(cfg.log.run_dir, "engines")
        self.router_log = os.path.join(log_dir, "router.log")
        if e.rollout_external:
            self.servers = [Server(k, normalize_url(a)) for k, a in enumerate(e.rollout_external_engine_addrs)]
            self.shares_devices = e.rollout_external_colocated
            self._probe_external(e.rollout_external_startup_timeout)
        else:
            n = num_engines(cfg)
            urls: list = [None, None, None]  # (server urls, colocated, key): the same length on every rank
            if self.rank == 0:  # one set of servers for the whole job; every trainer rank sends its own requests
                self.servers = self._launch(cfg, device, n, log_dir)
                # up before the other ranks learn the urls (one that lost its port is started again on another),
                # within half the time the others wait in the broadcast for them
                budget = cfg.engines.rollout_engine_startup_timeout
                if dist.is_initialized() and dist.get_world_size() > 1:
                    budget = min(budget, 30 * group_timeout_minutes())
                from polyrl.metrics import notice
                notice(f"waiting for {n} engine server{'s' * (n > 1)} ({', '.join(s.url for s in self.servers)}; logs in "
                       f"{log_dir}){' and the sglang-router' * e.use_sglang_router} to answer /health, up to "
                       f"{budget:.0f} s (--rollout-engine-startup-timeout)")
                deadline = time.monotonic() + budget
                self.servers = [self._up(s, cfg, device, log_dir, deadline) for s in self.servers]
                urls = [[s.url for s in self.servers], self.shares_devices, self.api_key]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(urls, src=0)
            if self.rank != 0:
                self.servers = [Server(k, u, log_path=os.path.join(log_dir, f"engine{k}.log")) for k, u in enumerate(urls[0])]
                self.shares_devices = urls[1]
                if urls[2] != self.api_key:  # rank 0's random key is the servers' key
                    self.api_key = urls[2]
                    self.http.close()
                    self.http = HTTPClient(self.api_key)
        for s in self.servers:
            if not e.rollout_external:  # launched ones (attached ones were probed above)
                self._wait_healthy(s, e.rollout_engine_startup_timeout)
        if e.use_sglang_router and self.rank == 0:
            self.router = self._launch_router()
        if e.use_sglang_router and dist.is_initialized() and dist.get_world_size() > 1:
            box = [self.router.url if self.router else None]
            dist.broadcast_object_list(box, src=0)
            self.router_url = box[0]
        else:
            self.router_url = self.router.url if self.router else None

    def _probe_external(self, timeout: float) -> None:
        """--rollout-external servers run already: each must answer /health within `timeout` s; the ones that do not
        answer at once are named in one line while they are waited for, and one still silent is an EngineDeadError."""
        late = [(s, err) for s in self.servers if (err := self._health_error(s, min(2.0, timeout))) is not None]
        if not late:
            return
        from polyrl.metrics import notice
        notice(f"waiting for --rollout-external engine{'s' * (len(late) > 1)} {', '.join(s.url for s, _ in late)} to "
               f"answer /health, up to {timeout:g} s (--rollout-external-startup-timeout)")
        deadline = time.monotonic() + timeout
        while late:
            if time.monotonic() > deadline:
                s, err = late[0]
                raise EngineDeadError(f"--rollout-external {s.name} did not answer /health within {timeout:g} s "
                                      f"(--rollout-external-startup-timeout): {err} (is it running, and reachable from "
                                      "this host?)")
            time.sleep(0.5)
            late = [(s, err) for s, _ in late if (err := self._health_error(s, 5.0)) is not None]

    def _health_error(self, s: Server, timeout: float) -> str | None:
        try:
            self.http.call(s.url, "/health", timeout=timeout)
            return None
        except (EngineHTTPError, TimeoutError) as err:
            return str(err)

    def _launch_router(self, port: int | None = None):
        """The sglang-router in front of every server (rank 0), ready once it routes to all of them; `port`: the one a
        dead router held, so that every rank keeps its address."""
        from polyrl.rollout.router import launch_router
        e = self.cfg.engines
        return launch_router([s.url for s in self.servers], policy=e.sglang_router_policy, api_key=self.api_key,
                             log_path=self.router_log, timeout=e.rollout_engine_startup_timeout, port=port)

    def _launch(self, cfg: Config, device: str, n: int, log_dir: str) -> list[Server]:
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"):
            env.pop(k, None)  # a server is not a rank of the trainer's job
        plan = plan_here(cfg)  # the layout validation checked: engine GPUs, and whether they are the trainer's
        gpus, self.shares_devices = [list(g) for g in plan.engine_devices], plan.shared
        if any(gpus):
            log.warning("rollout engines on GPUs %s (%s)", gpus, "shared with the trainer" if plan.shared else "their own")
        self._launch_env = (env, gpus)
        self.servers = [self._start_one(k, cfg, device, log_dir) for k in range(n)]
        return self.servers

    def _start_one(self, k: int, cfg: Config, device: str, log_dir: str) -> Server:
        """Engine k's server process, on a port free now."""
        env, gpus = self._launch_env
        port = free_port()
        key_file, key_env = launch_secret(cfg, self.kind, self.api_key, os.path.join(log_dir, f"engine{k}.sglang.yaml"))
        s = Server(k, f"http://127.0.0.1:{port}", cmd=server_command(cfg, self.kind, port, device, sglang_config=key_file),
                   env={**env, **key_env, **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus[k]))} if gpus[k] else {})},
                   log_path=os.path.join(log_dir, f"engine{k}.log"))
        s.start()
        if key_file and key_file not in self._secret_files:
            self._secret_files.append(key_file)
        return s

    def _up(self, s: Server, cfg: Config, device: str, log_dir: str, deadline: float, attempts: int = 3) -> Server:
        """A launched server once it answers /health, or still starting at `deadline` (every rank then waits for it
        with the whole startup timeout). The port free_port() found can be taken by another process before the server
        binds it (SGLang binds after loading the model): a server that exits saying so is started again on another port,
        `attempts` starts in all; any other exit, or the startup timeout, is the EngineDeadError as before."""
        startup = cfg.engines.rollout_engine_startup_timeout
        attempt = 1
        while True:
            wait = max(0.0, min(startup, deadline - time.monotonic()))
            try:
                self._wait_healthy(s, wait)
                return s
            except EngineDeadError:
                if not s.exited():  # still starting: every rank waits for it next, unless its whole timeout is spent
                    if wait < startup:
                        return s
                    raise
                if attempt == attempts or "already in use" not in s.said():
                    raise
            log.warning("%s: its port was taken before it could bind it; starting it again on another port", s.name)
            s = self._start_one(s.index, cfg, device, log_dir)
            attempt += 1

    def _wait_healthy(self, s: Server, timeout: float) -> None:
        wait_healthy(s, self.http, timeout)
        s.alive, s.failures = True, 0

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[list | None] | None = None, watch: GenerateWatch | None = None) -> list[Sample]:
        """images[i]: prompt i's images, sent as SGLang's `image_data` (data URLs); the samples carry the pixel inputs
        the trainer recomputes log-probs with, made here by the model's processor. watch: told of each sample as its
        answer arrives; once it stops, every request still out is aborted (/abort_request by rid, on every server) and
        comes back with the tokens it generated (finish reason "abort")."""
        data, mms = self._image_data(prompts, images)
        base = params.seed if params.seed is not None else random.getrandbits(62)
        jobs = []  # (prompt index, first sample index, n, seed)
        for i in range(len(prompts)):
            if self.split_samples or params.stop_lengths is not None:  # a stop length is one sample's
                jobs += [(i, j, 1, sample_seed(params, base, i, j)) for j in range(params.n)]
            else:
                jobs.append((i, 0, params.n, prompt_seed(params, base, i)))
        attempts = self._max_attempts()
        # each attempt may wait for a restart (startup timeout) before its request (request timeout)
        budget = (self.request_timeout + (self.cfg.engines.rollout_engine_startup_timeout if self.fault_tolerant else 0)) \
            * attempts + 60
        samples: list[Sample] = [None] * (len(prompts) * params.n)  # type: ignore[list-item]
        tag = secrets.token_hex(6)
        rids = [f"polyrl-{tag}-{k}" for k in range(len(jobs))] if watch is not None else [None] * len(jobs)
        out_rids = set(r for r in rids if r is not None)  # requests not answered yet (the ones a stop aborts)

        stopped: asyncio.Event | None = None  # set on the client's loop when an answer stops the watch

        def place(k: int, got: list[dict]) -> list[dict]:
            i, j, n, _ = jobs[k]
            for m, o in enumerate(got):
                s = samples[i * params.n + j + m] = self._to_sample(prompts[i], i, o)
                s.multimodal = mms[i]
                mark_forced(s, params.stop_length_of(i, j + m))
                if watch is not None and s.finish_reason != "abort":
                    watch.finished(i * params.n + j + m, s)
            out_rids.discard(rids[k])
            if watch is not None and watch.stop.is_set():
                stopped.set()  # the answer that completed the step: the aborts go out now, not at the next poll
            return got

        async def job(k: int):
            i, j, n, seed = jobs[k]
            stop_len = params.stop_length_of(i, j) if params.stop_lengths is not None else 0
            return place(k, await self._one(prompts[i], params, n, seed, data[i], max_new=params.max_new_tokens_of(i),
                                            stop_length=stop_len, rid=rids[k], watch=watch))

        async def all_jobs():
            nonlocal stopped
            stopped = asyncio.Event()
            aborter = asyncio.ensure_future(self._abort_on_stop(watch, out_rids, stopped)) if watch is not None else None
            try:
                return await asyncio.gather(*(job(k) for k in range(len(jobs))))
            finally:
                if aborter is not None:
                    aborter.cancel()
        self.http.run(all_jobs(), timeout=budget)
        return samples

    async def _abort_on_stop(self, watch: GenerateWatch, out_rids: set, stopped: asyncio.Event) -> None:
        """Once the watch stops: /abort_request for every request still out, on every live server (behind the router
        too: a server that does not hold a rid ignores it), again every 0.5 s for any that had not reached its server.
        An answer that stops the watch sets `stopped` at once; a stop from another thread (a group filter's scorer) is
        seen within 20 ms."""
        while not watch.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopped.wait(), 0.02)
        urls = [s.url for s in self.servers if s.alive] or ([self.router_url] if self.router_url else [])
        while out_rids:
            calls = [self.http.request(u, "/abort_request", {"rid": r}, timeout=10) for r in list(out_rids) for u in urls]
            for res in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(res, EngineHTTPError):
                    log.debug("abort_request failed: %s", res)
            self._stats["rollout/abort_requests"] += len(calls)
            await asyncio.sleep(0.5)

    def _image_data(self, prompts: list[list[int]], images: list[list | None] | None) -> tuple[list, list]:
        """(image_data per prompt: a list of data URLs or None, pixel inputs per prompt or None)."""
        if images is None or all(x is None for x in images):
            return [None] * len(prompts), [None] * len(prompts)
        from polyrl.multimodal import VisionProcessor, image_data_url
        if self._processor is None:
            self._processor = VisionProcessor.from_pretrained(self.cfg.model.hf_checkpoint, self.tokenizer)
            if self._processor is None:
                raise ValueError(f"image prompts: {self.cfg.model.hf_checkpoint} is not a vision-language model")
        data, mms = [], []
        for ids, imgs in zip(prompts, images):
            mm = self._processor.pixel_inputs(imgs) if imgs else None
            if mm is not None:
                self._processor.check(ids, mm["image_grid_thw"])
            data.append([image_data_url(x) for x in imgs] if imgs else None)
            mms.append(mm)
        return data, mms

    def _max_attempts(self) -> int:
        return 2 * len(self.servers) + 1 if self.fault_tolerant else 1

    def _payload(self, prompt: list[int], p: SamplingParams, n: int, seed: int, image_data: list | None = None,
                 max_new: int | None = None, stop_length: int = 0, rid: str | None = None) -> dict:
        sp = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
              "max_new_tokens": max_new if max_new is not None else p.max_new_tokens,
              "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids), "n": n, "sampling_seed": seed,
              "no_stop_trim": True, "skip_special_tokens": True}
        if stop_length:
            from polyrl.rollout.server import STOP_LENGTH_KEY
            sp[STOP_LENGTH_KEY] = stop_length
        out = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}
        if rid is not None:
            out["rid"] = rid
        if image_data:  # SGLang's form for one request: its images in order; input_ids hold their expanded pads
            out["image_data"] = image_data
        if p.return_routed_experts:
            out["return_routed_experts"] = True
        if p.top_logprobs:
            out["top_logprobs_num"] = p.top_logprobs
        return out

    async def _one(self, prompt: list[int], params: SamplingParams, n: int, seed: int,
                   image_data: list | None = None, max_new: int | None = None, stop_length: int = 0,
                   rid: str | None = None, watch: GenerateWatch | None = None) -> list[dict]:
        payload = self._payload(prompt, params, n, seed, image_data, max_new, stop_length, rid)
        last: Exception | None = None
        stopped = watch is not None and watch.stop.is_set
        for attempt in range(self._max_attempts()):
            if stopped and stopped():  # stopped before it was (re)sent: nothing generated
                return [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}
                        for _ in range(n)]
            s = None if self.router_url else await self._pick()
            url = self.router_url or s.url
            task = asyncio.ensure_future(self._generate_when_free(url, payload))
            if s is not None:  # no await between the pick and here: a server marked down meanwhile cancels this task
                s.outstanding += 1
                s.inflight.add(task)
            try:
                try:
                    out = await task
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # the whole generate is being cancelled
                    raise EngineHTTPError(url, "/generate", "cancelled: its engine was marked down (exited, or no "
                                          "answer to /health) while the request was in flight") from None
                outs = out if isinstance(out, list) else [out]
                if any(o.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort" for o in outs):
                    if stopped and stopped():  # our own stop: the tokens so far are the answer
                        return outs
                    raise EngineHTTPError(url, "/generate", "request aborted by the server")
                return outs
            except EngineHTTPError as err:
                if err.status is not None and 400 <= err.status < 500 and err.status not in (408, 429):
                    raise  # our request is wrong: retrying elsewhere cannot help
                last = err
                self._stats["rollout/retries"] += 1
                self._failed(s, err)
            finally:
                if s is not None:
                    s.outstanding -= 1
                    s.inflight.discard(task)
        raise EngineDeadError(f"a /generate request failed on every attempt ({self._max_attempts()}); last error: {last}")

    async def _generate_when_free(self, url: str, payload: dict):
        """POST /generate; a server that answers 429 (full: its --max-running-requests samples are queued or running)
        is asked again after a backoff (0.05 s doubling to 1 s), within one --rollout-request-timeout: busy is not dead."""
        if url == self.router_url:
            await self._router_back()
        deadline = time.monotonic() + self.request_timeout
        wait = 0.05
        while True:
            try:
                return await self.http.request(url, "/generate", payload, timeout=max(1.0, deadline - time.monotonic()))
            except EngineHTTPError as err:
                if err.status != 429 or time.monotonic() + wait > deadline:
                    raise
                self._stats["rollout/busy_retries"] += 1
                await asyncio.sleep(wait * (0.5 + random.random()))  # jitter: clients refused together spread out
                wait = min(1.0, 2 * wait)

    async def _pick(self) -> Server:
        """Least outstanding requests among live servers holding the current weights. With fault tolerance,
        re-sends the current weights to a live server that lacks them (a restarted one) and waits (bounded by
        --rollout-engine-startup-timeout) while servers are being restarted or may come back."""
        deadline = time.monotonic() + self.cfg.engines.rollout_engine_startup_timeout
        while True:
            down = [s for s in self.servers if not s.alive]
            if down and not self.fault_tolerant:
                raise EngineDeadError(f"{down[0].name} is down (failed its health check or exited). Last log lines:\n"
                                      f"{down[0].tail()}\n(--use-fault-tolerance re-sends requests and restarts engines)")
            ready = [s for s in self.servers if s.alive and s.version == self.version]
            if ready:
                return min(ready, key=lambda s: (s.outstanding, s.index))
            stale = [s for s in self.servers if s.alive and not s.restarting]
            if stale and self.fault_tolerant and self.rank == 0 and self._weight_source is not None:
                await asyncio.to_thread(self._bring_current, stale[0])
                continue
            if not self.fault_tolerant or time.monotonic() > deadline or not self._may_recover():
                states = "; ".join(f"{s.name}: {'up' if s.alive else 'down'}, weights v{s.version}" for s in self.servers)
                raise EngineDeadError(f"no engine can serve weights v{self.version}: {states}")
            await asyncio.sleep(0.2)

    def _may_recover(self) -> bool:
        """Whether a server may yet serve the current weights without this rank doing anything: one is being
        restarted, or rank 0 restarts and re-syncs them (other ranks), or an external one may come back."""
        return self.rank != 0 or any(s.restarting or (not s.cmd and not s.alive) for s in self.servers)

    def _failed(self, s: Server | None, err: Exception) -> None:
        if s is None:  # behind the router: it retries on its workers; health checks find the dead one
            self._router_failed(err)
            return
        if not self.fault_tolerant:
            s.alive = False
            raise EngineDeadError(f"{s.name} failed: {err}. Last log lines:\n{s.tail()}\n"
                                  "(--use-fault-tolerance re-sends its requests to the other engines and restarts it)") from None
        self._mark_down(s, str(err))

    # ---- the router ----------------------------------------------------------------------------------
    def _router_name(self) -> str:
        return self.router.name if self.router else f"sglang-router ({self.router_url}, log {self.router_log} on rank 0)"

    def _router_failed(self, err: Exception) -> None:
        """A request through the sglang-router failed. Without fault tolerance a RouterDeadError names the router, its
        log and whether it exited; with it, rank 0 checks the router and restarts one that exited or hung (requests
        wait for that in _router_back), and the others wait for it to answer again."""
        r = self.router
        exited = r is not None and r.proc.poll() is not None
        if not self.fault_tolerant:
            why = f"exited with code {r.proc.returncode}" if exited else f"failed: {err}"
            raise RouterDeadError(f"{self._router_name()} {why} (--use-fault-tolerance restarts a dead router and "
                                  "re-sends its requests)") from None
        if self._router_gave_up:
            raise RouterDeadError(f"{self._router_name()} died and could not be restarted: {self._router_gave_up}") from None
        if r is None:
            self._router_lost = True
        else:
            self._restart_router_soon()

    def _restart_router_soon(self) -> concurrent.futures.Future:
        """One check-and-restart of the router at a time; every request that failed meanwhile waits for the same one."""
        with self._lock:
            if self._router_restart is None or self._router_restart.done():
                self._router_restart = concurrent.futures.Future()
                threading.Thread(target=self._restart_router, args=(self._router_restart,), name="polyrl-router-restart",
                                 daemon=True).start()
            return self._router_restart

    def _restart_router(self, done: concurrent.futures.Future) -> None:
        """Rank 0: a router that exited, or that does not answer /health within 5 s (then killed), is started again on
        its port; the engines it routes to are alive and keep their addresses."""
        r = self.router
        try:
            if r.proc.poll() is None:
                try:
                    self.http.call(r.url, "/health", timeout=5.0)
                    return  # alive: the failure was a worker's, which the router and the health checks handle
                except (EngineHTTPError, TimeoutError):
                    r.proc.kill()
                    r.proc.wait(10)
            if self._closed:
                return
            log.warning("%s exited with code %s; starting it again on its port (the engines are up)", r.name,
                        r.proc.returncode)
            port = int(r.url.rsplit(":", 1)[1])
            self.router = self._launch_router(port)
            self._stats["rollout/router_restarts"] += 1
            log.warning("%s restarted", self.router.name)
        except Exception as err:  # the next request through it names the router and this
            self._router_gave_up = str(err).splitlines()[0]
            log.error("%s could not be restarted: %s", r.name, err)
        finally:
            done.set_result(None)

    async def _router_back(self) -> None:
        """Before a request through the router: the restart under way (rank 0), or, on another rank after a failure,
        until the router answers /health again (rank 0 restarts it at its address), within
        --rollout-engine-startup-timeout."""
        fut = self._router_restart
        if fut is not None and not fut.done():
            await asyncio.wrap_future(fut)
        elif self._router_lost:
            deadline = time.monotonic() + self.cfg.engines.rollout_engine_startup_timeout
            while time.monotonic() < deadline:
                try:
                    await self.http.request(self.router_url, "/health", timeout=5.0)
                    self._router_lost = False
                    return
                except EngineHTTPError:
                    await asyncio.sleep(0.5)

    def _mark_down(self, s: Server, why: str) -> None:
        """s is down: its in-flight requests are cancelled (each is re-sent, or names s without fault tolerance)
        and, with fault tolerance, a launched one is restarted."""
        restart = self.fault_tolerant and s.cmd is not None and self.rank == 0
        with self._lock:
            was_alive, s.alive = s.alive, False
            # before its requests are cancelled: a re-sent one then waits for the restart instead of giving up
            restart = restart and was_alive and not s.restarting and not self._closed
            if restart:
                s.restarting = True
        if not was_alive:
            return
        self._stats["rollout/engines_lost"] += 1
        if s.inflight:
            self.http.submit(self._cancel_inflight(s))
        if self.fault_tolerant:
            log.warning("%s is down (%s); re-sending its requests%s", s.name, why, " and restarting it" if s.cmd else "")
            if restart:
                threading.Thread(target=self._restart, args=(s,), name=f"polyrl-restart-{s.index}", daemon=True).start()
        else:
            log.error("%s is down (%s)", s.name, why)

    @staticmethod
    async def _cancel_inflight(s: Server) -> None:
        for task in list(s.inflight):
            task.cancel()

    def lost_during_sync(self, urls: list[str], err: str, since: int) -> list[str]:
        """Which of these servers died or hung during a weight sync that failed with `err` (down, restarted
        since the push began at membership `since`, exited, or no /health answer within 5 s). With fault
        tolerance they are marked down (and restarted, then re-sent the weights); without it the first one
        is an EngineDeadError naming it and its log."""
        lost = [s for s in self.servers if s.url in urls and (not s.alive or s.restarting or s.born > since or s.exited()
                                                              or not self._answers(s, 5.0))]
        if lost and not self.fault_tolerant:
            s = lost[0]
            why = f"exited with code {s.proc.returncode}" if s.exited() else "stopped answering"
            raise EngineDeadError(f"{s.name} {why} during the weight sync "
                                  "(--use-fault-tolerance restarts it and re-sends the weights)")
        for s in lost:
            if s.born <= since:  # a restarted one is current already, or is being brought current
                self._mark_down(s, f"lost during the weight sync: {err}")
        return [s.url for s in lost]

    def _answers(self, s: Server, timeout: float) -> bool:
        try:
            self.http.call(s.url, "/health", timeout=timeout)
            return True
        except (EngineHTTPError, TimeoutError):
            return False

    @staticmethod
    def _to_sample_fields(o: dict) -> tuple[list[int], list[float], str]:
        mi = o["meta_info"]
        ids = list(o["output_ids"])
        # a request aborted while still queued comes back with no tokens and (as from SGLang) no log-prob field
        raw = mi.get("output_token_logprobs", [] if not ids else None)
        if raw is None or len(raw) != len(ids):
            raise ValueError(f"a /generate answer with {len(ids)} output ids carries "
                             f"{'no' if raw is None else len(raw)} output_token_logprobs (return_logprob was asked)")
        lps = [float(x[0]) for x in raw]
        kind = (mi["finish_reason"] or {}).get("type")
        return ids, lps, (kind if kind in ("stop", "abort") else "length")

    def _to_sample(self, prompt: list[int], i: int, o: dict) -> Sample:
        ids, lps, finish = self._to_sample_fields(o)
        v = str(o["meta_info"].get("weight_version", ""))
        routes = o["meta_info"].get("routed_experts")
        if routes is not None:
            routes = decode_routed_experts(routes, len(prompt) + len(ids), *self._route_shape())
        tops = o["meta_info"].get("output_top_logprobs")
        if tops is not None:  # SGLang's per token [[logprob, token id, text or null], ...]
            if len(tops) != len(ids):
                raise ValueError(f"a /generate answer with {len(ids)} output ids carries {len(tops)} output_top_logprobs")
            tops = [[(int(x[1]), float(x[0])) for x in pos] for pos in tops]
        return Sample(prompt_ids=list(prompt), response_ids=ids, rollout_logprobs=lps, finish_reason=finish, group_index=i,
                      response=self.tokenizer.decode(ids, skip_special_tokens=True), weight_version=int(v) if v.isdigit() else None,
                      routed_experts=routes, top_logprobs=tops)

    def _route_shape(self) -> tuple[int, int]:
        """(num_hidden_layers, experts per token) of the served model: how routed_experts reshapes."""
        if getattr(self, "_routes_lk", None) is None:
            from transformers import AutoConfig
            text = AutoConfig.from_pretrained(self.cfg.model.hf_checkpoint).get_text_config()
            self._routes_lk = (int(text.num_hidden_layers), int(text.num_experts_per_tok))
        return self._routes_lk

    # ---- health and restarts ---------------------------------------------------------------------
    def _health_loop(self) -> None:
        interval = self.cfg.engines.rollout_health_check_interval
        # a busy CPU server answers /health late: 1-10 s, and a third of the request timeout, which bounds
        # detection anyway for a server with requests in flight
        timeout = min(max(self.request_timeout / 3, 1.0), 10.0)
        while not self._stop_health.wait(interval):
            if self.router is not None and self.fault_tolerant and not self._closed and self.router.proc.poll() is not None:
                self._restart_router_soon()  # before the next request finds it dead
            for s in list(self.servers):
                if s.restarting or self._closed:
                    continue
                ok = not s.exited() and self._answers(s, timeout)
                if ok:
                    s.failures = 0
                    # an external server or another rank's view of a launched one: back, or given new weights by rank 0
                    if not s.cmd and self.fault_tolerant and (not s.alive or s.version != self.version):
                        self._refresh_version(s)
                    continue
                s.failures += 1
                if s.alive and (s.exited() or s.failures >= 2):
                    self._mark_down(s, f"exited with code {s.proc.returncode}" if s.exited() else
                                    f"no answer to /health within {timeout:.3g} s, twice")

    def _refresh_version(self, s: Server) -> None:
        try:
            info = self.http.call(s.url, "/get_server_info", timeout=10)
            s.version = int(info.get("weight_version", 0)) if isinstance(info, dict) else None
            s.alive = True
        except (EngineHTTPError, TimeoutError, ValueError):
            pass

    def _restart(self, s: Server) -> None:
        try:
            if not s.exited() and not self._answers(s, 2.0):
                s.kill()  # hung (stopped, wedged): SIGTERM would wait for it to run again
            s.stop(grace=5)
            s.start()
            wait_healthy(s, self.http, self.cfg.engines.rollout_engine_startup_timeout)
            with self._lock:
                # it loaded --hf-checkpoint: without a weight source that is current only before the first sync
                s.version = None if self._weight_source is not None or self.version != 0 else 0
                s.failures = 0
                self.membership += 1
                s.born = self.membership
            self._stats["rollout/restarts"] += 1
            if self._weight_source is not None:
                self._bring_current(s)  # before it serves: the current weights, to it alone
            s.alive = True
            log.warning("%s restarted (weights v%s)", s.name, s.version)
        except Exception as err:  # the run goes on with the others; the next generate names what is down
            log.error("%s could not be restarted: %s", s.name, err)
        finally:
            s.restarting = False

    def _bring_current(self, s: Server) -> None:
        """Re-send the weight source's weights to s alone (rank 0): a restarted server holds --hf-checkpoint's."""
        with self._resync_lock:
            if self._weight_source is None or (s.version is not None and s.version == self.version):
                return
            source, transport = self._weight_source
            try:
                v = transport.push_to(source, self, [s.url])
            except Exception as err:  # it is marked down and restarted again; requests go elsewhere meanwhile
                log.error("re-sending the weights to %s failed: %s", s.name, err)
                self._mark_down(s, f"re-sending the weights failed: {err}")
                return
            self._stats["rollout/resyncs"] += 1
            log.warning("%s re-sent the current weights (v%d)", s.name, v)

    # ---- what the loop and the transports call ---------------------------------------------------
    def update_weights(self, weights, version: int) -> None:
        raise TypeError("engine servers receive weights through --weight-sync distributed or disk, not in-process tensors")

    def set_weight_source(self, source, transport) -> None:
        """How a restarted server gets the current weights: `source()` returns (stream of (HF name, tensor),
        version), pushed to it alone by `transport.push_to(source, self, [url])` on rank 0 (no collective: a
        host copy, or a live export only where nothing else runs on the trainer meanwhile)."""
        self._weight_source = (source, transport) if source is not None else None

    def weight_sync_urls(self) -> list[str]:
        """Servers that must receive the next weights: every live one (a restarted one once it holds the current ones)."""
        return [s.url for s in self.servers if s.alive]

    def weights_pushed(self, version: int, urls: list[str] | None = None) -> None:
        with self._lock:
            self.version = version
            for s in self.servers:
                if urls is None or s.url in urls:
                    s.version = version

    def sleep(self) -> None:
        if self.shares_devices:  # trainer and engines take turns on the same GPUs
            self.http.call_all(self.weight_sync_urls(), "/release_memory_occupation", {}, timeout=120)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        if self.shares_devices:
            body = {} if tags is None else {"tags": sorted(wake_tags(tags))}
            self.http.call_all(self.weight_sync_urls(), "/resume_memory_occupation", body, timeout=120)

    def stats(self) -> dict[str, float]:
        """Counters since the last call (retries, restarts), for the step's metrics."""
        out = {k: float(v) for k, v in self._stats.items()}
        out["rollout/engines_up"] = float(sum(s.alive for s in self.servers))
        self._stats.clear()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_stop_health"):
            self._stop_health.set()
        if self.router is not None:
            self.router.stop()
        for s in self.servers:
            s.stop()
        for path in self._secret_files:
            try:
                os.remove(path)
            except OSError:
                pass
        self.http.close()
