"""The lagged directory feed the simulated view routers read, as the live routers read the real one.

Pool events are buffered with their simulated time; ``sync`` hands the events at least
``lag_s`` old to a real ``AdapterDirectory`` and gives the router the directory's
``changes_since`` delta (a long poll returns only when there is news). Completed requests'
busy seconds reach the directory as the workers' heartbeats carry them (``busy`` syncs), and once every
``heartbeat_interval_s`` each replica's heartbeat extras (``SimReplica.heartbeat``: host-cached
and loading adapters, measured load seconds, queue length; ``LoRAWorker._state_extras``), by
which the live router prices a load as a host copy or a disk read; and every
``plan_interval_s`` the directory re-plans placement (``routing.plan``, as the live directory
does once a second, over every registered adapter: each has a planned home before its first
request); a changed plan rides on the next reply.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from routing.directory import AdapterDirectory
from routing.settings import DEFAULT_SETTINGS, RoutingSettings


@dataclass(frozen=True)
class PollPacing:
    """How the live router pulls the directory (``routing.directory_feed.DirectoryFeed``,
    with the default ``routing.settings.RoutingSettings``): a long poll goes out once
    ``requests_per_poll`` requests were routed since the last one went out (or ``timeout_s`` passed), never
    sooner than ``min_interval_s`` after it; it returns with the first change past the router's version
    (or empty after ``timeout_s``). Between two replies the router routes on its view plus its own
    decisions, so under traffic it sees the pools a poll's worth of requests late, not a flush late."""

    requests_per_poll: int = DEFAULT_SETTINGS.requests_per_poll
    min_interval_s: float = DEFAULT_SETTINGS.min_poll_interval_s
    timeout_s: float = DEFAULT_SETTINGS.poll_timeout_s

    @classmethod
    def of(cls, settings: RoutingSettings) -> "PollPacing":
        """The pacing a live router built from ``settings`` polls with."""
        return cls(settings.requests_per_poll, settings.min_poll_interval_s, settings.poll_timeout_s)


class DirectoryFeed:
    def __init__(self, clock: Callable[[], float], lag_s: float, rows: int, plan_interval_s: float = 1.0,
                 heartbeat_interval_s: float = 1.0, registered: Sequence[str] = (),
                 pacing: Optional[PollPacing] = None, settings: RoutingSettings = DEFAULT_SETTINGS):
        self.clock = clock
        self.pacing = pacing  # None: the router takes every delta at once (every sync)
        self.routed = 0        # requests the router routed (paces its polls)
        self._routed_at_poll = 0
        self._poll_sent_at = float("-inf")
        self._poll_out = False
        self.registered = tuple(registered)  # every adapter that exists: the live directory plans them all
        self.heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_at = float("-inf")
        self.lag_s = lag_s
        self.plan_interval_s = plan_interval_s
        self.directory = AdapterDirectory(clock=clock, replica_timeout_s=float("inf"), settings=settings)
        self.directory.planner.default_rows = rows  # what a live worker's heartbeat says: its max batch
        self.pending: deque = deque()
        self.version = -1
        self.plan_version = -1
        self._planned_at = float("-inf")
        self._busy: dict[str, Counter] = {}  # replica -> adapter -> request-seconds not yet reported

    def join(self, replica_id: str, snapshot) -> None:
        """A replica starts: its first report (a snapshot), as a live worker's at start, so the plan
        can place adapters on it before its pool has loaded anything."""
        self.directory.apply_snapshot(snapshot)

    def leave(self, replica_id: str) -> None:
        """A replica stops taking traffic: its goodbye (the plan forgets it at once)."""
        self.directory.forget_replica(replica_id)

    def record_busy(self, replica_id: str, adapter: str, seconds: float) -> None:
        """A request finished on ``replica_id`` after ``seconds`` there (the worker's busy accounting)."""
        self._busy.setdefault(replica_id, Counter())[adapter] += seconds


    def on_pool_event(self, event) -> None:
        self.pending.append((self.clock(), event))

    def start(self, router) -> None:
        """The router's first poll: the full view."""
        d = self.directory
        router.apply_directory_reply({"epoch": "sim", "version": d.version, "full": d.full_view()})
        self.version = d.version
        self._poll_sent_at, self._routed_at_poll = self.clock(), self.routed

    def heartbeat_due(self) -> bool:
        """Whether the replicas' heartbeats are due now (once every ``heartbeat_interval_s``)."""
        if self.clock() - self._heartbeat_at < self.heartbeat_interval_s:
            return False
        self._heartbeat_at = self.clock()
        return True

    def heartbeat(self, replica_id: str, extras: Mapping) -> None:
        """A replica's heartbeat extras (its state beside the pool), as the live worker sends them."""
        if replica_id in self.directory.replicas:
            self.directory.heartbeat(replica_id, **extras)

    def sync(self, router, busy: bool = True) -> None:
        """Events at least ``lag_s`` old to the directory; with ``busy``, also the busy seconds since the
        last delivery (the live worker sends them in its heartbeat, once a second); a re-plan when due;
        the router's delta."""
        cutoff = self.clock() - self.lag_s
        pending = self.pending
        batch: dict[str, list] = {}
        while pending and pending[0][0] <= cutoff:
            event = pending.popleft()[1]
            batch.setdefault(event.replica_id, []).append(event)
        d = self.directory
        for rid, events in batch.items():
            d.apply_events(rid, events)
        if busy:
            reported, self._busy = self._busy, {}
            for rid, seconds in reported.items():
                if rid in d.replicas:  # a replica first heard of by heartbeat would need a resync
                    d.heartbeat(rid, busy_s=seconds)
        if self.clock() - self._planned_at >= self.plan_interval_s:
            self._planned_at = self.clock()
            d.update_plan(registered=self.registered)
        if not self._poll_answered():
            return
        version, changes = d.changes_since(self.version)
        if changes is None:
            reply = {"epoch": "sim", "version": version, "full": d.full_view()}
        elif changes or d.plan.version != self.plan_version:
            reply = {"epoch": "sim", "version": version, "changes": changes}
        else:
            return
        if d.plan.version != self.plan_version:
            reply["plan"] = d.plan.to_dict()
            self.plan_version = d.plan.version
        router.apply_directory_reply(reply)
        self.version = version
        self._poll_out = False

    def _poll_answered(self) -> bool:
        """With ``pacing``: send the router's next poll when it is due; whether one is out now (a reply,
        when the directory has news, answers it)."""
        if self.pacing is None:
            return True
        now, p = self.clock(), self.pacing
        if self._poll_out and now - self._poll_sent_at >= p.timeout_s:
            self._poll_out = False  # returned empty: the next goes out when due
        if not self._poll_out and now - self._poll_sent_at >= p.min_interval_s and (
                self.routed - self._routed_at_poll >= p.requests_per_poll or now - self._poll_sent_at >= p.timeout_s):
            self._poll_out = True
            self._poll_sent_at, self._routed_at_poll = now, self.routed
        return self._poll_out
