"""Reward shaping (polyrl.algorithms.shaping) against hand-worked values, on CPU."""

import torch
from torch.testing import assert_close

from polyrl.algorithms.shaping import overlong_penalty


def test_overlong_penalty_by_hand():
    # max_len 20, buffer 5: free up to 15 tokens, then -F * (len - 15) / 5
    lens = torch.tensor([10, 15, 16, 18, 20])
    assert_close(overlong_penalty(lens, max_len=20, buffer_len=5, factor=1.0), torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0]))
    assert_close(overlong_penalty(lens, max_len=20, buffer_len=5, factor=0.5), torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5]))


def test_overlong_penalty_off_and_whole_length_buffer():
    lens = torch.tensor([3, 20])
    assert_close(overlong_penalty(lens, max_len=20, buffer_len=0, factor=1.0), torch.zeros(2))
    # buffer = max_len: linear from the first token, -F * len / max_len: 3 -> -0.15, 20 -> -1
    assert_close(overlong_penalty(lens, max_len=20, buffer_len=20, factor=1.0), torch.tensor([-0.15, -1.0]))
    assert overlong_penalty(torch.tensor([], dtype=torch.long), max_len=20, buffer_len=5, factor=1.0).shape == (0,)
