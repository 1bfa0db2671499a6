"""Embedded engine: sampling contract, stops, seeds, logprobs, weight updates."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from conftest import hf_greedy
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.types import SamplingParams


def prompts(engine):
    return [engine.tokenizer("12+34=")["input_ids"], engine.tokenizer("5+6=")["input_ids"], engine.tokenizer("99+1=")["input_ids"]]


def test_groups_lengths_and_logprobs(tiny_model):
    e = EmbeddedEngine(tiny_model)
    out = e.generate(prompts(e), SamplingParams(n=4, max_new_tokens=6, seed=0))
    assert len(out) == 12
    assert [s.group_index for s in out] == [0] * 4 + [1] * 4 + [2] * 4
    for s in out:
        assert 1 <= len(s.response_ids) <= 6
        assert len(s.rollout_logprobs) == len(s.response_ids)
        assert all(lp <= 0 for lp in s.rollout_logprobs)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == e.tokenizer.eos_token_id
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 6


def test_seed_makes_sampling_deterministic(tiny_model):
    e = EmbeddedEngine(tiny_model)
    sp = SamplingParams(n=4, max_new_tokens=6, seed=7)
    a = [s.response_ids for s in e.generate(prompts(e), sp)]
    b = [s.response_ids for s in e.generate(prompts(e), sp)]
    c = [s.response_ids for s in e.generate(prompts(e), SamplingParams(n=4, max_new_tokens=6, seed=8))]
    assert a == b and a != c


def test_greedy_equals_transformers_generate(tiny_model):
    e = EmbeddedEngine(tiny_model)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    out = e.generate(prompts(e), SamplingParams(temperature=0.0, max_new_tokens=6))
    for p, s in zip(prompts(e), out):
        assert s.response_ids == hf_greedy(ref, p, 6, e.tokenizer.eos_token_id, e.pad_id)


def test_logprobs_match_a_plain_forward_at_the_sampling_temperature(tiny_model):
    e = EmbeddedEngine(tiny_model)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for s in e.generate(prompts(e), SamplingParams(n=2, temperature=0.8, max_new_tokens=5, seed=1)):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = ref(ids).logits[0, len(s.prompt_ids) - 1:-1] / 0.8
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), want, atol=1e-4, rtol=0)


def test_top_logprobs_are_the_likeliest_tokens_of_the_sampling_distribution(tiny_model):
    """Each response token's k alternatives: the k largest of a plain forward's log-softmax at the sampling temperature,
    likeliest first, the sampled token's own log-prob among them whenever it is one of them; the tokens sampled are
    those of a call without them. 1e-4 as above: the cached decode and the plain forward sum in other orders (fp32)."""
    e = EmbeddedEngine(tiny_model)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    sp = SamplingParams(n=2, temperature=0.8, max_new_tokens=5, seed=1)
    plain = e.generate(prompts(e), sp)
    out = e.generate(prompts(e), SamplingParams(n=2, temperature=0.8, max_new_tokens=5, seed=1, top_logprobs=4))
    assert [s.response_ids for s in out] == [s.response_ids for s in plain] and plain[0].top_logprobs is None
    for s in out:
        assert len(s.top_logprobs) == len(s.response_ids) and all(len(pos) == 4 for pos in s.top_logprobs)
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            want = torch.log_softmax(ref(ids).logits[0, len(s.prompt_ids) - 1:-1] / 0.8, -1).topk(4, -1)
        got_lp = torch.tensor([[lp for _, lp in pos] for pos in s.top_logprobs])
        torch.testing.assert_close(got_lp, want.values, atol=1e-4, rtol=0)
        # the same tokens, unless two alternatives are closer than that tolerance (then their order may swap)
        close = (want.values[:, :-1] - want.values[:, 1:]).abs().min() < 1e-4
        assert close or [[t for t, _ in pos] for pos in s.top_logprobs] == want.indices.tolist()
        for tok, lp, pos in zip(s.response_ids, s.rollout_logprobs, s.top_logprobs):
            assert [a for _, a in pos] == sorted((a for _, a in pos), reverse=True)
            if tok in dict(pos):
                assert abs(dict(pos)[tok] - lp) < 1e-5


def test_stop_token_ids_and_stop_strings(tiny_model):
    e = EmbeddedEngine(tiny_model)
    p = prompts(e)
    free = e.generate(p, SamplingParams(n=2, max_new_tokens=8, seed=3))
    first_tok = free[0].response_ids[0]
    out = e.generate(p, SamplingParams(n=2, max_new_tokens=8, seed=3, stop_token_ids=[first_tok]))
    assert out[0].response_ids == [first_tok] and out[0].finish_reason == "stop"
    text = free[1].response
    if len(text) >= 2:
        stop = text[1]
        s = e.generate(p, SamplingParams(n=2, max_new_tokens=8, seed=3, stop=[stop]))[1]
        assert s.finish_reason == "stop" and s.response.endswith(stop) and len(s.response) <= len(text)


def test_update_weights_in_place_changes_the_policy(tiny_model):
    e = EmbeddedEngine(tiny_model)
    params_before = {n: p.data_ptr() for n, p in e.model.named_parameters()}
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    before = [s.rollout_logprobs for s in e.generate(prompts(e), sp)]
    stream = ((n, p.detach() * 0.5) for n, p in e.model.named_parameters())
    e.update_weights(stream, version=3)
    assert e.version == 3
    assert {n: p.data_ptr() for n, p in e.model.named_parameters()} == params_before  # no reallocation
    after = [s.rollout_logprobs for s in e.generate(prompts(e), sp)]
    assert before != after
    try:
        e.update_weights([("not.a.weight", torch.zeros(1))], version=4)
    except KeyError as err:
        assert "not.a.weight" in str(err)
    else:
        raise AssertionError("unknown weight name accepted")


def test_rows_stop_at_the_models_context(tiny_model):
    """The transformers path cuts each row where prompt + response fill max_position_embeddings (finish "length"), as
    SGLang's scheduler does, and refuses a prompt that leaves no room, naming it."""
    import pytest

    e = EmbeddedEngine(tiny_model)
    ctx = e.max_len
    assert ctx == e.model.config.max_position_embeddings
    short, long_ = [5, 6, 7], [5] * (ctx - 3)
    out = e.generate([short, long_], SamplingParams(n=8, max_new_tokens=8, temperature=1.0, seed=0))
    fill = [s for s in out if s.prompt_ids == long_]
    assert all(len(s.response_ids) + len(long_) <= ctx for s in fill)
    # 8 samples each need 3 tokens without EOS to fill the context: some do whatever the CPU's rounding
    assert any(s.finish_reason == "length" and len(long_) + len(s.response_ids) == ctx for s in fill)
    assert any(len(s.response_ids) > 3 for s in out if s.prompt_ids == short)  # the other row went on
    with pytest.raises(ValueError, match=f"prompt 1 has {ctx} tokens; the model's context is {ctx}"):
        e.generate([short, [5] * ctx], SamplingParams(max_new_tokens=2))


def test_a_prompts_samples_share_one_prefill_and_continue_as_transformers_does(tiny_model):
    e = EmbeddedEngine(tiny_model)
    widths = []
    forward = e.model.forward

    def counted(*a, **kw):
        widths.append(tuple(kw["input_ids"].shape))
        return forward(*a, **kw)
    e.model.forward = counted
    ref = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    out = e.generate(prompts(e), SamplingParams(n=3, temperature=0.0, max_new_tokens=6))
    assert widths[0] == (3, max(len(p) for p in prompts(e)))  # one row per prompt, left-padded to the longest
    for k, s in enumerate(out):
        assert s.response_ids == hf_greedy(ref, prompts(e)[k // 3], 6, e.tokenizer.eos_token_id, e.pad_id)
