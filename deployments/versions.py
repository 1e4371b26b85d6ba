"""Versioned rollout: add a version of an adapter name, shift traffic to it, retire the old one.

A version is its own registry entry (``name@label``) with its own uid, so pools, KV and
every cache keep the versions apart. Before a version first gets traffic it is pre-warmed:
read into the host tier of every replica that holds a serving version, and loaded into a
slot on those where one is resident (at least one replica). A version whose traffic drops
to 0% is retired after a grace period, long enough for requests already sent to it to
arrive: its entry goes, and each worker drains its requests and unloads it.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from engine.errors import AdapterExistsError
from engine.request import ReplicaTarget
from pool.errors import AdapterNotFoundError
from routing.identity import mint_uid

from .config import AdapterSpec
from .fleet_admin import FleetAdmin
from .registry import RegistryEntry
from .traffic_split import check_label, check_split, families, label_of, version_entry_name, weights

RETIRE_GRACE_S = 3.0


class VersionedFleetAdmin(FleetAdmin):
    """FleetAdmin that also knows adapter names with several versions."""

    def family(self, name: str) -> list[RegistryEntry]:
        return families(self.registry.entries.values()).get(name, [])

    def _family_or_404(self, name: str) -> list[RegistryEntry]:
        family = self.family(name)
        if not family:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return family

    async def register(self, spec: AdapterSpec) -> dict:
        if any(e.version_of == spec.name for e in self.registry.entries.values()):
            raise AdapterExistsError(f"adapter {spec.name!r} is registered with versions; add one with "
                                     f"POST /v1/adapters/{spec.name}/versions")
        return await super().register(spec)

    async def unregister(self, name: str) -> dict:
        """Remove the name and every version of it."""
        await self.registry.refresh()
        family = self.family(name)
        if len(family) <= 1:
            return await super().unregister(family[0].name if family else name)
        for entry in family:
            await self.directory.remove_adapter.remote(entry.name)
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
        """Pre-warm versions about to get their first traffic, publish the split, retire those now at 0%."""
        await self.registry.refresh()
        family = self._family_or_404(name)
        new = check_split(split, family)
        old = weights(family)
        by_label = {label_of(e): e for e in family}
        starting = [label for label in new if new[label] > 0 and old[label] == 0]
        prewarmed = {label: await self.prewarm(by_label[label], [e for e in family if old[label_of(e)] > 0])
                     for label in starting}
        # raise before lowering, so no moment has every version at 0%
        for label in sorted(new, key=lambda lb: new[lb] - old[lb], reverse=True):
            entry = by_label[label]
            if entry.traffic != new[label]:
                await self.directory.put_adapter.remote({**entry.to_dict(), "traffic": new[label]}, if_absent=False)
        await self.registry.refresh()
        retiring = [label for label in new if new[label] == 0 and old[label] > 0]
        if retiring:
            await asyncio.sleep(RETIRE_GRACE_S)
            for label in retiring:
                await self.directory.remove_adapter.remote(by_label[label].name)
            await self.registry.refresh()
        return {"name": name, "traffic": new, "prewarmed": prewarmed, "retired": retiring}

    async def prewarm(self, entry: RegistryEntry, serving: list[RegistryEntry]) -> dict[str, str]:
        """Host tier where a serving version is held, a slot where one is resident (at least one replica)."""
        replicas = (await self.directory.view.remote())["replicas"]
        old_uids = {e.uid for e in serving}
        holders = sorted(r for r, s in replicas.items()
                         if old_uids & (set(s["resident"]) | set(s["host_cached"]) | set(s["loading"])))
        slots = [r for r in holders if old_uids & set(replicas[r]["resident"])]
        if not slots:
            slots = (holders or sorted(replicas))[:1]
        targets = sorted(set(holders) | set(slots))
        results = await asyncio.gather(*(
            self.worker.prewarm_adapter.remote(ReplicaTarget(r), entry.name, r in slots) for r in targets))
        return {r: "slot" if res["resident"] else "host" for r, res in zip(targets, results)}

    async def set_quota(self, name: str, max_concurrency: Optional[int], requests_per_s: Optional[float]) -> dict:
        """The name's quota, written on every entry of the name (each ingress reads it from the registry)."""
        await self.registry.refresh()
        family = self._family_or_404(name)
        for entry in family:
            await self.directory.put_adapter.remote(
                {**entry.to_dict(), "max_concurrency": max_concurrency, "requests_per_s": requests_per_s},
                if_absent=False)
        await self.registry.refresh()
        return {"name": name, "max_concurrency": max_concurrency, "requests_per_s": requests_per_s}
