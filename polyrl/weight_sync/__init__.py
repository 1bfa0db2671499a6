"""Moving an HF-named (name, tensor) stream from a train backend into rollout engines.

Backends decide which tensors (and their HF names); transports decide how they move.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


def buckets(stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into buckets of about `bucket_bytes` (a tensor larger than the bucket
    travels alone), so at most one bucket is in flight at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in stream:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class InMemoryTransport:
    """Colocated: trainer and engine share a process; tensors are copied in place, bucket by bucket."""

    def __init__(self, bucket_bytes: int = 512 * 1024**2):
        self.bucket_bytes = bucket_bytes

    def push(self, stream: Iterable[tuple[str, torch.Tensor]], engines: list, version: int) -> int:
        total = 0
        def flat():
            nonlocal total
            for bucket in buckets(stream, self.bucket_bytes):
                for name, t in bucket:
                    total += t.numel() * t.element_size()
                    yield name, t
        if len(engines) == 1:
            engines[0].update_weights(flat(), version)
        else:
            items = list(flat())
            for e in engines:
                e.update_weights(iter(items), version)
        return total
