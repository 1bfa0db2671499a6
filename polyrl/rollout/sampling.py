"""Seeds of the samplers: every sample draws from its own counter-based stream, seeded from
its prompt's seed and its index within the prompt's group (the sampler itself is
polyrl.rollout.gpu.ops.sample, and its Triton twin on GPU)."""

from __future__ import annotations



def mix_seed(base: int, index: int) -> int:
    """splitmix64 of (base, index): independent per-sample streams from one user seed."""
    z = (base * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def prompt_seed(params, base: int, i: int) -> int:
    """Seed of prompt i of a generate call: params.prompt_seeds[i] when given, else derived from the call's seed."""
    return params.prompt_seeds[i] if params.prompt_seeds is not None else mix_seed(base, i)


def sample_seed(params, base: int, i: int, j: int) -> int:
    """Seed of sample j of prompt i: a counter-based stream per sample, the same on every engine.
    Sample 0 uses the prompt's seed itself, so one request with n samples and seed s gives the same
    samples as n single requests seeded sample_seed(s, j) (what a client sends to SGLang, whose
    n > 1 copies would share one seed)."""
    s = prompt_seed(params, base, i)
    return s if j == 0 else mix_seed(s, j)


def response_budget(prompt_len: int, max_new_tokens: int, max_context_len: int | None) -> int:
    """Most response tokens (the model's and a tool's) a sample whose prompt has `prompt_len` tokens may hold:
    --rollout-max-response-len, and what --rollout-max-context-len leaves after the prompt."""
    if max_context_len is None:
        return max_new_tokens
    return max(0, min(max_new_tokens, max_context_len - prompt_len))


def cut_to_budget(sample, max_new_tokens: int, max_context_len: int | None) -> bool:
    """The rule every rollout path applies to its samples: a response longer than its budget (response_budget) loses
    its tail (tokens, logprobs, loss mask alike) and gets finish reason "length". True when it was cut."""
    n = response_budget(len(sample.prompt_ids), max_new_tokens, max_context_len)
    if len(sample.response_ids) <= n:
        return False
    sample.response_ids, sample.rollout_logprobs = sample.response_ids[:n], sample.rollout_logprobs[:n]
    if getattr(sample, "top_logprobs", None) is not None:
        sample.top_logprobs = sample.top_logprobs[:n]
    if sample.loss_mask is not None:
        sample.loss_mask = sample.loss_mask[:n]
    sample.finish_reason = "length"
    return True
