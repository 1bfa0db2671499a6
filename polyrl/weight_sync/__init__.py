"""Moving an HF-named (name, tensor) stream from a train backend into rollout engines.

Backends decide which tensors (and their HF names); transports decide how they move.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Protocol

import torch


class WeightTransport(Protocol):
    """How an HF-named (name, tensor) stream reaches an engine: in process (InMemoryTransport), over a process group
    (DistributedTransport: NCCL or gloo), or through files (DiskTransport); polyrl/weight_sync/distributed.py."""

    def push(self, stream: Iterable[tuple[str, torch.Tensor]], engine, version: int) -> int:
        """Deliver the whole stream to `engine` (every server behind it), which then holds weights `version`; returns
        the bytes of the stream. Collective over the trainer's ranks: every rank calls it with its share of the export."""


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


class WeightExport:
    """What a backend's export_weights() may return instead of a plain generator. Iterating it yields the (HF name,
    full tensor) stream every transport understands. An engine in the same process that keeps its weights as named
    views of its own buffers calls `copy_into(views)` instead: the backend writes them straight from its parameters
    (polyrl.weight_sync.direct) and returns the names written, or None when it cannot here (the engine then iterates).
    `nbytes`: the bytes delivered either way."""

    def __init__(self, stream: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                 copy_into: Callable[[Mapping[str, torch.Tensor]], set[str] | None] | None = None):
        self._stream, self._copy_into = stream, copy_into
        self.nbytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._stream():
            self.nbytes += t.numel() * t.element_size()
            yield name, t

    def copy_into(self, views: Mapping[str, torch.Tensor]) -> set[str] | None:
        seen = self._copy_into(views) if self._copy_into is not None else None
        if seen is not None:
            self.nbytes += sum(views[n].numel() * views[n].element_size() for n in seen)
        return seen


class InMemoryTransport:
    """Trainer and engine share a process; tensors are copied in place, bucket by bucket."""

    def __init__(self, bucket_bytes: int = 512 * 1024**2):
        self.bucket_bytes = bucket_bytes

    def push(self, stream: Iterable[tuple[str, torch.Tensor]], engine, version: int) -> int:
        if isinstance(stream, WeightExport):  # the engine may take the direct copy
            engine.update_weights(stream, version)
            return stream.nbytes
        total = 0

        def flat():
            nonlocal total
            for bucket in buckets(stream, self.bucket_bytes):
                for name, t in bucket:
                    total += t.numel() * t.element_size()
                    yield name, t
        engine.update_weights(flat(), version)
        return total


class FP8Transport:
    """--rollout-quantization fp8 around any transport: every linear weight of the stream leaves as FP8 E4M3 with
    128x128 block scales (polyrl.weight_sync.quantize), stacked MoE experts per expert. Servers receive that (SGLang's
    FP8 names; `polyrl serve` dequantizes); an engine in this process gets the dequantized weights, since it runs
    BF16/FP32 matmuls either way. The bytes returned are those of the quantized stream: what FP8 weights cost to move.
    stacked_experts: split and quantize stacked expert tensors (False for quantize.TRANSPOSED_EXPERTS families)."""

    def __init__(self, inner: WeightTransport, *, in_process: bool, stacked_experts: bool = True):
        self.inner, self.in_process, self.stacked_experts = inner, in_process, stacked_experts

    def push(self, stream: Iterable[tuple[str, torch.Tensor]], engine, version: int) -> int:
        from polyrl.weight_sync.quantize import dequantize_stream, quantize_stream, stream_nbytes
        wire = quantize_stream(stream, stacked_experts=self.stacked_experts)
        if not self.in_process or getattr(engine, "loads_fp8_weights", False):  # the GPU engine's FP8 linears
            return self.inner.push(wire, engine, version)
        moved = [0]
        self.inner.push(dequantize_stream(stream_nbytes(wire, moved)), engine, version)
        return moved[0]


class NoTransport:
    """--debug-train-only: no engine to send weights to."""

    def push(self, stream: Iterable[tuple[str, torch.Tensor]], engine, version: int) -> int:
        engine.update_weights(iter(()), version)
        return 0
