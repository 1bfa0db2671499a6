"""Vision-language models on the Megatron backend: the language model through the bridge, the HF vision tower as a
plain module on the first pipeline stage.

A Qwen2.5-VL / Qwen3-VL checkpoint holds a decoder (Qwen2 / Qwen3 with q/k norms; `model.language_model.*`, or
`model.*` in the older layout), the vision tower (`model.visual.*` / `visual.*`) and `lm_head`. The decoder is built by
the bridge from `text_config(cfg)` (the text config under the decoder family's model type) and reads the checkpoint
through `TextCheckpoint`, which shows it the text names a *ForCausalLM would have. The vision tower is HF's own module,
attached to each first-stage GPTModel as `vision_model` (so DDP, the optimizer, the grad norm and the named parameters
include it), loaded from and exported to its HF names one to one (Qwen3-VL's deepstack mergers included). The forward
embeds the tokens with megatron's embedding, scatters the vision tower's merged image features into the image-pad rows
(HF's masked_scatter, same order) and hands the result to GPTModel as `decoder_input`; RoPE tables come from the HF
model's multimodal rotary frequencies at each token's 3-D (time, height, width) position, computed per sample by the
model's own get_rope_index (polyrl.multimodal.mrope_positions), with Qwen2-VL's contiguous or Qwen3-VL's interleaved
assignment of frequencies to the three axes (megatron's MultimodalRotaryEmbedding has only the contiguous one).

Qwen3-VL's deepstack: the vision tower's features from some of its blocks (deepstack_visual_indexes) are added to the
decoder's hidden states at the image-pad rows after decoder layers 0 .. k-1 (HF's _deepstack_process). Here forward
hooks on those TransformerLayers of the first stage add them (`attach_deepstack`), reading the features the same
micro-batch's `decoder_input` left on the chunk.

Tensor, pipeline, context and expert parallelism with images are refused (unproven: the merge assumes this rank holds
every token of its micro-batch, whole over TP, and the deepstack layers on the stage that runs the tower), and so are
Megatron-FSDP (its parameter gathering around a directly called non-megatron module is unproven), LoRA, a critic and an
OPD teacher.

No megatron import here: the name mapping, the merge, the deepstack addition and the positions are tested on CPU with
plain torch.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

PREFIX = "vision_model."  # the HF vision tower's attribute on a first-stage GPTModel
# HF VL model_type -> the bridge family of its decoder
DECODER_FAMILY = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}


def check_supported(cfg: Any, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, vpp: int | None = None,
                    lora: bool = False, role: str = "actor", custom_provider: bool = False, teacher: bool = False,
                    megatron_fsdp: bool = False) -> None:
    """Raise ValueError naming what a vision-language model cannot do on the Megatron backend yet."""
    mt = getattr(cfg, "model_type", None)
    if mt not in DECODER_FAMILY:
        raise ValueError(f"--train-backend megatron: vision-language model_type {mt!r} is not supported; supported: "
                         f"{sorted(DECODER_FAMILY)}; use --train-backend fsdp")
    bad = [f"{flag} {v}" for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                                         ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep)) if v > 1]
    if vpp:
        bad.append("--num-layers-per-virtual-pipeline-stage")
    if lora:
        bad.append("--lora-rank")
    if role != "actor":
        bad.append("a critic (--advantage-estimator gae)")
    if custom_provider:
        bad.append("--custom-model-provider-path")
    if teacher:
        bad.append("--opd-teacher-load")
    if megatron_fsdp:
        bad.append("--use-megatron-fsdp")
    if bad:
        raise ValueError(f"--train-backend megatron with a vision-language model ({mt}) runs on one model-parallel "
                         f"rank with megatron's DDP, without LoRA, a critic or a teacher; {', '.join(bad)} is not "
                         "supported with it yet (use --train-backend fsdp for that)")


def text_config(cfg: Any) -> Any:
    """The decoder's config as the bridge reads it: text_config under the decoder family's model type, with the
    top-level tie_word_embeddings (where Qwen-VL keeps it)."""
    t = copy.deepcopy(cfg.text_config)
    t.model_type = DECODER_FAMILY[cfg.model_type]
    t.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
    return t


# ---------------------------------------------------------------------------------------------
# names


def _text_candidates(name: str) -> list[str]:
    if name.startswith("model."):
        return ["model.language_model." + name[len("model."):], name]
    return [name]


class TextCheckpoint(Mapping):
    """An HF VL checkpoint seen as its decoder's causal-LM checkpoint: `model.X` reads `model.language_model.X`
    (transformers >= 5 layout) or `model.X` (the older one); the vision tower's tensors are not in it."""

    def __init__(self, hf: Mapping[str, Tensor]):
        self.hf = hf

    def _find(self, name: str) -> str | None:
        if is_vision_name(name):
            return None
        return next((c for c in _text_candidates(name) if c in self.hf), None)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def __getitem__(self, name: str) -> Tensor:
        found = self._find(name)
        if found is None:
            raise KeyError(name)
        return self.hf[found]

    def __iter__(self) -> Iterator[str]:
        for n in self.hf:
            if is_vision_name(n):
                continue
            yield "model." + n[len("model.language_model."):] if n.startswith("model.language_model.") else n

    def __len__(self) -> int:
        return sum(1 for _ in self)


def is_vision_name(hf_name: str) -> bool:
    return hf_name.startswith(("model.visual.", "visual."))


def vision_state(hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The vision tower's tensors of an HF checkpoint, under the tower's own parameter names."""
    out = {}
    for n in hf:
        if n.startswith("model.visual."):
            out[n[len("model.visual."):]] = hf[n]
        elif n.startswith("visual."):
            out[n[len("visual."):]] = hf[n]
    return out


def hf_text_name(name: str) -> str:
    """A bridge-exported decoder name as the HF VL model holds it in memory (transformers >= 5)."""
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def export_hf(named: Iterable[tuple[str, Tensor]], text_to_hf) -> Iterator[tuple[str, Tensor]]:
    """HF VL names from megatron (name, tensor) pairs: decoder tensors through `text_to_hf` (the bridge's mcore_to_hf
    over the text config) renamed to the VL layout, the vision tower's as `model.visual.*`, each as soon as it comes."""
    vision: list[tuple[str, Tensor]] = []

    def text():
        for n, t in named:
            n = _strip(n)
            if n.startswith(PREFIX):
                vision.append(("model.visual." + n[len(PREFIX):], t))
            else:
                yield n, t

    for n, t in text_to_hf(text()):
        while vision:
            yield vision.pop(0)
        yield hf_text_name(n), t
    yield from vision


# ---------------------------------------------------------------------------------------------
# the vision tower as a module


def build_tower(cfg: Any, dtype: torch.dtype, device) -> torch.nn.Module:
    """The HF vision tower of a VL config (its own class, SDPA attention), uninitialised weights are overwritten by
    `load_tower`."""
    mod = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    named = type(cfg.vision_config).__name__.removesuffix("Config") + "Model"  # Qwen3VLVisionModel
    cls = getattr(mod, named, None) or next(getattr(mod, n) for n in dir(mod)
                                            if n.endswith("VisionTransformerPretrainedModel"))
    vcfg = copy.deepcopy(cfg.vision_config)
    vcfg._attn_implementation = "sdpa"
    with torch.device(device):
        tower = cls._from_config(vcfg, dtype=dtype)
    return tower


@torch.no_grad()
def load_tower(tower: torch.nn.Module, hf: Mapping[str, Tensor]) -> None:
    sd = vision_state(hf)
    own = dict(tower.named_parameters())
    missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if missing or extra:
        raise ValueError(f"HF vision tower -> megatron: missing {missing[:8]}, unexpected {extra[:8]}")
    for n, p in own.items():
        if p.shape != sd[n].shape:
            raise ValueError(f"{PREFIX}{n}: module {tuple(p.shape)} vs checkpoint {tuple(sd[n].shape)}")
        p.copy_(sd[n])


def vision_outputs(tower: torch.nn.Module, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
    """([image tokens, hidden] merged features of all images, in order (HF get_image_features' pooler output),
    Qwen3-VL's deepstack features: one [image tokens, hidden] per deepstack layer, [] for towers without them)."""
    first = next(tower.parameters())
    out = tower(pixel_values.to(first.dtype), grid_thw=grid_thw)
    if isinstance(out, tuple):  # transformers 4's Qwen3-VL tower: (merged, deepstack list)
        return out[0], list(out[1]) if len(out) > 1 else []
    if hasattr(out, "pooler_output"):
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])
    return out, []


def image_features(tower: torch.nn.Module, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
    """[image tokens, hidden] merged features of all images, in order (HF get_image_features' pooler output)."""
    return vision_outputs(tower, pixel_values, grid_thw)[0]


def idle_term(tower: torch.nn.Module) -> Tensor:
    """0 times the tower's outputs (merged and deepstack features) on the smallest image it takes
    (polyrl.multimodal.blank_image): a training micro-batch without images still reaches every vision parameter in
    the backward (with zero gradient), so megatron's DDP sees the same parameters ready whichever micro-batch comes
    last (overlap_grad_reduce waits for all of a bucket's). Adding it changes no value (x + 0.0 == x)."""
    from polyrl.multimodal import blank_image, zero_of
    return zero_of(vision_outputs(tower, *blank_image(tower)))


def merge_embeddings(emb: Tensor, ids: Tensor, feats: Tensor, image_token_id: int) -> Tensor:
    """emb [T, 1, H] (megatron's embedding output) with the image-pad rows replaced by feats [N, H], in order, as
    HF's masked_scatter does; N must be the number of pads."""
    mask = ids.reshape(-1) == image_token_id
    n = int(mask.sum())
    if n != feats.shape[0]:
        raise ValueError(f"the micro-batch has {n} image tokens but its images make {feats.shape[0]} features")
    return emb.masked_scatter(mask[:, None, None].expand_as(emb), feats.to(emb.dtype))


# ---------------------------------------------------------------------------------------------
# Qwen3-VL's deepstack


def add_deepstack(hidden: Tensor, mask: Tensor, embeds: Tensor) -> Tensor:
    """hidden [T, 1, H] (megatron's; or HF's [1, T, H]) with embeds [N, H] added to the rows where mask [T] is set, in
    order: HF's _deepstack_process (the sum in the hidden states' dtype, the other rows untouched), out of place."""
    m = mask.reshape(hidden.shape[:-1])[..., None].expand_as(hidden)
    added = hidden[m].view(-1, hidden.shape[-1]) + embeds.to(hidden.dtype)
    return hidden.masked_scatter(m, added)


class DeepstackState:
    """The deepstack features of the micro-batch a first-stage chunk is running: `mask` [T] (its image-pad rows) and
    one [N, H] tensor per deepstack layer, or mask None (no images: nothing is added)."""

    def __init__(self):
        self.mask: Tensor | None = None
        self.embeds: list[Tensor] = []


DEEPSTACK = "deepstack_state"  # a first-stage GPTModel's DeepstackState (a plain attribute, not a module)


def deepstack_layers(vl_config: Any) -> int:
    return len(getattr(vl_config.vision_config, "deepstack_visual_indexes", None) or [])


def attach_deepstack(chunk: torch.nn.Module, vl_config: Any) -> None:
    """Forward hooks on the chunk's first deepstack_layers(vl_config) TransformerLayers adding the micro-batch's
    deepstack features to their output hidden states (HF adds feature i after decoder layer i); the last of them lets
    go of the features (autograd keeps what the backward needs). No-op for towers without deepstack."""
    k = deepstack_layers(vl_config)
    if not k:
        return
    if getattr(chunk.config, "recompute_granularity", None) == "full":
        # the recomputed layers would backpropagate into the tower's graph inside the checkpoint, then again outside
        raise ValueError("--recompute-granularity full (or --gradient-checkpointing) with Qwen3-VL on --train-backend "
                         "megatron: the deepstack features added inside recomputed layers are not supported; use "
                         "--recompute-granularity selective or none, or --train-backend fsdp")
    state = DeepstackState()
    setattr(chunk, DEEPSTACK, state)
    layers = chunk.decoder.layers
    last = min(k, len(layers)) - 1
    for i in range(last + 1):
        def hook(module, args, output, i=i):
            if state.mask is None:
                return None
            h, *rest = output if isinstance(output, tuple) else (output,)
            h = add_deepstack(h, state.mask, state.embeds[i])
            if i == last:
                state.mask, state.embeds = None, []
            return (h, *rest) if isinstance(output, tuple) else h
        layers[i].register_forward_hook(hook)


def decoder_input(chunk: torch.nn.Module, emb: Tensor, ids: Tensor, vis: Mapping[str, Tensor],
                  image_token_id: int) -> Tensor:
    """A first-stage chunk's decoder input: megatron's token embedding emb [T, 1, H] with the vision tower's merged
    features in the image-pad rows; its deepstack features (Qwen3-VL) are left on the chunk for the layer hooks."""
    tower = chunk.vision_model
    state = getattr(chunk, DEEPSTACK, None)
    if state is not None:
        state.mask, state.embeds = None, []
    if "pixel_values" not in vis:
        if torch.is_grad_enabled() and any(p.requires_grad for p in tower.parameters()):
            emb = emb + idle_term(tower).to(emb.dtype)
        return emb
    feats, deep = vision_outputs(tower, vis["pixel_values"], vis["image_grid_thw"])
    emb = merge_embeddings(emb, ids, feats, image_token_id)
    if state is not None:
        n = len(chunk.decoder.layers)
        state.mask, state.embeds = ids.reshape(-1) == image_token_id, deep[:n]
        if deep[n:] and torch.is_grad_enabled():  # features of layers the model lacks (HF drops them): zero gradient
            emb = emb + 0.0 * sum(d.float().sum() for d in deep[n:]).to(emb.dtype)
    return emb


# ---------------------------------------------------------------------------------------------
# multimodal RoPE


def packed_positions(per_sample: list[Tensor], cu_seqlens: Tensor) -> Tensor:
    """[3, T] positions of a packed micro-batch (cp 1): each sample's own [3, L_i] positions at its offset; the padding
    after a sample continues one past its largest position (it attends only to itself and earlier tokens of its
    sequence, and nothing reads its output)."""
    offs = [int(x) for x in cu_seqlens.cpu()]
    out = torch.zeros(3, offs[-1], dtype=torch.long)
    for k in range(len(offs) - 1):
        n = offs[k + 1] - offs[k]
        p = per_sample[k] if k < len(per_sample) else torch.zeros(3, 0, dtype=torch.long)
        L = p.shape[1]
        out[:, offs[k]:offs[k] + L] = p.cpu()
        start = int(p.max()) + 1 if L else 0
        out[:, offs[k] + L:offs[k + 1]] = torch.arange(start, start + n - L)
    return out


class MropeRope:
    """RoPE tables of a packed micro-batch at 3-D positions [3, T] (or 1-D [T]: text, the same on all three rows):
    the HF rotary module's inverse frequencies and attention scaling, each rotary frequency taken from the time,
    height or width position by `mrope_section`: in contiguous bands (Qwen2-VL's layout, which transformers applies in
    the rotary module or in the attention depending on its version) or interleaved (Qwen3-VL's `mrope_interleaved`:
    frequency j from height if j % 3 == 1 and j < 3 * section[1], from width if j % 3 == 2 and j < 3 * section[2],
    else from time). Done here so the tables do not depend on the transformers version."""

    def __init__(self, vl_config: Any, dtype: torch.dtype, device):
        mt = vl_config.model_type
        mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
        t = vl_config.text_config
        names = [type(c).__name__.removesuffix("Config") + "RotaryEmbedding" for c in (vl_config, t)]
        cls = next(getattr(mod, n) for n in names if hasattr(mod, n))  # Qwen2_5_VLRotaryEmbedding, Qwen3VLText...
        rotary = cls(t)
        self.inv_freq = rotary.inv_freq.float().to(device)  # fp32, outside the module tree
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))
        params = dict(getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None) or {})
        self.section = list(params.get("mrope_section") or getattr(rotary, "mrope_section", None) or [16, 24, 24])
        if sum(self.section) != self.inv_freq.numel():
            raise ValueError(f"mrope_section {self.section} does not cover the {self.inv_freq.numel()} rotary "
                             "frequencies")
        # HF's Qwen3-VL rotary interleaves whatever the config says; the flag names it for other models
        self.interleaved = mt in ("qwen3_vl", "qwen3_vl_moe") or bool(params.get("mrope_interleaved"))
        self.dtype = dtype

    def frequencies(self, position_ids: Tensor) -> Tensor:
        """[T, r/2] angles: each frequency times the position of its axis."""
        pos = position_ids if position_ids.dim() == 2 else position_ids[None].expand(3, -1)
        freqs = pos[..., None].float() * self.inv_freq.to(pos.device)  # [3, T, r/2]
        if not self.interleaved:
            return torch.cat([b[i % 3] for i, b in enumerate(freqs.split(self.section, dim=-1))], dim=-1)
        f = freqs[0].clone()
        for axis in (1, 2):
            idx = slice(axis, 3 * self.section[axis], 3)
            f[..., idx] = freqs[axis, ..., idx]
        return f

    def tables(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        f = self.frequencies(position_ids)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos[:, None, :].to(self.dtype), sin[:, None, :].to(self.dtype)


def rope_index_model(vl_config: Any):
    """The HF VL base model on the meta device: get_rope_index reads only its config (no weights are made)."""
    from transformers import AutoModel
    with torch.device("meta"):
        return AutoModel.from_config(vl_config)
