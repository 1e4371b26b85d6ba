"""Adapter loads on the shipped demo fleet under uniform traffic, with one and three routers.

Why: the demo's working set fits its slots (``serve_config.yaml``: six adapters, one of them
pinned, 2 workers x 3 slots), so once warm a router that keeps its placements loads nothing,
at any concurrency and with any number of routers; every load here is thrash. The same
app args as ``serve_config.yaml`` (read from it), two workers (its autoscaling floor, fixed so
the replica set cannot move under the measurement), uniform adapters, 8-32 character prompts,
8-16 new tokens. After a 60-request warm-up at concurrency 4, ``--requests`` (300) requests
per level at concurrency 1, 8 and 64, first through one client process (one router), then
three. Then streamed TTFT at concurrency 16 side by side with Serve's multiplexing and
``pow2`` (the product's workers behind Serve's default router), as ``benchmarks.routing_live``
deploys them.

Goals: ``live_demo_loads_one_router`` and ``live_demo_loads_three_routers`` (the most loads of
any level, target 0), ``demo_c64_p99_over_p50`` (e2e p99 over p50 at concurrency 64, the worse of one
and three routers: <= 2.5, no request starves), ``demo_ttft_p99_vs_p50_c16`` (<= 3) and
``demo_ttft_p99_vs_best_peer_c16`` (<= 1.0).

    python -m benchmarks.demo_loads [--quick] [--json PATH]

Column ``busiest_pct``: the busiest replica's share of the outstanding requests (p90 over send instants,
``benchmarks.live.imbalance``). At concurrency 64 each completion starts a request whose adapter is drawn afresh,
so with every adapter planned on one replica the split of the 64 outstanding requests is a random walk (0 loads
cannot move that work). With three routers the tail was worse (p99/p50 5-7): a row went to the router whose request
freed it; routers now keep one line across routers (``routing.wait_exchange``), 1.9-2.3 since.

``--quick``: the peers only in the TTFT row (about two minutes on 2 cores). Starts its own
local Ray cluster with Serve's HTTP proxy disabled.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import yaml

from . import common
from .routing_live import Setting, Variant, build_requests, measure_row, run_clients

CONFIG = Path(__file__).resolve().parents[1] / "serve_config.yaml"
LEVELS = (1, 8, 64)
ROUTER_COUNTS = (1, 3)
TTFT_CONCURRENCY = 16
UNIFORM = 1.0  # S-LoRA power(alpha = 1) is uniform over the adapters


def demo_app_args(path: Path = CONFIG):
    """``serve_config.yaml``'s lorafleet app args, validated as the app validates them."""
    from deployments.config import AppArgs

    config = yaml.safe_load(path.read_text())
    (app,) = [a for a in config["applications"] if a["name"] == "lorafleet"]
    return AppArgs(**app["args"])


def sequential_through(clients: list, requests: list, chunk: int = 10) -> dict:
    """Concurrency 1 through several routers: chunks of ``chunk`` requests, each client in turn."""
    parts = [run_clients([clients[k % len(clients)]], requests[i:i + chunk], 1)
             for k, i in enumerate(range(0, len(requests), chunk))]
    return {key: [x for p in parts for x in p[key]] for key in ("latencies", "ttfts", "replicas", "errors")} | {
        "wall_s": sum(p["wall_s"] for p in parts), "cpu_s": sum(p["cpu_s"] for p in parts)}


def ttft_row(variant: Variant, requests: list) -> dict:
    result = run_clients(variant.ensure_clients(1), requests, TTFT_CONCURRENCY, stream=True)
    ok = np.array([t for t, rep in zip(result["ttfts"], result["replicas"]) if rep is not None]) * 1000.0
    p50, p99 = (float(np.percentile(ok, q)) for q in (50, 99))
    row = {"variant": variant.name, "concurrency": TTFT_CONCURRENCY, "requests": len(requests),
           "ttft_p50_ms": p50, "ttft_p99_ms": p99, "p99_over_p50": p99 / p50 if p50 else float("nan"),
           "errors": len(result["errors"])}
    print(f"  ttft {variant.name:>11} c={TTFT_CONCURRENCY} p50={p50:7.1f} p99={p99:7.1f} ms "
          f"errors={row['errors']}", flush=True)
    return row


def goals(rows: list[dict], ttft: list[dict]) -> list[dict]:
    out = []
    for routers, name in ((1, "live_demo_loads_one_router"), (3, "live_demo_loads_three_routers")):
        loads = [r["loads"] for r in rows if r["variant"] == "affinity" and r["routers"] == routers]
        worst = max(loads) if loads else None
        out.append(common.goal(name, worst, 0, None if worst is None else worst <= 0))
    # no request starves: at concurrency 64 the slowest requests take at most 2.5x the median (e2e, worst of
    # the router counts)
    c64 = [r["p99_ms"] / r["p50_ms"] for r in rows if r["variant"] == "affinity" and r["concurrency"] == 64
           and r["p50_ms"] > 0]
    spread = max(c64) if c64 else None
    out.append(common.goal("demo_c64_p99_over_p50", None if spread is None else round(spread, 3), 2.5,
                           None if spread is None else spread <= 2.5))
    ours = [r for r in ttft if r["variant"] == "affinity"]
    peers = [r for r in ttft if r["variant"] != "affinity"]
    ratio = ours[0]["p99_over_p50"] if ours else None
    out.append(common.goal("demo_ttft_p99_vs_p50_c16", None if ratio is None else round(ratio, 3), 3.0,
                           None if ratio is None else ratio <= 3.0))
    vs = ours[0]["ttft_p99_ms"] / min(p["ttft_p99_ms"] for p in peers) if ours and peers else None
    out.append(common.goal("demo_ttft_p99_vs_best_peer_c16", None if vs is None else round(vs, 3), 1.0,
                           None if vs is None else vs <= 1.0))
    return out


def make_parser() -> argparse.ArgumentParser:
    parser = common.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per level (default 300)")
    parser.add_argument("--cpus", type=int, default=8, help="logical CPUs of the local Ray cluster (default 8)")
    parser.add_argument("--verbose", action="store_true", help="keep Ray Serve's driver-side log lines")
    return parser


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)
    started = time.perf_counter()
    import ray
    from ray import serve

    from engine.demo import ensure_demo_assets

    from .live.processes import CpuMeter, find_processes

    parsed = demo_app_args()
    num_adapters = len(parsed.adapters)
    ensure_demo_assets(num_adapters=num_adapters)
    shape = argparse.Namespace(replicas=2, slots=parsed.max_loras_per_batch, max_batch_size=parsed.max_batch_size,
                               load_bound_epsilon=parsed.routing.tie_epsilon)
    setting = Setting("demo", num_adapters, UNIFORM)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    serve.start(proxy_location="Disabled")
    if not args.verbose:
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    names = ["affinity", "multiplexed", "pow2"]
    variants = []
    for name in names:
        v = Variant(name, shape, num_adapters)
        v.parsed = parsed  # serve_config.yaml's args, pins included
        variants.append(v)
    print(f"demo_loads: {CONFIG.name} args ({num_adapters} adapters, {shape.slots} slots, max_batch_size "
          f"{shape.max_batch_size}), 2 workers, uniform adapters, {args.requests} requests per level", flush=True)
    rows: list[dict] = []
    ttft: list[dict] = []
    try:
        from ray.serve.api import RunTarget, run_many

        run_many([RunTarget(v.application(), name=v.app, route_prefix=None) for v in variants])
        for v in variants:
            v.loads()
        meter = CpuMeter(find_processes([v.app for v in variants]))
        warmup = build_requests(setting, 60, args.seed + 1)
        measured = variants if not args.quick else variants[:1]
        for routers in ROUTER_COUNTS:
            for v in measured if routers == 1 else variants[:1]:
                run_clients(v.ensure_clients(routers), warmup, 4)
            for c in LEVELS:
                requests = build_requests(setting, args.requests, args.seed + c)
                for v in measured if routers == 1 else variants[:1]:
                    if c < routers:
                        before = v.loads()
                        result = sequential_through(v.ensure_clients(routers), requests)
                        rows.append({"variant": v.name, "routers": routers, "concurrency": c,
                                     "requests": len(requests), "loads": v.loads() - before,
                                     "loads_per_1k": 1000.0 * (v.loads() - before) / len(requests),
                                     "p99_ms": 1000.0 * float(np.percentile(result["latencies"], 99)),
                                     "req_per_s": len(requests) / result["wall_s"],
                                     "errors": len(result["errors"])})
                        print(f"  demo r={routers} {v.name:>11} c={c:<3} loads={rows[-1]['loads']}", flush=True)
                    else:
                        rows.append(measure_row(v, meter, setting, "cheap", c, routers, requests))
        ttft_requests = build_requests(setting, max(200, args.requests // 2), args.seed + 16)
        for v in variants:
            ttft.append(ttft_row(v, ttft_requests))
    finally:
        serve.shutdown()
        ray.shutdown()
    columns = ["variant", "routers", "concurrency", "requests", "loads", "loads_per_1k", "p50_ms", "p99_ms",
               "router_p50_ms", "busiest_pct", "req_per_s", "errors"]
    print()
    common.print_table(rows, columns, floatfmt=".1f", title="Demo fleet, adapter loads per level (warm-up excluded)")
    print()
    common.print_table(ttft, ["variant", "concurrency", "requests", "ttft_p50_ms", "ttft_p99_ms", "p99_over_p50",
                              "errors"], floatfmt=".2f", title=f"Streamed TTFT at concurrency {TTFT_CONCURRENCY}")
    goal_rows = goals(rows, ttft)
    print()
    common.print_goals(goal_rows)
    print(f"\ntotal {common.elapsed_since(started)}")
    if args.json:
        common.write_json(args.json, "demo_loads", rows, common.settings_of(args, config=str(CONFIG.name)),
                          extra={"ttft": ttft}, goals=goal_rows)
    return rows


if __name__ == "__main__":
    main()
