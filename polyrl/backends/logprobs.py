"""Log-probs and entropy from hidden states, chunked so full-vocabulary FP32 logits exist
for at most `chunk_size` tokens at a time (in the forward and, via checkpointing, in the
backward)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temp: float, with_entropy: bool):
    logits = (hidden @ weight.t()).float()
    if inv_temp != 1.0:
        logits = logits * inv_temp
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, ent


_compiled = None


def _compiled_chunk():
    """The chunk under torch.compile: logsumexp, gather and entropy fuse into a couple of passes
    over the [chunk, V] logits instead of one pass per op."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_chunk, dynamic=True)
    return _compiled


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                     chunk_size: int = 1024, with_entropy: bool = False, compiled: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [T, H], weight: [V, H] (the LM head), targets: [T] -> logprobs [T] (fp32), entropy [T] | None."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    fn = _compiled_chunk() if compiled else _chunk
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        args = (hidden[s:s + chunk_size], weight, targets[s:s + chunk_size], inv_temp, with_entropy)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(fn, *args, use_reentrant=False)
        else:
            lp, ent = fn(*args)
        lps.append(lp)
        if ent is not None:
            ents.append(ent)
    logp = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
    return logp, (torch.cat(ents) if with_entropy and ents else (hidden.new_zeros(0, dtype=torch.float32) if with_entropy else None))
