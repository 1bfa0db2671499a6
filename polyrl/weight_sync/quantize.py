"""FP8 rollout (`--rollout-quantization fp8`): the HF-named weight stream with every linear weight quantized to FP8
E4M3 in 128x128 blocks, in the layout of HF block-FP8 checkpoints (Qwen3-*-FP8, DeepSeek-V3), which is what SGLang's
FP8 loader takes (python/sglang/srt/layers/quantization/fp8.py, Fp8LinearMethod.create_fp8_weight_ with
weight_block_size set):

  <module>.weight            float8_e4m3fn [out, in]
  <module>.weight_scale_inv  float32 [ceil(out / 128), ceil(in / 128)]; despite its name the dequantization multiplies:
                             w[i, j] ~= weight[i, j] * weight_scale_inv[i // 128, j // 128]

and the checkpoint's config.json says `quantization_config` = QUANTIZATION_CONFIG. MoE experts that the trainer holds
stacked (transformers 5: `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) leave per expert,
as FP8 checkpoints such as Qwen3-30B-A3B-FP8 store them and SGLang's FP8 MoE loader reads them
(python/sglang/srt/models/qwen3_moe.py Qwen3MoeForCausalLM.load_weights maps `experts.{e}.gate_proj.` / `up_proj.` /
`down_proj.` through FusedMoE.make_expert_params_mapping onto `experts.w13_` / `experts.w2_`, so each expert's
`weight_scale_inv` lands in the per-expert block grids that layers/quantization/fp8.py
Fp8MoEMethod.create_fp8_moe_weight_ allocates, w13 [E, 2 ceil(I/128), ceil(H/128)] and w2 [E, ceil(H/128), ceil(I/128)]):

  <prefix>.experts.{e}.gate_proj.weight / up_proj.weight   float8_e4m3fn [I, H], weight_scale_inv [ceil(I/128), ceil(H/128)]
  <prefix>.experts.{e}.down_proj.weight                    float8_e4m3fn [H, I], weight_scale_inv [ceil(H/128), ceil(I/128)]

Embeddings, norms, the LM head and MoE routers stay in the trainer's dtype (SGLang builds them as unquantized layers; the router's logits pick experts and
the LM head's pick tokens, where a rounding flips a choice rather than nudging a value).

A receiving engine that runs BF16/FP32 matmuls (the embedded engine, `polyrl serve`) dequantizes: it then samples from
the FP8-rounded model, which is the numerics an FP8 engine's weights have (its activations, quantized per token group
by an FP8 matmul kernel, are not emulated).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: the largest finite E4M3 value
BLOCK = (128, 128)  # (output rows, input columns) per scale, HF's weight_block_size
SCALE_SUFFIX = ".weight_scale_inv"
# what an FP8 checkpoint's config.json carries (HF's FineGrainedFP8Config; SGLang's Fp8Config.from_config reads it)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK)}
# modules kept unquantized whatever their shape: embeddings, LM head, norms, MoE routers (Qwen-MoE `mlp.gate`,
# `shared_expert_gate`; DeepSeek-V3 `mlp.gate`), vision/audio towers are not linear layers of the decoder
_KEEP_PARTS = ("embed_tokens", "lm_head", "norm", "shared_expert_gate")
# stacked experts (transformers 5's layout of the Qwen-MoE / Mixtral / DeepSeek families): the per-expert HF modules each
# stacked tensor holds, row blocks of equal height in this order. GPT-OSS stacks its experts under the same names
# transposed ([E, H, 2I], gate / up interleaved): FP8Transport is told not to split those (stacked_experts=False).
STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# model types whose stacked expert tensors are not STACKED_EXPERTS' layout (they pass through unquantized)
TRANSPOSED_EXPERTS = ("gpt_oss",)
_CHUNK_ELEMENTS = 1 << 26  # stacked experts are quantized a few experts at a time: at most 256 MiB of fp32 temporaries


def is_quantized_weight(name: str, t: torch.Tensor) -> bool:
    """Whether the HF-named tensor is a linear weight that FP8 rollout quantizes."""
    if not name.endswith(".weight") or t.dim() != 2 or not t.is_floating_point() or t.dtype == FP8_DTYPE:
        return False
    module = name[: -len(".weight")]
    last = module.rsplit(".", 1)[-1]
    if last == "gate" or any(p in module for p in _KEEP_PARTS):  # `gate` alone is a router; `gate_proj` is a linear
        return False
    return True


def stacked_expert_parts(name: str, t: torch.Tensor) -> list[str] | None:
    """For a stacked expert tensor (`<prefix>.experts.gate_up_proj` / `down_proj`, 3-D float), the HF module names of
    its parts in row order (`<prefix>.experts.{e}.gate_proj`, ...), expert by expert; None for any other tensor."""
    prefix, _, last = name.rpartition(".")
    if last not in STACKED_EXPERTS or not prefix.endswith(".experts") or t.dim() != 3 or not t.is_floating_point() \
            or t.dtype == FP8_DTYPE:
        return None
    return [f"{prefix}.{e}.{m}" for e in range(t.shape[0]) for m in STACKED_EXPERTS[last]]


def scale_shape(shape: tuple[int, int] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """Shape of a weight's weight_scale_inv: one scale per (partial) block, as SGLang allocates it."""
    out, inp = shape
    return (out + block[0] - 1) // block[0], (inp + block[1] - 1) // block[1]


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] (any float dtype, any device) -> (weight float8_e4m3fn [..., out, in], weight_scale_inv float32
    [..., ceil(out/bn), ceil(in/bk)]): leading dimensions are a batch of matrices (stacked experts), each quantized on
    its own. Each block's scale maps its largest |w| onto 448, so that value lands on E4M3's largest normal and every
    other value keeps 3 mantissa bits (relative error <= 2^-4) until it falls below E4M3's normal range
    (2^-6 * scale). Partial blocks at the edges are scaled by their own elements."""
    *lead, out, inp = w.shape
    bn, bk = block
    so, si = scale_shape((out, inp), block)
    x = w.detach().float()
    if so * bn != out or si * bk != inp:  # zero padding leaves each partial block's max as it is
        x = torch.nn.functional.pad(x, (0, si * bk - inp, 0, so * bn - out))
    blocks = x.view(*lead, so, bn, si, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero block: any scale gives zeros
    q = (blocks / scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, so * bn, si * bk)[..., :out, :inp].contiguous()
    return q, scale.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse map SGLang's block-FP8 linears apply to their weight: q * scale per block, as `dtype`."""
    out, inp = q.shape
    if tuple(scale.shape) != scale_shape(q.shape, block):
        raise ValueError(f"weight_scale_inv of shape {tuple(scale.shape)} does not fit an FP8 weight of shape "
                         f"{(out, inp)} in {block[0]}x{block[1]} blocks (expected {scale_shape(q.shape, block)})")
    s = scale.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return (q.float() * s).to(dtype)


def quantize_stream(stream: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = BLOCK, *,
                    stacked_experts: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named stream with each linear weight replaced by its FP8 weight followed by its weight_scale_inv, and (with
    stacked_experts) each stacked expert tensor by its experts' FP8 weights and scales under the per-expert names
    (stacked_expert_parts), a few experts at a time; every other tensor passes as it is. On the tensor's own device
    (the trainer's GPU while streaming)."""
    for name, t in stream:
        parts = stacked_expert_parts(name, t) if stacked_experts else None
        if parts is not None:
            E, rows = t.shape[0], t.shape[1] // (len(parts) // t.shape[0])
            step = max(1, _CHUNK_ELEMENTS // t[0].numel())
            for e0 in range(0, E, step):
                chunk = t[e0:e0 + step]
                per = [quantize_fp8_block(chunk[:, j * rows:(j + 1) * rows], block) for j in range(len(parts) // E)]
                for e in range(chunk.shape[0]):
                    for j, (q, s) in enumerate(per):
                        module = parts[(e0 + e) * len(per) + j]
                        # copies, not views of the chunk: safetensors (disk sync, FP8 checkpoints) refuses shared storage
                        yield module + ".weight", q[e].clone()
                        yield module + SCALE_SUFFIX, s[e].clone()
        elif is_quantized_weight(name, t):
            q, s = quantize_fp8_block(t, block)
            yield name, q
            yield name[: -len(".weight")] + SCALE_SUFFIX, s
        else:
            yield name, t


class Dequantizer:
    """What an engine without FP8 matmuls loads from a quantized stream: each FP8 weight, once its weight_scale_inv has
    arrived (either may come first, and bucket or file boundaries split pairs, so the halves wait across calls of
    `feed`), as float32 q * scale under the weight's name; the engine casts it to its own dtype as it does any weight.
    Other tensors pass as they are, so a stream without FP8 weights goes through unchanged."""

    def __init__(self, block: tuple[int, int] = BLOCK):
        self.block = block
        self.weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale
        self.scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight, under the weight's name

    def feed(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in stream:
            if name.endswith(SCALE_SUFFIX):
                base = name[: -len(SCALE_SUFFIX)] + ".weight"
                if base in self.weights:
                    yield base, dequantize_fp8_block(self.weights.pop(base), t, self.block)
                else:
                    self.scales[base] = t
            elif t.dtype == FP8_DTYPE:
                if name in self.scales:
                    yield name, dequantize_fp8_block(t, self.scales.pop(name), self.block)
                else:
                    self.weights[name] = t
            else:
                yield name, t

    def unpaired(self) -> list[str]:
        return ([f"{n} without its weight_scale_inv" for n in self.weights]
                + [f"{n[:-len('.weight')]}{SCALE_SUFFIX} without its weight" for n in self.scales])


def dequantize_stream(stream: Iterable[tuple[str, torch.Tensor]],
                      block: tuple[int, int] = BLOCK) -> Iterator[tuple[str, torch.Tensor]]:
    """A whole quantized stream dequantized (Dequantizer); a weight or scale left without its other half is an error."""
    d = Dequantizer(block)
    yield from d.feed(stream)
    if d.unpaired():
        raise ValueError("FP8 weight sync ended with unpaired tensors: " + ", ".join(d.unpaired()))


def quantized_shapes(shapes: dict[str, tuple[int, ...]], block: tuple[int, int] = BLOCK) -> dict[str, tuple[int, ...]]:
    """The names and shapes an FP8 stream may carry for a model whose HF weights have `shapes`: each 2-D `.weight`
    also under `.weight_scale_inv` with its block-scale shape (a server checks announced shapes against these)."""
    out = dict(shapes)
    for name, shape in shapes.items():
        if name.endswith(".weight") and len(shape) == 2:
            out[name[: -len(".weight")] + SCALE_SUFFIX] = scale_shape(shape, block)
    return out


def stream_nbytes(stream: Iterable[tuple[str, torch.Tensor]], counter: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a stream through, adding its bytes to counter[0]."""
    for name, t in stream:
        counter[0] += t.numel() * t.element_size()
        yield name, t
