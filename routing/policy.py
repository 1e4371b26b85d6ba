"""The routing decision as a pure function of (adapter, view, loads, config).

1. Replicas that hold the adapter and stay under the load bound, least loaded first
   ("affinity").
   Holders over the bound come next: Ray Serve moves past a tier only when all its
   replicas are at ``max_ongoing_requests`` (a "full_spill", counted by the router), and
   then only to replicas with a free slot until the request has waited ``spill_wait_s``.
2. Holders all over the bound: the first replica in the adapter's hash order that is under
   the bound and has a free slot takes it ("spill": a hot adapter gets replicated without
   evicting anyone); with no such replica the holders stay first.
3. No holder: bounded-load rendezvous hashing — replicas in the adapter's hash order; the
   first whose load stays <= ceil((1+eps) * (total+1) / n) wins, preferring, among the
   first ``placement_lookahead`` such replicas, a free slot, then a host-tier copy
   ("placement").
4. Base-model requests go to the least loaded replicas ("base").

Routers that share a view choose the same replica without talking to each other. Later
tiers are fallbacks: Ray Serve tries them when a replica of an earlier tier is full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

import numpy as np

from .hashing import rendezvous_scores, stable_hash


@dataclass(frozen=True)
class RoutingConfig:
    load_bound_epsilon: float = 0.25
    min_load_bound: int = 0  # a floor for the bound: batching makes a few more requests nearly free
    placement_lookahead: int = 2
    fallback_width: int = 4
    spill_wait_s: float = 1.0  # how long a request waits for a full holder before it may evict elsewhere


@dataclass
class RoutingDecision:
    tiers: list[list[int]]  # replica indexes into the view, most preferred tier first
    kind: str               # affinity | placement | spill | base


@dataclass
class FleetView:
    """The replicas a router may choose from, with what it believes each one holds.

    ``holders`` / ``warm`` map an adapter name to replica indexes: warm means a free slot
    or the adapter in the host tier (a cheap place to load it).
    """

    replica_ids: tuple[str, ...]
    holders: Mapping[str, Collection[int]] = field(default_factory=dict)
    warm: Mapping[str, Collection[int]] = field(default_factory=dict)
    free_slots: Optional[np.ndarray] = None  # free slot count per replica

    def __post_init__(self) -> None:
        self.hashes = np.fromiter((stable_hash(r) for r in self.replica_ids), dtype=np.uint64,
                                  count=len(self.replica_ids))
        self.index = {r: i for i, r in enumerate(self.replica_ids)}
        if self.free_slots is None:
            self.free_slots = np.zeros(len(self.replica_ids), dtype=np.int64)


def load_bound(loads: np.ndarray, epsilon: float, floor: int = 0) -> float:
    return max(math.ceil((1.0 + epsilon) * (float(loads.sum()) + 1.0) / len(loads)), floor)


def choose_replicas(adapter: Optional[str], view: FleetView, loads: Sequence[float] | np.ndarray,
                    config: RoutingConfig = RoutingConfig(), waited_s: float = 0.0) -> RoutingDecision:
    n = len(view.replica_ids)
    if n == 0:
        return RoutingDecision([], "none")
    loads = np.asarray(loads, dtype=np.float64)
    bound = load_bound(loads, config.load_bound_epsilon, config.min_load_bound)
    if adapter is None:
        return RoutingDecision(_least_loaded_tiers(loads, None, config), "base")

    scores = rendezvous_scores(stable_hash(adapter), view.hashes)
    holders = sorted((i for i in view.holders.get(adapter, ()) if i < n), key=lambda i: (loads[i], -int(scores[i])))
    if holders:
        under = [i for i in holders if loads[i] + 1 <= bound]
        if not under:
            # every holder is over the bound: replicate onto a free slot (no eviction) if one is under it
            target = _rendezvous_target(adapter, view, loads, scores, bound, config, exclude=set(holders),
                                        require_free=True)
            if target is not None:
                return RoutingDecision([[target], holders, *_least_loaded_tiers(loads, _without(n, target, *holders),
                                                                                        config)], "spill")
        # holders first, least loaded first; Serve moves past them only when all are at max_ongoing_requests,
        # and then only to a free slot, until the request has waited spill_wait_s (evicting for it before that
        # would thrash a working set that fits)
        over = [i for i in holders if i not in under]
        tiers = [t for t in (under, over) if t]
        free_only = waited_s < config.spill_wait_s
        return RoutingDecision([*tiers, *_fallback_tiers(loads, scores, bound, set(holders), config, view, free_only)],
                               "affinity")
    target = _rendezvous_target(adapter, view, loads, scores, bound, config)
    return RoutingDecision([[target], *_least_loaded_tiers(loads, _without(n, target), config)], "placement")


def _without(n: int, *excluded: int) -> np.ndarray:
    allowed = np.ones(n, dtype=bool)
    allowed[list(excluded)] = False
    return allowed


def _rendezvous_target(adapter: str, view: FleetView, loads: np.ndarray, scores: np.ndarray, bound: float,
                       config: RoutingConfig, exclude: set[int] = frozenset(),
                       require_free: bool = False) -> Optional[int]:
    """The first replica in ``adapter``'s hash order under the bound; within the lookahead a free
    slot wins (no eviction), then a host-tier copy (a cheap load). ``require_free``: only free slots."""
    ok = loads + 1 <= bound  # never empty without exclusions: the least loaded replica is at most the mean
    if exclude:
        ok[list(exclude)] = False
    if require_free:
        ok &= view.free_slots > 0
    if not ok.any():
        return None
    masked = np.where(ok, scores, np.uint64(0))
    k = min(config.placement_lookahead, int(ok.sum()))
    if k <= 1:
        return int(np.argmax(masked))
    top = np.argpartition(masked, len(masked) - k)[-k:]
    top = [int(i) for i in top[np.argsort(masked[top])[::-1]]]
    warm = view.warm.get(adapter, ())
    for i in top:
        if view.free_slots[i]:
            return i
    for i in top:
        if i in warm:
            return i
    return top[0]


def _fallback_tiers(loads: np.ndarray, scores: np.ndarray, bound: float, exclude: set[int],
                    config: RoutingConfig, view: FleetView, free_only: bool) -> list[list[int]]:
    """Where a request goes if every holder is full: its rendezvous replica, then the least loaded
    (with ``free_only``, only replicas with a free slot: no eviction)."""
    allowed = (view.free_slots > 0) if free_only else np.ones(len(loads), dtype=bool)
    if exclude:
        allowed[list(exclude)] = False
    ok = allowed & (loads + 1 <= bound)
    tiers = []
    if ok.any():
        target = int(np.argmax(np.where(ok, scores, np.uint64(0))))
        tiers.append([target])
        allowed[target] = False
    return tiers + _least_loaded_tiers(loads, allowed, config)


def _least_loaded_tiers(loads: np.ndarray, allowed: Optional[np.ndarray], config: RoutingConfig) -> list[list[int]]:
    """Up to ``fallback_width`` allowed replicas, least loaded first, as two tiers (a pair, then the rest)."""
    candidates = loads if allowed is None else np.where(allowed, loads, np.inf)
    n = len(candidates)
    width = min(config.fallback_width, n)
    idx = np.argpartition(candidates, width - 1)[:width] if width < n else np.arange(n)
    idx = sorted((int(i) for i in idx if candidates[i] != np.inf), key=lambda i: (loads[i], i))
    if not idx:
        return []
    return [idx[:2], idx[2:]] if len(idx) > 2 else [idx]
