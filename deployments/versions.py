"""Versioned rollout: add a version of an adapter name, shift traffic to it, retire the old one.

A version is its own registry entry (``name@label``) with its own uid, so pools, KV and
every cache keep the versions apart, but it is placed with its adapter (``routing.plan``: the
flip's traffic stays on the workers that had it). Before a version first gets traffic it is
pre-warmed: read into the host tier of every live replica that holds a serving version, and
loaded into a slot on those where one is resident or planned (at least one replica), bounded by
``prewarm_timeout_s``: the PUT returns with what was warmed and names what was not.
A version whose traffic drops to 0% gets a ``retire_at`` one grace period ahead (by default
``request_timeout_s``: by then every request that drew it has finished or timed out) and the
directory removes it then; each worker drains its requests and unloads it. Every write is a
compare-and-set on the entries' generations, so two concurrent splits cannot both apply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Optional

from engine.errors import AdapterExistsError
from pool.errors import AdapterNotFoundError
from routing.identity import mint_uid

from .config import AdapterSpec
from .fleet_admin import FleetAdmin
from .http_errors import unwrap
from .registry import RegistryConflictError, RegistryEntry
from .traffic_split import check_label, check_split, families, label_of, version_entry_name, weights

PREWARM_POLL_S = 0.2  # how often a traffic PUT reads the view while versions warm


class _ReadFirst(Exception):
    """A split starts a version: its pre-warm plans on the registry as read now, not on the copy."""


class VersionedFleetAdmin(FleetAdmin):
    """FleetAdmin that also knows adapter names with several versions."""

    def family(self, name: str) -> list[RegistryEntry]:
        return families(self.registry.entries.values()).get(name, [])

    def _family_or_404(self, name: str) -> list[RegistryEntry]:
        family = self.family(name)
        if not family:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return family

    async def register(self, spec: AdapterSpec, expires_after_s: Optional[float] = None,
                       missing_ok: bool = False) -> dict:
        if any(e.version_of == spec.name for e in self.registry.entries.values()):
            raise AdapterExistsError(f"adapter {spec.name!r} is registered with versions; add one with "
                                     f"POST /v1/adapters/{spec.name}/versions")
        return await super().register(spec, expires_after_s, missing_ok)

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
                              content=facts.get("content"),
                              version=label, version_of=name, traffic=0, max_concurrency=first.max_concurrency,
                              requests_per_s=first.requests_per_s)
        stored = await self.directory.put_adapter.remote(entry.to_dict())
        await self.registry.merge([stored])   # the entry as stored (ours, or a concurrent one): no re-read
        if stored["uid"] != uid:
            raise AdapterExistsError(f"adapter {name!r} got a version {label!r} concurrently")
        return stored

    async def set_traffic(self, name: str, split: dict[str, int]) -> dict:
        """Pre-warm versions about to get their first traffic, then publish the split in one
        compare-and-set write (409 if the family changed meanwhile); versions now at 0% retire later.

        A split that starts no version (10% -> 50% -> 100%) is computed from this ingress's registry
        copy and written in one directory call, whose result is applied to the copy: the write's
        compare-and-set on every entry of the name is the freshness check, so the read before it and
        the refresh after it were two more directory calls spent while traffic runs, on the CPU the
        requests in flight share (each call costs the ingress, its router thread and the directory). A
        copy found stale (a conflict, an unknown version) is refreshed and the split tried once more, as
        the read-first path would have seen it."""
        try:
            return await self._set_traffic(name, split, fresh=False)
        except Exception as exc:
            if not isinstance(unwrap(exc), (_ReadFirst, RegistryConflictError, AdapterNotFoundError)):
                raise   # (from the copy's attempt only: nothing was written, so trying again is safe)
        return await self._set_traffic(name, split, fresh=True)

    async def _set_traffic(self, name: str, split: dict[str, int], fresh: bool) -> dict:
        """One attempt; ``fresh``: read the registry first (always so when a version starts: pre-warm
        plans on the current family, and it takes seconds anyway)."""
        if fresh:
            await self.registry.refresh()
        family = self._family_or_404(name)
        new = check_split(split, family)
        old = weights(family)
        by_label = {label_of(e): e for e in family}
        starting = [label for label in new if new[label] > 0 and old[label] == 0]
        if starting and not fresh:
            raise _ReadFirst(name)
        serving = [e for e in family if old[label_of(e)] > 0]
        warmed = await asyncio.gather(*(self.prewarm(by_label[label], serving) for label in starting))
        generations = {e.name: e.generation for e in family}
        for label, (_, generation) in zip(starting, warmed):   # the plan's write, part of this CAS chain
            by_label[label] = dataclasses.replace(by_label[label], generation=generation, prewarm=None)
            generations[by_label[label].name] = generation
        retire_at = time.time() + self.retire_grace_s
        updates, retiring = [], []
        for label, entry in by_label.items():
            if new[label] == 0 and old[label] > 0:
                retiring.append(label)
            due = entry.retire_at if new[label] == 0 and old[label] == 0 else None
            when = retire_at if label in retiring else due
            if label in retiring and self.retire_grace_s == 0:
                continue   # removed by this very write (below)
            if entry.traffic != new[label] or entry.retire_at != when or label in starting:
                updates.append({**entry.to_dict(), "traffic": new[label], "retire_at": when})
        removed = tuple(by_label[label].name for label in retiring) if self.retire_grace_s == 0 else ()
        if updates or removed:  # one write: no moment has every version at 0%, and a concurrent split gets a 409
            written = await self.directory.write_entries.remote(updates, generations, removed)
            gone = {by_label[label].name: by_label[label].uid for label in retiring} if removed else {}
            await self.registry.merge(written, gone)  # this ingress reads its own write at once
        prewarmed = {label: outcome for label, (outcome, _) in zip(starting, warmed)}
        return {"name": name, "traffic": new, "prewarmed": prewarmed, "retired": retiring,
                "retire_in_s": self.retire_grace_s if retiring else None}

    @property
    def retire_grace_s(self) -> float:
        return self.args.version_retire_grace_s if self.args.version_retire_grace_s is not None \
            else self.args.request_timeout_s

    async def prewarm(self, entry: RegistryEntry, serving: list[RegistryEntry]) -> tuple[dict[str, str], int]:
        """Host tier where a serving version is held, a slot where one is resident or planned (at least one).

        The plan is written on the entry (compare-and-set) and each live replica it names warms the
        version itself when its registry follower sees it, so no call waits on a replica that is gone
        or on a router queue; this waits for the directory's view to show the result, at most
        ``prewarm_timeout_s``. Returns (replica -> "slot" | "host" | "timeout", the entry's new generation).
        """
        replicas = (await self.directory.view.remote())["replicas"]
        live = set(self.registry.replicas) & set(replicas) or set(replicas)
        old_uids = {e.uid for e in serving}
        holders = sorted(r for r in live if old_uids & (set(replicas[r]["resident"]) |
                                                        set(replicas[r]["host_cached"]) | set(replicas[r]["loading"])))
        slots = [r for r in holders if old_uids & set(replicas[r]["resident"])]
        # where the plan places the serving versions: the new one is planned there too and routers send it
        # there (routing.plan, routing.policy), so that is where its first requests must find it in a slot
        holders_of = (await self.directory.placement_plan.remote())["holders"]
        planned = {r for e in serving for r in holders_of.get(e.name, ()) if r in live}
        slots = sorted(set(slots) | planned)
        holders = sorted(set(holders) | planned)
        if not slots:
            slots = (holders or sorted(live))[:1]
        plan = {r: "slot" if r in slots else "host" for r in sorted(set(holders) | set(slots))}
        (written,) = await self.directory.write_entries.remote([{**entry.to_dict(), "prewarm": plan}],
                                                               {entry.name: entry.generation})
        return await self._wait_warm(entry.uid, plan), written["generation"]

    async def _wait_warm(self, uid: str, plan: dict[str, str]) -> dict[str, str]:
        deadline = time.monotonic() + self.args.prewarm_timeout_s
        outcome: dict[str, str] = {}
        while True:
            replicas = (await self.directory.view.remote())["replicas"]
            for r, want in plan.items():
                state = replicas.get(r, {})
                if uid in state.get("resident", ()):
                    outcome[r] = "slot"
                elif uid in state.get("host_cached", ()):
                    outcome[r] = "host"
            if all(outcome.get(r) == want or outcome.get(r) == "slot" for r, want in plan.items()) \
                    or time.monotonic() >= deadline:
                return {r: outcome.get(r, "timeout") for r in plan}
            await asyncio.sleep(PREWARM_POLL_S)

    async def set_quota(self, name: str, max_concurrency: Optional[int], requests_per_s: Optional[float]) -> dict:
        """The name's quota, written on every entry of the name at once (each ingress reads it from the registry)."""
        await self.registry.refresh()
        family = self._family_or_404(name)
        await self.directory.write_entries.remote(
            [{**e.to_dict(), "max_concurrency": max_concurrency, "requests_per_s": requests_per_s} for e in family],
            {e.name: e.generation for e in family})
        await self.registry.refresh()
        return {"name": name, "max_concurrency": max_concurrency, "requests_per_s": requests_per_s}
