"""Reward functions and the manager that applies them to a step's samples.

A reward function scores one sample, ``fn(sample) -> float``; a group function (``--group-rm``)
scores all samples of one prompt at once, ``fn(samples) -> list[float]``. Either may be
``async def``. Built-ins are named in ``REWARD_FUNCTIONS`` and imported only when chosen.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import numbers
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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


def _load_attr(target: str, flag: str) -> Callable:
    """``module:attr`` or ``path/to/file.py:attr`` -> the attribute, with errors naming ``flag``."""
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


def _as_reward(value: Any) -> float | Exception:
    # bool is an int, so True/False count as 1/0; None, strings, NaN and inf are errors.
    if isinstance(value, numbers.Real) and isfinite(value):
        return float(value)
    return ValueError(f"reward function returned {value!r} ({type(value).__name__}); return a finite float")


class RewardManager:
    """Applies the reward function to samples, isolating failures.

    A call that raises, or returns anything but a finite real number, gives that sample reward
    0.0 and counts in ``reward/errors`` (and ``errors_total`` across calls); the first failure's
    traceback is logged once per manager. Sync functions run one after another in order; async
    ones run concurrently, at most ``max_workers`` at a time.
    """

    def __init__(self, rm_type: str | None, custom_rm_path: str | None = None, group_rm: bool = False,
                 max_workers: int = 64):
        if group_rm and not custom_rm_path:
            raise ValueError("--group-rm needs --custom-rm-path to a function taking list[Sample]; "
                             "the built-in --rm-type functions score one sample at a time")
        self.fn = resolve_reward_fn(rm_type, custom_rm_path)
        self.group_rm, self.max_workers = group_rm, max_workers
        self.errors_total = 0
        self._logged_error = False

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set ``sample.reward`` on every sample. Metrics: ``reward/mean``, ``reward/errors`` and
        ``reward/accuracy`` (the fraction of samples with reward > 0.5)."""
        if self.group_rm:
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(samples):
                groups.setdefault(s.group_index, []).append(i)
            units = list(groups.values())
        else:
            units = [[i] for i in range(len(samples))]

        outcomes: list[Any] = [None] * len(units)
        pending: dict[int, Any] = {}
        for u, idx in enumerate(units):
            try:
                out = self.fn([samples[i] for i in idx] if self.group_rm else samples[idx[0]])
            except Exception as e:
                out = e
            if inspect.isawaitable(out):
                pending[u] = out
            else:
                outcomes[u] = out
        if pending:
            for u, out in zip(pending, self._await_all(list(pending.values()))):
                outcomes[u] = out

        errors = 0
        for idx, out in zip(units, outcomes):
            for i, reward in zip(idx, self._unit_rewards(out, len(idx))):
                if isinstance(reward, BaseException):
                    errors += 1
                    self._log_first(reward, samples[i])
                    reward = 0.0
                samples[i].reward = reward
        self.errors_total += errors
        n = max(len(samples), 1)
        return {
            "reward/mean": sum(s.reward for s in samples) / n,
            "reward/errors": float(errors),
            "reward/accuracy": sum(s.reward > 0.5 for s in samples) / n,
        }

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
        async def main() -> list:
            sem = asyncio.Semaphore(self.max_workers)

            async def one(aw):
                async with sem:
                    return await aw

            return await asyncio.gather(*(one(aw) for aw in awaitables), return_exceptions=True)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(main())
        # Called from inside a running event loop (async trainer, notebook), where asyncio.run
        # refuses to start: run the batch on a loop of its own in a helper thread.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, main()).result()

    def _log_first(self, err: BaseException, sample: Sample) -> None:
        if self._logged_error:
            return
        self._logged_error = True
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        logger.warning("reward function %s failed on a sample of group %d; it gets reward 0.0 and counts in "
                       "reward/errors (later failures are counted, not logged)", name, sample.group_index,
                       exc_info=err)
