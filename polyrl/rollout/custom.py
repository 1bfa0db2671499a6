"""--custom-generate-function-path: a user's async rollout function (multi-turn, tools, environments) instead of
one plain engine call per prompt.

The function (slime's hook name; polyrl's signature):

    async def generate(record: GenerateRecord, sampling_params: SamplingParams, engine: EngineHandle,
                       tokenizer) -> Sample | list[Sample]

- `record`: the prompt (`prompt_ids`, `prompt`, `label`, `metadata`), where the call sits in the step
  (`group_index`, `sample_index`) and its limits: `max_turns` (--max-turns, None: no limit) and `max_context_len`
  (--rollout-max-context-len, None: no limit).
- `sampling_params`: the run's sampling settings with `n=1` and a `seed` of its own for this (step, prompt, sample);
  derive further seeds from it (polyrl.rollout.sampling.mix_seed) for later turns. Its `max_new_tokens` is this
  sample's response budget: --rollout-max-response-len, lowered to what --rollout-max-context-len leaves after the
  prompt; every response token (the model's and the tool's) counts against it.
- `engine`: `await engine.generate(token_ids, params) -> list[Sample]` (params.n samples of one prompt, each with
  per-token rollout logprobs), over whatever engine the run has (embedded, servers, SGLang). Each call is one turn.
- `tokenizer`: the run's tokenizer.

It returns one Sample (or several) whose `prompt_ids` are the record's (left empty: filled in) and whose
`response_ids` hold every token after the prompt: the model's and the tool's / environment's, with
`loss_mask` 1 on model tokens and 0 on the others, and `rollout_logprobs` for every response token (any value on
masked tokens; 0.0 by convention). polyrl calls it --n-samples-per-prompt times per prompt, at most
--custom-generate-concurrency calls at once, each within --rollout-request-timeout seconds, and sets
group_index, prompt, label, metadata (the record's, updated with what the function set, and `turns`: its engine
calls) and weight_version.
Limits polyrl enforces: an engine call generates at most what --rollout-max-context-len leaves after its token_ids
(none left: an empty response, finish reason "length", and no engine work); a call past --max-turns raises an error
naming the function (a function that ignores record.max_turns is a bug, not data); a returned sample longer than its
budget is cut to it with finish reason "length" (polyrl.rollout.sampling.cut_to_budget).
The function runs on an event loop: await the engine (and any other I/O); a blocking call inside it stalls every
other call and escapes the timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from polyrl.rollout.sampling import cut_to_budget, mix_seed, response_budget
from polyrl.types import Sample, SamplingParams

FLAG = "--custom-generate-function-path"


class CustomGenerateTimeout(TimeoutError):
    """A call of the custom generate function passed --rollout-request-timeout (polyrl train exits 1 with it)."""


@dataclass
class GenerateRecord:
    """One prompt as a custom generate function sees it."""

    prompt_ids: list[int]
    prompt: Any  # str, or chat messages when the dataset stores conversations
    label: Any = None
    metadata: dict = field(default_factory=dict)
    group_index: int = 0  # the prompt's place in this rank's draw
    sample_index: int = 0  # which of its --n-samples-per-prompt calls this is
    max_turns: int | None = None  # --max-turns: engine calls this call may make
    max_context_len: int | None = None  # --rollout-max-context-len: prompt + response tokens a sample may hold


class EngineHandle:
    """The run's RolloutEngine as a custom generate function uses it: one async call per prompt. An engine in
    the trainer's process (engine.concurrent_update False: one model) runs one call at a time; engine servers
    take the calls concurrently."""

    def __init__(self, engine, threads: int):
        self._engine = engine
        self._lock = None if engine.concurrent_update else asyncio.Lock()
        # engine calls block: they run on threads of our own, which a timed-out step leaves behind instead of
        # waiting for them as asyncio.run does for its default executor
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="polyrl-custom-generate")

    @property
    def version(self) -> int | None:
        return self._engine.version

    async def generate(self, token_ids: list[int], params: SamplingParams) -> list[Sample]:
        """params.n samples continuing `token_ids`, each with response_ids, rollout_logprobs, finish_reason."""
        call = functools.partial(self._engine.generate, [list(token_ids)], params)
        if self._lock is None:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TurnLimitError(ValueError):
    """A custom generate function called the engine more often than --max-turns allows."""


class _CallEngine:
    """The engine as one call of the function sees it: counts its turns and holds each to the context budget."""

    def __init__(self, handle: EngineHandle, max_turns: int | None, max_context_len: int | None, where: str):
        self._handle, self._max_turns, self._ctx, self._where = handle, max_turns, max_context_len, where
        self.turns = 0

    @property
    def version(self) -> int | None:
        return self._handle.version

    async def generate(self, token_ids: list[int], params: SamplingParams) -> list[Sample]:
        """params.n samples continuing `token_ids`, each with response_ids, rollout_logprobs, finish_reason."""
        self.turns += 1
        if self._max_turns is not None and self.turns > self._max_turns:
            raise TurnLimitError(f"{self._where} made engine call {self.turns}, past --max-turns {self._max_turns}; "
                                 "stop after record.max_turns turns")
        room = response_budget(len(token_ids), params.max_new_tokens, self._ctx)
        if room == 0:  # the context is full: what the engine would answer, without asking it
            return [Sample(list(token_ids), [], [], "length") for _ in range(params.n)]
        if room < params.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=room)
        return await self._handle.generate(token_ids, params)


def resolve_generate_fn(path: str) -> Callable:
    """The --custom-generate-function-path function (imported once; start-up validation calls this first)."""
    from polyrl.rewards import _load_attr
    fn = _load_attr(path, FLAG)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{FLAG} {path!r}: {getattr(fn, '__name__', fn)!r} is not an `async def` function; polyrl "
                         "awaits it (async def fn(record, sampling_params, engine, tokenizer))")
    return fn


def generate_with(fn: Callable, path: str, engine, tokenizer, items: list, params: SamplingParams, *,
                  timeout: float, concurrency: int, max_turns: int | None = None,
                  max_context_len: int | None = None) -> list[Sample]:
    """Run `fn` params.n times per prompt of `items` [(prompt_ids, PromptRecord)] and return the samples grouped by
    prompt (samples of prompt i before those of prompt i + 1), as RolloutEngine.generate does."""
    limits = (max_turns, max_context_len)
    return asyncio.run(_generate_all(fn, path, engine, tokenizer, items, params, timeout, concurrency, limits))


async def _generate_all(fn, path, engine, tokenizer, items, params, timeout, concurrency, limits) -> list[Sample]:
    handle, gate = EngineHandle(engine, threads=concurrency), asyncio.Semaphore(concurrency)
    base = params.seed if params.seed is not None else 0

    async def one(i: int, j: int) -> list[Sample]:
        ids, rec = items[i]
        record = GenerateRecord(list(ids), rec.prompt, rec.label, dict(rec.metadata), group_index=i, sample_index=j,
                                max_turns=limits[0], max_context_len=limits[1])
        # one seed per (step, prompt, sample): the step's seed mixed with the call's index
        sp = dataclasses.replace(params, n=1, seed=mix_seed(base, i * params.n + j), prompt_seeds=None,
                                 max_new_tokens=response_budget(len(ids), params.max_new_tokens, limits[1]))
        call = _CallEngine(handle, *limits, where=f"{FLAG} {path} (prompt {i}, sample {j})")
        async with gate:
            try:
                out = await asyncio.wait_for(fn(record, sp, call, tokenizer), timeout)
            except asyncio.TimeoutError:
                raise CustomGenerateTimeout(f"{FLAG} {path} did not return within --rollout-request-timeout {timeout:g} s (prompt "
                                   f"{i}, sample {j}: {str(rec.prompt)[:200]!r}); raise the timeout or find where it "
                                   "waits") from None
        return [_checked(s, record, rec, path, call, tokenizer, (params.max_new_tokens, limits[1]))
                for s in (out if isinstance(out, list) else [out])]

    try:
        results = await asyncio.gather(*(one(i, j) for i in range(len(items)) for j in range(params.n)))
    finally:
        handle.close()
    counts = {len(r) for r in results}
    if len(counts) > 1:
        raise ValueError(f"{FLAG} {path} returned {sorted(counts)} samples from different calls of one step; every call "
                         "must return the same number (a group's samples share one advantage baseline)")
    return [s for r in results for s in r]


def _checked(s: Any, record: GenerateRecord, rec, path: str, call: _CallEngine, tokenizer, budget: tuple) -> Sample:
    """The sample with the fields polyrl owns set, cut to its budget (--rollout-max-response-len,
    --rollout-max-context-len)."""
    if not isinstance(s, Sample):
        raise TypeError(f"{FLAG} {path} returned {type(s).__name__}; return a polyrl.types.Sample or a list of them")
    n = len(s.response_ids)
    if s.loss_mask is None:
        s.loss_mask = [1] * n
    if len(s.loss_mask) != n or len(s.rollout_logprobs) != n:
        raise ValueError(f"{FLAG} {path} returned a sample with {n} response tokens but {len(s.loss_mask)} loss_mask and "
                         f"{len(s.rollout_logprobs)} rollout_logprobs entries; give one of each per response token "
                         "(tool tokens: loss_mask 0, logprob 0.0)")
    if not s.prompt_ids:
        s.prompt_ids = list(record.prompt_ids)
    if cut_to_budget(s, *budget) or not s.response:
        # what reward functions read: every response token, the tool's included
        s.response = tokenizer.decode(s.response_ids, skip_special_tokens=True)
    s.group_index = record.group_index
    s.prompt = rec.prompt if isinstance(rec.prompt, str) else str(rec.prompt)
    s.label = rec.label
    s.metadata = {**rec.metadata, **s.metadata, "turns": call.turns}
    if s.weight_version is None:  # engine servers report the version of each response; in-process engines hold one
        s.weight_version = call.version
    return s
