"""LoRAWorker: one engine, one LoRAMemoryPool and one host tier per Serve replica.

Requests carry their adapter inside the request object (not Serve's
``multiplexed_model_id``, by which ``@serve.batch`` would split mixed batches), resolved
once at the ingress to a uid (``GenerateRequest.resolved``): the worker loads that uid if
its engine lacks it and never looks the name up again; a uid whose name was re-registered
meanwhile is refused (410), never served other weights. Adapters are read from disk on
first use in a thread, with one lock per adapter uid, so loads of unrelated adapters
overlap and never stall the engine (Ray issue 65346). Pool events go
to the directory in batches from a background task; generation never waits on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import Counter
from typing import AsyncIterator, Optional

import torch
from ray import serve

from engine.engine import LoRAEngine
from engine.errors import AdapterUnregisteredError
from engine.request import AdapterRef, GenerateRequest, GenerateResult, ReplicaTarget, TokenDelta
from pool.errors import AdapterNotFoundError, LoRAFleetError
from pool.events import PoolEvent
from routing.autoscale import DemandWindow, working_set_sketch
from routing.directory import ReplicaState
from routing.load_timings import LoadTimings
from routing.pins import pin_holders
from routing.prefetch import Prefetch, prefetches

from .autoscaling import LOADS_METRIC, PINNED_METRIC, SLOTS_METRIC, sketch_metric
from .content_version import SourceChangedError, check_unchanged, content_version
from .config import AppArgs, resolve_demo_source
from .derived_options import check_deployment
from .engine_metrics import EngineMetrics
from .event_buffer import EventBuffer
from .metrics import PoolMetrics, PrefetchMetrics
from .registry import RegistryEntry, RegistryFollower

log = logging.getLogger("ray.serve")
FLUSH_INTERVAL_S = 0.02
HEARTBEAT_INTERVAL_S = 1.0
QUEUE_REPORT_INTERVAL_S = 0.25  # a changed queue length is reported at most this often (between heartbeats)
PIN_RETRY_INTERVAL_S = 1.0
REGISTRY_POLL_TIMEOUT_S = 5.0
FIRST_REPORT_TIMEOUT_S = 10.0  # a directory still starting must not hold the replica's start up


def _torch_threads() -> int:
    """As many threads as whole CPUs Ray gave this replica (at least one)."""
    import ray

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else (os.cpu_count() or 1)


@serve.deployment(name="LoRAWorker", health_check_period_s=5.0)  # the options AppArgs decide: build_fleet's
class LoRAWorker:
    async def __init__(self, args: dict, directory=None, derived: Optional[dict] = None):
        """``derived``: the options build_fleet derived (``derived_options.expected``), checked against Serve's."""
        self.args = AppArgs(**args)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        check_deployment("LoRAWorker", context._deployment_config, derived)
        if not torch.cuda.is_available():
            torch.set_num_threads(_torch_threads())
        self.engine = await asyncio.to_thread(LoRAEngine, self.args.engine_config(self.replica_id))
        self.events = EventBuffer()
        self.metrics = PoolMetrics()
        self.prefetch_metrics = PrefetchMetrics()
        self.engine_metrics = EngineMetrics()
        self.engine.subscribe_pool_events(self.events.append)
        self.directory = directory
        self.registry = RegistryFollower(directory, self._registry_changed, REGISTRY_POLL_TIMEOUT_S)
        self.loading: set[str] = set()
        self.load_timings = LoadTimings()
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._content: dict[str, Optional[str]] = {}  # uid -> content version registered (checked on a re-read)
        self._retiring: set[str] = set()
        self._prewarmed: set[str] = set()  # uids a rollout's pre-warm plan asked of this replica (started)
        self._warming: set[asyncio.Task] = set()
        self._refused_pins: set[str] = set()  # uids whose refused pin was logged (the pin loop retries each second)
        self.demand = DemandWindow(self.args.demand_window_s)
        self.demand.observe_loads(0, time.monotonic())  # warm-up loads count too
        self.warm_start: dict = {}
        self._busy_s: Counter = Counter()  # adapter -> request-seconds since the last heartbeat
        self._loads_after_ready: Counter = Counter()  # uid -> slot loads since warm-up ended (benchmarks.elastic)
        self._plan_version = -1          # the placement plan this replica last heard of (the directory's reply)
        self._planned: set[str] = set()  # adapter names that plan places here
        self._prefetch_queue: list[Prefetch] = []
        self._prefetching: Optional[asyncio.Task] = None
        self.prefetched = 0              # adapters read ahead for the plan (lorafleet_plan_prefetches_total)
        self.engine.subscribe_pool_events(self._count_load)
        self._left = False
        self._tasks: list[asyncio.Task] = []
        if directory is not None:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._report_loop()), loop.create_task(self.registry.run()),
                           loop.create_task(self._pin_loop())]
            await self._warm_up()

    async def _warm_up(self) -> None:
        """Load what the directory says this replica should hold (pins, hot adapters whose next copy
        belongs here), bounded by ``warm_start_timeout_s``, then report the pool so routers see it
        with its adapters before Serve sends traffic (Serve routes to a replica once this returns)."""
        started = time.monotonic()
        plan: dict = {}
        if self.args.warm_start_timeout_s > 0:
            try:
                plan = await asyncio.wait_for(self._load_warm_start_plan(), self.args.warm_start_timeout_s)
            except Exception as exc:  # a slow or failing source must not keep the replica from starting
                log.warning("lorafleet worker %s: warm start stopped after %.1f s (%r); starting with what is "
                            "loaded", self.replica_id, time.monotonic() - started, exc)
        snap = self.engine.pool_snapshot()
        self.warm_start = {"plan": plan, "seconds": round(time.monotonic() - started, 3),
                           "loads_at_ready": snap.counters.loads, "resident": sorted(snap.resident)}
        try:
            await asyncio.wait_for(self.directory.report.remote(self.replica_id, [], self._heartbeat(), snap.to_dict()),
                                   FIRST_REPORT_TIMEOUT_S)
        except Exception as exc:  # the report loop keeps trying and resyncs
            log.warning("lorafleet worker %s: first report failed (%r)", self.replica_id, exc)
            self.events.request_resync()

    async def _load_warm_start_plan(self) -> dict:
        await self.registry.refresh()
        slots = self.args.max_loras_per_batch
        plan = await self.directory.warm_start_plan.remote(self.replica_id, slots, slots)
        await self._apply_pins()  # the plan's pins: the same rule, over the same replica set
        for name in plan["slots"]:
            if name not in plan["pins"] and name in self.registry.entries:
                await self._prewarm(self.registry.entries[name], into_slot=True)
        for name in plan["host"]:
            if name in self.registry.entries:
                await self._ensure_entry(self.registry.entries[name])
        return plan

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        request = await self._resolved(request)
        self._count_demand(request.served_name)
        started = time.monotonic()
        try:
            await self._ensure_uid(request.resolved)
            result = await self.engine.generate(request)
        finally:
            self._count_busy(request.served_name, started)
        return dataclasses.replace(result, replica_id=self.replica_id)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta | GenerateResult]:
        """Deltas as produced, then the ``GenerateResult`` (usage, finish reason)."""
        request = await self._resolved(request)
        self._count_demand(request.served_name)
        started = time.monotonic()
        try:
            await self._ensure_uid(request.resolved)
            async for item in self.engine.generate_stream(request, with_result=True):
                yield dataclasses.replace(item, replica_id=self.replica_id) if isinstance(item, GenerateResult) \
                    else item
        finally:
            self._count_busy(request.served_name, started)

    def _count_busy(self, name: Optional[str], started: float) -> None:
        """Request-seconds per adapter since the last heartbeat: the demand the directory plans by."""
        if name is not None:
            self._busy_s[name] += time.monotonic() - started

    def model_info(self) -> dict:
        """What the OpenAI routes say of the base model (its context window, as the KV cache fits it)."""
        return {"max_model_len": self.engine.max_model_len}

    def _count_load(self, event: PoolEvent) -> None:
        """On the engine thread: count slot loads once the replica is ready (cheap, no lock needed)."""
        if event.kind == "load" and self.warm_start:
            self._loads_after_ready[event.uid] += 1

    def _count_demand(self, name: Optional[str]) -> None:
        if name is not None:
            self.demand.requested(name, time.monotonic())

    async def _resolved(self, request: GenerateRequest) -> GenerateRequest:
        """The request with its adapter's uid: as the ingress resolved it, or, for a caller that reached the
        worker directly with a name only, resolved here (once, in this replica's registry copy)."""
        if request.adapter is None or request.resolved is not None:
            return request
        entry = self.registry.entry(request.adapter)
        if entry is None and self.directory is not None:
            await self.registry.refresh()  # registered a moment ago: our long poll may not have seen it
            entry = self.registry.entry(request.adapter)
        if entry is None:
            raise AdapterNotFoundError(f"adapter {request.adapter!r} is not registered")
        return dataclasses.replace(request, resolved=AdapterRef(entry.name, entry.uid))

    async def _ensure_uid(self, ref: Optional[AdapterRef]) -> None:
        """Make ``ref``'s uid servable here. The engine checks the uid is live; one it lacks is looked up by uid
        (once per replica) and loaded; one the registry no longer has is refused (410)."""
        if ref is None:
            return
        if self.engine.serves(ref.uid):
            await self._restage(ref.uid)
            return
        entry = self.registry.entry_of_uid(ref.uid)
        if entry is None and self.directory is not None:
            await self.registry.refresh()  # registered a moment ago: our long poll may not have seen it
            entry = self.registry.entry_of_uid(ref.uid)
        if entry is None:
            raise AdapterUnregisteredError(f"adapter {ref.name!r} (uid {ref.uid!r}) is no longer registered: it was "
                                           f"re-registered or unregistered after this request was resolved")
        await self._ensure_entry(entry)

    async def _ensure_entry(self, entry: RegistryEntry) -> None:
        """Register ``entry``'s uid in the engine unless it serves it already, and stage it (requests, warm-up,
        pins and the plan, which hold the entry already, come here)."""
        if not self.engine.serves(entry.uid):
            async with self._load_locks.setdefault(entry.uid, asyncio.Lock()):
                if not self.engine.serves(entry.uid):
                    await self._load(entry)
        await self._restage(entry.uid)

    async def _restage(self, uid: str) -> None:
        if not self.engine.is_resident(uid) and not self.engine.host_cached(uid):
            # evicted from the host tier too: re-read it here, off the engine thread, so the step
            # that loads it into a slot does a memory copy instead of a file read (of what was registered)
            await asyncio.to_thread(check_unchanged, self.engine.adapter_record(uid), self._content.get(uid))
            with self.load_timings.disk_read():
                await asyncio.to_thread(self.engine.fetch_to_host, uid)

    async def _load(self, entry: RegistryEntry) -> None:
        self.loading.add(entry.uid)
        try:
            source = await asyncio.to_thread(resolve_demo_source, entry.source)
            with self.load_timings.disk_read():
                record = await asyncio.to_thread(self.engine.register_adapter, entry.name, source,
                                                 revision=entry.revision, uid=entry.uid)
            try:
                await asyncio.to_thread(check_unchanged, record, entry.content)
            except SourceChangedError:
                await asyncio.to_thread(self.engine.unregister_uid, entry.uid, 0.0)  # never serve other weights
                raise
            self._content[entry.uid] = entry.content
        finally:
            self.loading.discard(entry.uid)

    # ------------------------------------------------------------------ admin

    async def validate_adapter(self, name: str, source: str, revision: Optional[str], uid: str) -> dict:
        """Read and validate an adapter on this replica (registration's first step); returns its facts."""
        path = await asyncio.to_thread(resolve_demo_source, source)
        record = await asyncio.to_thread(self.engine.validate_adapter_files, uid, path, name=name, revision=revision)
        return {"rank": record.rank, "bytes": record.nbytes, "folder": str(record.folder),
                "content": await asyncio.to_thread(content_version, record)}

    async def _prewarm(self, entry: RegistryEntry, into_slot: bool) -> None:
        """Bring a registered adapter into the host tier and, if asked, into a slot (between two engine
        steps, with no request: a warm-up must not queue behind traffic or count as one)."""
        await self._ensure_entry(entry)
        if into_slot:
            await asyncio.to_thread(self.engine.load_into_slot, entry.uid)

    async def _prewarm_planned(self, entry: RegistryEntry, into_slot: bool) -> None:
        """A rollout's pre-warm plan names this replica (deployments/versions.py): warm it, best effort."""
        try:
            await self._prewarm(entry, into_slot)
        except Exception as exc:  # the PUT reports this replica as not warmed; traffic still loads it
            log.warning("lorafleet worker %s: pre-warm of %s failed (%r)", self.replica_id, entry.name, exc)
            self._prewarmed.discard(entry.uid)

    def pool_state(self, target: Optional[ReplicaTarget] = None) -> dict:
        """This replica's pool, exactly; call it with a ``ReplicaTarget`` to ask one replica."""
        if target is not None and target.target_replica != self.replica_id:
            raise RuntimeError(f"pool_state for {target.target_replica} reached replica {self.replica_id}")
        snap = self.engine.pool_snapshot().to_dict()
        snap["host_cached"] = self.engine.host_cached_uids()
        snap["engine"] = {k: v for k, v in self.engine.stats().items() if k not in ("adapters", "host_cached")}
        snap["warm_start"] = {**self.warm_start, "loads_after_ready": dict(self._loads_after_ready)}
        snap["registry_lookups"] = self.registry.lookups  # entries requests looked up here (by name or uid)
        return snap

    # ------------------------------------------------------------------ Serve hooks

    def record_routing_stats(self) -> dict:
        """What routers reconcile their view with every ``request_routing_stats_period_s``."""
        snap = self.engine.pool_snapshot()
        self.load_timings.observe_pool(snap.counters.loads, snap.counters.load_seconds)
        self.load_timings.observe_prefill(*self.engine.prefill_timed)
        return ReplicaState.from_snapshot(snap, **self._state_extras()).to_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (deployments/autoscaling.py reads them): slots, pinned slots,
        pool loads per second and the sketch of adapters requested over the last ``demand_window_s``."""
        now = time.monotonic()
        snap = self.engine.pool_snapshot()
        self.demand.observe_loads(snap.counters.loads, now)
        stats = {SLOTS_METRIC: float(snap.slots), PINNED_METRIC: float(len(snap.pinned)),
                 LOADS_METRIC: self.demand.loads_per_s(now)}
        for i, value in enumerate(working_set_sketch(self.demand.names(now))):
            stats[sketch_metric(i)] = value
        return stats

    def check_health(self) -> None:
        if not self.engine.healthy():
            raise RuntimeError("the engine is unhealthy: its thread died or its steps keep failing")
        for task in self._tasks:
            if task.done() and task.exception() is not None:
                raise RuntimeError(f"background task failed: {task.exception()!r}")

    def reconfigure(self, user_config: dict) -> None:
        """Live settings from ``user_config``: eviction_policy, max_batch_size, max_tokens_limit."""
        self.engine.apply_settings(user_config or {})

    def __del__(self):
        for task in getattr(self, "_tasks", []):
            task.cancel()
        if getattr(self, "directory", None) is not None and not getattr(self, "_left", True):
            self._left = True  # Serve calls this on a graceful stop: say goodbye so pins move at once
            try:
                self.directory.forget_replica.remote(self.replica_id)
            except Exception as exc:  # the directory is gone too: it forgets silent replicas by itself
                log.warning("lorafleet worker %s: goodbye to the directory failed (%r)", self.replica_id, exc)
        if hasattr(self, "engine"):
            self.engine.shutdown()

    # ------------------------------------------------------------------ background

    def _state_extras(self) -> dict:
        """What a replica's state holds beside its pool snapshot (``routing.directory.ReplicaState``)."""
        return {"queue_len": self.engine.queue_len(), "host_cached": self.engine.host_cached_uids(),
                "loading": sorted(self.loading), "rows": self.args.max_batch_size,
                "base_resident": self.engine.pool_snapshot().base_slot is not None,
                "load_s": self.load_timings.report()}  # measured host-copy / disk-read seconds (routers price loads)

    def _heartbeat(self) -> dict:
        counters = self.engine.pool_snapshot().counters
        self.load_timings.observe_pool(counters.loads, counters.load_seconds)
        self.load_timings.observe_prefill(*self.engine.prefill_timed)
        busy, self._busy_s = self._busy_s, Counter()
        return {**self._state_extras(), "busy_s": {name: round(s, 4) for name, s in busy.items()},
                "plan_version": self._plan_version}

    def _plan_changed(self, plan: dict) -> None:
        """The plan moved: the pool evicts last the adapters it gives a slot here (``kept``: the others
        planned here load on demand into the rest), and what it newly places here is read ahead
        (``routing.prefetch``), one at a time, in the background; generation never waits on it."""
        planned = [name for name in plan["planned"] if name in self.registry.entries]
        kept = [name for name in plan.get("kept", plan["planned"]) if name in self.registry.entries]
        self._plan_version = plan["version"]
        follow = self.args.replicas_follow_plan
        self.engine.keep_adapters([self.registry.entries[n].uid for n in kept] if follow else ())
        if follow and self.warm_start:
            uid = lambda name: self.registry.entries[name].uid  # noqa: E731
            todo = prefetches(planned, self._planned,
                              resident={n for n in planned if self.engine.is_resident(uid(n))},
                              staged={n for n in planned if self.engine.host_cached(uid(n)) or uid(n) in self.loading},
                              free_slots=self.engine.pool_snapshot().free_slots)
            self._prefetch_queue += todo
            if todo and (self._prefetching is None or self._prefetching.done()):
                self._prefetching = asyncio.get_running_loop().create_task(self._prefetch())
        self._planned = set(planned)

    async def _prefetch(self) -> None:
        while self._prefetch_queue:
            item = self._prefetch_queue.pop(0)
            if item.name not in self._planned or item.name not in self.registry.entries:
                continue  # the plan moved on, or the adapter left
            try:
                await self._prewarm(self.registry.entries[item.name],
                                    item.into_slot and self.engine.pool_snapshot().free_slots > 0)
                self.prefetched += 1
            except Exception as exc:  # best effort: a request still loads what it needs
                log.warning("lorafleet worker %s: prefetch of %s failed (%r)", self.replica_id, item.name, exc)

    async def _report_loop(self) -> None:
        """Events every FLUSH_INTERVAL_S when there are any; a changed queue length at most every
        QUEUE_REPORT_INTERVAL_S (so the admin view drops cancelled work within a second); heartbeat
        and metrics once a second.

        This loop shares the replica's event loop with Serve's queue-length probes, so it stays
        light: metrics are not pushed on every flush.
        """
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
                self.prefetch_metrics.update(self.prefetched)
                self.engine_metrics.update(self.engine.stats())
                self.demand.observe_loads(self.engine.pool_snapshot().counters.loads, now)
            events, resync = self.events.drain()
            snapshot = self.engine.pool_snapshot().to_dict() if resync else None
            heartbeat = self._heartbeat()
            reported_queue = heartbeat["queue_len"]
            try:
                reply = await self.directory.report.remote(self.replica_id, events, heartbeat, snapshot)
                if reply.get("resync"):
                    self.events.request_resync()
                if "plan" in reply:
                    self._plan_changed(reply["plan"])
            except Exception as exc:  # the directory restarts: resend the whole state when it is back
                log.warning("lorafleet worker %s: report failed (%r); will resync", self.replica_id, exc)
                self.events.request_resync()
                await asyncio.sleep(0.5)

    async def _registry_changed(self, old: dict[str, RegistryEntry], new: dict[str, RegistryEntry]) -> None:
        """Retire registrations removed or replaced (by uid, so a newer uid of the name is safe); warm what a
        rollout's plan asks of this replica; re-apply pins."""
        for entry in new.values():
            plan = (entry.prewarm or {}).get(self.replica_id)
            if plan is not None and entry.uid not in self._prewarmed:
                self._prewarmed.add(entry.uid)
                task = asyncio.get_running_loop().create_task(self._prewarm_planned(entry, plan == "slot"))
                self._warming.add(task)   # held until done (the loop keeps only weak references)
                task.add_done_callback(self._warming.discard)
        for name, entry in old.items():
            if (name not in new or new[name].uid != entry.uid) and entry.uid not in self._retiring:
                self._retiring.add(entry.uid)
                asyncio.get_running_loop().create_task(self._retire(entry.uid))
        await self._apply_pins()

    async def _retire(self, uid: str) -> None:
        try:
            await asyncio.to_thread(self.engine.unregister_uid, uid, self.args.drain_timeout_s)
        finally:
            self._retiring.discard(uid)
            self._prewarmed.discard(uid)
            self._load_locks.pop(uid, None)  # per-uid state goes with the uid
            self._content.pop(uid, None)

    async def _pin_loop(self) -> None:
        """Pins are desired state: one that could not be applied (busy slots, a replica just added or
        removed) is tried again every PIN_RETRY_INTERVAL_S until it holds."""
        known = set(self.registry.replicas)
        while True:
            await asyncio.sleep(PIN_RETRY_INTERVAL_S)
            if self._pins_differ():
                await self._apply_pins()
            now_known = set(self.registry.replicas)
            if known - now_known:
                await self._prefetch_departed()
            known = now_known

    async def _prefetch_departed(self) -> None:
        """Replicas left: read the adapters they held that now fall to this replica into the host tier."""
        try:
            names = await self.directory.rehome_plan.remote(self.replica_id)
            for name in names:
                if name in self.registry.entries:
                    await self._ensure_entry(self.registry.entries[name])
        except Exception as exc:  # best effort: a request still loads what it needs
            log.warning("lorafleet worker %s: prefetch after a scale-down failed (%r)", self.replica_id, exc)

    def _pins_differ(self) -> bool:
        replicas = sorted(set(self.registry.replicas) | {self.replica_id})
        pinned = self.engine.pinned_uids()
        return any((entry.pinned and self.replica_id in pin_holders(name, replicas, entry.replicas))
                   != (entry.uid in pinned) for name, entry in self.registry.entries.items())

    async def _apply_pins(self) -> None:
        """Pin each pinned adapter on its ``pin_holders`` (the rule ingress and view share); unpin elsewhere."""
        replicas = sorted(set(self.registry.replicas) | {self.replica_id})
        for name, entry in self.registry.entries.items():
            should_pin = entry.pinned and self.replica_id in pin_holders(name, replicas, entry.replicas)
            is_pinned = entry.uid in self.engine.pinned_uids()
            try:
                if should_pin and not is_pinned:
                    await self._ensure_entry(entry)
                    await asyncio.to_thread(self.engine.pin_adapter, name)
                elif is_pinned and not should_pin:
                    await asyncio.to_thread(self.engine.unpin_adapter, name)
            except LoRAFleetError as exc:  # a refused pin (starvation guard) must not break the sync loop
                if entry.uid not in self._refused_pins:  # logged once; the pin loop keeps retrying
                    self._refused_pins.add(entry.uid)
                    log.warning("lorafleet worker %s: pin of %s refused (kept trying each %.0f s): %r",
                                self.replica_id, name, PIN_RETRY_INTERVAL_S, exc)
