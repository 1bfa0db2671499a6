"""Qwen3-MoE on the GPU engine's code path, run on CPU (torch reference ops, no graphs): the router and the
sorted grouped expert compute vs transformers, decoder_sparse_step / mlp_only_layers, routed-expert capture in
prefill and decode vs the transformers path, and weight updates by stacked or per-expert HF names. The CUDA
kernels (torch grouped GEMM), graphs and BF16 are in test_gpu_engine.py."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

from conftest import hf_greedy, make_model_dir, sharpen
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.gpu.engine import GPUEngine
from polyrl.rollout.gpu.model import spec_from_config
from polyrl.types import SamplingParams

TEXTS = ["12+34=", "5+6=", "123+456=", "7+70="]
LAYERS, K, MOE_LAYERS = 3, 2, (0, 2)  # layer 1 is a dense MLP (mlp_only_layers)
# Where routes may differ: the engine and the reference compute router probabilities with different reduction
# orders (fp32: ~1e-7 apart), so a top-k can flip only where the k-th and (k+1)-th probabilities are that close;
# 1e-5 is two orders above it, and away from such near-ties routes must match.
NEAR_TIE = 1e-5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """8 experts, top-2, one dense layer; weights x8 so greedy text is varied and routing is not uniform."""
    d = make_model_dir(tmp_path_factory.mktemp("moe_engine"), arch="qwen3_moe", layers=LAYERS)
    cfg = AutoConfig.from_pretrained(d)
    cfg.mlp_only_layers = [1]
    torch.manual_seed(0)
    # transformers writes the per-expert names (experts.N.gate_proj.weight) to disk
    return sharpen(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), d)


def engine(path, **kw):
    return GPUEngine(path, **{"device": "cpu", "dtype": torch.float64, "num_kv_blocks": 256, "block_size": 4, **kw})


def reference(path, dtype=torch.float64):
    # transformers' grouped_mm experts have no float64 CPU kernel; "eager" is its per-expert loop, same math
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()


def prompts(e):
    return [e.tokenizer(t)["input_ids"] for t in TEXTS]


def hf_routes(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k experts [L - 1, layers, k] (-1 in dense layers), gap between the k-th and (k+1)-th router probability
    [L - 1, layers] (inf in dense layers)) of one transformers forward over tokens[:-1]."""
    n = len(tokens) - 1
    idx = torch.full((n, LAYERS, K), -1, dtype=torch.long)
    gap = torch.full((n, LAYERS), float("inf"), dtype=torch.float64)

    def spy(layer, mod, args, out):
        probs = torch.softmax(out[0].double(), -1).sort(-1, descending=True).values
        idx[:, layer], gap[:, layer] = out[2], probs[:, K - 1] - probs[:, K]

    hs = [model.model.layers[i].mlp.gate.register_forward_hook(functools.partial(spy, i)) for i in MOE_LAYERS]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens[:-1]]))
    finally:
        for h in hs:
            h.remove()
    return idx, gap


def assert_routes_match(routes: torch.Tensor, model, tokens: list[int]) -> None:
    want, gap = hf_routes(model, tokens)
    assert tuple(routes.shape) == (len(tokens) - 1, LAYERS, K) and routes.dtype == torch.int16
    assert bool((routes[:, 1] == -1).all())  # the dense layer has no route
    differs = (routes.long().sort(-1).values != want.sort(-1).values).any(-1)
    assert bool((gap[differs] < NEAR_TIE).all()), f"{int(differs.sum())} routes differ away from a near-tie"


def test_spec_follows_decoder_sparse_step_and_mlp_only_layers():
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, decoder_sparse_step=2, mlp_only_layers=[3])
    spec, why = spec_from_config(cfg)
    assert why is None
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    want = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert spec.moe_layers == want == (1, 5)
    assert (spec.experts, spec.top_k, spec.moe_inter, spec.inter) == (4, 2, 32, 96)


def test_greedy_and_logprobs_match_transformers(moe_dir):
    """float64 on both sides: the logprobs differ only by the sampler's fp32 log-softmax (~1e-7 at these logit
    sizes, 1e-5 leaves room), and greedy tokens must be identical."""
    e = engine(moe_dir)
    hf = reference(moe_dir)
    assert e.spec.moe_layers == MOE_LAYERS
    greedy = e.generate(prompts(e), SamplingParams(temperature=0.0, max_new_tokens=8))
    sampled = e.generate(prompts(e)[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1))
    assert len({tuple(s.response_ids) for s in greedy}) > 1  # not a degenerate model
    for p, s in zip(prompts(e), greedy):
        assert s.response_ids == hf_greedy(hf, p, 8, e.tokenizer.eos_token_id, e.pad_id)
    for s in greedy + sampled:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits[0, len(s.prompt_ids) - 1:-1], -1)
        want = lp.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs, dtype=torch.float64), want, atol=1e-5, rtol=0)
        assert s.routed_experts is None  # only when asked


def test_routed_experts_equal_the_transformers_path(moe_dir):
    """Same prompts, seeds and fp32 as the transformers path (EmbeddedEngine on CPU): the same tokens (a sampled
    token could only differ on a Gumbel-score tie within the ~1e-6 logit noise), and per token the same routes,
    prompt (prefill) and response (decode) rows alike, as the transformers path reports and a plain transformers
    forward computes, away from near-ties."""
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3, return_routed_experts=True)
    e = engine(moe_dir, dtype=torch.float32)
    ours = e.generate(prompts(e), sp)
    theirs = EmbeddedEngine(moe_dir, dtype=torch.float32).generate(prompts(e), sp)
    hf = reference(moe_dir)
    assert [s.response_ids for s in ours] == [s.response_ids for s in theirs]
    for a, b in zip(ours, theirs):
        tokens = a.prompt_ids + a.response_ids
        assert_routes_match(a.routed_experts, hf, tokens)
        assert_routes_match(b.routed_experts, hf, tokens)


def test_routes_do_not_depend_on_batching(moe_dir):
    """Admission mid-decode and row compaction (max_batch 3 < 4 prompts x 2 samples) keep each sample's routes
    attached to its own tokens: identical to one big batch (float64, same arithmetic per row)."""
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=5, return_routed_experts=True)
    big = engine(moe_dir, max_batch=64)
    want = big.generate(prompts(big), sp)
    small = engine(moe_dir, max_batch=3)
    got = small.generate(prompts(small), sp)
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    for a, b in zip(got, want):
        assert len(a.routed_experts) == len(a.prompt_ids) + len(a.response_ids) - 1
        assert torch.equal(a.routed_experts, b.routed_experts)


def test_update_weights_by_stacked_or_per_expert_names(moe_dir):
    """The trainer streams the HF model's state_dict names (stacked experts in transformers 5); a checkpoint has
    per-expert names: both write the same storage, in place."""
    e = engine(moe_dir)
    ptr = e.model.flat.data_ptr()
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = [s.rollout_logprobs for s in e.generate(prompts(e), sp)]
    hf = AutoModelForCausalLM.from_pretrained(moe_dir)
    named = dict(hf.named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" in named and "model.layers.1.mlp.gate_proj.weight" in named
    e.update_weights(((n, p.detach() * 0.5) for n, p in named.items()), version=2)
    assert e.version == 2 and e.model.flat.data_ptr() == ptr
    assert torch.equal(e.model.hf["model.layers.2.mlp.experts.down_proj"], named["model.layers.2.mlp.experts.down_proj"].double() * 0.5)
    gu = named["model.layers.0.mlp.experts.gate_up_proj"].double() * 0.5  # [E, 2I, H]: gate rows, then up rows
    assert torch.equal(e.get_weight("model.layers.0.mlp.experts.5.up_proj.weight"), gu[5, gu.shape[1] // 2:])
    assert [s.rollout_logprobs for s in e.generate(prompts(e), sp)] != before

    one = "model.layers.2.mlp.experts.3.gate_proj.weight"
    e.update_weights([(one, torch.ones(64, 64))], version=3)
    assert bool((e.model.hf["model.layers.2.mlp.experts.gate_up_proj"][3, :64] == 1).all())
    assert not bool((e.model.hf["model.layers.2.mlp.experts.gate_up_proj"][2, :64] == 1).any())
    # what a full update still lacks: a stacked tensor counts as written when all its per-expert parts are
    stacked = set(named) - {"lm_head.weight"}
    assert e.model.missing(stacked) == set()
    per_expert = {n for n in e.weight_shapes() if ".experts." in n and n.endswith(".weight")}
    assert e.model.missing((stacked - {n for n in stacked if ".experts." in n}) | per_expert) == set()
    assert e.model.missing(stacked - {"model.layers.0.mlp.experts.down_proj"} | {"model.layers.0.mlp.experts.1.down_proj.weight"}) == {
        f"model.layers.0.mlp.experts.{x}.down_proj.weight" for x in range(8) if x != 1}
    with pytest.raises(ValueError, match="shape"):
        e.update_weights([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 64, 64))], version=4)


def test_routed_experts_need_an_moe_model(tiny_model, moe_dir):
    dense = engine(tiny_model)
    assert not dense.reports_routed_experts and engine(moe_dir).reports_routed_experts
    with pytest.raises(ValueError, match="no MoE router"):
        dense.generate([[3, 4]], SamplingParams(max_new_tokens=2, return_routed_experts=True))


def test_polyrl_serve_returns_the_gpu_paths_routes(moe_dir):
    """`polyrl serve` around this engine answers return_routed_experts with SGLang's payload (base64 of int32
    [tokens - 1, layers, k]) holding the engine's routes."""
    import base64

    from polyrl.config import ServerConfig
    from polyrl.rollout.http_client import HTTPClient
    from polyrl.rollout.server import ServerThread
    e = engine(moe_dir)
    st = ServerThread(e, ServerConfig(port=0, max_request_bytes=1 << 20, batch_wait_ms=5), model_path=moe_dir, seed=0)
    http = HTTPClient()
    try:
        prompt = prompts(e)[0]
        out = http.call(st.url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "sampling_seed": 1},
                                              "return_routed_experts": True}, timeout=60)
    finally:
        http.close()
        st.stop()
    tokens = prompt + out["output_ids"]
    raw = base64.b64decode(out["meta_info"]["routed_experts"].encode("ascii"))
    routes = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(len(tokens) - 1, LAYERS, K)
    assert_routes_match(routes.to(torch.int16), reference(moe_dir), tokens)
