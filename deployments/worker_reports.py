"""What one worker replica tells the directory: pool events as they happen, its queue length when it
changes, and a heartbeat with its state once a second. The directory's reply carries the placement
plan, which the replica follows (``deployments/worker_plan.py``).

Why apart from the deployment: the loop shares the replica's event loop with Serve's queue-length
probes and must stay light; generation never waits on it. Events go in one batched call; a failed
call (the directory restarting) makes the next one resend the whole pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Optional

from engine.engine import LoRAEngine
from pool.events import PoolSnapshot
from routing.autoscale import DemandWindow

from .engine_metrics import EngineMetrics
from .event_buffer import EventBuffer
from .metrics import PoolMetrics, PrefetchMetrics
from .worker_adapters import WorkerAdapters
from .worker_plan import PlanFollower

log = logging.getLogger("ray.serve")
FLUSH_INTERVAL_S = 0.02
HEARTBEAT_INTERVAL_S = 1.0
QUEUE_REPORT_INTERVAL_S = 0.25  # a changed queue length is reported at most this often (between heartbeats)
FIRST_REPORT_TIMEOUT_S = 10.0  # a directory still starting must not hold the replica's start up


class DirectoryReporter:
    def __init__(self, adapters: WorkerAdapters, plan: PlanFollower, directory, demand: DemandWindow, rows: int):
        """``rows``: the requests the replica's batch holds (``max_batch_size``), reported with its state."""
        self.adapters = adapters
        self.engine: LoRAEngine = adapters.engine
        self.replica_id = adapters.replica_id
        self.plan = plan
        self.directory = directory
        self.demand = demand
        self.rows = rows
        self.events = EventBuffer()
        self.engine.subscribe_pool_events(self.events.append)
        self.metrics = PoolMetrics()
        self.prefetch_metrics = PrefetchMetrics()
        self.engine_metrics = EngineMetrics()
        self._busy_s: Counter = Counter()  # adapter -> request-seconds since the last heartbeat

    def count_busy(self, name: Optional[str], started: float) -> None:
        """Request-seconds per adapter since the last heartbeat: the demand the directory plans by."""
        if name is not None:
            self._busy_s[name] += time.monotonic() - started

    def state_extras(self) -> dict:
        """What a replica's state holds beside its pool snapshot (``routing.replica_state.ReplicaState``)."""
        timings = self.adapters.load_timings
        return {"queue_len": self.engine.queue_len(), "host_cached": self.engine.host_cached_uids(),
                "loading": sorted(self.adapters.loading), "rows": self.rows,
                "base_resident": self.engine.pool_snapshot().base_slot is not None,
                "load_s": timings.report()}  # measured host-copy / disk-read seconds (routers price loads)

    def observe_timings(self, snap: PoolSnapshot) -> None:
        """Fold the pool's load times and the engine's prefill times into what routers price loads by."""
        self.adapters.load_timings.observe_pool(snap.counters.loads, snap.counters.load_seconds)
        self.adapters.load_timings.observe_prefill(*self.engine.prefill_timed)

    def heartbeat(self) -> dict:
        self.observe_timings(self.engine.pool_snapshot())
        busy, self._busy_s = self._busy_s, Counter()
        return {**self.state_extras(), "busy_s": {name: round(s, 4) for name, s in busy.items()},
                "plan_version": self.plan.version}

    async def first_report(self, snap: PoolSnapshot) -> None:
        """The whole pool, once warm-up is over, so routers see the replica with its adapters before Serve
        sends it traffic; bounded, since a directory still starting must not hold the replica up."""
        try:
            await asyncio.wait_for(self.directory.report.remote(self.replica_id, [], self.heartbeat(), snap.to_dict()),
                                   FIRST_REPORT_TIMEOUT_S)
        except Exception as exc:  # the report loop keeps trying and resyncs
            log.warning("lorafleet worker %s: first report failed (%r)", self.replica_id, exc)
            self.events.request_resync()

    async def loop(self) -> None:
        """Events every FLUSH_INTERVAL_S when there are any; a changed queue length at most every
        QUEUE_REPORT_INTERVAL_S (so the admin view drops cancelled work within a second); heartbeat
        and metrics once a second (not on every flush: this loop shares the event loop with Serve)."""
        last_heartbeat = last_report = float("-inf")
        reported_queue = -1
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            now = time.monotonic()
            heartbeat_due = now - last_heartbeat >= HEARTBEAT_INTERVAL_S
            queue_due = (self.engine.queue_len() != reported_queue   # cancelled work leaves the admin view
                         and now - last_report >= QUEUE_REPORT_INTERVAL_S)  # within a second, not a heartbeat
            if not len(self.events) and not self.events.resync_needed and not heartbeat_due and not queue_due:
                continue
            last_report = now
            if heartbeat_due:
                last_heartbeat = now
                self.metrics.update(*self.engine.pool_metrics_sources())
                self.prefetch_metrics.update(self.plan.prefetched, self.plan.standby_staged)
                self.engine_metrics.update(self.engine.stats())
                self.demand.observe_loads(self.engine.pool_snapshot().counters.loads, now)
            events, resync = self.events.drain()
            snapshot = self.engine.pool_snapshot().to_dict() if resync else None
            heartbeat = self.heartbeat()
            reported_queue = heartbeat["queue_len"]
            try:
                reply = await self.directory.report.remote(self.replica_id, events, heartbeat, snapshot)
                if reply.get("resync"):
                    self.events.request_resync()
                if "plan" in reply:
                    self.plan.changed(reply["plan"])
            except Exception as exc:  # the directory restarts: resend the whole state when it is back
                log.warning("lorafleet worker %s: report failed (%r); will resync", self.replica_id, exc)
                self.events.request_resync()
                await asyncio.sleep(0.5)
