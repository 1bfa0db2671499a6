"""DAPO's dynamic sampling (--dynamic-sampling-filter-path): draw, generate, score and filter prompt groups until a
step holds --rollout-batch-size of them. Used by `Run.rollout` (polyrl/loop.py) in both loops."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch.distributed as dist

from polyrl import runtime as rt
from polyrl.data import DataError
from polyrl.rewards import merge_reward_metrics, resolve_filter_fn
from polyrl.types import Sample

if TYPE_CHECKING:
    from polyrl.loop import Run


class DynamicSamplingError(DataError):
    """Dynamic sampling could not fill a step within --max-dynamic-sampling-draws."""


def group_samples(samples: list[Sample]) -> list[list[Sample]]:
    """Samples split by prompt (group_index), in order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


class DynamicSampler:
    """The filter and the process group the ranks agree on the number of draws over: a group of its own, since this
    may run on the async loop's rollout thread while the main thread's collectives (training) use the default group."""

    def __init__(self, path: str, d: rt.Dist):
        self.path = path
        self.keep_group: Callable[[list[Sample]], bool] = resolve_filter_fn(path)
        self.d = rt.Dist(d.rank, d.world, group=dist.new_group(backend="gloo")) if d.world > 1 else d

    def keep(self, group: list[Sample]) -> bool:
        try:
            keep = self.keep_group(group)
        except Exception as e:
            raise RuntimeError(f"--dynamic-sampling-filter-path {self.path} raised on a group of {len(group)} samples "
                               f"(prompt {group[0].prompt[:200]!r}): {type(e).__name__}: {e}") from e
        if not isinstance(keep, (bool, np.bool_)):
            raise TypeError(f"--dynamic-sampling-filter-path {self.path} returned {keep!r} ({type(keep).__name__}); "
                            "return True (keep the group) or False (drop it)")
        return bool(keep)

    def fill(self, run: Run, step: int) -> tuple[list[Sample], dict, dict]:
        """Draw --over-sampling-batch-size prompts, generate, score and keep the groups the filter passes, until this
        rank holds its share of --rollout-batch-size groups; groups past that are dropped (counted in
        dynamic_sampling/surplus_groups). Every rank draws until all ranks are full, so the data position stays the
        same on all of them (a rank that is full draws without generating). Returns (samples, this rank's reward
        metrics, step metrics)."""
        r, d = run.cfg.rollout, self.d
        need, kept, scored = r.rollout_batch_size // d.world, [], []
        dropped = surplus = 0
        for draw in range(r.max_dynamic_sampling_draws):
            items = run.draw(step)
            if len(kept) < need:
                samples = run.generate(items, step, draw)
                scored.append((len(samples), run.score(samples)))
                for group in group_samples(samples):
                    if not self.keep(group):
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
                f"--dynamic-sampling-filter-path {self.path} dropped {total_dropped:.0f} groups. Raise "
                "--over-sampling-batch-size or --max-dynamic-sampling-draws, or check the reward: with "
                "polyrl.rewards.filters:nonzero_std a group whose samples all get the same reward is dropped")
        samples = [s for group in kept for s in group]
        for i, group in enumerate(kept):
            for s in group:
                s.group_index = i  # the prompt of the step it answers, as without dynamic sampling
        return samples, merge_reward_metrics(scored), {
            "dynamic_sampling/kept_groups": total_kept, "dynamic_sampling/dropped_groups": total_dropped,
            "dynamic_sampling/surplus_groups": total_surplus, "dynamic_sampling/extra_draws": draw}
