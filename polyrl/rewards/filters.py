"""Built-in dynamic sampling filters (--dynamic-sampling-filter-path).

A filter gets the scored samples of one prompt group and returns True to keep the group for
training, False to drop it (and draw more prompts until the step is full).
"""

from __future__ import annotations

from polyrl.types import Sample


def nonzero_std(samples: list[Sample]) -> bool:
    """DAPO's filter: keep a group unless every sample got the same reward (zero std: GRPO
    advantages of 0, so the group would add no gradient, only dilute the batch)."""
    return any(s.reward != samples[0].reward for s in samples[1:])
