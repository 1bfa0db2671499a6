"""MiMo-V2-Flash on the megatron backend, CPU half (megatron-core not needed): the bridge's tensors round-trip
bit-exactly through TP / PP / EP layouts from the checkpoint (per-expert names, sinks stored as
`attention_sink_bias`) and from the in-memory state dict (stacked experts, `sinks`); the TransformerConfig fields of
the sigmoid router (correction bias fixed, groups, scaling) reproduce HF's MiMoV2FlashMoE when run through a
pure-torch copy of megatron-core 0.19's routing and SequentialMLP; and the whole megatron layer layout (HF-wrapped
attention with sinks / sliding windows / narrow value heads, dense then MoE MLPs, the norms) gives the HF model's
logits on a packed batch. The tiny model is the GPU harness's (`build_mimo_v2_flash`)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from polyrl.backends.megatron import bridge

from tiny_models import assert_packed_layout_matches_hf, megatron_sigmoid_routing, tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_hf(tmp_path_factory, "build_mimo_v2_flash", "eager")


def test_megatron_config_fields(tiny):
    _, cfg, _ = tiny
    kw = bridge.config_to_mcore_kwargs(cfg)  # no longer refused
    assert kw["moe_layer_freq"] == [0, 1, 1, 1]  # mlp_layer_types: dense, then sparse
    assert kw["ffn_hidden_size"] == 96 and kw["moe_ffn_hidden_size"] == 32 and kw["num_moe_experts"] == 8
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0  # HF's correction bias is a fixed buffer
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"], kw["moe_router_topk"]) == (2, 1, 2)
    assert kw["moe_router_topk_scaling_factor"] == 2.5 and kw["moe_router_load_balancing_type"] == "none"
    assert "moe_shared_expert_intermediate_size" not in kw  # MiMo-V2-Flash has no shared experts
    assert not kw["add_bias_linear"]
    assert bridge.gpt_model_kwargs(cfg)["position_embedding_type"] == "none"  # RoPE: the wrapped HF attention's
    assert [bridge.wrapped_mixer(cfg, i) for i in range(4)] == ["self_attn"] * 4


def _roundtrip(hf, cfg, tp: int, pp: int, ep: int, fused: bool = False) -> dict[str, torch.Tensor]:
    """Per rank hf_to_mcore (expert TP = TP, megatron's default), the TP gather, mcore_to_hf per (PP stage, EP rank),
    as weight export gathers them."""
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            shards = [bridge.hf_to_mcore(hf, cfg, tp_rank=r, tp_size=tp, pp_rank=pp_rank, pp_size=pp,
                                         ep_rank=ep_rank, ep_size=ep) for r in range(tp)]
            full = {n: bridge.gather_from_tp(n, [s[n] for s in shards], cfg) for n in shards[0]}
            if ep_rank > 0:
                full = {n: t for n, t in full.items() if ".local_experts." in n}
            stream = bridge.mcore_to_hf(
                full.items(), cfg, layer_offset=bridge.pp_layer_range(cfg.num_hidden_layers, pp_rank, pp).start,
                expert_offset=bridge.expert_range(bridge.num_experts(cfg), ep_rank, ep).start, fused_experts=fused)
            for name, t in stream:
                assert name not in out, name
                out[name] = t
    return out


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 2, 4)])
def test_roundtrip_from_disk_is_exact(tiny, tp, pp, ep):
    d, cfg, _ = tiny
    hf = bridge.load_hf_safetensors(d)
    for name in ("model.layers.1.self_attn.attention_sink_bias", "model.layers.3.mlp.gate.e_score_correction_bias"):
        assert hf[name].abs().min() > 0, name  # every entry random: a dropped or misplaced tensor shows
    assert "model.layers.3.mlp.experts.7.gate_proj.weight" in hf  # checkpoint form: one tensor per expert
    out = _roundtrip(hf, cfg, tp, pp, ep)
    assert set(out) == set(hf)
    for name in hf:
        assert torch.equal(out[name], hf[name]), name


def test_roundtrip_from_in_memory_state_dict_is_exact(tiny):
    """The in-memory names (stacked experts, `self_attn.sinks`) with fused_experts=True: what export_weights sends the
    rollout engine and save_hf loads into the HF model."""
    _, cfg, model = tiny
    sd = model.state_dict()
    assert "model.layers.1.self_attn.sinks" in sd and "model.layers.1.mlp.experts.gate_up_proj" in sd
    out = _roundtrip(sd, cfg, 2, 2, 1, fused=True)  # (fused buffering needs every expert in one stream)
    assert set(out) == set(sd)
    for name in sd:
        assert torch.equal(out[name], sd[name]), name


def test_megatron_names(tiny):
    d, cfg, model = tiny
    sd = bridge.hf_to_mcore(bridge.load_hf_safetensors(d), cfg, tp_rank=1, tp_size=2)
    a = "decoder.layers.{}.self_attention.hf."
    # sinks on the sliding layers only, under the HF module's own name; sliding layers carry twice the k / v heads
    assert [(a.format(i) + "sinks") in sd for i in range(4)] == [False, True, True, False]
    assert not any("attention_sink_bias" in k for k in sd)
    assert sd[a.format(1) + "k_proj.weight"].shape == (2 * 2 * 16, 64)
    assert sd[a.format(0) + "k_proj.weight"].shape == (2 * 16, 64)
    assert sd[a.format(0) + "v_proj.weight"].shape == (2 * 8, 64)
    assert sd[a.format(0) + "o_proj.weight"].shape == (64, 4 * 8)  # v heads 8 wide
    assert torch.equal(sd[a.format(2) + "q_proj.weight"], model.model.layers[2].self_attn.q_proj.weight)  # replicated
    assert "decoder.layers.0.mlp.linear_fc1.weight" in sd and "decoder.layers.0.mlp.router.weight" not in sd
    assert sd["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    assert sd["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (32, 64)  # [gate_r; up_r]


def test_grouped_routing_with_another_group_scoring_is_refused(tiny):
    """HF scores a group by its top-2 experts, megatron-core by its top-(topk / topk_group)."""
    _, cfg, _ = tiny
    bad = type(cfg).from_dict({**cfg.to_dict(), "num_experts_per_tok": 4})
    with pytest.raises(ValueError, match="topk_group"):
        bridge.config_to_mcore_kwargs(bad)


def _mcore_mlp(h: torch.Tensor, sd: dict, layer: int, kw: dict, experts: range | None = None) -> torch.Tensor:
    """Layer `layer`'s megatron MLP from the bridge's tensors: the dense SwiGLU MLP, or (MoE) the router above and
    SequentialMLP's experts (`experts`: this EP rank's, numbered locally from 0) weighted by their routing probs."""
    m = f"decoder.layers.{layer}.mlp."
    if m + "linear_fc1.weight" in sd:
        gate, up = F.linear(h, sd[m + "linear_fc1.weight"]).chunk(2, -1)
        return F.linear(F.silu(gate) * up, sd[m + "linear_fc2.weight"])
    probs, idx = megatron_sigmoid_routing(F.linear(h, sd[m + "router.weight"]), kw, sd[m + "router.expert_bias"])
    out = torch.zeros_like(h)
    for local, e in enumerate(experts if experts is not None else range(kw["num_moe_experts"])):
        x = f"{m}experts.local_experts.{local}."
        gate, up = F.linear(h, sd[x + "linear_fc1.weight"]).chunk(2, -1)
        out += (probs * (idx == e)).sum(-1, keepdim=True) * F.linear(F.silu(gate) * up, sd[x + "linear_fc2.weight"])
    return out


def test_moe_layers_match_hf(tiny):
    """HF's MiMoV2FlashMoE (sigmoid scores in fp32, choice by score + e_score_correction_bias within the best group,
    unbiased scores renormalised, times routed_scaling_factor; stacked experts) == the megatron arithmetic above from
    the bridge's tensors and config, experts split over EP=2. FP32, summation order only: a few ulps of the largest
    output (1e-5 relative is ~100 ulps)."""
    _, cfg, model = tiny
    kw = bridge.config_to_mcore_kwargs(cfg)
    sd = model.state_dict()
    ranks = [bridge.hf_to_mcore(sd, cfg, ep_rank=r, ep_size=2) for r in range(2)]
    torch.manual_seed(1)
    h = torch.randn(40, cfg.hidden_size)
    for layer in (1, 2, 3):
        with torch.no_grad():
            ref = model.model.layers[layer].mlp(h[None])[0]
            m = f"decoder.layers.{layer}.mlp."
            logits = F.linear(h, ranks[0][m + "router.weight"])
            _, idx = megatron_sigmoid_routing(logits, kw, ranks[0][m + "router.expert_bias"])
            _, unbiased = megatron_sigmoid_routing(logits, kw, torch.zeros(8))
            _, ungrouped = megatron_sigmoid_routing(logits, {**kw, "moe_router_num_groups": None},
                                                     ranks[0][m + "router.expert_bias"])
            assert not torch.equal(idx.sort(-1).values, unbiased.sort(-1).values)  # the bias changes some choices
            assert not torch.equal(idx.sort(-1).values, ungrouped.sort(-1).values)  # and so does the group limit
            out = sum(_mcore_mlp(h, ranks[r], layer, kw, bridge.expert_range(8, r, 2)) for r in range(2))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_megatron_layout_gives_the_hf_logits_on_a_packed_batch(tiny):
    """Embedding, then per layer: input norm, the HF attention as HFMixer runs it (full / sliding with sinks, partial
    RoPE with the layer type's theta from the mixer's own rotary module, value scaling; one call per packed
    sequence), residual, pre-MLP norm, the dense MLP or the MoE above, residual; final norm and output layer (vocab
    padded to 128) - all from the bridge's megatron state dict of the checkpoint - equal the HF model run on each
    sequence alone. FP32, summation order only: 1e-4 absolute on logits of rms ~3 is ~1000 float32 ulps, far above
    the reordering, far below any wiring error (O(0.1) and up)."""
    d, cfg, model = tiny
    kw = bridge.config_to_mcore_kwargs(cfg)
    sd = bridge.hf_to_mcore(bridge.load_hf_safetensors(d), cfg)
    # lens 9 and 14 > sliding_window 4: the window changes the sliding layers' result
    assert_packed_layout_matches_hf(cfg, sd, model, "mimo_v2_flash", lambda h, layer: _mcore_mlp(h, sd, layer, kw))
