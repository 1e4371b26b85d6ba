"""Fleet-wide adapter administration: register, unregister, pin, unpin, list.

A registration is validated on a worker (the real shapes and limits), then published
through the directory, whose registry every worker and ingress follows.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from engine.errors import AdapterExistsError
from pool.errors import AdapterNotFoundError, PinRefusedError
from routing.identity import mint_uid
from routing.pins import overfull_pin_replica, pin_holders

from .config import AdapterSpec, AppArgs
from .registry import RegistryEntry, RegistryFollower

MISS_REFRESH_INTERVAL_S = 0.5


def not_registered(name: str) -> AdapterNotFoundError:
    return AdapterNotFoundError(f"adapter {name!r} is not registered")


class FleetAdmin:
    def __init__(self, worker, directory, registry: RegistryFollower, args: AppArgs):
        self.worker = worker
        self.directory = directory
        self.registry = registry
        self.args = args
        self.slots = args.max_loras_per_batch
        self.pin_replicas = args.pin_replicas
        self._refreshing: Optional[asyncio.Future] = None
        self._refreshed_at = float("-inf")

    def entry(self, name: str) -> RegistryEntry:
        entry = self.registry.entries.get(name)
        if entry is None:
            raise not_registered(name)
        return entry

    async def check_registered(self, name: Optional[str]) -> None:
        """404 for an unknown adapter without a directory call per request.

        The registry follows the directory's long poll; a miss only triggers a refresh when none
        ran in the last ``MISS_REFRESH_INTERVAL_S`` (concurrent misses share one), so a flood of
        bogus names costs the directory at most a few calls a second.
        """
        if name is None or name in self.registry.entries:
            return
        await self.refresh_after_miss()
        self.entry(name)

    def refresh_due(self) -> bool:
        """Whether a miss now would refresh the registry copy (or wait for a refresh under way): until then a
        miss is answered from the copy alone, which the ingress's model guard relies on to answer early."""
        return self._refreshing is not None or time.monotonic() - self._refreshed_at >= MISS_REFRESH_INTERVAL_S

    async def refresh_after_miss(self) -> None:
        """Refresh the registry copy, at most once per ``MISS_REFRESH_INTERVAL_S`` (concurrent callers share one)."""
        if self._refreshing is not None:
            await asyncio.shield(self._refreshing)
            return
        if time.monotonic() - self._refreshed_at < MISS_REFRESH_INTERVAL_S:
            return
        self._refreshing = asyncio.ensure_future(self.registry.refresh())
        try:
            await asyncio.shield(self._refreshing)
        finally:
            self._refreshing = None
            self._refreshed_at = time.monotonic()

    async def register(self, spec: AdapterSpec, expires_after_s: Optional[float] = None,
                       missing_ok: bool = False) -> dict:
        """Validate on a worker, then publish; ``expires_after_s`` gives the entry a ``retire_at`` (resolvers).
        ``missing_ok`` (resolvers): the worker answers a missing source instead of raising it (no traceback
        there); it is raised here all the same."""
        current = self.registry.entries.get(spec.name)
        if current is not None and (current.source, current.revision) != (spec.source, spec.revision):
            # this replica's copy may be a moment old: another ingress replica may have just unregistered the name
            # (an unregister then a register, each sent to a different replica, was refused with a 409)
            await self.registry.refresh()
            current = self.registry.entries.get(spec.name)
        if current is not None:
            if (current.source, current.revision) == (spec.source, spec.revision):
                return await self._update_pin_policy(current, spec)
            raise AdapterExistsError(f"adapter {spec.name!r} is already registered from {current.source!r}; "
                                     f"unregister it first")
        replicas = spec.replicas or self.pin_replicas
        if spec.pinned:
            self.check_pin_capacity(spec.name, replicas)
        uid = mint_uid(spec.name)
        facts = await self.worker.validate_adapter.remote(spec.name, spec.source, spec.revision, uid, missing_ok)
        if "missing" in facts:
            raise AdapterNotFoundError(facts["missing"])
        entry = RegistryEntry(name=spec.name, uid=uid, source=spec.source, revision=spec.revision,
                              pinned=spec.pinned, replicas=replicas, rank=facts["rank"], content=facts.get("content"),
                              retire_at=None if expires_after_s is None else time.time() + expires_after_s)
        stored = await self.directory.put_adapter.remote(entry.to_dict())
        await self.registry.refresh()
        if stored["uid"] != uid:
            raise AdapterExistsError(f"adapter {spec.name!r} was registered concurrently from {stored['source']!r}")
        return stored

    async def _update_pin_policy(self, current: RegistryEntry, spec: AdapterSpec) -> dict:
        """Re-registering the same source is idempotent, and updates ``pinned``/``replicas`` when they differ."""
        replicas = spec.replicas or current.replicas
        if (spec.pinned, replicas) == (current.pinned, current.replicas):
            return current.to_dict()
        if spec.pinned:
            self.check_pin_capacity(spec.name, replicas)
        result = await self.directory.set_pinned.remote(spec.name, spec.pinned, replicas)
        await self.registry.refresh()
        return result

    async def unregister(self, name: str) -> dict:
        await self.registry.refresh()
        current = self.registry.entries.get(name)
        # the entry this ingress knows: a registration made meanwhile under the name is not removed (409)
        removed = await self.directory.remove_adapter.remote(name, current.generation if current else None)
        self.registry.entries.pop(name, None)  # refuse new requests here at once
        return {"name": name, "uid": removed["uid"], "status": "unregistered"}

    async def pin(self, name: str, replicas: Optional[int] = None) -> dict:
        entry = self.entry(name)
        replicas = replicas or entry.replicas
        self.check_pin_capacity(name, replicas)
        result = await self.directory.set_pinned.remote(name, True, replicas)
        await self.registry.refresh()
        return result

    async def unpin(self, name: str) -> dict:
        self.entry(name)
        result = await self.directory.set_pinned.remote(name, False)
        await self.registry.refresh()
        return result

    def check_pin_capacity(self, name: str, replicas: int) -> None:
        """Refuse a pin that would leave some replica with no unpinned slot (each pool's guard)."""
        others = [(e.name, e.replicas) for e in self.registry.entries.values() if e.pinned and e.name != name]
        full = overfull_pin_replica(name, replicas, others, self.registry.replicas, self.slots)
        if full is not None:
            replica, pinned = full
            raise PinRefusedError(f"cannot pin {name!r}: replica {replica} already pins {pinned} of its {self.slots} "
                                  f"slots and at least one slot must stay unpinned")

    async def describe(self) -> dict:
        """Registry entries with residency, pins, loads and evictions per adapter, and each replica's pool."""
        await self.registry.refresh()
        view = await self.directory.view.remote()
        counts = await self.directory.adapter_counts.remote()
        plan = await self.directory.placement_plan.remote()
        replicas = view["replicas"]
        data = []
        for entry in self.registry.entries.values():
            resident = sorted(r for r, s in replicas.items() if entry.uid in s["resident"])
            pinned_on = sorted(r for r, s in replicas.items() if entry.uid in s["pinned"])
            c = counts.get(entry.uid, {})
            desired = pin_holders(entry.name, sorted(replicas), entry.replicas) if entry.pinned else []
            data.append({**entry.to_dict(), "object": "adapter", "resident_on": resident, "pinned_on": pinned_on,
                         "pinned_desired": sorted(desired), "loads": c.get("load", 0),
                         "evictions": c.get("evict", 0), "planned_on": plan["holders"].get(entry.name, []),
                         "plan_moves": plan["moves"].get(entry.name, 0)})
        data.sort(key=lambda d: d["name"])
        summary = {r: {k: s[k] for k in ("slots", "free_slots", "resident", "pinned", "queue_len", "seq")}
                   for r, s in replicas.items()}
        return {"object": "list", "data": data, "replicas": summary,
                "plan": {"version": plan["version"], "busy": plan["busy"], "moves": plan["moves_total"]}}
