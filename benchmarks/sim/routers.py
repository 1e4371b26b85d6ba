"""The routers the simulator compares.

``affinity`` is this project's router: ``routing.view.RouterView`` (fed by the real
``AdapterDirectory``'s deltas and placement plan, plus its own optimistic decisions), the same
``routing.router_state.LocalRouterState`` the Serve router keeps (requests in flight and
their adapters, request times, demand) and ``routing.policy.choose_replicas``. A request
whose best replica is full waits for capacity, as in ``routing.ray_router``: it decides
again, oldest first, when a request completes (one router: no polling).

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
  the less loaded one that is not full. The model set is what each replica's multiplexer
  pushes every 100 ms (``ray/serve/multiplex.py``: its loaded models and the ones it is
  loading or queued to load), not the pool's slots (no optimistic updates: Serve has none).
- ``pow2``: Serve's default router (``pow_2_router.py``): two distinct random replicas,
  the less loaded one that is not full.
- ``least_loaded``: the replica with the fewest ongoing requests (ties random).
- ``hash``: plain consistent (rendezvous) hashing on the adapter, no load bound: the
  first replica in the adapter's hash order that is not full.
- ``random``: a uniformly random replica that is not full.

Every other router backs off like Serve (25 ms doubling to 0.5 s) when it finds no replica.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Optional, Protocol

import numpy as np

from routing.hashing import rendezvous_scores, stable_hash
from routing.policy import choose_replicas
from routing.settings import DEFAULT_SETTINGS
from routing.router_state import LocalRouterState
from routing.view import RouterView

from .config import SimConfig, SimRequest


class Fleet(Protocol):
    """What a router reads from the simulated fleet (the event loop in ``fleet`` implements it)."""

    ids: tuple[str, ...]
    ongoing: np.ndarray
    seen_ongoing: np.ndarray   # what the product's router reads as each replica's count (Serve's cache, when modelled)
    accepts_later: bool        # True: a send may be refused; the product's router records it only once accepted
    max_ongoing: int
    now: float
    config: SimConfig


class Router(ABC):
    name = "base"
    uses_view = False
    waits_for_capacity = False  # True: a request it cannot place now waits for a completion, not a backoff
    follows_plan = False  # True: the product's replicas follow the directory's plan (read-ahead, kept adapters)
    multiplexed_worker = False  # True: its replicas run the multiplexing baseline's worker (Serve's model LRU)
    wants_model_ids = False  # True: it routes on the replicas' pushed multiplexed model ids (``model_ids_pushed``)

    def __init__(self, sim: Fleet):
        self.sim = sim
        self.rng = np.random.default_rng(sim.config.seed + 7919)
        self.kinds: dict[str, int] = {}

    @abstractmethod
    def route(self, req: SimRequest, now: float) -> Optional[int]:
        """The replica index for ``req`` now, or None when every replica is full (it waits)."""

    def finished(self, req: SimRequest) -> None:
        """``req`` completed on its replica (routers that learn from their traffic)."""

    def apply_directory_reply(self, reply: Mapping) -> None:  # pragma: no cover - view routers only
        pass

    def replicas_changed(self) -> None:
        """``sim.ids`` changed (scale events): per-replica tables follow it."""

    def _count(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


class _ViewRouter(Router):
    """A router fed by the directory through a real ``RouterView`` (lagged by the simulator)."""

    uses_view = True

    def __init__(self, sim: Fleet):
        super().__init__(sim)
        self.view = RouterView(ttl_s=sim.config.optimistic_ttl_s, clock=lambda: sim.now)

    def apply_directory_reply(self, reply: Mapping) -> None:
        self.view.apply_directory_reply(reply)


class AffinityRouter(_ViewRouter):
    """This project's router: RouterView + LocalRouterState + choose_replicas (see the module docstring)."""

    name = "affinity"
    waits_for_capacity = True
    follows_plan = True

    def __init__(self, sim: Fleet):
        super().__init__(sim)
        cfg, costs = sim.config, sim.config.costs
        host_s, disk_s = cfg.prior_load_s or (costs.load_seconds(16, True), costs.load_seconds(16, False))
        request_s = cfg.prior_request_s or costs.service_seconds(256, 256)
        # the run's routing settings; the tie from load_bound_epsilon where the run left tie_epsilon at its default
        tie = cfg.routing.tie_epsilon if cfg.routing.tie_epsilon != DEFAULT_SETTINGS.tie_epsilon else cfg.load_bound_epsilon
        self.config = replace(cfg.routing, tie_epsilon=tie, host_load_s=host_s, disk_load_s=disk_s,
                              default_request_s=request_s)
        self.local = LocalRouterState(clock=lambda: sim.now)
        self.caps = [float(sim.max_ongoing)] * len(sim.ids)
        self.waiting: Counter = Counter()  # adapter -> requests waiting for a planned row (as the live router)
        self._counted: set[int] = set()
        self._line: list[int] = []  # waiting requests by arrival (a lazy heap: routed ones are dropped when on top)

    def replicas_changed(self):
        self.caps = [float(self.sim.max_ongoing)] * len(self.sim.ids)

    def route(self, req, now):
        sim, local = self.sim, self.local
        ids = sim.ids
        loads = sim.seen_ongoing
        decision = choose_replicas(req.uid, self.view.fleet_view(ids, req.uid), loads, self.config,
                                   caps=self.caps, request_s=local.request_s_by_index(ids),
                                   active=local.active_by_index(ids), demand=local.demand,
                                   last_used=local.last_used_by_index(ids),
                                   batch_slowdown=local.batch_slowdown(), waited_s=now - req.arrival,
                                   first_in_line=req.i in self._counted and req.i == self._oldest(),
                                   waiting=self.waiting, full_at=local.full_at_by_index(ids), now=now,
                                   prefill_wait=local.prefill_wait_by_index(ids))
        if not decision.tiers:
            self._count("wait")
            if req.i not in self._counted:
                self._counted.add(req.i)
                heapq.heappush(self._line, req.i)
                self.waiting[req.uid] += 1
            return None
        if req.i in self._counted:
            self._counted.discard(req.i)
            self.waiting[req.uid] -= 1
            if not self.waiting[req.uid]:
                del self.waiting[req.uid]
        i = decision.tiers[0][0]
        if loads[i] + 1 >= self.caps[i]:  # this dispatch fills it (the one router sees every send)
            local.saw_full(ids[i])
        self._count(decision.kind)
        req.kind = decision.kind
        if not sim.accepts_later:
            self.accepted(req, i)
        return i

    def accepted(self, req, i: int) -> None:
        """Replica ``i`` took ``req`` (the live router's ``on_request_routed``): its view and local state count it."""
        rid = self.sim.ids[i]
        self.view.record_decision(req.uid, rid)
        self.local.routed(str(req.i), rid, req.uid, req.in_len,
                          self.view.prefill_s_per_token(rid) or self.config.prefill_s_per_token)

    def finished(self, req):
        self.local.completed(str(req.i))

    def _oldest(self) -> Optional[int]:
        """The oldest request waiting in this router (as the live router's line)."""
        while self._line and self._line[0] not in self._counted:
            heapq.heappop(self._line)
        return self._line[0] if self._line else None


class MultiplexRouter(Router):
    """Ray Serve's multiplexed-model routing (see the module docstring)."""

    name = "multiplex"
    multiplexed_worker = True
    wants_model_ids = True

    def __init__(self, sim: Fleet):
        super().__init__(sim)
        self.fallback_match: set[str] = set()
        self.model_ids: list[frozenset[str]] = [frozenset()] * len(sim.ids)
        self.holders: dict[str, list[int]] = {}
        self._fewest: np.ndarray = np.arange(len(sim.ids))
        self.timeout_s = sim.config.multiplex_timeout_s

    def replicas_changed(self):
        self.model_ids_pushed([frozenset()] * len(self.sim.ids))

    def model_ids_pushed(self, model_ids: list[frozenset[str]]) -> None:
        """Each routable replica's loaded and loading models, as Serve's replicas push them to the
        controller (every 100 ms when they change) and the controller to the routers."""
        self.model_ids = model_ids
        holders: dict[str, list[int]] = {}
        for i, ids in enumerate(model_ids):
            for uid in ids:
                holders.setdefault(uid, []).append(i)
        self.holders = holders
        counts = np.fromiter((len(ids) for ids in model_ids), dtype=np.int64, count=len(model_ids))
        self._fewest = np.flatnonzero(counts == counts.min())

    def candidates(self, req, now) -> tuple[list[int], str]:
        """Serve's two random candidates for ``req`` (among its model's holders while the match lasts) and which
        set they came from; the choice between them is ``route``'s (exact counts) or Serve's cache's."""
        sim, rng = self.sim, self.rng
        if req.mux_start is None:
            req.mux_start = now
        timeout = rng.uniform(self.timeout_s, 2 * self.timeout_s)
        if now - req.mux_start < timeout:
            holders = self.holders.get(req.uid, ())
            if (not holders and req.uid not in self.fallback_match) or req.mux_tried_first:
                cands, kind = self._fewest, "fewest"
                self.fallback_match.add(req.uid)
            else:
                if holders:
                    self.fallback_match.discard(req.uid)
                cands, kind = np.fromiter(holders, dtype=np.int64, count=len(holders)), "holder"
            req.mux_tried_first = True
        elif not req.mux_tried_fewest:
            cands, kind = self._fewest, "fewest"
            req.mux_tried_fewest = True
        else:
            cands, kind = None, "any"
        n = len(sim.ids) if cands is None else len(cands)
        if n == 0:
            self._count("no_candidates")
            return [], kind
        if n == 1:
            picks = [0]
        else:
            i = int(rng.integers(n))
            j = int(rng.integers(n - 1))
            picks = [i, j + (j >= i)]
        return [p if cands is None else int(cands[p]) for p in picks], kind

    def route(self, req, now):
        chosen, kind = self.candidates(req, now)
        ongoing, cap = self.sim.ongoing, self.sim.max_ongoing
        ok = [c for c in chosen if ongoing[c] < cap]
        if not ok:
            if chosen:
                self._count(f"{kind}_full")
            return None
        self._count(kind)
        return min(ok, key=lambda c: ongoing[c])


class Pow2Router(Router):
    """Ray Serve's default: two distinct random replicas, the less loaded that is not full."""

    name = "pow2"

    def candidates(self, req, now) -> tuple[list[int], str]:
        """Two distinct random replicas (the only one on a fleet of one)."""
        n = len(self.sim.ongoing)
        if n == 1:
            return [0], "pow2"
        i = int(self.rng.integers(n))
        j = int(self.rng.integers(n - 1))
        return [i, j + (j >= i)], "pow2"

    def route(self, req, now):
        ongoing, cap = self.sim.ongoing, self.sim.max_ongoing
        ok = [c for c in self.candidates(req, now)[0] if ongoing[c] < cap]
        return min(ok, key=lambda c: ongoing[c]) if ok else None


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

    def __init__(self, sim: Fleet):
        super().__init__(sim)
        self.replicas_changed()

    def replicas_changed(self):
        ids = self.sim.ids
        self.hashes = np.fromiter((stable_hash(r) for r in ids), dtype=np.uint64, count=len(ids))

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
    r.name: r for r in (AffinityRouter, MultiplexRouter, Pow2Router, LeastLoadedRouter, HashRouter, RandomRouter)
}
