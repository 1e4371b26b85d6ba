"""Prometheus metrics for workers and the directory, through ``ray.serve.metrics``.

Ray's metrics agent exports them (with Ray's ``ray_`` prefix) on each node's metrics
port. Values are pushed from the workers' report loop, never from the engine thread, so
metrics cost generation nothing.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

from pool.events import PoolCounters

LOAD_SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class PoolMetrics:
    """Per replica: slots, pins, loads, evictions by policy, hits, misses, load seconds, host tier."""

    def __init__(self) -> None:
        self.slots = Gauge("lorafleet_pool_slots", description="Adapter slots in this replica's pool")
        self.slots_used = Gauge("lorafleet_pool_slots_used", description="Slots holding an adapter or the base model")
        self.pinned = Gauge("lorafleet_pool_pinned", description="Pinned adapters in this replica's pool")
        self.loads = Counter("lorafleet_adapter_loads_total", description="Adapters loaded into a slot")
        self.evictions = Counter("lorafleet_adapter_evictions_total", description="Adapters evicted from a slot",
                                 tag_keys=("policy",))
        self.hits = Counter("lorafleet_pool_hits_total", description="Batch entries whose adapter was resident")
        self.misses = Counter("lorafleet_pool_misses_total", description="Batch entries that had to load an adapter")
        self.load_seconds = Histogram("lorafleet_adapter_load_seconds", description="Seconds to bring an adapter "
                                      "into a slot (host tier or disk)", boundaries=LOAD_SECONDS_BUCKETS)
        self.host_bytes = Gauge("lorafleet_host_cache_bytes", description="Bytes held by the host-memory tier")
        self.host_hits = Counter("lorafleet_host_cache_hits_total", description="Slot loads served by the host tier")
        self._last = PoolCounters()
        self._last_host_hits = 0

    def update(self, pool, host_cache) -> None:
        snap = pool.snapshot()
        c, last = snap.counters, self._last
        self.slots.set(snap.slots)
        self.slots_used.set(snap.slots - snap.free_slots)
        self.pinned.set(len(snap.pinned))
        for counter, now, before in ((self.loads, c.loads, last.loads), (self.hits, c.hits, last.hits),
                                     (self.misses, c.misses, last.misses)):
            if now > before:
                counter.inc(now - before)
        if c.evictions > last.evictions:
            self.evictions.inc(c.evictions - last.evictions, tags={"policy": snap.eviction_policy})
        while pool.recent_load_seconds:
            self.load_seconds.observe(pool.recent_load_seconds.popleft())
        self._last = c
        stats = host_cache.stats
        self.host_bytes.set(stats.bytes_used)
        if stats.hits > self._last_host_hits:
            self.host_hits.inc(stats.hits - self._last_host_hits)
            self._last_host_hits = stats.hits


class DirectoryMetrics:
    """The directory's view and its placement plan: version, holder moves, and per adapter its planned
    holder count (beside the workers' residency metrics: planned vs resident shows a plan not yet served)."""

    def __init__(self) -> None:
        self.events = Counter("lorafleet_directory_events_total", description="Pool events applied by the directory")
        self.replicas = Gauge("lorafleet_directory_replicas", description="Worker replicas the directory knows")
        self.plan_version = Gauge("lorafleet_plan_version", description="Version of the placement plan")
        self.plan_moves = Counter("lorafleet_plan_moves_total",
                                  description="Holders the placement plan added to an adapter it had placed")
        self.planned_holders = Gauge("lorafleet_plan_holders", description="Replicas the plan places an adapter on",
                                     tag_keys=("adapter",))
        self._last_events = 0
        self._last_moves = 0
        self._exported: set[str] = set()

    def update(self, directory) -> None:
        if directory.events_applied > self._last_events:
            self.events.inc(directory.events_applied - self._last_events)
            self._last_events = directory.events_applied
        self.replicas.set(len(directory.replicas))
        plan = directory.plan
        self.plan_version.set(plan.version)
        if directory.plan_moves_total > self._last_moves:
            self.plan_moves.inc(directory.plan_moves_total - self._last_moves)
            self._last_moves = directory.plan_moves_total
        for name, holders in plan.holders.items():
            self.planned_holders.set(len(holders), tags={"adapter": name})
        for name in self._exported - set(plan.holders):
            self.planned_holders.set(0, tags={"adapter": name})  # left the plan: no longer held anywhere
        self._exported = set(plan.holders)


class PrefetchMetrics:
    """Per worker: adapters read ahead because the plan made this replica a new holder, and standby copies
    (registered adapters read into the host tier of their rendezvous-first replica, where a request for one goes
    while nothing holds or plans it)."""

    def __init__(self) -> None:
        self.prefetches = Counter("lorafleet_plan_prefetches_total",
                                  description="Adapters a replica read ahead for the placement plan")
        self.standby = Counter("lorafleet_standby_stages_total",
                               description="Registered adapters read into this replica's host tier ahead of "
                                           "a request (it is their rendezvous-first replica)")
        self._last = 0
        self._last_standby = 0

    def update(self, prefetched: int, standby: int = 0) -> None:
        if prefetched > self._last:
            self.prefetches.inc(prefetched - self._last)
            self._last = prefetched
        if standby > self._last_standby:
            self.standby.inc(standby - self._last_standby)
            self._last_standby = standby
