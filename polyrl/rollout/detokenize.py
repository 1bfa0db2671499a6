"""Response texts of finished samples, decoded in batches on worker threads.

An engine's samples carry `response = tokenizer.decode(response_ids, skip_special_tokens=True)` for the reward
functions. Decoded one sample at a time on the engine's loop this is pure host time: ~0.5 us per token, so a step of
512 samples x 512 tokens spent ~0.2 s in it with the GPU idle (all of them finish at the last decode step). A fast
tokenizer's Rust backend releases the GIL in `decode_batch`, so `Detokenizer` hands each batch of finished samples to
a small thread pool as they finish (in parallel with the decode steps still running) and `finish()` waits for what is
left. The text is the one `tokenizer.decode` gives: the batched path is taken only where transformers' `decode` is
exactly the backend's decode (a fast tokenizer without its own `_decode` and without the clean-up of tokenization
spaces); any other tokenizer's samples go through `tokenizer.decode` one by one (on the same threads).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor

from polyrl.types import Sample

MAX_THREADS = 8
CHUNK = 64  # samples per task: small enough to spread one finishing wave over the threads


_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _pool() -> ThreadPoolExecutor:
    """The process's decode threads, made on first use. A forked child makes its own: it inherits the parent's
    executor without its threads, and work queued there would never run."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=max(1, min(MAX_THREADS, os.cpu_count() or 1)),
                                                 thread_name_prefix="detok"))
    return _POOL[1]


def batch_decoder(tokenizer):
    """The backend's `decode_batch` when it gives exactly what `tokenizer.decode(ids, skip_special_tokens=True)`
    gives, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    if cls._decode is not PreTrainedTokenizerFast._decode or cls.decode is not PreTrainedTokenizerBase.decode:
        return None
    return functools.partial(backend.decode_batch, skip_special_tokens=True)


def decode_all(tokenizer, seqs: list[list[int]]) -> list[str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` of every sequence, batched over the pool's threads."""
    d = Detokenizer(tokenizer)
    return [t for f in d.submit(seqs) for t in f.result()]


class Detokenizer:
    """Fills `Sample.response` of finished samples: `add` as they finish, `finish` before the samples leave the
    engine. One per generate call (it holds the call's pending batches)."""

    def __init__(self, tokenizer):
        self.decode = batch_decoder(tokenizer) or (lambda seqs: [tokenizer.decode(s, skip_special_tokens=True)
                                                                  for s in seqs])
        self.pending: list[tuple[list[Sample], list[Future]]] = []

    def submit(self, seqs: list[list[int]]) -> list[Future]:
        return [_pool().submit(self.decode, seqs[i:i + CHUNK]) for i in range(0, len(seqs), CHUNK)]

    def add(self, samples: list[Sample]) -> None:
        if samples:
            self.pending.append((samples, self.submit([s.response_ids for s in samples])))

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        for samples, parts in pending:
            for s, text in zip(samples, (t for f in parts for t in f.result())):
                s.response = text
