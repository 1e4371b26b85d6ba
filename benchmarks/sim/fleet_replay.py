"""``benchmarks.fleet_live``'s run, replayed in the simulator: the same segments, requests and cost model.

Why: the simulator may tune routing only once it reproduces the live fleet (issue 25: per
router loads within 10 %, TTFT p50 and p99 within 25 %, every pairwise ranking). This builds
each segment's requests exactly as ``fleet_live.segment_trace`` does from the run's settings,
and replays every variant on its own simulated fleet, segment after segment (pools, host
tiers, views and routers carry over, as on the live deployment):

- ``affinity`` runs first, on the fresh deployment: its replicas come up one at a time, each
  warm-starting what the directory's plan would give it then, the ones already up reading ahead
  what each later plan change gives them (``scale_events.warm_start_at_deploy``, which says what the
  live run does not record); ``pow2``, ``hash`` and ``multiplexed`` run after
  ``reset_adapters(follow_plan=False)`` (``Fleet._reset_pools``: every pool and host tier empty, the
  plan no longer followed): they start cold;
- the modelled ranks are the ones the live replicas are given (``fleet_live.adapter_ranks``:
  the seed's draw, the same for every segment);
- the affinity router starts from the live router's priors (``RoutingSettings``' defaults: a 0.5 s
  request, a 2 ms copy, a 50 ms read), not the cost model's, until replicas report measured times;
- a worker reads at most ``read_threads`` adapters from disk at once (its to_thread executor's threads,
  from the live machine's CPU count), the rest wait for a thread;
- the host tier never evicts: the live workers keep 1 GiB of the demo's adapters, a few kB
  each, whatever rank the cost model prices them at;
- router views lag as live: the directory hears the workers' events after their 20 ms flush
  (``deployments/worker_reports.py`` ``FLUSH_INTERVAL_S``), and the affinity router polls it as its feed
  thread does (``feed.PollPacing``: once per 16 routed requests, at least 0.2 s apart, or after 5 s);
  multiplexing's model sets arrive by Serve's 100 ms push (``PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S``);
- segments start at the live run's offsets when given (``starts``), else back to back: the
  next one ``SEGMENT_GAP_S`` after the previous one's last request finished (the replay client
  starts sending 0.5 s after it is called, once the previous segment has returned).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

import numpy as np

from routing.settings import RoutingSettings

from ..common import routing_overrides
from ..fleet_live import Segment, adapter_name, adapter_ranks, segment_trace
from .config import SimConfig, SimRequest
from ..traces import Trace
from .costs import CostModel
from .fleet import Simulator
from .fleet_agreement import agreement_with_live
from .scale_events import deployed_as_recorded, warm_start_at_deploy

__all__ = ["agreement_with_live", "live_starts", "HostCosts", "live_deploys", "live_host_costs", "live_model_id_delays",
           "live_replica_ids", "replay_fleet_live",
           "replay_variant"]

VARIANT_ROUTER = {"affinity": "affinity", "multiplexed": "multiplex", "pow2": "pow2", "hash": "hash"}
LIVE_LAG_S = {"affinity": 0.02, "multiplexed": 0.1}  # pool change -> the router's view (see the docstring)
WARM_STARTED = ("affinity",)  # deployed fresh: its workers' warm start runs; the others start empty
ADAPTER_NAMES = "demo-{}"  # fleet_live.adapter_name: the plan orders equal needs by name, so the names must match
SEGMENT_GAP_S = 0.5  # benchmarks.fleet_live.Fleet.replay: the client starts sending 0.5 s after the call


def _args(settings: Mapping) -> argparse.Namespace:
    """The fields of ``fleet_live``'s parsed flags that ``segment_trace`` and ``adapter_ranks`` read."""
    keys = ("replicas", "slots", "rows", "adapters", "zipf", "seed", "max_prompt", "max_output")
    return argparse.Namespace(**{k: settings[k] for k in keys})


def routing_of(settings: Mapping) -> RoutingSettings:
    """The routing settings the live run's router and plan had: its ``--routing`` on the defaults."""
    return RoutingSettings.from_mapping(routing_overrides(settings.get("routing") or []))


def costs_of(settings: Mapping) -> CostModel:
    """The run's cost model: time-scaled, its token budget, and a host tier that holds every adapter."""
    costs = CostModel().scaled(float(settings.get("time_scale", 1.0)))
    return replace(costs, token_budget=int(settings.get("token_budget", costs.token_budget)),
                   host_cache_bytes=math.inf)


def segments_of(settings: Mapping) -> list[Segment]:
    return [Segment(**s) for s in settings["segments"]]


def live_starts(live_rows: Sequence[Mapping]) -> dict[str, dict[str, float]]:
    """variant -> measured segment -> its ``start_s`` in the live run (relative to the variant's warm-up)."""
    out: dict[str, dict[str, float]] = {}
    for r in live_rows:
        if r.get("start_s") is not None:
            out.setdefault(r["variant"], {})[r["segment"]] = float(r["start_s"])
    return out


@dataclass(frozen=True)
class HostCosts:
    """What a live replica pays on its host that the emulated device's sleeps leave out, as ``fleet_live``
    measured it: each engine step's own work (scheduling, KV blocks, sampling) and the hop from the
    router's send to the replica (Serve's handle call)."""

    step_host_s: float = 0.0
    dispatch_s: float = 0.0


def live_host_costs(live_rows: Sequence[Mapping]) -> dict[str, HostCosts]:
    """variant -> its ``HostCosts`` in the live run: the step-weighted mean of its measured cells'
    ``step_host_ms``, and the median over its requests of the time to reach their replica (a request
    the router held is in that sample too; few are, so the median is the hop). Empty for runs that
    measured neither."""
    steps: dict[str, float] = {}
    host: dict[str, float] = {}
    arrive: dict[str, list[float]] = {}
    for r in live_rows:
        if r.get("step_host_ms") is None or not r.get("steps"):
            continue
        v = r["variant"]
        steps[v] = steps.get(v, 0.0) + r["steps"]
        host[v] = host.get(v, 0.0) + r["steps"] * r["step_host_ms"] / 1000
        arrive.setdefault(v, []).extend(x for x in r.get("arrive_s") or () if x is not None)
    return {v: HostCosts(host[v] / steps[v], float(np.median(arrive[v])) if arrive.get(v) else 0.0)
            for v in steps}


def live_model_id_delays(live_rows: Sequence[Mapping]) -> dict[str, float]:
    """variant -> seconds from a replica's model-id push to the routers having it, fitted to the live run's
    measured lags (``model_id_lag_s``: a load's start to the router seeing it): a load waits half a push interval
    for the next push on average, so the delay is the median lag less that half. Empty where none was measured."""
    lags: dict[str, list[float]] = {}
    for r in live_rows:
        lags.setdefault(r["variant"], []).extend(r.get("model_id_lag_s") or ())
    push_s = LIVE_LAG_S["multiplexed"]
    return {v: max(0.0, float(np.median(x)) - push_s / 2) for v, x in lags.items() if x}


def live_deploys(live_rows: Sequence[Mapping]) -> dict[str, dict]:
    """variant -> its fleet as the live deploy left it (``pools_at_start`` and ``plan_at_start`` of its warm-up,
    which ``fleet_live`` keeps in the first measured row's ``warmup``), for the variants a fresh deploy starts
    (``WARM_STARTED``); empty for runs that did not record it (their replay models the deploy)."""
    out: dict[str, dict] = {}
    for r in live_rows:
        w = r.get("warmup") or {}
        if r["variant"] in WARM_STARTED and w.get("pools_at_start") and w.get("plan_at_start"):
            out.setdefault(r["variant"], w)
    return out


def live_replica_ids(live_rows: Sequence[Mapping], replicas: int) -> Optional[tuple[str, ...]]:
    """The live run's replica ids (sorted), from its rows' ``replica_of``, when every one of the ``replicas``
    served a request there; else None. Hashing routers, the plan's ties and the standby copies all order replicas
    by a hash of their ids, so a replay on other ids places adapters elsewhere (``hash``'s loads moved 10-15 %
    between two live runs, that is between two draws of ids)."""
    ids = {rid for r in live_rows for rid in (r.get("replica_of") or ()) if rid}
    return tuple(sorted(ids)) if len(ids) == replicas else None


def _q(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else math.nan


def _row(variant: str, seg: Segment, reqs: list[SimRequest], t0: float, ids: Sequence[str]) -> dict:
    """``ids``: replica index -> its id (``replica_of`` names replicas by id, as ``fleet_live``'s rows do)."""
    ttft = [r.t_first - r.arrival for r in reqs]
    e2e = [r.t_done - r.arrival for r in reqs]
    by_kind: dict[str, int] = {}
    for r in reqs:
        if r.loaded and r.kind:
            by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    return {"variant": variant, "segment": seg.name, "loads": sum(1 for r in reqs if r.loaded),
            "loads_by_kind": by_kind,
            "disk_reads": sum(1 for r in reqs if r.disk),
            "ttft_p50_ms": 1000 * _q(ttft, 50), "ttft_p99_ms": 1000 * _q(ttft, 99),
            "e2e_p50_ms": 1000 * _q(e2e, 50), "e2e_p99_ms": 1000 * _q(e2e, 99),
            "start_s": round(t0, 3), "end_s": round(max(r.t_done for r in reqs), 3),
            "ttft_s": [round(x, 4) for x in ttft],
            # fleet_live's split of each TTFT: to the replica, to the adapter ready there
            "arrive_s": [round(r.t_dispatch - r.arrival, 4) for r in reqs],
            "ready_s": [round(r.t_submit - r.arrival, 4) for r in reqs],
            "replica_of": [ids[r.replica] if r.replica >= 0 else None for r in reqs]}


def jittered(trace: Trace, jitter_s: float, rng: np.random.Generator) -> Trace:
    """``trace`` with each arrival late by up to ``jitter_s`` (uniform), order kept: the live client sends
    each request when its event loop gets to it, a few ms late on a busy machine. Only for ensembles
    (``fleet_agreement --ensemble``): how far the fleet's outcome moves under noise that small."""
    late = trace.arrivals + rng.uniform(0.0, jitter_s, len(trace.arrivals))
    return replace(trace, arrivals=np.maximum.accumulate(late))


def read_threads(cpu_count: Optional[int]) -> Optional[int]:
    """The live worker's disk reads at once: ``asyncio.to_thread`` runs them on the event loop's default
    executor, ``min(32, CPUs + 4)`` threads (``concurrent.futures.ThreadPoolExecutor``) on the machine the
    run had; None (no limit) when the run does not say."""
    return None if not cpu_count else min(32, int(cpu_count) + 4)


def replay_variant(settings: Mapping, variant: str, starts: Optional[Mapping[str, float]] = None,
                   jitter_s: float = 0.0, seed: Optional[int] = None, cpu_count: Optional[int] = None,
                   host_costs: HostCosts = HostCosts(), replica_ids: Optional[Sequence[str]] = None,
                   model_id_delay_s: Optional[float] = None, deployed: Optional[Mapping] = None) -> list[dict]:
    """One variant's segments on one simulated fleet; a row per segment, the warm-up's included.
    ``jitter_s`` and ``seed`` (the routers' draws, the jitter's and, without ``replica_ids``, Serve-like random replica ids; default the run's
    seed and ids replica-0000...): see ``jittered``. ``cpu_count``: the live machine's (``read_threads``).
    ``host_costs``: what the live replicas paid beyond the emulated device (``live_host_costs``). ``replica_ids``:
    the live run's (``live_replica_ids``); None: ``replica-0000...``, or Serve-like random ids for other seeds.
    ``model_id_delay_s``: multiplexing's push -> router delay the live run measured (``live_model_id_delays``).
    ``deployed``: the fleet as the live deploy left it (``live_deploys``): with the live ``replica_ids``, a
    warm-started variant starts from it (``scale_events.deployed_as_recorded``) instead of a model of the deploy."""
    if variant not in VARIANT_ROUTER:
        raise ValueError(f"unknown variant {variant!r}; choose one of {sorted(VARIANT_ROUTER)}")
    args, costs, routing = _args(settings), costs_of(settings), routing_of(settings)
    segments = segments_of(settings)
    traces = [segment_trace(seg, args, costs) for seg in segments]
    seed = int(args.seed) if seed is None else seed
    if jitter_s > 0:
        rng = np.random.default_rng(seed + 1_000_003)
        traces = [jittered(trace, jitter_s, rng) for trace in traces]
    ranks = adapter_ranks(args, costs)
    first = replace(traces[0], ranks=np.array([ranks[adapter_name(i)] for i in range(args.adapters)]))
    config = SimConfig(replicas=args.replicas, router=VARIANT_ROUTER[variant], slots=args.slots,
                       max_batch=args.rows, lag_s=LIVE_LAG_S.get(variant, 0.1), seed=seed,
                       model_id_delay_s=model_id_delay_s,
                       costs=replace(costs, step_host_s=host_costs.step_host_s),  # the traces' load is the device's
                       dispatch_s=host_costs.dispatch_s,
                       warmup_fraction=0.0, adapter_names=ADAPTER_NAMES, paced_feed=True,
                       read_threads=read_threads(cpu_count),
                       prior_load_s=(routing.host_load_s, routing.disk_load_s),
                       prior_request_s=routing.default_request_s, routing=routing,
                       replica_id_seed=None if jitter_s <= 0 and seed == int(args.seed) else seed,
                       replica_ids=tuple(replica_ids) if replica_ids is not None else None)
    sim = Simulator(first, config)
    if variant in WARM_STARTED and deployed is not None and replica_ids is not None:
        deployed_as_recorded(sim, deployed["pools_at_start"], deployed["plan_at_start"])
    elif variant in WARM_STARTED:
        warm_start_at_deploy(sim)
    rows, end = [], 0.0
    for seg, trace in zip(segments, traces):
        live_t0 = (starts or {}).get(seg.name, 0.0 if not seg.measured and starts else None)
        t0 = end + SEGMENT_GAP_S if live_t0 is None else max(live_t0 + SEGMENT_GAP_S, end)
        reqs = sim.serve(trace, t0)
        rows.append({**_row(variant, seg, reqs, t0, [r.rid for r in sim.replicas]), "measured": seg.measured})
        end = sim.now
    return rows


def replay_fleet_live(settings: dict, variants: list[str],
                      starts: Optional[Mapping[str, Mapping[str, float]]] = None,
                      jitter_s: float = 0.0, seed: Optional[int] = None,
                      cpu_count: Optional[int] = None,
                      host_costs: Optional[Mapping[str, HostCosts]] = None,
                      replica_ids: Optional[Sequence[str]] = None,
                      model_id_delays: Optional[Mapping[str, float]] = None,
                      deploys: Optional[Mapping[str, Mapping]] = None) -> list[dict]:
    """Every variant's measured segments, simulated: rows ``{variant, segment, loads, ttft_p50_ms,
    ttft_p99_ms, e2e_p50_ms, e2e_p99_ms, ...}`` as ``fleet_live`` reports them. ``starts``: variant ->
    segment -> live ``start_s`` (``live_starts``); without it, segments run back to back. ``jitter_s``,
    ``seed``, ``cpu_count``: as ``replay_variant`` (jitter and seed for ensembles; the defaults replay the run
    as it was sent; pass the live machine's CPU count: it bounds the workers' concurrent disk reads).
    ``host_costs``: variant -> its measured ``HostCosts`` (``live_host_costs``; none: nothing beyond the device).
    ``replica_ids``: the live run's (``live_replica_ids``). ``model_id_delays``: variant -> its measured
    model-id delay (``live_model_id_delays``). ``deploys``: variant -> its fleet as the live deploy left it
    (``live_deploys``; used with the live ``replica_ids`` only)."""
    out = []
    for variant in variants:
        rows = replay_variant(settings, variant, (starts or {}).get(variant), jitter_s, seed, cpu_count,
                              (host_costs or {}).get(variant, HostCosts()), replica_ids,
                              (model_id_delays or {}).get(variant), (deploys or {}).get(variant))
        out += [{k: v for k, v in r.items() if k != "measured"} for r in rows if r["measured"]]
    return out
