"""The AdapterDirectory as a Ray Serve deployment (one replica per application).

Serve owns its life: it is created with the application, restarted if it dies, and
removed by ``serve shutdown``. Its view is soft state that the workers rebuild within a
heartbeat; the adapter registry is not, so every change is written to Ray's GCS
key-value store and read back when the directory starts again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import Optional

from ray import serve

from pool.errors import AdapterNotFoundError
from routing.directory import AdapterDirectory
from routing.plan import planned_on
from routing.settings import RoutingSettings
from routing.wait_exchange import EXPIRY_INTERVALS, WaitBoard
from routing.warm_start import AdapterPlacement, rehome_targets, warm_start_plan

from .metrics import DirectoryMetrics
from .registry import RegistryConflictError, RegistryEntry, RegistryWriteError

log = logging.getLogger("ray.serve")
KV_NAMESPACE = "lorafleet"
DEPARTED_MEMORY_S = 60.0  # how long a departed replica's adapters are offered to survivors
# How often a stopping directory looks whether its ongoing requests are done (Serve's default is 2 s). Its
# callers withdraw their long polls when they stop, the moment their own 2 s drain ends; checking as rarely as
# they drain made it wait one more period (an app's delete took 4 s instead of 2).
DRAIN_CHECK_S = 0.25


class _Versioned:
    """A version counter plus an event to wake long polls when it moves."""

    def __init__(self) -> None:
        self.version = 0
        self.waiting = 0  # long polls waiting here now (each is an ongoing request Serve waits for when stopping)
        self._changed = asyncio.Event()

    def bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_past(self, version: int, timeout_s: float, current) -> None:
        if current() > version or timeout_s <= 0:
            return
        event = self._changed
        self.waiting += 1
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self.waiting -= 1


@serve.deployment(name="AdapterDirectory", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=DRAIN_CHECK_S,
                  logging_config={"enable_access_log": False})  # reports arrive every few ms
class AdapterDirectoryActor:
    def __init__(self, routing: Optional[dict] = None):
        """``routing``: the app's routing settings that differ from the defaults (the plan's among them); the
        directory's replica timeout is its one default, in routing/directory.py."""
        self.settings = RoutingSettings.from_mapping(routing)
        self.directory = AdapterDirectory(settings=self.settings)
        self.epoch = uuid.uuid4().hex  # routers start over when the directory restarts
        self.metrics = DirectoryMetrics()
        self._view_changes = _Versioned()
        self._registry_changes = _Versioned()
        self.waits = WaitBoard(expiry_s=EXPIRY_INTERVALS * self.settings.wait_exchange_interval_s)
        self._app = serve.get_replica_context().app_name
        self._departed: dict[str, tuple[float, list[str]]] = {}  # replica -> (when, uids it held in slots)
        self.registry: dict[str, RegistryEntry] = self._load_registry()
        self._registry_changes.version = 1
        self._expiry = asyncio.get_event_loop().create_task(self._expire_loop())

    # ------------------------------------------------------------------ registry (persisted)

    def _kv_key(self) -> bytes:
        return f"registry:{self._app}".encode()

    def _load_registry(self) -> dict[str, RegistryEntry]:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(self._kv_key(), namespace=KV_NAMESPACE)
        if not raw:
            return {}
        entries = json.loads(raw)
        log.info("lorafleet directory: restored %d registry entries from GCS", len(entries))
        return {e["name"]: RegistryEntry.from_dict(e) for e in entries}

    def _commit_registry(self, registry: dict[str, RegistryEntry]) -> None:
        """Write ``registry`` to the GCS store first; only once it is durable does it take effect.

        A failed write raises ``RegistryWriteError`` (503) and leaves the registry as it was, so an
        acknowledged change is never lost to a directory restart.
        """
        from ray.experimental.internal_kv import _internal_kv_put

        data = json.dumps([e.to_dict() for e in registry.values()]).encode()
        try:
            _internal_kv_put(self._kv_key(), data, overwrite=True, namespace=KV_NAMESPACE)
        except Exception as exc:  # the GCS is unreachable or refused the write
            raise RegistryWriteError(f"the adapter registry could not be saved ({type(exc).__name__}); "
                                     f"nothing was changed, retry") from None
        self.registry = registry
        self._registry_changes.bump()

    def _stamped(self, entry: RegistryEntry) -> RegistryEntry:
        """The entry as written now: one generation past what the registry holds for its name."""
        current = self.registry.get(entry.name)
        return dataclasses.replace(entry, generation=(current.generation if current else 0) + 1)

    # Registry writes are coroutines so they run one at a time on this actor's event loop: Serve runs a
    # plain method in a thread pool, where two concurrent registrations each wrote the registry they had
    # read and one of them was lost.

    async def put_adapter(self, entry: dict, *, if_absent: bool = True) -> dict:
        """Add an entry; with ``if_absent`` an existing name is returned unchanged (first one wins)."""
        new = RegistryEntry.from_dict(entry)
        current = self.registry.get(new.name)
        if current is not None and if_absent:
            return current.to_dict()
        new = self._stamped(new)
        self._commit_registry({**self.registry, new.name: new})
        return new.to_dict()

    async def write_entries(self, updates: list[dict], expected: dict[str, int], remove: tuple[str, ...] = ()) -> list[dict]:
        """Compare-and-set: apply ``updates`` and ``remove`` at once, only if every name in ``expected``
        is still at that generation (else ``RegistryConflictError``, 409, and nothing changes)."""
        for name, generation in expected.items():
            current = self.registry.get(name)
            if current is None or current.generation != generation:
                now = "removed" if current is None else f"at generation {current.generation}"
                raise RegistryConflictError(f"adapter entry {name!r} changed meanwhile (expected generation "
                                            f"{generation}, now {now}); re-read and retry")
        written = [self._stamped(RegistryEntry.from_dict(d)) for d in updates]
        registry = {n: e for n, e in self.registry.items() if n not in remove}
        registry.update({e.name: e for e in written})
        self._commit_registry(registry)
        return [e.to_dict() for e in written]

    async def remove_adapter(self, name: str, expected_generation: Optional[int] = None) -> dict:
        entry = self.registry.get(name)
        if entry is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        if expected_generation is not None and entry.generation != expected_generation:
            raise RegistryConflictError(f"adapter {name!r} changed meanwhile; re-read and retry")
        self._commit_registry({n: e for n, e in self.registry.items() if n != name})
        return entry.to_dict()

    async def set_pinned(self, name: str, pinned: bool, replicas: Optional[int] = None) -> dict:
        entry = self.registry.get(name)
        if entry is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        changed = self._stamped(dataclasses.replace(
            entry, pinned=pinned, replicas=entry.replicas if replicas is None else replicas))
        self._commit_registry({**self.registry, name: changed})
        return changed.to_dict()

    def _retire_due_versions(self) -> None:
        """Remove 0% versions whose ``retire_at`` passed (no request can still hold them: see versions.py)."""
        now = time.time()
        due = [n for n, e in self.registry.items() if e.retire_at is not None and e.retire_at <= now]
        if due:
            try:
                self._commit_registry({n: e for n, e in self.registry.items() if n not in due})
                log.info("lorafleet directory: retired versions %s", due)
            except RegistryWriteError as exc:  # tried again next second
                log.warning("lorafleet directory: retiring %s failed (%s)", due, exc)

    async def get_registry(self, since_version: int = -1, timeout_s: float = 0.0) -> dict:
        """Long poll: returns at once if the registry moved past ``since_version``."""
        await self._registry_changes.wait_past(since_version, timeout_s, lambda: self._registry_changes.version)
        return {
            "version": self._registry_changes.version,
            "entries": [e.to_dict() for e in self.registry.values()],
            "replicas": sorted(self.directory.replicas),
        }

    # ------------------------------------------------------------------ view (soft state)

    async def report(self, replica_id: str, events: list[dict], heartbeat: dict,
                     snapshot: Optional[dict] = None) -> dict:
        """A worker's batched events, its heartbeat and (when asked for) a full snapshot.

        ``async`` on purpose: Serve runs a plain method on a thread pool (a thread hop and
        handoff per call, several times the work of applying the events); this one never blocks.
        """
        before = self.directory.version
        new_replica = replica_id not in self.directory.replicas
        if snapshot is not None:
            self.directory.apply_snapshot(snapshot, **heartbeat)
        ok = self.directory.apply_events(replica_id, events)
        self.directory.heartbeat(replica_id, **heartbeat)
        if self.directory.version != before:
            self._view_changes.bump()
        if new_replica:
            self._registry_changes.bump()  # pin placement depends on the replica set
        reply: dict = {"resync": not ok}
        plan = self.directory.plan
        if heartbeat.get("plan_version", plan.version) != plan.version:  # the worker prefetches new placements
            reply["plan"] = {"version": plan.version, "planned": planned_on(plan, replica_id),
                             "kept": list(plan.slotted.get(replica_id, ()))}
        return reply

    async def get_changes(self, since_version: int = -1, timeout_s: float = 0.0, plan_version: int = -1) -> dict:
        """Long poll for routers: replica states changed after ``since_version``, and the placement
        plan when its version is not ``plan_version`` (it changes rarely: hysteresis)."""
        if self.directory.plan.version == plan_version:
            await self._view_changes.wait_past(since_version, timeout_s, lambda: self.directory.version)
        version, changes = self.directory.changes_since(since_version)
        reply = {"epoch": self.epoch, "version": version}
        if changes is None:
            reply["full"] = self.directory.full_view()
        else:
            reply["changes"] = changes
        if self.directory.plan.version != plan_version:
            reply["plan"] = self.directory.plan.to_dict()
        return reply

    async def exchange_waits(self, router_id: str, ages: dict) -> dict:
        """A router's oldest wait per replica in, the other routers' out (``routing.wait_exchange``)."""
        return self.waits.exchange(router_id, ages)

    async def placement_plan(self) -> dict:
        """The current placement plan (``routing.plan``) and the demand it follows."""
        return {**self.directory.plan.to_dict(),
                "demand": {n: round(self.directory.demand.get(n), 4) for n in self.directory.demand.names()},
                "moves": dict(self.directory.plan_moves), "moves_total": self.directory.plan_moves_total}

    async def view(self) -> dict:
        """The replicas' states, and how many long polls wait here now (routers' and registry followers'):
        callers withdraw theirs when they stop, else a stopping directory waits them out."""
        return {"version": self.directory.version, "replicas": self.directory.full_view(),
                "events_applied": self.directory.events_applied,
                "long_polls": self._view_changes.waiting + self._registry_changes.waiting}

    async def adapter_counts(self) -> dict:
        """uid -> {"load": n, "evict": n, ...} over the whole fleet since the directory started."""
        return {uid: dict(c) for uid, c in self.directory.adapter_counts.items()}

    async def forget_replica(self, replica_id: str) -> bool:
        """A replica leaves (its own goodbye on graceful shutdown, or a caller that knows it is gone)."""
        self._remember_departed([replica_id])
        forgotten = self.directory.forget_replica(replica_id)
        if forgotten:
            self._view_changes.bump()
            self._registry_changes.bump()
        return forgotten

    async def _expire_loop(self) -> None:
        """Once a second: metrics, forget silent replicas, re-plan placement."""
        while True:
            await asyncio.sleep(self.settings.plan_interval_s)
            self.metrics.update(self.directory)
            self._retire_due_versions()
            held = {r: sorted(s.resident) for r, s in self.directory.replicas.items()}
            expired = self.directory.expire()
            if expired:
                self._remember_departed(expired, held)
                self._view_changes.bump()
                self._registry_changes.bump()
            plan_version = self.directory.plan.version
            if self.directory.update_plan(registered=self.registry).version != plan_version:
                self._view_changes.bump()  # wakes every router's long poll with the new plan

    # ------------------------------------------------------------------ elastic fleet (warm start, scale-down)

    def _remember_departed(self, replica_ids: list[str], held: dict[str, list[str]] | None = None) -> None:
        """Keep what departing replicas held in slots for a minute, for ``rehome_plan``."""
        now = time.monotonic()
        self._departed = {r: v for r, v in self._departed.items() if now - v[0] < DEPARTED_MEMORY_S}
        for replica_id in replica_ids:
            state = self.directory.replicas.get(replica_id)
            uids = sorted(state.resident) if state is not None else (held or {}).get(replica_id)
            if uids is not None:
                self._departed[replica_id] = (now, uids)

    def _names_by_uid(self) -> dict[str, str]:
        return {e.uid: name for name, e in self.registry.items()}

    async def warm_start_plan(self, replica_id: str, slots: int, host_limit: int) -> dict:
        """What a replica joining the fleet should load before it takes traffic (routing/warm_start.py)."""
        placements = [AdapterPlacement(name, e.replicas if e.pinned else 0,
                                       len(self.directory.holders.get(e.uid, ())))
                      for name, e in self.registry.items()]
        planned = self.directory.planned_for(replica_id, slots) if self.directory.plan.holders else None
        plan = warm_start_plan(replica_id, list(self.directory.replicas), placements, slots, host_limit, planned)
        if plan.skipped_pins:
            log.warning("lorafleet directory: %s would pin %s beyond its %d slots - 1; not pinned there",
                        replica_id, list(plan.skipped_pins), slots)
        return plan.to_dict()

    async def rehome_plan(self, replica_id: str) -> list[str]:
        """The adapters that replicas which left in the last minute held and ``replica_id`` should prefetch."""
        now = time.monotonic()
        names = self._names_by_uid()
        departed = [names[uid] for r, (when, uids) in self._departed.items()
                    if now - when < DEPARTED_MEMORY_S and r not in self.directory.replicas
                    for uid in uids if uid in names]
        holders = {name: self.directory.holders.get(uid, ()) for uid, name in names.items()}
        return rehome_targets(departed, list(self.directory.replicas), holders).get(replica_id, [])

    def check_health(self) -> None:
        if self._expiry.done():
            raise RuntimeError("the directory's expiry loop stopped")
