"""The ingress's own bound on requests in flight, and its per-request timeout.

The workers' bound is Serve's ``max_queued_requests``; this one keeps a flood from piling
up in the ingress before any worker refuses it.
"""

from __future__ import annotations

import asyncio

from .http_errors import HTTPError


class RequestLimiter:
    def __init__(self, max_inflight: int, timeout_s: float):
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.inflight = 0

    def acquire(self) -> None:
        """Take a place, or 429 at once when the ingress is full (before any work is done)."""
        if self.inflight >= self.max_inflight:
            raise HTTPError(429, f"{self.inflight} requests in flight at this ingress; retry later",
                            code="overloaded", retry_after=1)
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1

    async def call(self, response):
        """Await a worker's response under the bound and the timeout; a refused or late one is cancelled."""
        try:
            self.acquire()
        except HTTPError:
            response.cancel()
            raise
        try:
            return await self.first(response)
        except HTTPError:
            response.cancel()
            raise
        finally:
            self.release()

    async def first(self, awaitable):
        """Await ``awaitable`` under the timeout; Serve's full queues become a 429 rather than its 503."""
        from ray.serve.exceptions import BackPressureError

        try:
            return await asyncio.wait_for(awaitable, self.timeout_s)
        except asyncio.TimeoutError:
            raise self.timeout_error() from None
        except BackPressureError:
            raise HTTPError(429, "the fleet's queues are full; retry later", code="overloaded",
                            retry_after=1) from None

    def timeout_error(self) -> HTTPError:
        return HTTPError(504, f"request exceeded the {self.timeout_s:.0f}s timeout", code="timeout")
