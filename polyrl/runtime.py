"""Assembling the pieces a command needs from the config: process group, device, tokenizer,
train backend, rollout engine, datasets, rewards. Each component gets its own section."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from polyrl.backends.base import load_backend_class
from polyrl.backends.parallel_dims import init_distributed
from polyrl.config import Config
from polyrl.data import PromptDataset, load_records
from polyrl.rollout.base import InProcessEngine, load_engine_class
from polyrl.rollout.custom import generate_with, resolve_generate_fn
from polyrl.rollout.sampling import cut_to_budget
from polyrl.types import Sample, SamplingParams, TrainBatch

log = logging.getLogger("polyrl")


def resolve_device(cfg: Config) -> str:
    if cfg.cluster.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.cluster.device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Dist:
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

    def _reduce(self, values: list[float], op) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()


def setup(cfg: Config) -> tuple[str, Dist]:
    device = resolve_device(cfg)
    init_distributed(device, cfg.cluster.dist_backend)
    seed_everything(cfg.cluster.seed)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    return device, Dist(dist.get_rank(), dist.get_world_size())


def build_backend(cfg: Config, device: str, *, total_steps: int, need_ref: bool, need_teacher: bool = False):
    cls = load_backend_class(cfg.cluster.train_backend)
    extra = {"megatron_cfg": cfg.megatron} if cfg.cluster.train_backend == "megatron" else {}  # only megatron reads it
    if need_teacher:  # --opd-teacher-load: the FSDP and Megatron backends build one
        extra["need_teacher"] = True
    return cls(cfg.model, cfg.optimizer, cfg.batch, device=device, total_steps=total_steps, need_ref=need_ref,
               seed=cfg.cluster.seed, **extra)


def build_critic(cfg: Config, device: str, *, total_steps: int):
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


def build_engine(cfg: Config, device: str):
    """The one engine object the loop talks to: in this process, or N servers behind a client
    (--debug-train-only: none, its samples come from files)."""
    if cfg.debug.train_only:
        from polyrl.debug_rollout import NoEngine
        return NoEngine()
    name = "external" if cfg.engines.rollout_external else cfg.rollout.rollout_engine
    engine = load_engine_class(name).from_config(cfg, device)
    if isinstance(engine, InProcessEngine):  # the trainer allocates from the same CUDA caching allocator
        engine.shares_allocator = True
    return engine


def weight_sync_mode(cfg: Config) -> str:
    mode = cfg.engines.weight_sync
    if mode == "auto":
        return "tensor" if engine_in_process(cfg) else "distributed"
    return mode


def engine_in_process(cfg: Config) -> bool:
    return cfg.rollout.rollout_engine == "embedded" and not cfg.engines.rollout_external


def build_transport(cfg: Config, device: str, engine=None):
    """How the HF-named stream reaches the engine: decided once, here (config.validate checked the pairing).
    Servers that share the trainer's GPUs (engine.colocated) take the group over gloo: NCCL refuses two
    ranks on one GPU."""
    from polyrl.weight_sync import InMemoryTransport
    mode, bucket, e = weight_sync_mode(cfg), cfg.model.update_weight_buffer_size, cfg.engines
    if mode == "tensor":
        return InMemoryTransport(bucket)
    if mode == "distributed":
        from polyrl.weight_sync.distributed import DistributedTransport
        group_device = "cpu" if getattr(engine, "colocated", False) else device
        return DistributedTransport(bucket, device=group_device, check_equal=e.check_weight_update_equal,
                                    timeout_s=e.rollout_request_timeout)
    from polyrl.weight_sync.distributed import DiskTransport
    return DiskTransport(bucket, check_equal=e.check_weight_update_equal, timeout_s=e.rollout_request_timeout,
                         hf_checkpoint=cfg.model.hf_checkpoint)


def embedded_engine_kwargs(cfg: Config) -> dict:
    """The embedded engine's settings (also what `polyrl serve` runs)."""
    r = cfg.rollout
    return dict(max_batch=r.rollout_batch_generate, gpu_engine=r.rollout_gpu_engine, mem_fraction=r.rollout_mem_fraction,
                cuda_graph=r.rollout_cuda_graph)


def load_tokenizer(cfg: Config):
    return AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)


def prompt_dataset(cfg: Config, tokenizer, spec: str, *, shuffle: bool) -> PromptDataset:
    d, ctx = cfg.data, cfg.rollout.rollout_max_context_len
    records = load_records(spec, d.input_key, d.label_key, d.metadata_key)
    # a prompt must leave room for one response token in the context budget (slime's rule too)
    max_prompt_len = min((x for x in (d.rollout_max_prompt_len, ctx - 1 if ctx else None) if x is not None), default=None)
    return PromptDataset(records, tokenizer, max_prompt_len=max_prompt_len,
                         apply_chat_template=d.apply_chat_template, shuffle=shuffle, seed=cfg.cluster.seed)


def sampling_params(cfg: Config, *, seed: int, eval_mode: bool = False) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.eval_temperature if eval_mode else r.rollout_temperature,
        top_p=1.0 if eval_mode else r.rollout_top_p, top_k=-1 if eval_mode else r.rollout_top_k,
        max_new_tokens=r.rollout_max_response_len, stop=list(r.rollout_stop), stop_token_ids=list(r.rollout_stop_token_ids),
        n=1 if eval_mode else r.n_samples_per_prompt, seed=seed,
        return_routed_experts=not eval_mode and (cfg.model.return_routed_experts or cfg.model.use_rollout_routing_replay))


def rollout(engine, items: list, params: SamplingParams, max_context_len: int | None = None) -> list[Sample]:
    """One engine call for every prompt of `items`; samples past --rollout-max-context-len are cut to it (engines
    take one max_new_tokens for the whole call, so a long prompt's sample may have generated past its budget)."""
    version = getattr(engine, "version", None)  # in-process engines: no update can land during their generate
    samples = engine.generate([ids for ids, _ in items], params)
    for s in samples:
        if cut_to_budget(s, params.max_new_tokens, max_context_len):
            s.response = engine.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        if s.weight_version is None:  # engine servers report the version each response was generated with
            s.weight_version = version
        rec = items[s.group_index][1]
        s.prompt, s.label, s.metadata = rec.prompt if isinstance(rec.prompt, str) else str(rec.prompt), rec.label, rec.metadata
    return samples


def to_train_batch(samples: list[Sample]) -> TrainBatch:
    # one tensor per field for the whole batch, split into per-sample views (not one tensor per sample and field)
    lens, rlens = [s.num_tokens for s in samples], [len(s.response_ids) for s in samples]

    def flat(rows, dtype, sizes):
        return list(torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype).split(sizes))

    ids = flat((s.prompt_ids + s.response_ids for s in samples), torch.long, lens)
    if all(s.loss_mask is None for s in samples):
        mask = list(torch.ones(sum(rlens), dtype=torch.float32).split(rlens))
    else:
        mask = flat((s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids) for s in samples),
                    torch.float32, rlens)
    routes = [s.routed_experts for s in samples]  # MoE: the engine's routes (R3), when every sample has them
    return TrainBatch(ids, [len(s.prompt_ids) for s in samples], {
        "loss_mask": mask,
        "rollout_logprobs": flat((s.rollout_logprobs for s in samples), torch.float32, rlens),
    }, rollout_routed_experts=routes if samples and all(r is not None for r in routes) else None)


def generate(cfg: Config, engine, tokenizer, items: list, params: SamplingParams) -> list[Sample]:
    """The rollout of `items`, as training and evaluation both run it: through the --custom-generate-function-path
    when one is set (multi-turn / tools), else one engine call; held to --max-turns and --rollout-max-context-len."""
    r = cfg.rollout
    if r.custom_generate_function_path:
        return generate_with(resolve_generate_fn(r.custom_generate_function_path), r.custom_generate_function_path, engine,
                             tokenizer, items, params, timeout=cfg.engines.rollout_request_timeout,
                             concurrency=r.custom_generate_concurrency, max_turns=r.max_turns,
                             max_context_len=r.rollout_max_context_len)
    return rollout(engine, items, params, r.rollout_max_context_len)


def evaluate(cfg: Config, engine, dataset: PromptDataset, rewards, d: Dist) -> dict[str, float]:
    """Greedy (or --eval-temperature) accuracy on every prompt of a held-out set, generated the way training
    generates (a custom generate function included: tool use is measured as it is trained)."""
    items = [dataset[i] for i in range(len(dataset))]
    per = -(-len(items) // d.world)
    mine = items[d.rank * per:(d.rank + 1) * per]
    params = sampling_params(cfg, seed=cfg.rollout.rollout_seed, eval_mode=True)
    samples = generate(cfg, engine, engine.tokenizer, mine, params) if mine else []
    m = rewards.score(samples) if samples else {}
    custom = bool(cfg.rollout.custom_generate_function_path)  # its samples count their engine calls in "turns"
    correct, total, length, turns = d.sum([sum(s.reward > 0.5 for s in samples), len(samples),
                                           sum(len(s.response_ids) for s in samples),
                                           sum(s.metadata["turns"] if custom else 1 for s in samples)])
    return {"eval/accuracy": correct / max(total, 1), "eval/response_len": length / max(total, 1), "eval/n": total,
            "eval/turns": turns / max(total, 1),
            "eval/reward_errors": m.get("reward/errors", 0.0), "eval/reward_timeouts": m.get("reward/timeouts", 0.0)}
