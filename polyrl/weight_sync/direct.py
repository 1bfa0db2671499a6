"""Colocated weight sync without a per-parameter step: the trainer's tensors are cast and written straight into the
engine's weight buffer, a few kernels per FSDP unit.

An in-process engine keeps its weights as HF-named views of one flat buffer (polyrl.rollout.gpu.model.DenseLM.hf).
Writing name by name costs a Python lookup, a shape check and a view per parameter (~290 at the 0.5B shape, most of a
7.6 ms push against a 0.7 ms device-copy floor, bench/RESULTS.md). Here the destinations of one source group (an FSDP
unit: a decoder layer, the root) are sorted by their place in the engine's buffer and form one run per buffer (a new
run where a destination aliases one already in it). A run's region is split into its destinations with one call, and
every destination of the group is written by one multi-tensor copy (`torch._foreach_copy_`: a few kernel launches for
the whole model, the FP32 -> BF16 cast included; `torch.cat(..., out=)` would fall back to one copy kernel per source
when the dtypes differ). Gaps (padding, weights of other groups) are not written. Destinations that are not contiguous
views of that buffer go through a second multi-tensor copy. Plans are built once and reused while the buffers stay
where they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch


def _check(name: str, shape: torch.Size, views: Mapping[str, torch.Tensor]) -> torch.Tensor:
    try:
        dst = views[name]
    except KeyError:
        raise KeyError(f"weight sync sent {name!r}, which the rollout model does not have") from None
    if tuple(shape) != tuple(dst.shape):
        raise ValueError(f"{name}: got shape {tuple(shape)}, the rollout model has {tuple(dst.shape)}")
    return dst


@dataclass
class GroupPlan:
    """How one source group reaches the engine: `runs` (the name of the run's first destination, the run's length in
    elements, and its slots in buffer order: (source index in the group's order, or None for padding, elements)) and
    `loose` (source index, destination name). It holds names, not the engine's tensors: an engine that sleeps frees
    its buffer."""

    runs: list[tuple[str, int, list[tuple[int | None, int]]]] = field(default_factory=list)
    loose: list[tuple[int, str]] = field(default_factory=list)

    def bind(self, sources: list[torch.Tensor]) -> tuple[list, list, list]:
        """The copies' source arguments (sources: the group's tensors flattened, [numel], in the plan's order):
        (sources of the runs' destinations in order, per run (slot sizes, which slots are sources), loose sources);
        reusable while the sources stay where they are."""
        srcs, splits = [], []
        for _, _, slots in self.runs:
            srcs += [sources[i] for i, _ in slots if i is not None]
            splits.append(([n for _, n in slots], [j for j, (i, _) in enumerate(slots) if i is not None]))
        return srcs, splits, [sources[i] for i, _ in self.loose]

    def run(self, bound: tuple[list, list, list], views: Mapping[str, torch.Tensor]) -> None:
        srcs, splits, loose = bound
        dsts: list[torch.Tensor] = []
        for (first, n, _), (sizes, keep) in zip(self.runs, splits):
            v = views[first]
            pieces = v.as_strided((n,), (1,), v.storage_offset()).split(sizes)
            dsts += [pieces[j] for j in keep]
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        if loose:
            dsts = [views[name] for _, name in self.loose]
            torch._foreach_copy_(dsts, [t.view(d.shape) for t, d in zip(loose, dsts)], non_blocking=True)

    def write(self, sources: list[torch.Tensor], views: Mapping[str, torch.Tensor]) -> None:
        self.run(self.bind(sources), views)


def plan_groups(groups: list[list[tuple[str, torch.Size]]], views: Mapping[str, torch.Tensor]) -> list[GroupPlan]:
    """One GroupPlan per group of (HF name, shape) sources. Unknown names and shape mismatches raise as the engine's
    own load does."""
    dsts = [[_check(n, s, views) for n, s in g] for g in groups]
    plans = []
    for g, dst in zip(groups, dsts):
        plan = GroupPlan()
        placed = []  # (storage key, start element, source index, view, name)
        for i, ((name, _), d) in enumerate(zip(g, dst)):
            if d.is_contiguous() and d.numel():
                st = d.untyped_storage()
                placed.append(((st.data_ptr(), d.dtype, d.device), (d.data_ptr() - st.data_ptr()) // d.element_size(),
                               i, d, name))
            elif d.numel():
                plan.loose.append((i, name))
        placed.sort(key=lambda x: (x[0][0], x[1]))
        run: list = []
        for item in placed:
            if run:
                key, start, _, d, _ = run[-1]
                end = start + d.numel()
                if item[0] != key or item[1] < end:  # another buffer, or an alias of a weight already in the run
                    plan.runs.append(_run(run))
                    run = []
            run.append(item)
        if run:
            plan.runs.append(_run(run))
        plans.append(plan)
    return plans


def _run(items: list) -> tuple[str, int, list[tuple[int | None, int]]]:
    """(first destination's name, elements from its start to the last one's end, slots)."""
    first, last = items[0], items[-1]
    slots: list[tuple[int | None, int]] = []
    pos = first[1]
    for _, start, i, d, _ in items:
        if start > pos:  # a gap: padding or a weight this group does not send, left as it is
            slots.append((None, start - pos))
        slots.append((i, d.numel()))
        pos = start + d.numel()
    return first[4], last[1] + last[3].numel() - first[1], slots
