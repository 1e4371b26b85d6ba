"""The routing decision: the replica where a request is expected to complete first.

For each candidate replica ``i`` and a request for adapter ``a`` the expected completion
time (ECT, seconds; the request's own run time is left out: replicas are alike, and a
measured request time varies with the request mix far more than with the replica) is

    queue wait      max(0, q_i + 1 - cap_i) * T_i / cap_i    until a row frees (a full
                                            replica drains cap_i requests per T_i: its recent
                                            request time, measured)
                  + q_i * batch_slowdown * T_i   what sharing a batch with q_i others costs
                                            (decode steps are nearly flat in batch size)
  + slot wait       T_i * slot_wait_fraction when ``a`` cannot join the running batch now
                                            (every usable slot serves another adapter)
  + load            0 if ``a`` is resident; the replica's measured host-tier copy time if
                                            ``a`` is in its host tier; its disk read time else
  + eviction        what the load evicts: the victim's chance of being asked for again within
                                            demand_horizon request times (from its recent demand)
                                            times its reload time; within a tie the least
                                            wanted victim goes first

The request goes to the minimum; candidates within ``tie_epsilon`` of one queued request's
wait (T / cap), or within what one more co-running request costs (a queue length one
request stale, as right after a completion, must not move an adapter), of the minimum
are a tie, broken by the cheapest kind of placement, then the adapter's rendezvous order, so
routers that see the same state choose alike without talking. With expensive loads
this keeps affinity (a load costs more than queueing behind a holder); with cheap loads
and idle capacity it spreads. A hot adapter gains replicas while its holders' queue
wait exceeds a load elsewhere and loses them (LRU) as demand falls; a victim with demand
costs its reload, so replication never evicts an adapter in use for free.

Work-conserving: a replica that is full (``q_i >= cap_i``), or whose running batch the
adapter cannot join (every usable slot serves another adapter), cannot start the request
now: sent there, it would hold a row the batch cannot use until a slot frees. If no
replica within the tie of the best can start it now, the decision is to wait (``wait``:
the router waits for capacity, then decides again; the freed row goes to a waiting request
that can use it); otherwise the request goes to the best replica that can start it now.

Pure function over plain data; no Ray, no I/O. ``FleetView`` is the per-replica state a
router holds (``routing.view.RouterView`` builds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

import numpy as np

from .hashing import rendezvous_scores, stable_hash

SMALL_FLEET = 16  # up to this many replicas every one is scored; beyond, a bounded candidate set


@dataclass(frozen=True)
class RoutingConfig:
    tie_epsilon: float = 0.25         # ECTs within this many queued requests' wait (T/cap) of the best tie
    batch_slowdown: float = 0.01      # share of T one more running request adds, until measured (GPU decode: ~1%)
    default_request_s: float = 0.5    # a replica's request time before any is measured
    default_max_ongoing: int = 8      # cap when the caller gives none
    host_load_s: float = 0.002        # load-time priors until a replica reports measured ones
    disk_load_s: float = 0.05
    slot_wait_fraction: float = 0.5   # an adapter that cannot join the batch waits ~ this share of T
    slot_wait_patience: float = 2.0   # request times a request waits in the router for a joinable row
    demand_horizon: float = 4.0       # a victim asked for within this many request times is "in use"
    candidate_width: int = 4          # large fleets: rendezvous-first and least-loaded replicas scored


@dataclass
class RoutingDecision:
    tiers: list[list[int]]   # replicas to try now, best first (empty when waiting)
    kind: str                # affinity | spill | placement | base | wait | none
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
                    config: RoutingConfig = RoutingConfig(), *, caps: Optional[Sequence[float]] = None,
                    request_s: Optional[Sequence[Optional[float]]] = None,
                    active: Optional[Sequence[Mapping[Optional[str], int]]] = None,
                    demand: Optional[Mapping[str, float]] = None,
                    last_used: Optional[Sequence[Mapping[str, float]]] = None,
                    batch_slowdown: Optional[float] = None, waited_s: float = 0.0) -> RoutingDecision:
    """Rank candidates by expected completion time; see the module docstring.

    ``loads``: ongoing requests per replica (Serve's queue lengths). ``caps``: each one's
    ``max_ongoing_requests``. ``request_s``: recent seconds per request per replica (None:
    not measured). ``active``: adapters of the requests running on each replica (name ->
    count, only counts > 0; ``None`` is the base model). ``demand``: recent requests per second per adapter.
    ``last_used``: when each adapter was last sent to each replica (the victim a load evicts is
    the least recently used, as the pools evict). ``batch_slowdown``: measured (see
    ``LocalRouterState.batch_slowdown``); None: the config's. ``waited_s``: how long the request
    has waited in the router already; past ``slot_wait_patience`` request times it may take a
    row where it must wait for a slot (the engine then queues it), so no adapter starves while
    others keep taking the freed rows.
    """
    n = len(view.replica_ids)
    if n == 0:
        return RoutingDecision([], "none")
    if n <= SMALL_FLEET and isinstance(loads, np.ndarray):
        loads = loads.tolist()  # small fleets: plain floats are faster to index
    holders = view.holders.get(adapter, ()) if adapter is not None else ()
    warm = view.warm.get(adapter, ()) if adapter is not None else ()
    candidates = range(n) if n <= SMALL_FLEET else _candidates(adapter, view, loads, holders, config)
    cap_default = float(config.default_max_ongoing)
    t_default = config.default_request_s
    join_check = active is not None and view.slots is not None
    free = view.free
    slowdown = config.batch_slowdown if batch_slowdown is None else batch_slowdown
    ect: dict[int, float] = {}
    blocked: set[int] = set()  # replicas whose running batch the adapter cannot join now
    cost_class: dict[int, int] = {}  # 0 resident, 1 load into a free slot, 2 load that evicts
    best, best_e, best_tol = 0, float("inf"), 0.0
    for i in candidates:
        cap = caps[i] if caps is not None else cap_default
        t = (request_s[i] if request_s is not None else None) or t_default
        q = loads[i]
        e = (q + 1 - cap if q + 1 > cap else 0.0) * t / cap + q * slowdown * t
        if join_check and view.slots[i] and not _can_join(adapter, i, view, active):
            e += config.slot_wait_fraction * t
            blocked.add(i)
        if adapter is None or i in holders:
            cost_class[i] = 0
        else:
            e += _load_s(view, i, i in warm, config)
            if free[i] > 0:
                cost_class[i] = 1
            else:
                cost_class[i] = 2
                rate = _victim_demand(view, i, active, demand, last_used)
                e += min(1.0, rate * config.demand_horizon * t) * _load_s(view, i, True, config)
        ect[i] = e
        if e < best_e:  # the tie: a fraction of a row's wait, and at least one co-running request's cost
            best, best_e, best_tol = i, e, max(config.tie_epsilon * t / cap, slowdown * t)
    limit = best_e + best_tol
    # within the tie, the cheapest kind of placement, then the adapter's rendezvous order (base: least
    # loaded, then index), so routers whose estimates differ slightly still agree; beyond it, by ECT
    if adapter is None:
        tie_key = lambda i: (cost_class[i], loads[i], i)  # noqa: E731
    else:
        scores = view.scores(adapter)
        tie_key = lambda i: (cost_class[i], -int(scores[i]))  # noqa: E731
    tied = [i for i in ect if ect[i] <= limit]
    tied.sort(key=tie_key)
    best = tied[0]
    chosen = None
    t_best = (request_s[best] if request_s is not None else None) or t_default
    if blocked and waited_s > config.slot_wait_patience * t_best:
        blocked = set()  # waited long enough: queue in the engine for a slot rather than starve here
    for i in tied:  # a row taken by a request that must wait for a slot is a row the batch loses
        if loads[i] < (caps[i] if caps is not None else cap_default) and i not in blocked:
            chosen = i
            break
    if chosen is None:  # nothing in the tie can start now: wait for it
        return RoutingDecision([], "wait", wait=True, best=best, ect=ect)
    return RoutingDecision([[chosen]], _kind(adapter, holders, chosen), best=best, ect=ect)


def _kind(adapter: Optional[str], holders: Collection[int], chosen: int) -> str:
    if adapter is None:
        return "base"
    if chosen in holders:
        return "affinity"
    return "spill" if holders else "placement"


def _can_join(adapter: Optional[str], i: int, view: FleetView, active: Sequence[Mapping]) -> bool:
    """Whether ``adapter`` can enter replica ``i``'s running batch now: already in it, or a
    slot that neither the batch nor a pin holds (the pool would load it at the next step)."""
    running = active[i]
    if running.get(adapter, 0) > 0:
        return True
    pinned = view.pinned[i] if view.pinned is not None else ()
    pinned_idle = sum(1 for p in pinned if p not in running) if pinned else 0
    return len(running) + pinned_idle < view.slots[i]


def _load_s(view: FleetView, i: int, warm: bool, config: RoutingConfig) -> float:
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
                config: RoutingConfig) -> list[int]:
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

