"""The fleet placement plan: which replicas should hold each adapter, decided in one place.

Per-request routing cannot keep a fleet from thrashing: every router sees a queue blip at an
adapter's holder and places another copy elsewhere, evicting something in use there. So the
directory (one writer, read by every router) keeps a plan, and routers route within it:

- **How many holders.** An adapter's demand is its mean number of requests in service across
  the fleet (busy request-seconds per second, as the workers measure them: Little's law, so no
  service time has to be guessed). Divided by a replica's row count it is the adapter's need in
  replicas; it is planned on ``ceil(need / target_utilization)`` replicas (at least one).
- **Hysteresis.** A count that wants to grow must want it for ``grow_after_s`` first, one that
  wants to shrink for ``shrink_after_s``; a one-request blip never moves a placement.
- **Which holders.** Pinned adapters first, on the replicas that pin them. Then the others,
  neediest first, each on the least loaded replicas with a slot left in their budget, where
  a replica that is already a planned holder costs nothing extra, one that has the adapter
  resident or in its host tier a little, and any other ``move_margin`` replicas of load.
  Planned holders that had a slot keep it first (a newcomer never takes a placement's budget,
  and no placement is put where it would overload the replica), and a
  holder stays planned while the count holds unless its replica has been overloaded (by the
  long-window demand, ``popularity_tau_s``, which also places and balances: the short window's
  noise made replicas look overloaded by turns and moved about one placement a second; more than
  ``overload_share`` above the fleet's mean load and ``overload_floor`` replicas of load) for
  ``overload_after_s``: a demand blip moves nothing, since each move is a load and an eviction
  somewhere, but a replica that joins (or a lasting imbalance) takes placements from the most
  loaded: at once for placements nothing has asked for yet (at start-up, all of them), after
  ``overload_after_s`` for those in use. A joining replica warms what it will be given. When
  no budget is left, a placement that needs ``displace_ratio`` times more than a replica's least
  needed budgeted one takes that slot's budget (the other stays planned there, loaded on demand):
  slots planned before demand was measured do not keep their budget for good. Which adapters
  deserve slots is ranked by the long-window demand too. Budget per replica: its slots, minus one
  when the planned copies do not all fit (that slot serves what the plan could not place:
  without it every such request would evict a planned adapter, which then reloads). An
  adapter that finds no budget is still planned (it will load there on demand, into the spare
  slot): where it was, else on the first replica of its rendezvous order it does not overload,
  which is where its standby copy waits in the host tier (``routing.warm_start.standby_names``),
  so its first load is a copy, and such placements spread evenly without moving. (They all went
  to the one least loaded replica before: a zero-need placement adds no load, so that replica
  stayed the least loaded, and cold adapters' long prompts queued behind each other there.)
- **Versions together.** The versions of one adapter (``name@label`` entries of a rollout,
  ``routing.identity.family_of``) serve one stream of traffic that a split moves between them: a version
  is placed where another version of its adapter was placed before it, in this pass (with budget, not
  overloading it; else by the rules above), and without budget it loads on demand there too. Placed by
  load, a new version went to the other worker: each flip moved traffic off the worker that had it, so
  requests ran in two batches of one instead of one of two (the rollout's p99 1.3x steady on 2 cores).

The plan also names the replicas its placements keep busy (planned load at least
``busy_above`` of their rows): a request never spills onto one, since its free row is only
between two of its own requests, whatever a router's partial view of its queue says.

Pure, deterministic (sorted inputs, ties by replica id), no Ray. The directory runs it; the
simulator runs the same class.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from .hashing import placement_hash, rendezvous_scores, stable_hash
from .identity import family_of
from .settings import DEFAULT_SETTINGS, RoutingSettings


@dataclass(frozen=True)
class ReplicaSlots:
    """One replica as the planner sees it (names, not uids)."""

    replica_id: str
    slots: int
    rows: int = 0                     # requests it runs at once (0: unknown, the planner's default)
    resident: frozenset = frozenset()
    pinned: frozenset = frozenset()
    warm: frozenset = frozenset()     # in the host tier: a load there is a copy, not a read


@dataclass(frozen=True)
class PlacementPlan:
    version: int = 0
    holders: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # adapter -> planned replica ids
    busy: frozenset = frozenset()  # replicas whose planned adapters keep them busy: no spill goes there
    # replica id -> the planned adapters that have a slot of its budget (the rest load on demand there): what
    # its pool keeps, so the spare slots churn among the on-demand ones instead of evicting the neediest
    slotted: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"version": self.version, "holders": {a: list(r) for a, r in self.holders.items()},
                "busy": sorted(self.busy), "slotted": {r: list(a) for r, a in self.slotted.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlacementPlan":
        return cls(int(d.get("version", 0)), {a: tuple(r) for a, r in (d.get("holders") or {}).items()},
                   frozenset(d.get("busy") or ()), {r: tuple(a) for r, a in (d.get("slotted") or {}).items()})


class FleetPlanner:
    """Keeps the plan and its hysteresis timers; ``update`` is called every few seconds."""

    def __init__(self, config: RoutingSettings = DEFAULT_SETTINGS, default_rows: int = 8):
        self.config = config
        self.default_rows = default_rows
        self.plan = PlacementPlan()
        self._count: dict[str, int] = {}       # adapter -> planned holder count
        self._since: dict[str, float] = {}     # adapter -> since when its wanted count differs from _count
        self._low_since: dict[str, float] = {}  # adapter -> since when its need is below forget_below
        self._over_since: dict[str, float] = {}  # replica -> since when its planned load is above the bound
        self._replica_ids: set[str] = set()
        self._joined_at: Optional[float] = None  # when a replica last joined (its overload sheds sooner)

    def resume(self, plan: PlacementPlan) -> None:
        """Carry on from ``plan`` as if this planner had made it with no demand measured yet: each adapter keeps
        its holder count, no hysteresis timer runs, and the replicas it names are the known set. For a fleet
        whose plan was recorded before traffic began (``benchmarks.fleet_live`` records the deploy's plan, and its
        replay starts there instead of re-enacting the order in which sixteen replicas came up)."""
        self.plan = plan
        self._count = {a: len(holders) for a, holders in plan.holders.items() if holders}
        self._since, self._low_since, self._over_since = {}, {}, {}
        self._joined_at = None
        self._replica_ids = {r for holders in plan.holders.values() for r in holders} | set(plan.slotted)

    def update(self, now: float, demand: Mapping[str, float], replicas: Sequence[ReplicaSlots],
               registered: Iterable[str] = (), rebalance_now: bool = False,
               popularity: Optional[Mapping[str, float]] = None) -> PlacementPlan:
        """A new plan (a new version only when some adapter's holders changed).

        ``demand``: adapter -> requests in service on average across the fleet. ``registered``:
        adapters that exist though no demand is measured yet; they are planned with the least need
        the plan keeps, so the first request already finds its place (no placement to correct later).
        ``rebalance_now``: overloaded replicas hand placements over at once, resident or not, as
        they will after ``overload_after_s`` (a joining replica's warm start asks what it will be
        given, to warm it before traffic). ``popularity``: the same demand averaged over a longer window
        (``popularity_tau_s``): which adapters deserve the slots is ranked by it, since a tail adapter's
        short-term demand is mostly noise (one request makes it look needy for a few seconds)."""
        replicas = sorted(replicas, key=lambda r: r.replica_id)
        if not replicas:
            return self.plan
        rows = [r.rows or self.default_rows for r in replicas]
        mean_rows = sum(rows) / len(rows)
        need = {a: d / mean_rows for a, d in demand.items() if d > 0}
        for name in registered:
            need[name] = max(need.get(name, 0.0), self.config.forget_below)
        pinned_on: dict[str, list[int]] = {}
        for i, r in enumerate(replicas):
            for name in r.pinned:
                pinned_on.setdefault(name, []).append(i)
        counts = self._counts(now, need, len(replicas), pinned_on)
        ids = {r.replica_id for r in replicas}
        joined = bool(self._replica_ids) and not ids <= self._replica_ids
        if joined:
            self._joined_at = now
        self._replica_ids = ids
        # a join moves at once only placements nothing has asked for yet (the registered ones placed
        # before it; at start-up every placement): moving those in use at once tripled p99 TTFT after
        # a scale-out in cluster_sim, so they move as overload shedding decides (overload_after_s)
        in_use = {a for a, d in demand.items() if d > 0} if joined and not rebalance_now else None
        worth = need if popularity is None else {a: d / mean_rows for a, d in popularity.items()}
        holders, load, slotted = self._assign(now, counts, need, replicas, pinned_on, rebalance_now or joined, in_use,
                                              worth)
        busy = self._busy(replicas, load)
        if holders != dict(self.plan.holders) or busy != self.plan.busy or slotted != dict(self.plan.slotted):
            self.plan = PlacementPlan(self.plan.version + 1, holders, busy, slotted)
        return self.plan

    def _busy(self, replicas: Sequence[ReplicaSlots], load: Sequence[float]) -> frozenset:
        """Replicas whose planned load is at least ``busy_above`` of their rows (and stay busy until it
        falls below ``busy_below``: the set changes rarely, so the plan's version does too)."""
        cfg, before = self.config, self.plan.busy
        return frozenset(r.replica_id for r, x in zip(replicas, load)
                         if x >= cfg.busy_above or (r.replica_id in before and x >= cfg.busy_below))

    # ------------------------------------------------------------------ how many holders

    def _counts(self, now: float, need: Mapping[str, float], n: int,
                pinned_on: Mapping[str, list[int]]) -> dict[str, int]:
        cfg = self.config
        for name in list(self._count):
            if need.get(name, 0.0) >= cfg.forget_below or name in pinned_on:
                self._low_since.pop(name, None)
            elif now - self._low_since.setdefault(name, now) >= cfg.forget_after_s:
                del self._count[name]  # out of demand for a cool-down: leaves the plan
                self._since.pop(name, None)
                self._low_since.pop(name, None)
        for name, x in need.items():
            wanted = min(n, max(1, math.ceil(x / cfg.target_utilization - 1e-9), len(pinned_on.get(name, ()))))
            current = self._count.get(name)
            if current is None:
                if x >= cfg.forget_below or name in pinned_on:
                    self._count[name] = wanted  # a first placement moves nothing
                continue
            if wanted == current:
                self._since.pop(name, None)
                continue
            delay = cfg.grow_after_s if wanted > current else cfg.shrink_after_s
            if now - self._since.setdefault(name, now) >= delay:
                self._count[name] = wanted
                self._since.pop(name, None)
        for name, on in pinned_on.items():
            self._count[name] = max(self._count.get(name, 1), len(on))
        return {a: min(c, n) for a, c in self._count.items()}

    # ------------------------------------------------------------------ which holders

    def _assign(self, now: float, counts: Mapping[str, int], need: Mapping[str, float],
                replicas: Sequence[ReplicaSlots], pinned_on: Mapping[str, list[int]],
                rebalance_now: bool = False, keep: Optional[set] = None,
                worth: Optional[Mapping[str, float]] = None
                ) -> tuple[dict[str, tuple[str, ...]], list[float], dict[str, tuple[str, ...]]]:
        cfg = self.config
        n = len(replicas)
        index = {r.replica_id: i for i, r in enumerate(replicas)}
        previous = {a: {index[r] for r in rs if r in index} for a, rs in self.plan.holders.items()}
        wanted_copies = sum(counts.values())
        spare = 1 if wanted_copies > sum(r.slots for r in replicas) else 0
        budget = [max(0, r.slots - spare) for r in replicas]
        worth = worth if worth is not None else need
        load = [0.0] * n    # planned short-window need: which replicas the plan keeps busy (``_busy``)
        steady = [0.0] * n  # planned long-window need: where placements go and what sheds (noise moves nothing)
        chosen: dict[str, list[int]] = {}
        for name in sorted(pinned_on):  # pins hold their slots wherever they are pinned
            copies = max(1, counts.get(name, 1))
            for i in pinned_on[name]:
                budget[i] -= 1
                load[i] += need.get(name, 0.0) / copies
                steady[i] += worth.get(name, 0.0) / copies
            chosen[name] = list(pinned_on[name])
        known: dict[str, set[int]] = {}  # adapter -> replicas where it is resident or in the host tier
        for i, r in enumerate(replicas):
            for name in (*r.resident, *r.warm):
                known.setdefault(name, set()).add(i)
        # least loaded (long-window need: the one load the plan balances and sheds by), with budget and anywhere
        heap = [(steady[i], i) for i in range(n) if budget[i] > 0]  # lazily updated
        anywhere = [(steady[i], i) for i in range(n)]
        heapq.heapify(heap)
        heapq.heapify(anywhere)
        no_limit = [1] * n
        hashes = np.array([stable_hash(r.replica_id) for r in replicas], dtype=np.uint64)
        # overloaded: well above the mean of the long-window need (the short window's noise made replicas look
        # overloaded by turns: offline, Zipf demand over 16 replicas moved ~4 placements a second)
        mean = sum(worth.get(a, 0.0) for a in counts) / n
        overloaded = mean + max(cfg.overload_share * mean, cfg.overload_floor)
        after_join = self._joined_at is not None and now - self._joined_at < cfg.overload_after_s
        shed_after = min(cfg.join_shed_after_s, cfg.overload_after_s) if after_join else cfg.overload_after_s
        shedding = {i for i, r in enumerate(replicas)
                    if rebalance_now or now - self._over_since.get(r.replica_id, now) >= shed_after}
        order = sorted((a for a in counts if a not in pinned_on or counts[a] > len(pinned_on[a])),
                       key=lambda a: (-need.get(a, 0.0), a))
        share = {a: need.get(a, 0.0) / counts[a] for a in order}
        steady_share = {a: worth.get(a, 0.0) / counts[a] for a in order}
        # what a placement's slot is worth when slots are short: its long-window need per copy, never below
        # forget_below (a registered adapter nobody asked for yet is worth the least the plan keeps)
        value = {a: max(worth.get(a, 0.0), cfg.forget_below) / counts[a] for a in order}
        versions: dict[str, list[str]] = {}  # an adapter's family -> its planned versions (rollouts: two, briefly)
        for name in sorted(counts):
            versions.setdefault(family_of(name), []).append(name)

        def with_family(name: str) -> list[int]:
            """Replicas another version of ``name``'s adapter is placed on so far (in placement order)."""
            return list(dict.fromkeys(i for other in versions[family_of(name)] if other != name
                                      for i in chosen.get(other, ())))

        slotted: list[dict[str, float]] = [{} for _ in range(n)]  # replica -> budgeted placements and their shares

        def take(name: str, i: int, budgeted: bool = True) -> None:
            chosen.setdefault(name, []).append(i)
            load[i] += share[name]
            steady[i] += steady_share[name]
            heapq.heappush(anywhere, (steady[i], i))
            if budgeted:
                budget[i] -= 1
                slotted[i][name] = value[name]
                heapq.heappush(heap, (steady[i], i))

        def displace(name: str, picked: list, cost) -> Optional[int]:
            """No budget left: the replica whose least needed budgeted placement ``name`` needs
            ``displace_ratio`` times more gives that slot's budget up (the placement stays planned
            there, loaded on demand). Without this, slots planned before any demand was measured
            (every registered adapter at start-up) keep their budget for good and a hot adapter never
            gets a second holder."""
            best = None  # (cost, replica, its victim)
            for i in range(n):
                if i in picked or not slotted[i] or steady[i] + steady_share[name] > overloaded:
                    continue  # (never onto a replica it would overload: it would shed it again, a move each way)
                victim = min(slotted[i], key=lambda a: (slotted[i][a], a))
                if slotted[i][victim] * cfg.displace_ratio < value[name] and (best is None or cost(i) < best[0]):
                    best = (cost(i), i, victim)
            if best is None:
                return None
            _, i, victim = best
            del slotted[i][victim]
            budget[i] += 1
            return i

        # first every planned holder that had a slot keeps it, the most valuable first (so no placement loses its
        # budget to a newcomer, only to one displace_ratio times more valuable), except on a replica that has been
        # overloaded for overload_after_s (or just joined by another): it keeps what fits, and what ``keep`` names.
        # A holder that loaded on demand stays where it is (below) unless a slot is free or it displaces one.
        had_slot = {(a, index[r]) for r, names in self.plan.slotted.items() if r in index for a in names}
        slots_known = bool(self.plan.slotted)  # a plan from before slots were named: every holder may keep its slot
        for name in sorted(order, key=lambda a: (-value[a], a)):
            picked = chosen.setdefault(name, [])
            for i in sorted(previous.get(name, ()), key=lambda i: replicas[i].replica_id):
                if slots_known and (name, i) not in had_slot:
                    continue
                if len(picked) < counts[name] and budget[i] > 0 and i not in picked and (
                        i not in shedding or steady[i] + steady_share[name] <= overloaded
                        or (keep is not None and name in keep)):
                    take(name, i)
        # then the holders still missing, the cheapest first
        for name in order:
            k, picked, prev = counts[name], chosen[name], previous.get(name, set())
            cost = lambda i: (steady[i] + _move_cost(name, i, prev, replicas, cfg.move_margin),  # noqa: E731
                              replicas[i].replica_id)
            family = with_family(name)
            while len(picked) < k:
                cands = {i for i in family if budget[i] > 0 and i not in picked
                         and steady[i] + steady_share[name] <= overloaded}   # with its other versions first
                if not cands:
                    cands = {i for i in known.get(name, set()) if budget[i] > 0}
                    cands.update(_least_loaded(heap, steady, budget, k + 2))
                    cands.difference_update(picked)
                    cands = {i for i in cands if steady[i] + steady_share[name] <= overloaded}
                target = min(cands, key=cost) if cands else displace(name, picked, cost)
                if target is None:
                    break
                take(name, target)
            if not picked:  # no budget anywhere: loaded on demand where it was planned, else its rendezvous-first
                # replica that it does not overload (where its standby copy waits); one that adds no load never moves
                kept = [i for i in prev if i not in shedding] or [i for i in family if i not in shedding]
                target = min(kept, key=cost) if kept else _first_fitting(
                    name, hashes, lambda i: steady[i] + steady_share[name] <= overloaded)
                if target is None:
                    target = min(_least_loaded(anywhere, steady, no_limit, 2), key=cost)
                take(name, target, budgeted=False)
        for i, r in enumerate(replicas):
            if steady[i] > overloaded:
                self._over_since.setdefault(r.replica_id, now)
            else:
                self._over_since.pop(r.replica_id, None)
        holders = {name: tuple(sorted(replicas[i].replica_id for i in picked))
                   for name, picked in sorted(chosen.items()) if picked}
        for name, on in pinned_on.items():  # a pin holds its slot
            for i in on:
                slotted[i][name] = float("inf")
        return holders, load, {replicas[i].replica_id: tuple(sorted(s)) for i, s in enumerate(slotted) if s}


def _move_cost(name: str, i: int, previous: set, replicas: Sequence[ReplicaSlots], margin: float) -> float:
    if i in previous:
        return 0.0
    r = replicas[i]
    if name in r.resident:
        return 0.25 * margin
    if name in r.warm:
        return 0.5 * margin
    return margin


def _first_fitting(name: str, hashes: np.ndarray, fits) -> Optional[int]:
    """The first replica in ``name``'s rendezvous order (``hashes``: the replicas' ids hashed, in plan order)
    for which ``fits(i)``, or None."""
    scores = rendezvous_scores(placement_hash(name), hashes)
    first = int(np.argmax(scores))  # as ``routing.warm_start.standby_names`` picks; usually it fits (no sort)
    if fits(first):
        return first
    for i in np.argsort(scores, kind="stable")[::-1].tolist():
        if i != first and fits(i):
            return i
    return None


def _least_loaded(heap: list, load: Sequence[float], budget: Sequence[int], m: int) -> list[int]:
    """The ``m`` least loaded replicas that still have budget (lazy heap: stale entries are dropped)."""
    out: list[int] = []
    keep: list[tuple[float, int]] = []
    while heap and len(out) < m:
        value, i = heapq.heappop(heap)
        if budget[i] <= 0 or value != load[i] or i in out:
            continue
        out.append(i)
        keep.append((value, i))
    for entry in keep:
        heapq.heappush(heap, entry)
    return out


def planned_on(plan: PlacementPlan, replica_id: str) -> list[str]:
    """The adapters the plan places on ``replica_id``, by name."""
    return sorted(name for name, holders in plan.holders.items() if replica_id in holders)


def holder_moves(old: PlacementPlan, new: PlacementPlan) -> Mapping[str, int]:
    """Per adapter, the holders ``new`` adds to one ``old`` already planned (a move or a new copy,
    each a load somewhere); an adapter's first placement is not a move."""
    moves: dict[str, int] = {}
    for name, holders in new.holders.items():
        previous = old.holders.get(name)
        if previous:
            added = len(set(holders) - set(previous))
            if added:
                moves[name] = added
    return moves
