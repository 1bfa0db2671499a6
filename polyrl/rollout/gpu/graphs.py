"""CUDA-graph capture the way the engine's decode step does it, shared by the engine, its GPU tests and the benches."""

from __future__ import annotations

import torch


def capture(fn, *, warmup=None, pool=None, device=None):
    """(graph, what fn returned while captured). `warmup` (default: fn) runs once first on a side stream: it compiles
    the kernels and settles the caching allocator, so that the capture records no first-call work."""
    side, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        (warmup or fn)()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
