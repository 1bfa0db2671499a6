"""Packed THD layout, context-parallel attention plan and vocab-parallel log-probs (CPU; no
megatron-core needed): the pure-torch pieces the Megatron backend is built on."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polyrl.backends.logprobs import chunked_logprobs, reference_logprobs
from polyrl.backends.megatron import thd


def _samples(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, plens = [], []
    for i in range(n):
        p, r = 2 + i % 3, 1 + (i * 2) % 5
        ids.append(torch.randint(1, 50, (p + r,), generator=g))
        plens.append(p)
    return ids, plens




@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("sp", [1, 2])
def test_pack_covers_every_response_token_once(cp, sp):
    ids, plens = _samples()
    packs = [thd.pack_thd(ids, plens, cp_size=cp, cp_rank=r, sp_size=sp) for r in range(cp)]
    R = sum(int(x.numel()) - p for x, p in zip(ids, plens))
    slots = torch.cat([pb.logp_slot for pb in packs]).sort().values
    assert torch.equal(slots, torch.arange(R))
    # each target is the next token of the same sample
    full = torch.cat([torch.cat([x[p:] for x, p in zip(ids, plens)])])
    for pb in packs:
        assert torch.equal(pb.targets, full[pb.logp_slot])
        assert pb.input_ids.numel() * cp % (cp * sp) == 0 and (pb.input_ids.numel() % sp == 0)
        assert pb.num_response == R and pb.seq_ids.numel() == R


def _dense_global(q_all, k_all, v_all, seq, pos):
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1), attn_mask=mask[None], scale=0.3)
    return out.transpose(0, 1)

def test_one_rank_head_skips_megatron_vocab_padding():
    # TP 1 takes chunked_logprobs over the real vocabulary rows: padding rows take no probability and get no gradient
    torch.manual_seed(0)
    vocab, padded, H, T = 37, 48, 16, 9
    hidden, weight = torch.randn(T, H, dtype=torch.float64), torch.randn(padded, H, dtype=torch.float64)
    targets = torch.randint(0, vocab, (T,))
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = thd.vocab_parallel_logprobs(h, w, targets, vocab_start=0, vocab_size=vocab, temperature=0.7, chunk_size=4,
                                          with_entropy=True)
    (lp.sum() + 0.3 * ent.sum()).backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight[:vocab].clone().requires_grad_(True)
    lp2, ent2 = reference_logprobs(h2, w2, targets, temperature=0.7, with_entropy=True)
    (lp2.sum() + 0.3 * ent2.sum()).backward()
    # fp32 log-softmax over 37 terms on both sides: ~1e-6; 1e-4 leaves room and still catches any formula error
    for a, b in ((lp, lp2), (ent, ent2), (h.grad, h2.grad), (w.grad[:vocab], w2.grad)):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(w.grad[vocab:]) == 0


@pytest.mark.parametrize("cp", [1, 2])
def test_cp_attention_plan_equals_full_attention(cp):
    """Each CP rank's queries against the rank-major gathered keys give the rows of full
    per-sequence causal attention (dense path; the GPU test checks the varlen path against it)."""
    ids, plens = _samples(4)
    packs = [thd.pack_thd(ids, plens, cp_size=cp, cp_rank=r) for r in range(cp)]
    T = int(packs[0].cu_seqlens[-1])
    torch.manual_seed(0)
    qg, kg, vg = (torch.randn(T, 2, 8) for _ in range(3))
    seq = torch.repeat_interleave(torch.arange(len(packs[0].cu_seqlens) - 1), torch.diff(packs[0].cu_seqlens.long()))
    pos = torch.cat([torch.arange(int(n)) for n in torch.diff(packs[0].cu_seqlens.long())])
    ref = _dense_global(qg, kg, vg, seq, pos)
    local_idx = [thd._ranges(thd.local_chunks(torch.diff(pb.cu_seqlens.long()).tolist(), cp, r)) for r, pb in enumerate(packs)]
    k_gath = torch.cat([kg[i] for i in local_idx])
    v_gath = torch.cat([vg[i] for i in local_idx])
    for r, pb in enumerate(packs):
        out = thd.varlen_attention(qg[local_idx[r]], k_gath, v_gath, pb.plan, 0.3, impl="dense")
        torch.testing.assert_close(out, ref[local_idx[r]])
        # the varlen plan's key segments are exactly each query chunk's causal prefix
        for s in range(len(pb.plan.cu_q) - 1):
            ks = pb.plan.kv_index[pb.plan.cu_k[s]:pb.plan.cu_k[s + 1]]
            assert torch.equal(pb.plan.k_pos[ks], torch.arange(ks.numel()))
        # without CP the varlen path passes the keys as they are: kv_index must then be every key, in order
        assert pb.plan.kv_all == (cp == 1)
        if cp == 1:
            assert torch.equal(pb.plan.kv_index, torch.arange(T))


def test_gqa_heads_are_repeated():
    ids, plens = _samples(2)
    pb = thd.pack_thd(ids, plens)
    T = pb.input_ids.numel()
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    out = thd.varlen_attention(q, k, v, pb.plan, 0.5, impl="dense")
    ref = thd.varlen_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), pb.plan, 0.5, impl="dense")
    torch.testing.assert_close(out, ref)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vp_worker(rank, world, port, vocab, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    H, T = 16, 11
    hidden = torch.randn(T, H, dtype=torch.float32)
    padded = -(-vocab // world) * world
    weight = torch.randn(padded, H, dtype=torch.float32)
    weight[vocab:] = 0
    targets = torch.randint(0, vocab, (T,))
    per = padded // world
    h = hidden.clone().requires_grad_(True)
    w = weight[rank * per:(rank + 1) * per].clone().requires_grad_(True)
    lp, ent = thd.vocab_parallel_logprobs(h, w, targets, vocab_start=rank * per, vocab_size=vocab, group=dist.group.WORLD,
                                          temperature=0.7, chunk_size=4, with_entropy=True)
    (lp.sum() + 0.3 * ent.sum()).backward()
    hg = h.grad.clone()
    dist.all_reduce(hg)  # megatron's copy_to_tensor_model_parallel_region does this in the backward
    result[rank] = (lp.detach(), ent.detach(), hg, w.grad.detach())
    if rank == 0:
        h2 = hidden.clone().requires_grad_(True)
        w2 = weight[:vocab].clone().requires_grad_(True)
        lp2, ent2 = chunked_logprobs(h2, w2, targets, temperature=0.7, chunk_size=4, with_entropy=True)
        (lp2.sum() + 0.3 * ent2.sum()).backward()
        result["ref"] = (lp2.detach(), ent2.detach(), h2.grad, w2.grad)
    dist.barrier()  # no rank tears gloo down while another still has traffic in flight
    dist.destroy_process_group()
    os._exit(0)  # no interpreter finalization, as in test_gdn_tp_cpu._worker (a gloo thread would abort it)


@pytest.mark.parametrize("world,vocab", [(1, 37), (2, 37), (3, 40)])
def test_vocab_parallel_logprobs_match_full_vocab(world, vocab):
    result = mp.Manager().dict()
    mp.spawn(_vp_worker, args=(world, _free_port(), vocab, result), nprocs=world)
    lp_ref, ent_ref, hg_ref, wg_ref = result["ref"]
    per = -(-vocab // world)
    for r in range(world):
        lp, ent, hg, wg = result[r]
        torch.testing.assert_close(lp, lp_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ent, ent_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hg, hg_ref, atol=1e-4, rtol=1e-4)
        n = max(0, min(per, vocab - r * per))
        torch.testing.assert_close(wg[:n], wg_ref[r * per:r * per + n], atol=1e-4, rtol=1e-4)
        assert torch.count_nonzero(wg[n:]) == 0  # padding rows get no gradient



@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0},
                                  {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                  {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}])
def test_packed_rope_matches_hf_per_sequence(cp, rope):
    """PackedRope + apply_rope on this CP rank's packed tokens == HF's rotary embedding and
    apply_rotary_pos_emb run on each sequence alone (positions 0..L-1), for plain, scaled
    (llama3) and partial RoPE: packing and the CP split change nothing."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_parameters=dict(rope))
    ids, plens = _samples(n=4, seed=3)
    h, d = 4, 16
    g = torch.Generator().manual_seed(0)
    per_seq = [torch.randn(int(x.numel()), h, d, generator=g) for x in ids]
    hf_rot = LlamaRotaryEmbedding(cfg)
    ref = []
    for q in per_seq:
        cos, sin = hf_rot(q, torch.arange(q.shape[0])[None])
        ref.append(apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)[0][0].transpose(0, 1))
    rope_tables = thd.PackedRope(cfg, torch.float32, torch.device("cpu"))
    for r in range(cp):
        pb = thd.pack_thd(ids, plens, cp_size=cp, cp_rank=r)
        lens = (pb.cu_seqlens[1:] - pb.cu_seqlens[:-1]).tolist()
        padded = torch.cat([torch.cat([q, q.new_zeros(L - q.shape[0], h, d)]) for q, L in zip(per_seq, lens)])
        want = torch.cat([torch.cat([o, o.new_zeros(L - o.shape[0], h, d)]) for o, L in zip(ref, lens)])
        local = torch.cat([torch.arange(s, s + n) for s, n in thd.local_chunks(lens, cp, r)])
        cos, sin = rope_tables.tables(pb.position_ids)
        got = thd.apply_rope(padded[local], cos, sin)
        real = torch.cat([torch.arange(s, s + n) for s, n in zip(pb.cu_seqlens[:-1].tolist(),
                                                                 [int(x.numel()) for x in ids])])
        keep = torch.isin(local, real)
        torch.testing.assert_close(got[keep], want[local][keep], rtol=0, atol=1e-6)


def test_router_targets_cover_every_routed_token_once_across_cp_and_sp_ranks():
    """MoE replay on megatron: the router-order targets of every (CP rank, SP rank) together hold each sample's
    route exactly once, at its own packed position (thd padding and each sample's last token get placeholders)."""
    from polyrl.backends.megatron.routing import router_targets
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 50, (n,), generator=g) for n in (7, 12, 5)]
    layers, k, cp, sp = 3, 2, 2, 2
    routes = [torch.randint(0, 8, (len(x) - 1, layers, k), generator=g, dtype=torch.int16) for x in ids]
    seen = {}
    for cr in range(cp):
        pb = thd.pack_thd(ids, [2, 2, 2], cp_size=cp, cp_rank=cr, sp_size=sp)
        offs = [int(x) for x in pb.cu_seqlens]
        for sr in range(sp):
            tgt, has, glob = router_targets(pb.token_index, offs, routes, layers, k, sp, sr)
            for t, h, gi in zip(tgt, has.tolist(), glob.tolist()):
                if h:
                    assert gi not in seen
                    seen[gi] = t
    for i, r in enumerate(routes):
        off = [int(x) for x in thd.pack_thd(ids, [2, 2, 2], cp_size=cp, cp_rank=0, sp_size=sp).cu_seqlens][i]
        for j in range(r.shape[0]):
            assert torch.equal(seen.pop(off + j), r[j].long())
    assert not seen


def test_recorded_route_shares_merge_back_to_each_sample_over_cp_sp_and_pipeline_stages():
    """R2 on megatron: each rank sends only the routes its routers recorded (its CP chunk, its SP share, its pipeline
    stage's MoE layers); joining every rank's shares gives each sample's [n - 1, layers, k] routes exactly, -1 on
    layers without experts."""
    from polyrl.backends.megatron.routing import merge_route_shares, route_shares, router_targets
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 50, (n,), generator=g) for n in (9, 4, 13)]
    layers, k, cp, sp = 4, 2, 2, 2
    moe_layers_per_stage = [[1], [2, 3]]  # layer 0 dense; two pipeline stages
    routes = [torch.randint(0, 8, (len(x) - 1, layers, k), generator=g, dtype=torch.int16) for x in ids]
    for r in routes:
        r[:, 0] = -1
    shares = []
    for cr in range(cp):
        pb = thd.pack_thd(ids, [2, 2, 2], cp_size=cp, cp_rank=cr, sp_size=sp)
        offs = [int(x) for x in pb.cu_seqlens]
        for sr in range(sp):
            tgt, has, glob = router_targets(pb.token_index, offs, routes, layers, k, sp, sr)
            for stage in moe_layers_per_stage:
                rec = {layer: tgt[:, layer] for layer in stage}  # what this stage's routers recorded, router order
                share = route_shares(rec, glob, offs, [len(x) for x in ids], torch.int16)
                held = sum(v[0].numel() for v in share.values())
                assert held <= glob.numel()  # no more than this rank's tokens
                shares.append(share)
    full = merge_route_shares(shares, {i: len(x) for i, x in enumerate(ids)}, layers, k, torch.int16)
    for i, r in enumerate(routes):
        assert torch.equal(full[i], r)
