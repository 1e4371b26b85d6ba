"""Every routing tunable in one place: the per-request policy, the router's feed, the fleet plan.

One typed, frozen object, read by the policy (``routing.policy``), the router
(``routing.ray_router``), its local state (``routing.router_state``), the directory and its plan
(``routing.directory``, ``routing.plan``) and the simulator. Users set any of it from
``serve_config.yaml`` (``args.routing``); the app hands the router's share to Serve as
``request_router_kwargs`` and the plan's to the directory, so a value is written once.

Each field has one unit, named in its metadata and in the generated table
(``python -m routing.settings`` prints it; ``docs/routing_settings.md`` is that output):

- ``s``: seconds;
- ``count``: a number of requests, rows, replicas or routing tasks;
- ``share``: a fraction (0-1);
- ``row waits``: multiples of a replica's measured row wait, its request time over its rows
  (how long a full replica takes to free one row): the policy's scale of waiting, measured per
  replica, so one figure fits a CPU demo and a GPU fleet;
- ``request times``: multiples of a replica's measured request time;
- ``replicas``: replicas' worth of load (requests in service over a replica's rows);
- ``factor``: a ratio of two quantities of the same kind;
- ``s per token``: seconds per prompt token (a prefill rate).

No Ray here.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Optional

POLICY, FEED, PLAN = "policy", "router feed", "plan"


def _setting(default: Any, unit: str, group: str, doc: str, minimum: float = 0.0,
             maximum: Optional[float] = None, above: bool = False):
    """A field with its unit, group, doc and bounds (``above``: strictly greater than ``minimum``)."""
    return field(default=default, metadata={"unit": unit, "group": group, "doc": doc, "min": minimum,
                                            "max": maximum, "above": above})


@dataclass(frozen=True)
class RoutingSettings:
    # ---- the per-request policy (routing.policy): where a request goes, when it waits, when it spills
    tie_epsilon: float = _setting(0.25, "row waits", POLICY,
                                  "expected completion times within this of the best are a tie, broken by the "
                                  "cheapest placement then rendezvous order (larger: more affinity and agreement "
                                  "between routers; smaller: tighter balance)")
    batch_slowdown: float = _setting(0.01, "share", POLICY,
                                     "share of a request's time one more running request adds, until the router "
                                     "has measured it (GPU decode: about 1%)", maximum=1.0)
    default_request_s: float = _setting(0.5, "s", POLICY, "a replica's request time before any is measured",
                                        above=True)
    host_load_s: float = _setting(0.002, "s", POLICY,
                                  "a host-tier copy into a slot, until the replica reports measured ones")
    disk_load_s: float = _setting(0.05, "s", POLICY, "a read from disk into a slot, until the replica reports one")
    prefill_s_per_token: float = _setting(1e-4, "s per token", POLICY,
                                          "a prompt token's prefill, until the replica reports its measured rate "
                                          "(an 8B model on one datacenter GPU: about 1e-4). The prompt tokens a "
                                          "router has sent a replica and not yet seen prefilled are a wait before "
                                          "the first token of every later request there", above=True)
    slot_wait_fraction: float = _setting(0.5, "share", POLICY,
                                         "share of a request time an adapter that cannot join the running batch "
                                         "(no free slot) is expected to wait", maximum=1.0)
    slot_wait_patience: float = _setting(2.0, "request times", POLICY,
                                         "how long a request waits in the router for a row its adapter can join, "
                                         "before it takes a row where it must wait for a slot")
    demand_horizon: float = _setting(4.0, "request times", POLICY,
                                     "an eviction victim asked for within this is counted as in use (its reload "
                                     "is part of a load's cost)")
    spill_margin: float = _setting(1.5, "row waits", POLICY,
                                   "a planned replica's wait (for a row, or for the prompts queued ahead of it to "
                                   "prefill) must exceed the same wait plus a load's whole cost elsewhere by this "
                                   "before a request leaves its adapter's planned replicas")
    spill_headroom: int = _setting(2, "count", POLICY,
                                   "free rows a spill target must have beyond those its own planned adapters' "
                                   "waiting requests will take")
    idle_rows: float = _setting(4.0, "row waits", POLICY,
                                "a replica seen full within this is busy and takes no spill, whatever its queue "
                                "says this instant")
    max_router_wait: float = _setting(4.0, "row waits", POLICY,
                                      "a request waits for a planned row at most this long; then any free row "
                                      "will do, the cheapest first")
    oldest_queue: int = _setting(1, "count", POLICY,
                                 "per replica, places in its engine's queue beyond its rows, kept for the fleet's "
                                 "oldest request waiting for it (build_fleet adds them to max_ongoing_requests): it "
                                 "runs at the next free row, before newer requests of any router")
    candidate_width: int = _setting(4, "count", POLICY,
                                    "fleets above 16 replicas (``routing.policy.SMALL_FLEET``): the "
                                    "rendezvous-first and the least loaded replicas scored per decision", minimum=1)
    # ---- what a router learns and how often (routing.ray_router, routing.router_state, routing.view)
    view_ttl_s: float = _setting(3.0, "s", FEED,
                                 "a router's own not-yet-reported placements count in its view this long")
    poll_timeout_s: float = _setting(5.0, "s", FEED,
                                     "one directory long poll waits at most this for a change; under traffic, "
                                     "polls go out at least this often", above=True)
    min_poll_interval_s: float = _setting(0.2, "s", FEED,
                                          "directory polls at most this often (a burst of changes is one rebuild)")
    requests_per_poll: int = _setting(16, "count", FEED,
                                      "the directory feed polls at most once per this many routed requests "
                                      "(its cost per request is bounded at any rate)", minimum=1)
    capacity_poll_s: float = _setting(0.05, "s", FEED,
                                      "when other routers' requests fill the best replica, the oldest waiting "
                                      "request offers it this often so Serve asks its queue length", above=True)
    wait_exchange_interval_s: float = _setting(0.2, "s", FEED,
                                               "while requests wait in a router, it tells the directory its oldest "
                                               "wait per replica and hears the other routers' this often "
                                               "(``routing.wait_exchange``: oldest first across routers)",
                                               above=True)
    fair_wait_margin_s: float = _setting(0.25, "s", FEED,
                                          "a request leaves a free row (or queue place) to another router's request "
                                          "that has waited for that replica longer than it by more than this")
    max_wait_per_call_s: float = _setting(1.0, "s", FEED,
                                          "a waiting request is handed back to Serve this often (so it sees "
                                          "replica set changes)", above=True)
    repeat_window_s: float = _setting(0.01, "s", FEED,
                                      "the same request back within this: Serve could not use the choice, so it "
                                      "waits for capacity before deciding again")
    stats_apply_interval_s: float = _setting(0.1, "s", FEED,
                                             "replicas' routing stats are folded into the view at most this often")
    max_routing_tasks: int = _setting(64, "count", FEED,
                                      "pending requests Serve routes at once (at least Serve's own, twice the "
                                      "replicas): a freed row can go to a waiting request whose adapter fits it",
                                      minimum=1)
    metrics_export_interval_s: float = _setting(5.0, "s", FEED, "router metrics are exported this often",
                                                above=True)
    request_time_alpha: float = _setting(0.2, "share", FEED,
                                         "weight of the newest request in a replica's request-time average",
                                         maximum=1.0, above=True)
    demand_tau_s: float = _setting(10.0, "s", FEED,
                                   "time constant of each adapter's decayed demand (requests per second), in "
                                   "routers and in the directory's plan", above=True)
    send_ttl_s: float = _setting(1.0, "s", FEED,
                                 "a decision handed to Serve counts against its replica until sent, at most this "
                                 "long", above=True)
    # ---- the fleet plan (routing.plan, run by the directory)
    plan_interval_s: float = _setting(1.0, "s", PLAN, "how often the directory revisits the plan", above=True)
    target_utilization: float = _setting(0.75, "share", PLAN,
                                         "share of a planned holder's rows an adapter is meant to use; holders = "
                                         "ceil(need / this)", maximum=1.0, above=True)
    popularity_tau_s: float = _setting(120.0, "s", PLAN,
                                       "which adapters deserve slots when they are short is ranked by demand "
                                       "averaged over this (a tail adapter's short-term demand is mostly noise)",
                                       above=True)
    grow_after_s: float = _setting(5.0, "s", PLAN, "an extra holder must be wanted this long before it is added")
    shrink_after_s: float = _setting(30.0, "s", PLAN, "a holder no longer needed goes after this")
    forget_below: float = _setting(0.0005, "replicas", PLAN,
                                   "adapters needing less than this ... (see forget_after_s)")
    forget_after_s: float = _setting(120.0, "s", PLAN, "... for this long leave the plan")
    move_margin: float = _setting(0.25, "replicas", PLAN, "load a placement must gain before it moves")
    overload_share: float = _setting(0.5, "share", PLAN,
                                     "a holder more loaded than the fleet's mean by this share (and by "
                                     "overload_floor) for overload_after_s hands placements to the least loaded")
    overload_floor: float = _setting(0.1, "replicas", PLAN, "see overload_share")
    overload_after_s: float = _setting(30.0, "s", PLAN, "see overload_share")
    join_shed_after_s: float = _setting(10.0, "s", PLAN,
                                        "after a replica joins, placements in use on the replicas it leaves "
                                        "overloaded move to it after this instead of overload_after_s (a scale-out "
                                        "follows traffic that has grown already: cluster_sim's p99 TTFT after one was "
                                        "1.56x steady while the old replicas stayed over their load for 30 s)")
    displace_ratio: float = _setting(2.0, "factor", PLAN,
                                     "with no slot budget left, a placement needing this many times more than a "
                                     "replica's least needed budgeted one takes that slot's budget", minimum=1.0,
                                     above=True)
    busy_above: float = _setting(0.8, "share", PLAN,
                                 "planned load (share of a replica's rows) that makes a replica busy: no spill "
                                 "goes there ...", maximum=1.0)
    busy_below: float = _setting(0.6, "share", PLAN, "... until its planned load falls below this", maximum=1.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"routing setting {f.name} must be a number, got {value!r}")
            if f.type == "int" and not isinstance(value, int):
                raise ValueError(f"routing setting {f.name} must be a whole {meta['unit']}, got {value!r}")
            low = meta["min"]
            if value < low or (meta["above"] and value == low):
                raise ValueError(f"routing setting {f.name} = {value!r} must be {'>' if meta['above'] else '>='} "
                                 f"{low:g} ({meta['unit']})")
            if meta["max"] is not None and value > meta["max"]:
                raise ValueError(f"routing setting {f.name} = {value!r} must be <= {meta['max']:g} ({meta['unit']})")
        if self.busy_below > self.busy_above:
            raise ValueError(f"routing setting busy_below ({self.busy_below:g}) must not exceed busy_above "
                             f"({self.busy_above:g})")

    @classmethod
    def from_mapping(cls, values: Optional[Mapping[str, Any]]) -> "RoutingSettings":
        """From ``serve_config.yaml``'s ``args.routing`` (or ``request_router_kwargs``): unknown names are refused,
        naming them and the known ones."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown routing settings {unknown}; known: {sorted(known)}")
        return cls(**values)

    def changed(self) -> dict:
        """Only the settings that differ from the defaults (what a deployment needs to carry)."""
        return {k: v for k, v in asdict(self).items() if v != getattr(DEFAULT_SETTINGS, k)}


DEFAULT_SETTINGS = RoutingSettings()


def markdown_table() -> str:
    """The reference table of every routing setting, grouped, with its unit and default (docs are this output)."""
    lines = ["# Routing settings", "",
             "Generated by `python -m routing.settings` from `routing/settings.py`; do not edit by hand.",
             "Set any of them in `serve_config.yaml` under the app's `args.routing`, e.g.",
             "`routing: {tie_epsilon: 0.5, grow_after_s: 10}`.", "",
             "Units: `s` seconds; `count`; `share` a fraction 0-1; `row waits` multiples of a replica's measured",
             "request time over its rows (the wait for one row of a full replica); `request times` multiples of a",
             "replica's measured request time; `replicas` replicas' worth of load; `factor` a ratio of two like",
             "quantities.", ""]
    for group in (POLICY, FEED, PLAN):
        lines += [f"## {group[0].upper()}{group[1:]}", "", "| setting | default | unit | meaning |",
                  "|---|---|---|---|"]
        for f in fields(RoutingSettings):
            if f.metadata["group"] == group:
                lines.append(f"| `{f.name}` | {f.default!r} | {f.metadata['unit']} | {f.metadata['doc']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Print (or write) the routing settings' reference table.")
    parser.add_argument("--write", metavar="PATH", help="write the table to PATH instead of printing it")
    args = parser.parse_args(argv)
    text = markdown_table()
    if args.write:
        with open(args.write, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
