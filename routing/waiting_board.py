"""Which routers have requests waiting for which replica's rows, and since when: the directory's board.

Why: each router wakes its own waiting requests the moment one of its own requests completes, and
sees other routers' completions only by polling. With several routers under saturation, the rows a
router's requests hold pass from one of its requests to the next, and another router's requests
for the same replica wait until the first runs out of waiting requests: with three routers at
concurrency 64 the demo's e2e p99 was 5.2 times its p50. So each router posts, with its directory
poll, when its oldest request waiting for each replica first asked; the reply tells it the oldest
waiting in any other router; and a request leaves a free row to one that has waited
``fair_slack_s`` longer for it (``routing.policy``). Times are wall-clock seconds (routers live in
different processes). A router that stops posting drops off after ``ttl_s``.

No Ray here: ``deployments.directory_actor`` keeps one.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional


class WaitingBoard:
    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic, max_routers: int = 10_000):
        self.ttl_s, self._clock, self.max_routers = ttl_s, clock, max_routers
        self._posts: dict[str, tuple[float, dict[str, float]]] = {}  # router id -> (posted at, replica -> since)

    def post(self, router_id: str, waiting: Optional[Mapping[str, float]]) -> None:
        """``router_id``'s oldest waiting request per replica (wall-clock first-asked times); empty: none."""
        now = self._clock()
        if waiting:
            if router_id not in self._posts and len(self._posts) >= self.max_routers:
                self._expire(now)
                if len(self._posts) >= self.max_routers:
                    return  # bounded: a flood of router ids cannot grow the directory
            self._posts[router_id] = (now, {str(r): float(t) for r, t in waiting.items()})
        else:
            self._posts.pop(router_id, None)

    def others(self, router_id: str) -> dict[str, float]:
        """Per replica, the oldest first-asked time posted by any router but ``router_id`` within ``ttl_s``."""
        now = self._clock()
        self._expire(now)
        oldest: dict[str, float] = {}
        for rid, (_, waiting) in self._posts.items():
            if rid == router_id:
                continue
            for replica_id, since in waiting.items():
                if since < oldest.get(replica_id, float("inf")):
                    oldest[replica_id] = since
        return oldest

    def __len__(self) -> int:
        return len(self._posts)

    def _expire(self, now: float) -> None:
        for rid in [r for r, (at, _) in self._posts.items() if now - at > self.ttl_s]:
            del self._posts[rid]
