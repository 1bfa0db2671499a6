"""GPT-OSS's MoE on megatron-core: which TransformerConfig fields reproduce HF's GptOssMLP.

HF (transformers' modeling_gpt_oss.py), per token x [H]:

    logits = x @ router.weight.T + router.bias                       [E]
    top, idx = topk(logits, k); w = softmax(top)                      (softmax over the chosen k logits)
    gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]              [2I], gate / up interleaved
    gate = min(gate_up[0::2], limit); up = clamp(gate_up[1::2], -limit, limit)
    h = (up + 1) * gate * sigmoid(alpha * gate)                       alpha = swiglu_alpha (1.702)
    out += w_e * (h @ down_proj[e] + down_proj_bias[e])

megatron-core 0.19 has every piece: a router with a bias (`add_bias_linear`), top-k over logits then
softmax (`moe_router_pre_softmax=False`), biased expert linears (`add_bias_linear`), and in MLP.forward's
unfused GLU `activation_func(min(x_glu, c)) * (clamp(x_linear, -c, c) + glu_linear_offset)` with
`activation_func_clamp_value=c`. The bridge writes fc1 as [gate; up] (de-interleaved), which is the
order megatron's GLU chunks. Megatron scales the expert by its routing weight before fc2 and adds
`w_e * bias` after it (MLP.forward's per_token_scale): the same sum as HF's, rounded differently.
That bias add is in place on fc2's output, which megatron hands back as a view when the expert-TP group has one rank
and EP is 1; autograd refuses it in training, so model.layer_spec builds biased experts' fc2 as
model.ExpertRowParallelLinear (the one-rank reduce skipped, as megatron itself does at EP > 1).

The activation is a plain function rather than megatron's `fused_bias_geglu.quick_gelu` (the same
y * sigmoid(1.702 y)) because that one is wrapped in megatron's jit fuser (torch.compile), which would
recompile for each expert's token count.

Pure torch: the bridge imports this module, megatron-core does not need to be installed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor


def sigmoid_gate(y: Tensor, alpha: float) -> Tensor:
    """HF GptOssExperts' gate activation y * sigmoid(alpha * y) (megatron's quick_gelu at alpha 1.702)."""
    return y * torch.sigmoid(alpha * y)


def hf_swiglu_constants(cfg: Any) -> tuple[float, float]:
    """(alpha, limit) as the installed transformers' GptOssExperts reads them from `cfg`: recent releases take the
    config's swiglu_alpha / swiglu_limit, earlier ones hard-code 1.702 / 7.0 (or lack swiglu_alpha). Built on the
    meta device, so no expert weight is allocated."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    with torch.device("meta"):
        experts = GptOssExperts(cfg)
    return float(experts.alpha), float(experts.limit)


def mcore_kwargs(cfg: Any) -> dict[str, Any]:
    """TransformerConfig fields of GPT-OSS's biased, clamped SwiGLU experts and biased router (module docstring),
    on top of config_to_mcore_kwargs' MoE fields. The attention is the wrapped HF module and every layer is MoE,
    so `add_bias_linear` reaches the router and the experts only."""
    alpha, limit = hf_swiglu_constants(cfg)
    return dict(
        add_bias_linear=True,
        gated_linear_unit=True,
        activation_func=functools.partial(sigmoid_gate, alpha=alpha),
        glu_linear_offset=1.0,
        activation_func_clamp_value=limit,
    )


def check_expert_tp(etp: int) -> None:
    """megatron-core (0.19, TransformerConfig) supports expert biases only without expert tensor parallelism."""
    if etp != 1:
        raise ValueError(f"GPT-OSS on --train-backend megatron: its biased experts need "
                         f"--expert-tensor-parallel-size 1 (got {etp}; it defaults to --tensor-model-parallel-size), "
                         "as megatron-core supports expert biases only without expert tensor parallelism")
