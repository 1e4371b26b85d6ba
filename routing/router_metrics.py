"""The affinity router's ``lorafleet_router_*`` metrics (with ``ray_router.py``, the only Ray files in routing/).

``ray.util.metrics`` calls are not free and every one is work for the node's metrics agent;
per-decision calls made that agent's CPU grow with the request rate. So each router counts
locally and ``export`` (called from its directory-feed thread every
``metrics_export_interval_s``) sends one ``inc`` per kind.

``decision_counts`` reads, in this process, what ``lorafleet_router_decisions_total`` counts
for it (the exported counts plus those not exported yet): a caller that needs exact counts at
one moment (a benchmark's before and after) reads them here instead of waiting for a scrape or
reaching into Serve's handle for the router object.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter

# every live router's metrics in this process (Serve creates one router per handle-holding process and deployment)
_LIVE: "weakref.WeakSet[RouterMetrics]" = weakref.WeakSet()


class RouterMetrics:
    """One router's decision counts by kind and its view lag, exported periodically."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter as MetricCounter, Gauge

        self._decisions = MetricCounter("lorafleet_router_decisions_total",
                                        description="Routing decisions by kind (affinity, spill: another replica "
                                                    "than the holders, prefill_spill: the same, to skip a long "
                                                    "prefill queue, placement: no holder, base, wait: the best "
                                                    "replica was full; waited: offered after a wait for it; yield: a free "
                                                    "row left to another router's older request)",
                                        tag_keys=("kind",))
        self._lag = Gauge("lorafleet_router_view_lag_seconds",
                          description="Seconds since this router's view last heard from the directory")
        self._lock = threading.Lock()
        self._unsent: Counter = Counter()
        self._exported: Counter = Counter()  # what the metric has been sent (it counts from 0 in each process)
        self.lag_s = 0.0
        _LIVE.add(self)

    def decision(self, kind: str) -> None:
        self._unsent[kind] += 1  # the event loop's thread; export swaps the counter under the lock

    def export(self) -> None:
        with self._lock:
            unsent, self._unsent = self._unsent, Counter()
            self._exported.update(unsent)
        for kind, count in unsent.items():
            self._decisions.inc(count, tags={"kind": kind})
        self._lag.set(self.lag_s)

    def counts(self) -> dict[str, int]:
        """Decisions by kind so far: what the metric says once the next export has run."""
        with self._lock:
            return dict(self._exported + Counter(dict(self._unsent)))  # dict(): one C-level copy, safe beside inc


def decision_counts() -> dict[str, int]:
    """Routing decisions by kind of every affinity router in this process, exported or not
    (``lorafleet_router_decisions_total`` for this process; empty where Serve's own routers route)."""
    total: Counter = Counter()
    for metrics in list(_LIVE):
        total.update(metrics.counts())
    return dict(total)
