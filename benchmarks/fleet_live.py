"""A live 16-replica fleet on Ray Serve, the GPU replaced by the cost model: this router vs Serve's and the usual peers.

Why: the router exists to win at fleet scale, and a simulator may be trusted there only
once it reproduces a live fleet. Here every part of serving is the product's own (Serve,
the worker, the engine's scheduler, chunked prefill, KV blocks, the pool, adapter staging,
the host tier, the directory, the placement plan and the router) and only the GPU's work
is a sleep of ``benchmarks.sim.costs.CostModel``'s time (``benchmarks/live/emulated.py``):
a step's forward, a host-to-slot copy (the step stalls), a disk read (the requester waits).
So 16 replicas run on two cores and the times are a GPU fleet's.

Workload (``benchmarks.fleet_workload``): the Azure LLM inference trace 2023 (code service;
arrivals and prompt/output lengths, vendored with its attribution), time rescaled to an
offered load of the fleet's capacity (0.4 and 0.8), and the same requests with gamma CV 2
arrivals; 256 adapters, Zipf popularity, ranks 8-64. Sent open loop from one client process
(one router) through a ``DeploymentHandle``; TTFT is the worker's first token time less the
send time (one machine's clock).

Variants, one after another on one deployment of 16 replicas (starting them takes minutes
on two cores; each client process picks its router, ``benchmarks/live/peer_routers.py``, and
the pools and host tiers are emptied between variants), each replaying the same segments in
the same order (a warm-up, then each measured cell):

- ``affinity``: the product as it ships (``deployments.app.build_fleet``: directory, plan,
  read-ahead, ``AdapterAffinityRouter``);
- ``multiplexed``: Ray Serve's model multiplexing (``@serve.multiplexed`` over the same engine,
  LRU of ``slots`` models per replica, Serve's default router with ``multiplexed_model_id``;
  every load is a registration, a disk read);
- ``pow2``: the product's workers behind Serve's default router (power of two choices);
- ``hash``: consistent (rendezvous) hashing on the adapter name, next replica when full.

Goals (JSON ``goals``; each is the worst over the measured cells): ``fleet16_loads_vs_multiplexed``
<= 0.6 (slot loads), ``fleet16_p99_ttft_vs_best_peer`` <= 1.0, ``fleet16_sim_agrees`` (the simulator
replays the run: per variant and cell, loads within 10 %, TTFT p50 and p99 within 25 %, and every
pairwise ranking of loads and p99 TTFT the same), ``fleet16_control_plane_cpu_share`` (reported:
the share of the machine's CPU the fleet's processes used, the emulated GPU's sleeps excluded),
``fleet16_online_floor_vs_multiplexed`` (reported: column ``online_floor`` over multiplexing's loads).

Column ``online_floor``: A0's loads on the cell's requests (``sim.online_floor``): keep the
``replicas x slots - 1`` most popular adapters for good, one slot for the rest in turn. The workload
draws each request's adapter independently from its Zipf popularity, and under such requests no
online policy expects fewer loads, with every slot distinct and no routing constraint; a fleet
also needs copies of its hottest adapters and sends some requests away from busy holders.

Column ``first_requests``: the adapters a cell asks for that no earlier segment of the variant's replay
asked for. A router that starts empty and loads only when asked must load each of them once, whatever
it does: with multiplexing's loads, it is the floor under ``fleet16_loads_vs_multiplexed`` for any router
that does not read adapters ahead of their first request.

    python -m benchmarks.fleet_live [--quick] [--json PATH]
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from . import common
from .fleet_workload import describe, fleet_workload
from .sim.costs import CostModel
from .sim.online_floor import online_floor
from .traces import Trace

APP = "fleet-live"
VARIANTS = ("affinity", "multiplexed", "pow2", "hash")
PEERS = ("multiplexed", "pow2", "hash")
RUN_ORDER = ("affinity", "pow2", "hash", "multiplexed")  # affinity first: it starts where a fresh deploy starts
VOCAB_LOW = 10  # prompt token ids are drawn above the tokenizer's special tokens


@dataclass(frozen=True)
class Segment:
    """One replayed stretch of the trace: a warm-up or a measured cell."""

    name: str
    load: float
    arrivals: str
    offset: int
    requests: int
    seed: int

    @property
    def measured(self) -> bool:
        return self.name != "warmup"


def make_segments(args) -> list[Segment]:
    n = args.requests or (240 if args.quick else 800)
    cells = [(load, arrivals) for arrivals in args.arrivals for load in args.loads]
    out = [Segment("warmup", min(args.loads), "trace", 0, max(60, n // 3), args.seed)]
    offset = out[0].requests
    for k, (load, arrivals) in enumerate(cells):
        out.append(Segment(f"{arrivals}@{load:g}", load, arrivals, offset, n, args.seed + 1 + k))
        offset += n
    return out


def segment_trace(seg: Segment, args, costs: CostModel) -> Trace:
    return fleet_workload(seg.requests, num_adapters=args.adapters, zipf_s=args.zipf, offered_load=seg.load,
                          arrivals=seg.arrivals, costs=costs, replicas=args.replicas, rows=args.rows,
                          seed=seg.seed, offset=seg.offset, max_prompt=args.max_prompt, max_output=args.max_output)


def adapter_ranks(args, costs: CostModel) -> dict[str, int]:
    """Each adapter's modelled rank (the same draw every segment makes: ranks depend on the seed only)."""
    trace = fleet_workload(1, num_adapters=args.adapters, zipf_s=args.zipf, offered_load=1.0, arrivals="trace",
                           costs=costs, replicas=args.replicas, rows=args.rows, seed=args.seed)
    return {adapter_name(i): int(r) for i, r in enumerate(trace.ranks.tolist())}


def adapter_name(i: int) -> str:
    return f"demo-{i}"


def payload(trace: Trace, vocab: int, seed: int) -> list[tuple[float, str, list[int], int]]:
    rng = np.random.default_rng(seed + 104729)
    out = []
    for at, a, n_in, n_out in zip(trace.arrivals.tolist(), trace.adapters.tolist(), trace.input_lens.tolist(),
                                  trace.output_lens.tolist()):
        out.append((at, adapter_name(a), rng.integers(VOCAB_LOW, vocab, int(n_in)).tolist(), int(n_out)))
    return out


# ---------------------------------------------------------------------------- one variant


def app_args(args, costs: CostModel):
    from deployments.config import AdapterSpec, AppArgs

    return AppArgs(max_loras_per_batch=args.slots, max_lora_rank=16, max_batch_size=args.rows,
                   max_tokens_limit=args.max_output, max_model_len=args.max_prompt + args.max_output,
                   max_num_batched_tokens=costs.token_budget, enable_prefix_caching=False,
                   host_cache_bytes=1 << 30, max_waiting_requests=4 * args.rows,
                   adapters=[AdapterSpec(name=adapter_name(i), source=f"demo:{adapter_name(i)}")
                             for i in range(args.adapters)],
                   routing=common.routing_overrides(args.routing))


def application(args, parsed, env: dict):
    """The product's app on emulated workers, with ``VariantRouter``: each client process names its router."""
    from ray.serve.config import RequestRouterConfig

    from deployments.app import build_fleet

    from .live.emulated_workers import EmulatedLoRAWorker

    options = {"num_replicas": args.replicas, "ray_actor_options": {"num_cpus": 0.01, "runtime_env": env},
               "func_or_class": EmulatedLoRAWorker,
               "request_router_config": RequestRouterConfig(
                   request_router_class="benchmarks.live.peer_routers:VariantRouter",
                   request_router_kwargs=parsed.router_kwargs(), request_routing_stats_period_s=5.0)}
    return build_fleet(parsed, options)


class Fleet:
    """The deployed app and, for one variant at a time, its client (one router).

    Every variant runs on one deployment of 16 replicas (starting them takes minutes on two cores):
    the client's process picks the router (``VariantRouter``), and ``multiplexed`` requests carry a
    ``multiplexed_model_id`` that the workers serve through Serve's multiplexing. The pools and host
    tiers are emptied between variants."""

    def __init__(self, args, parsed, env: dict):
        self.args, self.parsed, self.env = args, parsed, env
        self.variant: Optional[str] = None
        self.client = None
        self.deploy_s = 0.0

    @property
    def multiplexed(self) -> bool:
        return self.variant == "multiplexed"

    def switch(self, variant: str) -> None:
        """Deploy (the first time) or empty the pools, then a new client process whose router is ``variant``'s."""
        import ray
        from ray import serve

        from .live.peer_routers import ROUTER_ENV
        from .live.replay_client import ReplayClient

        started = time.perf_counter()
        if self.client is not None:
            ray.kill(self.client)
            self.client = None
        if self.variant is None:
            serve.run(application(self.args, self.parsed, self.env), name=APP, route_prefix=None)
        else:
            self._reset_pools(follow_plan=variant == "affinity")
        self.variant = variant
        self.loads()  # every worker up and reporting
        router = "pow2" if variant == "multiplexed" else variant  # Serve's default router does multiplexing
        self.client = ReplayClient.options(runtime_env={"env_vars": {ROUTER_ENV: router}}).remote(
            APP, "LoRAWorker", self.multiplexed)
        ray.get(self.client.pid.remote())
        self.deploy_s = time.perf_counter() - started

    def _reset_pools(self, follow_plan: bool) -> None:
        """Every replica empties its pool and host tier (asked by ``ReplicaTarget`` through an affinity
        router in this process)."""
        from ray import serve

        from engine.request import ReplicaTarget

        handle = serve.get_deployment_handle("LoRAWorker", app_name=APP)
        for rid in self._replica_ids():
            handle.reset_adapters.remote(ReplicaTarget(rid), follow_plan).result()

    def _replica_ids(self) -> list[str]:
        from ray import serve

        directory = serve.get_deployment_handle("AdapterDirectory", app_name=APP)
        return directory.view.remote().result()["replicas"]

    def loads(self) -> int:
        """Slot loads over the whole fleet so far: every replica's pool counter, asked through this process's
        affinity router (it delivers a ``ReplicaTarget``), once every replica has reported."""
        deadline = time.monotonic() + 300
        while len(self._replica_ids()) < self.args.replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.variant}: not every worker reported within 300 s")
            time.sleep(0.2)
        return self.emulation_totals()["loads"]

    def emulation_totals(self) -> dict:
        """Every replica's emulation counters summed: slot loads, steps, and the steps' host work."""
        from ray import serve

        from engine.request import ReplicaTarget

        handle = serve.get_deployment_handle("LoRAWorker", app_name=APP)
        totals: dict[str, float] = {}
        for rid in self._replica_ids():
            for key, value in handle.emulation_stats.remote(ReplicaTarget(rid)).result().items():
                if key in ("loads", "steps", "step_host_s"):
                    totals[key] = totals.get(key, 0) + value
        return totals

    def adapter_contents(self) -> dict[str, dict]:
        """Replica id -> the adapter names in its slots and host tier now (``EmulatedLoRAWorker.adapter_contents``)."""
        from ray import serve

        from engine.request import ReplicaTarget

        handle = serve.get_deployment_handle("LoRAWorker", app_name=APP)
        out = {}
        for rid in self._replica_ids():
            got = handle.adapter_contents.remote(ReplicaTarget(rid)).result()
            out[rid] = {"slots": got["slots"], "host": got["host"]}
        return out

    def load_sources(self) -> tuple[dict, dict]:
        """Fleet-wide slot loads per adapter name so far (the directory's counts, from every pool's events) and the
        current placement plan: which loads were planned holders filling, and which were thrash."""
        from ray import serve

        from routing.identity import name_of

        directory = serve.get_deployment_handle("AdapterDirectory", app_name=APP)
        counts: dict[str, int] = {}
        for uid, c in directory.adapter_counts.remote().result().items():
            counts[name_of(uid)] = counts.get(name_of(uid), 0) + int(c.get("load", 0))
        return counts, directory.placement_plan.remote().result()

    def decisions(self) -> dict:
        import ray

        return ray.get(self.client.decisions.remote())

    def model_id_lags(self) -> list[float]:
        """Seconds from each multiplexed load since the last call to this client's router seeing it
        (``benchmarks.live.model_id_lag``)."""
        import ray
        from ray import serve

        from engine.request import ReplicaTarget

        from .live.model_id_lag import push_lags

        handle = serve.get_deployment_handle("LoRAWorker", app_name=APP)
        starts = [s for rid in self._replica_ids()
                  for s in handle.take_mux_load_starts.remote(ReplicaTarget(rid)).result()]
        return push_lags(starts, ray.get(self.client.model_id_sightings.remote()))

    def replay(self, requests: list) -> dict:
        import ray

        return ray.get(self.client.run.remote(requests, time.time() + 0.5))

    def close(self) -> None:
        import ray
        from ray import serve

        if self.client is not None:
            ray.kill(self.client)
        serve.delete(APP)


def _q(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else math.nan


def measure(fleet: Fleet, seg: Segment, requests: list, meter, started_at: float) -> dict:
    import psutil

    before = fleet.emulation_totals()
    loads_before = before["loads"]
    counts_before, plan_before = fleet.load_sources()
    pools_before = fleet.adapter_contents()
    kinds_before = fleet.decisions()
    if fleet.multiplexed:
        fleet.model_id_lags()  # forget the loads and sightings before this segment
    seg_start = time.time() - started_at
    meter.start()
    machine_before = psutil.cpu_times()
    out = fleet.replay(requests)
    machine_after = psutil.cpu_times()
    cpu = meter.stop()
    after = fleet.emulation_totals()
    loads = after["loads"] - loads_before
    steps = max(1, after["steps"] - before["steps"])
    counts_after, plan_after = fleet.load_sources()
    sources = _load_sources(counts_before, counts_after, plan_after)
    kinds = {k: n - kinds_before.get(k, 0) for k, n in fleet.decisions().items() if n > kinds_before.get(k, 0)}
    lags = fleet.model_id_lags() if fleet.multiplexed else []
    ttft = [x for x in out["ttft"] if x is not None]
    e2e = [x for x in out["e2e"] if x is not None]
    busy = lambda t: sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))  # noqa: E731
    cores = psutil.cpu_count() or 1
    fleet_cpu = sum(cpu.values())
    row = {
        "variant": fleet.variant, "segment": seg.name, "load": seg.load, "arrivals": seg.arrivals,
        "requests": seg.requests, "start_s": round(seg_start, 3), "loads": loads,
        "loads_per_1k": 1000.0 * loads / seg.requests,
        "ttft_p50_ms": 1000 * _q(ttft, 50), "ttft_p99_ms": 1000 * _q(ttft, 99),
        "e2e_p50_ms": 1000 * _q(e2e, 50), "e2e_p99_ms": 1000 * _q(e2e, 99),
        "req_per_s": len(e2e) / out["wall_s"], "errors": len(out["errors"]),
        "client_cpu_ms": 1000 * out["cpu_s"] / seg.requests,
        "fleet_cpu_share": fleet_cpu / (out["wall_s"] * cores),
        "machine_cpu_share": (busy(machine_after) - busy(machine_before)) / (out["wall_s"] * cores),
        "wall_s": out["wall_s"], "cpu_by_role_s": {k: round(v, 3) for k, v in cpu.items()},
        "error_samples": out["errors"][:3], "plan_moves": plan_after["moves_total"] - plan_before["moves_total"],
        "decisions": kinds,
        **sources,
        "ttft_s": [round(x, 4) if x is not None else None for x in out["ttft"]],
        # where a TTFT went: sending to reaching the replica (routing, Serve's dispatch), to the adapter ready
        # there (a disk read, or waiting for one); and each step's host work beyond the emulated sleeps
        "arrive_p50_ms": 1000 * _q([x for x in out["arrived"] if x is not None], 50),
        "arrive_p99_ms": 1000 * _q([x for x in out["arrived"] if x is not None], 99),
        "step_host_ms": round(1000 * (after["step_host_s"] - before["step_host_s"]) / steps, 3),
        "steps": int(after["steps"] - before["steps"]),
        "arrive_s": [round(x, 4) if x is not None else None for x in out["arrived"]],
        "ready_s": [round(x, 4) if x is not None else None for x in out["ready"]],
        "replica_of": out["replicas"],
        # multiplexing: a load's start to the client's router seeing the model id (benchmarks.live.model_id_lag)
        "model_id_lag_s": [round(x, 4) for x in lags],
        # the fleet as the segment began: each replica's slots and host tier, and the plan's holders (a replay that
        # disagrees is traced to where its state first differs from these)
        "pools_at_start": pools_before, "plan_at_start": {k: plan_before[k] for k in ("version", "holders", "busy", "slotted") if k in plan_before},
    }
    print(f"  {fleet.variant:>11} {seg.name:>10} loads={loads:4d} (planned {sources['loads_planned']}, repeated "
          f"{sources['loads_repeated']}, plan moves {row['plan_moves']}) ttft p50={row['ttft_p50_ms']:7.0f} "
          f"p99={row['ttft_p99_ms']:7.0f} ms e2e p99={row['e2e_p99_ms']:7.0f} ms {row['req_per_s']:5.1f} req/s "
          f"cpu {row['machine_cpu_share']:.0%} errors={row['errors']}", flush=True)
    if lags:
        print(f"    model ids reached the router {1000 * _q(lags, 50):.0f} ms (p50), {1000 * _q(lags, 90):.0f} ms (p90) "
              f"after {len(lags)} loads began", flush=True)
    if out["errors"]:
        print(f"    first error: {out['errors'][0]}", flush=True)
    return row


def _load_sources(before: dict, after: dict, plan: dict) -> dict:
    """Where a segment's loads went: adapters the plan places (its holders filling or refilling a slot) or not
    (the spare slot's churn), and how many were an adapter's second or later load within the segment (thrash)."""
    delta = {name: n - before.get(name, 0) for name, n in after.items() if n > before.get(name, 0)}
    planned = set(plan.get("holders", {}))
    return {"loads_planned": sum(n for a, n in delta.items() if a in planned),
            "loads_unplanned": sum(n for a, n in delta.items() if a not in planned),
            "loads_repeated": sum(n - 1 for n in delta.values()), "adapters_loaded": len(delta)}


def run_variant(fleet: Fleet, variant: str, segments: list[Segment], payloads: dict) -> list[dict]:
    import ray

    from .live.processes import CpuMeter, find_processes

    fleet.switch(variant)
    print(f"{variant}: {fleet.args.replicas} replicas ready in {fleet.deploy_s:.1f} s", flush=True)
    pids = find_processes([APP])
    pids["client"] = [ray.get(fleet.client.pid.remote())]
    pids["controller"] = _controller_pids()
    meter = CpuMeter(pids)
    rows = []
    started_at = time.time()
    asked: set[str] = set()  # adapters asked for so far in this variant's replay
    warmup: Optional[dict] = None
    for seg in segments:
        row = measure(fleet, seg, payloads[seg.name], meter, started_at)
        names = {name for _, name, _, _ in payloads[seg.name]}
        row["first_requests"] = len(names - asked)
        asked |= names
        if seg.measured:
            rows.append(row)
        elif warmup is None:  # the warm-up: its state and outcome go with the first measured row
            warmup = {k: row[k] for k in ("loads", "decisions", "pools_at_start", "plan_at_start", "start_s",
                                          "ttft_p50_ms", "ttft_p99_ms")}
    if rows and warmup is not None:
        rows[0]["warmup"] = warmup
    return rows


def _controller_pids() -> list[int]:
    import psutil

    from .live.processes import _title

    return [p.pid for p in psutil.process_iter() if "ServeController" in _title(p)]


# ---------------------------------------------------------------------------- goals


def _by_cell(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["segment"], {})[r["variant"]] = r
    return out


def goals(rows: list[dict], agreement: Optional[dict]) -> list[dict]:
    loads, p99 = [], []
    for cell, by in _by_cell(rows).items():
        a, mux = by.get("affinity"), by.get("multiplexed")
        peers = [by[p] for p in PEERS if p in by]
        if a is None:
            continue
        if mux is not None and mux["loads"] > 0:
            loads.append(a["loads"] / mux["loads"])
        if peers:
            p99.append(a["ttft_p99_ms"] / min(p["ttft_p99_ms"] for p in peers))
    share = max((r["machine_cpu_share"] for r in rows), default=None)
    floors = [by["multiplexed"]["online_floor"] / by["multiplexed"]["loads"] for by in _by_cell(rows).values()
              if by.get("multiplexed", {}).get("loads") and by["multiplexed"].get("online_floor") is not None]
    worst_loads = max(loads) if loads else None
    worst_p99 = max(p99) if p99 else None
    agrees = None if agreement is None else bool(agreement["agrees"])
    return [
        common.goal("fleet16_loads_vs_multiplexed", None if worst_loads is None else round(worst_loads, 3), "<= 0.6",
                    None if worst_loads is None else worst_loads <= 0.6),
        common.goal("fleet16_p99_ttft_vs_best_peer", None if worst_p99 is None else round(worst_p99, 3), "<= 1.0",
                    None if worst_p99 is None else worst_p99 <= 1.0),
        common.goal("fleet16_sim_agrees", None if agreement is None else agreement["summary"],
                    "loads within 10%, TTFT p50/p99 within 25%, every ranking", agrees),
        common.goal("fleet16_control_plane_cpu_share", None if share is None else round(share, 3), "reported", None),
        common.goal("fleet16_online_floor_vs_multiplexed", round(max(floors), 3) if floors else None,
                    "reported (A0's loads on the cell's requests / multiplexing's, worst cell: no online router "
                    "expects fewer loads, so a fleet16_loads_vs_multiplexed target below this is out of reach)",
                    None),
    ]


def make_parser():
    parser = common.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=16, help="worker replicas (default 16)")
    parser.add_argument("--slots", type=int, default=8, help="adapter slots per replica (default 8)")
    parser.add_argument("--rows", type=int, default=8, help="running requests per replica = max_ongoing_requests")
    parser.add_argument("--adapters", type=int, default=256, help="adapters (default 256)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity (default 1.0)")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.4, 0.8], help="offered loads (of capacity)")
    parser.add_argument("--arrivals", nargs="+", choices=("trace", "gamma"), default=["trace", "gamma"])
    parser.add_argument("--requests", type=int, help="requests per measured cell (default 800; quick 240)")
    parser.add_argument("--time-scale", type=float, default=2.0,
                        help="every modelled time multiplied by this (a GPU that much slower; default 2: at 1, 16 "
                             "emulated replicas' own CPU per step saturated two cores and stretched every time)")
    parser.add_argument("--max-prompt", type=int, default=8192, help="prompt tokens at most (trace capped)")
    parser.add_argument("--max-output", type=int, default=512, help="output tokens at most (trace capped)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--cpus", type=int, default=8, help="logical CPUs of the local Ray cluster")
    common.add_routing_flag(parser)
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator's replay of the run")
    parser.add_argument("--verbose", action="store_true", help="keep Ray Serve's driver-side log lines")
    return parser


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)
    all_started = time.perf_counter()
    costs = CostModel().scaled(args.time_scale)
    segments = make_segments(args)

    import ray
    from ray import serve

    from transformers import AutoConfig

    from engine.demo import ensure_demo_assets

    from .live.emulated_workers import emulation_env

    assets = ensure_demo_assets(num_adapters=args.adapters)  # once, before any replica races to build them
    vocab = int(AutoConfig.from_pretrained(assets.model_dir).vocab_size)
    traces = {seg.name: segment_trace(seg, args, costs) for seg in segments}
    floors = {name: online_floor(tr.adapters, tr.popularity.probabilities(args.adapters), args.replicas * args.slots)
              for name, tr in traces.items()}
    payloads = {name: payload(tr, vocab, seg.seed) for (name, tr), seg in zip(traces.items(), segments)}
    parsed = app_args(args, costs)
    env = emulation_env(args.time_scale, adapter_ranks(args, costs))
    print(f"fleet_live: {args.replicas} replicas x {args.slots} slots x {args.rows} rows, {args.adapters} adapters "
          f"(zipf s={args.zipf:g}, ranks 8-64), time scale {args.time_scale:g}; variants {args.variants}", flush=True)
    for seg in segments:
        print(f"  {seg.name:>10}: {describe(traces[seg.name])}", flush=True)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    serve.start(proxy_location="Disabled")
    if not args.verbose:
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    rows: list[dict] = []
    fleet = Fleet(args, parsed, env)
    try:
        for variant in sorted(args.variants, key=RUN_ORDER.index):
            rows += run_variant(fleet, variant, segments, payloads)
        fleet.close()
    finally:
        serve.shutdown()
        ray.shutdown()

    for row in rows:  # the cell's requests: the same for every variant
        row["online_floor"] = floors[row["segment"]].realized
    agreement = None
    if not args.no_sim:
        import os

        from .sim.fleet_replay import (agreement_with_live, live_deploys, live_host_costs, live_model_id_delays,
                                       live_replica_ids, live_starts, replay_fleet_live)

        # the segments at the offsets they had here, on this machine's CPU count (the workers' read threads)
        sim_rows = replay_fleet_live(_settings(args, segments, costs), args.variants, starts=live_starts(rows),
                                     cpu_count=os.cpu_count(), host_costs=live_host_costs(rows),
                                     replica_ids=live_replica_ids(rows, args.replicas),
                                     model_id_delays=live_model_id_delays(rows), deploys=live_deploys(rows))
        agreement = agreement_with_live(rows, sim_rows)
    columns = ["segment", "variant", "loads", "online_floor", "first_requests", "ttft_p50_ms", "ttft_p99_ms",
               "e2e_p50_ms", "e2e_p99_ms", "req_per_s",
               "errors", "client_cpu_ms", "fleet_cpu_share", "machine_cpu_share"]
    print()
    common.print_table(sorted(rows, key=lambda r: (r["segment"], VARIANTS.index(r["variant"]))), columns,
                       floatfmt=".2f", title=f"fleet_live: {args.replicas} replicas, emulated GPU, one router")
    if agreement is not None:
        print()
        common.print_table(agreement["rows"], title="the simulator's replay of this run (sim / live)",
                           floatfmt=".2f")
    goal_rows = goals(rows, agreement)
    print()
    common.print_goals(goal_rows)
    print(f"\ntotal {common.elapsed_since(all_started)}")
    if args.json:
        common.write_json(args.json, "fleet_live", rows, _settings(args, segments, costs),
                          extra={"agreement": agreement}, goals=goal_rows)
    return rows


def _settings(args, segments: list[Segment], costs: CostModel) -> dict:
    return common.settings_of(args, segments=[asdict(s) for s in segments], costs=costs.describe(),
                              token_budget=costs.token_budget)


if __name__ == "__main__":
    main()
