"""Versioned rollout: add a version of an adapter name, shift traffic to it, retire the old one.

A version is its own registry entry (``name@label``) with its own uid, so pools, KV and
every cache keep the versions apart. Before a version first gets traffic it is pre-warmed:
read into the host tier of every live replica that holds a serving version, and loaded into
a slot on those where one is resident (at least one replica), bounded by
``prewarm_timeout_s``: the PUT returns with what was warmed and names what was not.
A version whose traffic drops to 0% gets a ``retire_at`` one grace period ahead (by default
``request_timeout_s``: by then every request that drew it has finished or timed out) and the
directory removes it then; each worker drains its requests and unloads it. Every write is a
compare-and-set on the entries' generations, so two concurrent splits cannot both apply.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from engine.errors import AdapterExistsError
from engine.request import ReplicaTarget
from pool.errors import AdapterNotFoundError
from routing.identity import mint_uid

from .config import AdapterSpec
from .fleet_admin import FleetAdmin
from .registry import RegistryEntry
from .traffic_split import check_label, check_split, families, label_of, version_entry_name, weights

class VersionedFleetAdmin(FleetAdmin):
    """FleetAdmin that also knows adapter names with several versions."""

    def family(self, name: str) -> list[RegistryEntry]:
        return families(self.registry.entries.values()).get(name, [])

    def _family_or_404(self, name: str) -> list[RegistryEntry]:
        family = self.family(name)
        if not family:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return family

    async def register(self, spec: AdapterSpec, expires_after_s: Optional[float] = None) -> dict:
        if any(e.version_of == spec.name for e in self.registry.entries.values()):
            raise AdapterExistsError(f"adapter {spec.name!r} is registered with versions; add one with "
                                     f"POST /v1/adapters/{spec.name}/versions")
        return await super().register(spec, expires_after_s)

    async def unregister(self, name: str) -> dict:
        """Remove the name and every version of it (at once, and only as read: 409 if it changed)."""
        await self.registry.refresh()
        family = self.family(name)
        if len(family) <= 1:
            return await super().unregister(family[0].name if family else name)
        await self.directory.write_entries.remote([], {e.name: e.generation for e in family},
                                                  tuple(e.name for e in family))
        for entry in family:
            self.registry.entries.pop(entry.name, None)
        return {"name": name, "uid": [e.uid for e in family], "status": "unregistered"}

    async def add_version(self, name: str, label: str, source: str, revision: Optional[str] = None) -> dict:
        """Validate the version on a worker and register it with 0% traffic."""
        await self.registry.refresh()
        family = self._family_or_404(name)
        check_label(label, family)
        entry_name = version_entry_name(name, label)
        uid = mint_uid(entry_name)
        facts = await self.worker.validate_adapter.remote(entry_name, source, revision, uid)
        first = family[0]
        entry = RegistryEntry(name=entry_name, uid=uid, source=source, revision=revision, rank=facts["rank"],
                              version=label, version_of=name, traffic=0, max_concurrency=first.max_concurrency,
                              requests_per_s=first.requests_per_s)
        stored = await self.directory.put_adapter.remote(entry.to_dict())
        await self.registry.refresh()
        if stored["uid"] != uid:
            raise AdapterExistsError(f"adapter {name!r} got a version {label!r} concurrently")
        return stored

    async def set_traffic(self, name: str, split: dict[str, int]) -> dict:
        """Pre-warm versions about to get their first traffic, then publish the split in one
        compare-and-set write (409 if the family changed meanwhile); versions now at 0% retire later."""
        await self.registry.refresh()
        family = self._family_or_404(name)
        new = check_split(split, family)
        old = weights(family)
        by_label = {label_of(e): e for e in family}
        starting = [label for label in new if new[label] > 0 and old[label] == 0]
        serving = [e for e in family if old[label_of(e)] > 0]
        warmed = await asyncio.gather(*(self.prewarm(by_label[label], serving) for label in starting))
        retire_at = time.time() + self.retire_grace_s
        updates, retiring = [], []
        for label, entry in by_label.items():
            if new[label] == 0 and old[label] > 0:
                retiring.append(label)
            due = entry.retire_at if new[label] == 0 and old[label] == 0 else None
            when = retire_at if label in retiring else due
            if entry.traffic != new[label] or entry.retire_at != when:
                updates.append({**entry.to_dict(), "traffic": new[label], "retire_at": when})
        if updates:  # one write: no moment has every version at 0%, and a concurrent split gets a 409
            await self.directory.write_entries.remote(updates, {e.name: e.generation for e in family})
        await self.registry.refresh()
        return {"name": name, "traffic": new, "prewarmed": dict(zip(starting, warmed)), "retired": retiring,
                "retire_in_s": self.retire_grace_s if retiring else None}

    @property
    def retire_grace_s(self) -> float:
        return self.args.version_retire_grace_s if self.args.version_retire_grace_s is not None \
            else self.args.request_timeout_s

    async def prewarm(self, entry: RegistryEntry, serving: list[RegistryEntry]) -> dict[str, str]:
        """Host tier where a serving version is held, a slot where one is resident (at least one replica);
        live replicas only (in the directory's current view), each bounded by ``prewarm_timeout_s``.
        Returns replica -> "slot" | "host" | "timeout" | "failed: <error>"."""
        replicas = (await self.directory.view.remote())["replicas"]
        live = set(self.registry.replicas) & set(replicas) or set(replicas)
        old_uids = {e.uid for e in serving}
        holders = sorted(r for r in live if old_uids & (set(replicas[r]["resident"]) |
                                                        set(replicas[r]["host_cached"]) | set(replicas[r]["loading"])))
        slots = [r for r in holders if old_uids & set(replicas[r]["resident"])]
        if not slots:
            slots = (holders or sorted(live))[:1]
        targets = sorted(set(holders) | set(slots))
        calls = {r: self.worker.prewarm_adapter.remote(ReplicaTarget(r), entry.name, r in slots) for r in targets}
        tasks = {r: asyncio.ensure_future(_awaited(call)) for r, call in calls.items()}
        if tasks:
            await asyncio.wait(tasks.values(), timeout=self.args.prewarm_timeout_s)
        outcome: dict[str, str] = {}
        for r, task in tasks.items():
            if not task.done():
                task.cancel()
                calls[r].cancel()   # a replica that is gone or stuck: stop waiting, stop the work
                outcome[r] = "timeout"
            elif task.exception() is not None:
                outcome[r] = f"failed: {type(task.exception()).__name__}"
            else:
                outcome[r] = "slot" if task.result()["resident"] else "host"
        return outcome

    async def set_quota(self, name: str, max_concurrency: Optional[int], requests_per_s: Optional[float]) -> dict:
        """The name's quota, written on every entry of the name at once (each ingress reads it from the registry)."""
        await self.registry.refresh()
        family = self._family_or_404(name)
        await self.directory.write_entries.remote(
            [{**e.to_dict(), "max_concurrency": max_concurrency, "requests_per_s": requests_per_s} for e in family],
            {e.name: e.generation for e in family})
        await self.registry.refresh()
        return {"name": name, "max_concurrency": max_concurrency, "requests_per_s": requests_per_s}


async def _awaited(response):
    return await response
