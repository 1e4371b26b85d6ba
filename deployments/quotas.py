"""Per-adapter quotas at the ingress (concurrent requests and requests per second), fleet-wide and exact.

The count of each adapter lives in one place, the ``QuotaLeases`` deployment (``quota_book.py``
says why: per-replica shares refuse requests the fleet has room for). An ingress replica asks it
for a lease per request; while the limit is far a grant carries spares, which later requests use
without a round trip. Near the limit each request is one round trip, and its lease goes back
before the client sees its answer (``QuotaPlace.returned``), so a client's next request, on any
ingress replica, finds it free. A heartbeat tells the owner this replica is alive, reports what it
holds, and gives back spares of names the owner says are near their limit, and rate tokens older
than the bucket's one second. A refusal is a 429 that names the adapter and the quota, and counts
in ``lorafleet_adapter_quota_rejections_total``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from .http_errors import HTTPError
from .quota_book import CONCURRENCY, HeldReport, LeaseGrant

log = logging.getLogger("ray.serve")
TOKEN_LIFETIME_S = 1.0   # a cached rate token older than this goes back (the bucket holds one second)
GIVE_BACK_WAIT_S = 5.0   # at most this long does a finished request wait for its lease to be back


@dataclass
class _Held:
    """What this ingress replica holds of one name."""

    leases: int = 0          # concurrency leases, in use or spare
    in_use: int = 0          # of them, held by running requests
    tokens: int = 0          # rate tokens not used yet
    tokens_at: float = 0.0   # when the oldest of them was granted
    near: bool = True        # the owner's latest word: near the limit (give spares back at once)

    @property
    def spare_leases(self) -> int:
        return self.leases - self.in_use


@dataclass
class QuotaState:
    held: dict[str, _Held] = field(default_factory=dict)
    rejections: Counter = field(default_factory=Counter)   # (adapter, quota) -> count
    peak_inflight: Counter = field(default_factory=Counter)  # adapter -> most requests held at once here
    round_trips: int = 0     # grants asked of the owner (the rest were served from spares)
    local: int = 0           # requests admitted from spares, with no round trip


class HandleCalls:
    """The lease owner's methods through a Serve handle, as coroutines (``QuotaLeases`` has the same)."""

    def __init__(self, handle):
        self.handle = handle

    async def grant(self, *args) -> LeaseGrant:
        return await self.handle.grant.remote(*args)

    async def give_back(self, *args) -> None:
        return await self.handle.give_back.remote(*args)

    async def heartbeat(self, *args) -> list[str]:
        return await self.handle.heartbeat.remote(*args)


class AdapterQuotas:
    def __init__(self, leases, heartbeat_s: float = 0.5, holder: Optional[str] = None,
                 clock: Callable[[], float] = time.monotonic, metrics: bool = True):
        self.leases = leases
        self.heartbeat_s = heartbeat_s
        self.holder = holder or uuid.uuid4().hex
        self.clock = clock
        self.state = QuotaState()
        self._beat: Optional[asyncio.Task] = None
        self._counter = None
        if metrics:
            from ray.serve.metrics import Counter as RayCounter

            self._counter = RayCounter("lorafleet_adapter_quota_rejections_total",
                                       description="Requests refused by an adapter's quota (429)",
                                       tag_keys=("adapter", "quota"))

    async def acquire(self, name: str, max_concurrency: Optional[int],
                      requests_per_s: Optional[float]) -> Callable[[], Optional[Awaitable[None]]]:
        """Admit one request for ``name`` or raise a 429; returns the release to call when it ends (it
        returns an awaitable when a lease goes back to the owner: await it before answering the client)."""
        if max_concurrency is None and requests_per_s is None:
            return _noop
        held = self.state.held.setdefault(name, _Held())
        concurrency_local = max_concurrency is None or held.spare_leases > 0
        rate_local = requests_per_s is None or held.tokens > 0
        if concurrency_local and rate_local and not held.near:
            self.state.local += 1
            if requests_per_s is not None:
                held.tokens -= 1
        else:
            self.state.round_trips += 1
            try:
                answer = await self.leases.grant(self.holder, name, max_concurrency, requests_per_s)
            except BaseException:
                self._forget_if_empty(name, held)
                raise
            held = self.state.held.setdefault(name, held)
            if not answer.granted:
                self._forget_if_empty(name, held)
                self._reject(name, answer.refused, max_concurrency, requests_per_s)
            held.near = answer.near
            if max_concurrency is not None:
                held.leases += 1 + answer.spare_leases
            if answer.spare_tokens:
                held.tokens_at = held.tokens_at if held.tokens else self.clock()
                held.tokens += answer.spare_tokens
        if max_concurrency is None:
            self._forget_if_empty(name, held)
            if self.state.held:
                self._start_heartbeat()
            return _noop
        self._start_heartbeat()
        held.in_use += 1
        self.state.peak_inflight[name] = max(self.state.peak_inflight[name], held.in_use)
        released = False

        def release() -> Optional[Awaitable[None]]:
            nonlocal released
            if released:
                return None
            released = True
            mine = self.state.held.get(name)
            if mine is None:
                return None
            mine.in_use -= 1
            if mine.near or mine.spare_leases > 2 * max(1, mine.leases - mine.spare_leases):
                return self._give_back(name, mine, mine.spare_leases, 0)
            return None

        return release

    @property
    def inflight(self) -> Counter:
        return Counter({name: h.in_use for name, h in self.state.held.items() if h.in_use})

    def report(self) -> dict[str, HeldReport]:
        return {name: HeldReport(h.leases, h.spare_leases, h.tokens) for name, h in self.state.held.items()}

    async def heartbeat(self) -> None:
        """One beat: report, then give back the spares of names near their limit and stale rate tokens."""
        recall = set(await self.leases.heartbeat(self.holder, self.report()))
        now = self.clock()
        for name, held in list(self.state.held.items()):
            if name in recall:
                held.near = True
            spare = held.spare_leases if name in recall else 0
            tokens = held.tokens if (name in recall or now - held.tokens_at >= TOKEN_LIFETIME_S) else 0
            if spare or tokens:
                self._give_back(name, held, spare, tokens)

    def _give_back(self, name: str, held: _Held, leases: int, tokens: int) -> asyncio.Future:
        held.leases -= leases
        held.tokens -= tokens
        spares_left = held.spare_leases + held.tokens
        self._forget_if_empty(name, held)
        return asyncio.ensure_future(self._send_back(name, leases, tokens, spares_left))

    async def _send_back(self, name: str, leases: int, tokens: int, spares_left: int) -> None:
        try:
            await self.leases.give_back(self.holder, name, leases, tokens, spares_left)
        except Exception as exc:   # the owner is away: it re-adopts what we hold from our next heartbeat
            log.warning("lorafleet quotas: giving back %d leases of %r failed (%r)", leases, name, exc)

    def _forget_if_empty(self, name: str, held: _Held) -> None:
        if held.leases <= 0 and held.tokens <= 0 and held.in_use <= 0:
            self.state.held.pop(name, None)

    def _start_heartbeat(self) -> None:
        if self._beat is None or self._beat.done():
            self._beat = asyncio.get_running_loop().create_task(self._heartbeats())

    async def _heartbeats(self) -> None:
        """Beats while this replica holds anything (liveness matters only then); the last beat reports
        that it holds nothing, so the owner stops waiting for spares from it."""
        while True:
            try:
                await self.heartbeat()
            except Exception as exc:
                log.warning("lorafleet quotas: heartbeat failed (%r)", exc)
            if not self.state.held:
                break
            await asyncio.sleep(self.heartbeat_s)
        self._beat = None

    def _reject(self, name: str, quota: Optional[str], max_concurrency: Optional[int],
                requests_per_s: Optional[float]) -> None:
        quota = quota or CONCURRENCY
        self.state.rejections[(name, quota)] += 1
        if self._counter is not None:
            self._counter.inc(tags={"adapter": name, "quota": quota})
        if quota == CONCURRENCY:
            message = f"adapter {name!r} is at its quota of {max_concurrency} concurrent requests; retry later"
        else:
            message = f"adapter {name!r} is over its quota of {requests_per_s:g} requests per second; retry later"
        raise HTTPError(429, message, param="model", code="adapter_quota_exceeded", retry_after=1)


def _noop() -> None:
    return None
