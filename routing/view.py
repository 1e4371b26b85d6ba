"""A router's local view of the fleet: directory deltas, routing-stats snapshots, own decisions.

No Ray here, so the simulator and unit tests drive the same code. Three sources, merged:
- directory deltas (fast path, replica-granular states with a ``seq``);
- ``record_routing_stats`` snapshots from each replica (Serve-native; the newer ``seq`` wins,
  which repairs drift if deltas were lost);
- this router's own recent decisions ("I just sent X to k"), trusted for ``ttl_s`` (by then
  the replica's own report has confirmed or contradicted them).
"""

from __future__ import annotations

import copy
import time
from collections import ChainMap
from typing import Callable, Mapping, Optional

import numpy as np

from .identity import name_of
from .plan import PlacementPlan
from .policy import FleetView


class RouterView:
    def __init__(self, ttl_s: float = 3.0, clock: Callable[[], float] = time.monotonic):
        self.states: dict[str, Mapping] = {}   # replica id -> state dict (directory or routing stats)
        self.epoch: Optional[str] = None
        self.version = -1
        self.last_update = 0.0
        self.ttl_s = ttl_s
        self._clock = clock
        self._optimistic: dict[str, dict[str, float]] = {}  # name -> replica -> expiry
        self._generation = 0
        self._last_prune = float("-inf")
        self._reserved: dict[str, dict[str, float]] = {}  # replica -> adapters placed there, not yet reported
        self._cache_key: Optional[tuple] = None
        self._cache: Optional[FleetView] = None
        self._scores: dict = {}  # rendezvous scores and orders, kept across rebuilds for the same replicas
        self._scores_for: tuple[str, ...] = ()
        self.plan: Optional[PlacementPlan] = None  # the directory's placement plan (routing.plan)
        self._prefill_mean: tuple[int, Optional[float]] = (-1, None)  # (generation, mean measured prefill rate)

    @property
    def plan_version(self) -> int:
        return self.plan.version if self.plan is not None else -1

    # ------------------------------------------------------------------ inputs

    def apply_directory_reply(self, reply: Mapping) -> None:
        """A ``get_changes`` reply: deltas, or a full view (first poll, restart, or a log gap), and
        the placement plan when it changed."""
        if reply.get("plan") is not None:
            self.plan = PlacementPlan.from_dict(reply["plan"])
            self._touch()
        if reply.get("epoch") != self.epoch or "full" in reply:
            if reply.get("epoch") != self.epoch and reply.get("plan") is None:
                self.plan = None  # a restarted directory numbers its plans afresh
            self.states = {r: s for r, s in reply.get("full", {}).items()}
            self.epoch = reply.get("epoch")
            if "full" not in reply:  # new epoch but only deltas: ask again from scratch
                self.version = -1
                self._touch()
                return
        for replica_id, state in reply.get("changes", {}).items():
            if state.get("removed"):
                self.states.pop(replica_id, None)
                self._reserved.pop(replica_id, None)
            elif state.get("seq", 0) >= self.states.get(replica_id, {}).get("seq", -1):
                self.states[replica_id] = state
                self._confirm(replica_id, state)
        for replica_id, state in reply.get("full", {}).items():
            self._confirm(replica_id, state)
        self.version = reply["version"]
        self.last_update = self._clock()
        self._touch()

    def apply_routing_stats(self, replica_id: str, stats: Optional[Mapping]) -> None:
        """A replica's own snapshot; it replaces the directory's state when it is newer."""
        if not stats or "seq" not in stats:
            return
        current = self.states.get(replica_id)
        if current is None or stats["seq"] > current.get("seq", -1):
            merged = dict(current or {}, replica_id=replica_id)
            merged.update(stats)
            self.states[replica_id] = merged
            self._confirm(replica_id, merged)
            self._touch()

    def record_decision(self, adapter: Optional[str], replica_id: str) -> None:
        """"I just sent ``adapter`` to ``replica_id``": trusted for ``ttl_s``, never extended.

        A decision that places an adapter the replica does not hold also reserves one of its
        free slots, so the next cold adapter is not placed on the same "free" slot.
        """
        if adapter is None or self._holds(replica_id, adapter):
            return
        now = self._clock()
        targets = self._optimistic.setdefault(adapter, {})
        if targets.get(replica_id, 0.0) > now:
            return  # not extended: if the replica evicted it since, its reports win after ttl_s
        targets[replica_id] = now + self.ttl_s
        self._reserved.setdefault(replica_id, {})[adapter] = now + self.ttl_s
        cache = self._cache
        if cache is not None and replica_id in cache.index:
            i = cache.index[replica_id]
            cache.free_slots[i] = max(0, int(cache.free_slots[i]) - 1)
            cache.free[i] = int(cache.free_slots[i])

    def _holds(self, replica_id: str, adapter: str) -> bool:
        return any(name_of(u) == adapter for u in self.states.get(replica_id, {}).get("resident", ()))

    def _confirm(self, replica_id: str, state: Mapping) -> None:
        """A replica's own report supersedes our guesses about it: drop those it confirms."""
        reserved = self._reserved.get(replica_id)
        for uid in state.get("resident", ()):
            name = name_of(uid)
            targets = self._optimistic.get(name)
            if targets is not None:
                targets.pop(replica_id, None)
            if reserved:
                reserved.pop(name, None)

    # ------------------------------------------------------------------ output

    def fleet_view(self, replica_ids: tuple[str, ...], adapter: Optional[str] = None) -> FleetView:
        """The policy's input for these candidates: cached until the view changes, plus this
        router's live decisions for ``adapter`` (the only adapter a decision looks up, so the
        overlay is O(1) however many recent decisions there are)."""
        key = (replica_ids, self._generation)
        if key != self._cache_key:
            self._cache = self._build(replica_ids)
            self._cache_key = key
        view = self._cache
        now = self._clock()
        if now - self._last_prune >= self.ttl_s:  # bound memory: forget decisions nobody looks up
            self._last_prune = now
            self._optimistic = {a: t for a, t in self._optimistic.items() if t and max(t.values()) > now}
            reserved = {r: {a: t for a, t in placed.items() if t > now} for r, placed in self._reserved.items()}
            if reserved != self._reserved:  # expired reservations give their slots back
                self._reserved = {r: placed for r, placed in reserved.items() if placed}
                self._touch()
                return self.fleet_view(replica_ids, adapter)
        targets = self._optimistic.get(adapter) if adapter is not None else None
        if not targets:
            return view
        extra = {view.index[r] for r, expiry in targets.items() if expiry > now and r in view.index}
        if not extra:
            return view
        overlay = copy.copy(view)
        overlay.holders = ChainMap({adapter: set(view.holders.get(adapter, ())) | extra}, view.holders)
        return overlay

    def queue_len(self, replica_id: str) -> int:
        return int(self.states.get(replica_id, {}).get("queue_len", 0))

    def prefill_s_per_token(self, replica_id: str) -> Optional[float]:
        """The replica's measured prefill seconds per prompt token; else the mean of those measured; else None."""
        own = ((self.states.get(replica_id) or {}).get("load_s") or {}).get("prefill")
        if own:
            return float(own)
        if self._prefill_mean[0] != self._generation:  # once per change of the view, not per request
            known = [float(t) for st in self.states.values() if (t := (st.get("load_s") or {}).get("prefill"))]
            self._prefill_mean = (self._generation, sum(known) / len(known) if known else None)
        return self._prefill_mean[1]

    # ------------------------------------------------------------------ internals

    def _touch(self) -> None:
        self._generation += 1

    def _build(self, replica_ids: tuple[str, ...]) -> FleetView:
        if replica_ids != self._scores_for:
            self._scores, self._scores_for = {}, replica_ids
        holders: dict[str, set[int]] = {}
        warm: dict[str, set[int]] = {}
        now = self._clock()
        n = len(replica_ids)
        free = np.zeros(n, dtype=np.int64)
        slots = [0] * n
        residents: list[tuple[str, ...]] = [()] * n
        pinned: list[frozenset] = [frozenset()] * n
        host_s: list[Optional[float]] = [None] * n
        disk_s: list[Optional[float]] = [None] * n
        for i, replica_id in enumerate(replica_ids):
            state = self.states.get(replica_id)
            reserved = sum(1 for t in self._reserved.get(replica_id, {}).values() if t > now)
            if not state:
                free[i] = max(0, 1 - reserved)  # a replica nobody has heard of yet: at least one free slot
                continue
            names = tuple(name_of(uid) for uid in state.get("resident", {}))
            for name in names:
                holders.setdefault(name, set()).add(i)
            for uid in (*state.get("host_cached", ()), *state.get("loading", ())):
                warm.setdefault(name_of(uid), set()).add(i)
            free[i] = max(0, int(state.get("free_slots", 0)) - reserved)
            slots[i] = int(state.get("slots", 0))
            residents[i] = names
            pinned[i] = frozenset(name_of(uid) for uid in state.get("pinned", ()))
            timings = state.get("load_s") or {}
            host_s[i], disk_s[i] = timings.get("host"), timings.get("disk")
        planned, planned_on = self._planned(replica_ids)
        busy = frozenset(i for i, r in enumerate(replica_ids) if self.plan is not None and r in self.plan.busy)
        slotted_on = [frozenset(self.plan.slotted.get(r, ())) for r in replica_ids] \
            if self.plan is not None and self.plan.slotted else None
        return FleetView(replica_ids, holders=holders, warm=warm, free_slots=free, slots=slots, residents=residents,
                         pinned=pinned, host_load_s=_fill_with_mean(host_s), disk_load_s=_fill_with_mean(disk_s),
                         score_cache=self._scores, planned=planned, planned_on=planned_on, busy=busy,
                         slotted_on=slotted_on)

    def _planned(self, replica_ids: tuple[str, ...]) -> tuple[dict, list]:
        """The plan over these candidates: adapter -> indexes, and per index the adapters planned there."""
        planned: dict[str, tuple[int, ...]] = {}
        planned_on: list[list[str]] = [[] for _ in replica_ids]
        if self.plan is None:
            return planned, planned_on
        index = {r: i for i, r in enumerate(replica_ids)}
        for name, holders in self.plan.holders.items():
            at = tuple(index[r] for r in holders if r in index)
            if at:
                planned[name] = at
                for i in at:
                    planned_on[i].append(name)
        return planned, planned_on


def _fill_with_mean(values: list[Optional[float]]) -> list[Optional[float]]:
    """A replica that has not measured a timing yet gets the fleet's mean: pricing it with a
    prior instead would make every measured replica look cheaper (or dearer) than a new one."""
    known = [v for v in values if v is not None]
    if not known or len(known) == len(values):
        return values
    mean = sum(known) / len(known)
    return [mean if v is None else v for v in values]
