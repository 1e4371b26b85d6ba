"""When a replica releases Serve's count of a request, against when its client has the result; refusals.

Why: the simulator reproduces Serve's own routers at concurrency 64 only as far as it models
what they see (issue 25): each router's cache of a replica's ongoing count is what the replica
reported at its last accept or refusal, lowered by one at each result. This measures, live, the
inputs a model of that needs: per request, how long after the worker's method returned the
replica released its count (``release_ms``) and the client had the result (``client_ms``), the
share released after the client had it, and the refusals per request (a send to a replica at
``max_ongoing_requests``). Also, per replica, the share of the run it spent with no request and
with every row taken (``idle_share``, ``full_share``, from its own count changes), and for Serve's
default router (``release_log.ReleaseLogPow2Router``) Serve's cached count for the replica at each send
(``send_cache_p50``/``p90``, and ``sends_at_full_cache``: the share sent where its own cache already
counted ``max_ongoing_requests``) and its probes' latency and share that timed out. ``routing_live``'s skew setting, cheap loads, 2 replicas, closed
loop at ``--concurrency``, one router; the workers are ``benchmarks.live.release_log``'s.

Also the replica's CPU per send it refuses and per probe it answers (``benchmarks.live.refusal_cost``:
a replica held at its limit, sent what Serve's router sends), which the simulator charges to the
replica's core (``ServeTimes.refusal_cpu_s`` and ``probe_cpu_s``).

Goals are reported, not judged (a model is checked against them): ``serve_rejections_per_request``,
``affinity_rejections_per_request``, ``serve_replica_idle_share``, ``replica_cpu_ms_per_refusal`` and
``replica_cpu_ms_per_probe``.

    python -m benchmarks.serve_release [--quick] [--json PATH]
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
import time
from collections import defaultdict
from typing import Mapping, Sequence

import numpy as np

from . import common
from . import routing_live as rl


def analyse(events: Sequence[Mapping], sent_at: Sequence[float], latencies: Sequence[float],
            prompts: Sequence[str], since: float) -> dict:
    """Join the replicas' events to the client's requests by prompt; see the module docstring."""
    by_id: dict[str, dict] = defaultdict(dict)
    returned: dict[str, str] = {}
    rejections = 0
    for e in events:
        if e["ev"] == "reject":
            rejections += e["t"] >= since
            continue
        by_id[e["rid"]][e["ev"]] = e["t"]
        if e["ev"] == "return":
            returned[e["prompt"]] = e["rid"]
    received = {p: s + lat for p, s, lat in zip(prompts, sent_at, latencies)}
    release, client, late = [], [], 0
    for prompt, rid in returned.items():
        times = by_id[rid]
        if prompt not in received or "dec" not in times:
            continue
        release.append(1000.0 * (times["dec"] - times["return"]))
        client.append(1000.0 * (received[prompt] - times["return"]))
        late += times["dec"] > received[prompt]
    q = (lambda xs, p: float(np.percentile(xs, p)) if xs else float("nan"))
    return {"joined": len(release), "rejections": rejections,
            "rejections_per_request": rejections / len(prompts) if prompts else float("nan"),
            "release_p50_ms": q(release, 50), "release_p90_ms": q(release, 90), "release_p99_ms": q(release, 99),
            "client_p50_ms": q(client, 50), "client_p90_ms": q(client, 90), "client_p99_ms": q(client, 99),
            "released_after_client": late / len(release) if release else float("nan")}


def occupancy(events: Sequence[Mapping], since: float, rows: int) -> tuple[float, float]:
    """One replica's (share of time with no request, share with all ``rows`` taken) from ``since`` on, from its
    own ``inc``/``dec`` events in time order."""
    ongoing, last, idle, full, total = 0, None, 0.0, 0.0, 0.0
    for e in sorted((e for e in events if e["ev"] in ("inc", "dec")), key=lambda e: e["t"]):
        if last is not None and e["t"] > since:
            span = e["t"] - max(last, since)
            total += span
            idle += span if ongoing == 0 else 0.0
            full += span if ongoing >= rows else 0.0
        ongoing += 1 if e["ev"] == "inc" else -1
        last = e["t"]
    return (idle / total, full / total) if total > 0 else (float("nan"), float("nan"))


def router_view(events: Sequence[Mapping], since: float, rows: int) -> dict:
    """From ``ReleaseLogPow2Router``'s events: Serve's cached count for the replica at each send (a count at or
    above ``rows`` means it sent to a replica its own cache called full: sends it had made there and not yet
    heard back from), and its probes' latency and timeouts."""
    sends = [e.get("cache") or 0 for e in events if e["t"] >= since and e["ev"] == "send"]
    probes = [e for e in events if e["t"] >= since and e["ev"] == "probe"]
    answers = [n for e in probes for n in e["n"]]
    q = (lambda xs, p: float(np.percentile(xs, p)) if xs else float("nan"))
    return {"send_cache_p50": q(sends, 50), "send_cache_p90": q(sends, 90),
            "sends_at_full_cache": sum(c >= rows for c in sends) / len(sends) if sends else float("nan"),
            "probe_p50_ms": q([1000.0 * (e["t"] - e["t0"]) for e in probes], 50),
            "probe_timeouts": sum(n is None for n in answers) / len(answers) if answers else float("nan")}


def read_events(directory: str) -> dict[str, list[dict]]:
    """Each process's events (replicas and the client hosting the router), by log file."""
    out = {}
    for path in glob.glob(os.path.join(directory, "*.jsonl")):
        with open(path, encoding="utf-8") as lines:
            out[path] = [json.loads(line) for line in lines]
    return out


def application(variant, args):
    """``variant``'s app as ``routing_live`` builds it, on the logging worker (and, for ``pow2``, the logging router)."""
    from ray.serve.config import RequestRouterConfig

    from deployments.app import build_fleet

    from .live import release_log

    options = {"num_replicas": args.replicas, "ray_actor_options": {"num_cpus": 1},
               "func_or_class": release_log.ReleaseLogLoRAWorker}
    if variant.name == "pow2":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=f"{release_log.__name__}:ReleaseLogPow2Router")
    return build_fleet(variant.parsed, options)


def make_parser():
    parser = rl.make_parser()
    parser.description = __doc__.split("\n\n")[0]
    return parser


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)
    started = time.perf_counter()
    import ray
    from ray import serve

    from engine.demo import ensure_demo_assets
    from engine.request import GenerateRequest

    from .live import refusal_cost, release_log

    log_dir = tempfile.mkdtemp(prefix="lorafleet-release-")
    os.environ[release_log.LOG_ENV] = log_dir  # the clients (the router's process) read it from here
    concurrency = (args.concurrency or [64])[-1]
    n = args.requests or (300 if args.quick else 600)
    setting = [s for s in rl.settings_for(args.replicas * args.slots, args) if s.name == "skew"][0]
    ensure_demo_assets(num_adapters=setting.num_adapters)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {release_log.LOG_ENV: log_dir}})
    serve.start(proxy_location="Disabled")
    if not args.verbose:
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    rows = []
    try:
        for name in ("pow2", "affinity"):
            variant = rl.Variant(name, args, setting.num_adapters)
            serve.run(application(variant, args), name=variant.app, route_prefix=None)
            variant.loads()  # every worker up and reporting
            rl.run_clients(variant.ensure_clients(1), rl.build_requests(setting, 100, args.seed + 1), 8)
            requests = rl.build_requests(setting, n, args.seed)
            since = time.time()
            result = rl.run_clients(variant.ensure_clients(1), requests, concurrency)
            by_process = read_events(log_dir)
            replicas = [ev for ev in by_process.values() if any(e["ev"] == "inc" for e in ev)]
            found = analyse([e for ev in replicas for e in ev], result["sent_at"], result["latencies"],
                            [prompt for _, prompt, _ in requests], since)
            shares = [occupancy(ev, since, args.max_batch_size) for ev in replicas]
            router = [e for ev in by_process.values() for e in ev if e["ev"] in ("send", "probe")]
            rows.append({"variant": name, "concurrency": concurrency, "requests": n,
                         "req_per_s": n / result["wall_s"],
                         "p50_ms": 1000.0 * float(np.median(result["latencies"])), **found,
                         "idle_share": float(np.mean([i for i, _ in shares])),
                         "full_share": float(np.mean([f for _, f in shares])),
                         **(router_view(router, since, args.max_batch_size) if router else {})})
            print(f"  {name}: {rows[-1]['req_per_s']:.1f} req/s, {found['rejections']} refusals", flush=True)
            serve.delete(variant.app)
            shutil.rmtree(log_dir, ignore_errors=True)
            os.makedirs(log_dir)
        adapter, prompt, max_tokens = rl.build_requests(setting, 1, args.seed)[0]
        costs = refusal_cost.measure_refusal_cost(GenerateRequest(adapter=adapter, prompt=prompt,
                                                                  max_tokens=max_tokens, temperature=0.0),
                                                  rounds=2 if args.quick else 3)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(log_dir, ignore_errors=True)
    common.print_table(rows, ["variant", "concurrency", "requests", "req_per_s", "p50_ms", "rejections_per_request",
                              "release_p50_ms", "release_p90_ms", "release_p99_ms", "client_p50_ms", "client_p90_ms",
                              "client_p99_ms", "released_after_client"], floatfmt=".2f",
                       title="Serve's count release vs the client's result (ms after the worker's method returned)")
    print()
    common.print_table(rows, ["variant", "idle_share", "full_share", "send_cache_p50", "send_cache_p90",
                              "sends_at_full_cache", "probe_p50_ms", "probe_timeouts"], floatfmt=".2f",
                       title="Replicas' occupancy (share of the run with no request / every row taken) and, for "
                             "Serve's router, its cached count at each send and its probes")
    by = {r["variant"]: r for r in rows}
    goals = [common.goal("serve_rejections_per_request", round(by["pow2"]["rejections_per_request"], 3), "reported",
                         None),
             common.goal("affinity_rejections_per_request", round(by["affinity"]["rejections_per_request"], 3),
                         "reported", None),
             common.goal("serve_replica_idle_share", round(by["pow2"]["idle_share"], 3), "reported", None),
             common.goal("replica_cpu_ms_per_refusal", round(costs["refusal_cpu_ms"], 3), "reported", None),
             common.goal("replica_cpu_ms_per_probe", round(costs["probe_cpu_ms"], 3), "reported", None)]
    print()
    print(f"A replica held at its limit: {costs['refusals_per_s']:.0f} refused sends/s, {costs['probes_per_s']:.0f} "
          f"probes/s; its CPU above idle: {costs['refusal_cpu_ms']:.3f} ms per refusal, "
          f"{costs['probe_cpu_ms']:.3f} ms per probe")
    print()
    common.print_goals(goals)
    print(f"\ntotal {common.elapsed_since(started)}")
    if args.json:
        common.write_json(args.json, "serve_release", rows, common.settings_of(args), goals=goals)
    return rows


if __name__ == "__main__":
    main()
