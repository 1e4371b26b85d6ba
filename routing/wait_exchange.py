"""Oldest first across routers: each router hears, through the directory, how long the other routers' oldest
requests have waited for each replica.

Why: several routers share the workers (one per ingress replica or handle-holding process), and each wakes its own
waiting requests when one of its own requests completes. Another router learns of that free row only when it probes
the replica, and by then the freeing router's waiting (or newly arrived) request has taken it. So rows stick to the
router that holds them: a request in a router with few rows at its replica waits while newer requests of other
routers go first. On the demo at concurrency 64 through three routers (``benchmarks.demo_loads``) the e2e p99 was
5-7x the p50 (1.5-2x with one router) at the same req/s; a queue place per replica that any router may fill
(``engine_queue``) took it to 3-4x: the freeing router's next request, whose view of the replica is freshest,
takes that place too.

What the routers do with the exchange (``routing.ray_router``):

- every ``wait_exchange_interval_s`` while it has requests waiting, a router reports its oldest wait per replica
  and hears back the other routers' (one small call to the directory, which keeps the reports in a ``WaitBoard``;
  a router with no one waiting sends nothing after one empty report);
- a request that could take a row (or queue place) at a replica where another router's request has waited longer
  by more than ``fair_wait_margin_s`` leaves it and waits; while other routers' requests wait too, each router's
  oldest request for a replica polls it every ``capacity_poll_s`` (other routers' requests fill it), so the older
  request finds the room (and the one that left it takes it at its own next poll if no one did: a row is never
  left longer than a poll);
- while other routers have requests waiting, the fleet's oldest request for a replica (no other router reports an
  older one) may take the replica's ``oldest_queue`` places beyond its rows: it waits in that replica's engine and
  runs at its next free row, so the rows the others leave it are never idle (without those places the demo's
  three routers above served 57 and 80 req/s). A router alone leaves them empty: its own line is oldest first.

Measured on the demo at concurrency 64 through three routers, 600 requests, runs alternated with the code before
this (docs/benchmarks.md): e2e p99/p50 1.86-2.15 at 81-93 req/s, against 5.80-7.40 at 61-72 req/s.

No Ray here: the router hands ``WaitExchange`` a ``send(router_id, ages) -> PendingCall`` (the directory's
``exchange_waits`` in flight) and the directory holds the ``WaitBoard``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import Callable, Mapping, Optional, Protocol

from .directory_feed import FeedClosed, stopped_with_feeds

log = logging.getLogger("ray.serve")

EXPIRY_INTERVALS = 5  # a router's report is dropped after this many of its reporting intervals without another
FRESH_INTERVALS = 2.5  # what a router heard counts this many reporting intervals (the others' may have been served)


class WaitBoard:
    """The directory's side: every router's oldest waiting request per replica, as a time on this board's clock.

    Bounded: a router reports only while it has requests waiting, sends an empty report when it has none, and a
    report not renewed within ``expiry_s`` (a router that died) is dropped at the next exchange."""

    def __init__(self, expiry_s: float, clock: Callable[[], float] = time.monotonic):
        self.expiry_s = expiry_s
        self._clock = clock
        self._reports: dict[str, tuple[float, dict[str, float]]] = {}  # router -> (reported at, replica -> since)

    def exchange(self, router_id: str, ages: Mapping[str, float]) -> dict[str, float]:
        """Record ``router_id``'s oldest wait per replica (seconds waited so far; empty: none waiting) and return
        the other routers' longest wait per replica, in seconds."""
        now = self._clock()
        self._reports = {r: e for r, e in self._reports.items() if now - e[0] <= self.expiry_s}
        if ages:
            self._reports[router_id] = (now, {rid: now - float(age) for rid, age in ages.items()})
        else:
            self._reports.pop(router_id, None)
        oldest: dict[str, float] = {}
        for other, (_, since_by_replica) in self._reports.items():
            if other == router_id:
                continue
            for rid, since in since_by_replica.items():
                if since < oldest.get(rid, math.inf):
                    oldest[rid] = since
        return {rid: now - since for rid, since in oldest.items()}

    def __len__(self) -> int:
        return len(self._reports)


class OthersWaiting:
    """The router's side: what it last heard of the other routers' oldest waiters, per replica (its own clock)."""

    def __init__(self, fresh_s: float, clock: Callable[[], float] = time.monotonic):
        self.fresh_s = fresh_s
        self._clock = clock
        self._since: dict[str, float] = {}
        self._heard_at = -math.inf

    def heard(self, ages: Mapping[str, float], at: Optional[float] = None) -> None:
        """The directory's reply: the others' longest wait per replica (seconds) as of ``at`` (default now)."""
        at = self._clock() if at is None else at
        self._since = {rid: at - float(age) for rid, age in ages.items()}
        self._heard_at = at

    def anyone(self) -> bool:
        """Whether another router has requests waiting (as last heard, while fresh)."""
        return bool(self._since) and self._clock() - self._heard_at <= self.fresh_s

    def older_elsewhere(self, replica_id: str, since: float, margin_s: float = 0.0) -> bool:
        """Whether another router has a request waiting for ``replica_id`` that began waiting more than
        ``margin_s`` before ``since`` (False when nothing fresh was heard: a router alone never yields)."""
        if self._clock() - self._heard_at > self.fresh_s:
            return False
        other = self._since.get(replica_id)
        return other is not None and other + margin_s < since


class PendingCall(Protocol):
    """A directory call in flight (Serve's ``DeploymentResponse``)."""

    def result(self, *, timeout_s: Optional[float] = None) -> Mapping: ...


SendWaits = Callable[[str, Mapping[str, float]], PendingCall]
REPLY_TIMEOUT_S = 5.0
# calls that were out when this process's Ray was shut down, kept until the process ends (``directory_feed`` says why)
_left_behind: list = []


class WaitExchange:
    """A router's reports to the directory, on their own thread (a handle call inside the router's event loop
    would wait on that loop): every ``interval_s`` while requests wait, and one empty report when none do."""

    def __init__(self, router_id: str, interval_s: float, own_ages: Callable[[], dict[str, float]],
                 others: OthersWaiting, send: SendWaits):
        self.router_id, self.interval_s, self.own_ages, self.others, self.send = (router_id, interval_s, own_ages,
                                                                                  others, send)
        self._due = threading.Event()  # set while this router has (or just had) requests waiting
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        stopped_with_feeds(self)

    def waiting(self, loop: asyncio.AbstractEventLoop) -> None:
        """A request began waiting: report (the thread starts on the first one)."""
        if self._stopped.is_set():
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, args=(loop,), name="lorafleet-router-waits",
                                            daemon=True)
            self._thread.start()
        self._due.set()

    def stop(self) -> None:
        self._stopped.set()
        self._due.set()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stopped.is_set() and not loop.is_closed():
            self._due.wait()
            if self._stopped.is_set():
                break
            self._due.clear()  # before reading the ages: a request that starts waiting after this sets it again
            ages = self.own_ages()
            call = None
            try:
                call = self.send(self.router_id, ages)
                reply = call.result(timeout_s=REPLY_TIMEOUT_S)
                loop.call_soon_threadsafe(self.others.heard, dict(reply), time.monotonic())
            except FeedClosed:
                break
            except SystemExit:  # this process's Ray was shut down while the call was out
                if call is not None:
                    _left_behind.append(call)
                break
            except Exception as exc:  # routing goes on without the others' waits (no router yields on stale news)
                log.debug("lorafleet router: wait exchange failed: %r", exc)
            if ages:
                self._due.set()  # keep reporting while requests wait; the report after the last one is empty
            if self._stopped.wait(self.interval_s):
                break
