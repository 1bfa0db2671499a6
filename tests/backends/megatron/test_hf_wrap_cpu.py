"""HF module wrapping for Qwen3-Next (CPU; no megatron-core needed): the bridge's name / tensor maps
round-trip exactly, the wrapper's parameter names are the bridge's, and the megatron layer layout
(bridge tensors, zero-centered norms, fused gate/up MLP, HF mixers run per packed sequence) gives
the HF model's logits for every sequence of a packed batch."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from polyrl.backends.megatron import bridge, hf_wrap

from tiny_models import tiny_hf

LENS = [5, 1, 70, 12]  # 70 > the gated delta rule's 64-token chunk


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return tiny_hf(tmp_path_factory, "build_qwen3_next", "sdpa")


def _mixer(cfg, layer: int, sd: dict, sequence_parallel: bool = False) -> hf_wrap.HFMixer:
    """HFMixer as megatron's TransformerLayer builds it (layer_number is 1-based), loaded from the
    bridge's megatron state dict."""
    mcfg = SimpleNamespace(context_parallel_size=1, sequence_parallel=sequence_parallel)
    m = hf_wrap.HFMixer(mcfg, layer + 1, hf_config=hf_wrap.mixer_config(cfg), factory=hf_wrap.MIXERS[cfg.model_type])
    prefix = f"decoder.layers.{layer}.self_attention."
    m.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, strict=True)
    return m.eval()


def test_bridge_round_trip_is_exact(qwen3_next):
    d, cfg, _ = qwen3_next
    hf = bridge.load_hf_safetensors(d)
    sd = bridge.hf_to_mcore(hf, cfg)
    assert "decoder.layers.0.self_attention.hf.in_proj_qkvz.weight" in sd  # linear attention, HF names
    assert "decoder.layers.1.self_attention.hf.q_proj.weight" in sd  # gated full attention
    assert not any("linear_qkv" in k or "linear_proj" in k for k in sd)
    back = dict(bridge.mcore_to_hf(sd.items(), cfg))
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)

    # pipeline stages: renumbered layers map back to the right HF layers (and mixer types)
    got = {}
    for rank in range(2):
        stage = bridge.hf_to_mcore(hf, cfg, pp_rank=rank, pp_size=2)
        got.update(bridge.mcore_to_hf(stage.items(), cfg, layer_offset=2 * rank))
    assert set(got) == set(hf) and all(torch.equal(got[k], hf[k]) for k in hf)

    # TP: wrapped attention is replicated, the gated DeltaNet split by heads, megatron's MLP / vocab split
    tp = [bridge.hf_to_mcore(hf, cfg, tp_rank=r, tp_size=2) for r in range(2)]
    q = "decoder.layers.1.self_attention.hf.q_proj.weight"
    assert torch.equal(tp[0][q], sd[q]) and torch.equal(tp[1][q], sd[q])
    qkvz = "decoder.layers.2.self_attention.hf.in_proj_qkvz.weight"
    assert torch.equal(torch.cat([tp[0][qkvz], tp[1][qkvz]]), sd[qkvz])  # whole key-head groups per rank
    conv = "decoder.layers.2.self_attention.hf.conv1d.weight"
    assert tp[0][conv].shape[0] == sd[conv].shape[0] // 2
    fc1 = "decoder.layers.2.mlp.linear_fc1.weight"
    assert tp[0][fc1].shape[0] == sd[fc1].shape[0] // 2
    for k in tp[0]:
        assert torch.equal(bridge.gather_from_tp(k, [tp[0][k], tp[1][k]], cfg), sd[k]), k


def test_bridge_config(qwen3_next):
    _, cfg, _ = qwen3_next
    assert [bridge.wrapped_mixer(cfg, i) for i in range(4)] == ["linear_attn", "self_attn", "linear_attn", "self_attn"]
    assert bridge.config_to_mcore_kwargs(cfg)["layernorm_zero_centered_gamma"] is True
    assert bridge.gpt_model_kwargs(cfg)["position_embedding_type"] == "none"  # the HF attention applies RoPE
    assert "num_moe_experts" not in bridge.config_to_mcore_kwargs(cfg)  # every layer dense: no MoE settings
    sparse = cfg.__class__.from_dict({**cfg.to_dict(), "mlp_only_layers": [0, 1]})
    kw = bridge.config_to_mcore_kwargs(sparse)
    assert kw["moe_layer_freq"] == [0, 0, 1, 1] and kw["num_moe_experts"] == cfg.num_experts
    assert kw["moe_shared_expert_intermediate_size"] == cfg.shared_expert_intermediate_size
    assert kw["moe_shared_expert_gate"] is True


def test_wrapper_parameter_names_are_the_bridge_names(qwen3_next):
    d, cfg, _ = qwen3_next
    sd = bridge.hf_to_mcore(bridge.load_hf_safetensors(d), cfg)
    for layer in range(cfg.num_hidden_layers):
        m = _mixer(cfg, layer, sd)
        prefix = f"decoder.layers.{layer}.self_attention."
        assert {prefix + n for n, _ in m.named_parameters()} == {k for k in sd if k.startswith(prefix)}
        assert not list(m.buffers())  # the rotary module stays outside the module tree (fp32 under Float16Module)


def test_wrapper_refuses_context_parallel(qwen3_next):
    _, cfg, _ = qwen3_next
    with pytest.raises(ValueError, match="--context-parallel-size 1"):
        hf_wrap.HFMixer(SimpleNamespace(context_parallel_size=2, sequence_parallel=False), 1,
                        hf_config=hf_wrap.mixer_config(cfg), factory=hf_wrap.MIXERS[cfg.model_type])


@torch.no_grad()
def test_packed_mixer_equals_hf_layer_per_sequence(qwen3_next):
    """HFMixer on a packed [T, 1, H] batch == the HF model's own layer module on each sequence
    alone (positions from 0), bit for bit."""
    d, cfg, model = qwen3_next
    sd = bridge.hf_to_mcore(bridge.load_hf_safetensors(d), cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENS), cfg.hidden_size, generator=g)
    cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
    for layer in range(cfg.num_hidden_layers):
        out, bias = _mixer(cfg, layer, sd)(x[:, None], packed_seq_params=SimpleNamespace(cu_seqlens_q=cu))
        assert bias is None and out.shape == (x.shape[0], 1, cfg.hidden_size)
        ref_layer = model.model.layers[layer]
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            xs = x[s:e][None]
            if cfg.layer_types[layer] == "linear_attention":
                ref = ref_layer.linear_attn(xs)
            else:
                pe = model.model.rotary_emb(xs, torch.arange(e - s)[None])
                ref = ref_layer.self_attn(xs, position_embeddings=pe, attention_mask=None)[0]
            assert torch.equal(out[s:e, 0], ref[0]), (layer, s, e)


def _zero_centered_rmsnorm(x, w, eps):  # model.HFRMSNorm with layernorm_zero_centered_gamma
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).to(x.dtype)


def _glu(x, fc1, fc2):  # megatron MLP: linear_fc1 = [gate; up]
    gate, up = F.linear(x, fc1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, fc2)


def _megatron_mlp(sd: dict, p: str, x: torch.Tensor, topk: int) -> torch.Tensor:
    """Layer `p`'s MLP as megatron computes it from the bridge's tensors: a dense MLP, or MoELayer
    with moe_router_pre_softmax=False (softmax over the top-k logits), probabilities applied to
    each expert's output, plus the shared expert scaled by sigmoid(x @ gate_weight.T)."""
    if p + "mlp.linear_fc1.weight" in sd:
        return _glu(x, sd[p + "mlp.linear_fc1.weight"], sd[p + "mlp.linear_fc2.weight"])
    top, idx = F.linear(x, sd[p + "mlp.router.weight"]).topk(topk, dim=-1)
    probs = top.softmax(-1)
    out = torch.zeros_like(x)
    for k in range(topk):
        for e in idx[:, k].unique().tolist():
            rows = idx[:, k] == e
            ex = f"{p}mlp.experts.local_experts.{e}."
            out[rows] += probs[rows, k, None] * _glu(x[rows], sd[ex + "linear_fc1.weight"], sd[ex + "linear_fc2.weight"])
    sh = p + "mlp.shared_experts."
    shared = _glu(x, sd[sh + "linear_fc1.weight"], sd[sh + "linear_fc2.weight"])
    return out + shared * torch.sigmoid(F.linear(x, sd[sh + "gate_weight"]))


@torch.no_grad()
@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_next_moe"])
def test_megatron_layout_matches_hf_model_per_sequence(variant, request):
    """The megatron model as polyrl builds it for Qwen3-Next (bridge tensors, zero-centered norms,
    megatron's fused [gate; up] MLP or its MoE layer with the gated shared expert, HF mixers per
    packed sequence), written out in torch: logits of a packed batch == HF's logits of each
    sequence alone. HF on the packed row without boundaries differs: its linear attention carries
    state across sequences (the wrapper's per-sequence calls are what keeps them apart)."""
    d, cfg, model = request.getfixturevalue(variant)
    sd = bridge.hf_to_mcore(bridge.load_hf_safetensors(d), cfg)
    eps = cfg.rms_norm_eps
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in LENS]
    cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
    psp = SimpleNamespace(cu_seqlens_q=cu)

    h = F.embedding(torch.cat(seqs), sd["embedding.word_embeddings.weight"])[:, None]  # [T, 1, H]
    for layer in range(cfg.num_hidden_layers):
        p = f"decoder.layers.{layer}."
        out, _ = _mixer(cfg, layer, sd)(_zero_centered_rmsnorm(h, sd[p + "input_layernorm.weight"], eps),
                                        packed_seq_params=psp)
        h = h + out
        x = _zero_centered_rmsnorm(h[:, 0], sd[p + "pre_mlp_layernorm.weight"], eps)
        h = h + _megatron_mlp(sd, p, x, cfg.num_experts_per_tok)[:, None]
    h = _zero_centered_rmsnorm(h, sd["decoder.final_layernorm.weight"], eps)
    logits = F.linear(h[:, 0], sd["output_layer.weight"])[:, : cfg.vocab_size]

    ref = torch.cat([model(s[None]).logits[0] for s in seqs])
    # FP32; logits are O(10); the fused [gate; up] matmul and the order experts are summed in only
    # reorder fp32 sums (~3e-5 measured); a router near-tie would flip an expert (O(1) change)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    leaky = model(torch.cat(seqs)[None]).logits[0]  # one row, no boundaries
    first = LENS[0]
    torch.testing.assert_close(leaky[:first], ref[:first], rtol=1e-4, atol=1e-4)
    assert (leaky[first:] - ref[first:]).abs().max() > 1e-1


def test_fsdp_backend_uses_padded_rows_for_recurrent_layers(qwen3_next):
    """HF's torch gated-DeltaNet path ignores packed-sequence boundaries, so the FSDP backend lays
    such models out as padded rows (and refuses --micro-batch-layout packed by name); its log-probs
    then equal a per-sequence HF forward."""
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.types import TrainBatch

    d, _, model = qwen3_next
    init_distributed("cpu")
    with pytest.raises(ValueError, match="--micro-batch-layout packed"):
        FSDPBackend(ModelConfig(hf_checkpoint=d), OptimizerConfig(), BatchConfig(micro_batch_layout="packed"), device="cpu")
    be = FSDPBackend(ModelConfig(hf_checkpoint=d), OptimizerConfig(), BatchConfig(micro_batch_size=3), device="cpu")
    assert (be.layout, be.attn_impl) == ("padded", "sdpa")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 250, (n,), generator=g) for n in (9, 4, 30)]
    plens = [3, 2, 10]
    got = be.compute_logprobs(TrainBatch(ids, plens, {}))
    for x, p, lp in zip(ids, plens, got):
        with torch.no_grad():
            ref = torch.log_softmax(model(x[None]).logits[0].float(), -1)[p - 1:-1].gather(-1, x[p:, None])[:, 0]
        torch.testing.assert_close(lp, ref, atol=1e-4, rtol=1e-4)


_GLOBAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


@pytest.fixture(scope="module")
def qwen3_next_moe(tmp_path_factory):
    return tiny_hf(tmp_path_factory, "build_qwen3_next", "sdpa", sparse=True)


def test_sparse_moe_bridge_round_trips_over_tp_pp_ep(qwen3_next_moe):
    """Sparse Qwen3-Next: routed experts, the shared expert and its gate map to megatron's MoELayer
    names (mlp.router, mlp.experts.local_experts.{i}, mlp.shared_experts.{linear_fc1, linear_fc2,
    gate_weight}) and every TP x PP x EP split gathers back to the checkpoint bit for bit, also as
    the transformers>=5 stacked in-memory experts the rollout engine holds."""
    d, cfg, model = qwen3_next_moe
    hf = bridge.load_hf_safetensors(d)
    assert "model.layers.1.mlp.shared_expert_gate.weight" in hf and "model.layers.1.mlp.experts.3.up_proj.weight" in hf
    kw = bridge.config_to_mcore_kwargs(cfg)
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["moe_shared_expert_gate"] is True
    sd = bridge.hf_to_mcore(hf, cfg)
    m = "decoder.layers.1.mlp."
    assert {m + "router.weight", m + "shared_experts.linear_fc1.weight", m + "shared_experts.linear_fc2.weight",
            m + "shared_experts.gate_weight", m + "experts.local_experts.3.linear_fc1.weight"} <= set(sd)
    assert sd[m + "shared_experts.gate_weight"].shape == (1, cfg.hidden_size)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in sd  # layer 0 stays dense
    for tp, pp, ep in [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]:
        per_layer, per_expert = cfg.num_hidden_layers // pp, cfg.num_experts // ep
        got, fused = {}, {}
        for p in range(pp):
            stage = []  # this stage's TP-gathered tensors of every EP rank, experts renumbered globally
            for e in range(ep):
                ranks = [bridge.hf_to_mcore(hf, cfg, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e,
                                            ep_size=ep) for t in range(tp)]
                full = [(k, bridge.gather_from_tp(k, [r[k] for r in ranks], cfg)) for k in ranks[0]]
                got.update(bridge.mcore_to_hf(full, cfg, layer_offset=p * per_layer, expert_offset=e * per_expert))
                stage += [(_GLOBAL_EXPERT.sub(lambda x: f"local_experts.{int(x[1]) + e * per_expert}.", k), t)
                          for k, t in full if e == 0 or ".local_experts." in k]
            fused.update(bridge.mcore_to_hf(stage, cfg, layer_offset=p * per_layer, fused_experts=True))
        assert set(got) == set(hf) and all(torch.equal(got[k], hf[k]) for k in hf), (tp, pp, ep)
        mem = model.state_dict()
        assert set(fused) == set(mem) and all(torch.equal(fused[k], mem[k]) for k in mem), (tp, pp, ep)
