"""The routing decision as a pure function of (adapter, view, loads, config).

1. Replicas that hold the adapter and stay under the load bound, least loaded first
   ("affinity").
2. Otherwise bounded-load rendezvous hashing: replicas in the adapter's hash order; the
   first whose load stays <= ceil((1+eps) * (total+1) / n) wins, preferring, among the
   first ``placement_lookahead`` such replicas, one with a free slot or the adapter in its
   host tier ("placement"; "spill" when holders exist but are all over the bound — which
   is how a hot adapter gets replicated: its next replica in hash order takes the excess).
3. Base-model requests go to the least loaded replicas ("base").

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
    free_slots: Optional[np.ndarray] = None  # bool per replica

    def __post_init__(self) -> None:
        self.hashes = np.fromiter((stable_hash(r) for r in self.replica_ids), dtype=np.uint64,
                                  count=len(self.replica_ids))
        self.index = {r: i for i, r in enumerate(self.replica_ids)}
        if self.free_slots is None:
            self.free_slots = np.zeros(len(self.replica_ids), dtype=bool)


def load_bound(loads: np.ndarray, epsilon: float, floor: int = 0) -> float:
    return max(math.ceil((1.0 + epsilon) * (float(loads.sum()) + 1.0) / len(loads)), floor)


def choose_replicas(adapter: Optional[str], view: FleetView, loads: Sequence[float] | np.ndarray,
                    config: RoutingConfig = RoutingConfig()) -> RoutingDecision:
    n = len(view.replica_ids)
    if n == 0:
        return RoutingDecision([], "none")
    loads = np.asarray(loads, dtype=np.float64)
    bound = load_bound(loads, config.load_bound_epsilon, config.min_load_bound)
    if adapter is None:
        return RoutingDecision(_least_loaded_tiers(loads, view.hashes, set(), config), "base")

    scores = rendezvous_scores(stable_hash(adapter), view.hashes)
    holders = [i for i in view.holders.get(adapter, ()) if i < n]
    under = [i for i in holders if loads[i] + 1 <= bound]
    if under:
        under.sort(key=lambda i: (loads[i], -int(scores[i])))
        return RoutingDecision([under, *_fallback_tiers(loads, scores, bound, set(under), config)], "affinity")

    target = _rendezvous_target(adapter, view, loads, scores, bound, config)
    over = sorted(holders, key=lambda i: loads[i])
    tiers = [[target]]
    if over:
        tiers.append(over)
    tiers.extend(_least_loaded_tiers(loads, view.hashes, {target, *over}, config))
    return RoutingDecision(tiers, "spill" if holders else "placement")


def _rendezvous_target(adapter: str, view: FleetView, loads: np.ndarray, scores: np.ndarray, bound: float,
                       config: RoutingConfig) -> int:
    ok = loads + 1 <= bound  # never empty: the least loaded replica is at most the mean
    masked = np.where(ok, scores, np.uint64(0))
    k = min(config.placement_lookahead, int(ok.sum()))
    if k <= 1:
        return int(np.argmax(masked))
    top = np.argpartition(masked, len(masked) - k)[-k:]
    top = top[np.argsort(masked[top])[::-1]]
    warm = view.warm.get(adapter, ())
    for i in top:
        if int(i) in warm or view.free_slots[i]:
            return int(i)
    return int(top[0])


def _fallback_tiers(loads: np.ndarray, scores: np.ndarray, bound: float, exclude: set[int],
                    config: RoutingConfig) -> list[list[int]]:
    """Where a request goes if every holder is full: its rendezvous replica, then the least loaded."""
    ok = (loads + 1 <= bound)
    if exclude:
        ok[list(exclude)] = False
    tiers = []
    if ok.any():
        target = int(np.argmax(np.where(ok, scores, np.uint64(0))))
        tiers.append([target])
        exclude = exclude | {target}
    return tiers + _least_loaded_tiers(loads, None, exclude, config)


def _least_loaded_tiers(loads: np.ndarray, hashes: Optional[np.ndarray], exclude: set[int],
                        config: RoutingConfig) -> list[list[int]]:
    n = len(loads)
    width = min(config.fallback_width, n)
    candidates = loads.copy()
    if exclude:
        candidates[list(exclude)] = np.inf
    if width < n:
        idx = np.argpartition(candidates, width - 1)[:width]
    else:
        idx = np.arange(n)
    idx = [int(i) for i in idx if candidates[i] != np.inf]
    idx.sort(key=lambda i: (loads[i], i))
    if not idx:
        return []
    return [idx[:2], idx[2:]] if len(idx) > 2 else [idx]
