"""The routing decision: within the adapter's planned replicas, where it completes first.

Placement is a fleet decision (``routing.plan``: how many replicas hold each adapter and
which, made by the directory with hysteresis and published to every router). A request is
routed within its adapter's planned set; an adapter not in the plan yet is planned where it
is resident, else on its rendezvous-first replica. Within the set it goes to the replica with
the lowest expected completion time (ECT, seconds; the request's own run time left out):

    queue wait      max(0, q_i + 1 - cap_i) * T_i / cap_i    until a row frees (``T_i``: the
                                            replica's measured request time)
                  + q_i * batch_slowdown * T_i   what sharing a batch with q_i others costs
  + prefill wait    until the prompts this router sent there before have prefilled (their
                                            tokens times the replica's measured seconds per token)
  + slot wait       T_i * slot_wait_fraction when ``a`` cannot join the running batch now
  + load            0 if ``a`` is resident; the measured host-tier copy or disk read else
  + eviction        the victim's chance of being asked for again within ``demand_horizon``
                                            request times, times its reload

Ties (within a fraction of one row's wait) go by the cheapest placement, then the adapter's
rendezvous order, so routers that see the same state choose alike. Work-conserving within
the set: the best planned replica that can start the request now takes it.

Leaving the plan (a spill) happens when the best planned replica's prefill queue ends later than
another replica's by more than a load's cost there and ``spill_margin`` row waits, or when every
planned replica is full and the wait for a planned row exceeds the whole cost of a load
elsewhere by ``spill_margin`` rows' waits (T / cap): the load's own time, the running batch it
stalls there (load time x requests running), and the victim's reloads (which stall that batch
again and evict in turn). A spill target must
have a row that its own planned adapters' waiting requests will not take, so at saturation
nothing spills. Spills are served requests like any other: the demand they add is what makes
the plan grow the adapter's holder count, after its hysteresis, not the request.

A request whose planned replicas are full waits in the router (``wait``); after
``max_router_wait`` rows' waits any free row will do, the cheapest first (bounded waits), and
after ``slot_wait_patience`` request times it may take a row where it must wait for a slot.

Pure function over plain data; no Ray, no I/O. ``FleetView`` is the per-replica state a
router holds (``routing.view.RouterView`` builds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

import numpy as np

from .hashing import rendezvous_scores, stable_hash
from .settings import DEFAULT_SETTINGS, RoutingSettings

SMALL_FLEET = 16  # up to this many replicas every one is scored; beyond, a bounded candidate set
DEFAULT_ROWS = 8  # a replica's rows when the caller gives no caps (tests, the simulator's overhead runs)


@dataclass
class RoutingDecision:
    tiers: list[list[int]]   # replicas to try now, best first (empty when waiting)
    kind: str                # affinity | spill | prefill_spill | placement | base | wait | none
    wait: bool = False       # the best replica is full and nothing that could start now ties it
    best: Optional[int] = None       # the minimum-ECT replica (full or not)
    ect: dict[int, float] = field(default_factory=dict)  # scored candidates -> expected seconds


@dataclass
class FleetView:
    """The replicas a router may choose from and what it believes each holds.

    ``holders`` / ``warm`` map an adapter name to replica indexes: resident, or in the
    host tier / being read (a cheap place to load it). Per-replica lists are indexed
    like ``replica_ids``; a missing list means "not reported" and the config's priors apply.
    """

    replica_ids: tuple[str, ...]
    holders: Mapping[str, Collection[int]] = field(default_factory=dict)
    warm: Mapping[str, Collection[int]] = field(default_factory=dict)
    free_slots: Optional[np.ndarray] = None          # free slot count per replica
    slots: Optional[Sequence[int]] = None             # slot count per replica (0: unknown)
    residents: Optional[Sequence[tuple[str, ...]]] = None  # adapter names resident per replica
    pinned: Optional[Sequence[frozenset]] = None       # pinned adapter names per replica
    host_load_s: Optional[Sequence[Optional[float]]] = None  # measured host-tier copy seconds
    disk_load_s: Optional[Sequence[Optional[float]]] = None  # measured disk read seconds
    score_cache: Optional[dict] = None  # adapter -> rendezvous scores and order for these replica_ids (shareable)
    planned: Optional[Mapping[str, tuple[int, ...]]] = None  # the fleet plan: adapter -> planned replica indexes
    planned_on: Optional[Sequence[tuple[str, ...]]] = None   # per replica: the adapters planned there
    busy: frozenset = frozenset()  # replica indexes the plan keeps busy (no spill target)
    slotted_on: Optional[Sequence[frozenset]] = None  # per replica: planned adapters given a slot there (kept)

    def __post_init__(self) -> None:
        n = len(self.replica_ids)
        self.hashes = np.fromiter((stable_hash(r) for r in self.replica_ids), dtype=np.uint64, count=n)
        self.index = {r: i for i, r in enumerate(self.replica_ids)}
        if self.free_slots is None:
            self.free_slots = np.zeros(n, dtype=np.int64)
        self.free = [int(x) for x in self.free_slots]
        self._scores: dict = self.score_cache if self.score_cache is not None else {}

    def scores(self, adapter: str):
        """Rendezvous scores of ``adapter`` per replica (higher = earlier in its order), cached: a list
        for small fleets, the numpy array for large ones (compare them as ``int``)."""
        s = self._scores.get(adapter)
        if s is None:
            arr = rendezvous_scores(stable_hash(adapter), self.hashes)
            s = self._scores[adapter] = arr.tolist() if len(arr) <= SMALL_FLEET else arr
        return s

    def tie_scores(self, adapter: str, indexes: Sequence[int]) -> dict[int, int]:
        """Rendezvous scores of ``adapter`` at a few replicas (a large fleet computes just these)."""
        if len(self.replica_ids) <= SMALL_FLEET:
            s = self.scores(adapter)
            return {i: int(s[i]) for i in indexes}
        arr = rendezvous_scores(stable_hash(adapter), self.hashes[np.asarray(indexes, dtype=np.int64)])
        return dict(zip(indexes, arr.tolist()))

    def order(self, adapter: str, k: int) -> list[int]:
        """The first ``k`` replicas in ``adapter``'s rendezvous order, cached."""
        key = (adapter, k)
        o = self._scores.get(key)
        if o is None:
            s = np.asarray(self.scores(adapter), dtype=np.uint64)
            k = min(k, len(s))
            top = np.argpartition(s, len(s) - k)[-k:] if k < len(s) else np.arange(len(s))
            o = self._scores[key] = sorted((int(i) for i in top), key=lambda i: -int(s[i]))
        return o


def choose_replicas(adapter: Optional[str], view: FleetView, loads: Sequence[float] | np.ndarray,
                    config: RoutingSettings = DEFAULT_SETTINGS, *, caps: Optional[Sequence[float]] = None,
                    request_s: Optional[Sequence[Optional[float]]] = None,
                    active: Optional[Sequence[Mapping[Optional[str], int]]] = None,
                    demand: Optional[Mapping[str, float]] = None,
                    last_used: Optional[Sequence[Mapping[str, float]]] = None,
                    batch_slowdown: Optional[float] = None, waited_s: float = 0.0, first_in_line: bool = False,
                    waiting: Optional[Mapping[Optional[str], int]] = None,
                    full_at: Optional[Sequence[float]] = None, now: float = 0.0,
                    prefill_wait: Optional[Sequence[float]] = None) -> RoutingDecision:
    """Route within the adapter's planned set, by expected completion time; see the module docstring.

    ``loads``: ongoing requests per replica (Serve's queue lengths). ``caps``: each one's
    ``max_ongoing_requests``. ``request_s``: recent seconds per request per replica (None:
    not measured). ``active``: adapters of the requests running on each replica (name ->
    count, only counts > 0; ``None`` is the base model). ``demand``: recent requests per second per adapter.
    ``last_used``: when each adapter was last sent to each replica (the victim a load evicts is
    the least recently used, as the pools evict). ``batch_slowdown``: measured (see
    ``LocalRouterState.batch_slowdown``); None: the config's. ``waited_s``: how long the request
    has waited in the router already. ``first_in_line``: no request waiting in this router is older: it takes
    a planned row even where it must wait for a slot (the engine's bounded bypass then gets it one), so no
    request is passed over by younger ones whose adapters happen to fit the running batch. ``waiting``: this router's other waiting requests per
    adapter (the rows a replica's own planned adapters will take first). ``full_at``: when this
    router last saw each replica full (``now``: the same clock); a replica full within
    ``idle_rows`` rows' waits is busy, whatever its queue says this instant, and takes no spill.
    ``prefill_wait``: per replica, seconds until the prompts this router sent it have prefilled
    (``LocalRouterState.prefill_wait_by_index``); None: not priced.
    """
    n = len(view.replica_ids)
    if n == 0:
        return RoutingDecision([], "none")
    if n <= SMALL_FLEET and isinstance(loads, np.ndarray):
        loads = loads.tolist()  # small fleets: plain floats are faster to index
    ctx = _Scoring(adapter, view, loads, config, caps, request_s, active, demand, last_used,
                   config.batch_slowdown if batch_slowdown is None else batch_slowdown, prefill_wait)
    if adapter is None:
        candidates = range(n) if n <= SMALL_FLEET else _candidates(None, view, loads, (), config)
        return _route_base(ctx, candidates)
    planned = view.planned.get(adapter) if view.planned is not None else None
    if not planned:  # not in the plan yet: where it is resident, else its rendezvous-first replica
        planned = tuple(sorted(ctx.holders)) or tuple(view.order(adapter, 1))
    ranked = ctx.rank(planned)
    best = ranked[0]
    t_best = ctx.request_time(best)
    # waited long enough, or the oldest waiting: may queue in the engine for a slot
    patient = first_in_line or waited_s > config.slot_wait_patience * t_best
    for i in ranked:  # work-conserving within the plan
        if ctx.has_row(i) and (patient or i not in ctx.blocked):
            if prefill_wait is not None and prefill_wait[i] > 0:
                j = _prefill_spill(ctx, planned, i, waiting or {}, full_at, now)
                if j is not None:
                    return RoutingDecision([[j]], "prefill_spill", best=best, ect=ctx.ect)
            return RoutingDecision([[i]], _kind(adapter, ctx.holders, planned, i), best=best, ect=ctx.ect)
    overdue = waited_s > config.max_router_wait * t_best / ctx.cap(best)  # bounded wait: any free row now
    spill = _spill_target(ctx, planned, best, waiting or {}, overdue, full_at, now)
    if spill is not None:
        return RoutingDecision([[spill]], "spill", best=best, ect=ctx.ect)
    return RoutingDecision([], "wait", wait=True, best=best, ect=ctx.ect)


class _Scoring:
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
            load_cost = load_s * (1 + q)  # the running batch waits while the slot fills
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


def _route_base(ctx: _Scoring, candidates) -> RoutingDecision:
    """The base model needs no adapter: the least loaded replica by expected completion time."""
    scored = sorted((ctx.score(i), ctx.loads[i], i) for i in candidates)
    for _, _, i in scored:
        if ctx.has_row(i):
            return RoutingDecision([[i]], "base", best=scored[0][2], ect=ctx.ect)
    return RoutingDecision([], "wait", wait=True, best=scored[0][2], ect=ctx.ect)


def _spill_target(ctx: _Scoring, planned: Sequence[int], best: int, waiting: Mapping, overdue: bool = False,
                  full_at: Optional[Sequence[float]] = None, now: float = 0.0) -> Optional[int]:
    """A replica outside the plan worth a load now, or None (wait for a planned row).

    Every planned replica is full. Leaving the plan pays off only when the wait for a planned row
    exceeds the whole cost of a load elsewhere (its own time, the batch it stalls, the victim's
    reload) by ``spill_margin`` request times, and only on a replica whose free rows its own
    planned adapters' waiting requests will not take (``spill_headroom`` of them). ``overdue``: the request has waited its
    bound; the least costly free row anywhere takes it."""
    view, cfg = ctx.view, ctx.config
    row_wait = ctx.request_time(best) / ctx.cap(best)
    margin = 0.0 if overdue else cfg.spill_margin * row_wait
    # the wait for a planned row: the rows ahead of it (a full replica frees one per row_wait); what
    # sharing a batch costs is no reason to leave the plan (a spill shares a batch elsewhere too)
    wait = max(0.0, ctx.loads[best] + 1 - ctx.cap(best) + _ahead(view, best, waiting)) * row_wait
    if not overdue and wait <= margin:
        return None  # no load anywhere is cheaper than nothing: the common case costs no scan
    n = len(view.replica_ids)
    others = range(n) if n <= SMALL_FLEET else _candidates(ctx.adapter, view, ctx.loads, ctx.holders, cfg)
    target, target_cost = None, float("inf")
    inside = set(planned)
    for j in others:
        if j in inside or j in view.busy or _evicts_planned(ctx, j) or \
                ctx.loads[j] + _ahead(view, j, waiting) + cfg.spill_headroom > ctx.cap(j):
            continue  # its free rows are owed to requests planned there (overdue or not), or it is nearly full
        if full_at is not None and now - full_at[j] < cfg.idle_rows * ctx.request_time(j) / ctx.cap(j):
            continue  # full a moment ago: other routers' requests will take the row (their waits are unseen)
        ctx.score(j)
        cost = ctx.load_cost[j]  # the wait there is none: it has a free row
        if j in ctx.blocked or cost >= target_cost:
            continue
        target, target_cost = j, cost
    if target is None or (not overdue and wait - target_cost <= margin):
        return None
    return target


def _prefill_spill(ctx: _Scoring, planned: Sequence[int], chosen: int, waiting: Mapping,
                   full_at: Optional[Sequence[float]], now: float) -> Optional[int]:
    """A replica outside the plan whose prompts queued for prefill end sooner than ``chosen``'s by more than a
    load's whole cost there plus ``spill_margin`` row waits, or None (stay on ``chosen``, which has a row).

    A free row is not a short wait when long prompts are queued ahead of it: replaying ``fleet_live`` in the
    simulator (its trace's prompts run to 8k tokens), the slowest first tokens were prompts sent to a planned
    replica still prefilling one or two others, while a replica elsewhere was idle; leaving the plan for those
    cut p99 TTFT from 1.21x to 0.96x the best peer's (five jittered replays), for 11% more loads. The same
    exclusions as a spill for a row apply (replicas the plan keeps busy, rows owed to waiting requests,
    replicas seen full a moment ago)."""
    view, cfg, pw = ctx.view, ctx.config, ctx.prefill_wait
    row_wait = ctx.request_time(chosen) / ctx.cap(chosen)
    margin = cfg.spill_margin * row_wait
    if pw[chosen] <= margin:
        return None
    inside = set(planned)
    target, target_cost = None, pw[chosen] - margin
    n = len(view.replica_ids)
    for j in range(n) if n <= SMALL_FLEET else _candidates(ctx.adapter, view, ctx.loads, ctx.holders, cfg):
        if j in inside or j in view.busy or pw[j] >= target_cost or _evicts_planned(ctx, j) or \
                ctx.loads[j] + _ahead(view, j, waiting) + cfg.spill_headroom > ctx.cap(j):
            continue
        if full_at is not None and now - full_at[j] < cfg.idle_rows * ctx.request_time(j) / ctx.cap(j):
            continue
        ctx.score(j)
        cost = pw[j] + ctx.load_cost[j]
        if j in ctx.blocked or cost >= target_cost:
            continue
        target, target_cost = j, cost
    return target


def _evicts_planned(ctx: _Scoring, j: int) -> bool:
    """Whether loading the adapter on ``j`` must evict an adapter the plan gives a slot there: ``j`` does not
    hold it, has no free slot, and every resident has its slot by the plan. A spill never does that: the
    planned adapter is asked for again there, reloads, and evicts in turn (on a fleet whose slots the plan
    fills, as the demo's 2 x 3 slots for six adapters, each spill cost two loads or more)."""
    view = ctx.view
    kept = view.slotted_on if view.slotted_on is not None else view.planned_on
    if j in ctx.holders or view.free[j] > 0 or view.residents is None or kept is None:
        return False
    kept_here = kept[j]
    return all(r in kept_here for r in view.residents[j])


def _ahead(view: FleetView, i: int, waiting: Mapping) -> float:
    """This router's waiting requests whose plan includes replica ``i`` (each split over its holders)."""
    if not waiting or view.planned_on is None:
        return 0.0
    total = 0.0
    for name in view.planned_on[i]:
        w = waiting.get(name)
        if w:
            total += w / len(view.planned[name])
    return total


def _kind(adapter: Optional[str], holders: Collection[int], planned: Collection[int], chosen: int) -> str:
    if adapter is None:
        return "base"
    if chosen in holders:
        return "affinity" if chosen in planned else "spill"
    return "placement" if chosen in planned else "spill"


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


def _candidates(adapter: Optional[str], view: FleetView, loads: list, holders: Collection[int],
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

