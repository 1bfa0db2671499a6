"""FSDP2 train backend on native HuggingFace causal LMs."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

from polyrl import hf_families
from polyrl.cpu_governor import tick as cpu_tick
from polyrl.algorithms.losses import merge_metric
from polyrl.backends.base import LossFn, fewer_blocks, plan_micro_batches, to_device
from polyrl.backends.fsdp.lora import adapters_off, add_lora, merged_weights
from polyrl.backends.fsdp.mtp import mtp_logprobs, mtp_loss, mtp_token_counts, mtp_token_weights
from polyrl.backends.fsdp.parallelize import apply_ac, apply_compile, apply_fsdp
from polyrl.backends.logprobs import chunked_logprobs
from polyrl import multimodal
from polyrl.backends.parallel_dims import ParallelDims
from polyrl.backends.true_on_policy import (block_rows, pack_positions, pin_threads, sequences_logprobs,
                                           sequences_to_device)
from polyrl.weight_sync import WeightExport, direct
from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
from polyrl.types import TrainBatch

log = logging.getLogger(__name__)


def decoder_hidden(lm: nn.Module, input_ids, position_ids, attention_mask, attn_kwargs: dict) -> torch.Tensor:
    """The HF decoder body's last hidden states [B, L, H]."""
    base = getattr(lm, lm.base_model_prefix)
    return base(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                use_cache=False, **attn_kwargs).last_hidden_state


def response_hidden(lm: nn.Module, input_ids, position_ids, attention_mask, gather_idx, attn_kwargs: dict) -> torch.Tensor:
    """The HF decoder body's last hidden states at the positions that predict a response token: [R, H]."""
    hidden = decoder_hidden(lm, input_ids, position_ids, attention_mask, attn_kwargs)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather_idx)


class PolicyModel(nn.Module):
    """Wraps an HF causal LM so one FSDP forward returns per-token log-probs (and entropy)
    of the targets, computed from hidden states in chunks: no [T, V] logits tensor."""

    def __init__(self, lm: nn.Module, chunk_size: int = 1024, mtp_detach: bool | None = None):
        """mtp_detach: None, or (--enable-mtp-training) whether the MTP loss reads the main model detached; a training
        forward then also returns the MTP layers' log-probs [D, R] (polyrl.backends.fsdp.mtp)."""
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size
        self.mtp_detach = mtp_detach

    def forward(self, input_ids, position_ids, attention_mask, gather_idx, targets, temperature: float = 1.0,
                with_entropy: bool = False, sequences: list | None = None, idle_vision: bool = False, **attn_kwargs):
        """sequences (--true-on-policy): [(ids [L_i], P_i)] each scored alone by the engine's function, in place of the
        laid-out micro-batch (the other tensors are then None). idle_vision: run the vision tower on a dummy image
        (multimodal.idle_vision_term), for a rank without images while other ranks have some."""
        if sequences is not None:
            return sequences_logprobs(self.lm, sequences, temperature=temperature, with_entropy=with_entropy)
        idle = multimodal.idle_vision_term(self.lm) if idle_vision else None
        full = decoder_hidden(self.lm, input_ids, position_ids, attention_mask, attn_kwargs)
        hidden = full.reshape(-1, full.shape[-1]).index_select(0, gather_idx)
        weight = self.lm.get_output_embeddings().weight
        logp, ent = chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=self.chunk_size,
                                     with_entropy=with_entropy)
        logp = logp if idle is None else logp + idle
        if self.mtp_detach is None or not self.training:
            return logp, ent
        return logp, ent, mtp_logprobs(self.lm, full, input_ids, position_ids, attention_mask, gather_idx, attn_kwargs,
                                       detach=self.mtp_detach, chunk_size=self.chunk_size)


class ValueModel(nn.Module):
    """The critic: an HF decoder body with a Linear(hidden, 1) head (HF's *ForTokenClassification with one label, so
    an exported critic is a plain HF directory). Same forward signature as PolicyModel, returning the value of the
    state before each response token [R] (fp32) where PolicyModel returns its log-prob; targets are unused."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids, attention_mask, gather_idx, targets, temperature: float = 1.0,
                with_entropy: bool = False, **attn_kwargs):
        hidden = response_hidden(self.lm, input_ids, position_ids, attention_mask, gather_idx, attn_kwargs)
        return self.lm.score(hidden).squeeze(-1).float(), None  # no dropout: values are regression outputs


def pack(input_ids: list[torch.Tensor], prompt_lens: list[int], attn_impl: str, device, dtype, layout: str = "packed"):
    """Lay a micro-batch out for one forward.

    packed: one row, per-sequence position ids, and either cu_seqlens for a varlen kernel or a
    block-diagonal causal mask, so no token attends across a sequence boundary.
    padded: one right-padded row per sample with a 2D padding mask; for dense attention
    (sdpa/eager) this is cheaper than a packed row, whose mask is quadratic in the row length.

    Returns input_ids [B, L], position_ids [B, L], mask (None for varlen kernels), gather_idx
    [R] (flat positions whose next token is a response token), targets [R], seq_ids [R], and
    the cu_seqlens kwargs varlen kernels read instead of a mask.
    """
    lens = [int(x.numel()) for x in input_ids]
    width = max(lens) if layout == "padded" else sum(lens)
    off = sum(lens)
    # a few vector ops for the whole micro-batch (not a few per sample): sample i's response predictions sit at
    # flat positions start_i + p_i - 1 ... start_i + l_i - 2
    lens_t, plens_t = torch.tensor(lens, dtype=torch.long), torch.tensor(prompt_lens, dtype=torch.long)
    packed_starts = torch.cumsum(lens_t, 0) - lens_t
    starts = torch.arange(len(lens)) * width if layout == "padded" else packed_starts
    rlens = lens_t - plens_t
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), rlens)
    first = torch.cumsum(rlens, 0) - rlens  # where each sample's responses start in the gathered order
    gather_idx = (starts + plens_t - 1 - first)[seq_ids] + torch.arange(int(rlens.sum()))
    # everything is built on the host and crosses in one pinned, asynchronous copy: a blocking copy per tensor
    # would wait for the previous micro-batch's backward each time and leave the GPU idle while Python runs
    if layout == "padded":
        ids = torch.zeros(len(lens), width, dtype=torch.long)
        mask = torch.zeros(len(lens), width, dtype=torch.long)
        for i, x in enumerate(input_ids):
            ids[i, :lens[i]] = x
            mask[i, :lens[i]] = 1
        ids, mask, gather_idx, seq_ids, targets = to_device([ids, mask, gather_idx, seq_ids, ids.view(-1)[gather_idx + 1]],
                                                            device)
        pos = torch.arange(width, device=device).expand(len(lens), -1)
        return ids, pos, mask, gather_idx, targets, seq_ids, {}
    ids = torch.cat(input_ids)
    pos = torch.arange(off) - torch.repeat_interleave(packed_starts, lens_t)
    kernel_masks = attn_impl in ("varlen", "flash_attention_2", "flash_attention_3")
    host = [ids, pos, gather_idx, seq_ids, ids[gather_idx + 1],
            torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)]
    if not kernel_masks:  # dense attention: each token's sequence, for the block-diagonal mask (built here:
        host.append(torch.repeat_interleave(torch.arange(len(lens)), lens_t))  # with device repeats it syncs)
    ids, pos, gather_idx, seq_ids, targets, cu, *seg = to_device(host, device)
    mask, varlen = None, {}
    if kernel_masks:
        varlen = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    else:
        seg = seg[0]
        allowed = (seg[:, None] == seg[None, :]) & torch.ones(off, off, dtype=torch.bool, device=device).tril()
        if attn_impl == "eager":  # eager adds the mask to the scores
            mask = torch.zeros(off, off, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        else:
            mask = allowed[None, None]
    return ids[None], pos[None], mask, gather_idx, targets, seq_ids, varlen


def _lr_lambda(o: OptimizerConfig, total_steps: int):
    decay = o.lr_decay_steps or max(total_steps - o.lr_warmup_steps, 1)
    floor = o.min_lr / o.lr if o.lr > 0 else 0.0

    def fn(step: int) -> float:
        if step < o.lr_warmup_steps:
            return (step + 1) / (o.lr_warmup_steps + 1)
        frac = min((step - o.lr_warmup_steps) / decay, 1.0)
        if o.lr_decay_style == "linear":
            return floor + (1 - floor) * (1 - frac)
        if o.lr_decay_style == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1.0

    return fn


class FSDPBackend:
    """TrainBackend on FSDP2. Every rank holds 1/dp of params, grads and optimizer state."""

    def __init__(self, model_cfg: ModelConfig, optim_cfg: OptimizerConfig, batch_cfg: BatchConfig, *,
                 device: str, total_steps: int = 1, need_ref: bool = False, need_teacher: bool = False,
                 seed: int = 0, role: str = "actor"):
        """role "critic": the same backend around a ValueModel (--critic-load or the actor's weights, with its own
        optimizer_cfg); compute_values and train_step then work on values where the actor's work on log-probs."""
        self.mcfg, self.ocfg, self.bcfg = model_cfg, optim_cfg, batch_cfg
        self.role = role
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        self.dims = ParallelDims.from_world()
        self.dp_rank = dist.get_rank()
        self._save_group = None  # --async-save's process group, made at the first background save
        self.mesh = self.dims.build_dp_mesh(self.device.type)
        self.dtype = model_cfg.dtype(self.device.type)
        from polyrl.backends.fsdp.attention import resolve
        # linear-attention (recurrent) layers, e.g. Qwen3-Next's gated DeltaNet: HF's torch path carries
        # state across a packed row, so these models take padded rows with dense attention
        hf_families.register()  # MiMo (no remote code)
        self.hf_config = AutoConfig.from_pretrained(model_cfg.hf_checkpoint)
        # --enable-mtp-training: the MTP layers' depths (the CLI refuses a checkpoint without them)
        self.mtp_depths = hf_families.mtp_depths(self.hf_config) if model_cfg.enable_mtp_training and role == "actor" else 0
        if model_cfg.enable_mtp_training and role == "actor" and not self.mtp_depths:
            raise ValueError(f"--enable-mtp-training: {model_cfg.hf_checkpoint} has no multi-token-prediction layers")
        self._mtp_logp = None
        # several ranks on a vision-language model: a micro-batch without images still runs the vision tower
        self.vision_every_forward = dist.get_world_size() > 1 and multimodal.is_vision_language(self.hf_config)
        recurrent = "linear_attention" in (getattr(self.hf_config, "layer_types", None) or ())
        requested = "sdpa" if recurrent and model_cfg.attn_implementation == "auto" else model_cfg.attn_implementation
        if model_cfg.true_on_policy and role == "actor":  # one unpadded row per sequence, the engine's attention
            from polyrl.backends.true_on_policy import register_attention
            requested = register_attention()
        # attention sinks / sliding windows: polyrl's packed masks and varlen kernel express neither, HF's eager
        # attention on padded rows does (it builds each layer's causal or sliding mask from the padding mask)
        problem = hf_families.fsdp_layout_problem(self.hf_config, model_cfg.attn_implementation,
                                                  batch_cfg.micro_batch_layout)
        if problem is not None:  # the CLI refuses these at start-up (capabilities.check_setup); direct callers here
            raise ValueError(problem)
        dense_why = hf_families.dense_attention_reason(self.hf_config)
        if dense_why is not None:
            log.info("FSDP: %s has %s: HF eager attention on padded rows instead of polyrl's packed / varlen path",
                     self.hf_config.model_type, dense_why)
            requested, recurrent = "eager", True  # recurrent: padded rows (below)
        self.attn_impl = resolve(requested, self.device.type, self.dtype)
        self.layout = batch_cfg.micro_batch_layout
        if self.layout == "auto":  # varlen kernels read boundaries for free; dense attention prefers short rows
            varlen = self.attn_impl in ("varlen", "flash_attention_2", "flash_attention_3")
            self.layout = "packed" if varlen and not recurrent else "padded"
        torch.manual_seed(seed)
        critic = role == "critic"
        self.peft = None  # --lora-rank: the PeftModel around the actor's HF module (set by _build)
        self.model = self._build(model_cfg.critic_load or model_cfg.hf_checkpoint if critic else model_cfg.hf_checkpoint,
                                 train=True, value=critic)
        # with LoRA the reference is the actor with its adapters off: no second model
        self.ref_model = (self._build(model_cfg.ref_load or model_cfg.hf_checkpoint, train=False)
                          if need_ref and self.peft is None else None)
        # --opd-teacher-load: built and offloaded like the reference model; frozen, so checkpoints do not carry it
        # (a resume reads it from its directory again)
        self.teacher_model = self._build(model_cfg.opd_teacher_load, train=False) if need_teacher else None
        self.routing = self._attach_routing()
        self.exact = model_cfg.true_on_policy and role == "actor"  # the critic's values are not compared with anything
        if self.exact:
            cpu = self.device.type == "cpu"
            if (self.dtype != torch.float32 if cpu else self.dtype not in (torch.bfloat16, torch.float32)) \
                    or self.peft is not None:
                raise ValueError("--true-on-policy: the FSDP backend implements it without LoRA, on CPU in FP32 and on "
                                 "CUDA in BF16 or FP32")
            pin_threads(self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2),
                                           eps=optim_cfg.adam_eps, weight_decay=optim_cfg.weight_decay,
                                           fused=self.device.type == "cuda" and not model_cfg.fsdp_cpu_offload)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(optim_cfg, total_steps))
        self.skipped_steps = 0
        self.token_budget: int | None = None  # the GPU default micro-batch token budget, sized on first use
        self._export_units: list | None = None  # export_weights' FSDP units, built on first use
        self._direct: dict | None = None  # _copy_into's plan for the engine views it last wrote, and its sources

    # ---- construction -------------------------------------------------------------------
    def _build(self, path: str, *, train: bool, value: bool = False) -> PolicyModel | ValueModel:
        """Rank 0 reads the checkpoint on CPU; every rank builds the model on the meta device,
        shards it, and receives rank 0's weights by broadcast (tied embeddings stay tied:
        they are one Parameter in the root FSDP group). value: the critic (a causal LM's body, or a saved critic)."""
        config = AutoConfig.from_pretrained(path)
        dequant = hf_families.dequantized_load(config)  # MXFP4 experts (GPT-OSS) -> BF16 on read, saved unquantized
        attn = self.attn_impl
        # vision-language checkpoints (Qwen2.5-VL, Qwen3-VL): the HF class with the vision tower
        cls = AutoModelForImageTextToText if multimodal.is_vision_language(config) else AutoModelForCausalLM
        if value:
            cls, config.num_labels = AutoModelForTokenClassification, 1
        lora = train and not value and self.mcfg.lora_rank > 0  # the critic (PPO's value model) trains in full
        exact = self.mcfg.true_on_policy and self.role == "actor" and not value  # the engine's fixed-block arithmetic
        full_sd, buffers = {}, {}
        if self.dp_rank == 0:
            src, info = cls.from_pretrained(path, dtype=torch.float32, attn_implementation=attn, output_loading_info=True,
                                            **({"num_labels": 1} if value else {}), **dequant)
            if value and "score.weight" in info["missing_keys"]:
                zero_value_head(src.score)
            if lora:  # rank 0's freshly initialized adapters (B = 0: the base model's outputs) reach every rank below
                add_lora(src, self.mcfg, meta=False)
            full_sd = {f"lm.{k}": v for k, v in src.state_dict().items()}
            buffers = {n: b for n, b in src.named_buffers()}
        with torch.device("meta"):
            lm = cls.from_config(config, dtype=torch.float32, attn_implementation=attn)
        if exact:
            from polyrl.backends.true_on_policy import prepare
            prepare(lm)
        if self.mcfg.freeze_vision_tower:
            vision_tower(lm).requires_grad_(False)  # before FSDP: its units then hold no trainable parameter
        if lora:  # before AC and FSDP: they wrap the adapted layers; the base weights are frozen from here on
            self.peft = add_lora(lm, self.mcfg, meta=True)
        if self.mcfg.gradient_checkpointing and train:
            if exact:  # the backward's recomputation must run the fixed-block arithmetic its forward ran
                from polyrl.backends.true_on_policy import checkpoint_contexts
            apply_ac(lm, checkpoint_contexts if exact else None)
        if exact:
            # the engine's scorer compiles (or not) by the same call, so both run the same kernels
            from polyrl.backends.true_on_policy import compile_layers
            compile_layers(lm, self.device)
        elif self.mcfg.compiled(self.device.type, getattr(config, "model_type", None)):
            apply_compile(lm)
        mtp = self.mcfg.mtp_detach_encoder if self.mcfg.enable_mtp_training and train and not value else None
        root = ValueModel(lm) if value else PolicyModel(lm, self.mcfg.logprob_chunk_size, mtp)
        offload = self.mcfg.fsdp_cpu_offload or (not train and self.device.type == "cuda")  # reference lives on CPU
        # One CPU rank in FP32 has nothing to shard, cast or offload: FSDP2's hooks and DTensor
        # dispatch would be pure overhead there (~15% of a tiny model's step). DCP checkpoints of
        # the plain module load into sharded ones and back, so resumes across world sizes still work.
        sharded = not (dist.get_world_size() == 1 and self.device.type == "cpu" and self.dtype == torch.float32 and not offload)
        if sharded:
            # One rank has nothing to all-gather: resharding after the forward only drops the BF16 copies that the
            # backward then casts again (one more cast and FSDP hook round per layer; the 0.5B GRPO train phase 0.595 ->
            # 0.493 s on one H100, not seen on another: bench/RESULTS.md), for 2 bytes per parameter held from forward
            # to backward. Kept where memory is the point (offload) and on several ranks (the all-gather is what the
            # resharding saves).
            keep = dist.get_world_size() == 1 and not offload and not self.mcfg.offload_train
            apply_fsdp(root, lm, self.mesh, param_dtype=self.dtype, cpu_offload=offload, reshard_after_forward=not keep)
        root.to_empty(device="cpu" if offload else self.device)
        if not sharded and getattr(lm.config, "tie_word_embeddings", False):
            lm.tie_weights()  # to_empty re-creates parameters one module at a time, which unties them
        set_model_state_dict(root, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for name, buf in lm.named_buffers():  # non-persistent buffers (rotary inv_freq) are not in the state dict
            if self.dp_rank == 0:
                buf.copy_(buffers[name])
            if dist.get_world_size() > 1:
                dist.broadcast(buf, src=0)
        del full_sd, buffers
        if not train:
            root.eval().requires_grad_(False)
        return root

    def _attach_routing(self):
        """MoE routing hooks on the actor (replay, metrics, aux losses); None for a dense model."""
        from polyrl.backends.routing_replay import MoERouting, unsupported_router
        m = self.mcfg
        routing = MoERouting.attach(self.model.lm, aux_loss_coeff=m.moe_aux_loss_coeff, z_loss_coeff=m.moe_z_loss_coeff,
                                    load_balancing_type=m.moe_router_load_balancing_type)
        wanted = m.use_routing_replay or m.use_rollout_routing_replay or m.moe_aux_loss_coeff or m.moe_z_loss_coeff
        if routing is None and wanted:
            other = unsupported_router(self.model.lm)
            raise ValueError(f"--use-routing-replay / --use-rollout-routing-replay / --moe-*-loss-coeff: {m.hf_checkpoint} "
                             + (f"routes with {other}, which the FSDP backend cannot replay (softmax top-k routers only)"
                                if other else "has no MoE router"))
        return routing

    def _begin_routing(self, model: PolicyModel, mb: TrainBatch, real: bool, *, record: bool = False) -> None:
        """Set the MoE hooks up for one actor forward over `mb`: replay the rollout's routes (R3) or the log-prob
        pass's (R2), else route freely (recording if asked, comparing with the rollout's routes when it has them)."""
        if self.routing is None or model is not self.model:
            return
        lens = [int(x.numel()) for x in mb.input_ids]
        if not real:  # the dummy forward of a rank without samples: route it, count nothing
            self.routing.begin(lens, self.layout, self.device, count=False)
            return
        routes, replay = self._routes(mb)
        self.routing.begin(lens, self.layout, self.device, routes=routes, replay=replay, record=record)

    def _routes(self, mb: TrainBatch) -> tuple[list | None, bool]:
        """(routes, replay) of an actor forward over mb's samples: the rollout's routes replayed (R3), the log-prob
        pass's (R2), or the rollout's routes to compare with (none replayed)."""
        m = self.mcfg
        if m.use_rollout_routing_replay:
            if mb.rollout_routed_experts is None:
                raise ValueError("--use-rollout-routing-replay: these samples carry no routed experts; the rollout "
                                 "engine must return them (SGLang: launch with --enable-return-routed-experts)")
            return mb.rollout_routed_experts, True
        if m.use_routing_replay and mb.recorded_routed_experts is not None:
            return mb.recorded_routed_experts, True
        return mb.rollout_routed_experts, False

    # ---- forward ------------------------------------------------------------------------
    def _token_budget(self) -> int | None:
        """polyrl.config.gpu_token_budget, sized once, at the first forward, when the user chose no micro-batch size or
        budget: by then every co-resident model (a PPO critic beside the actor) is on the device, so the memory
        allocated now is the state, the engine's included where it stays awake (--async on one GPU), plus what other
        processes hold on the GPU (an engine server beside the trainer) and the grads and Adam moments not allocated
        yet (before the first step)."""
        b = self.bcfg
        if (self.token_budget is not None or self.device.type != "cuda" or b.use_dynamic_batch_size
                or b.micro_batch_size is not None or b.max_tokens_per_gpu):
            return self.token_budget
        from polyrl.config import gpu_token_budget
        pending = 0 if self.optimizer.state else 12 * sum(
            p.numel() for g in self.optimizer.param_groups for p in g["params"]) // self.dims.dp
        free, total = torch.cuda.mem_get_info(self.device)
        others = max(0, total - free - torch.cuda.memory_reserved(self.device))  # other processes (an engine server
        # on this GPU), CUDA context, NCCL and library buffers
        self.token_budget = gpu_token_budget(
            self.hf_config, total, state_bytes=torch.cuda.memory_allocated(self.device) + others + pending,
            checkpointing=self.mcfg.gradient_checkpointing, offload=self.mcfg.offload_train or self.mcfg.fsdp_cpu_offload,
            compiled=self.mcfg.compiled(self.device.type, getattr(self.hf_config, "model_type", None)))
        if dist.get_world_size() > 1:  # one budget on every rank (their allocations differ by a few buffers)
            t = torch.tensor([self.token_budget], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            self.token_budget = int(t)
        from polyrl.metrics import notice
        notice(f"{self.role}: micro-batches of up to {self.token_budget} tokens (sized from the GPU's memory; "
               "--max-tokens-per-gpu or --micro-batch-size to choose)")
        return self.token_budget

    def _micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        lens = [int(x.numel()) for x in batch.input_ids]
        kw = self.bcfg.micro_batch_plan(self.device.type, max(lens, default=1), self._token_budget())
        dyn = "max_tokens" in kw
        k = torch.tensor(len(plan_micro_batches(lens, **kw)) if lens else 1)
        if dist.get_world_size() > 1:  # every rank must run the same number of FSDP forwards
            dist.all_reduce(k, op=dist.ReduceOp.MAX)
        plans = plan_micro_batches(lens, num_micro_batches=int(k), **kw)
        if self.exact and dyn and lens:  # the same count of micro-batches, padded to fewer blocks in all
            plans = fewer_blocks(plans, lens, max_tokens=kw["max_tokens"], block=block_rows(self.device))
        if self.layout == "padded" and not dyn:  # similar lengths share a micro-batch: less padding
            order = sorted(range(len(lens)), key=lambda i: lens[i])
            plans = [sorted(order[i] for i in p) for p in plans]
        return plans

    def _forward(self, model: PolicyModel, batch: TrainBatch, idx: list[int], temperature: float, with_entropy: bool,
                 record: bool = False):
        """(micro-batch, log-probs [R], entropy [R] | None, sample of each token [R], tail): tail is None, or (with
        --true-on-policy on several ranks) a zero the loss adds so that padding forwards take part in the backward."""
        self._mtp_logp = None
        if self.exact and isinstance(model, PolicyModel):
            return self._forward_exact(model, batch, idx, temperature, with_entropy)
        if not idx:  # this rank has no samples for this micro-batch: run a 2-token dummy for the collectives
            mb = TrainBatch([torch.zeros(2, dtype=torch.long)], [1])
        else:
            mb = batch.select(idx)
        self._begin_routing(model, mb, bool(idx), record=record)
        ids, pos, mask, gidx, tgt, seq, varlen = pack(mb.input_ids, mb.prompt_lens, self.attn_impl, self.device, self.dtype,
                                                      self.layout)
        if mb.multimodal is not None:  # image prompts: pixel inputs and per-sample multimodal RoPE positions
            lm = model.lm
            pos = multimodal.train_position_ids(lm, mb.input_ids, mb.multimodal, lm.config.image_token_id, pos, self.layout)
            varlen = {**varlen, **multimodal.concat_inputs(mb.multimodal, self.device)}
        if self.vision_every_forward and "pixel_values" not in varlen and isinstance(model, PolicyModel):
            varlen["idle_vision"] = True  # the vision blocks are FSDP units: every rank runs them in every forward
        logp, ent, *mtp = model(ids, pos, mask, gidx, tgt, temperature, with_entropy, **varlen)
        self._mtp_logp = mtp[0] if mtp else None  # --enable-mtp-training, a training forward: train_step reads it
        return mb, logp, ent, seq, None

    def _forward_exact(self, model: PolicyModel, batch: TrainBatch, idx: list[int], temperature: float,
                       with_entropy: bool):
        """--true-on-policy: the micro-batch packed through the engine's scoring function (fixed-block GEMMs and norms,
        per-sequence attention: each token's value is the one the engine reported). One forward per micro-batch, as
        on every rank (a rank without samples runs a 2-token dummy whose log-prob joins the loss times 0)."""
        dummy = (torch.zeros(2, dtype=torch.long), 1)
        mb = batch.select(idx) if idx else TrainBatch([dummy[0]], [dummy[1]])
        seqs = list(zip(mb.input_ids, mb.prompt_lens))
        if self.routing is not None and model is self.model:
            # MoE: count the routing; R3 replays the routes of the engine's scoring pass (the routes this forward computes
            # too: the replayed gates are the same softmax entries, so the values stay the engine's)
            routes, replay = self._routes(mb) if idx else (None, False)
            self.routing.begin_at(*pack_positions([int(x.numel()) for x, _ in seqs], self.device), self.device,
                                  routes=routes if replay else None, replay=replay, count=bool(idx))
        # on the device already: FSDP's root forward would move host tensors one blocking copy at a time
        logp, ent = model(None, None, None, None, None, temperature, with_entropy,
                          sequences=sequences_to_device(seqs, self.device))
        lens = mb.response_lens
        n = sum(lens)
        tail = 0.0 * logp[n:].sum() if logp.numel() > n else None
        seq, = to_device([torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))], self.device)
        return mb, logp[:n], ent[:n] if ent is not None else None, seq, tail

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, model: str = "actor", temperature: float = 1.0) -> list[torch.Tensor]:
        m = {"actor": self.model, "ref": self.ref_model, "teacher": self.teacher_model}[model]
        lora_ref = model == "ref" and self.peft is not None
        if lora_ref:
            m = self.model
        if m is None:
            raise ValueError(f"compute_logprobs(model={model!r}): this backend was built without that model")
        m.eval()  # no dropout (--lora-dropout) in scoring; train_step switches back
        out: list[torch.Tensor | None] = [None] * len(batch)
        order, parts = [], []
        with adapters_off(self.peft) if lora_ref else contextlib.nullcontext():
            # R2: the actor's pass records its routes for the train forwards (R3 replays the rollout's instead)
            record = (self.routing is not None and m is self.model and self.mcfg.use_routing_replay
                      and batch.recorded_routed_experts is None)
            routes: list = [None] * len(batch)
            for idx in self._micro_batches(batch):
                cpu_tick()
                _, logp, *_ = self._forward(m, batch, idx, temperature, False, record=record)
                if idx:
                    order += idx
                    parts.append(logp.float())
                    if record:
                        for i, r in zip(idx, self.routing.recorded()):
                            routes[i] = r
            if self.routing is not None:
                self.routing.end()
            if record:
                batch.recorded_routed_experts = routes
        for mod in m.modules():  # FSDP2 keeps the root (and, at one rank, every layer) unsharded after a forward with
            if isinstance(mod, FSDPModule):  # no backward: free those copies
                mod.reshard()
        if parts:  # one device-to-host copy for the whole batch, not one (and a host sync) per micro-batch
            lens = [batch.response_lens[i] for i in order]
            for i, part in zip(order, torch.cat(parts).cpu().split(lens)):
                out[i] = part
        return out  # type: ignore[return-value]

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The critic's value of the state before each response token, one [R_i] tensor per sample (role "critic")."""
        if self.role != "critic":
            raise ValueError("compute_values: this backend is not a critic (build it with role='critic')")
        return self.compute_logprobs(batch)  # a ValueModel's forward gives values where a PolicyModel's gives log-probs

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, temperature: float = 1.0, with_entropy: bool = False) -> dict[str, float]:
        self.model.train()
        depths = self.mtp_depths
        mtp_counts = (mtp_token_counts(batch.response_lens, batch.token_fields["loss_mask"], depths)
                      if depths and len(batch) else [0.0] * depths)
        local = torch.tensor([float(torch.cat(batch.token_fields["loss_mask"]).sum()) if len(batch) else 0.0, float(len(batch)),
                              float(sum(int(x.numel()) for x in batch.input_ids)), *mtp_counts], dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(local)
        num_tokens, num_seqs, routed_tokens = float(local[0]), float(local[1]), float(local[2])
        mtp_counts = local[3:].tolist()  # the MTP loss's global token counts per depth
        scale = float(dist.get_world_size())  # FSDP averages gradients over ranks; the loss already has the global denominator
        # loss and metrics add up on the device and cross once after the last micro-batch (no host sync per micro-batch)
        sums: dict[str, torch.Tensor] = {}
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        plans = self._micro_batches(batch)
        for idx in plans:
            cpu_tick()  # a single-process CPU run's thread count follows the machine's load (polyrl.cpu_governor)
            mb, logp, ent, seq, tail = self._forward(self.model, batch, idx, temperature, with_entropy)
            if idx:
                keys = list(mb.token_fields)
                fields = dict(zip(keys, to_device([torch.cat(mb.token_fields[k]) for k in keys], self.device)))
            else:
                fields = {k: torch.zeros(1, device=self.device) for k in batch.token_fields}
            fields["seq_ids"] = seq
            loss, metrics = loss_fn(logp, ent, fields, num_tokens=num_tokens, num_seqs=num_seqs)
            if tail is not None:
                loss = loss + tail
            aux = self.routing.take_aux_loss() if self.routing is not None else None
            if aux is not None:  # a per-token mean over this micro-batch, weighted to a mean over all ranks' tokens
                loss = loss + aux * (sum(int(x.numel()) for x in mb.input_ids) / routed_tokens)
            if not idx:
                loss = loss * 0.0
            extra = 0.0  # the MTP loss trains but is reported apart from the policy loss (metric mtp_loss)
            if self._mtp_logp is not None:
                term, per_depth = mtp_loss(self._mtp_logp, mtp_token_weights(seq, fields["loss_mask"], depths), mtp_counts)
                extra = term * (self.mcfg.mtp_loss_scaling_factor if idx else 0.0)
                metrics = {**metrics, "mtp_loss": per_depth.mean()}
            ((loss + extra) * scale).backward()
            loss_total += loss.detach().double()
            for k, v in metrics.items():
                if idx:  # the largest over micro-batches (and ranks, below) for *_max, else the sum
                    merge_metric(sums, k, v.detach().double())
        max_norm = self.ocfg.clip_grad if self.ocfg.clip_grad > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        keys = sorted(sums)
        vec = torch.stack([loss_total.reshape(()), grad_norm.detach().double().reshape(()).to(self.device)]
                          + [torch.as_tensor(sums[k], dtype=torch.float64, device=self.device).reshape(()) for k in keys]).cpu()
        grad_norm, loss_value = float(vec[1]), float(vec[0])
        skipped = not math.isfinite(grad_norm) or not math.isfinite(loss_value)
        if skipped:  # a NaN/inf never reaches the weights (nor the Adam moments)
            self.skipped_steps += 1
            log.warning("non-finite loss or grad norm (%s); optimizer step skipped", grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies (the scheduler moves on after it)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()  # a skipped step does not advance the schedule either
        self.optimizer.zero_grad(set_to_none=True)
        if self.mcfg.offload_train:  # the Adam moments wait on the host for the next step: only the params stay for the sync
            self._move_optimizer_state("cpu")
        vec = torch.cat([vec[:1], vec[2:]])  # loss and metric sums (the grad norm is global already)
        if dist.get_world_size() > 1:
            peak = [i + 1 for i, k in enumerate(keys) if k.endswith("_max")]
            top = vec[peak].clone()
            dist.all_reduce(vec)
            if peak:
                dist.all_reduce(top, op=dist.ReduceOp.MAX)
                vec[peak] = top
        out = {"loss": float(vec[0]), **{k: float(v) for k, v in zip(keys, vec[1:].tolist())}}
        out.update(grad_norm=grad_norm, lr=lr, skipped_step=float(skipped))
        if self.routing is not None:
            self.routing.end()
            world = dist.get_world_size()
            out.update(self.routing.drain_metrics(dist.all_reduce if world > 1 else None, forwards=len(plans), world=world))
            from polyrl.backends.routing_replay import routes_nbytes
            out["moe/routed_experts_bytes"] = float(routes_nbytes(batch.rollout_routed_experts)
                                                    + routes_nbytes(batch.recorded_routed_experts))
        return out

    # ---- weights ------------------------------------------------------------------------
    def export_weights(self) -> WeightExport:
        """The HF-named stream below, and its direct copy into an in-process engine's views (`_copy_into`)."""
        return WeightExport(self._export_stream, self._copy_into)

    def _copy_into(self, views) -> set[str] | None:
        """Write every exported weight straight into `views` (HF name -> the engine's tensor), a few kernels per FSDP
        unit (polyrl.weight_sync.direct): the unit is gathered as in the stream, and its destinations are filled, cast
        included, by one multi-tensor copy. None (iterate the stream instead) with LoRA, off CUDA, or when the
        destinations are not on this device."""
        if self.peft is not None or self.device.type != "cuda" or next(iter(views.values())).device != self.device:
            return None
        lm = self.model.lm
        cache = self._direct
        first = next(iter(views.values()))
        key = (id(views), first.untyped_storage().data_ptr())  # the engine's current buffer (names -> views)
        if cache is None or cache["key"] != key:
            if not any(isinstance(p, DTensor) for p in self.model.parameters()):
                return None
            if self._export_units is None:
                self._export_units = _fsdp_units(self.model, {id(p): n for n, p in lm.named_parameters()})
            units = self._export_units
            if dist.get_world_size() == 1:  # nothing to gather: the whole model is one group, its runs cross units
                units = [(None, [n for _, names in units for n in names])]
            shapes = [[(n, lm.get_parameter(n).shape) for n in names] for _, names in units]
            owners = [(lm.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for _, names in units for n in names]
            plans = direct.plan_groups(shapes, views)
            cache = self._direct = {"key": key, "units": units, "plans": plans, "owners": owners, "bound": None,
                                    "ptrs": None}

        def sources(names: list[str]) -> list[torch.Tensor]:
            local = [lm.get_parameter(n) for n in names]
            return [(p._local_tensor if isinstance(p, DTensor) else p).detach().reshape(-1) for p in local]

        units, plans = cache["units"], cache["plans"]
        if units[0][0] is None:  # one rank: the local shards are the parameters, bound while they stay in place
            local = [getattr(m, a) for m, a in cache["owners"]]
            ptrs = [(p._local_tensor if isinstance(p, DTensor) else p).data_ptr() for p in local]
            if cache["ptrs"] != ptrs:
                src = sources(units[0][1])
                if any(t.device != self.device for t in src):  # offloaded: the caller takes the stream
                    return None
                cache["bound"], cache["ptrs"] = plans[0].bind(src), ptrs
            plans[0].run(cache["bound"], views)
            return set(units[0][1])
        seen: set[str] = set()
        for (unit, names), plan in zip(units, plans):
            unit.unshard()
            plan.write(sources(names), views)
            unit.reshard()
            seen.update(names)
        return seen

    def _export_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (the train dtype on GPU). Shared (tied) parameters are yielded once, under their first
        name. Sharded models export one FSDP unit (a decoder layer, the root) at a time: the unit is all-gathered with
        FSDP's own batched collective, its tensors are cast and copied into one new flat buffer by a single `torch.cat`
        (chunks of EXPORT_CHUNK_BYTES), and the unit is resharded. Never a second full model on one rank, no
        per-parameter collective or kernel, and the yielded views stay valid while a transport holds them in a bucket.
        At one rank the local shard is the full tensor: no gather at all. With LoRA: the base model's names and
        shapes, adapters merged in (no lora tensors leave the backend), one parameter at a time."""
        if self.peft is not None:
            for name, t in self._full_weights():
                yield name, t.to(self.dtype if self.device.type == "cuda" else t.dtype)
            return
        if not any(isinstance(p, DTensor) for p in self.model.parameters()):  # one unsharded CPU rank: the live tensors
            for name, p in self.model.lm.named_parameters():
                yield name, p.detach()
            return
        if self._export_units is None:  # the units and their parameters' names are fixed once the model is built
            self._export_units = _fsdp_units(self.model, {id(p): n for n, p in self.model.lm.named_parameters()})
        out_dtype = self.dtype if self.device.type == "cuda" else None
        single = dist.get_world_size() == 1
        for unit, unit_names in self._export_units:
            if not single:
                unit.unshard()  # this unit's parameters become plain full tensors (param dtype) until reshard()
            full = [(n, self.model.lm.get_parameter(n)) for n in unit_names]
            # one rank: the local shard is the whole tensor (_local_tensor: to_local()'s autograd wrapper costs ~20 us
            # per parameter, a third of the sync at the 0.5B shape)
            full = [(n, (p._local_tensor if isinstance(p, DTensor) else p).detach()) for n, p in full]
            chunks = _flat_copies(full, out_dtype, EXPORT_CHUNK_BYTES)
            if not single:
                unit.reshard()
            for chunk in chunks:
                yield from chunk

    def _full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the FP32 master weights with the adapters merged in, one parameter (collective) at a time."""
        full = lambda p: (p.full_tensor() if isinstance(p, DTensor) else p).detach()  # noqa: E731
        yield from merged_weights(self.model.lm, full)

    def sync_ref_from_actor(self) -> None:
        if self.ref_model is None:
            return
        with torch.no_grad():
            local = lambda p: p.to_local() if isinstance(p, DTensor) else p.data  # noqa: E731
            for pr, pa in zip(self.ref_model.parameters(), self.model.parameters()):
                local(pr).copy_(local(pa))

    def save_hf(self, path: str, tokenizer=None, *, adapter: bool = False) -> None:
        """adapter (--save-hf-adapter, LoRA only): a peft adapter directory instead of the merged model."""
        if self.peft is not None and not adapter:  # merged: the tensors the engines get, in fp32
            # every rank walks the whole stream (each tensor is a collective); rank 0 keeps them
            sd = {n: t.cpu() for n, t in self._full_weights() if dist.get_rank() == 0}
        else:
            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                           ignore_frozen_params=adapter))
            sd = {k[len("lm."):]: v for k, v in sd.items()}
        if dist.get_rank() == 0:
            tmp = path.rstrip("/") + ".tmp"
            if adapter:  # peft's own layout (adapter_config.json + adapter_model.safetensors): PeftModel.from_pretrained
                self.peft.save_pretrained(tmp, state_dict={f"base_model.model.{k}": v for k, v in sd.items()})
            else:
                self.model.lm.save_pretrained(tmp, state_dict=sd)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            processor = multimodal.VisionProcessor.from_pretrained(self.mcfg.hf_checkpoint, tokenizer)
            if processor is not None:  # a vision-language model is loaded back with its image processor
                processor.save_pretrained(tmp)
            _replace_dir(tmp, path)
        dist.barrier()

    # ---- checkpoints ----------------------------------------------------------------------
    def _state_dicts(self) -> tuple[dict, dict]:
        """The model and optimizer state a checkpoint holds. LoRA: the adapters and their optimizer state only; the
        frozen base is --hf-checkpoint's and is read from there again (a tied embedding would survive
        ignore_frozen_params under its second name, so the model state is filtered by name)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if self.peft is not None:
            keep = {n for n, p in self.model.named_parameters() if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in keep}
        return model_sd, optim_sd

    def save(self, path: str, *, optimizer: bool = True, background: bool = False):
        model_sd, optim_sd = self._state_dicts()
        state = {"model": model_sd, **({"optim": optim_sd} if optimizer else {})}
        written = None
        if background:  # DCP copies the state to host memory before it returns, then writes it on its own thread
            if self._save_group is None:  # its collectives on a gloo group of their own, never beside training's
                self._save_group = dist.new_group(backend="gloo")
            written = dcp.async_save(state, checkpoint_id=os.path.join(path, "dcp"), process_group=self._save_group)
        else:
            dcp.save(state, checkpoint_id=os.path.join(path, "dcp"))
        extra = {"scheduler": self.scheduler.state_dict(), "cpu_rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
                 "skipped_steps": self.skipped_steps}
        torch.save(extra, os.path.join(path, f"extra_rank{dist.get_rank()}.pt"))
        if self.ref_model is not None:
            dcp.save({"model": get_model_state_dict(self.ref_model)}, checkpoint_id=os.path.join(path, "dcp_ref"))
        return written

    def load(self, path: str) -> None:
        from polyrl.checkpoint import has_optimizer_state
        model_sd, optim_sd = self._state_dicts()
        with_optim = has_optimizer_state(os.path.join(path, "dcp"))  # not when --no-save-optim wrote it
        state = {"model": model_sd, **({"optim": optim_sd} if with_optim else {})}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))  # a key the checkpoint lacks fails here (DCP is strict)
        # LoRA: not strict, the base weights are not in the checkpoint and stay as --hf-checkpoint has them
        options = StateDictOptions(strict=self.peft is None)
        if with_optim:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=options)
        else:  # the optimizer as built: no step taken, zero moments
            set_model_state_dict(self.model, state["model"], options=options)
        # A resume onto more ranks than saved reuses rank 0's scheduler and RNG-derived state
        from polyrl.checkpoint import load_extras
        extra = load_extras(path)  # tensors and plain values only: a checkpoint from elsewhere runs no code
        self.scheduler.load_state_dict(extra["scheduler"])
        # the schedule goes on from the saved step at this run's --lr (the checkpoint's base rate would otherwise win),
        # as the Megatron backend does
        self.scheduler.base_lrs = [self.ocfg.lr] * len(self.optimizer.param_groups)
        for g, f in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            g["initial_lr"], g["lr"] = self.ocfg.lr, self.ocfg.lr * f(self.scheduler.last_epoch)
        torch.set_rng_state(extra["cpu_rng"])
        if extra["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(extra["cuda_rng"])
        self.skipped_steps = extra["skipped_steps"]
        if self.ref_model is not None and os.path.isdir(os.path.join(path, "dcp_ref")):
            ref_sd = {"model": get_model_state_dict(self.ref_model)}
            dcp.load(ref_sd, checkpoint_id=os.path.join(path, "dcp_ref"))
            set_model_state_dict(self.ref_model, ref_sd["model"])

    # ---- colocation ---------------------------------------------------------------------
    def offload(self) -> None:
        """--offload-train: free the accelerator for a colocated engine (params, grads and Adam
        moments to CPU). Nothing to do on CPU or when FSDP already keeps everything on CPU."""
        if self.device.type != "cuda" or self.mcfg.fsdp_cpu_offload or not self.mcfg.offload_train:
            return
        if self._direct is not None:  # _copy_into's bound views of the parameters would keep their GPU storage alive
            self._direct.update(bound=None, ptrs=None)
        # non_blocking device -> host copies land in pinned memory from PyTorch's caching host allocator (reused
        # offload after offload, so the host holds one pinned copy: 4 bytes per FP32 parameter plus the moments):
        # pinned copies run at PCIe/NVLink-C2C speed, pageable ones at a fraction of it (bench/offload_train.py)
        self.model.to("cpu", non_blocking=True)
        self._move_optimizer_state("cpu")  # synchronizes

    def onload(self) -> None:
        if self.device.type != "cuda" or self.mcfg.fsdp_cpu_offload or not self.mcfg.offload_train:
            return
        self.model.to(self.device, non_blocking=True)  # from the pinned host copies: asynchronous
        self._move_optimizer_state("cuda")  # synchronizes

    def _move_optimizer_state(self, to: str) -> None:
        if self.device.type != "cuda" or self.mcfg.fsdp_cpu_offload:
            return
        for st in self.optimizer.state.values():
            for k, v in st.items():
                # fused AdamW keeps `step` on the GPU too; the foreach/for-loop kernels want it on CPU
                if torch.is_tensor(v) and v.device.type != to and (k != "step" or self.optimizer.defaults.get("fused")):
                    st[k] = v.to(self.device if to == "cuda" else "cpu", non_blocking=True)
        torch.cuda.synchronize()
        if to == "cpu":
            torch.cuda.empty_cache()


def vision_tower(lm: nn.Module) -> nn.Module:
    """The vision encoder of a Qwen-VL HF model (`model.visual`)."""
    base = getattr(lm, lm.base_model_prefix)
    if not hasattr(base, "visual"):
        raise ValueError(f"--freeze-vision-tower: {type(lm).__name__} has no vision tower (not a vision-language model)")
    return base.visual


@torch.no_grad()
def zero_value_head(head: nn.Linear) -> None:
    """A fresh critic head starts at V = 0 everywhere: the first advantages are then the discounted rewards, not a
    random head's noise, and both backends start from the same head without sharing an RNG stream."""
    head.weight.zero_()
    if head.bias is not None:
        head.bias.zero_()


EXPORT_CHUNK_BYTES = 256 * 2**20  # one export copy; bounds the extra memory of a sync beside the model


def _fsdp_units(root: nn.Module, names: dict[int, str]) -> list[tuple[nn.Module, list[str]]]:
    """(FSDP unit, the HF names of the parameters it owns), in the model's parameter order; a parameter belongs to the
    innermost fully_shard-ed module above it."""
    owner: dict[str, nn.Module] = {}
    for _, mod in root.named_modules():  # pre-order: an inner unit overrides its parent
        if isinstance(mod, FSDPModule):
            for p in mod.parameters():
                if id(p) in names:
                    owner[names[id(p)]] = mod
    units: dict[int, tuple[nn.Module, list[str]]] = {}
    for name in names.values():
        units.setdefault(id(owner[name]), (owner[name], []))[1].append(name)
    return list(units.values())


def _flat_copies(tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
                 chunk_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Copy (and cast to `dtype`) named tensors into new flat buffers, one `torch.cat` per chunk of about chunk_bytes;
    returns the views into them, chunk by chunk."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    start = 0
    while start < len(tensors):
        end, size = start, 0
        first = tensors[start][1].dtype
        while end < len(tensors) and (end == start or (size + tensors[end][1].nbytes <= chunk_bytes
                                                       and (dtype is not None or tensors[end][1].dtype == first))):
            size += tensors[end][1].nbytes
            end += 1
        part = tensors[start:end]
        dt = dtype or first  # without a cast, a chunk holds one dtype
        flat = torch.empty(sum(t.numel() for _, t in part), dtype=dt, device=part[0][1].device)
        torch.cat([t.reshape(-1) for _, t in part], out=flat)  # one kernel: gather, cast, copy
        views, off = [], 0
        for n, t in part:
            views.append((n, flat[off:off + t.numel()].view(t.shape)))
            off += t.numel()
        out.append(views)
        start = end
    return out


def _replace_dir(tmp: str, final: str) -> None:
    """Swap a finished directory into place; the previous one survives until the swap."""
    import shutil
    old = final.rstrip("/") + ".old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
