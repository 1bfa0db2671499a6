"""Megatron-core train backend (GPU only): TP / SP / PP (+ virtual stages) / CP / EP, the
distributed optimizer or Megatron-FSDP, packed THD micro-batches, vocab-parallel log-probs.
megatron-core is imported lazily (`model.py`), so this module imports anywhere.

Data: the loop hands every rank its own share of samples (sharded by global rank). Megatron needs
the same samples on every rank of a model-parallel group, so each call first gathers all ranks'
samples (token ids only: small), cuts them into data-parallel shards, and at the end hands every
rank back the results for its own samples.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from polyrl.algorithms.losses import merge_metric
from polyrl.backends.base import LossFn, fewer_blocks, plan_micro_batches, to_device
from polyrl.backends.megatron import compat
from polyrl.backends.parallel_dims import ParallelDims
from polyrl.config import BatchConfig, MegatronConfig, ModelConfig, OptimizerConfig
from polyrl.types import TrainBatch

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e .[megatron]  (megatron-core >= 0.19, Python >= 3.12, a CUDA GPU)"


def require_megatron() -> None:
    """Exit early with what is missing: megatron-core, Python >= 3.12 or CUDA."""
    problems = []
    if sys.version_info < (3, 12):
        problems.append(f"Python >= 3.12 (this is {sys.version.split()[0]})")
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        problems.append("the megatron-core package")
    if not torch.cuda.is_available():
        problems.append("a CUDA GPU (megatron-core's parallel state needs one)")
    if problems:
        raise ImportError("--train-backend megatron needs " + ", ".join(problems) + f"; install with: {INSTALL_HINT}")


def _lr_factor(o: OptimizerConfig, total_steps: int, step: int) -> float:
    from polyrl.backends.fsdp.backend import _lr_lambda  # one schedule definition for both backends
    return _lr_lambda(o, total_steps)(step)


@dataclass
class _Micro:
    pb: object  # thd.PackedBatch
    fields: dict
    dummy: bool
    index: list[int]  # global sample indices
    routes: dict | None = None  # MoE: router-order targets / masks of this rank's tokens (_route_plan)
    vision: dict | None = None  # vision-language: pixel inputs and [3, T] RoPE positions (_vision_inputs)
    mtp: tuple | None = None  # --enable-mtp-training, a training pass: mtp.plan_inputs (next ids, targets)
    sequences: list | None = None  # --true-on-policy: (ids [L_i], P_i) of the micro-batch's samples (exact.py)


@contextlib.contextmanager
def _prepared(optimizer, found_inf: bool, grad_norm: float):
    """megatron's ChainedOptimizer.step() copies the grads to the main grads and computes their norm, which the train
    step has already done (to keep a non-finite step off the weights): inside, step() reuses both (one grad pass less)."""
    optimizer.prepare_grads = lambda: found_inf
    optimizer.get_grad_norm = lambda: grad_norm
    try:
        yield
    finally:
        del optimizer.prepare_grads, optimizer.get_grad_norm


class MegatronBackend:
    """TrainBackend on megatron-core. Same constructor and methods as FSDPBackend, plus the
    `megatron` config section."""

    def __init__(self, model_cfg: ModelConfig, optim_cfg: OptimizerConfig, batch_cfg: BatchConfig, *, device: str,
                 total_steps: int = 1, need_ref: bool = False, need_teacher: bool = False, seed: int = 0,
                 megatron_cfg: MegatronConfig | None = None, role: str = "actor"):
        """role "critic": the same GPTModel with a value head (model.add_value_heads) on the actor's parallel state,
        from --critic-load or the actor's weights, with its own optimizer_cfg. need_teacher: --opd-teacher-load's
        frozen teacher, compute_logprobs(model="teacher")."""
        require_megatron()
        self.role = role
        from transformers import AutoConfig

        from polyrl.backends.megatron import model as mm  # megatron-core itself, imported only now
        from polyrl import multimodal
        from polyrl.backends.megatron import vision

        self.mm = mm
        self.mcfg, self.ocfg, self.bcfg = model_cfg, optim_cfg, batch_cfg
        self.mg = mg = megatron_cfg or MegatronConfig()
        self.total_steps = total_steps
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}")
        from polyrl import hf_families
        hf_families.register()  # MiMo (no remote code)
        self.hf_config = AutoConfig.from_pretrained(model_cfg.hf_checkpoint)
        self.dims = ParallelDims.from_world(tp=mg.tensor_model_parallel_size, pp=mg.pipeline_model_parallel_size,
                                            cp=mg.context_parallel_size, ep=mg.expert_model_parallel_size,
                                            etp=mg.expert_tensor_parallel_size)
        # vision-language: the decoder is built from its text config, the HF vision tower rides on the first stage
        self.vl_config = None
        if multimodal.is_vision_language(self.hf_config):
            vision.check_supported(self.hf_config, tp=self.dims.tp, pp=self.dims.pp, cp=self.dims.cp, ep=self.dims.ep,
                                   vpp=mg.num_layers_per_virtual_pipeline_stage, lora=model_cfg.lora_rank > 0,
                                   role=role, custom_provider=bool(mg.custom_model_provider_path),
                                   teacher=need_teacher, megatron_fsdp=mg.use_megatron_fsdp)
            self.vl_config, self.hf_config = self.hf_config, vision.text_config(self.hf_config)
            self._rope_index_model = vision.rope_index_model(self.vl_config)
        self.vpp = mm.virtual_pipeline_size(self.hf_config.num_hidden_layers, self.dims.pp,
                                            mg.num_layers_per_virtual_pipeline_stage)
        self.mtp_depths = 0  # --enable-mtp-training: the MTP layers' depths (polyrl/backends/megatron/mtp.py)
        if model_cfg.enable_mtp_training and role == "actor":
            from polyrl.backends.megatron import mtp
            self.mtp_depths = mtp.check_trainable(self.hf_config, model_cfg.hf_checkpoint, pp=self.dims.pp,
                                                  custom_provider=bool(mg.custom_model_provider_path))
        from megatron.core import parallel_state
        if role == "actor" or not parallel_state.model_parallel_is_initialized():  # a critic shares the actor's groups
            mm.init_parallel_state(self.dims, self.vpp, seed)
        self.dtype = model_cfg.dtype("cuda")
        self.config = mm.transformer_config(self.hf_config, mg, self.dims, self.vpp, self.dtype, model_cfg)
        self.ddp_config = mm.ddp_config(mg)
        mm.use_wgrad_fusion(self.config, mg, self.ddp_config)
        if self.ddp_config.use_megatron_fsdp and (self.dims.tp > 1 or self.dims.ep > 1 or self.dims.pp > 1):
            log.warning("Megatron-FSDP with TP/EP/PP > 1: training works through megatron-core, but weight export / "
                        "HF save gather only data-parallel shards and are proven for TP=EP=PP=1")
        # --compile (default on CUDA for the dense families, as on FSDP): polyrl's norms and RoPE compiled (compiled.py)
        self.compiled = model_cfg.compiled(self.device.type, self.hf_config.model_type)
        path = (model_cfg.critic_load or model_cfg.hf_checkpoint) if role == "critic" else model_cfg.hf_checkpoint
        self.seed = seed
        self.lora = None  # --lora-rank: lora.Lora of the actor's adapters (set by _build); the critic trains in full
        if model_cfg.lora_rank > 0 and role == "actor" and self.ddp_config.use_megatron_fsdp:
            raise ValueError("--lora-rank with --use-megatron-fsdp: LoRA on megatron is built for the DDP / distributed "
                             "optimizer path; drop --use-megatron-fsdp")
        self.model = self._build(path, train=True)
        self.exact = None  # --true-on-policy: the actor's forwards through the scoring function (exact.py)
        if model_cfg.true_on_policy and role == "actor":
            from polyrl.backends.megatron import exact
            why = exact.problem(self.hf_config, mg)
            if why is None and (self.dtype not in (torch.bfloat16, torch.float32) or model_cfg.lora_rank):
                why = "the mode runs in BF16 or FP32, without LoRA"
            if why is not None:
                raise ValueError(f"--true-on-policy with --train-backend megatron: {why}")
            self.exact = exact.ExactForward(self.hf_config, self.dtype, self.device,
                                            checkpointing=model_cfg.gradient_checkpointing)
        self.optimizer = mm.build_optimizer(self.model, optim_cfg, self.dtype, self.ddp_config.use_distributed_optimizer,
                                            cpu_offload=mg.optimizer_cpu_offload)
        # --release-grad-buffers (DDP): the gradient buffers, zero between steps, hold no GPU memory between steps
        self._grads, self._step_weights = None, None
        if mg.release_grad_buffers and not self.ddp_config.use_megatron_fsdp:
            from polyrl.backends.megatron.compat import inner_optimizers
            from polyrl.backends.megatron.offload import Released, ddp_grad_buffers
            self._grads = Released(ddp_grad_buffers(self.model))
            self._grads.release()
            if self.dtype == torch.bfloat16 and not mg.optimizer_cpu_offload:
                # the BF16 weights hold nothing while Adam runs (its moments are made at the first step): megatron
                # rewrites every one from its FP32 main parameter right after the inner step, where this hook gives
                # their bytes back; 2 bytes a parameter off the step's peak
                trained = [p for c in self.model for p in torch.nn.Module.parameters(c)
                           if p.requires_grad and p.dtype == torch.bfloat16]
                self._step_weights = Released(trained, kind="weights")
                for inner in inner_optimizers(self.optimizer):
                    inner.register_step_post_hook(lambda *_: self._step_weights.materialize(zero=False))
        self._offloader = None  # --offload-train: offload.StorageOffloader, made at the first offload()
        self.offloaded_bytes: dict[str, int] = {}  # what the last offload() moved or released, per kind
        # with LoRA the reference is the actor with its adapters off: no second model
        self.ref_model = (self._build(model_cfg.ref_load or model_cfg.hf_checkpoint, train=False)
                          if need_ref and self.lora is None else None)
        self._lora_ref = need_ref and self.lora is not None
        # --opd-teacher-load: kept like the reference model (resident, frozen, not in checkpoints: a resume reads its
        # directory again), but of any size: its own HF and transformer configs, RoPE tables and vocabulary
        self.teacher_hf_config, self._teacher_rope = None, None
        self.teacher_model = self._build_teacher(model_cfg.opd_teacher_load) if need_teacher else None
        self.sched_step = 0
        self.skipped_steps = 0
        self._set_lr()
        self._fused_experts = self._hf_uses_fused_experts()
        self.routing = None  # MoE: RouterReplay control and routing metrics (polyrl/backends/megatron/routing.py)
        if getattr(self.config, "num_moe_experts", None):
            from polyrl.backends.megatron.routing import MegatronRouting
            self.routing = MegatronRouting(self.model, self.hf_config.num_hidden_layers, self.config.num_moe_experts,
                                           self.config.moe_router_topk)
        from polyrl.backends.megatron import bridge
        self._wrapped_layers = any(bridge.wrapped_mixer(self.hf_config, i) is not None
                                   for i in range(self.hf_config.num_hidden_layers))
        self._rope = self._packed_rope(self.hf_config, self.model)

    # ---- construction -------------------------------------------------------------------
    def _packed_rope(self, hf_config, chunks: list):
        """polyrl's core attention applies RoPE when the model leaves it out (bridge-built models);
        HF-wrapped mixers and a custom provider's own RoPE need none from us."""
        from polyrl.backends.megatron import bridge, thd, vision
        if self.vl_config is not None and hf_config is self.hf_config:  # 3-D (multimodal) RoPE
            return vision.MropeRope(self.vl_config, self.dtype, self.device)
        no_pos = all(getattr(self.mm.unwrap(c), "position_embedding_type", None) == "none" for c in chunks)
        mixers = getattr(bridge.FAMILIES.get(hf_config.model_type), "mixers", None)
        return thd.PackedRope(hf_config, self.dtype, self.device) if no_pos and not mixers else None

    def _build(self, path: str, *, train: bool, hf_config=None, config=None) -> list:
        """hf_config / config: another model's (the OPD teacher's); by default the actor's."""
        import copy

        mm = self.mm
        hf_config = hf_config or self.hf_config
        config = self.config if train else copy.copy(config or self.config)  # frozen models get no grad-sync hooks
        chunks = mm.build_chunks(config, hf_config, self.dims, self.vpp, self.mg.custom_model_provider_path)
        if train and self.role == "critic":
            mm.add_value_heads(chunks, config)
        vl = self.vl_config is not None and hf_config is self.hf_config
        if vl:  # before DDP wrapping, so it trains, syncs and checkpoints with the decoder
            from polyrl.backends.megatron import vision
            for c in chunks:
                if c.pre_process:
                    c.vision_model = vision.build_tower(self.vl_config, config.params_dtype, self.device)
                    if self.mcfg.freeze_vision_tower:
                        c.vision_model.requires_grad_(False)
                    vision.attach_deepstack(c, self.vl_config)  # Qwen3-VL: its features join the first layers
        mm.load_hf_weights(chunks, path, hf_config, config, vl=vl)
        if self.compiled and not mm.apply_compile(chunks) and self.mcfg.compile:
            raise ValueError("--compile: the model from --custom-model-provider-path has none of the modules the Megatron "
                             "backend compiles (polyrl's HFRMSNorm and VarlenCoreAttention); drop --compile")
        if train:  # MTP layers (MiMo) train only with --enable-mtp-training; otherwise they are kept as loaded
            from polyrl.backends.megatron import mtp
            mtp.set_trainable(chunks, self.role == "actor" and self.mcfg.enable_mtp_training)
        if train and self.role == "actor" and self.mcfg.lora_rank > 0:  # adapters before DDP: it buffers trainable params only
            from polyrl.backends.megatron import lora
            self.lora = lora.attach(chunks, hf_config, config, self.mcfg, self.seed,
                                    lambda c: mm.chunk_layer_offset(config, c))
        if train:
            return mm.wrap_chunks(chunks, config, self.ddp_config)
        out = [mm.half_module(config, c) for c in chunks]
        for m in out:
            m.eval().requires_grad_(False)
        return out

    def _build_teacher(self, path: str) -> list:
        """The OPD teacher in the actor's parallel layout (TP / PP / virtual stages / CP / EP), from its own config.
        Micro-batches are packed once for all models (sequence-parallel padding included), and a pipeline runs one
        schedule, so the teacher must split into the same stages and agree on sequence parallelism."""
        from transformers import AutoConfig
        hf = AutoConfig.from_pretrained(path)
        stages = self.dims.pp * (self.vpp or 1)
        if hf.num_hidden_layers % stages:
            raise ValueError(f"--opd-teacher-load {path}: its {hf.num_hidden_layers} layers do not split into the "
                             f"student's {stages} pipeline stages (--pipeline-model-parallel-size {self.dims.pp}"
                             + (f" x {self.vpp} virtual stages, --num-layers-per-virtual-pipeline-stage" if self.vpp else "")
                             + "); the teacher runs in the student's layout: pick a layout that divides both")
        config = self.mm.transformer_config(hf, self.mg, self.dims, self.vpp, self.dtype)
        if config.sequence_parallel != self.config.sequence_parallel:  # MoE turns it on at TP > 1
            raise ValueError(f"--opd-teacher-load {path}: sequence parallelism would be {config.sequence_parallel} for the "
                             f"teacher and {self.config.sequence_parallel} for the student (a MoE model needs it at "
                             "--tensor-model-parallel-size > 1); set --sequence-parallel so both agree")
        chunks = self._build(path, train=False, hf_config=hf, config=config)
        self.teacher_hf_config, self._teacher_rope = hf, self._packed_rope(hf, chunks)
        return chunks

    def _hf_uses_fused_experts(self) -> bool:
        """transformers >= 5 keeps MoE experts stacked in memory; the rollout engine's parameter
        names are those, so export matches them."""
        from transformers import AutoModelForCausalLM
        from polyrl.backends.megatron import bridge
        if not bridge.num_experts(self.hf_config):
            return False
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(self.hf_config)
        return any(n.endswith("mlp.experts.gate_up_proj") for n, _ in m.named_parameters())

    # ---- groups -------------------------------------------------------------------------
    @property
    def ps(self):
        from megatron.core import parallel_state
        return parallel_state

    def _reporting_rank(self) -> bool:
        """One rank per data-parallel replica reports per-sample results and metrics."""
        ps = self.ps
        return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0)

    # ---- data ---------------------------------------------------------------------------
    def _gather_batch(self, batch: TrainBatch, with_fields: bool) -> tuple[TrainBatch, list[int]]:
        mine = (batch.input_ids, batch.prompt_lens, batch.token_fields if with_fields else {},
                batch.rollout_routed_experts, batch.recorded_routed_experts,
                (batch.multimodal or [None] * len(batch)) if self.vl_config is not None else None)
        parts = _all_objects(mine)
        ids, plens, fields, counts = [], [], {}, []
        routes: list[list | None] = [[], []]
        mms: list | None = [] if self.vl_config is not None else None
        for p_ids, p_pl, p_f, *p_routes, p_mm in parts:
            if mms is not None:
                mms += p_mm
            counts.append(len(p_ids))
            ids += p_ids
            plens += p_pl
            for k, v in p_f.items():
                fields.setdefault(k, []).extend(v)
            for j, r in enumerate(p_routes):  # a route list counts only when every rank carries one
                routes[j] = routes[j] + r if (routes[j] is not None and r is not None) else None
        return TrainBatch(ids, plens, fields, *(r if r else None for r in routes), multimodal=mms), counts

    def _route_mode(self, glob: TrainBatch, *, actor: bool, logprob_pass: bool) -> tuple[str | None, list | None]:
        """(what the routers do, the per-sample routes that go with it) for one pass over `glob`: replay the
        rollout's routes (R3) or the log-prob pass's (R2), record (R2's log-prob pass), compare with the rollout's
        routes (moe/topk_mismatch_frac), or route freely (None)."""
        m = self.mcfg
        if self.routing is None or not actor:
            return None, None
        if m.use_rollout_routing_replay:
            if glob.rollout_routed_experts is None:
                raise ValueError("--use-rollout-routing-replay: these samples carry no routed experts; the rollout "
                                 "engine must return them (SGLang: launch with --enable-return-routed-experts)")
            return "replay", glob.rollout_routed_experts
        if m.use_routing_replay and glob.recorded_routed_experts is not None:
            return "replay", glob.recorded_routed_experts
        if m.use_routing_replay and logprob_pass:
            return "record", glob.rollout_routed_experts
        return ("compare", glob.rollout_routed_experts) if glob.rollout_routed_experts is not None else (None, None)

    def _route_plan(self, pb, mb: TrainBatch, routes: list | None) -> dict:
        """Router-order targets (or experts 0..k-1 where none is given) and masks of one micro-batch."""
        from polyrl.backends.megatron.routing import router_targets
        offs = [int(x) for x in pb.cu_seqlens.cpu()]
        lens = [int(x.numel()) for x in mb.input_ids]
        sp = self.dims.tp if self.config.sequence_parallel else 1
        sp_rank = self.ps.get_tensor_model_parallel_rank() if sp > 1 else 0
        given = routes if routes is not None else [torch.zeros(max(n - 1, 0), self.hf_config.num_hidden_layers,
                                                               self.config.moe_router_topk, dtype=torch.long) for n in lens]
        targets, has, glob_idx = router_targets(pb.token_index, offs, given, self.hf_config.num_hidden_layers,
                                                self.config.moe_router_topk, sp, sp_rank)
        real = torch.zeros(offs[-1], dtype=torch.bool)
        for off, n in zip(offs, lens):
            real[off:off + n] = True
        return dict(targets=targets.to(self.device) if routes is not None else None, has=has.to(self.device),
                    valid=real[glob_idx].to(self.device), glob=glob_idx, offsets=offs, lens=lens)

    def _plan(self, glob: TrainBatch, routes: list | None = None, mtp_depths: int = 0) -> list[_Micro]:
        """This data-parallel rank's micro-batches, as many on every rank (EP all-to-alls and
        Megatron-FSDP gathers run per forward), a multiple of PP with virtual stages. mtp_depths: the MTP layers'
        inputs of each micro-batch (a training pass with --enable-mtp-training)."""
        ps = self.ps
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        lens = [int(x.numel()) for x in glob.input_ids]
        kw = self.bcfg.micro_batch_plan(self.device.type, max(lens, default=1))
        dyn = "max_tokens" in kw
        if dyn:
            shards = plan_micro_batches(lens, max_tokens=max(sum(lens), 1), num_micro_batches=dp)
        else:
            shards = plan_micro_batches(lens, micro_batch_size=max(-(-len(lens) // dp), 1), num_micro_batches=dp)
        shard = shards[dp_rank] if len(lens) else []
        slens = [lens[i] for i in shard]
        k = len(plan_micro_batches(slens, **kw)) if slens else 1
        if dist.get_world_size() > 1:  # as many forwards on every rank
            t = torch.tensor(k, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            k = int(t)
        if self.vpp:
            k = -(-k // self.dims.pp) * self.dims.pp
        local = plan_micro_batches(slens, num_micro_batches=k, **kw) if slens else [[] for _ in range(k)]
        if self.exact is not None and dyn and slens:  # as many micro-batches, padded to fewer blocks in all
            from polyrl.backends.true_on_policy import block_rows
            local = fewer_blocks(local, slens, max_tokens=kw["max_tokens"], block=block_rows(self.device))
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        sp = self.dims.tp if self.config.sequence_parallel else 1
        from polyrl.backends.megatron import thd
        out = []
        for idx in local:
            gidx = [shard[i] for i in idx]
            if gidx:
                mb = glob.select(gidx)
            else:  # nothing for this rank: a 2-token dummy keeps the collectives in step; its loss is x0
                mb = TrainBatch([torch.zeros(2, dtype=torch.long)], [1], {k_: [torch.zeros(1)] for k_ in glob.token_fields})
            pb = thd.pack_thd(mb.input_ids, mb.prompt_lens, cp_size=cp, cp_rank=cp_rank, sp_size=sp, device=self.device)
            fields = dict(zip(mb.token_fields, to_device([torch.cat(v) for v in mb.token_fields.values()], self.device)))
            fields["seq_ids"] = pb.seq_ids
            rp = None
            if self.routing is not None:
                rp = self._route_plan(pb, mb, [routes[i] for i in gidx] if (routes is not None and gidx) else None)
            vis = self._vision_inputs(mb, pb) if self.vl_config is not None else None
            out.append(_Micro(pb, fields, not gidx, gidx, rp, vis))
            if self.exact is not None:
                out[-1].sequences = list(zip(mb.input_ids, mb.prompt_lens))
            if mtp_depths:
                from polyrl.backends.megatron import mtp
                out[-1].mtp = mtp.plan_inputs(mb.input_ids, pb, mtp_depths)
        return out

    def _vision_inputs(self, mb: TrainBatch, pb) -> dict:
        """A micro-batch's pixel inputs (every image, in token order) and its tokens' [3, T] RoPE positions, each
        sample's from the model's own get_rope_index as an unpacked HF forward computes them."""
        from polyrl import multimodal
        from polyrl.backends.megatron import vision
        mms = mb.multimodal or [None] * len(mb)
        token = self.vl_config.image_token_id
        per = [multimodal.mrope_positions(self._rope_index_model, x.long(), m["image_grid_thw"] if m is not None else None,
                                          token) for x, m in zip(mb.input_ids, mms)]
        return {"pos3": vision.packed_positions(per, pb.cu_seqlens).to(self.device),
                **multimodal.concat_inputs(mms, self.device)}

    def _decoder_input(self, chunk, ids: torch.Tensor, pos: torch.Tensor, vis: dict) -> torch.Tensor:
        """Megatron's token embedding [T, 1, H] with the vision tower's features in the image-pad rows."""
        from polyrl.backends.megatron import vision
        emb = chunk.embedding(input_ids=ids, position_ids=pos)
        return vision.decoder_input(chunk, emb, ids, vis, self.vl_config.image_token_id)

    def _run(self, model: list, micros: list[_Micro], loss_func, *, forward_only: bool, temperature: float,
             with_entropy: bool, route_mode: str | None = None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mm = self.mm
        cp_group = self.ps.get_context_parallel_group()
        chunk_ids = {id(c): i for i, c in enumerate(model)}
        micro_ids = {id(m): i for i, m in enumerate(micros)}
        teacher = model is self.teacher_model  # a teacher of another size has its own vocabulary and RoPE
        exact = self.exact is not None and model is self.model  # the actor's passes (exact is None on a critic)
        hf_config, rope = (self.teacher_hf_config, self._teacher_rope) if teacher else (self.hf_config, self._rope)

        def forward_step(data_iterator, chunk):
            item = next(data_iterator)
            if exact:  # the scoring function over this chunk's parameters (exact.py), not megatron's layers
                c = mm.unwrap(chunk)
                out = self.exact(c.named_parameters(), item.sequences, temperature=temperature,
                                 with_entropy=with_entropy, training=c.training)
                return out, functools.partial(loss_func, item)
            if self.routing is not None and model is self.model:
                rp = item.routes
                self.routing.begin(chunk_ids[id(chunk)], micro_ids[id(item)], targets=rp["targets"], has=rp["has"],
                                   valid=rp["valid"], replay=route_mode == "replay" and not item.dummy,
                                   record=route_mode == "record" and not item.dummy)
            vis = item.vision if not teacher else None
            ids, pos, psp = mm.packed_inputs(item.pb, cp_group, rope, vis["pos3"] if vis is not None else None)
            extra = {}
            if vis is not None and mm.unwrap(chunk).pre_process:
                extra["decoder_input"] = self._decoder_input(mm.unwrap(chunk), ids, pos, vis)
            if self.role == "critic":  # values where the actor has log-probs; the head lives on the last stage only
                head, ctx = mm.value_head, mm.ValueContext(item.pb, getattr(mm.unwrap(chunk), mm.VALUE_HEAD, None))
            else:
                head = mm.logprob_head
                ctx = mm.HeadContext(item.pb, hf_config.vocab_size, temperature, self.mcfg.logprob_chunk_size,
                                     with_entropy)
                if item.mtp is not None and model is self.model:
                    from polyrl.backends.megatron import mtp
                    ctx.mtp = mtp.MTPInputs(mm.unwrap(chunk), *item.mtp, detach=self.mcfg.mtp_detach_encoder)
            out = chunk(ids, pos, None, packed_seq_params=psp, output_processor=head, output_processor_context=ctx,
                        **extra)
            return out, functools.partial(loss_func, item)

        its = [iter(micros) for _ in model]
        fb = get_forward_backward_func()
        try:
            return fb(forward_step_func=forward_step, data_iterator=its if len(model) > 1 else its[0],
                      model=model if len(model) > 1 else model[0], num_microbatches=len(micros),
                      seq_length=max(int(m.pb.input_ids.numel()) for m in micros), micro_batch_size=1,
                      forward_only=forward_only)
        finally:
            if self.routing is not None and model is self.model:
                self.routing.end()
            if exact:
                self.exact.release()

    # ---- TrainBackend ---------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, model: str = "actor", temperature: float = 1.0) -> list[torch.Tensor]:
        self.onload()  # (a no-op unless offloaded)
        lora_ref = model == "ref" and self._lora_ref
        m = {"actor": self.model, "ref": self.model if lora_ref else self.ref_model, "teacher": self.teacher_model}[model]
        if m is None:
            raise ValueError(f"compute_logprobs(model={model!r}): this backend was built without that model")
        glob, counts = self._gather_batch(batch, with_fields=False)
        mode, routes = self._route_mode(glob, actor=model == "actor", logprob_pass=True)
        micros = self._plan(glob, routes)
        found: dict[int, torch.Tensor] = {}

        def collect(item: _Micro, output):
            logp, _ = output
            if not item.dummy:
                for i, part in zip(item.index, logp.float().cpu().split(item.pb.response_lens)):
                    found[i] = part
            return logp.sum() * 0.0, {}

        for c in m:
            c.eval()
        with self.lora.disabled() if lora_ref else contextlib.nullcontext():
            self._run(m, micros, collect, forward_only=True, temperature=temperature, with_entropy=False,
                      route_mode=mode)
        parts = _all_objects(found if self._reporting_rank() else {})
        merged: dict[int, torch.Tensor] = {}
        for p in parts:
            merged.update(p)
        start = sum(counts[:dist.get_rank()])
        mine = range(start, start + counts[dist.get_rank()])
        if mode == "record":  # R2: each rank holds its CP / SP / stage share of its micro-batches' routes; join them
            from polyrl.backends.megatron.routing import merge_route_shares
            from polyrl.backends.routing_replay import routes_dtype
            shares: dict[int, tuple] = {}
            # without SP every TP rank routes the same tokens: one of them sends
            sends = self.config.sequence_parallel or self.ps.get_tensor_model_parallel_rank() == 0
            for k, item in enumerate(micros):
                if item.dummy:
                    continue
                got = self.routing.take_recorded(k, item.routes["glob"], item.routes["offsets"], item.routes["lens"])
                if sends:
                    shares.update({item.index[j]: r for j, r in got.items()})
            parts = _all_objects(shares)
            lens = {i: int(glob.input_ids[i].numel()) for i in mine}
            full = merge_route_shares(parts, lens, self.hf_config.num_hidden_layers, self.config.moe_router_topk,
                                      routes_dtype(self.config.num_moe_experts))
            batch.recorded_routed_experts = [full[i] for i in mine]
        return [merged[i] for i in mine]

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The critic's value of the state before each response token, one [R_i] tensor per sample (role "critic")."""
        if self.role != "critic":
            raise ValueError("compute_values: this backend is not a critic (build it with role='critic')")
        return self.compute_logprobs(batch)  # the critic's output processor gives values where the actor's gives log-probs

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, temperature: float = 1.0, with_entropy: bool = False) -> dict[str, float]:
        self.onload()
        for c in self.model:
            c.train()
        glob, _ = self._gather_batch(batch, with_fields=True)
        num_tokens = float(sum(float(x.sum()) for x in glob.token_fields["loss_mask"]))
        num_seqs = float(len(glob))
        mode, routes = self._route_mode(glob, actor=True, logprob_pass=False)
        depths = self.mtp_depths
        micros = self._plan(glob, routes, depths)
        from polyrl.backends.fsdp.mtp import mtp_loss, mtp_token_counts, mtp_token_weights
        # the MTP loss's global token counts per depth (glob is every rank's batch)
        mtp_counts = mtp_token_counts(glob.response_lens, glob.token_fields["loss_mask"], depths) if depths else []
        scale = self.ps.get_data_parallel_world_size() * len(micros)  # megatron: x cp / n_micro; DDP: / (dp x cp)
        report = self._reporting_rank()
        sums: dict[str, float] = {}

        def loss_func(item: _Micro, output):
            logp, ent, *mtp_logp = output
            loss, metrics = loss_fn(logp, ent if with_entropy else None, item.fields, num_tokens=num_tokens,
                                    num_seqs=num_seqs)
            extra = 0.0  # the MTP loss trains but is reported apart from the policy loss (metric mtp_loss)
            if mtp_logp:
                weights = mtp_token_weights(item.fields["seq_ids"], item.fields["loss_mask"], depths)
                term, per_depth = mtp_loss(mtp_logp[0], weights, mtp_counts)
                extra = term * (0.0 if item.dummy else self.mcfg.mtp_loss_scaling_factor)
                metrics = {**metrics, "mtp_loss": per_depth.mean()}
            if item.dummy:
                loss = loss * 0.0
            elif report:  # kept as device tensors: a host sync here would stall the GPU before each backward
                merge_metric(sums, "loss", loss.detach().double())
                for k, v in metrics.items():  # the largest over micro-batches and ranks for *_max, else the sum
                    merge_metric(sums, k, v.detach().double())
            return (loss + extra) * scale, {}

        if self._grads is not None:
            self._grads.materialize(zero=False)  # zero_grad_buffer zeroes them next
        for c in self.model:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self.model, micros, loss_func, forward_only=False, temperature=temperature, with_entropy=with_entropy,
                  route_mode=mode)

        if self._offloader is not None:
            self._offloader.onload()  # --offload-train: the main parameters and Adam moments, away until the step
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if sums:  # one host sync for every metric of the step
            sums = dict(zip(sums, torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device)
                                               for v in sums.values()]).tolist()))
        parts = _all_objects(sums)
        total: dict[str, float] = {}
        for p in parts:
            for k, v in p.items():
                merge_metric(total, k, v)
        loss_total = total.pop("loss", 0.0)
        skipped = not math.isfinite(grad_norm) or not math.isfinite(loss_total)
        if skipped:  # a NaN/inf never reaches the weights (nor the Adam moments)
            self.skipped_steps += 1
            log.warning("non-finite loss or grad norm (%s); optimizer step skipped", grad_norm)
        lr = self.ocfg.lr * _lr_factor(self.ocfg, self.total_steps, self.sched_step)  # the rate this step applies
        if not skipped:
            self._set_lr()
            if self._step_weights is not None:
                self._step_weights.release()
            with _prepared(self.optimizer, found_inf, grad_norm):
                self.optimizer.step()
            if self._step_weights is not None and self._step_weights.released:
                raise RuntimeError("megatron's optimizer skipped its inner step, so the BF16 weights released for it "
                                   "were not rewritten from the main parameters: run with --no-release-grad-buffers")
            self.sched_step += 1  # a skipped step does not advance the schedule either
        if self._grads is None:  # released buffers are zeroed (and megatron's per-step flags reset) by the next step
            for c in self.model:
                c.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self._grads is not None:
            self._grads.release()
        out = {"loss": loss_total, **total}
        out.update(grad_norm=grad_norm, lr=lr, skipped_step=float(skipped))
        if self.routing is not None:
            from polyrl.backends.routing_replay import routes_nbytes
            out.update(self.routing.drain_metrics())
            out["moe/routed_experts_bytes"] = float(routes_nbytes(batch.rollout_routed_experts)
                                                    + routes_nbytes(batch.recorded_routed_experts))
        return out

    def _set_lr(self) -> None:
        lr = self.ocfg.lr * _lr_factor(self.ocfg, self.total_steps, self.sched_step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)

    # ---- weights ------------------------------------------------------------------------
    def _local_tensor(self, p: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        if isinstance(p, DTensor):  # Megatron-FSDP shards over data parallel ranks
            from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
            return uneven_dtensor_to_full_tensor(p).to(self.dtype)  # fp32 main weights -> compute dtype
        return p.detach()

    def _named_params(self, chunk, adapters: bool = False):
        """GPTModel-level names -> parameters. Under Megatron-FSDP the module's own parameters
        switch between gathered compute buffers (freed after use) and sharded ones, so the
        optimizer's sharded (up-to-date) parameters are read instead. LoRA: the base weights with
        the adapters merged in (this rank's shards), or with adapters=True the adapters alone."""
        if self.lora is not None and any(chunk is c for c in self.model):
            from polyrl.backends.megatron import lora
            named = self.mm.bridge_tensors(self.mm.unwrap(chunk))
            if adapters:
                return {n: p for n, p in named.items() if lora.is_adapter(n)}
            return self.lora.merged(named)
        if self.ddp_config.use_megatron_fsdp:
            out = {}
            for n, p in chunk.param_and_grad_buffer.optimizer_named_parameters:
                while n.startswith("module."):
                    n = n[len("module."):]
                out[n] = p
            out.update((n, b) for n, b in self.mm.bridge_tensors(self.mm.unwrap(chunk)).items() if n not in out
                       and n.endswith("expert_bias"))
            return out
        return self.mm.bridge_tensors(self.mm.unwrap(chunk))

    def _megatron_stream(self, model: list, adapters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(megatron name with global layer and expert indices, full tensor) for every parameter,
        on every rank: gathered over TP / expert-TP and EP, broadcast over PP. adapters: LoRA's
        adapter parameters instead (lora.gather_adapter joins their TP shards)."""
        from polyrl.backends.megatron import bridge, lora

        ps, mm = self.ps, self.mm
        tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        etp_group, ep_group = ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group()
        pp, pp_rank = self.dims.pp, ps.get_pipeline_model_parallel_rank()
        n_exp = bridge.num_experts(self.hf_config)
        per_ep = n_exp // self.dims.ep if n_exp else 0
        fsdp = self.ddp_config.use_megatron_fsdp

        def gather(t: torch.Tensor, group) -> list[torch.Tensor]:
            if group is None or dist.get_world_size(group) == 1:
                return [t]
            out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(out, t.contiguous(), group=group)
            return out

        for stage in range(pp):
            src = dist.get_global_rank(pp_group, stage) if pp > 1 else None
            for v in range(len(model)):
                meta = None
                if stage == pp_rank:
                    meta = (mm.chunk_layer_offset(self.config, mm.unwrap(model[v])),
                            list(self._named_params(model[v], adapters)))
                if pp > 1:
                    box = [meta]
                    dist.broadcast_object_list(box, src=src, group=pp_group)
                    meta = box[0]
                offset, names = meta
                params = self._named_params(model[v], adapters) if stage == pp_rank else {}
                for name in names:
                    expert = ".local_experts." in name
                    full: list[torch.Tensor] | None = None
                    if stage == pp_rank:
                        t = self._local_tensor(params[name])
                        if adapters:
                            t = lora.gather_adapter(name, gather(t, tp_group))
                        elif not fsdp:
                            t = bridge.gather_from_tp(name, gather(t, etp_group if expert else tp_group),
                                                      self.hf_config)
                        full = gather(t, ep_group) if expert else [t]
                    if pp > 1:
                        box = [None if full is None else (tuple(full[0].shape), len(full), full[0].dtype)]
                        dist.broadcast_object_list(box, src=src, group=pp_group)
                        shape, count, dtype = box[0]  # (expert_bias stays fp32 in a bf16 model)
                        if full is None:
                            full = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(count)]
                        for t in full:
                            dist.broadcast(t, src=src, group=pp_group)
                    m = _LAYER.fullmatch(name)
                    for r, t in enumerate(full):
                        gname = name
                        if m:
                            rest = m[2]
                            e = _EXPERT.fullmatch(rest)
                            if e:
                                rest = f"mlp.experts.local_experts.{int(e[1]) + r * per_ep}.{e[2]}"
                            gname = f"decoder.layers.{int(m[1]) + offset}.{rest}"
                        yield gname, t

    def _export(self, model: list, fused_experts: bool) -> Iterator[tuple[str, torch.Tensor]]:
        from polyrl.backends.megatron import bridge
        if self.vl_config is not None:  # the decoder through the bridge, the vision tower under its HF names
            from polyrl.backends.megatron import vision
            yield from vision.export_hf(self._megatron_stream(model), functools.partial(
                bridge.mcore_to_hf, hf_config=self.hf_config, fused_experts=fused_experts))
            return
        if self.role != "critic":
            yield from bridge.mcore_to_hf(self._megatron_stream(model), self.hf_config, fused_experts=fused_experts)
            return
        # the critic as HF's *ForTokenClassification: the body's names, no lm_head, the value head as `score`
        head: dict[str, torch.Tensor] = {}

        def body():
            for name, t in self._megatron_stream(model):
                if name.startswith(self.mm.VALUE_HEAD + "."):
                    head["score." + name.rsplit(".", 1)[1]] = t
                else:
                    yield name, t
        for name, t in bridge.mcore_to_hf(body(), self.hf_config, fused_experts=fused_experts):
            if name != "lm_head.weight":
                yield name, t
        yield from head.items()

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (the in-memory names of the HF model, like FSDP), gathered over
        TP / EP and broadcast over PP one parameter at a time."""
        with self._resident(self._export_kinds(), read_only=True):
            yield from self._export(self.model, self._fused_experts)

    @torch.no_grad()
    def sync_ref_from_actor(self) -> None:
        if self.ref_model is None:
            return
        mm = self.mm
        with self._resident():
            for a, r in zip(self.model, self.ref_model):
                rp = mm.bridge_tensors(mm.unwrap(r))
                for n, p in self._named_params(a).items():
                    rp[n].copy_(self._local_tensor(p))

    def save_hf(self, path: str, tokenizer=None, *, adapter: bool = False) -> None:
        """adapter (--save-hf-adapter, LoRA only): a peft adapter directory (PeftModel.from_pretrained loads it onto
        the base model) instead of the merged model."""
        if adapter:
            self._save_adapter(path, tokenizer)
            return
        sd = {}
        for name, t in self.export_weights():
            if dist.get_rank() == 0:
                sd[name] = t.to("cpu", copy=True)
        if dist.get_rank() == 0:
            from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

            from polyrl.backends.fsdp.backend import _replace_dir
            if self.role == "critic":
                import copy
                cfg = copy.copy(self.hf_config)
                cfg.num_labels = 1
                hf = AutoModelForTokenClassification.from_config(cfg, dtype=self.dtype)
            elif self.vl_config is not None:
                from transformers import AutoModelForImageTextToText
                hf = AutoModelForImageTextToText.from_config(self.vl_config, dtype=self.dtype)
            else:
                hf = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype)
            missing, unexpected = hf.load_state_dict(sd, strict=False)
            missing = [k for k in missing if not (k == "lm_head.weight" and self.hf_config.tie_word_embeddings)]
            if missing or unexpected:
                raise RuntimeError(f"save_hf: exported weights do not fit the HF model: missing {missing[:5]}, "
                                   f"unexpected {unexpected[:5]}")
            tmp = path.rstrip("/") + ".tmp"
            hf.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if self.vl_config is not None:  # loaded back with its image processor, as the FSDP backend saves it
                from polyrl.multimodal import VisionProcessor
                processor = VisionProcessor.from_pretrained(self.mcfg.hf_checkpoint, tokenizer)
                if processor is not None:
                    processor.save_pretrained(tmp)
            _replace_dir(tmp, path)
        dist.barrier()

    def _save_adapter(self, path: str, tokenizer=None) -> None:
        from polyrl.backends.megatron import lora
        if self.lora is None:
            raise ValueError("--save-hf-adapter writes LoRA adapters: train with --lora-rank R")
        with self._resident(self._export_kinds(), read_only=True):
            tensors = {}
            for name, t in lora.stream_to_peft(self._megatron_stream(self.model, adapters=True)):
                if dist.get_rank() == 0:
                    tensors[name] = t.to("cpu", copy=True)
        if dist.get_rank() == 0:
            from polyrl.backends.fsdp.backend import _replace_dir
            m = self.mcfg
            tmp = path.rstrip("/") + ".tmp"
            lora.write_peft_dir(tmp, tensors, lora.adapter_config(m.lora_rank, m.lora_alpha, m.lora_dropout,
                                                                  self.lora.hf_targets, m.hf_checkpoint))
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            _replace_dir(tmp, path)
        dist.barrier()

    # ---- checkpoints ----------------------------------------------------------------------
    def _ckpt_metadata(self) -> dict:
        return {"distrib_optim_sharding_type": "fsdp_dtensor" if self.ddp_config.use_megatron_fsdp
                else "fully_reshardable",  # model-space layout: loads onto other TP / PP / DP degrees
                "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                # HF-wrapped mixers differ per layer (DeltaNet vs attention): one key per layer,
                # not megatron's stacked [num_layers, ...] tensors
                "non_homogeneous_layers": self._wrapped_layers,
                "dp_cp_group": self.ps.get_data_parallel_group(with_context_parallel=True)}

    def _sharded_state(self, is_loading: bool) -> dict:
        md = self._ckpt_metadata()
        sd: dict = {}
        if self.ddp_config.use_megatron_fsdp:
            sd["model"] = self.model[0].state_dict()
        else:
            # the GPTModel itself: Float16Module's sharded dict carries a `module.` prefix its
            # load_state_dict does not accept
            for i, m in enumerate(self.model):
                msd = self.mm.unwrap(m).sharded_state_dict(metadata=md)
                if self.lora is not None:  # the adapters only: the frozen base is re-read from --hf-checkpoint
                    from polyrl.backends.megatron import lora
                    msd = {k: v for k, v in msd.items() if lora.is_adapter(k)}
                sd[f"model{i}"] = msd
            if self.ref_model is not None:
                for i, m in enumerate(self.ref_model):
                    sd[f"ref{i}"] = _prefix_keys(self.mm.unwrap(m).sharded_state_dict(metadata=md), "ref.")
        sd["optimizer"] = self.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=md)
        return sd

    def save(self, path: str, *, optimizer: bool = True, background: bool = False) -> None:
        if not optimizer:  # refused at start-up (no save_without_optimizer capability); a direct caller hears it here
            raise NotImplementedError("the megatron backend saves its distributed optimizer with the weights")
        if background:  # refused at start-up (no async_save capability)
            raise NotImplementedError("the megatron backend writes its checkpoints in the foreground")
        with self._resident():
            self._save(path)

    def _save(self, path: str) -> None:
        ckpt = os.path.join(path, "dcp")
        os.makedirs(ckpt, exist_ok=True)
        if self.ddp_config.use_megatron_fsdp:
            compat.fill_empty_shard_states(self.optimizer)
        sd = self._sharded_state(is_loading=False)
        if self.ddp_config.use_megatron_fsdp:  # Megatron-FSDP: PyTorch DCP over its DTensors
            import torch.distributed.checkpoint as dcp
            from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
                preprocess_state_dict_for_uneven_dtensor)
            preprocess_state_dict_for_uneven_dtensor(sd)
            dcp.save(sd, checkpoint_id=ckpt)
        else:
            from megatron.core import dist_checkpointing
            dist_checkpointing.save(sd, ckpt)
        from megatron.core import tensor_parallel
        extra = {"sched_step": self.sched_step, "skipped_steps": self.skipped_steps, "cpu_rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        torch.save(extra, os.path.join(path, f"extra_rank{dist.get_rank()}.pt"))
        dist.barrier()

    def load(self, path: str) -> None:
        with self._resident():
            self._load(path)

    def _load(self, path: str) -> None:
        ckpt = os.path.join(path, "dcp")
        if not self.ddp_config.use_megatron_fsdp:
            # megatron's DistributedOptimizer.state_dict() needs Adam state (torch AdamW, no Apex/TE,
            # makes it lazily); a fresh optimizer gets zero-filled state that the load overwrites
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
                compat.keep_adam_step_on_load(opt)
        else:
            compat.fill_empty_shard_states(self.optimizer)
        sd = self._sharded_state(is_loading=True)
        if self.ddp_config.use_megatron_fsdp:
            import torch.distributed.checkpoint as dcp
            from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
                preprocess_state_dict_for_uneven_dtensor)
            raw_model, raw_opt = sd["model"], sd["optimizer"]
            preprocess_state_dict_for_uneven_dtensor(sd)
            dcp.load(sd, checkpoint_id=ckpt)
            self.model[0].load_state_dict(raw_model, strict=False)
            self.optimizer.load_state_dict(raw_opt)
        else:
            from megatron.core import dist_checkpointing
            loaded = dist_checkpointing.load(sd, ckpt)
            for i, m in enumerate(self.model):
                if self.lora is not None:
                    missing, unexpected = self.mm.unwrap(m).load_state_dict(loaded[f"model{i}"], strict=False)
                    from polyrl.backends.megatron import lora
                    missing = [k for k in missing if lora.is_adapter(k)]
                    if missing or unexpected:
                        raise RuntimeError(f"{path}: a LoRA checkpoint of other adapters (--lora-rank / "
                                           f"--lora-target-modules): missing {missing[:4]}, unexpected {unexpected[:4]}")
                else:
                    self.mm.unwrap(m).load_state_dict(loaded[f"model{i}"])
            if self.ref_model is not None:
                for i, m in enumerate(self.ref_model):
                    self.mm.unwrap(m).load_state_dict(loaded[f"ref{i}"])
            self.optimizer.load_state_dict(loaded["optimizer"])
        compat.untie_adam_steps(self.optimizer)
        compat.use_fused_adam(self.optimizer)
        from polyrl.checkpoint import load_extras
        extra = load_extras(path)  # tensors and plain values only: a checkpoint from elsewhere runs no code
        self.sched_step, self.skipped_steps = extra["sched_step"], extra["skipped_steps"]
        torch.set_rng_state(extra["cpu_rng"])
        torch.cuda.set_rng_state(extra["cuda_rng"])
        from megatron.core import tensor_parallel
        tensor_parallel.get_cuda_rng_tracker().set_states(extra["tracker"])
        self._set_lr()

    # ---- colocation ---------------------------------------------------------------------
    def offload(self) -> None:
        """--offload-train: free the GPU for a colocated engine. Weights, fp32 main parameters, Adam state and the frozen
        models (reference, teacher) go to pinned host memory (non-blocking copies), the gradient buffers (zero between
        steps) are released; every storage is emptied in place, so megatron's views into its buffers stay valid
        (polyrl/backends/megatron/offload.py). A no-op without --offload-train or when already offloaded."""
        if not self.mcfg.offload_train:
            return
        from polyrl.backends.megatron.offload import StorageOffloader, megatron_state
        if self._offloader is None:
            self._offloader = StorageOffloader()
        self.offloaded_bytes = self._offloader.offload(
            megatron_state(self.model, self.optimizer, [self.ref_model, self.teacher_model]))

    def onload(self) -> None:
        """Weights, gradient buffers and frozen models back on the GPU; the FP32 main parameters and Adam moments only
        at the optimizer step (train_step), so log-prob passes, forward and backward run beside less state."""
        if self._offloader is not None:
            from polyrl.backends.megatron.offload import STEP_ONLY
            self._offloader.onload(skip=STEP_ONLY)

    def _export_kinds(self) -> tuple[str, ...]:
        """What an export reads: the BF16 (or FP32) weights with DDP; under Megatron-FSDP the parameters are DTensors
        over its FP32 main-weight buffer (offload.megatron_state files it under main_params), gathered from there."""
        return ("weights", "main_params") if self.ddp_config.use_megatron_fsdp else ("weights",)

    @contextlib.contextmanager
    def _resident(self, kinds: tuple[str, ...] | None = None, read_only: bool = False):
        """Exports and checkpoints use the state while --offload-train keeps it on the host: bring back what they use
        (`kinds` of offload.megatron_state, all by default), then offload again. read_only (exports, saves): what came
        back is emptied again without a copy, its host copy still holding its values; an export of a 7B model then
        moves its BF16 weights one way, not the weights, FP32 main parameters and Adam moments both ways."""
        off = self._offloader
        if off is None or not off.offloaded:
            yield
            return
        back = off.onload(only=kinds)
        try:
            yield
        finally:
            if read_only:
                off.put_back(back)
            else:
                self.offload()


def _all_objects(obj) -> list:
    """Every rank's obj (dist.all_gather_object); one rank keeps it without the pickling, the device round trip and
    the host sync that the collective costs even alone."""
    if dist.get_world_size() == 1:
        return [obj]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


def _prefix_keys(sd: dict, prefix: str) -> dict:
    """Give the reference model's sharded tensors their own checkpoint keys."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    for v in sd.values():
        if isinstance(v, ShardedBase):
            v.key = prefix + v.key
    return sd
