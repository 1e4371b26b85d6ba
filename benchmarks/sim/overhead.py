"""In-process cost of one routing decision: routing.policy.choose_replicas beside a power-of-two choice.

The view is what a router holds in a warm fleet: the directory's placement plan for the
workload's popularity (``routing.plan``, half of every replica's rows busy), every replica's
slots full of the adapters planned there, loads 0..max_batch-1. Each call is timed on its
own with ``perf_counter_ns`` (timer overhead, ~50-100 ns, included), garbage collector
on, as in service.

- ``policy``: ``choose_replicas`` on a cached ``FleetView`` with everything the Serve router
  passes (caps, request times, running adapters, demand and last use from a
  ``LocalRouterState`` that has routed the recent requests), per request.
- ``view+policy``: ``RouterView.fleet_view(ids, adapter)`` + the policy, with ``optimistic``
  live own decisions in the view (what ``AdapterAffinityRouter.choose_replicas`` does).
- ``pow2``: Ray Serve's power-of-two choice as ``pow_2_router.py`` does it (two distinct
  ``random.randrange`` indexes), plus picking the shorter of the two cached queue lengths.
- ``view rebuild``: ``RouterView._build`` after a directory delta (once per change, not per request).
"""

from __future__ import annotations

import random
import time
from typing import Callable, Sequence

import numpy as np

from routing.plan import FleetPlanner, ReplicaSlots
from routing.policy import choose_replicas
from routing.settings import DEFAULT_SETTINGS
from routing.router_state import LocalRouterState
from routing.view import RouterView

from ..traces import Popularity, adapter_uid


def _timed(fn: Callable[[object], object], args: Sequence) -> np.ndarray:
    ns = np.empty(len(args), dtype=np.int64)
    clock = time.perf_counter_ns
    for k, a in enumerate(args):
        t0 = clock()
        fn(a)
        ns[k] = clock() - t0
    return ns / 1e3  # microseconds


def _state(replica_id: str, uids: Sequence[str]) -> dict:
    return {"replica_id": replica_id, "seq": 1, "slots": len(uids), "resident": {u: s for s, u in enumerate(uids)},
            "pinned": [], "loading": [], "host_cached": [], "queue_len": 0, "free_slots": 0}


def measure(replicas: int, adapters: int = 10_000, *, calls: int = 20_000,
            slots: int = 8, max_batch: int = 16, optimistic: int = 3000,
            popularity: Popularity = Popularity("power", 0.3), seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = tuple(f"replica-{i:04d}" for i in range(replicas))
    probs = popularity.probabilities(adapters)
    # the directory's plan for this demand (half of every replica's rows busy), and pools that hold it
    busy = replicas * max_batch / 2
    demand = {adapter_uid(a): float(p) * busy for a, p in enumerate(probs.tolist())}
    plan = FleetPlanner(default_rows=max_batch).update(0.0, demand, [ReplicaSlots(r, slots, max_batch) for r in ids])
    planned_on: dict[str, list[str]] = {r: [] for r in ids}
    for name, holders in plan.holders.items():
        for r in holders:
            planned_on[r].append(name)
    full = {r: _state(r, planned_on[r][:slots]) for r in ids}
    reply = {"epoch": "bench", "version": 1, "full": full, "plan": plan.to_dict()}
    asked = [adapter_uid(int(a)) for a in popularity.sample(calls, adapters, rng)]
    loads = rng.integers(0, max_batch, replicas).astype(np.float64)
    config = DEFAULT_SETTINGS
    now = [0.0]
    view = RouterView(ttl_s=3.0, clock=lambda: now[0])
    view.apply_directory_reply(reply)
    fleet = view.fleet_view(ids)  # built once; no adapter asked: the cached view itself (the plan included)
    local = LocalRouterState(clock=lambda: now[0])
    for k, a in enumerate(asked[:optimistic]):  # this router's recent traffic: running adapters, times, demand
        local.routed(str(k), ids[int(rng.integers(replicas))], a)
        now[0] += 0.01
        if k >= max_batch * replicas // 2:  # about half of every replica's rows stay busy
            local.completed(str(k - max_batch * replicas // 2))
    caps = [float(max_batch)] * replicas
    inputs = dict(caps=caps, request_s=local.request_s_by_index(ids), active=local.active_by_index(ids),
                  demand=local.demand, last_used=local.last_used_by_index(ids))
    rows = []

    def row(kind: str, us: np.ndarray, note: str = "") -> dict:
        return {"replicas": replicas, "adapters": adapters, "kind": kind, "calls": int(len(us)),
                "median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
                "mean_us": float(us.mean()), "note": note}

    for a in asked[:200]:  # warm numpy's and the hash's caches
        choose_replicas(a, fleet, loads, config, **inputs)
    rows.append(row("policy", _timed(lambda a: choose_replicas(a, fleet, loads, config, **inputs), asked)))

    load_list = loads.tolist()
    n = replicas
    randrange = random.Random(seed).randrange

    def pow2(_a) -> int:
        i = randrange(n)
        j = randrange(n - 1)
        if j >= i:
            j += 1
        return i if load_list[i] <= load_list[j] else j

    rows.append(row("pow2", _timed(pow2, asked)))

    for a in asked[-optimistic:]:  # this router's recent decisions, all still within the ttl
        view.record_decision(a, ids[int(rng.integers(n))])

    def decide(a) -> None:
        choose_replicas(a, view.fleet_view(ids, a), loads, config, **inputs)

    rows.append(row("view+policy", _timed(decide, asked), f"{optimistic} live own decisions"))

    rows.append(row("view rebuild", _timed(lambda _a: view._build(ids), range(20 if replicas > 256 else 100)),
                    "once per directory delta"))
    return rows
