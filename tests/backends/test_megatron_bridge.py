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


def test_block_fp8_checkpoints_read_dequantized(saved, tmp_path):
    """A block-FP8 checkpoint (polyrl's own FP8 copy: quantization_config fp8, weight + weight_scale_inv, as the
    Qwen3-*-FP8 / MiMo-V2-Flash releases store theirs) reads as the dequantized weights under the unquantized names,
    its scales unlisted, and converts to megatron and back like the BF16 one (sharded or single-file)."""
    from polyrl.weight_sync.fp8_checkpoint import write_fp8_checkpoint
    from polyrl.weight_sync.quantize import dequantize_fp8_block
    from safetensors import safe_open
    cfg, _, path = saved
    dst = write_fp8_checkpoint(str(path), str(tmp_path / "fp8"))
    plain, fp8 = load_hf_safetensors(path), load_hf_safetensors(dst)
    assert set(fp8) == set(plain) and not any(n.endswith("_scale_inv") for n in fp8)
    raw = {}
    for f in (tmp_path / "fp8").glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            raw.update({k: h.get_tensor(k) for k in h.keys()})
    quantized = [n for n in plain if raw[n].dtype == torch.float8_e4m3fn]
    assert quantized and all(n + "_scale_inv" in raw for n in quantized)
    for n in plain:
        # exactly the block dequantization; E4M3 keeps 3 mantissa bits, so each value is within 2^-4 of itself (and
        # subnormals within 2^-9 of the block's scale), below 0.07 of the tensor's largest magnitude
        if n in quantized:
            assert torch.equal(fp8[n], dequantize_fp8_block(raw[n], raw[n + "_scale_inv"])), n
            w = plain[n].float()
            assert (fp8[n] - w).abs().max() <= 0.07 * w.abs().max(), n
        else:
            assert torch.equal(fp8[n], plain[n]), n
    out = _roundtrip(fp8, cfg, 2, 1, 1)
    assert set(out) == set(plain) and all(torch.equal(out[n], fp8[n].to(out[n].dtype)) for n in quantized[:4])


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
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*'llama', 'mimo', 'mimo_v2_flash', 'qwen2', 'qwen3', 'qwen3_5_text', 'qwen3_moe'"):
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


# --------------------------------------------------------------------------------------------
# GPT-OSS, MiMo (with MTP layers) and Qwen3.5 (text): tiny models from their config classes (MiMo from
# polyrl.hf_families, written from MiMo-7B's checkpoint names), random weights, exact round trips.

def _make_new(family: str, std: float = 1.0):
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from polyrl.hf_families import MiMoConfig, MiMoForCausalLM

    if family == "gpt_oss":  # layer 0 sliding, layer 1 full; 4 experts so EP=2 holds 2 each
        cfg = GptOssConfig(**{**COMMON, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=4, tie_word_embeddings=False)
        cls = GptOssForCausalLM
    elif family == "mimo":  # Qwen2 decoder + 2 MTP layers
        cfg, cls = MiMoConfig(**COMMON, num_nextn_predict_layers=2, tie_word_embeddings=False), MiMoForCausalLM
    else:  # 3 DeltaNet layers, 1 gated full attention; 2 key heads so TP=2 splits them
        cfg = Qwen3_5TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, linear_num_key_heads=2,
                                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                tie_word_embeddings=False)
        cls = Qwen3_5ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=std)
    return cfg, model


NEW_FAMILIES = ["gpt_oss", "mimo", "qwen3_5_text"]
_NEW_SAVED: dict = {}


def _new_saved(family, tmp_path_factory):
    if family not in _NEW_SAVED:
        cfg, model = _make_new(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        _NEW_SAVED[family] = cfg, model, path
    return _NEW_SAVED[family]


def _roundtrip_cfg(hf_state, cfg, tp, pp):
    """As _roundtrip (no EP), passing hf_config to the TP gather (the DeltaNet's q | k | v parts)."""
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        shards = [hf_to_mcore(hf_state, cfg, tp_rank=r, tp_size=tp, pp_rank=pp_rank, pp_size=pp) for r in range(tp)]
        full = {n: gather_from_tp(n, [s[n] for s in shards], cfg) for n in shards[0]}
        for name, t in mcore_to_hf(full.items(), cfg, layer_offset=pp_layer_range(cfg.num_hidden_layers, pp_rank, pp).start):
            assert name not in out, name
            out[name] = t
    return out


NEW_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)]


@pytest.mark.parametrize("family,tp,pp", [(f, tp, pp) for f in NEW_FAMILIES for tp, pp, _ in NEW_LAYOUTS])
def test_new_family_roundtrip_from_disk_is_exact(family, tp, pp, tmp_path_factory):
    cfg, _, path = _new_saved(family, tmp_path_factory)
    hf = load_hf_safetensors(path)
    out = _roundtrip_cfg(hf, cfg, tp, pp)
    assert set(out) == set(hf)
    for name in hf:
        assert torch.equal(out[name], hf[name]), name


def test_gpt_oss_expert_parallel_roundtrip_is_exact(tmp_path_factory):
    """EP=2: each rank's two experts come back stacked only when the stream carries all four (weight export gathers
    experts over EP before mcore_to_hf, as for fused_experts)."""
    cfg, model, path = _new_saved("gpt_oss", tmp_path_factory)
    hf = load_hf_safetensors(path)
    ranks = [hf_to_mcore(hf, cfg, ep_rank=r, ep_size=2) for r in range(2)]
    renamed = dict(ranks[0])
    for n, t in ranks[1].items():  # rank 1's local experts 0, 1 are global 2, 3
        if ".local_experts." in n:
            pre, rest = n.split(".local_experts.")
            i, tail = rest.split(".", 1)
            renamed[f"{pre}.local_experts.{int(i) + 2}.{tail}"] = t
    out = dict(mcore_to_hf(renamed.items(), cfg))
    assert set(out) == set(hf)
    assert all(torch.equal(out[n], hf[n]) for n in hf)
    with pytest.raises(ValueError, match="stacked experts missing"):
        list(mcore_to_hf(ranks[0].items(), cfg))  # half the experts: refused, not a silently short tensor


def test_new_family_names_and_shapes(tmp_path_factory):
    cfg, model, _ = _new_saved("gpt_oss", tmp_path_factory)
    sd = model.state_dict()
    mc = hf_to_mcore(sd, cfg, tp_rank=1, tp_size=2)
    e = "decoder.layers.0.mlp.experts.local_experts.3."
    w = sd["model.layers.0.mlp.experts.gate_up_proj"][3]  # [H, 2I], gate / up interleaved in the columns
    fc1 = torch.cat([w[:, 0::2].T, w[:, 1::2].T])  # [gate; up] as megatron's glu chunks it
    assert torch.equal(gather_from_tp(e + "linear_fc1.weight", [hf_to_mcore(sd, cfg, tp_rank=r, tp_size=2)[
        e + "linear_fc1.weight"] for r in range(2)]), fc1)
    assert mc[e + "linear_fc1.weight"].shape == (32, 64) and mc[e + "linear_fc1.bias"].shape == (32,)  # 2I / TP
    assert mc[e + "linear_fc2.weight"].shape == (64, 16) and mc[e + "linear_fc2.bias"].shape == (64,)
    assert mc["decoder.layers.0.mlp.router.bias"].shape == (4,)
    assert mc["decoder.layers.0.self_attention.hf.sinks"].shape == (4,)  # wrapped HF attention, replicated
    assert mc["decoder.layers.1.self_attention.hf.q_proj.bias"].shape == (64,)

    cfg, model, _ = _new_saved("mimo", tmp_path_factory)
    mc = hf_to_mcore(model.state_dict(), cfg, tp_rank=0, tp_size=2)
    assert mc["mtp.layers.1.eh_proj.weight"].shape == (32, 128)  # column parallel [H/TP, 2H]
    assert mc["mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.bias"].shape == ((4 + 4) * 16 // 2,)
    assert not any(n.startswith("mtp.") for n in hf_to_mcore(model.state_dict(), cfg, pp_rank=0, pp_size=2))

    cfg, model, _ = _new_saved("qwen3_5_text", tmp_path_factory)
    mc = hf_to_mcore(model.state_dict(), cfg, tp_rank=1, tp_size=2)
    a = "decoder.layers.0.self_attention.hf."
    full = model.state_dict()["model.layers.0.linear_attn.in_proj_qkv.weight"]  # rows q (32) | k (32) | v (64)
    assert torch.equal(mc[a + "in_proj_qkv.weight"], torch.cat([full[16:32], full[48:64], full[96:128]]))
    assert mc[a + "in_proj_z.weight"].shape == (32, 64) and mc[a + "in_proj_b.weight"].shape == (2, 64)
    assert mc["decoder.layers.3.self_attention.hf.q_proj.weight"].shape == (128, 64)  # gated: q and gate rows
    assert config_to_mcore_kwargs(cfg)["layernorm_zero_centered_gamma"] and "num_moe_experts" not in \
        config_to_mcore_kwargs(cfg)


def test_mimo_mtp_eh_proj_matches_the_hf_mtp_layer():
    """megatron-core's MTP layer computes eh_proj(cat([enorm(embedding), hnorm(hidden)])); from the bridge's tensors
    that equals MiMo's input_proj(cat([hidden_layernorm(hidden), token_layernorm(embedding)])), and the whole MTP layer
    (megatron-layout qkv, fc1) reproduces the HF module."""
    cfg, model = _make_new("mimo", std=0.2)
    mc = hf_to_mcore(model.state_dict(), cfg)
    layer = model.model.mtp_layers[0]
    torch.manual_seed(3)
    s = 6
    emb, hid = torch.randn(1, s, 64), torch.randn(1, s, 64)
    cos, sin = model.model.rotary_emb(hid, torch.arange(s)[None])
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
    p = {n[len("mtp.layers.0."):]: t for n, t in mc.items() if n.startswith("mtp.layers.0.")}
    rms = lambda x, w: F.rms_norm(x, (64,), w, cfg.rms_norm_eps)  # noqa: E731
    with torch.no_grad():
        ref = layer(emb, hid, (cos, sin), causal)[0]
        x = F.linear(torch.cat([rms(emb, p["enorm.weight"]), rms(hid, p["hnorm.weight"])], -1), p["eh_proj.weight"])[0]
        t = {k[len("mtp_model_layer."):]: v for k, v in p.items() if k.startswith("mtp_model_layer.")}
        attn = _mcore_attention(rms(x, t["input_layernorm.weight"])[:, None], _layer_params(
            {f"decoder.layers.0.{k}": v for k, v in t.items()}, 0, "self_attention"), 4, 2, 16, cfg.rms_norm_eps,
            cos[0], sin[0])[:, 0]
        x = x + attn
        x = x + _mcore_mlp(rms(x, t["pre_mlp_layernorm.weight"]), t["mlp.linear_fc1.weight"], t["mlp.linear_fc2.weight"])
        torch.testing.assert_close(rms(x, p["final_layernorm.weight"]), ref, rtol=1e-4, atol=1e-5)


def test_gpt_oss_mxfp4_checkpoint_is_dequantized_on_read(tmp_path):
    """A checkpoint whose experts are MXFP4 blocks / scales reads as the dequantized tensors, equal to transformers'
    own dequantizer's output (bf16)."""
    from safetensors.torch import save_file

    from polyrl.backends.mxfp4 import dequantize_mxfp4

    cfg, model = _make_new("gpt_oss")
    sd = {n: t.contiguous() for n, t in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    quant = {}
    for layer in range(2):
        for proj, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):  # [E, R, G, 16], R = out rows
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            del sd[name]
            quant[name] = (torch.randint(0, 256, (4, rows, cols // 32, 16), dtype=torch.uint8, generator=g),
                           torch.randint(124, 130, (4, rows, cols // 32), dtype=torch.uint8, generator=g))
            sd[name + "_blocks"], sd[name + "_scales"] = quant[name]
    save_file(sd, str(tmp_path / "model.safetensors"))
    hf = load_hf_safetensors(tmp_path)
    out = dict(mcore_to_hf(hf_to_mcore(hf, cfg).items(), cfg))
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:  # pragma: no cover (older transformers)
        convert_moe_packed_tensors = None
    for name, (blocks, scales) in quant.items():
        mine = dequantize_mxfp4(blocks, scales)
        assert mine.shape == model.state_dict()[name].shape
        if convert_moe_packed_tensors is not None:
            assert torch.equal(mine, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
        assert torch.equal(out[name], mine)  # exported under the unquantized name, dequantized values


def test_megatron_model_build_is_refused_where_not_built():
    cfg, _ = _make_new("gpt_oss")  # GPT-OSS builds: biased MoE from megatron-core's config (megatron/gpt_oss.py)
    assert config_to_mcore_kwargs(cfg)["add_bias_linear"]
    cfg, _ = _make_new("mimo")  # MiMo with MTP layers builds: a Qwen2 decoder plus megatron/mtp.py's block
    assert config_to_mcore_kwargs(cfg)["add_qkv_bias"] and gpt_model_kwargs(cfg)["position_embedding_type"] == "none"
