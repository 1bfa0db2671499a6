"""Our own forward of the Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder, reading HF weights by HF name.

All weights live in one flat buffer; every tensor is a view into it, and q/k/v (gate/up) are
stored fused as one matrix whose row slices are the HF tensors. MoE experts are stacked,
[E, 2I, H] gate|up and [E, H, I] down (transformers 5's in-memory layout); each expert's
slices are also addressable by the per-expert checkpoint names. So:
  - an HF-named stream (checkpoint or trainer) is copied in place: captured CUDA graphs stay
    valid, nothing is reallocated;
  - sleep/wake moves one buffer;
  - a decode layer is 4 GEMMs + 5 fused kernels.
"""

from __future__ import annotations

import glob
import importlib
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from polyrl.backends import varlen
from polyrl.rollout.gpu import fp8 as fp8_layout
from polyrl.rollout.gpu import ops as ref_ops
from polyrl.weight_sync.quantize import FP8_DTYPE, SCALE_SUFFIX, Dequantizer, quantize_fp8_block, quantize_stream

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")
# families whose decoder is another's: MiMo-7B is a Qwen2 decoder plus MTP layers the engine never runs (a draft head
# for speculative decoding, which this path does not do), so their tensors are accepted and dropped
DECODER_OF = {"mimo": "qwen2"}
IGNORED_PREFIXES = {"mimo": ("model.mtp_layers.",)}
# families the transformers path runs and this path does not, and what is missing here
NOT_YET = {
    "gpt_oss": "GPT-OSS needs learned attention sinks, sliding-window layers, YaRN RoPE and biased MoE experts with "
               "the clamped SwiGLU, which the paged-attention path does not have",
    "mimo_v2_flash": "MiMo-V2-Flash needs learned attention sinks, sliding-window layers, value heads narrower than "
                     "the query/key heads and group-limited sigmoid routing, which the paged-attention path does not have",
    "qwen3_5_text": "Qwen3.5's gated DeltaNet layers are recurrent (no paged KV cache for them)",
}
_ROTARY = {"llama": "LlamaRotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding", "qwen3": "Qwen3RotaryEmbedding",
           "qwen3_moe": "Qwen3MoeRotaryEmbedding"}


@dataclass
class ModelSpec:
    arch: str
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tied: bool
    max_pos: int
    # MoE (qwen3_moe): experts per layer, experts per token, expert MLP width, renormalised top-k gates, the layers
    # with experts (the others are dense MLPs of width `inter`)
    ignored: tuple[str, ...] = ()  # HF name prefixes loaded and synced as nothing (MiMo's MTP layers)
    experts: int = 0
    top_k: int = 0
    moe_inter: int = 0
    norm_topk: bool = False
    moe_layers: tuple[int, ...] = ()


def spec_from_config(cfg) -> tuple[ModelSpec | None, str | None]:
    """(spec, None) for a supported HF config, else (None, why not)."""
    given = getattr(cfg, "model_type", None)
    mt = DECODER_OF.get(given, given)
    if mt in NOT_YET:
        return None, NOT_YET[mt]
    if mt not in SUPPORTED:
        return None, f"model_type {given!r} is not one of {', '.join(SUPPORTED + tuple(DECODER_OF))}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return None, f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "use_sliding_window", False):
        return None, "sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return None, "mlp_bias"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if "dynamic" in str(rtype) or rtype == "longrope":
        return None, f"rope type {rtype!r} (position-dependent frequencies)"
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kvh = getattr(cfg, "num_key_value_heads", None) or heads
    if hd % 16 or hd > 256:
        return None, f"head_dim {hd} (needs a multiple of 16, at most 256)"
    bias = bool(getattr(cfg, "attention_bias", False))
    moe = {}
    if mt == "qwen3_moe":
        E, step, dense = cfg.num_experts, cfg.decoder_sparse_step, set(cfg.mlp_only_layers or ())
        moe = dict(experts=E, top_k=cfg.num_experts_per_tok, moe_inter=cfg.moe_intermediate_size,
                   norm_topk=bool(cfg.norm_topk_prob),  # the same rule as Qwen3MoeDecoderLayer's
                   moe_layers=tuple(i for i in range(cfg.num_hidden_layers) if i not in dense and E > 0 and (i + 1) % step == 0))
    return ModelSpec(
        arch=mt, vocab=cfg.vocab_size, hidden=cfg.hidden_size, inter=cfg.intermediate_size,
        layers=cfg.num_hidden_layers, heads=heads, kv_heads=kvh, head_dim=hd, eps=cfg.rms_norm_eps,
        qkv_bias=True if mt == "qwen2" else bias, o_bias=False if mt == "qwen2" else bias,
        qk_norm=mt in ("qwen3", "qwen3_moe"), tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        max_pos=cfg.max_position_embeddings, ignored=IGNORED_PREFIXES.get(given, ()), **moe), None


def rope_tables(cfg, spec: ModelSpec, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, D / 2] in the model dtype, from the architecture's own HF rotary
    module (so every static rope type it knows, llama3 / yarn / linear scaling included,
    and its attention scaling come out exactly as the trainer computes them)."""
    mod = importlib.import_module(f"transformers.models.{spec.arch}.modeling_{spec.arch}")
    rot = getattr(mod, _ROTARY[spec.arch])(config=cfg)
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), torch.arange(max_len)[None])
    half = spec.head_dim // 2
    return cos[0, :, :half].to(dtype).contiguous(), sin[0, :, :half].to(dtype).contiguous()


def iter_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named tensors of a local checkpoint directory (safetensors, else .bin)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model*.bin weights")
    for f in files:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


class DenseLM:
    """Weights + forward. `ops` is `polyrl.rollout.gpu.ops` (torch, any device) or
    `polyrl.rollout.gpu.triton_ops` layered over it (CUDA)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, ops=ref_ops, fp8: bool = False):
        """fp8: the decoder linears and MoE experts (polyrl.rollout.gpu.fp8.FP8_KEYS) are held as float8_e4m3fn with
        float32 block scales, inside the same flat buffer (each region a byte view of it), and run by ops.fp8_linear
        and ops.moe_experts."""
        self.spec, self.device, self.dtype, self.ops, self.fp8 = spec, device, dtype, ops, fp8
        s = spec
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self._qkv_rows = (q, kv, kv)
        # rows of each HF part of the FP8 matrices, and their scale layout (fp8.row_div)
        self.fp8_parts = {"qkv_w": [q, kv, kv], "o_w": [s.hidden], "gu_w": [s.inter, s.inter], "down_w": [s.hidden],
                          "egu": [s.moe_inter, s.moe_inter], "edown": [s.hidden]}  # experts: per expert
        self.row_div = {k: fp8_layout.row_div(p) for k, p in self.fp8_parts.items()}
        self.layout: list[tuple[str, tuple[int, ...]]] = [("embed", (s.vocab, s.hidden)), ("norm", (s.hidden,))]
        if not s.tied:
            self.layout.append(("lm_head", (s.vocab, s.hidden)))
        for i in range(s.layers):
            self.layout += [(f"{i}.ln1", (s.hidden,)), (f"{i}.qkv_w", (q + 2 * kv, s.hidden))]
            if s.qkv_bias:
                self.layout.append((f"{i}.qkv_b", (q + 2 * kv,)))
            if s.qk_norm:
                self.layout += [(f"{i}.qn", (s.head_dim,)), (f"{i}.kn", (s.head_dim,))]
            self.layout.append((f"{i}.o_w", (s.hidden, q)))
            if s.o_bias:
                self.layout.append((f"{i}.o_b", (s.hidden,)))
            self.layout.append((f"{i}.ln2", (s.hidden,)))
            if i in s.moe_layers:
                self.layout += [(f"{i}.router", (s.experts, s.hidden)), (f"{i}.egu", (s.experts, 2 * s.moe_inter, s.hidden)),
                                (f"{i}.edown", (s.experts, s.hidden, s.moe_inter))]
            else:
                self.layout += [(f"{i}.gu_w", (2 * s.inter, s.hidden)), (f"{i}.down_w", (s.hidden, s.inter))]
        # key -> dtype of its region: the model dtype unless FP8 (the matrix in float8, its scales in float32)
        self.kinds: dict[str, torch.dtype] = {}
        if fp8:
            for i in range(s.layers):
                for k in fp8_layout.FP8_KEYS:
                    key = f"{i}.{k}"
                    if key not in dict(self.layout):
                        continue
                    shape = dict(self.layout)[key]
                    self.kinds[key] = FP8_DTYPE
                    self.kinds[key + fp8_layout.SCALE] = torch.float32
                    grid = fp8_layout.scale_grid(self.fp8_parts[k], shape[-1])  # stacked experts: one grid per expert
                    self.layout.append((key + fp8_layout.SCALE, (*shape[:-2], *grid)))
        el = torch.empty((), dtype=dtype).element_size()
        self.offsets: dict[str, int] = {}
        n = 0
        for key, shape in self.layout:
            self.offsets[key] = n
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=self.kinds.get(key, dtype)).element_size()
            n += -(-nbytes // (64 * el)) * 64  # 128-byte aligned views (GEMM-friendly), in model-dtype elements
        self.numel = n
        self.flat = torch.empty(n, dtype=dtype, device=device)
        self.bind(self.flat)

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()

    def bind(self, flat: torch.Tensor) -> None:
        """(Re)build every view over `flat` (GPU buffer when awake, CPU copy while asleep)."""
        self.flat = flat
        self.w = {k: self._view(flat, k, sh) for k, sh in self.layout}
        if self.spec.tied:
            self.w["lm_head"] = self.w["embed"]
        s, (q, kv, _) = self.spec, self._qkv_rows
        hf = {"model.embed_tokens.weight": self.w["embed"], "model.norm.weight": self.w["norm"],
              "lm_head.weight": self.w["lm_head"]}
        # stacked expert tensor -> the per-expert names that cover it (checkpoints on disk use those; the trainer's
        # export streams the stacked names of the HF model's state_dict)
        self.parts: dict[str, list[str]] = {}
        for i in range(s.layers):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = self.w[f"{i}.qkv_w"]
            hf.update({p + "input_layernorm.weight": self.w[f"{i}.ln1"], p + "post_attention_layernorm.weight": self.w[f"{i}.ln2"],
                       a + "q_proj.weight": qkv[:q], a + "k_proj.weight": qkv[q:q + kv], a + "v_proj.weight": qkv[q + kv:],
                       a + "o_proj.weight": self.w[f"{i}.o_w"]})
            if i in s.moe_layers:
                gu, dn, I = self.w[f"{i}.egu"], self.w[f"{i}.edown"], s.moe_inter
                e = m + "experts."
                hf.update({m + "gate.weight": self.w[f"{i}.router"], e + "gate_up_proj": gu, e + "down_proj": dn})
                for x in range(s.experts):
                    hf.update({f"{e}{x}.gate_proj.weight": gu[x, :I], f"{e}{x}.up_proj.weight": gu[x, I:],
                               f"{e}{x}.down_proj.weight": dn[x]})
                self.parts[e + "gate_up_proj"] = [f"{e}{x}.{w}_proj.weight" for x in range(s.experts) for w in ("gate", "up")]
                self.parts[e + "down_proj"] = [f"{e}{x}.down_proj.weight" for x in range(s.experts)]
            else:
                hf.update({m + "down_proj.weight": self.w[f"{i}.down_w"], m + "gate_proj.weight": self.w[f"{i}.gu_w"][:s.inter],
                           m + "up_proj.weight": self.w[f"{i}.gu_w"][s.inter:]})
            if s.qkv_bias:
                b = self.w[f"{i}.qkv_b"]
                hf.update({a + "q_proj.bias": b[:q], a + "k_proj.bias": b[q:q + kv], a + "v_proj.bias": b[q + kv:]})
            if s.o_bias:
                hf[a + "o_proj.bias"] = self.w[f"{i}.o_b"]
            if s.qk_norm:
                hf.update({a + "q_norm.weight": self.w[f"{i}.qn"], a + "k_norm.weight": self.w[f"{i}.kn"]})
        # FP8: each HF part of an FP8 matrix also has its weight_scale_inv, a view of the matrix's scale rows (or, where
        # the engine keeps one scale row per weight row, filled by expanding the streamed grid: self.scale_expand)
        self.scale_of: dict[str, str] = {}  # HF weight name -> its scale's HF name
        self.fp8_of: dict[str, tuple[str, int]] = {}  # HF name of an FP8 part -> (layout key, part index)
        self.scale_expand: dict[str, tuple[int, ...]] = {}  # scale name -> the streamed (block-grid) shape
        self.stacked_key: dict[str, str] = {}  # FP8 engine: stacked expert name -> its layout key
        if self.fp8:
            for i in range(s.layers):
                a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
                e = m + "experts."
                # layout key -> the HF modules of each of its matrices (one matrix, or one per expert when stacked)
                names = {"qkv_w": [[a + "q_proj", a + "k_proj", a + "v_proj"]], "o_w": [[a + "o_proj"]],
                         "gu_w": [[m + "gate_proj", m + "up_proj"]], "down_w": [[m + "down_proj"]],
                         "egu": [[f"{e}{x}.gate_proj", f"{e}{x}.up_proj"] for x in range(s.experts)],
                         "edown": [[f"{e}{x}.down_proj"] for x in range(s.experts)]}
                if i in s.moe_layers:
                    self.stacked_key.update({e + "gate_up_proj": f"{i}.egu", e + "down_proj": f"{i}.edown"})
                for k, matrices in names.items():
                    key = f"{i}.{k}"
                    if key not in self.kinds:
                        continue
                    parts, sc = self.fp8_parts[k], self.w[key + fp8_layout.SCALE]
                    for x, mods in enumerate(matrices):
                        msc = sc if sc.dim() == 2 else sc[x]
                        for j, mod in enumerate(mods):
                            lo, hi = fp8_layout.part_scale_rows(parts, j)
                            hf[mod + SCALE_SUFFIX] = msc[lo:hi]
                            self.scale_of[mod + ".weight"] = mod + SCALE_SUFFIX
                            self.fp8_of[mod + ".weight"] = (key, j)
                            if self.row_div[k] == 1:
                                self.scale_expand[mod + SCALE_SUFFIX] = fp8_layout.scale_grid([parts[j]], sc.shape[-1])
        self.hf = hf
        self.layers = [{k.split(".", 1)[1]: v for k, v in self.w.items() if k.startswith(f"{i}.")} for i in range(s.layers)]

    def _view(self, flat: torch.Tensor, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The region of `key` as a tensor of its own dtype (FP8 matrices and their scales reinterpret the bytes)."""
        numel, kind = torch.Size(shape).numel(), self.kinds.get(key)
        o = self.offsets[key]
        if kind is None:
            return flat[o:o + numel].view(shape)
        el = flat.element_size()
        nbytes = numel * torch.empty((), dtype=kind).element_size()
        return flat[o:o + -(-nbytes // el)].view(torch.uint8)[:nbytes].view(kind).view(shape)

    def wire_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> the shape a weight sync sends it in."""
        return {n: self.scale_expand.get(n, tuple(v.shape)) for n, v in self.hf.items()}

    def read(self, name: str) -> torch.Tensor:
        """One HF-named weight as the engine uses it: an FP8 part dequantized to the model dtype (what the kernel
        multiplies by), a scale in its streamed shape, anything else the view itself."""
        if name in self.fp8_of:
            key, j = self.fp8_of[name]
            k = key.split(".", 1)[1]
            sc = self.hf[self.scale_of[name]]
            if self.row_div[k] == 1:
                sc = sc[::fp8_layout.BLOCK[0]]
            return fp8_layout.dequantize(self.hf[name], sc, fp8_layout.BLOCK[0], self.dtype)
        if name in self.scale_expand:
            return self.hf[name][::fp8_layout.BLOCK[0]]
        if name in self.stacked_key:  # FP8 experts, stacked
            key = self.stacked_key[name]
            return fp8_layout.dequantize(self.w[key], self.w[key + fp8_layout.SCALE], self.row_div[key.split(".", 1)[1]],
                                         self.dtype)
        return self.hf[name]

    def _fp8_stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream as the views take it: FP8 parts and their scales as they come (a float weight for an FP8 part is
        quantized here, on the engine's device, into the same pair; a float stacked expert tensor into its experts'
        pairs), scales expanded where the engine keeps one row per weight row; FP8 weights the engine keeps in its own
        dtype (an engine without FP8) dequantized once their scales arrive."""
        deq = Dequantizer()
        for name, t in self._split_stacked(weights):
            if name in self.fp8_of or (name in self.scale_expand or (name.endswith(SCALE_SUFFIX) and name in self.hf)):
                if name in self.fp8_of and t.dtype != FP8_DTYPE:
                    q, sc = quantize_fp8_block(t.to(self.device, non_blocking=True))
                    yield name, q
                    name, t = self.scale_of[name], sc
                if name in self.scale_expand:
                    if tuple(t.shape) != self.scale_expand[name]:
                        raise ValueError(f"{name}: got shape {tuple(t.shape)}, the rollout model has "
                                         f"{self.scale_expand[name]}")
                    t = t.to(self.device).repeat_interleave(fp8_layout.BLOCK[0], 0)[:self.hf[name].shape[0]]
                yield name, t
            else:
                yield from deq.feed(((name, t),))
        if deq.unpaired():
            raise ValueError("weight sync ended with unpaired FP8 tensors: " + ", ".join(deq.unpaired()))

    def _split_stacked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """FP8 engine: a float stacked expert tensor becomes its experts' FP8 weights and scales (the trainer's own
        quantization, run on the engine's device); everything else passes."""
        for name, t in weights:
            if name in self.stacked_key and t.dtype != FP8_DTYPE:
                yield from quantize_stream([(name, t.to(self.device, non_blocking=True))])
            else:
                yield name, t

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool) -> set[str]:
        """Copy an HF-named stream into the views, in place; returns the names written. Unknown names raise KeyError
        (rotary buffers excepted); with strict=True every weight must arrive."""
        seen = set()
        dsts, srcs = [], []
        for name, t in self._fp8_stream(weights):
            if name.endswith("rotary_emb.inv_freq") or name.startswith(self.spec.ignored):
                continue
            try:
                dst = self.hf[name]
            except KeyError:
                raise KeyError(f"weight sync sent {name!r}, which the rollout model does not have") from None
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: got shape {tuple(t.shape)}, the rollout model has {tuple(dst.shape)}")
            dsts.append(dst)
            srcs.append(t)
            seen.add(name)
            if len(dsts) == 64:  # a multi-tensor copy per 64 tensors, not a kernel launch each (weight sync is launch-bound)
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                dsts, srcs = [], []
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        if strict:
            missing = self.missing(seen)
            if missing:
                raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        return seen

    def missing(self, seen: set[str]) -> set[str]:
        """The weights a full update must write that `seen` lacks (a tied LM head is the embedding), each storage
        region named once: a stacked expert tensor is complete when it or all its per-expert parts arrived, and
        partly written, only its unwritten parts are missing."""
        out = set(self.hf) - seen - ({"lm_head.weight"} if self.spec.tied else set())
        for stacked, parts in self.parts.items():
            out -= set(parts)
            if stacked in out:
                rest = [n for n in parts if n not in seen]
                if len(rest) < len(parts):
                    out.discard(stacked)
                    out.update(rest)
        return out

    # ---- forward -------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, kv, attn,
                logits_rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                routes: torch.Tensor | None = None) -> torch.Tensor:
        """ids, pos, slots: [T]; kv: a KVCache (per-layer k/v [S, Hkv, D] and an FP8 cache's scales, rope cos/sin);
        attn: PrefillAttn or DecodeAttn; logits_rows: the rows that need logits (None: all);
        out: where to write the logits; routes: [T, layers, k] ints, where MoE layers write
        their top-k experts (other layers' rows are left as they are) -> logits [R, V] in the
        model dtype."""
        s, o, W = self.spec, self.ops, self.w
        lin = self._linear
        # w8a8 FP8 linears at decode sizes take E4M3 activations straight from the norms and SiLU (a launch fewer each)
        q8 = self.fp8 and o.fp8_activations(ids.shape[0], self.dtype)
        norm8 = o.add_rmsnorm_fp8 if q8 else o.add_rmsnorm
        h = F.embedding(ids, W["embed"])
        res = None
        for i, L in enumerate(self.layers):
            x, res = norm8(h, res, L["ln1"], s.eps)
            qkv = lin(x, L, "qkv_w", L.get("qkv_b"))
            sc = kv.scales_of(i)  # an FP8 cache's per-head scales ({} otherwise)
            q, k, v = o.rope_store(qkv, pos, slots, kv.k[i], kv.v[i], kv.cos, kv.sin, s.heads, s.kv_heads, s.head_dim,
                                   L.get("qn"), L.get("kn"), s.eps, write_k=attn.needs_k, **sc)
            a = attn(q, k, v, kv.k[i], kv.v[i], **sc)  # E4M3 already (FP8Act) where fp8_attention_out said so
            h = lin(a.reshape(a.shape[0], -1) if torch.is_tensor(a) else a, L, "o_w", L.get("o_b"))
            if "router" in L:  # the router stays in the model dtype; FP8 experts take unquantized activations (w8a16)
                x, res = o.add_rmsnorm(h, res, L["ln2"], s.eps)
                gates, experts = o.moe_route(x, L["router"], s.top_k, s.norm_topk)
                if routes is not None:
                    routes[:, i] = experts
                sc = fp8_layout.SCALE
                fp8 = (L["egu" + sc], self.row_div["egu"], L["edown" + sc], self.row_div["edown"]) if "egu" + sc in L else None
                h = o.moe_experts(x, L["egu"], L["edown"], gates, experts, scales=fp8)
            else:
                x, res = norm8(h, res, L["ln2"], s.eps)
                h = lin((o.silu_mul_fp8 if q8 else o.silu_mul)(lin(x, L, "gu_w")), L, "down_w")
        if logits_rows is not None:
            h, res = h[logits_rows], res[logits_rows]
        x, _ = o.add_rmsnorm(h, res, W["norm"], s.eps)
        if out is None:
            return F.linear(x, W["lm_head"])
        return torch.mm(x, W["lm_head"].t(), out=out)

    def fp8_attention_out(self, T: int) -> bool:
        """Whether decode attention over T tokens should hand the o projection E4M3 activations (w8a8 decode sizes,
        and head_dim 128, so that each head's output row is one 128-column activation group)."""
        return self.fp8 and self.spec.head_dim == 128 and self.ops.fp8_activations(T, self.dtype)

    def _linear(self, x: torch.Tensor, L: dict, key: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.fp8:
            sc = L.get(key + fp8_layout.SCALE)
            if sc is not None:
                return self.ops.fp8_linear(x, L[key], sc, bias, self.row_div[key])
        return F.linear(x, L[key], bias)


class PrefillAttn:
    """Causal attention over whole prompts (packed, lengths `lens`)."""
    needs_k = True

    def __init__(self, ops, lens: list[int], device, dtype: torch.dtype | None = None):
        self.ops, self.lens = ops, lens
        self.index = self.cu = None  # built once per prefill, not per layer
        if dtype is not None and varlen.usable(device, dtype):
            self.cu = ops.prefill_cu_seqlens(lens, device)  # one varlen flash call per layer
        elif len(set(lens)) > 1:  # ragged: SDPA over right-padded sequences
            self.index = ops.prefill_index(lens, device)

    def __call__(self, q, k, v, k_cache, v_cache, **scales):
        # the prompt attends to its own unrounded k / v, not to what an FP8 cache keeps of them
        return self.ops.prefill_attention(q, k, v, self.lens, self.index, self.cu)


class DecodeAttn:
    """One new token per sequence against the paged cache."""
    needs_k = False

    def __init__(self, ops, block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int, num_splits: int = 1,
                 split_len: torch.Tensor | None = None, fp8_out: bool = False):
        """fp8_out: the output as E4M3 activations for the FP8 o projection (DenseLM.fp8_attention_out; Triton ops)."""
        self.ops, self.bt, self.ctx, self.bs = ops, block_tables, ctx_lens, block_size
        self.num_splits, self.split_len = num_splits, split_len
        self.kw = {"fp8_out": True} if fp8_out else {}

    def __call__(self, q, k, v, k_cache, v_cache, **scales):
        return self.ops.paged_decode_attention(q, k_cache, v_cache, self.bt, self.ctx, self.bs, self.num_splits,
                                               self.split_len, **self.kw, **scales)


def load_config(path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)
