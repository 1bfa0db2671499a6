"""R3 on CPU: the embedded engine's routed experts equal what a transformers forward over the same tokens routes,
and SGLang's `routed_experts` payload (base64 of int32 [tokens - 1, layers, k]) makes the round trip through
`polyrl serve` and the HTTP engine into Sample.routed_experts. Servers run in this process on loopback; every
request is bounded in time."""

from __future__ import annotations

import base64
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_model_dir
from polyrl.config import Config, ServerConfig
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.http_client import HTTPClient
from polyrl.rollout.server import ServerThread
from polyrl.types import SamplingParams

LAYERS, K = 2, 2
# The engine routes in left-padded batches and one token at a time with a KV cache, the reference in one unpadded
# forward: router probabilities differ by fp32 reduction order (~1e-7). A top-k can only flip where the k-th and
# (k+1)-th probabilities are that close; 1e-5 is two orders above it, and away from such near-ties routes must match.
NEAR_TIE = 1e-5


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3_moe_r3"), arch="qwen3_moe", layers=LAYERS)


@pytest.fixture(scope="module")
def reference(tiny_moe):
    return AutoModelForCausalLM.from_pretrained(tiny_moe, attn_implementation="sdpa").eval()


def hf_routes(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k experts [L - 1, layers, k], gap between the k-th and (k+1)-th router probability [L - 1, layers]) of a
    plain transformers forward over tokens[:-1] (the last token is never forwarded by an engine)."""
    got: dict[int, tuple] = {}

    def spy(layer, mod, args, out):
        probs = torch.softmax(out[0].float(), -1).sort(-1, descending=True).values
        got[layer] = (out[2], probs[:, K - 1] - probs[:, K])

    hs = [model.model.layers[i].mlp.gate.register_forward_hook(functools.partial(spy, i)) for i in range(LAYERS)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens[:-1]]))
    finally:
        for h in hs:
            h.remove()
    return torch.stack([got[i][0] for i in range(LAYERS)], 1), torch.stack([got[i][1] for i in range(LAYERS)], 1)


def assert_routes_match(routes: torch.Tensor, model, tokens: list[int]) -> None:
    want, gap = hf_routes(model, tokens)
    assert tuple(routes.shape) == (len(tokens) - 1, LAYERS, K)
    differs = (routes.long().sort(-1).values != want.sort(-1).values).any(-1)
    assert bool((gap[differs] < NEAR_TIE).all()), f"{int(differs.sum())} routes differ away from a near-tie"


def test_embedded_engine_routes_equal_transformers_forward(tiny_moe, reference):
    eng = EmbeddedEngine(tiny_moe, dtype=torch.float32)
    tok = eng.tokenizer
    ps = [tok("12+34=")["input_ids"], tok("7+5=")["input_ids"]]  # different lengths: left padding in the batch
    samples = eng.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3, return_routed_experts=True))
    for s in samples:
        assert s.routed_experts.dtype == torch.int16
        assert_routes_match(s.routed_experts, reference, s.prompt_ids + s.response_ids)
    assert eng.generate(ps, SamplingParams(max_new_tokens=2, seed=3))[0].routed_experts is None  # only when asked


def test_routed_experts_round_trip_through_polyrl_serve(tiny_moe, reference, tmp_path):
    """SGLang's payload from `polyrl serve` (key meta_info.routed_experts, base64 of little-endian int32 bytes,
    [tokens - 1, num_hidden_layers, k]), and the HTTP engine decoding it into Sample.routed_experts."""
    from polyrl.rollout.http_engine import HTTPEngine
    eng = EmbeddedEngine(tiny_moe, dtype=torch.float32)
    st = ServerThread(eng, ServerConfig(port=0, max_request_bytes=1 << 20, batch_wait_ms=5), model_path=tiny_moe, seed=0)
    http = HTTPClient()
    client = None
    try:
        prompt = eng.tokenizer("21+13=")["input_ids"]
        out = http.call(st.url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "sampling_seed": 1},
                                              "return_logprob": True, "return_routed_experts": True}, timeout=30)
        tokens = prompt + out["output_ids"]
        raw = base64.b64decode(out["meta_info"]["routed_experts"].encode("ascii"))
        assert len(raw) == (len(tokens) - 1) * LAYERS * K * 4
        routes = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(len(tokens) - 1, LAYERS, K)
        assert_routes_match(routes, reference, tokens)
        plain = http.call(st.url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert "routed_experts" not in plain["meta_info"]

        cfg = Config()
        cfg.model.hf_checkpoint, cfg.cluster.device, cfg.log.run_dir = tiny_moe, "cpu", str(tmp_path)
        cfg.engines.rollout_external, cfg.engines.rollout_external_engine_addrs = True, [st.url]
        cfg.engines.rollout_request_timeout = 60
        client = HTTPEngine(cfg, "cpu")
        samples = client.generate([prompt], SamplingParams(max_new_tokens=5, n=2, seed=4, return_routed_experts=True))
        for s in samples:
            assert s.routed_experts.dtype == torch.int16
            assert_routes_match(s.routed_experts, reference, s.prompt_ids + s.response_ids)
    finally:
        if client is not None:
            client.close()
        http.close()
        st.stop()


def test_serve_refuses_routed_experts_for_a_dense_model(tiny_model):
    from polyrl.rollout.http_client import EngineHTTPError
    st = ServerThread(EmbeddedEngine(tiny_model, dtype=torch.float32), ServerConfig(port=0), model_path=tiny_model, seed=0)
    http = HTTPClient()
    try:
        with pytest.raises(EngineHTTPError, match="no MoE router"):
            http.call(st.url, "/generate", {"input_ids": [1, 2], "return_routed_experts": True}, timeout=30)
    finally:
        http.close()
        st.stop()


def test_debug_rollout_files_keep_routed_experts(tiny_moe, tmp_path):
    """--save/--load-debug-rollout-data: a sample's routes come back as the same int16 tensor."""
    from polyrl.debug_rollout import RolloutFiles
    eng = EmbeddedEngine(tiny_moe, dtype=torch.float32)
    s = eng.generate([eng.tokenizer("3+4=")["input_ids"]], SamplingParams(max_new_tokens=3, seed=0, return_routed_experts=True))
    files = RolloutFiles(str(tmp_path / "r_{rollout_id}.jsonl"), tokenizer=eng.tokenizer, hf_checkpoint=tiny_moe,
                         rollout_batch_size=1, n_samples_per_prompt=1)
    files.save(0, s)
    back = files.load(0)[0].routed_experts
    assert back.dtype == torch.int16 and torch.equal(back, s[0].routed_experts)
