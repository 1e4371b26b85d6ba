"""A lower bound on the adapter loads of any router: one cache holding every slot of the fleet.

Why: "affinity loads 70% less than least-loaded" says nothing about how far it is from the
best possible. Routing only decides which replica's slots an adapter lands in; merging all
replicas into one cache of ``replicas * slots`` slots removes every constraint routing
works under (which replica, load balance, batch limits), so the fewest loads that cache
can pay on the trace is a floor for every router. For one cache with unit-size entries the
fewest loads is exactly Belady's MIN (evict the adapter used furthest in the future),
which ``benchmarks.policies.belady_misses`` computes in O(n log n) with a precomputed
next-use index and a lazy max-heap.

Two forms, matching the simulator's two load counts:

- ``total``: the whole trace from empty slots (compare ``SimResult.loads_total``);
- ``measured``: only the measured requests (after the warm-up), with the cache starting
  from the best possible contents for free. Filling the ``K`` slots with the first ``K``
  distinct adapters the measured requests ask for is optimal, so this is MIN from empty
  minus ``min(K, distinct)`` (compare ``SimResult.loads``).

Assumption: requests use their adapters in arrival order. A replica's scheduler that
batches two requests for one adapter around a third can pay one load where the arrival
order needs two; with the fleet's slots counted together that needs one adapter to be
evicted and asked for again while a request for it waits, which the tests find never
happens on realistic traces (``tests/test_fleet_bound.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..policies import belady_misses


@dataclass(frozen=True)
class FleetBound:
    fleet_slots: int
    total: int      # MIN over the whole trace, empty at the start
    measured: int   # MIN over the measured requests, best contents at the start for free
    # one LRU cache of every slot, no routing constraint, over the whole trace; its misses among the measured requests:
    # what the fleet's LRU pools would pay if routing were perfect (MIN sees the future, which no online policy does)
    global_lru: int = 0


def warm_min(adapters: np.ndarray, slots: int) -> int:
    """MIN's loads when the cache may start holding any ``slots`` adapters at no cost."""
    adapters = np.asarray(adapters)
    if adapters.size == 0:
        return 0
    return belady_misses(adapters, slots) - min(slots, len(np.unique(adapters)))


def fleet_bound(adapters: np.ndarray, replicas: int, slots: int, first_measured: int = 0) -> FleetBound:
    """The bound for a fleet of ``replicas`` x ``slots`` on the adapter ids ``adapters`` (arrival order)."""
    if replicas < 1 or slots < 1:
        raise ValueError(f"need replicas >= 1 and slots >= 1, got {replicas}, {slots}")
    adapters = np.asarray(adapters)
    if not 0 <= first_measured <= adapters.size:
        raise ValueError(f"first_measured must be within the trace (0..{adapters.size}), got {first_measured}")
    k = replicas * slots
    total = belady_misses(adapters, k) if adapters.size else 0
    return FleetBound(k, total, warm_min(adapters[first_measured:], k), global_lru_misses(adapters, k, first_measured))


def global_lru_misses(adapters: np.ndarray, slots: int, first_measured: int = 0) -> int:
    """Misses among ``adapters[first_measured:]`` of one LRU cache of ``slots`` entries run over the whole sequence."""
    cache: OrderedDict = OrderedDict()
    misses = 0
    for k, a in enumerate(np.asarray(adapters).tolist()):
        if a in cache:
            cache.move_to_end(a)
            continue
        misses += k >= first_measured
        cache[a] = None
        if len(cache) > slots:
            cache.popitem(last=False)
    return misses


def bound_rows(rows: list[dict], routers: tuple[str, ...]) -> list[dict]:
    """Per setting (rows sharing a trace), every router's loads as a multiple of the bound."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if "bound" not in r:
            continue
        key = (r["experiment"], r["replicas"], r["adapters"], r["alpha"], r["cv"], r["load"], r["lag_s"], r["epsilon"])
        entry = out.setdefault(key, {"experiment": r["experiment"], "replicas": r["replicas"],
                                     "adapters": r["adapters"], "alpha": r["alpha"], "load": r["load"],
                                     "cv": r["cv"], "fleet_slots": r["fleet_slots"], "bound": r["bound"],
                                     "bound_total": r["bound_total"],
                                     "global_lru": r.get("global_lru", 0) / max(1, r["bound"]),
                                     "online_floor": r.get("online_floor", 0) / max(1, r["bound"])})
        if r["router"] in routers:
            entry[r["router"]] = r["loads"] / max(1, r["bound"])
            entry[f"{r['router']}_total"] = r["loads_total"] / max(1, r["bound_total"])
    return [e for e in out.values() if all(name in e for name in routers)]
