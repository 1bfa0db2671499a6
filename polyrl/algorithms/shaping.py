"""Reward shaping applied to sequence rewards before advantages: pure tensor functions."""

from __future__ import annotations

import torch


def overlong_penalty(response_lens: torch.Tensor, *, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment. response_lens: [N] -> penalty [N] (<= 0), added to the rewards.

    Responses up to max_len - buffer_len tokens get 0; past it the penalty falls linearly,
    -factor * (len - (max_len - buffer_len)) / buffer_len, reaching -factor at max_len.
    buffer_len 0 turns it off (all zeros).
    """
    if buffer_len <= 0:
        return torch.zeros(response_lens.shape, dtype=torch.float32)
    over = (response_lens.float() - (max_len - buffer_len)).clamp(min=0.0)
    return -factor * over / buffer_len
