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

Tensor parallelism. The gated DeltaNet is split over TP by heads (`tp_gated_deltanet`): each rank
builds the HF module for its nk/tp key heads and nv/tp value heads (a config with the head counts
divided), holds those heads' rows of in_proj_qkvz / in_proj_ba, channels of conv1d, entries of
A_log / dt_bias and columns of out_proj (bridge.GDN_TP slices them; HF groups q, k, v, z and b, a
per key head, so a contiguous group range is a contiguous row range), and runs HF's own forward on
them. Its out_proj is then row parallel: the ranks' partial outputs are summed by an all-reduce
(whose backward passes the gradient through), the input's gradient is summed the same way, and so
is the gated norm's weight gradient (one weight shared by every head). Wrapped full attention stays
replicated (every TP rank runs it whole). With --sequence-parallel the sequence shards are gathered
in and scattered out, with the backward megatron uses for duplicated compute.

Limits.
  - Full attention's compute and memory do not shrink with TP (replicated); the DeltaNet's do, and
    TP must divide linear_num_key_heads.
  - Context parallelism is refused: the recurrent state runs along whole sequences.
  - Speed: one HF call per packed sequence (a Python loop); the gated delta rule uses HF's torch
    chunked fallback unless flash-linear-attention is installed. Right for proofs and small models,
    slow for long-context training at scale.
  - Qwen3.5 (text) wraps the same way (`qwen3_5_mixer`; its DeltaNet's unfused in_proj_qkv splits like conv1d);
    GPT-OSS's attention (`gpt_oss_mixer`) runs eager with an explicit causal / sliding mask (its sinks need it).
    MiMo-V2-Flash's attention (`mimo_v2_flash_mixer`) runs the same way (sinks on its sliding layers).
  - Qwen3-Next's and Qwen3.5's MTP heads are not supported (`mtp.*` checkpoint tensors are skipped with a warning
    naming them: bridge.hf_to_mcore). Qwen3-Next's sparse MoE
    layers are megatron's own MoELayer with a gated shared expert (bridge.py), not wrapped.

Extension point. `MIXERS` maps an HF model_type to a factory `(hf_config, layer_idx, tp_group) -> Mixer`
(tp_group None: replicate the module; else a Mixer that splits itself over that group). To
wrap another HF module, add an entry here and a `bridge.FAMILIES` entry whose `mixers` names the HF
attribute per layer type (e.g. from a --custom-model-provider-path module, before the backend is
built); `model.layer_spec` then wraps every layer of that model type.

megatron-core is imported only inside HFMixer's methods, so the packing logic and the factories
are tested on CPU without it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from polyrl.backends.megatron import bridge

MixerCall = Callable[[Tensor, Tensor], Tensor]  # (x [1, L, H], position_ids [1, L]) -> [1, L, H]


@dataclass
class Mixer:
    module: nn.Module  # registered under the wrapper as `hf`: its parameter names are the checkpoint's
    call: MixerCall  # how to run it on one sequence
    tp_dims: dict[str, int] = field(default_factory=dict)  # parameter -> dim split over TP (empty: replicated)


class _CopyToTP(torch.autograd.Function):
    """Identity; the backward sums the gradient over the group (each rank's heads saw the whole
    input, so each holds only its heads' share of its gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # bounded by the process group's timeout
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sum over the group (row-parallel output: each rank holds its heads' partial out_proj); the
    backward passes the (replicated) gradient through unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def gdn_local_config(hf_config: Any, tp_size: int) -> Any:
    """Copy of a Qwen3-Next config whose gated DeltaNet has this TP rank's share of the heads."""
    nk, nv = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    if nk % tp_size:
        raise ValueError(f"--tensor-model-parallel-size {tp_size} must divide the gated DeltaNet's "
                         f"linear_num_key_heads {nk} (its heads are split over TP)")
    cfg = copy.deepcopy(hf_config)
    cfg.linear_num_key_heads, cfg.linear_num_value_heads = nk // tp_size, nv // tp_size
    return cfg


def tp_gated_deltanet(hf_config: Any, layer_idx: int, group, cls: Any = None) -> Mixer:
    """This rank's heads of Qwen3-Next's (or `cls`: Qwen3.5's) gated DeltaNet (module docstring, "Tensor
    parallelism"): x [1, L, H] replicated over `group` -> [1, L, H] replicated, equal to the unsplit module. Load
    it with `bridge.shard_for_tp(name, full, rank, size, hf_config)` of each full tensor."""
    if cls is None:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as cls

    gdn = cls(gdn_local_config(hf_config, dist.get_world_size(group)), layer_idx)
    own = dict(gdn.named_parameters())

    def call(x: Tensor, pos: Tensor) -> Tensor:
        x = _CopyToTP.apply(x, group)
        norm_w = _CopyToTP.apply(gdn.norm.weight, group)  # one weight for all heads: its grad sums over ranks
        partial = torch.func.functional_call(gdn, {"norm.weight": norm_w}, (x,))
        return _ReduceFromTP.apply(partial, group)

    return Mixer(gdn, call, {n: int(kind == "row") for n, kind in bridge.GDN_TP.items() if n in own})


def qwen3_next_mixer(hf_config: Any, layer_idx: int, tp_group=None) -> Mixer:
    """Qwen3-Next layer `layer_idx`: Qwen3NextGatedDeltaNet (split over `tp_group` when it has
    more than one rank) or Qwen3NextAttention (replicated), called as Qwen3NextDecoderLayer calls
    them without a cache or padding."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    if hf_config.layer_types[layer_idx] == "linear_attention":
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            return tp_gated_deltanet(hf_config, layer_idx, tp_group)
        gdn = hf.Qwen3NextGatedDeltaNet(hf_config, layer_idx)
        return Mixer(gdn, lambda x, pos: gdn(x))
    attn = hf.Qwen3NextAttention(hf_config, layer_idx)
    rotary = hf.Qwen3NextRotaryEmbedding(hf_config)  # captured, not registered: stays fp32 under Float16Module
    return Mixer(attn, lambda x, pos: attn(x, position_embeddings=rotary(x, pos), attention_mask=None)[0])


def qwen3_5_mixer(hf_config: Any, layer_idx: int, tp_group=None) -> Mixer:
    """Qwen3.5 (text) layer `layer_idx`: Qwen3_5GatedDeltaNet (its projections unfused; split over `tp_group` like
    Qwen3-Next's) or Qwen3_5Attention (replicated; the text rotary module gives every mrope section the same position
    ids, so its interleaved sections are plain partial RoPE). Parity with FSDP: tests/backends/megatron/test_qwen3_5_gpu.py."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    if hf_config.layer_types[layer_idx] == "linear_attention":
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            return tp_gated_deltanet(hf_config, layer_idx, tp_group, hf.Qwen3_5GatedDeltaNet)
        gdn = hf.Qwen3_5GatedDeltaNet(hf_config, layer_idx)
        return Mixer(gdn, lambda x, pos: gdn(x))
    attn = hf.Qwen3_5Attention(hf_config, layer_idx)
    rotary = hf.Qwen3_5TextRotaryEmbedding(hf_config)  # text positions: every multimodal section gets the same ids
    # the [3, batch, n] form, which every transformers release takes (some index it without expanding [batch, n])
    return Mixer(attn, lambda x, pos: attn(x, position_embeddings=rotary(x, pos[None].expand(3, -1, -1)),
                                           attention_mask=None)[0])


def causal_mask(x: Tensor, window: int | None) -> Tensor:
    """The additive [1, 1, n, n] causal mask of x [1, n, h] for eager attention with sinks (SDPA has none), limited to
    the last `window` positions, the query's own included, as HF's sliding layers mask."""
    n = x.shape[1]
    i = torch.arange(n, device=x.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    return torch.zeros(n, n, dtype=x.dtype, device=x.device).masked_fill(~allowed, torch.finfo(x.dtype).min)[None, None]


def gpt_oss_mixer(hf_config: Any, layer_idx: int, tp_group=None) -> Mixer:
    """GPT-OSS layer `layer_idx`: GptOssAttention (learned sinks; sliding window on its sliding layers) replicated,
    run with eager attention and an explicit causal (+ window) mask: SDPA has no sinks. YaRN: the HF rotary module's
    own cos / sin. The layer's MoE half is megatron-core's MoELayer (gpt_oss.py)."""
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    cfg = copy.deepcopy(hf_config)
    cfg._attn_implementation = "eager"
    attn = hf.GptOssAttention(cfg, layer_idx)
    rotary = hf.GptOssRotaryEmbedding(cfg)
    window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding_attention" else None

    def call(x: Tensor, pos: Tensor) -> Tensor:
        return attn(x, position_embeddings=rotary(x, pos), attention_mask=causal_mask(x, window))[0]

    return Mixer(attn, call)


MIXERS: dict[str, Callable[[Any, int, Any], Mixer]] = {"qwen3_next": qwen3_next_mixer, "qwen3_5_text": qwen3_5_mixer,
                                                      "gpt_oss": gpt_oss_mixer}


def mimo_v2_flash_mixer(hf_config: Any, layer_idx: int, tp_group=None) -> Mixer:
    """MiMo-V2-Flash layer `layer_idx`: MiMoV2FlashAttention replicated (q / k heads wider than v heads, values scaled
    by attention_value_scale; on sliding layers twice the k / v heads and learned sinks), run with eager attention and
    an explicit causal (+ window) mask as GPT-OSS's: SDPA has no sinks. Partial RoPE from the HF rotary module with the
    layer type's theta. The layer's MLP is megatron-core's (dense, or the sigmoid-routed MoELayer: bridge.py)."""
    from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as hf

    cfg = copy.deepcopy(hf_config)
    cfg._attn_implementation = "eager"
    attn = hf.MiMoV2FlashAttention(cfg, layer_idx)
    rotary = hf.MiMoV2FlashRotaryEmbedding(cfg)  # captured, not registered: stays fp32 under Float16Module
    kind = cfg.layer_types[layer_idx]
    window = cfg.sliding_window if kind == "sliding_attention" else None

    def call(x: Tensor, pos: Tensor) -> Tensor:
        return attn(x, position_embeddings=rotary(x, pos, kind), attention_mask=causal_mask(x, window))[0]

    return Mixer(attn, call)


MIXERS["mimo_v2_flash"] = mimo_v2_flash_mixer


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
                 factory: Callable[[Any, int, Any], Mixer] | None = None, pg_collection=None, **_: Any):
        super().__init__()
        if config.context_parallel_size > 1:
            raise ValueError(f"HF-wrapped layers ({hf_config.model_type}) do not support context parallelism: "
                             "use --context-parallel-size 1")
        self.sequence_parallel = config.sequence_parallel
        self.hf_config = hf_config
        self.tp_group = getattr(pg_collection, "tp", None)
        tp = getattr(config, "tensor_model_parallel_size", 1)
        if tp > 1 and self.tp_group is None:
            from megatron.core import parallel_state
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        with device:  # build where it runs; every weight is then loaded from the checkpoint
            # megatron's layer_number: global, 1-based
            mixer = factory(hf_config, layer_number - 1, self.tp_group if tp > 1 else None)
        self.hf = mixer.module
        self.call = mixer.call
        self.tp_dims = mixer.tp_dims
        params = dict(self.hf.named_parameters())
        for name, dim in self.tp_dims.items():
            # megatron's TP attributes: the grad norm then counts every rank's slice (not rank 0's only)
            p = params[name]
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1

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

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Distributed-checkpoint tensors: replicated ones as megatron's default writes them,
        TP-split ones (the gated DeltaNet) as slices of the full HF tensor along their TP dim, so a
        checkpoint reloads at another TP size. conv1d's rank slice is [q_r; k_r; v_r], three
        separate slices of the full [q; k; v]: a factory saves the three parts under their own keys
        and joins them again on load."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sd = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {f"hf.{n}": d for n, d in self.tp_dims.items()},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for part in ("conv1d.weight", "in_proj_qkv.weight"):  # [q; k; v] channels / rows (Qwen3.5's in_proj_qkv)
            self._qkv_parts(sd, f"{prefix}hf.{part}", part, sharded_offsets)
        return sd

    def _qkv_parts(self, sd: dict, key: str, part: str, sharded_offsets: tuple) -> None:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        if key in sd and getattr(self.hf_config, "linear_num_key_heads", None) is not None:
            # always three parts, split over TP or not: the checkpoint's keys must not depend on the TP size it was
            # saved at (a TP=2 checkpoint resumes at TP=1 and back)
            base = sd[key]
            split = part in self.tp_dims
            rank, size = (dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)) if split else (0, 1)
            tp_axis = ((len(sharded_offsets), rank, size),) if split else ()
            local = [n // size for n in bridge.gdn_conv_parts(self.hf_config)]

            def build(k, t, replica_id, flattened_range):
                return [ShardedTensor.from_rank_offsets(f"{k}.{name}", piece, *sharded_offsets, *tp_axis,
                                                        replica_id=replica_id, prepend_axis_num=len(sharded_offsets))
                        for name, piece in zip("qkv", t.split(local, dim=0))]

            sd[key] = ShardedTensorFactory(base.key, base.data, build, torch.cat, base.replica_id)


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
