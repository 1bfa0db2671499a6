"""HF <-> megatron-core bridge (CPU; megatron-core not needed).

Round trips every supported family through TP / PP / EP layouts and back, bit-exactly, and checks
the megatron layout numerically with a pure-torch re-implementation of megatron's attention / MLP /
MoE forward (qkv split exactly as `get_query_key_value_tensors`) against the HF modules.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from polyrl.backends.megatron.bridge import (
    config_to_mcore_kwargs,
    expert_range,
    fuse_qkv,
    gather_from_tp,
    gpt_model_kwargs,
    hf_to_mcore,
    load_hf_safetensors,
    mcore_to_hf,
    padded_vocab_size,
    pp_layer_range,
    shard_for_tp,
    split_qkv,
)

COMMON = dict(
    vocab_size=100,  # pads to 128 (TP=1) / 256 (TP=2)
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _make(family: str, std: float = 1.0, **overrides):
    if family == "llama":
        cfg, cls = LlamaConfig(**COMMON, tie_word_embeddings=False), LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = Qwen2Config(**COMMON, tie_word_embeddings=True), Qwen2ForCausalLM
    elif family == "qwen3":  # head_dim != hidden / heads, as in real Qwen3 checkpoints
        cfg, cls = Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False), Qwen3ForCausalLM
    else:  # layer 0 MoE, layer 1 dense (mlp_only_layers)
        cfg = Qwen3MoeConfig(
            **COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True,
        )
        cls = Qwen3MoeForCausalLM
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # random everything (norms, biases too) so a misplaced tensor cannot hide
        for p in model.parameters():
            p.normal_(std=std)
    return cfg, model


FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    cfg, model = _make(request.param)
    path = tmp_path_factory.mktemp(request.param)
    # qwen3 goes through the sharded index path
    model.save_pretrained(path, max_shard_size="60KB" if request.param == "qwen3" else "1GB")
    return cfg, model, path


def _roundtrip(hf_state, cfg, tp: int, pp: int, ep: int, fused: bool = False) -> dict[str, torch.Tensor]:
    """Convert per rank, gather TP, export each (PP stage, EP rank) like weight sync does."""
    out: dict[str, torch.Tensor] = {}
    moe = cfg.model_type == "qwen3_moe"
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            shards = [
                hf_to_mcore(
                    hf_state, cfg, tp_rank=r, tp_size=tp, pp_rank=pp_rank, pp_size=pp, ep_rank=ep_rank, ep_size=ep
                )
                for r in range(tp)
            ]
            assert all(s.keys() == shards[0].keys() for s in shards)
            full = {n: gather_from_tp(n, [s[n] for s in shards]) for n in shards[0]}
            if ep_rank > 0:  # non-expert params are replicated over EP: export them once
                full = {n: t for n, t in full.items() if ".local_experts." in n}
            stream = mcore_to_hf(
                full.items(), cfg,
                layer_offset=pp_layer_range(cfg.num_hidden_layers, pp_rank, pp).start,
                expert_offset=expert_range(cfg.num_experts, ep_rank, ep).start if moe else 0,
                fused_experts=fused,
            )
            for name, t in stream:
                assert name not in out, name
                out[name] = t
    return out


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2)]  # (tp, pp, ep)
# EP splits experts: the layouts with ep > 1 apply to the MoE family only
ROUNDTRIPS = [(f, *layout) for f in FAMILIES for layout in LAYOUTS if layout[2] == 1 or f == "qwen3_moe"]


@pytest.mark.parametrize("saved,tp,pp,ep", ROUNDTRIPS, indirect=["saved"])
def test_roundtrip_from_disk_is_exact(saved, tp, pp, ep):
    cfg, _, path = saved
    hf = load_hf_safetensors(path)
    out = _roundtrip(hf, cfg, tp, pp, ep)
    assert set(out) == set(hf)
    for name in hf:
        assert torch.equal(out[name], hf[name]), name


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_roundtrip_from_in_memory_state_dict_is_exact(saved, tp, pp):
    """transformers>=5 state_dict() stacks MoE experts; fused_experts=True reproduces it."""
    cfg, model, _ = saved
    sd = model.state_dict()
    out = _roundtrip(sd, cfg, tp, pp, 1, fused=True)
    expected = {n for n in sd if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    assert set(out) == expected
    for name in expected:
        assert torch.equal(out[name], sd[name]), name


def test_safetensors_loader_reads_sharded_index(saved):
    cfg, model, path = saved
    hf = load_hf_safetensors(path)
    sharded = (path / "model.safetensors.index.json").exists()
    assert sharded == (cfg.model_type == "qwen3")
    assert "model.norm.weight" in hf and "nope" not in hf
    assert torch.equal(hf["model.norm.weight"], model.state_dict()["model.norm.weight"])


def test_shapes_padding_and_tied_output_layer():
    cfg, model = _make("qwen2")  # tied
    sd = model.state_dict()
    h, hd, nq, ng = 64, 16, 4, 2
    r1 = hf_to_mcore(sd, cfg, tp_rank=1, tp_size=2)
    assert r1["embedding.word_embeddings.weight"].shape == (256 // 2, h)
    assert r1["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((nq + 2 * ng) * hd // 2, h)
    assert r1["decoder.layers.0.self_attention.linear_qkv.bias"].shape == ((nq + 2 * ng) * hd // 2,)
    assert r1["decoder.layers.0.self_attention.linear_proj.weight"].shape == (h, nq * hd // 2)
    assert r1["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96, h)
    assert r1["decoder.layers.0.mlp.linear_fc2.weight"].shape == (h, 48)
    assert "output_layer.weight" not in r1  # tied, single stage: megatron allocates no output weight
    # rank 1 holds vocab rows 128..255: all padding (zeros)
    assert not r1["embedding.word_embeddings.weight"].any()
    # tied + PP: the last stage keeps its own copy of the embedding, the first owns the embedding
    s0 = hf_to_mcore(sd, cfg, pp_rank=0, pp_size=2)
    s1 = hf_to_mcore(sd, cfg, pp_rank=1, pp_size=2)
    assert "output_layer.weight" not in s0 and "decoder.final_layernorm.weight" not in s0
    assert "embedding.word_embeddings.weight" not in s1
    assert torch.equal(s1["output_layer.weight"], s0["embedding.word_embeddings.weight"])
    assert {n.split(".")[2] for n in s1 if n.startswith("decoder.layers.")} == {"0"}  # renumbered
    assert [padded_vocab_size(v, tp) for v, tp in [(100, 1), (128, 1), (129, 2)]] == [128, 128, 256]


def test_expert_parallel_renumbering():
    cfg, model = _make("qwen3_moe")
    sd = model.state_dict()
    r1 = hf_to_mcore(sd, cfg, ep_rank=1, ep_size=2)
    prefix = "decoder.layers.0.mlp.experts.local_experts."
    assert {n[len(prefix):].split(".")[0] for n in r1 if n.startswith(prefix)} == {"0", "1"}
    gate_up = sd["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, H], gate rows first
    assert torch.equal(r1[prefix + "0.linear_fc1.weight"], gate_up[2])
    assert torch.equal(r1[prefix + "1.linear_fc2.weight"], sd["model.layers.0.mlp.experts.down_proj"][3])
    assert "decoder.layers.1.mlp.linear_fc1.weight" in r1  # layer 1 is dense (mlp_only_layers)
    assert list(expert_range(8, 3, 4)) == [6, 7]


def test_qkv_layout_hand_built():
    # 4 heads, 2 query groups, head_dim 2, hidden 1: q head i = rows [2i, 2i+1]
    q = torch.arange(8.0)[:, None]
    k = 100 + torch.arange(4.0)[:, None]
    v = 200 + torch.arange(4.0)[:, None]
    fused = fuse_qkv(q, k, v, num_query_groups=2)
    # [q0 q1 k0 v0 | q2 q3 k1 v1]
    expected = [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert fused[:, 0].tolist() == expected
    assert fuse_qkv(q[:, 0], k[:, 0], v[:, 0], 2).tolist() == expected  # bias layout
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, 4, 2), (q, k, v)))
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    # TP=2: one whole group per rank
    assert shard_for_tp(name, fused, 1, 2)[:, 0].tolist() == expected[8:]
    # TP=4 > groups: contiguous quarters, as megatron's ColumnParallelLinear holds them
    quarters = [shard_for_tp(name, fused, r, 4) for r in range(4)]
    assert quarters[1][:, 0].tolist() == [100, 101, 200, 201]
    assert torch.equal(gather_from_tp(name, quarters), fused)


def test_fc1_tp_shard_keeps_gate_and_up_halves():
    fc1 = torch.arange(8.0)[:, None]  # gate rows 0..3, up rows 4..7
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    shards = [shard_for_tp(name, fc1, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 4, 5] and shards[1][:, 0].tolist() == [2, 3, 6, 7]
    assert torch.equal(gather_from_tp(name, shards), fc1)


def test_unsupported_model_type_errors_clearly():
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*'llama', 'qwen2', 'qwen3', 'qwen3_moe'"):
        config_to_mcore_kwargs(GPT2Config())
    with pytest.raises(ValueError, match="unknown megatron parameter"):
        list(mcore_to_hf([("decoder.layers.0.foo.weight", torch.zeros(1))], LlamaConfig(**COMMON)))


def test_config_kwargs():
    cfg, _ = _make("qwen3_moe")
    kw = config_to_mcore_kwargs(cfg)
    assert (kw["kv_channels"], kw["num_query_groups"], kw["qk_layernorm"], kw["add_qkv_bias"]) == (16, 2, True, False)
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 32
    assert kw["moe_layer_freq"] == [1, 0] and kw["moe_router_pre_softmax"] is False
    assert kw["activation_func"] is F.silu and kw["normalization"] == "RMSNorm"
    assert config_to_mcore_kwargs(_make("qwen2")[0])["add_qkv_bias"]
    mk = gpt_model_kwargs(cfg, tp_size=2)
    assert mk["vocab_size"] == 256 and mk["share_embeddings_and_output_weights"]
    # RoPE is applied by polyrl's core attention from the HF rotary module (any rope type), not megatron
    assert mk["position_embedding_type"] == "none"


# --------------------------------------------------------------------------------------------
# Numerical check of the layout: megatron's forward math over megatron-layout (and TP-sharded)
# weights, written from megatron-core 0.19 source, against the HF modules.


def _rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def _mcore_attention(x, p, nq, ng, hd, eps, cos, sin):
    """One TP rank of megatron SelfAttention. x [s, b, h]; nq/ng: heads/groups on this rank."""
    s, b, _ = x.shape
    mixed = F.linear(x, p["linear_qkv.weight"], p.get("linear_qkv.bias"))
    # get_query_key_value_tensors: [s, b, ng, (nq/ng + 2) * hd] -> split (q heads, k, v)
    mixed = mixed.view(s, b, ng, (nq // ng + 2) * hd)
    q, k, v = torch.split(mixed, [nq // ng * hd, hd, hd], dim=3)
    q = q.reshape(s, b, nq, hd)
    if "q_layernorm.weight" in p:
        q = F.rms_norm(q, (hd,), p["q_layernorm.weight"], eps)
        k = F.rms_norm(k, (hd,), p["k_layernorm.weight"], eps)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # non-interleaved rope
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    # DotProductAttention: key/value.repeat_interleave(nq // ng, dim=2)
    k, v = k.repeat_interleave(nq // ng, dim=2), v.repeat_interleave(nq // ng, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, nq * hd)
    return F.linear(ctx, p["linear_proj.weight"])  # row parallel: partial sum over ranks


def _mcore_mlp(x, fc1, fc2):
    gate, up = F.linear(x, fc1).chunk(2, dim=-1)  # megatron glu: chunk of this rank's fc1 output
    return F.linear(F.silu(gate) * up, fc2)


def _layer_params(state, layer, sub):
    prefix = f"decoder.layers.{layer}.{sub}."
    return {n[len(prefix):]: t for n, t in state.items() if n.startswith(prefix)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_attention_and_mlp_match_hf(family, tp):
    cfg, model = _make(family, std=0.2)  # moderate activations keep the float32 comparison tight
    sd = model.state_dict()
    nq, ng, hd = cfg.num_attention_heads, cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or 16
    ranks = [hf_to_mcore(sd, cfg, tp_rank=r, tp_size=tp) for r in range(tp)]
    torch.manual_seed(1)
    b, s = 2, 5
    x = torch.randn(b, s, cfg.hidden_size)
    pos = torch.arange(s)[None].expand(b, s)
    cos, sin = model.model.rotary_emb(x, pos)
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
    layer = model.model.layers[0]
    with torch.no_grad():
        ref, _ = layer.self_attn(x, position_embeddings=(cos, sin), attention_mask=causal)
        xs = x.transpose(0, 1)  # megatron is [s, b, h]
        out = sum(  # each rank: its heads and groups; linear_proj outputs are summed (row parallel)
            _mcore_attention(
                xs, _layer_params(r, 0, "self_attention"), nq // tp, ng // tp, hd, cfg.rms_norm_eps, cos[0], sin[0]
            )
            for r in ranks
        )
        torch.testing.assert_close(out.transpose(0, 1), ref, rtol=1e-4, atol=1e-5)

        dense = 1 if family == "qwen3_moe" else 0
        ref = model.model.layers[dense].mlp(x)
        mlp = [_layer_params(r, dense, "mlp") for r in ranks]
        out = sum(_mcore_mlp(xs, p["linear_fc1.weight"], p["linear_fc2.weight"]) for p in mlp)
        torch.testing.assert_close(out.transpose(0, 1), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_layer_matches_hf(norm_topk_prob):
    """Router (with the pre_softmax flag from config_to_mcore_kwargs) + SequentialMLP experts."""
    cfg, model = _make("qwen3_moe", std=0.2, norm_topk_prob=norm_topk_prob)
    pre_softmax = config_to_mcore_kwargs(cfg)["moe_router_pre_softmax"]
    sd = model.state_dict()
    ep = 2
    ranks = [hf_to_mcore(sd, cfg, ep_rank=r, ep_size=ep) for r in range(ep)]
    torch.manual_seed(2)
    x = torch.randn(2, 5, cfg.hidden_size)
    tokens = x.reshape(-1, cfg.hidden_size)
    with torch.no_grad():
        ref = model.model.layers[0].mlp(x).reshape(-1, cfg.hidden_size)
        logits = F.linear(tokens, ranks[0]["decoder.layers.0.mlp.router.weight"])
        if pre_softmax:  # topk_routing_with_score_function, score_function="softmax"
            probs, idx = torch.topk(logits.softmax(-1), cfg.num_experts_per_tok, dim=-1)
        else:
            top, idx = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)
            probs = top.softmax(-1)
        out = torch.zeros_like(tokens)
        for ep_rank, r in enumerate(ranks):
            for local, e in enumerate(expert_range(cfg.num_experts, ep_rank, ep)):
                p = _layer_params(r, 0, f"mlp.experts.local_experts.{local}")
                weight = (probs * (idx == e)).sum(-1, keepdim=True)
                out += weight * _mcore_mlp(tokens, p["linear_fc1.weight"], p["linear_fc2.weight"])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
