"""Where the directory places adapters, as one worker replica follows it: the warm start, the placement
plan's read-ahead, and the adapters that fall to this replica when others leave.

Why apart from the deployment: following placement is background work with its own state (the
plan's version, what it places here, a read-ahead queue); requests never wait on it, and a
request still loads whatever it needs when the plan was not followed in time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from engine.engine import LoRAEngine
from routing.prefetch import Prefetch, prefetches
from routing.warm_start import standby_names

from .registry import RegistryFollower
from .worker_adapters import PIN_RETRY_INTERVAL_S, WorkerAdapters

log = logging.getLogger("ray.serve")


class PlanFollower:
    def __init__(self, adapters: WorkerAdapters, directory, follow: Callable[[], bool], standby_share: float = 0.0):
        """``follow``: whether this replica keeps and reads ahead what the plan gives it (``replicas_follow_plan``,
        read at each plan change, so a benchmark can switch it on a running replica). ``standby_share``: the
        share of the host tier the standby copies may fill (``AppArgs.host_standby_share``; 0: none)."""
        self.adapters = adapters
        self.engine: LoRAEngine = adapters.engine
        self.registry: RegistryFollower = adapters.registry
        self.replica_id = adapters.replica_id
        self.directory = directory
        self.follow = follow
        self.version = -1                # the placement plan this replica last heard of (the directory's reply)
        self.ready = False               # warm start over: the plan's read-ahead may begin
        self._planned: set[str] = set()  # adapter names that plan places here
        self._queue: list[Prefetch] = []
        self._prefetching: Optional[asyncio.Task] = None
        self.prefetched = 0              # adapters read ahead for the plan (lorafleet_plan_prefetches_total)
        self.standby_share = standby_share
        self.standby_staged = 0          # standby copies read into the host tier (lorafleet_standby_stages_total)
        self._standby_for: Optional[tuple] = None  # the (names, replicas) the last full standby pass covered

    async def warm_start(self, slots: int) -> dict:
        """Load what the directory says this replica should hold before traffic (pins, hot adapters whose
        next copy belongs here): ``slots`` of them into slots, the rest into the host tier."""
        await self.registry.refresh()
        plan = await self.directory.warm_start_plan.remote(self.replica_id, slots, slots)
        await self.adapters.apply_pins()  # the plan's pins: the same rule, over the same replica set
        for name in plan["slots"]:
            if name not in plan["pins"] and name in self.registry.entries:
                await self.adapters.prewarm(self.registry.entries[name], into_slot=True)
        for name in plan["host"]:
            if name in self.registry.entries:
                await self.adapters.ensure_entry(self.registry.entries[name])
        return plan

    def changed(self, plan: dict) -> None:
        """The plan moved: the pool evicts last the adapters it gives a slot here (``kept``: the others
        planned here load on demand into the rest), and what it newly places here is read ahead
        (``routing.prefetch``), one at a time, in the background; generation never waits on it."""
        entries = self.registry.entries
        planned = [name for name in plan["planned"] if name in entries]
        kept = [name for name in plan.get("kept", plan["planned"]) if name in entries]
        self.version = plan["version"]
        follow = self.follow()
        self.engine.keep_adapters([entries[n].uid for n in kept] if follow else ())
        if follow and self.ready:
            uid = lambda name: entries[name].uid  # noqa: E731
            todo = prefetches(planned, self._planned,
                              resident={n for n in planned if self.engine.is_resident(uid(n))},
                              staged={n for n in planned
                                      if self.engine.host_cached(uid(n)) or uid(n) in self.adapters.loading},
                              free_slots=self.engine.pool_snapshot().free_slots)
            self._queue += todo
            if todo and (self._prefetching is None or self._prefetching.done()):
                self._prefetching = asyncio.get_running_loop().create_task(self._prefetch())
        self._planned = set(planned)

    async def _prefetch(self) -> None:
        while self._queue:
            item = self._queue.pop(0)
            if item.name not in self._planned or item.name not in self.registry.entries:
                continue  # the plan moved on, or the adapter left
            try:
                await self.adapters.prewarm(self.registry.entries[item.name],
                                            item.into_slot and self.engine.pool_snapshot().free_slots > 0)
                self.prefetched += 1
            except Exception as exc:  # best effort: a request still loads what it needs
                log.warning("lorafleet worker %s: prefetch of %s failed (%r)", self.replica_id, item.name, exc)

    async def departures_loop(self) -> None:
        """Replicas that left the registry's replica list: read what they held that now falls here; and keep the
        standby copies (``stage_standby``) as registrations and the replica set change."""
        known = set(self.registry.replicas)
        while True:
            await asyncio.sleep(PIN_RETRY_INTERVAL_S)
            now_known = set(self.registry.replicas)
            if known - now_known:
                await self._prefetch_departed()
            known = now_known
            if self.ready:
                await self.stage_standby()

    async def stage_standby(self) -> int:
        """Read into the host tier the registered adapters whose rendezvous order starts here
        (``routing.warm_start.standby_names``): while no replica holds one and the plan places it nowhere, a router
        sends its requests here, which then copy it into a slot instead of reading a file on their time to first
        token.

        Only while the host tier is under ``standby_share`` of its budget (a standby copy never pushes out one
        that serves traffic) and only where this replica follows the plan. One pass per change of the
        registered names or the replica set; returns how many it read."""
        if not self.follow() or self.standby_share <= 0:
            return 0
        entries = self.registry.entries
        key = (frozenset(entries), frozenset(self.registry.replicas))
        if key == self._standby_for:
            return 0
        staged, complete = 0, True
        for name in standby_names(self.replica_id, self.registry.replicas, entries):
            entry = self.registry.entries.get(name)
            if entry is None:
                continue  # retired meanwhile
            uid = entry.uid
            if self.engine.is_resident(uid) or self.engine.host_cached(uid) or uid in self.adapters.loading:
                continue
            used, budget = self.engine.host_tier_bytes()
            if used >= self.standby_share * budget:
                complete = False  # full for now: the next change of names or replicas tries again
                break
            try:
                await self.adapters.ensure_entry(entry)
                staged += 1
            except Exception as exc:  # best effort: a request still loads what it needs
                log.warning("lorafleet worker %s: standby copy of %s failed (%r)", self.replica_id, name, exc)
        self._standby_for = key if complete else None
        self.standby_staged += staged
        return staged

    async def _prefetch_departed(self) -> None:
        """Read the adapters departed replicas held that now fall to this replica into the host tier."""
        try:
            names = await self.directory.rehome_plan.remote(self.replica_id)
            for name in names:
                if name in self.registry.entries:
                    await self.adapters.ensure_entry(self.registry.entries[name])
        except Exception as exc:  # best effort: a request still loads what it needs
            log.warning("lorafleet worker %s: prefetch after a scale-down failed (%r)", self.replica_id, exc)
