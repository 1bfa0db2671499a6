"""HF model families that need something from polyrl before transformers can run them.

MiMo-7B (`model_type: mimo`) ships remote code only: a Qwen2 decoder plus multi-token-prediction layers under
`model.mtp_layers.{i}`. `MiMoForCausalLM` here is written from the checkpoint's tensor names (no remote code runs):
the decoder is transformers' Qwen2, so training and generation see exactly Qwen2's forward, and the MTP layers are
modules of the model, so loading, checkpoints and weight export keep them under their names. The main forward
does not run them; --enable-mtp-training trains them on the FSDP backend (polyrl.backends.fsdp.mtp), otherwise they
stay as loaded.

`register()` makes AutoConfig / AutoModelForCausalLM know `mimo`; the CLI and the FSDP backend call it (explicitly:
no import side effect).

`dense_attention_reason(config)` names the families whose attention polyrl's packed / varlen path cannot express
(learned attention sinks, sliding-window layers): those run HF's eager attention on padded rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import (Qwen2Attention, Qwen2ForCausalLM, Qwen2MLP, Qwen2Model,
                                                      Qwen2RMSNorm)


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers: int = 0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)


class MiMoMTPLayer(nn.Module):
    """One MTP layer: norms of the previous hidden state and of the next token's embedding, concatenated as
    [hidden; embedding], projected to H, one Qwen2 decoder layer, a final norm."""

    def __init__(self, config: MiMoConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.post_attention_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.token_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.hidden_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.self_attn = Qwen2Attention(config, layer_idx=0)
        self.mlp = Qwen2MLP(config)

    def forward(self, input_embeds: torch.Tensor, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None,
                **attn_kwargs) -> torch.Tensor:
        """input_embeds, hidden_states [B, L, H] (the embedding of token t+1 beside the hidden state at t) -> [B, L, H]
        before the shared output layer. attn_kwargs: what the attention kernel reads beside the mask (cu_seqlens of a
        packed varlen row)."""
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden_states), self.token_layernorm(input_embeds)], -1))
        attn, _ = self.self_attn(self.input_layernorm(x), position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, **attn_kwargs)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)


class MiMoModel(Qwen2Model):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig):
        super().__init__(config)
        self.mtp_layers = nn.ModuleList([MiMoMTPLayer(config) for _ in range(config.num_nextn_predict_layers)])
        self.post_init()


class MiMoForCausalLM(Qwen2ForCausalLM):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig):
        super().__init__(config)
        self.model = MiMoModel(config)
        self.post_init()


def mtp_depths(config: Any) -> int:
    """How many multi-token-prediction layers a checkpoint's modules carry (the ones polyrl builds: MiMo's)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0) if getattr(config, "model_type", None) == "mimo" else 0


def register() -> None:
    """Teach transformers' Auto classes the families above (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register("mimo", MiMoConfig, exist_ok=True)
    AutoModelForCausalLM.register(MiMoConfig, MiMoForCausalLM, exist_ok=True)


# model_type -> why polyrl's packed / varlen attention cannot run it (HF eager attention on padded rows instead)
DENSE_ATTENTION = {
    "gpt_oss": "learned attention sinks and sliding-window layers",
    "mimo_v2_flash": "learned attention sinks and sliding-window layers",
}


def dense_attention_reason(config: Any) -> str | None:
    """Why this model must run HF's eager attention on padded rows (None: any attention path works)."""
    why = DENSE_ATTENTION.get(getattr(config, "model_type", None))
    if why is None and "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        why = "sliding-window layers"
    return why


def fsdp_layout_problem(config: Any, attn_implementation: str, micro_batch_layout: str) -> str | None:
    """Why the FSDP backend cannot run this model with these flags (None: it can), for the start-up check and the
    backend alike: dense-attention families need HF eager attention on padded rows, linear-attention (recurrent)
    layers need padded rows."""
    dense_why = dense_attention_reason(config)
    if dense_why is not None and (attn_implementation not in ("auto", "eager") or micro_batch_layout == "packed"):
        return (f"--attn-implementation {attn_implementation} / --micro-batch-layout {micro_batch_layout}: "
                f"{config.model_type} has {dense_why}, which only HF's eager attention on padded rows computes; use "
                "--attn-implementation auto or eager with --micro-batch-layout auto or padded")
    if "linear_attention" in (getattr(config, "layer_types", None) or ()) and micro_batch_layout == "packed":
        return ("--micro-batch-layout packed: this model has linear-attention (recurrent) layers, whose HF "
                "implementation carries state across packed sequences; use padded or auto")
    return None


def dequantized_load(config: Any) -> dict:
    """from_pretrained keyword arguments that load an MXFP4 checkpoint (GPT-OSS: experts) or a block-FP8 one (linear
    weights) dequantized (trainable, and the tensors weight sync names), and strip the quantization from `config`, so a model built from
    it and saved (--save-hf) is a plain BF16/FP32 checkpoint. {} for an unquantized checkpoint."""
    q = getattr(config, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    if method is None:
        return {}
    method = str(getattr(method, "value", method))
    if method not in ("mxfp4", "fp8"):
        raise ValueError(f"checkpoint quantized with {method}: polyrl loads unquantized, MXFP4 (GPT-OSS) or block-FP8 "
                         "checkpoints")
    from transformers import FineGrainedFP8Config, Mxfp4Config
    block = (q.get("weight_block_size") if isinstance(q, dict) else getattr(q, "weight_block_size", None)) or (128, 128)
    del config.quantization_config
    if method == "fp8":  # block-FP8 (Qwen3-*-FP8, polyrl's own FP8 copy for SGLang): weight * weight_scale_inv
        return {"quantization_config": FineGrainedFP8Config(weight_block_size=tuple(block), dequantize=True)}
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def checkpoint_config(path: str | None):
    """The HF config in checkpoint directory `path`, or None where there is none to read yet (a missing checkpoint is
    named where it is loaded): what start-up checks read before any weight loads."""
    import os
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)
