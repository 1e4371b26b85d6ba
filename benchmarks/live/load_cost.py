"""Benchmark-only: make adapter loads cost what they cost on a GPU host (``routing_live``'s load-cost axis).

The demo adapters are tiny, so their loads cost ~0.1 ms here; a Llama-3-8B rank-16
adapter costs 4.8 ms as a host-tier copy into a slot and 88 ms as a read from disk
(``benchmarks.swap``'s measurements, kept in ``benchmarks.sim.costs``). These worker
subclasses wrap their engine's adapter store so every load waits that long in the load
path itself: a host-tier hit (the slot copy, on the engine thread, so the step stalls as a
GPU copy would) and every read from disk (registration, a re-read after host-tier
eviction) lasting less than the target is topped up to it. The product never deploys
them; ``routing_live`` does, through ``func_or_class``, and sets the cost on every
replica with ``set_injected_load_cost`` (zeros turn it off), so one deployment serves
both load costs without a redeploy (which would restart the replicas).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from deployments.worker import LoRAWorker
from engine.request import ReplicaTarget

from ..sim.costs import MEASURED_LOAD_SECONDS
from .multiplexed_worker import MultiplexedLoRAWorker


@dataclass(frozen=True)
class LoadCost:
    host_s: float = 0.0   # a host-tier copy into a slot
    disk_s: float = 0.0   # a read from disk into the host tier

    @classmethod
    def llama3_8b_rank16(cls) -> "LoadCost":
        host, disk = MEASURED_LOAD_SECONDS[16]
        return cls(host_s=host, disk_s=disk)

    def __post_init__(self) -> None:
        if self.host_s < 0 or self.disk_s < 0:
            raise ValueError(f"load costs must not be negative, got {self}")


class InjectedLoadCost:
    """Wraps one engine's store (its public ``store`` and ``store.host_cache``); the cost is live-settable."""

    def __init__(self, engine):
        self.cost = LoadCost()
        store = engine.store
        cache = store.host_cache
        get, register, fetch = cache.get, store.register, store.fetch

        def timed_get(uid):
            weights = get(uid)
            if weights is not None and self.cost.host_s > 0:
                time.sleep(self.cost.host_s)  # the slot copy a GPU host would make from this tier
            return weights

        def topped_up(read):
            def wrapper(*args, **kwargs):
                started = time.perf_counter()
                result = read(*args, **kwargs)
                if self.cost.disk_s > 0:
                    time.sleep(max(0.0, self.cost.disk_s - (time.perf_counter() - started)))
                return result
            return wrapper

        def timed_fetch(uid):
            if uid in cache:  # a hit: the host-tier get prices it
                return fetch(uid)
            return topped_up(fetch)(uid)

        cache.get = timed_get
        store.register = topped_up(register)
        store.fetch = timed_fetch  # fetch_to_host's path; the pool's slot loads go through cache.get

class LoadCostLoRAWorker(LoRAWorker.func_or_class):
    """The product's worker with injected load costs (deployed under the same name, ``LoRAWorker``)."""

    async def __init__(self, args: dict, directory=None, derived: Optional[dict] = None):
        await super().__init__(args, directory, derived)
        self.injected = InjectedLoadCost(self.engine)

    def set_injected_load_cost(self, target: Optional[ReplicaTarget], host_s: float, disk_s: float) -> dict:
        """``target`` first, so the affinity router delivers it to that replica (Serve's own routers ignore it)."""
        self.injected.cost = LoadCost(host_s, disk_s)
        return {"replica_id": self.replica_id}

    def engine_counters(self, target: Optional[ReplicaTarget] = None) -> dict:
        """``target`` first, as above: this replica's engine steps, rows fed and engine-thread CPU so far."""
        return engine_counters(self.engine, self.replica_id)


class LoadCostMultiplexedWorker(MultiplexedLoRAWorker.func_or_class):
    """The multiplexing baseline with injected load costs (same name, ``MultiplexedLoRAWorker``)."""

    def __init__(self, args: dict, slots=None):
        super().__init__(args, slots)
        self.injected = InjectedLoadCost(self.engine)

    def set_injected_load_cost(self, target: Optional[ReplicaTarget], host_s: float, disk_s: float) -> dict:
        self.injected.cost = LoadCost(host_s, disk_s)
        return {"replica_id": self.replica_id}

    def engine_counters(self, target: Optional[ReplicaTarget] = None) -> dict:
        return engine_counters(self.engine, self.replica_id)


def engine_counters(engine, replica_id: str) -> dict:
    """What ``routing_live`` reads around a row: steps, rows stepped and the engine thread's CPU seconds (the
    simulator's live check prices a live step by them)."""
    stats = engine.stats()
    return {"replica_id": replica_id, "steps": stats["steps"], "rows_stepped": stats["rows_stepped"],
            "engine_cpu_s": stats["engine_cpu_s"]}
