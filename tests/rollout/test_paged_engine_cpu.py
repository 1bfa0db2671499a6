"""The GPU engine's logic on CPU (torch reference ops, float64, no graphs): its own forward
vs transformers, continuous batching, prefix sharing, KV-block pressure, stops, the sampler
and the top-k/top-p thresholds, in-place weight updates. The CUDA kernels, graphs and
sleep/wake are in test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import hf_greedy, sharpen
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.gpu import ops
from polyrl.rollout.gpu.engine import GPUEngine, unsupported_reason
from polyrl.types import SamplingParams

TEXTS = ["12+34=", "5+6=", "99+1=", "123+456=", "7+70=", "1+2+3+4+5="]


def _sharp_model(tmp_path_factory, arch: str, tied: bool) -> str:
    """A tiny model with weights scaled up, so greedy text is not one repeated token."""
    from conftest import make_model_dir
    d = make_model_dir(tmp_path_factory.mktemp(f"sharp_{arch}"), arch=arch, tied=tied)
    return sharpen(AutoModelForCausalLM.from_pretrained(d), d)


@pytest.fixture(scope="module", params=[("qwen2", True), ("llama", False), ("qwen3", True)], ids=lambda p: p[0])
def model_dir(request, tmp_path_factory):
    return _sharp_model(tmp_path_factory, *request.param)


def engine(path, **kw):
    kw = {"device": "cpu", "dtype": torch.float64, "num_kv_blocks": 256, "block_size": 4, **kw}
    return GPUEngine(path, **kw)


def prompts(e):
    return [e.tokenizer(t)["input_ids"] for t in TEXTS]


def hf_logprobs(hf, s, temperature=1.0):
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(s.prompt_ids) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1)


def test_greedy_and_logprobs_match_transformers(model_dir):
    e = engine(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = e.generate(prompts(e), SamplingParams(temperature=0.0, max_new_tokens=10))
    assert len({tuple(s.response_ids) for s in out}) > 1  # not a degenerate model
    for p, s in zip(prompts(e), out):
        assert s.response_ids == hf_greedy(hf, p, 10, e.tokenizer.eos_token_id, e.pad_id)
        lp = hf_logprobs(hf, s).gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs, dtype=torch.float64), lp, atol=1e-5, rtol=0)  # the sampler works in fp32, like sampling.py


def test_sampled_logprobs_are_under_the_temperature_scaled_unfiltered_distribution(model_dir):
    e = engine(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    for s in e.generate(prompts(e), SamplingParams(n=2, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=6, seed=1)):
        lp = hf_logprobs(hf, s, 0.7)
        ids = torch.tensor(s.response_ids)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs, dtype=torch.float64), lp.gather(-1, ids[:, None]).squeeze(-1),
                                   atol=1e-5, rtol=0)  # the sampler works in fp32, like sampling.py
        assert (lp.argsort(-1, descending=True)[:, :5] == ids[:, None]).any(-1).all()  # within the top 5


def test_continuous_batching_and_kv_pressure_do_not_change_results(model_dir):
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=9, seed=5)
    big = engine(model_dir, max_batch=64)
    want = [(s.response_ids, s.finish_reason, s.group_index) for s in big.generate(prompts(big), sp)]
    small = engine(model_dir, max_batch=4)  # groups are split (n=3 > free slots) and admitted as others finish
    assert [(s.response_ids, s.finish_reason, s.group_index) for s in small.generate(prompts(small), sp)] == want
    tight = engine(model_dir, max_batch=64, num_kv_blocks=12)  # room for about one group at a time
    assert [(s.response_ids, s.finish_reason, s.group_index) for s in tight.generate(prompts(tight), sp)] == want
    assert tight.alloc.num_free == 11 and big.alloc.num_free == 255  # every block back


def test_unwritten_cache_slots_never_reach_the_output(model_dir):
    """The KV cache is allocated uninitialized and never cleared (beside the trainer it is reused trainer memory), so
    the slots past a row's context can hold anything, NaN included: the results must not depend on them. A cache
    filled with NaN (but the scratch block, which padded rows read) gives the same tokens and logprobs as a fresh one.
    (This used to fail intermittently through 0 * NaN in the reference attention's value sum.)"""
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=5)
    clean = engine(model_dir)
    clean.kv.data.zero_()
    want = [(s.response_ids, s.rollout_logprobs) for s in clean.generate(prompts(clean), sp)]
    dirty = engine(model_dir)
    dirty.kv.data.fill_(float("nan"))
    dirty.kv.data[:, :, :dirty.block_size].zero_()
    assert [(s.response_ids, s.rollout_logprobs) for s in dirty.generate(prompts(dirty), sp)] == want


def test_prefix_sharing_matches_the_transformers_path_and_saves_blocks(model_dir):
    e = engine(model_dir)
    p = e.tokenizer("1234+5678=")["input_ids"]  # 10 tokens: 2 full blocks of 4 + a partial one
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=7, seed=2)
    shared = e.generate([p], sp)
    # the transformers path shares nothing and uses the same per-sample seed streams; both run float64, so a
    # sampled token could only differ on a Gumbel-score tie within ~1e-12, which these 28 draws do not have
    hf = EmbeddedEngine(model_dir, dtype=torch.float64).generate([p], sp)
    assert [s.response_ids for s in shared] == [s.response_ids for s in hf]
    assert len({tuple(s.response_ids) for s in shared}) > 1  # the samples differ: per-sample streams
    e._sp = sp
    assert e._blocks_needed(len(p), 4) == 2 + 4 * 2  # ceil(16 / 4) = 4 blocks per sample, 2 of them shared
    e._sp = SamplingParams(n=1, max_new_tokens=7)
    assert 4 * e._blocks_needed(len(p), 1) == 16


def test_cache_too_small_for_one_group_names_the_flag(model_dir):
    e = engine(model_dir, num_kv_blocks=3)
    with pytest.raises(RuntimeError, match="rollout-mem-fraction"):
        e.generate(prompts(e)[:1], SamplingParams(n=4, max_new_tokens=20))


def test_stop_token_ids_strings_and_seeds(tiny_model):
    e = engine(tiny_model)
    p = prompts(e)[:3]
    free = e.generate(p, SamplingParams(n=2, max_new_tokens=8, seed=3))
    assert [s.response_ids for s in free] == [s.response_ids for s in e.generate(p, SamplingParams(n=2, max_new_tokens=8, seed=3))]
    assert [s.response_ids for s in free] != [s.response_ids for s in e.generate(p, SamplingParams(n=2, max_new_tokens=8, seed=4))]
    for s in free:
        assert len(s.rollout_logprobs) == len(s.response_ids) and all(lp <= 0 for lp in s.rollout_logprobs)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == e.tokenizer.eos_token_id
        else:
            assert len(s.response_ids) == 8
    first = free[0].response_ids[0]
    out = e.generate(p, SamplingParams(n=2, max_new_tokens=8, seed=3, stop_token_ids=[first]))
    assert out[0].response_ids == [first] and out[0].finish_reason == "stop"
    text = free[1].response
    if len(text) >= 2:
        s = e.generate(p, SamplingParams(n=2, max_new_tokens=8, seed=3, stop=[text[1]]))[1]
        assert s.finish_reason == "stop" and s.response.endswith(text[1])
    ignore = engine(tiny_model, ignore_eos=True).generate(p, SamplingParams(n=2, max_new_tokens=8, seed=3))
    assert all(len(s.response_ids) == 8 and s.finish_reason == "length" for s in ignore)


def test_update_weights_in_place(tiny_model):
    e = engine(tiny_model)
    ptr = e.model.flat.data_ptr()
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    before = [s.rollout_logprobs for s in e.generate(prompts(e), sp)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model)
    e.update_weights(((n, p.detach() * 0.5) for n, p in hf.named_parameters()), version=3)
    assert e.version == 3 and e.model.flat.data_ptr() == ptr
    assert torch.equal(e.model.hf["model.layers.1.self_attn.k_proj.weight"],
                       hf.model.layers[1].self_attn.k_proj.weight.double() * 0.5)
    assert [s.rollout_logprobs for s in e.generate(prompts(e), sp)] != before
    with pytest.raises(KeyError, match="not.a.weight"):
        e.update_weights([("not.a.weight", torch.zeros(1))], version=4)


def test_filter_thresholds_keep_what_sampling_py_keeps():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    inv_t = torch.full((6,), 1 / 0.7)
    for k, p in ((5, 1.0), (-1, 0.8), (10, 0.5), (-1, 0.05)):
        thr = ops.filter_thresholds(logits, inv_t, k, p)
        x = logits * inv_t[:, None]
        keep = x >= thr[:, None]
        # sampling.py: which tokens can it draw? (nonzero probability after its filters)
        filtered = x
        if k > 0:
            filtered = filtered.masked_fill(filtered < torch.topk(filtered, k).values[:, -1:], float("-inf"))
        if p < 1:
            sl, order = torch.sort(filtered, descending=True)
            pr = torch.softmax(sl, -1)
            sl = sl.masked_fill(pr.cumsum(-1) - pr > p, float("-inf"))
            filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sl)
        assert torch.equal(keep, filtered > float("-inf")), (k, p)


def test_sampler_draws_from_the_scaled_distribution():
    V, N = 8, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 3.0, 0.2]])
    rows = logits.expand(N, V)
    tok, lp = ops.sample(rows, torch.full((N,), 2.0), torch.ones(N, dtype=torch.int32), torch.full((N,), float("-inf")),
                         torch.arange(N), torch.zeros(N, dtype=torch.long))
    freq = torch.bincount(tok, minlength=V).double() / N
    want = torch.softmax(logits[0].double() * 2, -1)
    assert (freq - want).abs().max() < 0.03
    torch.testing.assert_close(lp, torch.log_softmax(logits[0] * 2, -1)[tok])
    g_tok, g_lp = logits.argmax(-1), torch.log_softmax(logits, -1).max(-1).values  # greedy: raw distribution
    t, l = ops.sample(logits, torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.full((1,), float("-inf")),
                      torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    assert torch.equal(t, g_tok) and torch.allclose(l, g_lp)


def test_embedded_engine_keeps_the_transformers_path_on_cpu(tiny_model, tmp_path):
    assert type(EmbeddedEngine(tiny_model)) is EmbeddedEngine
    assert unsupported_reason(tiny_model) is None
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    assert "gpt2" in unsupported_reason(str(tmp_path))


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory):
    from conftest import tiny_mimo
    path = str(tmp_path_factory.mktemp("mimo"))
    return sharpen(tiny_mimo(path, hidden=64, inter=96, max_pos=128), path)


def test_mimo_runs_on_this_path_as_its_qwen2_decoder(mimo_dir):
    """MiMo-7B is a Qwen2 decoder plus MTP layers the engine does not run: greedy tokens and log-probs equal the HF
    model's (the MTP layers take no part in its forward), and a weight sync that carries the MTP tensors (as the
    trainer's export does) is taken, dropping them."""
    from polyrl.rollout.gpu.model import spec_from_config
    from transformers import AutoConfig
    spec, why = spec_from_config(AutoConfig.from_pretrained(mimo_dir))
    assert why is None and spec.qkv_bias and spec.ignored == ("model.mtp_layers.",)
    e = engine(mimo_dir)
    hf = AutoModelForCausalLM.from_pretrained(mimo_dir, dtype=torch.float64).eval()
    out = e.generate(prompts(e), SamplingParams(temperature=0.0, max_new_tokens=8))
    assert len({tuple(s.response_ids) for s in out}) > 1
    for p, s in zip(prompts(e), out):
        assert s.response_ids == hf_greedy(hf, p, 8, e.tokenizer.eos_token_id, e.pad_id)
        lp = hf_logprobs(hf, s).gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs, dtype=torch.float64), lp, atol=1e-5, rtol=0)  # the sampler works in fp32
    stream = [(n, p.detach() * 0.5) for n, p in hf.named_parameters()]
    assert any(n.startswith("model.mtp_layers.") for n, _ in stream)
    e.update_weights(iter(stream), version=1)
    assert torch.equal(e.model.hf["model.layers.0.self_attn.q_proj.bias"], hf.model.layers[0].self_attn.q_proj.bias * 0.5)
