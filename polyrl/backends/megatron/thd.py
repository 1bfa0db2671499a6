"""Packed THD micro-batches, varlen causal attention with context parallelism, and log-probs /
entropy over vocab-parallel logits. Plain torch + torch.distributed (no megatron-core), so all of
it is tested on CPU with gloo process groups; `model.py` plugs it into megatron's modules.

Layout of one packed micro-batch (megatron's THD convention):
  - sequences are concatenated; sequence i is padded at its end to L_i, a multiple of 2*cp
    (cp > 1), and the last one further so the total T splits evenly over cp x tp (sequence parallel);
  - with context parallelism each sequence is cut into 2*cp chunks of c_i = L_i / (2 cp) tokens and
    CP rank r holds chunks r and 2cp-1-r (the load-balanced causal split megatron / TE use), in
    sequence order: [s0 chunk r, s0 chunk 2cp-1-r, s1 chunk r, ...].
Padding tokens sit after every real token of their sequence, so causal attention never lets a real
token see one.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from polyrl.backends import varlen
from polyrl.backends.base import to_device

# ---------------------------------------------------------------------------------------------
# Packing


@dataclass
class AttnPlan:
    """What the core attention needs, for this CP rank's tokens (all on one device).

    varlen path: q is the local tokens, cut into segments (cu_q); segment s attends causally to
    keys `kv_index[cu_k[s]:cu_k[s+1]]` of the CP-gathered keys, with causal alignment at the
    bottom right (the segment's last query sees the segment's last key).
    dense path (reference / fallback): q token t has (q_seq[t], q_pos[t]); gathered key j has
    (k_seq[j], k_pos[j]); t sees j iff same sequence and k_pos <= q_pos."""

    cu_q: Tensor  # int32 [S+1]
    cu_k: Tensor  # int32 [S+1]
    max_q: int
    max_k: int
    kv_index: Tensor  # long [sum k lens] rows of the gathered [cp * T_local] keys
    q_seq: Tensor
    q_pos: Tensor
    k_seq: Tensor  # over gathered keys, in gathered (rank-major) order
    k_pos: Tensor
    kv_all: bool = False  # kv_index takes every gathered key in order (no CP): the varlen path skips the gather


@dataclass
class PackedBatch:
    input_ids: Tensor  # long [T_local] this CP rank's tokens
    position_ids: Tensor  # long [T_local] position inside its sequence
    cu_seqlens: Tensor  # int32 [n+1] padded full-sequence boundaries (same on every CP rank)
    max_seqlen: int
    plan: AttnPlan
    logp_index: Tensor  # long [R_local] local positions whose next-token log-prob is needed
    logp_slot: Tensor  # long [R_local] where each goes in the micro-batch's [R] response tokens
    targets: Tensor  # long [R_local] the next token at those positions
    num_response: int  # R
    seq_ids: Tensor  # long [R] sample index (within the micro-batch) of each response token
    response_lens: list[int]
    token_index: Tensor | None = None  # long [T_local] (host) packed index of each local token: where MoE routes go


def local_chunks(lens: list[int], cp: int, rank: int) -> list[tuple[int, int]]:
    """(start, length) ranges of the packed global layout held by CP rank `rank`, in local order."""
    out, off = [], 0
    for L in lens:
        if cp == 1:
            out.append((off, L))
        else:
            c = L // (2 * cp)
            out += [(off + rank * c, c), (off + (2 * cp - 1 - rank) * c, c)]
        off += L
    return out


def _ranges(chunks: list[tuple[int, int]]) -> Tensor:
    if not chunks:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(s, s + n) for s, n in chunks])


def pack_thd(input_ids: list[Tensor], prompt_lens: list[int], *, cp_size: int = 1, cp_rank: int = 0,
             sp_size: int = 1, pad_id: int = 0, device: torch.device | str = "cpu") -> PackedBatch:
    """Pack samples (prompt + response token ids) for one forward. An empty list packs a dummy
    sequence of padding with no response tokens (a rank with nothing to do still joins the
    collectives)."""
    align = 2 * cp_size if cp_size > 1 else 1
    real = [int(x.numel()) for x in input_ids]
    lens = [-(-n // align) * align for n in real] or [align]
    total_mult = cp_size * sp_size
    while sum(lens) % total_mult:  # grow the last sequence until T splits over cp x sp
        lens[-1] += align
    seqs = list(input_ids) or [torch.full((0,), pad_id, dtype=torch.long)]
    ids_g = torch.cat([torch.cat([s.long(), torch.full((L - s.numel(),), pad_id, dtype=torch.long)])
                       for s, L in zip(seqs, lens)])
    pos_g = torch.cat([torch.arange(L) for L in lens])
    seq_g = torch.cat([torch.full((L,), i, dtype=torch.long) for i, L in enumerate(lens)])
    offs = [0]
    for L in lens:
        offs.append(offs[-1] + L)

    # response tokens: position p (global) predicts ids[p + 1] for p in [off + P - 1, off + n - 1)
    gpos, slots, seq_ids, rlens = [], [], [], []
    r = 0
    for i, (n, p) in enumerate(zip(real, prompt_lens)):
        k = n - p
        gpos.append(torch.arange(offs[i] + p - 1, offs[i] + n - 1))
        slots.append(torch.arange(r, r + k))
        seq_ids.append(torch.full((k,), i, dtype=torch.long))
        rlens.append(k)
        r += k
    gpos_t = torch.cat(gpos) if gpos else torch.zeros(0, dtype=torch.long)
    slots_t = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)

    mine = local_chunks(lens, cp_size, cp_rank)
    local_index = _ranges(mine)  # global index of each local token
    owner = torch.full((offs[-1],), -1, dtype=torch.long)
    owner[local_index] = torch.arange(local_index.numel())
    loc = owner[gpos_t]
    keep = loc >= 0
    logp_index, logp_slot = loc[keep], slots_t[keep]
    targets = ids_g[gpos_t[keep] + 1]

    # attention plan
    if cp_size == 1:
        cu = torch.tensor(offs, dtype=torch.int32)
        cu_q = cu_k = cu
        max_q = max_k = max(lens)
        kv_index = torch.arange(offs[-1])
        k_global = local_index
    else:
        all_local = [_ranges(local_chunks(lens, cp_size, rr)) for rr in range(cp_size)]
        k_global = torch.cat(all_local)  # gathered keys are rank-major
        where = torch.empty(offs[-1], dtype=torch.long)
        where[k_global] = torch.arange(k_global.numel())
        q_lens, k_lens, kv = [], [], []
        for i, L in enumerate(lens):
            c = L // (2 * cp_size)
            for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
                q_lens.append(c)
                k_lens.append((j + 1) * c)
                kv.append(where[offs[i]: offs[i] + (j + 1) * c])
        cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + k_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        max_q, max_k = max(q_lens), max(k_lens)
        kv_index = torch.cat(kv)
    # built on the host, crossing in pinned asynchronous copies: a blocking copy per tensor would wait each time for
    # the GPU's queue to drain
    (cu_q, cu_k, kv_index, q_seq, q_pos, k_seq, k_pos, input_ids_l, cu_seqlens, logp_index, logp_slot, targets,
     seq_ids_t) = to_device(
        [cu_q, cu_k, kv_index, seq_g[local_index], pos_g[local_index], seq_g[k_global], pos_g[k_global],
         ids_g[local_index], torch.tensor(offs, dtype=torch.int32), logp_index, logp_slot, targets,
         torch.cat(seq_ids) if seq_ids else torch.zeros(0, dtype=torch.long)], device)
    plan = AttnPlan(cu_q=cu_q, cu_k=cu_k, max_q=int(max_q), max_k=int(max_k), kv_index=kv_index, q_seq=q_seq,
                    q_pos=q_pos, k_seq=k_seq, k_pos=k_pos, kv_all=cp_size == 1)
    return PackedBatch(
        input_ids=input_ids_l, position_ids=q_pos, cu_seqlens=cu_seqlens, max_seqlen=max(lens), plan=plan,
        logp_index=logp_index, logp_slot=logp_slot, targets=targets, num_response=r, seq_ids=seq_ids_t,
        response_lens=rlens, token_index=local_index)


# ---------------------------------------------------------------------------------------------
# Collectives with the backward each use needs


class _AllReduceSumSameGrad(torch.autograd.Function):
    """Sum over `group` in the forward; identity in the backward. For values that every rank of
    the group then uses identically (same loss on all ranks), so each rank's gradient is already
    the full one (megatron's reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x: Tensor, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


def reduce_same_grad(x: Tensor, group) -> Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSumSameGrad.apply(x, group)


class _AllGather(torch.autograd.Function):
    """[n, ...] per rank -> [world * n, ...] rank-major; backward reduce-scatters (sum): each
    rank's keys feed every rank's attention output."""

    @staticmethod
    def forward(ctx, x: Tensor, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        world = dist.get_world_size(ctx.group)
        out = g.new_empty((g.shape[0] // world, *g.shape[1:]))
        dist.reduce_scatter_tensor(out, g.contiguous(), group=ctx.group)
        return out, None


def all_gather_seq(x: Tensor, group) -> Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllGather.apply(x, group)


# ---------------------------------------------------------------------------------------------
# Attention


def apply_rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of packed tokens t [T, h, d] with per-token tables cos / sin [T, 1, r]
    (r <= d: partial rotary leaves the last d - r channels alone), HF's non-interleaved
    rotate-half form, in t's dtype as the HF decoders compute it. Tables come from each token's
    position inside its sequence, so packing needs no per-sequence loop (and no host sync)."""
    r = cos.shape[-1]
    x = t[..., :r]
    x1, x2 = x[..., : r // 2], x[..., r // 2:]
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if r == t.shape[-1] else torch.cat((out, t[..., r:]), dim=-1)


class PackedRope:
    """RoPE tables for a packed micro-batch, made once per forward by the HF model's own rotary
    module (so every HF rope type, its attention scaling and partial rotary come with it) from
    each token's position inside its sequence; VarlenCoreAttention applies them to q and k.
    megatron-core's RoPE without Transformer Engine loops over the packed sequences in every
    layer with two host syncs per call, which left the GPU idle between layers; megatron's own
    RoPE is therefore off for these models (bridge: position_embedding_type "none")."""

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device):
        # the config's own model type (a text config's module drops "_text": qwen3_5_text is in qwen3_5), else the
        # one its class extends (MiMo's config is Qwen2's: polyrl.hf_families)
        types = [getattr(c, "model_type", "") for c in type(hf_config).__mro__]
        for t in (x for t in types if t for x in dict.fromkeys((t, t.removesuffix("_text")))):
            if importlib.util.find_spec(f"transformers.models.{t}") is not None:
                break
        mod = importlib.import_module(f"transformers.models.{t}.modeling_{t}")
        name = type(hf_config).__name__.removesuffix("Config") + "RotaryEmbedding"
        cls = getattr(mod, name, None) or next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))
        self.rotary = cls(hf_config).to(device)  # fp32 buffers; not a megatron submodule, never cast
        self.dtype = dtype

    def tables(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """position_ids [T] (inside each sequence) -> cos, sin [T, 1, r] in the model's dtype."""
        x = torch.empty(0, dtype=self.dtype, device=position_ids.device)
        pos = position_ids[None]
        if getattr(self.rotary, "mrope_section", None) is not None:
            # a text model with a multimodal rope (Qwen3.5): text tokens carry the same id on its 3 axes, and some
            # transformers releases index the [3, batch, T] form without expanding a [batch, T] one
            pos = pos[None].expand(3, -1, -1)
        cos, sin = self.rotary(x, pos)
        return cos[0, :, None, :], sin[0, :, None, :]


def dense_attention(q: Tensor, k: Tensor, v: Tensor, plan: AttnPlan, scale: float) -> Tensor:
    """Reference: q [Tq, h, d] against all gathered keys k/v [Tk, h, d] with an explicit
    same-sequence causal mask. O(Tq * Tk) memory: tests and non-flash devices only."""
    mask = (plan.q_seq[:, None] == plan.k_seq[None, :]) & (plan.k_pos[None, :] <= plan.q_pos[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask[None], scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, plan: AttnPlan, scale: float, *,
                     impl: str = "auto") -> Tensor:
    """Causal attention of this rank's packed queries q [Tq, hq, d] over the CP-gathered keys and
    values k, v [cp * Tq, hkv, d] (GQA: the kernel shares K/V heads where torch lets it, else they
    are repeated here). Returns [Tq, hq, d].
    impl: auto (flash varlen on CUDA bf16/fp16, else dense) | varlen | dense."""
    if impl == "auto":
        impl = "varlen" if varlen.usable(q.device, q.dtype) else "dense"
    if impl == "dense":
        return dense_attention(q, k, v, plan, scale)
    if not plan.kv_all:
        k, v = k.index_select(0, plan.kv_index), v.index_select(0, plan.kv_index)
    return varlen.causal(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale)


# ---------------------------------------------------------------------------------------------
# Log-probs and entropy over vocab-parallel logits


def _chunk(hidden, weight, targets, vocab_start: int, vocab_size: int, inv_temp: float, with_entropy: bool, group):
    logits = (hidden @ weight.t()).float()
    if inv_temp != 1.0:
        logits = logits * inv_temp
    n_local = weight.shape[0]
    if vocab_start + n_local > vocab_size:  # megatron's vocab padding rows must not take probability
        pad = torch.arange(vocab_start, vocab_start + n_local, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad, torch.finfo(torch.float32).min)
    m = logits.detach().max(dim=-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m[:, None]
    e = shifted.exp()
    s = reduce_same_grad(e.sum(-1), group)
    lse = s.log()
    local = targets - vocab_start
    inside = (local >= 0) & (local < n_local)
    picked = shifted.gather(-1, local.clamp(0, n_local - 1)[:, None]).squeeze(-1) * inside
    logp = reduce_same_grad(picked, group) - lse
    if not with_entropy:
        return logp, None
    ent = lse - reduce_same_grad((e * shifted).sum(-1), group) / s
    return logp, ent


def vocab_parallel_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, vocab_start: int, vocab_size: int,
                            group=None, temperature: float = 1.0, chunk_size: int = 1024,
                            with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """hidden [T, H] (the same on every TP rank), weight [V/tp, H] (this rank's vocab rows
    starting at `vocab_start`), targets [T] -> logprobs [T], entropy [T] | None (fp32), the
    same on every rank of `group`. The full vocabulary is never gathered: a max and two sums
    are all-reduced per token; at most `chunk_size` x V/tp fp32 logits exist at a time (the
    backward recomputes each chunk).
    Without a TP group (or one of one rank) this is polyrl.backends.logprobs.chunked_logprobs over the real vocabulary
    rows (the backward keeps the per-token lse instead of recomputing the softmax; Triton passes on CUDA)."""
    if (group is None or dist.get_world_size(group) == 1) and vocab_start == 0 and hidden.shape[0]:
        from polyrl.backends.logprobs import chunked_logprobs
        return chunked_logprobs(hidden, weight[:min(vocab_size, weight.shape[0])], targets, temperature=temperature,
                                chunk_size=chunk_size, with_entropy=with_entropy)
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        args = (hidden[s:s + chunk_size], weight, targets[s:s + chunk_size], vocab_start, vocab_size, inv_temp,
                with_entropy, group)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        z = hidden.new_zeros(0, dtype=torch.float32) + (weight.sum() * 0).float()  # keep the graph connected
        return z, (z if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def assemble_responses(values: Tensor, slots: Tensor, num_response: int, group) -> Tensor:
    """Scatter this CP rank's per-token values into the micro-batch's [R] response order and sum
    over the CP group; every CP rank ends with the full [R] (and, under an identical loss on each,
    its own tokens' gradient)."""
    full = values.new_zeros(num_response).index_add(0, slots, values)
    return reduce_same_grad(full, group)
