"""One routing decision's expected times, in seconds: the wait for a row, the prompts queued ahead,
the slot wait, the load and its victim's reload (``routing.policy``'s docstring has the sum).

``Scoring`` computes each candidate's expected completion time once per decision and remembers what
the spill rules (``routing.spill``) need of it: each load's whole cost and which replicas' running
batches the adapter cannot join now. No Ray.
"""

from __future__ import annotations

from typing import Collection, Mapping, Optional, Sequence

import numpy as np

from .fleet_view import FleetView
from .settings import RoutingSettings

DEFAULT_ROWS = 8  # a replica's rows when the caller gives no caps (tests, the simulator's overhead runs)


class Scoring:
    """One decision's inputs and the expected completion times it has computed so far."""

    def __init__(self, adapter, view, loads, config, caps, request_s, active, demand, last_used, slowdown,
                 prefill_wait=None):
        self.prefill_wait = prefill_wait
        self.adapter, self.view, self.loads, self.config = adapter, view, loads, config
        self.caps, self.request_s, self.active, self.demand, self.last_used = caps, request_s, active, demand, last_used
        self.slowdown = slowdown
        self.holders = view.holders.get(adapter, ()) if adapter is not None else ()
        self.warm = view.warm.get(adapter, ()) if adapter is not None else ()
        self.join_check = active is not None and view.slots is not None
        self.ect: dict[int, float] = {}
        self.cost_class: dict[int, int] = {}  # 0 resident, 1 load into a free slot, 2 load that evicts
        self.blocked: set[int] = set()        # replicas whose running batch the adapter cannot join now
        self.load_cost: dict[int, float] = {}  # a load's whole cost there: its time, its victim's, the stall

    def cap(self, i: int) -> float:
        return self.caps[i] if self.caps is not None else float(DEFAULT_ROWS)

    def request_time(self, i: int) -> float:
        return (self.request_s[i] if self.request_s is not None else None) or self.config.default_request_s

    def has_row(self, i: int) -> bool:
        return self.loads[i] < self.cap(i)

    def score(self, i: int) -> float:
        e = self.ect.get(i)
        if e is not None:
            return e
        cfg, view, adapter = self.config, self.view, self.adapter
        cap, t, q = self.cap(i), self.request_time(i), self.loads[i]
        e = (q + 1 - cap if q + 1 > cap else 0.0) * t / cap + q * self.slowdown * t
        if self.prefill_wait is not None:
            e += self.prefill_wait[i]
        if self.join_check and view.slots[i] and not _can_join(adapter, i, view, self.active):
            e += cfg.slot_wait_fraction * t
            self.blocked.add(i)
        load_cost = 0.0
        if adapter is None or i in self.holders:
            self.cost_class[i] = 0
        else:
            load_s = _load_s(view, i, i in self.warm, cfg)
            e += load_s
            # the request waits for the whole load; the running batch only for the host-to-slot copy at a step
            # boundary (a disk read happens off the engine thread, before the copy)
            load_cost = load_s + _load_s(view, i, True, cfg) * q
            if view.free[i] > 0:
                self.cost_class[i] = 1
            else:
                self.cost_class[i] = 2
                rate = _victim_demand(view, i, self.active, self.demand, self.last_used)
                # the victim, asked for again, reloads (stalling that batch too) and evicts in turn
                victim = min(1.0, rate * cfg.demand_horizon * t) * _load_s(view, i, True, cfg)
                e += victim
                load_cost += 2.0 * victim * (1 + q)
        self.load_cost[i] = load_cost
        self.ect[i] = e
        return e

    def rank(self, candidates) -> list[int]:
        """By expected completion time; within a tie (a fraction of one row's wait, at least one
        co-running request's cost) by the cheapest kind of placement, then rendezvous order, so
        routers whose estimates differ slightly still agree."""
        scored = sorted((self.score(i), i) for i in candidates)
        if len(scored) == 1:
            return [scored[0][1]]
        best_e, best_i = scored[0]
        t = self.request_time(best_i)
        limit = best_e + max(self.config.tie_epsilon * t / self.cap(best_i), self.slowdown * t)
        tied = [i for e, i in scored if e <= limit]
        if len(tied) > 1:
            scores = self.view.tie_scores(self.adapter, tied)
            tied.sort(key=lambda i: (self.cost_class[i], -scores[i]))
        return tied + [i for e, i in scored if e > limit]


def _can_join(adapter: Optional[str], i: int, view: FleetView, active: Sequence[Mapping]) -> bool:
    """Whether ``adapter`` can enter replica ``i``'s running batch now: already in it, or a
    slot that neither the batch nor a pin holds (the pool would load it at the next step)."""
    running = active[i]
    if running.get(adapter, 0) > 0:
        return True
    pinned = view.pinned[i] if view.pinned is not None else ()
    if adapter in pinned:
        return True  # its own pinned slot waits for it
    pinned_idle = sum(1 for p in pinned if p not in running) if pinned else 0
    return len(running) + pinned_idle < view.slots[i]


def _load_s(view: FleetView, i: int, warm: bool, config: RoutingSettings) -> float:
    if warm:
        measured = view.host_load_s[i] if view.host_load_s is not None else None
        return measured if measured is not None else config.host_load_s
    measured = view.disk_load_s[i] if view.disk_load_s is not None else None
    return measured if measured is not None else config.disk_load_s


def _victim_demand(view: FleetView, i: int, active: Optional[Sequence[Mapping]],
                   demand: Optional[Mapping[str, float]], last_used: Optional[Sequence[Mapping]]) -> float:
    """Recent requests per second of the adapter a load on ``i`` would evict: the least recently
    used evictable resident (by ``last_used``; without it, the least wanted). 0 when unknown."""
    if view.residents is None or not demand:
        return 0.0
    running = active[i] if active is not None else {}
    pinned = view.pinned[i] if view.pinned is not None else frozenset()
    evictable = [r for r in view.residents[i] if running.get(r, 0) <= 0 and r not in pinned]
    if not evictable:
        return 0.0  # nothing evictable: the slot wait already counts it
    if last_used is not None:
        used = last_used[i]
        victim = min(evictable, key=lambda r: used.get(r, float("-inf")))
        return demand.get(victim, 0.0)
    return min(demand.get(r, 0.0) for r in evictable)


def candidates(adapter: Optional[str], view: FleetView, loads: list, holders: Collection[int],
                config: RoutingSettings) -> list[int]:
    """Large fleets: holders, host-tier copies, the first ``candidate_width`` replicas in the
    adapter's rendezvous order, and the ``candidate_width`` least loaded (O(n) once, in numpy)."""
    k = config.candidate_width
    arr = np.asarray(loads, dtype=np.float64)
    least = np.argpartition(arr, k)[:k] if k < len(arr) else np.arange(len(arr))
    chosen = {int(i) for i in least}
    if adapter is not None:
        chosen.update(holders)
        chosen.update(view.warm.get(adapter, ()))
        chosen.update(view.order(adapter, k))
    return sorted(chosen)

