"""HF <-> megatron-core weight bridge: names, fused layouts, vocab padding, TP/PP/EP slicing.

Pure torch + safetensors over transformers config objects; megatron-core is never imported, so this
module and its tests run on any machine. Target: megatron-core 0.19 `GPTModel` built with
`get_gpt_layer_local_spec()` (local modules, not Transformer Engine). Parameter names and layouts:

    embedding.word_embeddings.weight                    [V_pad, H]  vocab split over TP on dim 0
    decoder.layers.{l}.input_layernorm.weight           [H]
    decoder.layers.{l}.self_attention.linear_qkv.weight [ng*(np/ng+2)*hd, H]  per group: q heads, k, v
    decoder.layers.{l}.self_attention.linear_qkv.bias   same rows (qwen2: add_qkv_bias)
    decoder.layers.{l}.self_attention.q_layernorm.weight [hd]  (qwen3 / qwen3_moe: qk_layernorm)
    decoder.layers.{l}.self_attention.k_layernorm.weight [hd]
    decoder.layers.{l}.self_attention.linear_proj.weight [H, np*hd]  row parallel (dim 1)
    decoder.layers.{l}.pre_mlp_layernorm.weight         [H]
    decoder.layers.{l}.mlp.linear_fc1.weight            [2I, H] = [gate; up], per TP rank [gate_r; up_r]
    decoder.layers.{l}.mlp.linear_fc2.weight            [H, I]  row parallel (dim 1)
    decoder.layers.{l}.mlp.router.weight                [E, H]  replicated (MoE layers)
    decoder.layers.{l}.mlp.experts.local_experts.{i}.linear_fc1.weight  [2I_moe, H]  (SequentialMLP)
    decoder.layers.{l}.mlp.experts.local_experts.{i}.linear_fc2.weight  [H, I_moe]
    decoder.layers.{l}.mlp.shared_experts.linear_fc1.weight  [2I_sh, H]  (Qwen3-Next; split as linear_fc1)
    decoder.layers.{l}.mlp.shared_experts.linear_fc2.weight  [H, I_sh]   row parallel
    decoder.layers.{l}.mlp.shared_experts.gate_weight        [1, H]  replicated (moe_shared_expert_gate:
                                                        output * sigmoid(x @ gate_weight.T), as HF's shared_expert_gate)
    decoder.final_layernorm.weight                      [H]
    output_layer.weight                                 [V_pad, H]  absent when tied, except on a
                                                        last PP stage that is not also the first

Families marked `mixers` (Qwen3-Next) keep their token mixer as the HF module itself, run by
`hf_wrap.py` inside megatron's layer; its parameters keep their HF names under the wrapper:

    decoder.layers.{l}.self_attention.hf.{rest}  <->  model.layers.{l}.{linear_attn|self_attn}.{rest}

(copied 1:1). Wrapped full attention is replicated over TP; the gated DeltaNet is split over TP by
heads (hf_wrap.py runs each rank's heads), so its tensors are sliced per key-head group:

    in_proj_qkvz.weight [nk*(2dk + 2dv*nv/nk), H]  rows grouped per key head (q, k, v, z): dim-0 chunk
    in_proj_ba.weight   [nk*2*nv/nk, H]            rows grouped per key head (b, a): dim-0 chunk
    conv1d.weight       [2*nk*dk + nv*dv, 1, K]    channels [q | k | v]: each part chunked, then joined
    A_log, dt_bias      [nv]                       dim-0 chunk (value heads of a key group are adjacent)
    out_proj.weight     [H, nv*dv]                 row parallel (dim 1)
    norm.weight         [dv]                       replicated (shared by every head)

DeepSeek-V3 (`mla`): megatron-core's own MLASelfAttention (local spec, its own RoPE) replaces linear_qkv:

    self_attention.linear_q_down_proj.weight  [q_lora, H]            <- self_attn.q_a_proj.weight      col
    self_attention.q_layernorm.weight         [q_lora]               <- self_attn.q_a_layernorm.weight
    self_attention.linear_q_up_proj.weight    [n*(dn+dr), q_lora]    <- self_attn.q_b_proj.weight      col
    self_attention.linear_kv_down_proj.weight [kv_lora+dr, H]        <- self_attn.kv_a_proj_with_mqa.weight  col
    self_attention.kv_layernorm.weight        [kv_lora]              <- self_attn.kv_a_layernorm.weight
    self_attention.linear_kv_up_proj.weight   [n*(dn+dv), kv_lora]   <- self_attn.kv_b_proj.weight     col
(copied as is: megatron's per-head [nope | rope] and [k_nope | v] rows are HF's; the down projections
are ColumnParallelLinear in the local spec, so they split over TP too and MLA gathers them). HF's
`rope_interleave` (DeepSeek's interleaved rope pairs) is what megatron's MLA RoPE applies
(`mla_rotary_interleaved`: de-interleave, then rotate-half), so no permutation is needed.

Sigmoid-routed MoE (`sigmoid_router`: DeepSeek-V3, GLM4-MoE): HF's `mlp.gate.e_score_correction_bias`
[E] (fp32) is megatron's `mlp.router.expert_bias` buffer (moe_router_enable_expert_bias, update rate 0:
HF never moves it), and plain shared experts `mlp.shared_experts.{gate,up,down}_proj` are
`mlp.shared_experts.linear_fc1/fc2` (no gate). Layers below `first_k_dense_replace` are dense.

GLM4 dense (`post_norms`, `interleaved_rope`): the sandwich norms are
`self_attention.post_layernorm.weight` <- `post_self_attn_layernorm.weight` and
`mlp.post_layernorm.weight` <- `post_mlp_layernorm.weight` (model.py's PostNorm* modules), the fused
`mlp.gate_up_proj.weight` is linear_fc1 as is, and GLM4's interleaved partial RoPE (pairs (2i, 2i+1) of
the first r channels of each head) becomes polyrl's rotate-half RoPE by permuting those r rows of every
q / k head (and bias) to [0, 2, .., r-2, 1, 3, .., r-1]: q.k is unchanged because q and k move together.

Qwen3-Next's RMSNorms compute x_norm * (1 + w): the weight is
stored as is and megatron's `layernorm_zero_centered_gamma` tells polyrl's norm to add the 1.

Qwen3.5 (text, `qwen3_5_text`) is Qwen3-Next's mixers with a dense MLP and the DeltaNet's projections
unfused: `in_proj_qkv` [2*nk*dk + nv*dv, H] (rows q | k | v, split over TP like conv1d), `in_proj_z`
[nv*dv, H], `in_proj_b` / `in_proj_a` [nv, H] (rows per value head: dim-0 chunks). What else differs from Qwen3-Next
lives inside the wrapped HF modules (the attention's output gate folded into q_proj, partial RoPE with interleaved
mrope sections, equal to plain RoPE for text positions). Its checkpoints' multi-token-prediction tensors (`mtp.*`,
as those of Qwen3-Next) are not loaded, trained or exported, as transformers' Qwen3_5ForCausalLM drops them; a
warning names them. The vision-language checkpoints (`qwen3_5`) are refused by the backend (vision.py).

GPT-OSS (`oss_experts`): attention (learned sinks, alternating sliding / full layers, biases) runs as the
HF module (`mixers`); every layer is megatron's MoELayer with a biased router and biased experts (the clamped
SwiGLU with up + 1 as megatron-core config fields: gpt_oss.py) that HF stacks as
`mlp.experts.gate_up_proj` [E, H, 2I] (x @ W, gate / up interleaved in the columns), `gate_up_proj_bias`
[E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]; megatron's expert i holds

    mlp.experts.local_experts.{i}.linear_fc1.weight [2I, H] = [W[:, 0::2].T; W[:, 1::2].T]  (gate; up)
    mlp.experts.local_experts.{i}.linear_fc1.bias   [2I]    = [b[0::2]; b[1::2]]
    mlp.experts.local_experts.{i}.linear_fc2.weight [H, I]  = down_proj[e].T,  linear_fc2.bias = down_proj_bias[e]
    mlp.router.weight [E, H], mlp.router.bias [E]

Checkpoints with MXFP4 experts (`gate_up_proj_blocks` / `_scales`) are dequantized on read
(`polyrl.backends.mxfp4`) and export BF16 / FP32 `gate_up_proj` (the unquantized names).

MiMo (`mimo`, MiMo-7B: a Qwen2 decoder plus `model.mtp_layers.{i}.*`, `mtp`): each MTP layer is
megatron-core's MultiTokenPredictionLayer on the last pipeline stage (built by mtp.py):

    mtp.layers.{i}.enorm.weight         <- model.mtp_layers.{i}.token_layernorm.weight
    mtp.layers.{i}.hnorm.weight         <- model.mtp_layers.{i}.hidden_layernorm.weight
    mtp.layers.{i}.eh_proj.weight [H, 2H] <- input_proj.weight with its column halves swapped (MiMo concatenates
                                           [hidden; embedding], megatron [embedding; hidden]); column parallel
    mtp.layers.{i}.mtp_model_layer.*    <- model.mtp_layers.{i}.{input_layernorm, self_attn, post_attention_layernorm,
                                           mlp} as a decoder layer's names (megatron-core 0.19's module name; its
                                           dist-checkpoint keys say transformer_layer)
    mtp.layers.{i}.final_layernorm.weight <- model.mtp_layers.{i}.final_layernorm.weight

MiMo-V2-Flash (`mimo_v2_flash`): attention runs as the HF module (`mixers`: MiMoV2FlashAttention, q / k heads of
head_dim, v heads of v_head_dim, v scaled by attention_value_scale, partial RoPE with a theta per layer type, twice the
k / v heads and learned sinks on sliding layers), its parameters 1:1 under `self_attention.hf.` except the sinks,
which checkpoints store as `self_attn.attention_sink_bias` (`mixer_renames`; in memory `self_attn.sinks`). The MLP is
megatron's: dense where `mlp_layer_types` says "dense", else an MoELayer with DeepSeek-V3's sigmoid router
(`sigmoid_router` above; no shared experts) and experts as the generic MoE names below.

The Transformer-Engine spec names things differently (norms fused into
`linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`, grouped experts as
`experts.linear_fc1.weight{i}`); this bridge covers the local spec only.

HF side: checkpoint names, i.e. what `save_pretrained` writes and SGLang/vLLM load (per-expert
`mlp.experts.{e}.gate_proj.weight`). transformers>=5 keeps experts stacked in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); `hf_to_mcore` reads
either form and `mcore_to_hf(..., fused_experts=True)` writes the stacked one.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from polyrl.backends.megatron import gpt_oss

log = logging.getLogger(__name__)
_MTP_WARNED: set[str] = set()  # model types whose dropped mtp.* tensors were reported (once per process)


@dataclass(frozen=True)
class _Family:
    # a bool, or the HF config attribute that decides it (GLM: attention_bias, use_qk_norm)
    qkv_bias: bool | str  # q/k/v projections carry biases (megatron add_qkv_bias)
    qk_norm: bool | str  # per-head RMSNorm on q and k (megatron qk_layernorm)
    moe: bool
    # HF layer type -> HF attribute of the token mixer that hf_wrap.py runs as is (empty: megatron's attention)
    mixers: tuple[tuple[str, str], ...] = ()
    zero_centered_norm: bool = False  # RMSNorm output x_norm * (1 + w) (megatron layernorm_zero_centered_gamma)
    # MoE layers add a shared expert: "gated" (Qwen3-Next mlp.shared_expert * sigmoid(shared_expert_gate),
    # megatron moe_shared_expert_gate) or "plain" (DeepSeek / GLM mlp.shared_experts, added as is)
    shared_expert: str = ""
    mla: bool = False  # multi-latent attention (megatron MLASelfAttention)
    sigmoid_router: bool = False  # sigmoid scores + e_score_correction_bias, group-limited top-k, scaling
    post_norms: bool = False  # GLM4 sandwich norms after attention and MLP
    interleaved_rope: bool = False  # HF rotates channel pairs (2i, 2i+1): q/k rows are permuted (docstring)
    fused_gate_up: bool = False  # HF dense MLP stores [gate; up] as one mlp.gate_up_proj
    oss_experts: bool = False  # GPT-OSS: stacked, interleaved, biased experts and a biased router (docstring)
    mtp: bool = False  # MiMo: model.mtp_layers.* <-> megatron-core's mtp.layers.* (docstring)
    # wrapped HF module parameter -> its checkpoint name where they differ (MiMo-V2-Flash: sinks, attention_sink_bias)
    mixer_renames: tuple[tuple[str, str], ...] = ()


FAMILIES: dict[str, _Family] = {  # HF model_type -> what differs between supported decoders
    "llama": _Family(qkv_bias=False, qk_norm=False, moe=False),  # LlamaForCausalLM
    "qwen2": _Family(qkv_bias=True, qk_norm=False, moe=False),  # Qwen2ForCausalLM (Qwen2, Qwen2.5)
    "qwen3": _Family(qkv_bias=False, qk_norm=True, moe=False),  # Qwen3ForCausalLM
    "qwen3_moe": _Family(qkv_bias=False, qk_norm=True, moe=True),  # Qwen3MoeForCausalLM
    # Qwen3NextForCausalLM: gated DeltaNet and gated full attention run as HF modules; dense or sparse
    # MLPs (routed experts + gated shared expert) are megatron's
    "qwen3_next": _Family(qkv_bias=False, qk_norm=False, moe=True, zero_centered_norm=True, shared_expert="gated",
                          mixers=(("linear_attention", "linear_attn"), ("full_attention", "self_attn"))),
    # DeepseekV3ForCausalLM: MLA, sigmoid router with bias-based balancing, shared experts, first dense layers
    "deepseek_v3": _Family(qkv_bias=False, qk_norm=False, moe=True, mla=True, sigmoid_router=True,
                           shared_expert="plain"),
    # Glm4MoeForCausalLM (GLM-4.5 / 4.6): GQA with q/k/v bias and partial rotate-half RoPE, DeepSeek-style MoE
    "glm4_moe": _Family(qkv_bias="attention_bias", qk_norm="use_qk_norm", moe=True, sigmoid_router=True,
                        shared_expert="plain"),
    # Glm4ForCausalLM (GLM-4-0414): sandwich norms, fused gate_up MLP, interleaved partial RoPE
    "glm4": _Family(qkv_bias="attention_bias", qk_norm=False, moe=False, post_norms=True, interleaved_rope=True,
                    fused_gate_up=True),
    # GptOssForCausalLM: HF attention (sinks, sliding windows) wrapped; biased MoE in every layer
    "gpt_oss": _Family(qkv_bias=False, qk_norm=False, moe=True, oss_experts=True,
                       mixers=(("sliding_attention", "self_attn"), ("full_attention", "self_attn"))),
    # MiMo-7B (MiMoForCausalLM, polyrl.hf_families): Qwen2 decoder + MTP layers
    "mimo": _Family(qkv_bias=True, qk_norm=False, moe=False, mtp=True),
    # MiMoV2FlashForCausalLM: HF attention (sinks on sliding layers, q/k heads wider than v heads) wrapped; dense
    # first layers, then DeepSeek-style sigmoid-routed MoE without shared experts
    "mimo_v2_flash": _Family(qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True,
                             mixers=(("sliding_attention", "self_attn"), ("full_attention", "self_attn")),
                             mixer_renames=(("sinks", "attention_sink_bias"),)),
    # Qwen3_5ForCausalLM (text): Qwen3-Next's mixers (unfused DeltaNet projections), dense MLP
    "qwen3_5_text": _Family(qkv_bias=False, qk_norm=False, moe=False, zero_centered_norm=True,
                            mixers=(("linear_attention", "linear_attn"), ("full_attention", "self_attn"))),
}

_SUPPORTED = ("LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM, "
              "DeepseekV3ForCausalLM, Glm4MoeForCausalLM, Glm4ForCausalLM, GptOssForCausalLM, MiMoForCausalLM, "
              "MiMoV2FlashForCausalLM, Qwen3_5ForCausalLM")


def _flag(cfg: Any, value: bool | str) -> bool:
    return bool(getattr(cfg, value, False)) if isinstance(value, str) else value


def num_experts(cfg: Any) -> int:
    """Routed experts per MoE layer (Qwen: num_experts, DeepSeek / GLM: n_routed_experts); 0 if dense."""
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
               or getattr(cfg, "num_local_experts", None) or 0)


def _rope_params(cfg: Any) -> dict:
    return dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})


def _family(cfg: Any) -> _Family:
    fam = FAMILIES.get(getattr(cfg, "model_type", None))
    if fam is None:
        raise ValueError(
            f"megatron bridge: unsupported model_type {getattr(cfg, 'model_type', None)!r} "
            f"(architectures={getattr(cfg, 'architectures', None)}); supported model types: "
            f"{sorted(FAMILIES)} ({_SUPPORTED})"
        )
    # Variants the name map cannot express: refuse rather than build a silently different model.
    # (GLM's attention_bias puts biases on q/k/v only, which add_qkv_bias expresses)
    # (a wrapped HF attention carries its own biases and sliding windows)
    if ((getattr(cfg, "attention_bias", False) and fam.qkv_bias != "attention_bias" and not fam.mixers)
            or getattr(cfg, "mlp_bias", False)):
        raise ValueError("megatron bridge: attention_bias / mlp_bias variants are not supported")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []) and "sliding_attention" not in dict(fam.mixers):
        raise ValueError("megatron bridge: sliding-window attention layers are not supported")
    if cfg.hidden_act != "silu":
        raise ValueError(f"megatron bridge: hidden_act {cfg.hidden_act!r} is not supported (silu only)")
    if fam.mixers:
        unknown = set(getattr(cfg, "layer_types", None) or ["full_attention"]) - {t for t, _ in fam.mixers}
        if unknown:
            raise ValueError(f"megatron bridge: {cfg.model_type} layer types {sorted(unknown)} are not supported")
    if fam.mla:
        if cfg.q_lora_rank is None:
            raise ValueError("megatron bridge: DeepSeek MLA without q_lora_rank (q_proj, DeepSeek-V2-Lite style) is "
                             "not supported: megatron-core's local MLA spec has no un-normalised q projection")
        if not getattr(cfg, "rope_interleave", True):
            raise ValueError("megatron bridge: DeepSeek rope_interleave=False is not supported (megatron's MLA "
                             "RoPE de-interleaves its rope channels, as HF does with rope_interleave=True)")
    rope = _rope_params(cfg).get("rope_type", "default")
    if (fam.mla or fam.interleaved_rope) and rope not in (("default", "yarn") if fam.mla else ("default",)):
        raise ValueError(f"megatron bridge: {cfg.model_type} with rope_type {rope!r} is not supported")
    if fam.sigmoid_router and num_experts(cfg):
        if cfg.num_experts_per_tok > 1 and not cfg.norm_topk_prob:
            raise ValueError("megatron bridge: sigmoid routing with norm_topk_prob=False is not supported "
                             "(megatron-core always renormalises the top-k sigmoid scores)")
        if (cfg.n_group or 1) > 1 and cfg.num_experts_per_tok // cfg.topk_group != 2:
            raise ValueError(f"megatron bridge: group-limited routing scores a group by its top-2 experts in HF and by "
                             f"its top-(num_experts_per_tok / topk_group) in megatron-core; num_experts_per_tok "
                             f"{cfg.num_experts_per_tok} / topk_group {cfg.topk_group} must be 2")
    return fam


def wrapped_mixer(cfg: Any, layer: int) -> str | None:
    """HF attribute (`linear_attn`, `self_attn`) of global layer `layer`'s token mixer when that
    mixer runs as the HF module itself (hf_wrap.py); None for megatron's own attention."""
    fam = _family(cfg)
    if not fam.mixers:
        return None
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return dict(fam.mixers)[types[layer]]


def _head_dim(cfg: Any) -> int:
    # Qwen3 sets head_dim explicitly (it may differ from hidden/heads); older configs omit it.
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _num_query_groups(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def is_moe_layer(cfg: Any, layer: int) -> bool:
    """Same rule as transformers' decoder layers: Qwen3MoeDecoderLayer (mlp_only_layers,
    decoder_sparse_step), DeepSeek-V3 / GLM4-MoE (dense below first_k_dense_replace)."""
    if not _family(cfg).moe or not num_experts(cfg):
        return False
    if _family(cfg).oss_experts:  # GPT-OSS: every layer
        return True
    if getattr(cfg, "mlp_layer_types", None) is not None:  # MiMo-V2-Flash: "dense" / "sparse" per layer
        return cfg.mlp_layer_types[layer] == "sparse"
    if getattr(cfg, "first_k_dense_replace", None) is not None:
        return layer >= cfg.first_k_dense_replace
    return (
        layer not in (getattr(cfg, "mlp_only_layers", None) or [])
        and (layer + 1) % cfg.decoder_sparse_step == 0
    )


# ---------------------------------------------------------------------------------------------
# Config mapping


def config_to_mcore_kwargs(hf_config: Any) -> dict[str, Any]:
    """`TransformerConfig(**kwargs)` fields for this HF config. Model-level settings (vocab, tied
    embeddings, position embedding) are `GPTModel` arguments in megatron: see `gpt_model_kwargs`. Dtypes,
    parallel sizes and recompute are the backend's business and are left out."""
    cfg, fam = hf_config, _family(hf_config)
    kw: dict[str, Any] = dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,  # dense layers (all of them unless MoE)
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=_num_query_groups(cfg),
        kv_channels=_head_dim(cfg),
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,  # megatron also uses it for q/k layernorm, as HF does
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=_flag(cfg, fam.qkv_bias),
        qk_layernorm=_flag(cfg, fam.qk_norm),
        hidden_dropout=0.0,  # HF decoders have no residual dropout
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0)),
        init_method_std=cfg.initializer_range,
        layernorm_zero_centered_gamma=fam.zero_centered_norm,
    )
    if fam.mla:
        kw.update(_mla_kwargs(cfg))
    if any(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)):  # (all-dense Qwen3-Next: none)
        aux = bool(getattr(cfg, "output_router_logits", False))  # HF only adds aux loss when set
        kw.update(
            num_moe_experts=num_experts(cfg),
            # (GPT-OSS names its expert width intermediate_size)
            moe_ffn_hidden_size=cfg.intermediate_size if fam.oss_experts else cfg.moe_intermediate_size,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_router_score_function="softmax",
            # HF: softmax over all experts, top-k, renormalise if norm_topk_prob. Renormalised
            # top-k softmax == softmax over the top-k logits, which is megatron's pre_softmax=False
            # (GPT-OSS: softmax over its top-k logits outright).
            moe_router_pre_softmax=not (fam.oss_experts or cfg.norm_topk_prob),
            moe_layer_freq=[int(is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)],
            moe_router_load_balancing_type="aux_loss" if aux else "none",
            moe_aux_loss_coeff=float(cfg.router_aux_loss_coef) if aux else 0.0,
            moe_grouped_gemm=False,  # the local spec builds SequentialMLP experts
        )
        if fam.oss_experts:  # biased router and experts, clamped SwiGLU with up + 1 (gpt_oss.py)
            kw.update(gpt_oss.mcore_kwargs(cfg))
        if fam.shared_expert == "gated":  # HF: experts + sigmoid(shared_expert_gate(x)) * shared_expert(x)
            kw.update(moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
        if fam.shared_expert == "plain" and getattr(cfg, "n_shared_experts", 0):  # HF: experts + shared(x)
            kw.update(moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)
        if fam.sigmoid_router:
            grouped = (cfg.n_group or 1) > 1
            kw.update(
                # HF (DeepseekV3TopkRouter): sigmoid(logits) in fp32; experts chosen by score + bias (within
                # the topk_group best groups); weights = unbiased scores renormalised, times routed_scaling_factor
                moe_router_score_function="sigmoid", moe_router_dtype="fp32", moe_router_pre_softmax=False,
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0,  # HF's bias is a fixed buffer: RL must not move it (nor FSDP)
                moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor),
                moe_router_num_groups=cfg.n_group if grouped else None,
                moe_router_group_topk=cfg.topk_group if grouped else None,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,  # HF adds no aux loss here
            )
    return kw


def _mla_kwargs(cfg: Any) -> dict[str, Any]:
    """MLATransformerConfig fields of a DeepSeek-V3 config (RoPE: megatron's MLA applies its own)."""
    rope = _rope_params(cfg)
    kw: dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_layernorm=True,  # MLA: q_a_layernorm / kv_a_layernorm on the compressed latents
        num_query_groups=cfg.num_attention_heads, kv_channels=cfg.v_head_dim,
        rotary_base=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))), rotary_percent=1.0,
        apply_rope_fusion=False,
    )
    if rope.get("rope_type", "default") == "yarn":  # mapped field by field; parity proven on default RoPE only
        kw.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                  original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                  beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                  mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
    else:  # scale factor 1: MLA's softmax scale is then 1/sqrt(qk_head_dim), as HF's
        kw.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return kw


def padded_vocab_size(vocab_size: int, tp_size: int = 1, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron pads the vocab so every TP rank holds an equal, aligned slice."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def gpt_model_kwargs(
    hf_config: Any, tp_size: int = 1, make_vocab_size_divisible_by: int = 128
) -> dict[str, Any]:
    """`GPTModel(config, transformer_layer_spec, **kwargs)` arguments for this HF config."""
    cfg = hf_config
    return dict(
        vocab_size=padded_vocab_size(cfg.vocab_size, tp_size, make_vocab_size_divisible_by),
        max_sequence_length=cfg.max_position_embeddings,
        # RoPE is not megatron's: polyrl's core attention applies the HF model's own rotary tables
        # (thd.PackedRope; HF-wrapped attention applies its own), for every HF rope type. MLA is the
        # exception: megatron's MLASelfAttention applies its own RoPE to its rope channels ("rope" makes
        # GPTModel add none of its own under MLA, and tells the backend not to add polyrl's)
        position_embedding_type="rope" if _family(cfg).mla else "none",
        share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings),
    )


# ---------------------------------------------------------------------------------------------
# Layout conversions (exact: only reshape / cat / split / slice)


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, num_query_groups: int) -> Tensor:
    """HF q [np*hd, ...], k/v [ng*hd, ...] -> megatron linear_qkv [ng*(np/ng+2)*hd, ...].

    Megatron's SelfAttention views the fused output as [ng, (np/ng + 2) * hd] and splits each
    group into (np/ng q heads, 1 k head, 1 v head) (`get_query_key_value_tensors`), so rows are
    grouped per KV head. Works for weights ([rows, H]) and biases ([rows])."""
    ng, tail = num_query_groups, q.shape[1:]
    return torch.cat([t.reshape(ng, -1, *tail) for t in (q, k, v)], dim=1).reshape(-1, *tail)


def split_qkv(qkv: Tensor, num_heads: int, num_query_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`."""
    ng, tail = num_query_groups, qkv.shape[1:]
    grouped = qkv.reshape(ng, -1, *tail)
    hd = grouped.shape[1] // (num_heads // ng + 2)
    q, k, v = grouped.split([num_heads // ng * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_vocab(t: Tensor, padded: int) -> Tensor:
    # Padding rows are zero: they are never indexed, and their logits are masked by the backend.
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if padded > t.shape[0] else t


# ---------------------------------------------------------------------------------------------
# Tensor parallelism


_COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight",
                    # MLA: every projection is a ColumnParallelLinear in the local spec (heads, or latent channels)
                    "linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
                    "linear_kv_up_proj.weight", "eh_proj.weight")
# Qwen3-Next gated DeltaNet parameter -> how it splits over TP by heads (see the module docstring).
# Its names are unique to the DeltaNet among wrapped modules (the gated attention has q/k/v/o_proj).
GDN_TP: dict[str, str] = {"in_proj_qkvz.weight": "col", "in_proj_ba.weight": "col", "A_log": "col",
                          "dt_bias": "col", "out_proj.weight": "row", "conv1d.weight": "conv",
                          # Qwen3.5's unfused projections: rows q | k | v (as conv1d's channels), z / b / a per value head
                          "in_proj_qkv.weight": "conv", "in_proj_z.weight": "col", "in_proj_b.weight": "col",
                          "in_proj_a.weight": "col"}
_WRAPPED = ".self_attention.hf."


def _tp_kind(mcore_name: str) -> str | None:
    if _WRAPPED in mcore_name:  # wrapped HF modules: only the DeltaNet splits; the rest is replicated
        return GDN_TP.get(mcore_name.rsplit(_WRAPPED, 1)[1])
    if mcore_name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "glu"  # column parallel, gate and up split separately (megatron stride=2)
    if mcore_name.endswith(_COLUMN_PARALLEL):
        return "col"  # dim 0; the per-group qkv layout makes a contiguous chunk = whole groups
    if mcore_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"  # dim 1
    return None  # norms, router, row-parallel biases: replicated


def _chunk(t: Tensor, dim: int, rank: int, size: int, name: str) -> Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of size {t.shape[dim]} does not split over TP={size}")
    return t.chunk(size, dim=dim)[rank]


def gdn_conv_parts(hf_config: Any) -> list[int]:
    """Channel sizes [q, k, v] of the gated DeltaNet's depthwise conv1d."""
    if hf_config is None:
        raise ValueError("gated DeltaNet conv1d.weight: pass hf_config to split or join it over TP")
    key = hf_config.linear_num_key_heads * hf_config.linear_key_head_dim
    return [key, key, hf_config.linear_num_value_heads * hf_config.linear_value_head_dim]


def shard_for_tp(mcore_name: str, full: Tensor, tp_rank: int, tp_size: int, hf_config: Any = None) -> Tensor:
    """This TP rank's slice of a full megatron tensor (for experts pass the expert-TP rank/size).

    linear_qkv: a contiguous dim-0 chunk. With ng % tp == 0 that is ng/tp whole groups; with
    ng < tp megatron's ColumnParallelLinear still takes contiguous chunks and all-gathers inside
    attention, so the chunk is right there too. A gated DeltaNet conv1d.weight needs `hf_config`
    (its q / k / v channel counts)."""
    kind = _tp_kind(mcore_name)
    if tp_size == 1 or kind is None:
        return full
    if kind == "glu":
        return torch.cat([_chunk(half, 0, tp_rank, tp_size, mcore_name) for half in full.chunk(2, dim=0)])
    if kind == "conv":
        parts = full.split(gdn_conv_parts(hf_config), dim=0)
        return torch.cat([_chunk(p, 0, tp_rank, tp_size, mcore_name) for p in parts])
    # clone: a view would keep the whole unsharded tensor alive on every rank
    return _chunk(full, 0 if kind == "col" else 1, tp_rank, tp_size, mcore_name).clone()


def gather_from_tp(mcore_name: str, shards: Sequence[Tensor], hf_config: Any = None) -> Tensor:
    """Inverse of `shard_for_tp` given all ranks' shards in rank order."""
    kind = _tp_kind(mcore_name)
    if len(shards) == 1 or kind is None:
        return shards[0]
    if kind == "glu":
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([*gates, *ups])
    if kind == "conv":
        local = [n // len(shards) for n in gdn_conv_parts(hf_config)]
        q, k, v = zip(*(s.split(local, dim=0) for s in shards))
        return torch.cat([*q, *k, *v])
    return torch.cat(list(shards), dim=0 if kind == "col" else 1)


# ---------------------------------------------------------------------------------------------
# Pipeline / expert ranges


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global layers of an evenly split pipeline stage."""
    if num_layers % pp_size:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline size {pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Global experts held by an EP rank; megatron numbers them locally from 0 (MoELayer)."""
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by expert parallel size {ep_size}")
    per = num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


# ---------------------------------------------------------------------------------------------
# Name map. A rule is (mcore name, HF names, kind); kind says how HF tensors merge into one.

_Rule = tuple[str, tuple[str, ...], str]  # kind: copy | qkv | qkv_rope (permuted q/k) | glu | vocab


def _layer_rules(
    cfg: Any, fam: _Family, layer: int, local: int, experts: Iterable[tuple[int, int]],
    hf_names: Iterable[str] = (), prefixes: tuple[str, str] | None = None,
) -> list[_Rule]:
    """Rules for global HF layer `layer` stored as megatron layer `local`; experts: (local, global).
    hf_names: the checkpoint's tensor names, from which a wrapped HF mixer's parameters are listed.
    prefixes: (megatron, HF) name prefixes of a decoder layer stored elsewhere (MiMo's MTP layers)."""
    m, h = prefixes or (f"decoder.layers.{local}.", f"model.layers.{layer}.")
    a, sa = m + "self_attention.", h + "self_attn."
    rules: list[_Rule] = [(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "copy")]
    mixer = wrapped_mixer(cfg, layer)
    if mixer is not None:  # the HF module's own parameters, renamed under the wrapper, 1:1
        hp, module_name = f"{h}{mixer}.", {ckpt: mod for mod, ckpt in fam.mixer_renames}
        rules += [(f"{a}hf.{module_name.get(n[len(hp):], n[len(hp):])}", (n,), "copy")
                  for n in hf_names if n.startswith(hp)]
    elif fam.mla:
        rules += [(a + mc, (sa + hf,), "copy") for mc, hf in _MLA_NAMES]
    else:
        qkv = "qkv_rope" if fam.interleaved_rope else "qkv"
        rules.append((a + "linear_qkv.weight", tuple(f"{sa}{p}_proj.weight" for p in "qkv"), qkv))
        if _flag(cfg, fam.qkv_bias):
            rules.append((a + "linear_qkv.bias", tuple(f"{sa}{p}_proj.bias" for p in "qkv"), qkv))
        if _flag(cfg, fam.qk_norm):
            rules += [
                (a + "q_layernorm.weight", (sa + "q_norm.weight",), "copy"),
                (a + "k_layernorm.weight", (sa + "k_norm.weight",), "copy"),
            ]
        rules.append((a + "linear_proj.weight", (sa + "o_proj.weight",), "copy"))
    if fam.post_norms:
        rules += [(a + "post_layernorm.weight", (h + "post_self_attn_layernorm.weight",), "copy"),
                  (m + "mlp.post_layernorm.weight", (h + "post_mlp_layernorm.weight",), "copy")]
    rules.append((m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "copy"))
    if fam.oss_experts:
        rules += [(m + "mlp.router.weight", (h + "mlp.router.weight",), "copy"),
                  (m + "mlp.router.bias", (h + "mlp.router.bias",), "copy")]
        for i, e in experts:  # HF names `stacked#e`: expert e of a stacked tensor (docstring)
            me, he = f"{m}mlp.experts.local_experts.{i}.", f"{h}mlp.experts."
            rules += [(me + "linear_fc1.weight", (f"{he}gate_up_proj#{e}",), "oss_fc1"),
                      (me + "linear_fc1.bias", (f"{he}gate_up_proj_bias#{e}",), "oss_fc1"),
                      (me + "linear_fc2.weight", (f"{he}down_proj#{e}",), "oss_t"),
                      (me + "linear_fc2.bias", (f"{he}down_proj_bias#{e}",), "oss_t")]
    elif is_moe_layer(cfg, layer):
        rules.append((m + "mlp.router.weight", (h + "mlp.gate.weight",), "copy"))
        if fam.sigmoid_router:  # a buffer on both sides (fp32)
            rules.append((m + "mlp.router.expert_bias", (h + "mlp.gate.e_score_correction_bias",), "copy"))
        for i, e in experts:
            me, he = f"{m}mlp.experts.local_experts.{i}.", f"{h}mlp.experts.{e}."
            rules += [
                (me + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"), "glu"),
                (me + "linear_fc2.weight", (he + "down_proj.weight",), "copy"),
            ]
        if fam.shared_expert == "gated" or (fam.shared_expert and getattr(cfg, "n_shared_experts", 0)):
            ms = m + "mlp.shared_experts."
            hs = h + ("mlp.shared_expert." if fam.shared_expert == "gated" else "mlp.shared_experts.")
            rules += [
                (ms + "linear_fc1.weight", (hs + "gate_proj.weight", hs + "up_proj.weight"), "glu"),
                (ms + "linear_fc2.weight", (hs + "down_proj.weight",), "copy"),
            ]
            if fam.shared_expert == "gated":
                rules.append((ms + "gate_weight", (h + "mlp.shared_expert_gate.weight",), "copy"))  # both [1, H]
    elif fam.fused_gate_up:  # [gate; up] already: megatron's fc1 layout
        rules += [
            (m + "mlp.linear_fc1.weight", (h + "mlp.gate_up_proj.weight",), "copy"),
            (m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy"),
        ]
    else:
        rules += [
            (m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "glu"),
            (m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy"),
        ]
    return rules


# megatron MLASelfAttention name -> HF DeepseekV3Attention name (module docstring)
_MLA_NAMES = (("linear_q_down_proj.weight", "q_a_proj.weight"), ("q_layernorm.weight", "q_a_layernorm.weight"),
              ("linear_q_up_proj.weight", "q_b_proj.weight"), ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
              ("kv_layernorm.weight", "kv_a_layernorm.weight"), ("linear_kv_up_proj.weight", "kv_b_proj.weight"),
              ("linear_proj.weight", "o_proj.weight"))


def _mtp_rules(cfg: Any, fam: _Family, i: int) -> list[_Rule]:
    """MiMo MTP layer i <-> megatron-core's mtp.layers.{i} (module docstring)."""
    m, h = f"mtp.layers.{i}.", f"model.mtp_layers.{i}."
    return [(m + "enorm.weight", (h + "token_layernorm.weight",), "copy"),
            (m + "hnorm.weight", (h + "hidden_layernorm.weight",), "copy"),
            (m + "eh_proj.weight", (h + "input_proj.weight",), "swap_halves"),
            *_layer_rules(cfg, fam, 0, 0, (), prefixes=(m + "mtp_model_layer.", h)),
            (m + "final_layernorm.weight", (h + "final_layernorm.weight",), "copy")]


def num_mtp_layers(cfg: Any) -> int:
    """MTP layers the checkpoint carries (MiMo: num_nextn_predict_layers); 0 for families without them."""
    return int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) if _family(cfg).mtp else 0


def _swap_halves(t: Tensor) -> Tensor:
    a, b = t.chunk(2, dim=1)
    return torch.cat([b, a], dim=1)


def _deinterleave(t: Tensor) -> Tensor:
    """GPT-OSS gate_up (last dim interleaved gate, up, gate, up, ...) -> [gate; up], transposed to megatron's
    [2I, H] for weights."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1).t().contiguous()


def _interleave(t: Tensor) -> Tensor:
    """Inverse of `_deinterleave`."""
    t = t.t()
    out = torch.empty_like(t)
    half = t.shape[-1] // 2
    out[..., 0::2], out[..., 1::2] = t[..., :half], t[..., half:]
    return out


def rope_pair_permutation(cfg: Any) -> Tensor:
    """Per-head row order that turns interleaved RoPE pairs (2i, 2i+1) of the first r = head_dim *
    partial_rotary_factor channels into rotate-half halves (i, i + r/2): [0, 2, .., r-2, 1, 3, .., r-1,
    r, .., head_dim-1]. Applied to the q and k rows of every head, it is exact (a permutation)."""
    hd = _head_dim(cfg)
    r = int(hd * _rope_params(cfg).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, hd)])


def _permute_heads(t: Tensor, perm: Tensor) -> Tensor:
    tail = t.shape[1:]
    return t.reshape(-1, perm.numel(), *tail)[:, perm].reshape(-1, *tail)


_HF_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _hf_get(hf_state: Mapping[str, Tensor], name: str, stacked: dict[str, Tensor] | None = None) -> Tensor:
    if "#" in name:  # expert e of a stacked tensor, read once per call (stacked: the caller's cache)
        base, e = name.split("#")
        cache = {} if stacked is None else stacked
        if base not in cache:
            if base in hf_state:
                cache.clear()  # one stacked tensor at a time
                cache[base] = hf_state[base]
            elif f"{base}_blocks" in hf_state:  # MXFP4 checkpoint: dequantize as transformers does
                from polyrl.backends.mxfp4 import dequantize_mxfp4
                cache.clear()
                cache[base] = dequantize_mxfp4(hf_state[f"{base}_blocks"], hf_state[f"{base}_scales"])
            else:
                raise KeyError(f"megatron bridge: HF tensor {base!r} (nor {base}_blocks / _scales) not found")
        return cache[base][int(e)]
    if name in hf_state:
        return hf_state[name]
    m = _HF_EXPERT.fullmatch(name)
    if m is None:
        raise KeyError(f"megatron bridge: HF tensor {name!r} not found")
    # transformers>=5 in-memory layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
    prefix, e, which = m[1], int(m[2]), m[3]
    if which == "down":
        return hf_state[f"{prefix}.down_proj"][e]
    return hf_state[f"{prefix}.gate_up_proj"][e].chunk(2, dim=0)[which == "up"]


def hf_to_mcore(
    hf_state: Mapping[str, Tensor],
    hf_config: Any,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    layer_range: range | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> dict[str, Tensor]:
    """This rank's megatron state dict (local spec names) from an HF state dict or lazy loader.

    Only the tensors this rank needs are read. PP: layers `layer_range` (default: an even split
    by `pp_rank`/`pp_size`) renumbered from 0; the embedding lives on stage 0, the final norm and
    output layer on the last stage. EP: experts `expert_range(E, ep_rank, ep_size)` renumbered
    from 0. Expert weights are split over expert-TP (`etp_*`, default: the TP group, megatron's
    default when expert_tensor_parallel_size is unset). With tp_size == 1 unsharded tensors may be
    the caller's own tensors, not copies."""
    cfg, fam = hf_config, _family(hf_config)
    etp_size = tp_size if etp_size is None else etp_size
    if etp_rank is None:
        if etp_size not in (1, tp_size):
            raise ValueError("hf_to_mcore: pass etp_rank when expert TP size differs from TP size")
        etp_rank = tp_rank if etp_size == tp_size else 0
    if layer_range is None:
        layer_range = pp_layer_range(cfg.num_hidden_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    experts = list(enumerate(expert_range(num_experts(cfg), ep_rank, ep_size))) if num_experts(cfg) else []
    vocab = padded_vocab_size(cfg.vocab_size, tp_size, make_vocab_size_divisible_by)

    rules: list[_Rule] = []
    if first:
        rules.append(("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    names = list(hf_state) if fam.mixers else []  # names only: a lazy checkpoint reads no tensor here
    dropped = [n for n in names if n.startswith("mtp.")] if not fam.mtp and cfg.model_type not in _MTP_WARNED else []
    if dropped:  # Qwen3-Next / Qwen3.5 multi-token prediction: no megatron module holds it
        _MTP_WARNED.add(cfg.model_type)
        log.warning("megatron bridge: %s checkpoint's %d multi-token-prediction tensors (%s, ...) are not loaded: they "
                    "are neither trained nor exported (--save-hf / weight sync), as transformers drops them",
                    cfg.model_type, len(dropped), dropped[0])
    for local, layer in enumerate(layer_range):
        rules += _layer_rules(cfg, fam, layer, local, experts, names)
    if last:  # megatron-core builds the MTP block on the last pipeline stage
        for i in range(num_mtp_layers(cfg)):
            rules += _mtp_rules(cfg, fam, i)
    if last:
        rules.append(("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
        if not cfg.tie_word_embeddings:
            rules.append(("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif not first:  # megatron keeps a copy of the tied embedding on the last stage
            rules.append(("output_layer.weight", ("model.embed_tokens.weight",), "vocab"))

    out: dict[str, Tensor] = {}
    stacked: dict[str, Tensor] = {}
    for name, hf_names, kind in rules:
        parts = [_hf_get(hf_state, n, stacked) for n in hf_names]
        if kind == "qkv_rope":  # q, k: rope pairs to rotate-half order; v as is
            perm = rope_pair_permutation(cfg)
            parts = [_permute_heads(parts[0], perm), _permute_heads(parts[1], perm), parts[2]]
        if kind in ("qkv", "qkv_rope"):
            full = fuse_qkv(*parts, _num_query_groups(cfg))
        elif kind == "glu":
            full = torch.cat(parts)
        elif kind == "vocab":
            full = _pad_vocab(parts[0], vocab)
        elif kind == "swap_halves":
            full = _swap_halves(parts[0])
        elif kind == "oss_fc1":
            full = _deinterleave(parts[0])
        elif kind == "oss_t":
            full = parts[0].t().contiguous()
        else:
            full = parts[0]
        if ".local_experts." in name:
            out[name] = shard_for_tp(name, full, etp_rank, etp_size)
        else:
            out[name] = shard_for_tp(name, full, tp_rank, tp_size, cfg)
    return out


_GLOBAL_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "vocab"),
    "decoder.final_layernorm.weight": (("model.norm.weight",), "copy"),
    "output_layer.weight": (("lm_head.weight",), "vocab"),
}
_MC_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MC_WRAPPED = re.compile(r"self_attention\.hf\.(.+)")
_MC_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|bias)")
_MC_MTP = re.compile(r"mtp\.layers\.(\d+)\..+")


def mcore_to_hf(
    named_tensors: Iterable[tuple[str, Tensor]],
    hf_config: Any,
    *,
    layer_offset: int = 0,
    expert_offset: int = 0,
    fused_experts: bool = False,
) -> Iterator[tuple[str, Tensor]]:
    """Stream HF (name, tensor) pairs from TP-gathered megatron (name, tensor) pairs.

    One parameter in, its HF parameter(s) out, so weight sync can bucket as it goes. Megatron
    layer indices are local to the PP stage (`layer_offset` = the stage's first global layer) and
    expert indices local to the EP rank (`expert_offset`). Wrapper prefixes (`module.` from DDP /
    Float16Module) are stripped. The tied `output_layer.weight` copy is skipped, so `lm_head.weight`
    appears only when the HF config is untied. `fused_experts=True` emits the transformers>=5
    in-memory layout (`mlp.experts.gate_up_proj`/`down_proj`, and a wrapped module's own parameter names where
    the checkpoint renames them: `_Family.mixer_renames`), buffering each layer's experts
    until all `num_experts` have arrived: feed every expert, e.g. gathered over EP."""
    cfg, fam = hf_config, _family(hf_config)
    nq, ng = cfg.num_attention_heads, _num_query_groups(cfg)
    pending: dict[str, dict[int, Tensor]] = {}
    for name, tensor in named_tensors:
        while name.startswith("module."):
            name = name[len("module."):]
        expert = None
        if name in _GLOBAL_RULES:
            if name == "output_layer.weight" and cfg.tie_word_embeddings:
                continue
            hf_names, kind = _GLOBAL_RULES[name]
        elif (mtp := _MC_MTP.fullmatch(name)) is not None:
            rule = next((r for r in _mtp_rules(cfg, fam, int(mtp[1])) if r[0] == name), None) if fam.mtp else None
            if rule is None:
                raise ValueError(f"mcore_to_hf: unknown megatron parameter {name!r} ({cfg.model_type})")
            _, hf_names, kind = rule
        else:
            m = _MC_LAYER.fullmatch(name)
            if m is None:
                raise ValueError(f"mcore_to_hf: unknown megatron parameter {name!r}")
            local, layer = int(m[1]), int(m[1]) + layer_offset
            expert = _MC_EXPERT.fullmatch(m[2])
            experts = [(int(expert[1]), int(expert[1]) + expert_offset)] if expert else []
            wrapped = _MC_WRAPPED.fullmatch(m[2])
            mixer = wrapped_mixer(cfg, layer) if wrapped else None
            rest = wrapped[1] if wrapped else ""
            if not fused_experts:  # the checkpoint's names (mixer_renames); fused_experts: the HF module's own
                rest = dict(fam.mixer_renames).get(rest, rest)
            hf_name = [f"model.layers.{layer}.{mixer}.{rest}"] if mixer else []
            rule = next((r for r in _layer_rules(cfg, fam, layer, local, experts, hf_name) if r[0] == name), None)
            if rule is None:
                raise ValueError(f"mcore_to_hf: unknown megatron parameter {name!r} ({cfg.model_type})")
            _, hf_names, kind = rule

        if kind in ("oss_fc1", "oss_t"):  # GPT-OSS experts are stacked on the HF side whatever fused_experts says
            base, e = hf_names[0].split("#")
            bucket = pending.setdefault(base, {})
            bucket[int(e)] = _interleave(tensor) if kind == "oss_fc1" else tensor.t()
            if len(bucket) == num_experts(cfg):
                yield base, torch.stack([bucket[i] for i in range(num_experts(cfg))])
                del pending[base]
            continue
        if fused_experts and expert is not None:
            # fc1 of one expert is [gate; up] == gate_up_proj[e]; fc2 == down_proj[e]
            stacked = "gate_up_proj" if expert[2] == "linear_fc1" else "down_proj"
            key = f"model.layers.{layer}.mlp.experts.{stacked}"
            bucket = pending.setdefault(key, {})
            bucket[int(expert[1]) + expert_offset] = tensor
            if len(bucket) == num_experts(cfg):
                yield key, torch.stack([bucket[e] for e in range(num_experts(cfg))])
                del pending[key]
            continue

        if kind in ("qkv", "qkv_rope"):
            parts: Sequence[Tensor] = split_qkv(tensor, nq, ng)
            if kind == "qkv_rope":
                inv = torch.argsort(rope_pair_permutation(cfg))
                parts = [_permute_heads(parts[0], inv), _permute_heads(parts[1], inv), parts[2]]
        elif kind == "glu":
            parts = tensor.chunk(2, dim=0)
        elif kind == "vocab":
            parts = [tensor[: cfg.vocab_size]]  # drop megatron's padding rows
        elif kind == "swap_halves":
            parts = [_swap_halves(tensor)]
        else:
            parts = [tensor]
        yield from zip(hf_names, parts)
    if pending:
        raise ValueError(f"mcore_to_hf: stacked experts missing for {sorted(pending)} (feed every expert)")


# ---------------------------------------------------------------------------------------------
# Lazy safetensors checkpoint


class SafetensorsCheckpoint(Mapping[str, Tensor]):
    """Read-only mapping over an HF safetensors checkpoint; each lookup reads one tensor.

    Handles `model.safetensors` and sharded `model.safetensors.index.json` checkpoints. Files are
    memory-mapped by `safe_open`, so nothing is copied until a tensor is asked for. A block-FP8 checkpoint
    (config.json's quantization_config `quant_method: fp8`: a `weight` in float8_e4m3fn beside its `weight_scale_inv`)
    reads dequantized, as FP32 weight * scale per block (what transformers' dequantizing load and SGLang compute), and
    the scales are not listed."""

    def __init__(self, hf_dir: str | Path):
        d = Path(hf_dir)
        index = d / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: d / f for name, f in weight_map.items()}
        elif (d / "model.safetensors").exists():
            with safe_open(d / "model.safetensors", framework="pt") as f:
                self._file_of = {name: d / "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {d}")
        self._handles: dict[Path, Any] = {}
        self._scales: dict[str, tuple[str, Path]] = {}  # FP8 weight name -> its weight_scale_inv's name and file
        self._block: tuple[int, int] | None = None
        q = json.loads((d / "config.json").read_text()).get("quantization_config") if (d / "config.json").exists() else None
        if q and q.get("quant_method") == "fp8":
            self._block = tuple(q.get("weight_block_size") or (128, 128))
            for name in [n for n in self._file_of if n.endswith(".weight_scale_inv")]:
                self._scales[name.removesuffix("_scale_inv")] = (name, self._file_of.pop(name))

    def _read(self, name: str, path: Path) -> Tensor:
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path].get_tensor(name)

    def __getitem__(self, name: str) -> Tensor:
        t = self._read(name, self._file_of[name])
        if name in self._scales and t.dtype == torch.float8_e4m3fn:
            from polyrl.weight_sync.quantize import dequantize_fp8_block
            t = dequantize_fp8_block(t, self._read(*self._scales[name]), self._block)
        return t

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def load_hf_safetensors(hf_dir: str | Path) -> SafetensorsCheckpoint:
    """Lazy mapping of HF name -> tensor for a checkpoint directory (see `SafetensorsCheckpoint`)."""
    return SafetensorsCheckpoint(hf_dir)
