"""How late Serve's router learns that a replica loads a multiplexed model: measured, so the simulator need not guess.

Why: the multiplexing baseline routes a request to a replica that its router believes holds the request's
model. A replica tells the controller its model ids every 100 ms when they changed
(``PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S``), and the controller tells every router by long poll; on a busy
machine both hops stretch. Until the router hears, the next requests for that model go to the replicas with
the fewest models and load it again. The simulator delays the push by ``lag_s`` (``benchmarks.sim.fleet``),
and ``fleet_live``'s replay of multiplexing loaded 20-30 % less than the live run in two of four cells: this
measures the live lag instead.

Two halves, on one machine's wall clock: each replica notes when a load started
(``MultiplexedAdapters.load_starts``), and the client process's Serve router notes when a replica's model id
first appeared in its view (``ModelIdSightings``, fed by ``peer_routers``' default router). ``push_lags`` pairs
them: for each load, the first sighting of that replica and model at or after the load began.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Iterable, Mapping, Sequence

MAX_RECORDS = 100_000  # per process: a quick run has a few thousand loads


class ModelIdSightings:
    """When this process's router first saw each (replica, model) pair, each time it appeared again after
    leaving the replica's list."""

    def __init__(self, max_records: int = MAX_RECORDS):
        self.current: dict[str, frozenset[str]] = {}
        self.records: deque[tuple[str, str, float]] = deque(maxlen=max_records)

    def observe(self, replica_models: Mapping[str, Iterable[str]], now: float | None = None) -> None:
        """The router's replicas and their model ids, as Serve hands them to ``update_replicas``."""
        now = time.time() if now is None else now
        fresh = {rid: frozenset(models) for rid, models in replica_models.items()}
        for rid, models in fresh.items():
            for model in models - self.current.get(rid, frozenset()):
                self.records.append((rid, model, now))
        self.current = fresh

    def take(self) -> list[tuple[str, str, float]]:
        """Every sighting so far, oldest first (then forgotten: each segment reads its own)."""
        out = list(self.records)
        self.records.clear()
        return out


SIGHTINGS = ModelIdSightings()  # the client process's (one router per process)


def push_lags(load_starts: Sequence[tuple[str, str, float]],
              sightings: Sequence[tuple[str, str, float]]) -> list[float]:
    """Seconds from each ``(replica, model, started)`` load to the router's first sighting of that pair at or
    after it started; loads never sighted (unloaded again before any push) are left out."""
    seen: dict[tuple[str, str], list[float]] = {}
    for rid, model, at in sightings:
        seen.setdefault((rid, model), []).append(at)
    for times in seen.values():
        times.sort()
    lags = []
    for rid, model, started in load_starts:
        times = seen.get((rid, model), [])
        k = bisect.bisect_left(times, started)
        if k < len(times):
            lags.append(times[k] - started)
    return lags
