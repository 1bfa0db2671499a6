"""HuggingFace module wrapping: run a model's own HF token mixer inside megatron's TransformerLayer.

Why: megatron-core (0.19) has no Gated DeltaNet (Qwen3-Next's linear attention), and Qwen3-Next's
full attention (an output gate folded into q_proj, partial RoPE, zero-centered q/k norms) does not
fit its SelfAttention either. Rather than re-implement them inside megatron, the layer spec points
each TransformerLayer's `self_attention` at `HFMixer`, which holds the official transformers module
and runs it on megatron's packed hidden states (slime's approach, docs "Supporting Model
Architectures Beyond Megatron-LM"). The rest of the layer (norms, MLP, residuals), the embedding,
the log-prob head, the pipeline schedule, DDP / distributed optimizer and checkpoints stay
megatron's.

Data path. TransformerLayer calls `self_attention(h, attention_mask=..., rotary_pos_emb=...,
packed_seq_params=..., ...)` with the input-norm output h [T, 1, H] (THD: the micro-batch's
sequences concatenated, boundaries in `packed_seq_params.cu_seqlens_q`) and adds the first element
of the returned `(output, bias)` to the residual. HFMixer cuts h at the boundaries and calls the HF
module once per sequence as [1, L, H] with positions 0..L-1: polyrl's packing (thd.pack_thd)
restarts positions at every boundary, so nothing beyond cu_seqlens needs carrying. Megatron's own
RoPE is off for these models (bridge: position_embedding_type "none"); full-attention layers get
cos/sin from the model's HF rotary module (partial rotary included), kept in fp32 outside the
module tree so Float16Module never casts its inverse frequencies.

Parameters. `self.hf` is the HF module, so its parameters keep their HF names under the wrapper
(`decoder.layers.N.self_attention.hf.in_proj_qkvz.weight`) and the bridge maps them 1:1 to
`model.layers.N.linear_attn.in_proj_qkvz.weight`. HFMixer is a plain torch module: megatron's
default `sharded_state_dict` (MegatronModule -> `sharded_state_dict_default`) writes a non-megatron
child's tensors as replicated over TP and DP, which is what they are. Layers differ (DeltaNet vs
attention parameters), so the backend checkpoints such models with one key per layer
(megatron's `non_homogeneous_layers`) instead of stacking layers into one tensor per name.

Limits.
  - Tensor parallelism: the HF module is replicated on every TP rank, not split. TP > 1 is correct
    (every TP rank runs the full mixer; with --sequence-parallel the sequence shards are gathered in
    and scattered out, with the backward megatron uses for duplicated compute), but the mixer's
    compute and memory do not shrink with TP.
  - Context parallelism is refused: the recurrent state runs along whole sequences.
  - Speed: one HF call per packed sequence (a Python loop); the gated delta rule uses HF's torch
    chunked fallback unless flash-linear-attention is installed. Right for proofs and small models,
    slow for long-context training at scale.
  - Qwen3-Next's sparse MoE layers and its MTP head are not supported (the bridge refuses MoE
    layers; `mtp.*` checkpoint tensors are ignored).

Extension point. `MIXERS` maps an HF model_type to a factory `(hf_config, layer_idx) -> Mixer`. To
wrap another HF module, add an entry here and a `bridge.FAMILIES` entry whose `mixers` names the HF
attribute per layer type (e.g. from a --custom-model-provider-path module, before the backend is
built); `model.layer_spec` then wraps every layer of that model type.

megatron-core is imported only inside HFMixer's methods, so the packing logic and the factories
are tested on CPU without it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

MixerCall = Callable[[Tensor, Tensor], Tensor]  # (x [1, L, H], position_ids [1, L]) -> [1, L, H]


@dataclass
class Mixer:
    module: nn.Module  # registered under the wrapper as `hf`: its parameter names are the checkpoint's
    call: MixerCall  # how to run it on one sequence


def qwen3_next_mixer(hf_config: Any, layer_idx: int) -> Mixer:
    """Qwen3-Next layer `layer_idx`: Qwen3NextGatedDeltaNet or Qwen3NextAttention, called as
    Qwen3NextDecoderLayer calls them without a cache or padding."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    if hf_config.layer_types[layer_idx] == "linear_attention":
        gdn = hf.Qwen3NextGatedDeltaNet(hf_config, layer_idx)
        return Mixer(gdn, lambda x, pos: gdn(x))
    attn = hf.Qwen3NextAttention(hf_config, layer_idx)
    rotary = hf.Qwen3NextRotaryEmbedding(hf_config)  # captured, not registered: stays fp32 under Float16Module
    return Mixer(attn, lambda x, pos: attn(x, position_embeddings=rotary(x, pos), attention_mask=None)[0])


MIXERS: dict[str, Callable[[Any, int], Mixer]] = {"qwen3_next": qwen3_next_mixer}


def mixer_config(hf_config: Any) -> Any:
    """A copy of the HF config for standalone modules: the attention interface must be named
    (None would fall back to eager attention, which is not causal without a mask); SDPA with no
    mask is causal."""
    cfg = copy.deepcopy(hf_config)
    cfg._attn_implementation = "sdpa"
    return cfg


def run_packed(call: MixerCall, x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """x [T, H] packed sequences with boundaries cu_seqlens [n+1] -> [T, H]: `call` on each
    sequence alone, positions 0..L-1."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != x.shape[0]:
        raise ValueError(f"cu_seqlens {bounds[0]}..{bounds[-1]} does not cover the {x.shape[0]} packed tokens")
    outs = [call(x[s:e][None], torch.arange(e - s, device=x.device)[None])[0]
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs)


class HFMixer(nn.Module):
    """megatron `self_attention` submodule running an HF token mixer (see the module docstring).
    Built by megatron's TransformerLayer via the ModuleSpec from `wrap_layer_specs`."""

    def __init__(self, config, layer_number: int, hf_config: Any = None,
                 factory: Callable[[Any, int], Mixer] | None = None, pg_collection=None, **_: Any):
        super().__init__()
        if config.context_parallel_size > 1:
            raise ValueError(f"HF-wrapped layers ({hf_config.model_type}) do not support context parallelism: "
                             "use --context-parallel-size 1")
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = getattr(pg_collection, "tp", None)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        with device:  # build where it runs; every weight is then loaded from the checkpoint
            mixer = factory(hf_config, layer_number - 1)  # megatron's layer_number: global, 1-based
        self.hf = mixer.module
        self.call = mixer.call

    def forward(self, hidden_states: Tensor, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, **_: Any):
        """hidden_states [T, 1, H] (or [T/tp, 1, H] under sequence parallelism) -> (out of the same
        shape, None): SelfAttention's (output, bias) convention, without a bias."""
        cu = getattr(packed_seq_params, "cu_seqlens_q", None)
        if cu is None or hidden_states.shape[1] != 1:
            raise ValueError("HF-wrapped layers need packed THD inputs ([T, 1, H] with cu_seqlens_q), as polyrl's "
                             "megatron backend builds them")
        x = hidden_states
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # every TP rank runs the whole mixer, so the backward only splits (no reduce-scatter)
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        out = run_packed(self.call, x[:, 0], cu)[:, None]
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

            out = scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return out, None


def wrap_layer_specs(layer_specs: list, hf_config: Any) -> list:
    """Point every layer spec's `self_attention` at HFMixer; MIXERS[model_type] picks the HF
    module per layer (Qwen3-Next: by layer_types)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    factory = MIXERS.get(hf_config.model_type)
    if factory is None:
        raise ValueError(f"no HF mixer registered for model_type {hf_config.model_type!r}; "
                         f"hf_wrap.MIXERS has {sorted(MIXERS)}")
    spec = ModuleSpec(module=HFMixer, params=dict(hf_config=mixer_config(hf_config), factory=factory))
    return [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, self_attention=spec))
            for s in layer_specs]
