"""CUDA-graph capture the way the engine's decode step does it, shared by the engine, its GPU tests and the benches."""

from __future__ import annotations

import torch


# below this share of the device free, a capture first hands the allocator's unused cached blocks back to the driver
# (it cannot free them once capturing, and would fail an allocation the cache could have served)
TIGHT = 0.1


def capture(fn, *, warmup=None, pool=None, device=None, stream=None):
    """(graph, what fn returned while captured). `warmup` (default: fn) runs once first on a side stream: it compiles
    the kernels and settles the caching allocator, so that the capture records no first-call work. `stream`: the
    capture stream (default: torch's one for every graph). cuBLAS takes its workspace by stream, so graphs that may
    replay at the same time as others on another stream need a capture stream of their own: two replays writing one
    workspace at once hung the GPU (the engine's scoring launched during its decode).

    torch.cuda.graph empties the device cache and the pinned host cache before every capture, which beside a trainer
    made a capture cost seconds; here the device cache only when the device is nearly full, the host cache never (a
    capture takes no pinned memory)."""
    side, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        (warmup or fn)()
    current.wait_stream(side)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    if free < TIGHT * total:
        torch.cuda.empty_cache()
    if stream is None:  # the stream torch.cuda.graph captures on by default, shared by every graph
        owner = torch.cuda.graphs.graph
        if owner.default_capture_stream is None:
            owner.default_capture_stream = torch.cuda.Stream()
        stream = owner.default_capture_stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)))
        try:
            out = fn()
        finally:
            graph.capture_end()
    return graph, out


class GraphSets:
    """Captured graphs by key, one set per place of the memory they read. A graph bakes in the addresses of the tensors
    it reads (weights, KV cache), so memory that comes back elsewhere after a sleep needs graphs of its own; the sets of
    the last `keep` places are kept, because memory freed and reallocated beside a trainer tends to alternate between
    two places (measured: the --true-on-policy engine's decode graphs were captured again at every step with one set)."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.sets: dict[tuple, dict] = {}  # place -> (key -> graph), least recently used first
        self.current: dict = {}
        self.captures = self.resets = 0  # graphs captured, sets dropped for a new place
        self._drained = (0, 0)

    def use(self, place: tuple) -> None:
        """The memory is at `place` now: the graphs captured for it, if any, are the current set."""
        graphs = self.sets.pop(place, None)
        if graphs is None:
            graphs = {}
            if len(self.sets) >= self.keep:
                self.sets.pop(next(iter(self.sets)))  # the place used least recently
                self.resets += 1
        self.sets[place] = self.current = graphs

    def get(self, key, capture):
        """The current place's graph for `key`, captured by `capture()` on first use."""
        graph = self.current.get(key)
        if graph is None:
            graph = self.current[key] = capture()
            self.captures += 1
        return graph

    def drain(self) -> tuple[int, int]:
        """(graphs captured, sets dropped) since the last drain: a step's metrics."""
        now = (self.captures, self.resets)
        out = (now[0] - self._drained[0], now[1] - self._drained[1])
        self._drained = now
        return out
