"""The routing decision: within the adapter's planned replicas, where it completes first.

Placement is a fleet decision (``routing.plan``: how many replicas hold each adapter and
which, made by the directory with hysteresis and published to every router). A request is
routed within its adapter's planned set and the replicas that hold it resident (the plan says where a load
goes; a holder needs none); an adapter not in the plan yet is planned where it
is resident, else on its rendezvous-first replica (a rollout's new version: where the adapter it
versions is planned). Within the set it goes to the replica with
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
stalls there (the host-to-slot copy x requests running: a disk read is off the step), and the victim's reloads (which stall that batch
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

from .fleet_view import SMALL_FLEET, FleetView
from .identity import family_of
from .scoring import Scoring, candidates
from .settings import DEFAULT_SETTINGS, RoutingSettings
from .spill import prefill_spill, spill_target

__all__ = ["FleetView", "RoutingDecision", "SMALL_FLEET", "choose_replicas"]


@dataclass
class RoutingDecision:
    tiers: list[list[int]]   # replicas to try now, best first (empty when waiting)
    kind: str                # affinity | spill | prefill_spill | placement | base | wait | none
    wait: bool = False       # the best replica is full and nothing that could start now ties it
    best: Optional[int] = None       # the minimum-ECT replica (full or not)
    ect: dict[int, float] = field(default_factory=dict)  # scored candidates -> expected seconds



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
    ctx = Scoring(adapter, view, loads, config, caps, request_s, active, demand, last_used,
                   config.batch_slowdown if batch_slowdown is None else batch_slowdown, prefill_wait)
    if adapter is None:
        scored = range(n) if n <= SMALL_FLEET else candidates(None, view, loads, (), config)
        return _route_base(ctx, scored)
    planned = view.planned.get(adapter) if view.planned is not None else None
    if not planned and view.planned is not None and family_of(adapter) != adapter:
        # a version registered since the last plan (up to plan_interval_s): where its adapter is planned, which
        # the rollout pre-warmed (deployments/versions.py) and where the next plan puts it too (routing.plan)
        planned = view.planned.get(family_of(adapter))
    if not planned:  # not in the plan yet: where it is resident, else its rendezvous-first replica
        planned = tuple(sorted(ctx.holders)) or tuple(view.order(adapter, 1))
    elif ctx.holders and not any(h in planned for h in ctx.holders):  # (no sets built: every decision runs this)
        # the plan says where a load should go; a replica that holds the adapter needs none, so it is a candidate
        # like the planned ones (a copy a spill left there served nothing before: its adapter's next request went
        # to a planned replica, loaded there, and the fleet held two copies for one stream)
        planned = tuple(sorted(set(planned) | set(_spare_copies(view, ctx.holders))))
    ranked = ctx.rank(planned)
    best = ranked[0]
    t_best = ctx.request_time(best)
    # waited long enough, or the oldest waiting: may queue in the engine for a slot
    patient = first_in_line or waited_s > config.slot_wait_patience * t_best
    for i in ranked:  # work-conserving within the plan
        if ctx.has_row(i) and (patient or i not in ctx.blocked):
            if prefill_wait is not None and prefill_wait[i] > 0:
                j = prefill_spill(ctx, planned, i, waiting or {}, full_at, now)
                if j is not None:
                    return RoutingDecision([[j]], "prefill_spill", best=best, ect=ctx.ect)
            return RoutingDecision([[i]], _kind(adapter, ctx.holders, planned, i), best=best, ect=ctx.ect)
    overdue = waited_s > config.max_router_wait * t_best / ctx.cap(best)  # bounded wait: any free row now
    spill = spill_target(ctx, planned, best, waiting or {}, overdue, full_at, now)
    if spill is not None:
        return RoutingDecision([[spill]], "spill", best=best, ect=ctx.ect)
    return RoutingDecision([], "wait", wait=True, best=best, ect=ctx.ect)


def _route_base(ctx: Scoring, candidates) -> RoutingDecision:
    """The base model needs no adapter: the least loaded replica by expected completion time."""
    scored = sorted((ctx.score(i), ctx.loads[i], i) for i in candidates)
    for _, _, i in scored:
        if ctx.has_row(i):
            return RoutingDecision([[i]], "base", best=scored[0][2], ect=ctx.ect)
    return RoutingDecision([], "wait", wait=True, best=scored[0][2], ect=ctx.ect)


def _spare_copies(view: FleetView, holders: Collection[int]) -> list[int]:
    """The holders whose copy sits in a slot the plan gives no adapter there: a copy in a planned adapter's slot
    keeps that adapter out, which then loads and evicts it (on the demo's fully planned 2 x 3 slots, serving such
    copies moved the loads the plan had made at warm-up into the traffic after it)."""
    kept = view.slotted_on if view.slotted_on is not None else view.planned_on
    if kept is None or view.slots is None:
        return list(holders)
    return [j for j in holders if not view.slots[j] or len(kept[j]) < view.slots[j]]


def _kind(adapter: Optional[str], holders: Collection[int], planned: Collection[int], chosen: int) -> str:
    if adapter is None:
        return "base"
    if chosen in holders:
        return "affinity"
    return "placement" if chosen in planned else "spill"

