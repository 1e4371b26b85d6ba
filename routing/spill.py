"""Leaving an adapter's planned replicas: when a load elsewhere is worth it, and where.

Two cases (``routing.policy``'s docstring): every planned replica is full and the wait for a row
outlasts a load elsewhere (``spill_target``), or the best planned replica has a row behind a long
prefill queue that a replica elsewhere does not have (``prefill_spill``). Both by the same margin
(``spill_margin`` row waits) and the same exclusions: replicas the plan keeps busy, rows owed to
requests waiting for their own planned adapters, replicas seen full a moment ago, and replicas where
the load would evict an adapter the plan gives a slot there. No Ray.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from .fleet_view import SMALL_FLEET, FleetView
from .scoring import Scoring, candidates


def spill_target(ctx: Scoring, planned: Sequence[int], best: int, waiting: Mapping, overdue: bool = False,
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
    wait = max(0.0, ctx.loads[best] + 1 - ctx.cap(best) + owed_rows(view, best, waiting)) * row_wait
    if best in ctx.blocked:  # its row (or the next) waits for a slot too: no running adapter there is this one
        wait += cfg.slot_wait_fraction * ctx.request_time(best)
    if not overdue and wait <= margin:
        return None  # no load anywhere is cheaper than nothing: the common case costs no scan
    n = len(view.replica_ids)
    others = range(n) if n <= SMALL_FLEET else candidates(ctx.adapter, view, ctx.loads, ctx.holders, cfg)
    target, target_cost = None, float("inf")
    inside = set(planned)
    for j in others:
        if j in inside or j in view.busy or evicts_planned(ctx, j) or \
                ctx.loads[j] + owed_rows(view, j, waiting) + cfg.spill_headroom > ctx.cap(j):
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


def prefill_spill(ctx: Scoring, planned: Sequence[int], chosen: int, waiting: Mapping,
                   full_at: Optional[Sequence[float]], now: float) -> Optional[int]:
    """A replica outside the plan whose prompts queued for prefill end sooner than ``chosen``'s by more than a
    load's whole cost there plus ``spill_margin`` row waits, or None (stay on ``chosen``, which has a row).

    A free row is not a short wait when long prompts are queued ahead of it: replaying ``fleet_live`` in the
    simulator (its trace's prompts run to 8k tokens), the slowest first tokens were prompts sent to a planned
    replica still prefilling one or two others, while a replica elsewhere was idle; leaving the plan for those
    cut p99 TTFT from 1.21x to 0.91x the best peer's (five jittered replays), for 17% more loads. The same
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
    for j in range(n) if n <= SMALL_FLEET else candidates(ctx.adapter, view, ctx.loads, ctx.holders, cfg):
        if j in inside or j in view.busy or pw[j] >= target_cost or evicts_planned(ctx, j) or \
                ctx.loads[j] + owed_rows(view, j, waiting) + cfg.spill_headroom > ctx.cap(j):
            continue
        if full_at is not None and now - full_at[j] < cfg.idle_rows * ctx.request_time(j) / ctx.cap(j):
            continue
        ctx.score(j)
        cost = pw[j] + ctx.load_cost[j]
        if j in ctx.blocked or cost >= target_cost:
            continue
        target, target_cost = j, cost
    return target


def evicts_planned(ctx: Scoring, j: int) -> bool:
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


def owed_rows(view: FleetView, i: int, waiting: Mapping) -> float:
    """This router's waiting requests whose plan includes replica ``i`` (each split over its holders)."""
    if not waiting or view.planned_on is None:
        return 0.0
    total = 0.0
    for name in view.planned_on[i]:
        w = waiting.get(name)
        if w:
            total += w / len(view.planned[name])
    return total

