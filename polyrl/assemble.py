"""Builds the parts a command needs from the config and the placement plan, once: process group, tokenizer, data,
train backend, rollout engine, weight transport, rewards and the step parts. Nothing here runs a step.

Debug modes are substitutions made here: --debug-train-only gets a FileRollout, no engine and no transport;
--debug-rollout-only a ScoringLearner and a FrozenHandoff. --agent-function-path hands the rollout and the evaluator an
AgentRunner (agents against a loopback OpenAI-compatible gateway) and scores with the agents' own rewards."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass

from transformers import AutoTokenizer

from polyrl.backends.base import TrainBackend, load_backend_class
from polyrl.checkpoint import export_hf, load_checkpoint
from polyrl.config import Config, ConfigError
from polyrl.data import PromptDataset, load_records
from polyrl.debug_rollout import NoEngine, rollout_files
from polyrl.dist import Dist, setup
from polyrl.metrics import MetricsLogger, banner, closing_line, logger_from_config, notice
from polyrl.placement import Plan, plan_here
from polyrl.rewards import RewardManager
from polyrl.rollout.base import InProcessEngine, RolloutEngine, load_engine_factory
from polyrl.rollout.dynamic_sampling import GroupFilter
from polyrl.step.book import Book, checkpoint_saver
from polyrl.step.cursor import PromptCursor
from polyrl.step.handoff import FrozenHandoff, Handoff
from polyrl.step.learner import Learner, ScoringLearner, minibatches_per_step, needs_reference
from polyrl.step.partial_rollout import BufferedCursor, PartialRollout
from polyrl.step.rollout import EngineRollout, Evaluator, FileRollout, Scorer
from polyrl.weight_sync import FP8Transport, InMemoryTransport, NoTransport, WeightTransport


def build_backend(cfg: Config, device: str, *, total_steps: int, need_ref: bool, need_teacher: bool = False) -> TrainBackend:
    cls = load_backend_class(cfg.cluster.train_backend)
    extra = {"megatron_cfg": cfg.megatron} if cfg.cluster.train_backend == "megatron" else {}  # only megatron reads it
    if need_teacher:  # --opd-teacher-load: the FSDP and Megatron backends build one
        extra["need_teacher"] = True
    return cls(cfg.model, cfg.optimizer, cfg.batch, device=device, total_steps=total_steps, need_ref=need_ref,
               seed=cfg.cluster.seed, **extra)


def build_critic(cfg: Config, device: str, *, total_steps: int) -> TrainBackend:
    """The critic of --advantage-estimator gae: the same backend class in its critic role (--critic-load or the
    actor's weights with a fresh value head), with its own optimizer (--critic-lr, --critic-num-warmup-steps)."""
    o = cfg.optimizer
    lr = o.critic_lr if o.critic_lr is not None else o.lr
    optim = dataclasses.replace(o, lr=lr, min_lr=min(o.min_lr, lr), lr_warmup_steps=o.lr_warmup_steps
                                if o.critic_num_warmup_steps is None else o.critic_num_warmup_steps)
    cls = load_backend_class(cfg.cluster.train_backend)
    extra = {"megatron_cfg": cfg.megatron} if cfg.cluster.train_backend == "megatron" else {}
    return cls(cfg.model, optim, cfg.batch, device=device, total_steps=total_steps, seed=cfg.cluster.seed, role="critic",
               **extra)


def build_engine(cfg: Config, plan: Plan) -> RolloutEngine:
    """The one engine object the loop talks to: in this process, or N servers behind a client
    (--debug-train-only: none, its samples come from files)."""
    if plan.engine == "none":
        return NoEngine()
    engine = load_engine_factory(plan.engine)(cfg, plan.device)
    if isinstance(engine, InProcessEngine):  # the trainer allocates from the same CUDA caching allocator
        engine.shares_allocator = True
    return engine


def build_transport(cfg: Config, plan: Plan) -> WeightTransport:
    """How the HF-named stream reaches the engine, as the plan says; --rollout-quantization fp8 quantizes it on the way."""
    t = _plain_transport(cfg, plan)
    if cfg.rollout.rollout_quantization == "fp8" and plan.transport != "none":
        from transformers import AutoConfig

        from polyrl.weight_sync.quantize import TRANSPOSED_EXPERTS
        model_type = getattr(AutoConfig.from_pretrained(cfg.model.hf_checkpoint), "model_type", None)
        return FP8Transport(t, in_process=plan.transport == "tensor", stacked_experts=model_type not in TRANSPOSED_EXPERTS)
    return t


def _plain_transport(cfg: Config, plan: Plan) -> WeightTransport:
    """The transport the plan names. Servers that share the trainer's GPUs take the
    group over gloo: NCCL refuses two ranks on one GPU."""
    bucket, e = cfg.model.update_weight_buffer_size, cfg.engines
    if plan.transport == "none":
        return NoTransport()
    if plan.transport == "tensor":
        return InMemoryTransport(bucket)
    if plan.transport == "distributed":
        from polyrl.weight_sync.distributed import DistributedTransport
        return DistributedTransport(bucket, device="cpu" if plan.shared else plan.device,
                                    check_equal=e.check_weight_update_equal, timeout_s=e.rollout_request_timeout)
    from polyrl.weight_sync.distributed import DiskTransport
    return DiskTransport(bucket, check_equal=e.check_weight_update_equal, timeout_s=e.rollout_request_timeout,
                         hf_checkpoint=cfg.model.hf_checkpoint)


def engine_needs_first_push(cfg: Config, plan: Plan) -> bool:
    """Whether the engine may hold other weights than --hf-checkpoint's before the first push: external servers (another
    run may have updated them), and an engine that loaded the checkpoint unquantized under --rollout-quantization."""
    return plan.engine == "external" or cfg.rollout.rollout_quantization != "none"


def build_agents(cfg: Config, engine: RolloutEngine, rewards: RewardManager | None):
    """(the AgentRunner of --agent-function-path or None, the reward the Scorer calls: the agents' own numbers first)."""
    if not cfg.rollout.agent_function_path:
        return None, rewards
    from polyrl.rollout.agent import AgentRewards, AgentRunner
    return AgentRunner(cfg, engine), AgentRewards(rewards)


def load_tokenizer(cfg: Config):
    return AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)


def prompt_dataset(cfg: Config, tokenizer, spec: str, *, shuffle: bool) -> PromptDataset:
    d, ctx = cfg.data, cfg.rollout.rollout_max_context_len
    from polyrl.multimodal import VisionProcessor, parse_multimodal_keys
    keys = parse_multimodal_keys(d.multimodal_keys)
    records = load_records(spec, d.input_key, d.label_key, d.metadata_key, multimodal_keys=keys)
    # a prompt must leave room for one response token in the context budget (slime's rule too)
    max_prompt_len = min((x for x in (d.rollout_max_prompt_len, ctx - 1 if ctx else None) if x is not None), default=None)
    processor = VisionProcessor.from_pretrained(cfg.model.hf_checkpoint, tokenizer) if keys else None
    return PromptDataset(records, tokenizer, max_prompt_len=max_prompt_len, apply_chat_template=d.apply_chat_template,
                         shuffle=shuffle, seed=cfg.cluster.seed, processor=processor)


def announce_changed_rates(state: dict, cfg: Config) -> None:
    """A resume at another --lr / --critic-lr than the checkpoint was trained at: the new rate applies (both backends
    set it after the load), and one line says so; the schedule (warmup, decay) goes on from the checkpoint's step."""
    saved = (state.get("config") or {}).get("optimizer") or {}
    for flag, key in (("--lr", "lr"), ("--critic-lr", "critic_lr")):
        was, now = saved.get(key), getattr(cfg.optimizer, key)
        if was is not None and now is not None and was != now:
            notice(f"{flag} {now:g} applies from the resumed step on (the checkpoint was trained at {was:g}); the "
                   "schedule goes on from the checkpoint's step")


def setup_command(cfg: Config, threads_of_work: int = 1) -> tuple[str, Dist]:
    """The process group, seeds and threads of a command: (device, this rank's Dist). threads_of_work: 2 for
    polyrl train --async (the trainer's thread and the rollout's compute at once)."""
    c = cfg.cluster
    return setup(c.device, c.dist_backend, c.seed, c.distributed_timeout_minutes,
                 cpu_optimizer=cfg.model.fsdp_cpu_offload or cfg.megatron.optimizer_cpu_offload,
                 threads_of_work=threads_of_work)


@dataclass
class Parts:
    """What `polyrl train` runs: the step parts, and what they share for start-up and shutdown."""

    cfg: Config
    plan: Plan
    d: Dist
    cursor: PromptCursor
    rollout: EngineRollout | FileRollout | PartialRollout
    learner: Learner | ScoringLearner
    handoff: Handoff
    book: Book
    backend: TrainBackend
    critic: TrainBackend | None
    engine: RolloutEngine
    score: Scorer
    logger: MetricsLogger
    tokenizer: object
    agents: object = None  # polyrl.rollout.agent.AgentRunner of --agent-function-path

    def begin(self) -> int:
        """Resume from --load (backend, critic, data position), hand the engine the trainer's weights where it needs
        them, and run the step-0 eval; returns the first step to train (0-based)."""
        cfg, start = self.cfg, 0
        if cfg.checkpoint.load:
            state = load_checkpoint(cfg.checkpoint.load, self.backend, critic=self.critic)
            start = state["step"]
            self.cursor.restore(state["data"])
            announce_changed_rates(state, cfg)
        self.handoff.start(start, resumed=bool(cfg.checkpoint.load))
        n = cfg.rollout.num_rollout
        if start >= n:  # say so: a run that trains nothing must not look like one that finished
            notice(f"nothing to train: the checkpoint is at step {start}, at or past --num-rollout {n}; raise "
                   "--num-rollout to train on" if cfg.checkpoint.load else "nothing to train: --num-rollout 0 (no RL step runs)")
        elif start:
            notice(f"resuming at step {start + 1} of --num-rollout {n}")
        self.book.start(start)
        return start

    def close(self, *, finished: bool = True) -> None:
        """Stop what the run started (logger, reward workers, launched servers) and write --save-hf."""
        self.book.close()
        self.logger.close()
        self.score.close()
        if self.agents is not None:
            self.agents.close()  # the gateway first: it talks to the engine
        self.engine.close()  # launched servers stop here (and at exit, on an error)
        ck = self.cfg.checkpoint
        if finished and ck.save_hf:
            export_hf(self.backend, ck.save_hf, self.tokenizer, adapter=ck.save_hf_adapter, critic=self.critic)
        if finished and self.d.is_main:
            closing_line(self.cfg)


def assemble(cfg: Config, title: str = "polyrl train") -> Parts:
    plan = plan_here(cfg)
    device, d = setup_command(cfg, threads_of_work=2 if cfg.rollout.async_training else 1)
    r = cfg.rollout
    for flag, n in (("--rollout-batch-size", r.rollout_batch_size), ("--over-sampling-batch-size", r.over_sampling_batch_size)):
        if (n or 0) % d.world:
            raise ConfigError(f"{flag} {n} must be a multiple of the {d.world} ranks (each rank samples whole prompt groups)")
    if r.partial_rollout and d.world > 1:
        raise ConfigError(f"--partial-rollout runs on one trainer rank for now ({d.world} here): each rank's buffer would "
                          "draw a different number of prompts and the data position would part between the ranks")
    if d.is_main:
        banner(cfg, plan.summary())
    tok = load_tokenizer(cfg)
    cursor_cls = BufferedCursor if r.partial_rollout else PromptCursor  # the buffer is part of the data position
    cursor = cursor_cls(prompt_dataset(cfg, tok, cfg.data.prompt_data, shuffle=cfg.data.rollout_shuffle), d,
                          per_draw=r.over_sampling_batch_size or r.rollout_batch_size, source=cfg.data.prompt_data,
                          allow_change=cfg.data.allow_data_change)
    total_steps = r.num_rollout * minibatches_per_step(cfg)
    backend = build_backend(cfg, device, total_steps=total_steps, need_ref=needs_reference(cfg),
                            need_teacher=bool(cfg.model.opd_teacher_load))
    critic = build_critic(cfg, device, total_steps=total_steps) if cfg.algorithm.advantage_estimator == "gae" else None
    engine = build_engine(cfg, plan)
    # held around every engine call: an in-process engine cannot take a weight update under a running generate, so
    # the async loop's rollout thread and its trainer take turns on it
    engine_lock = (threading.Lock() if r.async_training and not engine.concurrent_update else contextlib.nullcontext())
    rc = cfg.reward  # --debug-train-only without a reward flag keeps the rewards saved with the samples
    agents, rewards = build_agents(cfg, engine, RewardManager.from_config(rc) if (rc.rm_type or rc.custom_rm_path or
                                                                                  rc.rm_url) else None)
    score = Scorer(cfg, rewards)
    files = rollout_files(cfg, tok, d.rank, d.world)  # --save/--load-debug-rollout-data
    transport = build_transport(cfg, plan)
    g = cfg.debug
    if g.train_only:
        rollout = FileRollout(files, cursor, score)
    else:
        group_filter = GroupFilter(r.dynamic_sampling_filter_path, d) if r.dynamic_sampling_filter_path else None
        if r.partial_rollout:
            rollout = PartialRollout(cfg, engine, cursor, score, d, engine_lock, group_filter,
                                     saver=files if g.save_debug_rollout_data else None)
        else:
            rollout = EngineRollout(cfg, engine, cursor, score, d, engine_lock, group_filter,
                                    saver=files if g.save_debug_rollout_data else None, agents=agents)
    learner = ScoringLearner(d) if g.debug_rollout_only else Learner(cfg, backend, d, critic)
    handoff_cls = FrozenHandoff if (g.debug_rollout_only or g.train_only) else Handoff
    handoff = handoff_cls(backend, engine, transport, engine_lock, push_at_start=engine_needs_first_push(cfg, plan))
    logger = logger_from_config(cfg, total_steps=r.num_rollout, enabled=d.is_main, title=title)
    evaluate = None
    if cfg.data.eval_prompt_data and cfg.log.eval_interval:
        evaluate = Evaluator(cfg, engine, prompt_dataset(cfg, tok, cfg.data.eval_prompt_data, shuffle=False), score, d,
                             engine_lock, agents=agents)
    book = Book(cfg, d, logger, cursor, engine, evaluate, checkpoint_saver(cfg, backend, critic), device)
    return Parts(cfg, plan, d, cursor, rollout, learner, handoff, book, backend, critic, engine, score, logger, tok, agents)
