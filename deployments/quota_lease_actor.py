"""QuotaLeases: the Serve deployment (one replica per application) that owns every quota count.

It runs ``quota_book.QuotaBook`` on its event loop. A grant that finds the fleet at a limit while
another ingress may still hold spares waits up to ``recall_wait_s`` for them to come back (their
holders' next heartbeat tells them to) instead of refusing: a refusal then means the fleet really
is at the limit. A sweep every quarter ``ttl_s`` takes back the leases of ingress replicas that
stopped calling. If this replica itself restarts, each ingress's next heartbeat re-adopts what it
holds, so the count comes back without anyone's request failing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Callable, Optional

from ray import serve

from .quota_book import HeldReport, LeaseGrant, QuotaBook, Reclaimed

log = logging.getLogger("ray.serve")
RECLAIMED_KEPT = 64   # the last reclaims kept for stats (an event log, bounded)


class QuotaLeases:
    """Plain class (tests run it in-process); ``QuotaLeaseActor`` below is the same class deployed."""

    def __init__(self, batch: int = 8, ttl_s: float = 5.0, recall_wait_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.book = QuotaBook(batch, ttl_s)
        self.clock = clock
        self.recall_wait_s = recall_wait_s
        self.reclaimed: deque[Reclaimed] = deque(maxlen=RECLAIMED_KEPT)
        self._returned: dict[str, asyncio.Event] = {}   # name -> set when something of it comes back
        self._sweeper: Optional[asyncio.Task] = None

    async def grant(self, holder: str, name: str, max_concurrency: Optional[int],
                    requests_per_s: Optional[float]) -> LeaseGrant:
        self._start_sweeper()
        deadline = time.monotonic() + self.recall_wait_s   # a real wait, whatever the book's clock says
        while True:
            answer = self.book.grant(holder, name, max_concurrency, requests_per_s, self.clock())
            left = deadline - time.monotonic()
            if answer.granted or left <= 0 or not self.book.may_have_spares(name, holder):
                return answer
            event = self._returned.setdefault(name, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                pass
            finally:
                if self._returned.get(name) is event and event.is_set():
                    del self._returned[name]

    async def give_back(self, holder: str, name: str, leases: int, tokens: int, spares_left: int) -> None:
        self.book.give_back(holder, name, leases, tokens, spares_left, self.clock())
        self._wake(name)

    async def heartbeat(self, holder: str, held: dict[str, HeldReport]) -> list[str]:
        """The holder is alive and holds ``held``; returns the names whose spares it must give back now."""
        self._start_sweeper()
        recall = self.book.heartbeat(holder, held, self.clock())
        for name in held:
            self._wake(name)   # its spare count may have dropped to zero: a waiting grant may now refuse
        return recall

    def stats(self) -> dict:
        """Leases held per name and the latest reclaims (tests and benchmarks read it)."""
        return {"held": {name: self.book.held(name) for name in self.book.names},
                "holders": sorted(self.book.seen), "grants": self.book.grants, "refusals": self.book.refusals,
                "names": len(self.book.names), "reclaimed": [dataclasses.asdict(r) for r in self.reclaimed]}

    def _wake(self, name: str) -> None:
        event = self._returned.get(name)
        if event is not None:
            event.set()

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.book.ttl_s / 4)
            for reclaim in self.book.expire(self.clock()):
                self.reclaimed.append(reclaim)
                log.warning("lorafleet quotas: ingress %s silent for %.1fs; %d leases returned",
                            reclaim.holder, reclaim.silent_for_s, reclaim.leases)
                for name in list(self._returned):
                    self._wake(name)


QuotaLeaseActor = serve.deployment(name="QuotaLeases", num_replicas=1, max_ongoing_requests=1000,
                                   ray_actor_options={"num_cpus": 0},
                                   logging_config={"enable_access_log": False})(QuotaLeases)
