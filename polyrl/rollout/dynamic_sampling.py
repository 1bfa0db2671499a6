"""DAPO's dynamic sampling (--dynamic-sampling-filter-path): draw, generate, score and filter prompt groups until a
step holds --rollout-batch-size of them. A free function over the rollout's own draw / generate / score and the
user's filter, so it knows nothing of the loop."""

from __future__ import annotations

from typing import Callable

import numpy as np

from polyrl.config import RolloutConfig
from polyrl.data import DataError
from polyrl.dist import Dist
from polyrl.rewards import merge_reward_metrics, resolve_filter_fn
from polyrl.types import Sample


class DynamicSamplingError(DataError):
    """Dynamic sampling could not fill a step within --max-dynamic-sampling-draws."""


def group_samples(samples: list[Sample]) -> list[list[Sample]]:
    """Samples split by prompt (group_index), in order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


class GroupFilter:
    """The user's filter (True keeps a prompt group), with errors that name it, and the process group the ranks agree
    on the number of draws over: a gloo group of its own, since this may run on the async loop's rollout thread while
    the main thread's collectives (training) use the default group."""

    def __init__(self, path: str, d: Dist):
        self.path = path
        self.keep_group: Callable[[list[Sample]], bool] = resolve_filter_fn(path)
        self.d = d.own_group()

    def __call__(self, group: list[Sample]) -> bool:
        try:
            keep = self.keep_group(group)
        except Exception as e:
            raise RuntimeError(f"--dynamic-sampling-filter-path {self.path} raised on a group of {len(group)} samples "
                               f"(prompt {group[0].prompt[:200]!r}): {type(e).__name__}: {e}") from e
        if not isinstance(keep, (bool, np.bool_)):
            raise TypeError(f"--dynamic-sampling-filter-path {self.path} returned {keep!r} ({type(keep).__name__}); "
                            "return True (keep the group) or False (drop it)")
        return bool(keep)


def fill_step(r: RolloutConfig, step: int, *, draw: Callable[[], list], generate: Callable[[list, int], list[Sample]],
              score: Callable[[list[Sample]], dict], keep: GroupFilter) -> tuple[list[Sample], dict, dict]:
    """Draw --over-sampling-batch-size prompts, generate (generate(items, draw index)), score and keep the groups the
    filter passes, until this rank holds its share of --rollout-batch-size groups; groups past that are dropped
    (counted in dynamic_sampling/surplus_groups). Every rank draws until all ranks are full, so the data position stays
    the same on all of them (a rank that is full draws without generating). Returns (samples, this rank's reward
    metrics, step metrics)."""
    d = keep.d
    need, kept, scored = r.rollout_batch_size // d.world, [], []
    dropped = surplus = 0
    for k in range(r.max_dynamic_sampling_draws):
        items = draw()
        if len(kept) < need:
            samples = generate(items, k)
            scored.append((len(samples), score(samples)))
            for group in group_samples(samples):
                if not keep(group):
                    dropped += 1
                elif len(kept) < need:
                    kept.append(group)
                else:
                    surplus += 1
        total_kept, short, total_dropped, total_surplus = d.sum([len(kept), len(kept) < need, dropped, surplus])
        if not short:
            break
    else:
        raise DynamicSamplingError(
            f"dynamic sampling kept {total_kept:.0f} of --rollout-batch-size {r.rollout_batch_size} groups in step "
            f"{step + 1} after --max-dynamic-sampling-draws {r.max_dynamic_sampling_draws} draws of "
            f"{r.over_sampling_batch_size or r.rollout_batch_size} prompts (--over-sampling-batch-size); "
            f"--dynamic-sampling-filter-path {keep.path} dropped {total_dropped:.0f} groups. Raise "
            "--over-sampling-batch-size or --max-dynamic-sampling-draws, or check the reward: with "
            "polyrl.rewards.filters:nonzero_std a group whose samples all get the same reward is dropped")
    samples = [s for group in kept for s in group]
    for i, group in enumerate(kept):
        for s in group:
            s.group_index = i  # the prompt of the step it answers, as without dynamic sampling
    return samples, merge_reward_metrics(scored), {
        "dynamic_sampling/kept_groups": total_kept, "dynamic_sampling/dropped_groups": total_dropped,
        "dynamic_sampling/surplus_groups": total_surplus, "dynamic_sampling/extra_draws": k}
