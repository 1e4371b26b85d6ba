"""AdapterDirectory: the fleet's global view, rebuilt from the replicas' own reports, and its plan.

Soft state, no Ray inside: replica -> resident / loading / pinned / host-cached adapters,
free slots and queue; adapter uid -> replicas holding it. Events are applied in order per
replica and idempotently (an old ``seq`` is ignored); a gap marks the replica for a
snapshot resync. Routers pull versioned deltas at replica granularity: "these replicas
changed since version v" with their current state, which is small and idempotent.

The directory is also where placement is decided (``routing.plan``): the workers report the
request-seconds each adapter kept them busy, the directory turns that into fleet-wide demand
and, every ``update_plan``, into the placement plan every router routes within.

Each replica's state is a ``ReplicaState`` (``routing.replica_state``), the one typed form
the directory stores, the workers report and the routers read.
"""

from __future__ import annotations

import copy
import time
from collections import Counter, OrderedDict, deque
from typing import Callable, Iterable, Mapping, Optional, Union

from pool.events import PoolEvent, PoolSnapshot

from .plan import FleetPlanner, PlacementPlan, ReplicaSlots, holder_moves
from .replica_state import STATE_EXTRAS, ReplicaState
from .router_state import DemandRates
from .settings import DEFAULT_SETTINGS, RoutingSettings

MAX_COUNTED_UIDS = 4096   # uids whose load/evict counts the directory keeps (a count budget; oldest dropped)



EventLike = Union[PoolEvent, Mapping]


def _event(e: EventLike) -> PoolEvent:
    return e if isinstance(e, PoolEvent) else PoolEvent(**e)


class AdapterDirectory:
    def __init__(self, *, replica_timeout_s: float = 15.0, max_log: int = 100_000,
                 clock: Callable[[], float] = time.monotonic, settings: RoutingSettings = DEFAULT_SETTINGS):
        self.replicas: dict[str, ReplicaState] = {}
        self.holders: dict[str, set[str]] = {}  # uid -> replica ids
        # uid -> {"load": n, "evict": n}, most recent last; at most MAX_COUNTED_UIDS (oldest dropped), and a
        # uid unloaded everywhere is dropped at once: 10,000 registrations and removals leave it at its bound
        self.adapter_counts: OrderedDict[str, dict[str, int]] = OrderedDict()
        self.version = 0
        self.events_applied = 0
        self.replica_timeout_s = replica_timeout_s
        self._log: deque[tuple[int, str]] = deque(maxlen=max_log)
        self._clock = clock
        self.demand = DemandRates(settings.demand_tau_s, clock)  # adapter name -> request-seconds per second
        self.popularity = DemandRates(settings.popularity_tau_s, clock)  # the same over a longer window
        self.planner = FleetPlanner(settings)
        self.plan_moves: Counter = Counter()  # adapter name -> holders the plan added to it since it was placed
        self.plan_moves_total = 0

    # ------------------------------------------------------------------ updates

    def apply_events(self, replica_id: str, events: Iterable[EventLike]) -> bool:
        """Apply events in ``seq`` order; returns False if a gap needs a snapshot resync."""
        events = sorted((_event(e) for e in events), key=lambda e: e.seq)
        state = self._state(replica_id, first_seq=events[0].seq if events else None)
        changed = False
        for event in events:
            if event.seq <= state.seq:
                continue  # already applied (a retry or an overlap with a snapshot)
            if event.seq != state.seq + 1 or state.needs_resync:
                state.needs_resync = True
                break
            self._apply_one(state, event)
            state.seq = event.seq
            self.events_applied += 1
            changed = True
        state.last_report = self._clock()
        if changed:
            self._bump(replica_id)
        return not state.needs_resync

    def apply_snapshot(self, snapshot: Union[PoolSnapshot, Mapping], **extras) -> None:
        """Replace a replica's state with its own full report (resync, or first contact)."""
        fresh = ReplicaState.from_snapshot(snapshot, **extras)
        state = self._state(fresh.replica_id, first_seq=None)
        if fresh.seq < state.seq and not state.needs_resync:
            return  # older than what events already told us
        for uid in list(state.resident):
            self._unindex(uid, state.replica_id)
        for uid in fresh.resident:
            self.holders.setdefault(uid, set()).add(state.replica_id)
        state.resident, state.pinned, state.slots, state.seq = fresh.resident, fresh.pinned, fresh.slots, fresh.seq
        state.base_resident = fresh.base_resident
        state.needs_resync = False
        state.set_extras(**{k: v for k, v in extras.items() if k in STATE_EXTRAS})
        state.last_report = self._clock()
        self._bump(state.replica_id)

    def heartbeat(self, replica_id: str, busy_s: Optional[Mapping[str, float]] = None, **extras) -> bool:
        """Liveness plus the parts of a replica's state that are not pool events, and the
        request-seconds each adapter kept it busy since its last heartbeat (``busy_s``: the demand).

        A queue length alone does not make a new version: routers take queue lengths from
        Serve's own cache, and waking every router's long poll once a second per replica for
        a number they do not use would cost each of them a round trip."""
        state = self._state(replica_id, first_seq=None)
        state.last_report = self._clock()
        for name, seconds in (busy_s or {}).items():
            self.demand.add(name, seconds)
            self.popularity.add(name, seconds)
        if state.set_extras(**{k: v for k, v in extras.items() if k in STATE_EXTRAS}):
            self._bump(replica_id)
        return not state.needs_resync

    def update_plan(self, registered: Iterable[str] = ()) -> PlacementPlan:
        """Re-plan from the current demand and replica states (a new version only when it changed);
        ``registered``: the adapters that exist (planned before their first request)."""
        self.demand.prune()
        self.popularity.prune()
        demand = {name: self.demand.get(name) for name in self.demand.names()}
        before = self.planner.plan
        plan = self.planner.update(self._clock(), demand, [s.slots_for_plan() for s in self.replicas.values()],
                                   registered, popularity=self._popularity())
        if plan.version != before.version:
            for name, added in holder_moves(before, plan).items():
                self.plan_moves[name] += added
                self.plan_moves_total += added
            for name in [n for n in self.plan_moves if n not in plan.holders]:
                del self.plan_moves[name]  # per-adapter counts only for what the plan holds (bounded)
        return plan

    def _popularity(self) -> dict[str, float]:
        return {name: self.popularity.get(name) for name in self.popularity.names()}

    @property
    def plan(self) -> PlacementPlan:
        return self.planner.plan

    def planned_for(self, replica_id: str, slots: int, rows: int = 0) -> list[str]:
        """What the plan would place on ``replica_id`` if it joined now, neediest first (warm start):
        a trial re-plan on a copy of the planner, so the real plan and its timers do not move."""
        trial = copy.deepcopy(self.planner)
        replicas = [s.slots_for_plan() for r, s in self.replicas.items() if r != replica_id]
        replicas.append(ReplicaSlots(replica_id, slots, rows))
        demand = {name: self.demand.get(name) for name in self.demand.names()}
        plan = trial.update(self._clock(), demand, replicas, rebalance_now=True,  # all it will be given
                            popularity=self._popularity())
        mine = [name for name, holders in plan.holders.items() if replica_id in holders]
        return sorted(mine, key=lambda name: (-demand.get(name, 0.0), name))

    def forget_replica(self, replica_id: str) -> bool:
        state = self.replicas.pop(replica_id, None)
        if state is None:
            return False
        for uid in state.resident:
            self._unindex(uid, replica_id)
        self._bump(replica_id)
        return True

    def expire(self) -> list[str]:
        """Forget replicas that have not reported for ``replica_timeout_s`` (dead or gone)."""
        now = self._clock()
        dead = [r for r, s in self.replicas.items() if now - s.last_report > self.replica_timeout_s]
        for replica_id in dead:
            self.forget_replica(replica_id)
        return dead

    # ------------------------------------------------------------------ queries

    def replicas_holding(self, uid: str) -> set[str]:
        return set(self.holders.get(uid, ()))

    def needs_resync(self, replica_id: str) -> bool:
        state = self.replicas.get(replica_id)
        return state is None or state.needs_resync

    def full_view(self) -> dict[str, dict]:
        return {r: s.to_dict() for r, s in self.replicas.items()}

    def changes_since(self, version: int) -> tuple[int, Optional[dict[str, dict]]]:
        """(current version, {replica_id: state dict, or {"removed": True}}) changed after ``version``.

        ``None`` instead of a dict means the log no longer reaches back that far: take a full view.
        """
        if version > self.version:
            return self.version, None  # a version from before a restart
        if version == self.version:
            return self.version, {}
        if version < 0 or (self._log and self._log[0][0] > version + 1) or (not self._log and version < self.version):
            return self.version, None
        changed: dict[str, dict] = {}
        for v, replica_id in reversed(self._log):
            if v <= version:
                break
            if replica_id not in changed:
                state = self.replicas.get(replica_id)
                changed[replica_id] = state.to_dict() if state else {"replica_id": replica_id, "removed": True}
        return self.version, changed

    # ------------------------------------------------------------------ internals

    def _state(self, replica_id: str, first_seq: Optional[int] = 1) -> ReplicaState:
        """The replica's state; one first heard of mid-stream (a directory restart, a lost first
        report) is marked for a snapshot, since its events so far are unknown."""
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(replica_id, last_report=self._clock(),
                                                             needs_resync=first_seq != 1)
            self._bump(replica_id)
        return state

    def _apply_one(self, state: ReplicaState, event: PoolEvent) -> None:
        self._count(event)
        if event.kind == "load":
            state.resident[event.uid] = event.slot
            state.loading.discard(event.uid)
            self.holders.setdefault(event.uid, set()).add(state.replica_id)
        elif event.kind in ("evict", "unload"):
            state.resident.pop(event.uid, None)
            state.pinned.discard(event.uid)
            self._unindex(event.uid, state.replica_id)
            if event.kind == "unload" and event.uid not in self.holders:
                self.adapter_counts.pop(event.uid, None)   # removed from the fleet: nothing left to count
        elif event.kind == "pin":
            state.pinned.add(event.uid)
        elif event.kind == "unpin":
            state.pinned.discard(event.uid)

    def _count(self, event: PoolEvent) -> None:
        counts = self.adapter_counts.get(event.uid)
        if counts is None:
            counts = self.adapter_counts[event.uid] = {}
            while len(self.adapter_counts) > MAX_COUNTED_UIDS:
                self.adapter_counts.popitem(last=False)
        else:
            self.adapter_counts.move_to_end(event.uid)
        counts[event.kind] = counts.get(event.kind, 0) + 1

    def _unindex(self, uid: str, replica_id: str) -> None:
        holders = self.holders.get(uid)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self.holders[uid]

    def _bump(self, replica_id: str) -> None:
        self.version += 1
        self._log.append((self.version, replica_id))
