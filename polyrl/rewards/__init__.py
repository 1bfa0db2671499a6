"""Reward functions and the manager that applies them to a step's samples.

A reward function scores one sample, ``fn(sample) -> float``; a group function (``--group-rm``)
scores all samples of one prompt at once, ``fn(samples) -> list[float]``. Either may be
``async def``. Built-ins are named in ``REWARD_FUNCTIONS`` and imported only when chosen.
Every call has a deadline (``--rm-timeout``): a call that never returns costs its samples their
reward, not the run. ``--rm-url`` scores batches through a reward model server instead
(``polyrl/rewards/remote.py`` documents its payload).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import logging
import numbers
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from math import isfinite  # not `import math`: importing polyrl.rewards.math rebinds that name here
from pathlib import Path
from typing import Any

from polyrl.types import Sample

logger = logging.getLogger(__name__)

REWARD_FUNCTIONS: dict[str, str] = {
    "math": "polyrl.rewards.math:math_reward",
    "gsm8k": "polyrl.rewards.math:gsm8k_reward",
    "exact": "polyrl.rewards:exact_match",
    "arithmetic": "polyrl.tasks.arithmetic:reward",
}


def exact_match(sample: Sample) -> float:
    """1.0 if the stripped response equals the stripped label."""
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0


@functools.lru_cache(maxsize=None)
def _load_attr(target: str, flag: str) -> Callable:
    """``module:attr`` or ``path/to/file.py:attr`` -> the attribute, with errors naming ``flag``.
    Cached: start-up validation imports it, and a file's top level must not run twice."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{flag} {target!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            # A fresh module per file; registered in sys.modules so dataclasses/pickle inside it work.
            name = f"polyrl_custom_rm_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"{flag} {target!r}: could not import {module_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{flag} {target!r}: {module_name!r} has no function {attr!r}")
    return fn


def resolve_reward_fn(rm_type: str | None, custom_rm_path: str | None) -> Callable:
    """The reward function for ``--custom-rm-path`` if given (it wins, as in slime), else ``--rm-type``."""
    if custom_rm_path:
        return _load_attr(custom_rm_path, "--custom-rm-path")
    if rm_type is None:
        raise ValueError(f"no reward function: pass --rm-type ({', '.join(REWARD_FUNCTIONS)}) or --custom-rm-path")
    if rm_type not in REWARD_FUNCTIONS:
        raise ValueError(f"--rm-type {rm_type!r} is unknown; valid: {', '.join(REWARD_FUNCTIONS)} "
                         "(or pass --custom-rm-path module:function)")
    return _load_attr(REWARD_FUNCTIONS[rm_type], "--rm-type")


def resolve_filter_fn(path: str) -> Callable:
    """The ``--dynamic-sampling-filter-path`` function: ``fn(samples of one group) -> bool`` (keep)."""
    return _load_attr(path, "--dynamic-sampling-filter-path")


def _as_reward(value: Any) -> float | Exception:
    # bool is an int, so True/False count as 1/0; None, strings, NaN and inf are errors.
    if isinstance(value, numbers.Real) and isfinite(value):
        return float(value)
    return ValueError(f"reward function returned {value!r} ({type(value).__name__}); return a finite float")


TIMED_OUT = object()  # the outcome of a call that did not return within the timeout


class _Batch:
    """Calls in flight on a _DaemonCaller's thread: their results in order, when the running one started, and a
    flag that stops the thread before its next call (set under the lock, so a call is never started twice)."""

    def __init__(self, fn: Callable, args: list):
        self.fn, self.args = fn, args
        self.results: list = []
        self.started: float | None = None  # time.monotonic() when call len(results) started
        self.cancelled = False
        self.lock = threading.Lock()
        self.done = threading.Event()


class _DaemonCaller:
    """Calls ``fn(arg)`` for each arg on a daemon thread, one after another in order, each with its own deadline of
    ``timeout`` seconds. A call past it is abandoned with its thread (a daemon: it holds up neither the step nor the
    process exit; Python threads cannot be killed) and the rest go to a fresh thread, so calls still run in order and
    none runs twice. One hand-off per batch, not per call (~30 us each: 8 ms per CPU step of 256 samples before)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue | None = None

    def map(self, fn: Callable, args: list, timeout: float) -> list:
        out: list = []
        while len(out) < len(args):
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._work, args=(self._jobs,), daemon=True, name="polyrl-reward").start()
                weakref.finalize(self, self._jobs.put, None)  # an idle thread ends with its caller
            batch = _Batch(fn, args[len(out):])
            self._jobs.put(batch)
            out += self._wait(batch, timeout)
        return out

    def _wait(self, batch: _Batch, timeout: float) -> list:
        """The batch's results; on the first call past its deadline, those before it and TIMED_OUT for it."""
        while True:
            with batch.lock:
                k, t0 = len(batch.results), batch.started
            if k == len(batch.args):
                return batch.results
            left = timeout if t0 is None else t0 + timeout - time.monotonic()
            if left > 0 and batch.done.wait(left):
                return batch.results
            with batch.lock:
                if len(batch.results) != k or batch.started is None or time.monotonic() - batch.started < timeout:
                    continue  # it moved on (or had not started): a new deadline
                batch.cancelled = True  # the stuck thread starts nothing more
                self._jobs.put(None)  # and ends if its call ever returns
                self._jobs = None
                return batch.results[:k] + [TIMED_OUT]

    @staticmethod
    def _work(jobs: queue.SimpleQueue) -> None:
        while (batch := jobs.get()) is not None:
            for arg in batch.args:
                with batch.lock:
                    if batch.cancelled:
                        return
                    batch.started = time.monotonic()
                try:
                    r = batch.fn(arg)
                except BaseException as e:  # noqa: BLE001 - the caller isolates it like any failure
                    r = e
                with batch.lock:
                    if batch.cancelled:
                        return
                    batch.results.append(r)
                    batch.started = None
            batch.done.set()


class RewardManager:
    """Applies the reward function to samples, isolating failures and stuck calls.

    A call that raises, or returns anything but a finite real number, gives that sample reward
    0.0 and counts in ``reward/errors`` (and ``errors_total`` across calls); the first failure's
    traceback is logged once per manager. A call that does not return within ``timeout`` seconds
    (``--rm-timeout``; None or 0 = no limit) gives its samples reward 0.0 and counts in
    ``reward/timeouts`` (``timeouts_total``); the first one is logged with its sample. Sync
    functions run one after another in order (on a helper thread when there is a timeout, so a
    stuck call can be abandoned); async ones run concurrently, at most ``max_workers`` at a time,
    each with its own deadline (one that blocks the event loop, e.g. time.sleep in an async def,
    stalls the calls sharing that loop, which then time out with it). With ``remote`` (``--rm-url``)
    the samples go in batches to a reward model server, which retries and bounds its own requests;
    samples of a request that failed score 0.0 and count in ``reward/errors``.
    """

    def __init__(self, rm_type: str | None, custom_rm_path: str | None = None, group_rm: bool = False,
                 max_workers: int = 64, timeout: float | None = 60.0, remote=None):
        if group_rm and not custom_rm_path:
            raise ValueError("--group-rm needs --custom-rm-path to a function taking list[Sample]; "
                             "the built-in --rm-type functions score one sample at a time")
        self.remote = remote  # a RemoteRewardModel (--rm-url): batches go over HTTP, it bounds and retries them itself
        self.fn = remote if remote is not None else resolve_reward_fn(rm_type, custom_rm_path)
        self.group_rm, self.max_workers = group_rm, max_workers
        self.timeout = timeout or None
        self.errors_total = self.timeouts_total = 0
        self._logged_error = self._logged_timeout = False
        self._call_sync = _DaemonCaller()
        # an async def is called right here (that only creates the coroutine); anything else may block
        self._is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))

    @classmethod
    def from_config(cls, rc) -> RewardManager:
        """From the reward section of the config (``RewardConfig``)."""
        if rc.rm_url:
            from polyrl.rewards.remote import RemoteRewardModel
            return cls(None, timeout=rc.rm_timeout, remote=RemoteRewardModel.from_config(rc))
        return cls(rc.rm_type, rc.custom_rm_path, rc.group_rm, timeout=rc.rm_timeout)

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set ``sample.reward`` on every sample. Metrics: ``reward/mean``, ``reward/errors``,
        ``reward/timeouts`` and ``reward/accuracy`` (the fraction of samples with reward > 0.5); with
        ``--rm-url`` also ``reward/remote_failures`` (requests that failed after their retries) and
        ``reward/remote_retries`` (attempts sent again)."""
        extra: dict[str, float] = {}
        if self.remote is not None:
            errors, timeouts = self._score_remote(samples, extra), 0
        else:
            errors, timeouts = self._score_calls(samples)
        self.errors_total += errors
        self.timeouts_total += timeouts
        return {**reward_metrics(samples, errors, timeouts), **extra}

    def _score_remote(self, samples: list[Sample], extra: dict[str, float]) -> int:
        values, failures, retried = self.remote.score(samples)  # the remote model logs its first failure
        errors = 0
        for s, v in zip(samples, values):
            if isinstance(v, BaseException):
                errors += 1
                v = 0.0
            s.reward = v
        extra.update({"reward/remote_failures": float(failures), "reward/remote_retries": float(retried)})
        return errors

    def _score_calls(self, samples: list[Sample]) -> tuple[int, int]:
        """One call of the reward function per sample (per group with --group-rm): (errors, timeouts)."""
        if self.group_rm:
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(samples):
                groups.setdefault(s.group_index, []).append(i)
            units = list(groups.values())
        else:
            units = [[i] for i in range(len(samples))]

        args = [[samples[i] for i in idx] if self.group_rm else samples[idx[0]] for idx in units]
        if self._is_async or self.timeout is None:
            outcomes: list[Any] = []
            for arg in args:
                try:
                    outcomes.append(self.fn(arg))
                except Exception as e:
                    outcomes.append(e)
        else:  # one hand-off to the helper thread for all of them, each call with its own deadline
            outcomes = self._call_sync.map(self.fn, args, self.timeout)
        pending = {u: out for u, out in enumerate(outcomes) if inspect.isawaitable(out)}
        if pending:
            for u, out in zip(pending, self._await_all(list(pending.values()))):
                outcomes[u] = out

        errors = timeouts = 0
        for idx, out in zip(units, outcomes):
            if out is TIMED_OUT:
                timeouts += len(idx)
                self._log_first_timeout(samples[idx[0]])
                for i in idx:
                    samples[i].reward = 0.0
                continue
            for i, reward in zip(idx, self._unit_rewards(out, len(idx))):
                if isinstance(reward, BaseException):
                    errors += 1
                    self._log_first(reward, samples[i])
                    reward = 0.0
                samples[i].reward = reward
        return errors, timeouts

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()

    def _unit_rewards(self, out: Any, n: int) -> list[float | BaseException]:
        if isinstance(out, BaseException):
            return [out] * n
        if not self.group_rm:
            return [_as_reward(out)]
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else repr(out)
            return [ValueError(f"group reward function returned {got} for a group of {n} samples; "
                               f"return a list of {n} floats")] * n
        return [_as_reward(v) for v in out]

    def _await_all(self, awaitables: list) -> list:
        """Outcomes of the awaitables (a value, an exception or TIMED_OUT), run on an event loop of
        their own in a daemon thread: that works from inside a running loop too (async trainer,
        notebook), and a coroutine that blocks its loop (time.sleep in an async def) or ignores its
        cancellation still cannot hold up the caller past the deadline."""
        results: list[Any] = [TIMED_OUT] * len(awaitables)

        async def one(i: int, aw, sem: asyncio.Semaphore) -> None:
            async with sem:
                task = asyncio.ensure_future(aw)
                done, _ = await asyncio.wait({task}, timeout=self.timeout)
                if not done:
                    task.cancel()  # not awaited: a coroutine that ignores cancellation must not hold the batch
                elif task.cancelled():
                    results[i] = asyncio.CancelledError("the reward coroutine was cancelled")
                else:
                    results[i] = task.exception() or task.result()

        async def main() -> None:
            sem = asyncio.Semaphore(self.max_workers)
            await asyncio.gather(*(one(i, aw, sem) for i, aw in enumerate(awaitables)))

        finished = threading.Event()

        def run() -> None:
            try:
                asyncio.run(main())
            finally:
                finished.set()

        threading.Thread(target=run, daemon=True, name="polyrl-reward-async").start()
        rounds = -(-len(awaitables) // self.max_workers)  # the semaphore admits max_workers calls at a time
        finished.wait(None if self.timeout is None else rounds * self.timeout + 1.0)
        return list(results)  # a call still running now counts as timed out

    def _log_first(self, err: BaseException, sample: Sample) -> None:
        if self._logged_error:
            return
        self._logged_error = True
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        logger.warning("reward function %s failed on a sample of group %d; it gets reward 0.0 and counts in "
                       "reward/errors (later failures are counted, not logged)", name, sample.group_index,
                       exc_info=err)

    def _log_first_timeout(self, sample: Sample) -> None:
        if self._logged_timeout:
            return
        self._logged_timeout = True
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        logger.warning("reward function %s did not return within --rm-timeout %gs on a sample of group %d "
                       "(prompt %r, response %r, label %r); it gets reward 0.0 and counts in reward/timeouts, the "
                       "stuck call is abandoned and the run goes on (later timeouts are counted, not logged)",
                       name, self.timeout, sample.group_index, _clip(sample.prompt), _clip(sample.response), sample.label)


# reward metrics that count events (summed over draws and ranks), unlike the means beside them
COUNT_METRICS = ("reward/errors", "reward/timeouts", "reward/remote_failures", "reward/remote_retries", "reward/samples",
                 "reward/zeros")


def merge_reward_metrics(scored: list[tuple[int, dict]]) -> dict[str, float]:
    """One step's reward metrics from those of several scorings [(samples, metrics)]: counts add, means are weighted."""
    n = max(sum(k for k, _ in scored), 1)
    return {key: sum(m[key] * (1 if key in COUNT_METRICS else k / n) for k, m in scored) for key in scored[0][1]}


def reward_metrics(samples: list[Sample], errors: int = 0, timeouts: int = 0) -> dict[str, float]:
    """The reward metrics of scored samples (also of samples read back with their rewards: --debug-train-only)."""
    n = max(len(samples), 1)
    return {
        "reward/mean": sum(s.reward for s in samples) / n,
        "reward/errors": float(errors),
        "reward/timeouts": float(timeouts),
        "reward/accuracy": sum(s.reward > 0.5 for s in samples) / n,
        # with errors and timeouts, these tell a step where every call failed or every reward is 0 (polyrl.metrics)
        "reward/samples": float(len(samples)),
        "reward/zeros": float(sum(s.reward == 0 for s in samples)),
    }


def _clip(text: Any, n: int = 200) -> Any:
    return text if not isinstance(text, str) or len(text) <= n else text[:n // 2] + " ... " + text[-n // 2:]
