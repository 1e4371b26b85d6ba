"""The lagged directory feed the simulated view routers read, as the live routers read the real one.

Pool events are buffered with their simulated time; ``sync`` hands the events at least
``lag_s`` old to a real ``AdapterDirectory`` and gives the router the directory's
``changes_since`` delta (a long poll returns only when there is news).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from routing.directory import AdapterDirectory


class DirectoryFeed:
    def __init__(self, clock: Callable[[], float], lag_s: float):
        self.clock = clock
        self.lag_s = lag_s
        self.directory = AdapterDirectory(clock=clock, replica_timeout_s=float("inf"))
        self.pending: deque = deque()
        self.version = -1

    def on_pool_event(self, event) -> None:
        self.pending.append((self.clock(), event))

    def start(self, router) -> None:
        """The router's first poll: the full view."""
        d = self.directory
        router.apply_directory_reply({"epoch": "sim", "version": d.version, "full": d.full_view()})
        self.version = d.version

    def sync(self, router) -> None:
        cutoff = self.clock() - self.lag_s
        pending = self.pending
        batch: dict[str, list] = {}
        while pending and pending[0][0] <= cutoff:
            event = pending.popleft()[1]
            batch.setdefault(event.replica_id, []).append(event)
        d = self.directory
        for rid, events in batch.items():
            d.apply_events(rid, events)
        version, changes = d.changes_since(self.version)
        if changes is None:
            reply = {"epoch": "sim", "version": version, "full": d.full_view()}
        elif changes:
            reply = {"epoch": "sim", "version": version, "changes": changes}
        else:
            return
        router.apply_directory_reply(reply)
        self.version = version
