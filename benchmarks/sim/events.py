"""The simulators' one event loop: simulated time and the actions due, in time order.

Both fleet models run on it (``fleet.Simulator``: an open-loop trace; ``cpu_fleet.CpuFleet``:
closed-loop clients), so the two agree on what "at the same time" means: actions due at the
same instant run in the order they were scheduled (a counter breaks the tie, never the action),
and a trace's arrival runs before any action due at the same instant. That order is what makes
a run deterministic for a seed.
"""

from __future__ import annotations

import heapq
from typing import Callable, Optional, Sequence


class EventLoop:
    """``now``, a heap of ``(time, order, action, args)``, and ``run_until`` to drain it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list = []
        self._seq = 0

    def at(self, t: float, action: Callable[..., None], *args) -> None:
        """Call ``action(*args)`` at simulated time ``t``."""
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, action, args))

    def run_until(self, finished: Callable[[], bool], arrivals: Sequence[float] = (),
            arrive: Optional[Callable[[int], None]] = None) -> bool:
        """Run actions (and ``arrive(k)`` at ``arrivals[k]``, sorted) until ``finished()``; False when nothing
        was left to run first."""
        heap, pop = self.heap, heapq.heappop
        nxt, n = 0, len(arrivals)
        while not finished():
            if nxt < n and (not heap or arrivals[nxt] <= heap[0][0]):
                self.now = arrivals[nxt]
                nxt += 1
                arrive(nxt - 1)
                continue
            if not heap:
                return False
            when, _, action, args = pop(heap)
            self.now = when
            action(*args)
        return True
