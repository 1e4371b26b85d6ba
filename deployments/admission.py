"""The ingress's own bound on requests in flight, its timeouts, and its one retry.

The workers' bound is Serve's ``max_queued_requests``; this one keeps a flood from piling
up in the ingress before any worker refuses it. A request whose replica died before it
produced anything is retried once on another replica: nothing was sent to the client yet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

from .http_errors import HTTPError

log = logging.getLogger("ray.serve")
T = TypeVar("T")


def replica_lost(exc: BaseException) -> bool:
    """The replica serving the call died or became unreachable (not an error of the request)."""
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


class RequestLimiter:
    def __init__(self, max_inflight: int, timeout_s: float):
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.inflight = 0
        self.retries = 0

    def acquire(self) -> None:
        """Take a place, or 429 at once when the ingress is full (before any work is done)."""
        if self.inflight >= self.max_inflight:
            raise HTTPError(429, f"{self.inflight} requests in flight at this ingress; retry later",
                            code="overloaded", retry_after=1)
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1

    def deadline(self) -> float:
        """When a request admitted now must have its first result (the request timeout from now)."""
        return time.monotonic() + self.timeout_s

    async def first_result(self, start: Callable[[], object], first: Callable[[object], Awaitable[T]],
                           deadline: float) -> T:
        """``first(start())`` before ``deadline``, once more on a fresh call if the replica was lost."""
        try:
            return await self._attempt(start, first, deadline)
        except BaseException as exc:
            if not replica_lost(exc):
                raise
            self.retries += 1
            log.warning("lorafleet ingress: replica lost before the first token (%r); retrying once", exc)
        return await self._attempt(start, first, deadline)

    async def _attempt(self, start: Callable[[], object], first: Callable[[object], Awaitable[T]],
                       deadline: float) -> T:
        """A late or failed call is cancelled, so its work stops in the engine too."""
        response = start()
        try:
            return await self.within_timeout(first(response), deadline)
        except BaseException:
            response.cancel()
            raise

    async def within_timeout(self, awaitable, deadline: float):
        """Await until ``deadline``; Serve's full queues become a 429 rather than its 503."""
        from ray.serve.exceptions import BackPressureError

        try:
            return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise self.timeout_error() from None
        except BackPressureError:
            raise HTTPError(429, "the fleet's queues are full; retry later", code="overloaded",
                            retry_after=1) from None

    def timeout_error(self) -> HTTPError:
        return HTTPError(504, f"request exceeded the {self.timeout_s:.0f}s timeout", code="timeout")
