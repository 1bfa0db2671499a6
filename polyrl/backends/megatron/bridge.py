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

Qwen3-Next's RMSNorms compute x_norm * (1 + w): the weight is
stored as is and megatron's `layernorm_zero_centered_gamma` tells polyrl's norm to add the 1.

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
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor


@dataclass(frozen=True)
class _Family:
    qkv_bias: bool  # q/k/v projections carry biases (megatron add_qkv_bias)
    qk_norm: bool  # per-head RMSNorm on q and k (megatron qk_layernorm)
    moe: bool
    # HF layer type -> HF attribute of the token mixer that hf_wrap.py runs as is (empty: megatron's attention)
    mixers: tuple[tuple[str, str], ...] = ()
    zero_centered_norm: bool = False  # RMSNorm output x_norm * (1 + w) (megatron layernorm_zero_centered_gamma)
    shared_expert: bool = False  # MoE layers add a sigmoid-gated shared expert (megatron moe_shared_expert_gate)


FAMILIES: dict[str, _Family] = {  # HF model_type -> what differs between supported decoders
    "llama": _Family(qkv_bias=False, qk_norm=False, moe=False),  # LlamaForCausalLM
    "qwen2": _Family(qkv_bias=True, qk_norm=False, moe=False),  # Qwen2ForCausalLM (Qwen2, Qwen2.5)
    "qwen3": _Family(qkv_bias=False, qk_norm=True, moe=False),  # Qwen3ForCausalLM
    "qwen3_moe": _Family(qkv_bias=False, qk_norm=True, moe=True),  # Qwen3MoeForCausalLM
    # Qwen3NextForCausalLM: gated DeltaNet and gated full attention run as HF modules; dense or sparse
    # MLPs (routed experts + gated shared expert) are megatron's
    "qwen3_next": _Family(qkv_bias=False, qk_norm=False, moe=True, zero_centered_norm=True, shared_expert=True,
                          mixers=(("linear_attention", "linear_attn"), ("full_attention", "self_attn"))),
}


def _family(cfg: Any) -> _Family:
    fam = FAMILIES.get(getattr(cfg, "model_type", None))
    if fam is None:
        raise ValueError(
            f"megatron bridge: unsupported model_type {getattr(cfg, 'model_type', None)!r} "
            f"(architectures={getattr(cfg, 'architectures', None)}); supported model types: "
            f"{sorted(FAMILIES)} (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
            "Qwen3MoeForCausalLM, Qwen3NextForCausalLM)"
        )
    # Variants the name map cannot express: refuse rather than build a silently different model.
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("megatron bridge: attention_bias / mlp_bias variants are not supported")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError("megatron bridge: sliding-window attention layers are not supported")
    if cfg.hidden_act != "silu":
        raise ValueError(f"megatron bridge: hidden_act {cfg.hidden_act!r} is not supported (silu only)")
    if cfg.model_type == "qwen3_next":
        unknown = set(cfg.layer_types) - {t for t, _ in fam.mixers}
        if unknown:
            raise ValueError(f"megatron bridge: Qwen3-Next layer types {sorted(unknown)} are not supported")
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
    """Same rule as transformers' Qwen3MoeDecoderLayer (mlp_only_layers, decoder_sparse_step)."""
    if not _family(cfg).moe:
        return False
    return (
        layer not in (getattr(cfg, "mlp_only_layers", None) or [])
        and cfg.num_experts > 0
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
        add_qkv_bias=fam.qkv_bias,
        qk_layernorm=fam.qk_norm,
        hidden_dropout=0.0,  # HF decoders have no residual dropout
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0)),
        init_method_std=cfg.initializer_range,
        layernorm_zero_centered_gamma=fam.zero_centered_norm,
    )
    if any(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)):  # (all-dense Qwen3-Next: none)
        aux = bool(getattr(cfg, "output_router_logits", False))  # HF only adds aux loss when set
        kw.update(
            num_moe_experts=cfg.num_experts,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_router_score_function="softmax",
            # HF: softmax over all experts, top-k, renormalise if norm_topk_prob. Renormalised
            # top-k softmax == softmax over the top-k logits, which is megatron's pre_softmax=False.
            moe_router_pre_softmax=not cfg.norm_topk_prob,
            moe_layer_freq=[int(is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)],
            moe_router_load_balancing_type="aux_loss" if aux else "none",
            moe_aux_loss_coeff=float(cfg.router_aux_loss_coef) if aux else 0.0,
            moe_grouped_gemm=False,  # the local spec builds SequentialMLP experts
        )
        if fam.shared_expert:  # HF: experts + sigmoid(shared_expert_gate(x)) * shared_expert(x)
            kw.update(moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
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
    _family(cfg)
    return dict(
        vocab_size=padded_vocab_size(cfg.vocab_size, tp_size, make_vocab_size_divisible_by),
        max_sequence_length=cfg.max_position_embeddings,
        # RoPE is not megatron's: polyrl's core attention applies the HF model's own rotary tables
        # (thd.PackedRope; HF-wrapped attention applies its own), for every HF rope type
        position_embedding_type="none",
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


_COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
# Qwen3-Next gated DeltaNet parameter -> how it splits over TP by heads (see the module docstring).
# Its names are unique to the DeltaNet among wrapped modules (the gated attention has q/k/v/o_proj).
GDN_TP: dict[str, str] = {"in_proj_qkvz.weight": "col", "in_proj_ba.weight": "col", "A_log": "col",
                          "dt_bias": "col", "out_proj.weight": "row", "conv1d.weight": "conv"}
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

_Rule = tuple[str, tuple[str, ...], str]  # kind: copy | qkv | glu | vocab


def _layer_rules(
    cfg: Any, fam: _Family, layer: int, local: int, experts: Iterable[tuple[int, int]],
    hf_names: Iterable[str] = (),
) -> list[_Rule]:
    """Rules for global HF layer `layer` stored as megatron layer `local`; experts: (local, global).
    hf_names: the checkpoint's tensor names, from which a wrapped HF mixer's parameters are listed."""
    m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
    a, sa = m + "self_attention.", h + "self_attn."
    rules: list[_Rule] = [(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "copy")]
    mixer = wrapped_mixer(cfg, layer)
    if mixer is not None:  # the HF module's own parameters, renamed under the wrapper, 1:1
        hp = f"{h}{mixer}."
        rules += [(f"{a}hf.{n[len(hp):]}", (n,), "copy") for n in hf_names if n.startswith(hp)]
    else:
        rules.append((a + "linear_qkv.weight", tuple(f"{sa}{p}_proj.weight" for p in "qkv"), "qkv"))
        if fam.qkv_bias:
            rules.append((a + "linear_qkv.bias", tuple(f"{sa}{p}_proj.bias" for p in "qkv"), "qkv"))
        if fam.qk_norm:
            rules += [
                (a + "q_layernorm.weight", (sa + "q_norm.weight",), "copy"),
                (a + "k_layernorm.weight", (sa + "k_norm.weight",), "copy"),
            ]
        rules.append((a + "linear_proj.weight", (sa + "o_proj.weight",), "copy"))
    rules.append((m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "copy"))
    if is_moe_layer(cfg, layer):
        rules.append((m + "mlp.router.weight", (h + "mlp.gate.weight",), "copy"))
        for i, e in experts:
            me, he = f"{m}mlp.experts.local_experts.{i}.", f"{h}mlp.experts.{e}."
            rules += [
                (me + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"), "glu"),
                (me + "linear_fc2.weight", (he + "down_proj.weight",), "copy"),
            ]
        if fam.shared_expert:
            ms, hs = m + "mlp.shared_experts.", h + "mlp.shared_expert."
            rules += [
                (ms + "linear_fc1.weight", (hs + "gate_proj.weight", hs + "up_proj.weight"), "glu"),
                (ms + "linear_fc2.weight", (hs + "down_proj.weight",), "copy"),
                (ms + "gate_weight", (h + "mlp.shared_expert_gate.weight",), "copy"),  # both [1, H]
            ]
    else:
        rules += [
            (m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "glu"),
            (m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy"),
        ]
    return rules


_HF_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _hf_get(hf_state: Mapping[str, Tensor], name: str) -> Tensor:
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
    experts = list(enumerate(expert_range(cfg.num_experts, ep_rank, ep_size))) if fam.moe else []
    vocab = padded_vocab_size(cfg.vocab_size, tp_size, make_vocab_size_divisible_by)

    rules: list[_Rule] = []
    if first:
        rules.append(("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    names = list(hf_state) if fam.mixers else []  # names only: a lazy checkpoint reads no tensor here
    for local, layer in enumerate(layer_range):
        rules += _layer_rules(cfg, fam, layer, local, experts, names)
    if last:
        rules.append(("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
        if not cfg.tie_word_embeddings:
            rules.append(("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif not first:  # megatron keeps a copy of the tied embedding on the last stage
            rules.append(("output_layer.weight", ("model.embed_tokens.weight",), "vocab"))

    out: dict[str, Tensor] = {}
    for name, hf_names, kind in rules:
        parts = [_hf_get(hf_state, n) for n in hf_names]
        if kind == "qkv":
            full = fuse_qkv(*parts, _num_query_groups(cfg))
        elif kind == "glu":
            full = torch.cat(parts)
        elif kind == "vocab":
            full = _pad_vocab(parts[0], vocab)
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
_MC_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")


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
    in-memory layout (`mlp.experts.gate_up_proj`/`down_proj`), buffering each layer's experts
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
        else:
            m = _MC_LAYER.fullmatch(name)
            if m is None:
                raise ValueError(f"mcore_to_hf: unknown megatron parameter {name!r}")
            local, layer = int(m[1]), int(m[1]) + layer_offset
            expert = _MC_EXPERT.fullmatch(m[2])
            experts = [(int(expert[1]), int(expert[1]) + expert_offset)] if expert else []
            wrapped = _MC_WRAPPED.fullmatch(m[2])
            mixer = wrapped_mixer(cfg, layer) if wrapped else None
            hf_name = [f"model.layers.{layer}.{mixer}.{wrapped[1]}"] if mixer else []
            rule = next((r for r in _layer_rules(cfg, fam, layer, local, experts, hf_name) if r[0] == name), None)
            if rule is None:
                raise ValueError(f"mcore_to_hf: unknown megatron parameter {name!r} ({cfg.model_type})")
            _, hf_names, kind = rule

        if fused_experts and expert is not None:
            # fc1 of one expert is [gate; up] == gate_up_proj[e]; fc2 == down_proj[e]
            stacked = "gate_up_proj" if expert[2] == "linear_fc1" else "down_proj"
            key = f"model.layers.{layer}.mlp.experts.{stacked}"
            bucket = pending.setdefault(key, {})
            bucket[int(expert[1]) + expert_offset] = tensor
            if len(bucket) == cfg.num_experts:
                yield key, torch.stack([bucket[e] for e in range(cfg.num_experts)])
                del pending[key]
            continue

        if kind == "qkv":
            parts: Sequence[Tensor] = split_qkv(tensor, nq, ng)
        elif kind == "glu":
            parts = tensor.chunk(2, dim=0)
        elif kind == "vocab":
            parts = [tensor[: cfg.vocab_size]]  # drop megatron's padding rows
        else:
            parts = [tensor]
        yield from zip(hf_names, parts)
    if pending:
        raise ValueError(f"mcore_to_hf(fused_experts=True): experts missing for {sorted(pending)}")


# ---------------------------------------------------------------------------------------------
# Lazy safetensors checkpoint


class SafetensorsCheckpoint(Mapping[str, Tensor]):
    """Read-only mapping over an HF safetensors checkpoint; each lookup reads one tensor.

    Handles `model.safetensors` and sharded `model.safetensors.index.json` checkpoints. Files are
    memory-mapped by `safe_open`, so nothing is copied until a tensor is asked for."""

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

    def __getitem__(self, name: str) -> Tensor:
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path].get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def load_hf_safetensors(hf_dir: str | Path) -> SafetensorsCheckpoint:
    """Lazy mapping of HF name -> tensor for a checkpoint directory (see `SafetensorsCheckpoint`)."""
    return SafetensorsCheckpoint(hf_dir)
