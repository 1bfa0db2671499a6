"""The length-controlled workload: stop lengths drawn from a named distribution, and every engine path forcing EOS
at them without changing a token before (the transformers path, the GPU engine's logic on CPU)."""

from __future__ import annotations

import pytest
import torch

from polyrl.rollout.base import GenerateWatch
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.gpu.engine import GPUEngine
from polyrl.rollout.lengths import FORCED_LOGPROB, LengthSpecError, parse_length_distribution
from polyrl.types import SamplingParams


def test_lognormal_matches_its_median_p99_and_cap():
    d = parse_length_distribution("lognormal:median=1024,p99=8192,cap=6000")
    draws = sorted(d.draw(s) for s in range(20000))
    assert abs(draws[10000] - 1024) < 40
    assert max(draws) == 6000 and min(draws) >= 1
    # the uncapped p99 is 8192: about 1.6% of draws lie past 6000 and are clipped to it
    assert 0.008 < sum(x == 6000 for x in draws) / len(draws) < 0.03
    assert d.draw(7) == d.draw(7)  # a function of the seed alone


def test_histogram_file(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# length count\n10 3\n20\n500 1\n")
    d = parse_length_distribution(f"histogram:{f}")
    draws = [d.draw(s) for s in range(4000)]
    assert set(draws) == {10, 20, 500} and d.cap == 500
    assert abs(draws.count(10) / len(draws) - 0.6) < 0.05


@pytest.mark.parametrize("spec", ["lognormal:median=10", "lognormal:median=100,p99=10", "uniform:1", "lognormal:mu=1",
                                  "histogram:/no/such/file"])
def test_bad_specs_say_what_is_expected(spec):
    with pytest.raises(LengthSpecError, match="rollout-length-distribution|expected"):
        parse_length_distribution(spec)


def _engines(path):
    yield EmbeddedEngine(path, device="cpu")
    yield GPUEngine(path, device="cpu", dtype=torch.float32, num_kv_blocks=256, block_size=4, ignore_eos=True)


@pytest.mark.parametrize("which", [0, 1], ids=["transformers", "paged"])
def test_forced_eos_changes_no_token_before_the_cut(tiny_model, which):
    e = list(_engines(tiny_model))[which]
    prompts = [e.tokenizer(t)["input_ids"] for t in ("12+34=", "5+6=", "99+1=")]
    base = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=3)
    full = e.generate(prompts, base)
    stops = [3, 1, 7, 0, 12, 5]  # 0: no cut for that sample
    cut = e.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=3, stop_lengths=stops))
    eos = e.tokenizer.eos_token_id
    for f, c, L in zip(full, cut, stops):
        if not L or len(f.response_ids) < L:
            assert c.response_ids == f.response_ids and c.loss_mask is None
            continue
        assert c.response_ids == f.response_ids[:L - 1] + [eos]
        # A cut row leaves the batch sooner, so later GEMMs run at another M: on CPUs whose kernels block by M the
        # fp32 sums change order, an error of a few ulps of the hidden-size dot products (~1e-6); tokens stay equal.
        torch.testing.assert_close(torch.tensor(c.rollout_logprobs[:L - 1]), torch.tensor(f.rollout_logprobs[:L - 1]),
                                   atol=1e-5, rtol=0)
        assert c.rollout_logprobs[-1] == FORCED_LOGPROB
        assert c.finish_reason == "stop" and c.loss_mask == [1] * (L - 1) + [0]


@pytest.mark.parametrize("which", [0, 1], ids=["transformers", "paged"])
def test_per_prompt_budgets_and_a_continuation_equal_one_uninterrupted_generation(tiny_model, which):
    """A response continued from its first k tokens (prompt + those tokens, the same sample seed, what is left of the
    budget) is the response generated in one go: what a resumed partial rollout relies on."""
    e = list(_engines(tiny_model))[which]
    p = e.tokenizer("12+34=")["input_ids"]
    whole = e.generate([p], SamplingParams(temperature=1.0, max_new_tokens=10, prompt_seeds=[11]))[0]
    k = 4
    head = e.generate([p, p], SamplingParams(temperature=1.0, max_new_tokens=10, prompt_seeds=[11, 11],
                                             prompt_max_new_tokens=[k, 10]))
    assert head[0].response_ids == whole.response_ids[:k] and head[1].response_ids == whole.response_ids
    rest = e.generate([p + whole.response_ids[:k]], SamplingParams(temperature=1.0, max_new_tokens=10 - k,
                                                                   prompt_seeds=[11]))[0]
    assert whole.response_ids[:k] + rest.response_ids == whole.response_ids
    torch.testing.assert_close(torch.tensor(head[0].rollout_logprobs[:k] + rest.rollout_logprobs),
                               torch.tensor(whole.rollout_logprobs), atol=1e-5, rtol=0)


class StopAfter(GenerateWatch):
    """Stops the call once k samples have finished."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.seen = k, []

    def finished(self, index, sample):
        self.seen.append(index)
        if len(self.seen) >= self.k:
            self.stop.set()


@pytest.mark.parametrize("which", [0, 1], ids=["transformers", "paged"])
def test_a_stopped_call_returns_every_unfinished_sample_with_its_tokens(tiny_model, which):
    e = list(_engines(tiny_model))[which]
    prompts = [e.tokenizer(t)["input_ids"] for t in ("12+34=", "5+6=", "99+1=")]
    sp = SamplingParams(temperature=1.0, max_new_tokens=30, n=2, seed=5, stop_lengths=[2, 3, 0, 0, 0, 0])
    full = e.generate(prompts, sp)
    watch = StopAfter(2)
    cut = e.generate(prompts, sp, watch=watch)
    assert sorted(watch.seen)[:2] == [0, 1]
    for k, (f, c) in enumerate(zip(full, cut)):
        if k in watch.seen:
            assert c.response_ids == f.response_ids and c.finish_reason == f.finish_reason
        else:
            assert c.finish_reason == "abort" and c.response_ids == f.response_ids[:len(c.response_ids)]
            assert len(c.response_ids) < len(f.response_ids)
