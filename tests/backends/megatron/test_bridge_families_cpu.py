"""DeepSeek-V3, GLM4-MoE and GLM4 in the HF <-> megatron bridge (CPU; megatron-core not needed).

Tiny models from transformers' own config classes (hidden 64, 2 layers: layer 0 dense, layer 1 MoE via
first_k_dense_replace=1). The bridge's tensors round-trip bit-exactly through TP / PP / EP layouts, and
pure-torch re-implementations of megatron-core 0.19's forward math over the bridge's (TP-sharded) tensors
reproduce the HF modules: MLA (its own de-interleaving RoPE), GLM4's permuted interleaved partial RoPE
with post norms, and the sigmoid router with expert bias, group-limited top-k, scaling and shared experts.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4Config, Glm4ForCausalLM, Glm4MoeConfig,
                          Glm4MoeForCausalLM)

from polyrl.backends.megatron import bridge, thd

from tiny_models import megatron_sigmoid_routing

COMMON = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
           n_shared_experts=1, norm_topk_prob=True)


def tiny_config(family: str, **overrides):
    if family == "deepseek_v3":  # 2 groups of 2 experts, 1 group chosen: group scoring = top-2 in both libraries
        cfg = DeepseekV3Config(**COMMON, **MOE, num_key_value_heads=4, n_group=2, topk_group=1, q_lora_rank=32,
                               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                               routed_scaling_factor=2.5)
    elif family == "glm4_moe":
        cfg = Glm4MoeConfig(**COMMON, **MOE, num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
                            n_group=1, topk_group=1, routed_scaling_factor=1.5)
    else:
        cfg = Glm4Config(**COMMON, num_key_value_heads=2, head_dim=16, attention_bias=True, pad_token_id=0,
                         eos_token_id=1)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


CLASSES = {"deepseek_v3": DeepseekV3ForCausalLM, "glm4_moe": Glm4MoeForCausalLM, "glm4": Glm4ForCausalLM}
FAMILIES = list(CLASSES)


def tiny_model(family: str, std: float = 1.0, **overrides):
    cfg = tiny_config(family, **overrides)
    torch.manual_seed(0)
    model = CLASSES[family](cfg).eval()
    with torch.no_grad():  # everything random (norms, biases, the router's correction bias) so misplacement shows
        for p in model.parameters():
            p.normal_(std=std)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(std=0.5)  # of the order of the sigmoid scores: it changes which experts win
    return cfg, model


_SAVED: dict = {}


def _saved(family: str, tmp_path_factory):
    if family not in _SAVED:
        cfg, model = tiny_model(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        _SAVED[family] = cfg, model, path
    return _SAVED[family]


@pytest.fixture(params=FAMILIES)
def saved(request, tmp_path_factory):
    return _saved(request.param, tmp_path_factory)


def _roundtrip(hf_state, cfg, tp: int, pp: int, ep: int, fused: bool = False) -> dict[str, torch.Tensor]:
    """Per rank hf_to_mcore, TP gather, mcore_to_hf per (PP stage, EP rank), as weight export does."""
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            shards = [bridge.hf_to_mcore(hf_state, cfg, tp_rank=r, tp_size=tp, pp_rank=pp_rank, pp_size=pp,
                                         ep_rank=ep_rank, ep_size=ep) for r in range(tp)]
            full = {n: bridge.gather_from_tp(n, [s[n] for s in shards]) for n in shards[0]}
            if ep_rank > 0:
                full = {n: t for n, t in full.items() if ".local_experts." in n}
            stream = bridge.mcore_to_hf(
                full.items(), cfg, layer_offset=bridge.pp_layer_range(cfg.num_hidden_layers, pp_rank, pp).start,
                expert_offset=bridge.expert_range(bridge.num_experts(cfg), ep_rank, ep).start if ep > 1 else 0,
                fused_experts=fused)
            for name, t in stream:
                assert name not in out, name
                out[name] = t
    return out


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]  # (tp, pp, ep); EP for the MoE families


@pytest.mark.parametrize("family,tp,pp,ep", [(f, *lay) for f in FAMILIES for lay in LAYOUTS
                                             if lay[2] == 1 or f != "glm4"])
def test_roundtrip_from_disk_is_exact(family, tp, pp, ep, tmp_path_factory):
    cfg, _, path = _saved(family, tmp_path_factory)
    hf = bridge.load_hf_safetensors(path)
    out = _roundtrip(hf, cfg, tp, pp, ep)
    assert set(out) == set(hf)
    for name in hf:
        assert torch.equal(out[name], hf[name]), name


def test_roundtrip_from_in_memory_state_dict_is_exact(saved):
    """transformers>=5 keeps experts stacked in memory: fused_experts=True reproduces that layout
    (this is what weight sync sends the rollout engine)."""
    cfg, model, _ = saved
    sd = model.state_dict()
    out = _roundtrip(sd, cfg, 2, 2, 1, fused=True)  # (fused buffering needs every expert in one stream)
    assert set(out) == set(sd)
    for name in sd:
        assert torch.equal(out[name], sd[name]), name


def test_megatron_names_and_shapes(saved):
    cfg, model, _ = saved
    sd = bridge.hf_to_mcore(model.state_dict(), cfg, tp_rank=1, tp_size=2)
    a0, a1, m1 = "decoder.layers.0.self_attention.", "decoder.layers.1.self_attention.", "decoder.layers.1.mlp."
    if cfg.model_type == "deepseek_v3":
        n = cfg.num_attention_heads
        assert sd[a0 + "linear_q_down_proj.weight"].shape == (cfg.q_lora_rank // 2, 64)  # ColumnParallel over TP
        assert sd[a0 + "linear_q_up_proj.weight"].shape == (n // 2 * 24, cfg.q_lora_rank)
        assert sd[a0 + "linear_kv_down_proj.weight"].shape == ((16 + 8) // 2, 64)
        assert sd[a0 + "linear_kv_up_proj.weight"].shape == (n // 2 * 32, 16)
        assert sd[a0 + "q_layernorm.weight"].shape == (32,) and sd[a0 + "kv_layernorm.weight"].shape == (16,)
        assert not any("linear_qkv" in k for k in sd)
    if cfg.model_type != "glm4":
        assert sd[m1 + "router.expert_bias"].dtype == torch.float32
        assert torch.equal(sd[m1 + "router.expert_bias"], model.model.layers[1].mlp.gate.e_score_correction_bias)
        assert sd[m1 + "shared_experts.linear_fc1.weight"].shape == (32, 64)  # [gate_r; up_r]: 2 * 32 / TP
        assert "decoder.layers.0.mlp.linear_fc1.weight" in sd  # first_k_dense_replace=1
        assert not any(k.startswith("decoder.layers.1.mlp.linear_fc1") for k in sd)
    else:
        assert sd[a1 + "post_layernorm.weight"].shape == (64,) and sd[m1 + "post_layernorm.weight"].shape == (64,)
        assert sd[m1 + "linear_fc1.weight"].shape == (96, 64)


def test_config_kwargs():
    kw = bridge.config_to_mcore_kwargs(tiny_config("deepseek_v3"))
    assert kw["multi_latent_attention"] and kw["qk_layernorm"] and kw["rope_type"] == "rope"
    assert (kw["q_lora_rank"], kw["kv_lora_rank"], kw["qk_head_dim"], kw["qk_pos_emb_head_dim"], kw["v_head_dim"]) == (
        32, 16, 16, 8, 16)
    assert kw["rotary_scaling_factor"] == 1.0 and kw["mscale_all_dim"] == 0.0  # softmax scale 1/sqrt(24), as HF
    assert kw["moe_layer_freq"] == [0, 1] and kw["num_moe_experts"] == 4 and kw["moe_ffn_hidden_size"] == 32
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_router_dtype"] == "fp32"
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"], kw["moe_router_topk_scaling_factor"]) == (2, 1, 2.5)
    assert kw["moe_shared_expert_intermediate_size"] == 32 and "moe_shared_expert_gate" not in kw
    assert bridge.gpt_model_kwargs(tiny_config("deepseek_v3"))["position_embedding_type"] == "rope"  # MLA's own

    kw = bridge.config_to_mcore_kwargs(tiny_config("glm4_moe"))
    assert kw["add_qkv_bias"] and kw["qk_layernorm"] and kw["kv_channels"] == 16 and kw["num_query_groups"] == 2
    assert kw["moe_router_num_groups"] is None and kw["moe_router_topk_scaling_factor"] == 1.5
    assert not bridge.config_to_mcore_kwargs(tiny_config("glm4_moe", attention_bias=False, use_qk_norm=False))[
        "add_qkv_bias"]
    kw = bridge.config_to_mcore_kwargs(tiny_config("glm4"))
    assert kw["add_qkv_bias"] and not kw["qk_layernorm"] and "num_moe_experts" not in kw
    assert bridge.gpt_model_kwargs(tiny_config("glm4"))["position_embedding_type"] == "none"  # polyrl's RoPE
    assert bridge.rope_pair_permutation(tiny_config("glm4")).tolist() == [0, 2, 4, 6, 1, 3, 5, 7, *range(8, 16)]


@pytest.mark.parametrize("family,overrides,match", [
    ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob"),
    ("deepseek_v3", dict(num_experts_per_tok=4, n_routed_experts=8), "must be 2"),
    ("deepseek_v3", dict(q_lora_rank=None), "q_lora_rank"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias"),
    ("glm4", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
])
def test_unsupported_variants_are_refused(family, overrides, match):
    with pytest.raises(ValueError, match=match):
        bridge.config_to_mcore_kwargs(tiny_config(family, **overrides))


# --------------------------------------------------------------------------------------------
# megatron-core 0.19's forward math (written from its source) over the bridge's tensors vs HF.
# FP32 throughout; weights std 0.2 keep activations O(1), so only summation order differs and
# rtol 1e-4 / atol 1e-5 holds with a wide margin (observed differences are ~1e-7).

def _params(state, prefix):
    return {n[len(prefix):]: t for n, t in state.items() if n.startswith(prefix)}


def _rms(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _causal_attention(q, k, v, scale):
    """q, k [s, n, d], v [s, n, dv] -> [s, n * dv]"""
    s = q.shape[0]
    scores = torch.einsum("snd,tnd->nst", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("nst,tnd->snd", scores.softmax(-1), v).reshape(s, -1)


def _megatron_rope_freqs(dim: int, base: float, s: int):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # RotaryEmbedding
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [s, 1, dim]


def _mla_rope(t, freqs):
    """_apply_rotary_pos_emb_bshd(mla_rotary_interleaved=True): de-interleave pairs, then rotate-half."""
    t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    t1, t2 = t.chunk(2, dim=-1)
    return t * freqs.cos() + torch.cat((-t2, t1), dim=-1) * freqs.sin()


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_matches_hf_attention(tp):
    cfg, model = tiny_model("deepseek_v3", std=0.2)
    sd = model.state_dict()
    ranks = [_params(bridge.hf_to_mcore(sd, cfg, tp_rank=r, tp_size=tp), "decoder.layers.0.self_attention.")
             for r in range(tp)]
    dn, dr, dv, n = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.num_attention_heads // tp
    torch.manual_seed(1)
    s = 7
    x = torch.randn(1, s, cfg.hidden_size)
    pos = torch.arange(s)[None]
    with torch.no_grad():
        ref, _ = model.model.layers[0].self_attn(x, position_embeddings=model.model.rotary_emb(x, pos),
                                                 attention_mask=torch.full((s, s), float("-inf")).triu(1)[None, None])
        xs = x[0]
        # ColumnParallel down projections, gathered over TP (MLASelfAttention._qkv_down_projection)
        q_c = torch.cat([F.linear(xs, r["linear_q_down_proj.weight"]) for r in ranks], -1)
        kv = torch.cat([F.linear(xs, r["linear_kv_down_proj.weight"]) for r in ranks], -1)
        kv_c, k_pe = kv.split([cfg.kv_lora_rank, dr], -1)
        freqs = _megatron_rope_freqs(dr, 10000.0, s)
        out = 0
        for r in ranks:
            q = F.linear(_rms(q_c, r["q_layernorm.weight"], cfg.rms_norm_eps), r["linear_q_up_proj.weight"])
            q = q.view(s, n, dn + dr)
            kvu = F.linear(_rms(kv_c, r["kv_layernorm.weight"], cfg.rms_norm_eps), r["linear_kv_up_proj.weight"])
            k_nope, v = kvu.view(s, n, dn + dv).split([dn, dv], -1)
            q = torch.cat([q[..., :dn], _mla_rope(q[..., dn:], freqs)], -1)
            k = torch.cat([k_nope, _mla_rope(k_pe[:, None, :], freqs).expand(-1, n, -1)], -1)
            ctx = _causal_attention(q, k, v, 1.0 / math.sqrt(dn + dr))  # MLA softmax_scale, mscale 1
            out = out + F.linear(ctx, r["linear_proj.weight"])  # row parallel: partial sums
        torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_glm4_layer_matches_hf(tp):
    """GLM4's interleaved partial RoPE through the permuted q/k rows and polyrl's rotate-half RoPE
    (thd.apply_rope with the HF rotary tables, as VarlenCoreAttention applies them), the post norms and
    the fused gate_up MLP, against Glm4Attention + post_self_attn_layernorm and Glm4MLP + post_mlp_layernorm."""
    cfg, model = tiny_model("glm4", std=0.2)
    sd = model.state_dict()
    ranks = [bridge.hf_to_mcore(sd, cfg, tp_rank=r, tp_size=tp) for r in range(tp)]
    nq, ng, hd = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp, cfg.head_dim
    torch.manual_seed(1)
    s = 7
    x = torch.randn(1, s, cfg.hidden_size)
    cos, sin = model.model.rotary_emb(x, torch.arange(s)[None])
    assert cos.shape[-1] == hd // 2  # partial rotary: the HF tables cover r = head_dim / 2 channels
    layer = model.model.layers[0]
    with torch.no_grad():
        attn, _ = layer.self_attn(x, position_embeddings=(cos, sin),
                                  attention_mask=torch.full((s, s), float("-inf")).triu(1)[None, None])
        ref = layer.post_self_attn_layernorm(attn)[0]
        out = 0
        for r in ranks:
            p = _params(r, "decoder.layers.0.self_attention.")
            mixed = F.linear(x[0], p["linear_qkv.weight"], p["linear_qkv.bias"]).view(s, ng, (nq // ng + 2) * hd)
            q, k, v = mixed.split([nq // ng * hd, hd, hd], dim=-1)
            q = q.reshape(s, nq, hd)
            q, k = thd.apply_rope(q, cos[0, :, None], sin[0, :, None]), thd.apply_rope(k, cos[0, :, None], sin[0, :, None])
            ctx = _causal_attention(q, k.repeat_interleave(nq // ng, 1), v.repeat_interleave(nq // ng, 1), hd ** -0.5)
            out = out + F.linear(ctx, p["linear_proj.weight"])
        post = ranks[0]["decoder.layers.0.self_attention.post_layernorm.weight"]
        torch.testing.assert_close(_rms(out, post, cfg.rms_norm_eps), ref, rtol=1e-4, atol=1e-5)

        ref = layer.post_mlp_layernorm(layer.mlp(x))[0]
        out = 0
        for r in ranks:
            gate, up = F.linear(x[0], r["decoder.layers.0.mlp.linear_fc1.weight"]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, r["decoder.layers.0.mlp.linear_fc2.weight"])
        post = ranks[0]["decoder.layers.0.mlp.post_layernorm.weight"]
        torch.testing.assert_close(_rms(out, post, cfg.rms_norm_eps), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_moe_layer_matches_hf(family):
    """Router (sigmoid, expert_bias from e_score_correction_bias, groups, scaling) + SequentialMLP experts
    split over EP=2 + the plain shared expert, from the bridge's tensors and config kwargs."""
    cfg, model = tiny_model(family, std=0.2)
    kw = bridge.config_to_mcore_kwargs(cfg)
    sd = model.state_dict()
    ep = 2
    ranks = [_params(bridge.hf_to_mcore(sd, cfg, ep_rank=r, ep_size=ep), "decoder.layers.1.mlp.") for r in range(ep)]
    torch.manual_seed(2)
    x = torch.randn(1, 16, cfg.hidden_size)
    tokens = x[0]
    with torch.no_grad():
        ref = model.model.layers[1].mlp(x)[0]
        logits = F.linear(tokens, ranks[0]["router.weight"])
        probs, idx = megatron_sigmoid_routing(logits, kw, ranks[0]["router.expert_bias"])
        _, unbiased = megatron_sigmoid_routing(logits, kw, torch.zeros(4))
        assert not torch.equal(idx.sort(-1).values, unbiased.sort(-1).values)  # the bias changes some choices
        out = torch.zeros_like(tokens)
        for ep_rank, r in enumerate(ranks):
            for local, e in enumerate(bridge.expert_range(4, ep_rank, ep)):
                gate, up = F.linear(tokens, r[f"experts.local_experts.{local}.linear_fc1.weight"]).chunk(2, -1)
                y = F.linear(F.silu(gate) * up, r[f"experts.local_experts.{local}.linear_fc2.weight"])
                out += (probs * (idx == e)).sum(-1, keepdim=True) * y
        gate, up = F.linear(tokens, ranks[0]["shared_experts.linear_fc1.weight"]).chunk(2, -1)
        out += F.linear(F.silu(gate) * up, ranks[0]["shared_experts.linear_fc2.weight"])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
