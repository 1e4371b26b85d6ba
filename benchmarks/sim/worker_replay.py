"""The workers' half of the simulator checked alone: ``fleet_live``'s requests sent where the live routers sent them.

Why: ``fleet_replay`` replays a live run end to end, and its cells disagree (affinity's p99 TTFT 30-65 %
above the simulation's in two cells). That comparison cannot say which half of the model is wrong:
the routers' (what they saw, where they sent) or the workers' (disk reads, slot copies, the engine's
steps under the cost model). A fleet is chaotic: one request placed elsewhere changes every later
queue, so two trajectories part within seconds even when both halves are right. Here the routing is
taken from the live run instead of modelled: each request reaches the replica the live run names
(``replica_of``) at the moment it reached it there (its arrival plus ``arrive_s``), and each
segment starts from the pools and host tiers the live run recorded at its start
(``pools_at_start``). Whatever differs per request is then the workers' model: a cost the emulated
engine pays that ``sim.replica`` does not charge, or one charged that it does not pay.

Left out (so not expected to agree): the affinity replicas' read-ahead of what a plan change newly
puts on them during a segment (the live run does not record when each plan reached each replica),
and the multiplexing wrapper's model order at the segment's start (taken as the slots' order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

import numpy as np

from routing.plan import PlacementPlan

from ..fleet_live import Segment, adapter_name, adapter_ranks, segment_trace
from .config import SimConfig
from .fleet import Simulator
from .fleet_agreement import agreement_with_live
from .fleet_replay import ADAPTER_NAMES, HostCosts, _args, costs_of, live_host_costs, read_threads, segments_of
from .routers import Router
from .scale_events import planned_on

PER_REQUEST_TOLERANCE = 0.25  # a request's replayed TTFT within 25 % of its live one (or within SMALL_S)
SMALL_S = 0.05  # ... or within 50 ms: a fast request's TTFT is mostly the hop, which both take from the live run


class RecordedRouter(Router):
    """Sends request ``i`` of the replayed segment to the replica the live run sent it to (``sim.recorded[i]``)."""

    name = "recorded"

    def route(self, req, now):
        self._count("recorded")
        return self.sim.ids.index(self.sim.recorded[req.i])


class RecordedMultiplexedRouter(RecordedRouter):
    """The same, onto workers that run the multiplexing baseline's wrapper (Serve's model LRU per replica)."""

    name = "recorded-multiplexed"
    multiplexed_worker = True


class RecordedSimulator(Simulator):
    """A ``Simulator`` whose router replays a live run's placements: ``recorded[i]`` is request ``i``'s replica id."""

    routers = {r.name: r for r in (RecordedRouter, RecordedMultiplexedRouter)}

    def __init__(self, trace, config: SimConfig, recorded: Sequence[str]):
        self.recorded = list(recorded)
        super().__init__(trace, config)


@dataclass(frozen=True)
class Replayed:
    """One measured cell: the live TTFTs and the replayed ones, request for request (same order)."""

    variant: str
    segment: str
    live_ttft: np.ndarray
    sim_ttft: np.ndarray
    live_ready: np.ndarray
    sim_ready: np.ndarray
    live_loads: int
    sim_loads: int
    in_lens: np.ndarray

    def agreement_row(self) -> dict:
        """As ``fleet_replay``'s rows, for ``fleet_agreement.agreement_with_live``: the same tolerances."""
        q = lambda a, p: 1000 * float(np.percentile(a, p))
        return {"variant": self.variant, "segment": self.segment, "loads": self.sim_loads,
                "ttft_p50_ms": q(self.sim_ttft, 50), "ttft_p99_ms": q(self.sim_ttft, 99)}

    def row(self) -> dict:
        lt, st = self.live_ttft, self.sim_ttft
        err = np.abs(st - lt)
        ok = (err <= PER_REQUEST_TOLERANCE * lt) | (err <= SMALL_S)
        q = lambda a, p: 1000 * float(np.percentile(a, p))
        return {"segment": self.segment, "variant": self.variant, "loads_live": self.live_loads,
                "loads_replayed": self.sim_loads, "p50_live": q(lt, 50), "p50_replayed": q(st, 50),
                "p99_live": q(lt, 99), "p99_replayed": q(st, 99), "mean_live": 1000 * float(lt.mean()),
                "mean_replayed": 1000 * float(st.mean()), "median_abs_err_ms": 1000 * float(np.median(err)),
                "requests_within": f"{ok.mean():.0%}",
                "ready_mean_live": 1000 * float(self.live_ready.mean()),
                "ready_mean_replayed": 1000 * float(self.sim_ready.mean())}


def _start_from(sim: RecordedSimulator, row: Mapping, multiplexed: bool) -> None:
    """The fleet as the live run recorded it when this segment began: slots, host tiers, and for plan-following
    replicas the plan's kept adapters (``pools_at_start``, ``plan_at_start``)."""
    pools = row.get("pools_at_start") or {}
    plan = PlacementPlan.from_dict(row["plan_at_start"]) if row.get("plan_at_start") else None
    for replica in sim.replicas:
        contents = pools.get(replica.rid, {"slots": (), "host": ()})
        for uid in contents["host"]:
            replica.warm(uid, into_slot=False)
        for uid in contents["slots"]:
            replica.warm(uid, into_slot=True)
            if multiplexed:
                replica.models[uid] = None
        if plan is not None and not multiplexed:
            replica.planned = set(planned_on(plan, replica.rid))
            replica.pool.keep(list(plan.slotted.get(replica.rid, ())))


def replay_cell(settings: Mapping, row: Mapping, seg: Segment, host_costs: HostCosts = HostCosts(),
                cpu_count: Optional[int] = None) -> Replayed:
    """One live row (a variant's measured segment) with its routing replayed; see the module docstring."""
    args, costs = _args(settings), costs_of(settings)
    trace = segment_trace(seg, args, costs)
    ranks = adapter_ranks(args, costs)
    trace = replace(trace, ranks=np.array([ranks[adapter_name(i)] for i in range(args.adapters)]))
    arrive = np.array([math.nan if x is None else x for x in row["arrive_s"]], dtype=float)
    if np.isnan(arrive).any() or len(arrive) != len(trace):
        raise ValueError(f"{row['variant']} {seg.name}: the live row must give every request's arrive_s")
    dispatch = trace.arrivals + arrive
    order = np.argsort(dispatch, kind="stable")
    replayed = replace(trace, arrivals=dispatch[order], adapters=trace.adapters[order],
                       input_lens=trace.input_lens[order], output_lens=trace.output_lens[order])
    multiplexed = row["variant"] == "multiplexed"
    ids = tuple(sorted(pools_ids(row)))
    config = SimConfig(replicas=len(ids), router="recorded-multiplexed" if multiplexed else "recorded",
                       slots=args.slots, max_batch=args.rows, seed=int(args.seed),
                       costs=replace(costs, step_host_s=host_costs.step_host_s), dispatch_s=0.0,
                       warmup_fraction=0.0, adapter_names=ADAPTER_NAMES, read_threads=read_threads(cpu_count),
                       replica_ids=ids)
    sim = RecordedSimulator(replayed, config, [row["replica_of"][k] for k in order.tolist()])
    _start_from(sim, row, multiplexed)
    reqs = sim.serve(replayed)
    back = np.empty(len(order), dtype=int)
    back[order] = np.arange(len(order))
    sim_ttft = np.array([reqs[b].t_first - reqs[b].arrival for b in back.tolist()]) + arrive
    sim_ready = np.array([reqs[b].t_submit - reqs[b].arrival for b in back.tolist()]) + arrive
    return Replayed(row["variant"], seg.name, np.array(row["ttft_s"], dtype=float), sim_ttft,
                    np.array(row["ready_s"], dtype=float), sim_ready, int(row["loads"]),
                    sum(1 for r in reqs if r.loaded), trace.input_lens)


def pools_ids(row: Mapping) -> set[str]:
    """The live fleet's replica ids: those whose pools it recorded, and any a request went to."""
    return set(row.get("pools_at_start") or {}) | {rid for rid in row["replica_of"] if rid}


def replay_run(live: Mapping, variants: Optional[Sequence[str]] = None) -> list[Replayed]:
    """Every measured cell of a ``fleet_live --json`` run with its routing replayed."""
    settings = live["metadata"]["settings"]
    segments = {s.name: s for s in segments_of(settings)}
    rows = [r for r in live["rows"] if not variants or r["variant"] in variants]
    costs = live_host_costs(rows)
    cpus = (live["metadata"].get("machine") or {}).get("cpu_count")
    return [replay_cell(settings, r, segments[r["segment"]], costs.get(r["variant"], HostCosts()), cpus)
            for r in rows]


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """Replay a ``fleet_live --json`` run's requests onto the replicas the live routers chose; print, per cell, how
    far the simulated workers' TTFTs are from the live ones, request for request."""
    import argparse
    import json

    from .. import common

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--live-json", required=True, help="a fleet_live --json run")
    parser.add_argument("--variants", nargs="+", help="only these variants")
    parser.add_argument("--worst", type=int, default=0, metavar="N", help="also list each cell's N worst requests")
    args = parser.parse_args(argv)
    live = json.loads(open(args.live_json).read())
    cells = replay_run(live, args.variants)
    rows = [c.row() for c in cells]
    common.print_table(rows, floatfmt=".0f", title=f"fleet_live's routing replayed onto simulated workers "
                       f"({args.live_json}): TTFT ms live vs replayed; requests_within: share within "
                       f"{PER_REQUEST_TOLERANCE:.0%} or {SMALL_S * 1000:.0f} ms")
    live_rows = [r for r in live["rows"] if not args.variants or r["variant"] in args.variants]
    agreement = agreement_with_live(live_rows, [c.agreement_row() for c in cells])
    print(f"  workers' model with the live routing: {agreement['summary']}")
    for c in cells if args.worst else ():
        err = c.sim_ttft - c.live_ttft
        print(f"\n{c.variant} {c.segment}: worst requests (live - replayed)")
        for k in np.argsort(err)[: args.worst].tolist():
            print(f"  #{k:3d} prompt {int(c.in_lens[k]):5d}  live {c.live_ttft[k]:.3f} s (ready {c.live_ready[k]:.3f})"
                  f"  replayed {c.sim_ttft[k]:.3f} s (ready {c.sim_ready[k]:.3f})")
    return rows


if __name__ == "__main__":
    main()
