"""Vision-language models on the Megatron backend: the language model through the bridge, the HF vision tower as a
plain module on the first pipeline stage.

A Qwen2.5-VL checkpoint holds a Qwen2 decoder (`model.language_model.*`, or `model.*` in the older layout), the vision
tower (`model.visual.*` / `visual.*`) and `lm_head`. The decoder is built by the bridge from `text_config(cfg)` (the
text config under the decoder family's model type) and reads the checkpoint through `TextCheckpoint`, which shows it
the text names a Qwen2ForCausalLM would have. The vision tower is HF's own module, attached to each first-stage GPTModel
as `vision_model` (so DDP, the optimizer, the grad norm and the named parameters include it), loaded from and exported to
its HF names one to one. The forward embeds the tokens with megatron's embedding, scatters the vision tower's merged
image features into the image-pad rows (HF's masked_scatter, same order) and hands the result to GPTModel as
`decoder_input`; RoPE tables come from the HF model's multimodal rotary module at each token's 3-D (time, height,
width) position, computed per sample by the model's own get_rope_index (polyrl.multimodal.mrope_positions).

Qwen3-VL is refused: its deepstack features are added to the hidden states of the first decoder layers, which would
need hooks inside megatron's TransformerBlock. Tensor, pipeline, context and expert parallelism with images are
refused too (unproven: the merge assumes this rank holds every token of its micro-batch, whole over TP), and so are
Megatron-FSDP (its parameter gathering around a directly called non-megatron module is unproven), LoRA, a critic and an
OPD teacher.

No megatron import here: the name mapping, the merge and the positions are tested on CPU with plain torch.
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
DECODER_FAMILY = {"qwen2_5_vl": "qwen2"}


def is_vision_language(cfg: Any) -> bool:
    return getattr(cfg, "image_token_id", None) is not None and getattr(cfg, "vision_config", None) is not None


def check_supported(cfg: Any, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, vpp: int | None = None,
                    lora: bool = False, role: str = "actor", custom_provider: bool = False, teacher: bool = False,
                    megatron_fsdp: bool = False) -> None:
    """Raise ValueError naming what a vision-language model cannot do on the Megatron backend yet."""
    mt = getattr(cfg, "model_type", None)
    if mt not in DECODER_FAMILY:
        why = (" (its deepstack visual features feed the first decoder layers' hidden states, which megatron's "
               "TransformerBlock has no hook for)" if mt == "qwen3_vl" else "")
        raise ValueError(f"--train-backend megatron: vision-language model_type {mt!r} is not supported{why}; supported: "
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
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("VisionTransformerPretrainedModel"))
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


def image_features(tower: torch.nn.Module, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
    """[image tokens, hidden] merged features of all images, in order (HF get_image_features' pooler output)."""
    first = next(tower.parameters())
    out = tower(pixel_values.to(first.dtype), grid_thw=grid_thw)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    return feats


def idle_term(tower: torch.nn.Module) -> Tensor:
    """0 times the tower's output on the smallest image it takes (one merged token of zero pixels): a training
    micro-batch without images still reaches every vision parameter in the backward (with zero gradient), so megatron's
    DDP sees the same parameters ready whichever micro-batch comes last (overlap_grad_reduce waits for all of a
    bucket's). Adding it changes no value (x + 0.0 == x)."""
    merge = int(tower.spatial_merge_size)
    w = tower.patch_embed.proj.weight
    pixels = torch.zeros(merge * merge, w[0].numel(), dtype=w.dtype, device=w.device)
    grid = torch.tensor([[1, merge, merge]], device=w.device)
    return 0.0 * image_features(tower, pixels, grid).float().sum()


def merge_embeddings(emb: Tensor, ids: Tensor, feats: Tensor, image_token_id: int) -> Tensor:
    """emb [T, 1, H] (megatron's embedding output) with the image-pad rows replaced by feats [N, H], in order, as
    HF's masked_scatter does; N must be the number of pads."""
    mask = ids.reshape(-1) == image_token_id
    n = int(mask.sum())
    if n != feats.shape[0]:
        raise ValueError(f"the micro-batch has {n} image tokens but its images make {feats.shape[0]} features")
    return emb.masked_scatter(mask[:, None, None].expand_as(emb), feats.to(emb.dtype))


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
    the HF rotary module's inverse frequencies and attention scaling, each rotary half's frequency bands taken from
    the time, height or width position by `mrope_section` (Qwen2-VL's layout, which transformers applies in the
    rotary module or in the attention depending on its version; done here so the tables do not depend on that)."""

    def __init__(self, vl_config: Any, dtype: torch.dtype, device):
        mt = vl_config.model_type
        mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
        cls = getattr(mod, type(vl_config).__name__.removesuffix("Config") + "RotaryEmbedding")
        rotary = cls(vl_config.text_config)
        self.inv_freq = rotary.inv_freq.float().to(device)  # fp32, outside the module tree
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))
        t = vl_config.text_config
        params = dict(getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None) or {})
        self.section = list(params.get("mrope_section") or getattr(rotary, "mrope_section", None) or [16, 24, 24])
        if sum(self.section) != self.inv_freq.numel():
            raise ValueError(f"mrope_section {self.section} does not cover the {self.inv_freq.numel()} rotary "
                             "frequencies")
        if params.get("mrope_interleaved"):
            raise ValueError("interleaved mrope (Qwen3-VL) is not supported on the Megatron backend")
        self.dtype = dtype

    def tables(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        pos = position_ids if position_ids.dim() == 2 else position_ids[None].expand(3, -1)
        freqs = pos[..., None].float() * self.inv_freq.to(pos.device)  # [3, T, r/2]
        bands = freqs.split(self.section, dim=-1)
        f = torch.cat([b[i % 3] for i, b in enumerate(bands)], dim=-1)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos[:, None, :].to(self.dtype), sin[:, None, :].to(self.dtype)


def rope_index_model(vl_config: Any):
    """The HF VL base model on the meta device: get_rope_index reads only its config (no weights are made)."""
    from transformers import AutoModel
    with torch.device("meta"):
        return AutoModel.from_config(vl_config)
