"""polyrl.rollout.http_client: a request after close() fails at once, naming the server, instead of waiting out its
timeout on a stopped loop (and leaving a never-awaited coroutine behind)."""

from __future__ import annotations

import gc
import warnings

import pytest

from polyrl.rollout.http_client import EngineHTTPError, HTTPClient


def test_a_request_after_close_fails_at_once_and_leaves_no_coroutine():
    http = HTTPClient()
    http.close()
    http.close()  # idempotent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(EngineHTTPError, match=r"http://127\.0\.0\.1:9/health: not sent: the HTTP client is closed"):
            http.call("http://127.0.0.1:9", "/health", timeout=30)
        with pytest.raises(EngineHTTPError, match="closed"):
            http.call_async("http://127.0.0.1:9", "/generate", {"input_ids": [1]}, timeout=30)
        with pytest.raises(EngineHTTPError, match="closed"):
            http.call_all(["http://127.0.0.1:9"], "/health", timeout=30)
        with pytest.raises(RuntimeError, match="closed"):
            http.run(http.request("http://127.0.0.1:9", "/health"), timeout=30)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
