"""Token sampling on logits: temperature, top-k, top-p, seeded; returns the sampled tokens
and their log-probs under the temperature-scaled (unfiltered) distribution, which is what
the trainer recomputes."""

from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V] -> tokens [B] (long), logprobs [B] (fp32)."""
    logits = logits.float()
    if temperature <= 0:  # greedy; logprobs under the raw distribution
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    logits = logits / temperature
    logprobs = torch.log_softmax(logits, -1)
    filtered = logits
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) > top_p  # keep the token that crosses p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(filtered, -1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
