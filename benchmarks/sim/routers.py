"""The routers the simulator compares.

``affinity`` is this project's router: ``routing.view.RouterView`` (fed by the real
``AdapterDirectory``'s deltas, plus its own optimistic decisions) and
``routing.policy.choose_replicas``; the request goes to the first replica of the first
tier that is below ``max_ongoing_requests`` (Ray Serve skips a full replica and tries the
next tier), else it backs off and retries.

The baselines are small implementations of other routers' logic (the comparison, not the
product):

- ``multiplex``: Ray Serve 2.60 model multiplexing, following
  ``ray/serve/_private/request_router/request_router.py`` (``apply_multiplex_routing``)
  and ``pow_2_router.py``: while a request is younger than a matching timeout drawn
  uniformly from 1-2 s at every attempt, its first attempt goes to replicas whose model
  set holds the adapter (or, when none does and the adapter is not yet marked as
  fallen back, to the replicas with the fewest models); later attempts inside the
  timeout go to the replicas with the fewest models; after it, the fewest-models
  replicas once, then all replicas. Each attempt picks two random candidates and takes
  the less loaded one that is not full. The model set is the pool's resident set as seen
  through the same lagged directory feed (no optimistic updates: Serve has none).
- ``least_loaded``: the replica with the fewest ongoing requests (ties random).
- ``hash``: plain consistent (rendezvous) hashing on the adapter, no load bound: the
  first replica in the adapter's hash order that is not full.
- ``random``: a uniformly random replica that is not full.

Every router backs off like Serve (25 ms doubling to 0.5 s) when it finds no replica.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

import numpy as np

from routing.hashing import rendezvous_scores, stable_hash
from routing.policy import FleetView, RoutingConfig, choose_replicas
from routing.view import RouterView

if TYPE_CHECKING:  # pragma: no cover
    from .fleet import Simulator, SimRequest

class Router(ABC):
    name = "base"
    uses_view = False

    def __init__(self, sim: "Simulator"):
        self.sim = sim
        self.rng = np.random.default_rng(sim.config.seed + 7919)
        self.kinds: dict[str, int] = {}

    @abstractmethod
    def route(self, req: "SimRequest", now: float) -> Optional[int]:
        """The replica index for ``req`` now, or None when every replica is full (it waits)."""

    def apply_directory_reply(self, reply: Mapping) -> None:  # pragma: no cover - view routers only
        pass

    def _count(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


class _ViewRouter(Router):
    """A router fed by the directory through a real ``RouterView`` (lagged by the simulator)."""

    uses_view = True

    def __init__(self, sim: "Simulator"):
        super().__init__(sim)
        self.view = RouterView(ttl_s=sim.config.optimistic_ttl_s, clock=lambda: sim.now)

    def apply_directory_reply(self, reply: Mapping) -> None:
        self.view.apply_directory_reply(reply)


class AffinityRouter(_ViewRouter):
    """This project's router: RouterView + choose_replicas, first non-full replica of the first tier."""

    name = "affinity"

    def __init__(self, sim: "Simulator"):
        super().__init__(sim)
        self.config = RoutingConfig(load_bound_epsilon=sim.config.load_bound_epsilon,
                                    placement_lookahead=sim.config.placement_lookahead)

    def route(self, req, now):
        sim = self.sim
        ongoing, cap = sim.ongoing, sim.max_ongoing
        decision = choose_replicas(req.uid, self.view.fleet_view(sim.ids, req.uid), ongoing, self.config,
                                   now - req.arrival)
        for rank, tier in enumerate(decision.tiers):
            for i in tier:
                if ongoing[i] < cap:
                    self._count(decision.kind if rank == 0 else "full_spill")
                    self.view.record_decision(req.uid, sim.ids[i])
                    return i
        self._count("all_full")
        return None


class MultiplexRouter(_ViewRouter):
    """Ray Serve's multiplexed-model routing (see the module docstring)."""

    name = "multiplex"

    def __init__(self, sim: "Simulator"):
        super().__init__(sim)
        self.fallback_match: set[str] = set()
        self._fewest_for: Optional[FleetView] = None
        self._fewest: np.ndarray = np.arange(len(sim.ids))
        self.timeout_s = sim.config.multiplex_timeout_s

    def _fewest_models(self, fv: FleetView) -> np.ndarray:
        if fv is not self._fewest_for:
            states = self.view.states
            counts = np.fromiter((len(states.get(r, {}).get("resident", ())) for r in self.sim.ids),
                                 dtype=np.int64, count=len(self.sim.ids))
            self._fewest = np.flatnonzero(counts == counts.min())
            self._fewest_for = fv
        return self._fewest

    def route(self, req, now):
        sim, rng = self.sim, self.rng
        fv = self.view.fleet_view(sim.ids)  # no adapter: the cached view, no optimistic overlay
        if req.mux_start is None:
            req.mux_start = now
        timeout = rng.uniform(self.timeout_s, 2 * self.timeout_s)
        if now - req.mux_start < timeout:
            holders = fv.holders.get(req.uid, ())
            if (not holders and req.uid not in self.fallback_match) or req.mux_tried_first:
                cands, kind = self._fewest_models(fv), "fewest"
                self.fallback_match.add(req.uid)
            else:
                if holders:
                    self.fallback_match.discard(req.uid)
                cands, kind = np.fromiter(holders, dtype=np.int64, count=len(holders)), "holder"
            req.mux_tried_first = True
        elif not req.mux_tried_fewest:
            cands, kind = self._fewest_models(fv), "fewest"
            req.mux_tried_fewest = True
        else:
            cands, kind = None, "any"
        n = len(sim.ids) if cands is None else len(cands)
        if n == 0:
            self._count("no_candidates")
            return None
        if n == 1:
            picks = [0]
        else:
            i = int(rng.integers(n))
            j = int(rng.integers(n - 1))
            picks = [i, j + (j >= i)]
        chosen = [p if cands is None else int(cands[p]) for p in picks]
        ongoing, cap = sim.ongoing, sim.max_ongoing
        ok = [c for c in chosen if ongoing[c] < cap]
        if not ok:
            self._count(f"{kind}_full")
            return None
        best = min(ok, key=lambda c: ongoing[c])
        self._count(kind)
        return best


class LeastLoadedRouter(Router):
    name = "least_loaded"

    def route(self, req, now):
        ongoing = self.sim.ongoing
        m = ongoing.min()
        if m >= self.sim.max_ongoing:
            return None
        cands = np.flatnonzero(ongoing == m)
        return int(cands[self.rng.integers(len(cands))]) if len(cands) > 1 else int(cands[0])


class HashRouter(Router):
    """Plain rendezvous hashing on the adapter name (the hash ``routing.hashing`` uses), no load bound."""

    name = "hash"

    def __init__(self, sim):
        super().__init__(sim)
        self.hashes = np.fromiter((stable_hash(r) for r in sim.ids), dtype=np.uint64, count=len(sim.ids))

    def route(self, req, now):
        ongoing = self.sim.ongoing
        scores = rendezvous_scores(stable_hash(req.uid), self.hashes)
        i = int(np.argmax(np.where(ongoing < self.sim.max_ongoing, scores, np.uint64(0))))
        return i if ongoing[i] < self.sim.max_ongoing else None


class RandomRouter(Router):
    name = "random"

    def route(self, req, now):
        ongoing, cap = self.sim.ongoing, self.sim.max_ongoing
        n = len(ongoing)
        for _ in range(4):
            i = int(self.rng.integers(n))
            if ongoing[i] < cap:
                return i
        free = np.flatnonzero(ongoing < cap)
        return int(free[self.rng.integers(len(free))]) if len(free) else None


ROUTERS: dict[str, type[Router]] = {
    r.name: r for r in (AffinityRouter, MultiplexRouter, LeastLoadedRouter, HashRouter, RandomRouter)
}
