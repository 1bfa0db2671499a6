"""GPT-OSS on the megatron backend, CPU half (megatron-core not needed): the bridge's tensors round-trip bit-exactly
through TP / PP / EP layouts with every bias in place (expert TP 1, as megatron-core requires for biased experts), the
TransformerConfig fields reproduce HF's GptOssMLP when run through a pure-torch copy of megatron-core 0.19's MoE
arithmetic (TopKRouter with bias, SequentialMLP experts: MLP.forward's unfused GLU with clamp and offset,
per_token_scale), and the whole megatron layer layout (HF-wrapped sink / sliding attention with YaRN, that MoE, the
norms) gives the HF model's logits on a packed batch. The tiny model is the GPU harness's (`build_gpt_oss`)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from polyrl.backends.megatron import bridge, gpt_oss

from tiny_models import assert_packed_layout_matches_hf, tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_hf(tmp_path_factory, "build_gpt_oss", "eager")


def test_megatron_config_fields(tiny):
    _, cfg, _ = tiny
    kw = bridge.config_to_mcore_kwargs(cfg)  # no longer refused
    assert kw["add_bias_linear"] and kw["gated_linear_unit"] and kw["glu_linear_offset"] == 1.0
    assert kw["activation_func_clamp_value"] == cfg.swiglu_limit == 1.0
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_layer_freq"] == [1, 1]
    assert kw["moe_ffn_hidden_size"] == cfg.intermediate_size == 32
    assert kw["moe_router_score_function"] == "softmax" and not kw["moe_router_pre_softmax"]
    assert kw["moe_router_load_balancing_type"] == "none"  # output_router_logits off: HF adds no aux loss
    y = torch.linspace(-4, 4, 33)
    assert torch.equal(kw["activation_func"](y), y * torch.sigmoid(1.702 * y))  # megatron's quick_gelu formula
    assert bridge.gpt_model_kwargs(cfg)["position_embedding_type"] == "none"  # YaRN: the wrapped HF attention's
    gpt_oss.check_expert_tp(1)
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 1"):
        gpt_oss.check_expert_tp(2)


def _roundtrip(hf, cfg, tp: int, pp: int, ep: int) -> dict[str, torch.Tensor]:
    """Per rank hf_to_mcore (expert TP 1: every TP rank holds its EP rank's experts whole), the TP gather of the
    non-expert tensors, mcore_to_hf per PP stage over every EP rank's experts renumbered globally, as weight export
    gathers them."""
    out: dict[str, torch.Tensor] = {}
    per = bridge.num_experts(cfg) // ep
    for pp_rank in range(pp):
        full: dict[str, torch.Tensor] = {}
        for ep_rank in range(ep):
            shards = [bridge.hf_to_mcore(hf, cfg, tp_rank=r, tp_size=tp, pp_rank=pp_rank, pp_size=pp, ep_rank=ep_rank,
                                         ep_size=ep, etp_rank=0, etp_size=1) for r in range(tp)]
            for n, t in shards[0].items():
                if ".local_experts." in n:
                    assert all(torch.equal(s[n], t) for s in shards), n  # replicated over TP
                    pre, rest = n.split(".local_experts.")
                    i, tail = rest.split(".", 1)
                    full[f"{pre}.local_experts.{int(i) + ep_rank * per}.{tail}"] = t
                elif ep_rank == 0:
                    full[n] = bridge.gather_from_tp(n, [s[n] for s in shards], cfg)
        start = bridge.pp_layer_range(cfg.num_hidden_layers, pp_rank, pp).start
        for name, t in bridge.mcore_to_hf(full.items(), cfg, layer_offset=start):
            assert name not in out, name
            out[name] = t
    return out


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)])
def test_roundtrip_with_biases_is_exact(tiny, tp, pp, ep):
    d, cfg, _ = tiny
    hf = bridge.load_hf_safetensors(d)
    for name in ("model.layers.0.mlp.router.bias", "model.layers.1.mlp.experts.gate_up_proj_bias",
                 "model.layers.1.mlp.experts.down_proj_bias", "model.layers.0.self_attn.sinks"):
        assert hf[name].abs().min() > 0, name  # every entry random: a dropped or misplaced bias shows
    out = _roundtrip(hf, cfg, tp, pp, ep)
    assert set(out) == set(hf)
    for name in hf:
        assert torch.equal(out[name], hf[name]), name


def _mcore_moe(h: torch.Tensor, p: dict, kw: dict, experts: range) -> torch.Tensor:
    """megatron-core 0.19's MoELayer on one EP rank, without Transformer Engine: TopKRouter.gating (F.linear with
    the router bias), softmax routing (top-k of the logits then softmax when not pre_softmax), and SequentialMLP's
    experts run as MLP.forward with per_token_scale: fc1 + bias, the unfused glu() (clamp, activation_func,
    + glu_linear_offset), times the routing weight, fc2, + bias times the routing weight. h [T, H] -> this rank's
    share of the output [T, H]."""
    logits = F.linear(h, p["router.weight"], p["router.bias"])
    k = kw["moe_router_topk"]
    if kw["moe_router_pre_softmax"]:
        probs, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    else:
        top, idx = torch.topk(logits, k, dim=-1)
        probs = torch.softmax(top, -1)
    out = torch.zeros_like(h)
    c = kw["activation_func_clamp_value"]
    for local, e in enumerate(experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        x = p[f"experts.local_experts.{local}."]
        scale = probs[tok, slot][:, None]
        x_glu, x_linear = F.linear(h[tok], x["linear_fc1.weight"], x["linear_fc1.bias"]).chunk(2, dim=-1)
        x_glu, x_linear = x_glu.clamp(min=None, max=c), x_linear.clamp(min=-c, max=c)
        inter = kw["activation_func"](x_glu) * (x_linear + kw["glu_linear_offset"]) * scale
        out.index_add_(0, tok, F.linear(inter, x["linear_fc2.weight"]) + x["linear_fc2.bias"] * scale)
    return out


def _layer_params(sd: dict, layer: int) -> dict:
    pre = f"decoder.layers.{layer}.mlp."
    p = {n[len(pre):]: t for n, t in sd.items() if n.startswith(pre)}
    for n in list(p):
        if ".local_experts." in n:
            head, tail = n.rsplit(".linear_", 1)
            p.setdefault(head + ".", {})["linear_" + tail] = p.pop(n)
    return p


def test_moe_layer_matches_hf_experts_and_router(tiny):
    """HF's GptOssMLP (router with bias, top-k then softmax, GptOssExperts: interleaved gate / up, clamps, up + 1,
    sigmoid(1.702 gate), biases) == the megatron arithmetic above from the bridge's tensors and config, experts split
    over EP=2. FP32; megatron scales before fc2 and adds the scaled bias after, HF scales the biased output: the same
    sum in another order, so a few float32 ulps of the largest output (1e-5 relative is ~100 ulps)."""
    _, cfg, model = tiny
    kw = bridge.config_to_mcore_kwargs(cfg)
    sd = model.state_dict()
    torch.manual_seed(1)
    h = torch.randn(40, cfg.hidden_size)
    for layer in range(cfg.num_hidden_layers):
        mlp = model.model.layers[layer].mlp
        with torch.no_grad():
            ref = mlp(h[None])[0][0]
            gate_up = torch.einsum("th,ehi->tei", h, mlp.experts.gate_up_proj) + mlp.experts.gate_up_proj_bias
            # both clamps act on this input: a megatron without activation_func_clamp_value would differ
            assert (gate_up[..., 0::2] > cfg.swiglu_limit).float().mean() > 0.05
            assert (gate_up[..., 1::2].abs() > cfg.swiglu_limit).float().mean() > 0.05
            unbiased = torch.topk(F.linear(h, mlp.router.weight), 2, dim=-1)[1].sort(-1).values
            biased = torch.topk(F.linear(h, mlp.router.weight, mlp.router.bias), 2, dim=-1)[1].sort(-1).values
            assert not torch.equal(unbiased, biased)  # the router bias changes some tokens' experts
            out = torch.zeros_like(h)
            for ep_rank in range(2):
                p = _layer_params(bridge.hf_to_mcore(sd, cfg, ep_rank=ep_rank, ep_size=2), layer)
                out += _mcore_moe(h, p, kw, bridge.expert_range(4, ep_rank, 2))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_megatron_layout_gives_the_hf_logits_on_a_packed_batch(tiny):
    """Embedding, then per layer: input norm, the HF attention as HFMixer runs it (sinks, the sliding window on layer
    0, YaRN cos / sin from the mixer's own rotary module; one call per packed sequence), residual, pre-MLP norm, the
    MoE above, residual; final norm and output layer (vocab padded to 128) - all from the bridge's megatron state
    dict - equal the HF model run on each sequence alone. FP32, summation order only: 1e-4 absolute on logits of
    rms ~3 is ~1000 float32 ulps, far above the reordering, far below any wiring error (O(0.1) and up)."""
    _, cfg, model = tiny
    kw = bridge.config_to_mcore_kwargs(cfg)
    sd = bridge.hf_to_mcore(model.state_dict(), cfg)
    # lens 9 and 14 > sliding_window 4: the window changes layer 0's result
    assert_packed_layout_matches_hf(cfg, sd, model, "gpt_oss",
                                    lambda h, layer: _mcore_moe(h, _layer_params(sd, layer), kw, range(4)))
