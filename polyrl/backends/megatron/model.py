"""megatron-core model construction: parallel state, layer spec, GPTModel chunks, HF weights in,
DDP / Megatron-FSDP wrapping, optimizer. Imports megatron-core at module level: only
`backend.py` imports this module, and only once a Megatron backend is built.

Why GPTModel and not HybridModel: megatron-core 0.19 marks GPTModel deprecated in favour of
HybridModel, but HybridModel describes layers by a hybrid pattern string meant for Mamba/attention
mixes and its local (non-Transformer-Engine) path is thinner; GPTModel with
`get_gpt_decoder_block_spec(use_transformer_engine=False)` is the path megatron's own local-spec
tests cover, takes the per-layer dense/MoE pattern Qwen3-MoE needs, and exposes the
`output_processor` hook the vocab-parallel log-prob head uses. The bridge's parameter names are
those of this model.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region)
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_size

from polyrl.backends.megatron import bridge, compat, compiled, gpt_oss, thd
from polyrl.backends.megatron.ddp import ddp_kwargs
from polyrl.backends.parallel_dims import ParallelDims
from polyrl.dist import group_timeout_minutes

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Parallel state (the one place megatron's process groups are made)


def init_parallel_state(dims: ParallelDims, vpp: int | None, seed: int) -> None:
    if ps.model_parallel_is_initialized():  # a second backend in one process (tests, actor + export)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp,
        distributed_timeout_minutes=group_timeout_minutes())  # the --distributed-timeout-minutes of every other group
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


# ---------------------------------------------------------------------------------------------
# Layer spec: local modules, our norms and our varlen core attention


class HFRMSNorm(torch.nn.Module):
    """RMSNorm computed as the HF decoders compute it (fp32 statistics, cast, then the weight),
    so logits match the FSDP backend closely. Megatron's torch-norm wrapper refuses sequence
    parallelism; this one marks its weight `sequence_parallel` so finalize_model_grads sums its
    gradient over TP when the activations it sees are sequence-sharded. With
    `layernorm_zero_centered_gamma` (Qwen3-Next) it computes HF's x_norm * (1 + w) in fp32 and then
    casts, as Qwen3NextRMSNorm does; the stored weight stays HF's."""

    norm = staticmethod(compiled.rms_norm)  # apply_compile swaps in compiled.compiled_rms_norm

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__()
        self.zero_centered = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps, self.zero_centered)


class HFQKNorm(HFRMSNorm):
    """Per-head q/k norm: it sees whole (all-gathered) sequences, so it is never SP-sharded
    (megatron sums q/k-norm grads over TP by name)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False


@dataclass
class VarlenPackedSeqParams(PackedSeqParams):
    attn_plan: Any = None  # thd.AttnPlan of this rank's micro-batch, built once per forward
    rope: Any = None  # (cos, sin) [T_local, 1, r] from thd.PackedRope, or None (the model applies its own)


class VarlenCoreAttention(MegatronModule):
    """Core attention for packed THD batches without Transformer Engine: causal attention inside
    each sequence (torch varlen flash attention; a dense-mask fallback off CUDA), with context
    parallelism by all-gathering K/V over the CP group and attending local query chunks to the
    causal prefix of their sequence."""

    impl = os.environ.get("POLYRL_VARLEN_IMPL", "auto")  # auto | varlen | dense (tests compare them)
    rope = staticmethod(compiled.rope_qk)  # apply_compile swaps in compiled.compiled_rope_qk

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None, **_: Any):
        super().__init__(config=config)
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None:
            self.cp_group = ps.get_context_parallel_group()
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("polyrl's varlen core attention has no attention dropout; the HF decoders use none")

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_: Any):
        plan = getattr(packed_seq_params, "attn_plan", None)
        if plan is None:
            raise ValueError("VarlenCoreAttention needs packed (THD) inputs built by polyrl.backends.megatron.thd.pack_thd")
        if packed_seq_params.rope is not None:  # this rank's tokens, before K/V are gathered over CP
            query, key = self.rope(query, key, *packed_seq_params.rope)
        k = thd.all_gather_seq(key, self.cp_group)
        v = thd.all_gather_seq(value, self.cp_group)
        out = thd.varlen_attention(query, k, v, plan, self.scale, impl=self.impl)
        return out.reshape(out.shape[0], -1)


class PostNormSelfAttention(SelfAttention):
    """SelfAttention followed by an RMSNorm of its output before the residual add (GLM4's
    post_self_attn_layernorm; megatron-core's TransformerLayer has no such norm). The output is
    whole over TP (after linear_proj's reduce) or sequence-sharded under SP, as HFRMSNorm expects."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.post_layernorm = HFRMSNorm(self.config, self.config.hidden_size, eps=self.config.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any):
        out, bias = super().forward(*args, **kwargs)
        return self.post_layernorm(out if bias is None else out + bias), None


class PostNormMLP(MLP):
    """MLP followed by an RMSNorm of its output (GLM4's post_mlp_layernorm)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.post_layernorm = HFRMSNorm(self.config, self.config.hidden_size, eps=self.config.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any):
        out, bias = super().forward(*args, **kwargs)
        return self.post_layernorm(out if bias is None else out + bias), None


class TPMLASelfAttention(MLASelfAttention):
    """megatron-core's MLA with its column-parallel (local spec) kv down projection made exact under TP.

    megatron (0.19.2, multi_latent_attention.py get_query_key_value_tensors) all-gathers the column-parallel
    kv_combined [s, b, kv_lora_rank + rope_dim] over TP and splits off k_pos_emb, which every rank then broadcasts to
    its own heads only. In backward the gather only splits the gradient, so the rope columns of linear_kv_down_proj
    receive one rank's heads' share: log-probs are right, that weight's gradient is not (TP2 grad norm 9.011 vs FSDP
    on the DeepSeek-V3 tiny model, 2026-11-23). Here the down projection's output is gathered over TP and scattered
    back to this rank's sequence share, so megatron takes its sequence-parallel branch, whose all-gather of k_pos_emb
    reduce-scatters (sums over TP) the gradient. Needs sequence parallelism with TP > 1 (transformer_config turns it
    on for MLA)."""

    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        if kv_combined.size(-1) != self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim:
            if not self.config.sequence_parallel:
                raise RuntimeError("TPMLASelfAttention under tensor parallelism needs sequence parallelism")
            kv_combined = scatter_to_sequence_parallel_region(gather_from_tensor_model_parallel_region(kv_combined))
        return q_compressed, kv_combined


class ExpertRowParallelLinear(RowParallelLinear):
    """An expert's linear_fc2 that hands back its matmul output itself when its expert-TP group has one rank.

    megatron-core (0.19.2) passes it through a one-rank TP reduce (or reduce-scatter under sequence parallelism): an
    autograd Function that returns its input as-is, i.e. a view. MLP.forward then adds a biased expert's
    routing-weighted bias to that view in place (per_token_scale), which autograd refuses in a training forward
    ("... is a view and is being modified inplace. This view was created inside a custom Function ..."). A one-rank
    reduce is the identity, so skipping it changes no arithmetic; megatron takes this path itself with EP > 1."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.is_expert and get_pg_size(self.tp_group) == 1:
            self.explicit_expert_comm = True


def _biased_experts(mlp):
    """A MoE layer spec (functools.partial of MoELayer) with its routed experts' linear_fc2 made
    ExpertRowParallelLinear; a dense MLP spec as it is."""
    if getattr(mlp, "func", None) is not MoELayer:
        return mlp
    sub = mlp.keywords["submodules"]
    experts = sub.experts
    if not isinstance(experts, functools.partial) or "submodules" not in experts.keywords:
        raise TypeError(f"biased experts: megatron's MoE experts spec {experts!r} is not the local SequentialMLP "
                        "partial whose linear_fc2 polyrl swaps (ExpertRowParallelLinear)")
    esub = dataclasses.replace(experts.keywords["submodules"], linear_fc2=ExpertRowParallelLinear)
    experts = functools.partial(experts.func, *experts.args, **{**experts.keywords, "submodules": esub})
    sub = dataclasses.replace(sub, experts=experts)
    return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": sub})


def _norm(spec, cls):
    return spec if spec in (None, IdentityOp) else cls


def _patch_layer_spec(spec: ModuleSpec, post_norms: bool = False) -> ModuleSpec:
    sub = spec.submodules
    attn = sub.self_attention
    a = attn.submodules
    if hasattr(a, "kv_layernorm"):  # MLA: norms of the compressed q / kv latents, shaped like the hidden states
        a = dataclasses.replace(a, core_attention=VarlenCoreAttention, q_layernorm=_norm(a.q_layernorm, HFRMSNorm),
                                kv_layernorm=_norm(a.kv_layernorm, HFRMSNorm))
        if attn.module is MLASelfAttention:
            attn = dataclasses.replace(attn, module=TPMLASelfAttention)
    else:
        a = dataclasses.replace(a, core_attention=VarlenCoreAttention, q_layernorm=_norm(a.q_layernorm, HFQKNorm),
                                k_layernorm=_norm(a.k_layernorm, HFQKNorm))
    attn = dataclasses.replace(attn, submodules=a)
    mlp = sub.mlp
    if post_norms:
        if attn.module is not SelfAttention or getattr(mlp, "func", None) != MLP.as_mlp_submodule:
            raise ValueError("post norms (GLM4) need megatron's dense SelfAttention and MLP layer spec")
        attn = dataclasses.replace(attn, module=PostNormSelfAttention)
        mlp = functools.partial(PostNormMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    sub = dataclasses.replace(sub, input_layernorm=HFRMSNorm, pre_mlp_layernorm=HFRMSNorm, self_attention=attn, mlp=mlp)
    return dataclasses.replace(spec, submodules=sub)


def layer_spec(config: TransformerConfig, vp_stage: int | None, hf_config=None):
    """megatron's local GPT block spec (dense and MoE layers per moe_layer_freq) with the norms
    and core attention swapped through the ModuleSpec mechanism. Model types whose bridge family
    names HF mixers (Qwen3-Next) get their HF token mixers wrapped instead (hf_wrap.py)."""
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage)
    post_norms = hf_config is not None and bridge.FAMILIES[hf_config.model_type].post_norms
    specs = [_patch_layer_spec(s, post_norms) for s in block.layer_specs]
    if config.num_moe_experts and config.add_bias_linear:  # biased experts (GPT-OSS)
        specs = [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules,
                                                                       mlp=_biased_experts(s.submodules.mlp)))
                 for s in specs]
    if hf_config is not None and bridge.FAMILIES[hf_config.model_type].mixers:
        from polyrl.backends.megatron import hf_wrap
        specs = hf_wrap.wrap_layer_specs(specs, hf_config)
    return dataclasses.replace(block, layer_specs=specs, layer_norm=HFRMSNorm)


# ---------------------------------------------------------------------------------------------
# Config and model


def virtual_pipeline_size(num_layers: int, pp: int, layers_per_vstage: int | None) -> int | None:
    if layers_per_vstage is None:
        return None
    if num_layers % (pp * layers_per_vstage):
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_vstage} x --pipeline-model-parallel-size "
                         f"{pp} must divide the model's {num_layers} layers")
    v = num_layers // (pp * layers_per_vstage)
    return v if v > 1 else None


def recompute_settings(mg, model_cfg=None) -> tuple[str | None, str | None, int | None]:
    """(granularity, method, num_layers): --gradient-checkpointing (FSDP's per-decoder-layer checkpointing) is
    megatron's full recompute of every layer; otherwise the --recompute-* flags as given."""
    if model_cfg is not None and model_cfg.gradient_checkpointing and mg.recompute_granularity is None:
        return "full", "uniform", 1
    return mg.recompute_granularity, mg.recompute_method, mg.recompute_num_layers


def transformer_config(hf_config, mg, dims: ParallelDims, vpp: int | None, dtype: torch.dtype,
                       model_cfg=None) -> TransformerConfig:
    kw = bridge.config_to_mcore_kwargs(hf_config)
    granularity, method, num_layers = recompute_settings(mg, model_cfg)
    if model_cfg is not None and "num_moe_experts" in kw:  # MoE flags (polyrl/backends/megatron/routing.py)
        m = model_cfg
        if m.moe_aux_loss_coeff:  # else the bridge's choice from the HF config (output_router_logits)
            kw.update(moe_router_load_balancing_type=m.moe_router_load_balancing_type, moe_aux_loss_coeff=m.moe_aux_loss_coeff)
        if m.moe_z_loss_coeff:
            kw["moe_z_loss_coeff"] = m.moe_z_loss_coeff
        if m.use_routing_replay or m.use_rollout_routing_replay:
            if granularity == "full":
                raise ValueError("--use-routing-replay / --use-rollout-routing-replay with --recompute-granularity full "
                                 "(or --gradient-checkpointing): "
                                 "the recomputed router would need megatron's backward replay queue, which polyrl does "
                                 "not drive; use selective recompute or none")
            kw["moe_enable_routing_replay"] = True
    if mg.moe_router_topk is not None and "moe_router_topk" in kw:
        kw["moe_router_topk"] = mg.moe_router_topk
    kw["moe_token_dispatcher_type"] = "alltoall"  # megatron refuses allgather with variable_seq_lengths (even dense)
    if kw.get("gated_linear_unit") and kw.get("activation_func") is torch.nn.functional.silu and "num_moe_experts" not in kw \
            and not kw.get("add_bias_linear"):
        # megatron's fused SwiGLU (its jit fuser is torch.compile): one kernel each way, and it keeps only its input
        # for backward where autograd's silu * up keeps three tensors
        kw["bias_activation_fusion"] = True
    sp = mg.sequence_parallel
    if "num_moe_experts" in kw and dims.tp > 1 and not sp:
        log.warning("MoE with --tensor-model-parallel-size > 1: turning on --sequence-parallel (megatron-core requires it)")
        sp = True
    if kw.get("multi_latent_attention") and dims.tp > 1 and not sp:
        log.warning("multi-latent attention with --tensor-model-parallel-size > 1: turning on --sequence-parallel "
                    "(TPMLASelfAttention's exact k_pos_emb gradient uses it)")
        sp = True
    if hf_config.num_hidden_layers % dims.pp:
        raise ValueError(f"--pipeline-model-parallel-size {dims.pp} must divide the model's {hf_config.num_hidden_layers} layers")
    if bridge.FAMILIES[hf_config.model_type].oss_experts:
        gpt_oss.check_expert_tp(dims.etp)
    cls = TransformerConfig
    if kw.get("multi_latent_attention"):
        cls = MLATransformerConfig
        if dims.cp > 1:  # MLA applies megatron's RoPE per packed sequence: its CP chunk layout is unproven here
            raise ValueError(f"{hf_config.model_type} (multi-latent attention) with --context-parallel-size > 1 is not "
                             "supported; use --context-parallel-size 1")
    return cls(
        **kw,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp,
        sequence_parallel=sp,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype, pipeline_dtype=dtype,
        variable_seq_lengths=True,  # packed micro-batches differ in length: p2p exchanges shapes
        # Megatron-LM's choice: the interleaved (virtual stage) schedule overlaps p2p with compute
        # through separate sends / receives; the plain 1F1B schedule batches them
        overlap_p2p_comm=bool(vpp), batch_p2p_comm=not vpp,
        transformer_impl="local", perform_initialization=False,  # every weight comes from the HF checkpoint
        recompute_granularity=granularity, recompute_method=method, recompute_num_layers=num_layers,
    )


def use_wgrad_fusion(config: TransformerConfig, mg, dcfg: DistributedDataParallelConfig) -> bool:
    """--gradient-accumulation-fusion (default on): set it in `config` before the model is built where it holds, DDP
    on CUDA (Megatron-FSDP makes its main grads in the backward and writes them through Transformer Engine's GEMM,
    absent here); megatron's Apex kernels are polyrl's shim (compat.wgrad_accumulate). A torch without the
    mixed-precision GEMM keeps the unfused path, with a warning."""
    if not mg.gradient_accumulation_fusion or dcfg.use_megatron_fsdp or not torch.cuda.is_available():
        return False
    why = compat.wgrad_accumulation_works(torch.cuda.current_device())
    if why is not None:
        log.warning("gradient accumulation fusion off: %s", why)
        return False
    compat.use_wgrad_accumulation()
    config.gradient_accumulation_fusion = True
    return True


def _load_provider(path: str):
    mod, _, fn = path.rpartition(":")
    if not mod or not fn:
        raise ValueError(f"--custom-model-provider-path {path!r}: expected 'module:function' or 'file.py:function'")
    if mod.endswith(".py"):
        spec = importlib.util.spec_from_file_location("polyrl_custom_model_provider", mod)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod)
    return getattr(module, fn)


def build_chunks(config: TransformerConfig, hf_config, dims: ParallelDims, vpp: int | None,
                 provider_path: str | None = None) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), on the GPU, uninitialised."""
    provider = _load_provider(provider_path) if provider_path else None
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        if provider is not None:
            m = provider(config, hf_config, pre_process=pre, post_process=post, vp_stage=vp)
        else:
            spec = layer_spec(config, vp, hf_config)
            m = GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre,
                         post_process=post, parallel_output=True, vp_stage=vp,
                         **bridge.gpt_model_kwargs(hf_config, dims.tp))
            if post and bridge.num_mtp_layers(hf_config):  # MiMo's MTP layers (mtp.py), trained or kept frozen
                from polyrl.backends.megatron import mtp
                m.mtp = mtp.build_block(config, bridge.num_mtp_layers(hf_config), spec.layer_specs[-1], HFRMSNorm, vp,
                                        m.pg_collection)
        chunks.append(m.cuda(torch.cuda.current_device()))
    return chunks


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def chunk_layer_offset(config: TransformerConfig, chunk: GPTModel) -> int:
    return get_transformer_layer_offset(config, vp_stage=getattr(chunk, "vp_stage", None))


def _bridge_stage(chunk: GPTModel) -> tuple[int, int]:
    """(pp_rank, pp_size) the bridge understands: it puts the embedding on rank 0 and the head on
    the last rank; a virtual stage is first/last only when it holds them."""
    pre, post = chunk.pre_process, chunk.post_process
    return {(True, True): (0, 1), (True, False): (0, 2), (False, True): (1, 2), (False, False): (1, 3)}[(pre, post)]


class _CriticCheckpoint(Mapping):
    """An HF critic directory (*ForTokenClassification: no lm_head) read through the causal-LM bridge: the critic never
    reads its LM head, so an untied model's output layer is filled with zeros instead of failing the load."""

    def __init__(self, hf, hf_config):
        self.hf, self.shape = hf, (hf_config.vocab_size, hf_config.hidden_size)

    def __contains__(self, name: object) -> bool:
        return name == "lm_head.weight" or name in self.hf

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and name not in self.hf:
            return torch.zeros(self.shape)
        return self.hf[name]

    def __iter__(self):
        return iter(self.hf)

    def __len__(self) -> int:
        return len(self.hf)


def bridge_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the bridge maps: parameters, plus the routers' expert_bias buffers (sigmoid-routed
    MoE: HF's e_score_correction_bias, fixed in training, loaded and exported with the weights)."""
    out = dict(module.named_parameters())
    out.update((n, b) for n, b in module.named_buffers() if n.endswith("router.expert_bias"))
    return out


@torch.no_grad()
def load_hf_weights(chunks: list[GPTModel], hf_dir: str, hf_config, config: TransformerConfig,
                    vl: bool = False) -> None:
    """Each rank reads only its own TP / PP / EP slice of the safetensors checkpoint. A critic's value head
    (add_value_heads) takes the directory's `score` head when it has one (a saved critic), else starts at zero.
    vl: a vision-language checkpoint (hf_config its decoder's, vision.text_config); a first-stage chunk's
    `vision_model` takes the vision tower's tensors."""
    hf = bridge.load_hf_safetensors(hf_dir)
    if vl:
        from polyrl.backends.megatron import vision
        raw, hf = hf, vision.TextCheckpoint(hf)
        for chunk in chunks:
            tower = getattr(unwrap(chunk), "vision_model", None)
            if tower is not None:
                vision.load_tower(tower, raw)
    critic = any(getattr(unwrap(c), VALUE_HEAD, None) is not None for c in chunks)
    if critic:
        hf = _CriticCheckpoint(hf, hf_config)
    for chunk in chunks:
        m = unwrap(chunk)
        pp_rank, pp_size = _bridge_stage(m)
        off = chunk_layer_offset(config, m)
        sd = bridge.hf_to_mcore(
            hf, hf_config, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=config.tensor_model_parallel_size,
            pp_rank=pp_rank, pp_size=pp_size, layer_range=range(off, off + len(m.decoder.layers)),
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=config.expert_model_parallel_size,
            etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=config.expert_tensor_parallel_size)
        params = {n: p for n, p in bridge_tensors(m).items()
                  if not n.startswith((VALUE_HEAD + ".", "vision_model."))}
        head = getattr(m, VALUE_HEAD, None)
        if head is not None:
            for k in ("weight", "bias"):
                src = hf.hf[f"score.{k}"] if f"score.{k}" in hf.hf else torch.zeros(getattr(head, k).shape)
                getattr(head, k).copy_(src.reshape(getattr(head, k).shape))
        missing, extra = sorted(set(params) - set(sd)), sorted(set(sd) - set(params))
        if missing or extra:
            raise ValueError(f"HF -> megatron mismatch: missing {missing[:8]}, unexpected {extra[:8]}")
        for name, t in sd.items():
            if params[name].shape != t.shape:
                raise ValueError(f"{name}: megatron {tuple(params[name].shape)} vs HF-derived {tuple(t.shape)}")
            params[name].copy_(t)


def apply_compile(chunks: list) -> int:
    """--compile: every HFRMSNorm and VarlenCoreAttention of `chunks` runs polyrl's compiled norm / RoPE
    (polyrl/backends/megatron/compiled.py). Returns how many modules it switched: 0 for a custom provider's model that
    holds none of them."""
    n = 0
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, HFRMSNorm):
                m.norm = compiled.compiled_rms_norm
            elif isinstance(m, VarlenCoreAttention):
                m.rope = compiled.compiled_rope_qk
            else:
                continue
            n += 1
    return n


def ddp_field_defaults() -> dict[str, Any]:
    """DistributedDataParallelConfig's field -> default (None where a factory makes it)."""
    return {f.name: (None if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(DistributedDataParallelConfig)}


def ddp_config(mg) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(**ddp_kwargs(mg, ddp_field_defaults()))


def half_module(config: TransformerConfig, m: GPTModel):
    """Float16Module(m), keeping the routers' fp32 expert_bias exact: Float16Module casts every buffer,
    and megatron's router only casts expert_bias back to fp32 (already rounded) in its forward."""
    if not (config.bf16 or config.fp16):
        return m
    keep = {n: b.clone() for n, b in m.named_buffers() if n.endswith("router.expert_bias")}
    out = Float16Module(config, m)  # m itself, cast in place
    for n, t in keep.items():
        m.get_submodule(n.rsplit(".", 1)[0]).expert_bias = t  # a registered buffer: assignment replaces it
    return out


def wrap_chunks(chunks: list[GPTModel], config: TransformerConfig, dcfg: DistributedDataParallelConfig) -> list:
    """Float16Module (bf16/fp16 params) then DDP or Megatron-FSDP, as megatron's get_model does."""
    wrapped = [half_module(config, m) for m in chunks]
    if dcfg.use_megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        out = [FullyShardedDataParallel(config=config, ddp_config=dcfg, module=m, disable_bucketing=i > 0,
                                        pg_collection=None) for i, m in enumerate(wrapped)]
    else:
        out = [DistributedDataParallel(config=config, ddp_config=dcfg, module=m, disable_bucketing=i > 0)
               for i, m in enumerate(wrapped)]
    config.finalize_model_grads_func = finalize_model_grads
    if dcfg.overlap_grad_reduce:
        no_sync = [m.no_sync for m in out]
        config.no_sync_func = no_sync[0] if len(out) == 1 else no_sync
    return out


def optimizer_offload_kwargs(cpu_offload: bool) -> dict:
    """--optimizer-cpu-offload as Megatron-LM sets it up: the hybrid-device optimizer with every parameter's fp32
    master copy and Adam state on the CPU (offload fraction 1), through the precision-aware path so the distributed
    optimizer keeps no fp32 main parameters of its own on the GPU (megatron-core needs no Transformer Engine for it
    when the optimizer is CPU-offloaded)."""
    if not cpu_offload:
        return {}
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True,
                overlap_cpu_optimizer_d2h_h2d=False)


def build_optimizer(model: list, o, dtype: torch.dtype, use_distributed: bool, cpu_offload: bool = False):
    cfg = McoreOptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=use_distributed, **optimizer_offload_kwargs(cpu_offload))
    opt = get_megatron_optimizer(cfg, model)
    for c in model:
        unwrap(c).config.grad_scale_func = opt.scale_loss
    compat.use_foreach_grad_kernels()
    compat.use_fused_adam(opt)
    return opt


# ---------------------------------------------------------------------------------------------
# Forward inputs and the log-prob head


def packed_inputs(pb: thd.PackedBatch, cp_group, rope: thd.PackedRope | None = None,
                  rope_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, VarlenPackedSeqParams]:
    """rope_positions: the tokens' RoPE positions when they are not pb.position_ids (vision-language: [3, T])."""
    cu = pb.cu_seqlens
    pos = pb.position_ids if rope_positions is None else rope_positions
    psp = VarlenPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=pb.max_seqlen,
                                max_seqlen_kv=pb.max_seqlen, cp_group=cp_group, attn_plan=pb.plan,
                                rope=rope.tables(pos) if rope is not None else None)
    return pb.input_ids[None], pb.position_ids[None], psp


@dataclass
class HeadContext:
    pb: thd.PackedBatch
    vocab_size: int
    temperature: float
    chunk_size: int
    with_entropy: bool
    mtp: Any = None  # mtp.MTPInputs in a training forward with --enable-mtp-training: the head adds [D, R] MTP log-probs


def response_logprobs(hidden_states, weight, targets, context: HeadContext, config, *, temperature: float,
                      with_entropy: bool):
    """Log-probs (and entropy) of `targets` [R_local] at this micro-batch's response positions, [R] each, identical
    on every TP and CP rank. Mirrors ColumnParallelLinear's input handling (sequence-parallel gather, or copy with a
    TP all-reduce in the backward) and never gathers the vocabulary."""
    tp_group = ps.get_tensor_model_parallel_group()
    h = hidden_states
    if config.sequence_parallel:
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=tp_group)
    else:
        h = copy_to_tensor_model_parallel_region(h, group=tp_group)
    pb = context.pb
    h = h[:, 0].index_select(0, pb.logp_index)
    start = ps.get_tensor_model_parallel_rank() * weight.shape[0]
    logp, ent = thd.vocab_parallel_logprobs(h, weight, targets, vocab_start=start, vocab_size=context.vocab_size,
                                            group=tp_group, temperature=temperature,
                                            chunk_size=context.chunk_size, with_entropy=with_entropy)
    cp_group = ps.get_context_parallel_group()
    logp = thd.assemble_responses(logp, pb.logp_slot, pb.num_response, cp_group)
    if ent is None:
        return logp, logp.new_zeros(0)
    return logp, thd.assemble_responses(ent, pb.logp_slot, pb.num_response, cp_group)


def logprob_head(*, hidden_states, output_layer, output_weight, context: HeadContext, config, packed_seq_params=None,
                 **_: Any):
    """GPTModel output_processor: per-response-token log-probs (and entropy) of this micro-batch (response_logprobs),
    and with `context.mtp` the MTP layers' [D, R] log-probs as a third output (mtp.py)."""
    weight = output_weight if output_weight is not None else output_layer.weight
    logp, ent = response_logprobs(hidden_states, weight, context.pb.targets, context, config,
                                  temperature=context.temperature, with_entropy=context.with_entropy)
    if context.mtp is None:
        return logp, ent
    from polyrl.backends.megatron import mtp
    return logp, ent, mtp.mtp_logprobs(hidden_states, weight, context, config, packed_seq_params, response_logprobs)


# ---------------------------------------------------------------------------------------------
# PPO's critic: the same GPTModel with a one-output value head on the last pipeline stage

VALUE_HEAD = "value_head"


def add_value_heads(chunks: list[GPTModel], config: TransformerConfig) -> None:
    """A Linear(hidden, 1) on each chunk that ends the pipeline (before DDP wrapping, so it trains and checkpoints
    with the rest). One output cannot be split over TP: the head is replicated, every TP rank computes all values
    from the full hidden state, so its gradient is whole on every rank (no TP reduction; megatron counts a parameter
    without `tensor_model_parallel` once in the grad norm, as it does the norms). The LM output layer stays, so the
    model, its checkpoints and its loading are the actor's GPTModel's, but an untied one is frozen: the critic never
    uses it, and a trainable parameter without a gradient would keep Megatron-FSDP waiting for it (DDP and the
    optimizer then keep no gradient or Adam state for it either). A tied output weight is the embedding's (PP 1) or
    its copy that finalize_model_grads keeps in step with it (PP > 1), so it stays as it is."""
    for c in chunks:
        if c.post_process:
            head = torch.nn.Linear(config.hidden_size, 1, dtype=config.params_dtype, device=torch.cuda.current_device())
            setattr(c, VALUE_HEAD, head)
            if not c.share_embeddings_and_output_weights and c.output_layer.weight is not None:
                c.output_layer.requires_grad_(False)


@dataclass
class ValueContext:
    pb: thd.PackedBatch
    head: torch.nn.Module


def value_head(*, hidden_states, context: ValueContext, config, **_: Any):
    """GPTModel output_processor of a critic: the value of the state before each response token, [R] fp32, identical
    on every TP and CP rank. Under sequence parallelism the hidden states are gathered with a plain split in the
    backward (tensor_parallel_output_grad=False): each rank's gradient is already the whole one, not a partial sum
    as after the vocab-parallel log-prob head."""
    h = hidden_states
    if config.sequence_parallel:
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False,
                                                 group=ps.get_tensor_model_parallel_group())
    pb = context.pb
    h = h[:, 0].index_select(0, pb.logp_index)
    values = context.head(h).squeeze(-1).float()
    values = thd.assemble_responses(values, pb.logp_slot, pb.num_response, ps.get_context_parallel_group())
    return values, values.new_zeros(0)
