"""JSON over HTTP to engine servers (SGLang or `polyrl serve`), callable from plain threads.

One asyncio loop runs in a daemon thread with one aiohttp session; synchronous callers
(the RL loop, weight transports) submit coroutines to it and wait with a timeout, so many
requests are in flight at once without a thread per request. Every call names the server
and the endpoint in its error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any


class EngineHTTPError(RuntimeError):
    """A request to an engine server failed: connection refused, timeout, or a non-2xx answer."""

    def __init__(self, url: str, path: str, message: str, status: int | None = None):
        super().__init__(f"{url}{path}: {message}")
        self.url, self.path, self.status = url, path, status


def normalize_url(addr: str) -> str:
    """'host:port' or 'http://host:port/' -> 'http://host:port'."""
    addr = addr.strip().rstrip("/")
    return addr if "://" in addr else f"http://{addr}"


class HTTPClient:
    def __init__(self, api_key: str | None = None, max_connections: int = 1024):
        import aiohttp  # noqa: F401  (fail here, with the install hint, not in the loop thread)

        self.api_key = api_key
        self._max_connections = max_connections
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="polyrl-http", daemon=True)
        self._thread.start()
        self._session = self.run(self._open(), timeout=30)

    async def _open(self):
        import aiohttp
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._max_connections),
                                     headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None)

    # ---- running coroutines from threads ---------------------------------------------------
    def submit(self, coro) -> concurrent.futures.Future:
        if self._closed:  # the loop is stopping: the coroutine would never run, and its caller wait out its timeout
            coro.close()
            raise RuntimeError("the HTTP client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro, timeout: float) -> Any:
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    # ---- requests --------------------------------------------------------------------------
    async def request(self, url: str, path: str, payload: dict | None = None, *, method: str | None = None,
                      timeout: float = 60.0) -> Any:
        """One JSON request; returns the decoded JSON answer (or the text when it is not JSON)."""
        import aiohttp
        method = method or ("POST" if payload is not None else "GET")
        try:
            async with self._session.request(method, url + path, json=payload,
                                             timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise EngineHTTPError(url, path, f"HTTP {resp.status}: {body[:500].decode(errors='replace')}",
                                          resp.status)
                if resp.content_type == "application/json":
                    return await resp.json()
                return body.decode(errors="replace")
        except asyncio.TimeoutError:
            raise EngineHTTPError(url, path, f"no answer within {timeout:g} s") from None
        except aiohttp.ClientError as e:
            raise EngineHTTPError(url, path, f"{type(e).__name__}: {e}") from None

    def _open_for(self, url: str, path: str) -> None:
        if self._closed:  # e.g. a health check racing the engine's shutdown
            raise EngineHTTPError(url, path, "not sent: the HTTP client is closed")

    def call(self, url: str, path: str, payload: dict | None = None, *, method: str | None = None,
             timeout: float = 60.0) -> Any:
        self._open_for(url, path)
        return self.run(self.request(url, path, payload, method=method, timeout=timeout), timeout + 5)

    def call_async(self, url: str, path: str, payload: dict | None = None, *, method: str | None = None,
                   timeout: float = 60.0) -> concurrent.futures.Future:
        """Start a request and return at once (e.g. a weight-update call that blocks until a broadcast)."""
        self._open_for(url, path)
        return self.submit(self.request(url, path, payload, method=method, timeout=timeout))

    def call_all(self, urls: list[str], path: str, payload: dict | None = None, *, method: str | None = None,
                 timeout: float = 60.0) -> list[Any]:
        """The same request to every server at once; raises the first failure (naming its server)."""
        futs = [self.call_async(u, path, payload, method=method, timeout=timeout) for u in urls]
        return [f.result(timeout + 5) for f in futs]

    def close(self) -> None:
        if self._closed or self._loop.is_closed():
            return
        try:
            self.run(self._session.close(), timeout=10)
        except Exception:  # closing is best effort: the loop thread is a daemon either way
            pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
