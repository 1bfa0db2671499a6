"""A reward model behind HTTP (``--rm-url``): batches of samples POSTed as JSON, one reward per sample back.

Request: one POST per batch of up to ``--rm-batch-size`` samples, in order, at most ``--rm-max-concurrency``
in flight at once::

    {"prompts": [str, ...], "responses": [str, ...], "labels": [any, ...], "metadata": [dict, ...]}

Answer: HTTP 200 with a JSON body::

    {"rewards": [float, ...]}    # one finite number per sample of the request, in its order

A request that fails for a reason that may pass (connection error, no answer within ``--rm-timeout``,
HTTP 5xx, 408 or 429) is sent again up to ``--rm-retries`` times, waiting 0.5 s, 1 s, 2 s, ... (at most
8 s) in between. Any other 4xx, or a malformed answer (not JSON, no ``rewards`` list, a list of the wrong
length), is not retried: the server did answer and would answer the same. A request that still fails
gives its samples reward 0.0 (they count in ``reward/errors``, the request in ``reward/remote_failures``),
its first failure is logged, and the run goes on. One non-numeric value in an otherwise well-formed
answer costs only its sample.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
from math import isfinite
from typing import Any

from polyrl.rollout.http_client import EngineHTTPError, HTTPClient, normalize_url
from polyrl.types import Sample

logger = logging.getLogger(__name__)

RETRY_STATUS = (408, 429)  # besides 5xx and no answer at all
MAX_BACKOFF_S = 8.0


class RemoteRewardError(RuntimeError):
    """The reward model's answer does not fit the request (shape or values)."""


class RemoteRewardModel:
    """Scores samples through ``url``; bounded in concurrency, per-request time and retries."""

    def __init__(self, url: str, *, batch_size: int = 64, max_concurrency: int = 8, retries: int = 3,
                 timeout: float | None = 60.0, backoff_s: float = 0.5, api_key: str | None = None):
        self.url = normalize_url(url)
        self.batch_size, self.max_concurrency, self.retries = batch_size, max_concurrency, retries
        self.timeout = timeout or None  # 0 = no limit, as --rm-timeout elsewhere
        self.backoff_s = backoff_s
        self._api_key = api_key
        self._client: HTTPClient | None = None
        self._logged = False

    @classmethod
    def from_config(cls, rc) -> RemoteRewardModel:
        return cls(rc.rm_url, batch_size=rc.rm_batch_size, max_concurrency=rc.rm_max_concurrency, retries=rc.rm_retries,
                   timeout=rc.rm_timeout)

    def score(self, samples: list[Sample]) -> tuple[list[float | BaseException], int, int]:
        """(per sample: its reward or the error that cost it, failed requests, retried attempts)."""
        batches = [samples[k:k + self.batch_size] for k in range(0, len(samples), self.batch_size)]
        if not batches:
            return [], 0, 0
        if self._client is None:
            self._client = HTTPClient(api_key=self._api_key, max_connections=self.max_concurrency)
        outcomes = self._client.run(self._score_all(batches), timeout=self._deadline(len(batches)))
        values: list[float | BaseException] = []
        failures = retried = 0
        for batch, (out, n_retries) in zip(batches, outcomes):
            retried += n_retries
            if isinstance(out, BaseException):
                failures += 1
                self._log_first(f"a request of {len(batch)} samples failed after {n_retries} retries", out)
                values.extend([out] * len(batch))
                continue
            for v in out:
                if isinstance(v, BaseException):
                    self._log_first("a reward in its answer is not a number", v)
            values.extend(out)
        return values, failures, retried

    def _deadline(self, n_batches: int) -> float | None:
        """A bound on the whole call, past every request's own bound (the client enforces those)."""
        if self.timeout is None:
            return None
        rounds = -(-n_batches // self.max_concurrency)
        per_request = (self.retries + 1) * self.timeout + sum(self._backoff(a) for a in range(self.retries))
        return rounds * per_request + 10.0

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** attempt, MAX_BACKOFF_S)

    async def _score_all(self, batches: list[list[Sample]]) -> list[tuple[Any, int]]:
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(batch: list[Sample]) -> tuple[Any, int]:
            async with sem:
                return await self._post(batch)

        return await asyncio.gather(*(one(b) for b in batches))

    async def _post(self, batch: list[Sample]) -> tuple[list[float | BaseException] | BaseException, int]:
        """One batch's rewards (or the exception that lost them) and how many times it was re-sent."""
        payload = {"prompts": [s.prompt for s in batch], "responses": [s.response for s in batch],
                   "labels": [s.label for s in batch], "metadata": [s.metadata for s in batch]}
        for attempt in range(self.retries + 1):
            try:
                answer = await self._client.request(self.url, "", payload, timeout=self.timeout)
            except EngineHTTPError as e:
                retryable = e.status is None or e.status >= 500 or e.status in RETRY_STATUS
                if not retryable or attempt == self.retries:
                    return e, attempt
                await asyncio.sleep(self._backoff(attempt))
                continue
            except Exception as e:  # e.g. a label json cannot encode: sending it again will not help
                return e, attempt
            return self._rewards(answer, len(batch)), attempt
        raise AssertionError("unreachable")

    def _rewards(self, answer: Any, n: int) -> list[float | BaseException] | BaseException:
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != n:
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else repr(answer)[:200]
            return RemoteRewardError(f"{self.url}: expected {{\"rewards\": [{n} numbers]}} for {n} samples, got {got}")
        return [float(v) if isinstance(v, numbers.Real) and isfinite(v) else
                RemoteRewardError(f"{self.url}: reward {v!r} ({type(v).__name__}) is not a finite number") for v in rewards]

    def _log_first(self, what: str, err: BaseException) -> None:
        if self._logged:
            return
        self._logged = True
        logger.warning("reward model %s: %s (%s: %s); those samples get reward 0.0 and count in reward/errors, the run "
                       "goes on (later failures are counted, not logged)", self.url, what, type(err).__name__, err)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
